#!/usr/bin/env python
"""Wall time of the login-side commands against a bare Python start and one squeue, same run.

    SLURM_CONF=/tmp/hpcrl-testbed/etc/slurm.conf .venv/bin/python scripts/bench_cli.py \
        [--jobs 200] [--many 1000] [--alive 20] [--nodes 256] [--repeat 15]
    ... scripts/bench_cli.py --smoke     # that it runs (tests/e2e/test_bench_smoke.py): 3 jobs, 12 rows, 2 nodes, once

Times each command --repeat times, the commands taking turns, and reports medians. Last line:
worst_cli_over_python_start=X render_over_import_floor=R  (X: the largest ratio; the status rows are held
against python start + one squeue. R: hpcrl render over a start that imports jinja2 and hpcrl.job.spec,
the "(ref) import jinja2+spec" row: the median of 3 x --repeat ratios, each of one render and one
such start run back to back, in CPU time. CPU time is what each start computes, which a loaded
machine's scheduling (slurmctld digesting the submissions above) does not stretch as it does wall
time; pairs, because the load changes between rounds far more than within one. The table's medians
swung 1.10-1.37 between five runs of one tree at load averages 3-12)
Reference rows (not in X): a Python start that only imports jinja2, and one that also imports
hpcrl.job.spec (the recipe and site dataclasses): the floor under `hpcrl render`; the squeue query
status sends while a job it shows is alive (text, -O hpcrl.login.slurm.SQUEUE_FORMAT, -j the ids);
and the `squeue --json` it sent before (Slurm 22.05 ignores its -j and writes every job slurmctld
holds, so its cost follows the cluster's queue, printed above the table).

hpcrl's modules are byte-compiled first, as an installed package's are: with PYTHONDONTWRITEBYTECODE
set (as on this machine) a module edited since its .pyc was written is compiled from source on
every start, a few ms each, which no installed hpcrl pays.

What is real and what is synthesised (each registry is private: its own HPCRL_HOME):
  * "status (200 jobs)": --jobs real jobs (`sbatch --wrap true`), registered with the Registry API
    as `hpcrl submit` registers them, each with a run directory holding one metrics line.
  * "status (1000 jobs ...)": one registry of --many rows, newest first:
      - --alive real jobs held pending (`sbatch --hold`): every status asks Slurm about them;
      - the --jobs real jobs above (finished: status asks Slurm no more once it has seen that);
      - 3 ids Slurm never had (squeue and sacct know nothing of them: status shows them UNKNOWN,
        and once it has recorded that, asks no more);
      - the rest synthesised: rows added with the Registry API with a final state stored the way
        status stores what Slurm said (COMPLETED, FAILED with the failure.txt a job's tasks write,
        CANCELLED, TIMEOUT), as for the old jobs of a long-used registry. Their ids are not Slurm's.
    Every row's run directory holds a metrics.jsonl of a few steps in the trainer's line format.
    The default view shows the newest 50; `-n --many` shows them all.
  * "status JOBID (256 nodes)": a real job (held pending: status asks squeue about it, and a shared
    testbed loses no CPU to it) registered against a synthesised run directory of a --nodes-node
    Frontier job: job.json and job.sbatch from `hpcrl render --site frontier -N 256`, then what it writes,
    in the compute side's formats: .servers/node-<n>.json (each node's server health file),
    heartbeat.json (trainer rank 0's, holding every node's health), ranks.json (8 ranks a node),
    metrics.jsonl (2,000 steps), and its Slurm output slurm-<id>.out (--log-mb MB).
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchtable import print_table  # scripts/benchtable.py (this script's directory is on sys.path)

REPO = Path(__file__).resolve().parent.parent
RANKS_PER_NODE = 8          # Frontier: 7 trainers and the node's server (the last local rank)
UNKNOWN_IDS = ("999999001", "999999002", "999999003")   # beyond any id the testbed hands out


def timed(commands: dict[str, tuple[list[str], dict, Path]], repeat: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median wall time, and median CPU time (user + system), of each command (argv, env, cwd). The
    commands take turns, one run each per round, so that a change in the machine's load (other work
    on a shared VM) reaches every row alike."""
    wall: dict[str, list[float]] = {name: [] for name in commands}
    cpu: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(repeat):
        for name, (cmd, env, cwd) in commands.items():
            c0, t0 = _children_cpu(), time.perf_counter()
            r = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(_children_cpu() - c0)
            if r.returncode != 0:
                sys.exit(f"bench_cli: {' '.join(cmd)} failed: {r.stderr.decode().strip()}")
    return ({name: statistics.median(s) for name, s in wall.items()},
            {name: statistics.median(s) for name, s in cpu.items()})


