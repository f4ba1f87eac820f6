"""A `trl grpo --config` YAML as a recipe: TRL's keys land on the fields of the same meaning, TRL's
defaults apply where it says nothing, and every key hpcrl does not implement is named at once."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO as ROOT

from hpcrl.job.errors import UserError
from hpcrl.job.grpo_config import DEMO_GRPO
from hpcrl.job.recipe import GRPOConfig
from hpcrl.login import compose, trl_config


# What `trl grpo --config` users write (TRL's own docs and recipes mix these kinds of keys).
TRL_YAML = """\
model_name_or_path: {model}
dataset_name: {data}
reward_funcs: [my_rewards.correct, think_format_reward]
reward_weights: [1.0, 0.5]
learning_rate: 1.0e-5
per_device_train_batch_size: 8
num_generations: 4
max_completion_length: 64
warmup_steps: 0.1
bf16: false
seed: 7
logging_steps: 1
use_vllm: true
vllm_mode: colocate
report_to: tensorboard
save_strategy: steps
save_steps: 20
output_dir: out/grpo
eval_strategy: "no"
per_device_eval_batch_size: 4
use_peft: false
lora_r: 8
optim: adamw_torch
inference:
  engine: transformers
"""


@pytest.fixture
def trl_yaml(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "model").mkdir()
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    path = tmp_path / "cfg.yaml"
    path.write_text(TRL_YAML.format(model="model", data="train.jsonl"))
    return path


def test_trl_fields_match_the_installed_trl():
    """trl_fields.json is the login side's copy of TRL's names and defaults; regenerate it with
    scripts/trl_fields.py when TRL changes."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import trl_fields
        installed = trl_fields.trl_fields()
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    stored = json.loads((ROOT / "hpcrl" / "login" / "trl_fields.json").read_text())
    assert stored == json.loads(json.dumps(installed)), "run .venv/bin/python scripts/trl_fields.py"


def test_every_hpcrl_grpo_field_is_a_trl_name_with_trls_default():
    fields = trl_config.trl_fields()
    for name, value in vars(GRPOConfig()).items():
        assert name in fields, f"grpo.{name} is not a TRL GRPOConfig name"
        default = fields[name]
        assert value == default or (isinstance(value, float) and math.isclose(value, float(default))), \
            f"grpo.{name}: hpcrl's default {value!r}, TRL's {default!r}"


def test_a_trl_config_translates(trl_yaml, tmp_path):
    resolved = compose.build_recipe(str(trl_yaml), ["beta=0.04", "grpo.top_k=5"])
    r, t = resolved.recipe, resolved.trl
    assert r.model.path == str(tmp_path / "model")               # relative to where hpcrl ran, as TRL
    assert r.data.path == str(tmp_path / "train.jsonl")
    assert [(x.func, x.weight) for x in r.rewards] == [("my_rewards.correct", 1.0), ("think_format_reward", 0.5)]
    g = r.grpo
    assert (g.learning_rate, g.num_generations, g.max_completion_length, g.seed, g.beta, g.top_k) == \
        (1e-5, 4, 64, 7, 0.04, 5)
    assert g.warmup_steps == 0.1 and g.save_steps == 20 and g.bf16 is False
    # Where the configuration says nothing, TRL's defaults, not the demo's.
    assert (g.max_steps, g.num_train_epochs, g.lr_scheduler_type, g.gradient_checkpointing) == (-1, 3.0, "linear", True)
    assert g.vllm_importance_sampling_correction is True
    assert r.logging.tensorboard is True and r.inference.engine == "transformers"
    assert r.checkpoint.output_dir == str(tmp_path / "out" / "grpo")
    assert t.moved["output_dir"] == "checkpoint.output_dir" and t.moved["beta"] == "grpo.beta"
    assert set(t.inert) >= {"logging_steps", "use_vllm", "vllm_mode", "lora_r"}
    assert t.moved["save_strategy"] == "grpo.save_strategy"
    assert t.moved["use_peft"] == "model.use_peft" and r.model.use_peft is False      # lora_r: 8 changes nothing
    assert t.moved["optim"] == "grpo.optim" and g.optim == "adamw_torch"
    assert t.moved["eval_strategy"] == "grpo.eval_strategy" and r.grpo.per_device_eval_batch_size == 4


