"""The generation interface between trainers and whatever generates for them.

A trainer asks for `n` completions of each prompt and gets token ids, text and the sampling
log-probabilities of every generated token, stamped with the weight version that produced them.
The same types travel over the node-local channel (pickled) and come out of in-process engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence


@dataclass(frozen=True)
class Sampling:
    n: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0              # 0 = off
    seed: int | None = None
    min_p: float | None = None  # None = off
    repetition_penalty: float = 1.0
    # The engine's own sampling arguments (vLLM's SamplingParams, transformers' generate), applied
    # last, over the ones above (grpo.generation_kwargs, as TRL passes it).
    generation_kwargs: Mapping[str, Any] | None = None
    # grpo.vllm_structured_outputs_regex: what every completion must match (vLLM's structured outputs).
    structured_outputs_regex: str | None = None

    @classmethod
    def of(cls, grpo, n: int, seed: int) -> "Sampling":
        """A recipe's grpo sampling fields, for ``n`` completions a prompt (training's and evaluation's)."""
        return cls(n=n, max_tokens=grpo.max_completion_length, temperature=grpo.temperature, top_p=grpo.top_p,
                   top_k=grpo.top_k, seed=seed, min_p=grpo.min_p, repetition_penalty=grpo.repetition_penalty,
                   generation_kwargs=grpo.generation_kwargs,
                   structured_outputs_regex=grpo.vllm_structured_outputs_regex)


@dataclass(frozen=True)
class Completion:
    prompt_index: int           # which prompt of the request
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]  # log p(token) under the sampling distribution (after temperature)
    text: str
    truncated: bool             # stopped at max_tokens, not at end-of-sequence
    weight_version: int
    # A multi-turn rollout's (hpcrl.compute.agents): 1 where the model sampled the token, 0 where a
    # tool's result put it there (no loss, no length); None: every token is the model's.
    tool_mask: tuple[int, ...] | None = None
    # Its messages, as TRL hands a tool conversation to reward functions: assistant turns, tool results.
    messages: tuple[dict, ...] | None = None
    tool_use: Any = None        # hpcrl.compute.agents.agent_rollouts.ToolUse: calls, failures, turns, time
    # inference.weight_update = in_flight: each token's weight version where a sync landed while the
    # completion was being sampled (weight_version is then its first token's, the oldest); None: every
    # token's is weight_version.
    token_versions: tuple[int, ...] | None = None

    @property
    def model_tokens(self) -> int:
        """The tokens the model sampled (TRL's completion length: tool results do not count)."""
        return len(self.token_ids) if self.tool_mask is None else sum(self.tool_mask)


class StaleWeights(RuntimeError):
    """Completions were sampled with other weights than the trainer's current ones."""


class PendingGeneration(Protocol):
    """A generation asked for and not yet taken: `result()` waits for it (bounded)."""

    def result(self) -> list[Completion]:
        ...


@dataclass
class Generated:
    """A generation that is already done (what a generator that cannot overlap returns)."""
    completions: list[Completion]

    def result(self) -> list[Completion]:
        return self.completions


class Generator(Protocol):
    """What the trainer loop needs from generation.

    `submit` may return before the completions exist, so the trainer can train while they are
    sampled. Several may be outstanding (inference.max_staleness), and `push_weights` may run while
    they are: a generation not yet begun is then sampled with the new weights, and each completion
    says which version it had."""

    def submit(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> PendingGeneration:
        """len(prompts) * n completions, grouped by prompt (all n of prompt 0 first)."""

    def push_weights(self, model, version: int) -> dict:
        """Make generation use `model`'s current weights as `version` (collective over the node's
        trainers); returns what the sync measured (the gathers' byte counts; may be empty)."""


class Stream(Protocol):
    """Requests added one by one and taken as each is done (the agents' per-sample rollouts): the
    engines generate whatever is outstanding as one batch that requests join and leave while it
    runs, so a rollout back from its tools does not wait for the others' turns. Each request is
    one completion (``sampling.n`` = 1) whose draws its own ``sampling.seed`` decides, whatever it
    is batched with. A generator's weights do not change while one of its streams is open."""

    outstanding: int                # requests added and not yet taken

    def add(self, key: int, prompt_ids: Sequence[int], sampling: Sampling) -> None:
        """Ask for one completion of ``prompt_ids``, taken back under ``key``."""

    def take(self, timeout: float | None = None) -> list[tuple[int, Completion]]:
        """The requests done since the last take, as (key, completion). Waits up to ``timeout``
        seconds for one ([] after it); None: up to the generation's bound, then raises naming the
        engine that did not answer and the recipe fields that set the bound."""

    def close(self) -> None:
        """End the stream (every request taken); the generator may sync weights again."""


class StreamingGenerator(Generator, Protocol):
    """A generator that also takes requests one by one (``Stream``)."""

    def open_stream(self) -> Stream:
        ...


def check_version(completions: Sequence[Completion], oldest: int) -> None:
    """Completions asked for when the generator had weight version ``oldest`` are sampled with it
    or (asynchronous generation: a sync landed before their turn) a later one, never an earlier."""
    stale = {c.weight_version for c in completions if c.weight_version < oldest}
    if stale:
        raise StaleWeights(f"completions sampled with weight version(s) {sorted(stale)}, older than version "
                           f"{oldest}, which the generator had when they were asked for")
