"""The rollout thread and the trainer's weight pushes take turns (hpcrl.compute.agents.sync_gate):
a push waits for the generation under way, the next waits for the push, and a generation that
failed fails the push with its own error."""

from __future__ import annotations

import threading
import time

import pytest

from hpcrl.compute.agents.sync_gate import SyncGate


def test_a_push_waits_for_the_rollouts_under_way_and_the_next_waits_for_the_push():
    gate, events = SyncGate(), []
    rolling, release = threading.Event(), threading.Event()

    def generation(name, hold=None):
        with gate.rollouts():
            events.append(f"{name} starts")
            rolling.set()
            if hold is not None:
                hold.wait(5)
            events.append(f"{name} ends")

    first = threading.Thread(target=generation, args=("g1", release))
    first.start()
    rolling.wait(5)
    pusher = threading.Thread(target=lambda: _push(gate, events))
    pusher.start()
    time.sleep(0.1)                 # the push is waiting now: a generation queued after it goes after it
    second = threading.Thread(target=generation, args=("g2",))
    second.start()
    time.sleep(0.1)
    assert events == ["g1 starts"]
    release.set()
    for t in (first, pusher, second):
        t.join(5)
    assert events == ["g1 starts", "g1 ends", "push", "g2 starts", "g2 ends"]


def _push(gate, events):
    with gate.sync():
        events.append("push")


def test_a_push_after_failed_rollouts_raises_their_error():
    gate = SyncGate()
    with pytest.raises(ValueError):
        with gate.rollouts():
            raise ValueError("the environment's reset failed")
    with pytest.raises(ValueError, match="the environment's reset failed"):
        with gate.sync():
            raise AssertionError("a push went ahead after its rollouts failed")
