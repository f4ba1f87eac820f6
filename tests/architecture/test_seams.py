"""The backends' seams and the size of things, read from the source with `ast` like test_layering.py
(nothing of hpcrl is imported, so the whole file runs in about a second).

- A backend's library is imported only by that backend's own modules: FSDP2 by the FSDP2 trainer
  engine's, DeepSpeed by the DeepSpeed engine's, vLLM by the vLLM inference engine's and the weight
  transports made for it.
- ZeRO-3's parameter attributes (``ds_tensor``, ``ds_shape``, ...) are read only by the DeepSpeed
  engine's modules: everything else reaches a partitioned parameter through
  hpcrl.compute.partitioned.
- In the job's own code (hpcrl.compute) no string is compared with an engine's name outside the
  registries: a backend's difference is a method or an attribute of the backend.
- No function takes more than 10 parameters, no module is over 600 lines, no private name is
  imported from another module. What breaks one of these today is listed in ``NOT_YET`` by name:
  the list may only shrink (an entry that no longer breaks its rule fails the test, so it is taken
  off when it is fixed).
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from test_layering import REPO, _in, scan

# The backends: their library, and the only modules that may import it or read its types.
BACKEND_MODULES = {
    "torch.distributed.fsdp": ("hpcrl.compute.train.fsdp",),
    "deepspeed": ("hpcrl.compute.train.deepspeed_engine", "hpcrl.compute.train.deepspeed_params"),
    "vllm": ("hpcrl.compute.inference.vllm_engine", "hpcrl.compute.sync.vllm_engines", "hpcrl.compute.sync.vllm_plugin",
             "hpcrl.compute.sync.shm_vllm", "hpcrl.compute.sync.receiver", "hpcrl.compute.sync.reload"),
}
ENGINE_NAMES = {"fsdp2", "deepspeed", "vllm", "transformers"}
# Where engines are named: the registries, and each engine's own `name`.
REGISTRIES = ("hpcrl.compute.train.engine", "hpcrl.compute.inference.engine")

MAX_PARAMETERS = 10
MAX_LINES = 600

# Known today, to be fixed (issue 28); each entry must still break its rule.
NOT_YET: dict[str, set[str]] = {
    "parameters": set(),
    "lines": set(),
    "private imports": set(),
}


@functools.cache        # parsed once for the file's tests (each parse of the package takes a second)
def _trees() -> dict[str, tuple[Path, ast.Module, str]]:
    out = {}
    for name, path in scan().modules.items():
        source = path.read_text(encoding="utf-8")
        out[name] = (path, ast.parse(source, filename=str(path)), source)
    return out


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(REPO)}:{node.lineno}"


def test_a_backends_library_is_imported_only_by_its_own_modules():
    bad = []
    for imp in scan().imports:
        for library, own in BACKEND_MODULES.items():
            if _in(imp.target, library) and imp.importer not in own:
                bad.append(f"{imp}  [only {', '.join(own)}]")
    assert not bad, "a backend's library imported outside its modules:\n  " + "\n  ".join(sorted(bad))


def _names_read(tree: ast.Module):
    """(node, attribute name) for every attribute read, getattr/hasattr/setattr with a literal name."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            yield node, node.attr
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            yield node, node.args[1].value


def test_zero3_parameter_attributes_are_read_only_by_the_deepspeed_engine():
    own = BACKEND_MODULES["deepspeed"]
    bad = [f"{_where(path, node)}: .{attr}" for name, (path, tree, _) in _trees().items()
           if _in(name, "hpcrl.compute") and name not in own
           for node, attr in _names_read(tree) if attr.startswith("ds_")]
    assert not bad, "ZeRO-3 attributes read outside the DeepSpeed engine (use hpcrl.compute.partitioned):\n  " \
        + "\n  ".join(sorted(bad))


def _constants(node: ast.AST) -> set[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
    return set()


def test_no_engine_name_is_compared_outside_the_registries():
    bad = []
    for name, (path, tree, source) in _trees().items():
        if not _in(name, "hpcrl.compute") or name in REGISTRIES:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Compare):
                named = set().union(*(_constants(n) for n in [node.left, *node.comparators])) & ENGINE_NAMES
                if named:
                    bad.append(f"{_where(path, node)}: {ast.get_source_segment(source, node)}")
    assert not bad, "engine names compared outside the registries (make it the engine's method):\n  " \
        + "\n  ".join(sorted(bad))


def _parameters(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    a = fn.args
    n = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)
    positional = a.posonlyargs + a.args
    return n - (1 if positional and positional[0].arg in ("self", "cls") else 0)


def _functions(tree: ast.Module):
    """(qualified name, node) of every function, methods as Class.method."""
    def walk(body, prefix):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{prefix}{node.name}", node
                yield from walk(node.body, f"{prefix}{node.name}.")
            elif isinstance(node, ast.ClassDef):
                yield from walk(node.body, f"{prefix}{node.name}.")
    yield from walk(tree.body, "")


@functools.cache
def _offenders() -> dict[str, dict[str, str]]:
    """rule -> {key: what}, the key naming the offender as NOT_YET does."""
    found: dict[str, dict[str, str]] = {"parameters": {}, "lines": {}, "private imports": {}}
    modules = scan().modules
    for name, (path, tree, source) in _trees().items():
        lines = source.count("\n")
        if lines > MAX_LINES:
            found["lines"][name] = f"{path.relative_to(REPO)}: {lines} lines"
        for qualname, fn in _functions(tree):
            if _parameters(fn) > MAX_PARAMETERS:
                found["parameters"][f"{name}.{qualname}"] = f"{_where(path, fn)}: {qualname} takes {_parameters(fn)}"
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and not node.level and _in(node.module or "", "hpcrl"):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__") \
                            and f"{node.module}.{alias.name}" not in modules:
                        found["private imports"][f"{name} <- {node.module}.{alias.name}"] = \
                            f"{_where(path, node)}: {alias.name} from {node.module}"
    return found


@pytest.mark.parametrize("rule", sorted(NOT_YET))
def test_sizes_and_private_names(rule):
    found = _offenders()[rule]
    new = {k: v for k, v in found.items() if k not in NOT_YET[rule]}
    fixed = NOT_YET[rule] - set(found)
    limit = {"parameters": f"more than {MAX_PARAMETERS} parameters", "lines": f"over {MAX_LINES} lines",
             "private imports": "a private name imported from another module"}[rule]
    assert not new, f"{limit}:\n  " + "\n  ".join(sorted(new.values()))
    assert not fixed, f"NOT_YET[{rule!r}] lists what no longer breaks the rule: take it off: {sorted(fixed)}"
