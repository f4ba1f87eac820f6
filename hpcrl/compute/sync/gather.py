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
- The wire dtype before the gather: with ``cast_to`` each rank casts its local shard and the
  all-gather moves the wire dtype (half the bytes of fp32 masters for a bf16 engine). A cast is
  elementwise, so this is bit-identical to gathering the master and casting the result; every
  rank of a gather must then use the same ``cast_to`` (``TrainerWeightSync`` agrees on it).

Names are mapped to Hugging Face checkpoint names, which is what vLLM's ``model.load_weights``
takes: wrapper prefixes are stripped and a tied ``lm_head.weight`` is skipped, as HF checkpoints do.

A model trained by DeepSpeed ZeRO-3 (hpcrl.compute.train.deepspeed_engine) holds each parameter
as an empty tensor and its partition (``ds_tensor``); each is sent as ``PartitionedParam``, which
knows the full shape and gathers the partitions itself, in the wire dtype, inside the node when
ZeRO++'s hierarchical partition (hpZ, DeepSpeed's HSDP) keeps a copy of each parameter there. The
walk, the order and the buckets are the FSDP2 ones: only the gather of one tensor differs.

A model with LoRA adapters (hpcrl.compute.train.lora) is sent as the model it stands for: each
adapted linear layer is ONE entry, ``MergedWeight``, gathered as its base weight, lora_A and lora_B
and merged there (W + scale * B A), one layer at a time inside the bucketing, so no merged copy of
the whole model ever exists. The adapters themselves are never sent.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

__all__ = [
    "WRAPPER_PREFIXES",
    "ParamSpec",
    "MergedWeight",
    "PartitionedParam",
    "lora_layers",
    "GatherTraffic",
    "LiveBytes",
    "hf_name",
    "sync_named_params",
    "changing_params",
    "param_specs",
    "full_tensor",
    "iter_full_tensors",
    "iter_buckets",
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
    as the merged model's would be (on GPUs the frozen base is stored in the engine's dtype anyway)."""

    def __init__(self, base: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> None:
        self.base, self.lora_a, self.lora_b, self.scale = base, lora_a, lora_b, float(scale)
        self.shape, self.dtype = base.shape, base.dtype
        self.requires_grad = True           # it changes whenever the adapters train

    def numel(self) -> int:
        return self.base.numel()

    @torch.no_grad()
    def merge(self, wire: torch.dtype, tracker: LiveBytes | None, traffic: GatherTraffic | None) -> torch.Tensor:
        base = full_tensor(self.base, None, tracker, traffic)
        a = full_tensor(self.lora_a, torch.float32, tracker, traffic)
        b = full_tensor(self.lora_b, torch.float32, tracker, traffic)
        merged = torch.addmm(base.float(), b, a, alpha=self.scale).to(wire)
        del base, a, b
        return tracker.track(merged) if tracker is not None else merged


class PartitionedParam:
    """A ZeRO-3 parameter as a sync sends it: the shape and dtype of the whole tensor (the module's
    own tensor is empty), and :meth:`gather`, a collective over the ranks holding its partitions.

    Where the whole tensor comes from (DeepSpeed 0.19, deepspeed/runtime/zero/):

    - Without hpZ: the primary partitions (``ds_tensor``, over every trainer), each rank casting its
      partition to the wire dtype first (half the bytes of fp32 partitions for a bf16 engine).
    - With hpZ (``zero_hpz_partition_size``) and the node's copy present (``ds_secondary_tensor``):
      that copy, over the node's ranks alone (``ds_zero_param_process_group``), in the wire dtype.
    - With hpZ and no node copy: every optimizer step drops the node copies (stage3.py
      ``_post_step`` -> ``invalidate_secondary_tensor``) and the next forward rebuilds them from the
      primary partitions, across nodes, when it releases each parameter (partition_parameters.py
      ``_partition`` -> ``_partition_param_sec``). A sync right after a step therefore gathers the
      primary partitions across nodes anyway; it does so through DeepSpeed's own
      ``GatheredParameters``, in the parameter's dtype, whose release fills the node copy from the
      gathered tensor. The next forward then gathers inside the node: the sync moves across nodes
      only what that forward would have moved, instead of the same bytes a second time.

    The values are always the current weights: the primary partitions are what the optimizer
    writes, and a node copy exists only between its (re)build from them and the next step. A
    parameter whose whole tensor DeepSpeed keeps (a "persistent" one, below
    ``stage3_param_persistence_threshold``) is gathered like the rest, never through
    ``GatheredParameters`` (whose release would free the whole tensor DeepSpeed keeps for it).
    Every rank sees the same state (node copies are dropped and made by collectives), so every rank
    takes the same path and the gathers match."""

    def __init__(self, param: torch.Tensor) -> None:
        self.param = param
        self.shape, self.dtype = torch.Size(param.ds_shape), param.dtype
        self.requires_grad = param.requires_grad

    def numel(self) -> int:
        return int(self.param.ds_numel)

    def refills(self) -> bool:
        """hpZ without the node copy, the parameter partitioned: gather it as DeepSpeed does, so that
        the node copy is made on release."""
        p = self.param
        return (getattr(p, "ds_zero_param_process_group", None) is not None
                and getattr(p, "ds_secondary_tensor", None) is None
                and getattr(getattr(p, "ds_status", None), "name", None) == "NOT_AVAILABLE")

    def source(self) -> tuple[torch.Tensor, object]:
        """The partition to gather and its process group: the node's (hpZ) copy when there is one,
        else the primary partition over every trainer."""
        p = self.param
        secondary = getattr(p, "ds_secondary_tensor", None)
        if secondary is not None and getattr(p, "ds_zero_param_process_group", None) is not None:
            return secondary, p.ds_zero_param_process_group
        return p.ds_tensor, p.ds_process_group

    @torch.no_grad()
    def gather(self, wire: torch.dtype) -> torch.Tensor:
        import torch.distributed as dist

        if self.refills():
            import deepspeed

            with deepspeed.zero.GatheredParameters([self.param]):
                # A copy: the gathered buffer is DeepSpeed's, freed (or reused) on release.
                return self.param.data.detach().reshape(self.shape).to(wire, copy=True)
        part, group = self.source()
        part = part.detach().to(wire).reshape(-1)
        world = dist.get_world_size(group)
        flat = torch.empty(part.numel() * world, dtype=wire, device=part.device)
        if world == 1:
            flat.copy_(part)
        else:
            dist.all_gather_into_tensor(flat, part, group=group)
        return flat.narrow(0, 0, self.numel()).view(self.shape).clone()

    def gathered_by(self) -> list[int]:
        """Global ranks of the gather's group (for the traffic count)."""
        import torch.distributed as dist

        return dist.get_process_group_ranks(self.source()[1])


