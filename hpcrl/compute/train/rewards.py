"""Reward functions: TRL's calling convention, loading by import path, scoring, and the demo rewards.

A reward function is called as TRL's GRPOTrainer (1.16) calls it::

    f(prompts=[...], completions=[...], completion_ids=[[...], ...], **columns,
      trainer_state=..., log_extra=..., log_metric=...) -> list[float | None]

``prompts`` and ``completions`` are strings, or for conversational prompts message lists (each
completion ``[{"role": "assistant", "content": text}]``); ``columns`` are the dataset's other columns,
one value per completion. ``trainer_state`` is a transformers.TrainerState (global_step, max_steps,
epoch, ...), ``log_extra(column, values)`` adds a column to the logged completions and
``log_metric(name, value)`` a scalar to the step's metrics (:class:`RewardLog`). None means "does
not apply"; a row where every function says None is left out of the advantages. So any TRL reward
function (``trl.rewards``) works unchanged.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import math
import os
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hpcrl.compute.launch.reason import Explained
from hpcrl.compute.train.advantages import combine_rewards
from hpcrl.job import metric_keys as mk
from hpcrl.job.recipe import reward_import_path

__all__ = [
    "RewardFunction",
    "RewardLog",
    "import_callable",
    "load_reward_functions",
    "new_trainer_state",
    "score_completions",
    "as_completions",
    "reward_inputs",
    "completion_text",
    "demo_correct",
    "demo_format",
    "DEMO_REWARDS",
]


@dataclass
class RewardFunction:
    name: str  # TRL logs rewards/<name>/mean
    func: Callable[..., list[float | None]]
    weight: float = 1.0


def import_callable(path: str) -> Callable:
    """``"package.module:attr"`` (or ``"package.module.attr"``) -> the object. Raises ImportError or
    AttributeError with the underlying message."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ImportError(f"not of the form 'package.module:function': {path!r}")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):  # "module:Class.method" works too
        obj = getattr(obj, part)
    return obj


# TRL's CLI makes get_soft_overlong_punishment, named alone, with these; trl.rewards' other
# factories named without kwargs are called with none (their own defaults).
TRL_CLI_FACTORY_KWARGS = {"get_soft_overlong_punishment": {"max_completion_len": 1280, "soft_punish_cache": 256}}


def load_reward_functions(specs: Sequence[str | Mapping[str, Any] | Callable],
                          module_dir: str | os.PathLike | None = None) -> list[RewardFunction]:
    """Resolve reward specs, each one of:

    - ``"package.module:function"`` (weight 1), or the name of one of trl.rewards' functions,
    - ``{"func": "package.module:function", "weight": 0.5, "name": ..., "kwargs": {...}}``: with
      ``kwargs`` the imported object is a *factory* called with them to make the reward function (as
      ``trl.rewards.get_soft_overlong_punishment``),
    - a callable.

    ``module_dir`` (the run directory's copies of the recipe's own modules) goes first on sys.path.
    A bad path raises ``ValueError("rewards[i].func: cannot import 'x.y:z' (ModuleNotFoundError: ...)")``,
    a factory that fails on its kwargs ``ValueError("rewards[i].kwargs: ...")``.
    """
    if module_dir is not None and os.path.isdir(module_dir) and str(module_dir) not in sys.path:
        sys.path.insert(0, str(module_dir))
    out = []
    for i, spec in enumerate(specs):
        where = f"rewards[{i}]"
        if callable(spec):
            spec = {"func": spec}
        elif isinstance(spec, str):
            spec = {"func": spec}
        elif not isinstance(spec, Mapping) or "func" not in spec:
            raise ValueError(f"{where}: expected an import path or a mapping with 'func', got {spec!r}")
        unknown = set(spec) - {"func", "weight", "name", "kwargs"}
        if unknown:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
        func, kwargs = spec["func"], spec.get("kwargs")
        if isinstance(func, str):
            try:
                func = import_callable(reward_import_path(func))
            except Exception as e:  # any failure while importing user code is a config error
                raise ValueError(f"{where}.func: cannot import {spec['func']!r} ({type(e).__name__}: {e})") from None
            if kwargs is None and _is_trl_factory(func):
                kwargs = TRL_CLI_FACTORY_KWARGS.get(func.__name__, {})
        if kwargs is not None:
            if not isinstance(kwargs, Mapping):
                raise ValueError(f"{where}.kwargs: expected a mapping, got {kwargs!r}")
            try:
                func = func(**kwargs)
            except Exception as e:  # the factory's own complaint, whatever its type
                raise ValueError(f"{where}.kwargs: {_callable_name(func)}(**{dict(kwargs)!r}) failed "
                                 f"({type(e).__name__}: {e})") from None
        if not callable(func):
            raise ValueError(f"{where}.func: {spec['func']!r} is not callable")
        try:
            weight = float(spec.get("weight", 1.0))
        except (TypeError, ValueError):
            raise ValueError(f"{where}.weight: not a number: {spec.get('weight')!r}") from None
        out.append(RewardFunction(spec.get("name") or _callable_name(func), func, weight))
    return out


