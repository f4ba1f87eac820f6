"""The recipe's model, tokenizer and dataset, checked on the login node before a job waits in a
queue: each mistake is one UserError naming the field (hpcrl.login.compose calls `check_inputs`).

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

import csv
import glob
import json
import os
import re
from pathlib import Path

from hpcrl.job import hfcache
from hpcrl.job.config import closest
from hpcrl.job.demo import is_demo, parse_demo_model
from hpcrl.job.errors import UserError
from hpcrl.job.lora import ALL_LINEAR, DECODER_LINEARS, decoder_linear_path, lora_target_matches
from hpcrl.job.model_shape import read_safetensors_header
from hpcrl.job.recipe import DATASET_BUILDERS, DataSource, ModelConfig, Recipe
from hpcrl.job.site import Site
from hpcrl.login import agent_inputs, data_rows, job_env

DEMO_DATA = "demo"
# Split names datasets infers from file names, beyond the split's own name.
SPLIT_WORDS = {"train": ("training",), "validation": ("valid", "val", "dev"), "test": ("testing", "eval", "evaluation")}
# Decoder layers of the "demo:<size>" models (Qwen2, built in the job by hpcrl.compute.models.tiny,
# whose SIZES these follow; a test holds them equal).
DEMO_LAYERS = {"tiny": 4, "small": 10, "medium": 10, "base": 12, "large": 28}
# A weight file's JSON header is read up to this size (a header is a few MB at most).
SAFETENSORS_HEADER_MAX_BYTES = 256 << 20


def check_inputs(recipe: Recipe, site: Site) -> None:
    env = _job_env(site)
    _check_model(recipe, env)
    agent_inputs.check_chat_template(recipe, lambda name, where: _model_dir(name, where, env))
    _check_reward_models(recipe, env)
    _check_data(recipe, env, data_rows.RowChecks(recipe.data.prompt_column, agent_inputs.environment_columns(recipe)))


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
    snapshot = hfcache.cached_snapshot(path, "model", hub_cache)
    if snapshot is None:
        raise UserError(f"model.path: site.stage.model_dest copies the model from this machine's Hugging Face "
                        f"cache ({hub_cache}), which lacks {path!r}; {hfcache.download_hint(path)}")
    return str(snapshot)


# ---------------------------------------------------------------------------- where the job looks
def _job_env(site: Site) -> dict[str, str | None]:
    """This environment with the site's variables on top, as the job gets it; a site's cache
    variable pointing where this machine cannot look becomes None (not checked)."""
    env: dict[str, str | None] = {**os.environ, **job_env.kept_hub_cache(site)}
    for key, value in {**job_env.hf_variables(site), **site.env}.items():
        expanded = os.path.expandvars(str(value))
        env[key] = expanded
        if key.startswith("HF_") and ("$" in expanded or not Path(expanded).expanduser().exists()):
            env[key] = None
    return env


def _caches(env: dict[str, str | None]) -> tuple[Path | None, Path | None]:
    """(hub cache, datasets cache) the job reads; None for one this machine cannot see."""
    unseen = {k for k, v in env.items() if v is None}
    hub, data = hfcache.hub_cache_dirs({k: v for k, v in env.items() if v is not None})
    # HF_HOME unseen: so is every cache under it, unless its own variable names another place.
    hub_unseen = bool(unseen & {"HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"}) or \
        ("HF_HOME" in unseen and not env.get("HF_HUB_CACHE"))
    data_unseen = "HF_DATASETS_CACHE" in unseen or ("HF_HOME" in unseen and not env.get("HF_DATASETS_CACHE"))
    return (None if hub_unseen else hub), (None if data_unseen else data)


# ---------------------------------------------------------------------------- model and tokenizer
def _check_model(recipe: Recipe, env) -> None:
    model = recipe.model
    if is_demo(model.path):
        if model.tokenizer:
            _tokenizer_dir(model.tokenizer, "model.tokenizer", env)
        _check_lora_targets(model, demo_module_paths(model.path))
        return
    model_dir = _weights_dir(model.path, "model.path", env)
    if model_dir is not None:
        _check_lora_targets(model, checkpoint_module_paths(model_dir))
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


def _weights_dir(name: str, where: str, env) -> Path | None:
    """The model directory `name` means, with a config.json and weights; None where this machine
    cannot look."""
    model_dir = _model_dir(name, where, env)
    if model_dir is not None:
        if not (model_dir / "config.json").is_file():
            raise UserError(f"{where}: {_shown(name, model_dir)} is not a Hugging Face model directory: it has "
                            f"no config.json")
        if not any(next(model_dir.glob(p), None) for p in hfcache.WEIGHT_PATTERNS):
            raise UserError(f"{where}: {_shown(name, model_dir)} has no weights ({', '.join(hfcache.WEIGHT_PATTERNS)})")
    return model_dir


def _shown(name: str, path: Path) -> str:
    return name if str(path) == name else f"{name} (cached at {path})"


def unseen_here(path: Path) -> bool:
    """A path on a file system this machine does not have (its top directory, /lustre or
    /mnt/bb, is absent here), or with a variable only the job expands: only compute nodes can tell."""
    if "$" in str(path):
        return True
    parts = path.absolute().parts
    return len(parts) > 1 and not Path(parts[0], parts[1]).exists()


def _model_dir(name: str, where: str, env) -> Path | None:
    """The directory `name` means: itself, or a hub id's cached snapshot; None where this machine
    cannot look (a file system or cache only compute nodes have)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.exists():
        raise UserError(f"{where}: {name} is a file, not a directory")
    if not hfcache.is_hub_id(name):
        if unseen_here(path):
            return None
        raise UserError(f"{where}: {name} does not exist")
    hub_cache, _ = _caches(env)
    if hub_cache is None:
        return None
    snapshot = hfcache.cached_snapshot(name, "model", hub_cache)
    if snapshot is None:
        raise UserError(f"{where}: {name!r} is neither a local directory nor a model in the Hugging Face cache "
                        f"({hub_cache}); {hfcache.download_hint(name)}")
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


