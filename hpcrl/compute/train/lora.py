"""LoRA in one place (recipe model.use_peft, TRL's names): adapters added, switched off, written out.

peft's own LoRA layers are injected into the Hugging Face model (``inject_adapter_in_model``: no
``PeftModel`` wrapper, so parameter names stay the model's, with ``.base_layer`` and
``.lora_A.default`` segments): before sharding on the meta device, and into rank 0's source model
before it streams the weights (hpcrl.compute.train.fsdp), so both have the same tensors and the
adapters start from the same seeded initialisation on every run. The base weights are frozen and
stored in the training dtype; the adapters are fp32 and the only trainable parameters, so gradients
and AdamW state exist for them alone, and FSDP2 shards them with their layer.

- The reference model is the policy with its adapters switched off (:class:`BaseModel`): no
  second copy of the weights.
- DoRA (model.use_dora): peft's layers also train a magnitude per output row (fp32, initialised to
  the base weight's row norms), and the merged weight is rescaled to it.
- model.lora_target_parameters: peft's ParamWrapper adapts a parameter itself (a MoE layer's fused
  expert stack: an adapter per expert), merging W + s B A into the parameter for each forward; two
  on one module nest (``experts.base_layer`` wraps the other stack). Each stack is sent merged
  expert by expert (hpcrl.compute.sync.gather.MergedWeight).
- model.lora_modules_to_save: peft wraps each such module, keeping the original (frozen, what the
  reference computes with) and training a copy in fp32; the engines get the copy under the
  module's name (hpcrl.compute.sync.gather), and the adapter directory holds it as peft writes it.
- The engines get the merged weights W + scale * B A: hpcrl.compute.sync.gather sends each LoRA
  layer as one ``MergedWeight``, merged layer by layer inside the bucketed gather; after the first
  sync only the layers that carry adapters move (``changing_params``).
- Checkpoints hold the trainable parameters only (the adapters) and their optimizer state; the
  frozen base comes from model.path again on resume.
- The run's model directory is a peft adapter directory (adapter_config.json,
  adapter_model.safetensors, the tokenizer) that ``PeftModel.from_pretrained(base, dir)`` loads;
  with checkpoint.save_merged_model, the merged model is written beside it in ``merged/``.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpcrl.compute.sync.gather import lora_layers, unwrapped_name
from hpcrl.job.errors import UserError
from hpcrl.job.lora import converted_dropout_error, lora_target_matches, tied_copy_error
from hpcrl.job.recipe import ModelConfig

__all__ = ["ADAPTER", "ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "MERGED_DIR", "lora_config", "add_adapters",
           "lora_layers", "parameter_wrappers", "adapted_parameter", "injected_config", "saved_module_paths",
           "modules_to_save", "SAVED_COPY", "adapters_disabled", "BaseModel", "adapter_tensors", "peft_key",
           "gather_adapters", "write_adapter_dir"]

ADAPTER = "default"                 # peft's name for the one adapter
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MERGED_DIR = "merged"               # checkpoint.save_merged_model: <model dir>/merged


def lora_config(model: ModelConfig, base_model: str = "", saved_modules: list[str] | None = None) -> Any:
    """peft's ``LoraConfig`` for a recipe's model section (TRL's get_peft_config, the same fields);
    ``saved_modules``: model.lora_modules_to_save as this model's own module paths."""
    from peft import LoraConfig

    targets = model.lora_target_modules
    return LoraConfig(r=model.lora_r, lora_alpha=model.lora_alpha, lora_dropout=model.lora_dropout,
                      target_modules=list(targets) if isinstance(targets, tuple) else targets,
                      use_rslora=model.use_rslora, use_dora=model.use_dora, task_type=model.lora_task_type,
                      target_parameters=list(model.lora_target_parameters or ()) or None,
                      bias="none", modules_to_save=saved_modules or None,
                      base_model_name_or_path=base_model or None)


def saved_module_paths(model: nn.Module, names: tuple[str, ...]) -> list[str]:
    """model.lora_modules_to_save's names -> the module paths of this model. ``lm_head`` is the output
    embeddings and ``embed_tokens`` the input embeddings whatever an architecture calls them (gpt_neox:
    ``gpt_neox.embed_in``), as transformers finds them; the whole path, as peft matches a name against
    every module path's end and a bare ``embed_tokens`` would also match a vision tower's."""
    getters = {"lm_head": "get_output_embeddings", "embed_tokens": "get_input_embeddings"}
    paths = {id(m): name for name, m in model.named_modules()}
    found, missing = [], []
    for name in names:
        getter = getattr(model, getters[name], None)
        module = getter() if getter is not None else None
        if module is not None and id(module) in paths:
            found.append(paths[id(module)])
        else:
            missing.append(name)
    if missing:
        raise UserError(f"model.lora_modules_to_save: {', '.join(missing)}: this model has no such module "
                        f"(lm_head: its output embeddings; embed_tokens: its input embeddings)")
    return found


def add_adapters(model: nn.Module, recipe_model: ModelConfig) -> nn.Module:
    """Inject LoRA adapters into ``model`` in place (on the meta device or a real one): fp32
    adapters, the only parameters with ``requires_grad``. A target that matches no module is the
    recipe's mistake: one line naming model.lora_target_modules."""
    from peft import inject_adapter_in_model

    saved_paths = saved_module_paths(model, recipe_model.lora_modules_to_save or ())
    # peft converts the config in place for a model transformers 5 holds otherwise than its checkpoint:
    # on a mixture-of-experts model, the expert linears a name like gate_proj reached in
    # transformers 4 become target_parameters on the fused stacks (gate_up_proj at twice the rank).
    config = lora_config(recipe_model, saved_modules=saved_paths)
    try:
        model = inject_adapter_in_model(config, model)
    except ValueError as e:
        if recipe_model.lora_target_parameters and "target_parameters" in str(e):
            # No module targets (None: peft takes only the parameters then) and no parameter matched.
            _check_parameter_targets(model, recipe_model.lora_target_parameters, {})
        if "does not work with lora_dropout" in str(e):
            converted = sorted(set(config.target_parameters or ()) - set(recipe_model.lora_target_parameters or ()))
            raise UserError(converted_dropout_error(recipe_model.lora_dropout, converted)) from None
        if "not found in the base model" in str(e) or "target_modules" in str(e) or "Cannot convert" in str(e):
            raise UserError(f"model.lora_target_modules: {str(e).splitlines()[0]}") from None
        raise
    layers = lora_layers(model)
    if not layers:
        raise UserError(f"model.lora_target_modules: {recipe_model.lora_target_modules!r} adapted no layer")
    _check_parameter_targets(model, recipe_model.lora_target_parameters or (), layers)
    _check_module_targets(model, recipe_model.lora_target_modules, config, layers)
    setattr(model, _INJECTED, config)
    if "lm_head" in layers and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        # The output head IS the embedding matrix here: an adapter on it would have to untie the two
        # in the engines, which load one tensor for both.
        raise UserError("model.lora_target_modules: lm_head is tied to the input embeddings in this model; "
                        "leave it out (\"all-linear\" does)")
    saved = modules_to_save(model)
    if saved and getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        raise UserError(tied_copy_error(recipe_model.lora_modules_to_save))
    for param in model.parameters():
        param.requires_grad_(False)
    for wrapper in saved.values():
        # The trained copy, fp32 as the adapters (the original stays frozen, for the reference).
        wrapper.modules_to_save[ADAPTER].to(dtype=torch.float32).requires_grad_(True)
    for layer in layers.values():
        dora = getattr(layer, "lora_magnitude_vector", {})
        for module in (layer.lora_A[ADAPTER], layer.lora_B[ADAPTER], *([dora[ADAPTER]] if ADAPTER in dora else [])):
            # Adapters train in fp32 whatever the base is stored in (FSDP2's mixed precision casts
            # them to the compute dtype for the forward, and reduces their gradients in fp32).
            module.to(dtype=torch.float32)
            module.weight.requires_grad_(True)
    return model


def parameter_wrappers(model: nn.Module) -> dict[str, nn.Module]:
    """peft's adapters on parameters (model.lora_target_parameters) by module path. Two on one module
    nest: the outer wraps the inner as its ``base_layer``, and both reach the module's parameter
    through ``get_base_layer()``."""
    return _parameter_wrappers(lora_layers(model))


def _parameter_wrappers(layers: dict[str, nn.Module]) -> dict[str, nn.Module]:
    return {path: layer for path, layer in layers.items() if hasattr(layer, "parameter_name")}


def adapted_parameter(path: str, wrapper: nn.Module) -> str:
    """A parameter wrapper's parameter by its name in the model without adapters (peft's key:
    mlp.experts.gate_up_proj), from the wrapper's module path."""
    return unwrapped_name(f"{path}.{wrapper.parameter_name}")


_INJECTED = "_hpcrl_lora_config"       # the model's attribute: the config peft injected, as it converted it


def injected_config(model: nn.Module) -> Any:
    """The LoraConfig :func:`add_adapters` injected, as peft converted it (target_parameters, and the
    rank and alpha patterns of fused stacks): what an adapter directory's config must say."""
    return getattr(model, _INJECTED)


def _check_module_targets(model: nn.Module, targets, config: Any, layers: dict[str, nn.Module]) -> None:
    """Each name of a model.lora_target_modules list adapted a module, or peft converted it to a
    parameter target (``config`` after injection no longer lists it). peft is silent about a name
    that matched nothing while another one did. The login node checks the names against the
    checkpoint's modules (hpcrl.login.lora_inputs). ``layers``: the model's :func:`lora_layers`."""
    if not isinstance(targets, tuple):
        return                      # peft's default, "all-linear", or a regular expression
    wrapped = _parameter_wrappers(layers)
    adapted = [path for path in layers if path not in wrapped]
    converted = set(targets) - set(config.target_modules or ())
    missing = [t for t in targets if t not in converted and not any(lora_target_matches((t,), p) for p in adapted)]
    if not missing:
        return
    linear = sorted({name.removesuffix(".base_layer").rsplit(".", 1)[-1] for name, m in model.named_modules()
                     if isinstance(m, nn.Linear) and ".lora_" not in name})
    stacked = _stacked_parameters(model)
    hint = (f"; its experts are stacked parameters ({', '.join(stacked[:4])}), which model.lora_target_parameters "
            f"adapts" if stacked else "")
    raise UserError(f"model.lora_target_modules: {', '.join(map(repr, missing))} "
                    f"{'matches' if len(missing) == 1 else 'match'} no module of this model{hint}; its linear "
                    f"layers: {', '.join(linear)}")


def _stacked_parameters(model: nn.Module) -> list[str]:
    """The model's 3-D parameters (fused expert stacks), once per layer: model.layers.N.mlp.experts.gate_up_proj."""
    return sorted({re.sub(r"\.\d+\.", ".N.", unwrapped_name(name)) for name, p in model.named_parameters()
                   if p.dim() == 3})


def _check_parameter_targets(model: nn.Module, targets: tuple[str, ...], layers: dict[str, nn.Module]) -> None:
    """Each name of model.lora_target_parameters adapted a parameter: peft adapts what matches and
    says nothing of a name that matched nothing while another one did. ``layers``: the model's
    :func:`lora_layers` (none where peft refused them all)."""
    if not targets:
        return
    adapted = [adapted_parameter(path, w) for path, w in _parameter_wrappers(layers).items()]
    missing = [t for t in targets if not any(lora_target_matches((t,), a) for a in adapted)]
    if missing:
        # What could be meant: the parameters no module name reaches (3-D, as fused experts are).
        stacked = _stacked_parameters(model)
        raise UserError(f"model.lora_target_parameters: {', '.join(map(repr, missing))} "
                        f"{'matches' if len(missing) == 1 else 'match'} no parameter of this model (a name matches "
                        f"a parameter path that is it or ends with it); its stacked parameters: "
                        f"{', '.join(stacked[:6]) or 'none'}")


def modules_to_save(model: nn.Module) -> dict[str, nn.Module]:
    """peft's wrappers of model.lora_modules_to_save by module path: the original module, frozen, and
    the trained copy in ``modules_to_save["default"]``."""
    return {name: m for name, m in model.named_modules()
            if isinstance(getattr(m, "original_module", None), nn.Module)
            and ADAPTER in getattr(m, "modules_to_save", {})}


def _tuner_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "_disable_adapters")]


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """The base model, for the duration: every LoRA layer computes its base layer only.

    peft's own switch (``enable_adapters``) also flips requires_grad of the adapters, which would
    change what FSDP2 and the optimizer see; the flag it sets is all the forward reads."""
    layers = _tuner_layers(model)
    for layer in layers:
        layer._disable_adapters = True
    try:
        yield
    finally:
        for layer in layers:
            layer._disable_adapters = False


