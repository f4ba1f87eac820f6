"""The trainer engine: what the GRPO loop asks of whatever holds the sharded policy.

The loop (hpcrl.compute.train.trainer) is the same for every engine: it runs the forward of
``engine.model``, hands each micro-batch's loss to ``backward`` and ends an optimizer step with
``step``. The engines differ only in how the model is wrapped, how a step is taken, how its
parameters are gathered for a sync (``sync_module``: the module whose parameters the sync and the
Hugging Face export walk, hpcrl.compute.sync.gather) and how training state is checkpointed.

- ``Fsdp2Engine`` (trainer.engine fsdp2, the default): the policy sharded by FSDP2
  (hpcrl.compute.train.fsdp), torch's AdamW over its DTensor shards, torch.distributed.checkpoint.
- ``DeepSpeedEngine`` (trainer.engine deepspeed, hpcrl.compute.train.deepspeed_engine): ZeRO-3.

Both build the optimizer from the recipe's grpo section (hpcrl.compute.train.optim) and step the
learning-rate schedule themselves after every optimizer step, skipped or not, so that a schedule
is the one TRL would run whichever engine trains.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpcrl.job.recipe import GRPOConfig

__all__ = ["TrainEngine", "Fsdp2Engine"]


class TrainEngine(ABC):
    """One trainer rank's engine. ``configure`` is called once, before the first step, with the
    run's grpo settings (max_steps resolved)."""

    name: str
    optimizer: Any = None
    scheduler: Any = None

    @property
    @abstractmethod
    def model(self) -> nn.Module:
        """What the loop calls for the policy's forward."""

    @property
    @abstractmethod
    def sync_module(self) -> nn.Module:
        """The module whose parameters a weight sync and the model export gather."""

    @abstractmethod
    def configure(self, grpo: GRPOConfig) -> None:
        """Build the optimizer and the learning-rate schedule."""

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        """Accumulate one micro-batch's gradients (the loss is already scaled for accumulation)."""

    @abstractmethod
    def step(self, max_grad_norm: float) -> float:
        """Clip to ``max_grad_norm`` (<= 0: measure only), take the optimizer step unless the norm
        is not finite, step the schedule, clear the gradients; returns the norm before clipping."""

    def learning_rate(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    @abstractmethod
    def save(self, directory: Path, step: int, extra: dict, *, keep: int, timeout_s: float) -> Path:
        """A training checkpoint after ``step`` steps (hpcrl.compute.train.checkpoint's layout and
        atomic commit); every trainer calls it."""

    @abstractmethod
    def load(self, path: Path, *, timeout_s: float) -> dict:
        """Load a checkpoint ``save`` wrote; returns this rank's ``extra`` with ``"step"``."""

    # The reference model, when grpo.sync_ref_model moves it: this rank's part of each parameter.
    @abstractmethod
    def local_parts(self, model: nn.Module) -> list[torch.Tensor]:
        """This rank's stored part of each parameter of ``model`` (a shard or a partition), in order."""

    @torch.no_grad()
    def mix_into_reference(self, reference: nn.Module, alpha: float) -> None:
        """grpo.sync_ref_model: ``reference = alpha * policy + (1 - alpha) * reference`` (TRL's
        SyncRefModelCallback), part by part: the policy and the reference are partitioned alike,
        so each rank mixes its own parts and nothing is gathered. The reference keeps its own dtype
        and device."""
        pairs = list(zip(self.local_parts(reference), self.local_parts(self.sync_module), strict=True))
        for r, p in pairs:
            if r.shape != p.shape:
                raise RuntimeError(f"reference part {tuple(r.shape)} and policy part {tuple(p.shape)} differ: "
                                   "the two models are not partitioned alike")
            r.mul_(1.0 - alpha).add_(p.to(device=r.device, dtype=r.dtype), alpha=alpha)


class Fsdp2Engine(TrainEngine):
    """The policy as hpcrl.compute.train.fsdp shards it (FSDP2 or HSDP, applied at load)."""

    name = "fsdp2"

    def __init__(self, policy: nn.Module) -> None:
        self.policy = policy

    @property
    def model(self) -> nn.Module:
        return self.policy

    @property
    def sync_module(self) -> nn.Module:
        return self.policy

    def configure(self, grpo: GRPOConfig) -> None:
        from hpcrl.compute.train.optim import build_optimizer, build_scheduler

        self.optimizer = build_optimizer(self.policy, grpo)
        self.scheduler = build_scheduler(self.optimizer, grpo)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, max_grad_norm: float) -> float:
        import math

        from hpcrl.compute.train.optim import clip_grad_norm

        norm = clip_grad_norm(self.policy.parameters(), max_grad_norm)
        if math.isfinite(norm):
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def save(self, directory: Path, step: int, extra: dict, *, keep: int, timeout_s: float) -> Path:
        from hpcrl.compute.train import checkpoint as ckpt

        return ckpt.save(directory, step, self.policy, self.optimizer, self.scheduler, extra=extra, keep=keep,
                         timeout_s=timeout_s)

    def load(self, path: Path, *, timeout_s: float) -> dict:
        from hpcrl.compute.train import checkpoint as ckpt

        return ckpt.load(path, self.policy, self.optimizer, self.scheduler, timeout_s=timeout_s)

    def local_parts(self, model: nn.Module) -> list[torch.Tensor]:
        from hpcrl.compute.train.fsdp import _local

        return [_local(p) for p in model.parameters()]
