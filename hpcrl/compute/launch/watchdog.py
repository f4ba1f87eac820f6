"""After the rendezvous, every wait on a peer is bounded: a rank that dies or stops answering
makes every other rank exit, with a message that names it. (Before it, the supervisor bounds
the rendezvous itself: supervisor.py.)

`Hub` + `Watchdog`: every rank (rank 0 included) keeps one authenticated TCP connection to a
hub thread in rank 0 and heartbeats over it. A process that dies closes its socket, so the hub
sees it within milliseconds; a node that vanishes is caught by missing heartbeats after
`peer_failure_timeout_s`. The hub tells everyone which rank is gone and every rank exits; if
rank 0 itself goes, every connection drops and the others exit naming it. A rank that fails
with an error says so first (`fail`), so the others can name the cause. The hub also carries
small broadcasts where there is no MPI (the SLURM_* fallback).

Launchers often act first (srun --kill-on-bad-exit, hydra's clean-up); this is what bounds the
cases they miss: hangs, lost nodes, a launcher told to keep going.
"""

from __future__ import annotations

import fcntl
import os
import selectors
import socket
import struct
import termios
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, NoReturn

from hpcrl.compute.launch import outcome, wire
from hpcrl.compute.launch.wire import AuthError, ChannelClosed

EXIT_PEER_FAILURE = 1
AUTH_TIMEOUT_S = 5.0
CALLBACK_BOUND_S = 5.0
DRAIN_BOUND_S = 1.0


@dataclass(frozen=True)
class Peer:
    rank: int
    node: int
    local_rank: int
    role: str
    host: str
    pid: int
    engine: int | None = None       # a server's engine index, named when its node has several

    @property
    def label(self) -> str:
        return self.role if self.engine is None else f"{self.role}, engine {self.engine}"

    def describe(self) -> str:
        return f"rank {self.rank} (node {self.node}, {self.label}, host {self.host}, pid {self.pid})"


def heartbeat_interval(peer_timeout_s: float) -> float:
    return max(0.05, min(5.0, peer_timeout_s / 4))


HUB_LOST_GRACE_S = 1.0


def die(who: str, reason: str, callbacks: list[Callable[[], None]] = ()) -> NoReturn:
    """Print one line and end the process now, from any thread. Callbacks (a server stopping its
    engine) get a bounded moment first; a stuck one cannot keep the process alive."""
    outcome.fatal(f"hpcrl: {who}: {reason}; exiting", summary=reason)
    if callbacks:
        threading.Timer(CALLBACK_BOUND_S, os._exit, (EXIT_PEER_FAILURE,)).start()
        for cb in callbacks:
            try:
                cb()
            except BaseException:
                pass
    os._exit(EXIT_PEER_FAILURE)


