"""trainer.engine=deepspeed on the login node: the user's DeepSpeed settings read (a DeepSpeed JSON,
or a TRL-style accelerate config and the JSON it names) and checked against the recipe by building
the trainers' configuration now (hpcrl.job.deepspeed), so that a conflict is refused before the job
queues. compose calls these three; what it keeps is the settings as read (JobSpec.deepspeed_user)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpcrl.job.errors import UserError
from hpcrl.job.placement import Plan
from hpcrl.job.recipe import Recipe
from hpcrl.job.spec import JobSpec

__all__ = ["resolve_paths", "read", "check"]


def resolve_paths(data: dict, recipe_path: str | None) -> None:
    """trainer.deepspeed_config and trainer.accelerate_config, when relative: from the directory
    hpcrl runs in, as TRL and accelerate take them, else beside the recipe. A file found in neither
    place is left as it is, for compose to name."""
    trainer = data.get("trainer")
    if not isinstance(trainer, dict):
        return
    for key in ("deepspeed_config", "accelerate_config"):
        value = trainer.get(key)
        if isinstance(value, str) and value:
            trainer[key] = _find_file(value, recipe_path)


def _find_file(value: str, beside: str | None) -> str:
    """`value` as an absolute path: from the current directory, else from the directory of the
    file `beside`; as it is where neither has it."""
    path = Path(value).expanduser()
    if path.is_absolute():
        return str(path)
    places = [Path.cwd()] + ([Path(beside).expanduser().absolute().parent] if beside else [])
    for place in places:
        if (place / path).exists():
            return str(place / path)
    return value


def read(recipe: Recipe, notes: list[str]) -> list[tuple[str, dict]]:
    """trainer.engine=deepspeed: the user's DeepSpeed settings, each with the name messages give
    it: trainer.deepspeed_config (a JSON file, or the mapping itself), and trainer.accelerate_config's
    DeepSpeed settings with the JSON it may name. What hpcrl does otherwise goes to `notes`."""
    from hpcrl.job import deepspeed

    t = recipe.trainer
    sources = []
    if isinstance(t.deepspeed_config, dict):
        if t.deepspeed_config:
            sources.append(("trainer.deepspeed_config", dict(t.deepspeed_config)))
    elif t.deepspeed_config:
        sources.append((f"trainer.deepspeed_config ({Path(t.deepspeed_config).name})",
                        _read_json(t.deepspeed_config, "trainer.deepspeed_config")))
    if t.accelerate_config:
        where = f"trainer.accelerate_config ({Path(t.accelerate_config).name})"
        data = _read_yaml(t.accelerate_config, "trainer.accelerate_config")
        fragment, unfollowed = deepspeed.read_accelerate_config(data, where)
        named = deepspeed.deepspeed_config_file(data)
        if named:
            if t.deepspeed_config:
                raise UserError(f"{where}: deepspeed_config_file and trainer.deepspeed_config both give a DeepSpeed "
                                f"JSON; keep one of them")
            path = _find_file(named, t.accelerate_config)
            sources.append((f"{where} deepspeed_config_file ({Path(path).name})",
                            _read_json(path, f"{where}: deepspeed_config_file")))
        if fragment:
            sources.append((where, fragment))
        if unfollowed:
            notes.append(f"{where}: not followed: {'; '.join(unfollowed)}")
    for name, config in sources:
        unfollowed = deepspeed.not_honoured(config)
        if unfollowed:
            notes.append(f"{name}: not followed: {'; '.join(unfollowed)}")
    return sources


def _read_text(path: str, where: str, kind: str) -> str:
    """The file's text; one line naming the field and the file when it cannot be read."""
    try:
        return Path(path).read_text()
    except FileNotFoundError:
        raise UserError(f"{where}: no such file {path}") from None
    except IsADirectoryError:
        raise UserError(f"{where}: {path} is a directory, not {kind}") from None
    except OSError as e:
        raise UserError(f"{where}: cannot read {path} ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise UserError(f"{where}: {path} is not a UTF-8 text file") from None


def _read_json(path: str, where: str) -> dict:
    """A DeepSpeed JSON: one line naming the field and the file when it cannot be one."""
    import json

    try:
        data = json.loads(_read_text(path, where, "a DeepSpeed JSON file"))
    except json.JSONDecodeError as e:
        raise UserError(f"{where}: {path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    if not isinstance(data, dict):
        raise UserError(f"{where}: {path} is not a DeepSpeed configuration (a JSON object), got {type(data).__name__}")
    return data


def _read_yaml(path: str, where: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(_read_text(path, where, "an accelerate config file"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise UserError(f"{where}: {path} is not valid YAML{at}: {getattr(e, 'problem', None) or e}") from None


def check(spec: JobSpec, plan: Plan, sources: list[tuple[str, dict]]) -> None:
    """Build the trainers' DeepSpeed configuration now, as they will from job.json, so that a
    conflict with the recipe is refused before the job queues. Each source alone first: the
    message then names the file the conflicting key is in."""
    if spec.recipe.trainer.engine != "deepspeed":
        return
    from hpcrl.job.deepspeed import build_config, config_for_job
    from hpcrl.job.mesh_choice import choose_mesh

    device_type = "cuda" if spec.site.device == "cuda" else "cpu"
    hpz = choose_mesh(spec, plan).hpz_partition_size
    for name, config in sources:
        build_config(spec.recipe, num_trainers=plan.num_trainers, hpz_partition_size=hpz, user=config,
                     device_type=device_type, where=name)
    config_for_job(spec, device_type)
