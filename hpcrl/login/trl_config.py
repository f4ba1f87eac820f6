"""A `trl grpo --config` YAML as a recipe: TRL's flat keys -> hpcrl's sections.

A recipe may hold TRL's keys at its top level (model_name_or_path, dataset_name, reward_funcs, every
GRPOConfig field by its TRL name, ...) beside hpcrl's own sections (inference, trainer, resources,
...). translate() moves each TRL key to the recipe field with its meaning. A TRL key is one of:

- mapped: a GRPOConfig field hpcrl implements (grpo.<same name>) or a renamed one (RENAMED);
- inert: it changes nothing about what is trained in hpcrl (INERT says why: e.g. logging_steps,
  since every step is logged); `hpcrl recipe` lists these with the reason;
- at TRL's default: accepted whatever hpcrl does with it, since it asks for nothing TRL would not do;
- anything else: not implemented, and named with what to do. All such keys are named in one error.

TRL's names and defaults come from trl_fields.json (scripts/trl_fields.py writes it from the
installed TRL; the login side never imports trl, which imports torch).
"""

from __future__ import annotations

import dataclasses
import json
from functools import cache
from pathlib import Path
from typing import Any

from hpcrl.job.config import closest
from hpcrl.job.recipe import GRPOConfig, InferenceConfig, Recipe

# TRL name -> the recipe field of the same meaning, where the name or section differs.
RENAMED = {
    "model_name_or_path": "model.path",
    "model_revision": "model.revision",
    "dtype": "model.dtype",
    "trust_remote_code": "model.trust_remote_code",
    "attn_implementation": "model.attn_implementation",
    # TRL's ModelConfig LoRA fields: model.<same name> (hpcrl.job.recipe.ModelConfig).
    **{name: f"model.{name}" for name in ("use_peft", "lora_r", "lora_alpha", "lora_dropout",
                                          "lora_target_modules", "lora_task_type", "use_rslora", "use_dora",
                                          "lora_modules_to_save", "lora_target_parameters")},
    "dataset_name": "data.path",
    "dataset_train_split": "data.split",
    "dataset_config": "data.config",
    "dataset_test_split": "data.eval_split",
    "shuffle_dataset": "data.shuffle",
    # TRL's DatasetMixtureConfig: data.datasets takes TRL's DatasetConfig entries as they are.
    "datasets": "data.datasets",
    "test_split_size": "data.test_split_size",
    "output_dir": "checkpoint.output_dir",
    "vllm_gpu_memory_utilization": "inference.gpu_memory_utilization",
    "vllm_max_model_length": "inference.max_model_len",
    "vllm_tensor_parallel_size": "inference.tensor_parallel_size",
    "ddp_timeout": "launch.collective_timeout_s",
    "run_name": "name",
    # TRL's deprecated name, which its GRPOConfig still takes for vllm_importance_sampling_clip_max.
    "vllm_importance_sampling_cap": "grpo.vllm_importance_sampling_clip_max",
    # GRPOTrainer's arguments (not GRPOConfig fields, so not in trl_fields.json), as import paths.
    "tools": "agent.tools",
    "environment_factory": "agent.environment_factory",
    "rollout_func": "agent.rollout_func",
}

# TRL AsyncGRPOConfig's keys (not GRPOConfig fields): a configuration written for TRL's asynchronous
# trainer keeps its bound on staleness.
ASYNC_RENAMED = {"max_staleness": "inference.max_staleness"}

