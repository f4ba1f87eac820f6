"""An agent recipe through the real training loop: 2 gloo trainer ranks, each with its own tool
workers, a scripted model that calls tools (tests/support.py's) standing in for the node's engines.

Checks what the loop adds for agents: the tools/ metrics, tool-result tokens out of the loss (and
out of the lengths), the conversation in the completions log and in what reward functions get, an
environment per rollout (reset's observation in the prompt, its methods as tools, get_reward as a
reward named after its class), and evaluation through the same tool loop.
"""

from __future__ import annotations

import json
import textwrap
import threading

from dist_harness import spawn
from support import (TOOL_MODULE, ScriptedStreamingGenerator, ScriptedToolGenerator, cpu_trainer_setup,
                     spy_on_packing, tool_tokenizer)

REWARDS = textwrap.dedent('''
    def answer(completions, answer, **kwargs):
        return [1.0 if a in c[-1]["content"] else 0.0 for c, a in zip(completions, answer)]
''')

ENVIRONMENT = textwrap.dedent('''
    class Adder:
        """Counts its calls; rewards a rollout that used it."""

        def reset(self, **row):
            self.calls = 0
            self.row = row
            return " Use the add tool."

        def add(self, a: int, b: int) -> int:
            """Add two integers.

            Args:
                a: The first integer.
                b: The second integer.
            """
            self.calls += 1
            return a + b

        def get_reward(self) -> float:
            return float(self.calls)
''')


def _dataset():
    import datasets

    pairs = [(3, 4), (5, 2), (1, 6), (2, 2)]
    return datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": f"{a}+{b}="}] for a, b in pairs],
                                       "answer": [str(a + b) for a, b in pairs]})


def _w_agent(rank, world, model_dir, run_dir, environment, staleness=0, weight_update="between_requests"):
    from pathlib import Path

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from hpcrl.compute.train import checkpoint as ckpt
    from hpcrl.compute.train import trainer as trainer_mod
    from hpcrl.compute.train.fsdp import load_policy_and_reference
    from hpcrl.job import metric_keys as mk
    from hpcrl.job import rundir
    from hpcrl.job.agent_config import AgentConfig
    from hpcrl.job.recipe import GRPOConfig, InferenceConfig, LoggingConfig, Recipe, RewardSpec

    ckpt.control_group(60)
    modules = Path(run_dir) / rundir.REWARDS_DIR
    if rank == 0:
        modules.mkdir(parents=True, exist_ok=True)
        (modules / "agent_tools.py").write_text(TOOL_MODULE)
        (modules / "agent_rewards.py").write_text(REWARDS)
        (modules / "agent_env.py").write_text(ENVIRONMENT)
    torch.distributed.barrier()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    grpo = GRPOConfig(learning_rate=1e-3, per_device_train_batch_size=4, num_generations=4, max_completion_length=230,
                      max_steps=5 if staleness else 2, seed=0, max_tool_calling_iterations=2,
                      gradient_checkpointing=False, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4)
    agent = (AgentConfig(environment_factory="agent_env:Adder", tool_workers=2) if environment else
             AgentConfig(tools=("agent_tools:add", "agent_tools:boom", "agent_tools:repeat"), tool_workers=2))
    recipe = Recipe(grpo=grpo, agent=agent, rewards=(RewardSpec("agent_rewards:answer"),),
                    logging=LoggingConfig(log_completions=1),
                    inference=InferenceConfig(max_staleness=staleness, weight_update=weight_update))
    policy, reference = load_policy_and_reference(model_dir, mesh, torch.device("cpu"), recipe)
    packed = spy_on_packing(trainer_mod)
    metrics, rows = [], []
    tok = tool_tokenizer()
    setup = cpu_trainer_setup(recipe, run_dir, model_dir, policy, reference, rank=rank, world=world, tokenizer=tok,
                              dataset=_dataset(), eval_dataset=_dataset(),
                              on_metrics=lambda step, m: metrics.append(m), on_completions=rows.extend)
    # In flight the push comes while the stream waits (however long a loaded machine takes to train a
    # step); between requests it cannot, and the wait runs out.
    generator = (SlowStreams(tok, grpo.num_generations, 60 if weight_update == "in_flight" else 5) if staleness
                 else ScriptedToolGenerator(tok))
    rolled = spy_on_rollouts()
    trainer = trainer_mod.Trainer(setup, generator)
    try:
        assert trainer.run() == "finished"
    finally:
        trainer.rollouts.close()
    if staleness:
        # Generations were asked for ahead and sampled under older weights, never more than k behind
        # (counted from a rollout's first token).
        assert max(m[mk.STALENESS_MAX] for m in metrics) == staleness, [m[mk.STALENESS_MAX] for m in metrics]
        pushed = (generator.pushes, generator.pushed_while_streaming)
        if weight_update == "in_flight":
            # The push went while the second generation's stream was open, and its rollouts' later
            # turns came from the new weights: their tokens say so, and the step that trained on
            # them counts them.
            assert generator.pushes >= 4 and generator.pushed_while_streaming >= 1, pushed
            assert any(len(v) == 2 for v in generator.stream_versions), generator.stream_versions
            assert any(m[mk.UPDATED_IN_FLIGHT] > 0 for m in metrics), [m[mk.UPDATED_IN_FLIGHT] for m in metrics]
            assert all(c.token_versions is None or (c.weight_version == c.token_versions[0] < c.token_versions[-1])
                       for c in rolled), "a rollout's versions run from its first token's up"
        else:
            # Every push found no stream open, and each stream's turns came from one version.
            assert generator.pushes >= 4 and generator.pushed_while_streaming == 0, pushed
            assert all(len(v) == 1 for v in generator.stream_versions), generator.stream_versions
    # Tool results are attended to but take no loss.
    assert packed and all(0 < loss < attended for _, loss, attended in packed), packed
    if rank != 0:
        return
    last = metrics[-1]
    assert last[mk.TOOLS_CALL_FREQUENCY] > 0 and last[mk.TOOLS_TURNS_MEAN] > 1, last
    assert "eval_reward" in last                                # evaluated through the same loop
    conversations = [r["completion"] for r in rows]
    assert any(m["role"] == "tool" for c in conversations for m in c), conversations[0]
    if environment:
        # reset's observation is in every prompt; the environment's reward is logged under its class.
        assert all(r["prompt"][-1]["content"].endswith(" Use the add tool.") for r in rows)
        assert mk.reward_mean("Adder") in last and last[mk.reward_mean("Adder")] > 0, last
    # The script also calls tools that fail (unknown, raising): counted, never a crash.
    assert 0 < last[mk.TOOLS_FAILURE_FREQUENCY] < 1, last
    Path(run_dir, "agent_metrics.json").write_text(json.dumps(last, default=str))


