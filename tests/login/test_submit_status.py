"""`hpcrl submit` / `status` / `logs` / `cancel` against the real Slurm testbed."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from conftest import probe_rows

pytestmark = pytest.mark.slurm


@pytest.fixture(autouse=True)
def _cancel_leftovers():
    """Jobs a failed test leaves pending would hold the testbed for the next ones."""
    submitted.clear()
    yield
    for job_id in submitted:
        subprocess.run(["scancel", job_id], capture_output=True, timeout=10)


submitted: list[str] = []


def _submit(hpcrl, *args) -> tuple[str, Path]:
    r = hpcrl("submit", "--site", "testbed", *args)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip()
    submitted.append(job_id)
    assert job_id.isdigit(), r.stdout
    run_dir = Path(r.stderr.rsplit("run directory ", 1)[1].strip())
    return job_id, run_dir


def _wait_state(hpcrl, job_id, states, timeout=240) -> dict:
    deadline = time.time() + timeout
    while True:
        r = hpcrl("status", job_id, "--json")
        assert r.returncode == 0, r.stderr
        info = json.loads(r.stdout)
        if info["state"] in states:
            return info
        assert time.time() < deadline, f"job {job_id} still {info['state']} after {timeout}s"
        time.sleep(1)


def test_probe_job_completes_on_two_nodes(testbed, hpcrl):
    job_id, run_dir = _submit(hpcrl, "-N", "2", "mode=probe")
    info = _wait_state(hpcrl, job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    assert info["state"] == "COMPLETED" and info["exit_code"] == 0, info
    assert info["nodes"] == 2
    # Every task printed the placement row it took, and they are `hpcrl plan`'s rows.
    rows = [row["plan"] for row in probe_rows(run_dir)]
    plan = json.loads(hpcrl("plan", "--site", "testbed", "-N", "2", "--json").stdout)["tasks"]
    assert sorted(rows, key=lambda r: r["rank"]) == [{k: v for k, v in t.items() if k != "est_memory_gb"} for t in plan]
    # The list view shows it too, with its exit code.
    listing = hpcrl("status").stdout
    line = next(l for l in listing.splitlines() if l.startswith(job_id + " "))
    assert "COMPLETED" in line and "testbed" in line
    detail = hpcrl("status", job_id).stdout
    assert "exit code 0" in detail and "log" in detail


def test_failing_job_shows_failed_and_exit_code(testbed, hpcrl):
    job_id, _ = _submit(hpcrl, "mode=probe", "site.python=false")
    info = _wait_state(hpcrl, job_id, {"COMPLETED", "FAILED", "CANCELLED"})
    assert info["state"] == "FAILED" and info["exit_code"] == 1, info
    line = next(l for l in hpcrl("status").stdout.splitlines() if l.startswith(job_id + " "))
    assert "FAILED(1)" in line and "no task recorded a reason (exit code 1); see the log" in line, line


def test_pending_reason_then_cancel(testbed, hpcrl):
    recipe = hpcrl.work.parent / "later.yaml"
    recipe.write_text("mode: probe\nresources:\n  sbatch_options: ['--begin=now+3600']\n")
    job_id, _ = _submit(hpcrl, str(recipe))
    info = _wait_state(hpcrl, job_id, {"PENDING"}, timeout=20)
    deadline = time.time() + 20
    while info["reason"] in ("", "None") and time.time() < deadline:   # the scheduler sets it on its pass
        time.sleep(1)
        info = json.loads(hpcrl("status", job_id, "--json").stdout)
    assert info["reason"] == "BeginTime", info
    line = next(l for l in hpcrl("status").stdout.splitlines() if l.startswith(job_id + " "))
    assert "PENDING" in line and "BeginTime" in line
    r = hpcrl("cancel", job_id)
    assert r.returncode == 0, r.stderr
    info = _wait_state(hpcrl, job_id, {"CANCELLED"}, timeout=20)
    assert info["state"] == "CANCELLED"


def test_status_when_slurmctld_does_not_answer(testbed, hpcrl, tmp_path):
    recipe = hpcrl.work.parent / "later.yaml"
    recipe.write_text("mode: probe\nresources:\n  sbatch_options: ['--begin=now+3600']\n")
    job_id, _ = _submit(hpcrl, str(recipe))
    _wait_state(hpcrl, job_id, {"PENDING"}, timeout=20)
    # A copy of the config that points at a port nobody listens on: the controller "is down".
    conf_dir = tmp_path / "deadconf"
    conf_dir.mkdir()
    src = Path(testbed)
    for f in src.parent.iterdir():
        if f.is_file():
            shutil.copy(f, conf_dir / f.name)
    text = (conf_dir / "slurm.conf").read_text().replace("SlurmctldPort=6817", "SlurmctldPort=6999")
    (conf_dir / "slurm.conf").write_text(text)
    t0 = time.time()
    r = hpcrl("status", env={"SLURM_CONF": str(conf_dir / "slurm.conf")})
    assert time.time() - t0 < 10
    assert r.returncode == 0
    assert "warning: Slurm did not answer" in r.stderr and "last known" in r.stderr
    line = next(l for l in r.stdout.splitlines() if l.startswith(job_id + " "))
    assert "PENDING" in line
    hpcrl("cancel", job_id)


def test_logs_and_unknown_job(testbed, hpcrl):
    job_id, run_dir = _submit(hpcrl, "mode=probe")
    _wait_state(hpcrl, job_id, {"COMPLETED"})
    r = hpcrl("logs", job_id)
    assert r.returncode == 0 and '"hpcrl_probe"' in r.stdout
    r = hpcrl("status", "999999")
    assert r.returncode == 2 and "not in the registry" in r.stderr


def test_resume_renders_the_script_again_from_job_json(testbed, hpcrl):
    """A run directory written before the compute entry point moved names `python -m hpcrl.launch`
    in its job.sbatch, a module that is gone: --resume renders the script again from job.json, so
    the resumed job starts the current entry point (and runs)."""
    r = hpcrl("render", "--site", "testbed", "mode=probe")
    assert r.returncode == 0, r.stderr
    run_dir = Path(r.stdout.splitlines()[0].split(":", 1)[1].strip())
    script = run_dir / "job.sbatch"
    old = script.read_text().replace("-m hpcrl.compute.launch", "-m hpcrl.launch")
    assert "-m hpcrl.launch " in old
    script.write_text(old)
    r = hpcrl("submit", "--resume", str(run_dir))
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip()
    submitted.append(job_id)
    text = script.read_text()
    assert "-m hpcrl.compute.launch " in text and "-m hpcrl.launch" not in text
    assert script.stat().st_mode & 0o777 == 0o755
    info = _wait_state(hpcrl, job_id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"})
    assert info["state"] == "COMPLETED" and info["exit_code"] == 0, info


def test_concurrent_submits_register_every_job(testbed, hpcrl):
    import concurrent.futures as cf
    with cf.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda i: hpcrl("submit", "--site", "testbed", "mode=probe", "-J", f"conc{i}"), range(4)))
    ids = {r.stdout.strip() for r in results}
    assert all(r.returncode == 0 for r in results) and len(ids) == 4
    listed = json.loads(hpcrl("status", "--json").stdout)
    assert ids <= {row["job_id"] for row in listed}


def test_python_api_returns_a_submitit_handle(testbed, hpcrl, monkeypatch):
    """The API submits the same script `hpcrl render` writes and hands back a submitit job."""
    monkeypatch.chdir(hpcrl.work)
    from hpcrl.login import api

    # mode=control: no torch; the probe job itself is test_probe_job_completes_on_two_nodes.
    job = api.submit(site="testbed", overrides=["mode=control"], name="api-control")
    submitted.append(job.job_id)
    assert (Path(job.paths.folder) / "job.sbatch").is_file()
    deadline = time.time() + 240
    while not job.done(force_check=True):
        assert time.time() < deadline, job.state
        time.sleep(1)
    assert job.state == "COMPLETED"
    assert job.job_id in hpcrl("status").stdout