_LOGGED = "hpcrl logs every step to metrics.jsonl"
_ENGINES = "hpcrl starts its own inference engines on every node (the inference: section)"
_NO_DDP = "hpcrl's trainers are sharded with FSDP2 or DeepSpeed ZeRO-3, not DDP"
_LOADER = "hpcrl's trainers read prompts without a DataLoader"
# TRL keys that change nothing about what hpcrl trains, with the reason.
INERT = {
    "logging_steps": _LOGGED, "logging_first_step": _LOGGED, "logging_strategy": _LOGGED,
    "logging_nan_inf_filter": _LOGGED,
    "log_level": "hpcrl's log lines are fixed", "log_level_replica": "hpcrl's log lines are fixed",
    "log_on_each_node": "hpcrl's log lines are fixed",
    "disable_tqdm": "hpcrl shows a progress bar only on a terminal",
    "use_vllm": _ENGINES, "vllm_mode": _ENGINES, "vllm_server_host": _ENGINES, "vllm_server_port": _ENGINES,
    "vllm_server_base_url": _ENGINES, "vllm_server_timeout": "inference.start_timeout_s bounds the engines' start",
    "vllm_group_port": _ENGINES, "vllm_enable_sleep_mode": "hpcrl's engines have GPUs of their own",
    "ds3_gather_for_generation": "hpcrl never gathers the whole model to generate",
    "do_train": "hpcrl always trains",
    "project": "hpcrl names W&B and TensorBoard runs after the job",
    "dataloader_num_workers": _LOADER, "dataloader_pin_memory": _LOADER,
    "dataloader_persistent_workers": _LOADER, "dataloader_prefetch_factor": _LOADER,
    "remove_unused_columns": "every dataset column reaches the reward functions (TRL's GRPO does the same)",
    "ddp_find_unused_parameters": _NO_DDP, "ddp_bucket_cap_mb": _NO_DDP, "ddp_broadcast_buffers": _NO_DDP,
    "ddp_backend": "the site profile picks the collective backend",
    "local_rank": "the launcher sets the ranks",
    "save_on_each_node": "trainer rank 0 writes the model once",
    "save_only_model": "checkpoint-<step> model directories hold the model only; training state is checkpoint.every",
    "skip_memory_metrics": _LOGGED, "include_num_input_tokens_seen": _LOGGED,
    "torch_empty_cache_steps": "hpcrl frees its temporaries itself",
    "use_cpu": "the site profile says whether there are GPUs",
    "use_liger_kernel": "Liger's layer kernels compute the same model (TRL 1.16 applies only those, and "
                        "deprecates the option); hpcrl's loss already works in log-prob chunks",
    "torch_compile": "hpcrl runs the model uncompiled: the same training, without compile time",
    "torch_compile_backend": "hpcrl runs the model uncompiled", "torch_compile_mode": "hpcrl runs the model uncompiled",
    "log_unique_prompts": "completions.jsonl holds every completion with its prompt (logging.log_completions)",
    "data_seed": "TRL's GRPO sampler shuffles with seed, not data_seed (hpcrl's too)",
}
_LORA = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "lora_target_parameters",
         "lora_modules_to_save", "lora_task_type", "use_rslora", "use_dora")
# Where TRL itself ignores a key unless another one switches it on.
_ONLY_WITH = {
    "eval_strategy": ("no", ("eval_delay", "eval_accumulation_steps", "eval_do_concat_batches",
                             "eval_use_gather_object", "batch_eval_metrics", "bf16_full_eval", "fp16_full_eval",
                             "prediction_loss_only", "do_eval", "metric_for_best_model", "greater_is_better",
                             "load_best_model_at_end")),
    "use_peft": (False, _LORA),
    "load_in_4bit": (False, ("bnb_4bit_quant_type", "use_bnb_nested_quant", "bnb_4bit_quant_storage")),
    "push_to_hub": (False, ("hub_model_id", "hub_strategy", "hub_token", "hub_private_repo", "hub_always_push",
                            "hub_revision")),
    "datasets": ([], ("streaming", "test_split_size")),
}
# What TRL's CLI ignores when `datasets` is given (it loads the mixture, with a warning).
_MIXTURE_IGNORES = ("dataset_name", "dataset_config", "dataset_streaming")
# What to do instead, for TRL keys hpcrl does not implement.
NOT_IMPLEMENTED = {
    "load_in_4bit": "quantized training is not supported", "load_in_8bit": "quantized training is not supported",
    "fsdp": "hpcrl shards the model with FSDP2 itself (trainer.mesh)",
    "fsdp_config": "hpcrl shards the model with FSDP2 itself (trainer.mesh)",
    "fp16": "fp16 training is not supported; use bf16",
    "resume_from_checkpoint": "resume a run with `hpcrl submit --resume RUN_DIR`",
    "push_to_hub": "compute nodes have no internet; upload the model directory from a login node",
    "streaming": "streamed datasets are not supported: the prompts are read at start",
    "dataset_streaming": "streamed datasets are not supported: the prompts are read at start",
    "reward_weights": "reward_weights needs reward_funcs, one weight each",
    "log_completions": "set logging.log_completions to the number of completions to print",
    "report_to": 'hpcrl reports to "wandb" (offline) and "tensorboard"',
}
# GRPOTrainer's arguments a configuration may name beside reward_funcs; TRL's own CLI takes none of them.
TRAINER_ARGUMENTS = ("tools", "environment_factory", "rollout_func")
# The recipe fields they set: lists or mappings of import paths, whose errors name an item.
_PATH_ITEMS = ("agent.tools", "agent.environment_factory")
_REPORTERS = {"wandb": "logging.wandb", "tensorboard": "logging.tensorboard"}


