"""The stop request: a signal that asks the trainers to checkpoint and end the run early. SIGUSR2
is Slurm's warning before the time limit or a preemption (--signal; not USR1, which NCCL/RCCL
catch); SIGTERM is scancel's, a preemption's without a user signal and `scontrol requeue`'s, with
KillWait seconds before SIGKILL; SIGINT is an interactive srun's Ctrl-C. Each sets a flag that the
trainers agree on at the next step boundary, so every rank checkpoints the same step. Installed at
the very start of every task, before anything slow, so a signal that comes early is kept instead of
killing the task. Torch-free."""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)


class StopFlag:
    def __init__(self):
        self.raised = False
        self.signal_name: str | None = None       # the first stop signal's name, for the log
        self.received: set[str] = set()           # every stop signal's name

    def install(self, signals=STOP_SIGNALS) -> None:
        for s in signals:
            signal.signal(s, self._set)

    def ignore_late_requests(self) -> None:
        """The role is over: a stop request from now on is moot. Ignored, not left to the handler:
        Python puts back the default action of every signal it handles as the interpreter
        finalizes (a server leaves through MPI_Finalize after that), and Slurm's warning landing
        there killed a finished task, which failed a job that had done all its steps."""
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)

    def _set(self, signum, _frame=None):
        name = signal.Signals(signum).name
        if not self.raised:
            self.signal_name = name
        self.received.add(name)
        self.raised = True


STOP = StopFlag()


class ShieldedChildren:
    """Processes started inside this context ignore SIGUSR2: Slurm's warning reaches every process
    of the step (srun forwards it to the whole process tree), and vLLM's engine core and workers,
    which have no handler for it, would die of it before the trainers checkpoint. An ignored signal
    stays ignored across fork and exec. SIGTERM and SIGINT are left to the engine: vLLM drains its
    requests on them (the server's `shutdown_timeout`) and stops, which is what a cancelled job
    wants; its server's stop flag still makes the trainers checkpoint."""

    def __enter__(self):
        self._old = signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        return self

    def __exit__(self, *_):
        signal.signal(signal.SIGUSR2, self._old)
