"""trainer.engine=deepspeed: the DeepSpeed ZeRO-3 configuration a job's trainers pass to
deepspeed.initialize, made from the recipe and checked against the user's own DeepSpeed JSON, and
the DeepSpeed settings of an accelerate config file.

Standard library only: compose builds the configuration on the login node, so that a conflict with
the recipe is refused before the job queues, and the trainers build the same one from job.json
(config_for_job). The recipe is the single source of what trains: the keys hpcrl owns (OWNED_KEYS)
are taken from it, and a user's value for one of them must be "auto" (Hugging Face's convention,
filled in here) or equal to the recipe's. Every other key of the user's reaches DeepSpeed as it is.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

from hpcrl.job.errors import UserError
from hpcrl.job.mesh_choice import MeshChoice, choose_mesh
from hpcrl.job.recipe import Recipe
from hpcrl.job.spec import JobSpec

AUTO = "auto"
# What the recipe decides; the user's config may only agree ("auto" or the same value).
OWNED_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
              "gradient_clipping", "bf16", "fp16", "zero_optimization.stage",
              "zero_optimization.zero_hpz_partition_size", "optimizer", "scheduler")
# DeepSpeed's own optimizer names for the AdamW hpcrl runs (torch's, built from grpo.*).
ADAM_TYPES = ("adam", "adamw")
# optimizer.params hpcrl compares with grpo.*, and those that only pick an implementation.
OPTIMIZER_PARAMS = ("lr", "betas", "eps", "weight_decay")
OPTIMIZER_IMPLEMENTATION = ("torch_adam", "fused")
# DeepSpeed's schedulers that match a grpo.lr_scheduler_type when their params are all "auto"
# (Hugging Face's Trainer fills them from the same TrainingArguments).
SCHEDULERS = {"WarmupLR": ("constant", "constant_with_warmup"), "WarmupDecayLR": ("linear",),
              "WarmupCosineLR": ("cosine",)}
# zero_optimization keys Hugging Face fills from the model's hidden size when they are "auto"
# (transformers.integrations.deepspeed); without a hidden size DeepSpeed's own defaults apply.
HIDDEN_SIZE_AUTO = {"reduce_bucket_size": lambda h: h * h,
                    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
                    "stage3_param_persistence_threshold": lambda h: 10 * h}
# Sections whose `enabled: true` would train other than the recipe says, each with why.
REFUSED_WHEN_ENABLED = {
    "fp16": "hpcrl trains in bf16 or fp32 (grpo.bf16)",
    "amp": "hpcrl trains in bf16 or fp32 (grpo.bf16), without apex",
    "torch_autocast": "hpcrl casts as grpo.bf16 says, with fp32 master weights",
    "elasticity": "the batch sizes come from grpo.per_device_train_batch_size and gradient_accumulation_steps",
}
# bf16 options that drop the fp32 master weights the estimate and hpcrl's numerics rely on.
BF16_REFUSED = ("bf16_master_weights_and_grads", "bf16_optimizer_states")
# Keys the user's JSON may set that hpcrl does something else for (named on stderr, not followed).
JSON_NOT_HONOURED = {
    "zero_optimization.stage3_gather_16bit_weights_on_model_save":
        "hpcrl writes the Hugging Face model itself, bucket by bucket",
    "zero_optimization.gather_16bit_weights_on_model_save":
        "hpcrl writes the Hugging Face model itself, bucket by bucket",
    "activation_checkpointing": "hpcrl checkpoints activations with trainer.activation_checkpointing "
                                "(grpo.gradient_checkpointing)",
}
# Far beyond any run: hpcrl logs every step itself (metrics.jsonl).
STEPS_PER_PRINT = 10 ** 12

# ------------------------------------------------------------------------- accelerate configs
_PLACEMENT = "hpcrl takes the nodes from -N and a task for each of the site's GPUs"
_RENDEZVOUS = "hpcrl's tasks meet through their own MPI rendezvous"
_LAUNCHER = "hpcrl starts every task with one srun step, or mpiexec without Slurm"
ACCELERATE_NOT_HONOURED = {
    "num_machines": _PLACEMENT, "num_processes": _PLACEMENT, "gpu_ids": _PLACEMENT,
    "machine_rank": _RENDEZVOUS, "main_process_ip": _RENDEZVOUS, "main_process_port": _RENDEZVOUS,
    "rdzv_backend": _RENDEZVOUS, "same_network": _RENDEZVOUS,
    "deepspeed_multinode_launcher": _LAUNCHER, "deepspeed_hostfile": _LAUNCHER,
    "deepspeed_inclusion_filter": _LAUNCHER, "deepspeed_exclusion_filter": _LAUNCHER,
    "use_cpu": "the site profile says whether the tasks compute on GPUs",
    "enable_cpu_affinity": "hpcrl pins each task to its GPU's cores from the site profile",
    "dynamo_config": "hpcrl does not compile the model",
    "zero3_init_flag": "hpcrl always builds the model partitioned (zero.Init)",
    "zero3_save_16bit_model": "hpcrl writes the Hugging Face model itself, bucket by bucket",
    "deepspeed_moe_layer_cls_names": "hpcrl's trainers take dense models",
    "offload_optimizer_nvme_path": "hpcrl offloads to host memory only",
    "offload_param_nvme_path": "hpcrl offloads to host memory only",
}
# Values that ask for nothing hpcrl does not do: not worth a warning.
ACCELERATE_QUIET_VALUES = {"use_cpu": (False,), "enable_cpu_affinity": (False,), "zero3_init_flag": (True,),
                           "zero3_save_16bit_model": (False,), "gpu_ids": ("all", None),
                           "offload_optimizer_nvme_path": (None, "none"), "offload_param_nvme_path": (None, "none")}
# Keys of no consequence outside accelerate's own launcher and TPUs.
ACCELERATE_IGNORED = ("compute_environment", "debug", "main_training_function", "downcast_bf16", "tpu_env",
                      "tpu_use_cluster", "tpu_use_sudo", "tpu_name", "tpu_zone", "commands", "command_file",
                      "distributed_type", "mixed_precision", "deepspeed_config")
ACCELERATE_DEEPSPEED_READ = ("zero_stage", "offload_optimizer_device", "offload_param_device",
                             "gradient_accumulation_steps", "gradient_clipping", "deepspeed_config_file")
OFFLOAD_DEVICES = ("none", "cpu")


def build_config(recipe: Recipe, *, num_trainers: int, hpz_partition_size: int = 1, user: dict | None = None,
                 device_type: str = "cpu", hidden_size: int | None = None,
                 where: str = "trainer.deepspeed_config") -> dict:
    """The complete DeepSpeed configuration for the recipe's ZeRO-3 trainers.

    `user`: the user's DeepSpeed JSON (with the accelerate config's settings), checked key by key:
    an owned key "auto" is filled, equal is fine, different is a UserError naming both sides;
    `where` names the user's file in that message. `device_type`: the trainers' torch device type
    (grpo.bf16 unset is bf16 on an accelerator, fp32 on CPU). `hidden_size`: the model's, for
    Hugging Face's "auto" bucket sizes (without it those keys get DeepSpeed's defaults)."""
    g = recipe.grpo
    config = copy.deepcopy(user or {})
    for section, why in REFUSED_WHEN_ENABLED.items():
        _refuse_enabled(config, section, why, where)
    micro, accumulation = g.per_device_train_batch_size, g.gradient_accumulation_steps
    owned = (("train_micro_batch_size_per_gpu", micro, "grpo.per_device_train_batch_size"),
             ("gradient_accumulation_steps", accumulation, "grpo.gradient_accumulation_steps"),
             ("train_batch_size", micro * accumulation * num_trainers,
              f"grpo.per_device_train_batch_size x grpo.gradient_accumulation_steps x {num_trainers} trainer(s)"),
             ("gradient_clipping", max(g.max_grad_norm, 0.0), "grpo.max_grad_norm"))
    for key, ours, field in owned:
        config[key] = _agree(config.get(key, AUTO), ours, key, field, where)
    config["bf16"] = _bf16_section(config, g.bf16, device_type, where)
    config["fp16"] = {"enabled": False}
    _check_optimizer(config.pop("optimizer", None), recipe, where)
    _check_scheduler(config.pop("scheduler", None), recipe, where)
    config["zero_optimization"] = _zero_section(config, recipe, hpz_partition_size, device_type, hidden_size, where)
    # hpcrl's loop calls backward once per micro-batch and step once per optimizer step; in
    # DeepSpeed's unmanaged mode every step() is the boundary, so hpcrl decides when one is.
    config["managed_gradient_accumulation"] = False
    # The optimizer is hpcrl's own torch AdamW built from grpo.* (the same as FSDP2's).
    config["zero_allow_untested_optimizer"] = True
    if config["zero_optimization"].get("offload_optimizer", {}).get("device") == "cpu":
        # torch's AdamW steps the offloaded state on the host: DeepSpeedCPUAdam would be faster
        # but needs a compiled op, which the CPU-only install does not build.
        config["zero_force_ds_cpu_optimizer"] = False
    config.setdefault("steps_per_print", STEPS_PER_PRINT)
    config.setdefault("wall_clock_breakdown", False)
    _refuse_leftover_auto(config, where)
    return config


def bf16_enabled(bf16: bool | None, device_type: str) -> bool:
    """grpo.bf16 resolved as hpcrl.compute.train.fsdp.mixed_precision_for resolves it: unset is
    bf16 on an accelerator, fp32 on CPU."""
    return device_type != "cpu" if bf16 is None else bf16


def config_for_job(spec: JobSpec, device_type: str, hidden_size: int | None = None) -> dict:
    """The configuration a job's trainers pass to deepspeed.initialize: build_config for the job's
    recipe, trainers, mesh choice (hpcrl.job.mesh_choice.choose_mesh) and the user's settings as compose read
    them (spec.deepspeed_user). `hidden_size`: the model config's, for Hugging Face's "auto" buckets."""
    plan = spec.plan()
    mesh = choose_mesh(spec, plan)
    return build_config(spec.recipe, num_trainers=plan.num_trainers, hpz_partition_size=mesh.hpz_partition_size,
                        user=spec.deepspeed_user, device_type=device_type, hidden_size=hidden_size,
                        where=user_config_name(spec.recipe))


def describe(mesh: MeshChoice) -> str:
    """One line for `hpcrl plan` and the trainers' log: the ZeRO-3 partition chosen, and why."""
    hpz = mesh.hpz_partition_size
    if hpz > 1:
        return (f"trainer engine: deepspeed ZeRO-3, hpZ partition of {hpz} (each node's trainers; the sync's "
                f"gathers stay inside the node): {mesh.reason}")
    return (f"trainer engine: deepspeed ZeRO-3 over all {math.prod(mesh.shape)} trainer(s), no hpZ partition: "
            f"{mesh.reason}")