@cache
def _table() -> dict[str, Any]:
    return json.loads((Path(__file__).with_name("trl_fields.json")).read_text())


@cache
def trl_fields() -> dict[str, Any]:
    """TRL's field name -> its default, for every key `trl grpo --config` takes."""
    return {name: f["default"] for name, f in _table()["fields"].items()}


def trl_version() -> str:
    return _table()["trl_version"]


def _sections() -> set[str]:
    return {f.name for f in dataclasses.fields(Recipe)}


def _grpo_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(GRPOConfig)}


@dataclasses.dataclass
class Translation:
    recipe: dict                                            # hpcrl's sections
    moved: dict[str, str] = dataclasses.field(default_factory=dict)       # TRL key -> recipe field
    inert: dict[str, str] = dataclasses.field(default_factory=dict)       # TRL key -> why it changes nothing
    problems: list[str] = dataclasses.field(default_factory=list)


def _same(value: Any, default: Any) -> bool:
    if isinstance(default, float) or isinstance(value, float):
        try:
            return float(value) == float(default)
        except (TypeError, ValueError):
            return False
    if default in (None, []) and value in (None, []):
        return True
    return value == default


def _put(out: dict, dotted: str, value: Any, key: str, t: Translation) -> None:
    *parents, leaf = dotted.split(".")
    node = out
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            t.problems.append(f"{key}: {'.'.join(parents)} is not a mapping; cannot set {dotted}")
            return
    if leaf in node:
        t.problems.append(f"{key}: sets {dotted}, which the recipe also sets; keep one of them")
        return
    node[leaf] = value
    t.moved[key] = dotted


def _is_model_path(name: str) -> bool:
    # TRL takes a string in reward_funcs that is no function for a reward model's name or path.
    return "/" in name or name.startswith(".") or Path(name).expanduser().is_dir()


def _rewards(data: dict, t: Translation, out: dict) -> None:
    funcs, weights = data.get("reward_funcs"), data.get("reward_weights")
    reward_model = data.get("reward_model_name_or_path")
    if funcs is None and reward_model is None:
        if weights is not None:
            t.problems.append(f"reward_weights: {NOT_IMPLEMENTED['reward_weights']}")
        return
    if isinstance(funcs, str):
        funcs = [funcs]
    funcs = funcs or []
    if not isinstance(funcs, list) or not all(isinstance(f, str) for f in funcs):
        t.problems.append(f"reward_funcs: expected a list of names or import paths, got {funcs!r}")
        return
    if reward_model is not None:
        if not isinstance(reward_model, str) or not reward_model:
            t.problems.append(f"reward_model_name_or_path: expected a model directory, got {reward_model!r}")
            return
        funcs = [reward_model, *funcs]          # first, as TRL's CLI puts it
        t.moved["reward_model_name_or_path"] = "rewards[0].model"
    if weights is not None and (not isinstance(weights, list) or len(weights) != len(funcs)):
        t.problems.append(f"reward_weights: expected one weight per reward function ({len(funcs)}), got {weights!r}")
        return
    if "rewards" in out:
        t.problems.append("reward_funcs: the recipe also has rewards:; keep one of them")
        return
    out["rewards"] = [{("model" if _is_model_path(f) or (i == 0 and reward_model) else "func"): f,
                       **({} if weights is None else {"weight": w})}
                      for i, (f, w) in enumerate(zip(funcs, weights or [None] * len(funcs)))]
    if data.get("reward_funcs") is not None:
        t.moved["reward_funcs"] = "rewards[].func (a model's path: rewards[].model)"
    if weights is not None:
        t.moved["reward_weights"] = "rewards[].weight"


