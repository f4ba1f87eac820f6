"""Which of the job's lines reach the console while `hpcrl run` runs (all reach run.log), and,
after everything else, the one line that says why a run failed."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from hpcrl.job import rundir
from hpcrl.job.rundir import LOCAL_LOG_FILE
from hpcrl.login.local.exit_codes import INTERRUPTED


class ConsoleFilter:
    """Which of the job's lines reach the console: all but tracebacks (Python's, and those vLLM's
    engine processes log, each line under a prefix like "(EngineCore pid=12) ERROR 11-27 09:12:08
    [core.py:1510] ") and MPICH's "BAD TERMINATION" banner, which run.log keeps. A failed run's
    cause is printed last instead, in the one line the job wrote to failure.txt
    (:func:`print_failure`). One per run; its state is per stream and per prefix (the ranks'
    tracebacks come on stderr, hydra's banner and vLLM's log on stdout, and one process's lines
    may come between another's)."""

    BANNER = re.compile(r"^(={20,}\s*$|=   |YOUR APPLICATION TERMINATED WITH THE EXIT STRING|"
                        r"This typically refers to a problem with your application|"
                        r"Please see the FAQ page for debugging suggestions)")
    CHAINED = ("The above exception was the direct cause", "During handling of the above exception")
    # vLLM's process tag and log header; every line of a multi-line record repeats both.
    PREFIX = re.compile(r"^(\([\w.\-]+ pid=\d+\) )?((DEBUG|INFO|WARNING|ERROR|CRITICAL) "
                        r"\d\d-\d\d \d\d:\d\d:\d\d(\.\d+)? \[[^\]]*\] )?")
    # multiprocessing's line before a child process's traceback
    PROCESS_HEADER = re.compile(r"^Process [\w.\-]+:\s*$")

    def __init__(self) -> None:
        self.tracebacks = 0
        self._state: dict[tuple[str, str], str] = {}     # (stream, prefix) -> "", "traceback", "after" or "banner"

    def show(self, line: str, stream: str = "stderr") -> bool:
        text = line.rstrip("\r\n")
        prefix = self.PREFIX.match(text).group(0)
        body, key = text[len(prefix):], (stream, prefix)
        state = self._state.get(key, "")
        if not prefix and self.BANNER.match(text):
            self._state[key] = "banner"
            return False
        if body.startswith("Traceback (most recent call last):"):
            if state not in ("traceback", "after"):
                self.tracebacks += 1
            self._state[key] = "traceback"
            return False
        if not prefix and self.PROCESS_HEADER.match(text):
            return False
        if state == "traceback":
            if not body.strip() or body[:1].isspace():
                return False
            if not prefix and text.startswith(("hpcrl: ", "[hpcrl ")):     # another rank's line, mid-traceback
                return True
            self._state[key] = "after"                          # the exception's own line ends it
            return False
        # after it: the rest of a multi-line message (indented, as pydantic's), the chaining lines
        if state == "after" and (not body.strip() or body[:1].isspace() or body.startswith(self.CHAINED)):
            return False
        if state == "banner" and (not body.strip() or body.startswith(self.CHAINED)):
            return False
        self._state[key] = ""
        return True


def print_failure(run_dir: Path, code: int, console: ConsoleFilter, file=None) -> None:
    """After everything else: where the whole output is, then why the run failed, in one line."""
    file = file or sys.stderr
    log = run_dir / LOCAL_LOG_FILE
    if code == INTERRUPTED:
        # The user's Ctrl-C (or a SIGTERM): the ranks' KeyboardInterrupt is its echo, not an error.
        print(f"hpcrl: interrupted; the job's whole output is in {log}", file=file, flush=True)
        return
    reason = rundir.read_failure(run_dir) if code != 0 else None
    if reason:
        print(f"hpcrl: the job's whole output, tracebacks included, is in {log}", file=file)
        print(f"hpcrl: error: {reason}", file=file, flush=True)
    elif console.tracebacks:
        print(f"hpcrl: {console.tracebacks} traceback(s) from the job are in {log} only", file=file, flush=True)
