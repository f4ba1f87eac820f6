"""hpcrl.compute.agents.tool_pool: an agent's tools and environments in worker processes, with
TRL's results (GRPOTrainer 1.16: `tools=`, `environment_factory=`) and hpcrl's bounds: each call
within agent.tool_timeout_s, a hung or dead worker replaced, its rollouts' environments lost.

The tools are a module written to tmp_path and imported by the workers through `module_dir`, as a
run directory's copy of the user's modules is."""

from __future__ import annotations

import importlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import REPO
from transformers.utils import get_json_schema

from hpcrl.compute.agents.tool_pool import ToolPool, ToolResult

MODULE = "hpcrl_test_agent_tools"
TOOLS_SOURCE = '''
"""Tools and environments for tests/compute/agents/test_tool_pool.py (imported by the pool's workers)."""
import asyncio
import itertools
import os
import sys
import threading
import time


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


async def async_add(a: int, b: int, delay: float = 0.0) -> int:
    """Add two numbers, later.

    Args:
        a: The first number.
        b: The second number.
        delay: Seconds to wait first.
    """
    await asyncio.sleep(delay)
    return a + b


def fail(message: str) -> str:
    """Raise.

    Args:
        message: What to raise with.
    """
    raise RuntimeError(message)


def nap(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return f"slept {seconds}"


async def async_nap(seconds: float) -> str:
    """Sleep without blocking the event loop.

    Args:
        seconds: How long.
    """
    await asyncio.sleep(seconds)
    return "awake"


async def blocking_nap(seconds: float) -> str:
    """Sleep, blocking the event loop.

    Args:
        seconds: How long.
    """
    time.sleep(seconds)
    return "awake"


def die(code: int) -> str:
    """End the process.

    Args:
        code: The exit code.
    """
    os._exit(code)


class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __repr__(self):
        return f"Point({self.x}, {self.y})"


def point() -> dict:
    """A value of a class only the user's module has."""
    return {"at": Point(1, 2)}


def lock() -> str:
    """A value that cannot be pickled."""
    return threading.Lock()


def has_module(name: str) -> bool:
    """Whether this process imported a module.

    Args:
        name: The module's name.
    """
    return name in sys.modules


def pid() -> int:
    """This process's id."""
    return os.getpid()


_serials = itertools.count()


class Counter:
    """Counts up to a target; rewarded for hitting it."""

    def __init__(self):
        self.serial = f"{os.getpid()}-{next(_serials)}"
        self.count, self.target = 0, None

    def reset(self, target=None, **row):
        self.count, self.target = 0, target
        return f"count to {target}"

    def increment(self, step: int) -> int:
        """Add to the count.

        Args:
            step: How much to add.
        """
        self.count += step
        return self.count

    async def peek(self) -> int:
        """The count, read asynchronously."""
        await asyncio.sleep(0)
        return self.count

    def instance(self) -> str:
        """Which instance this is."""
        return self.serial

    def _helper(self):
        return "private methods are not tools"

    def get_reward(self) -> float:
        if self.target is None:
            raise ValueError("no target was set")
        return 1.0 if self.count == self.target else 0.0


class Echo:
    def reset(self, **row):
        return None

    def echo(self, text: str) -> str:
        """Say it back.

        Args:
            text: What to say.
        """
        return text


class NoReset:
    def act(self) -> str:
        """Act."""
        return "acted"
'''

STANDALONE = ["add", "async_add", "fail", "nap", "point", "lock", "has_module", "pid"]
LOST = "the environment was lost: its worker process was replaced after "


def path(name: str) -> str:
    return f"{MODULE}:{name}"


@pytest.fixture(scope="module")
def tools_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("agent_tools")
    (directory / f"{MODULE}.py").write_text(TOOLS_SOURCE)
    sys.path.insert(0, str(directory))      # this process imports it too, for the expected schemas
    yield directory
    sys.path.remove(str(directory))
    sys.modules.pop(MODULE, None)


@pytest.fixture(scope="module")
def tools(tools_dir):
    return importlib.import_module(MODULE)


@pytest.fixture(scope="module")
def tools_pool(tools_dir):
    # The dotted form for one tool: both forms resolve.
    paths = [path(n) for n in STANDALONE]
    paths[0] = f"{MODULE}.add"
    with ToolPool(paths, workers=2, timeout_s=5.0, module_dir=tools_dir) as pool:
        yield pool


@pytest.fixture(scope="module")
def env_pool(tools_dir):
    with ToolPool([path("add")], {None: path("Counter")}, workers=2, timeout_s=5.0, module_dir=tools_dir) as pool:
        yield pool


