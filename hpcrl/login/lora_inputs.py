"""model.lora_target_modules checked on the login node against the modules the model has, as peft
matches them: the demo models' modules are known, a model directory's are read from its weights'
names (an index, or the safetensors headers), never by loading them; model.lora_modules_to_save
against a head tied to the embeddings; model.lora_dropout where peft converts the targets to
parameters of a mixture of experts (which take no dropout). hpcrl.login.inputs calls `check_targets`,
`check_converted_dropout` and `check_modules_to_save` for recipes with LoRA only.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from hpcrl.job.config import closest
from hpcrl.job.demo import parse_demo_model
from hpcrl.job.errors import UserError
from hpcrl.job.lora import (ALL_LINEAR, DECODER_LINEARS, converted_dropout_error, converted_parameter_names,
                            decoder_linear_path, lora_target_matches, tied_copy_error)
from hpcrl.job.model_shape import model_shape, read_safetensors_header
from hpcrl.job.recipe import ModelConfig

# Decoder layers of the "demo:<size>" models (Qwen2, built in the job by hpcrl.compute.models.tiny,
# whose SIZES these follow; a test holds them equal).
DEMO_LAYERS = {"tiny": 4, "small": 10, "medium": 10, "base": 12, "large": 28}
# A weight file's JSON header is read up to this size (a header is a few MB at most).
SAFETENSORS_HEADER_MAX_BYTES = 256 << 20


class ModulePaths:
    """A model's module paths as peft sees them (model.layers.0.self_attn.q_proj, and every parent
    module), and which of them are linear layers, read from its weights' names without loading them."""

    def __init__(self, paths: set[str], linear: set[str]):
        self.paths, self.linear = paths, linear

    @classmethod
    def of(cls, modules: dict[str, bool]) -> "ModulePaths":
        """From {module path: whether it is a linear layer}: every parent module is a path too."""
        paths = set()
        for module in modules:
            parts = module.split(".")
            paths.update(".".join(parts[:n]) for n in range(1, len(parts) + 1))
        return cls(paths, {m for m, linear in modules.items() if linear})

    def linear_names(self) -> list[str]:
        """The linear layers' names (the last part of their paths), once each."""
        return sorted({m.rsplit(".", 1)[-1] for m in self.linear})


def demo_module_paths(path: str) -> ModulePaths | None:
    """A "demo:<size>[:random|:agent]" model's modules (Qwen2; the head is tied to the embeddings, but is
    a module of its own); None for a size this machine does not know (the job says so)."""
    layers = DEMO_LAYERS.get(parse_demo_model(path)[0])
    if layers is None:
        return None
    modules = {"model.embed_tokens": False, "model.norm": False, "lm_head": True}
    for layer in range(layers):
        modules[f"model.layers.{layer}.input_layernorm"] = False
        modules[f"model.layers.{layer}.post_attention_layernorm"] = False
        modules.update({decoder_linear_path(layer, name): True for name in DECODER_LINEARS})
    return ModulePaths.of(modules)


def checkpoint_module_paths(model_dir: Path) -> ModulePaths | None:
    """The modules a model directory's weights belong to: the names in its weight index
    (model.safetensors.index.json, pytorch_model.bin.index.json), else in its *.safetensors
    headers, less the parameter's own name (".weight", ".bias"). A linear layer is a module with a
    two-dimensional weight that is no embedding (where only an index gives names and no shapes: a
    weight that is no norm's or embedding's). None when no weight names can be read here."""
    names: dict[str, list | None] = {}          # tensor name -> shape (None: unknown)
    for index in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        try:
            weight_map = json.loads((model_dir / index).read_text()).get("weight_map")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(weight_map, dict) and weight_map:
            names = dict.fromkeys(weight_map)
            for file in sorted(set(map(str, weight_map.values()))):
                names.update({k: v for k, v in _tensor_shapes(model_dir / file).items() if k in names})
            break
    if not names:
        for file in sorted(model_dir.glob("*.safetensors")):
            names.update(_tensor_shapes(file))
    if not names:
        return None
    modules: dict[str, bool] = {}
    for name, shape in names.items():
        module, _, param = name.rpartition(".")
        if not module:
            continue
        last = module.rsplit(".", 1)[-1]
        embedding_or_norm = bool(re.search(r"embed|norm|^wte$|^wpe$|^ln", last))
        linear = param == "weight" and not embedding_or_norm and (shape is None or len(shape) == 2)
        modules[module] = modules.get(module, False) or linear
    if "lm_head" not in modules and _tied_head(model_dir):
        modules["lm_head"] = True           # the head shares the embeddings' weight; its module exists
    return ModulePaths.of(modules)


