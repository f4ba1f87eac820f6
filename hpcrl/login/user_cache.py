"""The user's cache directory for what the login side keeps between commands (the compiled sbatch
template, parsed site profiles): $XDG_CACHE_HOME/hpcrl/<name>, i.e. ~/.cache/hpcrl/<name>. Only
ever a shortcut: a command that cannot use it does the work instead."""

from __future__ import annotations

import os


def directory(name: str) -> str | None:
    """The cache directory `name`, made if missing; None where it cannot be written."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    path = os.path.join(base, "hpcrl", name)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return None
    return path if os.access(path, os.W_OK) else None
