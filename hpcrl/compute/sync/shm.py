"""POSIX shared-memory transport for weight syncs inside one node (the ``hpcrl_shm`` backend).

One file in /dev/shm, created by the sending trainer (mode 0600, name with a per-job random
token), mapped by the sender and by the vLLM worker, then unlinked: once both sides hold the
mapping nothing is left behind in /dev/shm, whatever dies later. The file holds a small header and
two slots (double buffering: the sender fills one slot while the worker applies the other):

    [file header, 4 KiB][slot 0][slot 1]
    slot = [meta: seq u64, json_len u64, JSON [[name, dtype, shape, offset], ...]][data: tensors]

Tensors sit at 64-byte aligned offsets in the data area, so the worker views them straight out
of the mapping (``torch.frombuffer`` + ``view``): the only copy on the receiving side is the one
``load_weights`` makes. The sequence number in a slot must match the one the worker expects, so a
worker never applies a slot that was not (or not yet) written for it.

Two ways to tell the worker that a slot is ready (``mode``):

- ``"stream"`` (default): ONE ``update_weights`` call per sync; inside it the worker waits on a
  pair of FIFOs (created and unlinked with the region): the sender writes "slot k ready", the worker
  answers "slot k applied". No per-bucket round trip through the server's process and the engine
  core; the FIFO syscalls order the shared-memory writes; a sender that dies closes its FIFO end,
  which the worker sees at once (EOF). One worker only (tensor parallel size 1).
- ``"rpc"``: one ``update_weights`` per slot carrying ``{"slot", "seq"}``; works with any number of
  workers; costs a server round trip per bucket.

This module imports torch only (no vLLM): trainers use it without paying for ``import vllm``.
``shm_transport.ShmTransport`` is the backend's part of ``TrainerWeightSync`` (trainer.py). The worker side,
inside vLLM (shm_vllm.py), uses ``open_receiver``, ``read_slot``, ``receive_stream`` and
``close_receiver``; the server role's ``WeightReceiver`` (receiver.py) relays the messages to it.
"""

from __future__ import annotations

import json
import mmap
import os
import secrets
import select
import stat
import struct
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hpcrl.compute.sync.api import SyncClient, SyncError

__all__ = ["ShmRegion", "SignalPipe", "open_receiver", "close_receiver", "receive_stream", "SendStats", "ShmWeightSender", "shm_path",
           "numel"]

MAGIC = b"HPCRLSHM"
LAYOUT_VERSION = 1
FILE_HEADER_BYTES = 4096
_FILE_HEADER = struct.Struct("<8sIIQQ32s")  # magic, layout, num_slots, slot_bytes, meta_bytes, token
_SLOT_HEADER = struct.Struct("<QQ")  # seq, json_len
ALIGN = 64  # covers every dtype's alignment and a cache line
PAGE = 4096
DEFAULT_META_BYTES = 256 * 1024  # about 2,000 tensor entries per slot; more are split off
PAD_SLACK = 64 * 1024  # alignment padding for up to 1,000 tensors per slot without a split
_SIGNAL = struct.Struct("<qq")  # seq, kind: one FIFO record (atomic: far below PIPE_BUF)
READY, END, ABORT = 0, 1, 2  # kinds on the "ready" FIFO (sender -> worker); "done" carries READY
# What sets the stall bound in a job (ServerGenerator passes it): a stalled sync's message names it.
STALL_SETTING = "inference.request_timeout_s"


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def shm_path(job_token: str | None = None, shm_dir: str | os.PathLike = "/dev/shm") -> Path:
    """A fresh file name: job token (e.g. the Slurm job id) + a random part, so that concurrent
    jobs and restarted senders never meet."""
    token = job_token or os.environ.get("SLURM_JOB_ID") or "local"
    return Path(shm_dir) / f"hpcrl-sync-{token}-{os.getpid()}-{secrets.token_hex(8)}"