# ---------------------------------------------------------------------------- after the rendezvous
class Hub:
    """Rank 0's thread: registration, liveness of every rank, small broadcasts, and a row from
    each rank gathered to rank 0 (a probe's report)."""

    def __init__(self, secret: bytes, world_size: int, peer_timeout_s: float, bind_host: str):
        _allow_open_files(world_size + 256)
        self.world_size = world_size
        self.peer_timeout_s = peer_timeout_s
        self._secret = secret
        self._listener = socket.create_server((bind_host, 0), backlog=min(world_size + 8, 4096))
        self.address = (bind_host, self._listener.getsockname()[1])
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener, selectors.EVENT_READ, None)
        self._wake_r, self._wake_w = socket.socketpair()    # ends the select() at close
        self._sel.register(self._wake_r, selectors.EVENT_READ, None)
        self._rank_of: dict[socket.socket, int | None] = {}
        self._peers: dict[int, Peer] = {}
        self._conn: dict[int, socket.socket] = {}
        self._last_seen: dict[int, float] = {}
        self._done: set[int] = set()           # said goodbye
        self.failures: dict[int, str] = {}
        self._bcasts: dict[str, Any] = {}
        self._rows: dict[str, dict[int, Any]] = {}
        self._rows_arrived = threading.Condition()
        self._table_sent = False
        self._stop = threading.Event()
        self._idle = threading.Event()         # everyone said goodbye or is gone
        self._thread = threading.Thread(target=self._serve, name="hpcrl-hub", daemon=True)

    def start(self) -> "Hub":
        self._thread.start()
        return self

    def close(self, wait_s: float) -> dict[int, str]:
        """At the end: wait (bounded) for every rank's goodbye, then stop. Returns failures."""
        self._idle.wait(wait_s)
        unfinished = [r for r in range(self.world_size) if r not in self._done and r not in self.failures]
        for r in unfinished:
            self.failures[r] = f"did not finish within {wait_s:.0f} s of rank 0 (launch.collective_timeout_s)"
        self._stop.set()
        self._wake_w.send(b"x")
        self._thread.join(5.0)
        for conn in [*self._rank_of, self._listener, self._wake_r, self._wake_w]:
            conn.close()
        return dict(self.failures)

    # -- the thread
    def _serve(self) -> None:
        interval = heartbeat_interval(self.peer_timeout_s)
        next_beat = time.monotonic() + interval
        while not self._stop.is_set():
            for key, _ in self._sel.select(max(0.0, next_beat - time.monotonic())):
                if key.fileobj is self._wake_r:
                    return
                if key.fileobj is self._listener:
                    self._accept()
                else:
                    self._read(key.fileobj)
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + interval
                if self._table_sent:
                    self._beat(now)
            self._check_idle()

    def _accept(self) -> None:
        try:
            conn, _ = self._listener.accept()
        except OSError:
            return
        try:
            wire.authenticate_server_side(conn, self._secret, AUTH_TIMEOUT_S)
        except (AuthError, ChannelClosed, OSError):
            conn.close()                      # a stranger, or a port scanner: not our business
            return
        self._rank_of[conn] = None
        self._sel.register(conn, selectors.EVENT_READ, None)

    def _read(self, conn: socket.socket) -> None:
        rank = self._rank_of.get(conn)
        try:
            # The selector said it is readable: no timeout, so no select() inside, which refuses a
            # descriptor of 1024 or more (the hub holds one socket per rank, thousands at scale).
            msg = wire.recv_msg(conn, timeout=None)
        except (ChannelClosed, TimeoutError, OSError):
            self._forget(conn)
            if rank is not None and rank not in self._done:
                self._gone(rank, "its connection closed without a goodbye: the process died or was killed")
            return
        kind = msg.get("t")
        if kind == "register":
            self._register(conn, Peer(**msg["peer"]), msg["size"])
        elif rank is None:
            return
        elif kind == "hb":
            self._last_seen[rank] = time.monotonic()
        elif kind == "bye":
            self._done.add(rank)
        elif kind == "failed":
            self._gone(rank, f"failed: {msg['reason']}")
        elif kind == "bcast":
            self._bcasts[msg["key"]] = msg["value"]
            self._send_all({"t": "bcast", "key": msg["key"], "value": msg["value"]})
        elif kind == "row":
            with self._rows_arrived:
                self._rows.setdefault(msg["key"], {})[rank] = msg["value"]
                self._rows_arrived.notify_all()

    def wait_rows(self, key: str, timeout: float) -> dict[int, Any]:
        """Every rank's row under `key` (Watchdog.send_row), by rank, once all have arrived."""
        with self._rows_arrived:
            if not self._rows_arrived.wait_for(lambda: len(self._rows.get(key, {})) == self.world_size, timeout):
                missing = sorted(set(range(self.world_size)) - set(self._rows.get(key, {})))
                shown = ", ".join(map(str, missing[:8])) + (", ..." if len(missing) > 8 else "")
                raise TimeoutError(f"{len(missing)} rank(s) sent no {key} row within {timeout:.0f} s "
                                   f"(launch.collective_timeout_s): rank(s) {shown}")
            return dict(self._rows[key])

    def _register(self, conn: socket.socket, peer: Peer, size: int) -> None:
        problem = None
        if size != self.world_size:
            problem = f"{peer.describe()} was started in a world of {size} tasks, the plan has {self.world_size}"
        elif not 0 <= peer.rank < self.world_size:
            problem = f"{peer.describe()} is outside the plan's ranks 0..{self.world_size - 1}"
        elif peer.rank in self._peers:
            problem = (f"rank {peer.rank} registered twice: {self._peers[peer.rank].describe()} and "
                       f"{peer.describe()}")
        if problem:
            self._send_all({"t": "abort", "reason": problem}, also=[conn])
            return
        self._rank_of[conn] = peer.rank
        self._peers[peer.rank] = peer
        self._conn[peer.rank] = conn
        self._last_seen[peer.rank] = time.monotonic()
        if len(self._peers) == self.world_size:
            table = [asdict(self._peers[r]) for r in range(self.world_size)]
            # Rank 0 keeps the whole table (ranks.json); the others need only the hub's entry (a
            # death's message carries its peer): N tables of N peers were 2.2 GB at 8,192 ranks.
            self._send_one(self._conn[0], {"t": "table", "peers": table})
            self._send_all({"t": "table", "peers": table[:1]}, exclude={0})
            for key, value in self._bcasts.items():
                self._send_all({"t": "bcast", "key": key, "value": value})
            self._table_sent = True
            # Ranks heartbeat once they hold the table: the wait for the last registration (long
            # when thousands arrive) is no silence of theirs.
            now = time.monotonic()
            self._last_seen = dict.fromkeys(self._last_seen, now)

    def _beat(self, now: float) -> None:
        self._send_all({"t": "hb"})
        for rank, seen in list(self._last_seen.items()):
            if rank not in self._done and now - seen > self.peer_timeout_s:
                self._gone(rank, f"sent no heartbeat for {now - seen:.0f} s (its node is down, or it is stuck; "
                                 f"launch.peer_failure_timeout_s={self.peer_timeout_s:g})")

    def _gone(self, rank: int, reason: str) -> None:
        if rank in self.failures:
            return
        self.failures[rank] = reason
        self._last_seen.pop(rank, None)
        peer = self._peers.get(rank)
        msg = {"t": "gone", "peer": asdict(peer) if peer else {"rank": rank}, "reason": reason}
        # The rank in this very process dies on the verdict, and its exit resets every socket
        # with unsent bytes: tell the others first, let the kernel hand their copies over, then it.
        home = [r for r, p in self._peers.items() if p.pid == os.getpid() and p.host == socket.gethostname()]
        self._send_all(msg, exclude={rank, *home})
        self._drain(DRAIN_BOUND_S)
        for r in home:
            if r != rank and r in self._conn:
                self._send_one(self._conn[r], msg)

    def _send_all(self, msg: dict, also: list[socket.socket] = (), exclude: set[int] = frozenset()) -> None:
        frame = _Frame(msg)             # pickled once, not once per rank
        for conn in [*(c for r, c in self._conn.items() if r not in exclude), *also]:
            self._send_one(conn, frame)

    @staticmethod
    def _send_one(conn: socket.socket, msg: "dict | _Frame") -> None:
        try:
            if isinstance(msg, _Frame):
                conn.sendall(msg.data)
            else:
                wire.send_msg(conn, msg)
        except (ChannelClosed, OSError):
            pass

    def _drain(self, bound_s: float) -> None:
        """Wait (bounded) until the kernel has sent every byte queued on the ranks' sockets."""
        deadline = time.monotonic() + bound_s
        while time.monotonic() < deadline:
            try:
                if all(_unsent_bytes(c) == 0 for c in self._conn.values()):
                    return
            except OSError:
                return
            time.sleep(0.01)

    def _forget(self, conn: socket.socket) -> None:
        rank = self._rank_of.pop(conn, None)
        if rank is not None and self._conn.get(rank) is conn:
            del self._conn[rank]
        try:
            self._sel.unregister(conn)
        except (KeyError, ValueError):
            pass
        conn.close()

    def _check_idle(self) -> None:
        if self._table_sent and all(r in self._done or r in self.failures for r in range(self.world_size)):
            self._idle.set()


