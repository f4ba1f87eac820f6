"""The recipe's model, tokenizer and dataset, checked on the login node before a job waits in a
queue: each mistake is one UserError naming the field (hpcrl.login.compose calls `check_inputs`).
The data's checks are hpcrl.login.data_inputs', LoRA's hpcrl.login.lora_inputs', an agent's
hpcrl.login.agent_inputs': each imported only for a recipe with that part.

Light and fast: no torch, no datasets. Files are looked at, not loaded: a model directory's
config.json and weight file names (with LoRA, its weights' names: model.lora_target_modules must name
modules it has), a tokenizer's file names, a dataset's columns (the first line of a .jsonl, a .csv
header, a parquet schema when pyarrow happens to be importable, the features a save_to_disk
directory lists in its JSON) and the prompt of every row, within a time bound
(hpcrl.login.data_rows). What only loading can find (a line that is not JSON, weights that do not
match their config) fails on the compute nodes, in one line.

Only what this machine can see is checked: a path on a file system it does not mount (its top
directory is absent here) is left to the compute nodes. Hub ids must be in the Hugging Face cache
the job will read (the site's HF_HOME/HF_HUB_CACHE, else this environment's): compute nodes run
offline. A cache the site puts where this machine cannot see (Frontier's node-local NVMe) is not
checked.
"""

from __future__ import annotations

import os
from pathlib import Path

from hpcrl.job import hfcache
from hpcrl.job.demo import is_demo
from hpcrl.job.errors import UserError
from hpcrl.job.recipe import DataConfig, ModelConfig, Recipe
from hpcrl.job.site import Site
from hpcrl.login import job_paths
from hpcrl.login.job_paths import caches, unseen_here


def check_inputs(recipe: Recipe, site: Site) -> None:
    env = job_paths.environment(site)
    _check_model(recipe, env)
    names = ()
    # Each part's module is imported only for a recipe that has that part: `hpcrl render` of a
    # plain recipe stays close to its import floor (scripts/bench_cli.py).
    if recipe.agent.enabled:
        from hpcrl.login import agent_inputs

        revision = {"model.path": recipe.model.revision}      # model.tokenizer's is its main
        agent_inputs.check_chat_template(
            recipe, lambda name, where: _model_dir(name, where, env, revision.get(where, hfcache.MAIN)))
        names = agent_inputs.environment_columns(recipe)
    _check_reward_models(recipe, env)
    data = recipe.data
    if data.path != DataConfig.path or data.data_files or data.datasets:     # not the demo task's, built in the job
        from hpcrl.login.data_inputs import check_data

        check_data(recipe, env, names)


def model_to_stage(recipe: Recipe, site: Site) -> str:
    """The directory the job copies to each node (site.stage.model_dest): model.path itself, or a
    hub id's snapshot in THIS machine's Hugging Face cache (the batch host reads it from the shared
    file system; the nodes' own caches may be empty). "" for the demo model, built on the nodes."""
    path = recipe.model.path
    if not site.stage.model_dest or is_demo(path):
        return ""
    local = Path(path).expanduser()
    if local.is_dir() or not hfcache.is_hub_id(path):
        return str(local.absolute())        # a path only the nodes can see is theirs to find
    hub_cache, _ = hfcache.hub_cache_dirs(os.environ)
    revision = recipe.model.revision
    snapshot = hfcache.cached_snapshot(path, "model", hub_cache, revision)
    if snapshot is None:
        raise UserError(f"model.path: site.stage.model_dest copies the model from this machine's Hugging Face "
                        f"cache ({hub_cache}), which lacks {_at(path, revision)}; "
                        f"{hfcache.download_hint(path, revision=revision)}")
    return str(snapshot)


# ---------------------------------------------------------------------------- model and tokenizer
def _check_model(recipe: Recipe, env) -> None:
    model = recipe.model
    if is_demo(model.path):
        if model.tokenizer:
            _tokenizer_dir(model.tokenizer, "model.tokenizer", env)
        _check_lora_targets(model, None)
        return
    model_dir = _weights_dir(model.path, "model.path", env, model.revision)
    if model_dir is not None:
        _check_lora_targets(model, model_dir)
    if model.tokenizer:
        _tokenizer_dir(model.tokenizer, "model.tokenizer", env)
    elif model_dir is not None and not _has_tokenizer(model_dir):
        raise UserError(f"model.path: {_shown(model.path, model_dir)} has no tokenizer vocabulary "
                        f"({', '.join(_VOCABULARY_FILES)}); set model.tokenizer to the tokenizer's directory")


