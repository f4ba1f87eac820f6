"""Group-relative advantages from the reward functions' rewards, as TRL's GRPOTrainer computes them.

One job: rewards ``[B, F]`` (B completions, F reward functions, NaN where a function returned None)
in, advantages ``[B]`` and the group statistics out; tests/compute/train/test_grpo_math.py holds them against TRL's
own ``_generate_and_score_completions`` on identical inputs.

Advantages are computed on the batch they are given, which must hold whole groups of G. The trainer
gives each rank its own completions: every trainer generates whole groups (a job spec is refused
unless num_generations divides a trainer's completions per step), so group-relative advantages need
no cross-rank gather, where TRL gathers the global batch and keeps each process's slice. Group means
and stds come out the same either way, but ``scale_rewards="batch"`` does not: its std is over this
trainer's batch (per_device_train_batch_size x gradient_accumulation_steps completions), TRL's over
the global batch, so the two agree only with one trainer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from hpcrl.job import metric_keys as mk

__all__ = ["SCALE_REWARDS", "nanstd", "combine_rewards", "group_advantages", "compute_advantages"]

SCALE_REWARDS = ("group", "batch", "none")


def nanstd(tensor: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """Bessel-corrected standard deviation ignoring NaNs (NaN when fewer than two values), as TRL's."""
    mean = torch.nanmean(tensor, dim=dim, keepdim=True)
    variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True)
    correction = torch.where(count > 1, count / (count - 1), torch.full_like(variance, math.nan))
    std = torch.sqrt(variance * correction)
    if keepdim:
        return std
    return std.squeeze() if dim is None else std.squeeze(dim)


def _scale_mode(scale_rewards: str | bool) -> str:
    # GRPOConfig maps the legacy booleans this way.
    mode = {True: "group", False: "none"}.get(scale_rewards, scale_rewards)
    if mode not in SCALE_REWARDS:
        raise ValueError(f"Invalid value for scale_rewards: {scale_rewards!r}. Must be one of {SCALE_REWARDS}.")
    return mode


def _weights(weights: Sequence[float] | Tensor | None, like: Tensor) -> Tensor:
    if weights is None:
        return torch.ones(like.shape[1], dtype=like.dtype, device=like.device)
    w = torch.as_tensor(weights, dtype=torch.float32).to(device=like.device, dtype=like.dtype)
    if w.numel() != like.shape[1]:
        raise ValueError(f"{w.numel()} reward weights for {like.shape[1]} reward functions")
    return w


def combine_rewards(rewards_per_func: Tensor, weights: Sequence[float] | Tensor | None = None) -> Tensor:
    """Weighted sum over reward functions: ``[B, F] -> [B]``.

    A function that returned None (NaN here) for a row counts as 0 for that row (TRL's nansum), but a
    row where *every* function returned None is unscorable and stays NaN: it is then left out of the
    group baseline and gets advantage 0.
    """
    rewards = (rewards_per_func * _weights(weights, rewards_per_func).unsqueeze(0)).nansum(dim=1)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    return rewards.masked_fill(unscorable, math.nan)


def group_advantages(
    rewards: Tensor, num_generations: int, scale_rewards: str | bool = "group"
) -> tuple[Tensor, dict[str, float]]:
    """Group-relative advantages of a batch ``rewards[B]`` of whole groups (NaN = unscorable row).

    ``(r - mean(group)) / (std + 1e-4)`` where std is the group's ("group"), that of all of
    ``rewards`` ("batch") or no scaling at all ("none"). Returns the advantages and TRL's reward
    statistics.
    """
    mode = _scale_mode(scale_rewards)
    g = num_generations
    grouped = rewards.view(-1, g)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(g, dim=0)
    if mode in ("group", "none"):
        # With scale_rewards="none" the std only feeds the frac_reward_zero_std statistic.
        std = nanstd(grouped, dim=1).repeat_interleave(g, dim=0) if g > 1 else torch.zeros_like(rewards)
    else:
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    advantages = rewards - mean
    if mode != "none":
        advantages = advantages / (std + 1e-4)
    stats = _reward_stats(rewards, std)
    return torch.nan_to_num(advantages, nan=0.0), stats


def compute_advantages(
    rewards_per_func: Tensor,
    num_generations: int,
    weights: Sequence[float] | Tensor | None = None,
    scale_rewards: str | bool = "group",
    aggregation: str = "sum_then_normalize",
) -> tuple[Tensor, dict[str, float]]:
    """Advantages from per-function rewards ``[B, F]`` with TRL's ``multi_objective_aggregation``.

    "sum_then_normalize" (default) is :func:`combine_rewards` then :func:`group_advantages`.
    "normalize_then_sum" (GDPO) normalises each function within its group first, sums with the weights,
    then normalises over the batch; ``scale_rewards`` does not apply there (as in TRL).
    """
    if aggregation == "sum_then_normalize":
        return group_advantages(combine_rewards(rewards_per_func, weights), num_generations, scale_rewards)
    if aggregation != "normalize_then_sum":
        raise ValueError(
            f"Invalid multi_objective_aggregation: {aggregation!r}. Must be 'sum_then_normalize' or "
            "'normalize_then_sum'."
        )
    w = _weights(weights, rewards_per_func)
    num_funcs = rewards_per_func.shape[1]
    grouped = rewards_per_func.view(-1, num_generations, num_funcs)
    mean_k = torch.nanmean(grouped, dim=1, keepdim=True)
    std_k = nanstd(grouped, dim=1, keepdim=True) if num_generations > 1 else torch.zeros_like(mean_k)
    reward_k = ((grouped - mean_k) / (std_k + 1e-4)).view(-1, num_funcs)
    rewards = (reward_k * w.unsqueeze(0)).nansum(dim=1)
    rewards = rewards.masked_fill(torch.isnan(rewards_per_func).all(dim=1), math.nan)
    std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    advantages = (rewards - torch.nanmean(rewards)) / (std + 1e-4)
    # The logged reward is the plain weighted sum, whatever the aggregation.
    stats = _reward_stats(combine_rewards(rewards_per_func, w), std)
    return torch.nan_to_num(advantages, nan=0.0), stats


def _reward_stats(rewards: Tensor, std: Tensor) -> dict[str, float]:
    is_std_zero = torch.isclose(std, torch.zeros_like(std))
    return {
        mk.REWARD: torch.nanmean(rewards).item(),
        mk.REWARD_STD: nanstd(rewards).item(),
        mk.FRAC_REWARD_ZERO_STD: is_std_zero.float().mean().item(),
    }
