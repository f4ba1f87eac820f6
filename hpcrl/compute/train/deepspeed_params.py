"""DeepSpeed ZeRO-3's parameters as the rest of hpcrl reaches them (hpcrl.compute.partitioned): the
sync's gather, the loader's copy into a partition, the whole shape for the optimizer's groups.

A ZeRO-3 parameter is an empty tensor with its partition beside it (``ds_tensor``, over the
parameter's process group) and, under ZeRO++'s hierarchical partition (hpZ, DeepSpeed's HSDP), a
copy of the whole parameter spread over the node (``ds_secondary_tensor``). This module is the
only place outside hpcrl.compute.train.deepspeed_engine that reads those attributes; importing it
registers the recogniser (the engine imports it before it builds a model).
"""

from __future__ import annotations

from typing import Optional

import torch

from hpcrl.compute import partitioned

__all__ = ["Zero3Param"]


class Zero3Param(partitioned.PartitionedParam):
    """A ZeRO-3 parameter as a sync sends it and a load fills it: the shape and dtype of the whole
    tensor (the module's own tensor is empty), :meth:`gather` and :meth:`load`.

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

    @classmethod
    def recognise(cls, param: torch.Tensor) -> Optional[Zero3Param]:
        return cls(param) if hasattr(param, "ds_id") and hasattr(param, "ds_tensor") else None

    def numel(self) -> int:
        return int(self.param.ds_numel)

    def refills(self) -> bool:
        """hpZ without the node copy, the parameter partitioned: gather it as DeepSpeed does, so that
        the node copy is made on release."""
        p = self.param
        return (getattr(p, "ds_zero_param_process_group", None) is not None
                and getattr(p, "ds_secondary_tensor", None) is None
                and getattr(getattr(p, "ds_status", None), "name", None) == "NOT_AVAILABLE")

    def moves(self, wire: torch.dtype) -> torch.dtype:
        return self.dtype if self.refills() else wire      # DeepSpeed's own gather: the parameter's dtype

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
        import torch.distributed as dist

        return dist.get_process_group_ranks(self.source()[1])

    @torch.no_grad()
    def load(self, name: str, full: torch.Tensor) -> None:
        """This rank's partitions of ``full``: the primary one (``ds_tensor`` over the parameter's
        group) and, under hpZ, the node's copy (``ds_secondary_tensor`` over the node's group),
        which ``zero.Init`` made from the uninitialised weights and the first forward reads."""
        import torch.distributed as dist

        target = self.param
        if tuple(self.shape) != tuple(full.shape):
            raise RuntimeError(f"{name}: checkpoint shape {tuple(full.shape)} != model shape {tuple(self.shape)}")
        flat = full.reshape(-1)
        _copy_slice(target.ds_tensor, flat, dist.get_rank(target.ds_process_group))
        secondary = getattr(target, "ds_secondary_tensor", None)
        if secondary is None:
            return
        if hasattr(secondary, "ds_quant_scale"):
            target.ds_secondary_tensor = None       # quantized: DeepSpeed remakes it at the first gather
        else:
            _copy_slice(secondary, flat, dist.get_rank(target.ds_zero_param_process_group))


def _copy_slice(part: torch.Tensor, flat: torch.Tensor, index: int) -> None:
    """DeepSpeed keeps partition ``index`` of a parameter as the flat elements [index * size,
    (index + 1) * size), zero-padded past the end."""
    size = part.ds_numel if hasattr(part, "ds_numel") else part.numel()
    start = index * size
    n = max(0, min(size, flat.numel() - start))
    part.data.zero_()
    part.data.view(-1).narrow(0, 0, n).copy_(flat.narrow(0, start, n))


partitioned.register(Zero3Param.recognise)
