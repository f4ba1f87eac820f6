"""TRL 1.16's GRPO loss of one micro-batch, and the off-policy corrections it applies.

One job: per-token log-probabilities (:mod:`hpcrl.compute.train.logprobs`) and advantages
(:mod:`hpcrl.compute.train.advantages`) in, a loss ready for ``backward()`` and its metrics out.
The loss's settings come in one frozen :class:`LossConfig`, built once from the recipe
(:meth:`LossConfig.from_grpo`); everything else is a tensor of the micro-batch. tests/compute/train/test_grpo_math.py
holds loss, gradients and metrics against TRL's own ``_compute_loss`` on identical inputs.

Conventions (TRL's): B sequences, T completion tokens (right padded). ``completion_mask`` is the loss
mask: 1 for tokens that count (multiply a tool mask in before calling).

Distributed normalisation: TRL scales each micro-batch's loss so that, after gradients are *averaged*
over ranks (DDP, or FSDP's default reduce-scatter) and *summed* over gradient-accumulation steps, the
result is the loss of the whole optimizer batch. :class:`LossConfig` carries the same knobs
(``num_processes``, ``gradient_accumulation_steps``, ``steps_per_generation``); ``num_items_in_batch``
comes with each generation.

Metrics are :class:`~hpcrl.compute.train.rank_metrics.Metric` partials, reduced over ranks by
:func:`~hpcrl.compute.train.rank_metrics.reduce_metrics` as TRL's ``accelerator`` calls reduce them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from hpcrl.compute.train.rank_metrics import Metric, mean_metric
from hpcrl.job import metric_keys as mk
from hpcrl.job.grpo_config import GRPOConfig

__all__ = [
    "LOSS_TYPES",
    "IS_MODES",
    "IS_LEVELS",
    "LossConfig",
    "SamplerCorrection",
    "grpo_loss",
    "mismatch_metrics",
    "effective_sample_size",
    "sampling_importance_ratio",
    "high_entropy_mask",
    "off_policy_mask",
    "gamma_weights",
]

# Loss types of TRL 1.16; the clipped-surrogate family shares one per-token loss.
LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo")
_CLIPPED = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
IS_LEVELS = ("token", "sequence")


@dataclass(frozen=True)
class LossConfig:
    """What the GRPO loss is, fixed for a run: GRPOConfig's loss fields (same names and defaults,
    ``epsilon`` as ``epsilon_low``) and the batch geometry its normalisation divides by."""

    # The defaults are the recipe's (TRL's), read from GRPOConfig so that the two cannot drift apart.
    loss_type: str = GRPOConfig.loss_type
    beta: float = GRPOConfig.beta
    epsilon_low: float = GRPOConfig.epsilon
    epsilon_high: float | None = GRPOConfig.epsilon_high        # None: epsilon_low
    delta: float | None = GRPOConfig.delta
    importance_sampling_level: str = GRPOConfig.importance_sampling_level
    max_completion_length: int | None = None    # dr_grpo's normaliser
    num_processes: int = 1
    gradient_accumulation_steps: int = GRPOConfig.gradient_accumulation_steps
    # Micro-batches of one generation per trainer, which num_items_in_batch counts the loss tokens
    # of; None: gradient_accumulation_steps.
    steps_per_generation: int | None = None
    off_policy_mask_threshold: float | None = GRPOConfig.off_policy_mask_threshold
    use_bias_correction_kl: bool = GRPOConfig.use_bias_correction_kl
    sapo_temperature_pos: float = GRPOConfig.sapo_temperature_pos
    sapo_temperature_neg: float = GRPOConfig.sapo_temperature_neg
    vespo_k_pos: float = GRPOConfig.vespo_k_pos
    vespo_lambda_pos: float = GRPOConfig.vespo_lambda_pos
    vespo_k_neg: float = GRPOConfig.vespo_k_neg
    vespo_lambda_neg: float = GRPOConfig.vespo_lambda_neg
    entropy_coef: float = GRPOConfig.entropy_coef
    # False: an evaluation loss, as TRL's outside training: not split over accumulation steps.
    training: bool = True

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"Unknown loss type: {self.loss_type}. Must be one of {LOSS_TYPES}.")
        if self.importance_sampling_level not in IS_LEVELS:
            raise ValueError(f"Unknown importance sampling level: {self.importance_sampling_level}")
        if self.loss_type == "dr_grpo" and self.max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length")
        if self.epsilon_high is None:
            object.__setattr__(self, "epsilon_high", self.epsilon_low)

    @classmethod
    def from_grpo(cls, grpo: GRPOConfig, num_trainers: int = 1) -> LossConfig:
        """The loss a recipe's ``grpo`` section trains with on ``num_trainers`` trainers."""
        accumulation = grpo.gradient_accumulation_steps
        return cls(
            loss_type=grpo.loss_type, beta=grpo.beta, epsilon_low=grpo.epsilon, epsilon_high=grpo.epsilon_high,
            delta=grpo.delta, importance_sampling_level=grpo.importance_sampling_level,
            max_completion_length=grpo.max_completion_length, num_processes=num_trainers,
            gradient_accumulation_steps=accumulation,
            # The micro-batches of the whole optimizer steps a generation trains: the trainer's slices.
            steps_per_generation=grpo.micro_batches_per_generation(num_trainers) // accumulation * accumulation,
            off_policy_mask_threshold=grpo.off_policy_mask_threshold,
            use_bias_correction_kl=grpo.use_bias_correction_kl,
            sapo_temperature_pos=grpo.sapo_temperature_pos, sapo_temperature_neg=grpo.sapo_temperature_neg,
            vespo_k_pos=grpo.vespo_k_pos, vespo_lambda_pos=grpo.vespo_lambda_pos,
            vespo_k_neg=grpo.vespo_k_neg, vespo_lambda_neg=grpo.vespo_lambda_neg,
            entropy_coef=grpo.entropy_coef,
        )  # fmt: skip


