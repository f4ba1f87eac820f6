"""Prompt datasets, the built-in demo task, and a deterministic, resumable prompt sampler.

A dataset is any table with a ``prompt`` column, either plain text or conversational (a list of
``{"role", "content"}`` messages, rendered with the tokenizer's chat template as TRL does). Every other
column travels with the prompt and reaches the reward functions as a keyword argument (TRL's contract),
e.g. the demo's ``answer``.
"""

from __future__ import annotations

import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "load_prompts",
    "load_mixture",
    "mixture_prompts",
    "is_conversational",
    "render_prompt",
    "encode_prompt",
    "PromptBatch",
    "make_batch",
    "demo_pairs",
    "demo_dataset",
    "PromptSampler",
]


# --------------------------------------------------------------------------------------------------
# Loading


def load_prompts(source: str | os.PathLike, split: str | None = None, prompt_column: str = "prompt", *,
                 config: str = "", data_files: Sequence[str] = (), split_field: str = "data.split"):
    """Load a prompt dataset as TRL's ``load_dataset(dataset_name, dataset_config)`` finds it:

    - a local ``.jsonl``/``.json``/``.parquet``/``.csv`` file, a glob of them, or ``data_files`` (a
      list of files or globs, ``source`` then unused): one split, "train";
    - a directory of such files (``datasets.load_dataset(dir)``: splits from the file names);
    - a directory written by ``datasets``' ``save_to_disk`` (a ``DatasetDict`` is selected by ``split``);
    - a hub dataset id in the Hugging Face cache: a snapshot downloaded with ``huggingface-cli download
      --repo-type dataset ID``, or one ``datasets.load_dataset(ID)`` prepared before (compute nodes
      run offline).

    ``config`` is the dataset's configuration (load_dataset's ``name``); ``split`` (default "train")
    is checked for every form. ``prompt_column`` is renamed to "prompt" (what the trainer and reward
    functions see). Every error is one line naming the recipe field. Returns a ``datasets.Dataset``
    held in memory.
    """
    import datasets

    from hpcrl.job import hfcache

    split = split or "train"
    text = str(source)
    path = Path(os.path.expanduser(text))
    if data_files or hfcache.is_glob(text) or path.is_file() or path.suffix in hfcache.DATA_FILE_BUILDERS:
        where = "data.data_files" if data_files else "data.path"
        files = hfcache.expand_data_files(list(data_files) or [text], where)
        if split != "train":
            raise ValueError(f"{split_field}: {split!r}: {where} is a file or files, whose only split is \"train\"")
        builder = hfcache.DATA_FILE_BUILDERS[files[0].suffix]
        reader = {"json": datasets.Dataset.from_json, "parquet": datasets.Dataset.from_parquet,
                  "csv": datasets.Dataset.from_csv}[builder]
        what = str(files[0]) if len(files) == 1 else f"{len(files)} files ({files[0]}, ...)"
        bad_line = (lambda: _first_bad_json_line(files)) if builder == "json" else None
        ds = _reading(where, what, lambda: reader([str(f) for f in files], keep_in_memory=True), bad_line)
    elif path.is_dir() and hfcache.is_saved_dataset(path):
        ds = _reading("data.path", str(path), lambda: datasets.load_from_disk(str(path), keep_in_memory=True))
        if isinstance(ds, datasets.DatasetDict):
            ds = _select_split(ds, split, split_field, str(path))
        elif split not in ("train", str(ds.split or "train")):
            raise ValueError(f"{split_field}: {split!r}: {path} is a single saved Dataset "
                             f"(split {str(ds.split or 'train')!r})")
    elif path.is_dir():
        if not hfcache.data_files_in(path):
            raise FileNotFoundError(f"data.path: {path} holds no data files ({', '.join(hfcache.DATA_FILE_BUILDERS)}) "
                                    f"and is no save_to_disk directory")
        ds = _select_split(_load_dataset(str(path), config, str(path)), split, split_field, str(path))
    elif path.exists():
        raise ValueError(f"data.path: {path}: unknown dataset format (want {', '.join(hfcache.DATA_FILE_BUILDERS)}, "
                         f"a directory of them, a save_to_disk directory or a cached hub dataset id)")
    elif hfcache.is_hub_id(text):
        ds = _select_split(_load_hub_dataset(text, config), split, split_field, text)
    else:
        raise FileNotFoundError(f"data.path: {text} does not exist")
    if prompt_column not in ds.column_names:
        raise ValueError(f"data.prompt_column: no {prompt_column!r} column in {text} (columns: "
                         f"{', '.join(ds.column_names)})")
    if prompt_column != "prompt":
        ds = ds.rename_column(prompt_column, "prompt")
    return ds


