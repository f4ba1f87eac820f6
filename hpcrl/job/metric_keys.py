"""The names of a run's metrics, as its trainer writes them and every reader reads them.

A step's line in ``metrics.jsonl`` carries TRL 1.16's GRPOTrainer names (``reward``,
``rewards/<name>/mean``, ``completions/mean_length``, ``kl``, ``grad_norm``, ...), so a TRL user's
dashboards carry over; evaluation metrics carry TRL's ``eval_`` prefix, as in TRL's log history.
TensorBoard and W&B get them as transformers' integrations write them (:func:`dashboard_key`:
``train/reward``, ``eval/reward``). hpcrl's own metrics (times, tokens/s, weight versions)
stand beside them under names TRL does not use.

Runs written before these names (``completion_len_mean``, ``rewards/<name>``, ``eval/...``) are
read through :func:`upgrade`. :func:`learning_check` tells a run that learned nothing.

Standard library only: the login side imports it.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping

# -- TRL's names (trl/trainer/grpo_trainer.py, transformers' Trainer.log) ------------------------
REWARD = "reward"
REWARD_STD = "reward_std"
FRAC_REWARD_ZERO_STD = "frac_reward_zero_std"
COMPLETIONS_MEAN_LENGTH = "completions/mean_length"
COMPLETIONS_MIN_LENGTH = "completions/min_length"
COMPLETIONS_MAX_LENGTH = "completions/max_length"
COMPLETIONS_CLIPPED_RATIO = "completions/clipped_ratio"
COMPLETIONS_MEAN_TERMINATED_LENGTH = "completions/mean_terminated_length"
COMPLETIONS_MIN_TERMINATED_LENGTH = "completions/min_terminated_length"
COMPLETIONS_MAX_TERMINATED_LENGTH = "completions/max_terminated_length"
NUM_TOKENS = "num_tokens"
KL = "kl"
ENTROPY = "entropy"
ENTROPY_COEF = "entropy_coef"                  # the entropy bonus's coefficient after the step (TRL's)
POLICY_LOSS = "policy_loss"
CLIP_RATIO_LOW_MEAN = "clip_ratio/low_mean"
CLIP_RATIO_HIGH_MEAN = "clip_ratio/high_mean"
CLIP_RATIO_REGION_MEAN = "clip_ratio/region_mean"
CLIP_RATIO_LOW_MIN = "clip_ratio/low_min"
CLIP_RATIO_HIGH_MAX = "clip_ratio/high_max"
CISPO_CLIP_RATIO = "cispo_clip_ratio"
VESPO_PHI_SEQ_MEAN = "vespo/phi_seq_mean"
SAMPLING_LOGP_DIFFERENCE_MEAN = "sampling/sampling_logp_difference/mean"
SAMPLING_LOGP_DIFFERENCE_MAX = "sampling/sampling_logp_difference/max"
IMPORTANCE_SAMPLING_RATIO_MIN = "sampling/importance_sampling_ratio/min"
IMPORTANCE_SAMPLING_RATIO_MEAN = "sampling/importance_sampling_ratio/mean"
IMPORTANCE_SAMPLING_RATIO_MAX = "sampling/importance_sampling_ratio/max"
# How far the engines' sampling distribution is from the trainer's policy (numerics, and off-policy
# lag): the k3 estimate of KL(sampler || trainer) per completion token, and the effective sample size
# of the sequences' importance weights as a fraction of the batch, (sum w)^2 / (n sum w^2), 1 when
# they agree. (Not TRL's: the asynchronous peers' staleness signals, issue #31.)
SAMPLING_MISMATCH_KL = "sampling/mismatch_kl"
SAMPLING_IS_ESS = "sampling/importance_sampling_ess"
TOOLS_CALL_FREQUENCY = "tools/call_frequency"          # tool calls per completion
TOOLS_FAILURE_FREQUENCY = "tools/failure_frequency"    # failed calls per call (0 without calls)
LOSS = "loss"
GRAD_NORM = "grad_norm"
AUX_LOSS = "aux_loss"                   # a mixture of experts' load-balancing loss (router_aux_loss_coef)
LEARNING_RATE = "learning_rate"         # after the step's schedule step, as transformers logs it
EPOCH = "epoch"
EVAL_PREFIX = "eval_"


def reward_mean(name: str) -> str:
    return f"rewards/{name}/mean"


def reward_std(name: str) -> str:
    return f"rewards/{name}/std"


def reward_of(key: str) -> str | None:
    """The reward function whose mean ``key`` is (``rewards/<name>/mean``), else None."""
    if key.startswith("rewards/") and key.endswith("/mean") and len(key) > len("rewards//mean"):
        return key[len("rewards/"):-len("/mean")]
    return None


def eval_key(key: str) -> str:
    return EVAL_PREFIX + key


# -- hpcrl's own -----------------------------------------------------------------------------
STEP = "step"
MAX_STEPS = "max_steps"
TOOLS_TURNS_MEAN = "tools/turns_mean"                  # assistant turns per rollout (1: no tool called)
TOOLS_TIME_S = "tools/time_s"                          # seconds of tool calls per rollout, on average
TIME = "time"
LEARNING_RATE_USED = "learning_rate_used"   # the rate this step's update was taken with
ADVANTAGE_MEAN = "advantage_mean"
ADVANTAGE_STD = "advantage_std"
WEIGHT_VERSION = "weight_version"
OFF_POLICY_LAG = "off_policy_lag"
# TRL AsyncGRPOTrainer's names: weight syncs between a completion's sampling and its training, and
# the completions dropped for lagging more than inference.max_staleness (the run's total).
STALENESS_MEAN = "sample/staleness_mean"
STALENESS_MAX = "sample/staleness_max"
DROPPED_STALE_TOTAL = "sample/dropped_stale_total"
# inference.weight_update = in_flight: the share of completions a sync landed in while being sampled.
UPDATED_IN_FLIGHT = "sample/updated_in_flight_frac"
LOG_METRIC_NAMES = "log_metric_names"       # what reward functions logged with log_metric
TIME_GENERATION_S = "time_generation_s"
TIME_GENERATION_S_BY_NODE = "time_generation_s_by_node"
TIME_TRAIN_S = "time_train_s"
TIME_SYNC_S = "time_sync_s"
TIME_WAIT_S = "time_wait_s"
TIME_STEP_S = "time_step_s"
TIME_EVAL_S = "time_eval_s"
SYNC_S = "sync_s"
TOKENS_PER_S = "tokens_per_s"
EVAL_COMPLETIONS = eval_key("completions")  # how many completions the evaluation scored

# Written by runs before TRL's names; :func:`upgrade` maps them.
OLD_NAMES = {"completion_len_mean": COMPLETIONS_MEAN_LENGTH, "truncated_frac": COMPLETIONS_CLIPPED_RATIO}
_OLD_EVAL_PREFIX = "eval/"


def dashboard_key(key: str) -> str:
    """The name TensorBoard and W&B show, as transformers' integrations write TRL's logs
    (rewrite_logs): ``eval_x`` -> ``eval/x``, everything else under ``train/``."""
    return "eval/" + key[len(EVAL_PREFIX):] if key.startswith(EVAL_PREFIX) else "train/" + key


def _upgraded_name(key: str) -> str:
    if key in OLD_NAMES:
        return OLD_NAMES[key]
    if key.startswith("rewards/") and not key.endswith(("/mean", "/std")):
        return key + "/mean"
    return key


def upgrade(record: Mapping[str, Any]) -> dict:
    """A metrics line with today's names: an old run's ``completion_len_mean``, ``rewards/<f>``
    and ``eval/...`` keys also appear under TRL's names (a new name already there wins)."""
    out = dict(record)
    for key, value in record.items():
        if key.startswith(_OLD_EVAL_PREFIX):
            new = eval_key(_upgraded_name(key[len(_OLD_EVAL_PREFIX):]))
        else:
            new = _upgraded_name(key)
        if new != key:
            out.setdefault(new, value)
    return out


