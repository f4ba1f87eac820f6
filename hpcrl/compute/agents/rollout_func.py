"""A TRL rollout function (GRPOTrainer(rollout_func=), TRL 1.16) as the trainer's rollouts
(agent.rollout_func): the user's function makes the completions itself.

As TRL calls it: ``rollout_func(prompts, trainer)`` with a deep copy of the rank's prompts, each
``num_generations`` times in a row (TRL's RepeatSampler layout), and ``trainer`` (here
hpcrl.compute.agents.trainer_view.TrainerView); it returns a dict with ``prompt_ids``,
``completion_ids`` and ``logprobs`` (one row per prompt it was given, in their order; a log-probability
per completion token, None taken as NaN), optionally ``env_mask`` (1 where the model sampled the
token, 0 where the environment put it: no loss, no length; TRL's tool_mask), and any other key, which
reaches the reward functions as a keyword argument of that name: a list gives each row its value,
anything else is every row's (TRL's rule; a key the reward functions already get is refused). The
rows' prompt ids are the ones trained on; the reward functions get the dataset's prompts, as in TRL.

The function runs in a thread of its own, so that with inference.overlap_generation (or
max_staleness) it overlaps training as the engines' generation does. Between requests, a weight push
waits for the call under way (hpcrl.compute.agents.sync_gate), so a call's generations share one
weight version; in flight (inference.weight_update) it does not, and a sync may land between two of
a call's generations, or inside one. Beside agent.tools or agent.environment_factory, its rows are the
rollouts' first turns, which the tool loop then takes on (hpcrl.compute.agents.agent_rollouts).

Completions carry the weight versions of the engines' completions that the call generated through
``trainer``: each token's, where the row's model tokens are those completions as they were handed out
(``token_versions`` where they differ, ``weight_version`` the first token's, as for any completion);
else the oldest version the call saw, so that staleness is never undercounted. A call that generated
nothing there is refused, since hpcrl's engines are the only ones that hold the policy's weights.
"""

from __future__ import annotations

import concurrent.futures
import copy
import math
import os
import sys
from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

from hpcrl.compute.agents.sync_gate import SyncGate
from hpcrl.compute.agents.trainer_view import EngineCalls, TrainerView
from hpcrl.compute.inference.types import Completion, Generator, Sampling
from hpcrl.compute.launch.reason import Explained
from hpcrl.compute.train.data import PromptBatch
from hpcrl.compute.train.rewards import import_callable

__all__ = ["RolledOut", "RolloutFunction", "RolloutFunctionError", "RolloutFunctionGeneration", "load_rollout_func"]

FIELD = "agent.rollout_func"
REQUIRED = ("prompt_ids", "completion_ids", "logprobs")
# What reward functions get from the trainer itself, by these names (TRL's inputs drop "prompt" and
# "completion" before the call): an extra field of the same name could not reach them.
TAKEN = frozenset({"prompt", "completion", "prompts", "completions", "trainer_state", "log_extra", "log_metric",
                   "environments"})


class RolloutFunctionError(Explained, ValueError):
    """A rollout function that raised, or returned what cannot be trained on, by its import path."""


def load_rollout_func(path: str, module_dir: str | os.PathLike | None) -> Callable:
    """agent.rollout_func's function; ``module_dir`` (the run directory's copies of the recipe's own
    modules) goes first on sys.path, as for reward functions."""
    if module_dir is not None and os.path.isdir(module_dir) and str(module_dir) not in sys.path:
        sys.path.insert(0, str(module_dir))
    try:
        func = import_callable(path)
    except Exception as e:          # any failure while importing user code is a recipe error
        raise ValueError(f"{FIELD}: cannot import {path!r} ({type(e).__name__}: {e})") from None
    if not callable(func):
        raise ValueError(f"{FIELD}: {path!r} is not callable")
    return func


@dataclass(frozen=True)
class RolledOut:
    """What one call made: a completion per row, and the rows' prompt ids and extra fields."""
    completions: list[Completion]
    prompt_ids: list[list[int]]
    extra: dict[str, list]


