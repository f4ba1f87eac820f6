"""GRPO math as pure torch functions, numerically matching TRL 1.16's GRPOTrainer.

The trainer owns the model, the data and the processes; everything here is a function of tensors, so
tests/test_grpo_math.py can hold each piece against TRL's own code on identical inputs.

Conventions (TRL's):
  B sequences, T completion tokens (right padded), G generations per prompt, F reward functions.
  ``completion_mask`` is the loss mask: 1 for tokens that count (multiply a tool mask in before calling).

Advantages are computed on the batch they are given, which must hold whole groups of G. The trainer
gives each rank its own completions: every trainer generates whole groups (a job spec is refused
unless num_generations divides a trainer's completions per step), so group-relative advantages need
no cross-rank gather, where TRL gathers the global batch and keeps each process's slice. Group means
and stds come out the same either way, but ``scale_rewards="batch"`` does not: its std is over this
trainer's batch (per_device_train_batch_size x gradient_accumulation_steps completions), TRL's over
the global batch, so the two agree only with one trainer.

Distributed normalisation: TRL scales each micro-batch's loss so that, after gradients are *averaged*
over ranks (DDP, or FSDP's default reduce-scatter) and *summed* over gradient-accumulation steps, the
result is the loss of the whole optimizer batch. ``grpo_loss`` takes the same knobs
(``num_items_in_batch``, ``num_processes``, ``gradient_accumulation_steps``, ``steps_per_generation``).

Metrics are returned as :class:`Metric` partials (local sum and count, or local min / max), so that a
distributed trainer reduces them exactly as TRL's ``accelerator.reduce``/``gather`` calls do;
:func:`reduce_metrics` does that with one collective per reduction kind.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from hpcrl.job import metric_keys as mk
from hpcrl.job.recipe import TrainerConfig

__all__ = [
    "LOSS_TYPES",
    "SCALE_REWARDS",
    "IS_MODES",
    "Metric",
    "reduce_metrics",
    "nanstd",
    "selective_log_softmax",
    "entropy_from_logits",
    "DEFAULT_LOGPROB_CHUNK_TOKENS",
    "token_logprobs",
    "token_logprobs_unchunked",
    "completion_logprobs",
    "combine_rewards",
    "group_advantages",
    "compute_advantages",
    "reward_func_stats",
    "truncated_mask",
    "sampling_importance_ratio",
    "off_policy_mask",
    "gamma_weights",
    "grpo_loss",
]

# Loss types of TRL 1.16; the clipped-surrogate family shares one per-token loss.
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
_CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
SCALE_REWARDS = ("group", "batch", "none")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


# --------------------------------------------------------------------------------------------------
# Metrics


@dataclass
class Metric:
    """One logged scalar as local partials, combined over ranks by :func:`reduce_metrics`.

    op="mean": ``value`` is a local sum and ``count`` its weight; the result is sum(value)/sum(count).
    op="min"/"max": ``value`` is the local extreme (NaN when this rank has nothing), ``count`` unused.
    """

    value: Tensor
    count: Tensor | float = 1.0
    op: str = "mean"


def _mean(value: Tensor, count: Tensor | float) -> Metric:
    return Metric(value.detach().float(), torch.as_tensor(count, dtype=torch.float32, device=value.device))


def reduce_metrics(metrics: Mapping[str, Metric], group: dist.ProcessGroup | None = None) -> dict[str, float]:
    """Combine metric partials over the ranks of ``group`` (or locally if torch.distributed is not up)."""
    names = {op: [k for k, m in metrics.items() if m.op == op] for op in ("mean", "min", "max")}
    distributed = dist.is_available() and dist.is_initialized()
    out: dict[str, float] = {}
    if names["mean"]:
        sums = torch.stack(
            [
                torch.stack([metrics[k].value.float(), torch.as_tensor(metrics[k].count).to(metrics[k].value)])
                for k in names["mean"]
            ]
        )
        if distributed:
            dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        # Weights of zero read as 0.0, as TRL's `totals[0] / totals[1].clamp(min=1.0)`.
        for k, v in zip(names["mean"], (sums[:, 0] / sums[:, 1].clamp(min=1.0)).tolist()):
            out[k] = v
    for op, fill, rop in (("min", math.inf, "MIN"), ("max", -math.inf, "MAX")):
        if not names[op]:
            continue
        # NaN would poison MIN/MAX; park it at the neutral element and turn it back into NaN after.
        vals = torch.stack([metrics[k].value.float().nan_to_num(nan=fill) for k in names[op]])
        if distributed:
            dist.all_reduce(vals, op=getattr(dist.ReduceOp, rop), group=group)
        for k, v in zip(names[op], vals.tolist()):
            out[k] = v if math.isfinite(v) else math.nan
    return out


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


# --------------------------------------------------------------------------------------------------
# Log-probabilities

DEFAULT_LOGPROB_CHUNK_TOKENS = TrainerConfig.logprob_chunk_tokens      # the recipe's default


def selective_log_softmax(logits: Tensor, index: Tensor) -> Tensor:
    """``log_softmax(logits)[..., index]`` without materialising the full log-softmax."""
    logz = torch.logsumexp(logits, dim=-1)
    return logits.gather(-1, index.unsqueeze(-1)).squeeze(-1) - logz


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Shannon entropy (nats) of softmax(logits) over the last axis."""
    # -sum p log p rather than logZ - E[z]: no cancellation between two large numbers.
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _tempered_chunk(logits: Tensor, start: int, t: int, lo: int, hi: int, temperature: float) -> Tensor:
    """The fp32 tempered logits of the scored tokens ``lo..hi`` (flat over ``[B, T]``), ``[hi - lo, V]``.

    Token ``k`` is position ``start + k % t`` of row ``k // t`` of ``logits`` ``[B, L, V]``. Always a
    fresh buffer (never a view of ``logits``), so callers may work in it in place.
    """
    z = torch.empty((hi - lo, logits.shape[-1]), dtype=torch.float32, device=logits.device)
    for row in range(lo // t, (hi - 1) // t + 1):
        a, b = max(lo - row * t, 0), min(hi - row * t, t)
        z[row * t + a - lo : row * t + b - lo].copy_(logits[row, start + a : start + b])
    if temperature != 1.0:
        z.div_(temperature)
    return z


class _ChunkedLogprobs(torch.autograd.Function):
    """Selected-token log-probabilities (and optionally entropies) of ``logits / temperature`` in fp32,
    ``chunk`` tokens at a time, in forward and in backward.

    Autograd over the plain expression keeps the fp32 upcast of every token's logits for
    logsumexp's backward, and chunking it under autograd would not help (each chunk's input is
    saved all the same). So this function keeps for backward only the logits as they came (compute
    dtype, shared with the caller, no copy) and the per-token logsumexp, and its backward recomputes
    the softmax a chunk at a time, writing each chunk's gradient straight into the logits' gradient.

    The backward performs the operations autograd performs on the unchunked expression, in the same
    order: ``(-g) * exp(z - lse)``, then ``+ g`` at the target (the gather's scatter), then ``/ T``,
    then the cast to the logits' dtype; so the gradient of the log-probabilities equals the
    unchunked one, not merely to a tolerance (tests/test_grpo_math.py checks it on the CPU). The
    gradient with the entropy's, ``g_lp * onehot - p * (g_H * (log p + H) + g_lp)`` with
    ``log p = z - lse``, is autograd's quantity in another order of operations: equal to rounding.

    ``logits`` is ``[B, L, V]`` and ``ids`` ``[B, T]``: positions ``start .. start + T - 1`` score
    ``ids``. Taking the whole logits tensor with an offset (rather than a slice of it) makes the
    gradient come out in the logits' own shape: a slice would cost autograd a second, zero-padded
    copy of it.
    """

    @staticmethod
    def forward(ctx, logits, ids, start, temperature, chunk, want_entropy):
        b, t = ids.shape
        n = b * t
        flat_ids = ids.reshape(-1, 1)
        logps = torch.empty((b, t), dtype=torch.float32, device=logits.device)
        entropies = torch.empty_like(logps) if want_entropy else None
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        flat_logps = logps.view(-1)
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            z = _tempered_chunk(logits, start, t, lo, hi, temperature)
            lse[lo:hi] = torch.logsumexp(z, dim=-1)
            flat_logps[lo:hi] = z.gather(-1, flat_ids[lo:hi]).squeeze(-1) - lse[lo:hi]
            if want_entropy:
                # entropy_from_logits's own operations, so that the value is the same.
                logp = torch.log_softmax(z, dim=-1)
                del z
                entropies.view(-1)[lo:hi] = -logp.exp().mul_(logp).sum(-1)
                del logp
        ctx.set_materialize_grads(False)
        ctx.start, ctx.temperature, ctx.chunk = start, temperature, chunk
        ctx.save_for_backward(logits, ids, lse, entropies)
        return (logps, entropies) if want_entropy else logps

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logps, grad_entropies=None):
        logits, ids, lse, entropies = ctx.saved_tensors
        start, temperature, chunk = ctx.start, ctx.temperature, ctx.chunk
        b, t = ids.shape
        n = b * t
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad[:, :start].zero_()
        grad[:, start + t :].zero_()
        flat_ids = ids.reshape(-1, 1)
        flat_ent = None if entropies is None else entropies.reshape(-1, 1)
        g_lp = None if grad_logps is None else grad_logps.reshape(-1, 1).float()
        g_ent = None if grad_entropies is None else grad_entropies.reshape(-1, 1).float()
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            z = _tempered_chunk(logits, start, t, lo, hi, temperature)
            z.sub_(lse[lo:hi, None])
            if g_ent is None:
                gz = z.exp_().mul_(-g_lp[lo:hi])
            else:
                p = z.exp()
                z.add_(flat_ent[lo:hi]).mul_(g_ent[lo:hi])
                if g_lp is not None:
                    z.add_(g_lp[lo:hi])
                gz = z.neg_().mul_(p)
                del p
            if g_lp is not None:
                gz.scatter_add_(-1, flat_ids[lo:hi], g_lp[lo:hi])
            if temperature != 1.0:
                gz.div_(temperature)
            for row in range(lo // t, (hi - 1) // t + 1):
                a, e = max(lo - row * t, 0), min(hi - row * t, t)
                grad[row, start + a : start + e].copy_(gz[row * t + a - lo : row * t + e - lo])
            del z, gz
        return grad, None, None, None, None, None


def _check_logprob_args(temperature: float, chunk_tokens: int) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")


def _chunked(logits, ids, start, temperature, chunk_tokens, return_entropy):
    return _ChunkedLogprobs.apply(logits, ids, start, float(temperature), int(chunk_tokens), return_entropy)


def token_logprobs(
    logits: Tensor,
    ids: Tensor,
    temperature: float = 1.0,
    *,
    return_entropy: bool = False,
    chunk_tokens: int = DEFAULT_LOGPROB_CHUNK_TOKENS,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probabilities of ``ids`` under ``logits / temperature``, as TRL scores completions.

    TRL's fused LM head upcasts the logits to float32 *before* dividing by the sampling temperature,
    so that the scores match what the sampler (vLLM) drew from; we do the same. With
    ``return_entropy`` also returns the entropy of the tempered distribution (TRL's ``entropy`` metric).

    The fp32 work is done ``chunk_tokens`` tokens at a time, forward and backward (see
    :class:`_ChunkedLogprobs`): no fp32 ``[tokens x vocabulary]`` tensor of all the tokens ever
    exists, and the values equal :func:`token_logprobs_unchunked`'s.
    """
    _check_logprob_args(temperature, chunk_tokens)
    if logits.dim() < 2 or ids.shape != logits.shape[:-1]:
        raise ValueError(f"ids of shape {tuple(ids.shape)} for logits of shape {tuple(logits.shape)}")
    lead = ids.shape
    if logits.dim() == 2:
        logits, ids = logits.unsqueeze(0), ids.unsqueeze(0)
    elif logits.dim() != 3:
        logits, ids = logits.reshape(-1, *logits.shape[-2:]), ids.reshape(-1, ids.shape[-1])
    out = _chunked(logits, ids, 0, temperature, chunk_tokens, return_entropy)
    if return_entropy:
        return out[0].view(lead), out[1].view(lead)
    return out.view(lead)


def token_logprobs_unchunked(
    logits: Tensor, ids: Tensor, temperature: float = 1.0, *, return_entropy: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`token_logprobs` as one autograd expression over all the tokens at once (TRL's form).

    The reference that the chunked computation is tested and benchmarked against: it upcasts every
    token's logits to fp32 and autograd keeps ``[tokens x vocabulary]`` fp32 tensors for backward.
    """
    _check_logprob_args(temperature, 1)
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    logps = selective_log_softmax(z, ids)
    if not return_entropy:
        return logps
    return logps, entropy_from_logits(z)


def completion_logprobs(
    logits: Tensor,
    completion_ids: Tensor,
    temperature: float = 1.0,
    *,
    return_entropy: bool = False,
    chunk_tokens: int = DEFAULT_LOGPROB_CHUNK_TOKENS,
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`token_logprobs` of the completion from the logits of the whole ``prompt + completion``.

    The logit at position ``i`` predicts token ``i + 1``, so the ``T`` completion tokens are scored by
    the ``T`` positions before the last one. ``logits`` may already be cut to the last ``T + 1``
    positions (HF ``logits_to_keep=T + 1``).
    """
    _check_logprob_args(temperature, chunk_tokens)
    b, t = completion_ids.shape
    if logits.dim() != 3 or logits.shape[0] != b or logits.shape[1] < t + 1:
        raise ValueError(f"logits of shape {tuple(logits.shape)} cannot score completions of shape {(b, t)}: "
                         f"[B, at least T + 1, vocabulary] needed")
    return _chunked(logits, completion_ids, logits.shape[1] - t - 1, temperature, chunk_tokens, return_entropy)


# --------------------------------------------------------------------------------------------------
# Rewards and advantages


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


def reward_func_stats(rewards_per_func: Tensor, names: Sequence[str]) -> dict[str, float]:
    """TRL's ``rewards/<name>/mean`` and ``/std``, over the rows where the function returned a value."""
    out = {}
    for i, name in enumerate(names):
        out[mk.reward_mean(name)] = torch.nanmean(rewards_per_func[:, i]).item()
        out[mk.reward_std(name)] = nanstd(rewards_per_func[:, i]).item()
    return out


def truncated_mask(
    completion_ids: Sequence[Sequence[int]], stop_token_ids: Iterable[int], device: torch.device | str | None = None
) -> Tensor:
    """``[B]`` bool: True where a completion does not end in a stop token (EOS or pad), i.e. was cut at
    the length limit. With ``mask_truncated_completions`` TRL multiplies ``completion_mask`` by
    ``~truncated`` (for attention and loss) *before* counting ``num_items_in_batch``."""
    stops = set(stop_token_ids)
    return torch.tensor([len(ids) > 0 and ids[-1] not in stops for ids in completion_ids], device=device)


# --------------------------------------------------------------------------------------------------
# Off-policy corrections


def sampling_importance_ratio(
    old_per_token_logps: Tensor,
    sampling_per_token_logps: Tensor,
    completion_mask: Tensor,
    *,
    mode: str = "sequence_mask",
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> tuple[Tensor, dict[str, Metric]]:
    """Importance ratio pi_train / pi_sampler correcting for the sampler's (vLLM's) numerics.

    TRL's ``vllm_importance_sampling_correction``: ``mode`` is ``{token,sequence}_{truncate,mask}``;
    token modes give ``[B, T]``, sequence modes ``[B, 1]``. Truncate clamps to [clip_min, clip_max],
    mask zeroes ratios outside it. Sampler log-probs that are NaN (unavailable) count as no correction.
    Pass the result to :func:`grpo_loss` as ``importance_weights``.
    """
    if mode not in IS_MODES:
        raise ValueError(f"Unknown vLLM importance sampling level: {mode}. Possible values are {IS_MODES}.")
    if mode.endswith("_truncate") and clip_min is None and clip_max is None:
        raise ValueError("clip_min or clip_max must be set for a *_truncate importance sampling mode")
    diff = torch.nan_to_num((old_per_token_logps - sampling_per_token_logps) * completion_mask, nan=0.0)
    sequence_level = mode.startswith("sequence")
    if sequence_level:
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("_truncate"):
        ratio = torch.clamp(ratio, min=clip_min, max=clip_max)
    else:
        lo = -math.inf if clip_min is None else clip_min
        hi = math.inf if clip_max is None else clip_max
        ratio = ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)

    # TRL averages per-rank statistics (each rank weighs 1), hence count=1 partials.
    with torch.no_grad():
        mask = completion_mask.bool()
        delta = torch.abs(old_per_token_logps - sampling_per_token_logps)
        delta = delta[mask & ~torch.isnan(delta)]
        flat = ratio.flatten() if sequence_level else ratio[mask]
        zero = torch.zeros((), device=ratio.device)
        metrics = {
            mk.SAMPLING_LOGP_DIFFERENCE_MEAN: _mean(delta.mean() if delta.numel() else zero, 1.0),
            mk.SAMPLING_LOGP_DIFFERENCE_MAX: Metric(delta.max() if delta.numel() else zero, op="max"),
            mk.IMPORTANCE_SAMPLING_RATIO_MIN: Metric(flat.min() if flat.numel() else zero, op="min"),
            mk.IMPORTANCE_SAMPLING_RATIO_MEAN: _mean(flat.mean() if flat.numel() else zero, 1.0),
            mk.IMPORTANCE_SAMPLING_RATIO_MAX: Metric(flat.max() if flat.numel() else zero, op="max"),
        }
    return ratio, metrics


def high_entropy_mask(entropies: Tensor, mask: Tensor, threshold: float, group=None) -> Tensor:
    """TRL's get_high_entropy_mask (top_entropy_quantile = 1 - threshold): the loss tokens whose
    entropy is at least the ``threshold`` quantile of every trainer's loss tokens in this micro-batch.
    A collective of the trainers when they are more than one."""
    local = entropies[mask.bool()].float()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        world = dist.get_world_size(group)
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([local.numel()]), group=group)
        longest = int(max(s.item() for s in sizes))
        padded = torch.full((longest,), -1e9)          # no entropy is negative: a sentinel
        padded[:local.numel()] = local.cpu()
        parts = [torch.empty(longest) for _ in range(world)]
        dist.all_gather(parts, padded, group=group)
        gathered = torch.cat(parts)
        gathered = gathered[gathered != -1e9]
    else:
        gathered = local.cpu()
    if gathered.numel() == 0:
        return torch.zeros_like(entropies, dtype=torch.bool)
    cut = torch.quantile(gathered, threshold).to(entropies.device)
    return ((entropies * mask.float()) >= cut) & mask.bool()


def off_policy_mask(
    advantages: Tensor, per_token_logps: Tensor, sampling_per_token_logps: Tensor, mask: Tensor, threshold: float
) -> Tensor:
    """DeepSeek-V3.2 off-policy sequence mask ``[B, 1]``: drop negative-advantage sequences whose mean
    KL(sampler || policy) exceeds ``threshold``. ``advantages`` is ``[B, 1]``."""
    kl = torch.nan_to_num(sampling_per_token_logps - per_token_logps.detach(), nan=0.0)
    avg_kl = (kl * mask).sum(dim=1, keepdim=True) / mask.sum(dim=1, keepdim=True).clamp(min=1.0)
    return ((advantages >= 0) | (avg_kl <= threshold)).to(dtype=mask.dtype)


@torch.no_grad()
def gamma_weights(
    advantages: Tensor,
    log_ratio_per_token: Tensor,
    mask: Tensor,
    importance_sampling_ratio: Tensor | None,
    k_pos: float = 2.0,
    lambda_pos: float = 3.0,
    k_neg: float = 3.0,
    lambda_neg: float = 2.0,
) -> Tensor:
    """VESPO's detached sequence weight ``phi(w) = e^lambda w^k e^(-lambda w)`` ``[B, 1]``, in log space."""
    lower = math.log(1e-8)
    seq_log_ratio = torch.sum(torch.clamp(log_ratio_per_token, -20.0, 20.0) * mask, dim=-1, keepdim=True)
    if importance_sampling_ratio is not None:
        log_is = torch.clamp(torch.log(importance_sampling_ratio), lower, 20.0)
        seq_log_ratio = seq_log_ratio + torch.sum(log_is, dim=-1, keepdim=True)
    log_w = torch.clamp(seq_log_ratio, lower, 20.0)
    nonneg = advantages >= 0
    k = torch.where(nonneg, k_pos, k_neg)
    lam = torch.where(nonneg, lambda_pos, lambda_neg).clamp(min=1e-4)
    log_phi = lam + k * log_w - lam * torch.exp(log_w)
    return torch.exp(log_phi).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


# --------------------------------------------------------------------------------------------------
# The loss


def grpo_loss(
    per_token_logps: Tensor,
    old_per_token_logps: Tensor | None,
    ref_per_token_logps: Tensor | None,
    advantages: Tensor,
    completion_mask: Tensor,
    *,
    loss_type: str = "dapo",
    beta: float = 0.0,
    epsilon_low: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    num_items_in_batch: Tensor | float | None = None,
    num_processes: int = 1,
    gradient_accumulation_steps: int = 1,
    steps_per_generation: int | None = None,
    training: bool = True,
    importance_weights: Tensor | None = None,
    sampling_per_token_logps: Tensor | None = None,
    off_policy_mask_threshold: float | None = None,
    use_bias_correction_kl: bool = True,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    vespo_k_pos: float = 2.0,
    vespo_lambda_pos: float = 3.0,
    vespo_k_neg: float = 3.0,
    vespo_lambda_neg: float = 2.0,
    entropies: Tensor | None = None,
    entropy_coef: float = 0.0,
    entropy_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Metric]]:
    """TRL's GRPO loss of one micro-batch, ready for ``backward()``; returns ``(loss, metrics)``.

    Tensors are ``[B, T]`` except ``advantages`` ``[B]`` (or ``[B, T]``). ``old_per_token_logps=None``
    means on-policy (ratio 1, as TRL with one iteration per generation). ``ref_per_token_logps`` is
    needed when ``beta != 0`` (k3 KL estimator). Defaults are GRPOConfig's.

    Normalisation per ``loss_type`` (A = gradient_accumulation_steps, 1 when not ``training``):
      grpo, sapo: mean over sequences of each sequence's token mean, / A
      bnpo:       token mean of this micro-batch, / A
      dr_grpo:    token sum / (B * max_completion_length), / A
      luspo:      mean over sequences of each sequence's token sum, / A
      dapo, cispo, vespo: token sum / (num_items_in_batch / num_processes * A / steps_per_generation),
          where ``num_items_in_batch`` is the number of loss tokens of the whole *generation* batch
          summed over all ranks (TRL: ``gather(completion_mask.sum()).sum()``); None uses this
          micro-batch's count, i.e. a local token mean.
    ``importance_weights`` is :func:`sampling_importance_ratio`'s output (vLLM correction).
    ``entropies`` ([B, T], from :func:`token_logprobs`) feed the ``entropy`` metric and, with
    ``entropy_coef``, TRL's static entropy bonus. ``entropy_mask`` (:func:`high_entropy_mask`,
    top_entropy_quantile) keeps the policy gradient, and the bonus, to the high-entropy tokens.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"Unknown loss type: {loss_type}. Must be one of {LOSS_TYPES}.")
    epsilon_high = epsilon_low if epsilon_high is None else epsilon_high
    mask = completion_mask.to(per_token_logps.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    if old_per_token_logps is None:
        old_per_token_logps = per_token_logps.detach()
    accum = gradient_accumulation_steps if training else 1

    if off_policy_mask_threshold is not None:
        sampler = old_per_token_logps if sampling_per_token_logps is None else sampling_per_token_logps
        keep = off_policy_mask(advantages, per_token_logps, sampler, mask, off_policy_mask_threshold)

    log_ratio = per_token_logps - old_per_token_logps
    if importance_sampling_level == "token":
        log_weights = log_ratio
    elif importance_sampling_level == "sequence":  # GSPO: one ratio per sequence, the mean log-ratio
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    else:
        raise ValueError(f"Unknown importance sampling level: {importance_sampling_level}")
    coef_1 = torch.exp(log_weights)

    if beta != 0.0:
        if ref_per_token_logps is None:
            raise ValueError("beta != 0 needs ref_per_token_logps")
        # k3 estimator of KL(policy || ref); times the ratio it is the unbiased off-policy gradient.
        per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
        if use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1

    if loss_type == "cispo":
        per_token_loss = -torch.clamp(coef_1, max=epsilon_high).detach() * advantages * per_token_logps
    elif loss_type in _CLIPPED:
        coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
        if delta is not None:  # INTELLECT-2 two-sided clipping; the clip metrics below see the clamped ratio
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    elif loss_type == "sapo":
        temps = torch.where(advantages > 0, sapo_temperature_pos, sapo_temperature_neg)
        per_token_loss = -(torch.sigmoid(temps * (coef_1 - 1)) * 4 / temps) * advantages
    else:  # vespo
        phi_seq = gamma_weights(
            advantages, log_ratio, mask, importance_weights, vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg
        )
        per_token_loss = -phi_seq * advantages * per_token_logps

    if off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * keep
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if importance_weights is not None and loss_type != "vespo":  # vespo folded them into phi
        per_token_loss = per_token_loss * importance_weights
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl

    # Each loss type's own normalisation; all but the dapo family are then divided by the number of
    # accumulation steps, the dapo family's token count already spans the accumulated batch.
    masked = per_token_loss * mask
    if loss_type in ("dapo", "cispo", "vespo"):
        items = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch).to(mask)
        normalizer = items.clamp(min=1.0) / num_processes
        if training:  # num_items_in_batch counts the generation batch: rescale to one accumulation window
            normalizer = normalizer * gradient_accumulation_steps / (steps_per_generation or gradient_accumulation_steps)
        loss = policy_loss = masked.sum() / normalizer
    else:
        if loss_type in ("grpo", "sapo"):
            policy_loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        elif loss_type == "bnpo":
            policy_loss = masked.sum() / mask.sum().clamp(min=1.0)
        elif loss_type == "dr_grpo":
            if max_completion_length is None:
                raise ValueError("loss_type='dr_grpo' needs max_completion_length")
            policy_loss = masked.sum() / (per_token_loss.size(0) * max_completion_length)
        else:  # luspo
            policy_loss = masked.sum(-1).mean()
        loss = policy_loss / accum

    if entropy_coef != 0.0:
        if entropies is None:
            raise ValueError("entropy_coef != 0 needs entropies")
        # Mean entropy over the tokens the gradient acts on, independent of the loss type's normalisation.
        acting = mask if entropy_mask is None else mask * entropy_mask
        loss = loss - entropy_coef * (entropies * acting).sum() / acting.sum().clamp(min=1.0) / accum

    metrics = _loss_metrics(
        loss_type, mask, advantages, coef_1, epsilon_low, epsilon_high,
        per_token_kl if beta != 0.0 else None, entropies, phi_seq if loss_type == "vespo" else None,
    )  # fmt: skip
    metrics[mk.POLICY_LOSS] = _mean(policy_loss.detach(), 1.0)
    return loss, metrics


@torch.no_grad()
def _loss_metrics(loss_type, mask, advantages, coef_1, eps_low, eps_high, kl, entropies, phi_seq):
    def masked_mean(x: Tensor) -> Metric:  # token-weighted over all ranks
        if x.shape[1] == 1:  # sequence-level: one value per sequence
            return _mean(x.sum(), float(x.shape[0]))
        return _mean((x * mask).sum(), mask.sum())

    def seq_means(x: Tensor) -> Tensor:  # NaN for an empty sequence, skipped by the min/max
        return x.squeeze(1) if x.shape[1] == 1 else (x * mask).sum(-1) / mask.sum(-1)

    def nan_extreme(x: Tensor, op: str) -> Metric:
        x = x[~torch.isnan(x)]
        value = (x.min() if op == "min" else x.max()) if x.numel() else torch.tensor(math.nan, device=mask.device)
        return Metric(value.float(), op=op)

    metrics: dict[str, Metric] = {}
    if kl is not None:
        metrics[mk.KL] = masked_mean(kl)
    if entropies is not None:
        metrics[mk.ENTROPY] = masked_mean(entropies)
    if loss_type in _CLIPPED:
        low = ((coef_1 < 1 - eps_low) & (advantages < 0)).float()
        high = ((coef_1 > 1 + eps_high) & (advantages > 0)).float()
        metrics[mk.CLIP_RATIO_LOW_MEAN] = masked_mean(low)
        metrics[mk.CLIP_RATIO_HIGH_MEAN] = masked_mean(high)
        metrics[mk.CLIP_RATIO_REGION_MEAN] = masked_mean(torch.maximum(low, high))
        metrics[mk.CLIP_RATIO_LOW_MIN] = nan_extreme(seq_means(low), "min")
        metrics[mk.CLIP_RATIO_HIGH_MAX] = nan_extreme(seq_means(high), "max")
    elif loss_type == "cispo":
        metrics[mk.CISPO_CLIP_RATIO] = masked_mean(((coef_1 > eps_high) & (advantages > 0)).float())
    elif loss_type == "vespo":
        metrics[mk.VESPO_PHI_SEQ_MEAN] = masked_mean(phi_seq)
    return metrics
