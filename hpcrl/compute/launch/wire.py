"""Framed, authenticated messages over stream sockets: the one wire format of hpcrl's control
traffic (the node channel between trainers and their server, and the job's watchdog).

A message is a pickled object whose large buffers (torch tensors, numpy arrays) travel out of
band as raw bytes after the pickle, so completions with token ids and logprobs are neither
copied through pickle nor re-encoded. Unpickling runs code, so nothing is unpickled before the
peer proved it holds the job's secret (HMAC over fresh nonces, both ways), and the secret never
crosses the wire.

Frame: magic, buffer count, pickle length | one u64 length per buffer | pickle | buffers.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import os
import pickle
import select
import socket
import struct
import sys
from typing import Any

MAGIC = b"HPC1"
_HEADER = struct.Struct("!4sIQ")
_NONCE = 32
_MAX_BUFFERS = 1 << 16
# Once a message has started, the rest must follow within this long: a peer that stalls
# mid-message is broken, and waiting on it forever would hide that.
BODY_TIMEOUT_S = 120.0


class ChannelClosed(ConnectionError):
    """The peer closed the connection (it exited, or was killed)."""


class AuthError(ConnectionError):
    """The peer does not hold the job's secret (or speaks another protocol)."""


# ---------------------------------------------------------------------------- pickling
def _rebuild_tensor(buf, dtype: str, shape: tuple[int, ...]):
    import torch

    dt = getattr(torch, dtype)
    if len(buf) == 0:
        return torch.empty(shape, dtype=dt)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dt).reshape(shape)


class _Pickler(pickle.Pickler):
    """Pickles torch tensors as raw out-of-band bytes (any dtype, bf16 included) instead of
    torch's own reduce, which serializes the whole storage in-band through torch.save."""

    def reducer_override(self, obj):
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor) and obj.layout == torch.strided:
            t = obj.detach().cpu().contiguous()
            raw = t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)
            return _rebuild_tensor, (pickle.PickleBuffer(raw.numpy()), str(t.dtype).removeprefix("torch."),
                                     tuple(t.shape))
        return NotImplemented


def encode(obj: Any) -> tuple[bytes, list[memoryview]]:
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    _Pickler(out, protocol=5, buffer_callback=buffers.append).dump(obj)
    return out.getvalue(), [b.raw() for b in buffers]


# ---------------------------------------------------------------------------- framing
def send_msg(sock: socket.socket, obj: Any) -> None:
    data, buffers = encode(obj)
    head = _HEADER.pack(MAGIC, len(buffers), len(data))
    lengths = struct.pack(f"!{len(buffers)}Q", *(b.nbytes for b in buffers))
    try:
        sock.sendall(head + lengths + data)
        for b in buffers:
            sock.sendall(b)
    except (BrokenPipeError, ConnectionResetError) as e:
        raise ChannelClosed(f"peer closed the connection ({e.strerror})") from None


def wait_readable(sock: socket.socket, timeout: float | None) -> bool:
    # poll, not select: select() refuses a descriptor numbered 1024 or more, and rank 0 holds one
    # socket per rank for the watchdog hub (scripts/bench_scale.py).
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLPRI)
    return bool(poller.poll(None if timeout is None else timeout * 1000))


def recv_msg(sock: socket.socket, timeout: float | None = None) -> Any:
    """The next message; TimeoutError if none starts within `timeout` (None = wait forever)."""
    if timeout is not None and not wait_readable(sock, max(0.0, timeout)):
        raise TimeoutError(f"no message within {timeout:.1f} s")
    previous = sock.gettimeout()
    sock.settimeout(BODY_TIMEOUT_S)
    try:
        magic, n_buffers, n_data = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
        if magic != MAGIC or n_buffers > _MAX_BUFFERS:
            raise ChannelClosed("peer sent a malformed frame")
        lengths = struct.unpack(f"!{n_buffers}Q", _recv_exact(sock, 8 * n_buffers)) if n_buffers else ()
        data = _recv_exact(sock, n_data)
        buffers = [_recv_exact(sock, n) for n in lengths]
    except socket.timeout:
        raise ChannelClosed(f"peer stalled for {BODY_TIMEOUT_S:.0f} s in the middle of a message") from None
    finally:
        sock.settimeout(previous)
    return pickle.loads(data, buffers=buffers)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        try:
            k = sock.recv_into(view[got:])
        except ConnectionResetError:
            k = 0
        if k == 0:
            raise ChannelClosed("peer closed the connection")
        got += k
    return buf


# ---------------------------------------------------------------------------- authentication
def _mac(secret: bytes, *parts: bytes) -> bytes:
    return hmac.new(secret, b"".join(parts), hashlib.sha256).digest()


def authenticate_server_side(sock: socket.socket, secret: bytes, timeout: float) -> None:
    """Prove to each other that both ends hold `secret`; raises AuthError or ChannelClosed."""
    sock.settimeout(timeout)
    try:
        nonce_s = os.urandom(_NONCE)
        sock.sendall(MAGIC + nonce_s)
        reply = _recv_exact(sock, 2 * _NONCE)
        nonce_c, proof = bytes(reply[:_NONCE]), bytes(reply[_NONCE:])
        if not hmac.compare_digest(proof, _mac(secret, b"client", nonce_s, nonce_c)):
            raise AuthError("peer does not know the job's secret")
        sock.sendall(_mac(secret, b"server", nonce_c, nonce_s))
    except socket.timeout:
        raise AuthError(f"peer did not authenticate within {timeout:.0f} s") from None
    finally:
        sock.settimeout(None)


def authenticate_client_side(sock: socket.socket, secret: bytes, timeout: float) -> None:
    sock.settimeout(timeout)
    try:
        greeting = _recv_exact(sock, len(MAGIC) + _NONCE)
        if bytes(greeting[:len(MAGIC)]) != MAGIC:
            raise AuthError("the other end is not an hpcrl endpoint")
        nonce_s, nonce_c = bytes(greeting[len(MAGIC):]), os.urandom(_NONCE)
        sock.sendall(nonce_c + _mac(secret, b"client", nonce_s, nonce_c))
        try:
            proof = bytes(_recv_exact(sock, _NONCE))
        except ChannelClosed:
            raise AuthError("the endpoint refused this task's proof (another job's secret?)") from None
        if not hmac.compare_digest(proof, _mac(secret, b"server", nonce_c, nonce_s)):
            raise AuthError("the endpoint does not know the job's secret")
    except socket.timeout:
        raise AuthError(f"endpoint did not authenticate within {timeout:.0f} s") from None
    finally:
        sock.settimeout(None)
