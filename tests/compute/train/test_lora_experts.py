"""LoRA on a mixture-of-experts model's expert stacks, on one and two FSDP2 ranks (gloo), real peft
layers: named in model.lora_target_parameters (TRL's lora_target_parameters, peft's
target_parameters), or reached by Llama's target list (gate_proj, up_proj, down_proj) or
"all-linear" (the router's weight too), which peft converts for transformers 5's fused experts
(gate_up_proj at twice the rank and alpha). The login node's prediction of that conversion
(hpcrl.job.lora) is held to peft's own.

transformers 5 holds a MoE layer's experts as 3-D parameters (``mlp.experts.gate_up_proj`` [E, 2I,
H], ``mlp.experts.down_proj`` [E, H, I]), which no module name reaches: peft adapts them through
ParamWrapper, two of them nested on one experts module. Checks: the adapters on both stacks train
under FSDP2; what the sync sends for each stack is the stack merged expert by expert, equal to
peft's own merge_and_unload of the written adapter directory (before, the sync took every LoRA
layer for a linear one: "'ParamWrapper' object has no attribute 'weight'"); peft loads that
directory (its config keeps peft's conversion) and gives the trainers' logits; the merged model on
disk has save_pretrained's per-expert names, differs from the base in the experts and q_proj only,
and gives the trainers' logits; a name that matches nothing, and TRL's default dropout on stacks,
are one line each; and `hpcrl run` of a TRL configuration with lora_target_parameters, synced into
vLLM every step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dist_harness import spawn
from test_moe import make_moe_dir

PARAMETERS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


# Llama's list, as many a TRL configuration gives it: on transformers 5's fused experts peft converts
# gate_proj + up_proj to the gate_up_proj stack (at twice the rank and alpha) and down_proj to down_proj.
LLAMA_LIST = ("q_proj", "gate_proj", "up_proj", "down_proj")


def experts_recipe_model(parameters=PARAMETERS, modules=("q_proj",)):
    from hpcrl.job.recipe import ModelConfig

    return ModelConfig(use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=modules,
                       lora_target_parameters=parameters)


def _w_experts(rank, world, model_dir, out_dir, names):
    import json

    import torch
    from safetensors.torch import load_file
    from test_lora import assert_peft_loads_what_was_sent, save_lora_model
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    from hpcrl.compute.sync.gather import iter_full_tensors, sync_named_params
    from hpcrl.compute.train.fsdp import load_policy_and_reference
    from hpcrl.compute.train.lora import parameter_wrappers
    from hpcrl.job.recipe import GRPOConfig, Recipe

    torch.manual_seed(0)
    recipe_model = {"parameters": experts_recipe_model(), "llama-list": experts_recipe_model(None, LLAMA_LIST),
                    "all-linear": experts_recipe_model(None, "all-linear")}[names]
    router = names == "all-linear"      # peft's conversion of all-linear adapts the router's weight too
    recipe = Recipe(model=recipe_model, grpo=GRPOConfig(beta=0.0, gradient_checkpointing=False))
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    policy, _ = load_policy_and_reference(model_dir, mesh, torch.device("cpu"), recipe)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    layers = base.config.num_hidden_layers
    wrappers = parameter_wrappers(policy)
    assert sorted(w.parameter_name for w in wrappers.values()) == sorted(
        ["gate_up_proj", "down_proj"] * layers + ["weight"] * layers * router)

    opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=5e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, base.config.vocab_size, (2, 12), generator=g)
        policy(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    for path, w in wrappers.items():        # B started at 0: each stack's adapter trained
        assert w.lora_B["default"].weight.full_tensor().abs().max() > 1e-3, path
    ids = torch.randint(0, base.config.vocab_size, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        policy.eval()
        trained = policy(input_ids=ids).logits

    entries = sync_named_params(policy)
    assert [n for n, _ in entries] == [n for n, _ in sync_named_params(base)]
    sent = dict(iter_full_tensors(entries))
    out = save_lora_model(policy, model_dir, out_dir, recipe.model, rank)
    if rank != 0:
        return
    config = json.loads((out / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == (["k_proj", "o_proj", "q_proj", "v_proj"] if router else ["q_proj"]), config
    if names == "parameters":
        assert config["target_parameters"] == sorted(PARAMETERS), config
    else:       # peft's conversion, kept: the fused stack's adapter has twice the rank
        assert sorted(config["target_parameters"]) == ["down_proj", *["gate.weight"] * router, "gate_up_proj"], config
        assert list(config["rank_pattern"].values()) == [8] and list(config["alpha_pattern"].values()) == [16]
    assert_peft_loads_what_was_sent(model_dir, out, ids, trained, sent, atol=1e-6)
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        assert (sent[name] - base.state_dict()[name]).abs().max() > 1e-3, f"{name}: the base stack was sent"
    written = load_file(out / "merged" / "model.safetensors")
    source = load_file(Path(model_dir) / "model.safetensors")
    assert written.keys() == source.keys()
    changed = {n for n in source if not torch.equal(written[n], source[n])}
    adapted = ("q_proj.weight", *(("k_proj.weight", "v_proj.weight", "o_proj.weight", "mlp.gate.weight") * router))
    assert changed and all(".experts." in n or n.endswith(adapted) for n in changed), sorted(changed)
    assert sum(".experts." in n for n in changed) == layers * 4 * 3       # every expert's three projections
    # Merged once: on one trainer a gathered stack is the parameter itself, which a merge into it
    # changed for good (the engines then drifted from the trainer by 0.2 in log-prob per step).
    merged_model = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.allclose(merged_model(input_ids=ids).logits, trained, atol=1e-4), "merged twice"


@pytest.mark.parametrize("world,names", [(1, "parameters"), (2, "parameters"), (2, "llama-list"), (1, "all-linear")])
def test_adapters_on_expert_stacks_train_and_send_peft_merge(tmp_path, world, names):
    """names: the stacks named in model.lora_target_parameters, or reached by Llama's target list,
    or by "all-linear" (with the router's weight)."""
    model_dir = make_moe_dir(tmp_path / "qwen3-moe", "qwen3_moe", square=False)
    spawn(_w_experts, tmp_path, str(model_dir), str(tmp_path), names, world=world, timeout=240)


def test_a_parameter_name_that_matches_nothing_is_named_with_the_stacks(tmp_path):
    import dataclasses

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hpcrl.compute.train.lora import add_adapters
    from hpcrl.job.errors import UserError

    model_dir = make_moe_dir(tmp_path / "qwen3-moe", "qwen3_moe", square=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    want = ("model.lora_target_parameters: 'mlp.experts.gate_proj' matches no parameter of this model (a name "
            "matches a parameter path that is it or ends with it); its stacked parameters: "
            "model.layers.N.mlp.experts.down_proj, model.layers.N.mlp.experts.gate_up_proj")
    with pytest.raises(UserError) as e:
        add_adapters(model, experts_recipe_model(("mlp.experts.gate_up_proj", "mlp.experts.gate_proj")))
    assert str(e.value) == want, str(e.value)
    # With no module targets (TRL's default, None: peft then adapts the parameters only) peft itself
    # refuses first, in words about target_modules; the line is still about the parameters.
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    only = experts_recipe_model(("mlp.experts.gate_proj",))
    with pytest.raises(UserError) as e:
        add_adapters(model, dataclasses.replace(only, lora_target_modules=None))
    assert str(e.value) == want, str(e.value)


@pytest.mark.slow
@pytest.mark.vllm
def test_hpcrl_run_of_a_trl_yaml_with_adapters_on_the_experts(tmp_path):
    """`hpcrl run` of a TRL YAML (use_peft, lora_target_parameters) on a tiny Qwen3-MoE with the vLLM
    engine, 3 steps: the engine serves the trainers' merged weights after every sync (sampled
    tokens' log-probs equal the trainers' recomputation); the run's adapter directory and `hpcrl
    export`'s (from the last training checkpoint) hold the same adapters on both stacks, and the
    merged model differs from the base in its experts."""
    import json
    import subprocess
    import sys

    import torch
    from conftest import run_to_the_end
    from safetensors.torch import load_file
    from test_moe import SYNCED_LOGP_DIFF, write_moe_project

    make_moe_dir(tmp_path / "qmoe", "qwen3_moe", square=False)
    write_moe_project(tmp_path, """learning_rate: 0.05
use_peft: true
lora_r: 4
lora_dropout: 0.0
lora_target_modules: [q_proj]
lora_target_parameters: [mlp.experts.gate_up_proj, mlp.experts.down_proj]
""")
    proc = run_to_the_end([sys.executable, "-m", "hpcrl", "run", "cfg.yaml", "checkpoint.save_merged_model=true",
                           "--run-dir", "run"], tmp_path, 600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    gaps = [m["sampling/sampling_logp_difference/max"] for m in metrics]
    assert max(gaps) < SYNCED_LOGP_DIFF, gaps

    ex = subprocess.run([sys.executable, "-m", "hpcrl", "export", "run", "-o", "exported"], cwd=tmp_path,
                        capture_output=True, text=True, timeout=300)
    assert ex.returncode == 0, ex.stderr[-2000:]
    model = tmp_path / "run" / "model"
    adapters = load_file(model / "adapter_model.safetensors")
    assert adapters.keys() == load_file(tmp_path / "exported" / "adapter_model.safetensors").keys()
    assert any(".mlp.experts.base_layer.lora_B." in k for k in adapters) and any(
        ".mlp.experts.lora_B." in k for k in adapters), sorted(adapters)
    for out in (model, tmp_path / "exported"):
        config = json.loads((out / "adapter_config.json").read_text())
        assert config["target_parameters"] == ["mlp.experts.down_proj", "mlp.experts.gate_up_proj"], config
        assert config["target_modules"] == ["q_proj"], config
    merged = load_file(model / "merged" / "model.safetensors")
    source = load_file(tmp_path / "qmoe" / "model.safetensors")
    assert any(not torch.equal(merged[n], source[n]) for n in source if ".experts." in n)


def test_module_names_peft_neither_matches_nor_converts_are_named(tmp_path):
    """A name of a lora_target_modules list that matches no module (peft is silent about it while
    another matches) is one line, naming the stacks; so is TRL's default dropout where Llama's list
    reaches fused expert stacks (peft adapts them as parameters, which take none)."""
    import dataclasses

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hpcrl.compute.train.lora import add_adapters
    from hpcrl.job.errors import UserError

    model_dir = make_moe_dir(tmp_path / "qwen3-moe", "qwen3_moe", square=False)

    def refusal(recipe_model) -> str:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
        with pytest.raises(UserError) as e:
            add_adapters(model, recipe_model)
        return str(e.value)

    assert refusal(experts_recipe_model(None, ("q_proj", "gate_proj", "up_proj", "w9"))) == (
        "model.lora_target_modules: 'w9' matches no module of this model; its experts are stacked parameters "
        "(model.layers.N.mlp.experts.down_proj, model.layers.N.mlp.experts.gate_up_proj), which "
        "model.lora_target_parameters adapts; its linear layers: k_proj, lm_head, o_proj, q_proj, v_proj")
    assert refusal(dataclasses.replace(experts_recipe_model(None, LLAMA_LIST), lora_dropout=0.05)) == (
        "model.lora_dropout: 0.05: model.lora_target_modules reaches parameters of this mixture-of-experts model "
        "(down_proj, gate_up_proj: its fused expert stacks or router), which peft adapts without dropout; set it to 0")
    assert refusal(dataclasses.replace(experts_recipe_model(None, "all-linear"), lora_dropout=0.05)) == (
        "model.lora_dropout: 0.05: model.lora_target_modules reaches parameters of this mixture-of-experts model "
        "(down_proj, gate.weight, gate_up_proj: its fused expert stacks or router), which peft adapts without "
        "dropout; set it to 0")


def test_the_plans_view_of_peft_conversion_is_peft_own(tmp_path):
    """The login node predicts, without peft, what peft's conversion of model.lora_target_modules
    adapts on a mixture of experts (hpcrl.job.lora: the plan counts it, and the login refuses
    dropout on it before the queue): its model types are the installed tables', and for each form of
    target (a list, "all-linear", expressions, the router's name) the parameters it predicts are
    those of the config peft converted."""
    import json

    import torch
    from peft.utils import transformers_weight_conversion as conversion
    from transformers import AutoConfig, AutoModelForCausalLM

    from hpcrl.compute.train.lora import add_adapters, injected_config
    from hpcrl.job.lora import PEFT_MOE_EXPERT_NAMES, PEFT_MOE_FAMILIES, converted_parameter_names
    from hpcrl.job.model_shape import ModelShape

    families = {t: f for t, f in conversion._MODEL_TO_CONVERSION_PATTERN.items()
                if f in conversion._MOE_TARGET_MODULE_MAPPING and f in conversion._MOE_FUSED_TARGETS}
    assert PEFT_MOE_FAMILIES == families
    for family, (gate, up, down) in PEFT_MOE_EXPERT_NAMES.items():
        mapping = conversion._MOE_TARGET_MODULE_MAPPING[family]
        assert (mapping[gate], mapping[up], mapping[down]) == ("gate_up_proj", "gate_up_proj", "down_proj"), family

    for arch, names in (("qwen3_moe", ("gate_proj", "up_proj", "down_proj")), ("mixtral", ("w1", "w3", "w2"))):
        model_dir = make_moe_dir(tmp_path / arch, arch, square=False)
        shape = ModelShape.from_config(json.loads((model_dir / "config.json").read_text()))
        for targets in [("q_proj", *names), ("q_proj", names[2]), "all-linear", r".*\.(q_proj|" + names[2] + ")",
                        r".*(proj|w\d)", ("q_proj", "gate"), ("q_proj", "v_proj")]:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
            add_adapters(model, experts_recipe_model(None, targets))
            converted = sorted(injected_config(model).target_parameters or ())
            assert converted_parameter_names(shape, targets) == converted, (arch, targets)
