"""Quoting for the sbatch script: a user's value as one shell word, literal, or with its plain
$VARIABLES expanded in the job's shell."""

from __future__ import annotations

import re
import shlex

# A value that only references plain variables ($USER, ${HOME}) is rendered in double quotes so they
# expand; anything else is single-quoted and stays literal, so `$(...)`, backticks and quotes from a
# user never run.
_EXPANDABLE = re.compile(r'^(?:[^$`"\\\n]|\$[A-Za-z_][A-Za-z0-9_]*|\$\{[A-Za-z_][A-Za-z0-9_]*\})*$')


def quote(value) -> str:
    """One literal word."""
    return shlex.quote(str(value))


def env_quote(value) -> str:
    """One word whose plain $VARIABLES expand, and nothing else."""
    value = str(value)
    if "$" in value and _EXPANDABLE.match(value):
        return f'"{value}"'
    return shlex.quote(value)
