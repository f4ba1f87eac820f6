"""FSDP2 in one place: how the policy and the reference model are sharded and loaded, and the
trainer engine over them (``Fsdp2Engine``, trainer.engine fsdp2).

Modelled on torchtitan's ``apply_fsdp``: ``fully_shard`` each decoder layer, then the root (which
takes what is left: embeddings, the final norm, the LM head; tied embeddings stay in one group).
A 1-D mesh fully shards; a 2-D ``("replicate", "shard")`` mesh is HSDP (FSDP2 shards over the last
dimension and all-reduces gradients over the first).

Loading never materialises the model on every rank: all ranks build it on the meta device and
shard it, then rank 0 streams the Hugging Face checkpoint to them (hpcrl.compute.train.loading);
every rank keeps only its own slice.

Numerics: the policy's master weights are fp32 (so is the optimizer). With bf16 the layers compute in
bf16 (``MixedPrecisionPolicy``) and gradients are reduced in fp32. The reference model has no optimizer
and no gradients: with bf16 it is *stored* in bf16, which gives the same forward as an fp32 copy cast
to bf16 at every all-gather, in half the memory; recipe model.dtype stores it in another dtype.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor

from hpcrl.compute.train.engine import StoredTensors, TrainEngine
from hpcrl.compute.train.loading import check_devices, load_group, read_group, stream_from_rank0
from hpcrl.job import rundir
from hpcrl.job.errors import UserError
from hpcrl.job.recipe import GRPOConfig, Recipe

if TYPE_CHECKING:
    from hpcrl.compute.launch.context import LaunchContext

__all__ = [
    "Fsdp2Engine",
    "mixed_precision_for",
    "decoder_layers",
    "enable_activation_checkpointing",
    "apply_fsdp",
    "LoadOptions",
    "load_sharded_model",
    "load_policy_and_reference",
    "frozen_dtype",
    "local_param_bytes",
    "global_param_bytes",
    "param_devices",
    "is_offloaded",
    "describe",
]

log = logging.getLogger(__name__)


def mixed_precision_for(device_type: str, bf16: Optional[bool]) -> tuple[torch.dtype, torch.dtype]:
    """``(param_dtype, reduce_dtype)`` for a recipe's ``grpo.bf16``.

    None (auto): bf16 compute with fp32 gradient reduction on an accelerator, fp32 on CPU.
    True: bf16/fp32 anywhere (CPU included). False: fp32/fp32.
    """
    if bf16 is None:
        bf16 = device_type != "cpu"
    return (torch.bfloat16, torch.float32) if bf16 else (torch.float32, torch.float32)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of a Hugging Face causal LM (``model.model.layers``).

    Falls back to the classes the model names in ``_no_split_modules`` (what HF's own device_map
    and accelerate's FSDP auto-wrap use) for architectures that keep their layers elsewhere.
    """
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, (nn.ModuleList, nn.ModuleDict)):
        return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if type(m).__name__ in names]
    if not found:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}: "
                         f"no model.model.layers and no _no_split_modules")
    return found


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (non-reentrant checkpointing).

    Uses the model's own Hugging Face switch, which keeps parameter names unchanged (a
    ``checkpoint_wrapper`` would add ``_checkpoint_wrapped_module.`` to every name, and the names are
    what the weight sync and checkpoints are keyed by). FSDP2's hooks run inside the checkpointed
    region, so the recomputation re-gathers the layer's parameters like the backward does.
    """
    enable = getattr(model, "gradient_checkpointing_enable", None)
    if enable is None:
        raise ValueError(f"{type(model).__name__} has no gradient_checkpointing_enable()")
    enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if getattr(model, "config", None) is not None:
        model.config.use_cache = False


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    param_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    reshard_after_forward: bool = True,
    activation_checkpointing: bool = False,
    offload: bool = False,
    fp32_head: bool = False,
) -> nn.Module:
    """Shard ``model`` in place: each decoder layer, then the root. Returns the model.

    ``mesh``: 1-D = full sharding; 2-D (replicate, shard) = HSDP. ``param_dtype``/``reduce_dtype``:
    compute and gradient-reduction dtypes (None or the parameters' own dtype = no casting).
    ``offload``: FSDP2's ``CPUOffloadPolicy`` (sharded parameters, gradients and optimizer state
    live in host memory; each layer is copied to the device for its all-gather).
    ``fp32_head``: the LM head computes in fp32 (grpo.cast_lm_head_to_fp32), see :func:`_fp32_head`.
    """
    if mesh.ndim not in (1, 2):
        raise ValueError(f"apply_fsdp: mesh must be 1-D (fsdp) or 2-D (replicate, shard), got {mesh.ndim}-D")
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    orig_dtypes = {p.dtype for p in model.parameters()}
    if param_dtype in orig_dtypes and len(orig_dtypes) == 1:
        param_dtype = None          # no cast: the policy stays the identity
    if reduce_dtype is not None and param_dtype is None and reduce_dtype in orig_dtypes:
        reduce_dtype = None
    mp_policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    offload_policy: OffloadPolicy = OffloadPolicy()
    if offload:
        # Pinned host memory needs an accelerator; on a CPU-only machine it cannot be had.
        offload_policy = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")
    kw: dict[str, Any] = dict(mesh=mesh, mp_policy=mp_policy, offload_policy=offload_policy)
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **kw)
    root_kw = kw
    if fp32_head:
        fp32 = dict(kw, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32))
        if _fp32_head(model, param_dtype):
            root_kw = fp32
        else:
            fully_shard(model.get_output_embeddings(), reshard_after_forward=reshard_after_forward, **fp32)
    # The root keeps the embeddings / norm / head. Resharding it after forward matters for a
    # forward-only model (the reference): nothing would free it otherwise until the next forward.
    fully_shard(model, reshard_after_forward=reshard_after_forward, **root_kw)
    return model


def _fp32_head(model: nn.Module, param_dtype: Optional[torch.dtype]) -> bool:
    """grpo.cast_lm_head_to_fp32, as TRL does it: the head's weight all-gathered in fp32 and its input
    cast to fp32 (FSDP2 casts a group's inputs to its compute dtype), so the logits are fp32. Its own
    group, unless it is tied to the input embeddings (returns True): then the root group computes in
    fp32 (embeddings, final norm, head) and the embeddings' output is cast back to what the root
    computed in before (``param_dtype``, else the embeddings' own), as TRL's hook does, so the
    decoder layers see what they saw before."""
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None:
        raise UserError("grpo.cast_lm_head_to_fp32: this model has no LM head (get_output_embeddings() is None)")
    if hasattr(head, "base_layer"):
        raise UserError("grpo.cast_lm_head_to_fp32: not with an adapter on the LM head (model.lora_target_modules "
                        "matches lm_head), as TRL; leave lm_head out or the option off")
    if not _tied_head(model):
        return False
    before = param_dtype or embeddings.weight.dtype

    def cast_back(module, args, output):
        return output.to(before)

    embeddings.register_forward_hook(cast_back)
    return True


def _tied_head(model: nn.Module) -> bool:
    head, embeddings = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embeddings is not None and head.weight is embeddings.weight


def _store_fp32_head_in_fp32(model: nn.Module) -> None:
    """With grpo.cast_lm_head_to_fp32, the parameters that compute in fp32 (the head's; with a tied
    head, the root group's: all but the decoder layers') are stored in fp32, as a frozen model's
    others are stored in what they compute in: a reference then starts equal to the policy."""
    head = model.get_output_embeddings()
    if head is None:
        return                              # apply_fsdp names the problem
    if _tied_head(model):
        in_layers = {id(p) for layer in decoder_layers(model) for p in layer.parameters()}
        owners = list(model.modules())
    else:
        in_layers, owners = set(), [head]
    fp32: dict[int, nn.Parameter] = {}      # one new parameter per old one: tied weights stay tied
    for module in owners:
        for name, param in list(module._parameters.items()):
            if param is None or id(param) in in_layers or param.dtype == torch.float32:
                continue
            if id(param) not in fp32:
                fp32[id(param)] = nn.Parameter(param.detach().float(), requires_grad=param.requires_grad)
            module._parameters[name] = fp32[id(param)]


def _comm_group(mesh: DeviceMesh) -> Optional[dist.ProcessGroup]:
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() != dist.get_world_size():
        raise ValueError(f"a {mesh.ndim}-D mesh of {mesh.size()} ranks in a world of "
                         f"{dist.get_world_size()}: load needs a group spanning the mesh")
    return None


@dataclass(frozen=True)
class LoadOptions:
    """How :func:`load_sharded_model` builds, stores and reads a model."""

    dtype: torch.dtype = torch.float32          # what the parameters are stored in
    param_dtype: Optional[torch.dtype] = None   # FSDP2's compute dtype (mixed precision)
    reduce_dtype: Optional[torch.dtype] = None
    reshard_after_forward: bool = True
    activation_checkpointing: bool = False
    offload: bool = False                       # parameters in host memory (CPUOffloadPolicy)
    trust_remote_code: bool = False
    load_timeout_s: Optional[float] = None      # the others' wait for the reader (None: the collective timeout)
    attn_implementation: Optional[str] = None
    auto_class: str = "AutoModelForCausalLM"    # a reward model: AutoModelForSequenceClassification
    # Changes the model before it is sharded, and the reader's source model the same way (LoRA).
    adapt: Optional[Callable[[nn.Module], nn.Module]] = None
    read_groups: Optional[list[list[int]]] = None
    fp32_head: bool = False                     # the LM head computes in fp32 (grpo.cast_lm_head_to_fp32)


def load_sharded_model(model_dir: str, mesh: DeviceMesh, device: torch.device,
                       options: LoadOptions = LoadOptions()) -> nn.Module:
    """A Hugging Face causal LM from ``model_dir``, sharded with :func:`apply_fsdp` on ``mesh``.

    Parameters are stored in ``options.dtype`` on ``device`` (on the host when ``offload``). Only
    rank 0 reads the checkpoint; the others receive their slices. ``load_timeout_s`` bounds the
    others' wait for rank 0's read (None: the collective timeout of the mesh's group). ``adapt``
    changes the model before it is sharded, on the meta device, and rank 0's source model the same
    way before it streams (LoRA adapters: hpcrl.compute.train.lora.add_adapters).

    ``read_groups``: the ranks of each node (a partition of the world), when every node has its own
    copy of ``model_dir`` (a staged model): the first rank of each group reads it and streams to its
    group alone, so loading moves no weight byte between nodes.
    """
    import transformers
    from transformers import AutoConfig

    o = options
    model_class = getattr(transformers, o.auto_class)
    device = torch.device(device)
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=o.trust_remote_code)
    config.use_cache = False            # the trainer only runs whole sequences
    with torch.device("meta"):
        model = model_class.from_config(config, dtype=o.dtype, trust_remote_code=o.trust_remote_code,
                                        attn_implementation=o.attn_implementation)
        if o.adapt is not None:
            model = o.adapt(model)
        if o.fp32_head:
            _store_fp32_head_in_fp32(model)
    apply_fsdp(model, mesh, param_dtype=o.param_dtype, reduce_dtype=o.reduce_dtype,
               reshard_after_forward=o.reshard_after_forward,
               activation_checkpointing=o.activation_checkpointing, offload=o.offload, fp32_head=o.fp32_head)
    model.to_empty(device=torch.device("cpu") if o.offload else device)
    if o.offload and device.type != "cpu":
        # FSDP2 offloads parameters only; buffers (rotary inv_freq) belong on the compute device,
        # where a non-meta fully_shard would have moved them.
        for module in model.modules():
            for name, buf in module.named_buffers(recurse=False):
                module._buffers[name] = buf.to(device)
    group = _comm_group(mesh) if o.read_groups is None else read_group(o.read_groups)
    if o.load_timeout_s is not None:
        load_group(group, o.load_timeout_s)    # made before rank 0 reads: its making is a rendezvous too
    source = None
    if dist.get_rank(group) == 0:
        # An fp32 head beside weights stored in another dtype: read in fp32 and cast tensor by tensor
        # as they stream (the same rounding as reading in that dtype), so the head keeps the
        # checkpoint's values: rank 0 holds the model in fp32 while it loads.
        read_dtype = torch.float32 if o.fp32_head else o.dtype
        source = model_class.from_pretrained(model_dir, dtype=read_dtype, trust_remote_code=o.trust_remote_code,
                                             attn_implementation=o.attn_implementation)
        if o.adapt is not None:
            source = o.adapt(source)
    stream_from_rank0(model, source, device, group, what=model_dir, load_timeout_s=o.load_timeout_s)
    del source
    return model


def frozen_dtype(recipe: Recipe, compute_dtype: torch.dtype) -> torch.dtype:
    """What a frozen model (the reference, a reward model) is stored in. No gradients, no optimizer:
    model.dtype, by default the compute dtype (the forward of an fp32 copy cast at every all-gather,
    in half the bytes); it computes in the compute dtype either way."""
    return compute_dtype if recipe.model.dtype == "auto" else getattr(torch, recipe.model.dtype)


def load_policy_and_reference(model_dir: str, mesh: DeviceMesh, device: torch.device, recipe: Recipe,
                              read_groups: Optional[list[list[int]]] = None
                              ) -> tuple[nn.Module, Optional[nn.Module]]:
    """The trainable policy and (when ``recipe.grpo.beta > 0``) the frozen reference model.

    Reads ``grpo.bf16``, ``grpo.beta``, ``grpo.gradient_checkpointing``, ``grpo.cast_lm_head_to_fp32``,
    ``trainer.activation_checkpointing``, ``trainer.reference_offload``, ``model.dtype``, ``model.use_peft``
    and the LoRA fields,
    ``model.trust_remote_code``, ``model.attn_implementation`` and ``launch.model_load_timeout_s`` of the recipe.

    Both are sharded the same way on the same mesh and device. The reference is in eval mode with
    ``requires_grad=False`` everywhere; it lives in host memory only with an explicit
    ``trainer.reference_offload`` (FSDP2 ``CPUOffloadPolicy``), never because of where it was loaded.
    ``read_groups``: as :func:`load_sharded_model`'s (each node reads its own staged copy).
    """
    device = torch.device(device)
    grpo, trainer = recipe.grpo, recipe.trainer
    trust, load_timeout_s = recipe.model.trust_remote_code, recipe.launch.model_load_timeout_s
    attention = recipe.model.attn_implementation or None
    param_dtype, reduce_dtype = mixed_precision_for(device.type, grpo.bf16)
    lora = recipe.model.use_peft
    adapt = None
    if lora:
        from hpcrl.compute.train.lora import add_adapters

        adapt = lambda model: add_adapters(model, recipe.model)     # noqa: E731
    policy = load_sharded_model(model_dir, mesh, device, LoadOptions(
        # LoRA: the frozen base is stored as a frozen reference model is; the adapters are fp32.
        dtype=frozen_dtype(recipe, param_dtype) if lora else torch.float32,
        param_dtype=param_dtype, reduce_dtype=reduce_dtype,
        activation_checkpointing=bool(grpo.gradient_checkpointing or trainer.activation_checkpointing),
        trust_remote_code=trust, load_timeout_s=load_timeout_s, attn_implementation=attention, adapt=adapt,
        read_groups=read_groups, fp32_head=grpo.cast_lm_head_to_fp32))
    policy.train()
    check_devices(param_devices(policy), device, offload=False, what="policy")
    if grpo.beta <= 0:
        return policy, None
    if lora:
        from hpcrl.compute.train.lora import BaseModel

        return policy, BaseModel(policy)        # the base weights themselves: no second copy
    stored = frozen_dtype(recipe, param_dtype)
    reference = load_sharded_model(model_dir, mesh, device, LoadOptions(
        dtype=stored, param_dtype=param_dtype, offload=bool(trainer.reference_offload),
        trust_remote_code=trust, load_timeout_s=load_timeout_s, attn_implementation=attention,
        read_groups=read_groups, fp32_head=grpo.cast_lm_head_to_fp32))
    reference.eval()
    reference.requires_grad_(False)
    check_devices(param_devices(reference), device, offload=bool(trainer.reference_offload), what="reference")
    return policy, reference


# ----------------------------------------------------------------------------------------------
# Introspection (tests, benchmarks, startup log)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def local_param_bytes(model: nn.Module) -> int:
    """Bytes of this rank's parameter shards (what the parameters cost this rank at rest)."""
    return sum(_local(p).numel() * _local(p).element_size() for p in model.parameters())


def global_param_bytes(model: nn.Module) -> int:
    """Bytes of the whole (unsharded) model in its storage dtype."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def param_devices(model: nn.Module) -> set[torch.device]:
    """Devices holding this rank's parameter shards."""
    return {_local(p).device for p in model.parameters()}


def is_offloaded(model: nn.Module) -> bool:
    """True when FSDP2 manages ``model`` with a ``CPUOffloadPolicy``."""
    if not isinstance(model, FSDPModule):
        return False
    state = model._get_fsdp_state()       # FSDP2 keeps the policy on its parameter group
    group = state._fsdp_param_group
    return group is not None and isinstance(group.offload_policy, CPUOffloadPolicy)


def describe(model: nn.Module) -> str:
    """One line for the startup log: shard bytes here / whole model, devices, offload."""
    return (f"{type(model).__name__}: {local_param_bytes(model) / 2**20:.1f} MiB of "
            f"{global_param_bytes(model) / 2**20:.1f} MiB here on {sorted(map(str, param_devices(model)))}"
            f"{', host-offloaded' if is_offloaded(model) else ''}")


class Fsdp2Engine(TrainEngine):
    """The policy as this module shards it (FSDP2 or HSDP, applied at load), trained by torch's AdamW,
    checkpointed by torch.distributed.checkpoint."""

    name = "fsdp2"

    def __init__(self, policy: nn.Module) -> None:
        self.policy = policy

    @classmethod
    def build(cls, ctx: LaunchContext, model_dir: str, device: torch.device,
              read_groups: Optional[list[list[int]]]) -> tuple[Fsdp2Engine, Optional[nn.Module]]:
        policy, reference = load_policy_and_reference(model_dir, ctx.mesh, device, ctx.spec.recipe,
                                                      read_groups=read_groups)
        return cls(policy), reference

    def describe(self) -> str:
        return describe(self.policy)

    @property
    def model(self) -> nn.Module:
        return self.policy

    @property
    def sync_module(self) -> nn.Module:
        return self.policy

    def configure(self, grpo: GRPOConfig) -> None:
        from hpcrl.compute.train.optim import build_optimizer, build_scheduler

        self.optimizer = build_optimizer(self.policy, grpo)
        self.scheduler = build_scheduler(self.optimizer, grpo)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, max_grad_norm: float) -> float:
        import math

        from hpcrl.compute.train.optim import clip_grad_norm

        norm = clip_grad_norm(self.policy.parameters(), max_grad_norm)
        if math.isfinite(norm):
            self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    def save(self, directory: Path, step: int, extra: dict, *, keep: int, timeout_s: float) -> Path:
        from hpcrl.compute.train import checkpoint as ckpt

        return ckpt.save(directory, step, self.policy, self.optimizer, self.scheduler, extra=extra, keep=keep,
                         timeout_s=timeout_s)

    def load(self, path: Path, *, timeout_s: float) -> dict:
        from hpcrl.compute.train import checkpoint as ckpt

        self.ensure_wrote(path)
        return ckpt.load(path, self.policy, self.optimizer, self.scheduler, timeout_s=timeout_s)

    @classmethod
    def wrote(cls, path: Path) -> bool:
        return (Path(path) / rundir.DCP_INDEX).is_file()

    @classmethod
    def checkpoint_tensors(cls, path: Path) -> StoredTensors:
        from hpcrl.compute.train.dcp_reader import dcp_tensors

        return dcp_tensors(path)

    def local_parts(self, model: nn.Module) -> list[torch.Tensor]:
        return [_local(p) for p in model.parameters()]
