"""Will it fit? Memory per GPU for a job, estimated from the model's config.json before submitting,
and the trainers' mesh that the estimate (and the launch) assumes.

Standard library only: `hpcrl plan` and the checks of `hpcrl render`/`submit` run it on a login
node, and the launch (hpcrl.compute.launch) makes its mesh choice with the same code, so the plan a
user reads is the mesh that runs.

Sizes are in GiB (2**30 bytes), the unit a vendor's "64 GB" GCD or "80 GB" GPU is counted in and
the one the site files' `gpu_memory_gb` means; they are printed as "GB" like the site fields.

Trainer, per GPU (FSDP2 with the mixed precision of hpcrl.compute.train.fsdp):
  training state   16 B/param (fp32 master weights, fp32 gradients, two fp32 Adam moments) / shard
  reference        params x model.dtype ("auto": the compute dtype) / shard, when grpo.beta > 0 and not
                   trainer.reference_offload
  reward models    rewards[i].model's params, stored and sharded as the reference
  gathered layers  two decoder layers unsharded in the compute dtype (the one computing and the one
                   prefetched) + one layer's unsharded fp32 gradients (reduce dtype), + the root group
                   (embeddings, final norm, LM head) unsharded in the compute dtype with the head's
                   gradient, which the root keeps from the head's backward to the end of the backward
  activations      one micro-batch: per_device_train_batch_size x train_seq_len tokens (see
                   layer_activation_bytes, train_seq_len); with activation checkpointing each layer's input plus one
                   layer's activations, recomputed in its backward
  logits           micro-batch x (max_completion_length + 1) x vocabulary in the compute dtype, twice
                   (the logits and their gradient)
  log-prob chunk   4 fp32 [logprob_chunk_tokens x vocabulary] temporaries (upcast, tempered, exp of the
                   logsumexp, and its gradient)
  overhead         2 GiB on a GPU (CUDA/HIP context, NCCL/RCCL buffers, allocator fragmentation),
                   0.5 GiB for a CPU task
Shard: every trainer of the job for FSDP, the trainers of the fewest nodes that hold the step for
HSDP, one node's where they can (choose_mesh).

With trainer.engine=deepspeed (ZeRO-3; hpcrl.job.deepspeed) the same parts, for the same mesh: ZeRO-3
keeps the same 16 B a parameter (bf16: the parameter 2, its gradient 2, the fp32 master 4, two fp32
Adam moments 8; fp32: the parameter is its own master, with a 4 B gradient), and the hpZ partition of
an HSDP choice is counted as HSDP's shard (DeepSpeed shards the optimizer state over every trainer
and keeps a second copy of the parameters per node, which is less: the estimate errs high). On a GPU
site trainer.offload_optimizer moves all but the parameter (16 B less the compute dtype's) to host
memory, trainer.offload_params the parameter; the facts say how much host memory each trainer then
takes. DeepSpeed's own buckets (reduce_bucket_size, prefetch) are not counted beyond FSDP's gathered
layers.

With LoRA (model.use_peft; hpcrl.compute.train.lora), per GPU:
  frozen weights   every base parameter in model.dtype ("auto": the compute dtype), as the reference
                   above is stored, / shard: no gradients, no optimizer state
  training state   the adapters: r x (in_features + out_features) per adapted linear layer, 16 B each
                   (fp32 adapters, fp32 gradients, two fp32 Adam moments) / shard
  reference        none, whatever grpo.beta says: the reference is the policy with its adapters
                   switched off
  gathered layers  two decoder layers with their adapters in the compute dtype + one layer's adapter
                   gradients in fp32, + the root group in the compute dtype (the frozen head has no
                   gradient)
  activations      as above, less the inputs of the frozen linear layers (no weight gradient needs
                   them) unless an adapter takes them as they are (lora_dropout 0), + per adapted
                   linear layer and token its dropped input (compute dtype) and dropout mask (1 B)
                   when lora_dropout > 0, and lora_A's output (r values) (LoraTargets)
The adapted layers are read from model.lora_target_modules against the decoder layer's paths
(model.layers.N.self_attn.{q,k,v,o}_proj, model.layers.N.mlp.{gate,up,down}_proj), as peft matches
them: None is peft's default for Llama/Qwen/Mistral (q_proj and v_proj), "all-linear" all seven; an
adapter on lm_head is not counted (r x (hidden + vocabulary): a few MB).

Server, per GPU of one engine's tensor-parallel group (inference.tensor_parallel_size GPUs; a node
has inference.gpus / tensor_parallel_size engines, each generating for the trainers it serves):
  weights      params x serving dtype / tp (inference.dtype, else model.dtype; "auto" = the
               checkpoint's; vLLM serves a float32 checkpoint in bfloat16 on GPUs, float32 on CPU
               as hpcrl.compute.inference asks)
  KV cache     one sequence of the engine's context (inference.max_model_len, else the model's:
               vLLM will not start with less):
               2 x layers x kv heads per rank x head_dim x dtype bytes per token
  activations  vLLM's profiling forward: max_num_batched_tokens x (3 hidden + 3 intermediate / tp)
               x dtype bytes, + max_num_seqs x vocabulary x 8 (fp32 logits and probabilities);
               vLLM's defaults: 16384 tokens and 1024 sequences on GPUs of 70 GiB or more,
               8192 and 256 below (inference.engine_args may set either)
  overhead     1.5 GiB (context, NCCL, BLAS workspaces), + 0.5 GiB for CUDA graphs (the
               default on GPUs; none with inference.enforce_eager)
  against      inference.gpu_memory_utilization x the GPU's memory (vLLM's budget), the whole GPU for
               the transformers engine (which keeps the KV cache and the sampling scores of the node's
               whole batch at once, and counts them)
What is left of the budget is the KV cache for the batch: the verdict says how many of the node's
sequences it holds at once (fewer only means generation runs in waves).

Capacity per task: site.node.gpu_memory_gb on GPU sites; node.memory_gb / tasks per node on CPU
sites. No config.json (the locally built "demo:*" models, a path only the compute nodes see, a hub
id), a mixture-of-experts config, or an unknown memory size: no estimate, no verdict, no refusal.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path

from hpcrl.job import context
from hpcrl.job.placement import Plan
from hpcrl.job.recipe import TrainerConfig, engine_dtype
from hpcrl.job.spec import JobSpec

GIB = 2 ** 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# Bytes per parameter of training state: fp32 master weights, fp32 gradients, two fp32 Adam
# moments (mixed precision keeps all of these in fp32).
TRAIN_BYTES_PER_PARAM = 16
REFERENCE_BYTES_PER_PARAM = 2      # a bf16 reference model when grpo.beta > 0
# The fallback mesh rule where the model's shape is unknown (safetensors only, or demo sizes):
# the share of device memory the training state may take; activations and FSDP's gathered layers
# need the rest.
STATE_MEMORY_SHARE = 0.6
# "demo:<size>" models are built locally and are all small: assume ~100M parameters.
DEMO_PARAMS = 100_000_000
# LoRA: the linear layers of a Llama/Qwen/Mistral decoder layer, and the submodule each is in (a
# module path is model.layers.N.<submodule>.<name>); peft's default targets for these models.
DECODER_LINEARS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                   "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
PEFT_DEFAULT_TARGETS = ("q_proj", "v_proj")
ALL_LINEAR = "all-linear"
ADAPTER_BYTES_PER_PARAM = 16       # fp32 adapters, their fp32 gradients, two fp32 Adam moments

GATHERED_LAYERS = 2                # the layer computing and the one FSDP prefetches
LOGITS_COPIES = 2                  # the logits and their gradient
LOGPROB_FP32_COPIES = 4            # upcast, tempered, exp inside logsumexp, gradient
TRAINER_OVERHEAD_GPU = 2 * GIB
TRAINER_OVERHEAD_CPU = GIB // 2
SERVER_OVERHEAD = 3 * GIB // 2
SERVER_CUDA_GRAPHS = GIB // 2
# vLLM's defaults for the offline LLM class, by the GPU's memory (arg_utils' _set_default_args).
VLLM_LARGE_GPU_GIB = 70
VLLM_BATCHED_TOKENS = (8192, 16384)
VLLM_MAX_SEQS = (256, 1024)
# The largest gpu_memory_utilization a fix suggests: vLLM needs some room outside its budget.
MAX_SUGGESTED_UTILIZATION = 0.95


# ---------------------------------------------------------------------------------------- model
@dataclass(frozen=True)
class ModelShape:
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
                    dtype=dtype if dtype in DTYPE_BYTES else "float32", params=0, **moe)
        return replace(shape, params=params or shape.params_from_shape())

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
        """(in_features, out_features) of each linear layer of a decoder layer (DECODER_LINEARS)."""
        h, q, kv, inter = (self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                           self.expert_intermediate or self.intermediate_size)
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


# ---------------------------------------------------------------------------------------- LoRA
def lora_target_matches(targets: str | tuple[str, ...] | list[str], path: str) -> bool:
    """peft's rule for whether model.lora_target_modules names the module at `path`: a name
    matches a path that is it or ends with "." + it; one string is a regular expression that must
    match the whole path ("all-linear" is not handled here)."""
    if isinstance(targets, str):
        return re.fullmatch(targets, path) is not None
    return any(path == name or path.endswith("." + name) for name in targets)


def decoder_linear_path(layer: int, name: str) -> str:
    return f"model.layers.{layer}.{DECODER_LINEARS[name]}.{name}"


# The linear layers that share one input tensor (the attention norm's output, the attention's
# output, the MLP norm's output, the MLP's product): the full fine-tuning count keeps each once.
_SHARED_INPUT = {"q_proj": 0, "k_proj": 0, "v_proj": 0, "o_proj": 1, "gate_proj": 2, "up_proj": 2, "down_proj": 3}


@dataclass(frozen=True)
class LoraTargets:
    """The linear layers LoRA adapts in each decoder layer, with the adapters' rank and dropout."""
    r: int
    dropout: float
    features: tuple[tuple[str, int, int], ...]          # (name, in_features, out_features) of DECODER_LINEARS
    layers: tuple[frozenset[str], ...]                   # per decoder layer: the names of its adapted linears

    @classmethod
    def of(cls, shape: ModelShape, targets, r: int, dropout: float = 0.0) -> "LoraTargets":
        """From model.lora_target_modules (None: peft's default, q_proj and v_proj)."""
        if targets is None:
            targets = PEFT_DEFAULT_TARGETS
        elif targets == ALL_LINEAR:
            targets = tuple(DECODER_LINEARS)
        features = tuple((name, fin, fout) for name, (fin, fout) in shape.linear_features().items())
        return cls(r, dropout, features, tuple(
            frozenset(name for name in DECODER_LINEARS
                      if lora_target_matches(targets, decoder_linear_path(layer, name)))
            for layer in range(shape.num_layers)))

    def layer_params(self, layer: int) -> int:
        adapted = self.layers[layer]
        return sum(self.r * (fin + fout) for name, fin, fout in self.features if name in adapted)

    @property
    def params(self) -> int:
        """Every adapter's parameters: r x (in_features + out_features) per adapted linear layer."""
        return sum(self.layer_params(i) for i in range(len(self.layers)))

    def layer_activation_bytes(self, layer: int, compute_bytes: int) -> int:
        """What one decoder layer keeps for the backward per token with LoRA, less what it keeps
        in full fine-tuning (layer_activation_bytes; may be negative). A frozen linear layer keeps
        no input (its weight needs no gradient): an input tensor stays only where an adapter's
        lora_A takes it as it is (lora_dropout 0). With dropout, each adapter keeps its dropped input
        (compute dtype) and the dropout's mask (1 B). Each adapter's lora_A output (r values) is kept
        for lora_B. Measured on a Qwen2 layer (CPU, peft 0.21), this errs high by under 10 % of the
        layer's count."""
        c, adapted = compute_bytes, self.layers[layer]
        inputs = {_SHARED_INPUT[name]: fin for name, fin, _ in self.features}
        kept = {_SHARED_INPUT[name] for name in adapted} if self.dropout == 0 else set()
        dropped = sum(fin for name, fin, _ in self.features if name in adapted) * (c + 1) if self.dropout > 0 else 0
        return (dropped + len(adapted) * self.r * c
                - c * sum(size for group, size in inputs.items() if group not in kept))


