"""Typed config from plain dicts: dataclasses built from YAML/TOML/JSON, with field-named errors.

Written by hand instead of pydantic because `hpcrl --help` and `hpcrl status` must start in a
blink and this needs only a few dozen lines: nested dataclasses, Optional, list, dict, Literal.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from hpcrl.job.errors import UserError


def closest(name: str, choices) -> str:
    """' (did you mean "x"?)' or ''."""
    import difflib      # only for a mistake: not on the path of every command

    match = difflib.get_close_matches(name, list(choices), n=1, cutoff=0.6)
    return f' (did you mean "{match[0]}"?)' if match else ""


def _describe(tp) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp) if a is not type(None))
    if origin in (list, tuple):
        return "a list"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


def _convert(tp, value: Any, where: str):
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, where)
            except UserError as e:
                errors.append(e)
        raise UserError(f"{where}: expected {_describe(tp)}, got {value!r}")
    if origin is Literal:
        if value in get_args(tp):
            return value
        hint = closest(str(value), [str(a) for a in get_args(tp)])
        raise UserError(f"{where}: expected {_describe(tp)}, got {value!r}{hint}")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{where}: expected a list, got {value!r}")
        (item_tp, *_) = get_args(tp) or (Any,)
        return tuple(_convert(item_tp, v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if not isinstance(value, dict):
            raise UserError(f"{where}: expected a mapping, got {value!r}")
        key_tp, val_tp = get_args(tp) or (Any, Any)
        return {_convert(key_tp, k, f"{where}") if key_tp is not str else str(k): _convert(val_tp, v, f"{where}.{k}")
                for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return build(tp, value, where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise UserError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise UserError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise UserError(f"{where}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise UserError(f"{where}: expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise UserError(f"{where}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, bool):      # `key=false` reached us through YAML as a bool
            return "true" if value else "false"
        if isinstance(value, (int, float)):
            return str(value)
        raise UserError(f"{where}: expected a string, got {value!r}")
    raise TypeError(f"unsupported config type {tp!r} at {where}")


def _dataclass_of(tp):
    """The dataclass a field holds, directly, in Optional[...] or as list items; else None."""
    if dataclasses.is_dataclass(tp):
        return tp
    for arg in get_args(tp):
        if dataclasses.is_dataclass(arg):
            return arg
    return None


@functools.cache
def _hints(cls) -> dict:
    """`cls`'s resolved annotations, once per class: under `from __future__ import annotations` each
    is a string that typing compiles and evaluates, ~200 of them for a recipe."""
    return get_type_hints(cls)


def unknown_fields(cls, data: Any, where: str = "") -> list[str]:
    """Every key of `data`, at any depth, that `cls` has no field for, as one message each."""
    if not isinstance(data, dict):
        return []
    hints = _hints(cls)
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    prefix = f"{where}." if where else ""
    out = []
    for key, value in data.items():
        if key not in fields:
            out.append(f"{prefix}{key}: unknown field{closest(str(key), fields)}; allowed: {', '.join(sorted(fields))}")
            continue
        inner = _dataclass_of(hints[key])
        if inner is None:
            continue
        items = enumerate(value) if isinstance(value, (list, tuple)) else [(None, value)]
        for i, item in items:
            out += unknown_fields(inner, item, prefix + key + ("" if i is None else f"[{i}]"))
    return out


def problems_error(problems: list[str], what: str = "fields") -> UserError:
    """One UserError for several mistakes: one line for one, a counted list for more."""
    if len(problems) == 1:
        return UserError(problems[0])
    return UserError(f"{len(problems)} {what} are not accepted (nothing was written):\n"
                     + "\n".join(f"  {p}" for p in problems))


def build(cls, data: Any, where: str = ""):
    """Build dataclass `cls` from a mapping; unknown keys and bad values raise UserError naming the
    field. At the top level, every unknown key of the whole tree is named in one error."""
    if data is None:
        data = {}
    if isinstance(data, cls):
        return data
    if not isinstance(data, dict):
        raise UserError(f"{where or cls.__name__}: expected a mapping, got {data!r}")
    if not where:
        unknown = unknown_fields(cls, data)
        if unknown:
            raise problems_error(unknown)
    hints = _hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    prefix = f"{where}." if where else ""
    for key in data:
        if key not in fields:
            raise UserError(f"{prefix}{key}: unknown field{closest(str(key), fields)}; "
                            f"allowed: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, f in fields.items():
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], prefix + name)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise UserError(f"{prefix}{name}: required field is missing")
    obj = cls(**kwargs)
    check = getattr(obj, "validate", None)
    if check is not None:
        check(where)
    return obj


def to_dict(obj) -> Any:
    """Dataclasses (and tuples of them) back to plain JSON-able data."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def deep_merge(base: dict, override: dict, replace: tuple[str, ...] = (), _path: str = "") -> dict:
    """A copy of `base` with `override` merged in; mappings merge, everything else replaces.
    Mappings at the dotted paths in `replace` are replaced whole (a map that describes one
    machine, like a GPU -> cores table, makes no sense half from another machine)."""
    out = dict(base)
    for key, value in override.items():
        path = f"{_path}{key}"
        if isinstance(value, dict) and isinstance(out.get(key), dict) and path not in replace:
            out[key] = deep_merge(out[key], value, replace, path + ".")
        else:
            out[key] = value
    return out


def set_dotted(data: dict, dotted: str, value: Any) -> None:
    """data["a"]["b"] = value for "a.b", creating mappings on the way."""
    *parents, leaf = dotted.split(".")
    node = data
    for i, part in enumerate(parents):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise UserError(f"{'.'.join(parents[:i + 1])}: is not a mapping, cannot set {dotted}")
        node = child
    node[leaf] = value