class RolloutFunction:
    """The rollouts of ``func`` (imported from ``path``), generating through ``generator`` (the node's
    engines); ``grpo``: the recipe's grpo section, which ``trainer`` shows the function. Beside tools:
    ``tools``, their schemas, and ``chat_template``, the template they are rendered with (None: the
    tokenizer's), as ``trainer.tools`` and ``trainer.chat_template``."""

    def __init__(self, func: Callable, path: str, generator: Generator, tokenizer, grpo,
                 tools: list[dict] | None = None, chat_template: str | None = None, in_flight: bool = False):
        self.func, self.where = func, f"{FIELD} ({path})"
        self.tokenizer = tokenizer
        self.engines = EngineCalls(generator)
        # One object for every call, as TRL passes its trainer: what a function keeps on it stays.
        self.trainer = TrainerView(tokenizer, grpo, self.engines, tools=tools, chat_template=chat_template)
        self.stops = {tokenizer.eos_token_id, tokenizer.pad_token_id} - {None}
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hpcrl-rollout-func")
        self.gate = SyncGate()
        self.in_flight = in_flight

    def submit(self, batch: PromptBatch, sampling: Sampling) -> tuple[PromptBatch, "RolloutFunctionGeneration"]:
        """Call the function on each prompt of ``batch`` ``sampling.n`` times in a row; returns a row
        per rollout and the pending result, which completes the rows when taken."""
        rows = batch.repeat(sampling.n)
        future = self.executor.submit(self.gate.run, self.roll_out, copy.deepcopy(rows.prompts), sampling, len(batch))
        return rows, RolloutFunctionGeneration(future, rows, self.tokenizer)

    def paused_for_sync(self):
        """Around a weight push: between requests, waits for the call under way and holds the next
        until the push is done (a call's generations all come from one weight version); in flight,
        nothing (the engines take the sync between two of their steps)."""
        return nullcontext() if self.in_flight else self.gate.sync()

    def roll_out(self, prompts: list, sampling: Sampling, groups: int) -> RolledOut:
        """One call of the function on ``prompts`` (``groups`` prompts, each ``sampling.n`` times in a
        row), its output checked and made into completions."""
        self.engines.begin(sampling)
        try:
            output = self.func(prompts, self.trainer)
        except Exception as e:          # noqa: BLE001 - the user's code: named, chained
            raise RolloutFunctionError(f"{self.where} raised {type(e).__name__}: {e}") from e
        return self._rolled_out(output, len(prompts), groups, sampling.n)

    def _rolled_out(self, output: Any, rows: int, groups: int, n: int) -> RolledOut:
        """The function's dict checked and made into completions."""
        if not isinstance(output, Mapping):
            raise RolloutFunctionError(f"{self.where} returned {type(output).__name__}, not a dict with "
                                       f"{', '.join(REQUIRED)}")
        missing = [k for k in REQUIRED if k not in output]
        if missing:
            raise RolloutFunctionError(f"{self.where}: rollout_func must return keys {missing} in its output dict")
        extra = {k: v for k, v in output.items() if k not in REQUIRED}
        env_mask = extra.pop("env_mask", None)
        per_row = {k: output[k] for k in REQUIRED} | ({} if env_mask is None else {"env_mask": env_mask})
        for key, values in per_row.items():
            if not isinstance(values, (list, tuple)) or len(values) != rows:
                got = f"{len(values)} rows" if isinstance(values, (list, tuple)) else type(values).__name__
                raise RolloutFunctionError(
                    f"{self.where} returned {got} of {key}, expected {rows}: one per prompt it was given "
                    f"({groups} prompts x {n} generations, each prompt {n} times in a row)")
        taken = sorted(TAKEN & set(extra))
        if taken:
            raise RolloutFunctionError(f"{self.where} returned {taken[0]!r}, a name reward functions already get "
                                       f"from the trainer; rename that field")
        for key, values in extra.items():
            if isinstance(values, list) and len(values) != rows:
                raise RolloutFunctionError(f"{self.where} returned {len(values)} values of {key!r}, expected {rows} "
                                           f"(one per row; a value that is not a list is every row's)")
        versions = self.engines.versions
        if not versions:
            raise RolloutFunctionError(
                f"{self.where} returned rows without generating through its trainer (trainer.vllm_generation): "
                f"hpcrl's engines hold the policy's weights, so the completions trained on must come from them")
        if len(versions) > 1 and not self.in_flight:       # between requests, the gate keeps a call on one
            raise RolloutFunctionError(f"{self.where}: its generations came from weight versions {sorted(versions)}")
        completions = [self._completion(i, output["completion_ids"][i], output["logprobs"][i],
                                        None if env_mask is None else env_mask[i], i // n, min(versions))
                       for i in range(rows)]
        prompt_ids = [self._ids(ids, "prompt_ids", i) for i, ids in enumerate(output["prompt_ids"])]
        return RolledOut(completions, prompt_ids,
                         {k: v if isinstance(v, list) else [v] * rows for k, v in extra.items()})

    def _ids(self, ids: Any, key: str, row: int) -> list[int]:
        try:
            return [int(t) for t in ids]
        except (TypeError, ValueError):
            raise RolloutFunctionError(f"{self.where}: {key}[{row}] is not a list of token ids: {ids!r:.80}") from None

    def _completion(self, row: int, ids: Any, logprobs: Any, mask: Any, prompt_index: int, version: int) -> Completion:
        ids = self._ids(ids, "completion_ids", row)
        for key, values in [("logprobs", logprobs)] + ([] if mask is None else [("env_mask", mask)]):
            if not isinstance(values, (list, tuple)) or len(values) != len(ids):
                shown = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
                raise RolloutFunctionError(f"{self.where}: {key}[{row}] has {shown} entries for {len(ids)} "
                                           f"completion tokens (one each)")
        if mask is not None and any(m not in (0, 1) for m in mask):
            raise RolloutFunctionError(f"{self.where}: env_mask[{row}] holds {sorted(set(mask) - {0, 1})!r:.60}; "
                                       f"1 marks the model's tokens, 0 the environment's")
        # Always a mask: a row cut short by the function, not by the engine's context, must not read
        # as a completion the context cut (hpcrl.compute.train.scoring warns of those).
        tool_mask = tuple(int(m) for m in mask) if mask is not None else (1,) * len(ids)
        stamped = self.engines.stamp(ids, tool_mask) if len(self.engines.versions) > 1 else None
        return Completion(
            prompt_index=prompt_index, token_ids=tuple(ids), logprobs=self._logprobs(logprobs, row),
            text=self.tokenizer.decode(ids, skip_special_tokens=True),
            # TRL's rule for these rows: truncated where the completion does not end its sequence.
            truncated=bool(ids) and ids[-1] not in self.stops,
            weight_version=stamped[0] if stamped else version, tool_mask=tool_mask,
            token_versions=stamped if stamped and len(set(stamped)) > 1 else None)

    def _logprobs(self, values: Any, row: int) -> tuple[float, ...]:
        try:
            return tuple(math.nan if lp is None else float(lp) for lp in values)      # vLLM's None: NaN, as TRL
        except (TypeError, ValueError):
            # The likely slip: the client's [[logprob]] per token passed on as it is.
            raise RolloutFunctionError(f"{self.where}: logprobs[{row}] holds {values!r:.60}: one log-probability per "
                                       f"token (the client's logprobs hold [logprob] per token: take lp[0])") from None

    def reward_functions(self) -> list:
        return []

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class RolloutFunctionGeneration:
    """A rollout call in progress. ``result()`` waits for it and completes ``rows`` with the
    function's prompt ids (what is trained on) and extra fields (columns the reward functions get):
    both are known only once the function has run, and the loop and the evaluation read the rows
    only after taking the completions. The future's value is a RolledOut, or, beside tools, the
    rollouts' completions with the RolledOut of their first turns."""

    def __init__(self, future: concurrent.futures.Future, rows: PromptBatch, tokenizer):
        self.future, self.rows, self.tokenizer = future, rows, tokenizer
        self.completed = False

    def result(self) -> list[Completion]:
        value = self.future.result()
        completions, rolled = (value.completions, value) if isinstance(value, RolledOut) else value
        if not self.completed:
            self.rows.prompt_ids[:] = rolled.prompt_ids
            self.rows.texts[:] = [self.tokenizer.decode(ids) for ids in rolled.prompt_ids]
            self.rows.columns.update(rolled.extra)
            self.completed = True
        return completions
