"""Weight sync: sharded trainers -> the node's vLLM server, in memory, bounded by a bucket.

The pieces (each imports only what its side needs; nothing here imports torch or vLLM at import):

- ``gather.py``       trainer side, any backend: ordered, bucketed ``full_tensor()`` gathers, HF names.
- ``shm.py``          the ``hpcrl_shm`` transport (CPU, one node): a double-buffered /dev/shm region.
- ``vllm_plugin.py``  the backend inside vLLM's weight-transfer API (entry point ``register``).
- ``checkpoint_route.py``  the baseline: safetensors to the page cache + ``reload_weights``.
- this file           what the roles call: ``WeightReceiver`` (server), ``NotifyClient`` and
                      ``TrainerWeightSync`` (trainers), and the backend choice.

Messages between a trainer and the server are small dicts through ``notify(meta) -> reply``
(the node-local channel): ``weights_init`` once, then per sync ``weights_start``,
``weights_update`` (once per sync in hpcrl_shm's default "stream" mode, where the worker and the
sender pace the buckets through FIFOs; once per bucket in its "rpc" mode; once for nccl),
``weights_finish`` (or ``weights_abort``). The bytes never travel in the messages: they sit in
shared memory (hpcrl_shm) or go over NCCL/RCCL (nccl).

Backends: ``hpcrl_shm`` (CPU, tested here); ``nccl`` (CUDA, and ROCm through RCCL) and ``ipc``
(CUDA IPC, only when the server shares the sender's GPU) are vLLM's own backends driven through
the same messages; those two paths are written against vLLM 0.32's API but UNTESTED without a GPU.
"""

from __future__ import annotations

import time
from typing import Any, Callable

__all__ = [
    "BACKENDS",
    "SyncError",
    "WeightsInconsistentError",
    "default_backend",
    "engine_kwargs",
    "llm_dtype",
    "WeightReceiver",
    "NotifyClient",
    "TrainerWeightSync",
]

BACKENDS = ("hpcrl_shm", "nccl", "ipc")
Notify = Callable[[dict], Any]


class SyncError(RuntimeError):
    """A weight sync failed."""


class WeightsInconsistentError(SyncError):
    """The server's weights are mid-update or from an interrupted sync: it must not generate."""


def default_backend(device: str) -> str:
    """``nccl`` on GPU nodes (CUDA, or ROCm through RCCL), else ``hpcrl_shm``. Decided from the
    site's device, not by asking torch: ``torch.cuda.is_available()`` initializes the driver, and
    a vLLM engine process forked after that cannot use the GPU."""
    return "nccl" if device == "cuda" else "hpcrl_shm"


def llm_dtype(llm) -> str | None:
    """The dtype a ``vllm.LLM`` computes in ("bfloat16"): what the trainers send weights as."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    dtype = getattr(getattr(config, "model_config", None), "dtype", None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def engine_kwargs(backend: str) -> dict:
    """What the server passes to ``vllm.LLM(...)`` so its workers build the backend's engine."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown weight-sync backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    # The worker extension adds what vLLM's weight-transfer API lacks: an abort of an open update,
    # and the re-pack of a tied lm_head after a reload on CPU (vllm_plugin.refresh_tied_weights).
    return {"weight_transfer_config": {"backend": backend},
            "worker_extension_cls": "hpcrl.compute.sync.vllm_plugin.WorkerSyncExtension"}


# ---------------------------------------------------------------- server side