def user_config_name(recipe: Recipe) -> str:
    """How messages name the user's DeepSpeed settings: the field, and its file's name."""
    t = recipe.trainer
    if isinstance(t.deepspeed_config, str) and t.deepspeed_config:
        return f"trainer.deepspeed_config ({Path(t.deepspeed_config).name})"
    if t.deepspeed_config:
        return "trainer.deepspeed_config"
    if t.accelerate_config:
        return f"trainer.accelerate_config ({Path(t.accelerate_config).name})"
    return "trainer.deepspeed_config"


def not_honoured(user: dict) -> list[str]:
    """The user's JSON keys hpcrl sets otherwise, each with what it does instead."""
    out = []
    for dotted, why in JSON_NOT_HONOURED.items():
        value = _get(user, dotted)
        if value not in (None, False) and not (isinstance(value, dict) and not value):
            out.append(f"{dotted} ({why})")
    return out


def asked_offloads(user: dict) -> dict[str, bool]:
    """The trainer.offload_* flags the user's DeepSpeed settings switch on (device "cpu")."""
    return {flag: True for flag, section in (("offload_optimizer", "offload_optimizer"), ("offload_params", "offload_param"))
            if _get(user, f"zero_optimization.{section}.device") == "cpu"}


def merge_user(configs: list[tuple[str, dict]]) -> dict:
    """The user's DeepSpeed settings from several places (a JSON, an accelerate config) as one
    mapping; a key two of them set differently ("auto" gives way to a value) is a UserError naming
    both."""
    merged: dict = {}
    origin: dict[str, str] = {}
    for name, config in configs:
        for dotted, value in _leaves(config):
            before = _get(merged, dotted)
            if dotted in origin and AUTO not in (before, value) and not _equal(before, value):
                raise UserError(f"{name}: {dotted} {_show(value)} conflicts with {origin[dotted]}'s "
                                f"{_show(before)}; set one of them")
            if dotted not in origin or before == AUTO:     # "auto" gives way to a value
                origin[dotted] = name
                _set(merged, dotted, value)
    return merged


