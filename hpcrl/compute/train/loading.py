"""Loading a Hugging Face checkpoint into a partitioned model, the same for every trainer engine.

Loading never materialises the model on every rank: the model is built partitioned (FSDP2 on the
meta device, then sharded; DeepSpeed under ``zero.Init``), then one rank reads the checkpoint and
streams it tensor by tensor (``broadcast``), and every rank keeps only its own part: a DTensor's
slice (FSDP2), or the partition an engine keeps by its own rule (hpcrl.compute.partitioned: ZeRO-3). Non-persistent buffers (rotary ``inv_freq``) travel
the same way, so nothing is left uninitialised. The other ranks' wait for the reader to read the
checkpoint is bounded by ``launch.model_load_timeout_s`` (a gloo group of its own), not by the
collective timeout: reading a large model is not a hung collective. With a model staged to every
node (``read_groups``), each node's first rank reads its node's copy for the node alone.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from hpcrl.compute.partitioned import partitioned

__all__ = ["MODEL_LOAD_SETTING", "check_devices", "load_device", "stream_from_rank0", "load_group", "read_group"]


def _named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and ALL buffers (non-persistent ones too), tied names deduplicated."""
    out: dict[str, torch.Tensor] = dict(model.named_parameters())
    out.update(model.named_buffers())
    return out


def load_device() -> torch.device:
    """Where a trainer's model parts go: its GPU (one per task: the current device), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def check_devices(devices: set[torch.device], device: torch.device, *, offload: bool, what: str,
                  parts: str = "parameters") -> None:
    """A loaded model's parts (``devices``: where this rank's shards or partitions are) are on
    ``device``, or in host memory only when ``offload`` says so: never left on the host (or on
    another GPU) by accident. The same check for every engine."""
    want = torch.device("cpu") if offload else device
    bad = {d for d in devices if not _same_device(d, want)}
    if bad:
        raise RuntimeError(f"{what}: {parts} on {sorted(map(str, bad))}, expected {want}"
                           + (" (offload)" if offload else ""))


MODEL_LOAD_SETTING = "launch.model_load_timeout_s"
_load_groups: dict[tuple[tuple[int, ...], float], dist.ProcessGroup] = {}


def load_group(group: Optional[dist.ProcessGroup], timeout_s: float) -> dist.ProcessGroup:
    """A gloo group over ``group``'s ranks whose timeout is the model load's (made once per ranks and
    timeout, so that the policy and the reference share it). Only its members call this."""
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    key = (ranks, float(timeout_s))
    if key not in _load_groups:
        # Over the whole world (hpcrl's case) every rank makes it, numbered like any other group; a
        # mesh inside a larger world is made by its members alone (torch then names it by its ranks).
        _load_groups[key] = dist.new_group(ranks=list(ranks), backend="gloo", timeout=timedelta(seconds=timeout_s),
                                           use_local_synchronization=len(ranks) < dist.get_world_size())
    return _load_groups[key]


def _receive_header(header: list[Any], group: Optional[dist.ProcessGroup], wait_group: Optional[dist.ProcessGroup],
                    what: str, timeout_s: Optional[float]) -> None:
    """Rank 0's list of tensors, which it sends once it has read the whole checkpoint: the one wait
    that a model load makes long. On ``wait_group`` (the load's own timeout) when there is one."""
    try:
        dist.broadcast_object_list(header, group=wait_group or group, group_src=0)
    except RuntimeError as e:
        if wait_group is None:
            raise
        bound = f"{timeout_s:.0f} s ({MODEL_LOAD_SETTING})"
        if dist.get_rank(wait_group) == 0:
            why = f"sending the tensor list of {what} failed: a trainer stopped waiting after {bound}, or died"
        else:
            why = f"trainer rank 0 did not finish reading {what} within {bound}, or died"
        raise RuntimeError(f"trainer rank {dist.get_rank()}: {why}: {e}") from e


@torch.no_grad()
def stream_from_rank0(model: nn.Module, source: Optional[nn.Module], comm_device: torch.device,
                      group: Optional[dist.ProcessGroup], *, what: str = "the checkpoint",
                      load_timeout_s: Optional[float] = None) -> None:
    """Copy ``source`` (a full model, on group rank 0 only) into the sharded ``model`` on every rank.

    One broadcast per tensor, so the extra memory is one full tensor at a time. Each rank keeps the
    slice its DTensor placement owns (``distribute_tensor(..., src_data_rank=None)`` slices locally).
    """
    rank0 = dist.get_rank(group) == 0
    targets = _named_tensors(model)
    header: list[Any] = [None]
    if rank0:
        src = _named_tensors(source)
        missing = sorted(set(targets) - set(src))
        header = [[(name, tuple(t.shape), t.dtype) for name, t in src.items()], missing]
    else:
        header = [None, None]
    wait_group = load_group(group, load_timeout_s) if load_timeout_s is not None else None
    _receive_header(header, group, wait_group, what, load_timeout_s)
    entries, missing = header
    if missing:
        raise RuntimeError(f"checkpoint lacks {len(missing)} tensors the model has: {missing[:5]}")
    for name, shape, dtype in entries:
        if rank0:
            full = src[name].detach().to(comm_device, copy=False).contiguous()
        else:
            full = torch.empty(shape, dtype=dtype, device=comm_device)
        dist.broadcast(full, group=group, group_src=0)
        target = targets.get(name)
        if target is None:
            continue                    # e.g. a buffer the sharded model does not have
        if isinstance(target, DTensor):
            if tuple(target.shape) != tuple(shape):
                raise RuntimeError(f"{name}: checkpoint shape {shape} != model shape {tuple(target.shape)}")
            piece = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
            target.to_local().copy_(piece.to_local())
        elif (handle := partitioned(target)) is not None:
            handle.load(name, full)         # an engine's own partitioning (ZeRO-3)
        else:
            target.copy_(full)
        del full


_read_groups: dict[tuple[tuple[int, ...], ...], dist.ProcessGroup] = {}


def read_group(read_groups: list[list[int]]) -> dist.ProcessGroup:
    """This rank's group of ``read_groups`` (made once, by every rank, for the policy and the reference)."""
    key = tuple(tuple(ranks) for ranks in read_groups)
    if key not in _read_groups:
        _read_groups[key], _ = dist.new_subgroups_by_enumeration([list(r) for r in key])
    return _read_groups[key]
