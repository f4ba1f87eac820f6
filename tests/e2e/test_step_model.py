"""scripts/model_step.py: the step model's arithmetic on cases checked by hand, and the script's
output (the tables' last line and the PNG it writes)."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from dataclasses import replace

import pytest
from conftest import REPO

SCRIPT = REPO / "scripts" / "model_step.py"


@pytest.fixture(scope="module")
def ms():
    spec = importlib.util.spec_from_file_location("model_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["model_step"] = module      # dataclasses look the module up while building Inputs
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop("model_step", None)


@pytest.fixture
def simple(ms):
    """Round numbers: 1e9 parameters, 1 TFLOP/s, 1 TB/s, every efficiency 1, no collective latency."""
    return replace(ms.Inputs(), params=1e9, tensors=10, peak_tflops=1.0, hbm_tbs=1.0, train_tflops=1.0,
                   decode_flops_fraction=1.0, decode_hbm_fraction=1.0, link_efficiency=1.0,
                   coll_base_us=0.0, intra_hop_us=0.0, net_hop_us=0.0, prompt_tokens=100,
                   completion_tokens=10)


def test_generation_is_a_roofline(ms, simple):
    # A decode step reads 2e9 bytes at 1 TB/s (2 ms) or computes 2e9 FLOPs a sequence at 1 TFLOP/s (2 ms).
    assert ms.generation_s(simple, 1, 1) == pytest.approx(10 * 0.002)      # weights-bound: 10 steps x 2 ms
    assert ms.generation_s(simple, 5, 1) == pytest.approx(10 * 5 * 0.002)  # FLOP-bound: 10 x 10 ms
    assert ms.generation_s(simple, 10, 2) == ms.generation_s(simple, 5, 1)  # each engine its share


def test_training_and_allreduce_by_hand(ms, simple):
    # 1 completion x 110 tokens x 10 FLOPs x 1e9 parameters over 2 trainers at 1e12 FLOP/s.
    assert ms.training_s(simple, 1, 2) == pytest.approx(110 * 10 * 1e9 / 2e12)
    assert ms.allreduce_s(simple, 1) == 0.0                     # one node: nothing crosses the network
    # 2 nodes: 2 (n-1)/n x 4e9 bytes of fp32 gradients at 4 x 25 GB/s.
    assert ms.allreduce_s(simple, 2) == pytest.approx(4e9 / 100e9)


def test_ring_latency_follows_rccl_model(ms):
    inp = ms.Inputs()
    # 16 ranks on 2 nodes, an all-gather: 15 steps, one of them across the network.
    assert ms.ring_latency_s(inp, 16, 2) == pytest.approx((27.9 + 14 * 2.7 + 1 * 4.5) / 1e6)
    assert ms.ring_latency_s(inp, 1, 1) == 0.0


def test_hpcrl_sync_is_per_node_and_constant(ms):
    inp = ms.Inputs()
    syncs = {ms.step_hpcrl(inp, n, inp.global_batch)["sync"] for n in ms.NODES}
    assert len(syncs) == 1
    b = 14.77e9 * 2
    by_hand = (6 / 7 * b / (50e9 * 0.85) + 579 * (27.9 + 6 * 2.7) / 1e6   # gather over the node's 7 trainers
               + b / (200e9 * 0.85))                                       # GCD 6 -> GCD 7
    assert syncs.pop() == pytest.approx(by_hand)


def test_single_server_sync_grows_with_nodes(ms):
    inp = ms.Inputs()
    syncs = [ms.sync_s_single(inp, n) for n in ms.NODES[1:]]
    assert all(a < b for a, b in zip(syncs, syncs[1:]))
    assert syncs[-1] > 5 * ms.sync_s_hpcrl(inp)
    # Its floor: the model's bf16 bytes through rank 0's one NIC.
    assert syncs[0] > 14.77e9 * 2 / (25e9 * 0.85)


def test_generation_times_relate_as_engines(ms):
    one_gpu = replace(ms.Inputs(), server_gpus=1)
    # One node, one GCD serving in both: the same generation.
    assert ms.step_single(one_gpu, 1, 4096)["generation"] == ms.step_hpcrl(one_gpu, 1, 4096)["generation"]
    inp = ms.Inputs()
    for n in (2, 4, 16, 32):      # FLOP-bound: time is inversely proportional to the engines
        ratio = ms.step_single(inp, n, 4096)["generation"] / ms.step_hpcrl(inp, n, 4096)["generation"]
        assert ratio == pytest.approx(n * inp.engines_per_node / inp.server_gpus)
    assert ms.step_single(inp, 1, 4096) is None   # a node of its own leaves no trainer on one node


def test_step_is_the_sum_of_its_phases(ms):
    inp = ms.Inputs()
    for row in ms.scaling(inp, "weak"):
        for design in ("hpcrl", "single"):
            if row[design]:
                assert row[design]["step"] == pytest.approx(sum(row[design][p] for p in ms.PHASES))
    weak = ms.scaling(inp, "weak")
    assert weak[-1]["completions"] == 256 * inp.per_node_batch
    assert math.isclose(weak[0]["hpcrl"]["generation"], weak[-1]["hpcrl"]["generation"])


def test_script_writes_the_png_and_a_last_line(tmp_path):
    out = tmp_path / "fig" / "step.png"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size < 200_000
    last = dict(kv.split("=") for kv in proc.stdout.strip().splitlines()[-1].split())
    assert {"speedup_strong_at_256", "speedup_weak_at_256", "sync_s_hpcrl",
            "sync_share_at_256_single_server"} <= set(last)
    assert float(last["speedup_weak_at_256"]) > 1
