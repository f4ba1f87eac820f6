"""Multi-turn rollouts for the trainer: what a generation is when the recipe names tools or
environments (agent.tools, agent.environment_factory), as TRL's GRPOTrainer runs them.

``submit`` opens one tool session per rollout (an environment instance, reset with the prompt's row;
a string it returns is appended to the last user message) and renders each prompt with its tools; a
thread then runs the rollouts over the node's engines, so that with inference.overlap_generation
the whole conversation, tool rounds included, overlaps training; with inference.max_staleness = k
the thread works through the k generations asked for ahead, one after another, and a weight push
waits for the one under way (hpcrl.compute.agents.sync_gate), unless the engines take it in flight
(inference.weight_update): then the rollouts under way go on with the new weights. Where the
engines take streams (the server's), each rollout moves on by itself (hpcrl.compute.agents.per_sample): its tools start
when its turn is done, and its next turn joins the engine's batch when they are. Elsewhere, and
with ``per_sample=False``, the rounds are lockstep, as TRL's (hpcrl.compute.agents.rollout). An
environment's get_reward() is read when its rollout is done, and the session is closed then: what
is scored and checkpointed is plain data.

With a rollout function beside the tools (agent.rollout_func, TRL's rollout_func= with tools=), the
function makes each rollout's first turn from the prompts as the environments left them, and the
tool loop takes its rows on from there: its prompt ids are the rows', its extra fields reach the
reward functions, and its env_mask is kept as the first turn's mask (TRL would train on those tokens).
"""

from __future__ import annotations

import concurrent.futures
import copy
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

from hpcrl.compute.agents.conversation import ToolChat
from hpcrl.compute.agents.per_sample import Start, first_turn, run_per_sample
from hpcrl.compute.agents.rollout import Rollout, round_seed, tool_call_loop
from hpcrl.compute.agents.sync_gate import SyncGate
from hpcrl.compute.inference.types import Completion, Generator, Sampling
from hpcrl.compute.train.data import PromptBatch, is_conversational

__all__ = ["ToolUse", "FinishedEnvironment", "AgentRollouts", "AgentGeneration", "with_observation"]


@dataclass(frozen=True)
class ToolUse:
    """What a rollout did with its tools: the step's tools/ metrics are made of these."""
    calls: int
    failures: int
    turns: int                          # assistant turns (1: no tool was called)
    tool_s: float                       # seconds its tool calls took
    environment: str | None = None      # its environment's class name
    environment_reward: float | None = None     # get_reward(), where the environment has one

    def finished_environment(self) -> "FinishedEnvironment":
        """What reward functions get as this rollout's ``environments`` entry."""
        return FinishedEnvironment(self)


class FinishedEnvironment:
    """What reward functions get as ``environments`` (TRL passes the live instances): the instance
    lived in a tool worker process and is gone when the rollout is scored, so only what TRL's own
    environment reward reads is kept, get_reward()'s value."""

    def __init__(self, use: ToolUse):
        self.class_name = use.environment
        self._reward = use.environment_reward

    def get_reward(self) -> float | None:
        return self._reward

    def __getattr__(self, name: str):
        raise AttributeError(f"{name!r}: hpcrl runs environments in tool worker processes, and a reward function "
                             f"sees only their get_reward() values (environments[i].get_reward())")