@dataclass(frozen=True)
class SamplerCorrection:
    """What the loss knows of the sampler (vLLM) that drew the completions, ``[B, T]`` or ``[B, 1]``."""

    # The sampler's log-probabilities: the off-policy mask's KL is against them (None: the old policy's).
    sampling_per_token_logps: Tensor | None = None
    # sampling_importance_ratio's output (grpo.vllm_importance_sampling_correction).
    importance_weights: Tensor | None = None


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
    Pass the result to :func:`grpo_loss` in :class:`SamplerCorrection`'s ``importance_weights``.
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
            **mismatch_metrics(old_per_token_logps, sampling_per_token_logps, completion_mask),
            mk.SAMPLING_LOGP_DIFFERENCE_MEAN: mean_metric(delta.mean() if delta.numel() else zero, 1.0),
            mk.SAMPLING_LOGP_DIFFERENCE_MAX: Metric(delta.max() if delta.numel() else zero, op="max"),
            mk.IMPORTANCE_SAMPLING_RATIO_MIN: Metric(flat.min() if flat.numel() else zero, op="min"),
            mk.IMPORTANCE_SAMPLING_RATIO_MEAN: mean_metric(flat.mean() if flat.numel() else zero, 1.0),
            mk.IMPORTANCE_SAMPLING_RATIO_MAX: Metric(flat.max() if flat.numel() else zero, op="max"),
        }
    return ratio, metrics


# Partials of the importance weights' effective sample size, combined by effective_sample_size.
_IS_WEIGHT_MEAN, _IS_WEIGHT_SQUARE_MEAN = "sampling/_is_weight", "sampling/_is_weight_square"


def mismatch_metrics(trainer_logps: Tensor, sampling_logps: Tensor, mask: Tensor) -> dict[str, Metric]:
    """The sampler-trainer mismatch of a micro-batch as partials: the k3 estimate of
    KL(sampler || trainer) over its completion tokens (sampled by the sampler: r - 1 - log r with
    r = p_trainer / p_sampler), and the sums behind the effective sample size of its sequences'
    importance weights (exp of the summed log-ratio, unclipped; NaN sampler log-probs count as 0)."""
    with torch.no_grad():
        log_r = torch.nan_to_num((trainer_logps - sampling_logps).float(), nan=0.0) * mask
        k3 = (torch.exp(log_r) - 1 - log_r) * mask
        w = torch.exp(torch.clamp(log_r.sum(dim=-1), -20.0, 20.0))
        rows = float(w.numel())
        return {mk.SAMPLING_MISMATCH_KL: mean_metric(k3.sum(), mask.sum()),
                _IS_WEIGHT_MEAN: mean_metric(w.sum(), rows), _IS_WEIGHT_SQUARE_MEAN: mean_metric((w * w).sum(), rows)}


