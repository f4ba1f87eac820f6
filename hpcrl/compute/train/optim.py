"""Optimizer, learning-rate schedule and gradient clipping, with TRL's meaning of the settings.

- AdamW over the (sharded, DTensor) parameters; fused kernel where the device has one, else foreach;
  torchao's with block-quantized 8-bit moments for grpo.optim adamw_torch_8bit.
  Weight decay as Hugging Face's Trainer applies it: not on biases and normalisation weights.
- The schedule is ``transformers.get_scheduler`` itself, with warmup steps computed as TRL does
  (``warmup_steps`` as is, or ``ceil(max_steps * warmup_steps)`` for a fraction below 1), so a
  recipe's schedule is the one TRL would run
  (note HF's "constant" ignores warmup; "constant_with_warmup" does not).
- Gradient clipping over FSDP2's DTensor gradients: the total norm is a reduction across the mesh
  (each rank holds a shard), done the torchtitan way: norm of the local shards as a DTensor, then
  ``full_tensor()``, then one scale for every gradient.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from hpcrl.compute.partitioned import full_shape
from hpcrl.job.errors import UserError
from hpcrl.job.grpo_config import LOW_BIT_OPTIMS
from hpcrl.job.recipe import GRPOConfig

__all__ = [
    "no_decay",
    "param_groups",
    "build_optimizer",
    "low_bit_adamw",
    "warmup_steps",
    "build_scheduler",
    "clip_grad_norm",
    "current_lr",
]

# transformers.Trainer.get_decay_parameter_names: these parameters get no weight decay.
_NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


def no_decay(name: str, param: torch.Tensor) -> bool:
    """True for parameters excluded from weight decay (biases, norms, any 1-D parameter)."""
    # An engine's partitioned parameter (ZeRO-3) has an empty tensor of its own.
    ndim = len(full_shape(param))
    return bool(_NO_DECAY.search(name.lower())) or ndim < 2


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two AdamW groups: decayed matrices, undecayed biases/norms (empty groups dropped)."""
    decay, rest = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (rest if no_decay(name, p) else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def _fused_ok(params: list[torch.Tensor]) -> bool:
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    devices = {(p.to_local() if isinstance(p, DTensor) else p).device.type for p in params}
    dtypes = {p.dtype for p in params}
    return (devices <= set(_get_fused_kernels_supported_devices())
            and dtypes <= {torch.float32, torch.float16, torch.bfloat16, torch.float64})


def build_optimizer(model: nn.Module, grpo: GRPOConfig, *, implementation: str = "auto") -> torch.optim.Optimizer:
    """AdamW from a recipe's ``grpo`` section (learning_rate, adam_beta1/2, adam_epsilon, weight_decay, optim).

    ``implementation``: "auto" (``grpo.optim``: "adamw_torch_fused" is fused where supported, else
    foreach; "adamw_torch" is torch's own default, as transformers builds it; "adamw_torch_8bit" is
    :func:`low_bit_adamw`), "fused", "foreach", "for" or "default" (torch's choice).
    """
    groups = param_groups(model, grpo.weight_decay)
    params = [p for g in groups for p in g["params"]]
    if not params:
        raise ValueError("build_optimizer: the model has no trainable parameters")
    if implementation == "auto" and grpo.optim in LOW_BIT_OPTIMS:
        return low_bit_adamw(groups, grpo)
    if implementation == "auto":
        if grpo.optim not in ("adamw_torch", "adamw_torch_fused"):
            raise ValueError(f"grpo.optim {grpo.optim!r}: hpcrl's optimizer is AdamW (adamw_torch, adamw_torch_fused)")
        implementation = "default" if grpo.optim == "adamw_torch" else "fused" if _fused_ok(params) else "foreach"
    kw = {"fused": implementation == "fused", "foreach": implementation == "foreach"}
    if implementation not in ("fused", "foreach", "for", "default"):
        raise ValueError(f"unknown AdamW implementation {implementation!r}")
    if implementation == "for":
        kw = {"fused": False, "foreach": False}
    elif implementation == "default":
        kw = {}
    return torch.optim.AdamW(groups, lr=grpo.learning_rate, betas=(grpo.adam_beta1, grpo.adam_beta2),
                             eps=grpo.adam_epsilon, **kw)


def low_bit_adamw(groups: list[dict[str, Any]], grpo: GRPOConfig) -> torch.optim.Optimizer:
    """torchao's AdamW8bit, as transformers builds it for adamw_torch_8bit (blocks of 256, no
    stochastic rounding): the two moments of every parameter of at least 4,096 values (of its
    shard, and a whole number of blocks) quantized block by block, the rest in fp32; FSDP2's DTensor
    shards are what torchao's optimizers are written for. Its step is torch.compile'd, once per
    parameter shape (seconds each, at the first step). The learning rate is a tensor in the groups:
    transformers' schedules fill it in place. Checkpoints hold the moments dequantized, in fp32, so
    a resume on another number of trainers requantizes its own blocks."""
    try:
        from torchao.optim import AdamW8bit
    except ImportError as e:
        raise UserError(f"grpo.optim: {grpo.optim} needs torchao in the tasks' Python environment (pip install "
                        f"torchao; the login node checks where the tasks run its own Python): {e}") from None
    return AdamW8bit(groups, lr=grpo.learning_rate, betas=(grpo.adam_beta1, grpo.adam_beta2),
                     eps=grpo.adam_epsilon, block_size=256, bf16_stochastic_round=False)


def warmup_steps(max_steps: int, warmup: float) -> int:
    """Warmup steps as transformers computes them (TrainingArguments.get_warmup_steps): a whole
    number is steps, a fraction below 1 is a share of ``max_steps``."""
    return math.ceil(max_steps * warmup) if 0 < warmup < 1 else int(warmup)


def build_scheduler(optimizer: torch.optim.Optimizer, grpo: GRPOConfig) -> torch.optim.lr_scheduler.LRScheduler:
    """``transformers.get_scheduler(grpo.lr_scheduler_type, ...)`` over ``grpo.max_steps`` steps, with
    ``grpo.lr_scheduler_kwargs`` as its scheduler_specific_kwargs.

    Call ``scheduler.step()`` once after each ``optimizer.step()``; ``state_dict()`` is what the
    checkpoint keeps.
    """
    from transformers import get_scheduler

    return get_scheduler(grpo.lr_scheduler_type, optimizer,
                         num_warmup_steps=warmup_steps(grpo.max_steps, grpo.warmup_steps),
                         num_training_steps=grpo.max_steps,
                         scheduler_specific_kwargs=dict(grpo.lr_scheduler_kwargs or {}))


@torch.no_grad()
def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                   foreach: bool | None = None) -> float:
    """Clip gradients (plain or DTensor, FSDP/HSDP) to ``max_norm``; return the total norm before clipping.

    ``max_norm <= 0`` only measures (TRL/HF skip clipping then). Every rank of the mesh must call it
    (the norm is a collective). A non-finite norm is returned as is and nothing is scaled, so the
    caller can skip the step.
    """
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return 0.0
    grads = [p.grad for p in params]
    total = torch.nn.utils.get_total_norm(grads, norm_type=norm_type, error_if_nonfinite=False, foreach=foreach)
    if isinstance(total, DTensor):
        # Partial (summed over the shard dim, replicated over the replicate dim) -> one number.
        total = total.full_tensor()
    norm = float(total)
    if max_norm > 0 and math.isfinite(norm):
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=foreach)
    return norm


def current_lr(optimizer: torch.optim.Optimizer) -> float:
    """The learning rate of the first parameter group (what the metrics report)."""
    lr = optimizer.param_groups[0]["lr"]
    return float(lr)