def _is_trl_factory(func: Any) -> bool:
    return getattr(func, "__module__", "").startswith("trl.rewards") and getattr(func, "__name__", "").startswith("get_")


@dataclass
class RewardLog:
    """What reward functions log while one generation is scored, through the ``log_extra`` and
    ``log_metric`` they are given (TRL's ``_log_completion_extra`` and ``_log_metric``)."""
    extra: dict[str, list] = field(default_factory=lambda: defaultdict(list))
    metrics: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def log_extra(self, column: str, values: list) -> None:
        """Add a column to the completions' log: one value per completion."""
        self.extra[column].extend(values)

    def log_metric(self, name: str, value: float) -> None:
        """Add a scalar to the step's metrics: its mean over every call on every trainer."""
        try:
            self.metrics[name].append(float(value))
        except (TypeError, ValueError):
            raise ValueError(f"log_metric({name!r}, {value!r}): the value is not a number") from None


def new_trainer_state(grpo, steps_per_epoch: float, world_process_zero: bool):
    """The transformers.TrainerState TRL passes as ``trainer_state``, with what TRL's Trainer sets
    from its config (``grpo``: the recipe's GRPOConfig, max_steps resolved); the trainer sets
    global_step, epoch and num_input_tokens_seen before each scoring."""
    from transformers import TrainerState

    return TrainerState(max_steps=grpo.max_steps, logging_steps=1, save_steps=grpo.save_steps,
                        train_batch_size=grpo.per_device_train_batch_size,
                        num_train_epochs=math.ceil(grpo.max_steps / steps_per_epoch),
                        is_local_process_zero=world_process_zero, is_world_process_zero=world_process_zero)


def _unwrap(func: Callable) -> Callable:
    while isinstance(func, functools.partial):
        func = func.func
    return func


def _callable_name(func: Callable) -> str:
    # As TRL's get_callable_name: partials unwrapped, callable objects named by their class.
    func = _unwrap(func)
    return getattr(func, "__name__", type(func).__name__)


def _is_async(func: Callable) -> bool:
    # As TRL's is_async_callable: an async callable object carries the `async` on its __call__.
    func = _unwrap(func)
    return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(getattr(func, "__call__", None))


def score_completions(
    reward_funcs: Sequence[RewardFunction],
    prompts: list,
    completions: list,
    completion_ids: list[list[int]] | None = None,
    columns: Mapping[str, list] | None = None,
    **extra: Any,
) -> torch.Tensor:
    """Rewards ``[B, F]`` (float32, NaN where a function returned None), as TRL's _calculate_rewards.

    ``extra`` is passed to every function as well (TRL passes ``trainer_state``, ``log_extra``, ...;
    functions take ``**kwargs`` for that reason). Async functions run concurrently.
    """
    kwargs = dict(prompts=prompts, completions=completions, completion_ids=completion_ids, **(columns or {}), **extra)
    out = torch.zeros(len(prompts), len(reward_funcs), dtype=torch.float32)
    pending = {}
    for i, rf in enumerate(reward_funcs):
        if _is_async(rf.func):
            pending[i] = rf.func(**kwargs)
        else:
            out[:, i] = _to_tensor(rf, _called(rf, lambda: rf.func(**kwargs)), len(prompts))
    if pending:

        async def gather():
            return await asyncio.gather(*pending.values(), return_exceptions=True)

        for i, values in zip(pending, asyncio.run(gather())):
            if isinstance(values, BaseException):
                _called(reward_funcs[i], lambda: _reraise(values))
            out[:, i] = _to_tensor(reward_funcs[i], values, len(prompts))
    return out


class RewardError(Explained, ValueError):
    """A reward function that raised or returned what is not one reward per completion, by its name
    (Explained: the message is the run's reason as it stands)."""


def _reraise(e: BaseException):
    raise e


def _called(rf: RewardFunction, call: Callable[[], Any]) -> Any:
    """``call()``, a reward function's; what it raises is re-raised naming the function (the run's
    last line reads "reward function 'f' raised ValueError: ...", not the error alone)."""
    try:
        return call()
    except Exception as e:       # noqa: BLE001 - any error of the user's code, named and chained
        raise RewardError(f"reward function '{rf.name}' raised {type(e).__name__}: {e}") from e


def _to_tensor(rf: RewardFunction, values: Sequence[float | None], n: int) -> torch.Tensor:
    if isinstance(values, (str, bytes)) or not isinstance(values, Iterable):
        raise RewardError(f"reward function '{rf.name}' returned {values!r:.80}, not a list of {n} rewards "
                          f"(one per completion, None where it does not apply)")
    values = list(values)
    if len(values) != n:
        raise RewardError(
            f"The reward function '{rf.name}' returned {len(values)} rewards, but {n} were expected "
            "(one per prompt-completion pair)."
        )
    try:
        return torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)
    except (TypeError, ValueError):
        bad = next(v for v in values if v is not None and not isinstance(v, (int, float)))
        raise RewardError(f"reward function '{rf.name}' returned {bad!r:.80} among its rewards: each must be a "
                          f"number or None") from None