class WeightReceiver:
    """The server role's end of weight syncs; owns no thread, called from the role's loop.

    ``handle(msg)`` answers every ``weights_*`` message (or call ``init``/``begin``/``apply``/
    ``finish``/``abort`` directly). Between ``begin`` and a successful ``finish``, and after any
    failure, ``consistent`` is False and ``require_consistent()`` raises: the role must not
    generate then. A successful ``finish`` records the version (also in vLLM's own weight version)
    and resets the prefix cache, whose entries were computed with the old weights.

    A sender that dies between ``begin`` and ``finish`` ends the job (the launch's watchdog), and a
    sender that fails sends ``weights_abort``; a ``begin`` while a sync is open aborts the open one first.
    """

    def __init__(self, llm, version: str | None = "initial") -> None:
        self.llm = llm
        self.version = version
        self.state = "serving"  # serving | open | failed
        self.open_version: str | None = None
        self.last_error: str | None = None
        self.timings: dict[str, float] = {"start_s": 0.0, "apply_s": 0.0, "finish_s": 0.0, "applies": 0}

    @property
    def consistent(self) -> bool:
        return self.state == "serving"

    def require_consistent(self) -> None:
        if self.state != "serving":
            why = f"sync {self.open_version} in progress" if self.state == "open" else f"last sync failed: {self.last_error}"
            raise WeightsInconsistentError(f"weights not servable ({why}); waiting for a full sync")

    def init(self, init_info: dict) -> dict:
        """Set up the transport (hpcrl_shm: map the region; nccl: join the trainer's group).
        Returns what the sender adapts to: the engine's dtype (it casts before sending) and its
        number of workers (hpcrl_shm's stream mode needs exactly one)."""
        self.llm.init_weight_transfer_engine({"init_info": init_info})
        config = getattr(getattr(self.llm, "llm_engine", None), "vllm_config", None)
        workers = getattr(getattr(config, "parallel_config", None), "world_size", None)
        return {"dtype": llm_dtype(self.llm), "workers": workers}

    def begin(self, version: str | None = None) -> None:
        if self.state == "open":
            self.abort(f"sync {version} began before sync {self.open_version} finished")
        self.state, self.open_version = "open", version
        self.timings = {"start_s": 0.0, "apply_s": 0.0, "finish_s": 0.0, "applies": 0}
        t = time.perf_counter()
        try:
            self.llm.start_weight_update()
        except BaseException as exc:
            self._fail(exc)
            raise
        self.timings["start_s"] = time.perf_counter() - t

    def apply(self, update_info: dict | list) -> None:
        if self.state != "open":
            raise SyncError(f"weights_update without an open sync (state {self.state})")
        t = time.perf_counter()
        try:
            self.llm.update_weights({"update_info": update_info})
        except BaseException as exc:
            self._fail(exc)
            raise
        self.timings["apply_s"] += time.perf_counter() - t
        self.timings["applies"] += 1

    def finish(self, version: str | None = None) -> None:
        if self.state != "open":
            raise SyncError(f"weights_finish without an open sync (state {self.state})")
        version = version if version is not None else self.open_version
        t = time.perf_counter()
        try:
            self.llm.finish_weight_update(weight_version=version)
        except BaseException as exc:
            self._fail(exc)
            raise
        # Old KV entries would be reused for new prompts with the same prefix: always drop them.
        # If requests are running (their blocks pin the cache), preempt them: they are recomputed
        # with the new weights instead of finishing on a KV cache of the old ones.
        if self.llm.reset_prefix_cache() is False:
            self.llm.reset_prefix_cache(reset_running_requests=True)
        self.timings["finish_s"] = time.perf_counter() - t
        self.state, self.version, self.open_version, self.last_error = "serving", version, None, None

    def abort(self, reason: str = "aborted") -> None:
        """End an open sync (sender died, timed out, or gave up). The server stays unservable
        until the next full sync; the engine's layers are whole again (old or new per layer)."""
        self._fail(reason)

    def _fail(self, why) -> None:
        """Mark unservable and make sure no worker is left mid-update."""
        self.last_error = why if isinstance(why, str) else f"{type(why).__name__}: {why}"
        self.state = "failed"
        try:
            self.llm.collective_rpc("hpcrl_abort_weight_update")
        except Exception as exc:  # the engine itself is broken: the role must restart it
            self.last_error += f"; abort on the workers failed too: {exc!r}"

    def handle(self, msg: dict) -> dict:
        """Answer one ``weights_*`` message: ``{"ok": True, "version": ...}`` or
        ``{"ok": False, "error": ...}``. Never raises, so the channel always has a reply."""
        op = msg.get("op")
        extra = {}
        try:
            if op == "weights_init":
                extra = self.init(msg["init_info"])
            elif op == "weights_start":
                self.begin(msg.get("version"))
            elif op == "weights_update":
                self.apply(msg["update_info"])
            elif op == "weights_finish":
                self.finish(msg.get("version"))
            elif op == "weights_abort":
                self.abort(msg.get("reason", "aborted by the sender"))
            else:
                raise SyncError(f"unknown weight-sync message {op!r}")
        except Exception as exc:
            return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "state": self.state}
        return {"ok": True, "version": self.version, "state": self.state, **extra}


# ---------------------------------------------------------------- trainer side

