"""Will it fit? The memory estimate (hpcrl.job.estimate) part by part against numbers worked out here by
hand from Qwen2.5's published config.json values, the verdicts for frontier and cuda at 1 and 64
nodes, `hpcrl plan`'s memory column and verdict, and the refusals of `hpcrl render`/`submit`:
exit 2, one line with the role, the GPU, the estimate, the memory and the fix, nothing written.
Sizes are GiB, as the site files' gpu_memory_gb."""

from __future__ import annotations

import json
import math

import pytest

from hpcrl.job.estimate import estimate
from hpcrl.job.memory import GIB, TrainingStep, layer_activation_bytes, server_parts, trainer_parts
from hpcrl.job.mesh_choice import choose_mesh, sync_traffic
from hpcrl.job.model_shape import ModelShape, count_parameters, model_shape
from hpcrl.login.cli import main as cli_main
from hpcrl.login.compose import compose

# Qwen/Qwen2.5-14B and Qwen/Qwen2.5-1.5B, config.json (the keys the estimate reads).
QWEN_14B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 5120,
            "num_hidden_layers": 48, "vocab_size": 152064, "intermediate_size": 13824,
            "num_attention_heads": 40, "num_key_value_heads": 8, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16"}
QWEN_1_5B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 1536,
             "num_hidden_layers": 28, "vocab_size": 151936, "intermediate_size": 8960,
             "num_attention_heads": 12, "num_key_value_heads": 2, "tie_word_embeddings": True,
             "torch_dtype": "bfloat16"}
# Llama-3-70B's shape.
LLAMA_70B = {"hidden_size": 8192, "num_hidden_layers": 80, "vocab_size": 128256, "intermediate_size": 28672,
             "num_attention_heads": 64, "num_key_value_heads": 8, "tie_word_embeddings": False,
             "torch_dtype": "bfloat16"}

# A GRPO setting for a 14B model: 8 completions of up to 1024 tokens after prompts of up to 1024,
# log-probs in chunks of 1024 tokens (pinned: the hand-computed figures below assume it).
BATCH = ["grpo.per_device_train_batch_size=8", "grpo.num_generations=8", "grpo.max_completion_length=1024",
         "inference.max_model_len=2048", "trainer.logprob_chunk_tokens=1024"]
BIGGER_BATCH = ["grpo.per_device_train_batch_size=16", "grpo.num_generations=16"]


def _model(tmp_path, name: str, cfg: dict) -> str:
    d = tmp_path / name
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    # What render's look at a model directory wants beside it (hpcrl.login.inputs); no weights' bytes.
    (d / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (d / "tokenizer.json").write_text("{}")
    return str(d)


def _spec(site, nodes, *overrides):
    return compose(None, site, list(overrides), {"resources.nodes": nodes, "resources.account": "abc123"},
                   for_plan=True)


# ------------------------------------------------------------------------- the shape and its size
def _layer(h, heads, kv, d, inter):
    return h * heads * d * 2 + h * kv * d * 2 + 3 * h * inter + 2 * h     # q,o + k,v + gate/up/down + 2 norms


def test_shape_and_parameters_from_config(tmp_path):
    s14, why = model_shape(_model(tmp_path, "q14", QWEN_14B))
    assert why == ""
    assert (s14.head_dim, s14.num_kv_heads, s14.dtype, s14.tie_word_embeddings) == (128, 8, "bfloat16", False)
    assert s14.layer_params == _layer(5120, 40, 8, 128, 13824) == 275_261_440
    assert s14.params == 48 * 275_261_440 + 2 * 152064 * 5120 + 5120 == 14_769_689_600      # 14.8B as published
    s15, _ = model_shape(_model(tmp_path, "q15", QWEN_1_5B))
    assert s15.params == 28 * _layer(1536, 12, 2, 128, 8960) + 151936 * 1536 + 1536 == 1_543_656_960   # tied: 1.54B
    # A multimodal model's language model is its text_config; dtype may be transformers 5's "dtype".
    nested = {"text_config": {k: v for k, v in QWEN_1_5B.items() if k != "torch_dtype"}, "dtype": "float32"}
    shape, _ = model_shape(_model(tmp_path, "vl", nested))
    assert shape.params == s15.params and shape.dtype == "float32"


def test_no_estimate_where_the_shape_is_unknown(tmp_path):
    assert model_shape("demo:tiny")[0] is None and "built in the job" in model_shape("demo:tiny")[1]
    assert "no config.json" in model_shape(str(tmp_path / "absent"))[1]


# Qwen3-30B-A3B's config.json (its shape; the most common RL model of 2026)
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
                 "num_hidden_layers": 48, "vocab_size": 151936, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                 "tie_word_embeddings": False, "torch_dtype": "bfloat16", "max_position_embeddings": 40960}


def test_a_mixture_of_experts_model_is_estimated_with_all_its_experts_stored_and_its_active_ones_computing(tmp_path):
    shape = model_shape(_model(tmp_path, "moe", QWEN3_30B_A3B))[0]
    h = 2048
    attn = h * 32 * 128 * 2 + h * 4 * 128 * 2
    layer = attn + 128 * 3 * h * 768 + h * 128 + 2 * h         # every expert, the router, two norms
    assert shape.layer_params == layer
    assert shape.params == 2 * 151936 * h + h + 48 * layer == 30_532_110_336   # "30B"
    assert shape.active_intermediate == 8 * 768
    # Activations follow the 8 active experts, not the 128 stored: a dense 6144-wide MLP's less 0.
    dense = model_shape(_model(tmp_path, "dense", {k: v for k, v in QWEN3_30B_A3B.items()
                                                   if k not in ("num_experts", "moe_intermediate_size")}))[0]
    assert layer_activation_bytes(shape, 2) == layer_activation_bytes(dense, 2) + 2 * 8 * h + 4 * 128
    # `hpcrl plan` says whether it fits: one engine of 2 GCDs serves it (57 GiB of bf16 weights do
    # not fit one); the training state (16 B a parameter: 455 GiB) does not fit one node's 6
    # trainers, and fits 2 nodes' 12: at 4 nodes, HSDP in groups of 2 nodes.
    path = _model(tmp_path, "moe", QWEN3_30B_A3B)
    tp2 = ["inference.gpus=2", "inference.tensor_parallel_size=2", "trainer.activation_checkpointing=true"]
    one = estimate(_spec("frontier", 1, f"model.path={path}", *BATCH, *tp2))
    assert one.trainer.fits is False and one.server.fits is True and "-N 2" in one.trainer.fix_text()
    four = estimate(_spec("frontier", 4, f"model.path={path}", *BATCH, *tp2))
    assert four.trainer.fits is True and (four.mesh.shape, four.mesh.nodes_per_shard) == ((2, 12), 2)


