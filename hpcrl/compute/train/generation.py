"""A generation as the training loop holds it: asked for (``Requested``: prompts, the weight
version its completions must carry, the generator's handle) and then scored and packed
(``Generation``: what its optimizer steps share). A checkpoint keeps the generation being trained
on whole, so that a resumed run finishes it on exactly its completions, and of those asked for
ahead only the prompts (hpcrl.compute.train.ahead)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from hpcrl.compute.inference.types import Completion, PendingGeneration, check_version
from hpcrl.compute.train import data as data_mod

__all__ = ["Requested", "Generation", "updated_in_flight"]


@dataclass
class Requested:
    """A generation asked for: its prompts, the weight version the generator had then (its
    completions carry it or a later one), and the generator's handle until they are taken."""
    batch: data_mod.PromptBatch
    version: int
    pending: PendingGeneration | None
    completions: list[Completion] | None = None
    wait_s: float = 0.0         # time the trainer was blocked on it: the generation it could not hide
    # A row per rollout, as rolled out (an environment may add to a prompt); None: each prompt n times.
    rows: data_mod.PromptBatch | None = None

    def rollout_rows(self, n: int) -> data_mod.PromptBatch:
        return self.rows if self.rows is not None else self.batch.repeat(n)

    def take(self) -> list[Completion]:
        if self.completions is None:
            t0 = time.perf_counter()
            completions = self.pending.result()
            self.wait_s += time.perf_counter() - t0
            check_version(completions, self.version)
            self.completions, self.pending = completions, None
        return self.completions


@dataclass(frozen=True)
class Generation:
    """A generation scored and ready to train on: what its optimizer steps share.

    The counts (completion tokens, loss tokens, completions, truncated ones) are over all trainers,
    the tensors this rank's. ``wait_s`` and ``logps_s`` are the time this process spent waiting for its
    completions and computing its fixed log-probabilities; the first step on it reports them (a
    generation restored from a checkpoint has them at 0 and its first step done).
    """
    tensors: dict[str, torch.Tensor]        # pack_batch's
    advantages: torch.Tensor
    old_logps: torch.Tensor | None          # the policy's before the first step (None: not needed)
    ref_logps: torch.Tensor | None          # the reference model's (None: beta = 0)
    completion_tokens: float                # generated
    loss_tokens: float                      # the loss's num_items_in_batch (grpo.mask_truncated_completions)
    completions: float
    truncated: float                        # completions cut at max_completion_length
    reward_stats: dict[str, float]
    lag: int                                # weight versions its oldest completion is behind the policy
    wait_s: float = 0.0
    # Weight syncs between its completions' sampling and the policy it trains (mean, max).
    staleness: tuple[float, int] = (0.0, 0)
    logps_s: float = 0.0
    # The share of its completions with tokens of more than one weight version (in-flight syncs).
    updated_in_flight: float = 0.0

    def state_dict(self, steps_done: int) -> dict:
        """The checkpoint's form, tensors on the host, with the optimizer steps done on it."""
        return _to_device(dict(tensors=self.tensors, advantages=self.advantages, old_logps=self.old_logps,
                               ref_logps=self.ref_logps,
                               gen_tokens=[self.completion_tokens, self.completions, self.truncated,
                                           self.loss_tokens],
                               rstats=self.reward_stats, done=steps_done, lag=self.lag,
                               staleness=list(self.staleness), updated_in_flight=self.updated_in_flight),
                          torch.device("cpu"))

    @classmethod
    def from_state(cls, state: dict | None, device: torch.device) -> "Generation | None":
        if state is None:
            return None
        state = _to_device(state, device)
        tokens, completions, truncated, *loss_tokens = state["gen_tokens"]     # (older checkpoints: 3)
        # Older checkpoints have no loss_mask: their completions had no tool tokens, so it is the completion mask.
        tensors = {"loss_mask": state["tensors"]["completion_mask"], **state["tensors"]}
        return cls(tensors=tensors, advantages=state["advantages"], old_logps=state["old_logps"],
                   ref_logps=state["ref_logps"], completion_tokens=tokens,
                   loss_tokens=loss_tokens[0] if loss_tokens else tokens, completions=completions,
                   truncated=truncated, reward_stats=state["rstats"], lag=state.get("lag", 0),
                   staleness=tuple(state.get("staleness", (0.0, 0))),
                   updated_in_flight=float(state.get("updated_in_flight", 0.0)))


def updated_in_flight(completions) -> float:
    """The share of ``completions`` with tokens of more than one weight version (in-flight syncs)."""
    return sum(c.token_versions is not None for c in completions) / max(1, len(completions))


def _to_device(obj, device):
    """Tensors in nested dicts/lists moved to ``device`` (a checkpointed generation goes via the host)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: _to_device(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj
