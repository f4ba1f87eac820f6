"""The shapes every weight transport has, and the small names the transports share.

A transport has two sides. The trainer side (``TrainerSync``) is built on every trainer rank of a
node once the model is sharded, and ``sync(version)`` runs after each optimizer step on every
rank, since the gathers are collectives. The server side (``ServerSync``) answers each
``weights_*`` message from the node's sender with ``handle(msg) -> reply`` and says whether the
engine may generate.

This module imports nothing beyond the standard library, and nothing of hpcrl: every other sync
module may import it, and it imports none of them back. The transports are loaded by name
(``TRANSPORTS``), so that a trainer never imports vLLM for a backend that does not need it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Protocol, Union

__all__ = [
    "SHM_BACKEND",
    "TRANSPORTS",
    "BACKENDS",
    "WORKER_EXTENSION",
    "Notify",
    "SyncError",
    "WeightsInconsistentError",
    "TrainerSync",
    "ServerSync",
    "SyncClient",
    "ShmOptions",
    "NcclOptions",
    "IpcOptions",
    "TransportOptions",
    "SenderSetup",
    "SenderTransport",
    "default_backend",
]

SHM_BACKEND = "hpcrl_shm"
# Backend name -> the module and class of its trainer side inside TrainerWeightSync (trainer.py),
# imported when the backend is chosen: the vLLM backends import vLLM, hpcrl_shm only torch.
TRANSPORTS: dict[str, tuple[str, str]] = {
    SHM_BACKEND: ("hpcrl.compute.sync.shm_transport", "ShmTransport"),
    "nccl": ("hpcrl.compute.sync.vllm_engines", "NcclTransport"),
    "ipc": ("hpcrl.compute.sync.vllm_engines", "IpcTransport"),
}
BACKENDS = tuple(TRANSPORTS)
# What vLLM workers are extended with (vllm_plugin.WorkerSyncExtension), as vLLM takes it: a
# dotted path, so that the server side names it without importing vLLM.
WORKER_EXTENSION = "hpcrl.compute.sync.vllm_plugin.WorkerSyncExtension"
# Set by the server before it starts vLLM: the engine processes it spawns are hpcrl's, and die with
# their parent (vllm_plugin.end_with_parent).
ENGINE_PROCESS_ENV = "HPCRL_ENGINE_PROCESS"

Notify = Callable[[dict], Any]


class SyncError(RuntimeError):
    """A weight sync failed."""


class WeightsInconsistentError(SyncError):
    """The server's weights are mid-update or from an interrupted sync: it must not generate."""


def default_backend(device: str) -> str:
    """``nccl`` on GPU nodes (CUDA, or ROCm through RCCL), else ``hpcrl_shm``. Decided from the
    site's device, not by asking torch: ``torch.cuda.is_available()`` initializes the driver, and
    a vLLM engine process forked after that cannot use the GPU."""
    return "nccl" if device == "cuda" else SHM_BACKEND


class TrainerSync(Protocol):
    """The trainer side of a transport. ``sync(version)`` sends the model's current weights as
    ``version`` and returns what the sender measured (None or empty elsewhere); it raises when the
    sync failed. ``last_traffic`` holds the bytes the last sync's gathers moved (may be empty)."""

    last_traffic: dict[str, int]

    def sync(self, version: str | int) -> Any: ...

    def close(self) -> None: ...


class ServerSync(Protocol):
    """The server side of a transport. ``handle(msg)`` answers one ``weights_*`` message with a
    dict (``"ok"`` and, on refusal, ``"error"``) and never raises, so the channel always has a
    reply. ``state`` is "serving", "open" (a sync under way) or "failed"; the engine may generate
    only while ``consistent``, that is in "serving"."""

    state: str

    @property
    def consistent(self) -> bool: ...

    def handle(self, msg: dict) -> dict: ...


class SyncClient(Protocol):
    """What a vLLM backend's sender talks to: vLLM's ``VLLMWeightSyncClient`` protocol (four calls,
    plain dicts).

    ``NotifyClient`` (notify.py) implements it over the node-local channel; an optional
    ``abort_weight_update()`` lets a sender that fails midway tell the server at once.
    """

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> Any: ...
    def start_weight_update(self) -> Any: ...
    def update_weights(self, update_info: dict[str, Any]) -> Any: ...
    def finish_weight_update(self, weight_version: str | None = None) -> Any: ...


# One options type per transport, each with its own fields, built once by whoever picks the
# transport (the inference engine's trainer_sync); its ``backend`` names the transport in TRANSPORTS.
@dataclass(frozen=True)
class ShmOptions:
    """hpcrl_shm: a double-buffered /dev/shm region between the sender and its engine."""

    backend: ClassVar[str] = SHM_BACKEND
    job_token: str | None = None    # names the region (unique per job, node, sender and round)
    shm_dir: str = "/dev/shm"
    mode: str = "stream"            # "stream" or "rpc"
    stall_timeout_s: float = 300.0  # how long either side waits for the other


@dataclass(frozen=True)
class NcclOptions:
    """nccl (RCCL on ROCm): vLLM's NCCL weight-transfer engine; a group of the sender and the
    server's tensor-parallel workers."""

    backend: ClassVar[str] = "nccl"
    master: tuple[str, int] | None = None   # the group's rendezvous, hosted by the sender (None elsewhere)
    server_world_size: int = 1              # the server's tensor-parallel size


@dataclass(frozen=True)
class IpcOptions:
    """ipc: vLLM's CUDA-IPC engine, when the server shares the sender's GPU; no fields of its own."""

    backend: ClassVar[str] = "ipc"


TransportOptions = Union[ShmOptions, NcclOptions, IpcOptions]


@dataclass(frozen=True)
class SenderSetup:
    """What ``TrainerWeightSync`` builds its backend's transport from: its own arguments, with the
    parameter list and the channel client made; ``options`` are the transport's own."""

    model: Any                      # the trainer's (sharded) torch module
    # gather.sync_named_params(model): what a sync sends, in order. The same list object all along:
    # TrainerWeightSync narrows it to gather.changing_params after the first sync (LoRA).
    params: list
    client: Any                     # NotifyClient to the server; None on the trainers that do not send
    is_sender: bool
    bucket_bytes: int
    # The torch dtype of the floating tensors on the wire, agreed by every trainer rank, or None
    # (each tensor as stored); fixed for the transport's life (see TrainerWeightSync).
    wire_dtype: Any
    options: TransportOptions
    tracker: Any = None             # gather.LiveBytes, or None
    traffic: Any = None             # gather.GatherTraffic, or None
    log: Any = None                 # callable(str) for what an operator should see; None: logging


class SenderTransport(Protocol):
    """One backend inside ``TrainerWeightSync``, built as ``cls(setup)`` on every trainer rank.

    ``send(version)`` runs one sync: the gathers on every rank, the hand-off to the server on the
    sender. It returns the sender's stats (None elsewhere) and the hand-off's error, which it
    returns rather than raises: every rank must first finish the gathers the others are inside,
    then all of them agree on the outcome before any raises. It gathers in ``setup.wire_dtype``,
    which the ranks agreed on before it was built, and sizes its buffers for it.
    """

    def send(self, version: str) -> tuple[Any, Exception | None]: ...

    def close(self) -> None: ...
