"""Parameters a trainer engine partitions where torch cannot see it: the seam between such an engine
and the code that walks any model's parameters (the sync's gather, the loader, the optimizer).

FSDP2 keeps a shard as a DTensor, which torch itself knows how to gather and to slice. An engine
with a partitioning of its own (DeepSpeed ZeRO-3: each module tensor empty, the partition beside
it) registers a recogniser here; the walkers ask :func:`partitioned` for a parameter's handle and
never learn which engine made it. The recogniser is registered when the engine's module is
imported, which is before any of its parameters can exist.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Optional

import torch

__all__ = ["PartitionedParam", "register", "partitioned", "full_shape"]


class PartitionedParam(ABC):
    """A parameter as an engine partitions it: the whole tensor's shape and dtype, and the two
    collectives that move between the whole tensor and this rank's part."""

    shape: torch.Size
    dtype: torch.dtype
    requires_grad: bool

    @abstractmethod
    def numel(self) -> int:
        """Elements of the whole tensor."""

    @abstractmethod
    def gather(self, wire: torch.dtype) -> torch.Tensor:
        """The whole tensor in ``wire``: a collective over the ranks holding its partitions."""

    @abstractmethod
    def gathered_by(self) -> list[int]:
        """Global ranks of the gather's group (a sync counts the traffic from them)."""

    def moves(self, wire: torch.dtype) -> torch.dtype:
        """The dtype :meth:`gather` moves between ranks when asked for ``wire`` (a sync's traffic
        count): ``wire`` itself unless the engine gathers in a dtype of its own."""
        return wire

    @abstractmethod
    def load(self, name: str, full: torch.Tensor) -> None:
        """Keep this rank's partition of ``full`` (every rank has it: a model load broadcast it)."""


_recognisers: list[Callable[[torch.Tensor], Optional[PartitionedParam]]] = []


def register(recognise: Callable[[torch.Tensor], Optional[PartitionedParam]]) -> None:
    """An engine's recogniser: a handle for a parameter it partitioned, None for any other."""
    if recognise not in _recognisers:
        _recognisers.append(recognise)


def partitioned(param: torch.Tensor) -> Optional[PartitionedParam]:
    """The handle of a parameter an engine partitioned, or None (a plain tensor, a DTensor)."""
    for recognise in _recognisers:
        handle = recognise(param)
        if handle is not None:
            return handle
    return None


def full_shape(param: torch.Tensor) -> torch.Size:
    """The whole tensor's shape, whoever partitioned it."""
    handle = partitioned(param)
    return handle.shape if handle is not None else param.shape