# Config keys of mixture-of-experts models: the number of routed experts, and of those active per token.
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_MOE_TOP_K = ("num_experts_per_tok", "moe_top_k", "num_experts_per_token")


def model_shape(model_path: str) -> tuple[ModelShape | None, str]:
    """(shape, "") from <model_path>/config.json, or (None, why there is none)."""
    if model_path.startswith("demo:"):
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


def read_safetensors_header(path: Path, max_bytes: int | None = None) -> dict:
    """A .safetensors file's JSON header (tensor name -> dtype, shape, offsets; "__metadata__"):
    8 bytes of little-endian length, then the JSON. ValueError for a file that is not one (or whose
    header is longer than `max_bytes`), OSError when it cannot be read."""
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{path}: not a safetensors file")
        (n,) = struct.unpack("<Q", head)
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


# -------------------------------------------------------------------------------- the formulas
def layer_activation_bytes(shape: ModelShape, compute_bytes: int) -> int:
    """Bytes one decoder layer keeps for its backward, per token.

    Counted on Hugging Face's Llama/Qwen2 layer under autograd:
      2 RMSNorms   each keeps its input upcast to fp32 (4 B) and its normalised output in the
                   compute dtype (the q/k/v and gate/up projections keep that same tensor)
      attention    q, k and v after rotary, the attention output, and o_proj's contiguous input;
                   k and v repeated to every query head (HF's SDPA path repeats them whenever a
                   padding mask is passed, which the trainer always does); SDPA's flash/efficient
                   kernels keep no s x s scores, only a fp32 logsumexp per head
      MLP          gate, SiLU(gate), up and their product (down_proj's input)
      MoE          the same for each of a token's experts_per_token experts (and the shared ones),
                   plus each expert's copy of its tokens' input and the router's fp32 logits
    Residual adds and the rotary multiplications by cos/sin keep nothing of this size."""
    c, h, d = compute_bytes, shape.hidden_size, shape.head_dim
    norms = 2 * (4 + c) * h
    attention = c * 5 * shape.num_heads * d + 4 * shape.num_heads
    mlp = 4 * c * shape.active_intermediate
    if shape.experts:
        mlp += c * shape.experts_per_token * h + 4 * shape.experts
    return norms + attention + mlp


