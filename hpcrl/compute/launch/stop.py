"""The stop request: SIGUSR2 (Slurm's warning before the time limit, or before a preemption; not
USR1, which NCCL/RCCL catch) sets a flag that the trainers agree on at the next step boundary, so
every rank checkpoints the same step. Installed at the very start of every task, before anything
slow, so a signal that comes early is kept instead of killing the task. Torch-free."""

from __future__ import annotations

import signal


class StopFlag:
    def __init__(self):
        self.raised = False

    def install(self, signals=(signal.SIGUSR2,)) -> None:
        for s in signals:
            signal.signal(s, self._set)

    def _set(self, *_):
        self.raised = True


STOP = StopFlag()