def load_mixture(sources: Sequence, test_split_size: int | float | None = None, seed: int = 0, *,
                 prompt_column: str | None = None):
    """TRL's ``get_dataset(DatasetMixtureConfig)`` (TRL 1.16) for ``data.datasets``: each source
    (hpcrl.job.recipe.DataSource, TRL's DatasetConfig) is ``datasets.load_dataset(path, name,
    data_dir, data_files, split)`` with only its ``columns`` kept; with fractions, the first
    ``round(share * N)`` rows of each; the sources concatenated in order; with ``test_split_size``
    split by ``train_test_split``, seeded here (TRL leaves it unseeded) so that every rank draws the
    same split. A hub id is read from the Hugging Face cache, as data.path's is. Returns TRL's
    ``DatasetDict``: "train", and "test" with test_split_size. Errors name the source's field;
    ``prompt_column``: every source must have it (concatenating one without it gives rows with no
    prompt)."""
    import datasets

    loaded = []
    for i, source in enumerate(sources):
        where = f"data.datasets[{i}]"
        files = source.data_files
        if isinstance(files, Mapping):
            files = {k: v if isinstance(v, str) else list(v) for k, v in files.items()}
        elif files is not None and not isinstance(files, str):
            files = list(files)
        path = _cached_hub_dataset(source.path)

        def load(path=path, files=files, source=source):
            return datasets.load_dataset(path=path, name=source.name, data_dir=source.data_dir, data_files=files,
                                         split=source.split, keep_in_memory=True)

        ds = _reading(where, _describe_source(source), load,
                      (lambda files=files: _first_bad_json_line(_local_files(files))) if source.path == "json" else None)
        if source.columns is not None:
            missing = [c for c in source.columns if c not in ds.column_names]
            if missing:
                raise ValueError(f"{where}.columns: no column {missing[0]!r} in {source.path} (columns: "
                                 f"{', '.join(ds.column_names)})")
            ds = ds.select_columns(list(source.columns))
        if prompt_column is not None and prompt_column not in ds.column_names:
            raise ValueError(f"{where}.columns: keeps no {prompt_column!r} column (data.prompt_column)"
                             if source.columns is not None else
                             f"data.prompt_column: no {prompt_column!r} column in {where} ({source.path}; "
                             f"columns: {', '.join(ds.column_names)})")
        loaded.append(ds)
    fractions = [s.fraction for s in sources]
    if fractions and fractions[0] is not None:
        weights = [f / sum(fractions) for f in fractions]
        total = min(len(ds) / w for ds, w in zip(loaded, weights) if w > 0)
        loaded = [ds.select(range(round(w * total))) for ds, w in zip(loaded, weights)]
    if not loaded:
        raise ValueError("data.datasets: the mixture has no datasets")
    try:
        mixed = datasets.concatenate_datasets(loaded)
    except ValueError as e:             # a column of one type here, another there
        raise ValueError(f"data.datasets: cannot concatenate the datasets (TRL's get_dataset could not either): "
                         f"{str(e).splitlines()[0]}") from None
    if test_split_size is None:
        return datasets.DatasetDict({"train": mixed})
    try:
        return mixed.train_test_split(test_size=test_split_size, seed=seed)
    except ValueError as e:
        raise ValueError(f"data.test_split_size: {test_split_size!r} of the mixture's {len(mixed)} rows: "
                         f"{str(e).splitlines()[0]}") from None