def test_every_unimplemented_key_is_named_in_one_error(trl_yaml):
    trl_yaml.write_text(trl_yaml.read_text() + "load_in_4bit: true\nfp16: true\n"
                        "push_to_hub: true\nlearnin_rate: 3\ngrpo:\n  betta: 1\n")
    with pytest.raises(UserError) as e:
        compose.build_recipe(str(trl_yaml))
    lines = str(e.value).splitlines()
    assert lines[0] == "5 fields are not accepted (nothing was written):"
    text = "\n".join(lines)
    for name in ("load_in_4bit: quantized training is not supported", "fp16: fp16 training is not supported",
                 "push_to_hub: compute nodes have no internet",
                 'learnin_rate: unknown field (did you mean "learning_rate"?)',
                 'grpo.betta: unknown field (did you mean "beta"?)'):
        assert name in text, text
    # No hint to a field of another meaning (save_steps used to suggest max_steps).
    assert "did you mean" not in text.split("fp16:")[1].splitlines()[0]


LORA_YAML = """\
model_name_or_path: demo:tiny
dataset_name: train.jsonl
use_peft: true
lora_r: 8
lora_alpha: 16
lora_dropout: 0.0
lora_target_modules: [q_proj, v_proj]
use_rslora: true
lora_task_type: CAUSAL_LM
use_dora: false
"""


def test_trls_lora_keys_land_on_the_model_section(trl_yaml):
    trl_yaml.write_text(LORA_YAML)
    resolved = compose.build_recipe(str(trl_yaml))
    m, t = resolved.recipe.model, resolved.trl
    assert (m.use_peft, m.lora_r, m.lora_alpha, m.lora_dropout, m.use_rslora, m.lora_task_type) == \
        (True, 8, 16, 0.0, True, "CAUSAL_LM")
    assert m.lora_target_modules == ("q_proj", "v_proj")          # YAML's list, as the recipe holds it
    for key in ("use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "use_rslora",
                "lora_task_type", "use_dora"):
        assert t.moved[key] == f"model.{key}"
    assert m.use_dora is False
    trl_yaml.write_text(LORA_YAML.replace("use_dora: false", "use_dora: true"))
    assert compose.build_recipe(str(trl_yaml)).recipe.model.use_dora is True
    # One string stays one: "all-linear", or a regular expression over module paths.
    trl_yaml.write_text(LORA_YAML.replace("[q_proj, v_proj]", "all-linear"))
    assert compose.build_recipe(str(trl_yaml)).recipe.model.lora_target_modules == "all-linear"
    # key=value overrides over a configuration that switches LoRA on are not dropped (use_peft is
    # the configuration's, not the overrides').
    over = compose.build_recipe(str(trl_yaml), ["lora_r=4", "lora_target_modules=[q_proj]"]).recipe.model
    assert over.lora_r == 4 and over.lora_target_modules == ("q_proj",)
    # hpcrl's own model section may switch LoRA on beside TRL's flat keys.
    trl_yaml.write_text(LORA_YAML.replace("use_peft: true\n", "model: {use_peft: true}\n"))
    assert compose.build_recipe(str(trl_yaml)).recipe.model.lora_r == 8


def test_lora_keys_are_inert_without_use_peft(trl_yaml):
    trl_yaml.write_text(LORA_YAML.replace("use_peft: true", "use_peft: false").replace("use_dora: false", "use_dora: true")
                        + "lora_modules_to_save: [lm_head]\n")
    resolved = compose.build_recipe(str(trl_yaml))
    m, t = resolved.recipe.model, resolved.trl
    assert m.use_peft is False and m.lora_r == 16 and m.lora_target_modules is None
    for key in ("lora_r", "lora_target_modules", "lora_modules_to_save", "use_dora"):
        assert t.inert[key] == "TRL uses it only with use_peft", key
    # use_peft left out is TRL's default, false, too.
    trl_yaml.write_text(LORA_YAML.replace("use_peft: true\n", ""))
    assert compose.build_recipe(str(trl_yaml)).trl.inert["lora_r"] == "TRL uses it only with use_peft"


