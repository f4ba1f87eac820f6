"""hpcrl.login.registry: a real SQLite file, written by more than one process at a time."""

from __future__ import annotations

import multiprocessing
import sqlite3
from pathlib import Path

import pytest

from hpcrl.login.registry import Record, Registry, RegistryError, _on_network_fs, default_path


@pytest.fixture
def reg(tmp_path):
    r = Registry(tmp_path / "registry.sqlite")
    yield r
    r.close()


def test_add_get_list_remove(reg, tmp_path):
    rec = reg.add("101", "gsm8k-grpo", "testbed", tmp_path / "run1", tmp_path / "run1" / "job.sbatch",
                  submitted_at=1000.0)
    assert rec == reg.get("101")
    assert isinstance(rec, Record) and rec.run_dir == tmp_path / "run1" and rec.last_state is None
    reg.add(102, "second", "testbed", "/r2", "/r2/job.sbatch", submitted_at=2000.0)
    reg.add("103", "third", "other", "/r3", "/r3/job.sbatch")          # now: newest
    assert [r.job_id for r in reg.list()] == ["103", "102", "101"]
    assert [r.job_id for r in reg.list(limit=2)] == ["103", "102"]
    assert reg.get("999") is None
    assert reg.remove("102") is True and reg.remove("102") is False
    assert [r.job_id for r in reg.list()] == ["103", "101"]
    with pytest.raises(Exception):
        rec.name = "x"            # frozen


def test_same_job_id_again_replaces(reg):
    # a reset cluster (or testbed) hands out job ids again; the newest submission is the real one
    reg.add("1", "old", "testbed", "/old", "/old/s", submitted_at=1.0)
    reg.update_state("1", {"state": "COMPLETED"}, seen_at=2.0)
    reg.add("1", "new", "testbed", "/new", "/new/s", submitted_at=3.0)
    rec = reg.get("1")
    assert (rec.name, rec.last_state, rec.state_seen_at) == ("new", None, None)
    assert len(reg.list()) == 1


def test_update_state_keeps_the_newest_answer(reg):
    reg.add("7", "j", "s", "/r", "/r/s")
    info = {"job_id": "7", "state": "RUNNING", "exit_code": None, "elapsed_s": 12}
    assert reg.update_state("7", info, seen_at=100.0)
    assert not reg.update_state("7", {"job_id": "7", "state": "PENDING"}, seen_at=50.0)   # stale
    rec = reg.get("7")
    assert (rec.last_state, rec.state_seen_at) == (info, 100.0)
    assert reg.update_state("7", {"job_id": "7", "state": "COMPLETED", "exit_code": 0}, seen_at=200.0)
    assert reg.get("7").last_state["state"] == "COMPLETED"
    assert not reg.update_state("nope", info, seen_at=1.0)


def test_state_from_slurm_jobinfo_round_trips(reg):
    from hpcrl.login.slurm import JobInfo

    info = JobInfo("8", name="n", state="FAILED", exit_code=3, signal=0, time_limit_s=300)
    reg.add("8", "n", "s", "/r", "/r/s")
    reg.update_state("8", info.to_dict(), seen_at=1.0)
    assert JobInfo.from_dict(reg.get("8").last_state) == info


def test_persists_with_schema_version_and_wal(tmp_path):
    path = tmp_path / "sub" / "registry.sqlite"      # parent directories are created
    with Registry(path) as r:
        r.add("1", "j", "s", "/r", "/r/s")
    with Registry(path) as r:
        assert r.get("1").name == "j"
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == 1
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    db.close()


def test_newer_schema_is_refused(tmp_path):
    path = tmp_path / "registry.sqlite"
    Registry(path).close()
    db = sqlite3.connect(path)
    db.execute("PRAGMA user_version = 99")
    db.close()
    with pytest.raises(RegistryError, match="newer"):
        Registry(path)


