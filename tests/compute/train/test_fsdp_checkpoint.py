"""FSDP2 policy/reference (hpcrl.compute.train.fsdp), AdamW + schedule + clipping (hpcrl.compute.train.optim),
DCP checkpoints (hpcrl.compute.train.checkpoint) and the run's metrics files (hpcrl.compute.metrics).

Distributed tests run 2 gloo ranks (spawned processes, a FileStore) on a tiny Qwen2 model. Each
worker asserts itself; a failing rank's traceback becomes the test failure."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from dist_harness import WORLD, spawn  # noqa: E402  (the gloo harness)


def _recipe(**grpo):
    from hpcrl.job.recipe import GRPOConfig, Recipe, TrainerConfig

    trainer = {k: grpo.pop(k) for k in ("reference_offload", "activation_checkpointing") if k in grpo}
    grpo.setdefault("gradient_checkpointing", False)       # TRL's default is on; these tests choose
    return Recipe(grpo=GRPOConfig(**grpo), trainer=TrainerConfig(**trainer))


def _mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh

    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    return init_device_mesh("cpu", tuple(shape), mesh_dim_names=names)


def _full(model) -> dict:
    """Every parameter as a full tensor (a collective)."""
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def _max_diff(a: dict, b: dict) -> tuple[float, str]:
    assert a.keys() == b.keys()
    diffs = {k: (a[k].float() - b[k].float()).abs().max().item() for k in a}
    worst = max(diffs, key=diffs.get)
    return diffs[worst], worst


# ----------------------------------------------------------------------------------------------
# (a) one sharded step == one unsharded step


def _ce_step(model, opt, x, max_norm=1.0):
    from hpcrl.compute.train.optim import clip_grad_norm

    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}    # before clipping
    norm = clip_grad_norm(model.parameters(), max_norm)
    return loss.detach(), norm, grads


def _w_step_equivalence(rank, world, model_dir, cases):
    import torch
    from torch.distributed.tensor import DTensor
    from transformers import AutoModelForCausalLM

    from hpcrl.compute.train.fsdp import load_policy_and_reference
    from hpcrl.compute.train.optim import build_optimizer

    cfg = _recipe(learning_rate=1e-3, weight_decay=0.1)
    x = torch.randint(0, 384, (4, 24), generator=torch.Generator().manual_seed(0))

    # The unsharded reference run (every rank computes it; only cheap on a tiny model).
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ref.train()
    ref_opt = build_optimizer(ref, cfg.grpo)
    ref_loss, ref_norm, ref_grads = _ce_step(ref, ref_opt, x)
    ref_opt.step()
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}

    for shape, ac in cases:
        mesh = _mesh(shape)
        policy, reference = load_policy_and_reference(
            model_dir, mesh, torch.device("cpu"), _recipe(learning_rate=1e-3, weight_decay=0.1, gradient_checkpointing=ac))
        assert reference is None
        assert all(isinstance(p, DTensor) for p in policy.parameters())
        assert {p.placements for p in policy.parameters()} == (
            {(torch.distributed.tensor.Shard(0),)} if len(shape) == 1
            else {(torch.distributed.tensor.Replicate(), torch.distributed.tensor.Shard(0))})
        if ac:
            assert all(layer.gradient_checkpointing for layer in policy.model.layers)
        opt = build_optimizer(policy, cfg.grpo)
        assert opt.defaults["fused"], "fused AdamW should be available on CPU"

        # 1) The same batch on every rank: after one AdamW step, parameters as in the unsharded run.
        loss, norm, _ = _ce_step(policy, opt, x)
        assert abs(loss.item() - ref_loss.item()) < 1e-6, (shape, loss.item(), ref_loss.item())
        assert abs(norm - ref_norm) < 1e-5 * ref_norm, (shape, norm, ref_norm)
        opt.step()
        opt.zero_grad()
        diff, name = _max_diff(_full(policy), ref_params)
        assert diff < 1e-6, f"mesh {shape} ac={ac}: {name} differs by {diff}"

        # 2) Data parallel: each rank half of the batch. The reduced gradient is the full-batch one.
        fresh, _ = load_policy_and_reference(model_dir, mesh, torch.device("cpu"), cfg)
        half = x.shape[0] // world
        mine = x[rank * half:(rank + 1) * half]
        fresh(input_ids=mine, labels=mine).loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in fresh.named_parameters()}
        for n, g in grads.items():
            err = (g - ref_grads[n]).abs().max().item()
            scale = ref_grads[n].abs().max().item()
            assert err <= 1e-6 * max(scale, 1.0), f"mesh {shape}: grad of {n} differs by {err} (max {scale})"


    # bf16 compute (MixedPrecisionPolicy): fp32 master weights and fp32-reduced gradients.
    policy, _ = load_policy_and_reference(model_dir, _mesh((world,)), torch.device("cpu"), _recipe(bf16=True))
    loss = policy(input_ids=x, labels=x).loss
    loss.backward()
    assert {(p.dtype, p.grad.dtype) for p in policy.parameters()} == {(torch.float32, torch.float32)}
    assert abs(loss.item() - ref_loss.item()) < 0.05, (loss.item(), ref_loss.item())


def test_sharded_step_equals_unsharded(tmp_path, model_dir):
    """FSDP (2), HSDP meshes (2 replicas x 1 shard, 1 x 2), and FSDP with activation checkpointing."""
    spawn(_w_step_equivalence, tmp_path, model_dir, [((2,), False), ((2, 1), False), ((1, 2), False), ((2,), True)])


def test_hsdp_2x2_step_equals_unsharded(tmp_path, model_dir):
    """HSDP with both dimensions > 1: 4 ranks, 2 replicas of 2 shards."""
    spawn(_w_step_equivalence, tmp_path, model_dir, [((2, 2), False)], world=4, timeout=300)


# ----------------------------------------------------------------------------------------------
# (b) the reference model


def _w_reference(rank, world, model_dir):
    import torch

    from hpcrl.compute.train import fsdp

    mesh = _mesh((world,))
    cpu = torch.device("cpu")
    x = torch.randint(0, 384, (2, 16), generator=torch.Generator().manual_seed(1))

    policy, none = fsdp.load_policy_and_reference(model_dir, mesh, cpu, _recipe(beta=0.0))
    assert none is None

    policy, ref = fsdp.load_policy_and_reference(model_dir, mesh, cpu, _recipe(beta=0.04))
    assert policy.training and not ref.training
    assert all(p.requires_grad for p in policy.parameters())
    assert not any(p.requires_grad for p in ref.parameters())
    assert fsdp.param_devices(ref) == fsdp.param_devices(policy) == {cpu}
    assert not fsdp.is_offloaded(ref)
    total, local = fsdp.global_param_bytes(ref), fsdp.local_param_bytes(ref)
    assert abs(local - total / world) <= 0.01 * total, (local, total)
    assert fsdp.local_param_bytes(policy) == local      # both fp32 here (bf16 auto = off on CPU)
    pol_params, ref_params = dict(policy.named_parameters()), dict(ref.named_parameters())
    assert pol_params.keys() == ref_params.keys()
    for n, p in ref_params.items():                     # sharded exactly like the policy
        q = pol_params[n]
        assert (p.device_mesh, p.placements, p.to_local().shape) == (q.device_mesh, q.placements, q.to_local().shape)
    with torch.no_grad():
        same = policy(input_ids=x).logits
        ref_logits = ref(input_ids=x).logits
    assert torch.equal(same, ref_logits), "policy and reference start from the same weights"
    # Resharded after forward (root included): only the sharded DTensors stay registered.
    assert all(isinstance(p, torch.distributed.tensor.DTensor) for p in ref.parameters())

    _, off = fsdp.load_policy_and_reference(model_dir, mesh, cpu, _recipe(beta=0.04, reference_offload=True))
    assert fsdp.is_offloaded(off) and fsdp.param_devices(off) == {cpu}
    assert not any(p.requires_grad for p in off.parameters())
    assert abs(fsdp.local_param_bytes(off) - total / world) <= 0.01 * total
    with torch.no_grad():
        assert torch.equal(off(input_ids=x).logits, ref_logits)

    # bf16: the policy keeps fp32 master weights and computes in bf16; the reference is stored in bf16.
    pol16, ref16 = fsdp.load_policy_and_reference(model_dir, mesh, cpu, _recipe(beta=0.04, bf16=True))
    assert {p.dtype for p in pol16.parameters()} == {torch.float32}
    assert {p.dtype for p in ref16.parameters()} == {torch.bfloat16}
    assert fsdp.local_param_bytes(ref16) * 2 == fsdp.local_param_bytes(pol16)
    with torch.no_grad():
        a, b = pol16(input_ids=x).logits, ref16(input_ids=x).logits
    assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b)
    assert (a.float() - ref_logits).abs().max().item() < 0.1


def test_reference_model(tmp_path, model_dir):
    spawn(_w_reference, tmp_path, model_dir)


def test_mixed_precision_for():
    import torch

    from hpcrl.compute.train.fsdp import mixed_precision_for

    assert mixed_precision_for("cpu", None) == (torch.float32, torch.float32)
    assert mixed_precision_for("cuda", None) == (torch.bfloat16, torch.float32)
    assert mixed_precision_for("cpu", True) == (torch.bfloat16, torch.float32)
    assert mixed_precision_for("cuda", False) == (torch.float32, torch.float32)


def test_schedule_matches_transformers_and_weight_decay_groups():
    import torch

    from hpcrl.job.recipe import GRPOConfig
    from hpcrl.compute.train.optim import build_optimizer, build_scheduler, param_groups

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    groups = param_groups(model, 0.1)
    assert [len(g["params"]) for g in groups] == [1, 3] and groups[0]["params"][0] is model[0].weight
    for kind, expect in {
        "cosine": [0.0, 0.5, 1.0, 0.9330127, 0.75, 0.5, 0.25, 0.0669873],
        "linear": [0.0, 0.5, 1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6],
        "constant": [1.0] * 8,                       # HF's "constant" ignores warmup
        "constant_with_warmup": [0.0, 0.5] + [1.0] * 6,
    }.items():
        grpo = GRPOConfig(learning_rate=1.0, max_steps=8, warmup_steps=0.2, lr_scheduler_type=kind)
        opt = build_optimizer(model, grpo)
        sched = build_scheduler(opt, grpo)
        lrs = []
        for _ in range(8):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        assert lrs == pytest.approx(expect, abs=1e-6), kind


# ----------------------------------------------------------------------------------------------
# (c) checkpoints


def _train_setup(model_dir, seed_rank):
    import numpy as np
    import torch

    from hpcrl.compute.train.fsdp import load_policy_and_reference
    from hpcrl.compute.train.optim import build_optimizer, build_scheduler

    cfg = _recipe(learning_rate=3e-3, weight_decay=0.1, max_steps=10, warmup_steps=0.2,
                  lr_scheduler_type="cosine", max_grad_norm=0.5)
    torch.manual_seed(seed_rank)
    random.seed(seed_rank)
    np.random.seed(seed_rank)
    policy, _ = load_policy_and_reference(model_dir, _mesh((WORLD,)), torch.device("cpu"), cfg)
    opt = build_optimizer(policy, cfg.grpo)
    return cfg, policy, opt, build_scheduler(opt, cfg.grpo)


def _train_step(policy, opt, sched, cfg):
    """One step whose batch comes from torch, python and numpy RNG: resume must restore all three."""
    import numpy as np
    import torch

    from hpcrl.compute.train.optim import clip_grad_norm

    length = random.randint(8, 16)
    x = torch.randint(0, 384, (2, length))
    weight = float(np.random.uniform(0.5, 1.5))
    loss = policy(input_ids=x, labels=x).loss * weight
    loss.backward()
    norm = clip_grad_norm(policy.parameters(), cfg.grpo.max_grad_norm)
    opt.step()
    sched.step()
    opt.zero_grad()
    return [loss.item(), norm, opt.param_groups[0]["lr"]]


def _w_ckpt_first_run(rank, world, model_dir, ckpt_dir, out):
    import torch

    from hpcrl.compute.train import checkpoint

    cfg, policy, opt, sched = _train_setup(model_dir, seed_rank=100 + rank)
    checkpoint.control_group(10)
    assert checkpoint.latest_checkpoint(ckpt_dir) is None
    for step in range(1, 4):
        _train_step(policy, opt, sched, cfg)
        path = checkpoint.save(ckpt_dir, step, policy, opt, sched, {"sampler": {"index": 10 * step, "rank": rank}},
                               keep=2, timeout_s=10)
        assert path == Path(ckpt_dir) / f"step-{step}"
    assert sorted(p.name for p in Path(ckpt_dir).iterdir()) == ["latest", "step-2", "step-3"], "keep=2 prunes"
    after = [_train_step(policy, opt, sched, cfg) for _ in range(2)]
    torch.save({"after": after, "params": _full(policy)}, Path(out) / f"first-{rank}.pt")

    # Interrupted save of step 5: every rank wrote its part of step-5.tmp, then rank 0 dies before the
    # rename. Rank 1, waiting for the commit, must fail with a message (not hang).
    def die(*a, **k):
        os._exit(17)

    checkpoint._commit = die
    t0 = time.monotonic()
    try:
        checkpoint.save(ckpt_dir, 5, policy, opt, sched, {}, keep=2, timeout_s=10)
    except checkpoint.CheckpointError as e:
        Path(out, f"interrupted-{rank}.txt").write_text(f"{time.monotonic() - t0:.1f} {e}")
        os._exit(0)
    raise AssertionError("save with a dead rank 0 returned")


def _w_ckpt_resume(rank, world, model_dir, ckpt_dir, out):
    import torch

    from hpcrl.compute.train import checkpoint

    # Different seeds than the first run: only a restored RNG makes the same batches.
    cfg, policy, opt, sched = _train_setup(model_dir, seed_rank=999 + rank)
    path = checkpoint.latest_checkpoint(ckpt_dir)
    assert path == Path(ckpt_dir) / "step-3", path
    extra = checkpoint.load(path, policy, opt, sched, timeout_s=10)
    assert extra == {"sampler": {"index": 30, "rank": rank}, "step": 3}, extra
    again = [_train_step(policy, opt, sched, cfg) for _ in range(2)]
    params = _full(policy)
    first = torch.load(Path(out) / f"first-{rank}.pt", weights_only=False)
    assert again == first["after"], f"losses/norms/lrs after resume {again} != {first['after']}"
    diff, name = _max_diff(params, first["params"])
    assert diff == 0.0, f"{name} differs by {diff} after resume"
    # The next save of step 5 replaces the stale step-5.tmp and prunes to keep=2.
    checkpoint.save(ckpt_dir, 5, policy, opt, sched, {"sampler": {"index": 50}}, keep=2, timeout_s=10)
    checkpoint.barrier("listing", 10)
    assert sorted(p.name for p in Path(ckpt_dir).iterdir()) == ["latest", "step-3", "step-5"]
    assert (Path(ckpt_dir) / "latest").read_text().strip() == "step-5"


def test_checkpoint_resume_is_exact_and_interrupted_save_is_harmless(tmp_path, model_dir):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    out.mkdir()
    t_first = spawn(_w_ckpt_first_run, tmp_path / "a", model_dir, str(ckpt), str(out), expect={0: 17})
    # Rank 1 noticed rank 0's death within the timeout and said so.
    took, _, message = (out / "interrupted-1.txt").read_text().partition(" ")
    assert float(took) < 15 and "commit" in message and "rank" in message, message
    assert (ckpt / "step-5.tmp").is_dir() and not (ckpt / "step-5").exists()
    assert (ckpt / "latest").read_text().strip() == "step-3"
    from hpcrl.compute.train.checkpoint import latest_checkpoint, list_checkpoints

    assert latest_checkpoint(ckpt) == ckpt / "step-3"
    assert [p.name for p in list_checkpoints(ckpt)] == ["step-2", "step-3"]
    t_resume = spawn(_w_ckpt_resume, tmp_path / "b", model_dir, str(ckpt), str(out))
    print(f"first run {t_first:.1f} s, resume {t_resume:.1f} s")


def _w_hung_rank(rank, world, ckpt_dir, out):
    import torch

    from hpcrl.compute.train import checkpoint

    checkpoint.control_group(3)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    if rank == 1:               # alive but stuck: never reaches the save (until rank 0 has given up)
        deadline = time.monotonic() + 30
        while not Path(out, "hung.txt").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        os._exit(0)
    t0 = time.monotonic()
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.save(ckpt_dir, 1, model, opt, None, {}, keep=1, timeout_s=3)
    Path(out, "hung.txt").write_text(f"{time.monotonic() - t0:.1f} {err.value}")
    os._exit(0)


def test_save_fails_with_message_when_a_rank_hangs(tmp_path):
    ckpt = tmp_path / "ckpt"
    spawn(_w_hung_rank, tmp_path, str(ckpt), str(tmp_path), timeout=60)
    took, _, message = (tmp_path / "hung.txt").read_text().partition(" ")
    assert float(took) < 10, took
    assert "Rank 1" in message and "3 s timeout" in message, message
    from hpcrl.compute.train.checkpoint import latest_checkpoint

    assert latest_checkpoint(ckpt) is None


def test_latest_checkpoint_falls_back_to_newest_complete(tmp_path):
    from hpcrl.compute.train.checkpoint import latest_checkpoint

    for step in (4, 7):
        d = tmp_path / f"step-{step}"
        d.mkdir()
        (d / ".metadata").write_bytes(b"x")
        (d / "meta.json").write_text("{}")
    (tmp_path / "step-9.tmp").mkdir()
    (tmp_path / "step-8").mkdir()           # incomplete: no metadata
    assert latest_checkpoint(tmp_path) == tmp_path / "step-7"
    (tmp_path / "latest").write_text("step-4\n")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-4"
    (tmp_path / "latest").write_text("step-8\n")
    assert latest_checkpoint(tmp_path) == tmp_path / "step-7"


# ----------------------------------------------------------------------------------------------
# (d) metrics.jsonl and heartbeat.json


def test_metrics_truncate_after_and_rank_zero_only(tmp_path, caplog):
    from hpcrl.compute.metrics import MetricsWriter
    from hpcrl.job.rundir import read_metrics

    assert MetricsWriter(tmp_path / "other", rank=1).log(1, {"reward": 1.0}) is None
    assert not (tmp_path / "other").exists()

    with caplog.at_level("WARNING"):
        w = MetricsWriter(tmp_path, rank=0, tensorboard=True, wandb=True)
        for step in range(1, 6):
            w.log(step, {"reward": step / 10, "time_sync_s": 0.5, "grad_norm": float("nan"), "tokens_per_s": 100})
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        assert any("tensorboard" in r.message for r in caplog.records)
    w.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "rew')     # a line torn by a kill
    lines = read_metrics(tmp_path)
    assert [m["step"] for m in lines] == [1, 2, 3, 4, 5]
    assert lines[0]["sync_s"] == 0.5 and lines[0]["grad_norm"] is None and "time" in lines[0]

    w = MetricsWriter(tmp_path, rank=0)
    assert w.truncate_after(3) == 3
    w.log(4, {"reward": 0.44})
    w.log(5, {"reward": 0.55})
    w.close()
    assert [(m["step"], m["reward"]) for m in read_metrics(tmp_path)] == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.44), (5, 0.55)]
    text = (tmp_path / "metrics.jsonl").read_text()
    assert all(json.loads(line) for line in text.splitlines()) and text.endswith("\n")
    assert MetricsWriter(tmp_path / "fresh", rank=0).truncate_after(0) == 0


def test_metrics_lines_survive_a_kill(tmp_path):
    code = ("import os, sys; from hpcrl.compute.metrics import MetricsWriter; w = MetricsWriter(sys.argv[1], 0)\n"
            "for s in range(1, 4): w.log(s, {'reward': s})\n"
            "os._exit(9)")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], timeout=60)
    assert r.returncode == 9
    from hpcrl.job.rundir import read_metrics

    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2, 3]


def test_heartbeat_is_whole_json_under_concurrent_rewrites(tmp_path):
    from hpcrl.compute.metrics import MetricsWriter

    w = MetricsWriter(tmp_path, rank=0)
    stop = threading.Event()
    bad: list[str] = []

    def reader():
        while not stop.is_set():
            try:
                text = (tmp_path / "heartbeat.json").read_text()
            except FileNotFoundError:
                continue
            try:
                json.loads(text)
            except ValueError:
                bad.append(text)

    def writer(k):
        for i in range(150):
            w.heartbeat(i, f"phase-{k}", servers={"node0": {"state": "ready", "weight_version": i}}, writer=k)

    threads = [threading.Thread(target=reader)] + [threading.Thread(target=writer, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads[1:]:
        t.join()
    stop.set()
    threads[0].join()
    assert not bad, bad[:1]
    hb = json.loads((tmp_path / "heartbeat.json").read_text())
    assert hb["step"] == 149 and hb["pid"] == os.getpid() and hb["servers"]["node0"]["state"] == "ready"
    assert {"time", "step", "phase", "pid", "host", "servers"} <= hb.keys()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heartbeat.json"], "no temp files left"


def test_tensorboard_gets_every_numeric_metric(tmp_path):
    """logging.tensorboard: the scalars land in <run_dir>/tensorboard, readable by TensorBoard, under
    the names transformers' TensorBoard callback gives TRL's (train/..., eval/...)."""
    pytest.importorskip("tensorboard")      # installed by scripts/install.sh (the test extra)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hpcrl.compute.metrics import MetricsWriter

    w = MetricsWriter(tmp_path, rank=0, tensorboard=True)
    for step in range(1, 4):
        w.log(step, {"reward": step / 10, "rewards/demo_correct/mean": step / 20, "time_sync_s": 0.5,
                     **({"eval_reward": 0.7} if step == 3 else {})})
    w.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"train/reward", "train/rewards/demo_correct/mean", "train/time_sync_s",
                                          "train/sync_s", "eval/reward"}
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("train/reward")] == [(1, 0.1), (2, 0.2), (3, 0.3)]
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("eval/reward")] == [(3, 0.7)]


# ----------------------------------------------------------------------------------------------
# (c) a staged model: each node reads its own copy

def _w_read_per_node(rank, world, node_dirs):
    import torch
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor

    from hpcrl.compute.train.fsdp import LoadOptions, load_sharded_model

    node = rank // 2                                         # 2 fake nodes x 2 trainers
    mesh = _mesh((world,))                                   # FSDP across both nodes
    model = load_sharded_model(node_dirs[node], mesh, torch.device("cpu"),
                               LoadOptions(read_groups=[[0, 1], [2, 3]], load_timeout_s=60))
    # Node 1's copy differs from node 0's: the shards node 1 holds can only have come from its own copy.
    mine = load_file(str(Path(node_dirs[node]) / "model.safetensors"))
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor)
        full = mine[name]
        rows = torch.tensor_split(torch.arange(full.shape[0]), world)[rank] if full.ndim else None
        got = p.to_local()
        assert got.shape[0] == len(rows), name
        assert torch.equal(got, full[rows].to(got.dtype)), f"rank {rank}: {name} is not node {node}'s copy"


def test_a_staged_model_is_read_by_each_node_from_its_own_copy(tmp_path, model_dir):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    copies = [tmp_path / "node0", tmp_path / "node1"]
    for copy in copies:
        shutil.copytree(model_dir, copy)
    weights = load_file(str(copies[1] / "model.safetensors"))
    save_file({k: (v + 1).contiguous() if v.is_floating_point() else v for k, v in weights.items()},
              str(copies[1] / "model.safetensors"), metadata={"format": "pt"})
    assert not torch.equal(load_file(str(copies[1] / "model.safetensors"))[next(iter(weights))],
                           weights[next(iter(weights))])
    spawn(_w_read_per_node, tmp_path / "run", [str(c) for c in copies], world=4, timeout=300)
