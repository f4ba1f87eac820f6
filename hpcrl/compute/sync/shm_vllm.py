"""``hpcrl_shm`` inside vLLM 0.32's weight-transfer API (the transport itself is shm.py).

``vllm_plugin.register`` registers the two engines here, by module path, with vLLM's factories:
``HpcrlShmWeightTransferEngine`` with ``WeightTransferEngineFactory`` (the worker side: maps the
shared-memory region, applies slots) and ``HpcrlShmTrainerWeightTransferEngine`` with
``WeightTransferTrainerFactory`` (the trainer side, for callers that use vLLM's trainer API; the
trainer role uses ``TrainerWeightSync`` with shm_transport.ShmTransport instead).

The worker side applies weights the way vLLM's built-in engines do: layerwise reload
(``initialize_layerwise_reload`` at start, ``model.load_weights`` per slot,
``finalize_layerwise_reload`` at finish). ``update_weights`` is overridden because the base one
calls ``torch.accelerator.synchronize()``, which raises on CPU, and because an apply that fails
must put the model back into a servable (if mixed) state instead of leaving layers on the meta
device. Two more things the built-in engines do not need and this one does:

- a layer whose weights straddle two slots keeps a buffered view into the first slot until the
  rest arrives; such views are copied out before the slot is handed back (``_detach_pending_from``),
  or the sender would overwrite them (seen: corrupted q/k/v biases without it);
- vLLM's reload leaves a tied lm_head's packed CPU copy of the embedding stale
  (``reload.refresh_tied_weights``); this also affects vLLM's own ``reload_weights`` on CPU;
- and it leaves a mixture-of-experts layer's weights unpacked on CPU (``reload.repack_moe_on_reload``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from hpcrl.compute.sync.api import SHM_BACKEND, SyncError
from hpcrl.compute.sync.gather import iter_buckets
from hpcrl.compute.sync.reload import (abort_layerwise_reload, drop_expected_reload_warnings, refresh_tied_weights,
                                      repack_moe_on_reload)
from hpcrl.compute.sync.shm import (ShmRegion, ShmWeightSender, SignalPipe, close_receiver, numel, open_receiver,
                                    receive_stream)

__all__ = [
    "HpcrlShmInitInfo",
    "HpcrlShmUpdateInfo",
    "HpcrlShmWeightTransferEngine",
    "HpcrlShmTrainerInitInfo",
    "HpcrlShmTrainerWeightTransferEngine",
]


# ---------------------------------------------------------------- worker side (inside vLLM)

@dataclass
class HpcrlShmInitInfo(WeightTransferInitInfo):
    """Where the region is and what it must look like (``ShmRegion.init_info()``)."""

    path: str
    num_slots: int
    slot_bytes: int
    meta_bytes: int
    token: str
    signals: bool = False  # the sender made the FIFOs of the "stream" mode


@dataclass
class HpcrlShmUpdateInfo(WeightTransferUpdateInfo):
    """``slot >= 0``: apply that slot, which must hold bucket ``seq`` ("rpc" mode).
    ``slot == -1``: apply every bucket the sender signals, from ``seq`` on, until its end record
    ("stream" mode); fail after ``stall_timeout_s`` without a signal."""

    slot: int
    seq: int
    stall_timeout_s: float | None = None


def _detach_pending_from(model: torch.nn.Module, lo: int, hi: int) -> int:
    """Copy out buffered weights that still point into [lo, hi).

    Layerwise reload buffers a layer's weights until the whole layer has arrived. When a layer
    straddles two slots (q in one, k and v in the next), its buffered q would be a view into a
    slot the sender refills while the worker applies the other one. Such views are cloned at the
    end of each apply; usually none or a few tensors.
    """
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    copied = 0
    for module in model.modules():
        info = LAYERWISE_INFO.get(module)
        if info is None or not info.loaded_weights:
            continue
        for _, bound in info.loaded_weights:
            for key, value in bound.arguments.items():
                if isinstance(value, torch.Tensor) and value.device.type == "cpu" and lo <= value.data_ptr() < hi:
                    bound.arguments[key] = value.clone()
                    copied += 1
    return copied


class HpcrlShmWeightTransferEngine(WeightTransferEngine[HpcrlShmInitInfo, HpcrlShmUpdateInfo]):
    """Worker side of ``hpcrl_shm``: reads slots of the shared-memory region into the model."""

    init_info_cls = HpcrlShmInitInfo
    update_info_cls = HpcrlShmUpdateInfo

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.region: ShmRegion | None = None
        self.signals: SignalPipe | None = None
        self._aborted = False
        self.detached_tensors = 0  # how often a layer straddled two slots (diagnostics)
        self.load_s = 0.0  # time in load_weights (incl. layer processing), all syncs
        drop_expected_reload_warnings(bool(getattr(self.model_config.hf_config, "tie_word_embeddings", False)))
        repack_moe_on_reload(model)

    def init_transfer_engine(self, init_info: HpcrlShmInitInfo) -> None:
        self.shutdown()  # a new sender (restarted trainer): drop the old region
        self.region, self.signals = open_receiver(
            init_info.path, num_slots=init_info.num_slots, slot_bytes=init_info.slot_bytes,
            meta_bytes=init_info.meta_bytes, token=init_info.token,
            signals=bool(init_info.signals) and self.parallel_config.world_size == 1)

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._aborted = False
        initialize_layerwise_reload(self.model)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        info = self.parse_update_info(update_info)
        try:
            self.receive_weights(info)
        except BaseException:
            self._abort()  # the worker marks the update inactive after this raises
            raise
        # No accelerator synchronize: the loads above are synchronous host copies.

    def receive_weights(self, update_info: HpcrlShmUpdateInfo) -> None:
        if self.region is None:
            raise SyncError("hpcrl_shm: update_weights before init_weight_transfer_engine")
        if update_info.slot >= 0:
            self._apply(self.region.read_slot(update_info.slot, update_info.seq), update_info.slot)
            return
        if self.signals is None:
            raise SyncError("hpcrl_shm: stream mode needs the FIFOs and a single worker; use mode='rpc'")
        receive_stream(self.region, self.signals, update_info.seq, self._apply, update_info.stall_timeout_s or 300.0)

    def _apply(self, weights: list[tuple[str, torch.Tensor]], slot: int) -> None:
        from vllm.model_executor.model_loader.mtp_validation import disable_mtp_completeness_check

        t = time.perf_counter()
        with disable_mtp_completeness_check():
            self.model.load_weights(weights)
        del weights
        self.detached_tensors += _detach_pending_from(self.model, *self.region.data_range(slot))
        self.load_s += time.perf_counter() - t

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        if self._aborted:  # the update was abandoned; the model is already back together
            self._aborted = False
            return
        try:
            finalize_layerwise_reload(self.model, self.model_config)
            refresh_tied_weights(self.model)
        except BaseException:
            self._abort()
            raise

    def _abort(self) -> None:
        abort_layerwise_reload(self.model, self.model_config)
        self._aborted = True

    def shutdown(self) -> None:
        close_receiver(self.region, self.signals)
        self.region = self.signals = None


# ---------------------------------------------------------------- trainer side (vLLM's trainer API)

@dataclass
class HpcrlShmTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of ``hpcrl_shm`` for vLLM's ``WeightTransferTrainerFactory``."""

    backend: ClassVar[str] = SHM_BACKEND
    bucket_bytes: int = 256 * 2**20
    shm_dir: str = "/dev/shm"
    job_token: str | None = None