# -- did it learn? ---------------------------------------------------------------------------
def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def model_check(model_vs_base: Mapping[str, Any] | None) -> str | None:
    """One line when the model a run wrote equals its base in every tensor compared
    (rundir.MODEL_VS_BASE_FILE), naming the likely cause; None otherwise."""
    if not model_vs_base or not model_vs_base.get("compared") or model_vs_base.get("changed"):
        return None
    n, dtype = model_vs_base["compared"], model_vs_base.get("dtype") or "its dtype"
    why = ("the updates were below its resolution: raise grpo.learning_rate, train longer, or write the "
           "model in float32 (checkpoint.model_dtype: float32, as TRL does)"
           if dtype in ("bfloat16", "float16") else "no update reached the weights")
    return f"learned nothing: the model written equals the base model in all {n} tensors ({dtype}): {why}"


def learning_check(steps: Iterable[Mapping[str, Any]], num_generations: int | None = None,
                   model_vs_base: Mapping[str, Any] | None = None) -> str | None:
    """One line when a run's optimizer steps cannot have taught the policy anything, naming the
    likely cause; None when they could have, or the metrics do not tell. The metrics speak first;
    then the written model against its base (``model_vs_base``: rundir.model_vs_base, model_check).

    From the metrics: every reward None, every group's rewards equal (advantages 0: the loss has
    no reward signal), or no step with a finite gradient norm above 0 and a learning rate above 0
    (the weights never changed)."""
    return _metrics_check(steps, num_generations) or model_check(model_vs_base)


