"""`hpcrl plot` and the end of `hpcrl run`: a PNG from metrics.jsonl (by run directory or job id),
one-line errors with exit 2, the progress bar fed by metrics.jsonl, and the run's summary."""

from __future__ import annotations

import io
import json
import math
import os
import random
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import run_to_the_end

from hpcrl.login import plot
from hpcrl.login.cli import main
from hpcrl.login.local import progress as local_run
from hpcrl.login.registry import Registry

pytest.importorskip("matplotlib")

PY = sys.executable
MPIEXEC = str(Path(PY).parent / "mpiexec") if (Path(PY).parent / "mpiexec").exists() else shutil.which("mpiexec")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run(run_dir: Path, steps: int, *, kl: bool = True, funcs=("correct", "format_ok"), seed: int = 0,
             tools: bool = False, staleness: int = 0) -> Path:
    """A run directory as a training job leaves it: job.json and one metrics line per step."""
    rng = random.Random(seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    job = {"recipe": {"name": "gsm8k-test", "model": {"path": "demo:tiny"}, "resources": {"nodes": 2},
                      "grpo": {"beta": 0.04 if kl else 0.0, "max_steps": steps, "max_completion_length": 64}},
           "site": {"name": "testbed"}}
    (run_dir / "job.json").write_text(json.dumps(job))
    t = time.time() - 5 * steps
    with open(run_dir / "metrics.jsonl", "w") as f:
        for s in range(1, steps + 1):
            p = s / steps
            a, b = min(1, 0.2 + 0.6 * p + rng.gauss(0, 0.05)), min(1, 0.5 + 0.4 * p + rng.gauss(0, 0.05))
            gen, train, sync, wait = 2 + rng.random(), 1.5, 0.3, 0.1 * rng.random()
            t += gen + train + sync + wait
            rec = {"step": s, "time": t, "reward": a + b, "reward_std": 0.3, f"rewards/{funcs[0]}": a,
                   f"rewards/{funcs[1]}": b, "loss": 0.01, "completion_len_mean": 50 - 20 * p,
                   "tokens_per_s": 1000 + 10 * s, "time_generation_s": gen, "time_sync_s": sync,
                   "time_train_s": train, "time_wait_s": wait, "time_step_s": gen + train + sync + wait,
                   "learning_rate": 1e-6, "grad_norm": 0.5, "weight_version": s - 1}
            if kl:
                rec["kl"] = 0.001 * s
            if tools:           # an agent's run: TRL's tools/ metrics and the turns per rollout
                rec.update({"tools/call_frequency": 0.5 + p, "tools/failure_frequency": 0.2 - 0.1 * p,
                            "tools/turns_mean": 1.4 + p, "tools/time_s": 0.05})
            if staleness:       # inference.max_staleness: syncs behind, drops, the engine/trainer mismatch
                rec.update({"sample/staleness_mean": min(s - 1, staleness) * 0.9,
                            "sample/staleness_max": min(s - 1, staleness), "sample/dropped_stale_total": s // 7,
                            "off_policy_lag": min(s - 1, staleness), "sampling/mismatch_kl": 0.002 * (1 + p)})
            f.write(json.dumps(rec) + "\n")
    return run_dir


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def check_png(path: Path) -> tuple[int, int]:
    w, h = png_size(path)
    assert 900 <= w <= 2000 and 900 <= h <= 2000, (w, h)
    assert path.stat().st_size > 30_000                         # drawn, not an empty canvas
    import matplotlib.image
    assert matplotlib.image.imread(str(path)).shape[:2] == (h, w)   # decodes whole
    return w, h


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hpcrl: error: "), err
    return lines[0]


# ============================================================================ the plot
def test_plot_with_kl_two_reward_functions_and_many_steps(tmp_path, capsys):
    run_dir = make_run(tmp_path / "run", 200)
    assert main(["plot", str(run_dir)]) == 0
    out = capsys.readouterr().out.strip()
    assert out == str(run_dir / "metrics.png")
    check_png(run_dir / "metrics.png")


def test_plot_without_kl_few_steps_to_a_chosen_file(tmp_path, capsys):
    with_kl = make_run(tmp_path / "kl", 6)
    without = make_run(tmp_path / "nokl", 6, kl=False)
    assert main(["plot", str(with_kl), "-o", str(tmp_path / "a.png")]) == 0
    assert main(["plot", str(without), "--output", str(tmp_path / "b.png")]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "a.png"), str(tmp_path / "b.png")]
    _, h_kl = check_png(tmp_path / "a.png")
    _, h_no = check_png(tmp_path / "b.png")
    assert h_no < h_kl                            # no KL: a one-line note instead of a panel
    assert not (without / "metrics.png").exists()


