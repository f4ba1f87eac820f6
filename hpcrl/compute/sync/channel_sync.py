"""The channel transport: weights into the transformers engine (the fallback where vLLM is absent).

Buckets travel as tensors in the messages over the node channel: ``weights_start``, one
``weights_bucket`` per bucket, ``weights_finish``. Slower than shared memory, but it needs
nothing from the engine beyond ``load_weights``. ``ChannelWeightSync`` is the trainers' side,
``ChannelReceiver`` the server's.
"""

from __future__ import annotations

from typing import Callable, Iterable, Protocol

from hpcrl.compute.sync.gather import GatherTraffic, agree_wire_dtype, iter_buckets, sync_named_params

__all__ = ["ChannelWeightSync", "ChannelReceiver"]

# The sender's conversation with the server: (message, timeout in seconds) -> reply.
Request = Callable[[dict, float], dict]


class ChannelWeightSync:
    """The trainers' side: every trainer gathers (a collective), the sender sends each bucket.
    ``request`` is the sender's conversation with the server; a refusal raises on the sender.
    ``wire_dtype``: the engine's dtype (its health reply tells each trainer), which every trainer
    casts its shards to before the gathers; None: as stored. The trainers agree on it here, as
    TrainerWeightSync's do (a collective over the default group: build it on every trainer)."""

    def __init__(self, model, request: Request, *, is_sender: bool, bucket_bytes: int, timeout_s: float,
                 wire_dtype=None, node_of_rank: dict[int, int] | None = None):
        self.request = request
        self.is_sender = is_sender
        self.params = sync_named_params(model)
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.wire_dtype = agree_wire_dtype(wire_dtype)
        # With the plan's node of every trainer rank, each sync counts its gathers' bytes inside a
        # node and between nodes, as TrainerWeightSync does (the job's totals: last_traffic).
        self.traffic = GatherTraffic(node_of_rank) if node_of_rank else None
        self.last_traffic: dict[str, int] = {}

    def sync(self, version: int) -> dict:
        sender = self.is_sender
        if self.traffic is not None:
            self.traffic.reset()
        if sender:
            self._call({"op": "weights_start", "version": version})
        for bucket in iter_buckets(self.params, self.bucket_bytes, keep=sender, cast_to=self.wire_dtype,
                                   traffic=self.traffic):
            self._call({"op": "weights_bucket", "tensors": [(n, t) for n, t in bucket]})
        if sender:
            self._call({"op": "weights_finish", "version": version})
        if self.traffic is not None:
            self.last_traffic = self.traffic.job_totals()
        return {}

    def _call(self, msg: dict) -> None:
        reply = self.request(msg, self.timeout_s)
        if not reply.get("ok"):
            raise RuntimeError(f"weight sync {msg.get('version', '')} refused by the server: {reply.get('error')}")

    def close(self) -> None:
        """Nothing to release: the channel belongs to the caller."""


class WeightLoader(Protocol):
    """What the receiver needs from the engine (``TransformersEngine``)."""

    def load_weights(self, named_tensors: Iterable) -> None: ...


class ChannelReceiver:
    """The server's side: applies each bucket to the engine as it arrives."""

    def __init__(self, engine: WeightLoader):
        self.engine = engine
        self.state = "serving"

    @property
    def consistent(self) -> bool:
        return self.state == "serving"

    def handle(self, msg: dict) -> dict:
        op = msg["op"]
        if op == "weights_start":
            self.state = "open"
        elif op == "weights_bucket":
            if self.state != "open":
                return {"ok": False, "error": f"bucket without an open sync (state {self.state})"}
            self.engine.load_weights(msg["tensors"])
        elif op == "weights_finish":
            if self.state != "open":
                return {"ok": False, "error": f"finish without an open sync (state {self.state})"}
            self.state = "serving"
        elif op == "weights_abort":
            self.state = "failed"
        else:
            return {"ok": False, "error": f"unknown weight-sync message {op!r}"}
        return {"ok": True, "state": self.state}