def _partitioned(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id") and hasattr(param, "ds_tensor")


def lora_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The LoRA layers of ``model`` by module path: peft's layers keep the original module as
    ``base_layer`` and the active adapter's matrices in ``lora_A``/``lora_B`` (the adapter "default")."""
    return {name: m for name, m in model.named_modules()
            if isinstance(getattr(m, "base_layer", None), torch.nn.Module) and "default" in getattr(m, "lora_A", {})}


def sync_named_params(model: torch.nn.Module, tie_word_embeddings: bool | None = None) -> list[tuple[str, torch.Tensor]]:
    """``(hf_name, param)`` for every parameter a sync sends, in ``named_parameters()`` order.

    A tied ``lm_head.weight`` is left out (HF checkpoints leave it out; vLLM ties it itself).
    ``tie_word_embeddings`` defaults to ``model.config.tie_word_embeddings`` when there is one.
    ``named_parameters()`` already drops a second name for the same tensor object. A LoRA layer's
    weight is a ``MergedWeight`` under the base layer's name, in the base weight's place; its
    adapters are not sent, and its other parameters (a bias) keep the base layer's names.
    """
    if tie_word_embeddings is None:
        config = getattr(model, "config", None)
        tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    lora = lora_layers(model)
    merged = {f"{path}.base_layer.weight": MergedWeight(m.base_layer.weight, m.lora_A["default"].weight,
                                                        m.lora_B["default"].weight, m.scaling["default"])
              for path, m in lora.items()}
    adapters = tuple(f"{path}.lora_" for path in lora)
    out = []
    for name, param in model.named_parameters():
        if name.startswith(adapters):
            continue
        param = merged.get(name, param)
        if _partitioned(param):
            param = PartitionedParam(param)
        name = hf_name(name.replace(".base_layer.", "."))
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
    return [ParamSpec(name, _wire_dtype(p.dtype, cast_to), tuple(p.shape)) for name, p in named_params]


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
        import torch.distributed as dist

        values = [self.in_node, self.cross_node]
        if dist.is_available() and dist.is_initialized():
            device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl"
                      else "cpu")
            t = torch.tensor(values, dtype=torch.int64, device=device)
            dist.all_reduce(t, group=group)
            values = [int(v) for v in t.tolist()]
        return {"gathered_bytes_in_node": values[0], "gathered_bytes_cross_node": values[1]}

    def count(self, param: torch.Tensor, dtype: torch.dtype | None = None) -> None:
        """Add the gathers of ``param`` moved in ``dtype`` (default: its own)."""
        import torch.distributed as dist

        full = param.numel() * (dtype or param.dtype).itemsize
        if isinstance(param, PartitionedParam):
            if param.refills():         # DeepSpeed's own gather: the parameter's dtype on the wire
                full = param.numel() * param.dtype.itemsize
            self._add(tuple(param.gathered_by()), full)
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


def _wire_dtype(dtype: torch.dtype, cast_to: torch.dtype | None) -> torch.dtype:
    return cast_to if cast_to is not None and dtype.is_floating_point else dtype


@torch.no_grad()
def full_tensor(param: torch.Tensor, cast_to: torch.dtype | None = None, tracker: LiveBytes | None = None,
                traffic: GatherTraffic | None = None) -> torch.Tensor:
    """The whole tensor behind ``param`` in the wire dtype: ``full_tensor()`` for a DTensor (a
    collective: every rank of its mesh must call it, in the same order, with the same ``cast_to``),
    the tensor itself otherwise (no copy unless cast)."""
    wire = _wire_dtype(param.dtype, cast_to)
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
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    bucket: Bucket = []
    size = 0
    for name, param in named_params:
        # The size is known from the (global) shape before gathering: flush first, then gather,
        # so the previous bucket and this tensor are never alive together.
        nbytes = param.numel() * _wire_dtype(param.dtype, cast_to).itemsize
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket.clear()  # drops our (and the consumer's list's) references to the tensors
            size = 0
        if keep:
            bucket.append((name, full_tensor(param, cast_to, tracker, traffic)))  # no local ref left behind
            size += nbytes
        else:
            full_tensor(param, cast_to, tracker, traffic)  # stay in the collective, drop the result
    if bucket:
        yield bucket
        bucket.clear()
