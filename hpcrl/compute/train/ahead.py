"""Generations asked for ahead of their turn, and how far behind the policy their completions are.

inference.overlap_generation keeps one generation asked for while the trainers train; inference.
max_staleness = k keeps k. A completion's staleness is the number of weight syncs between the
version that sampled it and the policy that trains on it (TRL AsyncGRPOTrainer's measure); one more
than k syncs behind when its turn comes (an evaluation's sync can add one), its generation is
dropped, counted, and asked for again at the current weights.

A checkpoint keeps the prompts of the generations ahead, not their completions (issue #31): a
resume drops whatever was sampled under the weights before it, says so, and asks for the same
prompts again at the checkpoint's weights, in the same order and with the same seeds. So no
completion is trained on twice, no prompt is skipped, and a checkpoint never waits for a generation
in flight (at the time-limit signal that wait would come out of the signal's lead).
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

from hpcrl.compute.inference.types import Completion
from hpcrl.compute.train.data import PromptBatch
from hpcrl.compute.train.generation import Requested

__all__ = ["Ahead"]


class Ahead:
    """The generations asked for ahead (oldest first), the weight versions pushed since the oldest
    of them could have been sampled, and the completions dropped for staleness. ``request(step)``
    asks for the generation whose training starts at optimizer step ``step`` (``request(step, batch)``:
    of those prompts, rather than the sampler's next)."""

    def __init__(self, bound: int, request: Callable[..., Requested], log: Callable[[str], None] = print):
        self.bound = bound
        self.request = request
        self.log = log
        self.queue: deque[Requested] = deque()
        self.pushed: list[int] = []         # newest last; a re-push of the same version is no sync
        self.dropped = 0
        # A resume's: the prompts of the generations the checkpoint had asked for ahead, oldest first.
        self.again: deque[PromptBatch] = deque()

    def __len__(self) -> int:
        return len(self.queue)

    def fill(self, first_step: int, steps_per_generation: int, max_steps: int) -> None:
        """Ask for generations up to the bound, the first of those not yet asked for starting at
        optimizer step ``first_step`` (as far as the run will train on them)."""
        first_step += len(self.queue) * steps_per_generation
        while len(self.queue) < self.bound and first_step < max_steps:
            self.queue.append(self._ask(first_step))
            first_step += steps_per_generation

    def next(self, step: int) -> tuple[Requested, list[Completion], list[int]]:
        """The generation due at ``step`` (the oldest asked for ahead, else asked for now), its
        completions and each one's staleness; a stale one is replaced by one asked for now."""
        requested = self.queue.popleft() if self.queue else self._ask(step)
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

    def _ask(self, step: int) -> Requested:
        return self.request(step, self.again.popleft()) if self.again else self.request(step)

    def staleness(self, completions: Sequence[Completion]) -> list[int]:
        return [sum(v > c.weight_version for v in self.pushed) for c in completions]

    def pushed_version(self, version: int) -> None:
        if not self.pushed or self.pushed[-1] != version:
            self.pushed = self.pushed[-(self.bound + 1):] + [version]

    def take_all(self) -> None:
        """Wait for every generation asked for ahead (overlap_generation samples with the weights it
        asked under)."""
        for requested in self.queue:
            requested.take()

    def state_dict(self) -> dict:
        """The prompts of the generations ahead, in flight or not, and never their completions: the
        sampler is past these prompts, and a resume asks for them again."""
        return {"ahead_prompts": [r.batch for r in self.queue], "pushed": self.pushed[-(self.bound + 2):],
                "dropped_stale": self.dropped}

    def load_state_dict(self, extra: dict) -> int:
        """Returns how many generations ahead the checkpoint had, now dropped (their prompts are
        asked for again)."""
        if "ahead_prompts" in extra:
            batches = list(extra["ahead_prompts"])
        else:       # older checkpoints kept the completions ahead (or one, "next"): dropped as well
            batches = [state["batch"] for state in extra.get("ahead", [extra.get("next")]) if state is not None]
        self.queue, self.again = deque(), deque(batches)
        self.pushed = list(extra.get("pushed", []))
        self.dropped = int(extra.get("dropped_stale", 0))
        return len(batches)