# ------------------------------------------------------------------------- accelerate configs
def read_accelerate_config(data: dict, where: str) -> tuple[dict, list[str]]:
    """An (already parsed) accelerate config file -> (its DeepSpeed settings as a DeepSpeed config
    fragment, the fields hpcrl cannot honour, each "name (why)"). The fragment's owned keys are
    checked against the recipe like a DeepSpeed JSON's. `deepspeed_config_file`, a DeepSpeed JSON
    to read as well, is deepspeed_config_file()'s."""
    if not isinstance(data, dict):
        raise UserError(f"{where}: not an accelerate config (a mapping of fields), got {type(data).__name__}")
    kind = data.get("distributed_type", "DEEPSPEED")
    if kind != "DEEPSPEED":
        raise UserError(f"{where}: distributed_type {kind!r}: hpcrl reads an accelerate config for its DeepSpeed "
                        f"settings only (distributed_type: DEEPSPEED); for FSDP leave trainer.accelerate_config out "
                        f"and use trainer.engine=fsdp2")
    ds = data.get("deepspeed_config") or {}
    if not isinstance(ds, dict):
        raise UserError(f"{where}: deepspeed_config: expected a mapping of DeepSpeed settings, got {ds!r}")
    fragment: dict = {}
    _accelerate_precision(data.get("mixed_precision"), fragment, where)
    if ds.get("zero_stage") is not None:
        _set(fragment, "zero_optimization.stage", ds["zero_stage"])
    for key, section in (("offload_optimizer_device", "offload_optimizer"), ("offload_param_device", "offload_param")):
        device = ds.get(key)
        if device is None:
            continue
        if device not in OFFLOAD_DEVICES:
            raise UserError(f"{where}: deepspeed_config.{key} {device!r}: hpcrl offloads to host memory only "
                            f"(cpu) or not at all (none)")
        _set(fragment, f"zero_optimization.{section}.device", device)
    for key in ("gradient_accumulation_steps", "gradient_clipping"):
        if ds.get(key) is not None:
            fragment[key] = ds[key]
    return fragment, _accelerate_not_honoured(data, ds)