class ShmRegion:
    """The mapped file: header, slots, and typed views into them."""

    def __init__(self, path: Path, fd: int, mm: mmap.mmap, num_slots: int, slot_bytes: int, meta_bytes: int, token: str):
        self.path, self.num_slots, self.slot_bytes, self.meta_bytes, self.token = path, num_slots, slot_bytes, meta_bytes, token
        self._fd, self._mm = fd, mm
        self._bytes = torch.frombuffer(mm, dtype=torch.uint8)  # one tensor over the whole mapping
        self.base_ptr = self._bytes.data_ptr()

    @property
    def data_bytes(self) -> int:
        return self.slot_bytes - self.meta_bytes

    @property
    def total_bytes(self) -> int:
        return FILE_HEADER_BYTES + self.num_slots * self.slot_bytes

    @classmethod
    def create(cls, path: str | os.PathLike, data_bytes: int, *, num_slots: int = 2,
               meta_bytes: int = DEFAULT_META_BYTES) -> ShmRegion:
        path = Path(path)
        meta_bytes = _round_up(meta_bytes, PAGE)
        slot_bytes = meta_bytes + _round_up(data_bytes, PAGE)
        total = FILE_HEADER_BYTES + num_slots * slot_bytes
        token = secrets.token_hex(16)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Reserve the pages now: a full /dev/shm then fails here with ENOSPC instead of
            # killing the process with SIGBUS at its first write into the mapping.
            os.posix_fallocate(fd, 0, total)
            mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        mm[: _FILE_HEADER.size] = _FILE_HEADER.pack(MAGIC, LAYOUT_VERSION, num_slots, slot_bytes, meta_bytes, token.encode())
        region = cls(path, fd, mm, num_slots, slot_bytes, meta_bytes, token)
        for fifo in SignalPipe.paths(path):
            os.mkfifo(fifo, 0o600)
        return region

    @classmethod
    def open(cls, path: str | os.PathLike, *, num_slots: int, slot_bytes: int, meta_bytes: int, token: str) -> ShmRegion:
        """Map an existing region and check it is the one the sender described."""
        path = Path(path)
        fd = os.open(path, os.O_RDWR)
        try:
            total = os.fstat(fd).st_size
            mm = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        magic, layout, n, sb, mb, tok = _FILE_HEADER.unpack_from(mm, 0)
        expected = (MAGIC, LAYOUT_VERSION, num_slots, slot_bytes, meta_bytes, token.encode())
        if (magic, layout, n, sb, mb, tok) != expected or total != FILE_HEADER_BYTES + n * sb:
            mm.close()
            os.close(fd)
            raise SyncError(f"{path} is not the shared-memory region the sender announced")
        return cls(path, fd, mm, num_slots, slot_bytes, meta_bytes, token)

    def init_info(self) -> dict[str, Any]:
        """What the worker needs to map this region (the backend's init info)."""
        return {"path": str(self.path), "num_slots": self.num_slots, "slot_bytes": self.slot_bytes,
                "meta_bytes": self.meta_bytes, "token": self.token}

    def _slot_start(self, slot: int) -> int:
        if not 0 <= slot < self.num_slots:
            raise SyncError(f"slot {slot} out of range (0..{self.num_slots - 1})")
        return FILE_HEADER_BYTES + slot * self.slot_bytes

    def data_range(self, slot: int) -> tuple[int, int]:
        """Address range of a slot's data area (to find tensors that still point into it)."""
        lo = self.base_ptr + self._slot_start(slot) + self.meta_bytes
        return lo, lo + self.data_bytes

    def slot_views(self, slot: int, specs: list[Spec]) -> tuple[list[torch.Tensor], bytes]:
        """Where ``specs`` (name, dtype, shape) go in a slot's data area: a tensor view for each, for
        the sender to fill in place, and the slot's table for ``seal_slot`` once they are filled."""
        start = self._slot_start(slot)
        data = self._bytes[start + self.meta_bytes: start + self.slot_bytes]
        table, views, offset = [], [], 0
        for name, dtype, shape in specs:
            offset = _round_up(offset, ALIGN)
            n = dtype.itemsize * numel(shape)
            if offset + n > self.data_bytes:
                raise SyncError(f"slot overflow at {name}: {offset + n} > {self.data_bytes} bytes")
            views.append(data[offset: offset + n].view(dtype).view(tuple(shape)))
            table.append([name, str(dtype).removeprefix("torch."), list(shape), offset])
            offset += n
        blob = json.dumps(table, separators=(",", ":")).encode()
        if _SLOT_HEADER.size + len(blob) > self.meta_bytes:
            raise SyncError(f"slot table of {len(specs)} tensors does not fit {self.meta_bytes} bytes")
        return views, blob

    def seal_slot(self, slot: int, seq: int, table: bytes) -> None:
        """Mark a filled slot as holding bucket ``seq``: its table, then the sequence number, last,
        so a slot whose number matches was completely written."""
        start = self._slot_start(slot)
        self._mm[start + _SLOT_HEADER.size: start + _SLOT_HEADER.size + len(table)] = table
        self._mm[start: start + _SLOT_HEADER.size] = _SLOT_HEADER.pack(seq, len(table))

    def write_slot(self, slot: int, seq: int, tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Copy ``tensors`` into a slot and seal it. Returns bytes."""
        views, table = self.slot_views(slot, [spec_of(name, t) for name, t in tensors])
        for view, (_, tensor) in zip(views, tensors):
            view.copy_(tensor)
        self.seal_slot(slot, seq, table)
        return sum(v.numel() * v.element_size() for v in views)

    def read_slot(self, slot: int, seq: int) -> list[tuple[str, torch.Tensor]]:
        """Views (no copies) of the tensors in a slot; checks it holds bucket ``seq``."""
        start = self._slot_start(slot)
        got, length = _SLOT_HEADER.unpack_from(self._mm, start)
        if got != seq:
            raise SyncError(f"slot {slot} holds bucket {got}, expected {seq}: sender and worker out of step")
        table = json.loads(bytes(self._mm[start + _SLOT_HEADER.size: start + _SLOT_HEADER.size + length]))
        data = self._bytes[start + self.meta_bytes: start + self.slot_bytes]
        out = []
        for name, dtype_name, shape, offset in table:
            dtype = getattr(torch, dtype_name)
            n = dtype.itemsize * numel(shape)
            out.append((name, data[offset: offset + n].view(dtype).view(shape)))
        return out

    def fits(self, specs: list[Spec]) -> bool:
        """Whether ``specs`` (name, dtype, shape) fit one slot (data with padding, and the table)."""
        offset, table = 0, 2
        for name, dtype, shape in specs:
            offset = _round_up(offset, ALIGN) + dtype.itemsize * numel(shape)
            table += len(name) + 40 + 8 * len(shape)  # a generous bound on one JSON entry
        return offset <= self.data_bytes and _SLOT_HEADER.size + table <= self.meta_bytes

    def unlink(self) -> None:
        """Remove the names; mappings and open FIFOs stay valid (the pages go with the last user)."""
        self.path.unlink(missing_ok=True)
        for fifo in SignalPipe.paths(self.path):
            fifo.unlink(missing_ok=True)

    def close(self) -> None:
        self._bytes = None  # release our export of the mapping before closing it
        try:
            self._mm.close()
        except BufferError:
            pass  # views still alive somewhere: the mapping goes with them (GC)
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


Spec = tuple[str, torch.dtype, tuple[int, ...]]  # what a slot holds of one tensor: name, dtype, shape
Fill = Callable[[int, int], int]  # (slot, seq) -> bytes: writes one slot (copies, or gathers in place), seals it


def spec_of(name: str, tensor: torch.Tensor) -> Spec:
    return name, tensor.dtype, tuple(tensor.shape)


def numel(shape) -> int:
    """Elements of a tensor of this shape (1 for a scalar's empty shape)."""
    n = 1
    for d in shape:
        n *= d
    return n


class SignalPipe:
    """Ready/applied records between the sender and the worker, over two FIFOs next to the region.

    Each side reads one FIFO and writes the other. Reads wait with ``poll`` and a stall timeout;
    EOF (the other side closed its end: it exited or died) raises at once. Records carry the slot
    sequence number, so records left over from an interrupted sync (lower numbers) are skipped.
    """

    def __init__(self, read_fd: int, write_fd: int) -> None:
        self.read_fd, self.write_fd = read_fd, write_fd

    @staticmethod
    def paths(region_path: str | os.PathLike) -> tuple[Path, Path]:
        base = str(region_path)
        return Path(base + ".ready"), Path(base + ".done")  # sender -> worker, worker -> sender

    @staticmethod
    def _open(path: Path, flags: int) -> int:
        fd = os.open(path, flags | os.O_NONBLOCK)
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.close(fd)
            raise SyncError(f"{path} is not a FIFO")
        return fd

    @classmethod
    def open_worker(cls, region_path) -> SignalPipe:
        """Worker side, at init (the sender already holds the read end of "done")."""
        ready, done = cls.paths(region_path)
        read_fd = cls._open(ready, os.O_RDONLY)
        return cls(read_fd, cls._open(done, os.O_WRONLY))

    @classmethod
    def open_sender_read(cls, region_path) -> int:
        """Sender side, before init: the read end of "done" (lets the worker open its write end)."""
        return cls._open(cls.paths(region_path)[1], os.O_RDONLY)

    @classmethod
    def open_sender(cls, region_path, read_fd: int) -> SignalPipe:
        """Sender side, after init (the worker holds the read end of "ready" now)."""
        return cls(read_fd, cls._open(cls.paths(region_path)[0], os.O_WRONLY))

    def send(self, seq: int, kind: int = READY) -> None:
        try:
            os.write(self.write_fd, _SIGNAL.pack(seq, kind))
        except OSError as exc:  # EPIPE: the reader is gone; EAGAIN: it stopped reading
            raise SyncError(f"cannot signal the other side of the weight sync: {exc}") from exc

    def recv(self, timeout_s: float, min_seq: int = 0, keep_waiting=None) -> tuple[int, int]:
        """The next record with ``seq >= min_seq`` (older ones are leftovers: skipped).

        Raises ``SyncError`` on EOF, or after ``timeout_s`` without a record. ``keep_waiting``, if
        given, is asked about every 0.1 s and ends the wait early by returning False.
        """
        deadline = time.monotonic() + timeout_s
        buf = b""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SyncError(f"weight sync stalled: nothing from the other side for {timeout_s:.0f} s "
                                f"(the bound is {STALL_SETTING})")
            ready, _, _ = select.select([self.read_fd], [], [], min(left, 0.1))
            if not ready:
                if keep_waiting is not None and not keep_waiting():
                    raise SyncError("weight sync ended on the other side")
                continue
            try:
                chunk = os.read(self.read_fd, _SIGNAL.size - len(buf))
            except BlockingIOError:
                continue
            if not chunk:
                raise SyncError("the other side of the weight sync is gone (FIFO closed)")
            buf += chunk
            if len(buf) < _SIGNAL.size:
                continue
            seq, kind = _SIGNAL.unpack(buf)
            buf = b""
            if seq >= min_seq:
                return seq, kind

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            if fd >= 0:
                os.close(fd)
        self.read_fd = self.write_fd = -1


def open_receiver(path: str | os.PathLike, *, num_slots: int, slot_bytes: int, meta_bytes: int, token: str,
                  signals: bool) -> tuple[ShmRegion, SignalPipe | None]:
    """The receiving side's end of a sender's region (``ShmRegion.init_info`` with ``signals``): its
    mapping, and its end of the FIFOs where the sender signals through them (stream mode)."""
    region = ShmRegion.open(path, num_slots=num_slots, slot_bytes=slot_bytes, meta_bytes=meta_bytes, token=token)
    try:
        return region, SignalPipe.open_worker(path) if signals else None
    except BaseException:
        region.close()
        raise


def close_receiver(region: ShmRegion | None, signals: SignalPipe | None) -> None:
    """Close what ``open_receiver`` opened (either may be None: nothing, or not yet, opened)."""
    if signals is not None:
        signals.close()
    if region is not None:
        region.close()


def receive_stream(region: ShmRegion, signals: SignalPipe, first_seq: int, apply, stall_timeout_s: float = 300.0) -> int:
    """The worker's side of one "stream" sync: apply each signalled slot, acknowledge it, until the
    sender's end record. ``apply(tensors, slot)`` gets the slot's tensor views; it must not keep
    them past its return (the slot is refilled after the acknowledgement). Returns the slot count.
    """
    seq = first_seq
    while True:
        got, kind = signals.recv(stall_timeout_s, min_seq=first_seq)
        if kind == END:
            return seq - first_seq
        if kind == ABORT:
            raise SyncError("the sender aborted the weight sync")
        if got != seq:
            raise SyncError(f"bucket {got} signalled, expected {seq}: sender and worker out of step")
        slot = seq % region.num_slots
        apply(region.read_slot(slot, seq), slot)
        signals.send(seq)  # the slot may be refilled
        seq += 1


@dataclass
class SendStats:
    """Where one sync's time went, as the sender saw it."""

    version: str | None = None
    slots: int = 0  # slot fills
    bytes: int = 0
    produce_s: float = 0.0  # waiting on the bucket iterator (the gathers, when fed by iter_buckets)
    pack_s: float = 0.0  # copying tensors into shared memory (the hand-off proper)
    wait_s: float = 0.0  # waiting for the server to free a slot / finish
    total_s: float = 0.0
    events: list[str] = field(default_factory=list)

    @property
    def pack_gbps(self) -> float:
        return self.bytes / self.pack_s / 1e9 if self.pack_s else float("nan")


class ShmWeightSender:
    """Sends buckets of full tensors to the node's vLLM server through a shared-memory region.

    Created once (on the node's sending trainer): creates the region, has the server map it
    (``init_weight_transfer_engine``) and unlinks it. ``send`` runs one sync: start, the buckets
    (see the module doc for ``mode``), finish with the version. Server calls run on one
    background thread, so the next bucket is gathered and packed while the worker applies the
    previous one; a slot is refilled only after the worker has finished with it.

    ``bucket_bytes`` bounds a bucket; ``max_tensor_bytes`` (the largest single tensor, see
    ``gather.param_specs``) makes a slot big enough for any one tensor. ``stall_timeout_s``: how
    long either side waits for the other before the sync fails (the gathers of one bucket must
    fit in it).
    """

    def __init__(self, client: SyncClient, bucket_bytes: int, max_tensor_bytes: int = 0, *,
                 shm_dir: str | os.PathLike = "/dev/shm", job_token: str | None = None, mode: str = "stream",
                 meta_bytes: int = DEFAULT_META_BYTES, stall_timeout_s: float = 300.0):
        if mode not in ("stream", "rpc"):
            raise ValueError(f"mode must be 'stream' or 'rpc', not {mode!r}")
        self.client, self.bucket_bytes, self.mode, self.stall_timeout_s = client, bucket_bytes, mode, stall_timeout_s
        data_bytes = max(bucket_bytes, max_tensor_bytes) + PAD_SLACK
        self.region = ShmRegion.create(shm_path(job_token, shm_dir), data_bytes, num_slots=2, meta_bytes=meta_bytes)
        self._rpc = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpcrl-sync-rpc")
        self._seq = 0
        self.signals: SignalPipe | None = None
        try:
            done_fd = SignalPipe.open_sender_read(self.region.path)
            reply = self._call(self.client.init_weight_transfer_engine, {**self.region.init_info(), "signals": True})
            self.signals = SignalPipe.open_sender(self.region.path, done_fd)
            if isinstance(reply, dict) and (reply.get("workers") or 1) > 1:
                self.mode = "rpc"  # stream mode signals one worker; rpc reaches all of them
        finally:
            self.region.unlink()  # mapped/opened on both sides now (or failed): no name left to leak

    def _call(self, fn, *args):
        """Run a server call on the RPC thread and wait for it."""
        return self._wait(self._rpc.submit(fn, *args), getattr(fn, "__name__", "a server call"))

    def _wait(self, future: Future, what: str):
        """The result of a server call, within the stall bound; a bare TimeoutError would not say
        which call, nor what sets the bound."""
        try:
            return future.result(timeout=self.stall_timeout_s)
        except FutureTimeout:
            raise SyncError(f"weight sync stalled: the server did not answer {what} within "
                            f"{self.stall_timeout_s:.0f} s (the bound is {STALL_SETTING})") from None

    def chunks(self, items: list, spec=lambda item: spec_of(*item)) -> Iterable[list]:
        """``items`` (a bucket, or a group of parameters; ``spec(item)`` says what each holds in a
        slot) in pieces that fit one slot: the whole normally; split where padding or the table
        would overflow it."""
        specs = [spec(item) for item in items]
        if self.region.fits(specs):
            yield items
            return
        chunk: list = []
        held: list[Spec] = []
        for item, item_spec in zip(items, specs):
            if chunk and not self.region.fits(held + [item_spec]):
                yield chunk
                chunk, held = [], []
            if not self.region.fits([item_spec]):
                name, dtype, shape = item_spec
                raise SyncError(f"{name} ({dtype.itemsize * numel(shape)} bytes) does not fit a slot of "
                                f"{self.region.data_bytes} bytes; pass max_tensor_bytes")
            chunk.append(item)
            held.append(item_spec)
        if chunk:
            yield chunk

    def send(self, buckets: Iterable[list[tuple[str, torch.Tensor]]], version: str | int | None = None) -> SendStats:
        """One full sync of buckets of full tensors, each copied into a slot."""
        return self._send(lambda stats: self._copies(buckets, stats), version)

    def send_gathering(self, groups: list[list[Spec]], gather: Callable[[int, list[torch.Tensor]], None],
                       version: str | int | None = None) -> SendStats:
        """One full sync whose tensors are gathered straight into the slots: ``groups`` say what each
        slot will hold (each fits one, ``chunks``), and ``gather(i, views)`` fills group i's views
        when its slot is free (the gathers' collectives run inside it). No gathered copy exists."""
        return self._send(lambda stats: self._gathers(groups, gather, stats), version)

    def _copies(self, buckets, stats: SendStats) -> Iterator[Fill]:
        it = iter(buckets)
        while True:
            t = time.perf_counter()
            bucket = next(it, None)
            stats.produce_s += time.perf_counter() - t
            if bucket is None:
                return
            for chunk in self.chunks(bucket):
                def fill(slot: int, seq: int, chunk=chunk) -> int:
                    t = time.perf_counter()
                    nbytes = self.region.write_slot(slot, seq, chunk)
                    stats.pack_s += time.perf_counter() - t
                    return nbytes
                yield fill

    def _gathers(self, groups: list[list[Spec]], gather, stats: SendStats) -> Iterator[Fill]:
        for i, specs in enumerate(groups):
            def fill(slot: int, seq: int, i=i, specs=specs) -> int:
                views, table = self.region.slot_views(slot, specs)
                t = time.perf_counter()
                gather(i, views)
                stats.produce_s += time.perf_counter() - t
                self.region.seal_slot(slot, seq, table)
                return sum(v.numel() * v.element_size() for v in views)
            yield fill

    def _fill(self, fill: Fill, slot: int, stats: SendStats) -> None:
        stats.bytes += fill(slot, self._seq)
        stats.slots += 1

    def _send(self, fills, version: str | int | None) -> SendStats:
        """One full sync: start, the slot fills (``fills(stats)``), finish. Raises ``SyncError``
        (after telling the server to abort) on any failure."""
        version = None if version is None else str(version)
        stats = SendStats(version=version)
        t0 = time.perf_counter()
        try:
            self._call(self.client.start_weight_update)
            if self.mode == "stream":
                self._send_stream(fills(stats), stats)
            else:
                self._send_rpc(fills(stats), stats)
            t = time.perf_counter()
            self._call(self.client.finish_weight_update, version)
            stats.wait_s += time.perf_counter() - t
        except BaseException as exc:
            self._abort_on_server()
            if isinstance(exc, SyncError):
                raise
            raise SyncError(f"weight sync {version} failed: {exc!r}") from exc
        stats.total_s = time.perf_counter() - t0
        return stats

    def _send_stream(self, fills: Iterable[Fill], stats: SendStats) -> None:
        """One update_weights for the whole sync; slots signalled through the FIFOs."""
        first = self._seq
        n = self.region.num_slots
        update = self._rpc.submit(self.client.update_weights,
                                  {"slot": -1, "seq": first, "stall_timeout_s": self.stall_timeout_s})
        try:
            acked = first - 1  # last slot the worker reported applied
            for fill in fills:
                t = time.perf_counter()
                while acked < self._seq - n:  # the slot still holds an unapplied bucket: wait
                    acked, _ = self.signals.recv(self.stall_timeout_s, min_seq=first, keep_waiting=lambda: not update.done())
                stats.wait_s += time.perf_counter() - t
                self._fill(fill, self._seq % n, stats)
                self.signals.send(self._seq)
                self._seq += 1
            self.signals.send(self._seq, END)
            t = time.perf_counter()
            self._wait(update, "update_weights")
            stats.wait_s += time.perf_counter() - t
        except BaseException:
            if not update.done():
                try:
                    self.signals.send(self._seq, ABORT)  # release the worker now, not at its timeout
                except SyncError:
                    pass
            if update.done() and update.exception() is not None:
                raise update.exception()  # the worker's error says more than ours
            raise
        finally:
            self._seq += 1  # the END/ABORT record used a number: never reuse it

    def _send_rpc(self, fills: Iterable[Fill], stats: SendStats) -> None:
        """One update_weights per slot, {"slot", "seq"}; any number of workers."""
        in_flight: list[Future | None] = [None] * self.region.num_slots
        for fill in fills:
            slot = self._seq % self.region.num_slots
            t = time.perf_counter()
            if in_flight[slot] is not None:
                self._wait(in_flight[slot], "update_weights")  # the worker is done with this slot
            stats.wait_s += time.perf_counter() - t
            self._fill(fill, slot, stats)
            in_flight[slot] = self._rpc.submit(self.client.update_weights, {"slot": slot, "seq": self._seq})
            self._seq += 1
        t = time.perf_counter()
        for fut in in_flight:
            if fut is not None:
                self._wait(fut, "update_weights")
        stats.wait_s += time.perf_counter() - t

    def _abort_on_server(self) -> None:
        abort = getattr(self.client, "abort_weight_update", None)
        if abort is None:
            return  # a plain vLLM client: the server notices through its own timeout
        try:
            self._call(abort)
        except Exception:
            pass  # the server may be gone; it refuses to serve until the next sync either way

    def close(self) -> None:
        self._rpc.shutdown(wait=False, cancel_futures=True)
        if self.signals is not None:
            self.signals.close()
        self.region.close()