class BaseModel(nn.Module):
    """The reference model of a LoRA run: ``policy`` with its adapters switched off, in eval mode
    (no LoRA dropout), and no weights of its own. Called as the reference model is."""

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "policy", policy)      # not a submodule: its parameters are the policy's

    def forward(self, *args, **kwargs):
        was_training = self.policy.training
        self.policy.eval()
        try:
            with adapters_disabled(self.policy):
                return self.policy(*args, **kwargs)
        finally:
            self.policy.train(was_training)


# ------------------------------------------------------------------------------------- written out
_MAGNITUDE = f".lora_magnitude_vector.{ADAPTER}.weight"
SAVED_COPY = f".modules_to_save.{ADAPTER}."        # a trained copy's parameters (model.lora_modules_to_save)


def peft_key(name: str) -> str:
    """A LoRA parameter's name -> its key in a peft adapter file (what PeftModel.save_pretrained
    writes: the PeftModel's prefix, and no adapter name; DoRA's magnitude without its ".weight"; a
    trained copy of a whole module under the module's own name)."""
    name = name.replace(SAVED_COPY, ".")
    if name.endswith(_MAGNITUDE):
        name = name[:-len(".weight")]
    return "base_model.model." + name.replace(f".{ADAPTER}.", ".").removesuffix(f".{ADAPTER}")


