"""The recipe's own modules that its named modules import: a tools module beside the recipe may
import a helper beside it (`from calculator_tools import calculator`), and the job, which runs in
the run directory, finds only what was copied there. Read with ast, never imported (a reward module
may import torch, which the login side never does)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Callable

__all__ = ["with_imported"]


def with_imported(found: dict[str, None], find: Callable[[str], str | None]) -> dict[str, None]:
    """``found`` (files and package directories of the recipe's own modules, in order) and every own
    module they import, transitively; ``find`` gives a top-level name's own file or package
    directory, or None where the name is not the recipe's (installed, the standard library)."""
    out = dict(found)
    todo = list(found)
    while todo:
        for top in sorted(_imported_names(Path(todo.pop()))):
            where = find(top)
            if where is not None and where not in out:
                out[where] = None
                todo.append(where)
    return out


def _imported_names(path: Path) -> set[str]:
    """The top-level names a module file (or every file of a package directory) imports absolutely."""
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
    names: set[str] = set()
    for file in files:
        try:
            tree = ast.parse(file.read_text(encoding="utf-8", errors="replace"), str(file))
        except (OSError, SyntaxError, ValueError):
            continue        # the trainer names a module it cannot import, with its own error
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names