# ---------------------------------------------------------------------------- LoRA's target modules
class ModulePaths:
    """A model's module paths as peft sees them (model.layers.0.self_attn.q_proj, and every parent
    module), and which of them are linear layers, read from its weights' names without loading them."""

    def __init__(self, paths: set[str], linear: set[str]):
        self.paths, self.linear = paths, linear

    @classmethod
    def of(cls, modules: dict[str, bool]) -> "ModulePaths":
        """From {module path: whether it is a linear layer}: every parent module is a path too."""
        paths = set()
        for module in modules:
            parts = module.split(".")
            paths.update(".".join(parts[:n]) for n in range(1, len(parts) + 1))
        return cls(paths, {m for m, linear in modules.items() if linear})

    def linear_names(self) -> list[str]:
        """The linear layers' names (the last part of their paths), once each."""
        return sorted({m.rsplit(".", 1)[-1] for m in self.linear})


def demo_module_paths(path: str) -> ModulePaths | None:
    """A "demo:<size>[:random|:agent]" model's modules (Qwen2; the head is tied to the embeddings, but is
    a module of its own); None for a size this machine does not know (the job says so)."""
    layers = DEMO_LAYERS.get(parse_demo_model(path)[0])
    if layers is None:
        return None
    modules = {"model.embed_tokens": False, "model.norm": False, "lm_head": True}
    for layer in range(layers):
        modules[f"model.layers.{layer}.input_layernorm"] = False
        modules[f"model.layers.{layer}.post_attention_layernorm"] = False
        modules.update({decoder_linear_path(layer, name): True for name in DECODER_LINEARS})
    return ModulePaths.of(modules)