def test_not_a_database(tmp_path):
    path = tmp_path / "registry.sqlite"
    path.write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(RegistryError, match="registry.sqlite"):
        Registry(path)


def test_default_path_follows_hpcrl_home(hpcrl_home, monkeypatch):
    assert default_path() == hpcrl_home / "registry.sqlite"
    with Registry() as r:
        r.add("1", "j", "s", "/r", "/r/s")
    assert (hpcrl_home / "registry.sqlite").is_file()
    monkeypatch.delenv("HPCRL_HOME")
    assert default_path() == Path.home() / ".local" / "share" / "hpcrl" / "registry.sqlite"


def test_network_filesystem_detection(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/sda1 / ext4 rw 0 0\n"
                      "nas:/export/home /home nfs4 rw 0 0\n"
                      "tmpfs /home/scratch tmpfs rw 0 0\n")
    assert _on_network_fs(Path("/home/alice/.local/share/hpcrl"), str(mounts))
    assert not _on_network_fs(Path("/home/scratch/x"), str(mounts))      # longest mount wins
    assert not _on_network_fs(Path("/homework"), str(mounts))
    assert not _on_network_fs(Path("/x"), str(tmp_path / "no-such-file"))


def _writer(path: str, prefix: str, n: int, both_ready) -> None:
    # a separate process, as a second `hpcrl` command would be; both create the file at once
    both_ready.wait(60)
    with Registry(path) as r:
        for i in range(n):
            r.add(f"{prefix}{i}", f"job {i}", "testbed", f"/runs/{prefix}{i}", f"/runs/{prefix}{i}/s")
            r.update_state(f"{prefix}{i}", {"state": "PENDING"})
            r.list(limit=5)


def test_two_processes_writing_at_once_lose_nothing(tmp_path):
    path = str(tmp_path / "registry.sqlite")
    ctx = multiprocessing.get_context("spawn")
    both_ready = ctx.Barrier(2)
    procs = [ctx.Process(target=_writer, args=(path, p, 100, both_ready)) for p in ("a-", "b-")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    with Registry(path) as r:
        jobs = r.list()
    assert len(jobs) == 200
    assert {j.job_id for j in jobs} == {f"{p}{i}" for p in ("a-", "b-") for i in range(100)}
    assert all(j.last_state == {"state": "PENDING"} for j in jobs)


def _opener(path, barrier, errors):
    barrier.wait()
    try:
        with Registry(path):
            pass
    except Exception as e:          # noqa: BLE001 (the test reports it)
        errors.put(str(e))


def test_many_processes_opening_a_new_registry_at_once():
    """Setting WAL on a new database takes an exclusive lock that SQLite does not wait for: six
    first-time `hpcrl` commands at once used to fail with "database is locked" (every run of this test)."""
    import tempfile

    ctx = multiprocessing.get_context("fork")
    errors = ctx.Queue()
    for _ in range(40):
        path = str(Path(tempfile.mkdtemp()) / "registry.sqlite")
        barrier = ctx.Barrier(6)
        procs = [ctx.Process(target=_opener, args=(path, barrier, errors)) for _ in range(6)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
    assert errors.empty(), errors.get()


def test_update_states_is_one_call_for_many_jobs(reg):
    for i in range(3):
        reg.add(str(i), f"j{i}", "testbed", f"/r{i}", f"/r{i}/s", submitted_at=float(i))
    reg.update_state("2", {"job_id": "2", "state": "RUNNING"}, seen_at=300.0)
    got = reg.update_states({str(i): {"job_id": str(i), "state": "COMPLETED"} for i in range(3)} |
                            {"nope": {"state": "RUNNING"}}, seen_at=200.0)
    assert got == ["0", "1"]              # "2" has a newer answer, "nope" is not registered
    assert [r.last_state["state"] for r in reg.list()] == ["RUNNING", "COMPLETED", "COMPLETED"]
    assert reg.update_states({}) == []
