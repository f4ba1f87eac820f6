"""The server side of the vLLM backends (hpcrl_shm, nccl, ipc): ``WeightReceiver`` answers the
sender's ``weights_*`` messages (notify.py) by driving vLLM's weight-transfer API of the server's
``vllm.LLM``. What that ``LLM`` must be built with, and its processes' environment, are the vLLM
engine's (hpcrl.compute.inference.vllm_engine: ``weight_transfer_kwargs``, ``weight_transfer_env``).

Imports neither torch nor vLLM: it works on the ``LLM`` object it is given.
"""

from __future__ import annotations

import time

from hpcrl.compute.sync.api import SyncError, WeightsInconsistentError

__all__ = ["WeightReceiver", "llm_dtype"]


def llm_dtype(llm) -> str | None:
    """The dtype a ``vllm.LLM`` computes in ("bfloat16"): what the trainers send weights as."""
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    dtype = getattr(getattr(config, "model_config", None), "dtype", None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


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
        Returns what the sender adapts to: the engine's number of workers (hpcrl_shm's stream mode
        needs exactly one). Not its dtype: the trainers took that from its health reply before
        building their side, and agreed on it then."""
        self.llm.init_weight_transfer_engine({"init_info": init_info})
        config = getattr(getattr(self.llm, "llm_engine", None), "vllm_config", None)
        workers = getattr(getattr(config, "parallel_config", None), "world_size", None)
        return {"workers": workers}

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