def checkpoint_module_paths(model_dir: Path) -> ModulePaths | None:
    """The modules a model directory's weights belong to: the names in its weight index
    (model.safetensors.index.json, pytorch_model.bin.index.json), else in its *.safetensors
    headers, less the parameter's own name (".weight", ".bias"). A linear layer is a module with a
    two-dimensional weight that is no embedding (where only an index gives names and no shapes: a
    weight that is no norm's or embedding's). None when no weight names can be read here."""
    names: dict[str, list | None] = {}          # tensor name -> shape (None: unknown)
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        try:
            weight_map = json.loads((model_dir / index).read_text()).get("weight_map")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(weight_map, dict) and weight_map:
            names = dict.fromkeys(weight_map)
            for file in sorted(set(map(str, weight_map.values()))):
                names.update({k: v for k, v in _tensor_shapes(model_dir / file).items() if k in names})
            break
    if not names:
        for file in sorted(model_dir.glob("*.safetensors")):
            names.update(_tensor_shapes(file))
    if not names:
        return None
    modules: dict[str, bool] = {}
    for name, shape in names.items():
        module, _, param = name.rpartition(".")
        if not module:
            continue
        last = module.rsplit(".", 1)[-1]
        embedding_or_norm = bool(re.search(r"embed|norm|^wte$|^wpe$|^ln", last))
        linear = param == "weight" and not embedding_or_norm and (shape is None or len(shape) == 2)
        modules[module] = modules.get(module, False) or linear
    if "lm_head" not in modules and _tied_head(model_dir):
        modules["lm_head"] = True           # the head shares the embeddings' weight; its module exists
    return ModulePaths.of(modules)


def _tensor_shapes(file: Path) -> dict[str, list | None]:
    """A .safetensors file's tensor names -> shapes, from its header; {} when it cannot be read here."""
    if file.suffix != ".safetensors":
        return {}
    try:
        header = read_safetensors_header(file, SAFETENSORS_HEADER_MAX_BYTES)
    except (OSError, ValueError):
        return {}
    return {k: (v.get("shape") if isinstance(v, dict) else None) for k, v in header.items() if k != "__metadata__"}


def _tied_head(model_dir: Path) -> bool:
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(cfg, dict):
        return False
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    return bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", True)))


def _check_lora_targets(model: ModelConfig, modules: ModulePaths | None) -> None:
    """model.lora_target_modules must name modules the model has, as peft matches them: each name
    a module path that is it or ends with "." + it; one string (not "all-linear") a regular
    expression matching a whole path. None and "all-linear" are peft's to resolve."""
    targets = model.lora_target_modules
    if not model.use_peft or targets is None or targets == ALL_LINEAR or modules is None or not modules.paths:
        return
    names = modules.linear_names()
    if isinstance(targets, str):
        if not any(lora_target_matches(targets, p) for p in modules.paths):
            example = next((p for p in sorted(modules.linear) if ".0." in p), min(modules.linear, default=""))
            raise UserError(f"model.lora_target_modules: the regular expression \"{targets}\" matches no module "
                            f"path of {model.path} (it must match a whole path, e.g. \"{example}\"); its linear "
                            f"layers: {', '.join(names)}")
        return
    missing = [t for t in targets if not any(lora_target_matches((t,), p) for p in modules.paths)]
    if missing:
        hint = closest(missing[0], names) if len(missing) == 1 else ""
        raise UserError(f"model.lora_target_modules: {', '.join(f'{t!r}' for t in missing)} "
                        f"{'matches' if len(missing) == 1 else 'match'} no module of {model.path}{hint}; "
                        f"its linear layers: {', '.join(names)}")


# ---------------------------------------------------------------------------- data
def _check_data(recipe: Recipe, env, rows: data_rows.RowChecks) -> None:
    if recipe.data.datasets:
        return _check_mixture(recipe, env, rows)
    _check_split(recipe, env, recipe.data.split, rows)
    if recipe.grpo.eval_strategy != "no":
        try:
            _check_split(recipe, env, recipe.data.eval_split, rows)
        except UserError as e:      # the same checks, for the split evaluation reads
            raise UserError(str(e).replace("data.split:", "data.eval_split:", 1)) from None


def _check_split(recipe: Recipe, env, split: str, rows: data_rows.RowChecks) -> None:
    data = recipe.data
    if data.data_files:
        if data.path != DEMO_DATA:
            raise UserError("data.data_files: give data.path or data.data_files, not both")
        return _check_files(list(data.data_files), "data.data_files", split, rows)
    if data.path == DEMO_DATA:
        return None
    text = data.path
    path = Path(text).expanduser()
    if hfcache.is_glob(text) or path.is_file():
        return _check_files([text], "data.path", split, rows)
    if path.is_dir():
        if hfcache.is_saved_dataset(path):
            return _check_saved(path, text, split, rows)
        return _check_data_dir(path, text, split, rows)
    if unseen_here(path) and not hfcache.is_hub_id(text):
        return None
    if path.exists():
        raise UserError(f"data.path: {text} is neither a file nor a directory")
    if not hfcache.is_hub_id(text):
        raise UserError(f"data.path: {text} does not exist")
    hub_cache, datasets_cache = _caches(env)
    if hub_cache is None or datasets_cache is None:
        return None
    snapshot = hfcache.cached_snapshot(text, "dataset", hub_cache)
    if snapshot is not None:
        if hfcache.data_files_in(snapshot) and not data.config:
            _check_data_dir(snapshot, f"{text} (cached at {snapshot})", split, rows)
        return None
    prepared = hfcache.cached_prepared_dataset(text, datasets_cache)
    if prepared is None:
        raise UserError(f"data.path: {text!r} is neither a local path nor a dataset in the Hugging Face cache "
                        f"({hub_cache}, {datasets_cache}); {hfcache.download_hint(text, 'dataset')}")
    return None


