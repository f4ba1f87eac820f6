"""The registry + Slurm + the run directory -> what a person sees: the logic `hpcrl status`, `logs`
and `cancel` share (hpcrl.login.commands holds the commands themselves).

Fast on a loaded login node with a thousand registered jobs: one squeue call for the jobs still
alive (finished jobs keep the final state the registry recorded, and are not asked about again), one
registry transaction for what Slurm said, one small read per listed job still running or recently
ended (its metrics tail, and a stat of failure.txt; an older job's row is kept in the registry, see
SHOWN_AFTER_S), no torch, no jinja2, no YAML, no recipe or spec.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from hpcrl.login import slurm
from hpcrl.job import metric_keys as mk
from hpcrl.job.errors import UserError
from hpcrl.login.registry import Registry
from hpcrl.job.rundir import FAILURE_FILE, HEARTBEAT_FILE, METRICS_FILE, read_failure, slurm_output


def last_json_line(path: str | os.PathLike, max_bytes: int = 65536) -> dict | None:
    """The last complete JSON line of a file, reading only its tail."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return json.loads(line)
        except ValueError:
            continue       # a line being written right now
    return None


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def latest_metrics(run_dir: str | os.PathLike) -> dict:
    """Step, reward, tokens/s and last sync time: the trainer's last metrics line ({} before the first).
    (os.path, not pathlib: this runs once per listed job.)"""
    return last_json_line(os.path.join(run_dir, METRICS_FILE)) or {}


def progress(run_dir: str) -> dict:
    """The latest metrics, plus the heartbeat (with every node's server health: tens of KB at
    hundreds of nodes, so only the one-job view reads it)."""
    return {"metrics": latest_metrics(run_dir), "heartbeat": read_json(Path(run_dir) / HEARTBEAT_FILE) or {}}


def finished(state: dict) -> bool:
    """Whether a state (a dict of JobInfo fields, as the registry keeps it) is one a job never leaves."""
    return state.get("state") in slurm.FINISHED_STATES


# slurm.query's reason for an id that squeue and sacct both answered about, and neither knows.
NO_RECORD = "not known to squeue or sacct"


def settled(state: dict) -> bool:
    """Whether Slurm need not be asked about a job again: it ended, or Slurm has no record of it at
    all, not even in accounting (the cluster's state was reset, the registry came from elsewhere).
    Asking about those again costs an sacct call (a slurmdbd round trip, ~0.1 s) on every status."""
    return finished(state) or (state.get("state") == "UNKNOWN" and state.get("reason") == NO_RECORD)


def refresh(registry: Registry, records) -> tuple[dict[str, dict], str | None]:
    """Current Slurm state of each record (dicts of JobInfo fields), and a warning when Slurm did not
    answer (then the registry's last known state is shown). One query for all the jobs not settled,
    however many there are."""
    states = {r.job_id: (r.last_state or {}) for r in records}
    alive = [r.job_id for r in records if not settled(r.last_state or {})]
    if not alive:
        return states, None
    try:
        fresh = slurm.query(alive)
    except slurm.SlurmError as e:
        seen = [r.state_seen_at for r in records if r.state_seen_at]
        when = time.strftime("%H:%M:%S", time.localtime(max(seen))) if seen else "never"
        return states, f"warning: Slurm did not answer ({e}); showing last known states (as of {when})"
    updates = {}
    for job_id, info in fresh.items():
        if info.state == "UNKNOWN" and states.get(job_id):
            continue        # Slurm forgot the job (aged out, accounting down): keep what we knew
        new = info.to_dict()
        # sacct has no requeue count; once a job leaves squeue keep the count squeue last gave.
        new["restarts"] = max(new.get("restarts") or 0, (states.get(job_id) or {}).get("restarts") or 0)
        updates[job_id] = states[job_id] = new
    registry.update_states(updates, time.time())
    return states, None


# Shown in place of RUNNING (or COMPLETING): Slurm keeps a job there for minutes after a node died
# (until srun's kill-on-bad-exit and the epilogs are through), when its tasks already said why.
FAILING = "FAILING"


def recorded_failure(run_dir: str, after: float | None = None, before: float | None = None) -> str | None:
    """read_failure, where failure.txt was written (its mtime) at or after ``after`` and before
    ``before`` (unix seconds, Slurm's times; None: no bound). A stat first: most jobs have none."""
    try:
        written = os.stat(os.path.join(run_dir, FAILURE_FILE)).st_mtime
    except OSError:
        return None
    if (after is not None and written < after) or (before is not None and written >= before):
        return None
    return read_failure(run_dir)


def failing(state: dict, run_dir: str) -> str | None:
    """The reason of a job Slurm still calls RUNNING or COMPLETING whose tasks already recorded a
    failure, else None. Only a failure.txt written since the job (re)started counts: the batch
    script removes an earlier attempt's at its start, which may come minutes after Slurm's."""
    if state.get("state") not in ("RUNNING", "COMPLETING") or not state.get("start_time"):
        return None
    return recorded_failure(run_dir, after=state["start_time"])