def test_lora_target_parameters_and_modules_to_save_are_taken(trl_yaml):
    trl_yaml.write_text(LORA_YAML + "lora_target_parameters: [mlp.experts.gate_up_proj, mlp.experts.down_proj]\n")
    resolved = compose.build_recipe(str(trl_yaml))
    assert resolved.recipe.model.lora_target_parameters == ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    assert resolved.trl.moved["lora_target_parameters"] == "model.lora_target_parameters"
    # peft takes adapters on parameters without dropout or DoRA: TRL's default dropout (0.05) is named.
    for change, field in (("lora_dropout: 0.0\n", "model.lora_dropout: 0.05: peft's adapters on parameters "
                                                   "(model.lora_target_parameters) take no dropout"),
                          ("use_dora: false", "use_dora (model.use_dora): peft's adapters on parameters")):
        trl_yaml.write_text(LORA_YAML.replace(change, "use_dora: true" if "dora" in change else "")
                            + "lora_target_parameters: [mlp.experts.gate_up_proj]\n")
        with pytest.raises(UserError) as e:
            compose.build_recipe(str(trl_yaml))
        assert str(e.value).startswith(field) and "\n" not in str(e.value), str(e.value)
    # lora_modules_to_save is taken: model.lora_modules_to_save.
    trl_yaml.write_text(LORA_YAML + "lora_modules_to_save: [lm_head, embed_tokens]\n")
    resolved = compose.build_recipe(str(trl_yaml))
    assert resolved.recipe.model.lora_modules_to_save == ("lm_head", "embed_tokens")
    assert resolved.trl.moved["lora_modules_to_save"] == "model.lora_modules_to_save"
    assert "use_peft" not in trl_config.NOT_IMPLEMENTED
    # As key=value over a configuration that switches LoRA on.
    trl_yaml.write_text(LORA_YAML)
    resolved = compose.build_recipe(str(trl_yaml), ["lora_target_parameters=[mlp.experts.down_proj]"])
    assert resolved.recipe.model.lora_target_parameters == ("mlp.experts.down_proj",)
    # A key hpcrl does not implement: named, as key=value too.
    with pytest.raises(UserError) as e:
        compose.build_recipe(str(trl_yaml), ["load_in_8bit=true"])
    assert str(e.value).startswith("load_in_8bit: quantized training is not supported"), str(e.value)


def test_trls_tensor_parallel_size_is_one_engine_of_that_size_unless_the_recipe_says(trl_yaml):
    trl_yaml.write_text(trl_yaml.read_text() + "vllm_tensor_parallel_size: 2\n")
    inf = compose.build_recipe(str(trl_yaml)).recipe.inference
    assert (inf.gpus, inf.tensor_parallel_size) == (2, 2)
    trl_yaml.write_text(trl_yaml.read_text().replace("inference:\n", "inference:\n  gpus: 4\n"))
    inf = compose.build_recipe(str(trl_yaml)).recipe.inference
    assert (inf.gpus, inf.tensor_parallel_size) == (4, 2)         # two engines of 2 GPUs a node


def test_trls_async_max_staleness_is_the_inference_bound(trl_yaml):
    """TRL AsyncGRPOConfig's max_staleness: weight syncs a sample may lag before it is dropped."""
    trl_yaml.write_text(trl_yaml.read_text() + "max_staleness: 4\n")
    inf = compose.build_recipe(str(trl_yaml)).recipe.inference
    assert (inf.max_staleness, inf.staleness) == (4, 4)


def test_a_key_at_trls_default_is_accepted(trl_yaml):
    trl_yaml.write_text(trl_yaml.read_text() + "fp16: false\n")
    t = compose.build_recipe(str(trl_yaml)).trl
    assert t.inert["fp16"] == "TRL's default"


