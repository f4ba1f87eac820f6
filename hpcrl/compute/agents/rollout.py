"""TRL's tool-calling loop (GRPOTrainer._tool_call_loop, TRL 1.16) over rollouts in progress.

Each round runs the tool calls of every rollout whose last assistant turn made some, appends their
results as ``role: tool`` messages, and asks the engines to continue those rollouts, one completion
each. The token ids are built by concatenation (prompt + completion so far + the tool results' ids),
never by re-tokenising the conversation, so the trained tokens are the sampled ones; the tool
results' tokens get ``tool_mask`` 0 (no loss, no length) and sampling log-probability 0. A round
whose tool results would push a rollout past ``max_completion_length`` or the engine's context rolls
them back and ends that rollout with the turn that called them; ``max_tool_calling_iterations``
bounds the rounds. Differences from TRL, on purpose: the tools run in worker processes (bounded,
hpcrl.compute.agents.tool_pool), the rollouts' tools of one round run in parallel, and an async
tool's result keeps its place among the calls (TRL appends async results after the sync ones).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from hpcrl.compute.agents.conversation import ToolChat

__all__ = ["Rollout", "tool_call_loop", "continuation", "extend", "token_versions", "run_tools", "submit_tools",
           "tools_bound_s", "tool_messages", "tool_message"]


@dataclass
class Rollout:
    """One rollout as the loop grows it: the completion's ids, sampling log-probabilities and tool
    mask (one each per completion token), and its messages (assistant turns and tool results)."""
    prompt_ids: list[int]
    tools: list[dict]                   # the schemas its prompt was rendered with
    session: Any                        # its ToolPool session: its environment instance, if any
    completion_ids: list[int]
    logprobs: list[float]
    messages: list[dict]
    truncated: bool                     # the last turn stopped at the length limit
    tool_mask: list[int] = field(default_factory=list)
    # Each completion token's weight version (a tool result's tokens: its turn's); [] where no
    # turn's completion carried them.
    versions: list[int] = field(default_factory=list)
    calls: int = 0
    failures: int = 0
    turns: int = 1
    tool_s: float = 0.0

    def __post_init__(self):
        if not self.tool_mask:
            self.tool_mask = [1] * len(self.completion_ids)

    @property
    def tool_calls(self) -> list[dict] | None:
        return self.messages[-1].get("tool_calls") if self.messages else None


# A turn's continuations: (prompt ids of each rollout, the round) -> one Completion each.
Continue = Callable[[list[list[int]], int], Sequence[Any]]


def round_seed(seed: int | None, request: int) -> int | None:
    """The seed of a rollout call's ``request``-th request after its first (0: the second), in the
    lockstep loop and in a rollout function's calls: all of a call's requests differ, and a call
    seeded alike repeats itself."""
    return None if seed is None else seed * 7_919 + request + 1


def turn_seed(seed: int | None, rollout: int, turn: int) -> int | None:
    """The seed of ``rollout``'s ``turn`` (0: the first) within a generation seeded ``seed``, in the
    per-sample loop: a request's draws do not depend on the batch it lands in."""
    return None if seed is None else (seed * 1_000_003 + rollout * 1_009 + turn) % 2**63


def tool_call_loop(rollouts: Sequence[Rollout], chat: ToolChat, pool, generate: Continue, *, max_iterations: int,
                   max_completion_length: int, context_len: int) -> None:
    """Run the tool rounds of ``rollouts`` in place until none calls a tool, or for
    ``max_iterations`` rounds (TRL's max_tool_calling_iterations)."""
    active = [r for r in rollouts if r.tool_calls]
    round_ = 0
    while active and round_ < max_iterations:
        results = run_tools(active, pool)
        going, ids = [], []
        for r, messages in zip(active, results):
            pct = continuation(r, messages, chat, max_completion_length, context_len)
            if pct is not None:
                going.append(r)
                ids.append(pct)
        if not going:
            break
        outs = generate(ids, round_)
        active = []
        for r, pct, out in zip(going, ids, outs):
            if extend(r, pct, out, chat, max_completion_length):
                active.append(r)
        round_ += 1


