"""Logged metrics as one trainer rank's partials, and their reduction over all the trainer ranks.

The loss and its corrections return :class:`Metric` partials (local sum and count, or local min /
max), so that a distributed trainer reduces them exactly as TRL's ``accelerator.reduce``/``gather``
calls do: :func:`merge_metrics` accumulates them over micro-batches, :func:`reduce_metrics` combines
them over ranks with one collective per reduction kind.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["Metric", "mean_metric", "merge_metrics", "reduce_metrics", "global_sum"]


@dataclass
class Metric:
    """One logged scalar as local partials, combined over ranks by :func:`reduce_metrics`.

    op="mean": ``value`` is a local sum and ``count`` its weight; the result is sum(value)/sum(count).
    op="min"/"max": ``value`` is the local extreme (NaN when this rank has nothing), ``count`` unused.
    """

    value: Tensor
    count: Tensor | float = 1.0
    op: str = "mean"


def mean_metric(value: Tensor, count: Tensor | float) -> Metric:
    """A "mean" partial: the local sum ``value`` weighing ``count``."""
    return Metric(value.detach().float(), torch.as_tensor(count, dtype=torch.float32, device=value.device))


def merge_metrics(into: dict[str, Metric], new: Mapping[str, Metric]) -> None:
    """Accumulate metric partials over micro-batches: sums for means, extremes for min/max."""
    for k, m in new.items():
        old = into.get(k)
        if old is None:
            into[k] = m
        elif m.op == "mean":
            into[k] = Metric(old.value + m.value, torch.as_tensor(old.count) + torch.as_tensor(m.count), "mean")
        else:
            pick = torch.minimum if m.op == "min" else torch.maximum
            into[k] = Metric(pick(old.value, m.value), old.count, m.op)


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


def global_sum(values: list[float], group) -> list[float]:
    """``values`` summed element-wise over the trainer ranks of ``group`` (a collective), in float64."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.tolist()