def test_trls_adaptive_entropy_control_moves_with_its_bounds_checked(trl_yaml):
    trl_yaml.write_text(trl_yaml.read_text() + "use_adaptive_entropy: true\nentropy_coef: 0.01\nentropy_target: 0.5\n"
                        "entropy_coef_max: 0.05\n")
    built = compose.build_recipe(str(trl_yaml))
    g = built.recipe.grpo
    assert (g.use_adaptive_entropy, g.entropy_coef, g.entropy_target, g.entropy_coef_max) == (True, 0.01, 0.5, 0.05)
    assert (g.entropy_coef_min, g.entropy_coef_delta) == (0.0, 0.005)                       # TRL's defaults
    assert built.trl.moved["use_adaptive_entropy"] == "grpo.use_adaptive_entropy"
    with pytest.raises(UserError, match=r"^entropy_coef_min \(grpo.entropy_coef_min\): the adaptive coefficient's "):
        compose.build_recipe(str(trl_yaml), ["entropy_coef_min=0.1"])
    with pytest.raises(UserError, match=r"^entropy_coef_delta \(grpo.entropy_coef_delta\): .* must be positive"):
        compose.build_recipe(str(trl_yaml), ["entropy_coef_delta=0"])


def test_trls_cast_lm_head_to_fp32_moves_and_is_refused_where_it_cannot_run(trl_yaml):
    """TRL's cast_lm_head_to_fp32 is grpo's (FSDP2 computes the head in fp32); ZeRO-3 computes every
    parameter in one dtype, and TRL refuses it with an adapter on the head."""
    trl_yaml.write_text(trl_yaml.read_text() + "cast_lm_head_to_fp32: true\n")
    built = compose.build_recipe(str(trl_yaml))
    assert built.recipe.grpo.cast_lm_head_to_fp32 is True
    assert built.trl.moved["cast_lm_head_to_fp32"] == "grpo.cast_lm_head_to_fp32"
    named = r"^cast_lm_head_to_fp32 \(grpo.cast_lm_head_to_fp32\): "
    with pytest.raises(UserError, match=named + "with trainer.engine=fsdp2 only"):
        compose.build_recipe(str(trl_yaml), ["trainer.engine=deepspeed"])
    with pytest.raises(UserError, match=named + "not with an adapter on the LM head"):
        compose.build_recipe(str(trl_yaml), ["model.use_peft=true", 'model.lora_target_modules=["q_proj","lm_head"]'])


def test_the_demo_task_keeps_its_tuned_values_and_user_data_gets_trls():
    demo = compose.build_recipe(None).recipe.grpo
    assert {k: getattr(demo, k) for k in DEMO_GRPO} == DEMO_GRPO
    own = compose.build_recipe(None, ["data.path=/data/train.jsonl"]).recipe.grpo
    assert own == GRPOConfig()
    assert own.learning_rate == 1e-6 and own.max_steps == -1
    tuned = compose.build_recipe(None, ["grpo.learning_rate=1e-3"]).recipe.grpo
    assert tuned.learning_rate == 1e-3 and tuned.max_steps == DEMO_GRPO["max_steps"]


def test_hpcrl_recipe_prints_what_the_keys_became(hpcrl, trl_yaml):
    r = hpcrl("recipe", str(trl_yaml), "--json", cwd=trl_yaml.parent)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["recipe"]["grpo"]["learning_rate"] == 1e-5
    assert out["from_trl"]["moved"]["model_name_or_path"] == "model.path"
    assert "logging_steps" in out["from_trl"]["not_used"]
    r = hpcrl("recipe", str(trl_yaml), "learning_rate=2e-5", cwd=trl_yaml.parent)
    assert r.returncode == 0 and "learning_rate: 2.0e-05" in r.stdout
    assert "#   logging_steps" in r.stdout and "-> model.path" in r.stdout


