"""The recipe's data checked on the login node, as datasets.load_dataset will find it in the job:
data.path (a file, a glob, a directory of files or a save_to_disk directory, a hub dataset in the
cache the job reads), data.data_files, data.datasets (a mixture); the split each names, the prompt
column in the first row, and every row's prompt within a time bound (hpcrl.login.data_rows).
hpcrl.login.inputs calls `check_data` for recipes that bring data (the demo task's is built in the job).
"""

from __future__ import annotations

import csv
import glob
import json
import re
from pathlib import Path

from hpcrl.job import hfcache
from hpcrl.job.config import closest
from hpcrl.job.errors import UserError
from hpcrl.job.recipe import DATASET_BUILDERS, DataSource, Recipe
from hpcrl.login import data_rows
from hpcrl.login.job_paths import caches, unseen_here

DEMO_DATA = "demo"
# Split names datasets infers from file names, beyond the split's own name.
SPLIT_WORDS = {"train": ("training",), "validation": ("valid", "val", "dev"), "test": ("testing", "eval", "evaluation")}


def check_data(recipe: Recipe, env, names: tuple[data_rows.NamesColumn, ...] = ()) -> None:
    """The data's files, splits and prompts; `env` the job's environment (hpcrl.login.job_paths),
    `names` the columns whose rows must name one of a few names (an agent's `environment`)."""
    _check_data(recipe, env, data_rows.RowChecks(recipe.data.prompt_column, names))


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
    hub_cache, datasets_cache = caches(env)
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
    hub_cache, datasets_cache = caches(env)
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
