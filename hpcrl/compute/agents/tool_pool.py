"""The agent's tools, run in a pool of worker processes on the trainer's node.

TRL's GRPOTrainer (1.16) calls ``tools=`` and the methods of ``environment_factory=`` instances in
the trainer process; here they run in ``workers`` processes (hpcrl.compute.agents.tool_worker,
multiprocessing's "spawn": the trainer runs torch's threads, so fork is unsafe), so that a tool that
hangs or crashes costs one rollout's call, not the run:

- each call is bounded by ``timeout_s`` (the recipe's agent.tool_timeout_s): past it the worker is
  killed and replaced, and the model reads ``{"error": "tool 'NAME' did not return within T s
  (agent.tool_timeout_s)"}``; a worker that dies mid-call (os._exit, a segfault) likewise;
- every other failure is TRL's: ``{"error": str(e)}``, and ``"Tool NAME not found."``;
- a rollout's environment instance lives in one worker (the one with the fewest open sessions when
  it was opened); when that worker is replaced the instance is lost, and the rollout's later calls
  say so. Instances are pooled per worker and reused across rollouts (TRL: construct once, reset often).

Each worker has one thread here (a one-thread executor) that alone talks to it, so a session's
requests keep their order and the sessions of different workers run in parallel. The workers start
when the pool is made (about 0.5 s for four on two cores), which is also when a tool or factory that
cannot be imported raises ValueError.

call_many() answers in the calls' order; TRL's message order puts a turn's awaited (async) calls
after the others: sort the results stably by ``ToolResult.awaited`` to get it.

"spawn" re-imports the parent's ``__main__`` in each worker unless it is a package's ``__main__``
(as ``python -m hpcrl.compute.launch`` is): a trainer started as a script would run that script's
imports in every worker.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import itertools
import multiprocessing
import multiprocessing.connection
import os
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcrl.compute.agents import tool_worker

__all__ = ["ToolResult", "Session", "ToolPool"]

# A worker cancels an awaited call itself at timeout_s; this is how much longer the parent waits
# before it kills a worker whose event loop is blocked. Also the allowance for the worker's own
# bookkeeping between calls (pickling a result, making coroutines).
GRACE_S = 1.0
STOP_WAIT_S = 2.0      # close(): how long workers get to end by themselves before they are killed
KILL_WAIT_S = 5.0      # a killed process is reaped within this (else it is left, and said so)

WORKER_ENDED = "tool '{name}' ended its worker process (exit code {code})"


@dataclass(frozen=True)
class ToolResult:
    name: str           # the tool's name as called
    content: Any        # what the tool returned, or {"error": "..."} on failure
    failed: bool
    seconds: float
    awaited: bool = False   # run as a coroutine: TRL lists these after the turn's other results


@dataclass(eq=False)
class Session:
    """One rollout's tools: its environment instance (if any) in worker ``worker``."""
    id: int
    environment: str | None     # the name it was opened with (None: the one environment, or none)
    worker: int
    has_instance: bool          # False: standalone tools only (no environment factories)
    observation: Any = None     # what reset() returned: None, a str or a list
    generation: int = 0         # the worker's generation at open: a later one means the instance was lost
    closed: bool = False
    loss_logged: bool = False


class _Late(Exception):
    """A worker did not answer in time."""


class _Gone(Exception):
    """A worker process ended."""

    def __init__(self, code):
        super().__init__(code)
        self.code = code