def deepspeed_config_file(data: dict) -> str:
    """The DeepSpeed JSON an accelerate config names (deepspeed_config.deepspeed_config_file), or ""."""
    ds = data.get("deepspeed_config") if isinstance(data, dict) else None
    value = ds.get("deepspeed_config_file") if isinstance(ds, dict) else None
    return value if isinstance(value, str) and value.lower() != "none" else ""


def _accelerate_precision(precision: Any, fragment: dict, where: str) -> None:
    if precision is None:
        return
    if precision not in ("bf16", "no"):
        raise UserError(f"{where}: mixed_precision {precision!r}: hpcrl trains in bf16 or fp32 (mixed_precision "
                        f"bf16 or no, as grpo.bf16 says)")
    fragment["bf16"] = {"enabled": precision == "bf16"}


def _accelerate_not_honoured(data: dict, ds: dict) -> list[str]:
    reasons: dict[str, list[str]] = {}
    for key, value in [*data.items(), *ds.items()]:
        if key in ACCELERATE_IGNORED or key in ACCELERATE_DEEPSPEED_READ or key.startswith("tpu_"):
            continue
        if value in (None, "", {}, []):
            continue
        if value in ACCELERATE_QUIET_VALUES.get(key, ()):
            continue
        why = ACCELERATE_NOT_HONOURED.get(key, "not read by hpcrl")
        reasons.setdefault(why, []).append(key)
    return [f"{', '.join(keys)} ({why})" for why, keys in reasons.items()]


# ------------------------------------------------------------------------- the owned keys
def _agree(theirs: Any, ours: Any, key: str, field: str, where: str) -> Any:
    """Ours, once the user's value for `key` ("auto", or absent, or equal) agrees with it."""
    if theirs != AUTO and not _equal(theirs, ours):
        raise UserError(f"{where}: {key} {_show(theirs)} conflicts with {field} {_show(ours)}; set one of them")
    return ours


def _section(config: dict, key: str, where: str) -> dict:
    value = config.get(key) or {}
    if not isinstance(value, dict):
        raise UserError(f"{where}: {key}: expected a mapping, got {_show(value)}")
    return value


