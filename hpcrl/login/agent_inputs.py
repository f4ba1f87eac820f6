"""The recipe's agent section checked on the login node: tools, environments, a rollout function, the
model's chat template and the rows' environment names. Each mistake is one UserError naming the field.

The user's modules are read with `ast`, never imported (a tool module may import torch, which the
login side never does, or do anything at import). A tool passes where transformers' get_json_schema,
which TRL calls on it, would make its schema: a docstring, a type hint on every argument that
transformers can describe (basic types, list, tuple, dict, Union/Optional, Literal; any class is an
"object"), and a Google-style "Args:" section describing each hinted argument, parsed with
transformers' own expressions. An environment class passes where TRL's GRPOTrainer would take it: a
reset method, and its public methods (TRL offers each to the model) passing as tools. What cannot be
seen here (a name imported from elsewhere, a base class of another module, a decorated function, a
module this machine cannot read) is left to the job. A rollout function passes where TRL could call it
as it does, rollout_func(prompts, trainer), and take the dict it returns: a plain function (not a
class, not async) that takes two positional arguments.

hpcrl.login.compose calls `import_paths` and `check_sources` where it checks reward modules;
hpcrl.login.inputs calls `check_chat_template` and `environment_columns` with the model and data.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from hpcrl.job.agent_config import ENVIRONMENT_COLUMN, AgentConfig, split_import_path
from hpcrl.job.demo import AGENT, demo_name, demo_renders_tools, is_demo, parse_demo_model
from hpcrl.job.errors import UserError
from hpcrl.job.recipe import DataConfig, Recipe
from hpcrl.login.data_rows import NamesColumn

TOOL_RULE = ("a type hint on every argument and a docstring whose Google-style Args: section describes each "
             "(transformers' get_json_schema makes the tool's schema from them)")
TOOL_CHAT_TEMPLATE = "use a model whose chat template supports tool calling, e.g. Qwen2.5/Qwen3 instruct"

# transformers.utils.chat_template_utils' args_re and args_split_re (transformers 5), as they are: a
# test holds this module's verdicts equal to get_json_schema's.
ARGS_RE = re.compile(r"\n\s*Args:\n\s*(.*?)[\n\s]*(Returns:|Raises:|\Z)", re.DOTALL)
ARGS_SPLIT_RE = re.compile(r"""
(?:^|\n)  # Match the start of the args block, or a newline
\s*(\w+):\s*  # Capture the argument name and strip spacing
(.*?)\s*  # Capture the argument description, which can span multiple lines, and strip trailing spacing
(?=\n\s*\w+:|\Z)  # Stop when you hit the next argument or the end of the block
""", re.DOTALL | re.VERBOSE)
CHOICES_RE = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)

# Type hints by the name they are subscripted under (typing's and the builtins').
_LISTS, _TUPLES, _DICTS = {"list", "List"}, {"tuple", "Tuple"}, {"dict", "Dict"}
_UNIONS, _LITERALS, _ANNOTATED = {"Union", "Optional"}, {"Literal"}, {"Annotated"}
# A method under one of these is no function on its class: inspect.getmembers(isfunction), which TRL
# lists an environment's tools with, skips it.
_NOT_FUNCTIONS = {"property", "cached_property", "classmethod", "setter", "getter", "deleter", "abstractproperty"}
# Decorators that leave a function a function, with its signature and docstring.
_PLAIN = {"staticmethod", "abstractmethod"}
# Base classes that add no methods TRL would see.
_NO_METHODS = {"object", "ABC", "Generic", "Protocol"}


ROLLOUT_FUNC = "agent.rollout_func"


def import_paths(agent: AgentConfig) -> list[tuple[str, str]]:
    """(field, import path) of every tool, environment factory and the rollout function, in the recipe's order."""
    out = [(f"agent.tools[{i}]", path) for i, path in enumerate(agent.tools)]
    if isinstance(agent.environment_factory, dict):
        out += [(f"agent.environment_factory.{name}", path) for name, path in agent.environment_factory.items()]
    elif agent.environment_factory:
        out.append(("agent.environment_factory", agent.environment_factory))
    if agent.rollout_func:
        out.append((ROLLOUT_FUNC, agent.rollout_func))
    return out


