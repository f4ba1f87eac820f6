"""The trainer engine: what the GRPO loop asks of whatever holds the sharded policy, and the one
place a training backend is named (``TRAIN_ENGINES``, trainer.engine's values).

The loop (hpcrl.compute.train.trainer) is the same for every engine: it runs the forward of
``engine.model``, hands each micro-batch's loss to ``backward`` and ends an optimizer step with
``step``. The engines differ in how the models are loaded and partitioned (``build``, which also
checks every part landed on the task's device), how a step is taken, which module a sync and the
Hugging Face export gather (``sync_module``; a partitioning torch cannot see is reached through
hpcrl.compute.partitioned) and how training state is checkpointed and read back (``save``,
``load``, ``checkpoint_tensors``).

- ``Fsdp2Engine`` (fsdp2, the default; hpcrl.compute.train.fsdp): the policy sharded by FSDP2,
  torch's AdamW over its DTensor shards, torch.distributed.checkpoint.
- ``DeepSpeedEngine`` (deepspeed; hpcrl.compute.train.deepspeed_engine): ZeRO-3.

Both build the optimizer from the recipe's grpo section (hpcrl.compute.train.optim) and step the
learning-rate schedule themselves after every optimizer step, skipped or not, so that a schedule
is the one TRL would run whichever engine trains. A third engine is a module with a subclass and
one line in ``TRAIN_ENGINES`` (and the value in hpcrl.job.recipe's trainer.engine).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional

import torch
from torch import nn

from hpcrl.job.recipe import GRPOConfig

if TYPE_CHECKING:
    from hpcrl.compute.launch.context import LaunchContext

__all__ = ["TrainEngine", "TRAIN_ENGINES", "engine_class", "engine_that_wrote", "StoredTensors"]

# trainer.engine -> the engine's class, imported only when asked for (DeepSpeed's import is slow).
TRAIN_ENGINES: dict[str, str] = {
    "fsdp2": "hpcrl.compute.train.fsdp:Fsdp2Engine",
    "deepspeed": "hpcrl.compute.train.deepspeed_engine:DeepSpeedEngine",
}

# A checkpoint's model tensors as an export reads them: name -> (shape, dtype), and a reader that
# takes [(name, shape, dtype)] and a tracker of live bytes and returns those tensors.
StoredTensors = tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], Callable]


class TrainEngine(ABC):
    """One trainer rank's engine. ``configure`` is called once, before the first step, with the
    run's grpo settings (max_steps resolved)."""

    name: ClassVar[str]
    optimizer: Any = None
    scheduler: Any = None

    @classmethod
    @abstractmethod
    def build(cls, ctx: LaunchContext, model_dir: str, device: torch.device,
              read_groups: Optional[list[list[int]]]) -> tuple[TrainEngine, Optional[nn.Module]]:
        """The engine over the policy loaded from ``model_dir`` and the reference (None without
        grpo.beta), each part checked to be on ``device`` (or offloaded where the recipe says).
        ``read_groups``: the trainers of each node when every node reads its own staged copy."""

    @abstractmethod
    def describe(self) -> str:
        """One line for the startup log: how the policy is partitioned here."""

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
        """Load a checkpoint ``save`` wrote; returns this rank's ``extra`` with ``"step"``. Starts
        with :meth:`ensure_wrote`."""

    @classmethod
    @abstractmethod
    def checkpoint_tensors(cls, path: Path) -> StoredTensors:
        """The model tensors of a checkpoint this engine wrote, read without the engine (the export)."""

    @classmethod
    @abstractmethod
    def wrote(cls, path: Path) -> bool:
        """Whether this engine wrote the training checkpoint ``path`` (by its files)."""

    @classmethod
    def ensure_wrote(cls, path: Path) -> None:
        """A resume reads a checkpoint with the engine that wrote it: the formats differ."""
        from hpcrl.compute.train.checkpoint import CheckpointError

        writer = engine_that_wrote(path)
        if writer is not cls:
            raise CheckpointError(f"{path} was written by the {writer.name} engine; this run's trainer.engine is "
                                  f"{cls.name}: resume with the engine that wrote it")

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


def engine_class(name: str) -> type[TrainEngine]:
    """The engine class trainer.engine ``name`` stands for."""
    if name not in TRAIN_ENGINES:
        raise ValueError(f"trainer.engine {name!r}: one of {', '.join(TRAIN_ENGINES)}")
    module, _, attr = TRAIN_ENGINES[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def engine_that_wrote(path: Path) -> type[TrainEngine]:
    """The engine whose files the training checkpoint ``path`` holds."""
    for name in TRAIN_ENGINES:
        engine = engine_class(name)
        if engine.wrote(path):
            return engine
    raise ValueError(f"{path}: no trainer engine's checkpoint files ({', '.join(TRAIN_ENGINES)})")
