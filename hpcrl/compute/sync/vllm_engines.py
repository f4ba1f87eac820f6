"""vLLM's own GPU backends, ``nccl`` (CUDA, and ROCm through RCCL) and ``ipc`` (CUDA IPC, only
when the server shares the sender's GPU), on the trainer side: each transport builds vLLM's
trainer engine and lets it drive start/update/finish through ``NotifyClient`` (notify.py). On the
server they are vLLM's built-in worker engines, driven by ``WeightReceiver`` (receiver.py).

Written against vLLM 0.32's API but UNTESTED without a GPU. What ``ipc`` relies on, one export of
the packed buffer rebuilt in the engine's process on the same GPU, ran on an H200 with an engine
stand-in (tests/compute/sync/test_ipc_gpu.py); vLLM's own engines have not.

``HFWeightSource`` is the ``WeightSource`` those engines take on the trainer side: HF names, tied
embeddings skipped, one gather at a time in ``named_parameters()`` order, each in the wire dtype
and counted in the sync's gather traffic like hpcrl_shm's.

``ipc`` needs two things of the server that vLLM does not do by itself: the engine process must
run with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` (inference.vllm_engine.weight_transfer_env; the
rebuild arguments of a CUDA IPC handle hold a type and a torch.dtype, which vLLM's msgpack refuses
otherwise), and the packed buffer must hold the largest tensor (vLLM raises on one larger than
it): ``gather.ipc_buffer_bytes``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, TrainerInitInfo, WeightSource
from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

from hpcrl.compute.sync.api import SenderSetup
from hpcrl.compute.sync.gather import ipc_buffer_bytes, iter_full_tensors, param_specs, sync_named_params
from hpcrl.compute.sync.layout import CheckpointLayout
from hpcrl.compute.sync.notify import NotifyClient

__all__ = ["HFWeightSource", "NcclTransport", "IpcTransport"]

log = logging.getLogger(__name__)


class HFWeightSource(WeightSource):
    """A trainer model as vLLM's ``WeightSource``: HF checkpoint names, tied ``lm_head`` skipped,
    one ``full_tensor()`` at a time in ``named_parameters()`` order (the same on every rank).

    ``wire_dtype``: the dtype each floating shard is cast to before its gather, the one the ranks
    agreed on (None: as stored). ``traffic``: the
    sync's ``GatherTraffic``, counted by every pass over the source, the gathers a failed send
    left included, as hpcrl_shm's ``iter_buckets`` counts them.
    """

    def __init__(self, model: torch.nn.Module, wire_dtype: torch.dtype | None = None, traffic=None,
                 params: list | None = None) -> None:
        self._params = params if params is not None else sync_named_params(model)
        # vLLM loads checkpoint names (per-expert MoE weights, not transformers' fused ones); each
        # tensor converts alone (CheckpointLayout checks it), so one at a time is fine.
        self.layout = CheckpointLayout(model, self._params)
        self.wire_dtype = wire_dtype
        self.traffic = traffic
        self._current: Iterator[tuple[str, torch.Tensor]] | None = None

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(s.name, s.dtype, s.shape)
                for s in self.layout.specs(param_specs(self._params, self.wire_dtype))]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        tensors = iter_full_tensors(self._params, self.wire_dtype, traffic=self.traffic)
        self._current = tensors if self.layout.identity else self._converted(tensors)
        return self._current

    def _converted(self, tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for item in tensors:
            yield from self.layout.convert([item])

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
        self.is_sender, self.client, self.traffic = setup.is_sender, setup.client, setup.traffic
        self.log = setup.log or log.warning
        self.source = HFWeightSource(setup.model, setup.wire_dtype, setup.traffic, setup.params)
        info = self._init_info(setup, 0 if self.is_sender else 1)
        client = self.client if self.client is not None else NotifyClient(lambda msg: {"ok": True})
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=client, source=self.source)

    def _init_info(self, setup: SenderSetup, rank: int) -> TrainerInitInfo:
        raise NotImplementedError

    def send(self, version: str) -> tuple[None, Exception | None]:
        if self.client is not None:
            self.client.pending_version = version
        if self.traffic is not None:
            self.traffic.reset()
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
    group's rendezvous at ``NcclOptions.master``; the group is the sender and the server's
    ``server_world_size`` tensor-parallel workers."""

    def _init_info(self, setup: SenderSetup, rank: int) -> TrainerInitInfo:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        if setup.options.master is None and self.is_sender:
            raise ValueError("backend nccl needs NcclOptions(master=(address, port)) for the rendezvous on the sender")
        # The other trainers never join the group (vLLM's engine returns before connecting).
        address, port = setup.options.master or ("", 0)
        return NCCLTrainerInitInfo(master_address=address, master_port=port,
                                   world_size=1 + setup.options.server_world_size, packed=True,
                                   packed_buffer_size_bytes=setup.bucket_bytes, rank=rank)


class IpcTransport(_VLLMTransport):
    """``ipc``: vLLM's CUDA-IPC engine; only when the server runs on the sender's GPU. The server's
    engine must run with ``vllm_engine.weight_transfer_env("ipc")`` (``VLLMEngine`` sets it)."""

    def _init_info(self, setup: SenderSetup, rank: int) -> TrainerInitInfo:
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

        size, name = ipc_buffer_bytes(setup.bucket_bytes, setup.params, setup.wire_dtype)
        if name is not None and self.is_sender:
            self.log(f"weight sync (ipc): the packed buffer grows from the bucket's {setup.bucket_bytes / 2**20:.0f} MiB "
                     f"to {size / 2**20:.0f} MiB, the size of the largest tensor ({name})")
        return IPCTrainerInitInfo(packed=True, packed_buffer_size_bytes=size, rank=rank)