def explain(state: dict, run_dir: str) -> str:
    """One line on why a job is where it is: Slurm's reason while it waits; after an unsuccessful
    end, the job's own first fatal line (which rank, node and role, and what happened)."""
    name = state.get("state", "UNKNOWN")
    if name == "PENDING":
        return state.get("reason", "")
    if name in ("CANCELLED", "TIMEOUT"):
        # A failure recorded before the end is the cause (a person or Slurm ended a job that had
        # already failed); one recorded at the end is the tasks' echo of being killed.
        why = recorded_failure(run_dir, before=state.get("end_time"))
        if name == "CANCELLED":
            return f"{why}; then cancelled" if why else "cancelled (scancel, or an administrator)"
        return (f"{why}; then reached its time limit" if why else
                "reached its time limit without checkpointing on the warning signal "
                "(see the log; `hpcrl submit --resume RUN_DIR` continues from the last checkpoint)")
    if finished(state) and name != "COMPLETED":
        why = read_failure(run_dir)
        if why:
            return why
        if name == "NODE_FAIL":
            return "a node failed (Slurm NODE_FAIL)"
        if name == "OUT_OF_MEMORY":
            return "a task ran out of memory (Slurm OUT_OF_MEMORY)"
        return f"no task recorded a reason (exit code {state.get('exit_code')}); see the log"
    return failing(state, run_dir) or ""


# What a row takes from the job's run directory (the last metrics line; after a failure, the first
# line of failure.txt) stops changing when the job ends, so `status` keeps it in the registry with
# the final state (under SHOWN) and lists old jobs without opening their files: of a 1,000-job list,
# ~15 ms of ~60 (scripts/bench_cli.py). Only once the job ended SHOWN_AFTER_S ago: the run directory
# is written on compute nodes through a shared file system, whose caches on this node may lag their
# last writes for a while, and the end time is slurmctld's clock, not this node's.
SHOWN = "shown"
SHOWN_AFTER_S = 60.0
_SHOWN_FIELDS = ("step", "reward", "tokens_per_s", "sync_s", "reason")


def job_row(record, state: dict) -> dict:
    """One line of `hpcrl status`: of a job's run directory the list reads its metrics tail (and the
    failure.txt of a job that failed, or is failing), never the heartbeat; nothing once the registry
    keeps the row. "state" is Slurm's, or FAILING (then "slurm_state" is Slurm's)."""
    shown = state.get(SHOWN)
    if shown is None:
        m = latest_metrics(record.run_dir_text)
        shown = {"step": m.get(mk.STEP), "reward": m.get(mk.REWARD), "tokens_per_s": m.get(mk.TOKENS_PER_S),
                 "sync_s": m.get(mk.SYNC_S), "reason": explain(state, record.run_dir_text)}
    slurm_state = state.get("state", "UNKNOWN")
    # explain's reason for a RUNNING job is the failure its tasks recorded (a kept row is settled)
    shown_state = FAILING if slurm_state in ("RUNNING", "COMPLETING") and shown["reason"] else slurm_state
    return {
        "job_id": record.job_id, "name": record.name, "site": record.site,
        "state": shown_state, "slurm_state": slurm_state, "reason": shown["reason"],
        "elapsed_s": state.get("elapsed_s"), "time_limit_s": state.get("time_limit_s"),
        "nodes": state.get("nodes"), "restarts": state.get("restarts", 0), "exit_code": state.get("exit_code"),
        "step": shown["step"], "reward": shown["reward"], "tokens_per_s": shown["tokens_per_s"],
        "sync_s": shown["sync_s"], "run_dir": record.run_dir_text,
    }


def job_rows(registry: Registry, records, states: dict[str, dict]) -> list[dict]:
    """job_row of each record (states: from refresh); the rows of jobs that ended SHOWN_AFTER_S ago
    or more are kept in the registry, in one transaction, for the next `status`."""
    now = time.time()
    rows, keep = [], {}
    for record in records:
        state = states[record.job_id]
        row = job_row(record, state)
        rows.append(row)
        # `state is record.last_state`: the state was settled before this refresh, and is the one
        # the registry holds as of record.state_seen_at (amend_states writes only over that one).
        if (SHOWN not in state and state is record.last_state and settled(state)
                and now - (state.get("end_time") or record.state_seen_at or now) >= SHOWN_AFTER_S):
            keep[record.job_id] = ({**state, SHOWN: {k: row[k] for k in _SHOWN_FIELDS}}, record.state_seen_at)
    if keep:
        registry.amend_states(keep)
    return rows


def find_record(registry: Registry, job_id: str):
    """The registry's record of a job; a job it does not know is the user's mistake."""
    record = registry.get(job_id)
    if record is None:
        raise UserError(f"job {job_id!r} is not in the registry (see `hpcrl status`)")
    return record


def log_path(record, state: dict) -> Path | None:
    """The job's Slurm output file: what Slurm says, else the newest slurm-<id>.out in the run dir."""
    if state.get("std_out") and Path(state["std_out"]).is_file():
        return Path(state["std_out"])
    candidate = slurm_output(record.run_dir, record.job_id)
    return candidate if candidate.is_file() else None
