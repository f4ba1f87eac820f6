"""`hpcrl status`, `logs`, `cancel`: the registry + Slurm + the run directory -> what a person sees.

Fast on a loaded login node: one squeue call for the jobs still alive (finished jobs keep the
final state the registry recorded), no torch, no rich, plain aligned text (grep/awk friendly).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from hpcrl.login import slurm
from hpcrl.job.errors import UserError
from hpcrl.login.registry import Registry
from hpcrl.job.rundir import HEARTBEAT_FILE, METRICS_FILE, read_failure, slurm_output

# A requeued job leaves these states; until then a final state is final and needs no new query.
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                          "BOOT_FAIL", "DEADLINE", "PREEMPTED"})


def last_json_line(path: Path, max_bytes: int = 65536) -> dict | None:
    """The last complete JSON line of a file, reading only its tail."""
    try:
        with path.open("rb") as f:
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


def progress(run_dir: str) -> dict:
    """Step, reward, tokens/s and last sync time from the trainer's metrics, plus the heartbeat."""
    d = Path(run_dir)
    return {"metrics": last_json_line(d / METRICS_FILE) or {}, "heartbeat": read_json(d / HEARTBEAT_FILE) or {}}


def _hms(seconds) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    text = f"{rest // 3600}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days}-{text}" if days else text


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def refresh(registry: Registry, records) -> tuple[dict[str, dict], str | None]:
    """Current Slurm state of each record (dicts of JobInfo fields), and a warning when Slurm did not
    answer (then the registry's last known state is shown)."""
    states = {r.job_id: (r.last_state or {}) for r in records}
    alive = [r.job_id for r in records if (r.last_state or {}).get("state") not in FINAL_STATES]
    if not alive:
        return states, None
    try:
        fresh = slurm.query(alive)
    except slurm.SlurmError as e:
        seen = [r.state_seen_at for r in records if r.state_seen_at]
        when = time.strftime("%H:%M:%S", time.localtime(max(seen))) if seen else "never"
        return states, f"warning: Slurm did not answer ({e}); showing last known states (as of {when})"
    now = time.time()
    for job_id, info in fresh.items():
        if info.state == "UNKNOWN" and states.get(job_id):
            continue        # Slurm forgot the job (aged out, accounting down): keep what we knew
        new = info.to_dict()
        # sacct has no requeue count; once a job leaves squeue keep the count squeue last gave.
        new["restarts"] = max(new.get("restarts") or 0, (states.get(job_id) or {}).get("restarts") or 0)
        states[job_id] = new
        registry.update_state(job_id, new, now)
    return states, None


def explain(state: dict, run_dir: str) -> str:
    """One line on why a job is where it is: Slurm's reason while it waits; after an unsuccessful
    end, the job's own first fatal line (which rank, node and role, and what happened)."""
    name = state.get("state", "UNKNOWN")
    if name == "PENDING":
        return state.get("reason", "")
    if name == "CANCELLED":
        return "cancelled (scancel, or an administrator)"
    if name == "TIMEOUT":
        return ("reached its time limit without checkpointing on the warning signal "
                "(see the log; `hpcrl submit --resume RUN_DIR` continues from the last checkpoint)")
    if name in FINAL_STATES and name != "COMPLETED":
        why = read_failure(run_dir)
        if why:
            return why
        if name == "NODE_FAIL":
            return "a node failed (Slurm NODE_FAIL)"
        if name == "OUT_OF_MEMORY":
            return "a task ran out of memory (Slurm OUT_OF_MEMORY)"
        return f"no task recorded a reason (exit code {state.get('exit_code')}); see the log"
    return ""


def job_row(record, state: dict) -> dict:
    p = progress(record.run_dir)
    m = p["metrics"]
    return {
        "job_id": record.job_id, "name": record.name, "site": record.site,
        "state": state.get("state", "UNKNOWN"), "reason": explain(state, record.run_dir),
        "elapsed_s": state.get("elapsed_s"), "time_limit_s": state.get("time_limit_s"),
        "nodes": state.get("nodes"), "restarts": state.get("restarts", 0), "exit_code": state.get("exit_code"),
        "step": m.get("step"), "reward": m.get("reward"), "tokens_per_s": m.get("tokens_per_s"),
        "sync_s": m.get("sync_s"), "run_dir": str(record.run_dir),
    }