def test_an_agents_run_gets_a_tool_use_panel(tmp_path):
    plain = make_run(tmp_path / "plain", 20)
    agent = make_run(tmp_path / "agent", 20, tools=True)
    _, h_plain = check_png(plot.write_plot(plain))
    _, h_agent = check_png(plot.write_plot(agent))
    assert h_agent > h_plain


def test_an_asynchronous_run_gets_an_off_policy_panel(tmp_path):
    plain = make_run(tmp_path / "plain", 20)
    stale = make_run(tmp_path / "async", 20, staleness=4)
    _, h_plain = check_png(plot.write_plot(plain))
    _, h_async = check_png(plot.write_plot(stale))
    assert h_async > h_plain


def test_plot_keeps_the_last_line_of_a_step_and_skips_torn_lines(tmp_path):
    run_dir = make_run(tmp_path / "run", 5)
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "reward": 9.0}) + "\n" + '{"step": 6, "rew')
    steps = plot.load_steps(run_dir)
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5] and steps[2]["reward"] == 9.0
    assert plot.reward_names(steps) == ["correct", "format_ok"]
    assert plot.reward_names([{"rewards/a/mean": 1, "rewards/a/std": 0}]) == ["a"]       # TRL's names


def test_smoothing_keeps_length_and_level_and_skips_gaps():
    assert plot.smooth([2.0] * 50, 7) == [2.0] * 50
    ys = plot.smooth([1.0, math.nan, 3.0, math.nan], 3)
    assert ys == [1.0, 2.0, 3.0, 3.0]
    assert all(plot.window_for(n) % 2 == 1 for n in (30, 100, 200, 5000))


def test_plot_by_registered_job_id_imports_no_torch(tmp_path, hpcrl_home):
    run_dir = make_run(tmp_path / "run", 12)
    with Registry() as reg:
        reg.add("4242", "gsm8k-test", "testbed", run_dir, run_dir / "job.sbatch")
    code = ("import sys; from hpcrl.login.cli import main; rc = main(['plot', '4242']); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    proc = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120, env=os.environ.copy())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(run_dir / "metrics.png")
    check_png(run_dir / "metrics.png")


@pytest.mark.parametrize("case, message", [
    ("unknown id", "'999999' is neither a run directory nor a registered job id"),
    ("missing dir", "is neither a run directory nor a registered job id"),
    ("no metrics", "no metrics yet"),
    ("empty metrics", "no metrics yet"),
    ("run dir gone", "job 77: its run directory"),
    ("bad output", "--output: directory"),
])
def test_plot_errors_are_one_line_and_exit_2(tmp_path, hpcrl_home, capsys, case, message):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "job.json").write_text("{}")
    target, extra = {"unknown id": ("999999", []), "missing dir": (str(tmp_path / "nope"), []),
                     "no metrics": (str(empty), []), "empty metrics": (str(empty), []),
                     "run dir gone": ("77", []),
                     "bad output": (str(make_run(tmp_path / "ok", 3)), ["-o", str(tmp_path / "no/such/x.png")])}[case]
    if case == "empty metrics":
        (empty / "metrics.jsonl").write_text('{"step": 1, "rew')          # one torn line: no step yet
    if case == "run dir gone":
        with Registry() as reg:
            reg.add("77", "x", "testbed", tmp_path / "deleted", tmp_path / "deleted" / "job.sbatch")
    assert main(["plot", target, *extra]) == 2
    captured = capsys.readouterr()
    assert message in one_error_line(captured.err) and captured.out == ""
    assert not list(tmp_path.rglob("*.png"))