def mixture_prompts(sources: Sequence, split: str, prompt_column: str = "prompt", *,
                    test_split_size: int | float | None = None, seed: int = 0, split_field: str = "data.split"):
    """``split`` ("train", or "test" with test_split_size) of :func:`load_mixture` as a prompt
    dataset: ``prompt_column``, which every source must have, renamed to "prompt"."""
    mixture = load_mixture(sources, test_split_size, seed, prompt_column=prompt_column)
    ds = _select_split(mixture, split, split_field, "the mixture (data.datasets)")
    return ds.rename_column(prompt_column, "prompt") if prompt_column != "prompt" else ds


def _describe_source(source) -> str:
    from hpcrl.job.recipe import DATASET_BUILDERS

    if source.path not in DATASET_BUILDERS:
        return source.path
    return f"{source.path} data_files {source.data_files}" if source.data_files is not None else \
        f"{source.path} data_dir {source.data_dir}"


def _local_files(files) -> list[Path]:
    """The local files a load_dataset data_files (a file, a glob, a list or a split mapping of them) names."""
    import glob

    if files is None:
        return []
    values = files.values() if isinstance(files, Mapping) else [files]
    patterns = [p for v in values for p in ([v] if isinstance(v, str) else v)]
    return [Path(f) for p in patterns for f in sorted(glob.glob(os.path.expanduser(p), recursive=True))]


def _cached_hub_dataset(path: str) -> str:
    """A hub id's downloaded snapshot in the Hugging Face cache (read as a directory of data files,
    as data.path's is); anything else as it is (a prepared hub dataset is found offline by datasets)."""
    from hpcrl.job import hfcache
    from hpcrl.job.recipe import DATASET_BUILDERS

    if path in DATASET_BUILDERS or Path(os.path.expanduser(path)).exists() or not hfcache.is_hub_id(path):
        return path
    hub_cache, _ = hfcache.hub_cache_dirs(os.environ)
    snapshot = hfcache.cached_snapshot(path, "dataset", hub_cache)
    return str(snapshot) if snapshot is not None else path


def _root_cause(e: BaseException) -> BaseException:
    seen = set()
    while (e.__cause__ or e.__context__) is not None and id(e) not in seen:
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return e


def _reading(where: str, what: str, load, explain=None):
    """``load()``, with a corrupt file's error as one line naming the field and the root cause
    (``explain()``'s, when it finds one: the first line of JSON lines that is not JSON)."""
    try:
        return load()
    except Exception as e:
        root = _root_cause(e)
    found = explain() if explain is not None else None
    if found:
        raise ValueError(f"{where}: {found}") from root
    msg = str(root).strip().splitlines()[0] if str(root).strip() else type(root).__name__
    raise ValueError(f"{where}: cannot read {what}: {type(root).__name__}: {msg}") from root


