"""The GPU tier's mixture of experts: a tiny Qwen3-MoE (test_moe.make_moe_dir: 2 layers, 4 experts,
top-2) under FSDP2 with bf16 compute on the device, where transformers 5 runs the fused expert
stacks' grouped matrix products on CUDA, which no CPU test reaches.

  test_moe_grpo_step_on_the_device[full]
        one step of hpcrl's GRPO loss over its completion log-probs: the loss is finite, every
        parameter moved, the stacks and the router among them, and every shard lives on the device
  test_moe_grpo_step_on_the_device[lora]
        the same with "all-linear" adapters, which peft puts on the stacks and the router too: every
        adapter trained, nothing else moved, and what the sync gathers for each adapted weight is
        peft's own merge (merge_and_unload on the CPU, fp32) of the adapter directory the trainers
        wrote, to bf16's precision (the frozen base is stored in bf16)

Self-check without a GPU (HPCRL_GPU_TIER_DEVICE=cpu): the same on the CPU with gloo. Written on
2026-12-04 after the session's GPU time was spent: it has not run on a GPU yet.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from dist_harness import spawn
from test_moe import make_moe_dir

pytestmark = pytest.mark.gpu


def _w_moe_step(rank, world, device, model_dir, lora, out_dir):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoTokenizer

    from hpcrl.compute.inference.types import Completion
    from hpcrl.compute.sync.gather import iter_full_tensors, sync_named_params
    from hpcrl.compute.train import fsdp
    from hpcrl.compute.train.batch import completion_logps, pack_batch
    from hpcrl.compute.train.loss import LossConfig, grpo_loss
    from hpcrl.compute.train.optim import build_optimizer, clip_grad_norm
    from hpcrl.job.recipe import GRPOConfig, ModelConfig, Recipe

    model = (ModelConfig(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules="all-linear")
             if lora else ModelConfig())
    recipe = Recipe(model=model, grpo=GRPOConfig(learning_rate=5e-2 if lora else 1e-3, beta=0.0, bf16=True,
                                                 max_completion_length=8, gradient_checkpointing=False))
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    policy, _ = fsdp.load_policy_and_reference(model_dir, mesh, device, recipe)
    trained = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    frozen = {n: p for n, p in policy.named_parameters() if not p.requires_grad}
    off = [n for n, p in policy.named_parameters() if p.to_local().device.type != device.type]
    assert not off, f"not on {device}: {off[:5]}"
    assert any("experts" in n for n in (frozen if lora else trained)), "no expert stack in this model"
    before = {n: p.full_tensor().detach().float().clone() for n, p in policy.named_parameters()}

    tok = AutoTokenizer.from_pretrained(model_dir)
    g = torch.Generator().manual_seed(rank)
    vocab = len(tok)
    prompts = [torch.randint(3, vocab, (6,), generator=g).tolist() for _ in range(4)]
    completions = [Completion(i // 4, tuple(torch.randint(3, vocab, (8,), generator=g).tolist()), (), "", True, 0)
                   for i in range(16)]
    batch = pack_batch([prompts[c.prompt_index] for c in completions], completions, tok.pad_token_id, device)
    advantages = torch.randn(16, generator=g).to(device)
    mask = batch["completion_mask"]
    optimizer = build_optimizer(policy, recipe.grpo)
    for _ in range(2 if lora else 1):           # lora_B starts at 0: a second step moves lora_A too
        logps = completion_logps(policy, batch, 1.0)
        loss, _ = grpo_loss(logps, None, None, advantages, mask,
                            LossConfig(loss_type="dapo", beta=0.0, max_completion_length=8, num_processes=world),
                            num_items_in_batch=mask.sum().item() * world)
        assert math.isfinite(loss.item()), loss.item()
        loss.backward()
        grad_norm = clip_grad_norm(policy.parameters(), 1.0)
        assert math.isfinite(grad_norm) and grad_norm > 0, grad_norm
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    after = {n: p.full_tensor().detach().float() for n, p in policy.named_parameters()}
    still = [n for n in trained if torch.equal(before[n], after[n])]
    assert not still, f"{len(still)} of {len(trained)} trained parameters did not move: {still[:5]}"
    moved = [n for n in frozen if not torch.equal(before[n], after[n])]
    assert not moved, f"frozen parameters moved: {moved[:5]}"
    if not lora:
        return
    adapted = {n.split(".lora_")[0] for n in trained}
    assert any(n.endswith("mlp.gate") for n in adapted) and any("experts" in n for n in adapted), sorted(adapted)
    sent = {name: t.cpu() for name, t in iter_full_tensors(sync_named_params(policy))}
    from test_lora import save_lora_model

    out = save_lora_model(policy, model_dir, out_dir, recipe.model, rank)
    if rank != 0:
        return
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                       str(out)).merge_and_unload().state_dict()
    # With bf16 compute the frozen base is stored in bf16 (hpcrl.compute.train.fsdp) and the merge is sent
    # in it: within two bf16 units in the last place at each tensor's scale of peft's fp32 merge, far
    # below the adapters' own change (an adapter left out, or merged twice, moves weights by ~0.1 here).
    error = {n: (sent[n].float() - merged[n]).abs().max().item() / merged[n].abs().max().item() for n in sent}
    off = {n: e for n, e in error.items() if e > 2 ** -7}
    assert not off, f"the sync's merged weights are not peft's merge (error / the tensor's largest value): {off}"
    worst = max(error.values())
    Path(out_dir, "moe.json").write_text(json.dumps({"sent": len(sent), "worst": worst}))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_moe_grpo_step_on_the_device(tmp_path, gpu_device, lora):
    import torch

    world = 2 if gpu_device == "cpu" else min(2, torch.cuda.device_count())
    model_dir = make_moe_dir(tmp_path / "qwen3-moe", "qwen3_moe", square=False)
    spawn(_w_moe_step, tmp_path, str(model_dir), lora, str(tmp_path), world=world, timeout=300, device=gpu_device)
    if lora:
        r = json.loads((tmp_path / "moe.json").read_text())
        print(f"{gpu_device}, {world} rank(s): {r['sent']} tensors sent, within {r['worst']:.1e} (relative) of "
              f"peft's merge")
