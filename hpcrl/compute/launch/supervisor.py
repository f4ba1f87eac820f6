"""Each task's first process stays behind as a thin supervisor of the real task (a fork).

Two jobs no code inside the task can do:

- Bound the rendezvous. MPI_Init blocks until every task has called it, inside C code that
  holds the GIL, so no thread of the task could run a timer there. When the deadline passes
  first, the supervisor reads which ranks have checked in (the arrival files), prints them,
  and ends the task.
- Name a task that dies by a signal (the kernel's OOM killer, a stray kill -9). mpiexec (hydra)
  answers a signal death by SIGKILLing every other rank at once, and its banner names some
  pid, not the culprit; srun only says "task N: Killed". The supervisor sees its own task's
  exit status and says which rank, node and role died, and how, before exiting with
  128 + signal (an ordinary failure to the launcher, which then stops the others).

Signals the launcher sends (SIGTERM at a step's end or a cancel, USR2 before the time limit, INT)
are passed on to the task; the task dies with the supervisor (PR_SET_PDEATHSIG). Before the
rendezvous a terminating signal ends the task within KILL_AFTER_S; after it the task takes it as a
stop request (hpcrl.compute.launch.stop) and checkpoints, bounded by the launcher's own SIGKILL
(Slurm's KillWait, `hpcrl run`'s second Ctrl-C or its grace). The supervisor
imports nothing heavy and holds no MPI state: it is a few MB of copy-on-write memory.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import time
from typing import Callable

from hpcrl.compute.launch import outcome
from hpcrl.job.process_group import kill_group

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR2, signal.SIGQUIT, signal.SIGCONT)
# After one of these the task gets this long to exit before SIGKILL, so a stopped or stuck task
# cannot hold a launcher's shutdown forever.
TERMINATING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
KILL_AFTER_S = 15.0
# hydra (mpiexec -disable-auto-cleanup) announces a failed rank with SIGUSR1, whose default action
# would kill the task before its watchdog could name the rank; NCCL/RCCL take USR1 for themselves.
IGNORED = (signal.SIGUSR1,)
_DONE = b"\0done"


class Supervisor:
    def __init__(self, who: str, timeout_s: float, explain: Callable[[], str]):
        self.who = who                      # "rank 1 (node 0, trainer)"
        self.timeout_s = timeout_s
        self._explain = explain
        self._pipe: int | None = None       # the task's end: stages, then "done"
        self._task: int | None = None       # the supervisor's side: the task's pid, its pipe's end
        self._read: int | None = None
        self._forwarded: set[int] = set()
        self._kill_timer: threading.Timer | None = None
        self._met = False                   # the task reported the rendezvous complete

    # ---------------------------------------------------------------- both sides
    def start(self) -> bool:
        """Fork. True in the task (go on with the launch), False in the supervisor."""
        read_end, write_end = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            os.close(read_end)
            # Its own process group: whatever the task starts (vLLM's engine and workers) can be
            # ended with it, even after a SIGKILL that gave the task no chance to stop them.
            os.setpgid(0, 0)
            die_with_parent(parent)
            self._pipe = write_end
            return True
        os.close(write_end)
        self._task, self._read = pid, read_end
        return False

    # ---------------------------------------------------------------- the task's side
    def stage(self, text: str) -> None:
        """What the task waits on now; the timeout message quotes the last one."""
        self._send(text.replace("\n", " ").encode() + b"\n")

    def done(self) -> None:
        """The rendezvous is complete: from now on only deaths are reported."""
        if self._pipe is not None:
            self._send(_DONE + b"\n")
            os.close(self._pipe)
            self._pipe = None

    def _send(self, data: bytes) -> None:
        if self._pipe is not None:
            try:
                os.write(self._pipe, data)
            except OSError:
                pass

    # ---------------------------------------------------------------- the supervisor's side
    def supervise(self) -> int:
        """Wait for the task; returns the exit status this process should end with."""
        for sig in FORWARDED:
            signal.signal(sig, self._forward)
        for sig in IGNORED:
            signal.signal(sig, signal.SIG_IGN)
        if not self._watch_rendezvous():
            self._end_task()
            kill_group(self._task)
            return 1
        _, status = os.waitpid(self._task, 0)
        # Orphans of the task (an engine process) would keep the launcher's step, and so the
        # job, alive: on Slurm without cgroups, srun waits for every process holding its output.
        kill_group(self._task)
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            if sig not in self._forwarded:
                name = signal.Signals(sig).name
                hint = " (out of memory? see dmesg / the job's memory use)" if sig == signal.SIGKILL else ""
                _say(f"hpcrl: {self.who} was killed by {name}{hint}; exiting")
            return 128 + sig
        return os.WEXITSTATUS(status)

    def _forward(self, signum, frame) -> None:
        self._forwarded.add(signum)
        if signum in TERMINATING and not self._met:
            signum = signal.SIGTERM       # blocked in MPI_Init, a Python handler would never run
            self._forwarded.add(signum)
        try:
            os.kill(self._task, signum)
            if signum in TERMINATING:
                os.kill(self._task, signal.SIGCONT)      # a stopped task would never see it
                if self._kill_timer is None and not self._met:
                    self._kill_timer = threading.Timer(KILL_AFTER_S, self._kill)
                    self._kill_timer.daemon = True
                    self._kill_timer.start()
        except ProcessLookupError:
            pass

    def _kill(self) -> None:
        self._forwarded.add(signal.SIGKILL)
        try:
            os.kill(self._task, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _watch_rendezvous(self) -> bool:
        """False when the deadline passed before the task said it is done."""
        deadline = time.monotonic() + self.timeout_s
        stage, pending = "still starting, short of the rendezvous", b""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            ready, _, _ = select.select([self._read], [], [], left)
            if not ready:
                continue
            chunk = os.read(self._read, 4096)
            if not chunk:
                return True                 # the task ended (or closed the pipe): its status tells
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if line == _DONE:
                    self._met = True
                    return True
                stage = line.decode(errors="replace")
        try:
            explanation = self._explain()
        except Exception as e:              # the message must go out whatever happens
            explanation = f"(could not tell which ranks are missing: {e})"
        _say(f"hpcrl: {self.who}: the rendezvous did not complete within {self.timeout_s:.0f} s "
             f"(launch.rendezvous_timeout_s; this task was {stage}); {explanation}; exiting")
        return False

    def _end_task(self) -> None:
        """SIGTERM the (probably blocked) task, SIGKILL it if it is still there after 3 s; reap it."""
        try:
            os.kill(self._task, signal.SIGTERM)
            for _ in range(30):
                time.sleep(0.1)
                if os.waitpid(self._task, os.WNOHANG) != (0, 0):
                    return
            os.kill(self._task, signal.SIGKILL)
            os.waitpid(self._task, 0)
        except (ProcessLookupError, ChildProcessError):
            pass


def _say(line: str) -> None:
    outcome.fatal(line)


def die_with_parent(parent: int) -> None:
    """This process must not outlive `parent`: the task its supervisor (a launcher's SIGKILL reaches
    only the latter), an engine process the task that started it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)       # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:              # the supervisor died before the prctl took effect
        os._exit(1)