class NotifyClient:
    """vLLM's ``VLLMWeightSyncClient`` protocol over the node-local channel ``notify(msg) -> reply``.

    Works for every backend: ``ShmWeightSender`` and vLLM's own trainer engines (``nccl``, ``ipc``)
    call these four methods (plus ``abort_weight_update`` where they can). ``pending_version`` is
    sent with the start and the finish of the next sync (vLLM's engines pass no version).
    """

    def __init__(self, notify: Notify) -> None:
        self.notify = notify
        self.pending_version: str | None = None

    def _call(self, msg: dict) -> dict:
        reply = self.notify(msg)
        if not isinstance(reply, dict) or not reply.get("ok"):
            error = reply.get("error") if isinstance(reply, dict) else repr(reply)
            raise SyncError(f"server refused {msg['op']}: {error}")
        return reply

    def init_weight_transfer_engine(self, init_info: dict) -> dict:
        return self._call({"op": "weights_init", "init_info": init_info})

    def start_weight_update(self) -> None:
        self._call({"op": "weights_start", "version": self.pending_version})

    def update_weights(self, update_info: dict | list) -> None:
        self._call({"op": "weights_update", "update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        version = weight_version if weight_version is not None else self.pending_version
        self._call({"op": "weights_finish", "version": version})

    def abort_weight_update(self, reason: str = "aborted by the sender") -> None:
        self._call({"op": "weights_abort", "reason": reason})


class TrainerWeightSync:
    """The trainer role's weight sync, one instance per trainer rank of a node.

    Construct it on EVERY trainer rank of the node after the model is sharded; ``sync(version)``
    after each optimizer step, on every rank (the gathers are collectives). Only the sender
    (``is_sender``, the node's first trainer) talks to the server. ``group``: the process group of
    the node's trainers, used to agree on success so that all ranks raise together (default: the
    default group, if any).

    ``cast_to``: dtype of the floating tensors on the wire; ``"auto"`` = the engine's dtype as the
    server reports it at init (hpcrl_shm), else as gathered.

    ``backend="hpcrl_shm"``: ``ShmWeightSender`` (CPU, tested); ``shm_mode`` "stream" or "rpc".
    ``backend="nccl"``: vLLM's ``NCCLTrainerWeightTransferEngine`` (RCCL on ROCm); the sender
    needs ``nccl_master=(address, port)`` for the rendezvous, and ``server_world_size`` (TP size).
    ``backend="ipc"``: vLLM's CUDA-IPC engine; only when the server runs on the sender's GPU.
    The ``nccl`` and ``ipc`` paths are UNTESTED without a GPU.
    """

    def __init__(self, model, notify: Notify | None, *, is_sender: bool, backend: str = "hpcrl_shm",
                 bucket_bytes: int = 256 * 2**20, cast_to="auto", group=None, job_token: str | None = None,
                 shm_dir: str = "/dev/shm", shm_mode: str = "stream", nccl_master: tuple[str, int] | None = None,
                 server_world_size: int = 1, tracker=None, node_of_rank: dict[int, int] | None = None) -> None:
        from hpcrl.compute.sync.gather import GatherTraffic, param_specs, sync_named_params

        if backend not in BACKENDS:
            raise ValueError(f"unknown weight-sync backend {backend!r}; choose one of {', '.join(BACKENDS)}")
        if is_sender and notify is None:
            raise ValueError("the sending trainer needs a notify channel to the server")
        self.backend, self.is_sender, self.bucket_bytes = backend, is_sender, bucket_bytes
        self.cast_to = None if cast_to == "auto" else cast_to
        self.group, self.tracker = group, tracker
        # With the plan's node of every trainer rank, each sync counts the bytes its gathers move
        # inside a node and between nodes (the job's totals come back from sync()).
        self.traffic = GatherTraffic(node_of_rank) if node_of_rank else None
        self.last_traffic: dict[str, int] = {}
        self.params = sync_named_params(model)
        self.client = NotifyClient(notify) if notify is not None else None
        self.sender = None  # ShmWeightSender
        self.engine = None  # vLLM TrainerWeightTransferEngine (nccl / ipc)
        self.source = None  # its HFWeightSource
        self.last_stats = None
        if backend == "hpcrl_shm":
            if is_sender:
                import torch

                from hpcrl.compute.sync.shm import ShmWeightSender

                fixed = None if cast_to == "auto" else cast_to
                largest = max((s.nbytes for s in param_specs(self.params, fixed)), default=0)
                self.sender = ShmWeightSender(self.client, bucket_bytes, largest, shm_dir=shm_dir, job_token=job_token,
                                              mode=shm_mode)
                if cast_to == "auto":  # send in the engine's dtype: fewer bytes, no cast in the worker
                    dtype = getattr(torch, self.sender.server_dtype or "", None)
                    self.cast_to = dtype if isinstance(dtype, torch.dtype) else None
        else:
            self.engine = self._vllm_trainer_engine(model, nccl_master, server_world_size)

    def _vllm_trainer_engine(self, model, nccl_master, server_world_size):
        """vLLM's own trainer engine for a GPU backend (UNTESTED without a GPU)."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

        from hpcrl.compute.sync.vllm_plugin import HFWeightSource

        rank = 0 if self.is_sender else 1  # vLLM's convention: rank 0 sends, others only gather
        if self.backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

            if nccl_master is None and self.is_sender:
                raise ValueError("backend nccl needs nccl_master=(address, port) for the rendezvous on the sender")
            # The other trainers never join the group (vLLM's engine returns before connecting).
            address, port = nccl_master or ("", 0)
            info = NCCLTrainerInitInfo(master_address=address, master_port=port,
                                       world_size=1 + server_world_size, packed=True,
                                       packed_buffer_size_bytes=self.bucket_bytes, rank=rank)
        else:
            from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo

            info = IPCTrainerInitInfo(packed=True, packed_buffer_size_bytes=self.bucket_bytes, rank=rank)
        client = self.client if self.client is not None else NotifyClient(lambda msg: {"ok": True})
        self.source = HFWeightSource(model, self.cast_to)
        return WeightTransferTrainerFactory.trainer_init(info, client=client, source=self.source)

    def sync(self, version: str | int):
        """Send the current weights as ``version``. Returns the sender's stats (None elsewhere).
        Raises ``SyncError`` on every rank if the sync failed on the sender."""
        from hpcrl.compute.sync.gather import iter_buckets

        version = str(version)
        error = None
        if self.engine is not None:  # nccl / ipc: vLLM's engine drives start/update/finish
            if self.client is not None:
                self.client.pending_version = version
            self.source.new_send()
            import torch

            if torch.cuda.is_initialized():
                # vLLM's packed sender gathers on side streams: the optimizer step queued on this
                # stream must have landed in the shards first.
                torch.cuda.current_stream().synchronize()
            try:
                self.engine.send_weights()
            except Exception as exc:
                error = exc
                # No weights_abort here: vLLM's update thread may still wait for its reply on the
                # channel. The server keeps the sync open and refuses to generate, and every
                # trainer raises below once the gathers the sender left are done.
                if self.is_sender:
                    self.source.finish_gathers()
        else:
            if self.traffic is not None:
                self.traffic.reset()
            buckets = iter_buckets(self.params, self.bucket_bytes, keep=self.is_sender, cast_to=self.cast_to,
                                   tracker=self.tracker, traffic=self.traffic)
            try:
                if self.is_sender:
                    self.client.pending_version = version
                    self.last_stats = self.sender.send(buckets, version)
            except Exception as exc:
                error = exc
            finally:
                for _ in buckets:  # finish the gathers: the other ranks are still in them
                    pass
        traffic = (self.traffic.in_node, self.traffic.cross_node) if self.traffic is not None else (0, 0)
        failed, in_node, cross_node = self._all_reduce_sum([0 if error is None else 1, *traffic])
        if failed:
            if error is not None:
                raise error if isinstance(error, SyncError) else SyncError(f"weight sync {version} failed: {error!r}") from error
            raise SyncError(f"weight sync {version} failed on the sending trainer")
        self.last_traffic = ({"gathered_bytes_in_node": in_node, "gathered_bytes_cross_node": cross_node}
                             if self.traffic is not None else {})
        return self.last_stats

    def _all_reduce_sum(self, values: list[int]) -> list[int]:
        """Agree on success (any failure counts) and total the gather traffic, in one collective."""
        import torch
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            return values
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(self.group) == "nccl" else "cpu"
        t = torch.tensor(values, dtype=torch.int64, device=device)
        dist.all_reduce(t, group=self.group)
        return [int(v) for v in t.tolist()]

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        if self.engine is not None:
            self.engine.shutdown()
