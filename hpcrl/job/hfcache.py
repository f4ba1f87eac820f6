"""Where a recipe's model and data come from, in terms both sides share (stdlib only): the forms a
data.path takes, the Hugging Face cache's layout, and which names are hub ids.

The login side checks a recipe's model and data with these before a job waits in a queue
(hpcrl.login.compose); the compute side loads them the same way (hpcrl.compute.train.sources).
Compute nodes run offline (HF_HUB_OFFLINE=1), so a hub id is usable only once it is in the cache:
``huggingface-cli download ID`` (or ``hf download ID``) on a login node puts it there.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

# Data file suffix -> the datasets builder that reads it.
DATA_FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
GLOB_CHARS = re.compile(r"[*?\[]")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
# A hub repository's revisions: its default branch, a commit, and what a branch, tag or pull
# request may be called ("v1.0", "refs/pr/3"; no "..": it names a file under the cache's refs/).
MAIN = "main"
COMMIT_HASH = re.compile(r"[0-9a-f]{40}")
REVISION = re.compile(r"(?!.*\.\.)[\w][\w./-]*")
# What makes a directory a model's weights, and a tokenizer's.
WEIGHT_PATTERNS = ("*.safetensors", "*.bin", "*.safetensors.index.json", "*.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")
# datasets' save_to_disk: a Dataset has both files, a DatasetDict the third.
SAVED_DATASET_FILES = ("dataset_info.json", "state.json")
SAVED_DATASET_DICT_FILE = "dataset_dict.json"


def is_glob(text: str) -> bool:
    return bool(GLOB_CHARS.search(text))


def is_hub_id(text: str) -> bool:
    """A name that can only be a hub repository ("org/name" or "name"), not a local path: no
    leading / . ~, no data file suffix, at most one slash."""
    return bool(HUB_ID.match(text)) and ".." not in text and Path(text).suffix not in DATA_FILE_BUILDERS


def is_saved_dataset(path: str | os.PathLike) -> bool:
    """A directory written by datasets' save_to_disk (a Dataset or a DatasetDict)."""
    p = Path(path)
    return (p / SAVED_DATASET_DICT_FILE).is_file() or all((p / f).is_file() for f in SAVED_DATASET_FILES)


def expand_data_files(patterns: Sequence[str], where: str) -> list[Path]:
    """Files and globs -> the files, in order (a glob's sorted). Every entry must name at least one
    file, and all of one format; raises FileNotFoundError or ValueError naming `where`."""
    out: list[Path] = []
    for pattern in patterns:
        pattern = os.path.expanduser(str(pattern))
        if is_glob(pattern):
            found = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
            if not found:
                raise FileNotFoundError(f"{where}: no file matches {pattern}")
            out += found
        elif Path(pattern).is_file():
            out.append(Path(pattern))
        elif Path(pattern).exists():
            raise ValueError(f"{where}: {pattern} is not a file")
        else:
            raise FileNotFoundError(f"{where}: {pattern} does not exist")
    builders = {DATA_FILE_BUILDERS.get(p.suffix) for p in out}
    if None in builders:
        bad = next(p for p in out if p.suffix not in DATA_FILE_BUILDERS)
        raise ValueError(f"{where}: {bad}: unknown data file format (want {', '.join(DATA_FILE_BUILDERS)})")
    if len(builders) > 1:
        raise ValueError(f"{where}: the files mix formats ({', '.join(sorted(builders))}); give files of one format")
    return out


def data_files_in(directory: str | os.PathLike) -> list[Path]:
    """The data files datasets.load_dataset(directory) would read (hidden ones skipped)."""
    root = Path(directory)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith((".", "_")))
        found += [Path(dirpath) / f for f in sorted(filenames)
                  if not f.startswith((".", "_")) and Path(f).suffix in DATA_FILE_BUILDERS]
    return found


def hub_cache_dirs(env: Mapping[str, str]) -> tuple[Path, Path]:
    """(hub cache, datasets cache) under environment `env`, as huggingface_hub and datasets find them."""
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                                             "huggingface")
    hub = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    data = env.get("HF_DATASETS_CACHE") or os.path.join(home, "datasets")
    return Path(os.path.expanduser(hub)), Path(os.path.expanduser(data))


def cached_snapshot(repo_id: str, repo_type: str, hub_cache: Path, revision: str = MAIN) -> Path | None:
    """The snapshot directory of `repo_id` at `revision` in a hub cache, or None: a branch or tag
    (refs/<revision>, as huggingface_hub writes it) or a full commit hash (its snapshot's name); for
    "main" without a refs/main (a cache filled by copying snapshots), the newest snapshot."""
    repo = hub_cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshots = repo / "snapshots"
    try:
        ref = (repo / "refs" / revision).read_text().strip()
        if (snapshots / ref).is_dir():
            return snapshots / ref
    except OSError:
        pass
    if revision != MAIN:
        return snapshots / revision if COMMIT_HASH.fullmatch(revision) and (snapshots / revision).is_dir() else None
    try:
        found = [p for p in snapshots.iterdir() if p.is_dir()]
    except OSError:
        return None
    return max(found, key=lambda p: p.stat().st_mtime) if found else None


def cached_prepared_dataset(repo_id: str, datasets_cache: Path) -> Path | None:
    """A dataset that datasets.load_dataset(repo_id) prepared before (its own cache's layout)."""
    path = datasets_cache / repo_id.replace("/", "___")
    return path if path.is_dir() else None


def download_hint(repo_id: str, repo_type: str = "model", revision: str = MAIN) -> str:
    flag = "" if repo_type == "model" else f" --repo-type {repo_type}"
    flag += "" if revision == MAIN else f" --revision {revision}"
    return (f"compute nodes run offline (HF_HUB_OFFLINE=1): download it on a login node first with "
            f"`huggingface-cli download{flag} {repo_id}` (or `hf download{flag} {repo_id}`), or give a local path")
