"""TRL's metric names, old runs' names read through metric_keys.upgrade, and the learning check:
a run that cannot have learned anything says so, with the likely cause, as its last line."""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import pytest

from hpcrl.job import metric_keys as mk

PY = sys.executable
MPIEXEC = Path(PY).parent / "mpiexec"
needs_mpi = pytest.mark.skipif(not MPIEXEC.exists() and shutil.which("mpiexec") is None,
                               reason="no mpiexec (pip install mpich)")


def _step(step: int, **kw) -> dict:
    row = {mk.STEP: step, mk.REWARD: 0.4 + 0.1 * step, mk.REWARD_STD: 0.3, mk.FRAC_REWARD_ZERO_STD: 0.25,
           mk.GRAD_NORM: 0.5, mk.LEARNING_RATE_USED: 1e-6, mk.LEARNING_RATE: 1e-6}
    row.update(kw)
    return row


# ------------------------------------------------------------------ names
def test_trl_names_and_their_dashboard_form():
    assert mk.reward_mean("acc") == "rewards/acc/mean" and mk.reward_std("acc") == "rewards/acc/std"
    assert mk.reward_of("rewards/a/b/mean") == "a/b" and mk.reward_of("rewards/a/std") is None
    # transformers' rewrite_logs, which TRL's TensorBoard and W&B logs go through
    assert mk.dashboard_key("rewards/acc/mean") == "train/rewards/acc/mean"
    assert mk.dashboard_key(mk.eval_key("reward")) == "eval/reward"


def test_trainer_keys_are_trls():
    """The names hpcrl shares with TRL are the ones TRL 1.16's GRPOTrainer logs (its source, where installed)."""
    trl = pytest.importorskip("trl")
    source = (Path(trl.__file__).parent / "trainer" / "grpo_trainer.py").read_text()
    shared = [mk.REWARD, mk.REWARD_STD, mk.FRAC_REWARD_ZERO_STD, mk.COMPLETIONS_MEAN_LENGTH, mk.COMPLETIONS_MIN_LENGTH,
              mk.COMPLETIONS_MAX_LENGTH, mk.COMPLETIONS_CLIPPED_RATIO, mk.COMPLETIONS_MEAN_TERMINATED_LENGTH,
              mk.COMPLETIONS_MIN_TERMINATED_LENGTH, mk.COMPLETIONS_MAX_TERMINATED_LENGTH, mk.NUM_TOKENS, mk.KL,
              mk.ENTROPY, mk.POLICY_LOSS, mk.CLIP_RATIO_LOW_MEAN, mk.CLIP_RATIO_HIGH_MEAN, mk.CLIP_RATIO_REGION_MEAN,
              mk.CLIP_RATIO_LOW_MIN, mk.CLIP_RATIO_HIGH_MAX, mk.CISPO_CLIP_RATIO, mk.VESPO_PHI_SEQ_MEAN,
              mk.SAMPLING_LOGP_DIFFERENCE_MEAN, mk.IMPORTANCE_SAMPLING_RATIO_MAX]
    assert [k for k in shared if f'_metrics[mode]["{k}"]' not in source] == []
    assert '_metrics[mode][f"rewards/{reward_func_name}/mean"]' in source
    assert 'f"eval_{key}"' in source


def test_an_old_runs_names_are_read_as_trls():
    old = {"step": 3, "reward": 1.0, "completion_len_mean": 12.0, "truncated_frac": 0.5, "rewards/acc": 0.7,
           "eval/reward": 0.9, "eval/rewards/acc": 0.6, "eval/completion_len_mean": 8.0, "eval/completions": 10}
    new = mk.upgrade(old)
    assert new[mk.COMPLETIONS_MEAN_LENGTH] == 12.0 and new[mk.COMPLETIONS_CLIPPED_RATIO] == 0.5
    assert new["rewards/acc/mean"] == 0.7 and new["eval_reward"] == 0.9 and new["eval_rewards/acc/mean"] == 0.6
    assert new["eval_completions/mean_length"] == 8.0 and new[mk.EVAL_COMPLETIONS] == 10
    today = {"step": 1, "rewards/acc/mean": 0.7, "rewards/acc/std": 0.1}
    assert mk.upgrade(today) == today


# ------------------------------------------------------------------ the check, on metrics lines
def test_a_run_that_learned_is_left_alone():
    assert mk.learning_check([_step(s) for s in (1, 2, 3)], 8) is None
    # One step that moved the weights is enough; an eval-only step 0 and old runs without grad_norm say nothing.
    assert mk.learning_check([_step(1, grad_norm=0.0), _step(2)], 8) is None
    assert mk.learning_check([{"step": 1, "reward": 0.5}], 8) is None
    assert mk.learning_check([], 8) is None


