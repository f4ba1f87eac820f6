"""Trainer side of a weight sync: sharded parameters -> full tensors, in buckets, in one order.

Backend-agnostic (no vLLM import): every transport (shared memory, NCCL, the node channel, a checkpoint file) is fed
by ``iter_buckets``. Rules it keeps, each against a failure it would otherwise cause (a hang,
torn weights, a sender out of memory):

- ONE order: parameters are walked in the module's ``named_parameters()`` order on every rank. A
  DTensor's ``full_tensor()`` is an all-gather, so a rank that walked another order would hang.
- Each gather completes before its bytes are used (``full_tensor()`` is synchronous on CPU/gloo;
  on GPU the caller's copy runs on the same stream the all-gather result was waited on).
- Bounded memory: a bucket is yielded BEFORE the next tensor is gathered, and the yielded list is
  emptied when the generator resumes, so the sender holds at most one bucket of gathered tensors
  (plus the one all-gather in flight), never the model.
- The wire dtype before the gather: with ``cast_to`` (the sync's wire dtype) each rank casts its
  local shard and the all-gather moves the wire dtype (half the bytes of fp32 masters for a bf16
  engine). A cast is elementwise, so this is bit-identical to gathering the master and casting
  the result; every rank of a gather must then use the same one: a trainer-side sync takes it
  through ``agree_wire_dtype`` once, when it is built, and never changes it.

Names are mapped to Hugging Face checkpoint names, which is what vLLM's ``model.load_weights``
takes: wrapper prefixes are stripped and a tied ``lm_head.weight`` is skipped, as HF checkpoints do.

A parameter an engine partitions where torch cannot see it (DeepSpeed ZeRO-3's) is sent as the
engine's own handle (hpcrl.compute.partitioned.PartitionedParam), which knows the full shape and
gathers the partitions itself, in the wire dtype. The walk, the order and the buckets are the
FSDP2 ones: only the gather of one tensor differs, and this module never learns which engine it is.

A model with LoRA adapters (hpcrl.compute.train.lora) is sent as the model it stands for: each
adapted linear layer is ONE entry, ``MergedWeight``, gathered as its base weight, lora_A and lora_B
and merged there (W + scale * B A; DoRA rescales its rows), one layer at a time inside the
bucketing, so no merged copy of the whole model ever exists. The adapters themselves are never sent.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from hpcrl.compute.partitioned import PartitionedParam, partitioned
from hpcrl.compute.sync.api import SyncError

__all__ = [
    "WRAPPER_PREFIXES",
    "ParamSpec",
    "MergedWeight",
    "lora_layers",
    "GatherTraffic",
    "LiveBytes",
    "WIRE_DTYPES",
    "all_reduce_sum",
    "agree_wire_dtype",
    "hf_name",
    "unwrapped_name",
    "sync_named_params",
    "changing_params",
    "param_specs",
    "ipc_buffer_bytes",
    "full_tensor",
    "iter_full_tensors",
    "iter_buckets",
    "bucket_groups",
    "gather_into",
    "gather_and_drop",
]

# Module-wrapper segments that torch inserts into parameter names: FSDP1, torch.compile,
# activation checkpointing. FSDP2 (fully_shard) changes no names.
WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_orig_mod.", "_checkpoint_wrapped_module.")
_WRAPPER_RE = re.compile("|".join(re.escape(p) for p in WRAPPER_PREFIXES))

Bucket = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class ParamSpec:
    """What a parameter will look like once gathered (known without gathering)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


def hf_name(name: str) -> str:
    """Trainer parameter name -> HF checkpoint name (wrapper segments removed anywhere in it)."""
    return _WRAPPER_RE.sub("", name)


