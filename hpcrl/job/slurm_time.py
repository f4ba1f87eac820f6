"""Slurm's time formats: a --time limit string <-> seconds, and one way to print a duration."""

from __future__ import annotations

import re

from hpcrl.job.errors import UserError

# Slurm's --time forms: (pattern, seconds per field). Every field after the first is bounded
# (minutes and seconds < 60, hours after days < 24).
_TIME_FORMS = [
    (re.compile(r"^(\d+)$"), (60,)),
    (re.compile(r"^(\d+):(\d{1,2})$"), (60, 1)),
    (re.compile(r"^(\d+):(\d{1,2}):(\d{1,2})$"), (3600, 60, 1)),
    (re.compile(r"^(\d+)-(\d{1,2})$"), (86400, 3600)),
    (re.compile(r"^(\d+)-(\d{1,2}):(\d{1,2})$"), (86400, 3600, 60)),
    (re.compile(r"^(\d+)-(\d{1,2}):(\d{1,2}):(\d{1,2})$"), (86400, 3600, 60, 1)),
]
_FIELD_BOUND = {3600: 24, 60: 60, 1: 60}
TIME_FORMS_HELP = "MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"


def parse_walltime(text: str, where: str = "time") -> int:
    """A Slurm time limit string -> seconds (strict: the forms sbatch --time accepts)."""
    text = str(text).strip()
    for pattern, units in _TIME_FORMS:
        m = pattern.match(text)
        if not m:
            continue
        values = [int(g) for g in m.groups()]
        for value, unit in zip(values[1:], units[1:]):
            if value >= _FIELD_BOUND[unit]:
                raise UserError(f"{where}: {text!r} has a field out of range ({TIME_FORMS_HELP})")
        seconds = sum(v * u for v, u in zip(values, units))
        if seconds <= 0:
            raise UserError(f"{where}: must be longer than zero, got {text!r}")
        return seconds
    raise UserError(f"{where}: {text!r} is not a Slurm time; use {TIME_FORMS_HELP}")


def format_walltime(seconds: float) -> str:
    """Seconds -> HH:MM:SS, or D-HH:MM:SS from a day on: how Slurm writes a duration, and the one
    shape every duration hpcrl prints takes (--time, `hpcrl status`, `hpcrl run`'s summary)."""
    days, rest = divmod(round(seconds), 86400)
    hms = f"{rest // 3600:02d}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{hms}" if days else hms