def check_sources(recipe: Recipe, own: dict[str, str], installed: bool) -> None:
    """Each tool, environment factory and the rollout function, read from its module's source: `own`
    maps a top-level module found beside the recipe to its file or package directory
    (hpcrl.login.compose); other modules are looked up where the tasks' interpreter finds them when
    it is this one (`installed`)."""
    agent = recipe.agent
    rewarded: list[bool | None] = []        # per factory: whether its environment has get_reward
    factories = []
    for where, path in import_paths(agent):
        found, tree = _definition(where, path, own, installed)
        if where == ROLLOUT_FUNC:
            problem = rollout_func_problem(found) if found is not None else None
            if problem:
                raise UserError(f"{where}: {path}: {problem}; TRL calls rollout_func(prompts, trainer) and takes "
                                f"the dict it returns")
            continue
        if where.startswith("agent.tools"):
            if isinstance(found, (ast.FunctionDef, ast.AsyncFunctionDef)):
                problem = function_problem(found)
                if problem:
                    raise UserError(f"{where}: {path}: {problem}; a tool needs {TOOL_RULE}")
            continue
        factories.append(path)
        # A function that returns the instance, or a name from elsewhere: only the job can tell.
        rewarded.append(_check_environment(where, path, found, tree) if isinstance(found, ast.ClassDef) else None)
    if factories and not recipe.rewards and all(r is False for r in rewarded):
        raise UserError(f"rewards: none given, and no environment of agent.environment_factory "
                        f"({', '.join(factories)}) defines get_reward; name reward functions (TRL's reward_funcs), "
                        f"or give the environment a get_reward method (TRL: \"No reward source provided\")")


def tool_problem(file: str | Path, name: str) -> str | None:
    """What keeps function `name` of the module at `file` from being a tool (None: nothing seen)."""
    tree = ast.parse(Path(file).read_text(encoding="utf-8"))
    found = _binding(tree, name)
    if found is None:
        return f"{Path(file).name} defines no {name!r}"
    return function_problem(found) if isinstance(found, (ast.FunctionDef, ast.AsyncFunctionDef)) else None