class AgentRollouts:
    """Rollouts with tools through ``generator`` (the node's engines). ``pool``: the rank's
    hpcrl.compute.agents.tool_pool.ToolPool; ``grpo``: the recipe's grpo section;
    ``context_len``: the engines' context (prompt + completion), past which a tool result is rolled
    back; ``by_column``: the rows choose their environment by their ``environment`` column;
    ``per_sample``: each rollout moves on by itself where the generator takes streams (else, and
    when False, lockstep rounds: the bench's baseline); ``first_turns``: a
    hpcrl.compute.agents.rollout_func.RolloutFunction that makes the first turns (else the engines);
    ``in_flight``: the engines take syncs between two of their steps (inference.weight_update), so a
    push does not wait for the rollouts under way, whose tokens carry the versions that sampled them."""

    def __init__(self, generator: Generator, pool, chat: ToolChat, grpo, context_len: int, by_column: bool = False,
                 per_sample: bool = True, first_turns=None, in_flight: bool = False):
        self.generator, self.pool, self.chat, self.grpo = generator, pool, chat, grpo
        self.context_len = context_len
        self.by_column = by_column
        self.per_sample = per_sample and hasattr(generator, "open_stream")
        self.max_iterations = grpo.max_tool_calling_iterations
        if self.max_iterations is None:
            self.max_iterations = 2**62         # TRL's: no bound
        self.first_turns = first_turns
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="hpcrl-rollouts")
        self.gate = SyncGate()
        self.in_flight = in_flight

    def submit(self, batch: PromptBatch, sampling: Sampling) -> tuple[PromptBatch, "AgentGeneration"]:
        """Start ``sampling.n`` rollouts of each prompt of ``batch``; returns the batch as rolled out
        (a row per rollout, its prompt with the environment's observation) and the pending result."""
        if batch.prompts and not is_conversational(batch.prompts[0]):
            raise ValueError("agents need conversational prompts (a list of messages): a plain-text prompt has no "
                             "chat template to render tools with")
        rows = batch.repeat(sampling.n)
        environments = rows.columns.get("environment") if self.by_column else [None] * len(rows)
        # The resets run at once, each in its session's worker (the pool bounds each).
        opening = [self.pool.submit_open(e, self._reset_kwargs(rows, i)) for i, e in enumerate(environments)]
        sessions = [f.result() for f in opening]
        prompts = [with_observation(p, s.observation) for p, s in zip(rows.prompts, sessions)]
        tools = [self.pool.schemas(e) for e in environments]
        if self.first_turns is not None:
            from hpcrl.compute.agents.rollout_func import RolloutFunctionGeneration

            # The rows' prompt ids and texts are the function's, known once it has run.
            rows = PromptBatch(prompts, list(rows.texts), [[] for _ in prompts], rows.columns, rows.indices)
            future = self._in_thread(self._after_function, prompts, tools, sessions, environments, sampling, len(batch))
            return rows, RolloutFunctionGeneration(future, rows, self.chat.tokenizer)
        ids = [self.chat.prompt_ids(p, t) for p, t in zip(prompts, tools)]
        rows = PromptBatch(prompts, [self.chat.render(p, t) for p, t in zip(prompts, tools)], ids, rows.columns,
                           rows.indices)
        starts = [Start(p, t, s) for p, t, s in zip(ids, tools, sessions)]
        if self.per_sample:
            return rows, AgentGeneration(self._in_thread(self._per_sample, starts, environments, sampling))
        return rows, AgentGeneration(self._in_thread(self._lockstep, starts, environments, sampling))

    def _in_thread(self, work, *args) -> concurrent.futures.Future:
        """``work`` in the rollout thread, after the generations asked for before it, and never
        while the trainer pushes weights (``paused_for_sync``)."""
        return self.executor.submit(self.gate.run, work, *args)

    def paused_for_sync(self):
        """Around a weight push: waits for the generation under way, and holds the next until the
        push is done (every turn of a rollout comes from one weight version); in flight, nothing:
        the engines take the push between two of their steps."""
        return nullcontext() if self.in_flight else self.gate.sync()

    def _after_function(self, prompts: list, tools: list[list[dict]], sessions: list, environments: list,
                        sampling: Sampling, groups: int):
        """The first turns from the rollout function, then the tool loop from them (in the executor's
        thread); the rollouts' completions with the function's RolledOut (its prompt ids and fields)."""
        try:
            rolled = self.first_turns.roll_out(copy.deepcopy(prompts), sampling, groups)
        except BaseException:
            for s in sessions:
                self.pool.close_session(s)
            raise
        starts = [Start(p, t, s, first=c) for p, t, s, c in zip(rolled.prompt_ids, tools, sessions, rolled.completions)]
        if self.per_sample:
            return self._per_sample(starts, environments, sampling), rolled
        # The continuations' seeds follow the function's requests' (round_seed), none reused.
        return self._finish(None, starts, environments, sampling, self.first_turns.engines.requests), rolled

    def _reset_kwargs(self, rows: PromptBatch, i: int) -> dict:
        # TRL's: reset(**row); in the mapping form without the column that chose the environment.
        row = {"prompt": rows.prompts[i], **{k: v[i] for k, v in rows.columns.items()}}
        if self.by_column:
            row.pop("environment", None)
        return row

    def _per_sample(self, starts: list[Start], environments: list, sampling: Sampling) -> list[Completion]:
        """The rollouts, each moving on by itself over a stream on the engines (in the executor's thread)."""
        stream = self.generator.open_stream()
        try:
            done = run_per_sample(starts, self.chat, self.pool, stream, sampling, max_iterations=self.max_iterations,
                                  max_completion_length=self.grpo.max_completion_length,
                                  context_len=self.context_len)
            stream.close()
            return self._completions([r for r, _ in done], [c for _, c in done], environments)
        finally:
            for s in starts:
                self.pool.close_session(s.session)

    def _lockstep(self, starts: list[Start], environments: list, sampling: Sampling) -> list[Completion]:
        """The rollouts in lockstep rounds, first turns included (in the executor's thread)."""
        # One request of n per prompt where the rollouts of a prompt start alike (the engines sample a
        # group at once); a request per rollout where an environment made them differ.
        ids, n = [s.prompt_ids for s in starts], sampling.n
        alike = all(ids[i] == ids[i - i % n] for i in range(len(ids)))
        first = (self.generator.submit(ids[::n], sampling) if alike
                 else self.generator.submit(ids, replace(sampling, n=1)))
        return self._finish(first, starts, environments, sampling)

    def _finish(self, first, starts: list[Start], environments: list, sampling: Sampling,
                requests_before: int = 0) -> list[Completion]:
        """The rollouts taken to their end in lockstep rounds (in the executor's thread), as completions;
        ``first``: the engines' pending first turns, None where ``starts`` carry theirs; the rounds'
        seeds come after ``requests_before`` requests of the same generation."""
        try:
            turn = ([s.first for s in starts] if first is None
                    else sorted(first.result(), key=lambda c: c.prompt_index))   # stable: a prompt's n keep their order
            rollouts = [first_turn(s, c, self.chat) for s, c in zip(starts, turn)]

            def generate(prompt_ids: list[list[int]], round_: int):
                seed = round_seed(sampling.seed, requests_before + round_)
                out = self.generator.submit(prompt_ids, replace(sampling, n=1, seed=seed)).result()
                return sorted(out, key=lambda c: c.prompt_index)

            tool_call_loop(rollouts, self.chat, self.pool, generate, max_iterations=self.max_iterations,
                           max_completion_length=self.grpo.max_completion_length, context_len=self.context_len)
            return self._completions(rollouts, turn, environments)
        finally:
            for s in starts:
                self.pool.close_session(s.session)

    def _completions(self, rollouts: list[Rollout], first: list[Completion], environments: list) -> list[Completion]:
        # get_reward() of every rollout at once, now that each is done (TRL reads it when scoring).
        rewards = [self.pool.submit_reward(r.session) if self.pool.has_reward(e) else None
                   for r, e in zip(rollouts, environments)]
        return [self._completion(r, c, e, f.result() if f is not None else None)
                for r, c, e, f in zip(rollouts, first, environments, rewards)]

    def _completion(self, r: Rollout, first: Completion, environment: str | None, reward: float | None) -> Completion:
        stops = {self.chat.tokenizer.eos_token_id, self.chat.tokenizer.pad_token_id}
        use = ToolUse(calls=r.calls, failures=r.failures, turns=r.turns, tool_s=r.tool_s,
                      environment=self.pool.environment_class_name(environment) if self.pool.has_environments else None,
                      environment_reward=reward)
        versions = r.versions or [first.weight_version]
        return replace(first, token_ids=tuple(r.completion_ids), logprobs=tuple(r.logprobs),
                       # In flight a rollout's later tokens may come from newer weights (types.Completion).
                       weight_version=versions[0], token_versions=tuple(versions) if len(set(versions)) > 1 else None,
                       text=self.chat.tokenizer.decode(r.completion_ids, skip_special_tokens=True),
                       # TRL's rule for a multi-turn completion: cut where it does not end its turn.
                       truncated=bool(r.completion_ids) and r.completion_ids[-1] not in stops,
                       tool_mask=tuple(r.tool_mask), messages=tuple(r.messages), tool_use=use)

    def reward_functions(self) -> list:
        """TRL's environment reward: each environment class with get_reward() is a reward function of
        weight 1 named after the class, scoring only its own rollouts (None for the others)."""
        from hpcrl.compute.train.rewards import RewardFunction

        names = list(dict.fromkeys(self.pool.environment_class_name(e) for e in (self.pool.factories or {})
                                   if self.pool.has_reward(e)))       # TRL's order, one per class
        return [RewardFunction(name, _environment_reward(name), 1.0) for name in names]

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
        if self.first_turns is not None:
            self.first_turns.close()
        self.pool.close()


def _environment_reward(class_name: str):
    def reward(environments, **kwargs):
        return [e.get_reward() if e.class_name == class_name else None for e in environments]
    reward.__name__ = class_name
    return reward


class AgentGeneration:
    """A generation of rollouts in progress; ``result()`` waits for the last of them (every wait in
    it is bounded: the engines' requests by inference.request_timeout_s and its per-token part, the
    tools by agent.tool_timeout_s)."""

    def __init__(self, future: concurrent.futures.Future):
        self.future = future

    def result(self) -> list[Completion]:
        return self.future.result()


def with_observation(prompt: list[dict], observation: Any) -> list[dict]:
    """The prompt with what the environment's reset() returned appended to its last message (TRL's
    rule; a list of content blocks and a string are reconciled into blocks)."""
    if observation is None:
        return prompt
    content = prompt[-1]["content"]
    if isinstance(observation, list) and isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if isinstance(observation, str) and isinstance(content, list):
        observation = [{"type": "text", "text": observation}]
    return prompt[:-1] + [{**prompt[-1], "content": content + observation}]

