"""A job's memory per task: the formulas of hpcrl.job.memory in the setting the job's recipe and
site give them (the compute and serving dtypes, the widest micro-batch row, the engine's context,
vLLM's defaults, the LoRA targets), and the memory one task has.

A server rank is held against inference.gpu_memory_utilization x the GPU's memory (vLLM's budget),
or the whole GPU for the transformers engine (which keeps the KV cache and the sampling scores of
the node's whole batch at once, and counts them). What is left of the budget is the KV cache for
the batch: the facts say how many of the node's sequences it holds at once (fewer only means
generation runs in waves).

Capacity per task: site.node.gpu_memory_gb on GPU sites; node.memory_gb / tasks per node on CPU
sites; None where the site gives no size.
"""

from __future__ import annotations

import math

from hpcrl.job import context
from hpcrl.job.batch import sequences_per_engine
from hpcrl.job.lora import CONVERTED_STACKS, ROUTER_PARAMETER, LoraTargets, converted_parameter_names
from hpcrl.job.memory import (GIB, TRAIN_BYTES_PER_PARAM, TRAINER_OVERHEAD_CPU, TRAINER_OVERHEAD_GPU,
                              VLLM_BATCHED_TOKENS, VLLM_LARGE_GPU_GIB, VLLM_MAX_SEQS, ModelStorage, TrainingStep,
                              adam_moment_bytes, kv_bytes_per_token, server_parts, trainer_parts,
                              zero3_device_bytes_per_param)
from hpcrl.job.model_shape import DTYPE_BYTES, ModelShape, count_parameters
from hpcrl.job.placement import Plan
from hpcrl.job.recipe import engine_dtype
from hpcrl.job.spec import JobSpec

# The prompt tokens the trainers' estimate allows beside max_completion_length when the engine's
# context is the model's own (inference.max_model_len unset): a 32k-token context would otherwise
# size every micro-batch as 32k tokens wide and refuse most jobs of a long-context model.
ASSUMED_PROMPT_TOKENS = 1024


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


def frozen_dtype(spec: JobSpec) -> str:
    """What frozen weights are stored in (hpcrl.compute.train.fsdp.frozen_dtype): model.dtype, else
    the compute dtype."""
    dtype = spec.recipe.model.dtype
    return compute_dtype(spec) if dtype == "auto" else dtype


def lora_targets(spec: JobSpec, shape: ModelShape) -> LoraTargets | None:
    """The recipe's LoRA adapters on the model (None without model.use_peft)."""
    m = spec.recipe.model
    return LoraTargets.of(shape, m.lora_target_modules, m.lora_r, m.lora_dropout, m.use_dora,
                          m.lora_modules_to_save or (), m.lora_target_parameters or ()) if m.use_peft else None


def describe_lora(spec: JobSpec, shape: ModelShape) -> str | None:
    """`hpcrl plan`'s line on what the adapters reach (None without model.use_peft), peft's conversion
    on a mixture of experts included: a target list or "all-linear" there adapts the fused expert
    stacks (and the router) as parameters, which a user of transformers 4 would not expect."""
    m, targets = spec.recipe.model, lora_targets(spec, shape)
    if targets is None:
        return None
    linear = sorted(set().union(*targets.layers))
    layers = sum(1 for adapted in targets.layers if adapted)
    parts = [f"r {m.lora_r} on {', '.join(linear)} in {layers} of {shape.num_layers} layers" if linear else
             f"r {m.lora_r} on no linear layer"]
    converted = converted_parameter_names(shape, m.lora_target_modules)
    # a fused stack's adapter has the rank of every linear it fuses (gate_up_proj: twice)
    fused = {stack.rsplit(".", 1)[-1]: len(linears) for stack, linears in CONVERTED_STACKS.items()}
    stacks = [f"{name} (r {m.lora_r * fused[name]})" if fused[name] > 1 else name
              for name in converted if name != ROUTER_PARAMETER]
    if converted:
        reached = ([f"the expert stacks ({shape.experts} experts each) {' and '.join(stacks)}"] if stacks else []) + \
            ([f"the router ({ROUTER_PARAMETER})"] if ROUTER_PARAMETER in converted else [])
        parts.append(f"peft converts the targets for this mixture of experts: adapted as parameters in every "
                     f"layer, {' and '.join(reached)}")
    if m.lora_target_parameters:
        parts.append(f"model.lora_target_parameters: {', '.join(m.lora_target_parameters)}")
    if m.lora_modules_to_save:
        parts.append(f"trained copies of {', '.join(m.lora_modules_to_save)}")
    return f"lora: {'; '.join(parts)}; {targets.params / 1e6:,.1f}M adapter parameters"


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


def trainer_parts_for(spec: JobSpec, shape: ModelShape, shard: int) -> dict[str, int]:
    """One trainer's memory by part (hpcrl.job.memory.trainer_parts) for the job, its state
    sharded over `shard` trainers."""
    r = spec.recipe
    on_gpu = spec.site.device == "cuda"
    step = TrainingStep(
        micro_batch=r.grpo.per_device_train_batch_size,
        # The padded micro-batch is as wide as its longest prompt plus its longest completion;
        # the engine takes prompts up to max_model_len - max_completion_length, so a full-width
        # batch comes as soon as one long prompt gets a full-length completion. The estimate holds
        # for that batch: a step that runs out of memory hours in is what it is here to prevent.
        seq_len=train_seq_len(spec), completion_len=r.grpo.max_completion_length,
        compute_dtype=compute_dtype(spec),
        checkpointing=bool(r.trainer.activation_checkpointing or r.grpo.gradient_checkpointing),
        logprob_chunk_tokens=r.trainer.logprob_chunk_tokens, fp32_head=r.grpo.cast_lm_head_to_fp32,
        overhead_bytes=TRAINER_OVERHEAD_GPU if on_gpu else TRAINER_OVERHEAD_CPU)
    storage = ModelStorage(
        shard=shard, adam_bytes=adam_moment_bytes(r.grpo.optim),
        reference_dtype=None if r.model.dtype == "auto" else r.model.dtype,
        # An offloaded reference lives in host memory; on a CPU site that is the same memory.
        reference=r.grpo.beta > 0 and not (r.trainer.reference_offload and on_gpu),
        # A reward model this machine cannot read counts as nothing, as an unknown model does.
        reward_model_params=0 if r.trainer.reference_offload and on_gpu else
        sum(count_parameters(x.model) or 0 for x in r.rewards if x.model),
        lora=lora_targets(spec, shape),
        # Offloaded state lives in host memory; on a CPU site that is the same memory.
        offload_optimizer=r.trainer.offload_optimizer and on_gpu, offload_params=r.trainer.offload_params and on_gpu)
    return trainer_parts(shape, step, storage)


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


def server_parts_for(spec: JobSpec, plan: Plan, shape: ModelShape) -> tuple[dict[str, int], int | None, dict]:
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
    batch = sequences_per_engine(spec, plan)
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
