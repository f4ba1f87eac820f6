"""The probe's weight-transport check (issue #27, item 3): each sender moves one bucket of the
recipe's size (inference.sync_bucket_mb) to each engine it syncs, through the transport its job's
syncs take, and both rows report the pair: the path, the bytes, the time, the rate, and whether the
engine read back the bytes that were sent.

On CPU sites the transport is hpcrl_shm, and the check runs its real parts: the sender
(hpcrl.compute.sync.shm.ShmWeightSender: the /dev/shm region, its FIFOs, the ``weights_*`` messages
over the node channel) and, on the engine's side, the ``receive_stream`` loop vLLM's worker runs
(hpcrl.compute.sync.shm_vllm), with a checksum of the bucket in place of vLLM's ``load_weights``.
GPU sites' transports (nccl through NCCL/RCCL, ipc) are not probed yet: the row says so.
"""

from __future__ import annotations

import os
import time
from typing import Any

from hpcrl.compute.launch.context import LaunchContext
from hpcrl.compute.sync.api import SHM_BACKEND, default_backend

__all__ = ["PATH", "Receiver", "probed", "send"]

PATH = "/dev/shm (node-local shared memory)"
BUCKET = "hpcrl.probe.bucket"


def probed(ctx: LaunchContext) -> bool:
    """Whether the probe moves a bucket over this site's transport (hpcrl_shm: CPU sites)."""
    return default_backend(ctx.device) == SHM_BACKEND


def _bucket(ctx: LaunchContext):
    """The recipe's bucket of bytes, this sender's own pattern, and its checksum."""
    import torch

    words = max(1, (ctx.spec.recipe.inference.sync_bucket_mb << 20) // 8)
    pattern = torch.arange(words, dtype=torch.int64).mul_(2 * ctx.task.rank + 1)
    return pattern.view(torch.uint8), checksum(pattern.view(torch.uint8))


def checksum(data) -> int:
    """The bytes' sum as 64-bit words, modulo 2**64: cheap, and off for a slot that is not the bucket."""
    import torch

    return int(data.view(torch.int64).sum()) % 2**64


def send(ctx: LaunchContext) -> dict:
    """The sender's check: a bucket to each engine it syncs (``ctx.task.sends_to``)."""
    transport = default_backend(ctx.device)
    if transport != SHM_BACKEND:
        why = f"the probe moves a bucket over {SHM_BACKEND} only (CPU sites); {transport} not yet"
        ctx.log(f"probe: rank {ctx.task.rank} -> engine rank(s) {list(ctx.task.sends_to)}: not probed: {why}")
        return {"ok": True, "ran": False, "transport": transport, "why": why}
    bucket, total = _bucket(ctx)
    pairs = [_send_one(ctx, server, bucket, total) for server in ctx.task.sends_to]
    return {"ok": all(p["ok"] for p in pairs), "ran": True, "transport": transport, "path": PATH, "pairs": pairs}


def _send_one(ctx: LaunchContext, server: int, bucket, total: int) -> dict:
    from hpcrl.compute.sync.notify import NotifyClient
    from hpcrl.compute.sync.shm import ShmWeightSender

    # The bound of the job's own syncs, which the shm sender's stall message names (STALL_SETTING).
    timeout = ctx.spec.recipe.inference.request_timeout_s
    channel = ctx.channels[server]

    def notify(msg: dict) -> Any:
        try:
            return channel.request(msg, timeout=timeout)
        except TimeoutError:
            raise TimeoutError(f"the server rank {server} did not answer {msg['op']} within {timeout:.0f} s "
                               f"(inference.request_timeout_s)") from None

    token = f"{os.environ.get('SLURM_JOB_ID', 'local')}-n{ctx.task.node}-{os.getpid()}-probe"
    sender = ShmWeightSender(NotifyClient(notify), bucket.numel(), job_token=token, stall_timeout_s=timeout)
    try:
        stats = sender.send([[(BUCKET, bucket)]], version="probe")
    finally:
        sender.close()
    got = notify({"op": "probe_transfer"})
    ok = bool(got.get("ok")) and got.get("bytes") == bucket.numel() and got.get("checksum") == total
    pair = {"ok": ok, "server_rank": server, "bytes": stats.bytes, "seconds": round(stats.total_s, 4),
            "gb_per_s": round(stats.bytes / stats.total_s / 1e9, 3) if stats.total_s else None,
            "copy_gb_per_s": round(stats.pack_gbps, 3), "received": got}
    ctx.log(f"probe: rank {ctx.task.rank} -> engine rank {server} (node {ctx.task.node}): "
            f"{stats.bytes / 2**20:.0f} MiB over {SHM_BACKEND}, {PATH}, in {stats.total_s:.3f} s "
            f"({pair['gb_per_s']} GB/s); the engine read back {'the same bytes' if ok else 'OTHER BYTES: ' + repr(got)}")
    return pair


class Receiver:
    """The engine's side: the ``weights_*`` messages of one sender, as the vLLM worker answers them
    (hpcrl.compute.sync.shm_vllm), each slot summed instead of loaded; ``probe_transfer`` reports."""

    def __init__(self):
        self.region = self.signals = None
        self.sender: int | None = None
        self.bytes, self.total, self.apply_s = 0, 0, 0.0

    def handle(self, rank: int, msg: dict) -> dict:
        """The reply to a transfer message from trainer ``rank``; never raises (the channel needs one)."""
        from hpcrl.compute.sync.shm import open_receiver, receive_stream

        op = msg.get("op")
        try:
            if op == "weights_init":
                self.close()
                self.region, self.signals = open_receiver(**msg["init_info"])
                self.sender = rank
                return {"ok": True, "workers": 1}
            if op == "weights_update":
                update = msg["update_info"]
                t = time.perf_counter()
                receive_stream(self.region, self.signals, update["seq"], self._apply, update.get("stall_timeout_s") or 300.0)
                self.apply_s += time.perf_counter() - t
                return {"ok": True}
            if op in ("weights_start", "weights_finish", "weights_abort"):
                return {"ok": True}
            if op == "probe_transfer":
                self.close()
                return {"ok": True, "bytes": self.bytes, "checksum": self.total, "seconds": round(self.apply_s, 4)}
            return {"ok": False, "error": f"unknown probe message {op!r}"}
        except Exception as e:          # noqa: BLE001 - its reply says what failed
            return {"ok": False, "error": f"{type(e).__name__}: {e}"}

    def _apply(self, tensors, slot: int) -> None:
        for _, t in tensors:
            self.bytes += t.numel() * t.element_size()
            self.total = (self.total + checksum(t)) % 2**64

    def check(self, expected_sender: int) -> dict:
        """The engine's row: a bucket came from its sender (``expected_sender``)."""
        self.close()
        return {"ok": self.sender == expected_sender and self.bytes > 0, "transport": SHM_BACKEND, "path": PATH,
                "from": self.sender, "bytes": self.bytes, "apply_s": round(self.apply_s, 4)}

    def close(self) -> None:
        from hpcrl.compute.sync.shm import close_receiver

        close_receiver(self.region, self.signals)
        self.region = self.signals = None
