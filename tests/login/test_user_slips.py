"""Slips a user makes that must not cost a job: a recipe key given twice (refused with both lines),
H:MM:SS text that YAML 1.1 reads as a base-60 number (kept as text), an output directory that is
the base model (refused)."""

from __future__ import annotations

import pytest

from hpcrl.login import strict_yaml


def test_a_duplicated_section_is_refused_naming_both_lines(hpcrl):
    (hpcrl.work / "r.yaml").write_text("grpo:\n  max_steps: 3\nresources:\n  nodes: 1\ngrpo:\n  beta: 0.1\n")
    proc = hpcrl("render", "--site", "testbed", "r.yaml", "--run-dir", "run")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == ("hpcrl: error: recipe r.yaml: invalid YAML at line 5, column 1: duplicate key "
                                   "'grpo' (lines 1 and 5): YAML would keep only the second")
    assert not (hpcrl.work / "run").exists()


def test_a_duplicated_nested_key_is_refused():
    with pytest.raises(Exception, match=r"duplicate key 'beta' \(lines 2 and 3\)"):
        strict_yaml.load("grpo:\n  beta: 0.1\n  beta: 0.2\n")


@pytest.mark.parametrize("text, walltime", [("1:30:00", "01:30:00"), ("45:00", "00:45:00"), ("'2:00:00'", "02:00:00")])
def test_a_walltime_stays_the_text_it_was(hpcrl, text, walltime):
    (hpcrl.work / "r.yaml").write_text(f"resources:\n  time: {text}\n")
    proc = hpcrl("render", "--site", "testbed", "r.yaml", "--run-dir", "run")
    assert proc.returncode == 0, proc.stderr
    assert f"#SBATCH --time={walltime}\n" in (hpcrl.work / "run" / "job.sbatch").read_text()


def test_a_walltime_override_stays_text_too(hpcrl):
    proc = hpcrl("render", "--site", "testbed", "resources.time=1:30:00", "--run-dir", "run")
    assert proc.returncode == 0, proc.stderr
    assert "#SBATCH --time=01:30:00\n" in (hpcrl.work / "run" / "job.sbatch").read_text()


def test_the_rest_of_yaml_is_as_safe_load_reads_it():
    text = "base: &b {lr: 1.0e-6, steps: 10}\nrun:\n  <<: *b\n  steps: 20\nflag: true\nn: 0x10\nx: 1_000\nnone: null\n"
    import yaml

    assert strict_yaml.load(text) == yaml.safe_load(text)


def test_the_output_directory_is_never_the_base_model(hpcrl):
    """Issue #26, item 4: checkpoint.output_dir equal to model.path overwrote the base model."""
    from hpcrl.compute.models.tiny import make_tiny_model

    model = make_tiny_model(hpcrl.work / "base", size="tiny", seed=0)
    for out in ("base", "base/trained", "."):
        proc = hpcrl("render", "--site", "testbed", f"model.path={model}", f"checkpoint.output_dir={out}",
                     "--run-dir", "run")
        assert proc.returncode == 2 and "which the run's model would overwrite" in proc.stderr, proc.stderr
        assert not (hpcrl.work / "run").exists()


def test_an_output_directory_that_cannot_be_written_is_refused_before_the_job(hpcrl, tmp_path):
    """Issue #26, item 8: an unwritable output directory was found after all the training. An
    immutable directory: not writable even for root, as CI runs."""
    import subprocess

    locked = tmp_path / "locked"
    locked.mkdir()
    if subprocess.run(["chattr", "+i", str(locked)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here")
    try:
        proc = hpcrl("render", "--site", "testbed", f"checkpoint.output_dir={locked / 'out'}", "--run-dir", "run")
        assert proc.returncode == 2 and f"checkpoint.output_dir (TRL's output_dir): {locked / 'out'} cannot be " \
            f"written: {locked}: Operation not permitted" in proc.stderr, proc.stderr
        assert not (hpcrl.work / "run").exists()
    finally:
        subprocess.run(["chattr", "-i", str(locked)])
