"""Why a job ended: the first fatal line of any task, kept in the run directory.

Every fatal message of the compute side goes through `fatal` (the watchdog's verdicts, the
supervisor's "killed by", a task's own error): it is printed, and the first one of the job is
also written to run_dir/failure.txt, so that `hpcrl status` can say in one line why a job failed
without searching a log where the ranks' lines interleave. The first writer wins (O_EXCL): later
lines are mostly echoes of the first (a collective broke because a peer died).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from hpcrl.job.rundir import FAILURE_FILE

_record: Path | None = None


def record_to(run_dir: str | os.PathLike) -> None:
    global _record
    _record = Path(run_dir) / FAILURE_FILE


def fatal(line: str, summary: str | None = None) -> None:
    """Print `line` to stderr at once (safe from any thread or a signal handler's process) and keep
    it, or `summary` where the line's subject is not the cause (a rank reporting a peer's death),
    as the job's reason if it is the first."""
    os.write(2, (line.rstrip("\n") + "\n").encode(errors="replace"))
    keep(summary or line)


def keep(reason: str) -> None:
    """Keep `reason` as the job's reason if it is the first, without printing it."""
    if _record is None:
        return
    try:
        fd = os.open(_record, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError:
        return
    try:
        os.write(fd, f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {reason.strip()}\n".encode(errors="replace"))
    finally:
        os.close(fd)