def _check_reward_models(recipe: Recipe, env) -> None:
    """rewards[i].model: loaded as the policy is, with the tokenizer of its own directory."""
    for i, reward in enumerate(recipe.rewards):
        directory = _weights_dir(reward.model, f"rewards[{i}].model", env) if reward.model else None
        if directory is not None:
            _tokenizer_dir(reward.model, f"rewards[{i}].model", env, directory)


def _weights_dir(name: str, where: str, env, revision: str = hfcache.MAIN) -> Path | None:
    """The model directory `name` means, with a config.json and weights; None where this machine
    cannot look."""
    model_dir = _model_dir(name, where, env, revision)
    if model_dir is not None:
        if not (model_dir / "config.json").is_file():
            raise UserError(f"{where}: {_shown(name, model_dir)} is not a Hugging Face model directory: it has "
                            f"no config.json")
        if not any(next(model_dir.glob(p), None) for p in hfcache.WEIGHT_PATTERNS):
            raise UserError(f"{where}: {_shown(name, model_dir)} has no weights ({', '.join(hfcache.WEIGHT_PATTERNS)})")
    return model_dir


def _shown(name: str, path: Path) -> str:
    return name if str(path) == name else f"{name} (cached at {path})"


def _at(name: str, revision: str) -> str:
    return repr(name) if revision == hfcache.MAIN else f"{name!r} at revision {revision!r} (model.revision)"


def _model_dir(name: str, where: str, env, revision: str = hfcache.MAIN) -> Path | None:
    """The directory `name` means: itself, or a hub id's cached snapshot (at `revision`); None where
    this machine cannot look (a file system or cache only compute nodes have)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise UserError(f"{where}: {name} is a file, not a directory")
    if not hfcache.is_hub_id(name):
        if unseen_here(path):
            return None
        raise UserError(f"{where}: {name} does not exist")
    hub_cache, _ = caches(env)
    if hub_cache is None:
        return None
    snapshot = hfcache.cached_snapshot(name, "model", hub_cache, revision)
    if snapshot is None:
        raise UserError(f"{where}: {_at(name, revision)} is neither a local directory nor a model in the Hugging "
                        f"Face cache ({hub_cache}); {hfcache.download_hint(name, revision=revision)}")
    return snapshot


_VOCABULARY_FILES = tuple(f for f in hfcache.TOKENIZER_FILES if f != "tokenizer_config.json")


def _has_tokenizer(directory: Path) -> bool:
    # A vocabulary, not only tokenizer_config.json: with that file alone the engines fail on the
    # node in their own words ("You need to specify either text or text_target").
    return any((directory / f).is_file() for f in _VOCABULARY_FILES)


def _tokenizer_dir(name: str, where: str, env, directory: Path | None = None) -> None:
    """`name`'s tokenizer files (in `directory`, when the caller has looked `name` up already)."""
    directory = directory if directory is not None else _model_dir(name, where, env)
    if directory is not None and not _has_tokenizer(directory):
        raise UserError(f"{where}: {_shown(name, directory)} has no tokenizer vocabulary "
                        f"({', '.join(_VOCABULARY_FILES)})")


def _check_lora_targets(model: ModelConfig, model_dir: Path | None) -> None:
    """model.lora_target_modules against the modules of the model (its directory; None: a demo model)
    and, where peft converts them to parameters, against model.lora_dropout; model.lora_modules_to_save
    against its tied head."""
    if not model.use_peft:
        return
    from hpcrl.login import lora_inputs

    lora_inputs.check_modules_to_save(model, model_dir)
    if model.lora_target_modules is None:
        return
    modules = lora_inputs.demo_module_paths(model.path) if model_dir is None else \
        lora_inputs.checkpoint_module_paths(model_dir)
    lora_inputs.check_targets(model, modules)
    if model_dir is not None:
        lora_inputs.check_converted_dropout(model, model_dir)