def _check_mixture(recipe: Recipe, env, rows: data_rows.RowChecks) -> None:
    """data.datasets, each source as datasets.load_dataset will find it (the split of data.split
    itself was checked with the recipe: "train", or "test" with data.test_split_size)."""
    data = recipe.data
    splits = ("train", "test") if data.test_split_size is not None else ("train",)
    if recipe.grpo.eval_strategy != "no" and data.eval_split not in splits:
        raise UserError(f"data.eval_split: {data.eval_split!r}: a mixture's splits are \"train\" and, with "
                        f"data.test_split_size (TRL's test_split_size), \"test\"; evaluation needs one of them")
    for i, source in enumerate(data.datasets):
        _check_source(source, f"data.datasets[{i}]", rows, env)


def _split_names(split: str) -> list[str]:
    """The split names of a load_dataset split expression ("train[:10%]+test" -> train, test)."""
    return [part.split("[", 1)[0].strip() for part in split.split("+")]


def _check_source(source: DataSource, where: str, rows: data_rows.RowChecks, env) -> None:
    if source.columns is not None and rows.prompt not in source.columns:
        raise UserError(f"{where}.columns: keeps no {rows.prompt!r} column (data.prompt_column); add it")
    path = Path(source.path).expanduser()
    if source.path in DATASET_BUILDERS:
        if source.data_files is not None:
            return _check_source_files(source, where, rows, base=source.data_dir and Path(source.data_dir))
        if source.data_dir is None:
            raise UserError(f"{where}: the {source.path!r} builder reads the files of data_files or data_dir; "
                            f"give one of them")
        return _check_source_dir(source, where, rows, Path(source.data_dir).expanduser(), f"{where}.data_dir")
    if path.is_file():
        builder = hfcache.DATA_FILE_BUILDERS.get(path.suffix, "json")
        raise UserError(f"{where}.path: {source.path} is a file; datasets.load_dataset (so TRL) reads files "
                        f"through a builder: path: {builder}, data_files: {source.path}")
    if path.is_dir():
        if source.data_files is not None:
            return _check_source_files(source, where, rows, base=path / (source.data_dir or ""))
        return _check_source_dir(source, where, rows, path / (source.data_dir or ""), f"{where}.path")
    if unseen_here(path) and not hfcache.is_hub_id(source.path):
        return None
    if path.exists():
        raise UserError(f"{where}.path: {source.path} is neither a file nor a directory")
    if not hfcache.is_hub_id(source.path):
        raise UserError(f"{where}.path: {source.path} does not exist (and is no builder such as json, csv or "
                        f"parquet, nor a hub dataset id)")
    hub_cache, datasets_cache = _caches(env)
    if hub_cache is None or datasets_cache is None:
        return None
    snapshot = hfcache.cached_snapshot(source.path, "dataset", hub_cache)
    if snapshot is None and hfcache.cached_prepared_dataset(source.path, datasets_cache) is None:
        raise UserError(f"{where}.path: {source.path!r} is neither a local path nor a dataset in the Hugging Face "
                        f"cache ({hub_cache}, {datasets_cache}); {hfcache.download_hint(source.path, 'dataset')}")
    if snapshot is not None and source.name is None and hfcache.data_files_in(snapshot):
        # the job reads the snapshot as a directory of data files (hpcrl.compute.train.data)
        if source.data_files is not None:
            return _check_source_files(source, where, rows, base=snapshot / (source.data_dir or ""))
        return _check_source_dir(source, where, rows, snapshot / (source.data_dir or ""), f"{where}.path")
    return None


