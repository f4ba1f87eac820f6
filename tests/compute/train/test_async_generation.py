"""Asynchronous generation (inference.max_staleness, issue 31): the trainer keeps k generations
asked for ahead, pushes weights while they are in flight, never trains on a completion more than k
weight syncs behind its policy, and drops (and counts) a generation that lags more.

The real Trainer loop on one gloo rank, the tiny model; the generator is the tests' FixedGenerator
(tests/support.py: fixed completions, sampled when asked for with the version it holds), which is
the most eager server there is: everything asked for is sampled at once, so completions lag by
exactly the number of syncs until their turn.
"""

from __future__ import annotations

from dist_harness import spawn  # noqa: E402  (the gloo harness)


def _w_staleness(rank, world, model_dir, run_dir):
    import torch
    from support import FixedGenerator, cpu_trainer_setup
    from torch.distributed.device_mesh import init_device_mesh

    from hpcrl.compute.inference.types import Completion, Generated, StaleWeights
    from hpcrl.compute.train import checkpoint as ckpt
    from hpcrl.compute.train.fsdp import load_policy_and_reference
    from hpcrl.compute.train.generation import Requested
    from hpcrl.compute.train.trainer import Trainer
    from hpcrl.job.recipe import GRPOConfig, InferenceConfig, Recipe

    ckpt.control_group(60)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    grpo = GRPOConfig(learning_rate=1e-2, per_device_train_batch_size=4, num_generations=2, max_completion_length=4,
                      max_steps=6, seed=0, gradient_checkpointing=False)
    recipe = Recipe(grpo=grpo, inference=InferenceConfig(max_staleness=2))
    policy, reference = load_policy_and_reference(model_dir, mesh, torch.device("cpu"), recipe)

    class Spy(FixedGenerator):
        """Records how many generations are in flight whenever weights are pushed."""

        def __init__(self, vocab):
            super().__init__(vocab)
            self.in_flight_at_push = []

        def push_weights(self, model, version):
            self.in_flight_at_push.append(len(trainer.ahead))
            return super().push_weights(model, version)

    metrics = {}
    gen = Spy(policy.config.vocab_size)
    setup = cpu_trainer_setup(recipe, run_dir, model_dir, policy, reference, rank=rank, world=world,
                              on_metrics=lambda step, m: metrics.__setitem__(step, m))
    trainer = Trainer(setup, gen)
    assert trainer.run() == "finished"
    # Two generations ahead of the one training, pushed past; never more than 2 syncs behind.
    assert gen.in_flight_at_push == [2, 2, 2, 2, 1], gen.in_flight_at_push
    staleness = [metrics[s]["sample/staleness_max"] for s in range(1, 7)]
    assert staleness == [0, 1, 2, 2, 2, 2], staleness
    assert [metrics[s]["off_policy_lag"] for s in range(1, 7)] == [0, 1, 2, 2, 2, 2]
    assert all(metrics[s]["sample/dropped_stale_total"] == 0 for s in range(1, 7))
    # Six generations asked for in all: none twice, none beyond max_steps.
    assert len(gen.asked) == 6

    # A generation more than 2 syncs behind when its turn comes is dropped, counted, asked for again.
    trainer.ahead.pushed, trainer.weight_version = [1, 2, 3], 3
    gen.version = 3
    old = trainer._request(trainer.step)
    stale = [Completion(c.prompt_index, c.token_ids, c.logprobs, c.text, c.truncated, 0) for c in old.take()]
    trainer.ahead.queue.append(Requested(old.batch, 0, Generated(stale)))
    requested, completions, lags = trainer.ahead.next(trainer.step)
    assert trainer.ahead.dropped == len(stale) and lags == [0] * len(completions)
    assert all(c.weight_version == 3 for c in completions) and requested is not old
    # A generator that lags by itself (the fresh request is stale too) is an error, not a loop.
    gen.version = 0
    try:
        trainer.ahead.queue.append(Requested(old.batch, 0, Generated(stale)))
        trainer.ahead.next(trainer.step)
    except StaleWeights as e:
        assert "older than version 3, which the generator had when they were asked for" in str(e)
    else:
        raise AssertionError("a generator that lags by itself was trained on")


def test_max_staleness_keeps_generations_ahead_and_drops_what_lags_more(model_dir, tmp_path):
    spawn(_w_staleness, tmp_path, model_dir, str(tmp_path / "run"), world=1, timeout=300)
