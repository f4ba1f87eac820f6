"""The staged Python environment's unpack on a node (site.stage.python_env), as the script renders it,
run here: srun and sbcast are stood in by one-node shell functions (the testbed runs the real ones:
tests/e2e/test_e2e_slurm.py). A node-local disk that outlives jobs keeps what an earlier job
unpacked, a directory of site.stage.dest a tarball: the same tarball is used as it is, a new one of
the same name replaces it whole, tarballs of other names (the packages changed between two jobs) sit
side by side until no process runs from the older and nobody used it for an hour, and a dest hpcrl
did not fill is refused. Unpacks into one dest take turns, for at most site.stage.unpack_wait_s."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

# One node: each-node steps run here, sbcast is a copy, a failure ends the script in its line.
STAND_INS = """
hpcrl_each_node() { "$@"; }
sbcast() { cp "$2" "$3"; }
hpcrl_fail() { echo "$*" >&2; exit 1; }
SLURM_JOB_ID=42
"""


def _staging_block(script: str) -> str:
    """The script's lines from the tarball's name to the staged python's."""
    start = script.index("HPCRL_ENV_TAR=")
    return script[start:script.index('HPCRL_PYTHON="$HPCRL_ENV_DIR/bin/python"', start)]


@pytest.fixture
def stage(hpcrl, tmp_path):
    """Renders a Frontier job whose environment is `tarball`, staged to `dest`, and runs its staging block."""
    dest = tmp_path / "node-local" / "env"

    def run(tarball: Path, *overrides: str) -> subprocess.CompletedProcess:
        r = hpcrl("render", "--site", "frontier", "-A", "abc123", f"site.stage.python_env={tarball}",
                  f"site.stage.dest={dest}", *overrides)
        assert r.returncode == 0, r.stderr
        run_dir = Path(r.stdout.splitlines()[0].split(":", 1)[1].strip())
        block = _staging_block((run_dir / "job.sbatch").read_text())
        return subprocess.run(["bash", "-c", STAND_INS + block], capture_output=True, text=True, timeout=60)

    run.dest = dest
    return run


def _tarball(path: Path, files: dict[str, str], age_s: float = 0) -> Path:
    content = path.with_name(path.name + ".d")
    shutil.rmtree(content, ignore_errors=True)
    for name, text in files.items():
        (content / name).parent.mkdir(parents=True, exist_ok=True)
        (content / name).write_text(text)
    subprocess.run(["tar", "-czf", str(path), "-C", str(content), "."], check=True)
    if path.exists() and age_s:
        os.utime(path, (time.time() - age_s, time.time() - age_s))    # another id than the last file there
    return path


def _running_from(directory: Path) -> subprocess.Popen:
    """A process started as `directory`/bin/python is (a job's task), that sleeps."""
    return subprocess.Popen(["bash", "-c", 'exec -a "$0" sleep 60', str(directory / "bin" / "python")])


def _age(marker: Path, seconds: float) -> None:
    os.utime(marker, (time.time() - seconds, time.time() - seconds))


def test_an_environment_is_unpacked_once_then_used_as_it_is_and_replaced_whole(stage, tmp_path):
    tarball = _tarball(tmp_path / "env.tar.gz", {"bin/python": "1", "lib/old.py": "old"}, age_s=100)
    r = stage(tarball)
    assert r.returncode == 0, r.stderr
    env = stage.dest / "env"
    assert (env / "bin" / "python").read_text() == "1" and (env / "lib" / "old.py").is_file()
    assert (env / ".hpcrl-env").read_text().startswith(f"{tarball} ")
    assert not list(stage.dest.parent.glob("*.tar")), "the job's copy of the tarball stays on the node"
    # The next job with the same tarball unpacks nothing (a file it would have replaced stays).
    (env / "bin" / "python").write_text("touched")
    r = stage(tarball)
    assert r.returncode == 0 and f"the Python environment is already staged at {env}\n" in r.stdout, r
    assert (env / "bin" / "python").read_text() == "touched"
    # The tarball packed anew under its name: no file of the old one stays.
    _tarball(tarball, {"bin/python": "2", "lib/new.py": "new"})
    r = stage(tarball)
    assert r.returncode == 0, r.stderr
    assert (env / "bin" / "python").read_text() == "2" and (env / "lib" / "new.py").is_file()
    assert not (env / "lib" / "old.py").exists()
    # ... unless a process runs from the old one: refused, and left alone.
    running = _running_from(env)
    try:
        time.sleep(0.3)
        _tarball(tarball, {"bin/python": "3"}, age_s=50)
        r = stage(tarball)
    finally:
        running.kill()
    assert r.returncode == 1 and f"hpcrl: site.stage.dest: {env} on " in r.stderr, r
    assert (f"holds another tarball of the same name, which a running process (pid {running.pid}) uses: give this "
            f"one another file name") in r.stderr, r.stderr
    assert (env / "bin" / "python").read_text() == "2"