class MergedWeight:
    """The weight an engine serves for a LoRA layer: ``base + scale * lora_B @ lora_A``, known by
    its shape and dtype (the base weight's) without gathering, like a parameter. :func:`full_tensor`
    gathers the three (every rank of the mesh, in this order) and merges them in fp32. The base is
    gathered as stored, not cast to the wire dtype first: the merged weight is then rounded once,
    as the merged model's would be (on GPUs the frozen base is stored in the engine's dtype anyway).
    DoRA's ``magnitude`` (one value per output row), when there is one, is gathered last, and each
    row of the sum is rescaled to it: ``magnitude / ||row||`` (peft's merge).

    An adapter on a stack of experts' weights (peft's ParamWrapper, model.lora_target_parameters) has
    ``experts`` > 1: lora_A holds each expert's r rows one after the other, lora_B each expert's r
    columns interleaved, and expert e's update is B[:, :, e] A[e], laid out as the stack is
    (``out_first``: [E, out, in], else [E, in, out]), as peft's get_delta_weight computes it."""

    def __init__(self, base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float,
                 magnitude: torch.Tensor | None = None, *, experts: int = 1, out_first: bool = True) -> None:
        self.base, self.lora_a, self.lora_b, self.scale = base, lora_a, lora_b, float(scale)
        self.magnitude = magnitude
        self.experts, self.out_first = experts, out_first
        self.shape, self.dtype = base.shape, base.dtype
        self.requires_grad = True           # it changes whenever the adapters train

    def numel(self) -> int:
        return self.base.numel()

    @torch.no_grad()
    def merge(self, wire: torch.dtype, tracker: LiveBytes | None, traffic: GatherTraffic | None) -> torch.Tensor:
        base = full_tensor(self.base, None, tracker, traffic)
        a = full_tensor(self.lora_a, torch.float32, tracker, traffic)
        b = full_tensor(self.lora_b, torch.float32, tracker, traffic)
        if self.experts > 1:
            a = a.reshape(self.experts, -1, a.shape[-1])            # [E, r, in]
            b = b.reshape(b.shape[0], -1, self.experts)             # [out, r, E]
            delta = torch.einsum("ore,eri->eoi" if self.out_first else "ore,eri->eio", b, a)
            # Into the new tensor: on one trainer the gathered base can be the parameter itself.
            merged = delta.mul_(self.scale).add_(base)
        else:
            merged = torch.addmm(base.float(), b, a, alpha=self.scale)
        del base, a, b
        if self.magnitude is not None:
            m = full_tensor(self.magnitude, torch.float32, tracker, traffic)
            merged *= (m / torch.linalg.vector_norm(merged, dim=1)).unsqueeze(1)
            del m
        merged = merged.to(wire)
        return tracker.track(merged) if tracker is not None else merged


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The LoRA layers of ``model`` by module path: peft's layers keep the original module as
    ``base_layer`` and the active adapter's matrices in ``lora_A``/``lora_B`` (the adapter "default")."""
    return {name: m for name, m in model.named_modules()
            if isinstance(getattr(m, "base_layer", None), torch.nn.Module) and "default" in getattr(m, "lora_A", {})}


def _dora_magnitude(layer: torch.nn.Module) -> torch.Tensor | None:
    """A DoRA layer's trained magnitude (peft keeps it as the "default" DoraLinearLayer's weight)."""
    dora = getattr(layer, "lora_magnitude_vector", None)
    return dora["default"].weight if dora is not None and "default" in dora else None


_BASE_LAYERS = re.compile(r"(?:\.base_layer)+\.")


def unwrapped_name(name: str) -> str:
    """A parameter's name without peft's wrapper segments (``.base_layer``, several where adapters on
    one module nest): its name in the model without adapters."""
    return _BASE_LAYERS.sub(".", name)


