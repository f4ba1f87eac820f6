"""vLLM's own GPU backends, ``nccl`` (CUDA, and ROCm through RCCL) and ``ipc`` (CUDA IPC, only
when the server shares the sender's GPU), on the trainer side: each transport builds vLLM's
trainer engine and lets it drive start/update/finish through ``NotifyClient`` (notify.py). On the
server they are vLLM's built-in worker engines, driven by ``WeightReceiver`` (receiver.py).

Written against vLLM 0.32's API but UNTESTED without a GPU.

``HFWeightSource`` is the ``WeightSource`` those engines take on the trainer side: HF names, tied
embeddings skipped, one gather at a time in ``named_parameters()`` order.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, TrainerInitInfo, WeightSource
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from hpcrl.compute.sync.api import SenderSetup
from hpcrl.compute.sync.gather import iter_full_tensors, param_specs, sync_named_params
from hpcrl.compute.sync.notify import NotifyClient

__all__ = ["HFWeightSource", "NcclTransport", "IpcTransport"]


class HFWeightSource(WeightSource):
    """A trainer model as vLLM's ``WeightSource``: HF checkpoint names, tied ``lm_head`` skipped,
    one ``full_tensor()`` at a time in ``named_parameters()`` order (the same on every rank)."""

    def __init__(self, model: torch.nn.Module, cast_to: torch.dtype | None = None) -> None:
        self._params = sync_named_params(model)
        self._cast_to = cast_to
        self._current: Iterator[tuple[str, torch.Tensor]] | None = None

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(s.name, s.dtype, s.shape) for s in param_specs(self._params, self._cast_to)]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        self._current = iter_full_tensors(self._params, self._cast_to)
        return self._current

    def new_send(self) -> None:
        """Before a send: no gathers of it are under way yet."""
        self._current = None

    def finish_gathers(self) -> None:
        """After a send that stopped early on the sender (or never began): run the gathers it left,
        since every other trainer is inside them and would otherwise wait for the sender forever."""
        for _ in self._current if self._current is not None else iter(self):
            pass
        self._current = None


class _VLLMTransport:
    """A vLLM trainer engine inside ``TrainerWeightSync``. Every rank builds one; by vLLM's
    convention rank 0 sends and the others only take part in the gathers."""

    def __init__(self, setup: SenderSetup) -> None:
        self.is_sender, self.client = setup.is_sender, setup.client
        self.cast_to = None if setup.cast_to == "auto" else setup.cast_to
        info = self._init_info(setup, 0 if self.is_sender else 1)
        client = self.client if self.client is not None else NotifyClient(lambda msg: {"ok": True})
        self.source = HFWeightSource(setup.model, self.cast_to)
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=self.source)

    def _init_info(self, setup: SenderSetup, rank: int) -> TrainerInitInfo:
        raise NotImplementedError

    def send(self, version: str) -> tuple[None, Exception | None]:
        if self.client is not None:
            self.client.pending_version = version
        self.source.new_send()
        if torch.cuda.is_initialized():
            # vLLM's packed sender gathers on side streams: the optimizer step queued on this
            # stream must have landed in the shards first.
            torch.cuda.current_stream().synchronize()
        try:
            self.engine.send_weights()
        except Exception as exc:
            # No weights_abort here: vLLM's update thread may still wait for its reply on the
            # channel. The server keeps the sync open and refuses to generate, and every
            # trainer raises once the gathers the sender left are done.
            if self.is_sender:
                self.source.finish_gathers()
            return None, exc
        return None, None

    def close(self) -> None:
        self.engine.shutdown()


class NcclTransport(_VLLMTransport):
    """``nccl``: vLLM's ``NCCLTrainerWeightTransferEngine`` (RCCL on ROCm). The sender hosts the
    group's rendezvous at ``nccl_master``; the group is the sender and the server's
    ``server_world_size`` tensor-parallel workers."""

    def _init_info(self, setup: SenderSetup, rank: int) -> TrainerInitInfo:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        if setup.nccl_master is None and self.is_sender:
            raise ValueError("backend nccl needs nccl_master=(address, port) for the rendezvous on the sender")
        # The other trainers never join the group (vLLM's engine returns before connecting).
        address, port = setup.nccl_master or ("", 0)
        return NCCLTrainerInitInfo(master_address=address, master_port=port,
                                   world_size=1 + setup.server_world_size, packed=True,
                                   packed_buffer_size_bytes=setup.bucket_bytes, rank=rank)


class IpcTransport(_VLLMTransport):
    """``ipc``: vLLM's CUDA-IPC engine; only when the server runs on the sender's GPU."""

    def _init_info(self, setup: SenderSetup, rank: int) -> TrainerInitInfo:
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        return IPCTrainerInitInfo(packed=True, packed_buffer_size_bytes=setup.bucket_bytes, rank=rank)
