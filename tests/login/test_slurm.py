"""hpcrl.login.slurm: pure parsers on output captured from the Slurm 22.05.8 testbed (tests/data/slurm/),
fallbacks driven by fake Slurm commands on PATH, and `slurm`-marked tests against the real testbed."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import time
from pathlib import Path

import pytest
from conftest import REPO, TESTS

from hpcrl.login import slurm
from hpcrl.login.slurm import JobInfo, SlurmError, SlurmUnavailable

DATA = TESTS / "data" / "slurm"


@pytest.fixture(autouse=True)
def fresh_slurm_cache(monkeypatch):
    """Each test starts without the per-process "--json does not work here" memory."""
    monkeypatch.setattr(slurm, "_broken", set())


# ------------------------------------------------------------------------------ parse_slurm_time

@pytest.mark.parametrize("text, seconds", [
    ("1-02:03:04", 93784), ("05:00", 300), ("0:01", 1), ("30", 1800), ("1560", 93600),
    ("2:03:04", 7384), ("2-12", 216000), ("2-12:30", 217800), ("UNLIMITED", None),
    ("INFINITE", None), ("Partition_Limit", None), ("N/A", None), ("", None), (None, None),
])
def test_parse_slurm_time(text, seconds):
    assert slurm.parse_slurm_time(text) == seconds


# ------------------------------------------------------------------- squeue text, sacct JSON 22.05

def _by_name(jobs: dict[str, JobInfo]) -> dict[str, JobInfo]:
    return {j.name: j for j in jobs.values()}


def test_parse_squeue_text_22_05():
    # recorded by tests/data/slurm/record-squeue-text.sh with the format query() sends
    jobs = _by_name(slurm.parse_squeue_text((DATA / "squeue-22.05.txt").read_text()))
    ok, fail, held, cancelled, running = (jobs[n] for n in ("ok", "fail3", "held", "cancelme", "running"))
    d = "/tmp/slcap-dfie"
    assert (ok.state, ok.exit_code, ok.signal, ok.time_limit_s, ok.elapsed_s, ok.restarts) == (
        "COMPLETED", 0, 0, 300, 0, 0)
    assert ok.std_out == f"{d}/slurm-{ok.job_id}.out" and ok.work_dir == d and ok.node_list == "n1"
    assert ok.start_time == 1795586804 and ok.end_time == 1795586804 and ok.submit_time == 1795586803
    # exit_code is a raw wait status here: 768 = exit 3
    assert (fail.state, fail.reason, fail.exit_code, fail.signal) == ("FAILED", "NonZeroExitCode", 3, 0)
    assert (held.state, held.reason, held.start_time, held.exit_code, held.elapsed_s, held.end_time) == (
        "PENDING", "JobHeldUser", None, None, None, None)
    assert (cancelled.state, cancelled.exit_code, cancelled.signal, cancelled.elapsed_s) == ("CANCELLED", 0, 15, 2)
    # running: no exit code yet, EndTime (the limit) is not an end, 26 h limit
    assert (running.state, running.exit_code, running.end_time, running.time_limit_s, running.elapsed_s) == (
        "RUNNING", None, None, 93600, 4)
    assert (jobs["sig9"].exit_code, jobs["sig9"].signal) == (0, 9)              # kill -9 $$
    assert jobs["without"].std_out == f"{d}/out-{jobs['without'].job_id}.txt"   # -o out-%j.txt expanded
    assert jobs["without"].time_limit_s is None                                 # UNLIMITED
    # requeued (scontrol requeue): pending again, the requeue counted, its expected start not a start
    assert (jobs["rq"].restarts, jobs["rq"].state, jobs["rq"].reason, jobs["rq"].start_time) == (
        1, "PENDING", "BeginTime", None)
    ab = jobs["a|b"]                                  # the name is last: it may hold the separator
    assert ab.std_out == f"{d}/a/out-a|b-{ab.job_id}.log"


def test_parse_sacct_json_22_05_counts_a_requeued_jobs_earlier_attempts_as_restarts():
    # recorded: a job requeued once (scontrol requeue) that then completed. 22.05 has no restart_cnt,
    # but writes a record for each attempt; `hpcrl status` shows the count once squeue forgets the job.
    [job] = slurm.parse_sacct_json((DATA / "sacct-22.05-requeued.json").read_text()).values()
    assert (job.state, job.restarts) == ("COMPLETED", 1)


def test_parse_sacct_text_counts_a_requeued_jobs_earlier_attempts_as_restarts():
    text = ("9|REQUEUED|None|4|5|1|n1|0:0|/tmp|1795232068|1795232068|1795232072|rq\n"
            "9|REQUEUED|BeginTime|30|5|1|n1|0:0|/tmp|1795232072|1795232083|1795232113|rq\n"
            "9|COMPLETED|BeginTime|8|5|1|n1|0:0|/tmp|1795232113|1795232124|1795232132|rq\n")
    job = slurm.parse_sacct_text(text)["9"]
    assert (job.state, job.restarts) == ("COMPLETED", 2)


def test_parse_sacct_json_22_05():
    jobs = slurm.parse_sacct_json((DATA / "sacct-22.05.json").read_text())
    assert (jobs["2"].state, jobs["2"].exit_code, jobs["2"].elapsed_s, jobs["2"].time_limit_s) == (
        "COMPLETED", 0, 1, 300)
    assert (jobs["4"].state, jobs["4"].reason, jobs["4"].node_list, jobs["4"].start_time) == (
        "PENDING", "JobHeldUser", "", None)
    assert jobs["5"].state == "CANCELLED"
    assert (jobs["6"].state, jobs["6"].end_time, jobs["6"].time_limit_s) == ("RUNNING", None, 93600)
    # Slurm 22.05's bug, kept on record: the job exited 3 but sacct --json says 0 (sacct -P: "3:0").
    # query() re-reads such jobs from the text output.
    assert (jobs["3"].state, jobs["3"].exit_code) == ("FAILED", 0)


def test_parse_sacct_json_nothing_found_is_empty():
    assert slurm.parse_sacct_json((DATA / "sacct-22.05-nothing-found.json").read_text()) == {}


# ----------------------------------------------------- the same fields as Slurm 23.02+ writes them

NEWER_SACCT = {"meta": {}, "errors": [], "jobs": [{
    "job_id": 561, "name": "grpo", "state": {"current": ["TIMEOUT"], "reason": "None"},
    "exit_code": {"status": ["SIGNALED"], "return_code": {"set": False, "infinite": False, "number": 0},
                  "signal": {"id": {"set": True, "infinite": False, "number": 15}, "name": "SIGTERM"}},
    "time": {"elapsed": 3600, "start": 1700000000, "end": 1700003600, "submission": 1699999000,
             "limit": {"set": True, "infinite": False, "number": 60}},
    "nodes": "c1", "allocation_nodes": 1, "working_directory": "/home/dev", "restart_cnt": 1,
    "stdout_expanded": "/home/dev/slurm-561.out"}]}


def test_parse_newer_json_shapes():
    a = slurm.parse_sacct_json(json.dumps(NEWER_SACCT))["561"]
    assert (a.state, a.exit_code, a.signal, a.time_limit_s, a.restarts, a.std_out) == (
        "TIMEOUT", 0, 15, 3600, 1, "/home/dev/slurm-561.out")


# --------------------------------------------------------------------------- text output (22.05)

SQUEUE_TEXT = """\
2|COMPLETED|None|0:01|5:00|1|n1|0|0|dev|/tmp/slcap|/tmp/slcap/slurm-2.out|1795232068|1795232068|1795232069|ok
11|PENDING|JobHeldUser|0:00|UNLIMITED|1||0|0|dev|/tmp/slcap|/tmp/slcap/a/out-%u-%x-%j.log|1795232192|N/A|N/A|a|b
6|RUNNING|None|1-00:00:34|1-02:00:00|1|n1|0|2|dev|/tmp/slcap|/tmp/slcap/slurm-6.out|1795232068|1795232068|1795325668|running
12|FAILED|NonZeroExitCode|0:03|5:00|1|n1|3:0|0|dev|/tmp/slcap|/tmp/slcap/slurm-12.out|1795232068|1795232068|1795232071|c
"""

SACCT_TEXT = """\
3|FAILED|None|0|UNLIMITED|1|n1|3:0|/tmp/slcap|1795232068|1795232068|1795232068|fail3
4|PENDING|JobHeldUser|0|Partition_Limit|1|None assigned|0:0|/tmp/slcap|1795232068|Unknown|Unknown|held
5|CANCELLED by 0|None|3|UNLIMITED|1|n1|0:0|/tmp/slcap|1795232068|1795232068|1795232071|cancelme
7|FAILED|None|0|UNLIMITED|1|n1|0:9|/tmp/slcap|1795232097|1795232097|1795232097|sig9
8|RUNNING|None|81|1|1|n1|0:0|/tmp/slcap|1795232097|1795232097|Unknown|tlim
"""


def test_parse_squeue_text():
    jobs = slurm.parse_squeue_text(SQUEUE_TEXT)
    assert (jobs["2"].state, jobs["2"].time_limit_s, jobs["2"].elapsed_s, jobs["2"].end_time) == (
        "COMPLETED", 300, 1, 1795232069)
    assert (jobs["2"].exit_code, jobs["2"].signal) == (0, 0)
    held = jobs["11"]
    assert (held.state, held.reason, held.start_time, held.name) == ("PENDING", "JobHeldUser", None, "a|b")
    assert held.std_out == "/tmp/slcap/a/out-dev-a|b-11.log"
    assert (jobs["6"].elapsed_s, jobs["6"].time_limit_s, jobs["6"].end_time, jobs["6"].restarts) == (
        86434, 93600, None, 2)
    assert (jobs["12"].exit_code, jobs["12"].signal) == (3, 0)    # "rc:sig", as other releases may print


def test_parse_sacct_text():
    jobs = slurm.parse_sacct_text(SACCT_TEXT)
    assert (jobs["3"].state, jobs["3"].exit_code, jobs["3"].signal) == ("FAILED", 3, 0)
    assert (jobs["4"].reason, jobs["4"].node_list, jobs["4"].start_time, jobs["4"].time_limit_s) == (
        "JobHeldUser", "", None, None)
    assert jobs["5"].state == "CANCELLED"
    assert (jobs["7"].exit_code, jobs["7"].signal) == (0, 9)
    assert (jobs["8"].exit_code, jobs["8"].elapsed_s, jobs["8"].end_time, jobs["8"].time_limit_s) == (
        None, 81, None, 60)


def test_jobinfo_dict_round_trip():
    info = slurm.parse_sacct_text(SACCT_TEXT)["3"]
    d = info.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert JobInfo.from_dict({**d, "from_a_newer_hpcrl": 1}) == info
    assert info.finished and not slurm.parse_sacct_text(SACCT_TEXT)["8"].finished


# --------------------------------------------------------------- fake Slurm commands on PATH

def _fake_bin(tmp_path, monkeypatch, system_path=True, **scripts):
    """Put shell scripts named after Slurm commands first on PATH (system_path=False: alone)."""
    bindir = tmp_path / "bin"
    bindir.mkdir(parents=True)
    for name, body in scripts.items():
        f = bindir / name
        f.write_text("#!/bin/sh\n" + body)
        f.chmod(f.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin" if system_path else str(bindir))
    return bindir


def test_command_not_found_is_unavailable(tmp_path, monkeypatch):
    _fake_bin(tmp_path, monkeypatch, system_path=False)
    with pytest.raises(SlurmUnavailable, match="sbatch: command not found"):
        slurm.submit(tmp_path / "x.sh", tmp_path)
    with pytest.raises(SlurmUnavailable, match="scontrol"):
        slurm.query(["1"])
    assert slurm.ping() is False


def test_hung_command_times_out(tmp_path, monkeypatch):
    _fake_bin(tmp_path, monkeypatch, sbatch="exec /bin/sleep 30\n")
    monkeypatch.setenv("HPCRL_SLURM_TIMEOUT", "1")
    t0 = time.monotonic()
    with pytest.raises(SlurmUnavailable, match="no answer within 1 s"):
        slurm.submit(tmp_path / "x.sh", tmp_path)
    assert time.monotonic() - t0 < 5


def test_submit_parses_cluster_suffix_and_errors(tmp_path, monkeypatch):
    _fake_bin(tmp_path, monkeypatch, sbatch='echo "$PWD $*" > args; echo "4242;cluster1"\n')
    assert slurm.submit(Path("/x/job.sh"), tmp_path, ["--hold"]) == "4242"
    assert (tmp_path / "args").read_text().strip() == f"{tmp_path} --parsable --hold /x/job.sh"
    _fake_bin(tmp_path / "b", monkeypatch,
              sbatch='echo "sbatch: error: Batch job submission failed: '
                     'Invalid partition name specified" >&2; exit 1\n')
    with pytest.raises(SlurmError, match="Invalid partition name") as e:
        slurm.submit(Path("/x/job.sh"), tmp_path)
    assert not isinstance(e.value, SlurmUnavailable) and "\n" not in str(e.value)


def test_squeue_text_and_sacct_text_fallback(tmp_path, monkeypatch):
    # squeue is asked in text, for the ids asked (-j); a Slurm without the JSON plugin: sacct --json
    # fails once, and sacct's text output is used from then on
    squeue_line = SQUEUE_TEXT.splitlines()[0].replace("|0|0|dev|", "||0|dev|")   # no exit code printed
    sacct_text = SACCT_TEXT + "2|COMPLETED|None|1|5|1|n1|0:0|/tmp/slcap|1795232068|1795232068|1795232069|ok\n"
    no_json = 'case "$*" in *--json*) echo "{}" >&2; exit 1;; esac; echo "$*" >> "$0.calls"; '
    bindir = _fake_bin(tmp_path, monkeypatch,
                       scontrol='echo "Slurmctld(primary) at head is UP"\n',
                       squeue=no_json.format("squeue: unrecognized option '--json'") + f'echo "{squeue_line}"\n',
                       sacct=no_json.format("sacct: fatal: Unable to find plugin: serializer/json")
                       + f"cat <<EOF\n{sacct_text}EOF\n")
    for _ in range(2):
        got = slurm.query(["2", "3"])
        # state and stdout from squeue, exit code from sacct (squeue printed none)
        assert (got["2"].state, got["2"].exit_code, got["2"].std_out) == (
            "COMPLETED", 0, "/tmp/slcap/slurm-2.out")
        assert (got["3"].state, got["3"].exit_code) == ("FAILED", 3)
    assert slurm._broken == {"sacct --json"}
    calls = (bindir / "squeue.calls").read_text().splitlines()
    assert len(calls) == 2 and "-O" in calls[0] and "-j 2,3" in calls[0]
    assert len((bindir / "sacct.calls").read_text().splitlines()) == 2


def test_accounting_disabled_uses_job_completion_log(tmp_path, monkeypatch):
    _fake_bin(tmp_path, monkeypatch,
              scontrol='echo "Slurmctld(primary) at head is UP"\n',
              squeue='echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1\n',
              sacct='case "$*" in *-c*) echo "3|FAILED||0|UNLIMITED|1|n1|3:0|/w|1|2|3|fail3";; '
                    '*) echo "Slurm accounting storage is disabled" >&2; exit 1;; esac\n')
    got = slurm.query(["3", "4"])
    assert (got["3"].state, got["3"].exit_code) == ("FAILED", 3)
    assert (got["4"].state, got["4"].reason) == ("UNKNOWN", "not known to squeue or sacct")
    assert "sacct" in slurm._broken


# ------------------------------------------------------------------------ the real testbed

def _submit(tmp_path: Path, body: str, *sbatch_args: str) -> str:
    script = tmp_path / f"job-{time.monotonic_ns()}.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH -o out-%j.txt\n#SBATCH -n 1 --mem=100M\n{body}\n")
    return slurm.submit(script, tmp_path, ["-J", "hpcrl-test", *sbatch_args])


def _wait(job_id: str, done=lambda i: i.finished, timeout: float = 120, how=slurm.query) -> JobInfo:
    deadline = time.monotonic() + timeout
    while True:
        info = how([job_id]).get(job_id) or JobInfo(job_id)
        if done(info) or time.monotonic() > deadline:
            return info
        time.sleep(0.3)


@pytest.mark.slurm
def test_testbed_completed_job(testbed, tmp_path):
    job = _submit(tmp_path, "echo hello from $SLURM_JOB_ID", "-t", "5")
    info = _wait(job)
    assert (info.state, info.exit_code, info.signal) == ("COMPLETED", 0, 0), info
    assert info.time_limit_s == 300 and info.work_dir == str(tmp_path) and info.nodes == 1
    assert info.std_out == str(tmp_path / f"out-{job}.txt")
    assert Path(info.std_out).read_text().strip() == f"hello from {job}"
    assert info.start_time and info.end_time and info.submit_time and info.elapsed_s is not None
    assert info.restarts == 0


@pytest.mark.slurm
def test_testbed_exit_3_is_failed(testbed, tmp_path):
    job = _submit(tmp_path, "exit 3")
    info = _wait(job)
    assert (info.state, info.exit_code, info.signal) == ("FAILED", 3, 0), info
    # once slurmctld forgets the job, sacct answers; 22.05's JSON says 0 there, and we fix it
    acct = _wait(job, how=slurm._from_sacct, timeout=30)
    assert (acct.state, acct.exit_code) == ("FAILED", 3), acct
    slurm._broken.add("sacct --json")
    assert slurm._from_sacct([job])[job].exit_code == 3


@pytest.mark.slurm
def test_testbed_held_then_cancelled(testbed, tmp_path):
    job = _submit(tmp_path, "true", "--hold")
    info = _wait(job, done=lambda i: i.state == "PENDING" and i.reason == "JobHeldUser", timeout=30)
    assert (info.state, info.reason, info.exit_code, info.start_time) == (
        "PENDING", "JobHeldUser", None, None)
    slurm.cancel(job)
    info = _wait(job)
    assert info.state == "CANCELLED", info
    slurm.cancel(job)   # again: already over, not an error


@pytest.mark.slurm
def test_testbed_requeue_is_counted(testbed, tmp_path):
    # the requeue count `hpcrl status` shows (RESTARTS) comes from squeue's RestartCnt
    job = _submit(tmp_path, "sleep 300", "--requeue")
    try:
        _wait(job, done=lambda i: i.state == "RUNNING", timeout=60)
        slurm._run(["scontrol", "requeue", job])
        info = _wait(job, done=lambda i: i.state == "PENDING", timeout=60)   # COMPLETING first
        assert (info.restarts, info.state, info.exit_code) == (1, "PENDING", None), info
    finally:
        slurm.cancel(job)
    # and once slurmctld forgets the job, from sacct: JSON and text count the attempts' records
    acct = _wait(job, done=lambda i: i.state == "CANCELLED", how=slurm._from_sacct, timeout=30)
    assert (acct.state, acct.restarts) == ("CANCELLED", 1), acct
    assert slurm._sacct_text([job])[job].restarts == 1


@pytest.mark.slurm
def test_testbed_unknown_job(testbed):
    assert slurm.query(["987654321"])["987654321"].state == "UNKNOWN"
    assert slurm.ping() is True


@pytest.mark.slurm
def test_testbed_controller_unreachable(testbed, tmp_path, monkeypatch):
    # a copy of the testbed's config pointing at a closed port; the shared testbed keeps running
    etc = tmp_path / "etc"
    shutil.copytree(Path(testbed).parent, etc)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = etc / "slurm.conf"
    lines = [f"SlurmctldPort={port}" if ln.startswith("SlurmctldPort=") else ln
             for ln in conf.read_text().splitlines()]
    conf.write_text("\n".join(lines) + "\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))
    t0 = time.monotonic()
    with pytest.raises(SlurmUnavailable, match="scontrol ping"):
        slurm.query(["1"])
    assert time.monotonic() - t0 < 3
    assert slurm.ping() is False
    monkeypatch.setenv("HPCRL_SLURM_TIMEOUT", "2")   # sbatch retries for ~9 s before giving up
    t0 = time.monotonic()
    with pytest.raises(SlurmUnavailable):
        _submit(tmp_path, "true")
    assert time.monotonic() - t0 < 5


def test_no_heavy_imports():
    import subprocess
    import sys
    code = ("import sys, hpcrl.login.slurm, hpcrl.login.registry; "
            "print(sorted(m for m in ('torch', 'vllm', 'mpi4py', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.stdout.strip() == "[]"
