"""The sender's end of the vLLM backends' messages: vLLM's client protocol over the node channel.

Messages between a trainer and the server are small dicts through ``notify(meta) -> reply``
(the node-local channel): ``weights_init`` once, then per sync ``weights_start``,
``weights_update`` (once per sync in hpcrl_shm's default "stream" mode, where the worker and the
sender pace the buckets through FIFOs; once per bucket in its "rpc" mode; once for nccl),
``weights_finish`` (or ``weights_abort``). The bytes never travel in the messages: they sit in
shared memory (hpcrl_shm) or go over NCCL/RCCL (nccl). ``WeightReceiver`` (receiver.py) answers them.
"""

from __future__ import annotations

from hpcrl.compute.sync.api import Notify, SyncError

__all__ = ["NotifyClient"]


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
