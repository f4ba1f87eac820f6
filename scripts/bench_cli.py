#!/usr/bin/env python
"""Wall time of the login-side commands against a bare Python start and one squeue, same run.

    SLURM_CONF=/tmp/hpcrl-testbed/etc/slurm.conf .venv/bin/python scripts/bench_cli.py [--jobs 200] [--repeat 15]

Registers --jobs real jobs (tiny `sbatch --wrap true` jobs on the testbed) in a private registry,
then times each command --repeat times and reports medians. Last line:
worst_cli_over_python_start=X  (the largest ratio; status is held against python start + one squeue)
Two reference rows (not in X) time a Python start that only imports jinja2, and one that also
imports hpcrl.job.spec (the recipe and site dataclasses): the floor under `hpcrl render`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def timed(cmd: list[str], env: dict, cwd: str, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        r = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        samples.append(time.perf_counter() - t0)
        if r.returncode != 0:
            sys.exit(f"bench_cli: {' '.join(cmd)} failed: {r.stderr.decode().strip()}")
    return statistics.median(samples)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    if not os.environ.get("SLURM_CONF"):
        sys.exit("bench_cli: set SLURM_CONF (start the testbed: scripts/slurm-testbed.sh start)")

    work = tempfile.mkdtemp(prefix="hpcrl-bench-cli-")
    env = dict(os.environ, HPCRL_HOME=str(Path(work) / "home"))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    os.environ["HPCRL_HOME"] = env["HPCRL_HOME"]
    from hpcrl.login.registry import Registry

    registry = Registry()
    for i in range(args.jobs):
        out = subprocess.run(["sbatch", "--parsable", "-J", f"bench{i}", "-o", "/dev/null", "--wrap", "true"],
                             cwd=work, capture_output=True, text=True, check=True)
        run_dir = Path(work) / f"run{i}"
        run_dir.mkdir()
        (run_dir / "metrics.jsonl").write_text('{"step": 3, "reward": 0.5, "tokens_per_s": 900, "sync_s": 0.02}\n')
        registry.add(out.stdout.strip().split(";")[0], f"bench{i}", "testbed", str(run_dir), str(run_dir / "job.sbatch"))
    # slurmctld is busy with 200 fresh jobs for a while: time commands against a quiet controller.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        queued = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout.split()
        if not queued:
            break
        time.sleep(1)
    hpcrl = [sys.executable, "-m", "hpcrl"]
    subprocess.run([*hpcrl, "status"], env=env, cwd=work, stdout=subprocess.DEVNULL, check=True)   # warm caches

    py = timed([sys.executable, "-c", "pass"], env, work, args.repeat)
    squeue = timed(["squeue"], env, work, args.repeat)
    helpt = timed([*hpcrl, "--help"], env, work, args.repeat)
    render_dir = Path(work) / "renders"
    render_dir.mkdir()
    rendert = timed([*hpcrl, "render", "--site", "testbed"], env, str(render_dir), args.repeat)
    statust = timed([*hpcrl, "status", "-n", str(args.jobs)], env, work, args.repeat)
    # What render cannot go below: a Python start that imports jinja2 (the template engine), and one
    # that also defines the recipe and site dataclasses (hpcrl.job.spec). Reference rows, not in X.
    jinja = timed([sys.executable, "-c", "import jinja2"], env, work, args.repeat)
    floor = timed([sys.executable, "-c", "import jinja2, hpcrl.job.spec"], env, work, args.repeat)

    rows = [("python -c pass", py, py, 1.0), ("squeue", squeue, None, None),
            ("hpcrl --help", helpt, py, helpt / py), ("hpcrl render", rendert, py, rendert / py),
            (f"hpcrl status ({args.jobs} jobs)", statust, py + squeue, statust / (py + squeue)),
            ("(ref) import jinja2", jinja, py, jinja / py),
            ("(ref) import jinja2+spec", floor, py, floor / py)]
    print(f"{'command':28} {'median ms':>10} {'baseline ms':>12} {'ratio':>7}")
    for name, t, base, ratio in rows:
        print(f"{name:28} {t * 1e3:10.1f} {'' if base is None else f'{base * 1e3:12.1f}':>12} "
              f"{'' if ratio is None else f'{ratio:7.2f}':>7}")
    worst = max(r[3] for r in rows[2:5])
    print(f"worst_cli_over_python_start={worst:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