def zero3_device_bytes_per_param(compute_bytes: int, *, offload_optimizer: bool = False,
                                  offload_params: bool = False) -> int:
    """The training state ZeRO-3 keeps on the device per parameter: the parameter in the compute
    dtype unless offload_params, the rest of TRAIN_BYTES_PER_PARAM (its gradient, the fp32 master,
    two Adam moments) unless offload_optimizer, which moves them to host memory."""
    return ((0 if offload_params else compute_bytes)
            + (0 if offload_optimizer else TRAIN_BYTES_PER_PARAM - compute_bytes))


def trainer_parts(shape: ModelShape, *, micro_batch: int, seq_len: int, completion_len: int, shard: int = 1,
                  compute_dtype: str = "bfloat16", reference: bool = False, checkpointing: bool = False,
                  logprob_chunk_tokens: int = TrainerConfig.logprob_chunk_tokens, params: int | None = None,
                  overhead_bytes: int = TRAINER_OVERHEAD_GPU, reference_dtype: str | None = None,
                  reward_model_params: int = 0, lora: LoraTargets | None = None,
                  offload_optimizer: bool = False, offload_params: bool = False) -> dict[str, int]:
    """One trainer's peak memory in bytes, by part, for a training step in the given setting: the
    formula `hpcrl plan` and the render checks use, callable by a benchmark that measures the same
    step (pass overhead_bytes=0 to compare with torch's own allocation counters, which see no
    context or fragmentation). `params` overrides the shape's count (a model's exact numel).
    `reward_model_params`: the recipe's reward models (rewards[i].model), sharded and stored as the
    reference is. `lora`: LoRA's adapters (model.use_peft): the model's own parameters are then
    frozen weights, stored as the reference is, and there is no reference (`reference` is ignored);
    the parts get a "frozen_weights" entry. `offload_optimizer`, `offload_params`: DeepSpeed ZeRO-3's
    offload to host memory (zero3_device_bytes_per_param)."""
    c = DTYPE_BYTES[compute_dtype]
    n = params if params is not None else shape.params
    h, v = shape.hidden_size, shape.vocab_size
    tokens = micro_batch * seq_len
    final_norm = (4 + c) * h                      # the final norm before the LM head, every position
    frozen = DTYPE_BYTES[reference_dtype or compute_dtype]
    per_layer = layer_activation_bytes(shape, c)
    layers = [per_layer + (lora.layer_activation_bytes(i, c) if lora else 0) for i in range(shape.num_layers)]
    if checkpointing:
        activations = tokens * (shape.num_layers * c * h + max(layers, default=0) + final_norm)
    else:
        activations = tokens * (sum(layers) + final_norm)
    chunk = min(logprob_chunk_tokens, micro_batch * completion_len)
    if lora is None:
        per_param = zero3_device_bytes_per_param(c, offload_optimizer=offload_optimizer,
                                                 offload_params=offload_params)
        state = {"training_state": math.ceil(n * per_param / shard),
                 "reference": math.ceil(n * frozen / shard) if reference else 0}
        # one layer's fp32 gradients, and the LM head's gradient in the root group
        gathered = GATHERED_LAYERS * shape.layer_params * c + shape.layer_params * 4 + shape.root_params * c + v * h * c
    else:
        adapters = max((lora.layer_params(i) for i in range(shape.num_layers)), default=0)
        state = {"frozen_weights": math.ceil(n * frozen / shard),
                 "training_state": math.ceil(lora.params * ADAPTER_BYTES_PER_PARAM / shard),
                 "reference": 0}
        # one layer's adapter gradients in fp32; the frozen head has none
        gathered = GATHERED_LAYERS * (shape.layer_params + adapters) * c + adapters * 4 + shape.root_params * c
    return {
        **state,
        "reward_models": math.ceil(reward_model_params * frozen / shard),
        "gathered_layers": gathered,
        "activations": activations,
        "logits": LOGITS_COPIES * micro_batch * (completion_len + 1) * v * c,
        "logprob_chunk": LOGPROB_FP32_COPIES * chunk * v * 4,
        "overhead": overhead_bytes,
    }


def kv_bytes_per_token(shape: ModelShape, tp: int, kv_bytes: int) -> int:
    # Tensor parallelism splits the KV heads; with more ranks than KV heads vLLM replicates them.
    heads = max(1, math.ceil(shape.num_kv_heads / tp))
    return 2 * shape.num_layers * heads * shape.head_dim * kv_bytes