def reward_sums(per_func: torch.Tensor, weights: Sequence[float]) -> list[float]:
    """Additive partial sums of a batch's rewards ``[B, F]``, for :func:`reward_statistics` (sum
    them over batches and ranks first): for the weighted total, then each function, the sum, the
    sum of squares and the count of rows that have a value (None rewards are left out, as TRL's)."""
    total = combine_rewards(per_func, torch.tensor(list(weights), dtype=per_func.dtype))
    sums = []
    for column in [total] + [per_func[:, i] for i in range(per_func.shape[1])]:
        ok = ~torch.isnan(column)
        sums += [column[ok].sum().item(), (column[ok] ** 2).sum().item(), ok.sum().item()]
    return sums


def reward_statistics(sums: Sequence[float], names: Sequence[str], prefix: str = "") -> dict[str, float]:
    """TRL's reward metrics from :func:`reward_sums`' totals: ``reward`` and ``reward_std`` of the
    weighted total, ``rewards/<name>/mean`` and ``/std`` of each function, each under ``prefix``
    (TRL's "eval_"). Standard deviations are Bessel-corrected (NaN below two values), as TRL's nanstd."""
    out = {}
    keys = [(mk.REWARD, mk.REWARD_STD)] + [(mk.reward_mean(n), mk.reward_std(n)) for n in names]
    for k, (mean_key, std_key) in enumerate(keys):
        s, sq, n = sums[3 * k:3 * k + 3]
        mean = s / n if n else math.nan
        out[prefix + mean_key] = mean
        out[prefix + std_key] = math.sqrt(max(0.0, (sq - n * mean * mean) / (n - 1))) if n > 1 else math.nan
    return out


def as_completions(prompts: list, texts: list[str]) -> list:
    """Decoded completions in the form TRL hands to reward functions: message lists when the prompts
    are conversational, plain strings otherwise."""
    from hpcrl.compute.train.data import is_conversational

    if prompts and is_conversational(prompts[0]):
        return [[{"role": "assistant", "content": t}] for t in texts]
    return list(texts)


def reward_inputs(prompts: list, completions: Sequence[Any]) -> tuple[list, dict[str, Any]]:
    """Completions (hpcrl.compute.inference.types.Completion) in the form TRL hands to reward
    functions, and the keyword arguments only a run with environments adds: a multi-turn rollout is
    its messages (assistant turns and tool results), and ``environments`` holds each rollout's."""
    if not any(c.messages is not None for c in completions):
        return as_completions(prompts, [c.text for c in completions]), {}
    shown = [list(c.messages) if c.messages is not None else [{"role": "assistant", "content": c.text}]
             for c in completions]
    if not any(c.tool_use is not None and c.tool_use.environment is not None for c in completions):
        return shown, {}
    return shown, {"environments": [c.tool_use.finished_environment() if c.tool_use is not None else None
                                    for c in completions]}


def completion_text(completion: str | list[dict]) -> str:
    """The text of a completion in either form (the last message's content if conversational)."""
    if isinstance(completion, str):
        return completion
    return completion[-1]["content"] if completion else ""


# --------------------------------------------------------------------------------------------------
# The demo task's rewards (see hpcrl.compute.train.data.demo_dataset)

_LEADING_NUMBER = re.compile(r"\s*(\d+)")
_SHORT_NUMBER = re.compile(r"\s*\d{1,2}\s*")


def demo_correct(prompts: list, completions: list, answer: list[str], **kwargs) -> list[float]:
    """1.0 if the completion starts with the right number. A wrong number of the right length gets
    partial credit that grows as it gets closer (up to 0.5), so that a random policy already sees
    reward differences inside a group; a run of digits ("1111") or no number at all gets 0.0."""
    rewards = []
    for completion, expected in zip(completions, answer, strict=True):
        m = _LEADING_NUMBER.match(completion_text(completion))
        want = int(expected)
        if m is None:
            rewards.append(0.0)
        elif int(m.group(1)) == want:
            rewards.append(1.0)
        elif len(m.group(1)) == len(str(want)):
            rewards.append(0.5 * max(0.0, 1.0 - abs(int(m.group(1)) - want) / 10))
        else:
            rewards.append(0.0)
    return rewards


def demo_format(prompts: list, completions: list, **kwargs) -> list[float]:
    """1.0 if the completion is just a number of one or two digits (the model stopped right after the
    answer), else 0.0."""
    return [1.0 if _SHORT_NUMBER.fullmatch(completion_text(c)) else 0.0 for c in completions]


# Reward specs of the demo task, for load_reward_functions.
DEMO_REWARDS = (
    {"func": "hpcrl.compute.train.rewards:demo_correct", "weight": 1.0},
    {"func": "hpcrl.compute.train.rewards:demo_format", "weight": 0.5},
)