def _refuse_enabled(config: dict, section: str, why: str, where: str) -> None:
    """A section that would train other than the recipe says: refused when on; when off (false,
    or Hugging Face's "auto", which its Trainer turns off too) its other keys ask for nothing."""
    enabled = _section(config, section, where).get("enabled", False)
    if enabled not in (False, AUTO):
        raise UserError(f"{where}: {section}.enabled {_show(enabled)}: {why}; set it false or leave {section} out")
    config.pop(section, None)


def _bf16_section(config: dict, bf16: bool | None, device_type: str, where: str) -> dict:
    # "bfloat16" is DeepSpeed's older name of the same section.
    section = {**_section(config, "bfloat16", where), **_section(config, "bf16", where)}
    config.pop("bfloat16", None)
    for key in BF16_REFUSED:
        if section.get(key) not in (None, False):
            raise UserError(f"{where}: bf16.{key} {_show(section[key])}: hpcrl keeps fp32 master weights, "
                            f"gradients and AdamW state (16 B a parameter); set it false or leave it out")
    ours = bf16_enabled(bf16, device_type)
    theirs = section.get("enabled", AUTO)
    if bf16 is None and theirs != AUTO and not _equal(theirs, ours):
        raise UserError(f"{where}: bf16.enabled {_show(theirs)} conflicts with grpo.bf16 unset ({'bf16' if ours else 'fp32'} "
                        f"on {device_type}); set grpo.bf16={_show(theirs)} or change one of them")
    return {**section, "enabled": _agree(theirs, ours, "bf16.enabled", "grpo.bf16", where)}


def _zero_section(config: dict, recipe: Recipe, hpz: int, device_type: str, hidden_size: int | None,
                  where: str) -> dict:
    zero = dict(_section(config, "zero_optimization", where))
    stage = zero.get("stage", AUTO)
    if stage != AUTO and stage != 3:
        raise UserError(f"{where}: zero_optimization.stage {_show(stage)}: trainer.engine=deepspeed runs ZeRO "
                        f"stage 3 (parameters, gradients and optimizer state sharded); set 3 or leave it out")
    zero["stage"] = 3
    zero["zero_hpz_partition_size"] = _agree(zero.get("zero_hpz_partition_size", AUTO), hpz,
                                             "zero_optimization.zero_hpz_partition_size",
                                             "trainer.mesh's hpZ partition (chosen as the mesh)", where)
    t = recipe.trainer
    for section, asked, field in (("offload_optimizer", t.offload_optimizer, "trainer.offload_optimizer"),
                                  ("offload_param", t.offload_params, "trainer.offload_params")):
        offload = _offload_section(zero, section, asked, field, device_type, where)
        if offload is None:
            zero.pop(section, None)
        else:
            zero[section] = offload
    # hpcrl writes the Hugging Face model itself, bucket by bucket: never a whole 16-bit copy.
    zero.pop("gather_16bit_weights_on_model_save", None)
    zero["stage3_gather_16bit_weights_on_model_save"] = False
    for key, fill in HIDDEN_SIZE_AUTO.items():
        if zero.get(key) == AUTO:
            if hidden_size:
                zero[key] = fill(hidden_size)
            else:
                del zero[key]
    return zero


def _offload_section(zero: dict, section: str, asked: bool, field: str, device_type: str,
                     where: str) -> dict | None:
    """zero_optimization.<section> for the recipe's offload flag and the user's own section (either
    one asking is enough; asking for none against the flag is a conflict); None: no offload."""
    theirs = zero.get(section)
    if theirs is None:
        theirs = {}
    if not isinstance(theirs, dict):
        raise UserError(f"{where}: zero_optimization.{section}: expected a mapping, got {_show(theirs)}")
    device = theirs.get("device", AUTO)
    if device not in (AUTO, *OFFLOAD_DEVICES):
        raise UserError(f"{where}: zero_optimization.{section}.device {_show(device)}: hpcrl offloads to host "
                        f"memory only (\"cpu\") or not at all (\"none\")")
    if asked and device == "none":
        raise UserError(f"{where}: zero_optimization.{section}.device \"none\" conflicts with {field} true; "
                        f"set one of them")
    if not asked and device != "cpu":
        return None
    # Pinned host memory copies to and from a GPU asynchronously; a CPU trainer has nothing to pin for.
    return {**theirs, "device": "cpu", "pin_memory": theirs.get("pin_memory", device_type != "cpu")}


