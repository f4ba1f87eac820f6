"""The context an engine serves a model with when inference.max_model_len is unset: what vLLM
derives from the model (TRL's vllm_max_model_length defaults to None, which means the same), read
from config.json and tokenizer_config.json without transformers, so that the login node can check
a recipe against it and the estimate can size the engine's KV cache.

vLLM's rule (vllm/config/model.py _get_and_verify_max_len, 0.32): the smallest of the length keys
of the text config (model_max_length, where set, wins), capped by the tokenizer's model_max_length,
times the RoPE scaling factor for RoPE types whose max_position_embeddings is not already scaled
(not for Gemma3); 2048 when the config names no length.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from hpcrl.job.demo import is_demo

# vLLM's keys, in its order (transformers_utils/model_arch_config_convertor.py).
LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
               "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
# RoPE types whose max_position_embeddings already counts the scaling.
_PRESCALED_ROPE = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")
VLLM_DEFAULT = 2048


class Context(NamedTuple):
    tokens: int
    source: str         # where the number comes from, for messages: "max_position_embeddings in config.json"


def _rope_factor(text: dict, model_type: str) -> float:
    if "gemma3" in model_type:
        return 1.0
    factor = 1.0
    for params in (text.get("rope_scaling"), text.get("rope_parameters")):
        if not isinstance(params, dict):
            continue
        # transformers 5 may key rope_parameters by layer type ("full_attention": {...})
        groups = [params] if "rope_type" in params or "type" in params else [p for p in params.values()
                                                                                  if isinstance(p, dict)]
        for rp in groups:
            kind = rp.get("rope_type") or rp.get("type") or "default"
            if kind not in _PRESCALED_ROPE and kind != "default" and isinstance(rp.get("factor"), (int, float)):
                factor = float(rp["factor"])
    return factor


def from_configs(cfg: dict, tokenizer_cfg: dict | None = None) -> Context:
    """The derived context of a model from its config.json (and tokenizer_config.json) mappings."""
    text = cfg.get("text_config") or cfg
    found = {k: text[k] for k in LENGTH_KEYS if isinstance(text.get(k), (int, float)) and text[k] > 0}
    if "model_max_length" in found:
        key = "model_max_length"
    elif found:
        key = min(found, key=lambda k: found[k])
    else:
        key = ""
    tokens, source = (float(found[key]), f"{key} in config.json") if key else (float(VLLM_DEFAULT),
                                                                               "vLLM's default (config.json names no length)")
    tok_max = (tokenizer_cfg or {}).get("model_max_length")
    if isinstance(tok_max, (int, float)) and 0 < tok_max < tokens:
        tokens, source = float(tok_max), "model_max_length in tokenizer_config.json"
    factor = _rope_factor(text, str(cfg.get("model_type", "")))
    if factor != 1.0:
        tokens, source = tokens * factor, f"{source} x RoPE scaling factor {factor:g}"
    return Context(int(tokens), source)


def _read(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def model_context(model_path: str, tokenizer_path: str = "") -> Context | None:
    """The context vLLM will serve the local model at ``model_path`` with (None: no readable
    config.json here, as for the demo:* models or a path only compute nodes see)."""
    if is_demo(model_path):
        return None
    cfg = _read(Path(model_path) / "config.json")
    if cfg is None:
        return None
    return from_configs(cfg, _read(Path(tokenizer_path or model_path) / "tokenizer_config.json"))