def _trainer_argument(key: str, value: Any, t: Translation, out: dict) -> None:
    """tools, environment_factory, rollout_func (import paths) -> the agent section."""
    if value in (None, "", []):
        t.inert[key] = "GRPOTrainer's default (none)"
    else:
        _put(out, RENAMED[key], [value] if key == "tools" and isinstance(value, str) else value, key, t)


def _report_to(value: Any, t: Translation, out: dict) -> None:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list):
        t.problems.append(f"report_to: expected a name or a list of names, got {value!r}")
        return
    for name in names:
        if name in ("none", None):
            continue
        if name == "all":
            names = list(_REPORTERS)
    for name in names:
        if name in ("none", "all", None):
            continue
        if name not in _REPORTERS:
            t.problems.append(f"report_to: {name!r}: {NOT_IMPLEMENTED['report_to']}")
            continue
        _put(out, _REPORTERS[name], True, "report_to", t)


def _names_no_dtype(flat: dict, out: dict) -> bool:
    """Whether a configuration leaves the model's dtype to TRL's default (no dtype, no
    model_init_kwargs dtype, no model.dtype or checkpoint.model_dtype of hpcrl's)."""
    init = flat.get("model_init_kwargs") if isinstance(flat.get("model_init_kwargs"), dict) else {}
    return not ("dtype" in flat or {"dtype", "torch_dtype"} & set(init) or "dtype" in out.get("model", {})
                or "model_dtype" in out.get("checkpoint", {}))


def _vllm_mode(flat: dict) -> str:
    return str(flat.get("vllm_mode") or trl_fields()["vllm_mode"])


# model_init_kwargs (from_pretrained's keyword arguments) -> the recipe field of the same effect.
_MODEL_INIT = {"dtype": "model.dtype", "torch_dtype": "model.dtype", "trust_remote_code": "model.trust_remote_code",
               "attn_implementation": "model.attn_implementation"}
# from_pretrained arguments that change nothing about the loaded weights hpcrl trains.
_MODEL_INIT_INERT = ("device_map", "low_cpu_mem_usage", "use_cache")


def _model_init_kwargs(value: Any, t: Translation, out: dict) -> None:
    if not isinstance(value, dict):
        t.problems.append(f"model_init_kwargs: expected a mapping of from_pretrained's arguments, got {value!r}")
        return
    for name, arg in value.items():
        if name in _MODEL_INIT:
            _put(out, _MODEL_INIT[name], arg, f"model_init_kwargs.{name}", t)
        elif name in _MODEL_INIT_INERT:
            t.inert[f"model_init_kwargs.{name}"] = "hpcrl places and loads the model itself"
        else:
            t.problems.append(f"model_init_kwargs.{name}: not supported; hpcrl takes "
                              f"{', '.join(_MODEL_INIT)} (and ignores {', '.join(_MODEL_INIT_INERT)})")


def _checkpointing_kwargs(value: Any, t: Translation) -> None:
    """hpcrl checkpoints non-reentrantly (torch.utils.checkpoint use_reentrant=False); reentrant
    checkpointing computes the same gradients, so either value of use_reentrant trains the same."""
    if not isinstance(value, dict) or set(value) - {"use_reentrant"}:
        t.problems.append(f"gradient_checkpointing_kwargs: hpcrl takes only use_reentrant here, got {value!r}")
        return
    t.inert["gradient_checkpointing_kwargs"] = ("hpcrl checkpoints activations non-reentrantly "
                                                "(use_reentrant: false): the same gradients either way")


