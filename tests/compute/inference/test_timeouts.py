"""Timeouts sized for real models: a generation's bound grows with the tokens asked for, the model
load has its own bound apart from the collectives', and the messages name the recipe field to raise."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from hpcrl.job.recipe import InferenceConfig


def test_generation_bound_scales_with_the_tokens_requested():
    from hpcrl.compute.inference.client import generation_timeout_s
    from hpcrl.compute.inference.types import Sampling

    inf = InferenceConfig()
    assert (inf.request_timeout_s, inf.generation_s_per_ktoken) == (600.0, 2.0)
    # The demo's request: 32 prompts x 4 x 16 tokens, one trainer: barely above the floor.
    assert generation_timeout_s(inf, 32, Sampling(n=4, max_tokens=16)) == pytest.approx(600 + 2 * 2.048)
    # gpu-review defect 6: 14B, 7 trainers x 32 prompts x 4 completions x 4,096 tokens, one batch.
    big = generation_timeout_s(inf, 32, Sampling(n=4, max_tokens=4096), trainers=7)
    assert big == pytest.approx(600 + 2 * 7 * 32 * 4 * 4096 / 1000) and big > 2 * 3600
    faster = InferenceConfig(request_timeout_s=60, generation_s_per_ktoken=0.5)
    assert generation_timeout_s(faster, 1, Sampling(n=2, max_tokens=1000)) == pytest.approx(61.0)


class _SilentChannel:
    def __init__(self):
        self.sent, self.waited = [], []

    def send(self, msg):
        self.sent.append(msg)

    def recv(self, timeout=None):
        self.waited.append(timeout)
        raise TimeoutError("no message")


def test_a_silent_server_is_reported_with_the_field_that_bounds_the_wait():
    from hpcrl.compute.inference.client import ServerGenerator, ServerUnavailable
    from hpcrl.compute.inference.types import Sampling

    from hpcrl.job.placement import make_plan
    from hpcrl.login import profiles

    inf = InferenceConfig(request_timeout_s=100, generation_s_per_ktoken=1.5)
    local = profiles.load("local")
    plan = make_plan(replace(local, node=replace(local.node, gpus=3)), 1)        # 2 trainers, 1 engine (rank 2)
    channel = _SilentChannel()
    ctx = SimpleNamespace(spec=SimpleNamespace(recipe=SimpleNamespace(inference=inf)), plan=plan,
                          task=plan.task(0), channels={2: channel})
    gen = ServerGenerator(ctx, model=None)
    pending = gen.submit([[1, 2, 3]] * 10, Sampling(n=4, max_tokens=500))
    with pytest.raises(ServerUnavailable) as info:
        pending.result()
    # 2 trainers x 10 prompts x 4 x 500 tokens = 40,000 tokens: 100 + 1.5 x 40 s.
    assert channel.waited == [pytest.approx(160.0)]
    assert "the server on node 0 (rank 2) did not answer 'generate' within 160 s" in str(info.value)
    assert "inference.request_timeout_s=100" in str(info.value)
    assert "inference.generation_s_per_ktoken=1.5" in str(info.value)
    gen.engines[2].generating.clear()       # (else the health request's bound waits for it too)
    with pytest.raises(ServerUnavailable, match=r"'health' within 600 s \(inference.start_timeout_s\)"):
        gen.wait_ready()


# ------------------------------------------------------------------ the model load's own bound

def _load_rank(rank: int, world: int, init_file: str, model_dir: str, out_dir: str, collective_s: float,
               load_s: float, read_delay_s: float) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch.distributed as dist
    from datetime import timedelta
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from hpcrl.compute.train.fsdp import LoadOptions, load_sharded_model

    torch.set_num_threads(1)
    # Both ranks past their imports before the group forms: on a busy machine one may import seconds
    # later than the other, which a 2 s collective timeout would take for the load's slowness.
    Path(f"{init_file}.ready{rank}").touch()
    deadline = time.monotonic() + 60
    while not all(Path(f"{init_file}.ready{r}").exists() for r in range(world)) and time.monotonic() < deadline:
        time.sleep(0.01)
    result: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=collective_s))
        if rank == 0:       # rank 0 reads slowly, as a large checkpoint from a parallel file system
            read = AutoModelForCausalLM.from_pretrained
            AutoModelForCausalLM.from_pretrained = lambda *a, **k: (time.sleep(read_delay_s), read(*a, **k))[1]
        model = load_sharded_model(model_dir, init_device_mesh("cpu", (world,)), torch.device("cpu"),
                                   LoadOptions(load_timeout_s=load_s))
        result["loaded"] = sum(float(p.full_tensor().double().sum()) for p in model.parameters())
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)         # no teardown: a peer may be gone, and gloo's destructors can abort then


def _run_loads(tmp_path: Path, **runs: dict) -> dict[str, dict[int, dict]]:
    """Each run (tag -> its _load_rank settings) as two ranks, all runs at once (each waits out
    its own delay and bound: side by side they take the longest one's time, not the sum)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model_dir = tmp_path / "model"
    config = Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(model_dir)
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for tag, kw in runs.items():
        (tmp_path / tag).mkdir()
        procs += [ctx.Process(target=_load_rank, args=(r, 2, str(tmp_path / f"rdzv-{tag}"), str(model_dir),
                                                        str(tmp_path / tag)), kwargs=kw) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.is_alive():
            p.kill()
            p.join()
    return {tag: {r: json.loads((tmp_path / tag / f"rank{r}.json").read_text()) for r in range(2)
                  if (tmp_path / tag / f"rank{r}.json").exists()} for tag in runs}


def test_model_load_is_bounded_apart_from_the_collectives(tmp_path):
    """Rank 0 reads for 5 s against a 2 s collective timeout: with launch.model_load_timeout_s
    above it the load completes, and below it the other rank stops with a message naming it."""
    got = _run_loads(tmp_path, ok=dict(collective_s=2.0, load_s=60.0, read_delay_s=5.0),
                     slow=dict(collective_s=60.0, load_s=2.0, read_delay_s=8.0))
    ok, slow = got["ok"], got["slow"]
    assert set(ok) == {0, 1} and "error" not in ok[0] and "error" not in ok[1], ok
    assert ok[0]["loaded"] == pytest.approx(ok[1]["loaded"])

    assert "launch.model_load_timeout_s" in slow[1].get("error", ""), slow
    assert "did not finish reading" in slow[1]["error"] and "within 2 s" in slow[1]["error"], slow