def _tensor_shapes(file: Path) -> dict[str, list | None]:
    """A .safetensors file's tensor names -> shapes, from its header; {} when it cannot be read here."""
    if file.suffix != ".safetensors":
        return {}
    try:
        header = read_safetensors_header(file, SAFETENSORS_HEADER_MAX_BYTES)
    except (OSError, ValueError):
        return {}
    return {k: (v.get("shape") if isinstance(v, dict) else None) for k, v in header.items() if k != "__metadata__"}


def _tied_head(model_dir: Path) -> bool:
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(cfg, dict):
        return False
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
    return bool(text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", True)))


def check_targets(model: ModelConfig, modules: ModulePaths | None) -> None:
    """model.lora_target_modules must name modules the model has, as peft matches them: each name
    a module path that is it or ends with "." + it; one string (not "all-linear") a regular
    expression matching a whole path. None and "all-linear" are peft's to resolve."""
    targets = model.lora_target_modules
    if not model.use_peft or targets is None or targets == ALL_LINEAR or modules is None or not modules.paths:
        return
    names = modules.linear_names()
    if isinstance(targets, str):
        if not any(lora_target_matches(targets, p) for p in modules.paths):
            example = next((p for p in sorted(modules.linear) if ".0." in p), min(modules.linear, default=""))
            raise UserError(f"model.lora_target_modules: the regular expression \"{targets}\" matches no module "
                            f"path of {model.path} (it must match a whole path, e.g. \"{example}\"); its linear "
                            f"layers: {', '.join(names)}")
        return
    missing = [t for t in targets if not any(lora_target_matches((t,), p) for p in modules.paths)]
    if missing:
        hint = closest(missing[0], names) if len(missing) == 1 else ""
        raise UserError(f"model.lora_target_modules: {', '.join(f'{t!r}' for t in missing)} "
                        f"{'matches' if len(missing) == 1 else 'match'} no module of {model.path}{hint}; "
                        f"its linear layers: {', '.join(names)}")


def check_modules_to_save(model: ModelConfig, model_dir: Path | None) -> None:
    """model.lora_modules_to_save where the head is tied to the embeddings (a demo model's, or a
    config.json that says so), refused as the job would refuse it (hpcrl.compute.train.lora)."""
    if not model.lora_modules_to_save:
        return
    if model_dir is None:
        tied = True                         # the demo models tie their head
    else:
        try:
            tied = json.loads((Path(model_dir) / "config.json").read_text()).get("tie_word_embeddings") is True
        except (OSError, ValueError):
            return
    if tied:
        raise UserError(tied_copy_error(model.lora_modules_to_save))


def check_converted_dropout(model: ModelConfig, model_dir: Path) -> None:
    """model.lora_dropout with a model.lora_target_modules that peft converts to parameters of this
    mixture-of-experts model (hpcrl.job.lora.peft_converted_targets: Llama's expert names or
    "all-linear" on Qwen3-MoE, say): peft refuses dropout there, and the job would say so seconds in;
    TRL's default is 0.05."""
    if not model.lora_dropout:
        return
    shape, _ = model_shape(str(model_dir))
    converted = converted_parameter_names(shape, model.lora_target_modules) if shape else []
    if converted:
        raise UserError(converted_dropout_error(model.lora_dropout, converted))
