"""`hpcrl status`: every registered job in one table, or one job in detail.

Imports only the registry, slurm and the run-directory names (benchmarked by scripts/bench_cli.py
against a bare Python start and one squeue).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from hpcrl.job import metric_keys as mk
from hpcrl.job import rundir
from hpcrl.job.slurm_time import format_walltime
from hpcrl.login.registry import Registry
from hpcrl.login.status import (SHOWN, find_record, finished, job_row, job_rows, log_path, progress, refresh,
                                settled)
from hpcrl.login.table import print_table


def main(args) -> int:
    registry = Registry()
    if args.job_id:
        return _one(registry, args)
    records = registry.list(limit=args.limit)
    states, warning = refresh(registry, records)
    rows = job_rows(registry, records, states)
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
    print_table(header, [
        (r["job_id"], r["name"], r["site"], r["state"] + ("" if r["exit_code"] in (None, 0) else f"({r['exit_code']})"),
         f"{_fmt(r['elapsed_s'], format_walltime)}/{_fmt(r['time_limit_s'], format_walltime)}",
         _fmt(r["nodes"], "d"), str(r["restarts"]), _fmt(r["step"], "d"), _fmt(r["reward"], ".3f"),
         _fmt(r["tokens_per_s"], ".0f"), _fmt(r["sync_s"], ".3f"), r["reason"]) for r in rows])
    return 0


def _fmt(value, how) -> str:
    """"-" where Slurm or the metrics have no value yet; how: a format spec, or a formatter."""
    if value is None:
        return "-"
    return how(value) if callable(how) else format(value, how)


def _tail(path: Path, lines: int) -> list[str]:
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 64 * 1024))
        return f.read().decode(errors="replace").splitlines()[-lines:]


def _job(run_dir) -> dict:
    """The run's job.json as plain data: hpcrl.job.spec's dataclasses would double this command's
    start-up (scripts/bench_cli.py), and three fields are read."""
    try:
        return json.loads((Path(run_dir) / rundir.SPEC_FILE).read_text()) if run_dir else {}
    except (OSError, ValueError):
        return {}


def _model(run_dir, job: dict | None = None) -> str | None:
    """The run's final model directory, else its newest checkpoint-<step> one, else None."""
    if not run_dir:
        return None
    job = _job(run_dir) if job is None else job
    output_dir = job.get("recipe", {}).get("checkpoint", {}).get("output_dir") or ""
    final = rundir.model_dir(run_dir, output_dir=output_dir)
    if rundir.is_model_dir(final):
        return str(final)
    saved = rundir.model_checkpoint_steps(final)
    return str(rundir.model_dir(run_dir, saved[-1], output_dir)) if saved else None


def _balance(run_dir, job: dict) -> list[str]:
    """Per node, the trainers' wait for generation and the engine's idle time, then the advice on
    the split of GPUs (hpcrl.job.balance); [] before the first step."""
    try:
        gpus, inference = job["site"]["node"]["gpus"], job["recipe"]["inference"]
    except (KeyError, TypeError):
        return []
    from hpcrl.job.balance import from_run

    balance, lines = from_run(run_dir, gpus_per_node=gpus, server_gpus=inference.get("gpus", 1),
                              overlapped=bool(inference.get("overlap_generation") or inference.get("max_staleness")),
                              tensor_parallel_size=inference.get("tensor_parallel_size", 1))
    return lines + ([balance.advice()] if balance else [])


def _learning(run_dir, state: dict, job: dict) -> str | None:
    """metric_keys.learning_check of a job that has ended: "learned nothing: ..." or None. The
    metrics' tail answers for most runs (one step that changed the weights settles it); the whole
    file is read only when the tail learned nothing."""
    if not run_dir or not finished(state):
        return None
    groups = job.get("recipe", {}).get("grpo", {}).get("num_generations")
    vs_base = rundir.model_vs_base(run_dir)

    def check(lines: list[dict]) -> str | None:
        by_step = {m[mk.STEP]: m for m in lines if isinstance(m, dict) and isinstance(m.get(mk.STEP), int)}
        return mk.learning_check([by_step[s] for s in sorted(by_step)], groups, vs_base)

    return check(rundir.read_metrics(run_dir, max_bytes=256 * 1024)) and check(rundir.read_metrics(run_dir))


