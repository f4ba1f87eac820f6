"""Rollouts that run in a thread of their own, and weight syncs in the trainer's: one at a time.

An agent's rollouts (and a rollout function's) talk to the engines from their own thread, turn after
turn, and every turn of a rollout must come from one weight version. With several generations asked
for ahead (inference.max_staleness > 1) the trainer pushes weights while some are still to be rolled
out, so it waits here for the one under way to finish, and the next waits for the sync: the engines'
channels are never used by both threads at once, and a sync never lands inside a rollout. In flight
(inference.weight_update) the push does not wait here: the engines take it between two steps.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

__all__ = ["SyncGate"]


class SyncGate:
    """``rollouts()`` around each generation's work in the rollout thread, ``sync()`` around a weight
    push in the trainer's. A sync waits for the generation under way and then goes first: a
    generation that would start meanwhile waits for it, so a push is never starved by the queue."""

    def __init__(self):
        self._cond = threading.Condition()
        self._rolling = False
        self._syncing = False
        self._failed: BaseException | None = None

    @contextmanager
    def rollouts(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._syncing)
            self._rolling = True
        try:
            yield
        except BaseException as e:
            # Kept for the trainer: a sync that waited on these rollouts raises their own error
            # (not a stream left open), and the job's line gives the real cause.
            self._failed = e
            raise
        finally:
            with self._cond:
                self._rolling = False
                self._cond.notify_all()

    def run(self, work, *args):
        """``work(*args)`` as a generation of rollouts (what the rollout thread's executor calls)."""
        with self.rollouts():
            return work(*args)

    @contextmanager
    def sync(self) -> Iterator[None]:
        """Wait for the rollouts under way (each of their waits on the engines and tools has its own
        bound, so this one ends), then hold new ones off until the block is done."""
        with self._cond:
            self._syncing = True
            self._cond.wait_for(lambda: not self._rolling)
        try:
            if self._failed is not None:
                raise self._failed
            yield
        finally:
            with self._cond:
                self._syncing = False
                self._cond.notify_all()
