"""TRL's steps_per_generation / generation_batch_size: one generation holds several optimizer
steps' worth of completions per trainer; its steps take its slices in turn, num_iterations times
over, and the loss normalizes each slice as TRL does (the generation's loss tokens, rescaled to one
step). Runs the real Trainer on 2 gloo ranks with a generator of fixed completions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from dist_harness import spawn
from support import cpu_trainer_setup

from hpcrl.compute.inference.types import Completion
from hpcrl.job.recipe import GRPOConfig, Recipe


class _Counting:
    """Fixed completions (texts alternate, so groups have reward differences); counts requests."""

    def __init__(self):
        self.requests = []
        self.version = 0

    def submit(self, prompts, sampling):
        self.requests.append(len(prompts) * sampling.n)
        out = [Completion(i, (5 + j, 6, 7), (-1.0, -1.0, -1.0), "7" if j % 2 else "no", False, self.version)
               for i in range(len(prompts)) for j in range(sampling.n)]
        return SimpleNamespace(result=lambda: out)

    def push_weights(self, model, version):
        self.version = version
        return {}


def _w_slices(rank, world, model_dir, run_dir):
    from torch.distributed.device_mesh import init_device_mesh

    from hpcrl.compute.train import checkpoint as ckpt
    from hpcrl.compute.train import trainer as trainer_mod
    from hpcrl.compute.train.fsdp import load_policy_and_reference

    ckpt.control_group(60)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    # 4 micro-batches of 4 per generation and trainer, 2 per optimizer step: 2 slices, twice over.
    grpo = GRPOConfig(learning_rate=1e-3, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                      steps_per_generation=4, num_iterations=2, num_generations=2, max_completion_length=3,
                      max_steps=8, seed=0, vllm_importance_sampling_correction=False, gradient_checkpointing=False)
    recipe = Recipe(grpo=grpo)
    policy, reference = load_policy_and_reference(model_dir, mesh, torch.device("cpu"), recipe)
    seen_rows, normalizers = [], []
    real_logps, real_loss = trainer_mod.policy_forward, trainer_mod.grpo_loss

    def logps_spy(model, batch, temperature, rows=slice(None), *args, **kwargs):
        if model.training:
            seen_rows.append((rows.start, rows.stop))
        return real_logps(model, batch, temperature, rows, *args, **kwargs)

    def loss_spy(*args, **kwargs):
        normalizers.append((kwargs["num_items_in_batch"], args[5].steps_per_generation))     # args[5]: the LossConfig
        return real_loss(*args, **kwargs)

    trainer_mod.policy_forward, trainer_mod.grpo_loss = logps_spy, loss_spy
    generator = _Counting()
    setup = cpu_trainer_setup(recipe, run_dir, model_dir, policy, reference, rank=rank, world=world)
    trainer = trainer_mod.Trainer(setup, generator)
    assert (trainer.slices, trainer.steps_per_generation, trainer.prompts_per_rank) == (2, 4, 8)
    assert trainer.run() == "finished"
    assert trainer.step == 8
    assert generator.requests == [16, 16], generator.requests      # 8 steps: 2 generations of 16 completions
    one_generation = [(0, 4), (4, 8), (8, 12), (12, 16)] * 2       # slice 0, slice 1, then again
    assert seen_rows == one_generation * 2, seen_rows
    # Each micro-batch's loss: the generation's 2 x 16 completions x 3 tokens, over 4 micro-batches.
    assert {n for n in normalizers} == {(96.0, 4)}, normalizers


def test_a_generation_feeds_its_slices_in_turn(model_dir, tmp_path):
    spawn(_w_slices, tmp_path, model_dir, str(tmp_path / "run"), timeout=300)


def test_generation_batch_size_must_fill_whole_steps():
    from hpcrl.job.errors import UserError
    from hpcrl.login.compose import build_recipe, _validate_batch

    recipe = build_recipe(None, ["grpo.generation_batch_size=48", "grpo.per_device_train_batch_size=8",
                                 "grpo.num_generations=4"]).recipe
    _validate_batch(recipe, num_trainers=2)            # 3 steps of 16
    with pytest.raises(UserError, match="grpo.generation_batch_size: 48 is not a whole number"):
        _validate_batch(recipe, num_trainers=4)
    with pytest.raises(UserError, match="not a multiple of gradient_accumulation_steps"):
        build_recipe(None, ["grpo.steps_per_generation=3", "grpo.gradient_accumulation_steps=2"])