def adapter_tensors(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``(name, parameter)`` of every adapter tensor (lora_A, lora_B, DoRA's magnitude, a trained copy
    of a module to save), in ``named_parameters()`` order."""
    return [(name, p) for name, p in model.named_parameters()
            if ".lora_A." in name or ".lora_B." in name or name.endswith(_MAGNITUDE) or SAVED_COPY in name]


def gather_adapters(model: nn.Module, writer: bool) -> dict[str, torch.Tensor] | None:
    """Every adapter matrix whole, by parameter name, on ``writer`` (None elsewhere). Every trainer
    calls it: each is gathered (a collective, in one order). Adapters are small (r x (in + out) per
    layer), so the writer holds all of them in host memory; so it does a module to save's copy
    (lm_head: vocabulary x hidden in fp32)."""
    from hpcrl.compute.sync.gather import full_tensor

    tensors = {}
    for name, param in adapter_tensors(model):
        full = full_tensor(param)
        if writer:
            tensors[name] = full.detach().to("cpu", copy=True).contiguous()
        del full
    return tensors if writer else None


def write_adapter_dir(directory: Path, tensors: dict[str, torch.Tensor], *, recipe_model: ModelConfig,
                      base_model: str, tokenizer: Any, wrappers: Iterable[str] = (), injected: Any = None) -> None:
    """A peft adapter directory in ``directory`` (which exists): adapter_model.safetensors with
    peft's keys, adapter_config.json naming the modules actually adapted (peft's default for the
    architecture, or what the recipe named) and the parameters, and the tokenizer. ``wrappers``: the
    module paths of the adapters on parameters (:func:`parameter_wrappers`), whose tensors are no
    module's target; ``injected``: :func:`injected_config` of the model, whose target_parameters and
    rank and alpha patterns (peft's conversion of a fused MoE model's targets) the config keeps."""
    from safetensors.torch import save_file

    save_file({peft_key(name): t for name, t in tensors.items()}, str(directory / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    config = lora_config(recipe_model, base_model, saved_modules=sorted(
        {name.split(SAVED_COPY)[0] for name in tensors if SAVED_COPY in name}))
    wrapped = set(wrappers)
    config.target_modules = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in tensors
                                    if ".lora_" in name and name.split(".lora_")[0] not in wrapped})
    if injected is not None and injected.target_parameters:
        config.target_parameters = sorted(injected.target_parameters)
        config.rank_pattern, config.alpha_pattern = dict(injected.rank_pattern), dict(injected.alpha_pattern)
    tokenizer.save_pretrained(directory)
    config.save_pretrained(str(directory))      # last: it makes the directory a model directory
