"""The code that runs inside one tool worker process of hpcrl.compute.agents.tool_pool.ToolPool.

The process is started with multiprocessing's "spawn" context and imports only the standard
library and the user's modules (never torch: it must start in a fraction of a second, and a tool
must not pay for the trainer's libraries). transformers.utils.get_json_schema is imported only when
this worker is the one asked for an environment's schemas (about 0.6 s, once), and is kept from
importing torch (json_schema_function).

The protocol, over one duplex multiprocessing Pipe, one request at a time:

    -> ("probe", env_key, with_env)          <- ("ok", info) | ("error", text)
    -> ("open", sid, env_key, reset_kwargs)  <- ("ok", pickled observation) | ("error", text)
    -> ("calls", sid, env_key, [(i, name, arguments), ...])
         <- ("start", [i, ...], awaited)  before a sync call, or before the turn's awaited calls together
         <- ("result", i, name, failed, seconds, awaited, pickled content)  as each call ends
         <- ("done",)
    -> ("reward", sid)                       <- ("ok", float | None) | ("error", text)
    -> ("release", sid)                      <- ("ok", None)
    -> ("stop",)                             the process returns

and first, unasked, ("ready", None) or ("ready", "one line naming the import path and the error").
The parent bounds every wait; a call past its time is ended by killing this process.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import io
import multiprocessing
import os
import pickle
import signal
import sys
import threading
import time
from typing import Any

NOT_FOUND = "Tool {name} not found."                  # TRL's text for a name no tool has
TIMEOUT = "tool '{name}' did not return within {seconds:g} s (agent.tool_timeout_s)"


def resolve(path: str) -> Any:
    """``"package.module:attr"`` or ``"package.module.attr"`` (``"module:Class.attr"`` too) -> the object."""
    if ":" in path:
        module_name, _, attr = path.partition(":")
    else:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise ImportError("not of the form 'package.module:function'")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"{type(obj).__name__} is not callable")
    return obj


def one_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}".replace("\n", " ")


def json_schema_function():
    """transformers.utils.get_json_schema, imported here, not at start (about 0.6 s; most workers never
    need it), and kept from importing torch."""
    from transformers.utils import chat_template_utils

    # get_json_schema imports torch (a second or more, and the rule is: no torch in a worker) on
    # every call, only to map a torch.Tensor annotation. A tool annotated with torch.Tensor comes
    # from a module that imported torch itself, so asking sys.modules gives the same schemas.
    if hasattr(chat_template_utils, "is_torch_available"):
        chat_template_utils.is_torch_available = lambda: "torch" in sys.modules
    return chat_template_utils.get_json_schema


class _Portable(pickle.Pickler):
    """A pickler that refuses the user's own classes and functions: the trainer process does not
    have the user's modules on its path (and must not run their import-time code), so such a
    value is sent as its str() instead, which is what TRL puts in the tool message anyway."""

    def __init__(self, file, is_user_module):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.is_user_module = is_user_module

    def reducer_override(self, obj):
        by_reference = isinstance(obj, type) or inspect.isroutine(obj)    # pickled as module + name
        if self.is_user_module(type(obj).__module__) or (
                by_reference and self.is_user_module(getattr(obj, "__module__", None))):
            raise pickle.PicklingError(f"{type(obj).__qualname__} is the user's")
        return NotImplemented


class Worker:
    """The state of one worker: the tools, the environment factories, their instances."""

    def __init__(self, conn, tool_paths: list[str], factory_paths: dict, module_dir: str | None, timeout_s: float):
        self.conn, self.timeout_s = conn, timeout_s
        self.module_dir = os.path.realpath(module_dir) + os.sep if module_dir else None
        self.tool_paths, self.factory_paths = tool_paths, factory_paths
        self.tools: list = []
        self.factories: dict = {}
        self.free: dict = {}             # env key -> instances ready for a new rollout (TRL's pool)
        self.sessions: dict = {}         # session id -> (env key, instance)
        self.user_modules: set[str] = {"__main__", "__mp_main__"}
        self.module_verdicts: dict[str, bool] = {}
        self.methods: dict[type, list[str]] = {}
        self.loop: asyncio.AbstractEventLoop | None = None

    def load(self) -> str | None:
        """Import the tools and factories; the first failure as one line, else None."""
        for path in self.tool_paths:
            try:
                self.tools.append(resolve(path))
            except Exception as e:
                return f"agent tool {path!r} cannot be imported: {one_line(e)}"
        for key, path in self.factory_paths.items():
            try:
                self.factories[key] = resolve(path)
            except Exception as e:
                return f"agent environment factory {path!r} cannot be imported: {one_line(e)}"
        self.user_modules.update(path.partition(":")[0] if ":" in path else path.rpartition(".")[0]
                                 for path in [*self.tool_paths, *self.factory_paths.values()])
        self.user_modules.update(getattr(obj, "__module__", None) or "" for obj in
                                 [*self.tools, *self.factories.values()])
        return None

    # -- sending ---------------------------------------------------------------------------------

    def is_user_module(self, name: str | None) -> bool:
        if not name:
            return False
        verdict = self.module_verdicts.get(name)
        if verdict is None:
            file = getattr(sys.modules.get(name), "__file__", None) or ""
            verdict = name in self.user_modules or bool(
                self.module_dir and os.path.realpath(file).startswith(self.module_dir))
            self.module_verdicts[name] = verdict
        return verdict

    def portable(self, value: Any) -> bytes:
        """``value`` pickled for the trainer, or its str() where it cannot be (or should not be)."""
        buffer = io.BytesIO()
        try:
            _Portable(buffer, self.is_user_module).dump(value)
            return buffer.getvalue()
        except Exception:
            try:
                text = str(value)
            except Exception as e:
                text = f"<{type(value).__name__}: str() failed: {one_line(e)}>"
            return pickle.dumps(text)

    def send_result(self, i: int, name: str, content: Any, failed: bool, seconds: float, awaited: bool) -> None:
        self.conn.send(("result", i, name, failed, seconds, awaited, self.portable(content)))

    # -- requests ------------------------------------------------------------------------------

    def event_loop(self) -> asyncio.AbstractEventLoop:
        # One loop for the worker's life, as TRL's daemon loop: an environment may keep loop-bound state.
        if self.loop is None:
            self.loop = asyncio.new_event_loop()
        return self.loop

    def method_names(self, cls: type) -> list[str]:
        if cls not in self.methods:
            # On the class, as TRL: getmembers on an instance would evaluate its properties.
            self.methods[cls] = [name for name, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
                                 if name not in ("reset", "get_reward") and not name.startswith("_")]
        return self.methods[cls]

    def instance_tools(self, instance) -> list:
        return list(self.tools) + ([getattr(instance, n) for n in self.method_names(type(instance))]
                                   if instance is not None else [])

    def probe(self, key, with_env: bool) -> dict:
        """What the parent caches per environment: names, schemas, reward, class name. The probed
        instance seeds this worker's pool, as TRL's probe seeds its _environment_pool."""
        instance, where = None, {}
        if with_env:
            path = self.factory_paths[key]
            try:
                instance = self.factories[key]()
            except Exception as e:
                raise ValueError(f"agent environment factory {path!r} failed: {one_line(e)}") from None
            members = dict(inspect.getmembers(type(instance), predicate=inspect.isfunction))
            if "reset" not in members:
                raise ValueError(f"agent environment factory {path!r}: each environment instance returned by "
                                 "`environment_factory` must define a callable `reset`")
            self.free.setdefault(key, []).append(instance)
            where = {name: f"{path}.{name}" for name in self.method_names(type(instance))}
        get_json_schema = json_schema_function()
        tools = self.instance_tools(instance)
        schemas = []
        for tool, path in zip(tools, [*self.tool_paths, *where.values()]):
            try:
                schemas.append(get_json_schema(tool))
            except Exception as e:
                raise ValueError(f"agent tool {path!r} has no JSON schema: {one_line(e)}") from None
        return {"names": [t.__name__ for t in tools], "schemas": schemas,
                "has_reward": instance is not None and inspect.isfunction(getattr(type(instance), "get_reward", None)),
                "class_name": type(instance).__name__ if instance is not None else None}

    def open(self, sid: int, key, reset_kwargs: dict) -> Any:
        free = self.free.get(key)
        instance = free.pop() if free else None
        if instance is None:
            try:
                instance = self.factories[key]()
            except Exception as e:
                raise RuntimeError(f"agent environment factory {self.factory_paths[key]!r} failed: "
                                   f"{one_line(e)}") from None
        try:
            observation = instance.reset(**reset_kwargs)
        except Exception as e:
            # The instance is left out of the pool: its state after a failed reset is unknown.
            raise RuntimeError(f"{type(instance).__name__}.reset() failed: {one_line(e)}") from None
        self.sessions[sid] = (key, instance)
        return observation

    def calls(self, sid, calls: list) -> None:
        """One assistant turn, as TRL's _tool_call_loop: the sync calls in order, then the async ones
        awaited together; every failure becomes {"error": str(e)}."""
        if sid is not None and sid not in self.sessions:     # the parent tracks lost sessions; be safe
            for i, name, _ in calls:
                self.send_result(i, name, {"error": "the environment of this rollout is not in its worker"},
                                 True, 0.0, False)
            self.conn.send(("done",))
            return
        instance = self.sessions[sid][1] if sid is not None else None
        sync_tools, async_tools = {}, {}
        for tool in self.instance_tools(instance):
            (async_tools if inspect.iscoroutinefunction(tool) else sync_tools)[tool.__name__] = tool
        awaiting = []
        for i, name, arguments in calls:
            if name in sync_tools:
                self.conn.send(("start", [i], False))
                started = time.perf_counter()
                try:
                    content, failed = sync_tools[name](**arguments), False
                except Exception as e:
                    content, failed = {"error": str(e)}, True
                self.send_result(i, name, content, failed, time.perf_counter() - started, False)
            elif name in async_tools:
                try:
                    awaiting.append((i, name, async_tools[name](**arguments)))   # a bad argument fails here
                except Exception as e:
                    self.send_result(i, name, {"error": str(e)}, True, 0.0, False)
            else:
                self.send_result(i, name, {"error": NOT_FOUND.format(name=name)}, True, 0.0, False)
        if awaiting:
            self.conn.send(("start", [i for i, _, _ in awaiting], True))
            self.event_loop().run_until_complete(self.gather(awaiting))
        self.conn.send(("done",))

    async def gather(self, awaiting: list) -> None:
        async def one(i: int, name: str, coroutine) -> None:
            started = time.perf_counter()
            task = asyncio.ensure_future(coroutine)
            # A tool that awaits past its time is cancelled here and the worker lives on; one that
            # blocks the loop is killed by the parent a little later.
            done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
            if not done:
                task.cancel()
                content, failed = {"error": TIMEOUT.format(name=name, seconds=self.timeout_s)}, True
            else:
                try:
                    content, failed = task.result(), False
                except (Exception, asyncio.CancelledError) as e:
                    content, failed = {"error": str(e)}, True
            self.send_result(i, name, content, failed, time.perf_counter() - started, True)

        await asyncio.gather(*(one(*call) for call in awaiting))

    def reward(self, sid: int) -> float | None:
        if sid not in self.sessions:
            raise RuntimeError("the environment of this rollout is not in its worker")
        instance = self.sessions[sid][1]
        try:
            value = instance.get_reward()
            if inspect.isawaitable(value):
                value = self.event_loop().run_until_complete(value)
            return None if value is None else float(value)
        except Exception as e:
            raise RuntimeError(f"{type(instance).__name__}.get_reward() failed: {one_line(e)}") from None

    def release(self, sid: int) -> None:
        held = self.sessions.pop(sid, None)
        if held is not None:
            self.free.setdefault(held[0], []).append(held[1])

    def serve(self) -> None:
        while True:
            try:
                request = self.conn.recv()
            except EOFError:
                return
            op, args = request[0], request[1:]
            if op == "stop":
                return
            if op == "calls":
                self.calls(args[0], args[2])
                continue
            try:
                if op == "probe":
                    reply = ("ok", self.probe(*args))
                elif op == "open":
                    reply = ("ok", self.portable(self.open(*args)))
                elif op == "reward":
                    reply = ("ok", self.reward(*args))
                elif op == "release":
                    reply = ("ok", self.release(*args))
                else:
                    reply = ("error", f"unknown request {op!r}")
            except (ValueError, RuntimeError) as e:
                reply = ("error", str(e))
            self.conn.send(reply)


def _exit_with_parent() -> None:
    # A trainer killed outright (SIGKILL, OOM) cannot end its workers: they end themselves, even
    # in the middle of a hung tool.
    parent = multiprocessing.parent_process()
    if parent is not None:
        parent.join()
        os._exit(0)


def main(conn, tool_paths: list[str], factory_paths: dict, module_dir: str | None, timeout_s: float) -> None:
    """The worker process's entry (multiprocessing's target)."""
    # A Ctrl-C reaches the whole process group: the trainer decides when its workers end (stop, then kill).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, name="exit-with-parent", daemon=True).start()
    if module_dir:
        sys.path.insert(0, str(module_dir))
    worker = Worker(conn, tool_paths, factory_paths, module_dir, timeout_s)
    error = worker.load()
    conn.send(("ready", error))
    if error is None:
        worker.serve()
    conn.close()