def continuation(r: Rollout, messages: list[dict], chat: ToolChat, max_completion_length: int,
                 context_len: int) -> list[int] | None:
    """The ids ``r`` continues from once its tool results ``messages`` are appended (prompt +
    completion so far + the results' suffix ids); None where they would pass max_completion_length or
    the context: then they are rolled back and the rollout ends with the turn that called them."""
    pct = r.prompt_ids + r.completion_ids + chat.suffix_ids(messages)
    if len(pct) - len(r.prompt_ids) > max_completion_length or len(pct) >= context_len:
        return None
    r.messages += messages
    return pct


def extend(r: Rollout, pct: list[int], out, chat: ToolChat, max_completion_length: int) -> bool:
    """``r`` continued by ``out`` after its tool results (``pct``: the ids it was continued from);
    True when the new turn calls tools again."""
    budget = max_completion_length - (len(pct) - len(r.prompt_ids))
    new, logps = list(out.token_ids)[:budget], list(out.logprobs)[:budget]
    tool_len = len(pct) - len(r.prompt_ids) - len(r.completion_ids)
    r.tool_mask += [0] * tool_len + [1] * len(new)
    r.logprobs += [0.0] * tool_len + logps
    if r.versions:
        r.versions += [r.versions[-1]] * tool_len + token_versions(out)[:budget]
    r.completion_ids = pct[len(r.prompt_ids):] + new
    r.truncated = out.truncated or len(new) < len(out.token_ids)
    r.turns += 1
    if not new:                     # cut to nothing by the budget: no message, as TRL's
        return False
    message = chat.parse(new, pct, r.tools)
    r.messages.append(message)
    return bool(message.get("tool_calls"))


def token_versions(c) -> list[int]:
    """The weight version of each of completion ``c``'s tokens."""
    return list(c.token_versions) if c.token_versions is not None else [c.weight_version] * len(c.token_ids)


def run_tools(active: Sequence[Rollout], pool) -> list[list[dict]]:
    """The tool messages of each rollout's last turn, its calls run in its pool session; the
    rollouts' calls run at once (each session's on its own worker)."""
    pending = [submit_tools(r, pool) for r in active]
    return [tool_messages(r, future.result(timeout=tools_bound_s(r, pool)) if future else []) for r, future in
            zip(active, pending)]


def submit_tools(r: Rollout, pool):
    """Start the function calls of ``r``'s last turn in its session; their future (of ToolResults,
    in call order), or None where it made none."""
    functions = [(c["function"]["name"], c["function"].get("arguments", {})) for c in r.tool_calls
                 if c.get("type") == "function"]
    return pool.submit_many(r.session, functions) if functions else None


def tools_bound_s(r: Rollout, pool) -> float:
    """How long a turn's calls may take together: the pool bounds each call; this bounds them all,
    with room for a worker's restart."""
    return pool.timeout_s * (len(r.tool_calls) + 1) + 30


def tool_messages(r: Rollout, done: Sequence[Any]) -> list[dict]:
    """The messages of ``r``'s last turn's calls, ``done`` being its function calls' ToolResults;
    counts its calls, failures and tool time."""
    r.tool_s += sum(result.seconds for result in done)
    results = iter(done)
    messages = []
    for call in r.tool_calls:
        r.calls += 1
        if call.get("type") == "function":
            result = next(results)
            name, content, failed = result.name, result.content, result.failed
        else:
            name, failed = call.get("name", "unknown"), True
            content = {"error": f"Unsupported tool call type: {call.get('type')}"}
        r.failures += failed
        messages.append(tool_message(name, content))
    return messages


def tool_message(name: str, content: Any) -> dict:
    """A tool's result as TRL's message: a list of content blocks as it is, anything else as text."""
    return {"role": "tool", "name": name, "content": content if isinstance(content, list) else str(content)}