def paired_ratios(command: tuple[list[str], dict, Path], baseline: tuple[list[str], dict, Path],
                  pairs: int) -> list[float]:
    """CPU time of ``command`` over ``baseline``'s, each pair run back to back (which goes first
    alternates): the machine's load changes between rounds, far less within a pair."""
    ratios = []
    for i in range(max(pairs, 2)):
        spent = {}
        for which, (cmd, env, cwd) in ((("c", command), ("b", baseline)) if i % 2 else (("b", baseline), ("c", command))):
            c0 = _children_cpu()
            r = subprocess.run(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            if r.returncode != 0:
                sys.exit(f"bench_cli: {' '.join(cmd)} failed: {r.stderr.decode().strip()}")
            spent[which] = _children_cpu() - c0
        ratios.append(spent["c"] / spent["b"])
    return ratios


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def sbatch(cwd: Path, *args: str) -> str:
    out = subprocess.run(["sbatch", "--parsable", *args], cwd=cwd, capture_output=True, text=True, check=True)
    return out.stdout.strip().split(";")[0]


def metrics_line(step: int) -> str:
    """One line as the trainer's MetricsWriter.log writes it (hpcrl.compute.train.trainer's keys)."""
    m = {"step": step, "time": 1.7e9 + 30 * step, "max_steps": 2000, "reward": 0.5 + step / 5000,
         "reward_std": 0.21, "rewards/correct/mean": 0.5, "rewards/correct/std": 0.5, "rewards/format/mean": 0.9,
         "rewards/format/std": 0.3, "frac_reward_zero_std": 0.1, "loss": 0.013, "grad_norm": 0.41,
         "learning_rate_used": 1e-6, "kl": 0.0021, "entropy": 0.37, "clip_ratio/region_mean": 0.0,
         "advantage_mean": 0.0, "advantage_std": 0.93, "completions/mean_length": 412.5,
         "completions/min_length": 12.0, "completions/max_length": 1024.0, "completions/clipped_ratio": 0.02,
         "completions/mean_terminated_length": 400.1, "completions/min_terminated_length": 12.0,
         "completions/max_terminated_length": 1020.0, "num_tokens": 1.2e6 * step, "learning_rate": 1e-6,
         "epoch": step / 2000, "weight_version": step,
         "off_policy_lag": 0, "time_generation_s": 11.2, "time_train_s": 14.8, "time_sync_s": 0.9,
         "sync_s": 0.9, "sync_gathered_bytes": 3.1e9, "sync_internode_bytes": 0, "time_step_s": 27.4,
         "time_wait_s": 0.5, "tokens_per_s": 9100.0}
    return json.dumps(m, separators=(",", ":")) + "\n"


def small_run_dir(path: Path, steps: int = 3) -> Path:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(metrics_line(s) for s in range(1, steps + 1)))
    return path


def final_state(job_id: str, i: int) -> dict:
    """A finished job's state as status stores it (slurm.JobInfo.to_dict()), varied like real ones."""
    state, code = [("COMPLETED", 0), ("COMPLETED", 0), ("FAILED", 1), ("CANCELLED", 0), ("TIMEOUT", 0)][i % 5]
    t = 1.7e9 + 600 * i
    return {"job_id": job_id, "name": f"old{i}", "state": state, "reason": "", "elapsed_s": 3600,
            "time_limit_s": 7200, "nodes": 2, "node_list": "frontier[00001-00002]", "exit_code": code,
            "signal": 0, "restarts": 0, "work_dir": "", "std_out": "", "submit_time": int(t),
            "start_time": int(t) + 60, "end_time": int(t) + 3660}


