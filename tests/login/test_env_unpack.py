"""The staged Python environment's unpack on a node (site.stage.python_env), as the script renders it,
run here: srun and sbcast are stood in by one-node shell functions (the testbed runs the real ones:
tests/e2e/test_e2e_slurm.py). A node-local disk that outlives jobs keeps what an earlier job
unpacked: the same tarball is used as it is, another one replaces it whole, and a directory hpcrl did
not fill is refused. Unpacks into one directory take turns, for at most site.stage.unpack_wait_s."""

from __future__ import annotations

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
    return script[start:script.index('HPCRL_PYTHON="$HPCRL_ENV_DEST/bin/python"', start)]


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


def _tarball(path: Path, files: dict[str, str]) -> Path:
    content = path.with_suffix(".d")
    for name, text in files.items():
        (content / name).parent.mkdir(parents=True, exist_ok=True)
        (content / name).write_text(text)
    subprocess.run(["tar", "-czf", str(path), "-C", str(content), "."], check=True)
    return path


def test_an_environment_is_unpacked_once_then_used_as_it_is_and_replaced_whole(stage, tmp_path):
    first = _tarball(tmp_path / "env1.tar.gz", {"bin/python": "1", "lib/old.py": "old"})
    r = stage(first)
    assert r.returncode == 0, r.stderr
    dest = stage.dest
    assert (dest / "bin" / "python").read_text() == "1" and (dest / "lib" / "old.py").is_file()
    assert (dest / ".hpcrl-env").read_text().startswith(f"{first} ")
    assert not list(dest.parent.glob("*.tar")), "the job's copy of the tarball stays on the node"
    # The next job with the same tarball unpacks nothing (a file it would have replaced stays).
    (dest / "bin" / "python").write_text("touched")
    r = stage(first)
    assert r.returncode == 0 and "the Python environment is already staged at " in r.stdout, r
    assert (dest / "bin" / "python").read_text() == "touched"
    # Another tarball (the environment's packages changed): no file of the old one stays.
    second = _tarball(tmp_path / "env2.tar.gz", {"bin/python": "2", "lib/new.py": "new"})
    r = stage(second)
    assert r.returncode == 0, r.stderr
    assert (dest / "bin" / "python").read_text() == "2" and (dest / "lib" / "new.py").is_file()
    assert not (dest / "lib" / "old.py").exists()


def test_a_directory_hpcrl_did_not_fill_is_refused_and_left_alone(stage, tmp_path):
    stage.dest.mkdir(parents=True)
    (stage.dest / "notes.txt").write_text("mine")
    r = stage(_tarball(tmp_path / "env.tar.gz", {"bin/python": "1"}))
    assert r.returncode == 1, r
    assert f"hpcrl: site.stage.dest: {stage.dest} on " in r.stderr
    assert "holds files hpcrl did not stage: name a new or empty directory" in r.stderr
    assert sorted(p.name for p in stage.dest.iterdir()) == ["notes.txt"]


def test_a_failed_unpack_is_redone_by_the_next_job(stage, tmp_path):
    broken = tmp_path / "env.tar.gz"
    broken.write_bytes(b"not a tarball")
    r = stage(broken)
    assert r.returncode == 1 and "unpacking" in r.stderr and "failed on a node" in r.stderr, r
    good = _tarball(tmp_path / "good.tar.gz", {"bin/python": "1"})
    r = stage(good)
    assert r.returncode == 0 and (stage.dest / "bin" / "python").read_text() == "1", r.stderr


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