class _Frame:
    """A message framed once (wire.send_msg writing into this object), to send as is to many
    sockets. Per-rank pickling made the table's broadcast grow as N^2: 10 s of the hub's time at
    8,192 ranks (1.3 ms to pickle a table of 8,192 peers, once per rank)."""

    def __init__(self, msg: dict):
        self._parts: list[bytes] = []
        wire.send_msg(self, msg)
        self.data = b"".join(self._parts)

    def sendall(self, data) -> None:
        self._parts.append(bytes(data))


def _unsent_bytes(conn: socket.socket) -> int:
    return struct.unpack("i", fcntl.ioctl(conn.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]


def _allow_open_files(needed: int) -> None:
    """The hub holds one socket per rank: thousands at scale, over the usual soft limit of 1024."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise OSError(f"rank 0 may open only {hard} files (ulimit -Hn) but its watchdog hub needs one "
                          f"socket per rank ({needed})")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))


def _verdict(peer: dict, reason: str) -> str:
    """What every rank says of a peer that is gone (the peer as the hub sends it: a whole Peer, or
    only its rank): "rank 3 (node 1, server, host h, pid 9) failed: ..." where it said why."""
    name = Peer(**peer).describe() if len(peer) > 1 else f"rank {peer['rank']}"
    return f"{name} {reason}" if reason.startswith("failed: ") else f"{name} is gone: {reason}"


class _Stopped(Exception):
    """Ends the watchdog thread after a verdict handler that returned (tests)."""


class Watchdog:
    """A rank's link to the hub: registration, heartbeats, and the verdict when a peer is gone.
    A verdict ends the process (`die`), or goes to `on_fatal(who, reason)` where one is given."""

    def __init__(self, me: Peer, secret: bytes, peer_timeout_s: float,
                 on_fatal: Callable[[str, str], None] | None = None):
        self.me = me
        self._on_fatal = on_fatal
        self.peer_timeout_s = peer_timeout_s
        self._secret = secret
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._cond = threading.Condition()
        self._bcasts: dict[str, Any] = {}
        self._closing = False
        self._callbacks: list[Callable[[], None]] = []
        self.peers: list[Peer] = []
        self.hub_peer: Peer | None = None

    @property
    def who(self) -> str:
        return f"rank {self.me.rank} (node {self.me.node}, {self.me.label})"

    def connect(self, address: tuple[str, int], world_size: int, timeout: float) -> list[Peer]:
        """Register with the hub and wait until every rank has: returns the table of all ranks."""
        deadline = time.monotonic() + timeout
        delay = 0.05
        while True:
            try:
                sock = socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic()))
                break
            except OSError as e:
                if time.monotonic() + delay > deadline:
                    raise TimeoutError(f"cannot reach the watchdog hub of rank 0 at {address[0]}:{address[1]} "
                                       f"within {timeout:.0f} s (launch.rendezvous_timeout_s): {e}") from None
                time.sleep(delay)
                delay = min(delay * 2, 1.0)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # The hub authenticates one connection at a time: when thousands of ranks arrive together
        # on busy nodes, the last ones wait their turn for seconds (1,024 ranks played by threads
        # of two processes here: 13 waited more than 5 s), so the wait for its greeting is bounded
        # by the rendezvous deadline, not by AUTH_TIMEOUT_S.
        wire.authenticate_client_side(sock, self._secret, max(AUTH_TIMEOUT_S, deadline - time.monotonic()))
        self._sock = sock
        self._send({"t": "register", "peer": asdict(self.me), "size": world_size})
        while not self.peers:
            try:
                msg = wire.recv_msg(sock, max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise TimeoutError(f"not every rank registered with the watchdog hub within {timeout:.0f} s "
                                   f"(launch.rendezvous_timeout_s)") from None
            self._handle(msg)
        self.hub_peer = self.peers[0]
        threading.Thread(target=self._watch, name="hpcrl-watchdog", daemon=True).start()
        return self.peers

    def on_failure(self, callback: Callable[[], None]) -> None:
        """Run `callback` (bounded) before this process exits because a peer is gone."""
        self._callbacks.append(callback)

    def bcast(self, key: str, value: Any) -> None:
        self._send({"t": "bcast", "key": key, "value": value})

    def send_row(self, key: str, value: Any) -> None:
        """This rank's row under `key`, for rank 0's Hub.wait_rows."""
        self._send({"t": "row", "key": key, "value": value})

    def wait_bcast(self, key: str, timeout: float) -> Any:
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._bcasts, timeout):
                raise TimeoutError(f"rank 0 did not send {key!r} within {timeout:.0f} s (launch.rendezvous_timeout_s)")
            return self._bcasts[key]

    def fail(self, reason: str, grace_s: float = 1.0) -> None:
        """Tell every rank that this one failed. An error here is often the echo of a peer's death
        (a collective broke): wait a moment for the hub's verdict, which names the real cause."""
        time.sleep(grace_s)
        try:
            self._send({"t": "failed", "reason": reason})
        except (ChannelClosed, OSError):
            pass
        # Kept here as well, in the words the hub's verdict uses: once this task exits (non-zero)
        # the launcher may kill the others, rank 0 and its hub among them, before any of them has
        # written the verdict (a loaded machine: `hpcrl run` ended with no reason at all).
        outcome.keep(_verdict(asdict(self.me), f"failed: {reason}"))

    def close(self) -> None:
        """Say goodbye: from now on the end of the hub's connection is no failure."""
        self._closing = True
        try:
            self._send({"t": "bye"})
        except (ChannelClosed, OSError):
            pass

    def _send(self, msg: dict) -> None:
        with self._send_lock:
            wire.send_msg(self._sock, msg)

    def _handle(self, msg: dict) -> None:
        kind = msg.get("t")
        if kind == "table":
            self.peers = [Peer(**p) for p in msg["peers"]]
        elif kind == "bcast":
            with self._cond:
                self._bcasts[msg["key"]] = msg["value"]
                self._cond.notify_all()
        elif kind == "abort":
            self._fatal(f"the rendezvous failed: {msg['reason']}")
        elif kind == "gone" and not self._closing:
            self._fatal(_verdict(msg["peer"], msg["reason"]))

    def _fatal(self, reason: str) -> None:
        if self._on_fatal is None:
            die(self.who, reason, self._callbacks)
        self._on_fatal(self.who, reason)
        raise _Stopped

    def _watch(self) -> None:
        try:
            self._watch_hub()
        except _Stopped:
            pass

    def _watch_hub(self) -> None:
        interval = heartbeat_interval(self.peer_timeout_s)
        last_heard = last_sent = time.monotonic()
        hub = self.hub_peer.describe() if self.hub_peer else "rank 0"
        while True:
            try:
                msg = wire.recv_msg(self._sock, max(0.0, last_sent + interval - time.monotonic()))
                last_heard = time.monotonic()
                self._handle(msg)
            except TimeoutError:
                pass
            except (ChannelClosed, OSError):
                if self._closing:
                    return
                # Rank 0's own supervisor names how it died ("killed by SIGKILL"): a moment for its
                # line to be the job's reason (the first one written wins) before this echo of it.
                time.sleep(HUB_LOST_GRACE_S)
                self._fatal(f"lost the watchdog hub on {hub}: its connection closed, so rank 0 died or was killed")
            now = time.monotonic()
            if now - last_heard > self.peer_timeout_s and not self._closing:
                self._fatal(f"{hub}, which runs the job's watchdog, sent nothing for {now - last_heard:.0f} s "
                            f"(its node is down, or it is stuck; launch.peer_failure_timeout_s={self.peer_timeout_s:g})")
            if now - last_sent >= interval:
                last_sent = now
                try:
                    self._send({"t": "hb"})
                except (ChannelClosed, OSError):
                    pass                      # the read side reports it
