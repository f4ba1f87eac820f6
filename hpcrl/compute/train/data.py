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


def load_prompts(source: str | os.PathLike, split: str | None = None, prompt_column: str = "prompt"):
    """Load a prompt dataset from a local ``.jsonl``/``.json`` file, a ``.parquet`` file, or a directory
    written by ``datasets``' ``save_to_disk`` (a ``DatasetDict`` needs ``split``, default "train").
    ``prompt_column`` is renamed to "prompt" (what the trainer and reward functions see).

    Returns a ``datasets.Dataset`` held in memory (no cache files next to the data or in $HOME).
    """
    import datasets

    path = Path(source)
    if path.is_dir():
        ds = datasets.load_from_disk(str(path), keep_in_memory=True)
        if isinstance(ds, datasets.DatasetDict):
            split = split or "train"
            if split not in ds:
                raise ValueError(f"{path}: no split {split!r} (splits: {', '.join(ds)})")
            ds = ds[split]
    elif path.suffix in (".jsonl", ".json"):
        ds = datasets.Dataset.from_json(str(path), keep_in_memory=True)
    elif path.suffix == ".parquet":
        ds = datasets.Dataset.from_parquet(str(path), keep_in_memory=True)
    elif not path.exists():
        raise FileNotFoundError(f"prompt dataset {path} does not exist")
    else:
        raise ValueError(f"{path}: unknown dataset format (want .jsonl, .json, .parquet or a save_to_disk dir)")
    if prompt_column not in ds.column_names:
        raise ValueError(f"{path}: no {prompt_column!r} column (data.prompt_column; columns: "
                         f"{', '.join(ds.column_names)})")
    if prompt_column != "prompt":
        ds = ds.rename_column(prompt_column, "prompt")
    return ds


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