def rollout_func_problem(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> str | None:
    """Why TRL's call rollout_func(prompts, trainer) would not get a dict from this definition; None
    where it would, or where a decorator may have changed the signature."""
    if isinstance(node, ast.ClassDef):
        return "it is a class, not a function"
    if isinstance(node, ast.AsyncFunctionDef):
        return "it is async (TRL does not await it)"
    if any(_last_name(d) not in _PLAIN for d in node.decorator_list):
        return None
    a = node.args
    positional = len(a.posonlyargs) + len(a.args)
    required = positional - len(a.defaults)
    if required > 2:
        return f"it takes {required} positional arguments without defaults, not two"
    if positional < 2 and a.vararg is None:
        return f"it takes {positional} positional argument{'' if positional == 1 else 's'}, not two"
    bare = [k.arg for k, default in zip(a.kwonlyargs, a.kw_defaults) if default is None]
    if bare:
        return f"its keyword-only argument {bare[0]!r} has no default"
    return None


# ---------------------------------------------------------------------------- finding a definition
# What _binding gives for a name a star import or a module __getattr__ may bind: something, unseen.
_ELSEWHERE = ast.Pass()


def _definition(where: str, path: str, own: dict[str, str], installed: bool) -> tuple[ast.AST | None, ast.Module]:
    """The def or class that binds `path`'s name in its module's source, with the module's tree;
    None where the source is not this machine's to read or the name comes from elsewhere (an import,
    an assignment)."""
    module, attr = split_import_path(path)
    file = _module_file(where, module, own, installed)
    if file is None:
        return None, ast.Module([], [])
    try:
        tree = ast.parse(file.read_text(encoding="utf-8"), filename=str(file))
    except (OSError, UnicodeDecodeError):
        return None, ast.Module([], [])
    except SyntaxError as e:
        if not installed:
            return None, ast.Module([], [])     # the tasks' interpreter may take syntax this one does not
        raise UserError(f"{where}: {path}: {file} is not valid Python (line {e.lineno}: {e.msg})") from None
    found = _binding(tree, attr)
    if found is None:
        raise UserError(f"{where}: {path}: module {module} ({file}) defines no {attr!r} (no function, class or "
                        f"import of that name at its top level)")
    return (found if isinstance(found, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else None), tree


def _module_file(where: str, module: str, own: dict[str, str], installed: bool) -> Path | None:
    """The .py file of `module` as the tasks import it, found without running any of it; None where
    this machine cannot tell (another interpreter's packages, a compiled module, an import hook)."""
    import importlib.machinery

    top, *parts = module.split(".")
    if top in own:
        origin = Path(own[top])
        file, locations = (origin / "__init__.py", [str(origin)]) if origin.is_dir() else (origin, None)
    elif installed:
        search = [p for p in sys.path if p not in ("", str(Path.cwd()))]   # the tasks run in the run directory
        spec = importlib.machinery.PathFinder.find_spec(top, search)
        if spec is None:
            return None
        file = Path(spec.origin) if spec.origin not in (None, "namespace") else None
        locations = list(spec.submodule_search_locations or []) or None
    else:
        return None
    for i, part in enumerate(parts):
        spec = importlib.machinery.PathFinder.find_spec(part, locations) if locations else None
        if spec is None:
            if top in own:
                raise UserError(f"{where}: no module named {'.'.join([top, *parts[:i + 1]])!r} (in {own[top]})")
            return None
        file = Path(spec.origin) if spec.origin not in (None, "namespace") else None
        locations = list(spec.submodule_search_locations or []) or None
    return file if file is not None and file.suffix == ".py" else None


def _binding(tree: ast.Module, name: str) -> ast.AST | None:
    """The last top-level statement that binds `name` (in `if`/`try`/`with` blocks too)."""
    found, hook = None, False
    for node in _top_level(tree.body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == name:
                found = node
            hook = hook or node.name == "__getattr__"
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if (alias.asname or alias.name.split(".")[0]) == name:
                    found = node
                hook = hook or alias.name == "*"
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(n, ast.Name) and n.id == name for t in targets for n in ast.walk(t)):
                found = node
    return found if found is not None or not hook else _ELSEWHERE


def _top_level(body: list[ast.stmt]):
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", []),
                          *[h.body for h in getattr(node, "handlers", [])]):
                yield from _top_level(block)


# ---------------------------------------------------------------------------- environments
@dataclass
class _Methods:
    functions: dict[str, ast.FunctionDef | ast.AsyncFunctionDef]     # name -> its def, as the class sees it
    maybe: set[str]             # names bound otherwise (assigned, decorated): functions or not
    complete: bool              # every base class was read too


def _methods(cls: ast.ClassDef, tree: ast.Module, seen: frozenset = frozenset()) -> _Methods:
    out = _Methods({}, set(), True)
    for base in cls.bases:
        base_name = _last_name(base)
        local = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == base_name), None)
        if local is not None and local.name not in seen and isinstance(base, ast.Name):
            inherited = _methods(local, tree, seen | {cls.name})
            out.functions.update(inherited.functions)
            out.maybe |= inherited.maybe
            out.complete &= inherited.complete
        elif base_name not in _NO_METHODS:
            out.complete = False
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            decorators = {_last_name(d) for d in node.decorator_list}
            out.functions.pop(node.name, None)
            out.maybe.discard(node.name)
            if decorators & _NOT_FUNCTIONS:
                continue
            if decorators - _PLAIN:
                out.maybe.add(node.name)
            else:
                out.functions[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out.maybe.update(t.id for t in targets if isinstance(t, ast.Name))
    return out


def _check_environment(where: str, path: str, cls: ast.ClassDef, tree: ast.Module) -> bool | None:
    """An environment class as TRL takes it; whether it defines get_reward (None: cannot tell)."""
    methods = _methods(cls, tree)
    if "reset" not in methods.functions and "reset" not in methods.maybe and methods.complete:
        raise UserError(f"{where}: {path} defines no reset method, which TRL requires of an environment (called "
                        f"before each rollout; it may return text to add to the prompt)")
    for name, node in methods.functions.items():
        if name.startswith("_") or name in ("reset", "get_reward"):
            continue
        static = any(_last_name(d) == "staticmethod" for d in node.decorator_list)
        problem = function_problem(node, method=not static)
        if problem:
            raise UserError(f"{where}: {path}.{name}: {problem}; TRL offers each public method of an environment "
                            f"to the model as a tool, which needs {TOOL_RULE} (a name starting with _ keeps a "
                            f"method from the model)")
    if "get_reward" in methods.functions:
        return True
    return None if "get_reward" in methods.maybe or not methods.complete else False


# ---------------------------------------------------------------------------- a tool's schema
def function_problem(node: ast.FunctionDef | ast.AsyncFunctionDef, method: bool = False) -> str | None:
    """Why transformers' get_json_schema would refuse this function (a bound method's, with `method`);
    None where it makes a schema. Decorated functions are not judged: the decorator may change both."""
    if any(_last_name(d) not in _PLAIN for d in node.decorator_list):
        return None
    doc = ast.get_docstring(node)
    if not doc or not doc.strip():
        return "it has no docstring"
    a = node.args
    params = [*a.posonlyargs, *a.args, *([a.vararg] if a.vararg else []), *a.kwonlyargs,
              *([a.kwarg] if a.kwarg else [])]
    # A bound method's signature has no self; an unhinted first self or cls is taken for a receiver too.
    visible = params[1:] if method and (a.posonlyargs or a.args) else params
    receiver = visible[0].arg if visible and visible[0].arg in ("self", "cls") and visible[0].annotation is None \
        else None
    for p in visible:
        if p.arg != receiver and p.annotation is None:
            return f"argument {p.arg!r} has no type hint"
    hinted = [p for p in params if p.annotation is not None and p.arg != receiver]
    for p in hinted:
        problem = _hint_problem(p.annotation)
        if problem:
            return f"argument {p.arg!r}: {problem}"
    if node.returns is not None:
        problem = _hint_problem(node.returns)
        if problem:
            return f"its return type: {problem}"
    described = _described(doc.strip())
    for p in hinted:
        if p.arg not in described:
            return f"its docstring has no Args: entry for {p.arg!r}"
        choices = CHOICES_RE.search(described[p.arg])
        if choices:
            try:
                listed = json.loads(choices.group(1))
            except ValueError:
                listed = None
            if not isinstance(listed, list):
                return f"the (choices: ...) of {p.arg!r} is not a JSON list"
    return None


def _described(doc: str) -> dict[str, str]:
    """Argument name -> description, as transformers' parse_google_format_docstring reads them."""
    match = ARGS_RE.search(doc)
    if not match:
        return {}
    block = "\n".join(line for line in match.group(1).strip().split("\n") if line.strip())
    return {name: re.sub(r"\s*\n+\s*", " ", text.strip()) for name, text in ARGS_SPLIT_RE.findall(block)}


def _last_name(node: ast.AST) -> str:
    """`x`, `a.b.x` and `x(...)`, `a.x[...]` -> "x"."""
    while isinstance(node, (ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _hint_problem(node: ast.AST) -> str | None:
    """Why transformers cannot turn this type hint into a JSON schema (its _parse_type_hint); None if it can."""
    shown = ast.unparse(node)
    if isinstance(node, ast.Constant):
        if isinstance(node.value, str):
            try:
                return _hint_problem(ast.parse(node.value, mode="eval").body)
            except SyntaxError:
                return f"{node.value!r} is not a type"
        return None if node.value is None else f"{shown} is not a type"
    if isinstance(node, (ast.Name, ast.Attribute)):
        return None             # a class of its own is described as an "object"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _hint_problem(node.left) or _hint_problem(node.right)
    if not isinstance(node, ast.Subscript):
        return f"{shown} is not a type hint"
    base = _last_name(node.value)
    args = list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
    if base in _ANNOTATED or base in _LISTS:
        return _hint_problem(args[0]) if args else None
    if base in _DICTS:
        return _hint_problem(args[1]) if len(args) == 2 else None
    if base in _UNIONS:
        return next(filter(None, map(_hint_problem, args)), None)
    if base in _TUPLES:
        if len(args) == 1:
            return f"{shown} has a single element; transformers wants list[...] or the element itself"
        if any(isinstance(x, ast.Constant) and x.value is Ellipsis for x in args):
            return f"{shown}: transformers takes no '...' in a tuple; use list[...]"
        return next(filter(None, map(_hint_problem, args)), None)
    if base in _LITERALS:
        plain = all(isinstance(x, ast.Constant) and (x.value is None or isinstance(x.value, (str, int, float)))
                    or isinstance(x, ast.UnaryOp) and isinstance(x.op, ast.USub) and isinstance(x.operand, ast.Constant)
                    for x in args)
        return None if plain else f"{shown}: Literal may list only strings, numbers, booleans and None"
    return (f"{shown} is not a type transformers can describe (basic types, list, tuple, dict, Union/Optional, "
            f"Literal, or a class)")


# ---------------------------------------------------------------------------- model and data
def check_chat_template(recipe: Recipe, model_dir: Callable[[str, str], Path | None]) -> None:
    """An agent's model must render tools: its chat template (the tokenizer's, where model.tokenizer
    names one) mentions them. `model_dir(name, field)`: the directory a name means, None where this
    machine cannot look (hpcrl.login.inputs)."""
    if not recipe.agent.enabled:
        return
    model = recipe.model
    field, name = ("model.tokenizer", model.tokenizer) if model.tokenizer else ("model.path", model.path)
    if is_demo(name):
        if not demo_renders_tools(name):
            agent_demo = demo_name(parse_demo_model(name)[0], AGENT)
            raise UserError(f"{field}: {name}: the demo model's chat template has no tools, so it cannot take "
                            f"agent.tools or agent.environment_factory; use {agent_demo} (the agent demo's "
                            f"model, examples/agent.yaml), or a model whose chat template supports tool calling")
        return
    directory = model_dir(name, field)
    templates = None if directory is None else chat_templates(directory)
    if templates is None:
        return
    if not templates:
        raise UserError(f"{field}: {name} has no chat template (tokenizer_config.json's chat_template, "
                        f"chat_template.jinja), so it cannot render the tools of agent.tools or "
                        f"agent.environment_factory; {TOOL_CHAT_TEMPLATE}")
    if not any("tools" in t for t in templates):
        raise UserError(f"{field}: {name}'s chat template cannot render tools (it never uses `tools`), which "
                        f"agent.tools and agent.environment_factory need; {TOOL_CHAT_TEMPLATE}")


def chat_templates(directory: Path) -> list[str] | None:
    """Every chat template a tokenizer directory holds, as transformers finds them
    (chat_template.jinja, additional_chat_templates/*.jinja, tokenizer_config.json's chat_template:
    a string, or a list of {name, template}); None where tokenizer_config.json cannot be read here."""
    out = [p.read_text(encoding="utf-8", errors="replace") for p in
           [directory / "chat_template.jinja", *sorted((directory / "additional_chat_templates").glob("*.jinja"))]
           if p.is_file()]
    config = directory / "tokenizer_config.json"
    if config.is_file():
        try:
            data = json.loads(config.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            return None if not out else out
        value = data.get("chat_template") if isinstance(data, dict) else None
        if isinstance(value, str):
            out.append(value)
        elif isinstance(value, list):
            out += [t["template"] for t in value if isinstance(t, dict) and isinstance(t.get("template"), str)]
    return out


def environment_columns(recipe: Recipe) -> tuple[NamesColumn, ...]:
    """With a mapping of environment factories, the rows' `environment` column must name one of them
    (hpcrl.login.data_rows checks the rows); a mixture source must keep that column."""
    factories = recipe.agent.environment_factory
    if not isinstance(factories, dict):
        return ()
    data, owner = recipe.data, "agent.environment_factory"
    if data.path == DataConfig.path and not data.data_files and not data.datasets:
        raise UserError(f"{owner}: a mapping picks each row's environment by its `{ENVIRONMENT_COLUMN}` column, "
                        f"which the demo task's rows lack; give one import path, or data with that column")
    for i, source in enumerate(data.datasets):
        if source.columns is not None and ENVIRONMENT_COLUMN not in source.columns:
            raise UserError(f"data.datasets[{i}].columns: keeps no {ENVIRONMENT_COLUMN!r} column, by which {owner} "
                            f"(a mapping) picks each row's environment; add it")
    return (NamesColumn(ENVIRONMENT_COLUMN, tuple(factories), owner),)
