"""The GPU test tier (issue 14): hpcrl's trainer side on a CUDA GPU, without vLLM.

Every test here is marked `gpu` and takes the `gpu_device` fixture (tests/conftest.py): it runs
where torch sees a CUDA GPU and skips elsewhere, so CI stays green without one.
`scripts/gpu-check.sh` sets the tier up on a GPU machine and prints a PASS/FAIL/SKIP table.

  test_fsdp_bf16_grpo_step_on_the_device    FSDP2 in bf16 over NCCL, the reference model on the
                                            device, one GRPO step: loss finite, every weight moved
  test_deepspeed_bf16_grpo_step_on_the_device
                                            the same for trainer.engine deepspeed (ZeRO-3 partitions
                                            and the reference engine on the device); skipped where
                                            deepspeed is not installed
  test_bf16_logprobs_match_fp32             per-token log-probs in bf16 against fp32 (tolerance below)
  test_killed_and_resumed_run_equals_the_uninterrupted_one
                                            checkpoint and exact resume of the real Trainer loop
  test_hpcrl_run_shares_one_gpu_with_the_transformers_engine
                                            `hpcrl run`: trainer and server on one GPU, checkpoints

The tier's other files: test_gpu_memory.py (the allocator's peaks against the chunked log-probs and
the fit estimate), test_gpu_moe.py (a mixture of experts, with and without LoRA on its stacks) and
tests/compute/sync/test_ipc_gpu.py (the sender -> engine transfer over CUDA IPC).

Ranks: NCCL cannot put two ranks of one group on one GPU, so with one GPU the distributed tests
run one rank; with two or more, two ranks, one GPU each (each sees only its own, as hpcrl's
pinning leaves a task). `hpcrl run` puts its trainer and its server on the same GPU either way.

Self-check without a GPU: HPCRL_GPU_TIER_DEVICE=cpu runs these same tests on the CPU with gloo (two
ranks), which checks the tests' own logic. It is no substitute for the GPU: no CUDA kernel, NCCL
collective or GPU bf16 arithmetic runs then. HPCRL_GPU_TIER_DEVICE=cuda makes a missing GPU a
failure instead of a skip.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_to_the_end
from dist_harness import spawn
from test_trainer_resume import TIMING_KEYS, _differences, _read, record_metrics  # the CPU resume test's comparison

pytestmark = pytest.mark.gpu

# bf16 keeps 8 significant bits (7 stored, 1 implicit): rounding to it errs by at most 2^-8
# relative (unit roundoff u), uniformly spread, so u/2 on average.
BF16_UNIT_ROUNDOFF = 2.0 ** -8
NO_DATASETS = "the demo prompts need the datasets package (gpu-check.sh installs it from GPU_CHECK_WHEELS)"


# ----------------------------------------------------------------------------------------------
# Ranks on the tier's device (tests/dist_harness.py is gloo-only)


def _world(device: str) -> int:
    if device == "cpu":
        return 2
    import torch

    return min(2, torch.cuda.device_count())


# ----------------------------------------------------------------------------------------------
# Shared pieces


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from hpcrl.compute.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", size="tiny", seed=0))


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory) -> str:
    """The demo's warmed-up model: logits of a model that has learnt something, larger and more
    spread than a random model's, which is what bf16 rounding errors scale with."""
    from hpcrl.compute.models.tiny import DEMO_WARMUP, make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "demo", size="tiny", seed=0, warmup=DEMO_WARMUP))


def _recipe(**grpo):
    from hpcrl.job.recipe import GRPOConfig, Recipe

    grpo.setdefault("gradient_checkpointing", False)       # TRL's default is on; these tests choose
    return Recipe(grpo=GRPOConfig(**grpo))


def _same_device(t, device) -> bool:
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def _assert_all_on(model, device, what: str) -> None:
    """Every parameter shard and buffer of ``model`` lives on ``device`` (no CPU copy left behind)."""
    from torch.distributed.tensor import DTensor

    off = []
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), f"{what}: {name} is not sharded ({type(p).__name__})"
        if not _same_device(p.to_local(), device):
            off.append(f"{name} on {p.to_local().device}")
    off += [f"buffer {name} on {b.device}" for name, b in model.named_buffers() if not _same_device(b, device)]
    assert not off, f"{what}: not on {device}: {off[:5]}"


