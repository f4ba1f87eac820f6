"""Per-sample rollouts: each rollout moves on as soon as its own turn or its own tools are done.

TRL's loop (hpcrl.compute.agents.rollout.tool_call_loop) runs in lockstep rounds: every rollout's
tools wait for the round's longest turn, and the engine waits for the round's slowest tool. Here
each rollout is a request on a stream (types.Stream): when its turn comes back its tools start at
once, and when they are done its continuation joins the engine's running batch, so the engine
generates for some rollouts while others wait on their tools. The rules of a turn are TRL's, the
same functions as the lockstep loop's (continuation, extend, tool_messages); what differs is only
when each rollout's next step happens.

Each request is seeded by its rollout and turn (``turn_seed``), not by the batch it lands in: which
requests share a batch depends on timing, and the samples, a resumed run's included, must not.
"""

from __future__ import annotations

import queue
import time
from dataclasses import dataclass, replace
from typing import Any, Sequence

from hpcrl.compute.agents.conversation import ToolChat
from hpcrl.compute.agents.rollout import (Rollout, continuation, extend, submit_tools, token_versions,
                                          tool_messages, tools_bound_s, turn_seed)
from hpcrl.compute.inference.types import Completion, Sampling, Stream

__all__ = ["Start", "first_turn", "run_per_sample"]

# How often the loop looks at the engines while tools run (a tool's end does not wake the wait on
# the engines' channels): small against a tool call or an engine step.
POLL_S = 0.005


@dataclass(frozen=True)
class Start:
    """A rollout before its first turn: its prompt's ids, the tool schemas it was rendered with, its
    session; ``first``: its first turn where it was made before the loop (a rollout function's)."""
    prompt_ids: list[int]
    tools: list[dict]
    session: Any
    first: Completion | None = None


def run_per_sample(starts: Sequence[Start], chat: ToolChat, pool, stream: Stream, sampling: Sampling, *,
                   max_iterations: int, max_completion_length: int,
                   context_len: int) -> list[tuple[Rollout, Completion]]:
    """Every rollout of ``starts`` taken to its end through ``stream``; each with its first turn's
    completion (its weight version), in the order of ``starts``."""
    rollouts: list[Rollout | None] = [None] * len(starts)
    first: list[Completion | None] = [None] * len(starts)
    resumed_from: dict[int, list[int]] = {}         # rollout -> the ids its pending turn continues
    tools: dict[int, tuple[Any, float]] = {}        # rollout -> (its tools' future, their deadline)
    tools_done: queue.SimpleQueue[int] = queue.SimpleQueue()
    one = replace(sampling, n=1)

    def ask(i: int, ids: list[int], turn: int) -> None:
        stream.add(i, ids, replace(one, seed=turn_seed(sampling.seed, i, turn)))

    def generated(i: int, c: Completion) -> None:
        if rollouts[i] is None:
            s = starts[i]
            r = rollouts[i] = first_turn(s, c, chat)
            first[i] = c
            calls = bool(r.tool_calls)
        else:
            r = rollouts[i]
            calls = extend(r, resumed_from.pop(i), c, chat, max_completion_length)
        if calls and r.turns - 1 < max_iterations:          # TRL's bound on a rollout's tool rounds
            future = submit_tools(r, pool)
            if future is None:          # no call it can run: its error messages go back at once
                tools_finished(i, [])
                return
            tools[i] = (future, time.monotonic() + tools_bound_s(r, pool))
            future.add_done_callback(lambda _, i=i: tools_done.put(i))

    def tools_finished(i: int, results: list) -> None:
        r = rollouts[i]
        pct = continuation(r, tool_messages(r, results), chat, max_completion_length, context_len)
        if pct is not None:
            resumed_from[i] = pct
            ask(i, pct, r.turns)

    for i, s in enumerate(starts):
        if s.first is None:
            ask(i, s.prompt_ids, 0)
        else:
            generated(i, s.first)
    while stream.outstanding or tools:
        if stream.outstanding:
            # Wait on the engines alone when no tool runs; else look at them between the tools' ends.
            for i, c in stream.take(None if not tools else 0 if not tools_done.empty() else POLL_S):
                generated(i, c)
        elif tools_done.empty():
            _wait_for_tools(tools, tools_done)
        while not tools_done.empty():
            i = tools_done.get()
            future, _ = tools.pop(i)
            tools_finished(i, future.result())
        _check_tool_deadlines(tools, rollouts)
    return list(zip(rollouts, first))


def first_turn(s: Start, c: Completion, chat: ToolChat) -> Rollout:
    """The rollout of ``s`` after its first turn ``c``; a mask ``c`` carries (a rollout function's
    env_mask) is kept, so the environment's tokens in it take no loss."""
    return Rollout(prompt_ids=s.prompt_ids, tools=s.tools, session=s.session, completion_ids=list(c.token_ids),
                   logprobs=list(c.logprobs), messages=[chat.parse(c.token_ids, s.prompt_ids, s.tools)],
                   truncated=c.truncated, tool_mask=list(c.tool_mask or ()), versions=token_versions(c))


def _wait_for_tools(tools: dict[int, tuple[Any, float]], tools_done: queue.SimpleQueue) -> None:
    """Until a rollout's tools are done, or the first of their deadlines."""
    wait = max(0.0, min(deadline for _, deadline in tools.values()) - time.monotonic())
    try:
        tools_done.put(tools_done.get(timeout=wait))
    except queue.Empty:
        pass            # the deadline check names it


def _check_tool_deadlines(tools: dict[int, tuple[Any, float]], rollouts: list) -> None:
    now = time.monotonic()
    for i, (future, deadline) in tools.items():
        if now > deadline and not future.done():
            names = ", ".join(c["function"]["name"] for c in rollouts[i].tool_calls if c.get("type") == "function")
            raise TimeoutError(f"rollout {i}'s tool calls ({names}) were not done by their bound (agent.tool_timeout_s "
                               f"for each call, and 30 s for a worker's restart)")
