"""trainer.engine=deepspeed on the login side: the DeepSpeed ZeRO-3 configuration hpcrl builds from
the recipe (hpcrl.job.deepspeed.build_config), a user's DeepSpeed JSON checked against it key by key
("auto" filled, a conflict one line naming both sides), the DeepSpeed settings of a TRL-style
accelerate config, TRL's `deepspeed` key, the job spec that keeps the user's settings, `hpcrl plan`'s
hpZ choice (ZeRO++'s HSDP, chosen as the mesh) and the memory estimate with offload."""

from __future__ import annotations

import json
import math

import pytest

from hpcrl.job import deepspeed
from hpcrl.job.deepspeed import OWNED_KEYS, build_config, read_accelerate_config
from hpcrl.job.errors import UserError
from hpcrl.job.estimate import estimate
from hpcrl.job.memory import GIB
from hpcrl.job.recipe import GRPOConfig, Recipe, TrainerConfig
from hpcrl.job.spec import JobSpec
from hpcrl.login import compose
from hpcrl.login.cli import main as cli_main

WHERE = "trainer.deepspeed_config (ds.json)"
# Hugging Face's ZeRO-3 template (transformers' DeepSpeed docs): "auto" wherever the Trainer fills in
# its TrainingArguments; WarmupLR is warmup then constant.
HF_ZERO3 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True, "contiguous_gradients": True,
        "sub_group_size": 1e9, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}
