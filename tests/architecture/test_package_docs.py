"""Each package's __init__ docstring lists its modules and subpackages, one line each, and nothing
that is not there: a newcomer reads a folder's map in its __init__.py, so the map must stay true.

A listed entry is a docstring line that starts (after an optional "- " and backquotes) with
``name.py`` or ``name/``. Read with `ast`; nothing of hpcrl is imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from conftest import REPO

PACKAGE_DIR = REPO / "hpcrl"
ENTRY = re.compile(r"^\s*(?:- )?`{0,2}([A-Za-z_][\w]*(?:\.py|/))")


def _packages() -> list[Path]:
    return sorted(p.parent for p in PACKAGE_DIR.rglob("__init__.py") if "__pycache__" not in p.parts)


def _children(package: Path) -> set[str]:
    out = set()
    for child in package.iterdir():
        if child.name in ("__init__.py", "__main__.py", "__pycache__") or child.name.startswith("."):
            continue
        if child.is_file() and child.suffix == ".py":
            out.add(child.name)
        elif child.is_dir() and not child.is_symlink() and (child / "__init__.py").is_file():
            out.add(child.name + "/")
    return out


def _listed(package: Path) -> set[str]:
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text(encoding="utf-8"))) or ""
    return {m.group(1) for line in doc.splitlines() if (m := ENTRY.match(line))}


@pytest.mark.parametrize("package", _packages(), ids=lambda p: str(p.relative_to(PACKAGE_DIR.parent)))
def test_the_package_docstring_lists_exactly_its_modules(package):
    children, listed = _children(package), _listed(package)
    assert not children - listed, f"{package.relative_to(PACKAGE_DIR.parent)}/__init__.py does not list: " \
                                  f"{sorted(children - listed)}"
    assert not listed - children, f"{package.relative_to(PACKAGE_DIR.parent)}/__init__.py lists what is not there: " \
                                  f"{sorted(listed - children)}"