class HpcrlShmTrainerWeightTransferEngine(TrainerWeightTransferEngine[HpcrlShmTrainerInitInfo]):
    """``hpcrl_shm`` through vLLM's trainer API: ``trainer_init(...)`` then ``send_weights()``.

    Every rank iterates the source (the gathers are collectives); only the sender (rank 0) holds a
    ``ShmWeightSender``. Same transport as ``hpcrl.compute.sync.trainer.TrainerWeightSync``, which
    the trainer role uses directly.
    """

    init_info_cls = HpcrlShmTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource, is_sender: bool = True,
                 sender: ShmWeightSender | None = None, bucket_bytes: int = 256 * 2**20) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.sender = sender
        self.bucket_bytes = bucket_bytes
        self.last_stats = None

    @classmethod
    def trainer_init(cls, init_info: HpcrlShmTrainerInitInfo, *, client: VLLMWeightSyncClient,
                     source: WeightSource | None = None) -> Self:
        if source is None:
            raise ValueError("hpcrl_shm trainer weight transfer requires a WeightSource")
        sender = None
        if init_info.is_sender:
            largest = max((m.dtype.itemsize * numel(m.shape) for m in source.metadata()), default=0)
            sender = ShmWeightSender(client, init_info.bucket_bytes, largest, shm_dir=init_info.shm_dir,
                                     job_token=init_info.job_token)
        return cls(client=client, source=source, is_sender=init_info.is_sender, sender=sender,
                   bucket_bytes=init_info.bucket_bytes)

    def send_weights(self, weight_version: str | None = None) -> None:
        buckets = iter_buckets(self.source, self.bucket_bytes, keep=self.is_sender)
        if not self.is_sender:
            for _ in buckets:
                pass
            return
        try:
            self.last_stats = self.sender.send(buckets, weight_version)
        finally:
            for _ in buckets:  # keep gathering: the other ranks are still in the collectives
                pass

    def shutdown(self) -> None:
        if self.sender is not None:
            self.sender.close()
