"""What `hpcrl status` says when a job goes wrong: a job Slurm still calls RUNNING whose tasks already
recorded a failure, a cancelled job that had failed first, engines whose last health word was
"serving" when the job ended, and a registry file that is not a usable database. Real run
directories and registries on tmp_path, fake Slurm commands first on PATH (no testbed)."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import time

import pytest

from hpcrl.login import cli, slurm
from hpcrl.login.registry import Registry

FAILURE = "2025-06-01T12:00:00 rank 7 (node 1, server) was killed by SIGKILL\n"
REASON = "rank 7 (node 1, server) was killed by SIGKILL"


@pytest.fixture(autouse=True)
def _fresh_slurm_module(monkeypatch):
    monkeypatch.setattr(slurm, "_broken", set())


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """scontrol, squeue, sacct and sbatch first on PATH. squeue prints squeue.txt (set it with the
    returned function, a line per job); sbatch logs that it ran and refuses."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    scripts = {"scontrol": 'echo "Slurmctld(primary) at head is UP"\n',
               "squeue": f"cat {tmp_path}/squeue.txt\n",
               "sacct": """echo '{"errors": [], "jobs": []}'\n""",
               "sbatch": f"echo sbatch >> {tmp_path}/sbatch.log\nexit 1\n"}
    for name, body in scripts.items():
        f = bindir / name
        f.write_text("#!/bin/sh\n" + body)
        f.chmod(f.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")
    (tmp_path / "squeue.txt").write_text("")

    def say(job_id: str, state: str, start: float, run_dir) -> None:
        """squeue's line (slurm.SQUEUE_FORMAT, epoch times) for one job in `state`, started at `start`."""
        (tmp_path / "squeue.txt").write_text(
            f"{job_id}|{state}|None|5:00|2:00:00|2|n[1-2]|0|0|root|{run_dir}|{run_dir}/slurm-%j.out|"
            f"{int(start) - 60}|{int(start)}|{int(start) + 7200}|job{job_id}\n")
    return say


def _job(tmp_path, job_id: str, failure_written_at: float | None = None):
    """A registered job with a run directory; failure.txt written at the given time (unix s)."""
    run_dir = tmp_path / "runs" / job_id
    run_dir.mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 3, "reward": 0.5}) + "\n")
    if failure_written_at is not None:
        (run_dir / "failure.txt").write_text(FAILURE)
        os.utime(run_dir / "failure.txt", (failure_written_at, failure_written_at))
    Registry().add(job_id, f"job{job_id}", "testbed", run_dir, run_dir / "job.sbatch")
    return run_dir


def _ended(job_id: str, state: str, end: float, code: int = 0) -> dict:
    """The state the registry keeps for a job Slurm saw end at `end` (not asked about again)."""
    return {"job_id": job_id, "name": f"job{job_id}", "state": state, "reason": "", "elapsed_s": 600,
            "time_limit_s": 7200, "nodes": 2, "node_list": "n[1-2]", "exit_code": code, "signal": 0,
            "restarts": 0, "work_dir": "", "std_out": "", "submit_time": end - 700, "start_time": end - 600,
            "end_time": end}


def _row(out: str, job_id: str) -> str:
    return next(line for line in out.splitlines() if line.split()[:1] == [job_id])


# ------------------------------------------------------------------------- a job that is failing

@pytest.mark.parametrize("slurm_state", ["RUNNING", "COMPLETING"])
def test_a_running_job_whose_tasks_recorded_a_failure_shows_failing(hpcrl_home, tmp_path, fake_slurm, capsys,
                                                                    slurm_state):
    now = time.time()
    run_dir = _job(tmp_path, "71", failure_written_at=now - 10)
    fake_slurm("71", slurm_state, now - 300, run_dir)

    assert cli.main(["status"]) == 0
    row = _row(capsys.readouterr().out, "71")
    assert "FAILING" in row and slurm_state not in row and REASON in row

    assert cli.main(["status", "71"]) == 0
    out = capsys.readouterr().out
    assert f"state      FAILING (Slurm still says {slurm_state})" in out
    assert f"why        {REASON}" in out

    assert cli.main(["status", "71", "--json"]) == 0
    detail = json.loads(capsys.readouterr().out)
    assert (detail["state"], detail["slurm_state"], detail["reason"]) == ("FAILING", slurm_state, REASON)
    assert detail["slurm"]["state"] == slurm_state


def test_an_earlier_attempts_failure_does_not_make_a_running_job_failing(hpcrl_home, tmp_path, fake_slurm, capsys):
    # Requeued and started again 5 minutes ago; the script has not yet removed the old failure.txt.
    now = time.time()
    run_dir = _job(tmp_path, "72", failure_written_at=now - 3600)
    fake_slurm("72", "RUNNING", now - 300, run_dir)
    assert cli.main(["status", "72", "--json"]) == 0
    detail = json.loads(capsys.readouterr().out)
    assert (detail["state"], detail["reason"]) == ("RUNNING", "")

    (run_dir / "failure.txt").unlink()          # the script's first act: a healthy running job
    assert cli.main(["status"]) == 0
    row = _row(capsys.readouterr().out, "72")
    assert "RUNNING" in row and "FAILING" not in row


# --------------------------------------------------------------- why a job that ended, ended

@pytest.mark.parametrize("state, then", [("CANCELLED", "; then cancelled"),
                                         ("TIMEOUT", "; then reached its time limit")])
