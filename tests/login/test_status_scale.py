"""`hpcrl status` at scale, against fake Slurm commands that log each call (no testbed, no timing:
scripts/bench_cli.py times it): a registry of 1,000 jobs, and the run directory of a 256-node job."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from hpcrl.login import cli, slurm
from hpcrl.login import status as status_mod
from hpcrl.login.registry import Registry

N_JOBS = 1000
NODES = 256
ALIVE = [str(900000 + i) for i in range(10)]          # running: Slurm is asked about them every time
NEVER_KNOWN = ["999999001", "999999002"]              # squeue and sacct know nothing of them
FAILURE = "2025-06-01T12:00:00 rank 7 (node 0, server) was killed by SIGKILL\n"


@pytest.fixture(autouse=True)
def _fresh_slurm_module(monkeypatch):
    monkeypatch.setattr(slurm, "_broken", set())


def _squeue_job(job_id: str, nodes: int = 2, work_dir: str = "/nonexistent") -> str:
    """One running job as `squeue -O slurm.SQUEUE_FORMAT` prints it (tests/data/slurm/squeue-22.05.txt)."""
    return (f"{job_id}|RUNNING|None|1:00|2:00:00|{nodes}|n[1-{nodes}]|0|0|root|{work_dir}|{work_dir}/slurm-%j.out|"
            f"1795232000|1795232068|1795239268|job{job_id}\n")


def _fake_slurm(tmp_path, monkeypatch, jobs: list[str]):
    """scontrol/squeue/sacct first on PATH; each appends its arguments to calls.log. squeue knows
    `jobs` (and prints them all, whatever -j asks: the filter is hpcrl's too); sacct knows nothing."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (tmp_path / "squeue.txt").write_text("".join(jobs))
    log = f'echo "$(basename "$0") $*" >> {tmp_path}/calls.log\n'
    scripts = {"scontrol": 'echo "Slurmctld(primary) at head is UP"\n',
               "squeue": f"cat {tmp_path}/squeue.txt\n",
               "sacct": """echo '{"errors": [], "jobs": []}'\n"""}
    for name, body in scripts.items():
        f = bindir / name
        f.write_text("#!/bin/sh\n" + log + body)
        f.chmod(f.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bindir}:/usr/bin:/bin")

    def calls() -> list[list[str]]:
        """Each call, in order; `scontrol ping` and squeue start together (slurm._from_squeue), so
        their lines land in either order: a ping is listed as "ping" right before its squeue."""
        path = tmp_path / "calls.log"
        got = [line.split() for line in path.read_text().splitlines()] if path.exists() else []
        pings = sum(c[0] == "scontrol" for c in got)
        got = [c for c in got if c[0] != "scontrol"]
        out = []
        for c in got:
            if c[0] == "squeue":
                out.append(["ping"])
            out.append(c)
        assert pings == sum(c[0] == "squeue" for c in got), "a ping without its squeue, or one more"
        return out
    return calls


def _asked(call: list[str]) -> set[str]:
    """The job ids a squeue/sacct call asked about (its -j list)."""
    return set(call[call.index("-j") + 1].split(","))


def _metrics(step: int) -> str:
    return json.dumps({"step": step, "reward": 0.5, "tokens_per_s": 900.0, "sync_s": 0.02}) + "\n"


def _finished(job_id: str, state: str, code: int) -> dict:
    return {"job_id": job_id, "name": f"old{job_id}", "state": state, "reason": "", "elapsed_s": 60,
            "time_limit_s": 3600, "nodes": 2, "node_list": "n[1-2]", "exit_code": code, "signal": 0,
            "restarts": 0, "work_dir": "", "std_out": "", "submit_time": 1, "start_time": 2, "end_time": 62}


@pytest.fixture
def thousand(hpcrl_home, tmp_path) -> Registry:
    """1,000 registered jobs, oldest first: finished ones with the state status stored when it saw
    them end (every third FAILED, with its failure.txt), two ids Slurm never had, and ALIVE newest."""
    reg = Registry()
    finished = N_JOBS - len(NEVER_KNOWN) - len(ALIVE)
    ids = [str(100000 + i) for i in range(finished)] + NEVER_KNOWN + ALIVE
    for i, job_id in enumerate(ids):
        run_dir = tmp_path / "runs" / job_id
        run_dir.mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text(_metrics(1) + _metrics(i))
        reg.add(job_id, f"job{job_id}", "testbed", run_dir, run_dir / "job.sbatch", submitted_at=1000.0 + i)
        if i < finished:
            failed = i % 3 == 0
            if failed:
                (run_dir / "failure.txt").write_text(FAILURE)
            reg.update_state(job_id, _finished(job_id, "FAILED" if failed else "COMPLETED", int(failed)), 5.0)
    return reg


def _rows(out: str) -> dict[str, str]:
    lines = out.splitlines()
    assert lines[0].startswith("JOBID")
    return {line.split()[0]: line for line in lines[1:]}


def test_listing_1000_jobs_asks_slurm_once_about_the_live_ones(thousand, tmp_path, monkeypatch, capsys):
    calls = _fake_slurm(tmp_path, monkeypatch, [_squeue_job(j) for j in ALIVE])
    assert cli.main(["status", "-n", str(N_JOBS)]) == 0
    rows = _rows(capsys.readouterr().out)
    assert len(rows) == N_JOBS
    # One ping, one squeue for every job not known to have ended, one sacct for those squeue did not
    # know: whatever the number of jobs. Nothing about the jobs the registry knows have ended.
    assert [c[0] for c in calls()] == ["ping", "squeue", "sacct"]
    assert _asked(calls()[1]) == {*ALIVE, *NEVER_KNOWN} and _asked(calls()[2]) == set(NEVER_KNOWN)
    assert "RUNNING" in rows[ALIVE[0]] and f" {N_JOBS - 1} " in rows[ALIVE[-1]]      # its step
    assert "UNKNOWN" in rows[NEVER_KNOWN[0]]
    assert "FAILED(1)" in rows["100000"] and "rank 7 (node 0, server) was killed by SIGKILL" in rows["100000"]
    assert "COMPLETED" in rows["100001"] and " 1 " in rows["100001"]
    assert thousand.get(ALIVE[0]).last_state["state"] == "RUNNING"
    assert thousand.get("100001").last_state["state"] == "COMPLETED"

    # Ids that neither squeue nor sacct knows are not asked about again (an sacct call each time);
    # the running jobs are, in one squeue again.
    assert cli.main(["status", "-n", str(N_JOBS)]) == 0
    rows = _rows(capsys.readouterr().out)
    assert len(rows) == N_JOBS and "UNKNOWN" in rows[NEVER_KNOWN[0]] and "RUNNING" in rows[ALIVE[0]]
    assert [c[0] for c in calls()[3:]] == ["ping", "squeue"] and _asked(calls()[4]) == set(ALIVE)


def test_default_listing_shows_and_asks_about_the_newest_50(thousand, tmp_path, monkeypatch, capsys):
    calls = _fake_slurm(tmp_path, monkeypatch, [_squeue_job(j) for j in ALIVE])
    thousand.add("42", "oldest-alive", "testbed", tmp_path, tmp_path / "job.sbatch", submitted_at=0.0)
    assert cli.main(["status"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert len(rows) == 50 and set(ALIVE) <= set(rows) and "42" not in rows
    assert [c[0] for c in calls()] == ["ping", "squeue", "sacct"]
    assert _asked(calls()[1]) == {*ALIVE, *NEVER_KNOWN}      # not 42: it is not shown

    # Slurm forgets jobs it had (aged out of slurmctld, accounting down): status keeps what it
    # knew, and asks again next time (unlike ids Slurm never had).
    (tmp_path / "squeue.txt").write_text("".join(_squeue_job(j) for j in ALIVE[:3]))
    for run in (2, 3):
        assert cli.main(["status"]) == 0
        rows = _rows(capsys.readouterr().out)
        assert "RUNNING" in rows[ALIVE[9]] and "UNKNOWN" in rows[NEVER_KNOWN[0]]
        squeue, sacct = calls()[-2:]
        assert _asked(squeue) == set(ALIVE) and _asked(sacct) == set(ALIVE[3:])
    assert len(calls()) == 9


def test_listing_reads_no_heartbeat(thousand, tmp_path, monkeypatch, capsys):
    # A heartbeat holds every node's server health (tens of KB at hundreds of nodes): only the
    # one-job view reads it, not each row of the list.
    _fake_slurm(tmp_path, monkeypatch, [_squeue_job(j) for j in ALIVE])
    monkeypatch.setattr(status_mod, "read_json", lambda path: pytest.fail(f"the list read {path}"))
    assert cli.main(["status", "-n", str(N_JOBS)]) == 0


def test_an_ended_jobs_row_is_kept_and_its_files_not_read_again(thousand, tmp_path, monkeypatch, capsys):
    """A job that ended SHOWN_AFTER_S ago keeps its row (metrics, failure line) in the registry:
    listing 1,000 old jobs opens only the files of those still running or just ended."""
    import time
    just_ended = "100001"          # ended a second ago: its run directory may still be settling
    thousand.update_state(just_ended, {**_finished(just_ended, "COMPLETED", 0), "end_time": int(time.time())}, 6.0)
    _fake_slurm(tmp_path, monkeypatch, [_squeue_job(j) for j in ALIVE])
    opened = []
    read = status_mod.last_json_line
    monkeypatch.setattr(status_mod, "last_json_line", lambda path, *a: opened.append(path) or read(path, *a))

    assert cli.main(["status", "-n", str(N_JOBS)]) == 0
    first = _rows(capsys.readouterr().out)
    assert len(opened) == N_JOBS
    kept = thousand.get("100000").last_state
    assert kept["shown"] == {"step": 0, "reward": 0.5, "tokens_per_s": 900.0, "sync_s": 0.02,
                             "reason": "rank 7 (node 0, server) was killed by SIGKILL"}
    assert kept["state"] == "FAILED" and thousand.get("100000").state_seen_at == 5.0
    # not kept: alive, just ended, or settled only by this status (seen now, not SHOWN_AFTER_S ago)
    for job_id in (ALIVE[0], just_ended, NEVER_KNOWN[0]):
        assert "shown" not in thousand.get(job_id).last_state, job_id

    # The kept rows come from the registry: the same table with the files gone.
    for job_id in ("100000", "100003"):
        for name in ("metrics.jsonl", "failure.txt"):
            (tmp_path / "runs" / job_id / name).unlink()
    opened.clear()
    assert cli.main(["status", "-n", str(N_JOBS)]) == 0
    assert _rows(capsys.readouterr().out) == first
    assert {Path(p).parent.name for p in opened} == {*ALIVE, *NEVER_KNOWN, just_ended}

    # `status JOBID --json` shows Slurm's state, not the kept row under it
    assert cli.main(["status", "100000", "--json"]) == 0
    detail = json.loads(capsys.readouterr().out)
    assert "shown" not in detail["slurm"] and detail["reason"] == kept["shown"]["reason"] and detail["step"] == 0


def test_amend_states_writes_only_over_the_state_it_read(hpcrl_home, tmp_path):
    reg = Registry()
    reg.add("1", "a", "testbed", tmp_path, tmp_path / "job.sbatch")
    reg.update_state("1", _finished("1", "COMPLETED", 0), 5.0)
    assert reg.amend_states({"1": ({"state": "COMPLETED", "shown": {}}, 4.0)}) == []     # not the one read
    assert reg.amend_states({"1": ({"state": "COMPLETED", "shown": {}}, 5.0)}) == ["1"]
    assert reg.get("1").last_state == {"state": "COMPLETED", "shown": {}} and reg.get("1").state_seen_at == 5.0
    reg.add("1", "b", "testbed", tmp_path, tmp_path / "job.sbatch")    # Slurm handed the id out again
    assert reg.amend_states({"1": ({"state": "COMPLETED", "shown": {}}, 5.0)}) == []
    assert reg.get("1").last_state is None


def test_one_job_of_256_nodes_shows_every_server(hpcrl_home, tmp_path, monkeypatch, capsys):
    """A 256-node job's run directory: one health file per node's server, and the trainers'
    heartbeat that gathers them (hpcrl.compute.train.role._server_health); two servers lag."""
    job_id, steps, lagging = "4242", 812, {5, 102}
    run_dir = tmp_path / "big"
    (run_dir / ".servers").mkdir(parents=True)
    servers = {}
    for node in range(NODES):
        health = {"node": node, "rank": 8 * node + 7, "state": "syncing" if node in lagging else "serving",
                  "engine": "vllm", "weight_version": steps - (node in lagging), "requests": 3 * steps,
                  "time": 1795232068.0, "pid": 4000 + node}
        (run_dir / ".servers" / f"node-{node}.json").write_text(json.dumps(health))
        servers[str(node)] = health
    heartbeat = {"time": 1795232068.0, "step": steps, "phase": "train", "pid": 41, "host": "n1", "servers": servers}
    (run_dir / "heartbeat.json").write_text(json.dumps(heartbeat, indent=1) + "\n")
    (run_dir / "metrics.jsonl").write_text("".join(_metrics(s) for s in range(1, steps + 1)))
    (run_dir / f"slurm-{job_id}.out").write_text("".join(f"step {s}\n" for s in range(1, steps + 1)))
    Registry().add(job_id, "big", "frontier", run_dir, run_dir / "job.sbatch")
    calls = _fake_slurm(tmp_path, monkeypatch, [_squeue_job(job_id, NODES, str(run_dir))])

    assert cli.main(["status", job_id, "--json"]) == 0
    detail = json.loads(capsys.readouterr().out)
    assert (detail["state"], detail["nodes"], detail["step"]) == ("RUNNING", NODES, steps)
    assert detail["heartbeat"]["servers"] == servers
    assert detail["log_tail"] == [f"step {s}" for s in range(steps - 19, steps + 1)]

    assert cli.main(["status", job_id]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.strip().startswith("server ")]
    shown = {int(line.split()[2].rstrip(":")): line.split(":", 1)[1].strip() for line in lines}
    assert len(lines) == NODES
    assert shown == {n: f"syncing (weights v{steps - 1})" if n in lagging else f"serving (weights v{steps})"
                     for n in range(NODES)}
    assert f"nodes {NODES} n[1-{NODES}]" in out and f"progress   step {steps}" in out
    assert [c[0] for c in calls()] == ["ping", "squeue"] * 2, calls()
