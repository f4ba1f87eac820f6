"""The memory formulas: one trainer's and one server rank's peak bytes per GPU, by part, from a
model's shape (hpcrl.job.model_shape) and a step's setting. What a job's recipe and site make of
that setting is hpcrl.job.job_memory's; the verdict against the GPU, hpcrl.job.estimate's.

Sizes are in GiB (2**30 bytes), the unit a vendor's "64 GB" GCD or "80 GB" GPU is counted in and
the one the site files' `gpu_memory_gb` means; they are printed as "GB" like the site fields.

Trainer, per GPU (FSDP2 with the mixed precision of hpcrl.compute.train.fsdp):
  training state   16 B/param (fp32 master weights, fp32 gradients, two fp32 Adam moments) / shard;
                   with grpo.optim adamw_torch_8bit the moments take 2 B + an fp32 scale per 256
                   values (10.03 B/param)
  reference        params x model.dtype ("auto": the compute dtype) / shard, when grpo.beta > 0 and not
                   trainer.reference_offload
  reward models    rewards[i].model's params, stored and sharded as the reference
  gathered layers  two decoder layers unsharded in the compute dtype (the one computing and the one
                   prefetched) + one layer's unsharded fp32 gradients (reduce dtype), + the root group
                   (embeddings, final norm, LM head) unsharded in the compute dtype with the head's
                   gradient, which the root keeps from the head's backward to the end of the backward
  activations      one micro-batch: per_device_train_batch_size x train_seq_len tokens (see
                   layer_activation_bytes, hpcrl.job.job_memory.train_seq_len); with activation
                   checkpointing each layer's input plus one layer's activations, recomputed in its
                   backward
  logits           micro-batch x (max_completion_length + 1) x vocabulary in the compute dtype, twice
                   (the logits and their gradient)
  log-prob chunk   4 fp32 [logprob_chunk_tokens x vocabulary] temporaries (upcast, tempered, exp of the
                   logsumexp, and its gradient)
  overhead         2 GiB on a GPU (CUDA/HIP context, NCCL/RCCL buffers, allocator fragmentation),
                   0.5 GiB for a CPU task
Shard: every trainer of the job for FSDP, the trainers of the fewest nodes that hold the step for
HSDP, one node's where they can (hpcrl.job.mesh_choice).

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
  training state   the adapters: r x (in_features + out_features) per adapted linear layer (DoRA: +
                   out_features, its magnitude), and the trained copies of model.lora_modules_to_save
                   (lm_head, embed_tokens: vocabulary x hidden each), 16 B each
                   (fp32 adapters, fp32 gradients, two fp32 Adam moments) / shard
  reference        none, whatever grpo.beta says: the reference is the policy with its adapters
                   switched off
  gathered layers  two decoder layers with their adapters in the compute dtype + one layer's adapter
                   gradients in fp32, + the root group in the compute dtype (the frozen head has no
                   gradient; a trained copy of a module to save is there too, with its fp32 gradient)
  activations      as above, less the inputs of the frozen linear layers (no weight gradient needs
                   them) unless an adapter takes them as they are (lora_dropout 0), + per adapted
                   linear layer and token its dropped input (compute dtype) and dropout mask (1 B)
                   when lora_dropout > 0, and lora_A's output (r values) (hpcrl.job.lora.LoraTargets);
                   with DoRA (model.use_dora) + per adapted linear layer and token two outputs (out
                   values), and once the forward's weight-sized temporaries of the largest adapted
                   layer (in x in + 3 in x out values: peft's B A as a weight, W + s B A); with
                   model.lora_target_parameters on expert stacks, r x experts x (in + out)
                   adapter parameters per stack and layer, each stack merged (experts x in x out
                   values, compute dtype) kept per layer the backward has yet to reach (one with
                   checkpointing), + one stack's gradient, and per token and stack experts per
                   token x in values (scripts/bench_memory.py measures the kept part)
The adapted layers are model.lora_target_modules as peft matches them (hpcrl.job.lora).

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
"""

from __future__ import annotations

import math
from typing import NamedTuple

from hpcrl.job.lora import LoraTargets
from hpcrl.job.model_shape import DTYPE_BYTES, ModelShape
from hpcrl.job.recipe import TrainerConfig

GIB = 2 ** 30

# Bytes per parameter of training state: fp32 master weights, fp32 gradients, two fp32 Adam
# moments (mixed precision keeps all of these in fp32).
TRAIN_BYTES_PER_PARAM = 16
REFERENCE_BYTES_PER_PARAM = 2      # a bf16 reference model when grpo.beta > 0
ADAPTER_BYTES_PER_PARAM = 16       # fp32 adapters, their fp32 gradients, two fp32 Adam moments
ADAM_MOMENT_BYTES = 8              # of those 16: the two fp32 Adam moments
# grpo.optim with block-quantized moments (torchao): 1 B a value per moment, and an fp32 scale per
# block of 256.
LOW_BIT_MOMENT_BYTES = {"adamw_torch_8bit": 2 + 8 / 256}


def adam_moment_bytes(optim: str) -> float:
    """The two Adam moments' bytes per parameter for grpo.optim."""
    return LOW_BIT_MOMENT_BYTES.get(optim, ADAM_MOMENT_BYTES)


def with_moments(bytes_per_param: float, adam_bytes: float) -> float:
    """A per-parameter count that holds two fp32 Adam moments (TRAIN_BYTES_PER_PARAM,
    ADAPTER_BYTES_PER_PARAM), with moments of ``adam_bytes`` (adam_moment_bytes) instead."""
    return bytes_per_param - ADAM_MOMENT_BYTES + adam_bytes


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