def test_epochs_count_steps_as_trl():
    from hpcrl.compute.train.trainer import epoch_steps

    g = GRPOConfig(num_train_epochs=3.0, num_iterations=2)
    assert epoch_steps(g, prompts=100, prompts_per_generation=8, steps_per_generation=2) == math.ceil(300 / 8) * 2
    assert epoch_steps(GRPOConfig(num_train_epochs=0.5), 10, 4, steps_per_generation=1) == 2
    # TRL's steps_per_generation: a generation of 4 micro-batches, 2 a step, twice over: 4 steps.
    g = GRPOConfig(steps_per_generation=4, gradient_accumulation_steps=2, num_iterations=2)
    assert g.micro_batches_per_generation(3) == 4 and g.optimizer_steps_per_generation(3) == 4
    g = GRPOConfig(generation_batch_size=48, per_device_train_batch_size=8)
    assert g.micro_batches_per_generation(2) == 3 and g.optimizer_steps_per_generation(2) == 3
    assert GRPOConfig().optimizer_steps_per_generation(4) == 1


def test_warmup_steps_as_transformers():
    from hpcrl.compute.train.optim import warmup_steps

    assert warmup_steps(100, 0.1) == 10 and warmup_steps(100, 7) == 7 and warmup_steps(100, 0) == 0