class _Replaced(Exception):
    """A request's worker was replaced; ``reason`` says why."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class _Slot:
    """One worker process, its replacements, and the one thread that talks to it."""

    def __init__(self, index: int, context, args: tuple, log: Callable[[str], None]):
        self.index, self.context, self.args, self.log = index, context, args, log
        self.executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"hpcrl-tool-worker-{index}")
        # Held by the executor's thread around each request; close() takes it to send "stop" safely.
        self.lock = threading.Lock()
        self.process = None
        self.conn = None
        self.ready = False
        self.generation = 0                         # how many times this worker was replaced
        self.replaced_after: dict[int, str] = {}    # generation -> why the one before it was replaced
        self.open_sessions = 0
        self.closed = False

    def start(self) -> None:
        parent_end, child_end = self.context.Pipe()
        process = self.context.Process(target=tool_worker.main, args=(child_end, *self.args),
                                       name=f"hpcrl-tool-worker-{self.index}")
        process.start()
        child_end.close()       # the worker holds the only other end now: its death reads as EOF here
        self.process, self.conn, self.ready = process, parent_end, False

    def ensure_ready(self, start_timeout_s: float) -> None:
        """Wait (bounded) for a started worker's "ready"; its import error raises ValueError."""
        if self.closed:
            raise RuntimeError("the tool pool is closed")
        if self.process is None:
            self.start()
        if self.ready:
            return
        try:
            _, error = self.receive(time.monotonic() + start_timeout_s)
        except _Gone as e:
            self.kill()
            raise RuntimeError(f"tool worker {self.index} ended while starting (exit code {e.code})") from None
        except _Late:
            self.kill()
            raise RuntimeError(f"tool worker {self.index} did not start within {start_timeout_s:g} s") from None
        if error is not None:
            self.kill()
            raise ValueError(error)
        self.ready = True

    def send(self, message) -> None:
        try:
            self.conn.send(message)
        except (BrokenPipeError, ConnectionResetError, EOFError):
            raise _Gone(self.exit_code()) from None

    def receive(self, deadline: float):
        """The worker's next message, waiting until ``deadline`` (time.monotonic()) at most."""
        conn, process = self.conn, self.process
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _Late()
            try:
                ready = multiprocessing.connection.wait([conn, process.sentinel], remaining)
                if conn in ready or conn.poll():
                    return conn.recv()
            except (EOFError, OSError):
                raise _Gone(self.exit_code()) from None
            if process.sentinel in ready:
                raise _Gone(self.exit_code())

    def exit_code(self):
        process = self.process
        if process is None:
            return None
        process.join(1.0)      # EOF comes just before the exit; give it that moment
        return process.exitcode if process.exitcode is not None else "none: still running"

    def kill(self, close_conn: bool = True) -> None:
        process = self.process
        if process is not None and process.exitcode is None:
            process.kill()
            process.join(KILL_WAIT_S)
            if process.exitcode is None:
                self.log(f"hpcrl tool pool: worker {self.index} (pid {process.pid}) did not end when killed")
        if close_conn:
            if self.conn is not None:
                self.conn.close()
            self.process, self.conn, self.ready = None, None, False

    def replace(self, reason: str) -> None:
        """Kill the worker and start another now (its "ready" is read by the next request)."""
        self.kill()
        self.generation += 1
        self.replaced_after[self.generation] = reason
        if not self.closed:     # when closed, the kill was close()'s own
            self.log(f"hpcrl tool pool: worker {self.index} replaced after {reason}")
            self.start()

    def request(self, message, what: str, limit_s: float):
        """One request and its ("ok", value) reply; an ("error", text) reply raises RuntimeError(text).
        Past ``limit_s``, or when the worker ends, it is replaced and _Replaced raised."""
        try:
            self.send(message)
            status, value = self.receive(time.monotonic() + limit_s)
        except _Late:
            reason = f"{what} did not return within {limit_s:g} s (agent.tool_timeout_s)"
            self.replace(reason)
            raise _Replaced(reason) from None
        except _Gone as e:
            reason = f"{what} ended its worker process (exit code {e.code})"
            self.replace(reason)
            raise _Replaced(reason) from None
        if status != "ok":
            raise RuntimeError(value)
        return value


def _shutdown(slots: list[_Slot]) -> None:
    """End every worker: "stop", a bounded wait, then kill. Queued requests are cancelled."""
    for slot in slots:
        slot.closed = True
        slot.executor.shutdown(wait=False, cancel_futures=True)
    idle = []
    for slot in slots:
        # A slot busy with a request is not waited for: its worker is killed below and the request
        # ends with an error, in its own thread, which then closes its pipe.
        if slot.lock.acquire(timeout=0.05):
            idle.append(slot)
            try:
                if slot.conn is not None:
                    slot.conn.send(("stop",))
            except (OSError, EOFError):
                pass
    deadline = time.monotonic() + STOP_WAIT_S
    for process in [slot.process for slot in slots]:   # read once: a busy slot's thread may reset it
        if process is not None:
            process.join(max(0.0, deadline - time.monotonic()))
    for slot in slots:
        slot.kill(close_conn=slot in idle)
    for slot in idle:
        slot.lock.release()


def _load(payload: bytes, name: str) -> tuple[Any, bool]:
    try:
        return pickle.loads(payload), False
    except Exception as e:
        return {"error": f"tool '{name}' returned a value the trainer cannot read ({tool_worker.one_line(e)})"}, True