def cmd_status(args) -> int:
    registry = Registry()
    if args.job_id:
        return _status_one(registry, args)
    records = registry.list(limit=args.limit)
    states, warning = refresh(registry, records)
    rows = [job_row(r, states[r.job_id]) for r in records]
    if warning:
        print(warning, file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no jobs registered (submit one with `hpcrl submit`)")
        return 0
    # REASON last: a failure's explanation is a sentence and would push every column after it.
    header = ("JOBID", "NAME", "SITE", "STATE", "TIME/LIMIT", "NODES", "RESTARTS",
              "STEP", "REWARD", "TOK/S", "SYNC_S", "REASON")
    table = [(r["job_id"], r["name"], r["site"], r["state"] + ("" if r["exit_code"] in (None, 0) else f"({r['exit_code']})"),
              f"{_hms(r['elapsed_s'])}/{_hms(r['time_limit_s'])}",
              _fmt(r["nodes"], "d"), str(r["restarts"]), _fmt(r["step"], "d"), _fmt(r["reward"], ".3f"),
              _fmt(r["tokens_per_s"], ".0f"), _fmt(r["sync_s"], ".3f"), r["reason"]) for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *table)]
    out = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in (header, *table)]
    sys.stdout.write("\n".join(out) + "\n")
    return 0


def _record(registry: Registry, job_id: str):
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


def _tail(path: Path, lines: int) -> list[str]:
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 64 * 1024))
        return f.read().decode(errors="replace").splitlines()[-lines:]


def _status_one(registry: Registry, args) -> int:
    record = _record(registry, args.job_id)
    states, warning = refresh(registry, [record])
    state = states[record.job_id]
    row = job_row(record, state)
    p = progress(record.run_dir)
    log = log_path(record, state)
    detail = {**row, "slurm": state, "heartbeat": p["heartbeat"], "metrics": p["metrics"],
              "log": str(log) if log else None, "log_tail": _tail(log, 20) if log else []}
    if warning:
        print(warning, file=sys.stderr)
    if args.json:
        print(json.dumps(detail, indent=2))
        return 0
    print(f"job {row['job_id']}  {row['name']}  on {row['site']}")
    exit_text = "" if row["exit_code"] is None else f"  exit code {row['exit_code']}"
    print(f"  state      {row['state']}{exit_text}")
    if row["reason"]:
        print(f"  why        {row['reason']}")
    print(f"  time       {_hms(row['elapsed_s'])} of {_hms(row['time_limit_s'])}   nodes {_fmt(row['nodes'], 'd')}"
          f" {state.get('node_list', '')}   restarts {row['restarts']}")
    print(f"  run dir    {row['run_dir']}")
    if p["metrics"]:
        m = p["metrics"]
        print(f"  progress   step {m.get('step')}  reward {_fmt(m.get('reward'), '.3f')}  "
              f"tokens/s {_fmt(m.get('tokens_per_s'), '.0f')}  last sync {_fmt(m.get('sync_s'), '.3f')} s")
    for node, health in sorted((p["heartbeat"].get("servers") or {}).items()):
        print(f"  server     node {node}: {health.get('state', '?')}" +
              (f" (weights v{health['weight_version']})" if "weight_version" in health else ""))
    if log:
        print(f"  log        {log}")
        for line in detail["log_tail"]:
            print(f"    {line}")
    return 0


def cmd_logs(args) -> int:
    registry = Registry()
    record = _record(registry, args.job_id)
    states, _ = refresh(registry, [record])
    log = log_path(record, states[record.job_id])
    if log is None:
        print(f"hpcrl: job {record.job_id} has no log yet", file=sys.stderr)
        return 1
    with log.open("rb") as f:
        sys.stdout.buffer.write(f.read())
        sys.stdout.flush()
        while args.follow:
            chunk = f.read()
            if chunk:
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
                continue
            states, _ = refresh(registry, [record])
            if states[record.job_id].get("state") in FINAL_STATES:
                sys.stdout.buffer.write(f.read())
                return 0
            time.sleep(1.0)
    return 0


def cmd_cancel(args) -> int:
    registry = Registry()
    record = _record(registry, args.job_id)
    try:
        slurm.cancel(record.job_id)
    except slurm.SlurmError as e:
        print(f"hpcrl: error: {e}", file=sys.stderr)
        return 1
    print(f"cancelled job {record.job_id} ({record.name})")
    return 0
