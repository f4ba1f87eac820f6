"""The trainers' device mesh for FSDP2: full sharding, or HSDP (shard inside a node, replicate
across nodes).

HSDP keeps the all-gathers of a weight sync inside the node, where the node's sender hands the
weights to its server: no weight bytes cross the interconnect for a sync. It needs one node's
trainers to hold the whole model with its optimizer state, so `auto` picks it only when that
fits; otherwise the model is sharded over every trainer of the job.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from hpcrl.job.placement import Plan
from hpcrl.job.spec import JobSpec

# Bytes per parameter of training state: fp32 master weights, fp32 gradients, two fp32 Adam
# moments (mixed precision keeps all of these in fp32).
TRAIN_BYTES_PER_PARAM = 16
REFERENCE_BYTES_PER_PARAM = 2      # a bf16 reference model when grpo.beta > 0
# Share of device memory the training state may take; activations, buffers and the gathered
# layers of FSDP need the rest.
STATE_MEMORY_SHARE = 0.6
# "demo:<size>" models are built locally and are all small: assume ~100M parameters.
DEMO_PARAMS = 100_000_000


@dataclass(frozen=True)
class MeshChoice:
    kind: str                          # "fsdp" or "hsdp"
    shape: tuple[int, ...]             # (trainers,) or (nodes, trainers per node)
    dim_names: tuple[str, ...]
    reason: str
    params: int | None = None

    def describe(self) -> str:
        dims = " x ".join(f"{n}={s}" for n, s in zip(self.dim_names, self.shape))
        return f"mesh {self.kind} ({dims}): {self.reason}"


def count_parameters(model_path: str) -> int | None:
    """Parameters of a local model: exact from safetensors headers, else estimated from
    config.json; None when neither can be read."""
    if model_path.startswith("demo:"):
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


def _safetensors_params(path: Path) -> int:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")


def _params_from_config(cfg: dict) -> int:
    """Decoder-only transformer (Llama/Qwen/Mistral layout): embeddings, attention, gated MLP."""
    cfg = cfg.get("text_config", cfg)
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    inter = cfg.get("intermediate_size", 4 * h)
    heads = cfg.get("num_attention_heads", 1)
    head_dim = cfg.get("head_dim") or h // heads
    kv = cfg.get("num_key_value_heads", heads)
    attn = h * heads * head_dim * 2 + h * kv * head_dim * 2
    per_layer = attn + 3 * h * inter + 2 * h
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings", False) else 2)
    return embed + layers * per_layer + h


def choose_mesh(spec: JobSpec, plan: Plan) -> MeshChoice:
    nodes, per_node = plan.nodes, plan.trainers_per_node

    def fsdp(reason: str, params: int | None = None) -> MeshChoice:
        return MeshChoice("fsdp", (plan.num_trainers,), ("shard",), reason, params)

    def hsdp(reason: str, params: int | None = None) -> MeshChoice:
        return MeshChoice("hsdp", (nodes, per_node), ("replicate", "shard"), reason, params)

    wanted = spec.recipe.trainer.mesh
    if wanted == "fsdp":
        return fsdp("set in the recipe (trainer.mesh)")
    if wanted == "hsdp":
        return hsdp("set in the recipe (trainer.mesh)")
    if nodes == 1:
        return fsdp("one node: sharding over its trainers is HSDP already")
    params = count_parameters(spec.recipe.model.path)
    node = spec.site.node
    per_gpu = node.gpu_memory_gb if spec.site.device == "cuda" else node.memory_gb / max(1, plan.tasks_per_node)
    if params is None:
        return fsdp(f"the size of {spec.recipe.model.path} is unknown: shard over all trainers to be safe")
    if not per_gpu:
        return hsdp("the site gives no memory size; assuming the model fits one node", params)
    per_param = TRAIN_BYTES_PER_PARAM + (REFERENCE_BYTES_PER_PARAM if spec.recipe.grpo.beta > 0 else 0)
    need_gb = params * per_param / 1e9
    have_gb = per_node * per_gpu * STATE_MEMORY_SHARE
    facts = (f"{params / 1e9:.2f}B parameters need ~{need_gb:.0f} GB of training state; one node's "
             f"{per_node} trainers have ~{have_gb:.0f} GB for it")
    if need_gb <= have_gb:
        return hsdp(f"{facts}: shard inside each node, replicate across nodes", params)
    return fsdp(f"{facts}: too little, shard over all {plan.num_trainers} trainers", params)


def build_mesh(choice: MeshChoice, device_type: str):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, choice.shape, mesh_dim_names=choice.dim_names)
