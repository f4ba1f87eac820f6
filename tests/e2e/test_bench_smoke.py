"""Every benchmark script (scripts/bench_*.py, scripts/model_step.py) runs in its --smoke mode: its
whole code path on the smallest sizes, in seconds to a minute. Its last line must hold the figures it
reports, each key present and each value a number, and its tables must read back as tables
(scripts/benchtable.py). A refactor that breaks a script (a key it reads renamed, a function it
calls gone) fails here instead of the next time someone measures.

The scripts that need the Slurm testbed, mpiexec or vLLM skip without them, as the tests of those
parts do; in CI (scripts/test.sh) all of them are there."""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

SCRIPTS = REPO / "scripts"
sys.path.insert(0, str(SCRIPTS))
from benchtable import print_table, read_tables  # noqa: E402  (scripts/benchtable.py)

PY = sys.executable
MPIEXEC = str(Path(PY).parent / "mpiexec") if (Path(PY).parent / "mpiexec").exists() else shutil.which("mpiexec")
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None

needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install mpich)")
needs_vllm = [pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")]
needs_testbed = pytest.mark.slurm       # and the `testbed` fixture, which skips when it is down


def bench(script, args, keys, timeout, *marks, testbed=False):
    return pytest.param(script, args, keys, timeout, testbed,
                        id=Path(script).stem + "".join(a.replace("--", "-") for a in args), marks=list(marks))


BENCHES = [  # script, arguments besides --smoke, the keys of its last line, seconds it may take
    bench("model_step.py", [], {"speedup_strong_at_256", "speedup_weak_at_256", "sync_s_hpcrl",
                                "sync_s_single_server_at_256", "sync_share_at_256_hpcrl",
                                "sync_share_at_256_single_server", "crossover_nodes_strong",
                                "async_speedup_at_256_k1", "async_speedup_at_256_continuous",
                                "engine_idle_at_256_k0", "engine_idle_at_256_continuous"}, 60),
    bench("bench_cli.py", [], {"worst_cli_over_python_start", "render_over_import_floor"}, 180,
          needs_testbed, testbed=True),
    bench("bench_scale.py", [], {"rendezvous_s_at_16", "failure_detect_s_at_16", "growth_exponent_rendezvous"}, 240,
          pytest.mark.slow, needs_mpi),
    bench("bench_train.py", [], {"peak_mem_ratio_ws2_over_ws1", "lora_over_full_state_ws2",
                                 "lora_over_full_peak_ws2_ref_on", "lora_over_full_step_time_ws2"}
          | ({"deepspeed_ws2_over_ws1_memory"} if HAS_DEEPSPEED else set()), 300, pytest.mark.slow),
    bench("bench_memory.py", [], {"logprob_peak_ratio_chunked_over_full", "fit_estimate_error",
                                         "expert_lora_kept_over_estimate"}, 300,
          pytest.mark.slow),
    bench("bench_sync.py", [], {"sync_speedup_vs_checkpoint", "handoff_fraction_of_memcpy", "peak_extra_over_bucket",
                                "gathered_bytes_over_wire_bytes", "lora_sync_bytes_over_full",
                                "lora_sync_time_over_full", "e2e_share_gather", "e2e_share_handoff",
                                "e2e_share_engine"}, 360, pytest.mark.slow, *needs_vllm),
    bench("bench_sync.py", ["--engines"], {"sync_s_two_engines_over_one"}, 360, pytest.mark.slow, needs_mpi),
    bench("bench_load.py", [], {"load_s_staged_over_broadcast_at_1", "cross_node_load_bytes_broadcast_at_1",
                                "cross_node_load_bytes_staged"}, 360, pytest.mark.slow, needs_testbed, testbed=True),
    # One process for both of its paths: the step against TRL, then asynchronous generation
    # (inference.max_staleness) with the synchronous and the k = 4 in-flight systems and a long tail of
    # completions (1 in 2 to the 8 tokens, the others end at 4).
    bench("bench_step.py", [], {"step_throughput_vs_trl", "async_steps_per_s_ratio_k4_inflight_over_k0",
                                "engine_idle_k4_inflight",
                                "long_tail_len_over_max"}, 600, pytest.mark.slow, needs_mpi, *needs_vllm),
    bench("bench_agent.py", [], {"agent_rollouts_per_s_ratio_vs_lockstep", "agent_ratio_at_1_turns"}, 240,
          pytest.mark.slow, *needs_vllm),
    # Two `hpcrl run`s of 6 steps: synchronous, and k = 4 in flight (which must reach staleness 4).
    bench("bench_learning.py", [], {"reward_gap_k4_in_flight_vs_sync", "worst_seed_gap_k4_in_flight", "bar",
                                    "seeds"}, 300, pytest.mark.slow, *needs_vllm),
]


# Figures a smoke run can bound: the run did its work, not only printed a number.
BOUNDS = {"long_tail_len_over_max": (0.5, 0.95),   # --long-tail 2 of 8 tokens: halves at 8 and at 4 (or 5, the stop)
          # hpcrl_shm's sender gathers a dense model straight into its slots: no copy, no gathered tensor
          # alive, and each gather moves the wire dtype once (issue #32's regression would show here first).
          "e2e_share_handoff": (0.0, 0.02), "peak_extra_over_bucket": (0.0, 0.02),
          "gathered_bytes_over_wire_bytes": (0.99, 1.01)}


def run_bench(cmd: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    """The script in a process group of its own; past its time, the group gets Ctrl-C as a terminal
    would send it (so `hpcrl run` stops its ranks), then SIGKILL."""
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
        pytest.fail(f"`{' '.join(cmd[1:])}` did not end within {timeout} s:\n{out[-2000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def last_line_figures(stdout: str) -> dict[str, str]:
    line = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    pairs = [item.partition("=") for item in line.split()]
    assert pairs and all(sep and key and value for key, sep, value in pairs), f"last line is not key=value ...: {line!r}"
    return {key: value for key, _, value in pairs}


def test_every_bench_script_has_a_smoke_run():
    scripts = {p.name for p in SCRIPTS.glob("bench_*.py")} | {"model_step.py"}
    assert scripts == {p.values[0] for p in BENCHES}


@pytest.mark.parametrize("script,args,keys,timeout,testbed", BENCHES)
def test_bench_smoke(script, args, keys, timeout, testbed, request, hpcrl_home, tmp_path):
    if testbed:
        request.getfixturevalue("testbed")
    proc = run_bench([PY, str(SCRIPTS / script), *args, "--smoke"], tmp_path, timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    figures = last_line_figures(proc.stdout)
    assert keys <= set(figures), f"missing {sorted(keys - set(figures))} in {figures}"
    for key, value in figures.items():
        try:
            number = float(value)
        except ValueError:
            pytest.fail(f"{key}={value}: not a number")
        assert not math.isnan(number), f"{key}={value}"
        low, high = BOUNDS.get(key, (-math.inf, math.inf))
        assert low <= number <= high, f"{key}={value}: expected within [{low}, {high}]"
    tables = read_tables(proc.stdout)
    assert tables, f"no table in:\n{proc.stdout[-3000:]}"
    for title, headers, rows in tables:
        assert title and rows, (title, headers, rows)
        assert all(len(row) == len(headers) for row in rows), (title, headers, rows)


def test_tables_read_back(capsys):
    print_table("two rows", ["name", "value ms"], [["hpcrl render", "81.2"], ["a|b", ""]])
    print("key=1")
    out = capsys.readouterr().out
    assert read_tables(out) == [("two rows", ["name", "value ms"], [["hpcrl render", "81.2"], ["a/b", ""]])]
    assert len({len(line) for line in out.splitlines()[1:5]}) == 1      # the columns line up