def fill_many(registry, work: Path, real: list[str], alive: list[str], many: int) -> None:
    """The --many registry: synthesised old jobs first (oldest), the unknown ids, then the real
    finished jobs, then the alive ones (newest, so the default view asks Slurm about them)."""
    synthetic = many - len(real) - len(alive) - len(UNKNOWN_IDS)
    if synthetic < 0:
        sys.exit("bench_cli: --many must hold --jobs + --alive + 3 rows")
    now = time.time()
    when = iter(range(many))
    runs = work / "many"
    for i in range(synthetic):
        job_id = str(500000 + i)
        run_dir = small_run_dir(runs / f"old{i}")
        state = final_state(job_id, i)
        if state["state"] == "FAILED":
            (run_dir / "failure.txt").write_text(
                "2025-06-01T12:00:00 rank 7 (node 0, server) was killed by SIGKILL (out of memory?)\n")
        registry.add(job_id, f"old{i}", "frontier", run_dir, run_dir / "job.sbatch", now - many + next(when))
        registry.update_state(job_id, state, now - many)
    for job_id in [*UNKNOWN_IDS, *real, *alive]:
        run_dir = small_run_dir(runs / f"job{job_id}")
        registry.add(job_id, f"bench{job_id}", "testbed", run_dir, run_dir / "job.sbatch", now - many + next(when))


def big_run_dir(run_dir: Path, nodes: int, steps: int = 2000) -> None:
    """What a --nodes-node Frontier job leaves in its run directory mid-run (see the docstring)."""
    subprocess.run([sys.executable, "-m", "hpcrl", "render", "--site", "frontier", "-A", "PRJ123", "-N", str(nodes),
                    "-t", "02:00:00", "--run-dir", str(run_dir)], check=True, stdout=subprocess.DEVNULL)
    now = time.time()
    servers = {}
    (run_dir / ".servers").mkdir()
    for node in range(nodes):
        lagging = node % 97 == 5          # a few servers still take the newest weights
        health = {"node": node, "rank": node * RANKS_PER_NODE + RANKS_PER_NODE - 1,
                  "state": "syncing" if lagging else "serving", "engine": "vllm",
                  "weight_version": steps - lagging, "requests": 3 * steps, "time": now, "pid": 40000 + node}
        (run_dir / ".servers" / f"node-{node}.json").write_text(json.dumps(health))   # Server.write_health
        servers[str(node)] = health                                                     # role._server_health
    heartbeat = {"time": now, "step": steps, "phase": "train", "pid": 41000, "host": "frontier00001",
                 "servers": servers}
    (run_dir / "heartbeat.json").write_text(json.dumps(heartbeat, indent=1) + "\n")     # MetricsWriter.heartbeat
    ranks = [{"rank": r, "node": r // RANKS_PER_NODE, "local_rank": r % RANKS_PER_NODE,
              "role": "server" if r % RANKS_PER_NODE == RANKS_PER_NODE - 1 else "trainer",
              "host": f"frontier{r // RANKS_PER_NODE + 1:05d}", "pid": 40000 + r} for r in range(nodes * RANKS_PER_NODE)]
    (run_dir / "ranks.json").write_text(json.dumps(ranks, indent=1) + "\n")             # rendezvous.write_ranks
    (run_dir / "metrics.jsonl").write_text("".join(metrics_line(s) for s in range(1, steps + 1)))