def _check_optimizer(optimizer: Any, recipe: Recipe, where: str) -> None:
    """An optimizer section may only describe the AdamW hpcrl runs from grpo.*; it is then dropped
    (DeepSpeed takes hpcrl's optimizer object instead)."""
    if optimizer is None:
        return
    if not isinstance(optimizer, dict):
        raise UserError(f"{where}: optimizer: expected a mapping, got {_show(optimizer)}")
    kind = optimizer.get("type", AUTO)
    if kind != AUTO and str(kind).lower() not in ADAM_TYPES:
        raise UserError(f"{where}: optimizer.type {_show(kind)}: hpcrl's optimizer is AdamW from grpo.* "
                        f"(grpo.optim); set \"AdamW\" or leave the optimizer section out")
    params = optimizer.get("params") or {}
    if not isinstance(params, dict):
        raise UserError(f"{where}: optimizer.params: expected a mapping, got {_show(params)}")
    g = recipe.grpo
    ours = {"lr": (g.learning_rate, "grpo.learning_rate"), "betas": ([g.adam_beta1, g.adam_beta2],
                                                                     "[grpo.adam_beta1, grpo.adam_beta2]"),
            "eps": (g.adam_epsilon, "grpo.adam_epsilon"), "weight_decay": (g.weight_decay, "grpo.weight_decay")}
    for key, value in params.items():
        if key in ours:
            _agree(value, ours[key][0], f"optimizer.params.{key}", ours[key][1], where)
        elif key in ("adam_w_mode", "bias_correction"):
            if value is not True and value != AUTO:
                raise UserError(f"{where}: optimizer.params.{key} {_show(value)}: hpcrl's optimizer is torch's "
                                f"AdamW (decoupled weight decay, bias correction); set true or leave it out")
        elif key not in OPTIMIZER_IMPLEMENTATION:
            raise UserError(f"{where}: optimizer.params.{key}: hpcrl's optimizer is AdamW from grpo.*; its params "
                            f"may be only {', '.join(OPTIMIZER_PARAMS)} (\"auto\" or the recipe's values)")


def _check_scheduler(scheduler: Any, recipe: Recipe, where: str) -> None:
    """hpcrl runs grpo.lr_scheduler_type itself: a scheduler section may only say the same, with
    every parameter "auto" (as Hugging Face's Trainer fills them from the recipe's fields)."""
    if scheduler is None:
        return
    if not isinstance(scheduler, dict):
        raise UserError(f"{where}: scheduler: expected a mapping, got {_show(scheduler)}")
    wanted = recipe.grpo.lr_scheduler_type
    kind = scheduler.get("type", AUTO)
    if kind != AUTO and wanted not in SCHEDULERS.get(kind, ()):
        raise UserError(f"{where}: scheduler.type {_show(kind)} conflicts with grpo.lr_scheduler_type {_show(wanted)}"
                        f" (hpcrl runs it, with grpo.warmup_steps, itself); set one of them or leave the scheduler "
                        f"section out")
    params = scheduler.get("params") or {}
    if not isinstance(params, dict):
        raise UserError(f"{where}: scheduler.params: expected a mapping, got {_show(params)}")
    for key, value in params.items():
        if value != AUTO:
            raise UserError(f"{where}: scheduler.params.{key} {_show(value)}: hpcrl runs grpo.lr_scheduler_type "
                            f"with grpo.learning_rate and grpo.warmup_steps itself; set it \"auto\" or leave the "
                            f"scheduler section out")


def _refuse_leftover_auto(config: dict, where: str) -> None:
    """An "auto" hpcrl does not fill would reach DeepSpeed, which fails on it after the queue."""
    for dotted, value in _leaves(config):
        if value == AUTO:
            raise UserError(f"{where}: {dotted} \"auto\": hpcrl fills \"auto\" only in the keys it owns (batch "
                            f"sizes, gradient accumulation and clipping, bf16, fp16, the ZeRO stage, optimizer, "
                            f"scheduler) and, from the model's hidden size, {', '.join(HIDDEN_SIZE_AUTO)}; give a "
                            f"value or leave it out")


# ------------------------------------------------------------------------- plain mappings
def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def _show(value: Any) -> str:
    """A value as the user's JSON writes it."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _leaves(config: dict, prefix: str = ""):
    """(dotted key, value) of every non-mapping value (an empty mapping is a leaf)."""
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from _leaves(value, dotted + ".")
        else:
            yield dotted, value


def _get(config: dict, dotted: str) -> Any:
    node: Any = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _set(config: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = config
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[leaf] = copy.deepcopy(value)
