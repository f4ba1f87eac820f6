"""Scoring one trainer rank's share of a generation: the reward functions' rewards, group-relative
advantages, and the statistics over all trainers that a step logs of them (rewards, completion
lengths and counts, the reward functions' log_metric values), with the completions log
(logging.log_completions).

Every collective here is one of all the trainers, in the same order on each: every rank scores its
own completions of each generation.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from hpcrl.compute.metrics import format_completion
from hpcrl.compute.train.advantages import compute_advantages
from hpcrl.compute.train.rank_metrics import global_sum
from hpcrl.compute.train.rewards import (RewardFunction, RewardLog, reward_inputs, reward_statistics, reward_sums,
                                         score_completions)
from hpcrl.job import metric_keys as mk
from hpcrl.job.recipe import Recipe

__all__ = ["Scorer", "length_stats", "tool_stats"]


class Scorer:
    """One trainer rank's scoring of its completions. ``setup`` is the trainer's TrainerSetup (rank,
    group, log, on_completions); ``trainer_state`` is what the reward functions get as TRL's
    self.state, shared with the trainer (which checkpoints it)."""

    def __init__(self, setup: Any, recipe: Recipe, rewards: list[RewardFunction], trainer_state: Any,
                 epochs_per_step: float):
        self.setup = setup
        self.recipe = recipe
        self.rewards = rewards
        self.trainer_state = trainer_state
        self.epochs_per_step = epochs_per_step
        # What the reward functions logged with log_extra on the generation scored last: this rank's
        # columns, a value per completion, for its completions log.
        self.completion_extra: dict[str, list] = {}
        self.warned_all_none: set[str] = set()
        self.warned_context_cut = False

    def score(self, batch, completions, step: int) -> tuple[torch.Tensor, dict]:
        """This rank's advantages of a generation trained on from optimizer step ``step + 1``, and
        its statistics over all trainers."""
        grpo = self.recipe.grpo
        log = RewardLog()
        shown, extra = reward_inputs(batch.prompts, completions)
        per_func = score_completions(
            self.rewards, batch.prompts, shown, [list(c.token_ids) for c in completions], batch.columns,
            trainer_state=self._trainer_state(batch, completions, step), log_extra=log.log_extra,
            log_metric=log.log_metric, **extra)
        self.completion_extra = dict(log.extra)
        self._warn_all_none(per_func, step)
        # Whole groups live on one rank (spec validation), so advantages are local.
        advantages, local = compute_advantages(per_func, grpo.num_generations, [rf.weight for rf in self.rewards],
                                               grpo.scale_rewards, grpo.multi_objective_aggregation)
        stats = {**self._logged_metrics(log.metrics), **self._reward_stats(per_func, local["frac_reward_zero_std"])}
        logged = [list(c.messages) if c.messages is not None else c.text for c in completions]
        self.log_completions(batch.prompts, logged, per_func, advantages, step)
        stats.update(length_stats(completions, self.setup.group))
        if any(c.tool_use is not None for c in completions):
            stats.update(tool_stats(completions, self.setup.group))
        return advantages, stats

    def counts(self, completions, loss_tokens: float) -> tuple[float, float, float, float]:
        """The generation's completion tokens, loss tokens (this rank's: ``loss_tokens``), completions
        and truncated completions, over all trainers."""
        cap = self.recipe.grpo.max_completion_length
        tokens, loss_tokens, count, truncated, cut = global_sum(
            [sum(c.model_tokens for c in completions), loss_tokens, len(completions),
             sum(c.truncated for c in completions),
             sum(c.truncated and c.model_tokens < cap and c.tool_mask is None for c in completions)], self.setup.group)
        if cut and not self.warned_context_cut and self.setup.trainer_rank == 0:
            # The engine stops a sequence at its context: such a completion looks truncated like one
            # at max_completion_length, and would train on silently.
            self.warned_context_cut = True
            self.setup.log(f"warning: {int(cut)} of {int(count)} completions were cut by the engine's context "
                           f"(prompt + completion), before grpo.max_completion_length={cap}: raise "
                           f"inference.max_model_len (TRL's vllm_max_model_length; unset = the model's own "
                           f"context) or shorten the prompts")
        return tokens, loss_tokens, count, truncated

    def _warn_all_none(self, per_func: torch.Tensor, step: int) -> None:
        """A reward function that returned None for every completion of a generation says nothing
        of them (TRL leaves such rows out too): named once, since a run of it trains on nothing."""
        for i, rf in enumerate(self.rewards):
            if rf.name not in self.warned_all_none and per_func.shape[0] and torch.isnan(per_func[:, i]).all():
                self.warned_all_none.add(rf.name)
                self.setup.log(f"warning: reward function '{rf.name}' returned None for every completion of trainer "
                               f"{self.setup.trainer_rank}'s generation at step {step + 1}"
                               + (" (no reward function scored them: they train on nothing)"
                                  if torch.isnan(per_func).all() else ""))

    def log_completions(self, prompts: list, texts: list, per_func: torch.Tensor, advantages: torch.Tensor,
                        step: int) -> None:
        """logging.log_completions (TRL's log_completions): every trainer's completions of this
        generation, with prompt, rewards and advantage, go to rank 0, which hands them to
        on_completions and prints the first log_completions of them."""
        shown = self.recipe.logging.log_completions
        if not shown:
            return
        names = [rf.name for rf in self.rewards]
        # Each row carries the first optimizer step that trains on it.
        rows = [{"step": step + 1, "prompt": p, "completion": t, "rewards": dict(zip(names, r)), "advantage": a}
                for p, t, r, a in zip(prompts, texts, per_func.tolist(), advantages.tolist())]
        if self.completion_extra:       # the reward functions' log_extra columns, as in TRL's table
            for i, row in enumerate(rows):
                row["extra"] = {k: v[i] if i < len(v) else None for k, v in self.completion_extra.items()}
        setup = self.setup
        if setup.num_trainers > 1:
            parts = [None] * setup.num_trainers if setup.trainer_rank == 0 else None
            dist.gather_object(rows, parts, group=setup.group, group_dst=0)
            rows = [row for part in parts or [] for row in part]
        if setup.trainer_rank != 0:
            return
        if setup.on_completions:
            setup.on_completions(rows)
        for row in rows[:shown]:
            setup.log(format_completion(row))

    def _trainer_state(self, batch, completions, step: int):
        """TRL's self.state as its reward functions see it, before optimizer step ``step + 1``:
        num_input_tokens_seen counts this generation's prompts and completions on every trainer."""
        state = self.trainer_state
        tokens = sum(len(p) for p in batch.prompt_ids) + sum(c.model_tokens for c in completions)
        state.num_input_tokens_seen += int(global_sum([tokens], self.setup.group)[0])
        state.global_step = step
        state.epoch = step * self.epochs_per_step
        return state

    def _logged_metrics(self, local: dict[str, list[float]]) -> dict:
        """What the reward functions gave log_metric: each name's mean over every call on every
        trainer, as TRL's, and the names under "log_metric_names" (the plot draws them). A function
        may log a name on some ranks only, so the ranks agree on the names first."""
        names = sorted(local)
        if self.setup.num_trainers > 1:
            every = [None] * self.setup.num_trainers
            dist.all_gather_object(every, names, group=self.setup.group)
            names = sorted(set().union(*every))
        if not names:
            return {}
        sums = global_sum([x for n in names for x in (sum(local.get(n, ())), len(local.get(n, ())))],
                          self.setup.group)
        return {"log_metric_names": names, **{n: sums[2 * i] / sums[2 * i + 1] for i, n in enumerate(names)}}

    def _reward_stats(self, per_func: torch.Tensor, frac_zero_std: float) -> dict:
        """Mean/std over all trainers' completions, overall and per reward function, and the share
        of completions whose group's rewards were all alike (no learning signal), as TRL logs them."""
        sums = reward_sums(per_func, [rf.weight for rf in self.rewards])
        sums += [frac_zero_std, 1.0]        # every rank scores as many completions: average over ranks
        sums = global_sum(sums, self.setup.group)
        out = reward_statistics(sums[:-2], [rf.name for rf in self.rewards])
        out[mk.FRAC_REWARD_ZERO_STD] = sums[-2] / sums[-1]
        return out


def length_stats(completions, group) -> dict[str, float]:
    """TRL's completions/min_length, max_length and the lengths of the completions that ended
    before max_completion_length (0 when none did, as TRL's), over all trainers."""
    lengths = [c.model_tokens for c in completions]
    ended = [n for n, c in zip(lengths, completions) if not c.truncated]
    # Minima as negated maxima: one reduction for all four extremes.
    extremes = torch.tensor([max(lengths, default=-math.inf), -min(lengths, default=math.inf),
                             max(ended, default=-math.inf), -min(ended, default=math.inf)], dtype=torch.float64)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
    total, count = global_sum([sum(ended), len(ended)], group)
    top, low, top_ended, low_ended = extremes.tolist()
    return {mk.COMPLETIONS_MIN_LENGTH: -low, mk.COMPLETIONS_MAX_LENGTH: top,
            mk.COMPLETIONS_MEAN_TERMINATED_LENGTH: total / count if count else 0.0,
            mk.COMPLETIONS_MIN_TERMINATED_LENGTH: -low_ended if count else 0.0,
            mk.COMPLETIONS_MAX_TERMINATED_LENGTH: top_ended if count else 0.0}


def tool_stats(completions, group) -> dict[str, float]:
    """TRL's tools/call_frequency (calls per completion) and tools/failure_frequency (failed calls
    per call), with hpcrl's turns per rollout and tool seconds per rollout, over all trainers."""
    uses = [c.tool_use for c in completions if c.tool_use is not None]
    calls, failures, turns, seconds, count = global_sum(
        [sum(u.calls for u in uses), sum(u.failures for u in uses), sum(u.turns for u in uses),
         sum(u.tool_s for u in uses), len(completions)], group)
    return {mk.TOOLS_CALL_FREQUENCY: calls / max(1, count), mk.TOOLS_FAILURE_FREQUENCY: failures / calls if calls else 0.0,
            mk.TOOLS_TURNS_MEAN: turns / max(1, count), mk.TOOLS_TIME_S: seconds / max(1, count)}
