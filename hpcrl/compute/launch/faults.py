"""Fault injection for the launch's failure tests: HPCRL_FAULT="<fault>:<rank>[,<fault>:<rank>]".

  hang-before-rendezvous   the rank never reaches the rendezvous (a stuck import, a dead node)
  exit-before-rendezvous   the rank exits with status 3 before the rendezvous
  die-after-rendezvous     the rank is SIGKILLed right after the rendezvous (an OOM kill)
  exit-after-rendezvous    the rank exits with status 3 right after it, without a goodbye
  freeze-after-rendezvous  the rank is SIGSTOPped right after it (a node that stops answering)
  die-after-report         (mode control) the rank is SIGKILLed once every task's probe row is
                           written, while the others wait for it at the last barrier
  slow-steps[=S]           the (trainer) rank sleeps S seconds (STEP_DELAY_S) at the start of
                           every step, so that a run's work outlasts a short time limit whatever
                           the machine
  slow-first-attempt[=S]   slow-steps, in the job's first attempt only (SLURM_RESTART_COUNT unset
                           or 0): the work outlasts the first allocation, and a requeued attempt
                           is not slowed, so that the whole stays short on a loaded machine

Without the variable this module does nothing. It is the one compute-side knob outside the job
spec, on purpose: a test injects a different fault into each launch (srun step) of one run
directory, and no recipe a user writes should be able to carry a fault.
"""

from __future__ import annotations

import os
import signal
import time

FAULTS = ("hang-before-rendezvous", "exit-before-rendezvous", "die-after-rendezvous",
          "exit-after-rendezvous", "freeze-after-rendezvous", "die-after-report", "slow-steps",
          "slow-first-attempt")
STEP_DELAY_S = 0.5
_rank: int | None = None          # this task's, once the rendezvous has confirmed it


def _wanted(rank: int | None) -> dict[str, str]:
    """The faults meant for `rank`, each with its argument ("" where none was given)."""
    out = {}
    for item in os.environ.get("HPCRL_FAULT", "").split(","):
        spec, _, target = item.strip().partition(":")
        name, _, argument = spec.partition("=")
        if name in FAULTS and target.isdigit() and int(target) == rank:
            out[name] = argument
    return out


def inject(point: str, rank: int | None) -> None:
    """Called at "before-rendezvous", "after-rendezvous" and (mode control) "after-report"."""
    if "HPCRL_FAULT" not in os.environ:
        return
    wanted = _wanted(rank)
    if point == "before-rendezvous":
        if "exit-before-rendezvous" in wanted:
            os._exit(3)
        if "hang-before-rendezvous" in wanted:
            time.sleep(1e6)               # the supervisor's rendezvous bound ends it
    elif point == "after-rendezvous":
        global _rank
        _rank = rank
        if "die-after-rendezvous" in wanted:
            os.kill(os.getpid(), signal.SIGKILL)
        if "exit-after-rendezvous" in wanted:
            os._exit(3)
        if "freeze-after-rendezvous" in wanted:
            os.kill(os.getpid(), signal.SIGSTOP)
    elif point == "after-report" and "die-after-report" in wanted:
        os.kill(os.getpid(), signal.SIGKILL)


def at_step() -> None:
    """Called by the trainer at the start of every step."""
    if "HPCRL_FAULT" not in os.environ:
        return
    wanted = _wanted(_rank)
    if "slow-first-attempt" in wanted and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
        wanted["slow-steps"] = wanted["slow-first-attempt"]
    if "slow-steps" in wanted:
        time.sleep(float(wanted["slow-steps"] or STEP_DELAY_S))