def _deepspeed(value: Any, t: Translation, out: dict) -> None:
    """TRL's `deepspeed` (a DeepSpeed JSON's path, or the configuration inline) trains with hpcrl's
    DeepSpeed ZeRO-3 engine; its keys are checked against the recipe at render (hpcrl.job.deepspeed)."""
    if not isinstance(value, (str, dict)):
        t.problems.append(f"deepspeed: expected a DeepSpeed JSON's path or the configuration as a mapping, "
                          f"got {value!r}")
        return
    _put(out, "trainer.deepspeed_config", value, "deepspeed", t)
    if "engine" not in out["trainer"]:
        out["trainer"]["engine"] = "deepspeed"     # a recipe's own trainer.engine=fsdp2 is refused, not overridden
        t.moved["deepspeed"] = "trainer.engine: deepspeed, trainer.deepspeed_config"


_UNKNOWN = object()


def _switch_value(switch: str, flat: dict, out: dict, whole: bool) -> Any:
    """An _ONLY_WITH switch's value: its TRL key, else the recipe field it maps to (a recipe's
    `model: {use_peft: true}` beside flat lora_r), else TRL's default in a whole configuration;
    _UNKNOWN in key=value overrides that do not set it (the configuration underneath does)."""
    if switch in flat:
        return flat[switch]
    dotted = RENAMED.get(switch) or (f"grpo.{switch}" if switch in _grpo_fields() else "")
    node: Any = out
    for part in dotted.split(".") if dotted else ():
        node = node.get(part, _UNKNOWN) if isinstance(node, dict) else _UNKNOWN
    if dotted and node is not _UNKNOWN:
        return node
    return trl_fields()[switch] if whole else _UNKNOWN


def in_trl_terms(message: str, t: Translation) -> str:
    """An error about a recipe field that one of the configuration's TRL keys set, named by that
    key first: "vllm_max_model_length (inference.max_model_len): ..." (the user wrote the TRL key)."""
    field_name, sep, rest = message.partition(": ")
    by_field = {dotted: key for key, dotted in t.moved.items()}
    # An item of a list or mapping of import paths (agent.tools[1], agent.environment_factory.wordle) is its key's.
    owner = next((f for f in _PATH_ITEMS if field_name.startswith((f + "[", f + "."))), field_name)
    key = by_field.get(owner)
    if not sep or key is None or key == field_name:
        return message
    return f"{key} ({field_name}): {rest}"