def _prompt_ids(tokenizer, pairs) -> list[list[int]]:
    from hpcrl.compute.train.data import encode_prompt

    return [encode_prompt(f"{a}+{b}=", tokenizer) for a, b in pairs]


def _pad_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def _full(model) -> dict:
    """Every parameter as a full fp32 tensor (a collective)."""
    return {n: p.full_tensor().detach().float().clone() for n, p in model.named_parameters()}


def _grpo_batch(model_dir: str, rank: int, g: int, device):
    """A GRPO batch on ``device``: 4 demo prompts per rank, ``g`` completions each, random tokens of
    random lengths (1-8), random advantages; and the completion tokens of all ranks (a collective)."""
    import torch
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from hpcrl.compute.inference.types import Completion
    from hpcrl.compute.models.tiny import VOCAB_SIZE
    from hpcrl.compute.train.batch import pack_batch

    tok = AutoTokenizer.from_pretrained(model_dir)
    gen = torch.Generator().manual_seed(1000 + rank)
    prompts = _prompt_ids(tok, [(rank + i, i) for i in range(4)])
    completions, prompt_of = [], []
    for i in range(len(prompts) * g):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        ids = tuple(torch.randint(3, VOCAB_SIZE, (n,), generator=gen).tolist())     # no special tokens
        completions.append(Completion(i // g, ids, (), "", n == 8, 0))
        prompt_of.append(prompts[i // g])
    batch = pack_batch(prompt_of, completions, _pad_id(tok), device)
    assert all(_same_device(t, device) for t in batch.values())
    advantages = torch.randn(len(completions), generator=gen).to(device)
    tokens = batch["completion_mask"].sum().float()
    dist.all_reduce(tokens)
    return batch, advantages, tokens


def _logps_before_the_step(policy, reference, batch, device):
    """The reference's and the policy's log-probs of ``batch`` before any step, checked to be the
    same bf16 function: the policy casts its fp32 masters to bf16 for compute, the reference was
    stored in bf16. 1e-3 is far below bf16-vs-fp32 differences (~1e-2)."""
    import torch

    from hpcrl.compute.train.batch import completion_logps

    with torch.no_grad():
        ref_logps = completion_logps(reference, batch, 1.0)
        assert ref_logps.dtype == torch.float32 and _same_device(ref_logps, device)
        start_logps = completion_logps(policy, batch, 1.0)
    same = (start_logps - ref_logps).abs()[batch["completion_mask"].bool()].max().item()
    assert same <= 1e-3, f"policy and reference differ by {same} before any step"
    return ref_logps, start_logps


def _check_the_step_moved_the_policy_alone(policy, reference, batch, ref_logps, start_logps) -> float:
    """After one optimizer step: the policy's log-probs moved, the reference's did not; returns
    the largest move."""
    import torch

    from hpcrl.compute.train.batch import completion_logps

    with torch.no_grad():
        moved = (completion_logps(policy, batch, 1.0) - start_logps).abs()[batch["completion_mask"].bool()].max().item()
        ref_again = completion_logps(reference, batch, 1.0)
    assert moved > 0, "the step did not change the policy's log-probabilities"
    assert torch.equal(ref_again, ref_logps), "the policy's step changed the reference model"
    return moved


# ----------------------------------------------------------------------------------------------
# FSDP2 in bf16 over NCCL, the reference model on the device, one GRPO step


def _w_grpo_step(rank, world, device, model_dir, out):
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from hpcrl.compute.train import fsdp
    from hpcrl.compute.train.loss import LossConfig, grpo_loss
    from hpcrl.compute.train.optim import build_optimizer, clip_grad_norm
    from hpcrl.compute.train.batch import completion_logps

    beta, g = 0.04, 4
    # bf16 explicitly: the CPU self-check takes the same path ("auto" is bf16 on a GPU only).
    recipe = _recipe(learning_rate=1e-3, beta=beta, bf16=True, num_generations=g, max_completion_length=8)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    policy, reference = fsdp.load_policy_and_reference(model_dir, mesh, device, recipe)
    assert reference is not None, "beta > 0 must load a reference model"

    _assert_all_on(policy, device, "policy")
    _assert_all_on(reference, device, "reference")
    assert not fsdp.is_offloaded(reference), "the reference is offloaded without trainer.reference_offload"
    assert not reference.training and not any(p.requires_grad for p in reference.parameters())
    assert {p.dtype for p in policy.parameters()} == {torch.float32}, "fp32 master weights"
    assert {p.dtype for p in reference.parameters()} == {torch.bfloat16}, "the reference is stored in bf16"
    total = fsdp.global_param_bytes(reference)
    assert abs(fsdp.local_param_bytes(reference) - total / world) <= 0.01 * total, "the reference is sharded"
    if device.type == "cuda":
        # The CUDA allocator holds both models' shards: they were really put on the GPU.
        held = torch.cuda.memory_allocated(device)
        need = fsdp.local_param_bytes(policy) + fsdp.local_param_bytes(reference)
        assert held >= need, f"{held} bytes allocated on {device}, the two models' shards alone are {need}"

    batch, advantages, tokens = _grpo_batch(model_dir, rank, g, device)
    mask = batch["completion_mask"]

    # FSDP2 casts the fp32 shards to bf16 at every all-gather.
    ref_logps, start_logps = _logps_before_the_step(policy, reference, batch, device)

    before = _full(policy)
    optimizer = build_optimizer(policy, recipe.grpo)
    policy.train()
    logps = completion_logps(policy, batch, 1.0)
    loss, _ = grpo_loss(logps, None, ref_logps, advantages, mask,
                        LossConfig(loss_type="dapo", beta=beta, max_completion_length=8, num_processes=world),
                        num_items_in_batch=tokens.item())
    assert math.isfinite(loss.item()), f"loss {loss.item()}"
    loss.backward()
    for name, p in policy.named_parameters():
        assert p.grad is not None, f"no gradient for {name}"
        local = p.grad.to_local()
        assert local.dtype == torch.float32 and _same_device(local, device), (name, local.dtype, local.device)
        assert torch.isfinite(local).all(), f"non-finite gradient in {name}"
    grad_norm = clip_grad_norm(policy.parameters(), 1.0)
    assert math.isfinite(grad_norm) and grad_norm > 0, f"grad norm {grad_norm}"
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    state_devices = {s["exp_avg"].to_local().device.type for s in optimizer.state.values()}
    assert state_devices == {device.type}, f"optimizer state on {state_devices}"
    _assert_all_on(policy, device, "policy after the step")
    _assert_all_on(reference, device, "reference after the step")

    after = _full(policy)
    unchanged = [n for n in before if torch.equal(before[n], after[n])]
    assert not unchanged, f"the step left {len(unchanged)} of {len(before)} parameters unchanged: {unchanged[:5]}"
    moved = _check_the_step_moved_the_policy_alone(policy, reference, batch, ref_logps, start_logps)
    if rank == 0:
        largest = max((after[n] - before[n]).abs().max().item() for n in before)
        Path(out).write_text(json.dumps({"loss": loss.item(), "grad_norm": grad_norm, "params": len(before),
                                         "largest_change": largest, "logp_change": moved,
                                         "memory_allocated": torch.cuda.memory_allocated(device)
                                         if device.type == "cuda" else None}))


def test_fsdp_bf16_grpo_step_on_the_device(tmp_path, gpu_device, tiny_model):
    world = _world(gpu_device)
    out = tmp_path / "step.json"
    seconds = spawn(_w_grpo_step, tmp_path, tiny_model, str(out), world=world, timeout=300, device=gpu_device)
    r = json.loads(out.read_text())
    print(f"{gpu_device}, {world} rank(s): loss {r['loss']:.4f}, grad norm {r['grad_norm']:.3f}, all {r['params']} "
          f"parameters moved (largest {r['largest_change']:.2e}); {seconds:.1f} s")


# ----------------------------------------------------------------------------------------------
# DeepSpeed ZeRO-3 (trainer.engine deepspeed) in bf16 on the device, the reference a ZeRO-3
# inference engine on the device too, one GRPO step through hpcrl's engine


def _w_deepspeed_step(rank, world, device, model_dir, out):
    import dataclasses

    import torch
    from transformers import AutoConfig

    from hpcrl.compute.train import deepspeed_engine
    from hpcrl.compute.train.loss import LossConfig, grpo_loss
    from hpcrl.compute.train.batch import completion_logps
    from hpcrl.job.deepspeed import build_config
    from hpcrl.job.recipe import TrainerConfig

    beta, g = 0.04, 4
    # max_steps resolved, as the trainer hands it to the engine (its learning-rate schedule spans it)
    recipe = dataclasses.replace(_recipe(learning_rate=1e-3, beta=beta, bf16=True, num_generations=g,
                                         max_completion_length=8, max_steps=10),
                                 trainer=TrainerConfig(engine="deepspeed"))
    config = build_config(recipe, num_trainers=world, device_type=device.type,
                          hidden_size=AutoConfig.from_pretrained(model_dir).hidden_size)
    # The load checks every partition's device itself (deepspeed_engine.check_partition_devices);
    # checked here again, in the test's own words.
    policy, reference = deepspeed_engine.load_policy_and_reference(model_dir, recipe, config)
    assert reference is not None, "beta > 0 must load a reference model"
    engine = deepspeed_engine.DeepSpeedEngine(policy, config)
    engine.configure(recipe.grpo)
    held = 0
    for what, model in (("policy", policy), ("reference", reference.module)):
        off = [f"{n} on {p.ds_tensor.device}" for n, p in model.named_parameters() if not _same_device(p.ds_tensor, device)]
        assert not off, f"{what}: ZeRO-3 partitions not on {device}: {off[:5]}"
        dtypes = {p.ds_tensor.dtype for p in model.parameters()}
        assert dtypes == {torch.bfloat16}, f"{what}: partitions in {dtypes}, bf16 expected"
        held += sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in model.parameters())
    assert not reference.module.training and not any(p.requires_grad for p in reference.module.parameters())
    if device.type == "cuda":
        allocated = torch.cuda.memory_allocated(device)
        assert allocated >= held, f"{allocated} bytes allocated on {device}, the two models' partitions alone are {held}"

    batch, advantages, tokens = _grpo_batch(model_dir, rank, g, device)
    mask = batch["completion_mask"]
    ref_logps, start_logps = _logps_before_the_step(engine.model, reference, batch, device)

    engine.model.train()
    logps = completion_logps(engine.model, batch, 1.0)
    loss, _ = grpo_loss(logps, None, ref_logps, advantages, mask,
                        LossConfig(loss_type="dapo", beta=beta, max_completion_length=8, num_processes=world),
                        num_items_in_batch=tokens.item())
    assert math.isfinite(loss.item()), f"loss {loss.item()}"
    engine.backward(loss)
    grad_norm = engine.step(1.0)
    assert math.isfinite(grad_norm) and grad_norm > 0, f"grad norm {grad_norm}"
    moved = _check_the_step_moved_the_policy_alone(engine.model, reference, batch, ref_logps, start_logps)
    if rank == 0:
        Path(out).write_text(json.dumps({"loss": loss.item(), "grad_norm": grad_norm, "logp_change": moved,
                                         "partition_bytes": held}))


def test_deepspeed_bf16_grpo_step_on_the_device(tmp_path, gpu_device, tiny_model):
    import importlib.util

    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (scripts/install.sh builds it; GPU_CHECK_WHEELS can carry its wheel)")
    world = _world(gpu_device)
    out = tmp_path / "step.json"
    seconds = spawn(_w_deepspeed_step, tmp_path, tiny_model, str(out), world=world, timeout=300, device=gpu_device)
    r = json.loads(out.read_text())
    print(f"{gpu_device}, {world} rank(s), ZeRO-3: loss {r['loss']:.4f}, grad norm {r['grad_norm']:.3f}, "
          f"log-probs moved {r['logp_change']:.2e}; {seconds:.1f} s")


# ----------------------------------------------------------------------------------------------
# bf16 numerics against fp32
#
# The same model and batch (the demo model, its own sampled completions to demo prompts) through
# hpcrl's policy loading with grpo.bf16 true and false; per-token log-probabilities of the completion
# tokens, as the trainer computes them. With S the logit scale (mean over tokens of the largest
# |logit| at the position, from the fp32 run):
#   mean |bf16 - fp32| <= u*S/2: on average no worse than rounding the largest logit to bf16 once
#                                 (a round-to-nearest error is uniform in [-u*S, u*S], mean u*S/2);
#   max  |bf16 - fp32| <= 4u*S:  a log-prob is a difference of two logit-sized terms (the target
#                                 logit and the logsumexp), 2u*S for one rounding each, twice that
#                                 for the errors the layers add before them.
# u = 2^-8. On the CPU (2026-11-24, S = 6.1) the mean came to 0.12 u*S and the max to 0.93 u*S.
# Also: the bf16 run really computed in bf16 (logits dtype, a mean difference over 1e-4), the
# log-probs come out in fp32, the bf16 reference computes what the bf16 policy does (within 1e-3),
# and the fp32 log-probs equal the sampler's own (the engine's, in fp32) within 1e-2: measured
# 1e-6 on the CPU; a misplaced position or pad is off by whole nats, and 1e-2 leaves room for fp32
# kernels that sum in another order (TF32, should anything turn it on, errs by ~1e-3 here).


def _w_bf16_numerics(rank, world, device, model_dir, out):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoTokenizer

    from hpcrl.compute.inference.hf_engine import TransformersEngine
    from hpcrl.compute.inference.types import Sampling
    from hpcrl.compute.train import fsdp
    from hpcrl.compute.train.data import demo_pairs
    from hpcrl.compute.train.batch import completion_logps, pack_batch

    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    policy16, reference16 = fsdp.load_policy_and_reference(model_dir, mesh, device, _recipe(bf16=True, beta=0.04))
    policy32, _ = fsdp.load_policy_and_reference(model_dir, mesh, device, _recipe(bf16=False))
    _assert_all_on(reference16, device, "reference")

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = _prompt_ids(tok, demo_pairs()[::3][:16])
    engine = TransformersEngine(model_dir, device=device.type, dtype="float32", seed=0)
    completions = engine.generate(prompts, Sampling(n=4, max_tokens=8, temperature=1.0, seed=1))
    batch = pack_batch([prompts[c.prompt_index] for c in completions], completions, _pad_id(tok), device)
    mask = batch["completion_mask"].bool()
    t = batch["completion_ids"].shape[1]

    def logits(model):
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     position_ids=batch["position_ids"], logits_to_keep=t + 1).logits[:, -t - 1:-1]

    with torch.no_grad():
        z16, z32 = logits(policy16), logits(policy32)
        lp16 = completion_logps(policy16, batch, 1.0)
        lp32 = completion_logps(policy32, batch, 1.0)
        lpref = completion_logps(reference16, batch, 1.0)
    assert z16.dtype == torch.bfloat16 and z32.dtype == torch.float32, (z16.dtype, z32.dtype)
    assert lp16.dtype == lp32.dtype == torch.float32, "log-probs are computed and returned in fp32"

    diff = (lp16 - lp32).abs()[mask]
    scale = z32.float().abs().amax(-1)[mask].mean().item()
    mean_tol, max_tol = BF16_UNIT_ROUNDOFF * scale / 2, 4 * BF16_UNIT_ROUNDOFF * scale
    sampled = torch.zeros_like(lp32)
    for i, c in enumerate(completions):
        sampled[i, :len(c.logprobs)] = torch.tensor(c.logprobs, device=device)
    result = {"tokens": int(mask.sum()), "scale": scale, "mean_abs": diff.mean().item(), "max_abs": diff.max().item(),
              "mean_tol": mean_tol, "max_tol": max_tol,
              "reference_vs_policy": (lpref - lp16).abs()[mask].max().item(),
              "sampler_vs_fp32": (sampled - lp32).abs()[mask].max().item()}
    Path(out).write_text(json.dumps(result))


def test_tf32_is_set_as_the_recipe_asks(gpu_device):
    """grpo.tf32 (TRL's) on the device, as the trainer role sets it (hpcrl.compute.train.role.set_tf32):
    TF32 matmuls where the GPU has them, full fp32 for False, torch's default left for None; a GPU
    without TF32 refuses True in one line. (On the CPU self-check there is no TF32 to set.)"""
    import torch

    from hpcrl.compute.train.role import set_tf32
    from hpcrl.job.errors import UserError

    if gpu_device != "cuda":
        pytest.skip("TF32 is a GPU's: the CPU self-check has none")
    device = torch.device("cuda", 0)
    before = torch.backends.fp32_precision
    try:
        set_tf32(None, device)
        assert torch.backends.fp32_precision == before
        if torch.cuda.get_device_capability(device)[0] < 8:
            with pytest.raises(UserError, match="grpo.tf32: .* has no TF32"):
                set_tf32(True, device)
            return
        set_tf32(True, device)
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        set_tf32(False, device)
        assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    finally:
        torch.backends.fp32_precision = before


def test_bf16_logprobs_match_fp32(tmp_path, gpu_device, demo_model):
    out = tmp_path / "numerics.json"
    spawn(_w_bf16_numerics, tmp_path, demo_model, str(out), world=1, timeout=300, device=gpu_device)
    r = json.loads(out.read_text())
    line = (f"{gpu_device}: {r['tokens']} tokens, logit scale S {r['scale']:.2f}: "
            f"|bf16 - fp32| mean {r['mean_abs']:.2e} "
            f"(<= u*S/2 = {r['mean_tol']:.2e}), max {r['max_abs']:.2e} (<= 4u*S = {r['max_tol']:.2e}); "
            f"bf16 reference vs bf16 policy {r['reference_vs_policy']:.1e}; sampler vs fp32 {r['sampler_vs_fp32']:.1e}")
    print(line)
    assert r["mean_abs"] > 1e-4, f"bf16 and fp32 agree too well: the bf16 run did not compute in bf16: {line}"
    assert r["mean_abs"] <= r["mean_tol"] and r["max_abs"] <= r["max_tol"], line
    assert r["reference_vs_policy"] <= 1e-3, f"the bf16 reference computes another function than the policy: {line}"
    assert r["sampler_vs_fp32"] <= 1e-2, f"the trainer's fp32 log-probs differ from the sampler's: {line}"


# ----------------------------------------------------------------------------------------------
# Checkpoint and exact resume on the device
#
# tests/compute/train/test_trainer_resume.py's case num_iterations = 2 on the tier's device: the real Trainer loop
# with an in-process transformers engine on the same device, a reference model, a cosine schedule
# with warmup, gradient accumulation. A: 6 steps uninterrupted. B: a checkpoint every 3 steps (step 3
# falls in the middle of a generation), every rank SIGKILLs itself after step 4's optimizer step.
# C: new processes, seeded differently, resume from B's step-3 checkpoint. Every metric of C's steps 4..6 but the timings
# equals A's within 1e-6 (the CPU test's tolerance), and B's steps 1..3 equal A's.
#
# On a GPU the runs are made deterministic rather than given a looser tolerance: a difference of one
# ulp in a weight may flip a sampled token, and then no tolerance would hold. So the workers turn on
# torch's deterministic algorithms (warn_only: an op without a deterministic kernel warns, it does
# not fail) with a fixed cuBLAS workspace, and use the math attention kernel (the flash and
# memory-efficient backward passes accumulate with atomics). That tests what a resume restores, not
# the speed kernels.

RESUME_STEPS, RESUME_KILL_AFTER = 6, 3
LEG_TIMEOUT_S = 180       # three legs stay inside pytest-timeout's 600 s, which would orphan the ranks


def _w_resume_run(rank, world, device, model_dir, run_dir, metrics_path, every, die_after, seed):
    import contextlib

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoTokenizer

    from hpcrl.compute.inference.hf_engine import TransformersEngine
    from support import InProcessGenerator
    from hpcrl.compute.train import checkpoint as ckpt
    from hpcrl.compute.train.fsdp import load_policy_and_reference
    from hpcrl.compute.train.sources import load_dataset
    from hpcrl.compute.train.trainer import Trainer, TrainerSetup
    from hpcrl.job.recipe import CheckpointConfig, GRPOConfig, Recipe

    attention = contextlib.nullcontext()
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        torch.use_deterministic_algorithms(True, warn_only=True)
        attention = sdpa_kernel(SDPBackend.MATH)
    torch.manual_seed(seed + rank)
    grpo = GRPOConfig(
        learning_rate=5e-3, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_generations=4,
        max_completion_length=8, beta=0.04, num_iterations=2, max_steps=RESUME_STEPS, warmup_steps=0.3,
        lr_scheduler_type="cosine", max_grad_norm=1.0, weight_decay=0.01, seed=7, gradient_checkpointing=False)
    recipe = Recipe(grpo=grpo, checkpoint=CheckpointConfig(every=every, keep=2, dir=str(Path(run_dir) / "ckpt")))
    ckpt.control_group(120)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    policy, reference = load_policy_and_reference(model_dir, mesh, device, recipe)
    _assert_all_on(reference, device, "reference")

    on_metrics = record_metrics(rank, metrics_path, die_after)
    setup = TrainerSetup(
        recipe=recipe, run_dir=Path(run_dir), device=device, policy=policy, reference=reference,
        tokenizer=AutoTokenizer.from_pretrained(model_dir), dataset=load_dataset(recipe.data, grpo.seed),
        trainer_rank=rank, num_trainers=world, log=lambda line: None, collective_timeout_s=120,
        on_metrics=on_metrics)
    engine = TransformersEngine(model_dir, device=device.type, dtype="float32", seed=grpo.seed)
    trainer = Trainer(setup, InProcessGenerator(engine))
    with attention:
        outcome = trainer.run()
    assert outcome == "finished" and trainer.step == RESUME_STEPS, (outcome, trainer.step)
    _assert_all_on(policy, device, "policy at the end")


def test_killed_and_resumed_run_equals_the_uninterrupted_one(tmp_path, gpu_device, tiny_model):
    pytest.importorskip("datasets", reason=NO_DATASETS)
    world, k = _world(gpu_device), RESUME_KILL_AFTER
    whole_dir, killed_dir = tmp_path / "whole", tmp_path / "killed"
    whole_dir.mkdir()
    killed_dir.mkdir()
    whole, first, second = tmp_path / "whole.jsonl", tmp_path / "first.jsonl", tmp_path / "second.jsonl"

    spawn(_w_resume_run, tmp_path / "a", tiny_model, str(whole_dir), str(whole), 0, None, 100, world=world,
          timeout=LEG_TIMEOUT_S, device=gpu_device)
    spawn(_w_resume_run, tmp_path / "b", tiny_model, str(killed_dir), str(first), k, k, 100, world=world,
          timeout=LEG_TIMEOUT_S, expect={r: -signal.SIGKILL for r in range(world)}, device=gpu_device)
    assert (killed_dir / "ckpt" / "latest").read_text().strip() == f"step-{k}"
    spawn(_w_resume_run, tmp_path / "c", tiny_model, str(killed_dir), str(second), k, None, 555,
          world=world, timeout=LEG_TIMEOUT_S, device=gpu_device)

    a, b, c = _read(whole), _read(first), _read(second)
    assert sorted(a) == list(range(1, RESUME_STEPS + 1))
    assert sorted(b) == list(range(1, k + 1)), "the first leg was killed after step k"
    assert sorted(c) == list(range(k + 1, RESUME_STEPS + 1)), "the second leg resumed at step k+1"
    assert all(math.isfinite(a[s]["loss"]) for s in a), [a[s]["loss"] for s in a]
    # The run learns something at all: otherwise equal metrics would prove little.
    assert len({round(a[s]["loss"], 9) for s in a}) > 1 and any(a[s]["grad_norm"] > 0 for s in a)
    problems = [f"step {s} (checkpointing run): {d}" for s in range(1, k + 1) for d in _differences(a[s], b[s])]
    problems += [f"step {s} (resumed): {d}" for s in range(k + 1, RESUME_STEPS + 1) for d in _differences(a[s], c[s])]
    assert not problems, "metrics differ from the uninterrupted run:\n" + "\n".join(problems)
    worst = max((abs(a[s][key] - c[s][key]) for s in c for key in c[s].keys() - TIMING_KEYS
                 if isinstance(c[s][key], float) and not math.isnan(c[s][key])), default=0.0)
    print(f"{gpu_device}, {world} rank(s): steps {k + 1}..{RESUME_STEPS} after the resume, "
          f"largest metric difference {worst:.3g}")


# ----------------------------------------------------------------------------------------------
# `hpcrl run` with the transformers engine sharing one GPU with the trainer
#
# The local site with two task slots on a GPU node: plan GPU 0 trains, plan GPU 1 serves. hpcrl's
# pinning maps plan GPU g to the g-th entry of the inherited CUDA_VISIBLE_DEVICES, so "0,0" (this
# process's first GPU, twice) puts both tasks on one GPU, each seeing it as cuda:0.


def _hpcrl_run_overrides(device: str) -> list[str]:
    common = ["inference.engine=transformers", "model.path=demo:tiny", "grpo.max_steps=4", "checkpoint.every=2",
              "grpo.per_device_train_batch_size=16", "grpo.num_generations=4", "grpo.max_completion_length=8",
              "grpo.beta=0.04"]
    if device == "cuda":
        common += ["site.device=cuda", "site.gpu_vendor=nvidia", "site.node.gpus=2"]
    return common


def test_hpcrl_run_shares_one_gpu_with_the_transformers_engine(tmp_path, gpu_device, hpcrl_home, monkeypatch):
    pytest.importorskip("datasets", reason=NO_DATASETS)
    from hpcrl.job.errors import UserError
    from hpcrl.job.rundir import CHECKPOINTS_DIR, FINISHED_MARKER, LOCAL_LOG_FILE, read_metrics
    from hpcrl.login.local.mpiexec import find_mpiexec

    try:
        find_mpiexec()
    except UserError as e:
        pytest.skip(f"{e} (gpu-check.sh installs the mpich wheel from GPU_CHECK_WHEELS)")
    # In a child: MPI_Init in this process would make it an MPI singleton for the rest of the session.
    mpi = subprocess.run([sys.executable, "-c", "from mpi4py import MPI"], capture_output=True, text=True, timeout=120)
    if mpi.returncode != 0:
        pytest.skip(f"mpi4py has no MPI library here ({(mpi.stderr.strip().splitlines() or ['?'])[-1]}); "
                    f"gpu-check.sh installs the mpich wheel from GPU_CHECK_WHEELS")
    if gpu_device == "cuda":
        held = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip() or "0"
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{held},{held}")
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "hpcrl", "run", "--run-dir", str(run_dir), *_hpcrl_run_overrides(gpu_device)]
    t0 = time.monotonic()
    proc = run_to_the_end(cmd, tmp_path, 480)
    seconds = time.monotonic() - t0
    log = proc.stdout + proc.stderr
    if (run_dir / LOCAL_LOG_FILE).is_file():
        log += (run_dir / LOCAL_LOG_FILE).read_text(errors="replace")
    assert proc.returncode == 0, f"`hpcrl run` exited {proc.returncode}:\n{log[-4000:]}"

    steps = read_metrics(run_dir)
    assert [m["step"] for m in steps] == [1, 2, 3, 4], [m["step"] for m in steps]
    losses = [m.get("loss") for m in steps]
    assert all(isinstance(x, float) and math.isfinite(x) for x in losses), losses
    ckpts = run_dir / CHECKPOINTS_DIR
    assert (ckpts / "latest").read_text().strip() == "step-4", sorted(p.name for p in ckpts.iterdir())
    assert (ckpts / "step-2").is_dir() and (ckpts / "step-4").is_dir(), sorted(p.name for p in ckpts.iterdir())
    assert (run_dir / FINISHED_MARKER).is_file()
    assert "transformers engine 0 ready" in log, log[-3000:]
    if gpu_device == "cuda":
        assert "cuda:0" in log, f"no sign of the trainer on cuda:0 in the log:\n{log[-3000:]}"
    print(f"{gpu_device}: 4 steps, checkpoints {sorted(p.name for p in ckpts.iterdir())}, "
          f"reward {steps[0].get('reward')} -> {steps[-1].get('reward')}; {seconds:.0f} s")