def _check_source_files(source: DataSource, where: str, rows: data_rows.RowChecks, base: Path | None) -> None:
    """A source's data_files (relative ones inside `base`, the dataset's directory; made absolute
    at compose otherwise): the split's files exist and their first row has the columns asked for."""
    files = source.data_files
    names = _split_names(source.split)
    if isinstance(files, dict):
        missing = [n for n in names if n not in files]
        if missing:
            raise UserError(f"{where}.split: {source.split!r}: data_files names the splits {', '.join(files)}")
        patterns = [p for n in names for p in ([files[n]] if isinstance(files[n], str) else files[n])]
    else:
        if any(n != "train" for n in names):
            raise UserError(f"{where}.split: {source.split!r}: data_files as a file or a list of files has one "
                            f"split, \"train\" (a mapping of split names to files gives more)")
        patterns = [files] if isinstance(files, str) else list(files)
    if not patterns:
        raise UserError(f"{where}.data_files: names no file for split {source.split!r}")
    found = []
    for pattern in patterns:
        if "://" in pattern:
            return None
        full = Path(base or "", pattern).expanduser()
        if unseen_here(full):
            return None
        if hfcache.is_glob(pattern):
            matches = sorted(Path(p) for p in glob.glob(str(full), recursive=True) if Path(p).is_file())
            if not matches:
                raise UserError(f"{where}.data_files: no file matches {full}")
        elif not full.is_file():
            raise UserError(f"{where}.data_files: {full} {'is not a file' if full.exists() else 'does not exist'}")
        else:
            matches = [full]
        found += matches
    _check_source_columns(source, where, rows, found[0])
    data_rows.check_prompts(found, rows, where, source.split)


def _check_source_dir(source: DataSource, where: str, rows: data_rows.RowChecks, directory: Path, field: str) -> None:
    if unseen_here(directory):
        return None
    if not directory.is_dir():
        raise UserError(f"{field}: {directory} is not a directory")
    files = hfcache.data_files_in(directory)
    if not files:
        raise UserError(f"{field}: {directory} holds no data files ({', '.join(hfcache.DATA_FILE_BUILDERS)})")
    for name in _split_names(source.split):
        split_files = _split_files(directory, files, name, f"{where}.split", str(directory))
        _check_source_columns(source, where, rows, split_files[0])
        data_rows.check_prompts(split_files, rows, where, name)


def _check_source_columns(source: DataSource, where: str, rows: data_rows.RowChecks, file: Path) -> None:
    """The first row of `file` has every column of `columns`, and the prompt column."""
    if file.suffix not in hfcache.DATA_FILE_BUILDERS:
        return None
    try:
        columns = first_row_columns(file)
    except UserError as e:
        raise UserError(str(e).replace("data.path:", f"{where}:", 1)) from None
    if columns is None:
        return None
    for wanted in source.columns or ():
        if wanted not in columns:
            raise UserError(f"{where}.columns: no {wanted!r} column in {file} (first row's columns: "
                            f"{', '.join(map(str, columns)) or 'none'}){closest(wanted, columns)}")
    if rows.prompt not in columns:
        raise UserError(f"data.prompt_column: no {rows.prompt!r} column in {file} ({where}; first row's columns: "
                        f"{', '.join(map(str, columns)) or 'none'})")
    return None


def _check_files(patterns: list[str], where: str, split: str, rows: data_rows.RowChecks) -> None:
    if split != "train":
        raise UserError(f"data.split: {split!r}: {where} is a file or files, whose only split is \"train\"")
    if any(unseen_here(Path(p).expanduser()) for p in patterns):
        return
    try:
        files = hfcache.expand_data_files(patterns, where)
    except (OSError, ValueError) as e:
        raise UserError(str(e)) from None
    _check_column(files[0], rows.prompt)
    data_rows.check_prompts(files, rows, where)