def gib_text(n: float) -> str:
    """Bytes as GiB for a sentence: "41.2", "64"."""
    return f"{n / GIB:.1f}".removesuffix(".0")


def gib_rounded(n: float) -> float:
    """Bytes as GiB for --json: one decimal."""
    return round(n / GIB, 1)


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


class TrainingStep(NamedTuple):
    """What one trainer computes at once: a micro-batch of rows, how wide, in which dtype."""
    micro_batch: int                   # rows (completions with their prompts)
    seq_len: int                       # a row's tokens, prompt and completion
    completion_len: int                # the tokens of a row the logits are kept for
    compute_dtype: str = "bfloat16"
    checkpointing: bool = False        # activation checkpointing: each layer recomputed in its backward
    logprob_chunk_tokens: int = TrainerConfig.logprob_chunk_tokens
    fp32_head: bool = False            # grpo.cast_lm_head_to_fp32: the head gathered, and its logits, in fp32
    # The framework's share (context, communication buffers, fragmentation); 0 to compare with
    # torch's own allocation counters, which see none of it.
    overhead_bytes: int = TRAINER_OVERHEAD_GPU


class ModelStorage(NamedTuple):
    """What one trainer keeps of the models between steps: over how many trainers it is sharded,
    which frozen copies, and what DeepSpeed ZeRO-3 offloads to host memory
    (zero3_device_bytes_per_param)."""
    shard: int = 1
    params: int | None = None          # the model's exact numel, over the shape's count
    reference: bool = False            # a frozen reference copy (ignored with lora: there is none)
    reference_dtype: str | None = None  # frozen weights' dtype; None: the compute dtype
    reward_model_params: int = 0       # rewards[i].model: sharded and stored as the reference is
    # LoRA's adapters (model.use_peft): the model's own parameters are then frozen weights,
    # stored as the reference is.
    lora: LoraTargets | None = None
    offload_optimizer: bool = False
    offload_params: bool = False
    adam_bytes: float = ADAM_MOMENT_BYTES   # the two moments per trained parameter (adam_moment_bytes)


def trainer_parts(shape: ModelShape, step: TrainingStep, storage: ModelStorage = ModelStorage()) -> dict[str, int]:
    """One trainer's peak memory in bytes, by part, for a training step in the given setting: the
    formula `hpcrl plan` and the render checks use, callable by a benchmark that measures the same
    step. With LoRA the parts get a "frozen_weights" entry."""
    c = DTYPE_BYTES[step.compute_dtype]
    n = storage.params if storage.params is not None else shape.params
    h, v, lora = shape.hidden_size, shape.vocab_size, storage.lora
    tokens = step.micro_batch * step.seq_len
    final_norm = (4 + c) * h                      # the final norm before the LM head, every position
    frozen = DTYPE_BYTES[storage.reference_dtype or step.compute_dtype]
    # A frozen model's head is stored in what it computes in: with an fp32 head, fp32.
    frozen_head = v * h * (4 - frozen) if step.fp32_head else 0
    per_layer = layer_activation_bytes(shape, c)
    layers = [per_layer + (lora.layer_activation_bytes(i, c) if lora else 0) for i in range(shape.num_layers)]
    dora = lora.dora_peak_bytes(c) if lora else 0
    # Merged expert stacks (model.lora_target_parameters): each layer the backward has yet to reach
    # keeps its own (one with checkpointing), and one stack's gradient is computed at a time.
    stacks = lora.stack_bytes(c) if lora else 0
    if step.checkpointing:
        activations = tokens * (shape.num_layers * c * h + max(layers, default=0) + final_norm) + dora + 2 * stacks
    else:
        activations = tokens * (sum(layers) + final_norm) + dora + (shape.num_layers + 1) * stacks
    chunk = min(step.logprob_chunk_tokens, step.micro_batch * step.completion_len)
    head_bytes = 4 if step.fp32_head else c
    root = shape.root_params * c + v * h * (head_bytes - c)     # the gathered root group
    shard = storage.shard
    if lora is None:
        per_param = zero3_device_bytes_per_param(c, offload_optimizer=storage.offload_optimizer,
                                                 offload_params=storage.offload_params)
        if not storage.offload_optimizer:
            per_param = with_moments(per_param, storage.adam_bytes)
        state = {"training_state": math.ceil(n * per_param / shard),
                 "reference": math.ceil((n * frozen + frozen_head) / shard) if storage.reference else 0}
        # one layer's fp32 gradients, and the LM head's gradient in the root group
        gathered = GATHERED_LAYERS * shape.layer_params * c + shape.layer_params * 4 + root + v * h * head_bytes
    else:
        adapters = max((lora.layer_params(i) for i in range(shape.num_layers)), default=0)
        state = {"frozen_weights": math.ceil((n * frozen + frozen_head) / shard),
                 "training_state": math.ceil((lora.params + lora.saved_params)
                                             * with_moments(ADAPTER_BYTES_PER_PARAM, storage.adam_bytes) / shard),
                 "reference": 0}
        # one layer's adapter gradients in fp32; the frozen head has none, a trained copy of it
        # (model.lora_modules_to_save) is gathered with the root and keeps its fp32 gradient
        gathered = (GATHERED_LAYERS * (shape.layer_params + adapters) * c + adapters * 4 + root
                    + lora.saved_params * (c + 4))
    return {
        **state,
        "reward_models": math.ceil(storage.reward_model_params * frozen / shard),
        "gathered_layers": gathered,
        "activations": activations,
        "logits": LOGITS_COPIES * step.micro_batch * (step.completion_len + 1) * v * head_bytes,
        "logprob_chunk": LOGPROB_FP32_COPIES * chunk * v * 4,
        "overhead": step.overhead_bytes,
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

