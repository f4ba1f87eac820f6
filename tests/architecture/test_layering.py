"""The wall between the three wings of the package, read from the source with `ast` (nothing of hpcrl is
imported, so a broken or heavy module cannot hide a violation, and the whole file runs in well under a second).

  hpcrl.job      the job description both sides read: the standard library and hpcrl.job only
                 (and `hpcrl` itself, for __version__)
  hpcrl.login    login-node code: never hpcrl.compute, torch, vllm or mpi4py
  hpcrl.compute  in-job code: never hpcrl.login
  no import cycles between hpcrl modules

Every import counts, wherever it is: module level, inside a function, under `if TYPE_CHECKING:`, and
`importlib.import_module` / `__import__` with a literal name (an f-string such as
f"hpcrl.login.commands.{name}" counts as importing each module directly inside that package).
`import hpcrl.a.b` and `from hpcrl.a import b` are a dependency on the module hpcrl.a.b where it
exists, else on the package hpcrl.a; a package's __init__.py is a module like any other.
"""

from __future__ import annotations

import ast
import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO

PACKAGE_DIR = REPO / "hpcrl"
HEAVY = ("torch", "vllm", "mpi4py")


@dataclass(frozen=True)
class Imp:
    importer: str       # the module holding the import statement
    path: Path
    line: int
    target: str         # what it imports, resolved: hpcrl.a.b if that module exists, else hpcrl.a
    text: str           # the statement as written, for messages

    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"

    def __str__(self) -> str:
        return f"{self.where()}: {self.importer} -> {self.target}    ({self.text})"


@dataclass
class Scan:
    modules: dict[str, Path]            # module name -> file
    imports: list[Imp]
    problems: list[str]                 # files that do not parse, relative imports that leave hpcrl


