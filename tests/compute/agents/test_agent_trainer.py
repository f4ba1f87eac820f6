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

from dist_harness import spawn
from support import TOOL_MODULE, ScriptedToolGenerator, cpu_trainer_setup, spy_on_packing, tool_tokenizer

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


def _w_agent(rank, world, model_dir, run_dir, environment):
    from pathlib import Path

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from hpcrl.compute.train import checkpoint as ckpt
    from hpcrl.compute.train import trainer as trainer_mod
    from hpcrl.compute.train.fsdp import load_policy_and_reference
    from hpcrl.job import metric_keys as mk
    from hpcrl.job import rundir
    from hpcrl.job.agent_config import AgentConfig
    from hpcrl.job.recipe import GRPOConfig, LoggingConfig, Recipe, RewardSpec

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
                      max_steps=2, seed=0, max_tool_calling_iterations=2, gradient_checkpointing=False,
                      eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4)
    agent = (AgentConfig(environment_factory="agent_env:Adder", tool_workers=2) if environment else
             AgentConfig(tools=("agent_tools:add", "agent_tools:boom", "agent_tools:repeat"), tool_workers=2))
    recipe = Recipe(grpo=grpo, agent=agent, rewards=(RewardSpec("agent_rewards:answer"),),
                    logging=LoggingConfig(log_completions=1))
    policy, reference = load_policy_and_reference(model_dir, mesh, torch.device("cpu"), recipe)
    packed = spy_on_packing(trainer_mod)
    metrics, rows = [], []
    tok = tool_tokenizer()
    setup = cpu_trainer_setup(recipe, run_dir, model_dir, policy, reference, rank=rank, world=world, tokenizer=tok,
                              dataset=_dataset(), eval_dataset=_dataset(),
                              on_metrics=lambda step, m: metrics.append(m), on_completions=rows.extend)
    trainer = trainer_mod.Trainer(setup, ScriptedToolGenerator(tok))
    try:
        assert trainer.run() == "finished"
    finally:
        trainer.rollouts.close()
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


def test_an_agent_trains_with_tools(model_dir, tmp_path):
    spawn(_w_agent, tmp_path, model_dir, str(tmp_path / "run"), False, timeout=300)


def test_an_agent_trains_with_an_environment(model_dir, tmp_path):
    spawn(_w_agent, tmp_path, model_dir, str(tmp_path / "run"), True, timeout=300)
