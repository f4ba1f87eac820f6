"""The generation interface between trainers and whatever generates for them.

A trainer asks for `n` completions of each prompt and gets token ids, text and the sampling
log-probabilities of every generated token, stamped with the weight version that produced them.
The same types travel over the node-local channel (pickled) and come out of in-process engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence


@dataclass(frozen=True)
class Sampling:
    n: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0              # 0 = off
    seed: int | None = None


@dataclass(frozen=True)
class Completion:
    prompt_index: int           # which prompt of the request
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # log p(token) under the sampling distribution (after temperature)
    text: str
    truncated: bool             # stopped at max_tokens, not at end-of-sequence
    weight_version: int


class StaleWeights(RuntimeError):
    """Completions were sampled with other weights than the trainer's current ones."""


class Generator(Protocol):
    """What the trainer loop needs from generation."""

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Completion]:
        """len(prompts) * n completions, grouped by prompt (all n of prompt 0 first)."""

    def push_weights(self, model, version: int) -> dict:
        """Make generation use `model`'s current weights as `version` (collective over the node's
        trainers); returns timings."""


def check_version(completions: Sequence[Completion], expected: int) -> None:
    stale = {c.weight_version for c in completions if c.weight_version != expected}
    if stale:
        raise StaleWeights(f"completions sampled with weight version(s) {sorted(stale)}, trainer is at {expected}")