# ------------------------------------------------------------------------- the parts, by hand
def test_trainer_parts_by_hand(tmp_path):
    """14B on one Frontier node: 7 trainers share the state (FSDP), reference on, bf16,
    micro-batch 8 x 2048 tokens with activation checkpointing, log-probs in chunks of 1024."""
    path = _model(tmp_path, "q14", QWEN_14B)
    spec = _spec("frontier", 1, f"model.path={path}", "grpo.beta=0.04", "trainer.activation_checkpointing=true", *BATCH)
    fit = estimate(spec)
    assert (fit.mesh.kind, fit.mesh.shape) == ("fsdp", (7,))
    p, layer, h, v = 14_769_689_600, 275_261_440, 5120, 152064
    root = 2 * v * h + h                                    # untied embeddings and head, final norm
    # Per token and layer, bf16: 2 norms x (fp32 input 4 B + bf16 output 2 B) x h; q, k, v (k, v
    # repeated to the 40 query heads), attention output and o_proj's input: 5 x 40 x 128 x 2 B,
    # fp32 logsumexp 40 x 4 B; gate, silu, up, product: 4 x 13824 x 2 B.
    per_layer = 2 * 6 * h + 5 * 40 * 128 * 2 + 40 * 4 + 4 * 13824 * 2
    assert per_layer == layer_activation_bytes(model_shape(path)[0], 2) == 223_392
    tokens = 8 * 2048
    expected = {
        "training_state": math.ceil(p * 16 / 7),                       # 31.4 GiB: the "~34 GB"
        "reference": math.ceil(p * 2 / 7),                             # bf16, sharded alike
        "reward_models": 0,
        "gathered_layers": 2 * layer * 2 + layer * 4 + root * 2 + v * h * 2,
        "activations": tokens * (48 * h * 2 + per_layer + 6 * h),     # layer inputs + one layer + final norm
        "logits": 2 * 8 * 1025 * v * 2,                               # bf16 logits and their gradient
        "logprob_chunk": 4 * 1024 * v * 4,                            # four fp32 chunk temporaries
        "overhead": 2 * GIB,
    }
    assert fit.trainer.parts == expected
    assert fit.trainer.est_bytes == sum(expected.values())
    assert round(fit.trainer.est_bytes / GIB, 1) == 62.1 and fit.trainer.fits       # of 64 GB per GCD
    # Without checkpointing every layer keeps its activations: 48 x 223,392 B per token.
    bare = _spec("frontier", 1, f"model.path={path}", "grpo.beta=0.04", *BATCH)
    assert estimate(bare).trainer.parts["activations"] == tokens * (48 * per_layer + 6 * h)
    # grpo.cast_lm_head_to_fp32: the head gathered in fp32, with its gradient, its logits in fp32,
    # and the reference's head stored in fp32.
    fp32 = estimate(_spec("frontier", 1, f"model.path={path}", "grpo.beta=0.04", "trainer.activation_checkpointing=true",
                          "grpo.cast_lm_head_to_fp32=true", *BATCH)).trainer.parts
    assert fp32 == expected | {"gathered_layers": 2 * layer * 2 + layer * 4 + root * 2 + v * h * 2 + v * h * 4,
                               "logits": 2 * 8 * 1025 * v * 4, "reference": math.ceil((p * 2 + v * h * 2) / 7)}


def test_trainer_parts_is_the_benchmarks_formula(tmp_path):
    """What a benchmark calls for one trainer in its own setting (torch's counters see no
    context or fragmentation: overhead 0); fp32 on CPU, no reference, one rank."""
    shape = ModelShape.from_config(QWEN_1_5B)
    parts = trainer_parts(shape, TrainingStep(micro_batch=2, seq_len=256, completion_len=128, compute_dtype="float32",
                                              checkpointing=False, logprob_chunk_tokens=64, overhead_bytes=0))
    h, v, p = 1536, 151936, 1_543_656_960
    per_layer = 2 * 8 * h + 5 * 12 * 128 * 4 + 12 * 4 + 4 * 8960 * 4
    assert parts == {"training_state": p * 16, "reference": 0, "reward_models": 0,
                     "gathered_layers": 2 * shape.layer_params * 4 + shape.layer_params * 4
                     + (v * h + h) * 4 + v * h * 4,
                     "activations": 512 * (28 * per_layer + 8 * h), "logits": 2 * 2 * 129 * v * 4,
                     "logprob_chunk": 4 * 64 * v * 4, "overhead": 0}


def test_server_parts_by_hand(tmp_path):
    """14B served in bf16 on one 64 GB GCD (TP 1, max_model_len 2048): fits vLLM's 0.85 budget."""
    path = _model(tmp_path, "q14", QWEN_14B)
    fit = estimate(_spec("frontier", 1, f"model.path={path}", *BATCH))
    kv_token = 2 * 48 * 8 * 128 * 2                            # K and V, 48 layers, 8 KV heads of 128, bf16
    parts = fit.server.parts
    assert parts["weights"] == 14_769_689_600 * 2
    assert parts["kv_cache"] == 2048 * kv_token                # one max_model_len sequence
    # vLLM's profiling forward on a < 70 GiB GPU: 8192 tokens, 256 sequences' fp32 logits and probs.
    assert parts["activations"] == 8192 * (3 * 5120 + 3 * 13824) * 2 + 256 * 152064 * 8
    assert parts["overhead"] == 3 * GIB // 2 + GIB // 2        # + HIP graphs: enforce_eager is off on GPUs
    assert fit.server.capacity_bytes == int(int(64 * GIB) * 0.85)
    assert fit.server.fits and round(fit.server.est_bytes / GIB, 1) == 31.0
    # The rest of the budget is KV cache: 63 sequences of 2048 tokens, all the node's 7 x 8 at once.
    room = fit.server.capacity_bytes - parts["weights"] - parts["activations"] - parts["overhead"]
    assert fit.server.facts["kv_sequences_at_once"] == room // (2048 * kv_token) == 63
    assert fit.server.facts["sequences_per_step"] == 56 and "room for all 56" in fit.server.verdict()
    # Tensor parallel: weights and KV heads split over the ranks.
    two = server_parts(model_shape(path)[0], tp=2, max_model_len=2048)
    assert two["weights"] == 14_769_689_600 and two["kv_cache"] == 2048 * kv_token // 2


