"""Generations asked for ahead of their turn, and how far behind the policy their completions are.

inference.overlap_generation keeps one generation asked for while the trainers train; inference.
max_staleness = k keeps k. A completion's staleness is the number of weight syncs between the
version that sampled it and the policy that trains on it (TRL AsyncGRPOTrainer's measure); one more
than k syncs behind when its turn comes (an evaluation's sync can add one), its generation is
dropped, counted, and asked for again at the current weights.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

from hpcrl.compute.inference.types import Completion
from hpcrl.compute.train.generation import Requested

__all__ = ["Ahead"]


class Ahead:
    """The generations asked for ahead (oldest first), the weight versions pushed since the oldest
    of them could have been sampled, and the completions dropped for staleness. ``request(step)``
    asks for the generation whose training starts at optimizer step ``step``."""

    def __init__(self, bound: int, request: Callable[[int], Requested], log: Callable[[str], None] = print):
        self.bound = bound
        self.request = request
        self.log = log
        self.queue: deque[Requested] = deque()
        self.pushed: list[int] = []         # newest last; a re-push of the same version is no sync
        self.dropped = 0

    def __len__(self) -> int:
        return len(self.queue)

    def fill(self, first_step: int, steps_per_generation: int, max_steps: int) -> None:
        """Ask for generations up to the bound, the first of those not yet asked for starting at
        optimizer step ``first_step`` (as far as the run will train on them)."""
        first_step += len(self.queue) * steps_per_generation
        while len(self.queue) < self.bound and first_step < max_steps:
            self.queue.append(self.request(first_step))
            first_step += steps_per_generation

    def next(self, step: int) -> tuple[Requested, list[Completion], list[int]]:
        """The generation due at ``step`` (the oldest asked for ahead, else asked for now), its
        completions and each one's staleness; a stale one is replaced by one asked for now."""
        requested = self.queue.popleft() if self.queue else self.request(step)
        completions = requested.take()
        staleness = self.staleness(completions)
        if max(staleness, default=0) <= self.bound:
            return requested, completions, staleness
        self.dropped += len(completions)
        self.log(f"step {step + 1}: dropped a generation of {len(completions)} completions {max(staleness)} weight "
                 f"syncs behind (inference.max_staleness={self.bound}); asking again")
        # Asked for now, it is no older than the current weights (Requested.take checks it).
        requested = self.request(step)
        completions = requested.take()
        return requested, completions, self.staleness(completions)

    def staleness(self, completions: Sequence[Completion]) -> list[int]:
        return [sum(v > c.weight_version for v in self.pushed) for c in completions]

    def pushed_version(self, version: int) -> None:
        if not self.pushed or self.pushed[-1] != version:
            self.pushed = self.pushed[-(self.bound + 1):] + [version]

    def take_all(self) -> None:
        """Wait for every generation asked for ahead (a checkpoint keeps completions, never a
        request in flight; overlap_generation samples with the weights it asked under)."""
        for requested in self.queue:
            requested.take()

    def state_dict(self) -> dict:
        """The generations ahead kept whole: the sampler is past their prompts, and a resume trains
        on exactly these completions."""
        self.take_all()
        return {"ahead": [r.state_dict() for r in self.queue], "pushed": self.pushed[-(self.bound + 2):],
                "dropped_stale": self.dropped}

    def load_state_dict(self, extra: dict) -> None:
        states = extra.get("ahead", [extra.get("next")])       # (older checkpoints: one, "next")
        self.queue = deque(r for r in map(Requested.from_state, states) if r is not None)
        self.pushed = list(extra.get("pushed", []))
        self.dropped = int(extra.get("dropped_stale", 0))
