"""No field accepted and ignored (issue 12): every field of every dataclass of the recipe
(hpcrl/job/recipe.py, its grpo section hpcrl/job/grpo_config.py, its agent section hpcrl/job/agent_config.py)
and the site profile (hpcrl/job/site.py) is read somewhere in hpcrl.

A field counts as read where hpcrl's code, outside its own class's validate(), loads it as an
attribute (`x.name`; a method call `x.name(...)` is something else), names it as a string to
getattr/hasattr, a subscript or .get(), or where the sbatch templates name it inside a `{{ }}` or
`{% %}` block (`site.x`, or `x` handed to the template). Names are matched, not types: a field that
shares its name with some other attribute looks read, so this finds fields read nowhere at all.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
from collections import defaultdict
from pathlib import Path

import hpcrl.job.agent_config
import hpcrl.job.grpo_config
import hpcrl.job.recipe
import hpcrl.job.site
from conftest import REPO as ROOT

MODULES = (hpcrl.job.recipe, hpcrl.job.grpo_config, hpcrl.job.agent_config, hpcrl.job.site)

# Fields read only indirectly, each with where. Keep it short: a field read by its name belongs
# nowhere here.
INDIRECT: dict[str, str] = {}
# Fields that hpcrl accepts and does not act on yet, each with why. Every entry is a known gap
# (issue 12): wiring a field means taking it off this list, which the last test below insists on.
NOT_WIRED: dict[str, str] = {
    "Qos.max_running_jobs": "a site fact (Frontier's debug QOS: one running job); `hpcrl submit` does not "
                            "look at the user's running jobs, Slurm holds the second job itself",
    "Site.fake_gpus": "a site fact (the testbed's and local's GPUs are /dev/null); device = \"cpu\" is "
                      "what makes those sites compute on the CPU",
}


def _dataclasses() -> list[type]:
    return [obj for module in MODULES for obj in vars(module).values()
            if dataclasses.is_dataclass(obj) and isinstance(obj, type) and obj.__module__ == module.__name__]


def _string(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


@functools.cache        # the repository's files, read once for the file's tests
def _reads() -> dict[str, list[tuple[str, int]]]:
    """Field-like name -> where hpcrl reads it (file relative to the repository, line)."""
    reads: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for path in sorted((ROOT / "hpcrl").rglob("*.py")):
        where = str(path.relative_to(ROOT))
        tree = ast.parse(path.read_text(), filename=where)
        called = {id(node.func) for node in ast.walk(tree) if isinstance(node, ast.Call)}
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load) and id(node) not in called:
                name = node.attr
            elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
                name = _string(node.slice)
            elif isinstance(node, ast.Call) and node.args:
                func = node.func
                func_name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
                if func_name in ("getattr", "hasattr") and len(node.args) > 1:
                    name = _string(node.args[1])
                elif func_name in ("get", "pop") and isinstance(func, ast.Attribute):
                    name = _string(node.args[0])
            if name:
                reads[name].append((where, node.lineno))
    for path in sorted((ROOT / "templates").rglob("*.j2")):
        text = path.read_text()
        for block in re.findall(r"\{\{.*?\}\}|\{%.*?%\}", text, re.S):
            line = text[:text.index(block)].count("\n") + 1
            for name in re.findall(r"[A-Za-z_]\w*", block):
                reads[name].append((str(path.relative_to(ROOT)), line))
    return reads


@functools.cache
def _validate_lines() -> dict[str, tuple[str, range]]:
    """Class name -> (its file, the lines of its validate())."""
    out = {}
    for module in MODULES:
        path = Path(module.__file__)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == "validate":
                        out[node.name] = (str(path.relative_to(ROOT)), range(item.lineno, item.end_lineno + 1))
    return out


def _unread() -> list[str]:
    reads, validates = _reads(), _validate_lines()
    unread = []
    for cls in _dataclasses():
        own = validates.get(cls.__name__)
        for f in dataclasses.fields(cls):
            outside = [(file, line) for file, line in reads.get(f.name, ())
                       if own is None or file != own[0] or line not in own[1]]
            if not outside:
                unread.append(f"{cls.__name__}.{f.name}")
    return unread


def test_every_recipe_and_site_field_is_read():
    unread = [name for name in _unread() if name not in INDIRECT and name not in NOT_WIRED]
    assert not unread, (f"fields no code reads (a user setting them changes nothing): {', '.join(unread)}; "
                        f"wire them, or list an indirect use in INDIRECT with where it is")


def test_the_indirect_list_holds_only_fields_not_read_by_name():
    names = {f"{cls.__name__}.{f.name}" for cls in _dataclasses() for f in dataclasses.fields(cls)}
    assert set(INDIRECT) <= names, set(INDIRECT) - names
    assert set(INDIRECT) <= set(_unread()), set(INDIRECT) - set(_unread())


def test_the_gaps_listed_are_still_gaps():
    names = {f"{cls.__name__}.{f.name}" for cls in _dataclasses() for f in dataclasses.fields(cls)}
    assert set(NOT_WIRED) <= names, set(NOT_WIRED) - names
    wired = set(NOT_WIRED) - set(_unread())
    assert not wired, f"read now: take them off NOT_WIRED: {wired}"


def test_the_search_sees_a_field_read_nowhere(monkeypatch):
    """The check itself: a field added and never read is reported; one read only in its own
    validate() is too."""
    @dataclasses.dataclass(frozen=True)
    class Probe:
        an_unread_field_of_the_probe: int = 0

    Probe.__module__ = hpcrl.job.recipe.__name__
    monkeypatch.setattr(hpcrl.job.recipe, "Probe", Probe, raising=False)
    assert "Probe.an_unread_field_of_the_probe" in _unread()
    assert "GRPOConfig.epsilon_high" not in _unread()