def translate(data: dict, whole: bool = True) -> Translation:
    """A recipe mapping that may hold TRL's keys -> hpcrl's sections, and what could not move.
    `whole`: a whole configuration (not key=value overrides), which must name a model and data."""
    sections, grpo_fields, fields = _sections(), _grpo_fields(), trl_fields()
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items() if k in sections}
    t = Translation(out)
    flat = {k: v for k, v in data.items() if k not in sections}
    # Keys whose switch is off (`off`), and those whose switch key=value overrides leave to the
    # configuration underneath (`unsure`): such a key still moves where it has a recipe field
    # (lora_r=8 over a configuration with use_peft: true), is named where hpcrl says it is not
    # implemented (use_dora=true), and is otherwise inert.
    off: dict[str, str] = {}
    unsure: dict[str, str] = {}
    for switch, (off_value, names) in _ONLY_WITH.items():
        value = _switch_value(switch, flat, out, whole)
        if value is _UNKNOWN:
            unsure.update(dict.fromkeys(names, switch))
        elif _same(value, off_value):
            off.update(dict.fromkeys(names, switch))
    _rewards(flat, t, out)
    mixture = bool(_switch_value("datasets", flat, out, whole=False) not in (_UNKNOWN, None, []))
    for key, value in flat.items():
        if key in ("reward_funcs", "reward_weights", "reward_model_name_or_path"):
            continue
        if key in TRAINER_ARGUMENTS:
            _trainer_argument(key, value, t, out)
            continue
        if key in ASYNC_RENAMED:
            _put(out, ASYNC_RENAMED[key], value, key, t)
            continue
        if mixture and key in _MIXTURE_IGNORES:
            t.inert[key] = "TRL loads `datasets` and ignores it when both are given"
            continue
        if key not in fields:
            hint = closest(key, [*fields, *sections])
            t.problems.append(f"{key}: unknown field{hint}; neither TRL's GRPO configuration (TRL "
                              f"{trl_version()}) nor a recipe section ({', '.join(sorted(sections))})")
        elif key in grpo_fields:
            _put(out, f"grpo.{key}", value, key, t)
        elif key in off:
            t.inert[key] = f"TRL uses it only with {off[key]}"
        elif key == "vllm_gpu_memory_utilization" and _vllm_mode(flat) == "colocate":
            # TRL's colocated engine shares a GPU with training, so its share leaves room for that;
            # hpcrl's engines have GPUs of their own, where the same number would idle most of it.
            t.inert[key] = (f"vllm_mode colocate's share of a GPU shared with training; hpcrl's engines have GPUs "
                            f"of their own (inference.gpu_memory_utilization, default "
                            f"{InferenceConfig.gpu_memory_utilization})")
        elif key in RENAMED:
            _put(out, RENAMED[key], value, key, t)
            if key == "vllm_tensor_parallel_size" and whole and "gpus" not in out.get("inference", {}):
                # TRL's one engine of that many GPUs, unless the recipe's inference: says otherwise
                out["inference"]["gpus"] = value
        elif key == "report_to":
            _report_to(value, t, out)
        elif key == "deepspeed" and value not in (None, ""):
            _deepspeed(value, t, out)
        elif key == "model_init_kwargs" and value is not None:
            _model_init_kwargs(value, t, out)
        elif key == "gradient_checkpointing_kwargs" and value is not None:
            _checkpointing_kwargs(value, t)
        elif key == "vllm_model_impl" and value != fields[key]:
            _put(out, "inference.engine_args.model_impl", value, key, t)
        elif key == "log_completions" and isinstance(value, bool):
            # TRL prints every completion when num_completions_to_print is unset; hpcrl prints 8 on
            # the console and writes every one to completions.jsonl.
            count = flat.get("num_completions_to_print")
            _put(out, "logging.log_completions", (count or 8) if value else 0, key, t)
        elif key == "num_completions_to_print":
            t.inert[key] = "the number of completions log_completions prints"
        elif key in INERT:
            t.inert[key] = INERT[key]
        elif key in unsure and key not in NOT_IMPLEMENTED:
            t.inert[key] = f"TRL uses it only with {unsure[key]}"
        elif _same(value, fields[key]):
            t.inert[key] = "TRL's default"
        else:
            why = NOT_IMPLEMENTED.get(key) or f"not implemented by hpcrl yet; remove it (TRL's default: {fields[key]!r})"
            t.problems.append(f"{key}: {why}")
    if whole and any(key in fields for key in flat) and _names_no_dtype(flat, out):
        # TRL's CLI loads the model in float32 (ModelConfig.dtype's default) and saves it so: the
        # run's model directories keep updates that bf16 would round away. The engines still serve
        # the checkpoint's dtype, as TRL's vLLM does.
        _put(out, "checkpoint.model_dtype", "float32", "dtype", t)
        t.moved["dtype"] = "checkpoint.model_dtype: float32 (TRL's default dtype, which it saves the model in)"
    if flat.get("eval_strategy") == "steps" and "eval_steps" not in flat and "logging_steps" in flat:
        # transformers evaluates every logging_steps when eval_steps is unset
        _put(out, "grpo.eval_steps", flat["logging_steps"], "logging_steps", t)
        t.inert.pop("logging_steps", None)
    # A configuration with TRL's keys must say what TRL requires (a typo alone does not make one).
    whole = whole and any(key in fields for key in flat)
    if whole and "model_name_or_path" not in flat and "path" not in out.get("model", {}):
        t.problems.append("model_name_or_path: required in a TRL configuration (a local Hugging Face model directory)")
    if whole and not mixture and "dataset_name" not in flat and "path" not in out.get("data", {}):
        t.problems.append("dataset_name: required in a TRL configuration (a local dataset file or directory), "
                          "or datasets (a mixture)")
    return t