def _check_saved(path: Path, name: str, split: str, rows: data_rows.RowChecks) -> None:
    """A save_to_disk directory: its split and features, from its JSON files."""
    dict_file = path / hfcache.SAVED_DATASET_DICT_FILE
    if dict_file.is_file():
        splits = _read_json(dict_file, "data.path").get("splits") or []
        if split not in splits:
            raise UserError(f"data.split: {name} has no split {split!r} (splits: {', '.join(map(str, splits))})")
        path = path / split
    else:
        own = _read_json(path / "state.json", "data.path").get("_split") or "train"
        if split not in ("train", own):
            raise UserError(f"data.split: {split!r}: {name} is a single saved Dataset (split {own!r})")
    info = path / "dataset_info.json"
    features = _read_json(info, "data.path").get("features") if info.is_file() else None
    if isinstance(features, dict) and features and rows.prompt not in features:
        raise UserError(f"data.prompt_column: no {rows.prompt!r} column in {name} (columns: {', '.join(features)})")
    data_rows.check_prompts(data_rows.saved_files(path), rows, "data.path", split)


def _check_data_dir(path: Path, name: str, split: str, rows: data_rows.RowChecks) -> None:
    files = hfcache.data_files_in(path)
    if not files:
        raise UserError(f"data.path: {name} holds no data files ({', '.join(hfcache.DATA_FILE_BUILDERS)}) "
                        f"and is no save_to_disk directory")
    split_files = _split_files(path, files, split, "data.split", name)
    _check_column(split_files[0], rows.prompt)
    data_rows.check_prompts(split_files, rows, "data.path", split)


def _split_files(directory: Path, files: list[Path], split: str, where: str, shown: str) -> list[Path]:
    """The data files of ``directory`` that datasets gives ``split``: those with the split's name (or
    a synonym) as a word of their path; "train" takes all when none is named."""
    words = (split, *SPLIT_WORDS.get(split, ()))
    named = [f for f in files if any(re.search(rf"(^|[\W_]){re.escape(w)}($|[\W_])", str(f.relative_to(directory)))
                                     for w in words)]
    if split != "train" and not named:
        raise UserError(f"{where}: no file in {shown} is named for split {split!r} "
                        f"(files: {', '.join(str(f.relative_to(directory)) for f in files[:5])})")
    return named or files


def _read_json(path: Path, where: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{where}: cannot read {path}: {e}") from None
    return data if isinstance(data, dict) else {}


def _check_column(file: Path, column: str) -> None:
    columns = first_row_columns(file)
    if columns is not None and column not in columns:
        raise UserError(f"data.prompt_column: no {column!r} column in {file} (first row's columns: "
                        f"{', '.join(map(str, columns)) or 'none'})")


def first_row_columns(file: Path) -> list[str] | None:
    """The columns of a data file's first row, read cheaply; None where that would take more
    (a big JSON array, parquet without pyarrow). A first row that cannot be read is an error."""
    where = f"data.path: {file}"
    try:
        if file.suffix == ".csv":
            with open(file, newline="", encoding="utf-8") as f:
                return next(csv.reader(f), [])
        if file.suffix == ".parquet":
            try:
                import pyarrow.parquet as pq      # not a login-side dependency: used when present
            except ImportError:
                return None
            try:
                return list(pq.read_schema(file).names)
            except Exception as e:                # noqa: BLE001 - any unreadable file, in one line
                raise UserError(f"{where}: not a readable parquet file ({str(e).splitlines()[0]})") from None
        if file.suffix == ".json" and file.stat().st_size <= data_rows.WHOLE_JSON_MAX_BYTES:
            text = file.read_text(encoding="utf-8")
            try:
                whole = json.loads(text)
            except ValueError:
                whole = None                      # JSON lines in a .json file
            if isinstance(whole, list):
                return list(whole[0]) if whole and isinstance(whole[0], dict) else None
            if isinstance(whole, dict):
                return list(whole) if all(isinstance(v, list) for v in whole.values()) else None
        with open(file, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    break
            else:
                raise UserError(f"{where}: the file is empty")
    except UnicodeDecodeError:
        raise UserError(f"{where}: not a UTF-8 text file") from None
    except OSError as e:
        raise UserError(f"{where}: cannot read it: {e.strerror or e}") from None
    try:
        row = json.loads(line)
    except ValueError as e:
        if file.suffix == ".json":
            return None                           # too big to parse whole, not JSON lines: the job reads it
        raise UserError(f"{where}: line {number} is not JSON ({e})") from None
    if not isinstance(row, dict):
        raise UserError(f"{where}: line {number} is not a JSON object (a row of named columns)")
    return list(row)