def test_environments_of_other_packages_sit_side_by_side_until_the_older_is_unused(stage, tmp_path):
    """Packages changed between two jobs (an auto-packed tarball's name carries their fingerprint):
    the second job must not remove the files the first runs from, and a node's disk must not fill up
    with every environment ever staged."""
    old = _tarball(tmp_path / "venv-aaaa.tar", {"bin/python": "old"})
    new = _tarball(tmp_path / "venv-bbbb.tar", {"bin/python": "new"})
    assert stage(old).returncode == 0 and stage(new).returncode == 0
    assert sorted(p.name for p in stage.dest.iterdir()) == [".hpcrl-envs", "venv-aaaa", "venv-bbbb"]
    _age(stage.dest / "venv-aaaa" / ".hpcrl-env", 2 * 3600)       # staged two hours ago ...
    running = _running_from(stage.dest / "venv-aaaa")             # ... and a job still runs from it
    try:
        time.sleep(0.3)
        r = stage(new)
        assert r.returncode == 0 and (stage.dest / "venv-aaaa" / "bin" / "python").read_text() == "old", r
    finally:
        running.kill()
        running.wait()
    r = stage(new)
    assert r.returncode == 0 and f"removed {stage.dest / 'venv-aaaa'}, an environment no process runs from" in r.stdout
    assert sorted(p.name for p in stage.dest.iterdir()) == [".hpcrl-envs", "venv-bbbb"]
    # Used by a job in the last hour (between its unpack and its first task): kept.
    assert stage(old).returncode == 0 and stage(new).returncode == 0
    assert (stage.dest / "venv-aaaa").is_dir()


def test_a_directory_hpcrl_did_not_fill_is_refused_and_left_alone(stage, tmp_path):
    stage.dest.mkdir(parents=True)
    (stage.dest / "notes.txt").write_text("mine")
    r = stage(_tarball(tmp_path / "env.tar.gz", {"bin/python": "1"}))
    assert r.returncode == 1, r
    assert f"hpcrl: site.stage.dest: {stage.dest} on " in r.stderr
    assert "holds files hpcrl did not stage: name a new or empty directory" in r.stderr
    assert sorted(p.name for p in stage.dest.iterdir()) == ["notes.txt"]
    assert not list(stage.dest.parent.glob("*.tar")), "the job's copy of the tarball stays on the node"


def test_a_failed_unpack_is_redone_by_the_next_job(stage, tmp_path):
    tarball = tmp_path / "env.tar.gz"
    tarball.write_bytes(b"not a tarball")
    r = stage(tarball)
    assert r.returncode == 1 and "unpacking" in r.stderr and "failed on a node" in r.stderr, r
    _tarball(tarball, {"bin/python": "1"}, age_s=100)
    r = stage(tarball)
    assert r.returncode == 0 and (stage.dest / "env" / "bin" / "python").read_text() == "1", r.stderr


def test_the_wait_for_another_unpack_is_bounded_and_named(stage, tmp_path):
    tarball = _tarball(tmp_path / "env.tar.gz", {"bin/python": "1"})
    stage.dest.parent.mkdir(parents=True)
    holder = subprocess.Popen(["flock", f"{stage.dest}.lock", "sleep", "30"])
    try:
        time.sleep(0.5)
        started = time.monotonic()
        r = stage(tarball, "site.stage.unpack_wait_s=1")
        assert time.monotonic() - started < 20
    finally:
        holder.kill()
    assert r.returncode == 1, r
    assert (f"hpcrl: staging the Python environment: a node waited 1 s for {stage.dest}.lock, held by another "
            f"unpack into {stage.dest} (site.stage.unpack_wait_s)") in r.stderr, r.stderr
    assert not stage.dest.exists()
