"""Issue #26: what a killed, preempted or requeued attempt leaves must not stop the next one, and a
time limit that leaves no step is refused before the queue. Fast: no job runs here (the testbed's
requeue and cancel are in tests/e2e/test_e2e_slurm.py, Ctrl-C and resume in
tests/compute/train/test_lora.py, whose LoRA demo is interrupted and resumed)."""

from __future__ import annotations

import mmap
import os
import signal
import subprocess
import sys
import time

import pytest

from hpcrl.compute.launch import shm_sweep
from hpcrl.compute.launch.stop import STOP_SIGNALS, ShieldedChildren, StopFlag


def _segment(directory, name, age_s=60.0):
    path = directory / name
    path.write_bytes(b"\0" * 4096)
    old = time.time() - age_s
    os.utime(path, (old, old))
    return path


def test_sweep_removes_a_dead_attempts_mpich_segment_and_keeps_live_and_new_ones(tmp_path):
    stale = _segment(tmp_path, "mpich_shm_47449822_0")
    new = _segment(tmp_path, "mpich_shm_1af39768_0", age_s=0)         # a peer of this launch just made it
    mapped = _segment(tmp_path, "mpich_shm_5_0")                        # a live job's, mapped by its process
    other = _segment(tmp_path, "psm_0116ecbb")                          # not MPICH's: left alone
    with open(mapped, "r+b") as f, mmap.mmap(f.fileno(), 4096):
        removed = shm_sweep.sweep(shm_dir=tmp_path)
    assert removed == [stale.name]
    assert not stale.exists() and new.exists() and mapped.exists() and other.exists()


def _open_files(pid: int) -> set[str]:
    """What process `pid` has open now (an fd closed between the listing and its link is skipped:
    a starting Python opens and closes files as it imports, CI rehearsal 7 met one)."""
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            found.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:
            pass
    return found


def test_sweep_keeps_a_segment_another_process_holds_open(tmp_path):
    held = _segment(tmp_path, "mpich_shm_7_0")
    holder = subprocess.Popen([sys.executable, "-c", f"f = open({str(held)!r}); import time; time.sleep(60)"])
    try:
        deadline = time.monotonic() + 10
        while str(held) not in _open_files(holder.pid):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert shm_sweep.sweep(shm_dir=tmp_path) == []
    finally:
        holder.kill()
        holder.wait()
    assert shm_sweep.sweep(shm_dir=tmp_path) == [held.name]


def test_stop_flag_takes_every_stop_signal_and_names_the_first():
    flag = StopFlag()
    old = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    try:
        flag.install()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGUSR2)
        assert flag.raised and flag.signal_name == "SIGTERM" and flag.received == {"SIGTERM", "SIGUSR2"}
    finally:
        for s, h in old.items():
            signal.signal(s, h)


# A task past Python's finalization, as a server waiting in MPI_Finalize (mpi4py's exit hook): here
# a C-level exit hook that waits for a signal, pause(2).
LATE_EXIT = """
import ctypes, sys
from hpcrl.compute.launch.stop import STOP
STOP.install()
if sys.argv[1] == "ignore":
    STOP.ignore_late_requests()
libc = ctypes.CDLL(None)
libc.__cxa_atexit(ctypes.cast(libc.pause, ctypes.c_void_p), None, None)   # atexit(pause)
print("ready", flush=True)
"""


