"""A trainer's own error ends `hpcrl run` with its reason, and failure.txt (what `hpcrl status`
reads) keeps it, also where no peer reports the trainer's death while running: the transformers
engine says goodbye first. Before, the last line was "1 traceback(s) from the job are in run.log
only" and failure.txt was never written (found by scripts/trl_corpus.py: TRL's think_format_reward
on plain-text prompts)."""

from __future__ import annotations

import re
import sys

import pytest
from conftest import run_to_the_end

from hpcrl.job.rundir import read_failure


@pytest.mark.slow
def test_a_failing_reward_on_the_transformers_engine_is_the_runs_last_line(tmp_path):
    pytest.importorskip("torch")
    (tmp_path / "bad_rewards.py").write_text("def broken(prompts, completions, **kwargs):\n"
                                             "    raise ValueError(\"the reward's own reason\")\n")
    (tmp_path / "r.yaml").write_text("model: {path: 'demo:tiny:random'}\ndata: {path: demo}\n"
                                     "rewards: [{func: 'bad_rewards:broken'}]\n"
                                     "inference: {engine: transformers}\ngrpo: {max_steps: 2}\n")
    proc = run_to_the_end([sys.executable, "-m", "hpcrl", "run", "r.yaml", "--run-dir", "run"], tmp_path, 300)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"hpcrl: error: rank 0 \(node 0, trainer, host \S+, pid \d+\) failed: reward function "
                        r"'broken' raised ValueError: the reward's own reason", last), proc.stderr[-2000:]
    assert read_failure(tmp_path / "run") == last.removeprefix("hpcrl: error: ")
