"""A model's shape and size, read from its directory on this machine: config.json for the shape,
the safetensors headers for the exact parameter count.

Standard library only: `hpcrl plan` and the checks of `hpcrl render`/`submit` read it on a login
node, before any weight is loaded (the memory estimate, hpcrl.job.estimate, starts from it).

No config.json (the locally built "demo:*" models, a path only the compute nodes see, a hub id):
no shape, and the reason why.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import NamedTuple

from hpcrl.job.demo import is_demo

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# "demo:<size>" models are built locally and are all small: assume ~100M parameters.
DEMO_PARAMS = 100_000_000
# Config keys of mixture-of-experts models: the number of routed experts, and of those active per token.
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_MOE_TOP_K = ("num_experts_per_tok", "moe_top_k", "num_experts_per_token")


class ModelShape(NamedTuple):
    """What the estimate needs of a decoder-only transformer (Llama/Qwen/Mistral layout; with
    ``experts``, a mixture-of-experts one: Qwen3-MoE, Mixtral, Qwen2-MoE, DeepSeek-style shared experts)."""
    hidden_size: int
    num_layers: int
    vocab_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    dtype: str                     # the checkpoint's: "bfloat16", "float16" or "float32"
    params: int                    # exact from safetensors headers where present, else from the shape
    # Mixture of experts (0: a dense MLP of intermediate_size): every layer's routed experts of
    # expert_intermediate each, experts_per_token of them active per token, and shared experts
    # (shared_intermediate in all) that every token passes through.
    experts: int = 0
    experts_per_token: int = 0
    expert_intermediate: int = 0
    shared_intermediate: int = 0
    model_type: str = ""           # config.json's (which of transformers' layouts, hpcrl.job.lora)

    @classmethod
    def from_config(cls, cfg: dict, params: int | None = None) -> "ModelShape":
        """From a Hugging Face config.json mapping (a multimodal model's `text_config` is its
        language model). KeyError or TypeError when it is not a decoder-only transformer's."""
        text = cfg.get("text_config") or cfg
        h = int(text["hidden_size"])
        heads = int(text.get("num_attention_heads", 1))
        dtype = str(text.get("torch_dtype") or text.get("dtype") or cfg.get("torch_dtype")
                    or cfg.get("dtype") or "float32").removeprefix("torch.")
        tie = text.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        inter = int(text.get("intermediate_size") or 4 * h)
        experts = next((int(text[k]) for k in _MOE_KEYS if isinstance(text.get(k), int) and text[k] > 1), 0)
        moe = {}
        if experts:
            expert_inter = int(text.get("moe_intermediate_size") or inter)      # Mixtral: intermediate_size
            shared = int(text.get("shared_expert_intermediate_size")
                         or (text.get("n_shared_experts") or 0) * expert_inter)
            moe = dict(experts=experts, expert_intermediate=expert_inter, shared_intermediate=shared,
                       experts_per_token=int(next((text[k] for k in _MOE_TOP_K if text.get(k)), 1)))
        shape = cls(hidden_size=h, num_layers=int(text["num_hidden_layers"]), vocab_size=int(text["vocab_size"]),
                    intermediate_size=inter, num_heads=heads,
                    num_kv_heads=int(text.get("num_key_value_heads") or heads),
                    head_dim=int(text.get("head_dim") or h // heads), tie_word_embeddings=bool(tie),
                    dtype=dtype if dtype in DTYPE_BYTES else "float32", params=0,
                    model_type=str(cfg.get("model_type") or text.get("model_type") or ""), **moe)
        return shape._replace(params=params or shape.params_from_shape())

    @property
    def active_intermediate(self) -> int:
        """The MLP width one token passes through: its experts' and the shared ones' (dense: the MLP's)."""
        if not self.experts:
            return self.intermediate_size
        return self.experts_per_token * self.expert_intermediate + self.shared_intermediate

    @property
    def mlp_params(self) -> int:
        h = self.hidden_size
        if not self.experts:
            return 3 * h * self.intermediate_size
        # every expert's gate, up and down projections, the router, the shared experts
        return self.experts * 3 * h * self.expert_intermediate + h * self.experts + 3 * h * self.shared_intermediate

    @property
    def layer_params(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        return attn + self.mlp_params + 2 * h

    @property
    def root_params(self) -> int:
        """Embeddings, final norm and LM head: the root FSDP group."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2) + self.hidden_size

    def params_from_shape(self) -> int:
        return self.root_params + self.num_layers * self.layer_params

    def linear_features(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of each linear layer of a decoder layer
        (hpcrl.job.lora.DECODER_LINEARS)."""
        h, q, kv, inter = (self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                           self.expert_intermediate or self.intermediate_size)
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def model_shape(model_path: str) -> tuple[ModelShape | None, str]:
    """(shape, "") from <model_path>/config.json, or (None, why there is none)."""
    if is_demo(model_path):
        return None, f"{model_path} is built in the job (no config.json)"
    root = Path(model_path)
    try:
        cfg = json.loads((root / "config.json").read_text())
    except FileNotFoundError:
        return None, f"no config.json in {model_path} on this machine"
    except (OSError, ValueError) as e:
        return None, f"cannot read {model_path}/config.json ({e.__class__.__name__})"
    if not isinstance(cfg, dict):
        return None, f"{model_path}/config.json is not a mapping"
    try:
        return ModelShape.from_config(cfg, count_parameters(model_path)), ""
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None, (f"{model_path}/config.json is not a decoder-only transformer's "
                      f"(hidden_size, num_hidden_layers, vocab_size)")


def count_parameters(model_path: str) -> int | None:
    """Parameters of a local model: exact from safetensors headers, else estimated from
    config.json; None when neither can be read."""
    if is_demo(model_path):
        return DEMO_PARAMS
    root = Path(model_path)
    if not root.is_dir():
        return None
    files = sorted(root.glob("*.safetensors"))
    if files:
        try:
            return sum(_safetensors_params(f) for f in files)
        except (OSError, ValueError, KeyError):
            pass
    try:
        return _params_from_config(json.loads((root / "config.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_safetensors_header(path: Path, max_bytes: int | None = None) -> dict:
    """A .safetensors file's JSON header (tensor name -> dtype, shape, offsets; "__metadata__"):
    8 bytes of little-endian length, then the JSON. ValueError for a file that is not one (or whose
    header is longer than `max_bytes`), OSError when it cannot be read."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file")
        (n,) = struct.unpack("<Q", head)
        # A length past the file's end is no header (a file that is not safetensors): reading it
        # would allocate whatever the first 8 bytes say.
        if n > path.stat().st_size - 8:
            raise ValueError(f"{path}: not a safetensors file (a header of {n} bytes in a file of "
                             f"{path.stat().st_size})")
        if max_bytes is not None and n > max_bytes:
            raise ValueError(f"{path}: a header of {n} bytes")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the header is not a JSON object")
    return header


def _safetensors_params(path: Path) -> int:
    header = read_safetensors_header(path)
    return sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")


def _params_from_config(cfg: dict) -> int:
    """Decoder-only transformer (Llama/Qwen/Mistral layout, dense or MoE): embeddings, attention, MLP."""
    return ModelShape.from_config(cfg).params_from_shape()

