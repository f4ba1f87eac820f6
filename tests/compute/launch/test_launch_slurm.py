"""The compute side's start under real srun on the Slurm testbed: 2 fake nodes x 4 fake GPUs,
`--mpi=pmi2` with the mpich wheel. Two batch jobs, submitted once for the module:

- the script `hpcrl render` writes, in probe mode: every task's row equals `hpcrl plan`'s and
  what the task really got (node, GPU variable, cores, links) equals its row;
- one allocation with several srun steps: the SLURM_* fallback (srun --mpi=none: MPI sees a
  world of one), a trainer killed after the rendezvous (with and without --kill-on-bad-exit), a
  rank that never arrives, a task missing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import probe_rows
from support import check_probe_transfer, check_trainer_imports_overlap

pytestmark = pytest.mark.slurm

PY = sys.executable
TIMEOUTS = ["launch.rendezvous_timeout_s=10", "launch.peer_failure_timeout_s=5"]
JOB_WAIT_S = 300          # queueing behind other users' jobs included
DONE_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
               "DEADLINE", "PREEMPTED"}

STEPS = """#!/bin/bash
#SBATCH --job-name=hpcrl-launch-steps
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=4
#SBATCH --cpus-per-task=2
#SBATCH --gres=gpu:4
#SBATCH --time=00:10:00
#SBATCH --output={run}/job-%j.out
cd {run}
SRUN="srun --nodes=2 --ntasks-per-node=4 --cpus-per-task=2 --mpi=pmi2"
LAUNCH="{py} -u -m hpcrl.compute.launch {run}"
step() {{
  name=$1; shift
  start=$(date +%s.%N)
  "$@" > {run}/$name.out 2> {run}/$name.err
  rc=$?
  echo "$name $rc $start $(date +%s.%N)" >> {run}/steps.txt
}}
step fallback srun --nodes=2 --ntasks-per-node=4 --cpus-per-task=2 --mpi=none --kill-on-bad-exit=1 $LAUNCH
mv {run}/probe.jsonl {run}/fallback-probe.jsonl
step killed env HPCRL_FAULT=die-after-rendezvous:1 $SRUN --kill-on-bad-exit=0 $LAUNCH
step killed_srun_ends env HPCRL_FAULT=die-after-rendezvous:5 $SRUN --kill-on-bad-exit=1 $LAUNCH
step never_arrives env HPCRL_FAULT=hang-before-rendezvous:5 $SRUN --kill-on-bad-exit=1 $LAUNCH
step one_task_missing srun --nodes=2 --ntasks=7 --ntasks-per-node=4 --cpus-per-task=2 --mpi=pmi2 $LAUNCH
"""


def _hpcrl(*args) -> subprocess.CompletedProcess:
    proc = subprocess.run([PY, "-m", "hpcrl", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc


def _sbatch(script: Path, *options: str) -> str:
    proc = subprocess.run(["sbatch", "--parsable", *options, str(script)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def _job_state(job_id: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30).stdout
    for field in out.split():
        if field.startswith("JobState="):
            return field.split("=", 1)[1]
    return "UNKNOWN"


def _wait(job_id: str) -> str:
    deadline = time.monotonic() + JOB_WAIT_S
    while time.monotonic() < deadline:
        state = _job_state(job_id)
        if state in DONE_STATES:
            return state
        time.sleep(0.5)
    subprocess.run(["scancel", job_id], timeout=30)
    pytest.fail(f"job {job_id} did not finish within {JOB_WAIT_S} s (state {_job_state(job_id)}); "
                f"queue: {subprocess.run(['squeue'], capture_output=True, text=True).stdout}")


@pytest.fixture(scope="module")
def jobs(testbed, tmp_path_factory):
    base = tmp_path_factory.mktemp("launch-slurm")
    probe, steps = base / "probe", base / "steps"
    for run in (probe, steps):
        _hpcrl("render", "--site", "testbed", "-N", "2", "mode=probe", *TIMEOUTS, "--run-dir", str(run))
    (steps / "steps.sbatch").write_text(STEPS.format(run=steps, py=PY))
    probe_id = _sbatch(probe / "job.sbatch")
    # One after the other: the testbed's fake nodes share one host, and two MPI jobs starting at
    # once there can meet in MPICH's shared-memory wire-up (seen: a rank's PMI2 exchange garbled,
    # MPI_Init aborting) - something separate hosts never do.
    ids = {"probe": probe_id, "steps": _sbatch(steps / "steps.sbatch", f"--dependency=afterany:{probe_id}")}
    return {"probe": probe, "steps": steps, "ids": ids}


@pytest.fixture(scope="module")
def probe_job(jobs):
    state = _wait(jobs["ids"]["probe"])
    out = (jobs["probe"] / f"slurm-{jobs['ids']['probe']}.out").read_text()
    assert state == "COMPLETED", out
    return {"out": out, "rows": probe_rows(jobs["probe"])}


@pytest.fixture(scope="module")
def steps_job(jobs):
    _wait(jobs["ids"]["steps"])
    run = jobs["steps"]
    steps = {}
    for line in (run / "steps.txt").read_text().splitlines():
        name, rc, start, end = line.split()
        steps[name] = {"rc": int(rc), "seconds": float(end) - float(start), "out": (run / f"{name}.out").read_text(),
                       "err": (run / f"{name}.err").read_text()}
    return {**steps, "run": run}


def _plan_json() -> dict:
    return json.loads(_hpcrl("plan", "--site", "testbed", "-N", "2", "--json").stdout)


def check_rows(rows: list[dict], source: str) -> None:
    plan = _plan_json()
    placement = [{k: v for k, v in t.items() if k != "est_memory_gb"} for t in plan["tasks"]]
    assert [r["plan"] for r in rows] == placement                          # equal to `hpcrl plan`
    for row in rows:
        task, seen = row["plan"], row["observed"]
        assert (seen["rank"], seen["node"], seen["local_rank"], seen["role"], seen["sender"]) == \
            (task["rank"], task["node"], task["local_rank"], task["role"], task["sender"])
        assert seen["slurm_procid"] == str(task["rank"]) and seen["slurm_nodeid"] == str(task["node"])
        assert seen["source"] == source
        assert seen["gpu_env"] == {"CUDA_VISIBLE_DEVICES": ",".join(map(str, task["gpus"]))}
        assert seen["affinity"] == task["cores"]
        assert all(c["ok"] for c in row["checks"].values()), row["checks"]
    # Slurm numbers the allocation's nodes in the testbed's order (n1 < n2 < ... < n16): node i is
    # the i-th of whichever nodes the job got.
    names = {r["plan"]["node"]: r["observed"]["node_name"] for r in rows}
    assert len(set(names.values())) == len(names) and all(
        len({r["observed"]["node_name"] for r in rows if r["plan"]["node"] == n}) == 1 for n in names)
    assert [names[n] for n in sorted(names)] == sorted(names.values(), key=lambda name: int(name[1:]))
    # `hpcrl plan --json`'s senders: each engine (server task) by its rank -> the trainer that syncs it.
    senders = {str(r["plan"]["server_rank"]): r["plan"]["rank"] for r in rows if r["observed"]["sender"]}
    assert senders == plan["senders"]
    trainers = [r for r in rows if r["plan"]["role"] == "trainer"]
    assert all(r["checks"]["all_reduce"]["sum"] == 21 for r in trainers)  # 1 + ... + 6
    assert all(r["observed"]["mesh"] == {"kind": "hsdp", "shape": [2, 3], "dims": ["replicate", "shard"]}
               for r in trainers)
    for r in rows:
        if r["plan"]["role"] == "server":
            assert r["checks"]["channel"]["served"] == [r["plan"]["rank"] - 3 + i for i in range(3)]


def test_probe_through_the_rendered_script_matches_hpcrl_plan(probe_job):
    rows = probe_job["rows"]
    assert len(rows) == 8, probe_job["out"]
    check_rows(rows, "mpi")
    check_trainer_imports_overlap(rows)
    check_probe_transfer(rows)      # on each node, its own sender to its own engine
    assert {r["observed"]["node_name"] for r in rows if "transfer" in r["checks"]} == \
        {r["observed"]["node_name"] for r in rows}
    assert "mesh hsdp (replicate=2 x shard=3)" in probe_job["out"]


def test_slurm_fallback_gives_the_same_placement_as_mpi(probe_job, steps_job):
    step = steps_job["fallback"]
    assert step["rc"] == 0, step["err"]
    assert "MPI sees a world of 1 but Slurm started 8 tasks" in step["err"]
    # Without MPI too, every task's row reached rank 0 (over the watchdog hub), which wrote them.
    rows = probe_rows(steps_job["run"], "fallback-probe.jsonl")
    assert len(rows) == 8, step["err"]
    check_rows(rows, "slurm")

    def placement(rs):      # two jobs: on whichever testbed nodes each got
        # (the import spans are wall-clock times: each job's own)
        skip = ("source", "node_name", "torch_import")
        return [(r["plan"], {k: v for k, v in r["observed"].items() if k not in skip}) for r in rs]
    assert placement(rows) == placement(probe_job["rows"])


def test_killed_trainer_makes_every_other_rank_exit_naming_it(steps_job):
    """srun told to keep going: hpcrl's own watchdog ends every other rank."""
    step = steps_job["killed"]
    assert step["rc"] != 0
    assert "hpcrl: rank 1 (node 0, trainer) was killed by SIGKILL" in step["err"]
    named = [line for line in step["err"].splitlines() if "rank 1 (node 0, trainer, host" in line and "is gone" in line]
    assert sorted(int(line.split()[2]) for line in named) == [0, 2, 3, 4, 5, 6, 7], step["err"]
    assert step["seconds"] < 5 + 20, step


def test_killed_trainer_under_kill_on_bad_exit_is_named(steps_job):
    step = steps_job["killed_srun_ends"]
    assert step["rc"] != 0
    assert "hpcrl: rank 5 (node 1, trainer) was killed by SIGKILL" in step["err"]
    assert step["seconds"] < 5 + 20, step


def test_rank_that_never_arrives_is_named_within_the_bound(steps_job):
    step = steps_job["never_arrives"]
    assert step["rc"] != 0
    assert "the rendezvous did not complete within 10 s" in step["err"]
    assert "never arrived: rank 5 (node 1, trainer)" in step["err"]
    assert step["seconds"] < 10 + 20, step


def test_one_task_missing_is_named_at_once(steps_job):
    step = steps_job["one_task_missing"]
    assert step["rc"] != 0
    assert "the launcher started 7 task(s) but the plan has 8" in step["err"]
    assert "missing rank 7 (node 1, server)" in step["err"]
    assert step["seconds"] < 20, step