def _merged_weight(model: torch.nn.Module, path: str, layer: torch.nn.Module) -> tuple[str, MergedWeight]:
    """A LoRA layer's merged weight, by the name of the parameter it stands for. An adapter on a
    parameter (peft's ParamWrapper: ``parameter_name``) reaches it in the innermost wrapped module."""
    a, b, scale = layer.lora_A["default"].weight, layer.lora_B["default"].weight, layer.scaling["default"]
    if not hasattr(layer, "parameter_name"):
        return f"{path}.base_layer.weight", MergedWeight(layer.base_layer.weight, a, b, scale, _dora_magnitude(layer))
    inner = path + ".base_layer"
    while hasattr(model.get_submodule(inner), "parameter_name"):
        inner += ".base_layer"
    return f"{inner}.{layer.parameter_name}", MergedWeight(
        layer.get_param(), a, b, scale, experts=layer.num_experts, out_first=layer._did_swap_in_out_features)


def sync_named_params(model: torch.nn.Module, tie_word_embeddings: bool | None = None) -> list[tuple[str, torch.Tensor]]:
    """``(hf_name, param)`` for every parameter a sync sends, in ``named_parameters()`` order.

    A tied ``lm_head.weight`` is left out (HF checkpoints leave it out; vLLM ties it itself).
    ``tie_word_embeddings`` defaults to ``model.config.tie_word_embeddings`` when there is one.
    ``named_parameters()`` already drops a second name for the same tensor object. A LoRA layer's
    weight is a ``MergedWeight`` under the base layer's name, in the base weight's place; its
    adapters are not sent, and its other parameters (a bias) keep the base layer's names. A module
    peft trains a copy of (model.lora_modules_to_save) is sent as its copy, under its own name.
    """
    if tie_word_embeddings is None:
        config = getattr(model, "config", None)
        tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    lora = lora_layers(model)
    merged = dict(_merged_weight(model, path, m) for path, m in lora.items())
    adapters = tuple(f"{path}.lora_" for path in lora)
    out = []
    for name, param in model.named_parameters():
        if name.startswith(adapters) or ".original_module." in name:
            continue
        param = merged.get(name, param)
        param = partitioned(param) or param
        # peft's wrappers (nested where two adapters share a module) leave; a module of
        # model.lora_modules_to_save is sent as its trained copy, under the module's own name.
        name = hf_name(unwrapped_name(name).replace(".modules_to_save.default.", "."))
        if tie_word_embeddings and name == "lm_head.weight":
            continue
        out.append((name, param))
    return out