# TRL's examples/accelerate_configs/deepspeed_zero3.yaml, as its multi-node GRPO recipes use it.
TRL_ACCELERATE_ZERO3 = """\
compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  deepspeed_multinode_launcher: standard
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: true
  zero3_save_16bit_model: true
  zero_stage: 3
distributed_type: DEEPSPEED
downcast_bf16: 'no'
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 8
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""
QWEN_14B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 5120,
            "num_hidden_layers": 48, "vocab_size": 152064, "intermediate_size": 13824,
            "num_attention_heads": 40, "num_key_value_heads": 8, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16"}


def _recipe(**grpo) -> Recipe:
    return Recipe(grpo=GRPOConfig(**{"per_device_train_batch_size": 8, "gradient_accumulation_steps": 4, **grpo}),
                  trainer=TrainerConfig(engine="deepspeed"))


def _refused(user: dict, recipe: Recipe | None = None, **kw) -> str:
    with pytest.raises(UserError) as e:
        build_config(recipe or _recipe(), num_trainers=kw.pop("num_trainers", 2), user=user, where=WHERE, **kw)
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"{WHERE}: "), text
    return text


# ------------------------------------------------------------------------- the recipe's config
def test_the_recipe_defaults_fill_every_owned_key():
    config = build_config(_recipe(), num_trainers=3)
    assert config == {
        "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4, "train_batch_size": 96,
        "gradient_clipping": 1.0, "bf16": {"enabled": False}, "fp16": {"enabled": False},
        "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 1, "stage3_gather_16bit_weights_on_model_save": False},
        "managed_gradient_accumulation": False, "zero_allow_untested_optimizer": True,
        "steps_per_print": deepspeed.STEPS_PER_PRINT, "wall_clock_breakdown": False}
    assert "optimizer" not in config and "scheduler" not in config      # hpcrl passes its own AdamW and schedule
    # grpo.bf16 unset: bf16 on an accelerator, fp32 on CPU (as the FSDP2 engine's mixed precision)
    assert build_config(_recipe(), num_trainers=3, device_type="cuda")["bf16"] == {"enabled": True}
    assert build_config(_recipe(bf16=True), num_trainers=3)["bf16"] == {"enabled": True}
    assert build_config(_recipe(bf16=False), num_trainers=3, device_type="cuda")["bf16"] == {"enabled": False}
    assert build_config(_recipe(max_grad_norm=0.0), num_trainers=1)["gradient_clipping"] == 0.0
    assert build_config(_recipe(), num_trainers=8, hpz_partition_size=4)["zero_optimization"]["zero_hpz_partition_size"] == 4


def test_offload_from_the_recipe_or_the_users_config():
    recipe = Recipe(trainer=TrainerConfig(engine="deepspeed", offload_optimizer=True, offload_params=True))
    zero = build_config(recipe, num_trainers=2, device_type="cuda")["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert zero["offload_param"] == {"device": "cpu", "pin_memory": True}
    config = build_config(recipe, num_trainers=2, device_type="cpu")
    assert config["zero_optimization"]["offload_optimizer"]["pin_memory"] is False     # nothing to pin for on CPU
    # torch's AdamW steps the offloaded state: DeepSpeed must not insist on its compiled CPU Adam
    assert config["zero_force_ds_cpu_optimizer"] is False
    # The user's own section asks too; its other keys are kept, "none" sections go.
    user = {"zero_optimization": {"offload_optimizer": {"device": "cpu", "buffer_count": 8, "pin_memory": False},
                                  "offload_param": {"device": "none"}}}
    zero = build_config(_recipe(), num_trainers=2, user=user, device_type="cuda")["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "buffer_count": 8, "pin_memory": False}
    assert "offload_param" not in zero
    assert deepspeed.asked_offloads(user) == {"offload_optimizer": True}


def test_the_config_is_one_deepspeed_takes():
    ds_config = pytest.importorskip("deepspeed.runtime.config")
    recipe = Recipe(grpo=GRPOConfig(per_device_train_batch_size=4, gradient_accumulation_steps=2),
                    trainer=TrainerConfig(engine="deepspeed", offload_optimizer=True))
    config = build_config(recipe, num_trainers=1, user=HF_ZERO3 | {"scheduler": None}, hidden_size=64)
    parsed = ds_config.DeepSpeedConfig(config)
    assert (parsed.train_batch_size, parsed.gradient_accumulation_steps, parsed.zero_optimization_stage) == (8, 2, 3)
    assert parsed.managed_gradient_accumulation is False and parsed.zero_config.reduce_bucket_size == 64 * 64


# ------------------------------------------------------------------------- a user's DeepSpeed JSON
def test_hugging_faces_auto_values_are_filled():
    recipe = _recipe(lr_scheduler_type="constant_with_warmup", bf16=True)
    config = build_config(recipe, num_trainers=4, user=HF_ZERO3, device_type="cuda", hidden_size=1536, where=WHERE)
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["train_batch_size"], config["gradient_clipping"]) == (8, 4, 128, 1.0)
    assert config["bf16"] == {"enabled": True} and config["fp16"]["enabled"] is False
    zero = config["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"], zero["stage3_param_persistence_threshold"]) \
        == (1536 ** 2, int(0.9 * 1536 ** 2), 15360)
    # The user's other keys as they are; what hpcrl decides, hpcrl's.
    assert zero["overlap_comm"] is True and zero["stage3_max_live_parameters"] == 1e9 and config["steps_per_print"] == 2000
    assert zero["stage3_gather_16bit_weights_on_model_save"] is False and "optimizer" not in config
    assert deepspeed.not_honoured(HF_ZERO3) == [
        "zero_optimization.stage3_gather_16bit_weights_on_model_save (hpcrl writes the Hugging Face model itself, "
        "bucket by bucket)"]
    # Sections that are off ("auto" is off for them, as Hugging Face's Trainer leaves them) go whole.
    off = build_config(recipe, num_trainers=1, user={"amp": {"enabled": "auto", "opt_level": "auto"},
                                                     "fp16": {"enabled": False, "loss_scale": "auto"}})
    assert "amp" not in off and off["fp16"] == {"enabled": False}
    # Without the model's hidden size the buckets are DeepSpeed's defaults.
    zero = build_config(recipe, num_trainers=4, user=HF_ZERO3, device_type="cuda")["zero_optimization"]
    assert "reduce_bucket_size" not in zero and "stage3_prefetch_bucket_size" not in zero
    # Equal values are fine, whatever their JSON spelling.
    same = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 4, "train_batch_size": 64,
            "gradient_clipping": 1, "zero_optimization": {"stage": 3},
            "optimizer": {"type": "adamw", "params": {"lr": 1e-06, "betas": [0.9, 0.999], "eps": 1e-8,
                                                      "weight_decay": 0}}}
    assert build_config(_recipe(), num_trainers=2, user=same)["train_batch_size"] == 64


CONFLICTS = [
    ({"gradient_accumulation_steps": 8},
     "gradient_accumulation_steps 8 conflicts with grpo.gradient_accumulation_steps 4; set one of them"),
    ({"train_micro_batch_size_per_gpu": 2},
     "train_micro_batch_size_per_gpu 2 conflicts with grpo.per_device_train_batch_size 8; set one of them"),
    ({"train_batch_size": 32}, "train_batch_size 32 conflicts with grpo.per_device_train_batch_size x "
                               "grpo.gradient_accumulation_steps x 2 trainer(s) 64; set one of them"),
    ({"gradient_clipping": 0.5}, "gradient_clipping 0.5 conflicts with grpo.max_grad_norm 1.0; set one of them"),
    ({"bf16": {"enabled": True}},
     "bf16.enabled true conflicts with grpo.bf16 unset (fp32 on cpu); set grpo.bf16=true or change one of them"),
    ({"zero_optimization": {"zero_hpz_partition_size": 8}},
     "zero_optimization.zero_hpz_partition_size 8 conflicts with trainer.mesh's hpZ partition (chosen as the mesh) 1"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}},
     "optimizer.params.lr 0.0001 conflicts with grpo.learning_rate 1e-06; set one of them"),
    ({"optimizer": {"params": {"betas": [0.9, 0.95]}}},
     "optimizer.params.betas [0.9, 0.95] conflicts with [grpo.adam_beta1, grpo.adam_beta2] [0.9, 0.999]"),
    ({"optimizer": {"params": {"eps": 1e-6}}}, "optimizer.params.eps 1e-06 conflicts with grpo.adam_epsilon 1e-08"),
    ({"optimizer": {"params": {"weight_decay": 0.1}}},
     "optimizer.params.weight_decay 0.1 conflicts with grpo.weight_decay 0.0"),
    ({"optimizer": {"type": "Lamb"}}, 'optimizer.type "Lamb": hpcrl\'s optimizer is AdamW from grpo.*'),
    ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}, "optimizer.params.adam_w_mode false"),
    ({"optimizer": {"params": {"momentum": 0.9}}}, "optimizer.params.momentum: hpcrl's optimizer is AdamW"),
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}},
     'scheduler.type "WarmupLR" conflicts with grpo.lr_scheduler_type "linear"'),
    ({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 100}}},
     "scheduler.params.warmup_num_steps 100: hpcrl runs grpo.lr_scheduler_type"),
    ({"zero_optimization": {"stage": 2}}, "zero_optimization.stage 2: trainer.engine=deepspeed runs ZeRO stage 3"),
    ({"fp16": {"enabled": True}}, "fp16.enabled true: hpcrl trains in bf16 or fp32 (grpo.bf16)"),
    ({"amp": {"enabled": True}}, "amp.enabled true"),
    ({"bf16": {"enabled": "auto", "bf16_master_weights_and_grads": True}},
     "bf16.bf16_master_weights_and_grads true: hpcrl keeps fp32 master weights"),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
     'zero_optimization.offload_optimizer.device "nvme": hpcrl offloads to host memory only'),
    ({"zero_optimization": {"sub_group_size": "auto"}},
     'zero_optimization.sub_group_size "auto": hpcrl fills "auto" only in the keys it owns'),
]


@pytest.mark.parametrize("user,expect", CONFLICTS, ids=[json.dumps(c[0])[:60] for c in CONFLICTS])
def test_a_conflict_is_one_line_naming_both_sides(user, expect):
    assert expect in _refused(user)


def test_every_owned_key_has_a_conflict_case():
    tested = {key for user, _ in CONFLICTS for key in (*user, *(f"zero_optimization.{k}"
                                                               for k in user.get("zero_optimization", {})))}
    assert set(OWNED_KEYS) <= tested, set(OWNED_KEYS) - tested


def test_offload_none_against_the_recipes_flag_and_explicit_bf16():
    recipe = Recipe(trainer=TrainerConfig(engine="deepspeed", offload_params=True))
    assert _refused({"zero_optimization": {"offload_param": {"device": "none"}}}, recipe).endswith(
        'zero_optimization.offload_param.device "none" conflicts with trainer.offload_params true; set one of them')
    assert _refused({"bf16": {"enabled": True}}, _recipe(bf16=False), device_type="cuda").endswith(
        "bf16.enabled true conflicts with grpo.bf16 false; set one of them")


def test_settings_from_two_places_must_agree():
    merged = deepspeed.merge_user([("a.json", {"zero_optimization": {"stage": 3, "overlap_comm": True}}),
                                   ("b.yaml", {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}})])
    assert merged == {"zero_optimization": {"stage": 3, "overlap_comm": True}, "bf16": {"enabled": True}}
    # "auto" gives way to a value, from either side.
    assert deepspeed.merge_user([("a.json", {"bf16": {"enabled": "auto"}}), ("b.yaml", {"bf16": {"enabled": True}})]) \
        == deepspeed.merge_user([("b.yaml", {"bf16": {"enabled": True}}), ("a.json", {"bf16": {"enabled": "auto"}})]) \
        == {"bf16": {"enabled": True}}
    with pytest.raises(UserError, match=r'^b.yaml: zero_optimization.offload_optimizer.device "cpu" conflicts with '
                                        r'a.json\'s "none"; set one of them$'):
        deepspeed.merge_user([("a.json", {"zero_optimization": {"offload_optimizer": {"device": "none"}}}),
                              ("b.yaml", {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}})])


# ------------------------------------------------------------------------- accelerate configs
def test_trls_accelerate_config_gives_its_deepspeed_settings_and_names_the_rest():
    import yaml

    where = "trainer.accelerate_config (deepspeed_zero3.yaml)"
    fragment, unfollowed = read_accelerate_config(yaml.safe_load(TRL_ACCELERATE_ZERO3), where)
    assert fragment == {"bf16": {"enabled": True}, "zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "none"}, "offload_param": {"device": "none"}}}
    text = "; ".join(unfollowed)
    for name in ("num_machines", "num_processes", "machine_rank", "rdzv_backend", "same_network",
                 "deepspeed_multinode_launcher", "zero3_save_16bit_model"):
        assert name in text, text
    assert "num_machines, num_processes (hpcrl takes the nodes from -N and a task for each of the site's GPUs)" in text
    assert "zero3_save_16bit_model (hpcrl writes the Hugging Face model itself, bucket by bucket)" in text
    # Asking for what hpcrl does anyway is no warning: zero3_init_flag true, use_cpu false, the TPU keys.
    for quiet in ("zero3_init_flag", "use_cpu", "tpu_", "compute_environment", "downcast_bf16", "debug"):
        assert quiet not in text, text
    # The fragment is checked like a JSON: bf16 agrees on a GPU site (grpo.bf16 unset), ZeRO-3 with no offload.
    config = build_config(_recipe(), num_trainers=8, user=fragment, device_type="cuda", where=where)
    assert config["bf16"] == {"enabled": True} and "offload_optimizer" not in config["zero_optimization"]

    data = yaml.safe_load(TRL_ACCELERATE_ZERO3)
    data["mixed_precision"] = "no"
    data["deepspeed_config"].update(zero3_init_flag=False, offload_optimizer_device="cpu",
                                    deepspeed_config_file="ds.json", gradient_accumulation_steps=4)
    fragment, unfollowed = read_accelerate_config(data, where)
    assert fragment["bf16"] == {"enabled": False} and fragment["gradient_accumulation_steps"] == 4
    assert fragment["zero_optimization"]["offload_optimizer"] == {"device": "cpu"}
    assert any(u.startswith("zero3_init_flag (hpcrl always builds the model partitioned") for u in unfollowed)
    assert deepspeed.deepspeed_config_file(data) == "ds.json"


@pytest.mark.parametrize("keys,value,expect", [
    (("distributed_type",), "FSDP", "distributed_type 'FSDP': hpcrl reads an accelerate config for its DeepSpeed settings"),
    (("mixed_precision",), "fp16", "mixed_precision 'fp16': hpcrl trains in bf16 or fp32"),
    (("deepspeed_config", "offload_param_device"), "nvme",
     "deepspeed_config.offload_param_device 'nvme': hpcrl offloads to host memory only"),
])
def test_accelerate_settings_hpcrl_cannot_train_with(keys, value, expect):
    import yaml

    data = yaml.safe_load(TRL_ACCELERATE_ZERO3)
    node = data
    for key in keys[:-1]:
        node = node[key]
    node[keys[-1]] = value
    with pytest.raises(UserError) as e:
        read_accelerate_config(data, "acc")
    assert str(e.value).startswith("acc: ") and expect in str(e.value)


# ------------------------------------------------------------------------- through the CLI
def _render(hpcrl, *args):
    return hpcrl("render", "--site", "testbed", "--run-dir", str(hpcrl.work / "run"), *args)


def test_render_refuses_a_conflicting_json_and_writes_nothing(hpcrl):
    ds = hpcrl.work.parent / "ds.json"
    ds.write_text(json.dumps({"gradient_accumulation_steps": 8, "zero_optimization": {"stage": 3}}))
    r = _render(hpcrl, "trainer.engine=deepspeed", f"trainer.deepspeed_config={ds}", "grpo.gradient_accumulation_steps=4")
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines() == [
        "hpcrl: error: trainer.deepspeed_config (ds.json): gradient_accumulation_steps 8 conflicts with "
        "grpo.gradient_accumulation_steps 4; set one of them"]
    assert list(hpcrl.work.iterdir()) == []
    ds.write_text('{"zero_optimization": {"stage": 3,}}')
    r = _render(hpcrl, "trainer.engine=deepspeed", f"trainer.deepspeed_config={ds}")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"hpcrl: error: trainer.deepspeed_config: {ds} is not valid JSON (line 1, column 35: Expecting property name "
        f"enclosed in double quotes)"]
    r = _render(hpcrl, f"trainer.deepspeed_config={ds}")       # a DeepSpeed config alone does not pick the engine
    assert r.returncode == 2 and "set trainer.engine=deepspeed" in r.stderr and len(r.stderr.splitlines()) == 1
    assert list(hpcrl.work.iterdir()) == []


def test_render_keeps_the_users_settings_in_job_json(hpcrl):
    (hpcrl.work.parent / "ds.json").write_text(json.dumps(HF_ZERO3))
    (hpcrl.work.parent / "acc.yaml").write_text(TRL_ACCELERATE_ZERO3.replace("  offload_optimizer_device: none\n", "")
                                                .replace("  offload_param_device: none\n", ""))
    recipe = hpcrl.work.parent / "recipe.yaml"
    # Relative paths beside the recipe (not in the directory hpcrl runs in) are found there.
    recipe.write_text("trainer: {engine: deepspeed, deepspeed_config: ds.json, accelerate_config: acc.yaml}\n"
                      "grpo: {lr_scheduler_type: constant_with_warmup, bf16: true, learning_rate: 1.0e-6}\n")
    r = _render(hpcrl, str(recipe), "-N", "2")
    assert r.returncode == 0, r.stderr
    warnings = r.stderr.strip().splitlines()
    assert warnings == [
        "hpcrl: warning: trainer.accelerate_config (acc.yaml): not followed: machine_rank, rdzv_backend, same_network "
        "(hpcrl's tasks meet through their own MPI rendezvous); num_machines, num_processes (hpcrl takes the nodes "
        "from -N and a task for each of the site's GPUs); deepspeed_multinode_launcher (hpcrl starts every task with "
        "one srun step, or mpiexec without Slurm); zero3_save_16bit_model (hpcrl writes the Hugging Face model itself, "
        "bucket by bucket)",
        "hpcrl: warning: trainer.deepspeed_config (ds.json): not followed: "
        "zero_optimization.stage3_gather_16bit_weights_on_model_save (hpcrl writes the Hugging Face model itself, "
        "bucket by bucket)"]
    spec = JobSpec.load(hpcrl.work / "run")
    assert spec.recipe.trainer.deepspeed_config == str(hpcrl.work.parent / "ds.json")
    assert spec.deepspeed_user == {**HF_ZERO3, "bf16": {"enabled": True}}       # the JSON, with the accelerate bf16
    # HF_ZERO3 offloads both: the recipe in job.json says so too, for the estimate and the trainers.
    assert spec.recipe.trainer.offload_optimizer and spec.recipe.trainer.offload_params
    # The job's trainers build the same config from job.json, later edits of the file notwithstanding.
    (hpcrl.work.parent / "ds.json").write_text("{}")
    config = deepspeed.config_for_job(JobSpec.from_json(spec.to_json()), "cpu", hidden_size=64)
    assert config["train_batch_size"] == 128 * 1 * 6 and config["zero_optimization"]["zero_hpz_partition_size"] == 3
    assert config["zero_optimization"]["offload_param"] == {"device": "cpu", "pin_memory": True}
    assert config["zero_optimization"]["reduce_bucket_size"] == 4096 and config["bf16"] == {"enabled": True}


def test_the_spec_round_trips_the_users_settings():
    spec = compose.compose(None, "testbed", ["trainer.engine=deepspeed",
                                             "trainer.deepspeed_config={zero_optimization: {overlap_comm: true}}"],
                           {"resources.nodes": 1}, for_plan=True)
    assert spec.deepspeed_user == {"zero_optimization": {"overlap_comm": True}}
    again = JobSpec.from_json(spec.to_json())
    assert again == spec and again.deepspeed_user == spec.deepspeed_user
    assert compose.compose(None, "testbed", [], {}, for_plan=True).deepspeed_user is None


def test_plan_prints_the_hpz_choice(capsys):
    assert cli_main(["plan", "--site", "testbed", "trainer.engine=deepspeed"]) == 0
    out = capsys.readouterr().out
    assert ("model demo:tiny: trainer engine: deepspeed ZeRO-3 over all 3 trainer(s), no hpZ partition: one node: "
            "sharding over its trainers is HSDP already") in out
    assert cli_main(["plan", "--site", "testbed", "-N", "2", "trainer.engine=deepspeed"]) == 0
    out = capsys.readouterr().out
    assert ("model demo:tiny: trainer engine: deepspeed ZeRO-3, hpZ partition of 3 (each node's trainers; the sync's "
            "gathers stay inside the node): 0.10B parameters need") in out
    assert cli_main(["plan", "--site", "testbed", "-N", "2", "trainer.engine=deepspeed", "trainer.mesh=fsdp",
                     "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["trainer_engine"] == {"engine": "deepspeed", "zero_stage": 3, "hpz_partition_size": 1,
                                       "offload_optimizer": False, "offload_params": False}
    assert cli_main(["plan", "--site", "testbed", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["trainer_engine"] == {"engine": "fsdp2"}


def test_trls_deepspeed_key(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    trl = tmp_path / "cfg.yaml"
    trl.write_text("model_name_or_path: demo:tiny\ndataset_name: demo\ndeepspeed: ds.json\n")
    resolved = compose.build_recipe(str(trl))
    t = resolved.recipe.trainer
    assert (t.engine, t.deepspeed_config) == ("deepspeed", str(tmp_path / "ds.json"))
    assert resolved.trl.moved["deepspeed"] == "trainer.engine: deepspeed, trainer.deepspeed_config"
    # Inline, as TrainingArguments takes a dict.
    trl.write_text("model_name_or_path: demo:tiny\ndataset_name: demo\n"
                   "deepspeed: {zero_optimization: {stage: 3, overlap_comm: true}}\n")
    spec = compose.compose(str(trl), "testbed", [], {}, for_plan=True)
    assert spec.recipe.trainer.engine == "deepspeed"
    assert spec.deepspeed_user == {"zero_optimization": {"stage": 3, "overlap_comm": True}}
    # A recipe that says fsdp2 itself is refused, not overridden.
    trl.write_text("model_name_or_path: demo:tiny\ndataset_name: demo\ndeepspeed: ds.json\ntrainer: {engine: fsdp2}\n")
    with pytest.raises(UserError, match=r"^deepspeed \(trainer.deepspeed_config\): .*set trainer.engine=deepspeed"):
        compose.build_recipe(str(trl))
    trl.write_text("model_name_or_path: demo:tiny\ndataset_name: demo\ndeepspeed: 3\n")
    with pytest.raises(UserError, match=r"^deepspeed: expected a DeepSpeed JSON's path"):
        compose.build_recipe(str(trl))


# ------------------------------------------------------------------------- will it fit, with offload
def test_offload_in_the_estimate_and_its_fix(tmp_path):
    path = tmp_path / "q14"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(QWEN_14B))
    params = 14_769_689_600
    base = [f"model.path={path}", "grpo.beta=0.04", "trainer.activation_checkpointing=true",
            "grpo.per_device_train_batch_size=16", "grpo.num_generations=16", "grpo.max_completion_length=1024",
            "inference.max_model_len=2048", "trainer.logprob_chunk_tokens=1024"]

    def fit(site, *extra):
        return estimate(compose.compose(None, site, [*base, *extra], {"resources.nodes": 1, "resources.account": "a"},
                                        for_plan=True))

    fsdp, ds = fit("frontier"), fit("frontier", "trainer.engine=deepspeed")
    # ZeRO-3 keeps FSDP's 16 B a parameter sharded over the node's 7 trainers: the same estimate.
    assert ds.trainer.parts == fsdp.trainer.parts and ds.trainer.fits is False
    assert ds.trainer.fixes[0] == "trainer.offload_optimizer=true" and "offload" not in " ".join(fsdp.trainer.fixes)
    assert ds.trainer.facts["host_offload_gb"] == 0
    opt = fit("frontier", "trainer.engine=deepspeed", "trainer.offload_optimizer=true")
    assert opt.trainer.parts["training_state"] == math.ceil(params * 2 / 7)       # the bf16 parameter stays
    assert opt.trainer.fits is True and opt.trainer.facts["host_offload_gb"] == round(params * 14 / 7 / GIB, 1)
    assert "offloaded to host memory: ~27.5 GB per trainer, ~192.6 GB a node of its 512 GB" in opt.trainer.verdict()
    both = fit("frontier", "trainer.engine=deepspeed", "trainer.offload_optimizer=true", "trainer.offload_params=true")
    assert both.trainer.parts["training_state"] == 0 and both.trainer.facts["host_offload_gb"] == round(params * 16 / 7 / GIB, 1)
    # On a CPU site the host is the trainers' memory already: offload frees nothing.
    cpu = [fit("testbed", "trainer.engine=deepspeed", *x).trainer.parts["training_state"]
           for x in ([], ["trainer.offload_optimizer=true"])]
    assert cpu[0] == cpu[1] == math.ceil(params * 16 / 3)
