"""grpo.optim adamw_torch_8bit (hpcrl.compute.train.optim.low_bit_adamw): torchao's AdamW8bit over
FSDP2's DTensor shards, on two gloo ranks.

Checks: the moments of a large parameter are stored quantized (torchao's subclass, ~1 B a value), a
small one's in fp32; the steps are AdamW's with the recipe's settings (the updates stay within 5 %
of torch's AdamW's on the same gradients, by norm: measured 0.4 to 3 %); transformers' schedule drives
the learning rate, which torchao keeps as a tensor; hpcrl's checkpoint (DCP, the moments
dequantized) resumes exactly on the same two ranks, and loads on one. The killed-and-resumed trainer
with the 8-bit moments is tests/compute/train/test_trainer_resume.py's mu1-8bit.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_harness import spawn

STEPS = 4


def _grpo(optim: str):
    from hpcrl.job.recipe import GRPOConfig

    return GRPOConfig(optim=optim, learning_rate=1e-2, adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6,
                      weight_decay=0.1, max_steps=10, warmup_steps=2, lr_scheduler_type="linear")


def _model(mesh):
    import torch
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    fully_shard(model, mesh=mesh)
    return model


def _train(model, optimizer, scheduler, batches):
    from hpcrl.compute.train.optim import current_lr

    lrs = []
    for x in batches:
        model(x).pow(2).mean().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        lrs.append(current_lr(optimizer))
    return lrs


def _w_low_bit(rank, world, optim, ckpt_dir):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torchao.optim.subclass_8bit import OptimState8bit

    from hpcrl.compute.train import checkpoint
    from hpcrl.compute.train.optim import build_optimizer, build_scheduler

    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(8, 256, generator=g) for _ in range(2 * STEPS)]
    runs = {}
    for name in (optim, "adamw_torch"):
        model = _model(mesh)
        optimizer = build_optimizer(model, _grpo(name))
        scheduler = build_scheduler(optimizer, _grpo(name))
        before = [p.full_tensor().clone() for p in model.parameters()]
        lrs = _train(model, optimizer, scheduler, batches[:STEPS])
        runs[name] = (model, optimizer, scheduler, lrs, [p.full_tensor() - b for p, b in zip(model.parameters(), before)])
    model, optimizer, scheduler, lrs, moved = runs[optim]
    # The schedule, in a float32 tensor filled in place.
    assert lrs == pytest.approx(runs["adamw_torch"][3], rel=1e-6), (lrs, runs["adamw_torch"][3])
    for mine, torchs in zip(moved, runs["adamw_torch"][4]):
        # AdamW's update, the moments rounded: within a few per cent of torch's.
        assert (mine - torchs).norm() <= 0.05 * torchs.norm(), float((mine - torchs).norm() / torchs.norm())
    assert [(g["betas"], g["eps"], g["weight_decay"]) for g in optimizer.param_groups] == [
        ((0.8, 0.95), 1e-6, 0.1), ((0.8, 0.95), 1e-6, 0.0)]         # the recipe's; no decay on biases
    for moment in ("exp_avg", "exp_avg_sq"):
        local = optimizer.state[model[0].weight][moment].to_local()
        assert isinstance(local, OptimState8bit), type(local)
        stored = local.codes.numel() * local.codes.element_size() + local.scale.numel() * local.scale.element_size()
        assert stored == local.numel() * (1 + 4 / 256), (stored, local.numel())     # 1 B a value, a scale a block
    assert not isinstance(optimizer.state[model[0].bias]["exp_avg"].to_local(), OptimState8bit)     # 256 values

    checkpoint.save(ckpt_dir, STEPS, model, optimizer, scheduler, {}, keep=1)
    _train(model, optimizer, scheduler, batches[STEPS:])
    want = [p.full_tensor() for p in model.parameters()]
    fresh = _model(mesh)
    fresh_opt = build_optimizer(fresh, _grpo(optim))
    fresh_sched = build_scheduler(fresh_opt, _grpo(optim))
    checkpoint.load(Path(ckpt_dir) / f"step-{STEPS}", fresh, fresh_opt, fresh_sched)
    assert isinstance(fresh_opt.state[fresh[0].weight]["exp_avg"].to_local(), OptimState8bit)
    _train(fresh, fresh_opt, fresh_sched, batches[STEPS:])
    for a, b in zip(want, (p.full_tensor() for p in fresh.parameters())):
        assert torch.equal(a, b), float((a - b).abs().max())


def _w_load_on_one(rank, world, optim, ckpt_dir):
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from hpcrl.compute.train import checkpoint
    from hpcrl.compute.train.optim import build_optimizer, build_scheduler

    model = _model(init_device_mesh("cpu", (world,)))
    optimizer = build_optimizer(model, _grpo(optim))
    scheduler = build_scheduler(optimizer, _grpo(optim))
    assert checkpoint.load(Path(ckpt_dir) / f"step-{STEPS}", model, optimizer, scheduler)["step"] == STEPS
    exp_avg = optimizer.state[model[0].weight]["exp_avg"].full_tensor().dequantize()
    assert exp_avg.abs().max() > 0 and torch.isfinite(exp_avg).all()
    _train(model, optimizer, scheduler, [torch.ones(8, 256)])


def test_8bit_adamw_steps_as_adamw_and_resumes_exactly(tmp_path):
    optim, ckpt = "adamw_torch_8bit", tmp_path / "ckpt"
    spawn(_w_low_bit, tmp_path / "a", optim, str(ckpt), timeout=300)
    # Another number of trainers quantizes its own shards of the checkpoint's fp32 moments again.
    spawn(_w_load_on_one, tmp_path / "b", optim, str(ckpt), world=1, timeout=300)