def changing_params(named_params: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Of a sync's entries, those a later sync must send again when only some weights train (LoRA):
    every entry of a module whose parent also holds a trained one. Siblings go too because engines
    fuse them (vLLM's qkv_proj holds q_proj, k_proj and v_proj, weights and biases) and reload a
    fused layer only from all of its parts: a layer given some of them would keep garbage in the
    rest. With every weight trained this is every entry."""
    def parent(name: str) -> str:
        return name.rsplit(".", 2)[0] if name.count(".") >= 2 else ""
    trained = {parent(name) for name, p in named_params if p.requires_grad}
    return [(name, p) for name, p in named_params if parent(name) in trained]


def param_specs(named_params: Iterable[tuple[str, torch.Tensor]], cast_to: torch.dtype | None = None) -> list[ParamSpec]:
    """Global name/dtype/shape of each parameter; reads DTensor metadata, gathers nothing."""
    return [ParamSpec(name, _on_wire(p.dtype, cast_to), tuple(p.shape)) for name, p in named_params]


def ipc_buffer_bytes(bucket_bytes: int, params, wire_dtype: torch.dtype | None) -> tuple[int, str | None]:
    """The packed IPC buffer: the bucket, or the largest tensor in ``wire_dtype`` (None: as stored)
    when that is larger (vLLM's ``packed_ipc_producer`` raises on a tensor larger than its buffer;
    a 14B model's embedding is 1.5 GB against a 256 MiB bucket). Returns the size and the tensor
    that set it (None: the bucket did)."""
    specs = param_specs(params, wire_dtype)
    largest = max(specs, key=lambda s: s.nbytes, default=None)
    if largest is None or largest.nbytes <= bucket_bytes:
        return bucket_bytes, None
    return largest.nbytes, largest.name


# The dtypes a sync may put on the wire, by position: the ranks agree on one by its index (0: none
# known, each tensor as stored).
WIRE_DTYPES: tuple[torch.dtype | None, ...] = (None, torch.float32, torch.bfloat16, torch.float16, torch.float64)


def all_reduce_sum(values: list[int], group=None) -> list[int]:
    """``values`` summed over ``group``: a collective; unchanged where torch.distributed is not set up."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return values
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    t = torch.tensor(values, dtype=torch.int64, device=device)
    dist.all_reduce(t, group=group)
    return [int(v) for v in t.tolist()]


def agree_wire_dtype(mine: torch.dtype | None, group=None) -> torch.dtype | None:
    """The wire dtype every rank of ``group`` gathers in: the one any of them was given (None: each
    tensor as stored). A collective, run once when a trainer-side sync is built. A rank that
    gathered fp32 while another gathered bf16 would meet it in an all-gather of mismatched sizes
    (a hang or garbage), so two ranks given different dtypes raise together, before any gather."""
    if mine not in WIRE_DTYPES:
        raise ValueError(f"wire_dtype={mine!r}: the wire dtype must be None or one of {WIRE_DTYPES[1:]}")
    votes = [0] * len(WIRE_DTYPES)
    votes[WIRE_DTYPES.index(mine)] = 1
    known = [d for d, n in zip(WIRE_DTYPES, all_reduce_sum(votes, group)) if n and d is not None]
    if len(known) > 1:
        raise SyncError(f"the trainers disagree on the weight sync's wire dtype: {known}; "
                        f"the node's engines must all compute in one dtype")
    return known[0] if known else None


class LiveBytes:
    """Counts the bytes of gathered tensors that are still alive (a sender-memory probe).

    tracemalloc does not see torch allocations; this counts each gathered tensor from its gather
    until the last reference to it is dropped (weakref finalizer), and keeps the peak.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.live = 0
        self.peak = 0

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        n = tensor.numel() * tensor.element_size()
        with self._lock:
            self.live += n
            self.peak = max(self.peak, self.live)
        weakref.finalize(tensor, self._release, n)
        return tensor

    def _release(self, n: int) -> None:
        with self._lock:
            self.live -= n

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.live


class GatherTraffic:
    """Bytes this rank receives in the gathers of a sync (in the wire dtype they move in), split by
    whether the gather's group stays inside one node. Under HSDP it must: a sync never moves
    weights between nodes (each node's sender gathers from its own node's shards). Counted from
    the placements, not measured: an all-gather over a group of n ranks brings each of them
    (n - 1) / n of the full tensor.

    ``node_of_rank``: rank in the default (trainers') process group -> node index.
    """

    def __init__(self, node_of_rank: dict[int, int]) -> None:
        self.node_of_rank = dict(node_of_rank)
        self.in_node = 0
        self.cross_node = 0
        self._crosses: dict[tuple[int, ...], bool] = {}

    def reset(self) -> None:
        self.in_node = self.cross_node = 0

    def job_totals(self, group=None) -> dict[str, int]:
        """The sync's bytes over every trainer (a collective over ``group``), as the step logs them."""
        values = all_reduce_sum([self.in_node, self.cross_node], group)
        return {"gathered_bytes_in_node": values[0], "gathered_bytes_cross_node": values[1]}

    def count(self, param: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Add the gathers of ``param`` moved in ``dtype`` (default: its own)."""
        import torch.distributed as dist

        full = param.numel() * (dtype or param.dtype).itemsize
        if isinstance(param, PartitionedParam):
            self._add(tuple(param.gathered_by()), param.numel() * param.moves(dtype or param.dtype).itemsize)
            return
        placements = getattr(param, "placements", None)
        if placements is None:
            return
        for dim, placement in enumerate(placements):
            if placement.is_shard():
                self._add(tuple(dist.get_process_group_ranks(param.device_mesh.get_group(dim))), full)

    def _add(self, ranks: tuple[int, ...], full: int) -> None:
        if len(ranks) < 2:
            return
        crosses = self._crosses.get(ranks)
        if crosses is None:
            crosses = self._crosses[ranks] = len({self.node_of_rank[r] for r in ranks}) > 1
        received = full * (len(ranks) - 1) // len(ranks)
        if crosses:
            self.cross_node += received
        else:
            self.in_node += received


def _on_wire(dtype: torch.dtype, cast_to: torch.dtype | None) -> torch.dtype:
    return cast_to if cast_to is not None and dtype.is_floating_point else dtype


@torch.no_grad()
def full_tensor(param: torch.Tensor, cast_to: torch.dtype | None = None, tracker: LiveBytes | None = None,
                traffic: GatherTraffic | None = None) -> torch.Tensor:
    """The whole tensor behind ``param`` in the wire dtype: ``full_tensor()`` for a DTensor (a
    collective: every rank of its mesh must call it, in the same order, with the same ``cast_to``),
    the tensor itself otherwise (no copy unless cast)."""
    wire = _on_wire(param.dtype, cast_to)
    if isinstance(param, MergedWeight):
        return param.merge(wire, tracker, traffic)
    if traffic is not None:
        traffic.count(param, wire)
    if isinstance(param, PartitionedParam):
        tensor = param.gather(wire)
        return tracker.track(tensor) if tracker is not None else tensor
    if callable(getattr(param, "full_tensor", None)):
        if wire != param.dtype:
            # DTensor's cast is pointwise: each rank casts its own shard, placements unchanged
            # (uneven shards too), so the all-gather below moves wire bytes, not master bytes.
            param = param.to(wire)
        tensor = param.full_tensor()
        gathered = True
    else:
        tensor = param.detach()
        gathered = wire != tensor.dtype
        if gathered:
            tensor = tensor.to(wire)
    if tracker is not None and gathered:
        tracker.track(tensor)
    return tensor


def iter_full_tensors(named_params: Iterable[tuple[str, torch.Tensor]], cast_to: torch.dtype | None = None,
                      tracker: LiveBytes | None = None,
                      traffic: GatherTraffic | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, full tensor)`` one at a time, in the given order. Run on every rank."""
    for name, param in named_params:
        yield name, full_tensor(param, cast_to, tracker, traffic)


def iter_buckets(named_params: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, *, keep: bool = True,
                 cast_to: torch.dtype | None = None, tracker: LiveBytes | None = None,
                 traffic: GatherTraffic | None = None) -> Iterator[Bucket]:
    """Gather parameters in order and yield buckets of ``(name, full tensor)``.

    A bucket takes parameters until the next one would push it past ``bucket_bytes``; a single
    tensor larger than that is a bucket of its own. Run it on EVERY rank that holds a shard:
    ranks that do not send pass ``keep=False``; they gather (to stay in the collectives) and drop
    each tensor at once, and yield nothing.

    The yielded list is emptied when the generator resumes: copy (or send) its tensors before
    asking for the next bucket. That is what bounds the sender's extra memory to about one bucket
    plus the tensor being gathered.
    """
    for group in bucket_groups(named_params, bucket_bytes, cast_to):
        if not keep:
            for _, param in group:
                full_tensor(param, cast_to, tracker, traffic)  # stay in the collective, drop the result
            continue
        bucket: Bucket = [(name, full_tensor(param, cast_to, tracker, traffic)) for name, param in group]
        yield bucket
        bucket.clear()  # drops our (and the consumer's list's) references to the tensors


def bucket_groups(named_params: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                  cast_to: torch.dtype | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The parameters of each bucket, in order: a bucket takes parameters until the next one would
    push it past ``bucket_bytes`` on the wire (a larger one is a bucket of its own). Decided from
    the global shapes alone, so a group is known before any of it is gathered: iter_buckets
    yields a bucket before gathering the next one's first tensor, and hpcrl_shm picks the slot a
    group is gathered straight into."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    group: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, param in named_params:
        nbytes = param.numel() * _on_wire(param.dtype, cast_to).itemsize
        if group and size + nbytes > bucket_bytes:
            yield group
            group, size = [], 0
        group.append((name, param))
        size += nbytes
    if group:
        yield group


def _shard0_group(param: torch.Tensor):
    """The process group that gathers ``param`` when it is a DTensor split along dim 0 in equal
    parts and replicated otherwise (FSDP2's shards, HSDP's too, on a mesh dividing the rows), else
    None. Such a tensor's all-gather output IS the full tensor, so it can be written straight into
    a destination; any other layout (uneven rows, a tensor-parallel split) goes through DTensor."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(param, DTensor):
        return None
    split = [dim for dim, placement in enumerate(param.placements) if not isinstance(placement, Replicate)]
    if len(split) != 1:
        return None
    placement = param.placements[split[0]]
    if type(placement) is not Shard or placement.dim != 0 or param.shape[0] % param.device_mesh.size(split[0]):
        return None
    return param.device_mesh.get_group(split[0])


def _in_place_group(param: torch.Tensor, device: torch.device):
    """The group ``gather_into`` all-gathers ``param`` over straight into a destination on
    ``device``, or None where it gathers and copies."""
    group = _shard0_group(param)
    return group if group is not None and param.device == device else None


@torch.no_grad()
def gather_into(param: torch.Tensor, out: torch.Tensor, cast_to: torch.dtype | None = None,
                tracker: LiveBytes | None = None, traffic: GatherTraffic | None = None) -> None:
    """``full_tensor(param, cast_to)`` written into ``out`` (contiguous, the full shape, the wire
    dtype); a collective like it, and on every rank of the gather through the same path (the path
    depends on the parameter's metadata and the destination's device, which every rank must
    share). A DTensor split along dim 0 is all-gathered into ``out`` itself: no gathered copy to
    allocate, fault in, and copy again (hpcrl_shm's sender gathers into its shared-memory slot so).
    Anything else (or ``out`` on another device) is gathered, then copied."""
    group = _in_place_group(param, out.device)
    if group is None:
        out.copy_(full_tensor(param, cast_to, tracker, traffic))
        return
    import torch.distributed as dist

    wire = _on_wire(param.dtype, cast_to)
    if traffic is not None:
        traffic.count(param, wire)
    local = param.to_local()
    dist.all_gather_into_tensor(out, local.to(wire).contiguous(), group=group)


@torch.no_grad()
def gather_and_drop(named_params: Iterable[tuple[str, torch.Tensor]], cast_to: torch.dtype | None = None,
                    tracker: LiveBytes | None = None, traffic: GatherTraffic | None = None,
                    device: torch.device = torch.device("cpu")) -> None:
    """Take part in the gathers of ``named_params`` and keep nothing (a rank that does not send, or
    a sender finishing after a failure), through the paths ``gather_into`` takes for destinations
    on ``device`` (the sender's: the ranks' collectives must match): the tensors it gathers in
    place land in one scratch buffer reused for each (the size of the largest, freed at the end)
    instead of a fresh allocation each; the others are gathered and dropped."""
    named_params = list(named_params)
    in_place = [p for _, p in named_params if _in_place_group(p, device) is not None]
    largest = max((p.numel() * _on_wire(p.dtype, cast_to).itemsize for p in in_place), default=0)
    scratch = torch.empty(largest, dtype=torch.uint8, device=device) if largest else None
    for _, param in named_params:
        if _in_place_group(param, device) is None:
            full_tensor(param, cast_to, tracker, traffic)
            continue
        wire = _on_wire(param.dtype, cast_to)
        gather_into(param, scratch[: param.numel() * wire.itemsize].view(wire).view(param.shape), cast_to,
                    tracker, traffic)
