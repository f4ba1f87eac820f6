"""`hpcrl export` of a damaged training checkpoint (issue #26, item 8): one line that names the
checkpoint, the damaged file and the step to export instead, exit status 2, no traceback; and an
export that fails leaves nothing behind: no model directory where there was none, an earlier one
unchanged. The run directory is one training would leave (the job spec, checkpoints of steps 2 and
3 written by hpcrl.compute.train.checkpoint), of the tiny model tests/compute/train/test_export.py builds."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpcrl.compute.train import export, export_checkpoint
from hpcrl.compute.train.dcp_reader import DamagedCheckpoint
from hpcrl.job import rundir

from conftest import REPO
from test_export import tiny_model_dir

PY = sys.executable


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM

    from hpcrl.compute.train import checkpoint as ckpt
    from hpcrl.login.compose import compose

    tmp = tmp_path_factory.mktemp("faults")
    src = tiny_model_dir(tmp)
    spec = compose(None, "local", [f"model.path={src}"], {"resources.nodes": 1}, str(tmp / "run"),
                   check_fit=False, check_inputs=False)
    run = rundir.create(spec.run_dir, spec.to_json(), None)
    model = AutoModelForCausalLM.from_pretrained(src)
    optimizer = torch.optim.AdamW(model.parameters())
    for step in (2, 3):
        model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
        optimizer.step()            # the optimizer's state is in the shard file too, as in a real run
        ckpt.save(run / rundir.CHECKPOINTS_DIR, step, model, optimizer, None)
    return run


@pytest.fixture
def run_dir(pristine, tmp_path) -> Path:
    return Path(shutil.copytree(pristine, tmp_path / "run"))


def _step3(run_dir: Path) -> Path:
    return run_dir / rundir.CHECKPOINTS_DIR / "step-3"


def _shard(run_dir: Path) -> Path:
    (shard,) = _step3(run_dir).glob("__*.distcp")
    return shard


def _model_bytes_end(run_dir: Path) -> int:
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(_step3(run_dir))).read_metadata()
    return max(v.offset + v.length for k, v in meta.storage_data.items() if k.fqn.startswith("model."))


def _hpcrl_export(*args) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "hpcrl", "export", *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def _error_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if "error" in line]
    assert len(errors) == 1, stderr
    return errors[0]


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------ through the command line
def test_truncated_shard_is_named_and_the_earlier_model_stays(run_dir, tmp_path):
    earlier = tmp_path / "exported"
    assert export_checkpoint.main([str(run_dir), "--step", "2", "-o", str(earlier)]) == 0
    before = _files(earlier)
    shard = _shard(run_dir)
    with open(shard, "r+b") as f:      # through the model's tensors (the optimizer's come after them)
        f.truncate(_model_bytes_end(run_dir) // 2)
    proc = _hpcrl_export(run_dir, "-o", earlier)
    assert proc.returncode == 2, proc.stderr
    line = _error_line(proc.stderr)
    assert f"{_step3(run_dir)}: {shard.name} is truncated" in line, line
    assert f"--step 2 -o {earlier}" in line, "the fix is the command for the older checkpoint"
    assert _files(earlier) == before, "the earlier export is untouched"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "run"], "no temporary left beside it"


def test_zeroed_shard_leaves_no_model_directory(run_dir):
    shard = _shard(run_dir)
    shard.write_bytes(bytes(shard.stat().st_size))
    before = sorted(run_dir.rglob("*"))
    proc = _hpcrl_export(run_dir)
    assert proc.returncode == 2, proc.stderr
    line = _error_line(proc.stderr)
    assert f"{_step3(run_dir)}: {shard.name} is corrupt" in line and "--step 2" in line, line
    assert not (run_dir / rundir.MODEL_DIR).exists(), "not even an empty model directory"
    assert sorted(run_dir.rglob("*")) == before


def test_missing_metadata_is_named_not_passed_over(run_dir):
    (_step3(run_dir) / ".metadata").unlink()
    for args in ((), ("--step", 3)):
        proc = _hpcrl_export(run_dir, *args)
        assert proc.returncode == 2, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr      # refused before any work
        line = _error_line(proc.stderr)
        assert f"{_step3(run_dir)}: .metadata" in line and "missing" in line and "--step 2" in line, line
    assert not (run_dir / rundir.MODEL_DIR).exists()


# ------------------------------------------------------------------ the compute side, in this process
def test_missing_shard_and_garbled_metadata(run_dir, capsys):
    shard = _shard(run_dir)
    shard.rename(shard.with_suffix(".moved"))
    assert export_checkpoint.main([str(run_dir)]) == 2
    assert f"{_step3(run_dir)}: {shard.name} is missing" in capsys.readouterr().err
    shard.with_suffix(".moved").rename(shard)
    (_step3(run_dir) / ".metadata").write_bytes(b"\x80\x05garbage" * 10)
    assert export_checkpoint.main([str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert f"{_step3(run_dir)}: .metadata is corrupt" in err and "--step 2" in err, err
    assert not (run_dir / rundir.MODEL_DIR).exists()


def test_failure_after_files_were_written_leaves_the_earlier_model(run_dir, tmp_path, monkeypatch):
    """The last tensor's bytes are zeroed: the earlier buckets are written into several shard files
    before its read fails; none of them remain, and the earlier model of that name is as it was."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoTokenizer

    from hpcrl.job.spec import JobSpec

    final = tmp_path / "exported"
    assert export_checkpoint.main([str(run_dir), "--step", "2", "-o", str(final)]) == 0
    before = _files(final)
    meta = dcp.FileSystemReader(str(_step3(run_dir))).read_metadata()
    (info,) = [v for k, v in meta.storage_data.items() if k.fqn == "model.lm_head.weight"]
    with open(_step3(run_dir) / info.relative_path, "r+b") as f:
        f.seek(info.offset)
        f.write(bytes(info.length))
    opened = []
    real_open = export.ShardWriter._open
    monkeypatch.setattr(export.ShardWriter, "_open", lambda self, shard: (opened.append(shard), real_open(self, shard)))
    src = JobSpec.load(run_dir).recipe.model.path
    how = export.ModelWriting(model_dir=src, tokenizer=AutoTokenizer.from_pretrained(src), dtype=torch.float32,
                              max_shard_bytes=100_000, bucket_bytes=40_000)
    with pytest.raises(DamagedCheckpoint, match=f"{info.relative_path} is corrupt"):
        export_checkpoint.export_checkpoint(_step3(run_dir), final, how)
    assert len(opened) > 2, "the failure came after shard files were written"
    assert _files(final) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "run"], "no temporary left beside it"