# ============================================================================ `hpcrl run`: bar and summary
def test_progress_bar_follows_metrics_jsonl(tmp_path, monkeypatch):
    pytest.importorskip("tqdm")
    monkeypatch.setattr(local_run, "_isatty", lambda stream: True)
    screen = io.StringIO()
    progress = local_run.Progress(tmp_path, total=10, file=screen)
    assert progress.bar is not None and progress.bar.n == 0
    progress.poll()                                              # no metrics.jsonl yet: nothing happens
    with open(tmp_path / "metrics.jsonl", "w") as f:
        f.write(json.dumps({"step": 1, "reward": 0.25, "time_step_s": 3.0}) + "\n")
        f.write(json.dumps({"step": 2, "reward": 0.5, "time_step_s": 2.5}) + "\n" + '{"step": 3, "re')
    progress.poll()
    assert progress.bar.n == 2 and "reward 0.500" in str(progress.bar) and "step 2.5s" in str(progress.bar)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('ward": 0.75, "time_step_s": 2.0}\n')            # the torn line completes
    progress.poll()
    assert progress.bar.n == 3 and "reward 0.750" in str(progress.bar)
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward": 0.1}) + "\n")   # a resume rewrote it
    progress.poll()
    assert progress.bar.n == 1
    with progress.writing():
        screen.write("a line of the job\n")
    progress.close()
    assert "a line of the job" in screen.getvalue() and progress.bar is None


def test_no_bar_when_not_a_terminal(tmp_path):
    progress = local_run.Progress(tmp_path, total=5, file=io.StringIO())      # StringIO is no terminal
    assert progress.bar is None
    progress.poll()
    progress.close()


def test_summary_of_a_failed_run_names_where_things_are_and_draws_nothing(tmp_path):
    run_dir = make_run(tmp_path / "run", 20)
    out = io.StringIO()
    local_run.print_summary(run_dir, 50, 125.0, 1, file=out)
    text = out.getvalue()
    assert text.splitlines()[0] == "hpcrl: stopped: step 20 of 50 in 00:02:05 (exit code 1)"
    assert "(mean of steps 1-4)" in text and "(mean of steps 17-20)" in text
    assert f"plot      hpcrl plot {run_dir}" in text and not (run_dir / "metrics.png").exists()
    out = io.StringIO()
    local_run.print_summary(tmp_path / "nothing", 50, 3.0, 1, file=out)
    assert out.getvalue() == ""                                  # failed before a step: its error says it




@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec (pip install mpich)")
def test_hpcrl_run_ends_with_a_summary_and_a_plot(tmp_path):
    """Two real GRPO steps with the transformers engine (starts in about a second). The watchdog
    gets more patience than its default: on a crowded machine a rank can go quiet for a while."""
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    proc = run_to_the_end([PY, "-m", "hpcrl", "run", "grpo.max_steps=2", "grpo.per_device_train_batch_size=16",
                           "inference.engine=transformers", "launch.peer_failure_timeout_s=120",
                           "logging.log_completions=2", "--run-dir", str(run_dir)], tmp_path, 420)
    seconds = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("hpcrl: finished: "))
    summary = lines[first:]
    assert summary[0].startswith("hpcrl: finished: step 2 of 2 in "), summary
    assert summary[1].startswith("  reward    ") and "at the start (step 1) ->" in summary[1] \
        and summary[1].endswith("at the end (step 2)"), summary
    assert summary[2] == f"  metrics   {run_dir / 'metrics.jsonl'}"
    assert summary[3] == f"  plot      {run_dir / 'metrics.png'}"
    assert summary[4] == f"  log       {run_dir / 'run.log'}"
    assert [r["step"] for r in plot.load_steps(run_dir)] == [1, 2]
    # logging.log_completions: every completion in the file, two of each step on the console.
    completions = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    per_step = [sum(c["step"] == step for c in completions) for step in (1, 2)]
    assert per_step[0] == per_step[1] and per_step[0] % 16 == 0 and len(completions) == sum(per_step), per_step
    assert proc.stderr.count("] completion  step ") == 4, proc.stderr[-3000:]
    png_size(run_dir / "metrics.png")
    assert "training 0/2" not in proc.stderr and "training 2/2" not in proc.stderr     # no bar into a pipe
    print(f"hpcrl run, 2 steps: {seconds:.1f} s")