def errors(results: list[ToolResult]) -> list:
    return [r.content["error"] if r.failed else None for r in results]


def test_schemas_are_transformers_get_json_schema(tools_pool, env_pool, tools):
    assert tools_pool.schemas() == [get_json_schema(getattr(tools, n)) for n in STANDALONE]
    assert tools_pool.tool_names() == STANDALONE
    assert not tools_pool.has_reward() and not tools_pool.has_environments
    counter = tools.Counter()
    # TRL's order: the standalone tools, then the environment's public methods by name.
    assert env_pool.schemas() == [get_json_schema(f) for f in (tools.add, counter.increment, counter.instance,
                                                                 counter.peek)]
    assert env_pool.tool_names() == ["add", "increment", "instance", "peek"]
    assert env_pool.has_reward() and env_pool.environment_class_name() == "Counter"


def test_sync_and_async_tools(tools_pool):
    session = tools_pool.open()
    assert session.observation is None
    started = time.monotonic()
    results = tools_pool.call_many(session, [("add", {"a": 2, "b": 3}),
                                             ("async_add", {"a": 1, "b": 1, "delay": 1.0}),
                                             ("async_add", {"a": 2, "b": 2, "delay": 1.0})])
    elapsed = time.monotonic() - started
    assert [(r.name, r.content, r.failed, r.awaited) for r in results] == [
        ("add", 5, False, False), ("async_add", 2, False, True), ("async_add", 4, False, True)]
    # One after the other they take 2 s; together 1 s, and 0.8 s to spare on a machine busy with
    # other tests (scripts/test.sh can run two lanes).
    assert elapsed < 1.8, f"a turn's async calls run together (TRL's asyncio.gather): {elapsed:.2f}s"
    assert results[1].seconds >= 0.95
    tools_pool.close_session(session)


def test_failures_are_trl_error_messages(tools_pool):
    session = tools_pool.open()
    results = tools_pool.call_many(session, [("nope", {}), ("fail", {"message": "boom"}),
                                             ("add", {"a": 1, "c": 2}), ("add", "not a dict"),
                                             ("async_add", {"x": 1}), ("add", {"a": 1, "b": 1})])
    assert [r.failed for r in results] == [True, True, True, True, True, False]
    got = errors(results)
    assert got[0] == "Tool nope not found." and got[1] == "boom"
    assert "unexpected keyword argument 'c'" in got[2]
    assert "must be a mapping, not str" in got[3]
    assert "unexpected keyword argument 'x'" in got[4] and not results[4].awaited   # fails before it is awaited
    assert results[5].content == 2
    assert tools_pool.replacements == 0
    tools_pool.close_session(session)


def test_results_the_trainer_cannot_load_come_back_as_text(tools_pool):
    session = tools_pool.open()
    unpicklable, user_class = tools_pool.call_many(session, [("lock", {}), ("point", {})])
    assert not unpicklable.failed and isinstance(unpicklable.content, str)
    assert unpicklable.content.startswith("<unlocked _thread.lock object")
    # The trainer could import this module (the test put it on sys.path) but must not need to.
    assert not user_class.failed and user_class.content == "{'at': Point(1, 2)}"
    tools_pool.close_session(session)


def test_workers_do_not_import_torch(tools_pool):
    tools_pool.schemas()        # the probing worker imported transformers.utils for the schemas
    sessions = [tools_pool.open() for _ in range(2)]
    assert sorted(s.worker for s in sessions) == [0, 1]
    for s in sessions:
        torch, itself = tools_pool.call_many(s, [("has_module", {"name": "torch"}), ("has_module", {"name": MODULE})])
        assert (torch.content, itself.content) == (False, True)
        tools_pool.close_session(s)


def test_an_environment_per_rollout(env_pool):
    one = env_pool.open(None, {"target": 2, "prompt": [{"role": "user", "content": "hi"}]})
    two = env_pool.open(None, {"target": 1})
    assert (one.observation, two.observation) == ("count to 2", "count to 1")
    assert one.worker != two.worker
    assert [r.content for r in env_pool.call_many(one, [("increment", {"step": 1}), ("increment", {"step": 1}),
                                                        ("peek", {}), ("add", {"a": 1, "b": 1})])] == [1, 2, 2, 2]
    assert env_pool.call_many(two, [("increment", {"step": 1})])[0].content == 1
    assert (env_pool.reward(one), env_pool.reward(two)) == (1.0, 1.0)
    env_pool.call_many(two, [("increment", {"step": 1})])
    assert env_pool.reward(two) == 0.0
    assert errors(env_pool.call_many(one, [("_helper", {}), ("reset", {}), ("get_reward", {})])) == [
        "Tool _helper not found.", "Tool reset not found.", "Tool get_reward not found."]
    env_pool.close_session(one)
    env_pool.close_session(two)
    env_pool.close_session(two)     # twice is harmless