def test_every_group_alike():
    steps = [_step(s, frac_reward_zero_std=1.0, grad_norm=0.0) for s in (1, 2, 3, 4)]
    assert mk.learning_check(steps, 8) == (
        "learned nothing: every group's rewards were equal in all 4 steps (advantages 0): rewards need to differ "
        "within a group of 8 completions (grpo.num_generations)")
    constant = [_step(s, frac_reward_zero_std=1.0, reward=1.0, reward_std=0.0) for s in (1, 2)]
    assert mk.learning_check(constant, None) == (
        "learned nothing: every group's rewards were equal in all 2 steps (advantages 0; every completion got "
        "reward 1): rewards need to differ within a group (the grpo.num_generations completions of a prompt)")


def test_weights_that_never_changed():
    never = "learned nothing: the policy's weights never changed: "
    assert mk.learning_check([_step(1, learning_rate_used=0.0, learning_rate=0.0)], 8) == (
        never + "the learning rate was 0 in its one step (grpo.learning_rate, the warmup and the schedule)")
    assert mk.learning_check([_step(s, grad_norm=0.0) for s in (1, 2)], 8) == (
        never + "grad_norm 0 in all 2 steps: no gradient reached a trainable parameter (all frozen, or the loss "
        "does not depend on them)")
    assert mk.learning_check([_step(s, grad_norm=None) for s in (1, 2)], 8) == (
        never + "the gradient norm was not finite (nan or inf) in all 2 steps, and each step was skipped")
    assert mk.learning_check([_step(1, grad_norm=None), _step(2, grad_norm=0.0)], 8).startswith(
        never + "no step had both")
    # The rate a step used, not the one logged after the schedule's step (0 at the end of a linear decay).
    assert mk.learning_check([_step(1, learning_rate=0.0)], 8) is None


