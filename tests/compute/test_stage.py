"""Staging the model to node-local storage (hpcrl.compute.stage): the copy one task per node makes
when site.stage.model_dest is set with model_via = "srun". The testbed job that stages and loads:
tests/e2e/test_e2e_slurm.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from hpcrl.compute.stage import MANIFEST, stage_model


def _model(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    (src / "blobs").mkdir(parents=True)
    (src / "blobs" / "abc").write_bytes(b"w" * 1000)
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").symlink_to(src / "blobs" / "abc")       # as a hub snapshot links to blobs
    return src


def test_copies_once_and_follows_links(tmp_path):
    src = _model(tmp_path)
    dest = tmp_path / "node" / "model"
    assert stage_model(src, dest) == (True, 2002)
    assert not (dest / "model.safetensors").is_symlink() and (dest / "model.safetensors").read_bytes() == b"w" * 1000
    assert stage_model(src, dest) == (False, 2002)          # a requeued job keeps the copy
    (src / "config.json").write_text('{"changed": 1}')
    assert stage_model(src, dest)[0] and (dest / "config.json").read_text() == '{"changed": 1}'


def test_an_interrupted_copy_is_replaced(tmp_path):
    src = _model(tmp_path)
    dest = tmp_path / "model"
    dest.mkdir()
    (dest / "config.json").write_text("half")               # no manifest: not complete
    assert stage_model(src, dest)[0]
    assert json.loads((dest / MANIFEST).read_text())["config.json"] == 2
    assert not list(tmp_path.glob("model.partial-*"))


def test_a_missing_source_fails_the_job_in_one_line(tmp_path):
    """Run as the sbatch script runs it: the node's line on stderr and in failure.txt."""
    from hpcrl.login.compose import compose

    model = _model(tmp_path)
    spec = compose(None, "testbed", [f"model.path={model}", f"site.stage.model_dest={tmp_path}/$SLURMD_NODENAME/m",
                                     "site.stage.model_via=srun", "grpo.per_device_train_batch_size=16",
                                     "grpo.num_generations=8"],
                   run_dir=str(tmp_path / "run"), check_fit=False, check_inputs=False)
    assert spec.model_source == str(model)
    run = Path(spec.run_dir)
    run.mkdir()
    (run / "job.json").write_text(spec.to_json())
    env = {**os.environ, "SLURMD_NODENAME": "n7"}
    ok = subprocess.run([sys.executable, "-m", "hpcrl.compute.stage", str(run)], env=env, capture_output=True, text=True)
    assert ok.returncode == 0 and f"n7: model staged at {tmp_path}/n7/m" in ok.stderr
    assert (tmp_path / "n7" / "m" / "config.json").is_file()
    subprocess.run(["rm", "-rf", str(model)], check=True)
    env["SLURMD_NODENAME"] = "n8"
    bad = subprocess.run([sys.executable, "-m", "hpcrl.compute.stage", str(run)], env=env, capture_output=True, text=True)
    assert bad.returncode == 1
    assert bad.stderr.strip() == f"hpcrl: n8: staging the model failed: model.path: {model} is not a directory on " \
                                 f"{os.uname().nodename}"
    assert (run / "failure.txt").read_text().split(" ", 1)[1].strip() == bad.stderr.strip()