def _in(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _module_files() -> dict[str, Path]:
    modules = {}
    # os.walk does not follow the hpcrl/sites and hpcrl/templates symlinks (data, no code).
    for root, dirs, files in os.walk(PACKAGE_DIR):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            parts = list(Path(root, f).relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = Path(root, f)
    return modules


def _resolve(modules: dict[str, Path], name: str) -> str:
    """The longest prefix of dotted `name` that is an hpcrl module (name itself when outside hpcrl)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return name


def _dynamic_targets(call: ast.Call, modules: dict[str, Path]) -> list[str] | None:
    """Targets of importlib.import_module(...) / __import__(...) with a name known from the source."""
    func = call.func
    fname = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if fname not in ("import_module", "__import__") or not call.args:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return [arg.value]
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        head = str(arg.values[0].value)
        package = head[:-1] if head.endswith(".") else head.rpartition(".")[0]
        if not package:
            return None
        children = [m for m in modules if m.rpartition(".")[0] == package]
        return children or [package]
    return None


def _imports_of(name: str, path: Path, modules: dict[str, Path], problems: list[str]) -> list[Imp]:
    source = path.read_text(encoding="utf-8")
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError as e:
        problems.append(f"{path.relative_to(REPO)}:{e.lineno}: does not parse ({e.msg})")
        return []
    is_package = path.name == "__init__.py"
    found = []
    # The statement's first line, from the file's lines split once (ast.get_source_segment splits the
    # whole file again for every call: 6 of this file's 7 s, and 50 s on a loaded CI machine).
    source_lines = source.splitlines()

    def add(node: ast.AST, target: str) -> None:
        text = source_lines[node.lineno - 1][node.col_offset:].strip() + (" ..." if node.end_lineno > node.lineno else "")
        found.append(Imp(name, path, node.lineno, target, text))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(node, _resolve(modules, alias.name) if _in(alias.name, "hpcrl") else alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = name.split(".") if is_package else name.split(".")[:-1]
                if node.level - 1 >= len(package):
                    problems.append(f"{path.relative_to(REPO)}:{node.lineno}: relative import beyond hpcrl")
                    continue
                base = ".".join(package[:len(package) - (node.level - 1)] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(node, sub if sub in modules else _resolve(modules, base) if _in(base, "hpcrl") else base)
        elif isinstance(node, ast.Call):
            for target in _dynamic_targets(node, modules) or ():
                add(node, _resolve(modules, target) if _in(target, "hpcrl") else target)
    return found


@functools.cache
def scan() -> Scan:
    modules = _module_files()
    problems: list[str] = []
    imports = [imp for name, path in modules.items() for imp in _imports_of(name, path, modules, problems)]
    return Scan(modules, imports, problems)


def _report(rule: str, bad: list[Imp]) -> str:
    lines = sorted({str(i) for i in bad})
    return f"{rule}: {len(lines)} import(s) break it\n  " + "\n  ".join(lines)


def _cycles(s: Scan) -> list[list[str]]:
    """For every module that lies on a cycle, the shortest cycle through it (deduplicated)."""
    edges: dict[str, set[str]] = {m: set() for m in s.modules}
    for imp in s.imports:
        # A module naming itself (`from . import x` in a package's __init__, x not a submodule) is no cycle.
        if imp.target in s.modules and imp.target != imp.importer:
            edges[imp.importer].add(imp.target)
    cycles = {}
    for start in sorted(edges):
        parent: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in parent:
            nxt = []
            for m in frontier:
                for t in sorted(edges[m]):
                    if t not in parent:
                        parent[t] = m
                        nxt.append(t)
            frontier = nxt
        if start not in parent:
            continue
        chain = [start]
        while True:
            chain.append(parent[chain[-1]])
            if chain[-1] == start:
                break
        chain = chain[::-1][:-1]                       # start ... (forward order), start not repeated
        i = chain.index(min(chain))
        rotated = tuple(chain[i:] + chain[:i])
        cycles[rotated] = list(rotated) + [rotated[0]]
    return [cycles[k] for k in sorted(cycles)]


def test_every_module_parses():
    s = scan()
    assert len(s.modules) > 20 and "hpcrl.job" in s.modules and "hpcrl.login.cli" in s.modules, sorted(s.modules)
    assert not s.problems, "the layering tests cannot read these:\n  " + "\n  ".join(s.problems)


def test_no_import_cycles():
    s = scan()
    first: dict[tuple[str, str], Imp] = {}
    for imp in sorted(s.imports, key=lambda i: i.line):
        first.setdefault((imp.importer, imp.target), imp)
    found = _cycles(s)
    msg = []
    for chain in found:
        msg.append(" -> ".join(chain))
        msg += [f"    {first[a, b].where()}: {first[a, b].text}" for a, b in zip(chain, chain[1:])]
    if found:
        pytest.fail(f"import cycles between hpcrl modules ({len(found)}):\n  " + "\n  ".join(msg), pytrace=False)


def test_login_never_imports_compute():
    bad = [i for i in scan().imports if _in(i.importer, "hpcrl.login") and _in(i.target, "hpcrl.compute")]
    if bad:
        pytest.fail(_report("hpcrl.login must not import hpcrl.compute", bad), pytrace=False)


def test_compute_never_imports_login():
    bad = [i for i in scan().imports if _in(i.importer, "hpcrl.compute") and _in(i.target, "hpcrl.login")]
    if bad:
        pytest.fail(_report("hpcrl.compute must not import hpcrl.login", bad), pytrace=False)


def _stdlib(target: str) -> bool:
    return target.split(".")[0] in sys.stdlib_module_names


def test_job_imports_only_stdlib_and_job():
    bad = [i for i in scan().imports if _in(i.importer, "hpcrl.job")
           and not (_stdlib(i.target) or _in(i.target, "hpcrl.job") or i.target == "hpcrl")]
    if bad:
        pytest.fail(_report("hpcrl.job may import only the standard library, hpcrl.job and hpcrl.__version__",
                            bad), pytrace=False)


def test_top_package_imports_only_stdlib():
    # Importing any hpcrl module runs hpcrl/__init__.py first: whatever it imported would cross every wall.
    bad = [i for i in scan().imports if i.importer == "hpcrl" and not _stdlib(i.target)]
    if bad:
        pytest.fail(_report("hpcrl/__init__.py may import only the standard library", bad), pytrace=False)


def test_login_and_job_never_import_heavy_packages():
    bad = [i for i in scan().imports if (_in(i.importer, "hpcrl.login") or _in(i.importer, "hpcrl.job"))
           and any(_in(i.target, h) for h in HEAVY)]
    if bad:
        pytest.fail(_report(f"hpcrl.login and hpcrl.job must not import {', '.join(HEAVY)}", bad), pytrace=False)