def write_log(run_dir: Path, job_id: str, mb: int) -> None:
    """The job's Slurm output: the trainers' step lines."""
    line = "step  812  reward 0.712  kl 0.0021  loss 0.0130  len 412.5  gen 11.20s  train 14.80s  sync 0.900s\n"
    with (run_dir / f"slurm-{job_id}.out").open("a") as f:
        f.write(line * (mb * 2**20 // len(line)))


def wait_until_quiet(timeout: float, staying: set[str], only: list[str] | None = None) -> None:
    """slurmctld is busy with hundreds of fresh jobs for a while: time commands against a quiet one
    (the `staying` jobs, held, are not waited for; with `only`, the jobs waited for are those)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        which = ["-j", ",".join(only)] if only else []
        queued = subprocess.run(["squeue", "-h", "-o", "%i", *which], capture_output=True, text=True).stdout.split()
        if set(queued) <= staying:
            return
        time.sleep(1)


SMOKE = dict(jobs=3, many=12, alive=2, nodes=2, log_mb=1, repeat=1)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true",
                    help="that it runs, in seconds: "
                         + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in SMOKE.items())
                         + " (unless given); waits for its own jobs only, not for a quiet slurmctld")
    ap.add_argument("--jobs", type=int, default=None, help="default 200")
    ap.add_argument("--many", type=int, default=None, help="default 1000")
    ap.add_argument("--alive", type=int, default=None, help="held (pending) jobs in the --many registry (default 20)")
    ap.add_argument("--nodes", type=int, default=None, help="default 256")
    ap.add_argument("--log-mb", type=int, default=None, help="size of the big job's Slurm output (default 20)")
    ap.add_argument("--repeat", type=int, default=None, help="default 15")
    args = ap.parse_args(argv)
    full = dict(jobs=200, many=1000, alive=20, nodes=256, log_mb=20, repeat=15)
    for key, value in (SMOKE if args.smoke else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if not os.environ.get("SLURM_CONF"):
        sys.exit("bench_cli: set SLURM_CONF (start the testbed: scripts/slurm-testbed.sh start)")

    compileall.compile_dir(REPO / "hpcrl", quiet=1)
    work = Path(tempfile.mkdtemp(prefix="hpcrl-bench-cli-"))
    homes = {k: str(work / f"home-{k}") for k in ("jobs", "many", "big")}
    env = {k: dict(os.environ, HPCRL_HOME=h) for k, h in homes.items()}
    sys.path.insert(0, str(REPO))
    from hpcrl.login.registry import Registry

    registry = Registry(Path(homes["jobs"]) / "registry.sqlite")
    real = []
    for i in range(args.jobs):
        job_id = sbatch(work, "-J", f"bench{i}", "-o", "/dev/null", "--wrap", "true")
        run_dir = small_run_dir(work / f"run{i}")
        registry.add(job_id, f"bench{i}", "testbed", str(run_dir), str(run_dir / "job.sbatch"))
        real.append(job_id)
    held: list[str] = []      # cancelled at the end, whatever happens
    try:
        for i in range(args.alive):
            held.append(sbatch(work, "--hold", "-J", f"held{i}", "-o", "/dev/null", "--wrap", "true"))
        fill_many(Registry(Path(homes["many"]) / "registry.sqlite"), work, real, held, args.many)
        big = work / "big"
        big_run_dir(big, args.nodes)
        held.append(sbatch(work, "--hold", "-J", "big", "-o", str(big / "slurm-%j.out"), "--wrap", "true"))
        write_log(big, held[-1], args.log_mb)
        Registry(Path(homes["big"]) / "registry.sqlite").add(held[-1], "big", "frontier", big, big / "job.sbatch")
        # A smoke run shares the testbed with other tests' jobs: it waits for its own.
        wait_until_quiet(180, set(held), real if args.smoke else None)
        return bench(args, work, env, held[-1])
    finally:
        subprocess.run(["scancel", *held], capture_output=True)
        if args.smoke:
            shutil.rmtree(work, ignore_errors=True)


def bench(args, work: Path, env: dict, big_job: str) -> int:
    from hpcrl.login.slurm import SQUEUE_FORMAT
    hpcrl = [sys.executable, "-m", "hpcrl"]
    status_all = [*hpcrl, "status", "-n", str(args.many)]
    status_big = [*hpcrl, "status", big_job]
    # Warm the file cache; the first status also records the finished jobs' states, as a user's would.
    for cmd, k in ((status_all, "jobs"), (status_all, "many"), (status_big, "big")):
        subprocess.run(cmd, env=env[k], cwd=work, stdout=subprocess.DEVNULL, check=True)
    big_out = subprocess.run(status_big, env=env["big"], cwd=work, capture_output=True, text=True).stdout
    squeue_o = ["squeue", "-h", "-t", "all", "-j", big_job, "-O", SQUEUE_FORMAT]
    render_dir = work / "renders"
    render_dir.mkdir()
    e = env["jobs"]
    render = ([*hpcrl, "render", "--site", "testbed"], e, render_dir)
    floor = ([sys.executable, "-c", "import jinja2, hpcrl.job.spec"], e, work)
    t, cpu = timed({
        "python -c pass": ([sys.executable, "-c", "pass"], e, work),
        "squeue": (["squeue"], e, work),
        "hpcrl --help": ([*hpcrl, "--help"], e, work),
        "hpcrl render": render,
        f"hpcrl status ({args.jobs} jobs)": ([*hpcrl, "status", "-n", str(args.jobs)], e, work),
        f"hpcrl status ({args.many} jobs, 50 shown)": ([*hpcrl, "status"], env["many"], work),
        f"hpcrl status -n {args.many} ({args.many} jobs)": (status_all, env["many"], work),
        f"hpcrl status JOBID ({args.nodes} nodes)": (status_big, env["big"], work),
        # What render cannot go below: a Python start that imports jinja2 (the template engine), and
        # one that also defines the recipe and site dataclasses (hpcrl.job.spec). Not in X.
        "(ref) import jinja2": ([sys.executable, "-c", "import jinja2"], e, work),
        "(ref) import jinja2+spec": floor,
        # The query status sends while a job it shows is alive (hpcrl.login.slurm._from_squeue), and
        # the one it sent before (issue 17). Not in X.
        "(ref) squeue -O (status's)": (squeue_o, e, work),
        "(ref) squeue --json (before)": (["squeue", "--json", "-t", "all", "-j", big_job], e, work),
    }, args.repeat)

    py = t["python -c pass"]
    # (name, baseline or None, counted in X): status is held against a Python start + one squeue.
    rows = [(name, None if "squeue" in name else py + t["squeue"] if "status" in name else py,
             name.startswith("hpcrl")) for name in t]
    state = next((line.split()[1] for line in big_out.splitlines() if line.strip().startswith("state")), "?")
    # Slurm 22.05's squeue --json ignores -j: its cost follows every job slurmctld holds, not ours.
    in_ctld = len(subprocess.run(["squeue", "-h", "-t", "all", "-o", "%i"], capture_output=True, text=True).stdout.split())
    print(f"{args.alive} held jobs in the {args.many}-job registry; the {args.nodes}-node job is {state}, "
          f"{len(big_out.splitlines())} lines of detail; {in_ctld} jobs in slurmctld; "
          f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print_table(f"login commands, median ms of {args.repeat} runs each, taking turns",
                ["command", "median ms", "baseline ms", "ratio", "median CPU ms"],
                [[name, f"{t[name] * 1e3:.1f}", "" if base is None else f"{base * 1e3:.1f}",
                  "" if base is None else f"{t[name] / base:.2f}", f"{cpu[name] * 1e3:.1f}"] for name, base, _ in rows])
    worst = max(t[name] / base for name, base, in_x in rows if in_x)
    ratios = paired_ratios(render, floor, 3 * args.repeat)
    print(f"hpcrl render over its import floor, CPU time, {len(ratios)} back-to-back pairs: median "
          f"{statistics.median(ratios):.3f}, quartiles {' - '.join(f'{q:.3f}' for q in statistics.quantiles(ratios, n=4)[::2])}")
    print(f"worst_cli_over_python_start={worst:.2f} render_over_import_floor={statistics.median(ratios):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
