"""The trainer engines' registry (hpcrl.compute.train.engine): trainer.engine's values name the engine
classes, a checkpoint names the engine that wrote it, and a resume with the other engine stops with
one line naming both. The engines themselves are exercised in test_deepspeed_engine.py and the
FSDP2 tests; here only what picks and checks them."""

from __future__ import annotations

import typing

import pytest

from hpcrl.compute.train.checkpoint import CheckpointError
from hpcrl.compute.train.engine import TRAIN_ENGINES, TrainEngine, engine_class, engine_that_wrote
from hpcrl.job import rundir
from hpcrl.job.recipe import TrainerConfig


def test_every_trainer_engine_a_recipe_accepts_is_registered_and_nothing_else():
    annotation = typing.get_type_hints(TrainerConfig)["engine"]
    accepted = set(typing.get_args(annotation))
    assert accepted == set(TRAIN_ENGINES)
    for name in TRAIN_ENGINES:
        engine = engine_class(name)
        assert issubclass(engine, TrainEngine) and engine.name == name


def test_an_unknown_engine_name_lists_the_known_ones():
    with pytest.raises(ValueError, match=r"trainer.engine 'megatron': one of fsdp2, deepspeed"):
        engine_class("megatron")


def _checkpoint(tmp_path, state: str):
    path = tmp_path / "step-3"
    path.mkdir()
    if state == rundir.DCP_INDEX:
        (path / state).write_bytes(b"")
    else:
        (path / state).mkdir()
    return path


@pytest.mark.parametrize("state, writer", [(rundir.DCP_INDEX, "fsdp2"), (rundir.DEEPSPEED_STATE_DIR, "deepspeed")])
def test_a_checkpoint_names_the_engine_that_wrote_it(tmp_path, state, writer):
    path = _checkpoint(tmp_path, state)
    assert engine_that_wrote(path) is engine_class(writer)
    engine_class(writer).ensure_wrote(path)         # the same engine resumes it
    other = next(name for name in TRAIN_ENGINES if name != writer)
    with pytest.raises(CheckpointError, match=rf"^{path} was written by the {writer} engine; this run's "
                                              rf"trainer.engine is {other}: resume with the engine that wrote it$"):
        engine_class(other).ensure_wrote(path)


def test_a_directory_no_engine_wrote_says_so(tmp_path):
    with pytest.raises(ValueError, match="no trainer engine's checkpoint files"):
        engine_that_wrote(tmp_path)


# ------------------------------------------------------------------ a third engine, through the loop
class PlainEngine(TrainEngine):
    """A mock third trainer engine: the whole model on every rank, gradients all-reduced by hand.
    Defined here alone: the loop meets it only through TrainEngine's methods."""

    name = "plain"

    def __init__(self, policy) -> None:
        self.policy, self.steps = policy, 0

    @classmethod
    def build(cls, ctx, model_dir, device, read_groups):
        raise NotImplementedError("built by the test")

    def describe(self) -> str:
        return "plain: the whole model here"

    @property
    def model(self):
        return self.policy

    @property
    def sync_module(self):
        return self.policy

    def configure(self, grpo) -> None:
        import torch

        self.optimizer = torch.optim.SGD(self.policy.parameters(), lr=grpo.learning_rate)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda step: 1.0)

    def backward(self, loss) -> None:
        loss.backward()

    def step(self, max_grad_norm: float) -> float:
        import torch
        import torch.distributed as dist

        grads = [p.grad for p in self.policy.parameters() if p.grad is not None]
        for g in grads:
            dist.all_reduce(g)
            g.div_(dist.get_world_size())
        norm = float(torch.nn.utils.clip_grad_norm_(self.policy.parameters(), max_grad_norm))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return norm

    # Checkpoints in DCP's format, as FSDP2's (the end of a run saves one).
    def save(self, directory, step, extra, *, keep, timeout_s):
        from hpcrl.compute.train import checkpoint as ckpt

        return ckpt.save(directory, step, self.policy, self.optimizer, self.scheduler, extra=extra, keep=keep,
                         timeout_s=timeout_s)

    def load(self, path, *, timeout_s):
        raise NotImplementedError("not resumed here")

    @classmethod
    def checkpoint_tensors(cls, path):
        raise NotImplementedError("not exported here")

    @classmethod
    def wrote(cls, path) -> bool:
        return False

    def local_parts(self, model):
        return list(model.parameters())


def _w_plain_engine(rank, world, model_dir, run_dir):
    from pathlib import Path

    import torch
    from support import FixedGenerator, cpu_trainer_setup
    from transformers import AutoModelForCausalLM

    from hpcrl.compute.train.trainer import Trainer
    from hpcrl.job.recipe import GRPOConfig, Recipe

    grpo = GRPOConfig(learning_rate=1e-2, per_device_train_batch_size=4, num_generations=2, max_completion_length=4,
                      max_steps=2, seed=0, vllm_importance_sampling_correction=False, gradient_checkpointing=False)
    recipe = Recipe(grpo=grpo)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    before = [p.detach().clone() for p in policy.parameters()]
    engine = PlainEngine(policy)
    setup = cpu_trainer_setup(recipe, run_dir, model_dir, policy, None, rank=rank, world=world, engine=engine)
    trainer = Trainer(setup, FixedGenerator(policy.config.vocab_size))
    assert trainer.run() == "finished" and trainer.step == 2 and engine.steps == 2
    assert (Path(run_dir) / rundir.CHECKPOINTS_DIR / "step-2").is_dir()
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters())), "the engine trained nothing"


def test_a_third_engine_trains_through_the_loop_knowing_only_the_interface(model_dir, tmp_path, monkeypatch):
    """What a newcomer's engine needs: a TrainEngine subclass (this test's PlainEngine) and its line
    in TRAIN_ENGINES (and trainer.engine's values in the recipe); the loop, the sync and the export
    reach it through the interface alone."""
    from dist_harness import spawn

    monkeypatch.setitem(TRAIN_ENGINES, "plain", f"{__name__}:PlainEngine")
    assert engine_class("plain") is PlainEngine
    spawn(_w_plain_engine, tmp_path, model_dir, str(tmp_path / "run"), timeout=300)