def test_a_float32_checkpoint_is_served_in_bf16_on_gpus(tmp_path):
    path = _model(tmp_path, "q15", dict(QWEN_1_5B, torch_dtype="float32"))
    assert estimate(_spec("cuda", 1, f"model.path={path}")).server.parts["weights"] == 1_543_656_960 * 2
    assert estimate(_spec("cuda", 1, f"model.path={path}", "inference.dtype=float32")).server.parts["weights"] \
        == 1_543_656_960 * 4


def test_the_transformers_engine_holds_the_whole_batch(tmp_path):
    """No paging: the node's 56 sequences' KV cache and every step's fp32 scores over the
    vocabulary stay at once, against the whole GCD; vLLM would fit."""
    path = _model(tmp_path, "q14", QWEN_14B)
    server = estimate(_spec("frontier", 1, f"model.path={path}", "inference.engine=transformers", *BATCH)).server
    assert server.parts == {"weights": 14_769_689_600 * 2, "kv_cache": 56 * 2048 * 2 * 48 * 8 * 128 * 2,
                            "scores": 56 * 1024 * 152064 * 4, "overhead": 3 * GIB // 2}
    assert server.capacity_bytes == 64 * GIB and server.fits is False and server.fixes == ("inference.engine=vllm",)


# ------------------------------------------------------------------------- verdicts at 1 and 64 nodes
def test_14b_full_fine_tuning_on_one_frontier_node_does_not_fit(tmp_path):
    """7 trainers, reference on, 16 completions of up to 2048 tokens per micro-batch, checkpointed:
    the state sharded 7 ways is 31.4 GiB and the reference 3.9, FSDP's gathered layers (with the
    untied 152k x 5120 embeddings and head) 6.4, the checkpointed activations of 32,768 tokens
    22.8, the logits 9.3, a log-prob chunk 2.3, overhead 2: ~78.1 GiB of a 64 GiB GCD."""
    path = _model(tmp_path, "q14", QWEN_14B)
    fit = estimate(_spec("frontier", 1, f"model.path={path}", "grpo.beta=0.04",
                         "trainer.activation_checkpointing=true", *BATCH, *BIGGER_BATCH))
    t = fit.trainer
    assert {k: round(v / GIB, 1) for k, v in t.parts.items()} == {
        "training_state": 31.4, "reference": 3.9, "reward_models": 0.0, "gathered_layers": 6.4, "activations": 22.8,
        "logits": 9.3, "logprob_chunk": 2.3, "overhead": 2.0}
    assert t.est_gb == 78.1 and t.fits is False and fit.fits is False
    # What fixes it: half the micro-batch (the completions per step kept), or a second node (FSDP
    # over 14 trainers halves the state); checkpointing is already on.
    assert t.fixes == ("grpo.per_device_train_batch_size=8 grpo.gradient_accumulation_steps=2", "-N 2")
    assert "trainers: ~78.1 GB of 64 GB per GCD: does not fit (training state 31.4" in t.verdict()
    # The server on its own GCD is fine.
    assert fit.server.fits is True


def test_14b_at_64_frontier_nodes_shards_over_two_nodes_and_replicates_beyond(tmp_path):
    """Issue #27, item 6: a model one node's trainers cannot hold was sharded over all 448 trainers
    of the job (every all-gather, every sync's, spanning 64 nodes); now over the fewest nodes that
    hold it, 2, replicated across 32 such groups, as the launch will build it."""
    path = _model(tmp_path, "q14", QWEN_14B)
    spec = _spec("frontier", 64, f"model.path={path}", "grpo.beta=0.04", "trainer.activation_checkpointing=true",
                 *BATCH, *BIGGER_BATCH)
    fit = estimate(spec)
    # One node's 7 trainers would keep 78.1 GiB per GCD; 2 nodes' 14 keep 60.5.
    assert (fit.mesh.kind, fit.mesh.shape, fit.mesh.nodes_per_shard) == ("hsdp", (32, 14), 2)
    assert choose_mesh(spec, spec.plan()) == fit.mesh
    assert "78.1 GB per GCD with the state sharded over one node's 7 trainers" in fit.mesh.reason
    assert "shard over each 2 nodes, replicate across the 32 groups" in fit.mesh.reason
    assert round(fit.trainer.parts["training_state"] / GIB, 2) == 15.72       # 14.8B x 16 B / 14
    assert fit.trainer.est_gb == 60.5 and fit.fits is True
    assert fit.mesh.hpz_partition_size == 1         # DeepSpeed's hpZ copy is a node's: plain ZeRO-3 there
    # A sync: each of a node's 7 trainers gathers the other node's half of the 27.5 GiB bf16 model,
    # where sharding over all 448 brought 441/448 of it from other nodes.
    model = 14_769_689_600 * 2
    traffic = sync_traffic(spec, spec.plan(), fit.mesh)
    assert (traffic.model_bytes, traffic.cross_node_bytes) == (model, 7 * model * 7 // 14)
    before = sync_traffic(spec, spec.plan(), fit.mesh._replace(shape=(448,), nodes_per_shard=64))
    assert before.cross_node_bytes == 7 * model * 441 // 448
    # 3 nodes do not split into groups of 2: all 21 trainers shard it.
    three = _spec("frontier", 3, f"model.path={path}", "grpo.beta=0.04", "trainer.activation_checkpointing=true",
                  *BATCH, *BIGGER_BATCH)
    assert choose_mesh(three, three.plan()).shape == (21,)
    # With the smaller micro-batch one node's trainers hold it all: HSDP, no weight bytes cross nodes.
    small = _spec("frontier", 64, f"model.path={path}", "grpo.beta=0.04", "trainer.activation_checkpointing=true",
                  *BATCH)
    assert choose_mesh(small, small.plan()).kind == "hsdp" and estimate(small).trainer.est_gb == 62.1
    assert sync_traffic(small, small.plan(), choose_mesh(small, small.plan())).cross_node_bytes == 0


def test_activations_do_not_shrink_with_nodes_on_cuda(tmp_path):
    """14B without activation checkpointing: 8 x 2048 tokens keep 164 GiB of activations per GPU,
    at 1 node as at 64; the fix is checkpointing (or a smaller micro-batch), not nodes."""
    path = _model(tmp_path, "q14", QWEN_14B)
    for nodes in (1, 64):
        t = estimate(_spec("cuda", nodes, f"model.path={path}", "grpo.beta=0.04", *BATCH)).trainer
        assert t.fits is False and round(t.parts["activations"] / GIB, 1) == 164.1
        assert t.fixes[0] == "trainer.activation_checkpointing=true" and not any(f.startswith("-N") for f in t.fixes)
    fixed = estimate(_spec("cuda", 1, f"model.path={path}", "grpo.beta=0.04", "trainer.activation_checkpointing=true",
                           *BATCH))
    assert fixed.fits is True and fixed.trainer.est_gb == 62.1             # of 80 GB


def test_70b_needs_many_cuda_nodes_and_a_tensor_parallel_server(tmp_path):
    path = _model(tmp_path, "l70", LLAMA_70B)
    args = [f"model.path={path}", "grpo.beta=0.04", "trainer.activation_checkpointing=true", *BATCH]
    one = estimate(_spec("cuda", 1, *args))
    # 70.6B parameters in bf16 are 131 GiB: no 80 GB GPU serves them alone; TP 4 does (TP 2 leaves
    # too little of the 0.85 budget).
    assert one.server.fits is False and round(one.server.parts["weights"] / GIB, 1) == 131.4
    assert one.server.fixes[0] == "inference.gpus=4 inference.tensor_parallel_size=4 (1 engine(s) of 4 GPUs, tensor parallel; leaves 4 trainers per node)"
    # The trainers' fix is counted with the server's GPUs taken: 4 trainers per node.
    assert one.trainer.fits is False and one.trainer.fixes == ("-N 9 (with inference.gpus=4 inference.tensor_parallel_size=4)",)
    at64 = estimate(_spec("cuda", 64, *args, "inference.gpus=4", "inference.tensor_parallel_size=4"))
    assert (at64.mesh.shape, at64.mesh.nodes_per_shard) == ((4, 64), 16) and at64.fits is True
    # On Frontier the 70B server with TP 1 does not fit a 64 GB GCD either.
    assert estimate(_spec("frontier", 64, *args)).server.fits is False


def test_cpu_sites_count_a_share_of_the_nodes_memory(tmp_path):
    """The testbed's fake-GPU nodes: 16 GB for 4 tasks, fp32 training state of a 1.5B model."""
    path = _model(tmp_path, "q15", QWEN_1_5B)
    fit = estimate(_spec("testbed", 1, f"model.path={path}"))
    assert fit.trainer.capacity_bytes == 4 * GIB and fit.trainer.device == "task"
    assert fit.trainer.parts["training_state"] == math.ceil(1_543_656_960 * 16 / 3) and fit.fits is False
    # The local site names no memory size: an estimate, but no verdict and never a refusal.
    local = estimate(_spec("local", 1, f"model.path={path}"))
    assert local.trainer.est_bytes and local.fits is None and "no memory size" in local.trainer.unknown
    assert local.refusal("local") is None


def test_the_demo_has_no_estimate_and_is_never_refused(tmp_path):
    fit = estimate(_spec("local", 1))
    assert fit.fits is None and fit.trainer.est_bytes is None and fit.refusal("local") is None
    spec = compose(None, "local", [], {}, str(tmp_path / "run"))          # `hpcrl run`'s compose
    assert spec.recipe.model.path == "demo:tiny"


# ------------------------------------------------------------------------- hpcrl plan
def test_plan_json_carries_the_estimate_and_the_verdict(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _model(tmp_path, "q14", QWEN_14B)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model: {{path: {path}}}\ngrpo: {{beta: 0.04}}\ntrainer: {{activation_checkpointing: true}}\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert cli_main(["plan", str(recipe), *BATCH, *BIGGER_BATCH, "--site", "frontier", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["fits"] is False and shown["memory"]["fits"] is False
    assert {t["role"]: t["est_memory_gb"] for t in shown["tasks"]} == {"trainer": 78.1, "server": 31.0}
    assert shown["memory"]["trainer"]["parts_gb"]["training_state"] == 31.4
    assert shown["memory"]["trainer"]["fixes"] == [
        "grpo.per_device_train_batch_size=8 grpo.gradient_accumulation_steps=2", "-N 2"]
    assert cli_main(["plan", str(recipe), *BATCH, *BIGGER_BATCH, "--site", "frontier", "-N", "64", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["fits"] is True and shown["memory"]["mesh"]["shape"] == [32, 14]
    assert sorted(p.name for p in tmp_path.iterdir()) == before              # plan writes nothing


def test_plan_table_has_the_memory_column_and_the_verdicts(tmp_path, capsys):
    path = _model(tmp_path, "q14", QWEN_14B)
    assert cli_main(["plan", "--site", "frontier", "--server-gpus", "2", "inference.tensor_parallel_size=2",
                     f"model.path={path}",
                     "trainer.activation_checkpointing=true", *BATCH]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[-2:] == ["est.", "GB"]
    # --server-gpus is inference.gpus: a tensor-parallel server on GCDs 6-7 leaves 6 trainers, which
    # share the state 6 ways (36.7 GiB), and the server holds half the weights.
    assert out[1].split()[3] == "trainer" and out[1].split()[-1] == "63.4"
    assert out[7].split()[3:5] == ["server", "6,7"] and out[7].split()[-1] == "16.8"
    assert out[-2] == ("trainers: ~63.4 GB of 64 GB per GCD: fits (training state 36.7, gathered layers 6.4, "
                       "activations 11.4, logits 4.6, log-prob chunk 2.3, overhead 2)")
    assert out[-1].startswith("server: ~16.8 GB of 54.4 GB per GCD (gpu_memory_utilization 0.85 of 64 GB): fits "
                              "(weights 13.8, KV cache 0.2")
    assert out[-3].startswith("global batch: 8 completions per trainer x 6 trainers = 48 completions (6 prompts x 8)")
    assert not any(line.startswith("weight sync:") for line in out)        # one node: nothing crosses


def test_plan_says_what_a_sync_moves_across_nodes_and_that_the_batch_grows_with_nodes(tmp_path, capsys):
    path = _model(tmp_path, "q14", QWEN_14B)
    args = ["plan", "--site", "frontier", f"model.path={path}", "grpo.beta=0.04", "trainer.activation_checkpointing=true",
            *BATCH]
    assert cli_main([*args, "-N", "64", *BIGGER_BATCH]) == 0
    out = capsys.readouterr().out
    assert ("weight sync: each node takes in ~96.3 GB from other nodes per sync (its trainers' gathers from their "
            "shard group's other nodes; the model is 27.5 GB in bfloat16)") in out
    assert "global batch: 16 completions per trainer x 448 trainers = 7168 completions (448 prompts x 16)" in out
    # Issue #27, item 5: the engine's KV cache against the sequences a step asks of it, and the fix.
    assert "room for ~63 of the node's 112 sequences at once (generation runs in waves; inference.gpus=2 would " \
           "hold them all)" in out
    assert cli_main([*args, "-N", "64", *BIGGER_BATCH, "inference.gpus=2"]) == 0
    assert "KV cache room for all 48 of the node's sequences at once" in capsys.readouterr().out    # 6 x 16 over 2
    assert cli_main([*args, "-N", "2"]) == 0
    out = capsys.readouterr().out
    assert "weight sync: no weight bytes cross nodes (each shard group is one node; the model is 27.5 GB" in out
    assert "= 112 completions (14 prompts x 8) per optimizer step" in out and "so it grows with -N" in out


def test_plan_needs_a_site(capsys):
    assert cli_main(["plan"]) == 2
    assert capsys.readouterr().err.strip() == "hpcrl: error: plan: --site is required (see `hpcrl sites`)"


# ------------------------------------------------------------------------- refusals
FRONTIER = ["--site", "frontier", "-A", "abc123"]


@pytest.mark.parametrize("command", ["render", "submit"])
def test_a_job_that_cannot_fit_is_refused_in_one_line(hpcrl, command):
    path = _model(hpcrl.work.parent, "q14", QWEN_14B)
    r = hpcrl(command, *FRONTIER, f"model.path={path}", "grpo.beta=0.04", "trainer.activation_checkpointing=true",
              *BATCH, *BIGGER_BATCH)
    assert r.returncode == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and r.stdout == "" and "Traceback" not in r.stderr
    line = lines[0]
    assert line.startswith("hpcrl: error: memory: the trainers need ~78.1 GB per GCD, frontier has 64 GB per GCD")
    assert "training state 31.4" in line and "fix: grpo.per_device_train_batch_size=8" in line and "-N 2" in line
    assert list(hpcrl.work.iterdir()) == [] and not (hpcrl.home / "registry.sqlite").exists()


def test_a_server_that_cannot_fit_is_refused_with_tensor_parallel(hpcrl):
    path = _model(hpcrl.work.parent, "l70", LLAMA_70B)
    r = hpcrl("render", "--site", "cuda", "-N", "64", f"model.path={path}", "trainer.activation_checkpointing=true",
              *BATCH)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "the server needs ~" in r.stderr
    assert "per GPU, cuda has 68 GB per GPU (gpu_memory_utilization 0.85 of 80 GB)" in r.stderr
    assert "fix: inference.gpus=4 inference.tensor_parallel_size=4 (1 engine(s) of 4 GPUs, tensor parallel" in r.stderr
    assert list(hpcrl.work.iterdir()) == []


def test_the_fix_it_names_is_accepted(hpcrl):
    path = _model(hpcrl.work.parent, "q14", QWEN_14B)
    r = hpcrl("render", *FRONTIER, "-N", "2", f"model.path={path}", "grpo.beta=0.04",
              "trainer.activation_checkpointing=true", *BATCH, *BIGGER_BATCH)
    assert r.returncode == 0, r.stderr
    assert [p.name for p in (hpcrl.work / "runs").iterdir()][0].startswith("hpcrl-demo-")


def test_unknown_sizes_never_refuse(hpcrl):
    # A model directory only the compute nodes see, and the demo on the local site.
    r = hpcrl("render", *FRONTIER, "model.path=/lustre/orion/abc123/models/Qwen2.5-72B", *BATCH)
    assert r.returncode == 0 and "run directory:" in r.stdout, r.stderr
    r = hpcrl("run", "--dry-run")
    assert r.returncode == 0 and "hpcrl.compute.launch" in r.stdout, r.stderr


def test_a_reward_model_counts_like_the_reference(tmp_path):
    """rewards[i].model is sharded and stored as the reference model: its parameters in the
    reference's dtype over the shard."""

    path, rm = _model(tmp_path, "q14", QWEN_14B), _model(tmp_path, "rm", QWEN_1_5B)
    base = _spec("frontier", 1, f"model.path={path}", *BATCH)
    with_rm = _spec("frontier", 1, f"model.path={path}", *BATCH, f"rewards=[{{model: {rm}}}]")
    base_fit, rm_fit = estimate(base, base.plan()), estimate(with_rm, with_rm.plan())
    assert base_fit.trainer.parts["reward_models"] == 0
    shard = rm_fit.mesh.shard
    assert rm_fit.trainer.parts["reward_models"] == math.ceil(count_parameters(rm) * 2 / shard) > 0


# ------------------------------------------------------------------------- LoRA (model.use_peft)
LORA = ["model.use_peft=true"]


def test_lora_adapters_count_r_times_in_plus_out(tmp_path):
    """r x (in_features + out_features) per adapted linear layer, from config.json's shape; the
    targets as peft matches them against model.layers.N.<self_attn|mlp>.<name>."""
    from hpcrl.job.lora import LoraTargets

    shape = ModelShape.from_config(QWEN_14B)
    h, q, kv, inter, layers = 5120, 40 * 128, 8 * 128, 13824, 48
    # None: peft's default for Qwen2/Llama, q_proj and v_proj.
    assert LoraTargets.of(shape, None, 16).params == layers * 16 * ((h + q) + (h + kv)) == 12_582_912
    every = (h + q) + 2 * (h + kv) + (q + h) + 2 * (h + inter) + (inter + h)
    assert LoraTargets.of(shape, "all-linear", 8).params == layers * 8 * every
    assert LoraTargets.of(shape, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                          8).params == layers * 8 * every
    assert LoraTargets.of(shape, ("mlp.down_proj", "o_proj"), 4).params == layers * 4 * ((inter + h) + (q + h))
    # One string is a regular expression over whole paths: here the first two layers' q_proj only.
    assert LoraTargets.of(shape, r"model\.layers\.[01]\.self_attn\.q_proj", 16).params == 2 * 16 * (h + q)
    assert LoraTargets.of(shape, "q_proj", 16).params == 0           # a regex, not a name: matches no whole path
    # A head_dim of its own (Qwen3-style: heads x head_dim != hidden).
    own = ModelShape.from_config(dict(QWEN_1_5B, head_dim=256))
    assert LoraTargets.of(own, ("q_proj",), 2).params == 28 * 2 * (1536 + 12 * 256)


def test_lora_on_expert_stacks_counts_every_experts_adapter_and_the_merged_stacks(tmp_path):
    """model.lora_target_parameters on Qwen3-30B-A3B's fused stacks: r x (in + out) per expert and
    stack in the training state, and each stack merged (experts x in x out, compute dtype) among
    the activations: one layer's and one gradient with checkpointing, every layer's without."""
    from hpcrl.job.lora import LoraTargets
    from hpcrl.job.memory import ModelStorage, TrainingStep, trainer_parts

    shape = model_shape(_model(tmp_path, "moe", QWEN3_30B_A3B))[0]
    h, i, e, layers = 2048, 768, 128, 48
    stacks = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    both = LoraTargets.of(shape, ("q_proj",), 8, parameters=stacks)
    assert both.stacks == ((e, h, 2 * i, 8, 1), (e, i, h, 8, 1))
    assert both.params == layers * 8 * ((h + 32 * 128) + e * (h + 2 * i) + e * (i + h))
    assert LoraTargets.of(shape, ("q_proj",), 8, parameters=("experts.down_proj",)).stacks == ((e, i, h, 8, 1),)
    # Llama's list, which peft converts for the fused experts: gate_up_proj at twice the rank.
    llama = LoraTargets.of(shape, ("q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"), 8)
    assert llama.stacks == ((e, h, 2 * i, 8, 2), (e, i, h, 8, 1)) and llama.layers[0] == {"q_proj", "v_proj"}
    assert llama.params == layers * 8 * ((h + 32 * 128) + (h + 4 * 128) + 2 * e * (h + 2 * i) + e * (i + h))
    # "all-linear" as peft converts it on this model: the attention's linear layers, both stacks
    # (gate_up_proj at twice the rank) and the router's weight (hidden x experts).
    every = LoraTargets.of(shape, "all-linear", 8)
    assert every.layers[0] == {"q_proj", "k_proj", "v_proj", "o_proj"} and every.stacks == llama.stacks
    assert every.router == (h, e)
    assert every.params == layers * 8 * ((h + 32 * 128) + 2 * (h + 4 * 128) + (32 * 128 + h)
                                         + 2 * e * (h + 2 * i) + e * (i + h) + (h + e))
    # The router's merged weight keeps the MLP's input, which frozen experts' attention-only adapters do not.
    attention = LoraTargets.of(shape, ("q_proj", "k_proj", "v_proj", "o_proj"), 8, parameters=stacks)
    assert every.layer_activation_bytes(0, 2) - attention.layer_activation_bytes(0, 2) == 2 * h
    # A regular expression reaches what it spells out: peft probes the experts' transformers-4 paths.
    assert LoraTargets.of(shape, r".*\.(q_proj|down_proj)", 8).stacks == ((e, i, h, 8, 1),)
    assert LoraTargets.of(shape, r".*\.(q_proj|down_proj)", 8).router == ()
    # A mixture of experts peft does not convert (not in its table): the list's expert names reach nothing.
    unconverted = shape._replace(model_type="qwen2_moe")
    assert LoraTargets.of(unconverted, ("q_proj", "gate_proj", "up_proj", "down_proj"), 8).stacks == ()
    assert LoraTargets.of(shape, ("q_proj",), 8, parameters=("router.weight",)).stacks == ()   # shape unknown: not counted
    assert both.stack_bytes(2) == 2 * e * (h * 2 * i + i * h)                     # 1.1 GiB a layer
    step = dict(micro_batch=1, seq_len=1024, completion_len=512, compute_dtype="bfloat16")
    plain = LoraTargets.of(shape, ("q_proj",), 8)
    # Each routed token's input to a stack is kept for the merged weight's gradient: 8 experts a token.
    assert both.layer_activation_bytes(0, 2) - plain.layer_activation_bytes(0, 2) == 2 * 8 * (h + i)
    tokens = 1024
    for checkpointing, kept, per_token in ((True, 2, 2 * 8 * (h + i)), (False, layers + 1, layers * 2 * 8 * (h + i))):
        grown = [trainer_parts(shape, TrainingStep(**step, checkpointing=checkpointing), ModelStorage(shard=8, lora=t))
                 for t in (plain, both)]
        assert grown[1]["activations"] - grown[0]["activations"] == kept * both.stack_bytes(2) + tokens * per_token
    # A dense model has no stacks to adapt.
    dense = ModelShape.from_config(QWEN_14B)
    assert LoraTargets.of(dense, None, 8, parameters=stacks).stacks == ()


def test_the_plan_says_what_the_adapters_reach(tmp_path):
    """`hpcrl plan`'s lora line: the linear layers, and on a mixture of experts what peft's conversion
    of the targets adapts as parameters (the stacks, gate_up_proj at twice the rank, the router)."""
    from hpcrl.job.job_memory import describe_lora
    from hpcrl.job.model_shape import ModelShape

    moe = _model(tmp_path, "moe", QWEN3_30B_A3B)
    shape = model_shape(moe)[0]
    line = describe_lora(_spec("frontier", 1, f"model.path={moe}", *LORA, "model.lora_target_modules=all-linear",
                               "model.lora_dropout=0", "model.lora_r=16"), shape)
    assert line == ("lora: r 16 on k_proj, o_proj, q_proj, v_proj in 48 of 48 layers; peft converts the targets for "
                    "this mixture of experts: adapted as parameters in every layer, the expert stacks (128 experts "
                    "each) down_proj and gate_up_proj (r 32) and the router (gate.weight); 996.5M adapter parameters")
    named = describe_lora(_spec("frontier", 1, f"model.path={moe}", *LORA, "model.lora_target_modules=[q_proj]",
                                "model.lora_target_parameters=[mlp.experts.down_proj]", "model.lora_dropout=0"), shape)
    assert named.startswith("lora: r 16 on q_proj in 48 of 48 layers; model.lora_target_parameters: "
                            "mlp.experts.down_proj; ")
    dense = _model(tmp_path, "q14", QWEN_14B)
    assert describe_lora(_spec("frontier", 1, f"model.path={dense}", *LORA), model_shape(dense)[0]) == (
        "lora: r 16 on q_proj, v_proj in 48 of 48 layers; 12.6M adapter parameters")
    assert describe_lora(_spec("frontier", 1, f"model.path={dense}"), ModelShape.from_config(QWEN_14B)) is None


def test_lora_trainer_parts_by_hand(tmp_path):
    """14B with LoRA on one Frontier node (7 trainers), beta 0.04, checkpointing: the frozen base
    in bf16 sharded, the adapters' 16 B/param sharded, no reference, no base gradients."""
    path = _model(tmp_path, "q14", QWEN_14B)
    fit = estimate(_spec("frontier", 1, f"model.path={path}", "grpo.beta=0.04", "trainer.activation_checkpointing=true",
                         *BATCH, *LORA))
    p, layer, h, v = 14_769_689_600, 275_261_440, 5120, 152064
    adapters_layer = 16 * ((h + 5120) + (h + 1024))                        # q_proj and v_proj, r 16
    root = 2 * v * h + h
    # Per token in a layer, against full fine-tuning's 223,392 B: the frozen linear layers keep no
    # inputs (both norms' outputs, o_proj's and down_proj's: 2 x (5120 + 5120 + 5120 + 13824)); each
    # adapter keeps its dropped input and mask (5120 x 3 B) and lora_A's output (16 x 2 B).
    per_layer = 223_392 - 2 * (5120 + 5120 + 5120 + 13824) + 2 * (5120 * 3 + 16 * 2)
    tokens = 8 * 2048
    expected = {
        "frozen_weights": math.ceil(p * 2 / 7),
        "training_state": math.ceil(48 * adapters_layer * 16 / 7),
        "reference": 0,
        "reward_models": 0,
        "gathered_layers": 2 * (layer + adapters_layer) * 2 + adapters_layer * 4 + root * 2,
        "activations": tokens * (48 * h * 2 + per_layer + 6 * h),
        "logits": 2 * 8 * 1025 * v * 2,
        "logprob_chunk": 4 * 1024 * v * 4,
        "overhead": 2 * GIB,
    }
    assert fit.trainer.parts == expected and fit.trainer.est_bytes == sum(expected.values())
    assert fit.trainer.facts["lora_params"] == 48 * adapters_layer
    assert "frozen weights 3.9, training state <0.1, gathered layers 3.9" in fit.trainer.verdict()
    # model.dtype is what the frozen base is stored in, as the reference model's.
    fp32 = estimate(_spec("frontier", 1, f"model.path={path}", "trainer.activation_checkpointing=true", *BATCH, *LORA,
                          "model.dtype=float32"))
    assert fp32.trainer.parts["frozen_weights"] == math.ceil(p * 4 / 7)


def test_8bit_adamw_moments_take_a_byte_each(tmp_path):
    """grpo.optim adamw_torch_8bit (torchao's): the two Adam moments 1 B a value each plus an fp32
    scale per block of 256, for 10.03 B of training state a parameter instead of 16. Qwen2.5-14B on
    64 Frontier nodes (the mesh above: shard groups of 2 nodes): 6.3 GB less per GCD; one node's 7
    trainers would need 66.4 GB per GCD instead of 78.1, still over what the mesh choice allows."""
    from hpcrl.job.memory import adam_moment_bytes

    assert adam_moment_bytes("adamw_torch_8bit") == 2 + 8 / 256 and adam_moment_bytes("adamw_torch_fused") == 8
    path = _model(tmp_path, "q14", QWEN_14B)
    args = [f"model.path={path}", "grpo.beta=0.04", "trainer.activation_checkpointing=true", *BATCH, *BIGGER_BATCH]
    fused, low = (estimate(_spec("frontier", 64, *args, f"grpo.optim={o}")) for o in ("adamw_torch_fused",
                                                                                   "adamw_torch_8bit"))
    p = count_parameters(path) or ModelShape.from_config(QWEN_14B).params
    assert low.mesh.nodes_per_shard == fused.mesh.nodes_per_shard == 2
    assert low.trainer.parts["training_state"] == math.ceil(p * (16 - 8 + 2 + 8 / 256) / 14)
    saved = fused.trainer.est_bytes - low.trainer.est_bytes
    assert saved == fused.trainer.parts["training_state"] - low.trainer.parts["training_state"]
    assert round(saved / 1e9, 1) == 6.3
    assert "~66.4 GB per GCD with the state sharded over one node's 7 trainers" in low.mesh.reason, low.mesh.reason
    # LoRA: the adapters' moments the same way.
    lora = [estimate(_spec("frontier", 1, f"model.path={path}", *BATCH, *LORA, f"grpo.optim={o}")).trainer.parts
            for o in ("adamw_torch_fused", "adamw_torch_8bit")]
    assert lora[1]["training_state"] == pytest.approx(lora[0]["training_state"] * (8 + 2 + 8 / 256) / 16, abs=1)


def test_dora_adds_a_magnitude_per_row_two_outputs_per_token_and_one_weight_sized_forward(tmp_path):
    """DoRA (model.use_dora) against plain LoRA, 14B on one Frontier node: each adapter's magnitude
    (out_features values, 16 B each, sharded), two kept outputs per adapter and token, and once the
    forward's temporaries of the largest adapted layer (q_proj: 5120 x 5120 in, 5120 out)."""
    path = _model(tmp_path, "q14", QWEN_14B)
    args = [f"model.path={path}", "trainer.activation_checkpointing=true", *BATCH, *LORA]
    lora = estimate(_spec("frontier", 1, *args)).trainer.parts
    dora = estimate(_spec("frontier", 1, *args, "model.use_dora=true")).trainer.parts
    h, tokens, magnitudes = 5120, 8 * 2048, 5120 + 1024                     # q_proj's and v_proj's rows
    assert dora["training_state"] - lora["training_state"] == pytest.approx(48 * magnitudes * 16 / 7, abs=1)
    assert dora["gathered_layers"] - lora["gathered_layers"] == 2 * magnitudes * 2 + magnitudes * 4
    assert dora["activations"] - lora["activations"] == tokens * 2 * 2 * magnitudes + 2 * (h * h + 3 * h * h)


def test_a_trained_copy_of_the_head_counts_as_training_state_and_in_the_gathered_root(tmp_path):
    """model.lora_modules_to_save [lm_head] against plain LoRA, 14B on one Frontier node: the copy's
    vocabulary x hidden parameters at 16 B each, sharded, and gathered with the root in bf16 with an
    fp32 gradient (the original head is frozen weights already)."""
    path = _model(tmp_path, "q14", QWEN_14B)
    args = [f"model.path={path}", "trainer.activation_checkpointing=true", *BATCH, *LORA]
    lora = estimate(_spec("frontier", 1, *args)).trainer.parts
    saved = estimate(_spec("frontier", 1, *args, "model.lora_modules_to_save=[lm_head]")).trainer.parts
    head = 152064 * 5120
    assert saved["training_state"] - lora["training_state"] == pytest.approx(head * 16 / 7, abs=1)
    assert saved["gathered_layers"] - lora["gathered_layers"] == head * (2 + 4)
    assert saved["frozen_weights"] == lora["frozen_weights"] and saved["activations"] == lora["activations"]


def test_lora_is_well_below_full_fine_tuning_and_has_no_reference_copy(tmp_path):
    path = _model(tmp_path, "q14", QWEN_14B)
    args = [f"model.path={path}", "trainer.activation_checkpointing=true", *BATCH]
    full = estimate(_spec("frontier", 1, *args, "grpo.beta=0.04")).trainer
    lora = estimate(_spec("frontier", 1, *args, "grpo.beta=0.04", *LORA)).trainer
    assert full.est_gb == 62.1 and lora.est_bytes < 0.5 * full.est_bytes
    # The state: 31.4 + 3.9 GiB of fp32 weights, gradients, moments and a reference -> 3.9 GiB of bf16 weights.
    assert lora.parts["frozen_weights"] + lora.parts["training_state"] < 0.13 * (
        full.parts["training_state"] + full.parts["reference"])
    # beta > 0 adds a reference copy to full fine-tuning, nothing to LoRA (the adapters switched off).
    no_kl = estimate(_spec("frontier", 1, *args, "grpo.beta=0", *LORA)).trainer
    assert lora.parts == no_kl.parts and lora.parts["reference"] == 0
    assert estimate(_spec("frontier", 1, *args, "grpo.beta=0")).trainer.est_bytes < full.est_bytes
    # all-linear adapts seven layers instead of two: more adapters, still far below.
    wide = estimate(_spec("frontier", 1, *args, *LORA, "model.lora_target_modules=all-linear")).trainer
    assert lora.parts["training_state"] < wide.parts["training_state"] and wide.est_bytes < 0.5 * full.est_bytes


def test_lora_fixes_never_offload_the_reference(tmp_path):
    """70B on one cuda node without checkpointing: LoRA has no reference to offload (the recipe
    refuses trainer.reference_offload with model.use_peft), so no fix names it."""
    path = _model(tmp_path, "l70", LLAMA_70B)
    args = [f"model.path={path}", "grpo.beta=0.04", *BATCH]
    assert any("reference_offload" in f for f in estimate(_spec("cuda", 1, *args)).trainer.fixes)
    lora = estimate(_spec("cuda", 1, *args, *LORA)).trainer
    assert lora.fits is False and lora.fixes and not any("reference_offload" in f for f in lora.fixes)
    assert lora.fixes[0].startswith("trainer.activation_checkpointing=true")
    # What the fix names fits: one node with the server on 4 GPUs, where full fine-tuning needs 9.
    fixed = estimate(_spec("cuda", 1, *args, *LORA, "inference.gpus=4", "inference.tensor_parallel_size=4", "trainer.activation_checkpointing=true"))
    assert fixed.fits is True


def test_plan_json_carries_the_lora_estimate(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _model(tmp_path, "q14", QWEN_14B)
    assert cli_main(["plan", "--site", "frontier", f"model.path={path}", "grpo.beta=0.04",
                     "trainer.activation_checkpointing=true", *BATCH, *LORA, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    rows = {t["role"]: t["est_memory_gb"] for t in shown["tasks"]}
    assert rows["trainer"] == shown["memory"]["trainer"]["est_memory_gb"] < 30 and rows["server"] == 31.0
    trainer = shown["memory"]["trainer"]
    assert trainer["parts_gb"]["frozen_weights"] == 3.9 and trainer["parts_gb"]["reference"] == 0
    assert trainer["lora_params"] == 12_582_912 and shown["fits"] is True
    # The text form says what the adapters reach.
    assert cli_main(["plan", "--site", "frontier", f"model.path={path}", "grpo.beta=0.04",
                     "trainer.activation_checkpointing=true", *BATCH, *LORA]) == 0
    assert "\nlora: r 16 on q_proj, v_proj in 48 of 48 layers; 12.6M adapter parameters\n" in capsys.readouterr().out
