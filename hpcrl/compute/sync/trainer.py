"""The trainer side of the vLLM backends: ``TrainerWeightSync``, one per trainer rank of a node.

What every backend shares lives here: the parameters in sync order, the channel client, the count
of the gathers' traffic, and the agreement of all the node's trainers on the wire dtype (once,
before the transport is built) and on each sync's outcome. What
differs (the hand-off itself) is the backend's transport, picked by name from ``api.TRANSPORTS``:
``shm_transport.ShmTransport`` (hpcrl_shm), ``vllm_engines.NcclTransport`` and ``vllm_engines.IpcTransport``.
"""

from __future__ import annotations

import importlib

import torch

from hpcrl.compute.sync.api import (BACKENDS, TRANSPORTS, Notify, SenderSetup, SenderTransport, ShmOptions, SyncError,
                                   TransportOptions)
from hpcrl.compute.sync.gather import GatherTraffic, agree_wire_dtype, all_reduce_sum, changing_params, sync_named_params
from hpcrl.compute.sync.notify import NotifyClient

__all__ = ["TrainerWeightSync", "transport_class"]


def transport_class(backend: str) -> type[SenderTransport]:
    """The trainer-side transport of ``backend`` (imported now: only the chosen one is)."""
    if backend not in TRANSPORTS:
        raise ValueError(f"unknown weight-sync backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    module, name = TRANSPORTS[backend]
    return getattr(importlib.import_module(module), name)


class TrainerWeightSync:
    """The trainer role's weight sync, one instance per trainer rank of a node.

    Construct it on EVERY trainer rank of the node after the model is sharded; ``sync(version)``
    after each optimizer step, on every rank (the gathers are collectives). Only the sender
    (``is_sender``) talks to the server: the plan (hpcrl.job.placement) makes it the node's trainer
    whose GPU shares a fast link group with the server's, else the one on the highest-numbered
    trainer GPU. ``group``: the process group of the node's trainers, used to agree on success so
    that all ranks raise together (default: the default group, if any).

    ``wire_dtype``: dtype of the floating tensors on the wire, a torch dtype (the engine's: every
    trainer knows it from the engines' health replies, inference.engine.SyncPeer) or None (each
    tensor as stored). Each rank casts its shards to it BEFORE the gathers, so the ranks must
    agree: before building the transport they take the dtype any of them was given (a collective
    over ``group``, gather.agree_wire_dtype), and refuse to start if two were given different
    ones. The transport gets the agreed dtype and keeps it: ``self.wire_dtype``.

    ``transport``: the transport's own options, whose type picks it (api.py):
    ``ShmOptions`` (hpcrl_shm): ``ShmWeightSender`` (CPU, tested).
    ``NcclOptions`` (nccl): vLLM's ``NCCLTrainerWeightTransferEngine`` (RCCL on ROCm); the sender
    needs ``master=(address, port)`` for the rendezvous, and ``server_world_size`` (TP size).
    ``IpcOptions`` (ipc): vLLM's CUDA-IPC engine; only when the server runs on the sender's GPU.
    The ``nccl`` and ``ipc`` paths are UNTESTED without a GPU.
    """

    def __init__(self, model, notify: Notify | None, *, is_sender: bool, transport: TransportOptions = ShmOptions(),
                 bucket_bytes: int = 256 * 2**20, wire_dtype: torch.dtype | None = None, group=None, tracker=None,
                 node_of_rank: dict[int, int] | None = None, log=None) -> None:
        backend = transport.backend
        if is_sender and notify is None:
            raise ValueError("the sending trainer needs a notify channel to the server")
        self.backend, self.is_sender, self.bucket_bytes = backend, is_sender, bucket_bytes
        self.group, self.tracker = group, tracker
        # With the plan's node of every trainer rank, each sync counts the bytes its gathers move
        # inside a node and between nodes (the job's totals come back from sync()).
        self.traffic = GatherTraffic(node_of_rank) if node_of_rank else None
        self.last_traffic: dict[str, int] = {}
        self.params = sync_named_params(model)
        # What later syncs send when only some weights train (LoRA: the adapted layers); the first
        # sends everything, so the engine holds this model whatever it loaded at start.
        self.changing = changing_params(self.params)
        self.synced_once = False
        self.client = NotifyClient(notify) if notify is not None else None
        self.last_stats = None
        self.wire_dtype = agree_wire_dtype(wire_dtype, group)
        self.transport: SenderTransport = transport_class(backend)(SenderSetup(
            model=model, params=self.params, client=self.client, is_sender=is_sender, bucket_bytes=bucket_bytes,
            wire_dtype=self.wire_dtype, options=transport, tracker=tracker, traffic=self.traffic, log=log))

    def sync(self, version: str | int):
        """Send the current weights as ``version``. Returns the sender's stats (None elsewhere).
        Raises ``SyncError`` on every rank if the sync failed on the sender."""
        version = str(version)
        stats, error = self.transport.send(version)
        if stats is not None:
            self.last_stats = stats
        traffic = (self.traffic.in_node, self.traffic.cross_node) if self.traffic is not None else (0, 0)
        # Agree on success (any failure counts) and total the gather traffic, in one collective.
        failed, in_node, cross_node = all_reduce_sum([0 if error is None else 1, *traffic], self.group)
        if failed:
            if error is not None:
                raise error if isinstance(error, SyncError) else SyncError(f"weight sync {version} failed: {error!r}") from error
            raise SyncError(f"weight sync {version} failed on the sending trainer")
        self.last_traffic = ({"gathered_bytes_in_node": in_node, "gathered_bytes_cross_node": cross_node}
                             if self.traffic is not None else {})
        if not self.synced_once:
            self.synced_once = True
            # The transport walks this very list (SenderSetup.params): from now on, the changing part.
            self.params[:] = self.changing
        return self.last_stats

    def close(self) -> None:
        self.transport.close()
