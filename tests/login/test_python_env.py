"""site.stage.python_env "auto" and python_env_from_nodes (issue #27, item 7): at scale the job stages
the Python environment it runs from by default, packed once per state of its packages. The staged
job itself runs on the testbed: test_e2e_slurm.py (the TRL user's job on two nodes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.login import python_env

FRONTIER = ["--site", "frontier", "-A", "abc123"]


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A real virtual environment (no pip: seconds) with one package of its own."""
    prefix = tmp_path_factory.mktemp("envs") / "myenv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(prefix)], check=True)
    site_packages = next(prefix.glob("lib/python*/site-packages"))
    (site_packages / "mypkg.py").write_text("WHERE = __file__\n")
    return prefix


def _render(hpcrl, *args):
    r = hpcrl("render", *args)
    assert r.returncode == 0, r.stderr
    run_dir = Path(r.stdout.splitlines()[0].split(":", 1)[1].strip())
    return run_dir, (run_dir / "job.sbatch").read_text(), r.stderr


def test_frontier_stages_the_environment_it_runs_from_at_8_nodes_and_more(hpcrl, venv):
    python = str(venv / "bin" / "python")
    run_dir, script, _ = _render(hpcrl, *FRONTIER, "-N", "7", f"site.python={python}")
    assert "HPCRL_ENV_TAR" not in script and f"HPCRL_PYTHON={python}\n" in script
    run_dir, script, _ = _render(hpcrl, *FRONTIER, "-N", "8", f"site.python={python}")
    spec = json.loads((run_dir / "job.json").read_text())
    tarball = Path(spec["site"]["stage"]["python_env"])
    assert spec["python_env_source"] == str(venv)
    assert tarball.parent == run_dir.parent / ".python-env" and tarball.name.startswith("myenv-")
    assert not tarball.exists(), "the login node packed it: the job's batch step does"
    assert f"HPCRL_ENV_TAR={tarball}\n" in script and f"HPCRL_ENV_SOURCE={venv}\n" in script
    assert f'tar -cf "$HPCRL_ENV_PART" -C {venv} .' in script and 'HPCRL_PYTHON="$HPCRL_ENV_DIR/bin/python"' in script
    subprocess.run(["bash", "-n", str(run_dir / "job.sbatch")], check=True)
    # The next job of the same environment names the same tarball (and finds it packed).
    run_dir2, _, _ = _render(hpcrl, *FRONTIER, "-N", "64", f"site.python={python}")
    assert json.loads((run_dir2 / "job.json").read_text())["site"]["stage"]["python_env"] == str(tarball)


def test_plan_says_whether_the_job_stages_its_environment(hpcrl, venv):
    python = f"site.python={venv}/bin/python"
    below = hpcrl("plan", "--site", "frontier", "-N", "2", python)
    assert below.returncode == 0, below.stderr
    assert (f"python env: not staged: every task imports {venv}/bin/python's packages where they are; from 8 "
            f"nodes on, staged (site.stage.python_env_from_nodes)\n") in below.stdout, below.stdout
    at = hpcrl("plan", "--site", "frontier", "-N", "8", python, "--json")
    assert json.loads(at.stdout)["python_env"] == (
        f"python env: {venv} staged to each node's /mnt/bb/$USER/hpcrl-env (site.stage.python_env_from_nodes = 8, "
        f"this job has 8 nodes); packed by the first job into .python-env beside the run directory, reused until "
        f"its packages change")


def test_auto_refuses_an_interpreter_of_no_environment_and_the_count_only_warns(hpcrl, tmp_path):
    bare = tmp_path / "usr" / "bin" / "python3"        # no pyvenv.cfg, no conda-meta above it
    bare.parent.mkdir(parents=True)
    bare.symlink_to(sys._base_executable)
    r = hpcrl("render", *FRONTIER, f"site.python={bare}", "site.stage.python_env=auto")
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("hpcrl: error: site.stage.python_env: \"auto\" packs the job's Python environment, "
                               f"and {bare} is not in a virtual environment"), r.stderr
    assert list(hpcrl.work.iterdir()) == [] and "Traceback" not in r.stderr
    _, script, err = _render(hpcrl, *FRONTIER, "-N", "8", f"site.python={bare}")
    assert "HPCRL_ENV_TAR" not in script
    assert "warning: the Python environment is not staged to the nodes' local storage (site.stage." \
           f"python_env_from_nodes = 8, this job has 8 nodes): {bare} is not in a virtual environment" in err, err
    # In a container the image holds the environment.
    _, script, err = _render(hpcrl, *FRONTIER, "-N", "8", "site.python=python3",
                             "site.container.image=/lustre/orion/abc123/vllm.sif")
    assert "HPCRL_ENV_TAR" not in script and "whose environment is the image's" in err, err


def test_python_env_from_nodes_must_not_be_negative(hpcrl):
    r = hpcrl("render", *FRONTIER, "site.stage.python_env_from_nodes=-1")
    assert r.returncode == 2 and "site.stage.python_env_from_nodes: must be >= 0" in r.stderr, r.stderr


def test_the_tarball_is_named_after_the_state_of_the_packages(venv, tmp_path):
    before = python_env.fingerprint(venv)
    assert python_env.fingerprint(venv) == before
    extra = next(venv.glob("lib/python*/site-packages")) / "newpkg-1.0.dist-info"
    extra.mkdir()
    try:
        assert python_env.fingerprint(venv) != before
    finally:
        extra.rmdir()
    assert python_env.fingerprint(venv) == before


def test_a_packed_virtual_environment_runs_from_where_it_is_unpacked(venv, tmp_path):
    """What the script does with the tarball (hpcrl.login.python_env.pack_command, then tar -xf on each
    node): the copy's python takes its prefix, and its packages, from the copy."""
    part = tmp_path / "env.tar.part"
    subprocess.run([str(part) if w == python_env.PART else w for w in python_env.pack_command(str(venv))], check=True)
    dest = tmp_path / "node-local" / "env"
    dest.mkdir(parents=True)
    subprocess.run(["tar", "-xf", str(part), "-C", str(dest)], check=True)
    out = subprocess.run([str(dest / "bin" / "python"), "-c", "import sys, mypkg; print(sys.prefix); print(mypkg.WHERE)"],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == str(dest) and out[1].startswith(str(dest) + "/lib/"), out


def test_a_conda_environment_needs_conda_pack(tmp_path, monkeypatch):
    prefix = tmp_path / "conda-env"
    (prefix / "conda-meta").mkdir(parents=True)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    found, why = python_env.environment_of(str(prefix / "bin" / "python"))
    assert found is None and why == f"{prefix} is a conda environment, and conda-pack is not on PATH " \
                                    "(conda install conda-pack)"
