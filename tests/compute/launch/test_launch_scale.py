"""The launch at 128 ranks on this machine: 16 fake nodes x 8 tasks (7 trainers + 1 server, a
Frontier node's shape) in `recipe.mode: control`, which imports no torch, under mpiexec.

Every task reports the place the plan gives it (`hpcrl plan --json`), and a rank SIGKILLed after
its report is named by every other one, all gone within launch.peer_failure_timeout_s (one launch
for both; the kill right after the rendezvous: tests/compute/launch/test_launch_slurm.py and
scripts/bench_scale.py, at 16..256 ranks).
Each task may run on all of this machine's cores (site.node.gpu_cores): the local site's even
split would put all 112 trainers on core 0 and the 16 servers on core 1 of this 2-core machine.
scripts/bench_scale.py measures the same launches at 16..256 ranks."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from conftest import probe_rows

from hpcrl.job import rundir
from hpcrl.login.compose import compose

PY = sys.executable
MPIEXEC = str(Path(PY).parent / "mpiexec") if (Path(PY).parent / "mpiexec").exists() else shutil.which("mpiexec")
RANKS, PER_NODE = 128, 8
PEER_TIMEOUT_S = 5.0
OVERRIDES = ["mode=control", f"site.node.gpus={PER_NODE}",
             "site.node.gpu_cores=" + json.dumps({str(g): f"0-{max(0, (os.cpu_count() or 1) - 1)}"
                                                  for g in range(PER_NODE)}),
             f"launch.peer_failure_timeout_s={PEER_TIMEOUT_S:g}", "launch.rendezvous_timeout_s=100"]

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install mpich)")]


def _launch(tmp_path, *flags, fault: str | None = None, timeout: float = 110):
    """mpiexec of a control job of RANKS tasks: (exit status, [(seconds since start, line)], run dir)."""
    spec = compose(None, "local", OVERRIDES, {"resources.nodes": RANKS // PER_NODE},
                   str(tmp_path / f"run-{uuid.uuid4().hex[:6]}"), check_fit=False, check_inputs=False)
    run_dir = rundir.create(spec.run_dir, spec.to_json(), None)
    env = {**os.environ, "HPCRL_LAUNCH_ID": uuid.uuid4().hex[:8], "PYTHONUNBUFFERED": "1"}
    env.pop("HPCRL_FAULT", None)
    if fault:
        env["HPCRL_FAULT"] = fault
    cmd = [MPIEXEC, *flags, "-n", str(RANKS), PY, "-u", "-m", "hpcrl.compute.launch", str(run_dir)]
    lines: list[tuple[float, str]] = []
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)

    def pump(src):
        for line in iter(src.readline, ""):
            lines.append((time.monotonic() - t0, line.rstrip("\n")))

    pumps = [threading.Thread(target=pump, args=(s,), daemon=True) for s in (proc.stdout, proc.stderr)]
    for t in pumps:
        t.start()
    try:
        code = proc.wait(timeout)
        seconds = time.monotonic() - t0          # every rank has exited
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"{RANKS} ranks still running after {timeout} s:\n" + "\n".join(l for _, l in lines[-20:]))
    finally:
        for t in pumps:
            t.join(10)
    print(f"{RANKS} ranks{' with ' + fault if fault else ''}: {seconds:.1f} s")
    return code, lines, seconds, run_dir


def test_128_ranks_report_the_place_the_plan_gives_them_and_a_killed_one_is_named_by_every_other(tmp_path):
    """Every task reports where it runs (rank 0 writes the rows); then the last rank (node 15's
    server) is SIGKILLed (HPCRL_FAULT die-after-report) and mpiexec is told not to clean up, so
    hpcrl's watchdog alone must end the 127 others, each naming it, within the bound. (One launch
    for both: each had one of its own, issue #29.)"""
    victim = RANKS - 1
    code, lines, seconds, run_dir = _launch(tmp_path, "-disable-auto-cleanup", fault=f"die-after-report:{victim}")
    rows = probe_rows(run_dir)
    assert len(rows) == RANKS, "\n".join(l for _, l in lines if l.startswith("hpcrl:"))[:3000]
    plan = subprocess.run([PY, "-m", "hpcrl", "plan", "--site", "local", "-N", str(RANKS // PER_NODE), "--json",
                           *OVERRIDES], capture_output=True, text=True, timeout=60)
    assert plan.returncode == 0, plan.stderr
    planned = [{k: v for k, v in t.items() if k != "est_memory_gb"} for t in json.loads(plan.stdout)["tasks"]]
    assert [r["plan"] for r in rows] == planned
    for row, task in zip(rows, planned):
        seen = row["observed"]
        assert (seen["rank"], seen["node"], seen["local_rank"], seen["role"], seen["sender"], seen["source"]) == \
            (task["rank"], task["node"], task["local_rank"], task["role"], task["sender"], "mpi")
        assert seen["affinity"] == task["cores"] and seen["node_name"].endswith(f"-fake{task['node']}")
        assert all(c["ok"] for c in row["checks"].values()), row["checks"]
        assert row["checks"]["channel"]["server_rank" if task["role"] == "trainer" else "served"] == (
            task["server_rank"] if task["role"] == "trainer" else list(range(task["rank"] - PER_NODE + 1, task["rank"])))
        if task["role"] == "trainer":
            n = RANKS // PER_NODE * (PER_NODE - 1)
            assert (row["checks"]["allreduce"]["sum"], row["checks"]["allreduce"]["world"]) == (n * (n + 1) // 2, n)
        assert row["torch_imported"] is False and "trainers_group" not in row["timings"]
    launched = [l for _, l in lines if "rank 0 node 0 trainer] launched: rendezvous at" in l]
    assert len(launched) == 1, launched
    assert not (run_dir / ".launch").exists()
    print(f"{launched[0]}; hub CPU {rows[0]['usage'].get('hub_cpu_s')} s; rank 0 peak RSS "
          f"{rows[0]['usage']['peak_rss_kb'] / 1024:.0f} MiB")

    assert code != 0
    who = f"rank {victim} (node {victim // PER_NODE}, server"
    killed = [t for t, l in lines if l.startswith(f"hpcrl: {who}) was killed by SIGKILL")]
    assert len(killed) == 1, "\n".join(l for _, l in lines if l.startswith("hpcrl:"))[:3000]
    named = re.compile(rf"^hpcrl: rank (\d+) \(node \d+, \w+\): {re.escape(who)}, host .*\) is gone: "
                       rf"its connection closed without a goodbye.*; exiting$")
    namers = sorted(int(m.group(1)) for _, l in lines if (m := named.match(l)))
    assert namers == list(range(victim)), [l for _, l in lines if l.startswith("hpcrl:") and not named.match(l)][:10]
    assert who in (rundir.read_failure(run_dir) or "")
    out_after_kill = seconds - killed[0]
    assert out_after_kill < PEER_TIMEOUT_S, out_after_kill
    print(f"rank {victim} killed: all {RANKS - 1} others named it and were gone {out_after_kill:.2f} s later")


# ---------------------------------------------------------------------------- through real srun
TESTBED_OVERRIDES = ["mode=control", f"site.node.gpus={PER_NODE}",
                     # The testbed believes in 8 CPUs per node on this 2-core machine: as its site does.
                     "site.node.gpu_cores=" + json.dumps({str(g): "1" if g == PER_NODE - 1 else "0"
                                                          for g in range(PER_NODE)})]


def _testbed_nodes() -> tuple[int, int]:
    """(idle-or-mixed nodes, GPUs per node) of the testbed's default partition."""
    r = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %G"], capture_output=True, text=True, timeout=30)
    nodes = {line.split()[0]: line.split()[1] for line in r.stdout.splitlines() if line.strip()}
    gpus = [int(m.group(1)) for g in nodes.values() if (m := re.search(r"gpu:(\d+)", g))]
    return len(nodes), min(gpus, default=0)


def test_16_nodes_through_srun_report_the_place_the_plan_gives_them(testbed, hpcrl):
    """16 testbed nodes x 8 tasks, launched by the rendered script's own srun (PMI2 wire-up, Slurm's
    node names and GPU variables), each task where `hpcrl plan` puts it."""
    nodes = RANKS // PER_NODE
    have, gpus = _testbed_nodes()
    if have < nodes or gpus < PER_NODE:
        pytest.skip(f"the testbed has {have} nodes x {gpus} GPUs; this test needs {nodes} x {PER_NODE} "
                    f"(scripts/test.sh starts it with SLURM_NODES=24 SLURM_NODE_GPUS={PER_NODE})")
    r = hpcrl("submit", "--site", "testbed", "-N", str(nodes), "-t", "10", *TESTBED_OVERRIDES)
    assert r.returncode == 0, r.stderr
    job_id, run_dir = r.stdout.strip(), Path(r.stderr.rsplit("run directory ", 1)[1].strip())
    deadline = time.monotonic() + 300
    while True:
        info = json.loads(hpcrl("status", job_id, "--json").stdout)
        if info["state"] in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        assert time.monotonic() < deadline, f"job {job_id} still {info['state']} after 300 s"
        time.sleep(2)
    log = (run_dir / f"slurm-{job_id}.out").read_text()
    assert info["state"] == "COMPLETED", log[-3000:]
    rows = probe_rows(run_dir)
    assert len(rows) == RANKS
    plan = hpcrl("plan", "--site", "testbed", "-N", str(nodes), "--json", *TESTBED_OVERRIDES)
    assert plan.returncode == 0, plan.stderr
    planned = [{k: v for k, v in t.items() if k != "est_memory_gb"} for t in json.loads(plan.stdout)["tasks"]]
    assert [r["plan"] for r in rows] == planned
    for row, task in zip(rows, planned):
        seen = row["observed"]
        assert (seen["rank"], seen["node"], seen["local_rank"], seen["role"], seen["sender"]) == \
            (task["rank"], task["node"], task["local_rank"], task["role"], task["sender"])
        assert seen["slurm_procid"] == str(task["rank"]) and seen["slurm_nodeid"] == str(task["node"])
        assert seen["affinity"] == task["cores"] and seen["gpu_env"]["CUDA_VISIBLE_DEVICES"] == str(task["gpus"][0])
        assert all(c["ok"] for c in row["checks"].values()), row["checks"]
    # 16 distinct testbed nodes, node i the i-th of them in Slurm's order (n1 < n2 < ...).
    names = {r["plan"]["node"]: r["observed"]["node_name"] for r in rows}
    assert all(r["observed"]["node_name"] == names[r["plan"]["node"]] for r in rows)
    assert [names[n] for n in range(nodes)] == sorted(set(names.values()), key=lambda name: int(name[1:]))