def spy_on_rollouts() -> list:
    """Every completion the agent rollouts make, from now on in this process."""
    from hpcrl.compute.agents.agent_rollouts import AgentRollouts

    rolled, real = [], AgentRollouts._completions

    def spy(self, *args):
        rolled.extend(real(self, *args))
        return rolled[-len(args[0]):]

    AgentRollouts._completions = spy
    return rolled


class SlowStreams(ScriptedStreamingGenerator):
    """The scripted streams, of which the second (the first generation asked for ahead, rolled out
    while the trainer trains) waits in its first turn for a push made after it opened, up to
    ``wait_s``: a push that does not wait for the rollouts under way lands inside it. Counts such
    pushes, and the weight versions each stream's turns carry."""

    def __init__(self, tok, group, wait_s: float):
        super().__init__(tok, group)
        self.wait_s = wait_s
        self.open, self.pushes, self.pushed_while_streaming = 0, 0, 0
        self.stream_versions: list[set] = []
        self.pushed = threading.Condition()

    def push_weights(self, model, version):
        self.pushed_while_streaming += self.open > 0
        try:
            return super().push_weights(model, version)
        finally:
            with self.pushed:
                self.pushes += 1
                self.pushed.notify_all()

    def open_stream(self):
        stream, gen = super().open_stream(), self
        versions: set = set()
        gen.open += 1
        gen.stream_versions.append(versions)
        take, close = stream.take, stream.close
        waits = len(gen.stream_versions) == 2
        pushes_before = gen.pushes

        def slow_take(timeout=None):
            nonlocal waits
            if waits:
                with gen.pushed:
                    gen.pushed.wait_for(lambda: gen.pushes > pushes_before, gen.wait_s)
                waits = False
            done = take(timeout)
            versions.update(c.weight_version for _, c in done)
            return done

        def closing():
            close()
            gen.open -= 1

        stream.take, stream.close = slow_take, closing
        return stream


def test_an_agent_trains_with_an_environment(model_dir, tmp_path):
    """Synchronous (max_staleness 0), lockstep rounds (a generator without streams)."""
    spawn(_w_agent, tmp_path, model_dir, str(tmp_path / "run"), True, timeout=300)


def test_an_agent_trains_with_tools_generations_ahead_with_a_push_between_two_of_them(model_dir, tmp_path):
    """inference.max_staleness = 2 with agent rollouts over streams (per sample): the rollout thread
    works through the generations asked for ahead while the trainer trains, and a push waits for the
    one under way. (The plain tools run at max_staleness 0 was a test of its own: every check of it
    is made here too, and the environment's run keeps max_staleness 0.)"""
    spawn(_w_agent, tmp_path, model_dir, str(tmp_path / "run"), False, 2, timeout=300)


def test_in_flight_an_agents_push_lands_inside_its_rollouts_and_their_tokens_say_which_weights_sampled_them(
        model_dir, tmp_path):
    """inference.weight_update = in_flight with agent rollouts: a push does not wait for the rollouts
    under way (the engines take it between two steps); a rollout's turns after it come from the new
    weights, and its completion carries each token's version, its first token's as its own."""
    spawn(_w_agent, tmp_path, model_dir, str(tmp_path / "run"), False, 2, "in_flight", timeout=300)