@pytest.mark.slow
def test_hpcrl_run_takes_a_trl_config(tmp_path):
    """The TRL user's YAML, run as it is: epochs counted as TRL counts them (12 prompts, 2 a
    generation: 6 steps), the model written to TRL's output_dir."""
    from conftest import run_to_the_end
    from support import check_trl_user_run, write_trl_user_files

    cfg = write_trl_user_files(tmp_path)
    proc = run_to_the_end([sys.executable, "-m", "hpcrl", "run", cfg.name, "--run-dir", "run"], tmp_path, 600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "finished: step 6 of 6" in proc.stdout, proc.stdout
    assert f"model     {tmp_path / 'out'}" in proc.stdout and "  eval      reward " in proc.stdout
    check_trl_user_run(tmp_path / "run", tmp_path / "out", 6)
    _export_decodes_as_the_trained_weights(tmp_path / "run", tmp_path / "my-model", tmp_path / "out")


def _export_decodes_as_the_trained_weights(run_dir: Path, source: Path, out: Path) -> None:
    """The model in TRL's output_dir holds the trainer's final weights (its last training checkpoint
    put into the source model) and decodes greedily as they do. That a fresh vLLM engine serves what
    hpcrl writes is test_export.py's test_fresh_vllm_engine_loads_the_model, on the same writer; it
    ran here too until issue #29 (two more engine starts, ~35 s of CI)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpcrl.job import rundir
    from support import greedy

    trained = AutoModelForCausalLM.from_pretrained(source)
    sd = trained.state_dict()
    dcp.load({"model": sd}, checkpoint_id=str(run_dir / rundir.CHECKPOINTS_DIR / "step-6"), no_dist=True)
    trained.load_state_dict(sd)
    written = {}
    for path in sorted(out.glob("*.safetensors")):
        written.update(load_file(path))
    want = trained.state_dict()
    assert written and set(written) <= set(want), sorted(set(written) - set(want))
    assert all(torch.equal(t, want[n].to(t.dtype)) for n, t in written.items())       # in the dtype written
    tokenizer = AutoTokenizer.from_pretrained(out)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True) for q in ("1+2=", "2+3=", "0+1=")]
    assert greedy(AutoModelForCausalLM.from_pretrained(out), tokenizer, prompts) == greedy(trained, tokenizer, prompts)


def test_evaluation_schedule_as_transformers():
    from hpcrl.compute.train.evaluation import eval_due, eval_every, summarize
    from hpcrl.compute.train.rewards import reward_sums

    g = GRPOConfig(eval_strategy="steps", eval_steps=None, max_steps=25)
    assert eval_every(g) == 10 and [s for s in range(26) if eval_due(g, s)] == [10, 20, 25]
    g = GRPOConfig(eval_strategy="steps", eval_steps=0.5, max_steps=10, eval_on_start=True)
    assert [s for s in range(11) if eval_due(g, s)] == [0, 5, 10]
    assert not any(eval_due(GRPOConfig(max_steps=10), s) for s in range(11))
    # Two functions of weight 1 over 4 completions (b said None twice: left out), 40 tokens, 1 truncated.
    per_func = torch.tensor([[1.0, 1.0], [1.0, math.nan], [0.0, 0.0], [0.0, math.nan]])
    out = summarize(reward_sums(per_func, [1.0, 1.0]) + [4, 40, 1], ["a", "b"])
    assert out["eval_reward"] == 0.75 and out["eval_rewards/a/mean"] == 0.5 and out["eval_rewards/b/mean"] == 0.5
    assert out["eval_completions/mean_length"] == 10 and out["eval_completions/clipped_ratio"] == 0.25
    # Bessel-corrected, as TRL's nanstd: totals 2, 1, 0, 0; a's values 1, 1, 0, 0; b's 1, 0.
    assert math.isclose(out["eval_reward_std"], math.sqrt((5 - 4 * 0.75 ** 2) / 3))
    assert math.isclose(out["eval_rewards/a/std"], math.sqrt(1 / 3))
    assert math.isclose(out["eval_rewards/b/std"], math.sqrt(1 / 2))


def test_trls_structured_outputs_regex_reaches_the_engines_and_is_checked(trl_yaml):
    """vllm_structured_outputs_regex: grpo's, as the engines' sampling takes it (the vLLM engine's
    own test: tests/compute/sync/test_vllm_sync.py); not a regular expression, or the transformers
    engine, which cannot constrain its sampling: one line each."""
    from hpcrl.compute.inference.types import Sampling

    trl_yaml.write_text(trl_yaml.read_text().replace("engine: transformers", "engine: vllm")
                        + "vllm_structured_outputs_regex: '[0-9]+'\n")
    resolved = compose.build_recipe(str(trl_yaml))
    assert resolved.trl.moved["vllm_structured_outputs_regex"] == "grpo.vllm_structured_outputs_regex"
    assert Sampling.of(resolved.recipe.grpo, 2, 0).structured_outputs_regex == "[0-9]+"
    with pytest.raises(UserError, match=r"^vllm_structured_outputs_regex \(grpo.vllm_structured_outputs_regex\): "
                                        r"'\[0-9' is not a regular expression"):
        compose.build_recipe(str(trl_yaml), ["vllm_structured_outputs_regex=[0-9"])
    with pytest.raises(UserError, match=r"^vllm_structured_outputs_regex \(grpo.vllm_structured_outputs_regex\): "
                                        r"structured outputs need the vLLM engine \(inference.engine: vllm or auto\)"):
        compose.build_recipe(str(trl_yaml), ["inference.engine=transformers"])


def test_trls_tf32_is_taken_where_the_gpus_have_it_and_refused_elsewhere(trl_yaml, hpcrl):
    """tf32: grpo's (the trainers set it: tests/compute/train/test_gpu.py); as transformers, True is an
    error where no NVIDIA GPU runs the trainers (Frontier's AMD GPUs, this machine's CPUs)."""
    trl_yaml.write_text(trl_yaml.read_text() + "tf32: true\n")
    resolved = compose.build_recipe(str(trl_yaml))
    assert resolved.recipe.grpo.tf32 is True and resolved.trl.moved["tf32"] == "grpo.tf32"
    r = hpcrl("render", "--site", "cuda", "-N", "2", "grpo.tf32=true")
    assert r.returncode == 0, r.stderr
    for site, on in (("frontier", "amd"), ("local", "CPUs")):
        r = hpcrl("render", "--site", site, "-A", "abc123", "grpo.tf32=true")
        assert r.returncode == 2 and r.stderr == (f"hpcrl: error: grpo.tf32: TF32 needs NVIDIA GPUs (Ampere or newer), "
                                                  f"and site {site}'s trainers run on {on}: leave it unset\n"), r.stderr
    r = hpcrl("render", "--site", "frontier", "-A", "abc123", "grpo.tf32=false")
    assert r.returncode == 0, r.stderr