@pytest.mark.parametrize("late", ["ignore", "handler only"])
def test_the_time_limits_warning_after_the_role_ended_does_not_kill_the_task(late):
    """A job that had done every step failed: Slurm's USR2 reached a server in MPI_Finalize, after
    Python had put back the signal's default action (it does so for every signal it handles as the
    interpreter finalizes), and the task died of it. STOP.ignore_late_requests, once the role is over,
    leaves the signal ignored through the end of the process."""
    proc = subprocess.Popen([sys.executable, "-c", LATE_EXIT, late], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(1.0)                  # past finalization: in pause()
        proc.send_signal(signal.SIGUSR2)
        time.sleep(0.5)
        alive = proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
    if late == "ignore":
        assert alive, f"the task died of the late USR2 (exit {proc.returncode})"
    else:   # the check can fail: without ignore_late_requests the signal kills the finalized task
        assert not alive and proc.returncode == -signal.SIGUSR2


def test_an_engine_gone_after_a_signal_it_ends_on_is_the_signals_doing():
    """Stop 34's CI: `scontrol requeue` (SIGTERM to every process of the step) ended vLLM's engine
    core, as vLLM does by design, and its server reported an EngineDeadError traceback. The server
    now says the job was stopped by SIGTERM; after SIGUSR2 alone (which the engine ignores) an engine
    gone is still the engine's failure, named by the watcher."""
    from hpcrl.compute.inference.engine import engine_class
    from hpcrl.compute.inference.server import signal_that_ends_the_engine

    vllm, transformers = engine_class("vllm"), engine_class("transformers")
    flag = StopFlag()
    assert signal_that_ends_the_engine(vllm, flag) is None
    flag._set(signal.SIGUSR2)
    assert signal_that_ends_the_engine(vllm, flag) is None
    flag._set(signal.SIGTERM)
    assert signal_that_ends_the_engine(vllm, flag) == "SIGTERM"
    assert signal_that_ends_the_engine(transformers, flag) is None     # in the server's process


def test_engine_processes_started_shielded_outlive_the_stop_signal():
    """Slurm's SIGUSR2 reaches every process of the step; vLLM's engine core has no handler for it
    and died of it before the trainers checkpointed (issue #26, item 1)."""
    code = "import time; time.sleep(30)"
    with ShieldedChildren():
        shielded = subprocess.Popen([sys.executable, "-c", code])
    plain = subprocess.Popen([sys.executable, "-c", code])
    try:
        time.sleep(0.5)
        for p in (shielded, plain):
            p.send_signal(signal.SIGUSR2)
        assert plain.wait(10) == -signal.SIGUSR2
        time.sleep(0.3)
        assert shielded.poll() is None
    finally:
        for p in (shielded, plain):
            p.kill()
            p.wait()
    assert signal.getsignal(signal.SIGUSR2) is not signal.SIG_IGN      # the server's own handler is back


@pytest.mark.parametrize("time_text, ok", [("1", False), ("2", True)])
def test_a_time_limit_without_room_for_a_step_is_refused_at_render(hpcrl, time_text, ok, tmp_path):
    """Issue #26, item 3: a limit shorter than start-up + the signal lead requeued forever, each
    attempt stopped during start-up. The testbed: startup_s 30, USR2@60 (90 s); -t in minutes."""
    r = hpcrl("render", "--site", "testbed", "-t", time_text, "--run-dir", str(tmp_path / "run"))
    if ok:
        assert r.returncode == 0, r.stderr
        return
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "time: 1 leaves no time to train on testbed" in r.stderr and "startup_s" in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, said", [("site.signal=USR2", "site.signal: 'USR2' is not a signal and its lead"),
                                            ("launch.max_restarts=-1", "launch.max_restarts: must be >= 0")])
def test_stop_settings_are_checked(hpcrl, override, said, tmp_path):
    r = hpcrl("render", "--site", "testbed", override, "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 2 and said in r.stderr, r.stderr


def test_the_script_requeues_only_after_a_checkpoint_with_progress_and_within_max_restarts(hpcrl, tmp_path):
    r = hpcrl("render", "--site", "testbed", "launch.max_restarts=3", "--run-dir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stderr
    script = (tmp_path / "run" / "job.sbatch").read_text()
    requeue = script[script.index('if [ -e "$HPCRL_RUN_DIR/.requeue-requested" ]'):]
    assert requeue.index(".requeue-ready") < requeue.index("scontrol requeue")
    assert '[ "${SLURM_RESTART_COUNT:-0}" -lt 3 ]' in requeue


def test_recorded_engine_buffers_are_swept_once_unmapped_and_only_on_their_host(tmp_path):
    from hpcrl.job import rundir

    shm, run_dir = tmp_path / "shm", tmp_path / "run"
    shm.mkdir()
    gone, held, foreign = (_segment(shm, n, age_s=0) for n in ("psm_0a", "psm_0b", "psm_0c"))
    unrecorded = _segment(shm, "psm_0d")            # another program's: never touched
    shm_sweep.record(rundir.engine_shm_record(run_dir, 0, 0), [gone.name, held.name])
    other_host = rundir.engine_shm_record(run_dir, 1, 0)
    shm_sweep.record(other_host, [foreign.name])
    other_host.write_text(other_host.read_text().replace('"host": "', '"host": "elsewhere-'))
    with open(held, "r+b") as f, mmap.mmap(f.fileno(), 4096):
        assert shm_sweep.sweep_recorded(run_dir, shm_dir=shm) == [gone.name]
    assert held.exists() and foreign.exists() and unrecorded.exists()
    assert shm_sweep.sweep_recorded(run_dir, shm_dir=shm) == [held.name]
    assert not rundir.engine_shm_record(run_dir, 0, 0).exists() and other_host.exists()