def test_a_failure_recorded_before_the_end_is_the_cause(hpcrl_home, tmp_path, capsys, state, then):
    end = time.time() - 30
    _job(tmp_path, "73", failure_written_at=end - 120)
    Registry().update_state("73", _ended("73", state, end), end)
    assert cli.main(["status"]) == 0
    row = _row(capsys.readouterr().out, "73")
    assert state in row and f"{REASON}{then}" in row

    assert cli.main(["status", "73"]) == 0
    assert f"why        {REASON}{then}" in capsys.readouterr().out


def test_a_failure_recorded_at_the_cancel_is_not_its_cause(hpcrl_home, tmp_path, capsys):
    # scancel kills the tasks; one of them records how it died: an echo of the cancel.
    end = time.time() - 30
    _job(tmp_path, "74", failure_written_at=end + 1)
    Registry().update_state("74", _ended("74", "CANCELLED", end), end)
    assert cli.main(["status", "74", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["reason"] == "cancelled (scancel, or an administrator)"


@pytest.mark.parametrize("state", ["FAILED", "NODE_FAIL", "OUT_OF_MEMORY"])
def test_a_failed_job_shows_its_recorded_failure(hpcrl_home, tmp_path, capsys, state):
    end = time.time() - 30
    _job(tmp_path, "75", failure_written_at=end - 5)
    Registry().update_state("75", _ended("75", state, end, code=1), end)
    assert cli.main(["status"]) == 0
    row = _row(capsys.readouterr().out, "75")
    assert f"{state}(1)" in row and REASON in row


# ------------------------------------------------------------------- engines of a job that ended

def _heartbeat(run_dir, states: list[str]) -> None:
    """The trainers' heartbeat with one engine per node, each health file's last word in `states`."""
    servers = {f"{node}/0": {"node": node, "engine_index": 0, "state": s, "weight_version": 3}
               for node, s in enumerate(states)}
    (run_dir / "heartbeat.json").write_text(json.dumps({"time": time.time(), "step": 3, "servers": servers}))


def test_engines_of_an_ended_job_are_stopped_not_serving(hpcrl_home, tmp_path, capsys):
    end = time.time() - 30
    run_dir = _job(tmp_path, "76", failure_written_at=end - 60)
    _heartbeat(run_dir, ["serving", "syncing", "finished"])
    Registry().update_state("76", _ended("76", "NODE_FAIL", end, code=1), end)

    assert cli.main(["status", "76"]) == 0
    servers = [line.strip() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("server ")]
    assert servers == ["server     node 0: stopped (last: serving) (weights v3)",
                       "server     node 1: stopped (last: syncing) (weights v3)",
                       "server     node 2: finished (weights v3)"]

    assert cli.main(["status", "76", "--json"]) == 0
    detail = json.loads(capsys.readouterr().out)
    assert detail["servers"]["0/0"] == "stopped (last: serving) (weights v3)"
    assert detail["heartbeat"]["servers"]["0/0"]["state"] == "serving"      # the file as written


def test_engines_of_a_running_job_show_their_health(hpcrl_home, tmp_path, fake_slurm, capsys):
    run_dir = _job(tmp_path, "77")
    _heartbeat(run_dir, ["serving", "syncing"])
    fake_slurm("77", "RUNNING", time.time() - 300, run_dir)
    assert cli.main(["status", "77"]) == 0
    out = capsys.readouterr().out
    assert "server     node 0: serving (weights v3)" in out and "server     node 1: syncing (weights v3)" in out


# ------------------------------------------------------------------------- a registry not usable

def _real_registry(path) -> None:
    with Registry(path) as reg:
        for i in range(500):
            reg.add(str(i), f"job{i}", "testbed", f"/runs/{i}", f"/runs/{i}/job.sbatch", submitted_at=float(i))


def _random_bytes(path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(os.urandom(8192))


def _truncated(path) -> None:
    _real_registry(path)
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 3])


def _damaged_pages(path) -> None:
    # The first page (the header and the schema) intact: the file opens, and fails on the first
    # read of a job.
    _real_registry(path)
    data = path.read_bytes()
    path.write_bytes(data[:4096] + bytes(len(data) - 4096))


def _other_schema(path) -> None:
    # An hpcrl registry's version, but a table of another shape (a hand edit, another program's file).
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY, what TEXT)")
    db.execute("PRAGMA user_version = 1")
    db.commit()
    db.close()


BROKEN = {"random bytes": _random_bytes, "truncated": _truncated, "damaged pages": _damaged_pages,
          "other schema": _other_schema}


@pytest.mark.parametrize("damage", BROKEN.values(), ids=BROKEN.keys())
@pytest.mark.parametrize("command", [["status"], ["status", "7"], ["cancel", "7"], ["logs", "7"]],
                         ids=" ".join)
def test_an_unusable_registry_is_one_line_naming_it_and_the_way_out(hpcrl_home, fake_slurm, capsys, damage,
                                                                    command):
    path = hpcrl_home / "registry.sqlite"
    damage(path)
    assert cli.main(command) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert str(path) in err and "move it aside" in err and "HPCRL_HOME" in err


def test_submit_to_an_unusable_registry_submits_nothing(hpcrl_home, tmp_path, fake_slurm, capsys):
    _random_bytes(hpcrl_home / "registry.sqlite")
    run_dir = tmp_path / "run"
    assert cli.main(["submit", "--site", "testbed", "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and str(hpcrl_home / "registry.sqlite") in err, err
    assert not (tmp_path / "sbatch.log").exists() and not run_dir.exists()


def test_an_unusable_registry_prints_no_traceback(hpcrl, tmp_path):
    _truncated(hpcrl.home / "registry.sqlite")
    r = hpcrl("status")
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("hpcrl: error: ") and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
