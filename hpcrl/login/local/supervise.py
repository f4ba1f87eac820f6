"""Runs mpiexec for `hpcrl run` and bounds every way of ending it.

Output is streamed, and kept in <run_dir>/run.log; the exit status is mpiexec's. When a rank fails,
mpiexec (hydra) kills the others at once; the failing rank has named itself by then
(hpcrl.compute.launch.supervisor), which hydra's banner would not. Every rank also bounds its waits
for what no launcher sees, a rank that never arrives or hangs: the supervisor bounds the
rendezvous, hpcrl.compute.launch.watchdog every wait after it. As a last resort, ranks still
running some time after one of them announced a fatal exit are stopped, and so are all of them on
Ctrl-C.
"""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from hpcrl.login.local.console import ConsoleFilter
from hpcrl.login.local.exit_codes import INTERRUPTED
from hpcrl.login.local.processes import kill_launch, request_stop
from hpcrl.login.local.progress import Progress

# After the first Ctrl-C / SIGTERM the trainers checkpoint at the end of their step: this long at
# most, or until a second one; then the ranks get STOP_GRACE_S before SIGKILL.
CHECKPOINT_GRACE_S = 120.0
STOP_GRACE_S = 10.0
AFTER_FAILURE_GRACE_S = 15.0  # beyond peer_failure_timeout_s, after a rank announced a fatal exit
# Every fatal message of hpcrl.compute.launch ends so (watchdog.die, the supervisor, main).
_FATAL_LINE = re.compile(r"^hpcrl: .*; exiting\s*$")


def supervise(cmd: list[str], env: dict, log_path: Path, after_failure_s: float,
              progress: Progress | None = None, console: ConsoleFilter | None = None,
              checkpoint_grace_s: float = CHECKPOINT_GRACE_S) -> int:
    """Run `cmd` in its own session, tee its output (every line to `log_path`, those `console`
    lets through to this process's stdout/stderr), and bound every way of ending it. The first
    Ctrl-C or SIGTERM asks the trainers to checkpoint and stop; a second, or `checkpoint_grace_s`,
    stops every rank at once."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    launch_id = env.get("HPCRL_LAUNCH_ID")
    failed_at: list[float] = []
    stop_requested = False         # the first Ctrl-C's stop request went to the ranks
    lock = threading.Lock()
    with open(log_path, "ab") as log:
        def pump(src, dst) -> None:
            stream = "stdout" if dst is sys.stdout else "stderr"
            for line in iter(src.readline, b""):
                with lock, (progress.writing() if progress is not None else contextlib.nullcontext()):
                    if console is None or console.show(line.decode(errors="replace"), stream):
                        dst.buffer.write(line)
                        dst.flush()
                    log.write(line)
                    log.flush()
                if not failed_at and _FATAL_LINE.match(line.decode(errors="replace")):
                    failed_at.append(time.monotonic())

        pumps = [threading.Thread(target=pump, args=(proc.stdout, sys.stdout), daemon=True),
                 threading.Thread(target=pump, args=(proc.stderr, sys.stderr), daemon=True)]
        for t in pumps:
            t.start()
        stops: list[float] = []      # when each Ctrl-C / SIGTERM came
        wake = threading.Event()

        def on_stop(*_):
            stops.append(time.monotonic())
            wake.set()

        old = {sig: signal.signal(sig, on_stop) for sig in (signal.SIGTERM, signal.SIGINT)
               if signal.getsignal(sig) is not signal.SIG_IGN}
        try:
            while proc.poll() is None:
                if progress is not None:
                    progress.poll()
                if stops and (len(stops) > 1 or time.monotonic() - stops[0] > checkpoint_grace_s):
                    if progress is not None:
                        progress.close()
                    print("hpcrl: interrupted; stopping the ranks now", file=sys.stderr, flush=True)
                    _stop(proc, launch_id)
                    return INTERRUPTED
                if stops and not stop_requested:
                    stop_requested = True
                    with lock, (progress.writing() if progress is not None else contextlib.nullcontext()):
                        print(f"hpcrl: interrupted; the trainers checkpoint at the end of their step "
                              f"(Ctrl-C again to stop now)", file=sys.stderr, flush=True)
                    request_stop(launch_id)
                if failed_at and time.monotonic() - failed_at[0] > after_failure_s:
                    if progress is not None:
                        progress.close()
                    print(f"hpcrl: ranks still running {after_failure_s:.0f} s after a fatal error; stopping them",
                          file=sys.stderr, flush=True)
                    _stop(proc, launch_id)
                    break
                wake.wait(0.2)
                wake.clear()
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
            kill_launch(proc, launch_id)    # leftovers (engine processes) of a finished launch
            for t in pumps:
                t.join(2.0)
            if env.get("HPCRL_RUN_DIR"):
                _sweep_shared_memory(env["HPCRL_RUN_DIR"], env)
    code = proc.wait()
    if stops:
        return INTERRUPTED
    return code if code >= 0 else 128 - code


def _sweep_shared_memory(run_dir: str, env: dict) -> None:
    """What killed engines left in /dev/shm (hpcrl.compute.launch.shm_sweep; compute-side code, so
    run, not imported). Bounded, and never the run's failure."""
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        subprocess.run([sys.executable, "-m", "hpcrl.compute.launch.shm_sweep", run_dir], env=env, timeout=30,
                       stdout=subprocess.DEVNULL)


def _stop(proc: subprocess.Popen, launch_id: str | None) -> None:
    """SIGINT to mpiexec (it forwards it), then SIGKILL to the whole session after a bound."""
    try:
        proc.send_signal(signal.SIGINT)
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    kill_launch(proc, launch_id)
    proc.wait()
