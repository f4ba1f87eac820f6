"""Ending a process group at once: both the login side (`hpcrl run`'s mpiexec) and each task's
supervisor stop what a launch started this way."""

from __future__ import annotations

import os
import signal


def kill_group(pgid: int) -> None:
    """SIGKILL a whole process group (a task and whatever it started); one already gone is fine."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