def _first_bad_json_line(files: Sequence[Path]) -> str | None:
    """"FILE line N is not JSON (why)" for the first such line of JSON lines files (a .json file
    holding one JSON document is not looked at); None if every line parses."""
    import json

    for file in files:
        try:
            with open(file, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if number == 1 and file.suffix == ".json" and line.lstrip().startswith("["):
                        break
                    if not line.strip():
                        continue
                    try:
                        json.loads(line)
                    except ValueError as e:
                        return f"{file} line {number} is not JSON ({e})"
        except (OSError, UnicodeDecodeError) as e:
            return f"{file}: {e}"
    return None


def _select_split(ds, split: str, split_field: str, what: str):
    import datasets

    if not isinstance(ds, datasets.DatasetDict):
        return ds
    if split not in ds:
        raise ValueError(f"{split_field}: {what} has no split {split!r} (splits: {', '.join(ds)})")
    return ds[split]


def _load_dataset(target: str, config: str, what: str):
    """datasets.load_dataset(target, config): every split, in memory; a bad config named as data.config."""
    import datasets

    try:
        return datasets.load_dataset(target, name=config or None, keep_in_memory=True)
    except ValueError as e:
        if config and config in str(e):
            raise ValueError(f"data.config: {config!r}: {str(e).splitlines()[0]}") from None
        raise ValueError(f"data.path: cannot read {what}: {str(e).splitlines()[0]}") from e


def _load_hub_dataset(repo_id: str, config: str):
    """A hub dataset from the cache, never the network: its downloaded snapshot (read as a directory
    of data files), else what datasets.load_dataset prepared before (in offline mode)."""
    from hpcrl.job import hfcache

    hub_cache, datasets_cache = hfcache.hub_cache_dirs(os.environ)
    snapshot = hfcache.cached_snapshot(repo_id, "dataset", hub_cache)
    if snapshot is not None:
        return _load_dataset(str(snapshot), config, f"{repo_id} (cached at {snapshot})")
    if hfcache.cached_prepared_dataset(repo_id, datasets_cache) is None:
        raise FileNotFoundError(f"data.path: {repo_id} is neither a local path nor a dataset in the Hugging Face "
                                f"cache ({hub_cache}, {datasets_cache}); {hfcache.download_hint(repo_id, 'dataset')}")
    import datasets

    offline = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True       # the prepared copy, without asking the hub for a newer one
    try:
        return _load_dataset(repo_id, config, f"{repo_id} (cached in {datasets_cache})")
    finally:
        datasets.config.HF_HUB_OFFLINE = offline


# --------------------------------------------------------------------------------------------------
# Prompts to text and tokens


def is_conversational(prompt: Any) -> bool:
    """True for a list of chat messages (TRL's test: the first item is a dict with a "role")."""
    return isinstance(prompt, list) and len(prompt) > 0 and isinstance(prompt[0], Mapping) and "role" in prompt[0]


def render_prompt(prompt: str | list[dict], tokenizer, **chat_template_kwargs) -> str:
    """The text the model continues: plain prompts as they are, conversations through the chat
    template. As TRL's ``apply_chat_template``: after a user/tool turn the assistant header is added;
    a final assistant turn is continued (prefill) rather than closed."""
    if not is_conversational(prompt):
        return prompt
    last_role = prompt[-1]["role"]
    if last_role not in ("user", "tool", "assistant"):
        raise ValueError(f"Invalid role in the last message: {last_role}")
    return tokenizer.apply_chat_template(
        prompt,
        tokenize=False,
        add_generation_prompt=last_role != "assistant",
        continue_final_message=last_role == "assistant",
        **chat_template_kwargs,
    )


def encode_prompt(prompt: str | list[dict], tokenizer, **chat_template_kwargs) -> list[int]:
    """Token ids of :func:`render_prompt`. The chat template already holds its special tokens, so only
    plain prompts get the tokenizer's own (e.g. a BOS), as TRL tokenises them."""
    text = render_prompt(prompt, tokenizer, **chat_template_kwargs)
    return tokenizer(text, add_special_tokens=not is_conversational(prompt))["input_ids"]


@dataclass
class PromptBatch:
    """Rows of a prompt dataset, ready for the generator and the reward functions."""

    prompts: list  # as in the dataset (str or messages): what reward functions receive as `prompts`
    texts: list[str]  # rendered prompts
    prompt_ids: list[list[int]]
    columns: dict[str, list] = field(default_factory=dict)  # the other columns, for reward kwargs
    indices: list[int] = field(default_factory=list)  # dataset row of each prompt

    def __len__(self) -> int:
        return len(self.prompts)

    def repeat(self, n: int) -> PromptBatch:
        """Each prompt ``n`` times in a row: the layout of a GRPO group (TRL's RepeatSampler)."""

        def rep(xs: list) -> list:
            return [x for x in xs for _ in range(n)]

        return PromptBatch(
            rep(self.prompts), rep(self.texts), rep(self.prompt_ids),
            {k: rep(v) for k, v in self.columns.items()}, rep(self.indices),
        )  # fmt: skip


def make_batch(dataset, indices: Sequence[int], tokenizer, **chat_template_kwargs) -> PromptBatch:
    """Select ``indices`` of ``dataset`` and render and tokenise their prompts."""
    rows = dataset[list(indices)]  # column-major dict of lists
    prompts = rows.pop("prompt")
    texts = [render_prompt(p, tokenizer, **chat_template_kwargs) for p in prompts]
    ids = [encode_prompt(p, tokenizer, **chat_template_kwargs) for p in prompts]
    return PromptBatch(prompts, texts, ids, rows, list(indices))


# --------------------------------------------------------------------------------------------------
# The demo task


def demo_pairs(max_sum: int = 9) -> list[tuple[int, int]]:
    """The digit pairs ``(a, b)`` of the demo task: every pair whose sum is at most ``max_sum``."""
    return [(a, b) for a in range(10) for b in range(10) if a + b <= max_sum]


def demo_dataset(n: int = 1000, seed: int = 0, max_sum: int = 9, conversational: bool = False):
    """Tiny addition, e.g. prompt ``"3+4="``, answer ``"7"``: ``n`` rows drawn uniformly from the pairs
    of digits whose sum is at most ``max_sum`` (9: every answer is one token; 18: all digit pairs).

    The demo's model (``model.path: demo:tiny``) is warmed up on exactly these prompts until it
    answers right ~40% of the time (:mod:`hpcrl.compute.models.tiny`); from there GRPO with the demo rewards
    (:func:`hpcrl.compute.train.rewards.demo_correct`, :func:`~hpcrl.compute.train.rewards.demo_format`) raises
    ``demo_correct`` from ~0.6 to ~0.87 in the default 200 steps, a minute or two on a CPU. From
    random weights (``demo:tiny:random``) a random policy emits a digit first now and then, and the
    rewards' partial credit for a number close to the answer gives GRPO reward differences from the
    first step; but it learns slowly (with the default settings ``demo_correct`` 0.01 -> ~0.4 in 150
    steps, mostly partial credit, while completions still run to the length limit): learning the
    sums themselves takes a warmed-up (or pretrained) model.
    """
    import datasets

    pairs = demo_pairs(max_sum)
    rng = random.Random(seed)
    rows = {"prompt": [], "answer": []}
    for a, b in (rng.choice(pairs) for _ in range(n)):
        text = f"{a}+{b}="
        rows["prompt"].append([{"role": "user", "content": text}] if conversational else text)
        rows["answer"].append(str(a + b))
    return datasets.Dataset.from_dict(rows)


# --------------------------------------------------------------------------------------------------
# Sampling


class PromptSampler:
    """Endless, deterministic stream of prompt-index batches; resumable from ``state_dict()``.

    Epoch ``e`` visits the rows in the order of a permutation seeded by ``(seed, e)``, so the stream
    depends only on the seed and never on the history: restoring ``(epoch, position)`` continues it
    exactly. Batches run over epoch boundaries rather than dropping rows. Every rank draws the same
    global batch of ``batch_size`` prompts and keeps its contiguous share (as TRL slices by process).
    """

    def __init__(
        self, dataset, batch_size: int, seed: int = 0, *, shuffle: bool = True, rank: int = 0, world_size: int = 1
    ):
        self.num_rows = dataset if isinstance(dataset, int) else len(dataset)
        if self.num_rows == 0:
            raise ValueError("PromptSampler: the dataset is empty")
        if batch_size % world_size:
            raise ValueError(f"batch_size {batch_size} is not divisible by world_size {world_size}")
        self.batch_size, self.seed, self.shuffle = batch_size, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.epoch, self.position = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_rows))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_rows, generator=g).tolist()

    def __iter__(self) -> PromptSampler:
        return self

    def __next__(self) -> list[int]:
        """This rank's indices of the next global batch."""
        batch = []
        while len(batch) < self.batch_size:
            take = min(self.batch_size - len(batch), self.num_rows - self.position)
            batch += self._order[self.position : self.position + take]
            self.position += take
            if self.position == self.num_rows:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation(self.epoch)
        per_rank = self.batch_size // self.world_size
        return batch[self.rank * per_rank : (self.rank + 1) * per_rank]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_rows": self.num_rows}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if state.get("num_rows", self.num_rows) != self.num_rows:
            raise ValueError(
                f"sampler state is for a dataset of {state['num_rows']} rows, this one has {self.num_rows}"
            )
        self.seed = state.get("seed", self.seed)
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._permutation(self.epoch)