def test_instances_are_reset_and_reused(env_pool):
    serials = set()
    for _ in range(4):
        session = env_pool.open(None, {"target": 3})
        count, serial = env_pool.call_many(session, [("peek", {}), ("instance", {})])
        assert count.content == 0       # reset
        serials.add(serial.content)
        env_pool.call_many(session, [("increment", {"step": 5})])
        env_pool.close_session(session)
    assert len(serials) == 1, "construct once, reset often"


def test_get_reward_failure_names_the_environment(env_pool):
    session = env_pool.open(None, {})
    with pytest.raises(RuntimeError, match=r"Counter\.get_reward\(\) failed: ValueError: no target was set"):
        env_pool.reward(session)
    env_pool.close_session(session)


def test_a_mapping_of_environments(tools_dir, tools):
    factories = {"counter": path("Counter"), "echo": path("Echo"), "broken": path("NoReset")}
    with ToolPool([path("add")], factories, workers=1, timeout_s=5.0, module_dir=tools_dir) as pool:
        assert pool.schemas("echo") == [get_json_schema(tools.add), get_json_schema(tools.Echo().echo)]
        assert (pool.has_reward("counter"), pool.has_reward("echo")) == (True, False)
        assert pool.environment_class_name("echo") == "Echo"
        echo, counter = pool.open("echo", {"text": "row"}), pool.open("counter", {"target": 1})
        assert (echo.observation, counter.observation) == (None, "count to 1")
        assert [r.content for r in pool.call_many(echo, [("echo", {"text": "hi"}), ("increment", {"step": 1})])] == [
            "hi", {"error": "Tool increment not found."}]
        pool.call_many(counter, [("increment", {"step": 1})])
        assert pool.reward(counter) == 1.0 and pool.reward(echo) is None
        with pytest.raises(ValueError, match="must define a callable `reset`"):
            pool.schemas("broken")
        with pytest.raises(ValueError, match="not among the environments"):
            pool.open("nope")
        with pytest.raises(ValueError, match="not among the environments"):
            pool.schemas(None)


@pytest.mark.parametrize("tools_, factories, message", [
    (["hpcrl_test_agent_tools:missing"], None,
     "agent tool 'hpcrl_test_agent_tools:missing' cannot be imported: AttributeError"),
    (["no_such_module_for_hpcrl.f"], None,
     "agent tool 'no_such_module_for_hpcrl.f' cannot be imported: ModuleNotFoundError"),
    ([], {None: "hpcrl_test_agent_tools:Missing"},
     "agent environment factory 'hpcrl_test_agent_tools:Missing' cannot be imported: AttributeError"),
])
def test_an_import_error_is_a_value_error_at_construction(tools_dir, tools_, factories, message):
    with pytest.raises(ValueError) as raised:
        ToolPool(tools_, factories, workers=1, module_dir=tools_dir)
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)