def _servers(heartbeat: dict, state: dict) -> dict[str, str]:
    """Each engine's state as shown, by rundir.server_key in order: the last word of its health file
    (as the heartbeat gathered it), which stays "serving" when the job ends without the engine saying
    goodbye (a node died, the job was cancelled). Once Slurm says the job is over, none is serving."""
    servers = heartbeat.get("servers") or {}
    over = settled(state)
    shown = {}
    for key, health in sorted(servers.items(), key=lambda kv: rundir.server_key_order(kv[0])):
        if not isinstance(health, dict):
            continue
        last = health.get("state", "?")
        text = f"stopped (last: {last})" if over and last != "finished" else last
        shown[key] = text + (f" (weights v{health['weight_version']})" if "weight_version" in health else "")
    return shown


def _one(registry: Registry, args) -> int:
    record = find_record(registry, args.job_id)
    states, warning = refresh(registry, [record])
    state = states[record.job_id]
    row = job_row(record, state)
    p = progress(record.run_dir)
    job = _job(record.run_dir)
    log = log_path(record, state)
    detail = {**row, "slurm": {k: v for k, v in state.items() if k != SHOWN}, "heartbeat": p["heartbeat"], "metrics": p["metrics"],
              "log": str(log) if log else None, "log_tail": _tail(log, 20) if log else [],
              "model": _model(record.run_dir, job), "balance": _balance(record.run_dir, job) if job else [],
              "learning": _learning(record.run_dir, state, job), "servers": _servers(p["heartbeat"], state)}
    if warning:
        print(warning, file=sys.stderr)
    if args.json:
        print(json.dumps(detail, indent=2))
        return 0
    print(f"job {row['job_id']}  {row['name']}  on {row['site']}")
    exit_text = "" if row["exit_code"] is None else f"  exit code {row['exit_code']}"
    slurm_text = "" if row["state"] == row["slurm_state"] else f" (Slurm still says {row['slurm_state']})"
    print(f"  state      {row['state']}{slurm_text}{exit_text}")
    if row["reason"]:
        print(f"  why        {row['reason']}")
    print(f"  time       {_fmt(row['elapsed_s'], format_walltime)} of {_fmt(row['time_limit_s'], format_walltime)}"
          f"   nodes {_fmt(row['nodes'], 'd')} {state.get('node_list', '')}   restarts {row['restarts']}")
    print(f"  run dir    {row['run_dir']}")
    if p["metrics"]:
        m = p["metrics"]
        print(f"  progress   step {m.get(mk.STEP)}  reward {_fmt(m.get(mk.REWARD), '.3f')}  "
              f"tokens/s {_fmt(m.get(mk.TOKENS_PER_S), '.0f')}  last sync {_fmt(m.get(mk.SYNC_S), '.3f')} s")
    if detail["learning"]:
        print(f"  learning   {detail['learning']}")
    if detail["model"]:
        print(f"  model      {detail['model']}")
    for line in detail["balance"]:
        print(f"  balance    {line}")
    servers = p["heartbeat"].get("servers") or {}
    engines = 1 + max((h.get("engine_index") or 0 for h in servers.values() if isinstance(h, dict)), default=0)
    for key, text in detail["servers"].items():
        node, _, engine = str(key).partition("/")       # rundir.server_key: "<node>/<engine>"
        where = f"node {node}" if engines == 1 else f"node {node} engine {engine}"
        print(f"  server     {where}: {text}")
    if log:
        print(f"  log        {log}")
        for line in detail["log_tail"]:
            print(f"    {line}")
    return 0
