"""model.lora_target_modules checked on the login node (hpcrl.login.lora_inputs, which
hpcrl.login.inputs calls for a recipe with LoRA), without torch: every name must match a module of
the model as peft matches it (a path that is the name or ends with "." + name; one string other
than "all-linear" is a regular expression over whole paths). The module paths come from the
weights' names (a weight index, else the safetensors headers), or for "demo:<size>" from the Qwen2
layout the job builds. A mistake is one line naming the field, the names that match nothing and
the model's linear layers, exit 2, nothing written."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from hpcrl.job.errors import UserError
from hpcrl.job.recipe import ModelConfig
from hpcrl.login import lora_inputs

LINEARS = "down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from hpcrl.compute.models.tiny import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", size="tiny", seed=0))


def _check(path: str, targets, use_peft: bool = True) -> None:
    model = ModelConfig(path=path, use_peft=use_peft, lora_target_modules=targets)
    modules = (lora_inputs.demo_module_paths(path) if path.startswith("demo:")
               else lora_inputs.checkpoint_module_paths(Path(path)))
    lora_inputs.check_targets(model, modules)


@pytest.mark.parametrize("path", ["demo:tiny", "demo:small:random", "local"])
def test_targets_are_checked_against_the_models_modules(path, tiny_model):
    path = tiny_model if path == "local" else path
    for good in [None, "all-linear", ("q_proj", "v_proj"), ("self_attn.q_proj",), ("layers.0.mlp.up_proj",),
                 ("lm_head",), r"model\.layers\.\d+\.self_attn\.(q|v)_proj", r".*_proj"]:
        _check(path, good)
    with pytest.raises(UserError) as e:
        _check(path, ("q_proj", "v_prj"))
    assert str(e.value) == (f"model.lora_target_modules: 'v_prj' matches no module of {path} "
                            f'(did you mean "v_proj"?); its linear layers: {LINEARS}')
    with pytest.raises(UserError) as e:
        _check(path, ("qproj", "vproj"))
    assert str(e.value).startswith("model.lora_target_modules: 'qproj', 'vproj' match no module of")
    with pytest.raises(UserError) as e:
        _check(path, r"model\.layers\.\d+\.attn\.q_proj")
    assert str(e.value) == (r'model.lora_target_modules: the regular expression "model\.layers\.\d+\.attn\.q_proj" '
                            f"matches no module path of {path} (it must match a whole path, e.g. "
                            f'"model.layers.0.mlp.down_proj"); its linear layers: {LINEARS}')
    # A regular expression must match a whole path: "q_proj" alone names no module path.
    with pytest.raises(UserError):
        _check(path, "q_proj")
    # Without use_peft the LoRA fields change nothing, and are not checked.
    _check(path, ("v_prj",), use_peft=False)


def test_the_check_agrees_with_peft(tiny_model):
    """What peft (the job's) accepts on the model built by hpcrl.compute.models.tiny is accepted
    here, and what it finds nothing for is refused here."""
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import AutoModelForCausalLM

    for targets in [("q_proj",), ("qproj",), ("self_attn.q_proj",), ("attn.q_proj",), ("layers.3.mlp.down_proj",),
                    ("layers.4.mlp.down_proj",), ("lm_head",), r"model\.layers\.[0-3]\.mlp\.up_proj",
                    r"layers\.0\.mlp\.up_proj"]:
        try:
            inject_adapter_in_model(LoraConfig(r=2, target_modules=targets),
                                    AutoModelForCausalLM.from_pretrained(tiny_model))
            peft_ok = True
        except ValueError as e:
            assert "not found in the base model" in str(e), e
            peft_ok = False
        try:
            _check(tiny_model, targets)
            ours = True
        except UserError:
            ours = False
        assert ours == peft_ok, (targets, peft_ok)


def test_the_demo_layouts_are_the_tiny_models(tiny_model):
    """demo:<size> is built in the job: its layers as hpcrl.compute.models.tiny.SIZES, its module
    paths those of the model directory tiny builds."""
    from hpcrl.compute.models.tiny import SIZES

    assert lora_inputs.DEMO_LAYERS == {name: spec.num_hidden_layers for name, spec in SIZES.items()}
    demo, local = lora_inputs.demo_module_paths("demo:tiny"), lora_inputs.checkpoint_module_paths(Path(tiny_model))
    assert demo.linear == local.linear and local.paths <= demo.paths
    assert lora_inputs.demo_module_paths("demo:enormous") is None          # the job names the unknown size
    # The names the job builds the same model from ("demo:" alone is demo:tiny, as hpcrl.job.demo parses it).
    for alias in ("demo:", "demo::random", "demo:tiny:random"):
        assert lora_inputs.demo_module_paths(alias).linear == demo.linear, alias


def _safetensors(path, tensors: dict[str, list[int]]) -> None:
    header = json.dumps({"__metadata__": {"format": "pt"},
                         **{k: {"dtype": "BF16", "shape": s, "data_offsets": [0, 0]} for k, s in tensors.items()}})
    path.write_bytes(struct.pack("<Q", len(header)) + header.encode())


def test_module_paths_from_an_index_or_headers(tmp_path):
    # Sharded: the index names the weights; the shards' headers (when here) give their shapes.
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text('{"tie_word_embeddings": false}')
    weight_map = {"model.embed_tokens.weight": "a.safetensors", "model.layers.0.attn.c_attn.weight": "a.safetensors",
                  "model.layers.0.attn.c_attn.bias": "a.safetensors", "model.layers.0.ln_1.weight": "b.safetensors",
                  "model.layers.0.mlp.c_fc.weight": "b.safetensors", "lm_head.weight": "b.safetensors"}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    _safetensors(sharded / "a.safetensors", {"model.embed_tokens.weight": [10, 4],
                                             "model.layers.0.attn.c_attn.weight": [12, 4],
                                             "model.layers.0.attn.c_attn.bias": [12]})
    paths = lora_inputs.checkpoint_module_paths(sharded)     # b.safetensors is absent: names only for its weights
    assert paths.linear_names() == ["c_attn", "c_fc", "lm_head"]
    assert {"model", "model.layers.0", "model.layers.0.attn", "model.layers.0.ln_1"} <= paths.paths
    # No index: every *.safetensors header; a 1-D weight is no linear layer; a tied head is a module.
    single = tmp_path / "single"
    single.mkdir()
    (single / "config.json").write_text("{}")
    _safetensors(single / "model.safetensors", {"model.layers.0.self_attn.q_proj.weight": [8, 8],
                                                "model.layers.0.scale.weight": [8]})
    assert lora_inputs.checkpoint_module_paths(single).linear_names() == ["lm_head", "q_proj"]
    # Nothing readable (a .bin checkpoint without an index, an empty file): nothing to check against.
    unreadable = tmp_path / "bin"
    unreadable.mkdir()
    (unreadable / "pytorch_model.bin").write_bytes(b"\0" * 16)
    (unreadable / "model.safetensors").write_bytes(b"")
    assert lora_inputs.checkpoint_module_paths(unreadable) is None
    _check(str(unreadable), ("anything",))


def test_hpcrl_refuses_a_target_the_local_model_lacks(hpcrl, tiny_model):
    r = hpcrl("run", "--dry-run", f"model.path={tiny_model}", "model.use_peft=true",
              "model.lora_target_modules=[q_proj,gate_prj]")
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.strip() == (f"hpcrl: error: model.lora_target_modules: 'gate_prj' matches no module of "
                                f'{tiny_model} (did you mean "gate_proj"?); its linear layers: {LINEARS}')
    assert list(hpcrl.work.iterdir()) == []
    r = hpcrl("run", "--dry-run", f"model.path={tiny_model}", "model.use_peft=true",
              "model.lora_target_modules=[q_proj,gate_proj]")
    assert r.returncode == 0, r.stderr
    r = hpcrl("render", "--site", "testbed", "model.use_peft=true", r"model.lora_target_modules=.*\.(q|v)_proj")
    assert r.returncode == 0, r.stderr


def test_dropout_on_what_peft_converts_to_parameters_is_refused_before_the_queue(hpcrl, tiny_model, tmp_path):
    """TRL's default lora_dropout (0.05) with targets peft converts to parameters of a mixture of
    experts ("all-linear", or Llama's list, on Qwen3-MoE: its fused expert stacks and router, which
    take no dropout): one line on the login node, exit 2, nothing written; the job said it seconds
    into the run before. Dropout 0 passes, and so does a list of the attention's names."""
    import shutil

    from hpcrl.job.lora import converted_dropout_error

    moe = tmp_path / "qmoe"
    moe.mkdir()
    (moe / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
        "num_hidden_layers": 1, "vocab_size": 384, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_experts": 4, "num_experts_per_tok": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 32, "tie_word_embeddings": False, "torch_dtype": "float32"}))
    # The checkpoint's layout: one module per expert (transformers 5 fuses them when it loads).
    layer = "model.layers.0"
    _safetensors(moe / "model.safetensors", {
        "model.embed_tokens.weight": [384, 64], "lm_head.weight": [384, 64], f"{layer}.mlp.gate.weight": [4, 64],
        **{f"{layer}.self_attn.{n}.weight": [64, 64] for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
        **{f"{layer}.mlp.experts.{e}.{n}.weight": [32, 64] for e in range(4) for n in ("gate_proj", "up_proj")},
        **{f"{layer}.mlp.experts.{e}.down_proj.weight": [64, 32] for e in range(4)}})
    for f in Path(tiny_model).glob("*tok*"):
        shutil.copy(f, moe / f.name)
    for targets, converted in (("all-linear", ["down_proj", "gate.weight", "gate_up_proj"]),
                               ("[q_proj,gate_proj,up_proj,down_proj]", ["down_proj", "gate_up_proj"])):
        r = hpcrl("run", "--dry-run", f"model.path={moe}", "model.use_peft=true", f"model.lora_target_modules={targets}")
        assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
        assert r.stderr.strip() == "hpcrl: error: " + converted_dropout_error(0.05, converted)
        assert list(hpcrl.work.iterdir()) == []
    for allowed in (["model.lora_target_modules=all-linear", "model.lora_dropout=0"],
                    ["model.lora_target_modules=[q_proj,v_proj]"]):
        r = hpcrl("run", "--dry-run", f"model.path={moe}", "model.use_peft=true", *allowed)
        assert r.returncode == 0, r.stderr
