"""The entropy bonus's coefficient, step by step: grpo.entropy_coef as it is, or TRL's adaptive
entropy control (grpo.use_adaptive_entropy, from Skywork-OR1) as GRPOTrainer._compute_loss runs it.

Adaptive: every micro-batch of an optimizer step applies the coefficient left by the step before,
and only while that step's entropy was at or below grpo.entropy_target (none before the first
measurement); after the step, the entropy of its loss tokens over every trainer (their sum over
their count, not a mean of means) moves the coefficient by entropy_coef_delta, up at or below the
target, down above it, within [entropy_coef_min, entropy_coef_max]. A checkpoint keeps both numbers.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from hpcrl.compute.train.rank_metrics import global_sum
from hpcrl.job.grpo_config import GRPOConfig

__all__ = ["EntropyControl"]


class EntropyControl:
    def __init__(self, grpo: GRPOConfig):
        self.grpo = grpo
        self.adaptive = grpo.use_adaptive_entropy
        self.coef = grpo.entropy_coef
        self.last_entropy = math.inf        # TRL's: no bonus until a step has measured the entropy
        self._window = torch.zeros(2)       # this step's sum of loss-token entropies, and their count

    @property
    def enabled(self) -> bool:
        """Whether the loss has an entropy bonus at all (then it needs the entropies): for the whole
        run, as the adaptive coefficient can come back from 0."""
        return self.coef != 0.0 or self.adaptive

    def applied(self) -> float:
        """The coefficient the micro-batches of the step under way apply."""
        if self.adaptive and not self.last_entropy <= self.grpo.entropy_target:
            return 0.0
        return self.coef

    def observe(self, entropies: Tensor, acting: Tensor) -> None:
        """A micro-batch's token entropies over the tokens the bonus acts on (``acting``: the loss
        mask, times the high-entropy mask where there is one)."""
        if self.adaptive:
            acting = acting.detach().float()
            self._window += torch.stack([(entropies.detach().float() * acting).sum(), acting.sum()]).cpu()

    def step_done(self, group=None, reduce=global_sum) -> None:
        """After an optimizer step, on every trainer: ``reduce(values, group)`` sums over them (a
        collective) when adaptive."""
        if not self.adaptive:
            return
        total, count = reduce(self._window.tolist(), group)
        self._window.zero_()
        entropy = total / max(count, 1.0)
        g = self.grpo
        if entropy <= g.entropy_target:
            self.coef = min(self.coef + g.entropy_coef_delta, g.entropy_coef_max)
        else:
            self.coef = max(self.coef - g.entropy_coef_delta, g.entropy_coef_min)
        self.last_entropy = entropy

    def state_dict(self) -> dict:
        return {"entropy_coef": self.coef, "last_world_entropy": self.last_entropy}

    def load_state_dict(self, state: dict | None) -> None:
        """A checkpoint's numbers (one from before this controller, or of a run without it: the start)."""
        if self.adaptive and state:
            self.coef, self.last_entropy = float(state["entropy_coef"]), float(state["last_world_entropy"])