class ToolPool:
    """Standalone ``tools`` (import paths "package.module:function" or "package.module.function")
    and ``environment_factories`` (None; {None: path} for one environment; {name: path} for TRL's
    dict form, chosen per row by its ``environment`` column), run in ``workers`` processes, each
    call bounded by ``timeout_s``. ``module_dir`` goes first on the workers' sys.path."""

    def __init__(self, tools: Sequence[str], environment_factories: Mapping[str | None, str] | None = None, *,
                 workers: int = 4, timeout_s: float = 60.0, module_dir: str | Path | None = None,
                 log: Callable[[str], None] = print, start_timeout_s: float = 60.0):
        if isinstance(tools, str) or not all(isinstance(t, str) for t in tools):
            raise ValueError(f"agent tools must be a list of import paths, got {tools!r}")
        if environment_factories is not None and (
                not isinstance(environment_factories, Mapping) or not environment_factories
                or not all(isinstance(p, str) for p in environment_factories.values())):
            raise ValueError("agent environment factories must be {None: import path} or {name: import path}, "
                             f"got {environment_factories!r}")
        if workers < 1 or timeout_s <= 0:
            raise ValueError(f"a tool pool needs workers >= 1 and timeout_s > 0 (got {workers}, {timeout_s})")
        self.tools = list(tools)
        self.factories = dict(environment_factories) if environment_factories is not None else None
        self.timeout_s, self.start_timeout_s, self.log = float(timeout_s), float(start_timeout_s), log
        directory = str(module_dir) if module_dir is not None and os.path.isdir(module_dir) else None
        args = (self.tools, self.factories or {}, directory, self.timeout_s)
        context = multiprocessing.get_context("spawn")
        self._slots = [_Slot(i, context, args, log) for i in range(workers)]
        self._lock = threading.Lock()       # session counts, probes, closing
        self._ids = itertools.count()
        self._probes: dict[Any, concurrent.futures.Future] = {}
        self._closed = False
        self._finalizer = weakref.finalize(self, _shutdown, self._slots)
        for slot in self._slots:
            slot.start()
        # Registered after the workers started, so after multiprocessing's own exit hook, and run
        # before it (atexit is last in, first out): that hook joins non-daemon children, and would
        # wait forever on workers nobody told to stop. (Not daemon processes: a tool may start its own.)
        atexit.register(self._finalizer)
        deadline = time.monotonic() + self.start_timeout_s
        try:
            for slot in self._slots:
                slot.ensure_ready(max(0.0, deadline - time.monotonic()))
        except BaseException:
            self.close()
            raise

    # -- what the tools are --------------------------------------------------------------------

    @property
    def has_environments(self) -> bool:
        return self.factories is not None

    @property
    def replacements(self) -> int:
        """How many workers were replaced (timeouts and crashes) so far."""
        return sum(slot.generation for slot in self._slots)

    @property
    def worker_pids(self) -> list[int | None]:
        return [slot.process.pid if slot.process is not None else None for slot in self._slots]

    def schemas(self, environment: str | None = None) -> list[dict]:
        """The tools' JSON schemas (transformers.utils.get_json_schema): the standalone tools, then
        the environment's public methods, in TRL's order."""
        return list(self._info(environment)["schemas"])

    def tool_names(self, environment: str | None = None) -> list[str]:
        return list(self._info(environment)["names"])

    def has_reward(self, environment: str | None = None) -> bool:
        """Whether the environment's class defines get_reward (TRL then adds it as a reward)."""
        return self.has_environments and self._info(environment)["has_reward"]

    def environment_class_name(self, environment: str | None = None) -> str:
        """type(instance).__name__: TRL's name for the environment's reward."""
        if not self.has_environments:
            raise ValueError("this tool pool has no environment factories")
        return self._info(environment)["class_name"]

    def _key(self, environment):
        if self.factories is None:
            if environment is not None:
                raise ValueError(f"environment {environment!r} asked for, but there is no environment_factory")
            return None
        if environment not in self.factories:
            raise ValueError(f"Example has `environment={environment!r}`, which is not among the environments "
                             f"passed to `environment_factory`. Expected one of: {list(self.factories)}.")
        return environment

    def _info(self, environment) -> dict:
        """The probe of one environment, made once (in the least busy worker) and cached."""
        key = self._key(environment)
        with self._lock:
            future = self._probes.get(key)
            if future is None:
                slot = self._least_busy()
                future = self._probes[key] = self._submit(slot, self._probe_on, slot, key)
        return future.result()

    def _probe_on(self, slot: _Slot, key) -> dict:
        what = (f"the probe of agent environment factory {self.factories[key]!r}" if self.has_environments
                else "the probe of the agent tools")
        with slot.lock:
            try:
                slot.ensure_ready(self.start_timeout_s)
                # It may import transformers.utils (about 0.6 s) besides running the factory.
                return slot.request(("probe", key, self.has_environments), what, self.timeout_s + self.start_timeout_s)
            except (RuntimeError, _Replaced) as e:
                raise ValueError(str(e)) from None

    # -- sessions ------------------------------------------------------------------------------

    def open(self, environment: str | None = None, reset_kwargs: dict | None = None) -> Session:
        """A rollout's session: an environment instance, reset(**reset_kwargs), in the least busy
        worker; ``Session.observation`` is what reset returned. Without environment factories: the
        standalone tools only, no reset."""
        return self.submit_open(environment, reset_kwargs).result()

    def submit_open(self, environment: str | None = None,
                    reset_kwargs: dict | None = None) -> concurrent.futures.Future[Session]:
        """open() without waiting: the resets of different workers run in parallel."""
        key = self._key(environment)
        if self.has_environments:
            self._info(environment)     # TRL validates an environment (reset defined) before it is used
        with self._lock:
            if self._closed:
                raise RuntimeError("the tool pool is closed")
            slot = self._least_busy()
            slot.open_sessions += 1
            session = Session(next(self._ids), environment, slot.index, has_instance=self.has_environments)
        try:
            return self._submit(slot, self._open_on, slot, session, key, dict(reset_kwargs or {}))
        except BaseException:
            self._forget(session)
            raise

    def _open_on(self, slot: _Slot, session: Session, key, reset_kwargs: dict) -> Session:
        try:
            with slot.lock:
                slot.ensure_ready(self.start_timeout_s)
                session.generation = slot.generation
                if session.has_instance:
                    what = f"{self._class_name(session)}.reset()"
                    try:
                        payload = slot.request(("open", session.id, key, reset_kwargs), what, self.timeout_s)
                    except _Replaced as e:
                        raise RuntimeError(e.reason) from None
                    session.observation, failed = _load(payload, "reset")
                    if failed:
                        raise RuntimeError(f"{what}: {session.observation['error']}")
        except BaseException:
            self._forget(session)
            raise
        return session

    def close_session(self, session: Session) -> None:
        """The session's instance goes back to its worker's pool (without waiting)."""
        if not self._forget(session) or not session.has_instance:
            return
        slot = self._slots[session.worker]
        try:
            self._submit(slot, self._release_on, slot, session)
        except RuntimeError:
            pass        # the pool closed meanwhile: nothing to give back to

    def _forget(self, session: Session) -> bool:
        with self._lock:
            if session.closed:
                return False
            session.closed = True
            self._slots[session.worker].open_sessions -= 1
            return True

    def _release_on(self, slot: _Slot, session: Session) -> None:
        with slot.lock:
            if slot.closed or self._lost(session, slot) is not None or not slot.ready:
                return
            try:
                slot.request(("release", session.id), "the release of an environment", GRACE_S + self.timeout_s)
            except _Replaced:
                pass        # logged by the replacement; the instance went with the worker

    def _class_name(self, session: Session) -> str:
        # Probed before the session was opened: read from the cache, never probed from a worker's
        # own thread (that would wait on itself).
        return self._probes[session.environment].result()["class_name"]

    def _lost(self, session: Session, slot: _Slot) -> str | None:
        if not session.has_instance or session.generation == slot.generation:
            return None
        return ("the environment was lost: its worker process was replaced after "
                + slot.replaced_after[session.generation + 1])

    # -- calls ---------------------------------------------------------------------------------

    def call_many(self, session: Session, calls: Sequence[tuple[str, dict]]) -> list[ToolResult]:
        """The tool calls of one assistant turn, for one rollout: a ToolResult per call, in the
        calls' order (TRL lists the awaited ones last: sort by ``awaited`` for its order)."""
        return self.submit_many(session, calls).result()

    def submit_many(self, session: Session,
                    calls: Sequence[tuple[str, dict]]) -> concurrent.futures.Future[list[ToolResult]]:
        """call_many() without waiting: the turns of sessions in different workers run in parallel."""
        if session.closed:
            raise ValueError(f"session {session.id} is closed")
        calls = [(str(name), arguments) for name, arguments in calls]
        slot = self._slots[session.worker]
        return self._submit(slot, self._turn, slot, session, calls)

    def _turn(self, slot: _Slot, session: Session, calls: list) -> list[ToolResult]:
        results: list[ToolResult | None] = [None] * len(calls)
        retry = True
        with slot.lock:
            while None in results:
                lost = self._lost(session, slot)
                if lost is not None:
                    for i, (name, _) in enumerate(calls):
                        results[i] = results[i] or ToolResult(name, {"error": lost}, True, 0.0)
                    break
                slot.ensure_ready(self.start_timeout_s)
                # Calls not reached when a worker was replaced run again in the next one (they
                # are standalone tools: a session with an instance is lost, above).
                self._run_calls(slot, session, calls, results, retry)
                retry = False
        return results

    def _run_calls(self, slot: _Slot, session: Session, calls: list, results: list, retry: bool) -> None:
        """Send the calls still without a result; fill in what comes back. ``retry``: a worker that
        ended or stalled before running any of them (it died idle, say) is replaced and the calls
        left for the next round, once."""
        pending = [(i, name, arguments) for i, (name, arguments) in enumerate(calls) if results[i] is None]
        running: list[int] = []
        awaited = False
        since, limit = time.monotonic(), self.timeout_s + GRACE_S
        try:
            slot.send(("calls", session.id if session.has_instance else None, session.environment, pending))
            while True:
                message = slot.receive(since + limit)
                if message[0] == "done":
                    for i, name, _ in pending:      # the worker answers every call; be sure of it
                        if results[i] is None:
                            results[i] = ToolResult(name, {"error": f"tool '{name}' got no result"}, True, 0.0)
                    return
                if message[0] == "start":
                    running, awaited = list(message[1]), message[2]
                    since, limit = time.monotonic(), self.timeout_s + (GRACE_S if awaited else 0.0)
                elif message[0] == "result":
                    _, i, name, failed, seconds, was_awaited, payload = message
                    content, unreadable = _load(payload, name)
                    results[i] = ToolResult(name, content, failed or unreadable, seconds, was_awaited)
                    if i in running:
                        running.remove(i)
                    if not running:
                        since, limit = time.monotonic(), self.timeout_s + GRACE_S
        except (_Late, _Gone) as e:
            seconds = time.monotonic() - since
            if isinstance(e, _Late):
                texts = {i: tool_worker.TIMEOUT.format(name=calls[i][0], seconds=self.timeout_s) for i in running}
            else:
                texts = {i: WORKER_ENDED.format(name=calls[i][0], code=e.code) for i in running}
            reason = next(iter(texts.values()), "")
            if not running:
                # Nothing of the user's was running (a worker that died idle, or stalled pickling a
                # result): once, the calls go to a new worker; then the rest of the turn fails here
                # rather than looping on a worker that keeps ending.
                why = "did not answer" if isinstance(e, _Late) else f"ended (exit code {e.code})"
                reason = f"the tool worker {why} between calls"
                if retry and all(results[i] is None for i, _, _ in pending):
                    slot.replace(reason)
                    return
                texts = {i: f"tool '{name}' was not run: its worker {why} between calls" for i, name, _ in pending
                         if results[i] is None}
            slot.replace(reason)
            for i, text in texts.items():
                results[i] = ToolResult(calls[i][0], {"error": text}, True, seconds if running else 0.0,
                                        awaited=awaited and bool(running))

    # -- rewards -------------------------------------------------------------------------------

    def reward(self, session: Session) -> float | None:
        """environment.get_reward() (sync or async) in its worker; None where the session has no
        instance or lost it (logged once). A failure raises RuntimeError naming the class."""
        return self.submit_reward(session).result()

    def submit_reward(self, session: Session) -> concurrent.futures.Future[float | None]:
        if session.closed:
            raise ValueError(f"session {session.id} is closed: its instance may serve another rollout")
        slot = self._slots[session.worker]
        return self._submit(slot, self._reward_on, slot, session)

    def _reward_on(self, slot: _Slot, session: Session) -> float | None:
        # TRL scores a rollout by get_reward only where its environment's class defines it (else None).
        if not session.has_instance or not self._probes[session.environment].result()["has_reward"]:
            return None
        what = f"{self._class_name(session)}.get_reward()"
        with slot.lock:
            lost = self._lost(session, slot)
            if lost is not None:
                if not session.loss_logged:
                    session.loss_logged = True
                    self.log(f"hpcrl tool pool: no {what} for session {session.id}: {lost}")
                return None
            slot.ensure_ready(self.start_timeout_s)
            try:
                return slot.request(("reward", session.id), what, self.timeout_s)
            except _Replaced as e:
                raise RuntimeError(e.reason) from None

    # -- the pool ------------------------------------------------------------------------------

    def _least_busy(self) -> _Slot:
        return min(self._slots, key=lambda slot: slot.open_sessions)

    def _submit(self, slot: _Slot, fn, *args) -> concurrent.futures.Future:
        if self._closed:
            raise RuntimeError("the tool pool is closed")
        return slot.executor.submit(fn, *args)

    def close(self) -> None:
        """End every worker (bounded: a stop, a wait of a few seconds, then kill)."""
        with self._lock:
            self._closed = True
        self._finalizer()
        atexit.unregister(self._finalizer)

    def __enter__(self) -> "ToolPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