def test_a_hung_or_dead_tool_costs_one_call_and_its_environment(tools_dir):
    lines = []
    tools_ = [path(n) for n in ("nap", "die", "async_nap", "blocking_nap", "pid")]
    with ToolPool(tools_, {None: path("Counter")}, workers=1, timeout_s=0.5, module_dir=tools_dir,
                  log=lines.append) as pool:
        first = pool.open(None, {"target": 1})
        assert pool.call_many(first, [("increment", {"step": 1})])[0].content == 1
        pid = pool.worker_pids[0]

        started = time.monotonic()
        (hung,) = pool.call_many(first, [("nap", {"seconds": 30})])
        assert time.monotonic() - started < 3.0
        assert hung.failed and hung.content == {"error": "tool 'nap' did not return within 0.5 s "
                                                         "(agent.tool_timeout_s)"}
        assert pool.replacements == 1 and pool.worker_pids[0] != pid
        assert any("replaced after tool 'nap' did not return" in line for line in lines)

        # The rollout's environment went with the worker: later calls say so, its reward is None.
        (gone,) = pool.call_many(first, [("increment", {"step": 1})])
        assert gone.failed and gone.content["error"].startswith(LOST + "tool 'nap' did not return within 0.5 s")
        lines.clear()
        assert pool.reward(first) is None and pool.reward(first) is None
        assert len(lines) == 1 and "Counter.get_reward()" in lines[0] and LOST in lines[0]
        pool.close_session(first)

        second = pool.open(None, {"target": 1})         # the new worker serves new rollouts
        assert [r.content for r in pool.call_many(second, [("increment", {"step": 1})])] == [1]

        # An awaited call past its time is cancelled in the worker, which lives on.
        started = time.monotonic()
        (slow,) = pool.call_many(second, [("async_nap", {"seconds": 30})])
        assert time.monotonic() - started < 2.0 and slow.failed and slow.awaited
        assert "did not return within 0.5 s" in slow.content["error"] and pool.replacements == 1
        assert pool.reward(second) == 1.0

        # One that blocks the event loop is killed (after the grace for the worker's own timer).
        started = time.monotonic()
        (blocked,) = pool.call_many(second, [("blocking_nap", {"seconds": 30})])
        assert time.monotonic() - started < 4.0 and blocked.failed
        assert blocked.content == {"error": "tool 'blocking_nap' did not return within 0.5 s (agent.tool_timeout_s)"}
        assert pool.replacements == 2
        pool.close_session(second)

        third = pool.open(None, {"target": 1})
        died, after = pool.call_many(third, [("die", {"code": 3}), ("increment", {"step": 1})])
        assert died.failed and died.content == {"error": "tool 'die' ended its worker process (exit code 3)"}
        assert after.failed and after.content["error"] == LOST + "tool 'die' ended its worker process (exit code 3)"
        assert pool.replacements == 3
        fourth = pool.open(None, {"target": 1})
        assert pool.call_many(fourth, [("increment", {"step": 1})])[0].content == 1


def test_standalone_tools_after_a_replacement_run_in_the_new_worker(tools_dir):
    with ToolPool([path("nap"), path("add"), path("pid")], workers=1, timeout_s=0.5, module_dir=tools_dir,
                  log=lambda line: None) as pool:
        session = pool.open()
        (before,) = pool.call_many(session, [("pid", {})])
        hung, added, after = pool.call_many(session, [("nap", {"seconds": 30}), ("add", {"a": 1, "b": 2}),
                                                      ("pid", {})])
        assert hung.failed and (added.content, added.failed) == (3, False)
        assert after.content != before.content

        # A worker that died between turns (the OOM killer, say) is replaced when next asked.
        os.kill(after.content, signal.SIGKILL)
        (again,) = pool.call_many(session, [("add", {"a": 2, "b": 2})])
        assert (again.content, again.failed) == (4, False) and pool.replacements == 2


def test_sessions_on_different_workers_run_in_parallel_and_close_ends_every_worker(tools_dir):
    started = time.monotonic()
    pool = ToolPool([path("nap"), path("pid")], workers=4, timeout_s=10.0, module_dir=tools_dir)
    start_up = time.monotonic() - started
    assert start_up < 5.0, f"four workers started in {start_up:.2f}s"
    sessions = [pool.open() for _ in range(4)]
    assert sorted(s.worker for s in sessions) == [0, 1, 2, 3]
    pids = {pool.call_many(s, [("pid", {})])[0].content for s in sessions}
    assert pids == set(pool.worker_pids) and len(pids) == 4

    started = time.monotonic()
    futures = [pool.submit_many(s, [("nap", {"seconds": 1.0})]) for s in sessions]
    results = [f.result(timeout=30) for f in futures]
    elapsed = time.monotonic() - started
    assert all(r[0].content == "slept 1.0" for r in results)
    assert elapsed < 2.5, f"four 1 s calls on four workers took {elapsed:.2f}s"

    started = time.monotonic()
    pool.close()
    assert time.monotonic() - started < 5.0
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)     # ended and reaped
    pool.close()                # twice is harmless
    with pytest.raises(RuntimeError, match="closed"):
        pool.open()


def test_a_pool_left_open_does_not_hold_the_interpreter_at_exit(tools_dir, tmp_path):
    script = tmp_path / "left_open.py"
    script.write_text(textwrap.dedent(f"""
        if __name__ == "__main__":
            from hpcrl.compute.agents.tool_pool import ToolPool
            pool = ToolPool([{path("pid")!r}], workers=2, module_dir={str(tools_dir)!r})
            print(" ".join(str(p) for p in pool.worker_pids), flush=True)
    """))
    started = time.monotonic()
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - started < 15.0
    for pid in map(int, out.stdout.split()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
