"""Issue #26, item 4: a checkpoint directory and an output directory belong to one run. Another
run's checkpoint.dir was resumed from (its weights and optimizer, for a different recipe) and
written among, moving its `latest`; another run's checkpoint.output_dir had its model replaced.
Rendering claims both for the run (rundir.RUN_IDENTITY_FILE), compose refuses another run's, and
the trainers' checkpoint save and load refuse them too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hpcrl.job import rundir


def _render(hpcrl, run: str, *overrides: str):
    return hpcrl("render", "--site", "testbed", "--run-dir", run, *overrides)


def _refused(proc, *parts: str) -> str:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    line = proc.stderr.strip()
    assert len(line.splitlines()) == 1, line
    for part in parts:
        assert part in line, line
    return line


def _fake_checkpoint(directory: Path, step: int) -> None:
    """What rundir takes for a complete training checkpoint."""
    step_dir = directory / f"{rundir.TRAINING_CHECKPOINT_PREFIX}{step}"
    step_dir.mkdir(parents=True)
    (step_dir / ".metadata").write_bytes(b"")
    (step_dir / rundir.TRAINING_CHECKPOINT_META).write_text(json.dumps({"step": step}))


def _fake_model(directory: Path) -> None:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text("{}")
    (directory / "model.safetensors").write_bytes(b"")


def test_another_runs_checkpoint_dir_is_refused(hpcrl):
    assert _render(hpcrl, "a", "checkpoint.dir=ck").returncode == 0
    a = hpcrl.work / "a"
    assert rundir.read_identity(hpcrl.work / "ck") == rundir.job_identity(a)
    _refused(_render(hpcrl, "b", "checkpoint.dir=ck", "grpo.beta=0.1"),
             f"checkpoint.dir: {hpcrl.work / 'ck'} is the checkpoint directory of run {a};",
             f"to continue that run, `hpcrl submit --resume {a}`")
    assert not (hpcrl.work / "b").exists()
    # A run that finished is not continued.
    (a / rundir.FINISHED_MARKER).touch()
    _refused(_render(hpcrl, "b", "checkpoint.dir=ck"), "that run has finished; name another directory")


def test_checkpoints_of_a_run_from_before_identities_are_refused(hpcrl):
    # Its own checkpoints/ under its run directory: named by it.
    assert _render(hpcrl, "old").returncode == 0
    old = hpcrl.work / "old"
    _fake_checkpoint(old / rundir.CHECKPOINTS_DIR, 4)
    _refused(_render(hpcrl, "b", f"checkpoint.dir={old / rundir.CHECKPOINTS_DIR}"),
             f"is the checkpoint directory of run {old};", f"`hpcrl submit --resume {old}`")
    # A checkpoint.dir of its own: nothing says whose.
    _fake_checkpoint(hpcrl.work / "ck", 2)
    _refused(_render(hpcrl, "b", "checkpoint.dir=ck"), "holds training checkpoints that no run claims",
             "`hpcrl submit --resume RUN_DIR` with its run directory")
    assert not (hpcrl.work / "b").exists()


def test_another_runs_output_dir_is_refused(hpcrl):
    assert _render(hpcrl, "a", "checkpoint.output_dir=out").returncode == 0
    a = hpcrl.work / "a"
    assert rundir.read_identity(hpcrl.work / "out") == rundir.job_identity(a)
    where = "checkpoint.output_dir (TRL's output_dir)"
    _refused(_render(hpcrl, "b", "checkpoint.output_dir=out"),
             f"{where}: {hpcrl.work / 'out'} is the output directory of run {a}, whose model this run's would replace")
    # A model directory no run claims (another program's, or an hpcrl run's from before identities).
    _fake_model(hpcrl.work / "hf")
    _refused(_render(hpcrl, "b", "checkpoint.output_dir=hf"), "holds a model that this run did not write")
    # Another run's own model/ directory.
    _fake_model(a / rundir.MODEL_DIR)
    _refused(_render(hpcrl, "b", f"checkpoint.output_dir={a / rundir.MODEL_DIR}"),
             f"is the output directory of run {a}")
    assert not (hpcrl.work / "b").exists()


def test_fresh_and_empty_dirs_are_accepted_and_claimed(hpcrl):
    (hpcrl.work / "ck").mkdir()
    (hpcrl.work / "out").mkdir()
    for run, ck, out in (("a", "ck", "out"), ("b", "new/ck", "new/out")):
        assert _render(hpcrl, run, f"checkpoint.dir={ck}", f"checkpoint.output_dir={out}").returncode == 0
        identity = rundir.job_identity(hpcrl.work / run)
        assert identity["run_dir"] == str(hpcrl.work / run)
        assert rundir.read_identity(hpcrl.work / ck) == rundir.read_identity(hpcrl.work / out) == identity


def test_a_claim_whose_run_directory_is_gone(hpcrl):
    """A render whose submission failed leaves a claim and nothing else: free. Checkpoints of a
    run directory that is gone are not resumed from."""
    assert _render(hpcrl, "a", "checkpoint.dir=ck", "checkpoint.output_dir=out").returncode == 0
    shutil.rmtree(hpcrl.work / "a")
    assert _render(hpcrl, "b", "checkpoint.dir=ck", "checkpoint.output_dir=out").returncode == 0
    assert rundir.read_identity(hpcrl.work / "ck")["run_dir"] == str(hpcrl.work / "b")
    _fake_checkpoint(hpcrl.work / "ck", 1)
    _fake_model(hpcrl.work / "out" / "checkpoint-1")
    shutil.rmtree(hpcrl.work / "b")
    _refused(_render(hpcrl, "c", "checkpoint.dir=ck"),
             f"holds the training checkpoints of run {hpcrl.work / 'b'}, whose run directory is gone")
    _refused(_render(hpcrl, "c", "checkpoint.output_dir=out"),
             f"holds a model of run {hpcrl.work / 'b'}, whose run directory is gone")


def test_the_same_run_rendered_again_where_it_was(hpcrl):
    """Its run directory deleted and rendered again as it was (the same path and recipe): its
    checkpoints are its own. Another recipe at that path is another run."""
    args = ("checkpoint.dir=ck", "checkpoint.output_dir=out")
    assert _render(hpcrl, "a", *args).returncode == 0
    _fake_checkpoint(hpcrl.work / "ck", 1)
    _fake_model(hpcrl.work / "out" / "checkpoint-1")
    shutil.rmtree(hpcrl.work / "a")
    _refused(_render(hpcrl, "a", *args, "grpo.beta=0.1"), "whose run directory is gone")
    assert _render(hpcrl, "a", *args).returncode == 0


def test_a_local_run_is_continued_with_hpcrl_run(tmp_path):
    (tmp_path / rundir.SPEC_FILE).write_text("{}")
    assert rundir.resume_command(tmp_path) == f"hpcrl run --resume {tmp_path}"
    (tmp_path / rundir.SCRIPT_FILE).write_text("")
    assert rundir.resume_command(tmp_path) == f"hpcrl submit --resume {tmp_path}"


def test_the_trainers_checkpoints_keep_to_their_run(hpcrl, monkeypatch):
    """The save writes the run's identity; its own resume (a requeue, `hpcrl submit --resume`)
    loads, another run neither loads nor saves there."""
    import torch

    from hpcrl.compute.train import checkpoint as ckpt

    for run in ("a", "b"):
        assert _render(hpcrl, run).returncode == 0
    a, b = hpcrl.work / "a", hpcrl.work / "b"
    ck = a / rundir.CHECKPOINTS_DIR
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    monkeypatch.setenv(ckpt.RUN_DIR_ENV, str(a))
    saved = ckpt.save(ck, 1, model, optimizer, None)
    assert rundir.read_identity(ck) == rundir.job_identity(a)
    assert ckpt.load(saved, model, optimizer, None)["step"] == 1
    monkeypatch.setenv(ckpt.RUN_DIR_ENV, str(b))
    with pytest.raises(ckpt.CheckpointError, match=f"holds the checkpoints of run {a}, not of this run "
                                                   f"\\({b}\\).*`hpcrl submit --resume {a}`"):
        ckpt.load(saved, model, optimizer, None)
    with pytest.raises(ckpt.CheckpointError, match=f"holds the checkpoints of run {a}"):
        ckpt.save(ck, 2, model, optimizer, None)
    assert ckpt.latest_checkpoint(ck) == saved and not (ck / "step-2.tmp").exists()
