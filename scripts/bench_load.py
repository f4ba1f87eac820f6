#!/usr/bin/env python
"""Model load against the number of fake nodes on the testbed: trainer rank 0 reading model.path and
streaming every tensor to every trainer (the default), against each node loading its own copy
staged to node-local storage (site.stage.model_dest; model_via "srun" on the testbed).

    SLURM_CONF=/tmp/hpcrl-testbed/etc/slurm.conf .venv/bin/python scripts/bench_load.py [--nodes 1 2 4] [--size base]
    ... scripts/bench_load.py --smoke     # that it runs (tests/e2e/test_bench_smoke.py): --nodes 1 --size tiny

Each row is one real job (1 trainer + 1 transformers engine per node, one GRPO step). The figures
are the job's own lines: "model loaded in X s" (trainer rank 0, policy + reference) and each
node's "model staged ... in Y s". The bytes a load sends between nodes are the design's: a
broadcast from rank 0 gives every other node the whole model once; a staged load sends none
(the staging copy itself is Slurm's or the file system's, before the launch). All fake nodes
share this machine's 2 cores and one disk, so times show the overheads, not a network.
Last line: load_s_staged_over_broadcast_at_<N>=R cross_node_load_bytes_broadcast_at_<N>=B cross_node_load_bytes_staged=0
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from benchtable import print_table  # noqa: E402

PY = sys.executable
TASKS = ["site.node.gpus=2", 'site.node.gpu_cores={"0": "0", "1": "1"}', "inference.engine=transformers",
         "grpo.max_steps=1", "grpo.per_device_train_batch_size=4", "grpo.num_generations=4",
         "grpo.max_completion_length=8", "grpo.beta=0.04"]
STAGED = ["site.stage.model_via=srun", "site.stage.model_dest=$HPCRL_RUN_DIR/node-local/$SLURMD_NODENAME/model"]


def hpcrl(*args, env) -> subprocess.CompletedProcess:
    # Run directories go under the bench's own temporary directory (HPCRL_HOME's parent).
    return subprocess.run([PY, "-m", "hpcrl", *args], env=env, capture_output=True, text=True, timeout=120,
                          cwd=Path(env["HPCRL_HOME"]).parent)


def run_job(nodes: int, model: Path, staged: bool, env: dict) -> dict:
    r = hpcrl("submit", "--site", "testbed", "-N", str(nodes), "-t", "15", f"model.path={model}", *TASKS,
              *(STAGED if staged else []), env=env)
    if r.returncode != 0:
        sys.exit(f"bench_load: submit failed: {r.stderr.strip()}")
    job_id, run_dir = r.stdout.strip(), Path(r.stderr.rsplit("run directory ", 1)[1].strip())
    deadline = time.monotonic() + 900
    while True:
        info = json.loads(hpcrl("status", job_id, "--json", env=env).stdout)
        if info["state"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job_id])
            sys.exit(f"bench_load: job {job_id} still {info['state']} after 900 s")
        time.sleep(2)
    log = (run_dir / f"slurm-{job_id}.out").read_text()
    if info["state"] != "COMPLETED":
        sys.exit(f"bench_load: job {job_id} {info['state']}:\n{log[-2000:]}")
    loaded = float(re.search(r"model loaded in ([\d.]+) s", log).group(1))
    staging = [float(s) for s in re.findall(r"model staged at .* \(copied [\d.]+ MiB in ([\d.]+) s\)", log)]
    if staged and len(staging) != nodes:
        sys.exit(f"bench_load: job {job_id}: {len(staging)} staging lines for {nodes} nodes")
    return {"load_s": loaded, "stage_s": max(staging) if staging else 0.0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="that it runs (--nodes 1 --size tiny unless given)")
    # Each run directory holds the job's checkpoints and model (1.6 GB a run at the base size: six
    # runs filled this machine's disk once), so they go unless asked for.
    ap.add_argument("--keep", action="store_true", help="keep the work directory (model, run directories)")
    ap.add_argument("--nodes", type=int, nargs="+", default=None, help="default 1 2 4")
    ap.add_argument("--size", default=None, help='hpcrl.compute.models.tiny size of the model loaded (default "base")')
    args = ap.parse_args(argv)
    args.nodes = args.nodes or ([1] if args.smoke else [1, 2, 4])
    args.size = args.size or ("tiny" if args.smoke else "base")
    if not os.environ.get("SLURM_CONF"):
        sys.exit("bench_load: set SLURM_CONF (start the testbed: scripts/slurm-testbed.sh start)")
    work = Path(tempfile.mkdtemp(prefix="bench-load-"))
    try:
        return bench(args, work)
    finally:
        if args.keep:
            print(f"bench_load: kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


def bench(args, work: Path) -> int:
    from hpcrl.compute.models.tiny import make_tiny_model

    model = make_tiny_model(work / "model", size=args.size, seed=0)
    model_bytes = sum(p.stat().st_size for p in model.glob("*.safetensors"))
    env = {**os.environ, "HPCRL_HOME": str(work / "home")}
    rows, results = [], {}
    for nodes in args.nodes:
        for staged in (False, True):
            got = run_job(nodes, model, staged, env)
            results[nodes, staged] = got
            cross = 0 if staged else model_bytes * (nodes - 1)
            rows.append([str(nodes), "each node's own copy" if staged else "rank 0 broadcasts",
                         f"{got['load_s']:.1f}", f"{got['stage_s']:.1f}" if staged else "-", f"{cross / 2**20:.0f}"])
            print(f"{nodes} node(s), {'staged' if staged else 'broadcast'}: {got}", flush=True)
    print_table(f"model load, {args.size} ({model_bytes / 2**20:.0f} MiB on disk), 1 trainer + 1 engine per fake node",
                ["nodes", "read by", "load s", "staging s", "MiB between nodes at load"], rows)
    top = max(args.nodes)
    ratio = results[top, True]["load_s"] / results[top, False]["load_s"]
    print(f"load_s_staged_over_broadcast_at_{top}={ratio:.2f} "
          f"cross_node_load_bytes_broadcast_at_{top}={model_bytes * (top - 1)} cross_node_load_bytes_staged=0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
