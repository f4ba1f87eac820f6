"""The node-local channel between an inference engine (a server task) and the trainers it serves.

Control messages, prompts and completions (token ids, logprobs) go over a unix socket in the
abstract namespace: nothing on disk to clean up or to leave behind after a crash, and fake
nodes sharing one host (the Slurm testbed) each get their own name. Other users of a node can
see abstract sockets, so three locks keep them out: the name is derived from the job's secret
and the server's rank (they cannot find it; a node's engines each have their own), the server checks the peer's uid (SO_PEERCRED), and both ends prove they
hold the secret before a single byte is unpickled (wire.py). The listener closes once the
engine's trainers are all connected: later connections are refused outright.

Request/response: each trainer `request()`s; the server `recv_any()`s and `reply()`s. The
server may also push with `send(rank, obj)` / `broadcast(obj)`; trainers `recv()` those.
"""

from __future__ import annotations

import hashlib
import os
import selectors
import socket
import struct
import time
from typing import Any, Iterable

from hpcrl.compute.launch import wire
from hpcrl.compute.launch.wire import AuthError, ChannelClosed

AUTH_TIMEOUT_S = 10.0


class PeerClosed(ChannelClosed):
    """A trainer closed its end of the channel (`rank` says which)."""

    def __init__(self, rank: int, detail: str = "closed the channel"):
        super().__init__(f"trainer rank {rank} {detail}")
        self.rank = rank


def socket_name(secret: bytes, server_rank: int) -> bytes:
    digest = hashlib.sha256(secret + b"/node-channel/%d" % server_rank).hexdigest()[:40]
    return b"\0hpcrl-" + digest.encode()


def _peer_uid(sock: socket.socket) -> int:
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          struct.calcsize("3i")))
    return uid


class NodeServerChannel:
    """The server's end: one connection per trainer it serves, keyed by global rank."""

    def __init__(self, secret: bytes, node: int, trainer_ranks: Iterable[int], server_rank: int):
        self.node = node
        self.server_rank = server_rank
        self.expected = tuple(sorted(trainer_ranks))
        self._secret = secret
        self._conns: dict[int, socket.socket] = {}
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(socket_name(secret, server_rank))
        self._listener.listen(len(self.expected) + 4)
        self.rejected: list[str] = []      # why strangers were turned away (for the log)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self._conns))

    def accept_all(self, timeout: float) -> None:
        """Wait until every trainer of the node is connected; TimeoutError names the missing."""
        deadline = time.monotonic() + timeout
        try:
            while len(self._conns) < len(self.expected):
                left = deadline - time.monotonic()
                if left <= 0 or not wire.wait_readable(self._listener, left):
                    missing = [r for r in self.expected if r not in self._conns]
                    raise TimeoutError(f"node {self.node}'s trainer(s) {', '.join(map(str, missing))} did not "
                                       f"connect to the channel of the server rank {self.server_rank} within {timeout:.0f} s "
                                       f"(launch.rendezvous_timeout_s)")
                conn, _ = self._listener.accept()
                self._admit(conn)
        finally:
            if len(self._conns) == len(self.expected):
                self._listener.close()      # nobody else may connect from now on

    def _admit(self, conn: socket.socket) -> None:
        try:
            if _peer_uid(conn) != os.getuid():
                raise AuthError(f"connection from uid {_peer_uid(conn)}")
            wire.authenticate_server_side(conn, self._secret, AUTH_TIMEOUT_S)
            hello = wire.recv_msg(conn, AUTH_TIMEOUT_S)
            rank = hello.get("rank") if isinstance(hello, dict) else None
            if rank not in self.expected or rank in self._conns:
                raise AuthError(f"unexpected hello {hello!r}")
        except (AuthError, ChannelClosed, TimeoutError, OSError) as e:
            self.rejected.append(str(e))
            conn.close()
            return
        wire.send_msg(conn, {"ok": True})
        self._conns[rank] = conn

    def poll(self, timeout: float | None = 0.0) -> list[int]:
        """Ranks with a message (or a close) waiting, after waiting up to `timeout` for one."""
        if not self._conns:
            return []
        with selectors.DefaultSelector() as sel:
            for rank, conn in self._conns.items():
                sel.register(conn, selectors.EVENT_READ, rank)
            return sorted(key.data for key, _ in sel.select(timeout))

    def recv_any(self, timeout: float | None = None) -> tuple[int, Any]:
        """(rank, message) from whichever trainer speaks first; TimeoutError if none does.
        A trainer that closed its end raises PeerClosed once (and is no longer polled)."""
        ready = self.poll(timeout)
        if not ready:
            raise TimeoutError(f"no trainer message within {timeout:.1f} s")
        rank = ready[0]
        return rank, self.recv_from(rank, timeout=0)

    def recv_from(self, rank: int, timeout: float | None = None) -> Any:
        try:
            return wire.recv_msg(self._conn(rank), timeout)
        except ChannelClosed:
            self._drop(rank)
            raise PeerClosed(rank) from None

    def reply(self, rank: int, obj: Any) -> None:
        self.send(rank, obj)

    def send(self, rank: int, obj: Any) -> None:
        try:
            wire.send_msg(self._conn(rank), obj)
        except ChannelClosed:
            # Not dropped here: what the trainer said before it closed (its goodbye) may still wait
            # to be read, and recv_from drops the connection once it has read to the end.
            raise PeerClosed(rank) from None

    def broadcast(self, obj: Any) -> None:
        for rank in self.ranks:
            self.send(rank, obj)

    def _conn(self, rank: int) -> socket.socket:
        try:
            return self._conns[rank]
        except KeyError:
            raise PeerClosed(rank, "is not connected") from None

    def _drop(self, rank: int) -> None:
        conn = self._conns.pop(rank, None)
        if conn is not None:
            conn.close()

    def close(self) -> None:
        for rank in list(self._conns):
            self._drop(rank)
        self._listener.close()


class NodeChannel:
    """A trainer's end: one connection to one engine of its node."""

    def __init__(self, sock: socket.socket, rank: int, server_rank: int):
        self._sock = sock
        self.rank = rank
        self.server_rank = server_rank

    @classmethod
    def connect(cls, secret: bytes, node: int, rank: int, server_rank: int, timeout: float) -> "NodeChannel":
        """Connect to the engine `server_rank` of this node, retrying while it is still starting up."""
        deadline, delay = time.monotonic() + timeout, 0.02
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(socket_name(secret, server_rank))
                wire.authenticate_client_side(sock, secret, AUTH_TIMEOUT_S)
                wire.send_msg(sock, {"rank": rank})
                wire.recv_msg(sock, AUTH_TIMEOUT_S)
                return cls(sock, rank, server_rank)
            except (FileNotFoundError, ConnectionRefusedError, ChannelClosed) as e:
                sock.close()
                if time.monotonic() + delay > deadline:
                    raise TimeoutError(f"rank {rank}: the server of node {node} (rank {server_rank}) did not "
                                       f"open its channel within {timeout:.0f} s (launch.rendezvous_timeout_s): "
                                       f"{e}") from None
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
            except BaseException:
                sock.close()
                raise

    def fileno(self) -> int:
        """Its socket's, so that a trainer can wait on several engines at once (selectors)."""
        return self._sock.fileno()

    def send(self, obj: Any) -> None:
        wire.send_msg(self._sock, obj)

    def recv(self, timeout: float | None = None) -> Any:
        return wire.recv_msg(self._sock, timeout)

    def request(self, obj: Any, timeout: float | None = None) -> Any:
        self.send(obj)
        return self.recv(timeout)

    def close(self) -> None:
        self._sock.close()
