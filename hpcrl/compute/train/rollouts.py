"""What the loop asks of generation: a batch of prompts in, one rollout per completion out.

``SingleTurn`` is GRPO as it was: the engines' completions as they come. An agent recipe
(agent.tools, agent.environment_factory) gets hpcrl.compute.agents' multi-turn rollouts instead, and
one with agent.rollout_func the user's own function's (TRL's rollout_func; beside tools, its rows are
the first turns), through the same two calls, so the loop and the evaluation hold no branch for them.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Protocol

from hpcrl.compute.inference.types import Generator, PendingGeneration, Sampling
from hpcrl.compute.train.data import PromptBatch
from hpcrl.compute.train.rewards import RewardFunction
from hpcrl.job import context

__all__ = ["Rollouts", "SingleTurn", "make_rollouts", "context_len"]


class Rollouts(Protocol):
    def submit(self, batch: PromptBatch, sampling: Sampling) -> tuple[PromptBatch, PendingGeneration]:
        """Start ``sampling.n`` rollouts of each prompt; returns a row per rollout (its prompt as
        rolled out: an environment may add to it) and the pending completions, in that order."""

    def paused_for_sync(self) -> AbstractContextManager:
        """Around a weight push: rollouts that talk to the engines from a thread of their own wait
        for it, and it for the one under way (hpcrl.compute.agents.sync_gate)."""

    def reward_functions(self) -> list[RewardFunction]:
        """Reward sources of the rollouts' own (an environment's get_reward), after the recipe's."""

    def close(self) -> None:
        ...


class SingleTurn:
    """One completion per rollout, as the engines return it."""

    def __init__(self, generator: Generator):
        self.generator = generator

    def submit(self, batch: PromptBatch, sampling: Sampling) -> tuple[PromptBatch, PendingGeneration]:
        return batch.repeat(sampling.n), self.generator.submit(batch.prompt_ids, sampling)

    def paused_for_sync(self) -> AbstractContextManager:
        # Asked for from the trainer's thread: the engines order generations and syncs themselves.
        return nullcontext()

    def reward_functions(self) -> list[RewardFunction]:
        return []

    def close(self) -> None:
        pass


def make_rollouts(recipe, generator: Generator, tokenizer, run_dir: Path | None, context_len: int,
                  log=print) -> Rollouts:
    """The recipe's rollouts: the user's function's where agent.rollout_func is set, multi-turn with
    tools where agent.tools or agent.environment_factory is (their first turns the function's where
    both are), else single-turn."""
    from hpcrl.job import rundir

    agent = recipe.agent
    module_dir = None if run_dir is None else run_dir / rundir.REWARDS_DIR
    func = None
    if agent.rollout_func:
        from hpcrl.compute.agents.rollout_func import RolloutFunction, load_rollout_func

        func = load_rollout_func(agent.rollout_func, module_dir)
        if not agent.enabled:
            return RolloutFunction(func, agent.rollout_func, generator, tokenizer, recipe.grpo,
                                   in_flight=recipe.inference.in_flight)
    if not agent.enabled:
        return SingleTurn(generator)
    from hpcrl.compute.agents.agent_rollouts import AgentRollouts
    from hpcrl.compute.agents.conversation import ToolChat
    from hpcrl.compute.agents.tool_pool import ToolPool

    factories = agent.factories()
    pool = ToolPool(agent.tools, factories, workers=agent.tool_workers, timeout_s=agent.tool_timeout_s,
                    module_dir=module_dir, log=log)
    chat = ToolChat(tokenizer, recipe.grpo.chat_template_kwargs)
    by_column = factories is not None and None not in factories
    first_turns = None
    if func is not None:
        # trainer.tools as GRPOTrainer's: every environment's tools together, in TRL's order.
        schemas: list[dict] = []
        for environment in factories or [None]:
            schemas += [t for t in pool.schemas(environment) if t not in schemas]
        first_turns = RolloutFunction(func, agent.rollout_func, generator, tokenizer, recipe.grpo, tools=schemas,
                                      chat_template=chat.chat_template, in_flight=recipe.inference.in_flight)
    return AgentRollouts(generator, pool, chat, recipe.grpo, context_len, by_column=by_column,
                         first_turns=first_turns, in_flight=recipe.inference.in_flight)


def context_len(recipe, policy, tokenizer) -> int:
    """The engines' context (prompt + completion): inference.max_model_len, else the one vLLM
    derives from the model (hpcrl.job.context's rule, which the login side checks recipes by),
    read from the loaded model's config and tokenizer."""
    if recipe.inference.max_model_len:
        return recipe.inference.max_model_len
    return context.from_configs(policy.config.to_dict(),
                                {"model_max_length": getattr(tokenizer, "model_max_length", None)}).tokens