def effective_sample_size(reduced: dict[str, float]) -> None:
    """Replace the weight partials of reduced metrics by their effective sample size, as a fraction
    of the sequences: mean(w)^2 / mean(w^2)."""
    mean, square = reduced.pop(_IS_WEIGHT_MEAN, None), reduced.pop(_IS_WEIGHT_SQUARE_MEAN, None)
    if mean is not None and square:
        reduced[mk.SAMPLING_IS_ESS] = mean * mean / square


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
    config: LossConfig,
    *,
    num_items_in_batch: Tensor | float | None = None,
    sampler: SamplerCorrection | None = None,
    entropies: Tensor | None = None,
    entropy_mask: Tensor | None = None,
) -> tuple[Tensor, dict[str, Metric]]:
    """TRL's GRPO loss of one micro-batch, ready for ``backward()``; returns ``(loss, metrics)``.

    Tensors are ``[B, T]`` except ``advantages`` ``[B]`` (or ``[B, T]``). ``old_per_token_logps=None``
    means on-policy (ratio 1, as TRL with one iteration per generation). ``ref_per_token_logps`` is
    needed when ``config.beta != 0`` (k3 KL estimator).

    Normalisation per ``loss_type`` (A = gradient_accumulation_steps, 1 when not ``training``):
      grpo, sapo: mean over sequences of each sequence's token mean, / A
      bnpo:       token mean of this micro-batch, / A
      dr_grpo:    token sum / (B * max_completion_length), / A
      luspo:      mean over sequences of each sequence's token sum, / A
      dapo, cispo, vespo: token sum / (num_items_in_batch / num_processes * A / steps_per_generation),
          where ``num_items_in_batch`` is the number of loss tokens of the whole *generation* batch
          summed over all ranks (TRL: ``gather(completion_mask.sum()).sum()``); None uses this
          micro-batch's count, i.e. a local token mean.
    ``sampler``: the sampler's log-probabilities (the off-policy mask) and importance weights (vLLM
    correction). ``entropies`` ([B, T], from :func:`~hpcrl.compute.train.logprobs.token_logprobs`) feed
    the ``entropy`` metric and, with ``entropy_coef``, TRL's static entropy bonus. ``entropy_mask``
    (:func:`high_entropy_mask`, top_entropy_quantile) keeps the policy gradient, and the bonus, to the
    high-entropy tokens.
    """
    cfg = config
    sampler = sampler or SamplerCorrection()
    importance_weights = sampler.importance_weights
    mask = completion_mask.to(per_token_logps.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    if old_per_token_logps is None:
        old_per_token_logps = per_token_logps.detach()
    accum = cfg.gradient_accumulation_steps if cfg.training else 1

    if cfg.off_policy_mask_threshold is not None:
        sampled = sampler.sampling_per_token_logps
        keep = off_policy_mask(advantages, per_token_logps, old_per_token_logps if sampled is None else sampled, mask,
                               cfg.off_policy_mask_threshold)

    log_ratio = per_token_logps - old_per_token_logps
    if cfg.importance_sampling_level == "token":
        log_weights = log_ratio
    else:  # "sequence", GSPO: one ratio per sequence, the mean log-ratio
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_weights)

    if cfg.beta != 0.0:
        if ref_per_token_logps is None:
            raise ValueError("beta != 0 needs ref_per_token_logps")
        # k3 estimator of KL(policy || ref); times the ratio it is the unbiased off-policy gradient.
        per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
        if cfg.use_bias_correction_kl:
            per_token_kl = per_token_kl * coef_1

    if cfg.loss_type == "cispo":
        per_token_loss = -torch.clamp(coef_1, max=cfg.epsilon_high).detach() * advantages * per_token_logps
    elif cfg.loss_type in _CLIPPED:
        coef_2 = torch.clamp(coef_1, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
        if cfg.delta is not None:  # INTELLECT-2 two-sided clipping; the clip metrics below see the clamped ratio
            coef_1 = torch.clamp(coef_1, max=cfg.delta)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    elif cfg.loss_type == "sapo":
        temps = torch.where(advantages > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)
        per_token_loss = -(torch.sigmoid(temps * (coef_1 - 1)) * 4 / temps) * advantages
    else:  # vespo
        phi_seq = gamma_weights(advantages, log_ratio, mask, importance_weights, cfg.vespo_k_pos,
                                cfg.vespo_lambda_pos, cfg.vespo_k_neg, cfg.vespo_lambda_neg)
        per_token_loss = -phi_seq * advantages * per_token_logps

    if cfg.off_policy_mask_threshold is not None:
        per_token_loss = per_token_loss * keep
    if entropy_mask is not None:
        per_token_loss = per_token_loss * entropy_mask
    if importance_weights is not None and cfg.loss_type != "vespo":  # vespo folded them into phi
        per_token_loss = per_token_loss * importance_weights
    if cfg.beta != 0.0:
        per_token_loss = per_token_loss + cfg.beta * per_token_kl

    # Each loss type's own normalisation; all but the dapo family are then divided by the number of
    # accumulation steps, the dapo family's token count already spans the accumulated batch.
    masked = per_token_loss * mask
    if cfg.loss_type in ("dapo", "cispo", "vespo"):
        items = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch).to(mask)
        normalizer = items.clamp(min=1.0) / cfg.num_processes
        if cfg.training:  # num_items_in_batch counts the generation batch: rescale to one accumulation window
            normalizer = (normalizer * cfg.gradient_accumulation_steps
                          / (cfg.steps_per_generation or cfg.gradient_accumulation_steps))
        loss = policy_loss = masked.sum() / normalizer
    else:
        if cfg.loss_type in ("grpo", "sapo"):
            policy_loss = (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        elif cfg.loss_type == "bnpo":
            policy_loss = masked.sum() / mask.sum().clamp(min=1.0)
        elif cfg.loss_type == "dr_grpo":
            policy_loss = masked.sum() / (per_token_loss.size(0) * cfg.max_completion_length)
        else:  # luspo
            policy_loss = masked.sum(-1).mean()
        loss = policy_loss / accum

    if cfg.entropy_coef != 0.0:
        if entropies is None:
            raise ValueError("entropy_coef != 0 needs entropies")
        # Mean entropy over the tokens the gradient acts on, independent of the loss type's normalisation.
        acting = mask if entropy_mask is None else mask * entropy_mask
        loss = loss - cfg.entropy_coef * (entropies * acting).sum() / acting.sum().clamp(min=1.0) / accum

    metrics = _loss_metrics(
        cfg, mask, advantages, coef_1, per_token_kl if cfg.beta != 0.0 else None, entropies,
        phi_seq if cfg.loss_type == "vespo" else None,
    )  # fmt: skip
    metrics[mk.POLICY_LOSS] = mean_metric(policy_loss.detach(), 1.0)
    return loss, metrics


@torch.no_grad()
def _loss_metrics(cfg: LossConfig, mask, advantages, coef_1, kl, entropies, phi_seq) -> dict[str, Metric]:
    def masked_mean(x: Tensor) -> Metric:  # token-weighted over all ranks
        if x.shape[1] == 1:  # sequence-level: one value per sequence
            return mean_metric(x.sum(), float(x.shape[0]))
        return mean_metric((x * mask).sum(), mask.sum())

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
    if cfg.loss_type in _CLIPPED:
        low = ((coef_1 < 1 - cfg.epsilon_low) & (advantages < 0)).float()
        high = ((coef_1 > 1 + cfg.epsilon_high) & (advantages > 0)).float()
        metrics[mk.CLIP_RATIO_LOW_MEAN] = masked_mean(low)
        metrics[mk.CLIP_RATIO_HIGH_MEAN] = masked_mean(high)
        metrics[mk.CLIP_RATIO_REGION_MEAN] = masked_mean(torch.maximum(low, high))
        metrics[mk.CLIP_RATIO_LOW_MIN] = nan_extreme(seq_means(low), "min")
        metrics[mk.CLIP_RATIO_HIGH_MAX] = nan_extreme(seq_means(high), "max")
    elif cfg.loss_type == "cispo":
        metrics[mk.CISPO_CLIP_RATIO] = masked_mean(((coef_1 > cfg.epsilon_high) & (advantages > 0)).float())
    elif cfg.loss_type == "vespo":
        metrics[mk.VESPO_PHI_SEQ_MEAN] = masked_mean(phi_seq)
    return metrics