def _metrics_check(steps: Iterable[Mapping[str, Any]], num_generations: int | None) -> str | None:
    trained = [s for s in steps if isinstance(s.get(STEP), int) and s[STEP] >= 1
               and (GRAD_NORM in s or REWARD in s)]
    if not trained:
        return None
    n = len(trained)
    where = f"in all {n} steps" if n > 1 else "in its one step"
    if all(REWARD in s and s[REWARD] is None for s in trained):
        return (f"learned nothing: no reward function scored a completion {where} (every reward was None, so no "
                f"completion had an advantage)")
    zero_std = [s.get(FRAC_REWARD_ZERO_STD) for s in trained]
    if all(_number(v) and v >= 1 - 1e-9 for v in zero_std):
        group = (f"a group of {num_generations} completions (grpo.num_generations)" if num_generations
                 else "a group (the grpo.num_generations completions of a prompt)")
        rewards = {round(s[REWARD], 6) for s in trained if _number(s.get(REWARD))}
        constant = (len(rewards) == 1 and all(_number(s.get(REWARD_STD)) and s[REWARD_STD] == 0 for s in trained))
        every = f"; every completion got reward {rewards.pop():g}" if constant else ""
        return (f"learned nothing: every group's rewards were equal {where} (advantages 0{every}): "
                f"rewards need to differ within {group}")
    if not all(GRAD_NORM in s for s in trained):
        return None                              # a run that did not log its gradient norms
    lrs = [s.get(LEARNING_RATE_USED, s.get(LEARNING_RATE)) for s in trained]
    grads = [s[GRAD_NORM] for s in trained]
    if any(_number(g) and g > 0 and _number(lr) and lr > 0 for g, lr in zip(grads, lrs)):
        return None
    unchanged = "learned nothing: the policy's weights never changed: "
    if all(_number(lr) and lr == 0 for lr in lrs):
        return unchanged + f"the learning rate was 0 {where} (grpo.learning_rate, the warmup and the schedule)"
    if all(_number(g) and g == 0 for g in grads):
        return unchanged + (f"grad_norm 0 {where}: no gradient reached a trainable parameter "
                            "(all frozen, or the loss does not depend on them)")
    if all(not _number(g) for g in grads):
        return unchanged + f"the gradient norm was not finite (nan or inf) {where}, and each step was skipped"
    return unchanged + (f"no step had both a finite gradient norm above 0 and a learning rate above 0 "
                        f"({n} steps: grad_norm 0, not finite, or learning rate 0)")