def server_parts(shape: ModelShape, *, tp: int = 1, serve_dtype: str = "bfloat16", max_model_len: int = 1024,
                 kv_dtype_bytes: int | None = None, batched_tokens: int = VLLM_BATCHED_TOKENS[0],
                 max_seqs: int = VLLM_MAX_SEQS[0], cuda_graphs: bool = False) -> dict[str, int]:
    """A vLLM server rank's memory in bytes, by part, before the KV cache for the batch."""
    s = DTYPE_BYTES[serve_dtype]
    kv = kv_bytes_per_token(shape, tp, kv_dtype_bytes or s)
    act = (batched_tokens * (3 * shape.hidden_size + 3 * shape.active_intermediate // tp) * s
           + max_seqs * shape.vocab_size * 8)
    return {
        "weights": math.ceil(shape.params * s / tp),
        "kv_cache": max_model_len * kv,
        "activations": act,
        "overhead": SERVER_OVERHEAD + (SERVER_CUDA_GRAPHS if cuda_graphs else 0),
    }


# ---------------------------------------------------------------------------------------- mesh
@dataclass(frozen=True)
class MeshChoice:
    kind: str                          # "fsdp" or "hsdp"
    shape: tuple[int, ...]             # (trainers,) or (nodes, trainers per node)
    dim_names: tuple[str, ...]
    reason: str
    params: int | None = None
    nodes_per_shard: int = 1           # HSDP: the nodes one shard group (one copy of the state) spans

    def describe(self) -> str:
        dims = " x ".join(f"{n}={s}" for n, s in zip(self.dim_names, self.shape))
        return f"mesh {self.kind} ({dims}): {self.reason}"

    @property
    def shard(self) -> int:
        """How many trainers share one copy of the model's state."""
        return self.shape[-1]

    @property
    def hpz_partition_size(self) -> int:
        """trainer.engine=deepspeed: ZeRO++'s secondary partition (zero_hpz_partition_size), the
        HSDP of DeepSpeed: each node's trainers for HSDP over several nodes, else 1 (plain ZeRO-3,
        also where a shard group spans nodes: hpZ's secondary copy is a node's)."""
        return self.shard if self.kind == "hsdp" and self.shape[0] > 1 and self.nodes_per_shard == 1 else 1


def choose_mesh(spec: JobSpec, plan: Plan) -> MeshChoice:
    """FSDP over every trainer, or HSDP (shard inside a group of nodes, replicate across groups).

    HSDP inside one node keeps the all-gathers of a weight sync inside the node, where the node's
    sender hands the weights to its server: no weight bytes cross the interconnect for a sync.
    `auto` picks it where one node's trainers hold the whole training step (the estimate below,
    when the model's config.json and the GPU's memory are known; else the training state alone
    within 60% of the node's memory). Where they do not, the state is sharded over the fewest nodes
    that hold it (a number of nodes that divides the job's), replicated beyond: every all-gather,
    a sync's included, then spans those nodes only, not the whole job; FSDP over every trainer is
    left for a model no smaller group holds."""
    shape, _ = model_shape(spec.recipe.model.path)
    params = shape.params if shape else count_parameters(spec.recipe.model.path)
    return _choose_mesh(spec, plan, shape, params)


def _choose_mesh(spec: JobSpec, plan: Plan, shape: ModelShape | None, params: int | None) -> MeshChoice:
    nodes, per_node = plan.nodes, plan.trainers_per_node

    def fsdp(reason: str) -> MeshChoice:
        return MeshChoice("fsdp", (plan.num_trainers,), ("shard",), reason, params)

    def hsdp(reason: str) -> MeshChoice:
        return MeshChoice("hsdp", (nodes, per_node), ("replicate", "shard"), reason, params)

    wanted = spec.recipe.trainer.mesh
    if wanted == "fsdp":
        return fsdp("set in the recipe (trainer.mesh)")
    if wanted == "hsdp":
        return hsdp("set in the recipe (trainer.mesh)")
    if nodes == 1:
        return fsdp("one node: sharding over its trainers is HSDP already")
    capacity = task_capacity(spec, plan)

    def over(k: int) -> str:
        return f"one node's {per_node} trainers" if k == 1 else f"{k} nodes' {k * per_node} trainers"

    if shape is not None and capacity:
        def holds(k: int) -> bool:
            return sum(_trainer_parts(spec, shape, k * per_node).values()) <= capacity

        def facts(k: int) -> str:
            need = sum(_trainer_parts(spec, shape, k * per_node).values())
            return f"~{_fmt(need)} GB per {device_word(spec)} with the state sharded over {over(k)}, of {_fmt(capacity)} GB"
    elif params is None:
        return fsdp(f"the size of {spec.recipe.model.path} is unknown: shard over all trainers to be safe")
    elif not capacity:
        return hsdp("the site gives no memory size; assuming the model fits one node")
    else:
        if spec.recipe.model.use_peft:
            # frozen weights only (the adapters, unknown without the shape, are a small fraction)
            per_param = DTYPE_BYTES[_frozen_dtype(spec)]
        else:
            per_param = TRAIN_BYTES_PER_PARAM + (REFERENCE_BYTES_PER_PARAM if spec.recipe.grpo.beta > 0 else 0)
        need_gb = params * per_param / 1e9

        def have_gb(k: int) -> float:
            return k * per_node * capacity / GIB * STATE_MEMORY_SHARE

        def holds(k: int) -> bool:
            return need_gb <= have_gb(k)

        def facts(k: int) -> str:
            return f"{params / 1e9:.2f}B parameters need ~{need_gb:.0f} GB of training state; {over(k)} have ~{have_gb(k):.0f} GB for it"

    fewest = next((k for k in range(1, nodes + 1) if nodes % k == 0 and holds(k)), None)
    if fewest == 1:
        return hsdp(f"{facts(1)}: shard inside each node, replicate across nodes")
    if fewest is not None and fewest < nodes:
        groups = nodes // fewest
        return MeshChoice("hsdp", (groups, fewest * per_node), ("replicate", "shard"),
                          f"{facts(1)}: too much; {facts(fewest)}: shard over each {fewest} nodes, replicate "
                          f"across the {groups} groups (a sync gathers inside its group)", params,
                          nodes_per_shard=fewest)
    if fewest == nodes:
        return fsdp(f"{facts(1)}: too much, and no group of fewer nodes holds it: shard over all "
                    f"{plan.num_trainers} trainers")
    return fsdp(f"{facts(1)}: too much, shard over all {plan.num_trainers} trainers")


@dataclass(frozen=True)
class SyncTraffic:
    """What one weight sync gathers, per node: every trainer of a shard group all-gathers each
    weight in the engine's dtype (FSDP2's gathers deliver the whole tensor to every member), and
    what its group's members on other nodes hold crosses the network."""
    model_bytes: int                   # the whole model in the engine's dtype
    dtype: str
    in_node_bytes: int                 # per node, per sync
    cross_node_bytes: int

    def describe(self) -> str:
        gathered = f"the model is {_fmt(self.model_bytes)} GB in {self.dtype}"
        if not self.cross_node_bytes:
            return f"weight sync: no weight bytes cross nodes (each shard group is one node; {gathered})"
        return (f"weight sync: each node takes in ~{_fmt(self.cross_node_bytes)} GB from other nodes per sync "
                f"(its trainers' gathers from their shard group's other nodes; {gathered})")


def sync_traffic(spec: JobSpec, plan: Plan, mesh: MeshChoice) -> SyncTraffic | None:
    """None where the model's shape is unknown on this machine."""
    shape, _ = model_shape(spec.recipe.model.path)
    if shape is None:
        return None
    dtype = serve_dtype(spec, shape)
    full = shape.params * DTYPE_BYTES[dtype]
    per_node, group = plan.trainers_per_node, mesh.shard
    # Each trainer receives (group - 1) / group of every weight; the part held on other nodes is
    # (group - per_node) / group, a shard group being whole nodes.
    return SyncTraffic(full, dtype, per_node * full * (min(per_node, group) - 1) // group,
                       per_node * full * max(group - per_node, 0) // group)


def global_batch(spec: JobSpec, plan: Plan) -> int:
    """One optimizer step's completions, which TRL's per-device batch makes grow with the job."""
    g = spec.recipe.grpo
    return g.per_device_train_batch_size * g.gradient_accumulation_steps * plan.num_trainers


def describe_global_batch(spec: JobSpec, plan: Plan) -> str:
    g, total = spec.recipe.grpo, global_batch(spec, plan)
    accumulation = f" x {g.gradient_accumulation_steps} accumulation steps" if g.gradient_accumulation_steps > 1 else ""
    return (f"global batch: {g.per_device_train_batch_size} completions per trainer{accumulation} x "
            f"{plan.num_trainers} trainers = {total} completions ({total // g.num_generations} prompts x "
            f"{g.num_generations}) per optimizer step; per_device_train_batch_size is per trainer, as in TRL, "
            f"so it grows with -N")


# ------------------------------------------------------------------------------- a job's fit
def device_word(spec: JobSpec) -> str:
    """What one task's memory is called: a GCD (an MI250X is two), a GPU, or a CPU task's share."""
    if spec.site.device != "cuda":
        return "task"
    return "GCD" if spec.site.gpu_vendor == "amd" else "GPU"


def task_capacity(spec: JobSpec, plan: Plan) -> int | None:
    """Bytes one task may use: its GPU's memory, or on a CPU site its share of the node's memory."""
    node = spec.site.node
    if spec.site.device == "cuda":
        gb = node.gpu_memory_gb
    else:
        gb = node.memory_gb / plan.tasks_per_node
    return int(gb * GIB) if gb > 0 else None


def compute_dtype(spec: JobSpec) -> str:
    # As hpcrl.compute.train.fsdp.mixed_precision_for: bf16 on an accelerator unless grpo.bf16 is
    # false; on CPU only when grpo.bf16 is true.
    bf16 = spec.recipe.grpo.bf16
    if bf16 is None:
        bf16 = spec.site.device != "cpu"
    return "bfloat16" if bf16 else "float32"


def _frozen_dtype(spec: JobSpec) -> str:
    """What frozen weights are stored in (hpcrl.compute.train.fsdp.frozen_dtype): model.dtype, else
    the compute dtype."""
    dtype = spec.recipe.model.dtype
    return compute_dtype(spec) if dtype == "auto" else dtype


def lora_targets(spec: JobSpec, shape: ModelShape) -> LoraTargets | None:
    """The recipe's LoRA adapters on the model (None without model.use_peft)."""
    m = spec.recipe.model
    return LoraTargets.of(shape, m.lora_target_modules, m.lora_r, m.lora_dropout) if m.use_peft else None


# The prompt tokens the trainers' estimate allows beside max_completion_length when the engine's
# context is the model's own (inference.max_model_len unset): a 32k-token context would otherwise
# size every micro-batch as 32k tokens wide and refuse most jobs of a long-context model.
ASSUMED_PROMPT_TOKENS = 1024


def engine_len(spec: JobSpec) -> int:
    """The engine's context: inference.max_model_len, else the model's (hpcrl.job.context)."""
    if spec.recipe.inference.max_model_len:
        return spec.recipe.inference.max_model_len
    ctx = context.model_context(spec.recipe.model.path, spec.recipe.model.tokenizer)
    return ctx.tokens if ctx else context.VLLM_DEFAULT


def train_seq_len(spec: JobSpec) -> int:
    """The widest micro-batch row the trainers' estimate holds for: the engine's context where the
    recipe bounds it (inference.max_model_len), else max_completion_length + ASSUMED_PROMPT_TOKENS
    within the model's context."""
    r = spec.recipe
    if r.inference.max_model_len:
        return r.inference.max_model_len
    return min(engine_len(spec), r.grpo.max_completion_length + ASSUMED_PROMPT_TOKENS)


def _trainer_parts(spec: JobSpec, shape: ModelShape, shard: int) -> dict[str, int]:
    r = spec.recipe
    on_gpu = spec.site.device == "cuda"
    return trainer_parts(
        shape, micro_batch=r.grpo.per_device_train_batch_size,
        # The padded micro-batch is as wide as its longest prompt plus its longest completion;
        # the engine takes prompts up to max_model_len - max_completion_length, so a full-width
        # batch comes as soon as one long prompt gets a full-length completion. The estimate holds
        # for that batch: a step that runs out of memory hours in is what it is here to prevent.
        seq_len=train_seq_len(spec), completion_len=r.grpo.max_completion_length, shard=shard,
        compute_dtype=compute_dtype(spec),
        reference_dtype=None if r.model.dtype == "auto" else r.model.dtype,
        # An offloaded reference lives in host memory; on a CPU site that is the same memory.
        reference=r.grpo.beta > 0 and not (r.trainer.reference_offload and on_gpu),
        checkpointing=bool(r.trainer.activation_checkpointing or r.grpo.gradient_checkpointing),
        logprob_chunk_tokens=r.trainer.logprob_chunk_tokens,
        overhead_bytes=TRAINER_OVERHEAD_GPU if on_gpu else TRAINER_OVERHEAD_CPU,
        # A reward model this machine cannot read counts as nothing, as an unknown model does.
        reward_model_params=0 if r.trainer.reference_offload and on_gpu else
        sum(count_parameters(x.model) or 0 for x in r.rewards if x.model),
        lora=lora_targets(spec, shape),
        # Offloaded state lives in host memory; on a CPU site that is the same memory.
        offload_optimizer=r.trainer.offload_optimizer and on_gpu, offload_params=r.trainer.offload_params and on_gpu)


def host_offload_bytes(spec: JobSpec, params: int, shard: int) -> int:
    """What a trainer of a GPU site keeps in host memory with trainer.offload_optimizer and
    offload_params (0 without): the training state its device does not keep."""
    if spec.site.device != "cuda":
        return 0
    t, c = spec.recipe.trainer, DTYPE_BYTES[compute_dtype(spec)]
    on_device = zero3_device_bytes_per_param(c, offload_optimizer=t.offload_optimizer,
                                             offload_params=t.offload_params)
    return math.ceil(params * (TRAIN_BYTES_PER_PARAM - on_device) / shard)


def serve_dtype(spec: JobSpec, shape: ModelShape) -> str:
    inf = spec.recipe.inference
    dtype = engine_dtype(inf.dtype, spec.recipe.model.dtype)
    if dtype != "auto":
        return dtype
    if inf.engine == "transformers":
        return shape.dtype          # from_pretrained(dtype="auto") keeps the checkpoint's
    if spec.site.device != "cuda":
        return "float32"            # hpcrl.compute.inference.vllm_engine asks vLLM-CPU for float32
    if shape.dtype == "float32":
        return "bfloat16"           # vLLM serves a float32 checkpoint in half precision on GPUs
    return shape.dtype


def _vllm_defaults(spec: JobSpec) -> tuple[int, int]:
    large = spec.site.device == "cuda" and spec.site.node.gpu_memory_gb >= VLLM_LARGE_GPU_GIB
    args = spec.recipe.inference.engine_args
    tokens = args.get("max_num_batched_tokens") or VLLM_BATCHED_TOKENS[large]
    seqs = args.get("max_num_seqs") or VLLM_MAX_SEQS[large]
    try:
        return int(tokens), int(seqs)
    except (TypeError, ValueError):
        return VLLM_BATCHED_TOKENS[large], VLLM_MAX_SEQS[large]


def _sequences_per_step(spec: JobSpec, plan: Plan) -> int:
    """The sequences one engine generates per step: those of the trainers it serves (the busiest
    engine of a node; a trainer fed by several engines splits its prompts evenly over them)."""
    g = spec.recipe.grpo
    per_trainer = g.per_device_train_batch_size * g.gradient_accumulation_steps
    return max(math.ceil(sum(per_trainer / len(t.servers) for t in plan.served_by(s.rank)))
               for s in plan.node_servers(0))


def _server(spec: JobSpec, plan: Plan, shape: ModelShape) -> tuple[dict[str, int], int | None, dict]:
    """(parts, capacity, facts) of one server rank."""
    inf, g = spec.recipe.inference, spec.recipe.grpo
    dtype = serve_dtype(spec, shape)
    tokens, seqs = _vllm_defaults(spec)
    kv_dtype = str(inf.engine_args.get("kv_cache_dtype", "auto"))
    kv_bytes = 1 if kv_dtype.startswith("fp8") else DTYPE_BYTES[dtype]
    tp = inf.tensor_parallel_size
    parts = server_parts(shape, tp=tp, serve_dtype=dtype, max_model_len=engine_len(spec),
                         kv_dtype_bytes=kv_bytes, batched_tokens=tokens, max_seqs=seqs,
                         cuda_graphs=spec.site.device == "cuda" and inf.engine != "transformers"
                         and not inf.eager(spec.site.device))
    capacity = task_capacity(spec, plan)
    batch = _sequences_per_step(spec, plan)
    per_seq = engine_len(spec) * kv_bytes_per_token(shape, tp, kv_bytes)
    facts = {"dtype": dtype, "tensor_parallel": tp, "engines_per_node": plan.engines_per_node, "utilization": inf.gpu_memory_utilization,
             "sequences_per_step": batch, "kv_bytes_per_sequence": per_seq}
    if inf.engine == "transformers":
        # HF generate holds the KV cache and every step's sampling scores (fp32 over the
        # vocabulary) of the node's whole batch; its one-token forward steps are small beside them.
        del parts["activations"]
        parts["kv_cache"] = batch * per_seq
        parts["scores"] = batch * g.max_completion_length * shape.vocab_size * 4
        parts["overhead"] = parts.pop("overhead")
        facts["budget"] = "the whole GPU (transformers engine)"
    elif spec.site.device == "cuda" and capacity:
        capacity = int(capacity * inf.gpu_memory_utilization)
        facts["budget"] = f"gpu_memory_utilization {inf.gpu_memory_utilization:g}"
    if capacity and inf.engine != "transformers":
        room = capacity - sum(parts.values()) + parts["kv_cache"]
        at_once = facts["kv_sequences_at_once"] = max(0, min(seqs, room // per_seq)) if per_seq else None
        if at_once and at_once < batch:
            # More engines split the node's sequences: enough of them hold all at once.
            gpus = math.ceil(plan.engines_per_node * batch / at_once) * tp
            if gpus < spec.site.node.gpus:
                facts["kv_all_at_once_with"] = f"inference.gpus={gpus}"
    return parts, capacity, facts


@dataclass(frozen=True)
class RoleFit:
    """One role's estimate per GPU (bytes), its parts, the memory it has, and what would fix it."""
    role: str                              # "trainers" or "server"
    device: str                            # "GPU", "GCD" or "task"
    est_bytes: int | None = None
    capacity_bytes: int | None = None
    parts: dict[str, int] = field(default_factory=dict)
    facts: dict = field(default_factory=dict)
    unknown: str = ""                      # why there is no estimate or no verdict
    fixes: tuple[str, ...] = ()

    @property
    def fits(self) -> bool | None:
        if self.est_bytes is None or not self.capacity_bytes:
            return None
        return self.est_bytes <= self.capacity_bytes

    @property
    def est_gb(self) -> float | None:
        return None if self.est_bytes is None else _gb(self.est_bytes)

    def parts_text(self) -> str:
        labels = {"training_state": "training state", "frozen_weights": "frozen weights",
                  "gathered_layers": "gathered layers",
                  "logprob_chunk": "log-prob chunk", "kv_cache": "KV cache"}
        return ", ".join(f"{labels.get(k, k)} {_fmt(v) if v >= GIB / 20 else '<0.1'}"
                         for k, v in self.parts.items() if v)

    def capacity_text(self) -> str:
        if self.role == "server" and "gpu_memory_utilization" in self.facts.get("budget", ""):
            full = self.capacity_bytes / float(self.facts["utilization"])
            return f"{_fmt(self.capacity_bytes)} GB per {self.device} ({self.facts['budget']} of {_fmt(full)} GB)"
        return f"{_fmt(self.capacity_bytes)} GB per {self.device}"

    def verdict(self) -> str:
        """One line for `hpcrl plan`."""
        if self.est_bytes is None:
            return f"{self.role}: no estimate: {self.unknown}"
        head = f"{self.role}: ~{_fmt(self.est_bytes)} GB"
        if self.fits is None:
            return f"{head} per {self.device}: no verdict: {self.unknown} ({self.parts_text()})"
        head += f" of {self.capacity_text()}"
        extra = self._kv_text() + self._host_text()
        if self.fits:
            return f"{head}: fits ({self.parts_text()}){extra}"
        return f"{head}: does not fit ({self.parts_text()}); {self.fix_text()}"

    def fix_text(self) -> str:
        if not self.fixes:
            return "fix: none found: a smaller model or shorter sequences"
        return "fix: " + ", or ".join(self.fixes)

    def _kv_text(self) -> str:
        at_once, batch = self.facts.get("kv_sequences_at_once"), self.facts.get("sequences_per_step")
        if at_once is None or batch is None:
            return ""
        if at_once >= batch:
            return f"; KV cache room for all {batch} of the node's sequences at once"
        more = self.facts.get("kv_all_at_once_with")
        return (f"; KV cache room for ~{at_once} of the node's {batch} sequences at once (generation runs in waves"
                + (f"; {more} would hold them all)" if more else ")"))

    def _host_text(self) -> str:
        """DeepSpeed's offload: the host memory it takes, against the node's where the site says."""
        per_trainer, node, have = (self.facts.get(k) for k in ("host_offload_gb", "host_offload_node_gb",
                                                               "host_memory_gb"))
        if not per_trainer:
            return ""
        text = f"; offloaded to host memory: ~{per_trainer:g} GB per trainer, ~{node:g} GB a node"
        if have:
            text += f" of its {have:g} GB" + ("" if node <= have else ": more than the node has")
        return text

    def to_dict(self) -> dict:
        return {"est_memory_gb": self.est_gb,
                "capacity_gb": None if not self.capacity_bytes else _gb(self.capacity_bytes),
                "fits": self.fits, "device": self.device,
                "parts_gb": {k: _gb(v) for k, v in self.parts.items()},
                "unknown": self.unknown or None, "fixes": list(self.fixes),
                **self.facts}


@dataclass(frozen=True)
class Fit:
    """The estimate for a job: the trainers, the server, and the mesh the trainers will get."""
    trainer: RoleFit
    server: RoleFit
    mesh: MeshChoice

    @property
    def fits(self) -> bool | None:
        verdicts = (self.trainer.fits, self.server.fits)
        if False in verdicts:
            return False
        return True if all(verdicts) else None

    def refusal(self, site_name: str) -> str | None:
        """The one line `hpcrl render`/`submit` refuse with, or None when nothing is known not to fit."""
        why = []
        for r in (self.trainer, self.server):
            if r.fits is False:
                need = "needs" if r.role == "server" else "need"
                why.append(f"the {r.role} {need} ~{_fmt(r.est_bytes)} GB per {r.device}, {site_name} has "
                           f"{r.capacity_text()} ({r.parts_text()}); {r.fix_text()}")
        if not why:
            return None
        return "memory: " + "; and ".join(why) + " (`hpcrl plan` with the same arguments shows the estimate)"

    def to_dict(self) -> dict:
        return {"unit": "GiB", "fits": self.fits,
                "mesh": {"kind": self.mesh.kind, "shape": list(self.mesh.shape),
                         "dims": list(self.mesh.dim_names), "reason": self.mesh.reason},
                "trainer": self.trainer.to_dict(), "server": self.server.to_dict()}


def estimate(spec: JobSpec, plan: Plan | None = None) -> Fit:
    """Memory per GPU of the job's trainers and servers, against what the site's GPUs have."""
    plan = plan or spec.plan()
    shape, why = model_shape(spec.recipe.model.path)
    params = shape.params if shape else count_parameters(spec.recipe.model.path)
    mesh = _choose_mesh(spec, plan, shape, params)
    word = device_word(spec)
    capacity = task_capacity(spec, plan)
    if shape is None:
        return Fit(RoleFit("trainers", word, capacity_bytes=capacity, unknown=why),
                   RoleFit("server", word, capacity_bytes=capacity, unknown=why), mesh)
    no_size = "" if capacity else f"site {spec.site.name} gives no memory size ({_memory_field(spec)})"
    parts = _trainer_parts(spec, shape, mesh.shard)
    facts = {"mesh": mesh.kind, "shard": mesh.shard, "compute_dtype": compute_dtype(spec),
             "micro_batch_tokens": spec.recipe.grpo.per_device_train_batch_size * train_seq_len(spec)}
    lora = lora_targets(spec, shape)
    if lora is not None:
        facts["lora_params"] = lora.params
    if spec.recipe.trainer.engine == "deepspeed":
        host = host_offload_bytes(spec, shape.params, mesh.shard)
        facts.update(engine="deepspeed", hpz_partition_size=mesh.hpz_partition_size, host_offload_gb=_gb(host),
                     host_offload_node_gb=_gb(host * plan.trainers_per_node), host_memory_gb=spec.site.node.memory_gb)
    trainer = RoleFit("trainers", word, sum(parts.values()), capacity, parts, facts, no_size)
    s_parts, s_capacity, facts = _server(spec, plan, shape)
    server = RoleFit("server", word, sum(s_parts.values()), s_capacity, s_parts, facts, no_size)
    base, after = spec, ""
    if server.fits is False:
        fixes, change = _server_fixes(spec, shape)
        server = replace(server, fixes=tuple(fixes))
        if change:
            # The server's tensor-parallel fix takes GPUs from the trainers: theirs must hold with it.
            base, after = _with(spec, "inference", **change), f" (with {_assignments(change)})"
    if trainer.fits is False:
        trainer = replace(trainer, fixes=tuple(f + after for f in _trainer_fixes(base, shape, params)))
    return Fit(trainer, server, mesh)


def _assignments(change: dict) -> str:
    """{"gpus": 4, "tensor_parallel_size": 4} -> "inference.gpus=4 inference.tensor_parallel_size=4"."""
    return " ".join(f"inference.{k}={v}" for k, v in change.items())


def _memory_field(spec: JobSpec) -> str:
    return "node.gpu_memory_gb" if spec.site.device == "cuda" else "node.memory_gb"


def _gb(n: float) -> float:
    return round(n / GIB, 1)


def _fmt(n: float) -> str:
    """Bytes as GiB for a sentence: "41.2", "64"."""
    return f"{n / GIB:.1f}".removesuffix(".0")


# ------------------------------------------------------------------------------------- fixes
def _with(spec: JobSpec, section: str, **changes) -> JobSpec:
    recipe = spec.recipe
    return replace(spec, recipe=replace(recipe, **{section: replace(getattr(recipe, section), **changes)}))


def _trainer_need(spec: JobSpec, shape: ModelShape, params: int | None) -> tuple[int, int | None]:
    plan = spec.plan()
    mesh = _choose_mesh(spec, plan, shape, params)
    return sum(_trainer_parts(spec, shape, mesh.shard).values()), task_capacity(spec, plan)


def _fits(spec: JobSpec, shape: ModelShape, params: int | None) -> bool:
    need, capacity = _trainer_need(spec, shape, params)
    return bool(capacity) and need <= capacity


def _node_limit(spec: JobSpec) -> int | None:
    site, res = spec.site, spec.recipe.resources
    limits = [p.max_nodes for p in (site.partitions.get(res.partition),) if p and p.max_nodes]
    limits += [q.max_nodes for q in (site.qos_limits.get(res.qos),) if q and q.max_nodes]
    return min(limits) if limits else None


def _nodes_fix(spec: JobSpec, shape: ModelShape, params: int | None) -> tuple[str, JobSpec] | None:
    """The fewest nodes at which FSDP over every trainer fits: only the training state, the
    frozen weights (LoRA), the reference and the reward models shrink with the shard, the rest per
    GPU stays."""
    plan = spec.plan()
    capacity = task_capacity(spec, plan)
    one = _trainer_parts(spec, shape, 1)
    sharded = one["training_state"] + one["reference"] + one["reward_models"] + one.get("frozen_weights", 0)
    room = (capacity or 0) - (sum(one.values()) - sharded)
    if room <= 0:
        return None
    nodes = max(1, math.ceil(sharded / (plan.trainers_per_node * room)))
    limit = _node_limit(spec)
    if limit is not None and nodes > limit:
        return None
    fix, variant = [], spec
    if spec.recipe.trainer.mesh == "hsdp":
        fix.append("trainer.mesh=fsdp")
        variant = _with(variant, "trainer", mesh="fsdp")
    if nodes > spec.nodes:
        fix.insert(0, f"-N {nodes}")
        variant = replace(variant, recipe=replace(variant.recipe, resources=replace(
            variant.recipe.resources, nodes=nodes)))
    if not fix or not _fits(variant, shape, params):
        return None
    return " ".join(fix), variant


def _micro_batch_fix(spec: JobSpec, shape: ModelShape, params: int | None) -> tuple[str, JobSpec] | None:
    """The largest smaller micro-batch that fits, with the completions per step kept (a divisor of
    per_device_train_batch_size x gradient_accumulation_steps)."""
    g = spec.recipe.grpo
    per_rank = g.per_device_train_batch_size * g.gradient_accumulation_steps
    for micro in sorted((m for m in range(1, g.per_device_train_batch_size) if per_rank % m == 0), reverse=True):
        variant = _with(spec, "grpo", per_device_train_batch_size=micro, gradient_accumulation_steps=per_rank // micro)
        if _fits(variant, shape, params):
            return (f"grpo.per_device_train_batch_size={micro} "
                    f"grpo.gradient_accumulation_steps={per_rank // micro}"), variant
    return None


def _trainer_fixes(spec: JobSpec, shape: ModelShape, params: int | None) -> list[str]:
    """Each change that alone makes the trainers fit; else one combination of them that does."""
    r = spec.recipe
    switches = []
    if not (r.trainer.activation_checkpointing or r.grpo.gradient_checkpointing):
        switches.append("activation_checkpointing")
    if r.grpo.beta > 0 and not r.trainer.reference_offload and spec.site.device == "cuda" and not r.model.use_peft:
        switches.append("reference_offload")       # with LoRA there is no reference copy to offload
    if r.trainer.engine == "deepspeed" and spec.site.device == "cuda":
        # ZeRO-3's offload: the optimizer state first (the parameter stays for the forward), then the parameters
        switches += [name for name in ("offload_optimizer", "offload_params") if not getattr(r.trainer, name)]
    alone = [f"trainer.{name}=true" for name in switches
             if _fits(_with(spec, "trainer", **{name: True}), shape, params)]
    for search in (_micro_batch_fix, _nodes_fix):
        found = search(spec, shape, params)
        if found:
            alone.append(found[0])
    if alone:
        return alone
    # Nothing alone: the switches on, then the micro-batch, then nodes, until it fits.
    combined, variant = [], spec
    for name in switches:
        combined.append(f"trainer.{name}=true")
        variant = _with(variant, "trainer", **{name: True})
        if _fits(variant, shape, params):
            return ["all of " + " ".join(combined)]
    for search in (_micro_batch_fix, _nodes_fix):
        found = search(variant, shape, params)
        if found:
            return ["all of " + " ".join(combined + [found[0]])]
    per_rank = r.grpo.per_device_train_batch_size * r.grpo.gradient_accumulation_steps
    if r.grpo.per_device_train_batch_size > 1:
        found = _nodes_fix(_with(variant, "grpo", per_device_train_batch_size=1,
                                 gradient_accumulation_steps=per_rank), shape, params)
        if found:
            return ["all of " + " ".join(combined + ["grpo.per_device_train_batch_size=1",
                                                     f"grpo.gradient_accumulation_steps={per_rank}", found[0]])]
    return []


def _server_fixes(spec: JobSpec, shape: ModelShape) -> tuple[list[str], dict | None]:
    """The changes that make a server rank fit, and the inference fields of the tensor-parallel one
    among them (or None)."""
    fixes, chosen = [], None
    inf, gpus = spec.recipe.inference, spec.site.node.gpus
    if inf.engine == "transformers":
        # It has no tensor parallelism and keeps the whole batch's cache and scores: vLLM pages both.
        variant = _with(spec, "inference", engine="vllm")
        parts, capacity, _ = _server(variant, variant.plan(), shape)
        return (["inference.engine=vllm"] if capacity and sum(parts.values()) <= capacity else []), None
    engines = inf.gpus // inf.tensor_parallel_size
    for tp in range(inf.tensor_parallel_size + 1, gpus):
        # vLLM splits the attention heads evenly over the tensor-parallel ranks.
        if shape.num_heads % tp:
            continue
        # As many engines as now, as long as a trainer is left on the node.
        n = max(1, min(engines, (gpus - 1) // tp))
        change = {"gpus": n * tp, "tensor_parallel_size": tp}
        variant = _with(spec, "inference", **change)
        parts, capacity, _ = _server(variant, variant.plan(), shape)
        if capacity and sum(parts.values()) <= capacity:
            fixes.append(f"{_assignments(change)} ({n} engine(s) of {tp} GPUs, tensor parallel; leaves "
                         f"{gpus - n * tp} trainers per node)")
            chosen = change
            break
    if spec.site.device == "cuda" and inf.engine != "transformers" and spec.site.node.gpu_memory_gb:
        parts, _, _ = _server(spec, spec.plan(), shape)
        wanted = math.ceil(100 * sum(parts.values()) / (spec.site.node.gpu_memory_gb * GIB)) / 100
        if inf.gpu_memory_utilization < wanted <= MAX_SUGGESTED_UTILIZATION:
            fixes.append(f"inference.gpu_memory_utilization={wanted:g}")
    return fixes, chosen
