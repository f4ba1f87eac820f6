"""The split of a node's GPUs between generation and training, judged from a run's own timings
(pure logic: the trainers log it at the end of a run, `hpcrl status JOBID` shows it).

Generation is most of a GRPO step on GPUs, and the split (inference.gpus of a node's GPUs generate,
the rest train) is the main knob a user has for step time. From the measured seconds per step the
engines spent generating (busy) and the trainers spent training, the work of each is taken as
time x GPUs, and each phase as that work over the GPUs it would get under another split: a model
of perfect scaling within a node, which is what makes it advice, not a promise.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from hpcrl.job import metric_keys as mk
from hpcrl.job.rundir import SERVERS_DIR, read_metrics

__all__ = ["Balance", "advise", "from_run"]

# A split is suggested only when the model expects the step this much shorter.
MIN_GAIN = 1.10


@dataclass(frozen=True)
class Balance:
    gen_wait_frac: float         # of each step, the trainers' wait for generation
    engine_idle_frac: float      # of each step, the engines' time not generating
    server_gpus: int             # inference.gpus now
    best_server_gpus: int        # the split the model likes best
    gain: float                  # modelled step time now / at best_server_gpus
    gpus_per_node: int = 0
    splits: int = 2              # the splits a node's GPUs allow (whole engines, a trainer left)
    # A synchronous run's step now / with generation beside training (inference.max_staleness >= 1)
    # under the same model; 1.0 for a run that already overlaps.
    async_gain: float = 1.0

    def advice(self) -> str:
        return self._split_advice() + self._async_advice()

    def _split_advice(self) -> str:
        head = (f"generation waits {self.gen_wait_frac:.0%} of each step, the engines idle "
                f"{self.engine_idle_frac:.0%}")
        if self.splits < 2:
            # One engine and one trainer use a node's GPUs up: "balanced" would be advice with no choice.
            return (f"{head}: no other split of a node's {self.gpus_per_node} GPUs exists (inference.gpus="
                    f"{self.server_gpus}, the rest training); more nodes add both")
        if self.best_server_gpus == self.server_gpus or self.gain < MIN_GAIN:
            return f"{head}: the split of GPUs is balanced (inference.gpus={self.server_gpus})"
        return (f"{head}: try inference.gpus={self.best_server_gpus} (a model of this run's timings "
                f"expects each step {self.gain:.1f}x shorter)")

    def _async_advice(self) -> str:
        if self.async_gain < MIN_GAIN:
            return ""
        return (f"; inference.max_staleness=1 would have the engines sample the next generation while the "
                f"trainers train, one weight sync behind (the same model: each step {self.async_gain:.1f}x "
                f"shorter; README: Asynchronous generation)")


def _step_s(gen_work: float, train_work: float, server_gpus: int, gpus: int, overlapped: bool) -> float:
    gen, train = gen_work / server_gpus, train_work / (gpus - server_gpus)
    return max(gen, train) if overlapped else gen + train


def advise(*, gpus_per_node: int, server_gpus: int, step_s: float, gen_wait_s: float, engine_busy_s: float,
           train_s: float, overlapped: bool, tensor_parallel_size: int = 1) -> Balance | None:
    """The balance of one run from its mean seconds per step: the step, the trainers' wait for
    generation, the engines' generating (busy) time and the trainers' training time. None when
    there is nothing to judge (no step yet, or a node without a choice of split). The splits weighed
    are whole engines of tensor_parallel_size GPUs, with a trainer left on the node."""
    if step_s <= 0 or gpus_per_node < 2 or not 0 < server_gpus < gpus_per_node:
        return None
    gen_work, train_work = engine_busy_s * server_gpus, train_s * (gpus_per_node - server_gpus)
    now = _step_s(gen_work, train_work, server_gpus, gpus_per_node, overlapped)
    tp = tensor_parallel_size
    splits = {s: _step_s(gen_work, train_work, s, gpus_per_node, overlapped) for s in range(tp, gpus_per_node, tp)}
    if server_gpus not in splits:
        return None
    best = min(splits, key=lambda s: (splits[s], abs(s - server_gpus)))
    gain = now / splits[best] if splits[best] > 0 else 1.0
    overlapping = _step_s(gen_work, train_work, server_gpus, gpus_per_node, True)
    async_gain = 1.0 if overlapped or overlapping <= 0 else now / overlapping
    return Balance(gen_wait_frac=min(1.0, gen_wait_s / step_s),
                   engine_idle_frac=max(0.0, 1.0 - engine_busy_s / step_s),
                   server_gpus=server_gpus, best_server_gpus=best, gain=gain, gpus_per_node=gpus_per_node,
                   splits=len(splits), async_gain=async_gain)


def _engine_busy_fracs(run_dir: str | os.PathLike) -> dict[int, float]:
    """Each node's engines: the share of their serving time spent generating (their health files;
    the mean of a node's engines)."""
    by_node: dict[int, list[float]] = {}
    for path in Path(run_dir, SERVERS_DIR).glob("node-*.json"):
        try:
            h = json.loads(path.read_text())
            if h.get("serving_since") is None:
                continue                    # no request served yet
            serving = float(h["time"]) - float(h["serving_since"])
            if serving > 0:
                by_node.setdefault(int(h["node"]), []).append(min(1.0, float(h["busy_s"]) / serving))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return {node: sum(fracs) / len(fracs) for node, fracs in by_node.items()}


def from_run(run_dir: str | os.PathLike, *, gpus_per_node: int, server_gpus: int, overlapped: bool,
             last: int = 20, tensor_parallel_size: int = 1) -> tuple[Balance | None, list[str]]:
    """The balance of a run from its last ``last`` steps' metrics and its engines' health files,
    and a line per node (its trainers' wait, its engine's idle time); (None, []) before a step."""
    # The file's tail: `hpcrl status JOBID` reads this, and a long run's file is large.
    steps = [m for m in read_metrics(run_dir, max_bytes=256 * 1024) if m.get(mk.TIME_STEP_S)][-last:]
    busy = _engine_busy_fracs(run_dir)
    if not steps or not busy:
        return None, []
    n = len(steps)
    step_s = sum(m[mk.TIME_STEP_S] for m in steps) / n
    waits: dict[int, float] = {}
    for m in steps:
        for node, w in enumerate(m.get(mk.TIME_GENERATION_S_BY_NODE) or ()):
            waits[node] = waits.get(node, 0.0) + w / n
    engines = "the engine" if server_gpus == tensor_parallel_size else "its engines"
    lines = [f"node {node}: trainers waited {waits[node] / step_s:.0%} of each step for generation, "
             f"{engines} idled {1 - busy[node]:.0%}" for node in sorted(busy) if node in waits]
    balance = advise(gpus_per_node=gpus_per_node, server_gpus=server_gpus, step_s=step_s,
                     gen_wait_s=sum(m.get(mk.TIME_GENERATION_S) or 0.0 for m in steps) / n,
                     engine_busy_s=step_s * sum(busy.values()) / len(busy),
                     train_s=sum(m.get(mk.TIME_TRAIN_S) or 0.0 for m in steps) / n, overlapped=overlapped,
                     tensor_parallel_size=tensor_parallel_size)
    return balance, lines