def test_the_summary_ends_with_the_line(tmp_path):
    from hpcrl.login.local.progress import print_summary

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "job.json").write_text(json.dumps({"recipe": {"grpo": {"num_generations": 4}}}))
    rows = [_step(s, frac_reward_zero_std=1.0, max_steps=2) for s in (1, 2)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = io.StringIO()
    print_summary(run_dir, 2, 5.0, 130, file=out)     # interrupted: no plot to draw
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("hpcrl: stopped: step 2 of 2")
    assert lines[-1] == ("hpcrl: learned nothing: every group's rewards were equal in all 2 steps (advantages 0): "
                         "rewards need to differ within a group of 4 completions (grpo.num_generations)")


# ------------------------------------------------------------------ end to end
REWARDS = '''

def always_one(completions, **kwargs):
    return [1.0] * len(completions)


def mixed(completions, **kwargs):
    # Unequal in every group whether a prompt's completions come together or interleaved.
    return [float(i % 3 == 0) for i in range(len(completions))]


def always_none(completions, **kwargs):
    return [None] * len(completions)
'''

RECIPE = '''
name: learns-nothing
model: {{path: "demo:tiny:random"{model_extra}}}
data: {{path: demo}}
rewards:
  - {{func: "nothing_rewards:{func}"}}
grpo: {{max_steps: {max_steps}, num_generations: 4, max_completion_length: 4{extra}}}
inference: {{engine: transformers}}
'''


def _run(tmp_path: Path, func: str, extra: str = "", max_steps: int = 2, model_extra: str = ""):
    from conftest import run_to_the_end

    (tmp_path / "nothing_rewards.py").write_text(REWARDS)
    (tmp_path / "recipe.yaml").write_text(RECIPE.format(func=func, extra=extra, max_steps=max_steps,
                                                                     model_extra=model_extra))
    proc = run_to_the_end([PY, "-m", "hpcrl", "run", "recipe.yaml", "--run-dir", "run"], tmp_path, 300)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    lines = proc.stdout.strip().splitlines()
    assert any(line.startswith(f"hpcrl: finished: step {max_steps} of {max_steps}") for line in lines), proc.stdout
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return lines, metrics


@needs_mpi
def test_hpcrl_run_with_a_constant_reward_says_it_learned_nothing(tmp_path):
    lines, metrics = _run(tmp_path, "always_one")
    assert lines[-1] == ("hpcrl: learned nothing: every group's rewards were equal in all 2 steps (advantages 0; "
                         "every completion got reward 1): rewards need to differ within a group of 4 completions "
                         "(grpo.num_generations)")
    # TRL's names, hpcrl's own beside them
    m = metrics[-1]
    assert m["rewards/always_one/mean"] == 1.0 and m["rewards/always_one/std"] == 0.0 and m["reward_std"] == 0.0
    assert m["frac_reward_zero_std"] == 1.0 and m["grad_norm"] == 0.0
    assert 0 <= m["completions/min_length"] <= m["completions/mean_length"] <= m["completions/max_length"] <= 4
    assert 0 <= m["completions/clipped_ratio"] <= 1 and "completions/mean_terminated_length" in m
    assert m["num_tokens"] > metrics[0]["num_tokens"] > 0 and m["epoch"] > 0
    assert "completion_len_mean" not in m and "time_step_s" in m and "tokens_per_s" in metrics[0]
    # The model written, tensor by tensor against the base: not one changed (a zero gradient moves
    # no AdamW weight), which the learning check would say if the metrics had not.
    report = json.loads((tmp_path / "run" / "model-vs-base.json").read_text())
    assert report["compared"] > 5 and report["changed"] == 0 and report["dtype"] == "float32"


@needs_mpi
def test_hpcrl_run_all_in_warmup_says_its_weights_never_changed(tmp_path):
    """The learning rate 0 in every step: a warmup as long as the run (the schedule's first step
    has rate 0)."""
    lines, metrics = _run(tmp_path, "mixed", ", warmup_steps: 2, lr_scheduler_type: linear", max_steps=1)
    assert [(m["step"], m["learning_rate_used"]) for m in metrics] == [(1, 0.0)] and metrics[0]["grad_norm"] > 0
    assert metrics[0]["frac_reward_zero_std"] == 0.0
    assert lines[-1] == ("hpcrl: learned nothing: the policy's weights never changed: the learning rate was 0 in "
                         "its one step (grpo.learning_rate, the warmup and the schedule)")


@needs_mpi
def test_hpcrl_run_whose_reward_is_always_none_names_it_and_learned_nothing(tmp_path):
    """Issue #26, item 8: a reward returning None for every sample finished with loss 0 and no word."""
    lines, metrics = _run(tmp_path, "always_none")
    log = (tmp_path / "run" / "run.log").read_text()
    assert "warning: reward function 'always_none' returned None for every completion of trainer 0's generation " \
           "at step 1 (no reward function scored them: they train on nothing)" in log
    assert lines[-1] == ("hpcrl: learned nothing: no reward function scored a completion in all 2 steps (every "
                         "reward was None, so no completion had an advantage)")


def test_a_changed_model_is_told_apart_from_its_base(tmp_path):
    import torch
    from safetensors.torch import save_file

    from hpcrl.compute.train.base_diff import BaseDiff

    base = {"a": torch.ones(4), "b": torch.zeros(2, 2), "step": torch.tensor([3])}
    save_file(base, str(tmp_path / "model.safetensors"))
    diff = BaseDiff(tmp_path)
    diff.add("a", torch.ones(4, dtype=torch.bfloat16))       # equal in the written dtype
    diff.add("b", torch.full((2, 2), 0.5))
    diff.add("step", torch.tensor([4]))                       # not a weight: not compared
    diff.add("new", torch.ones(1))                            # not in the base
    result = diff.close()
    assert (result.compared, result.changed, result.max_abs_diff) == (2, 1, 0.5)
    assert mk.model_check({"compared": 2, "changed": 1, "dtype": "float32"}) is None
    assert "in all 2 tensors (float32): no update reached" in mk.model_check({"compared": 2, "changed": 0,
                                                                              "dtype": "float32"})


def test_a_base_it_cannot_read_ends_the_comparison_not_the_export(tmp_path):
    import torch

    from hpcrl.compute.train.base_diff import BaseDiff

    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    diff = BaseDiff(tmp_path)
    diff.add("a", torch.ones(2))
    assert diff.close().compared == 0
    assert mk.model_check({"compared": 0, "changed": 0, "dtype": "float32"}) is None


def test_status_of_an_ended_job_names_it(tmp_path):
    """`hpcrl status JOBID` of a job that ended: the same line; a long run's file is read whole only
    when its tail learned nothing."""
    from hpcrl.login.commands.status import _learning

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    job = {"recipe": {"grpo": {"num_generations": 8}}}
    padding = "x" * 400          # ~1,000 steps of ~500 bytes: more than the 256 KiB tail
    rows = [_step(s, grad_norm=0.0, pad=padding) for s in range(1, 1001)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _learning(str(run_dir), {"state": "RUNNING"}, job) is None
    assert _learning(str(run_dir), {"state": "COMPLETED"}, job) == (
        "learned nothing: the policy's weights never changed: grad_norm 0 in all 1000 steps: no gradient reached "
        "a trainable parameter (all frozen, or the loss does not depend on them)")
    rows[0][mk.GRAD_NORM] = 0.1           # only the first step, outside the tail, changed the weights
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert _learning(str(run_dir), {"state": "COMPLETED"}, job) is None
