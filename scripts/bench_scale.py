#!/usr/bin/env python
"""The launch's control plane at hundreds of ranks on this machine: rendezvous, watchdog hub,
node channels and failure detection, fitted against the number of ranks and extrapolated.

Every size N is a `recipe.mode: control` job (no torch: hpcrl/compute/launch/probe.py) of N/8
fake nodes of 8 tasks (7 trainers + 1 server, like a Frontier node's 8 GCDs), started exactly as
`hpcrl run` starts it (hpcrl.login.local's mpiexec command and environment), on this one machine:
mpiexec's ranks are split into nodes by blocks of 8 (rendezvous.tasks_per_fake_node). Overrides:

  site.node.gpus=8            8 tasks a node
  site.node.gpu_cores=0-(C-1) for every GPU: each task may run on all C cores. The local site's even
                              split puts, on 2 cores, every trainer on core 0 and every server on
                              core 1: at 256 ranks, 224 trainers on one core, which would time the
                              kernel's scheduler, not hpcrl. A Frontier task has 7 cores of its own;
                              here all tasks share all cores.
  launch.peer_failure_timeout_s  --peer-timeout (heartbeats every timeout/4, at most 5 s)
  launch.rendezvous_timeout_s    --rendezvous-timeout

Per size, two launches:

  ok     every task reports (one JSON line), all checks pass, placement equals the plan, no torch.
         launch_s      mpiexec's start -> rank 0's "launched: ..." line on stderr, less rank 0's
                       node-channel phase: the whole rendezvous as a user waits for it (process
                       starts, imports, MPI_Init of all, hub registration of all)
         rdv_s         rank 0's own "rendezvous at X s" (from its setup's start, after its imports)
         hub_cpu_s     CPU time of rank 0's hub thread when rank 0 reports (registration, the
                       table to every rank, heartbeats)
         r0_cpu_s, r0_mb   rank 0's task process: CPU time, peak RSS (MiB)
         rank_mb med/max   every task's peak RSS (MiB, VmHWM of the task process)
         mem_mb/rank   (MemAvailable before - its lowest during the launch) / N: what a rank really
                       costs this machine, supervisor process, mpiexec's proxy and the kernel included
         wall_s        mpiexec's start -> its exit
         CPU s/rank    the machine's busy CPU-seconds (/proc/stat, every core) over the launch / N
         bare MPI s    `mpiexec -n N python -c "<mpi4py: MPI_Init, a split, an allgather, a barrier>"`:
                       the floor under a rendezvous of N ranks on this machine, hpcrl aside
  kill   the same job with the last rank (a server) SIGKILLed right after the rendezvous
         (HPCRL_FAULT=die-after-rendezvous:N-1, hpcrl/compute/launch/faults.py) and mpiexec told not
         to clean up (-disable-auto-cleanup), so that hpcrl's own watchdog is what ends the others.
         detect_s      the victim's supervisor's "was killed by SIGKILL" line -> mpiexec's exit (every
                       rank gone). Checked: every other rank's last line names the victim, the job's
                       one line (failure.txt) names it, and detect_s <= launch.peer_failure_timeout_s.

Fit: log(figure) = a + b log(N) by least squares over the sizes; b is the growth exponent (1 =
linear) and a + b log(2048), a + b log(8192) the extrapolations. A fit over 16..256 ranks of one
machine: the machine's 2 cores run every rank, so times here grow with the total work of all ranks.

The hub alone (--hub-sizes, default 256,1024,2048,4096: sizes no launch here can reach): rank 0's
watchdog hub (hpcrl.compute.launch.watchdog.Hub) in this process, and N ranks' ends of the protocol
(connect, authenticate, register, heartbeat, goodbye) played by 2 single-threaded client processes:
the hub sees a real launch's traffic, without N Python processes.
         hub_reg_s     first connection -> every rank holds the table; hub_reg_cpu_s its hub CPU
         hub_beat_ms   hub CPU per heartbeat round (N heartbeats in, N out; a round is
                       min(5 s, timeout/4)): the single thread reading every heartbeat
         hub_kill_s    one rank's connection closes -> every other rank has the verdict
--hub-sizes ...,8192 runs too (1.1 s to register 8,192 ranks on 11-25). Before rank 0 alone got the
table (the others get the hub's entry), every rank received all N entries: 2.2 GB at 8,192 ranks,
which ran into the kernel's TCP memory limit here and took 190 s.

Before each size the memory it needs is estimated from the previous size's mem_mb/rank (x1.2):
a size that would leave less than --min-free-gb is skipped, and a launch is stopped if
MemAvailable falls below it. Last line:
    rendezvous_s_at_<largest>=A failure_detect_s_at_<largest>=B growth_exponent_rendezvous=C
(largest: the largest size that ran; A: launch_s).

    .venv/bin/python scripts/bench_scale.py                      # 16,64,128,256
    .venv/bin/python scripts/bench_scale.py --sizes 16,64,128,256,512
    .venv/bin/python scripts/bench_scale.py --smoke    # 8 and 16 ranks, the hub alone at 16 and 64: that it
                                                       # runs (tests/e2e/test_bench_smoke.py), seconds
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import re
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict
from pathlib import Path

from benchtable import print_table  # scripts/benchtable.py (this script's directory is on sys.path)

from hpcrl.compute.launch import wire
from hpcrl.compute.launch.watchdog import Hub, Peer, heartbeat_interval
from hpcrl.job import rundir
from hpcrl.job.spec import JobSpec
from hpcrl.login.compose import compose
from hpcrl.login.local.mpiexec import find_mpiexec, launch_command, mpi_flavor

TASKS_PER_NODE = 8
EXTRAPOLATE_TO = (2048, 8192)
LAUNCHED = re.compile(r"rank 0 node 0 trainer\] launched: (.*)$")
PHASE = re.compile(r"(\w+) at ([0-9.]+) s")


def mem_available_kb() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    raise RuntimeError("no MemAvailable in /proc/meminfo")


def busy_cpu_s() -> float:
    """CPU-seconds this machine has been busy since boot (every core, /proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


BARE_MPI = ("from mpi4py import MPI; w = MPI.COMM_WORLD; w.Split_type(MPI.COMM_TYPE_SHARED, key=w.rank); "
            "w.allgather(w.rank); w.Barrier()")


def measure_bare_mpi(n: int, timeout: float) -> tuple[float, float]:
    """(wall s, machine CPU s) of `mpiexec -n N python -c <import mpi4py, MPI_Init, a split, an
    allgather, a barrier>`: the floor under a rendezvous of N ranks on this machine, hpcrl aside."""
    mpiexec = find_mpiexec()
    cpu0, t0 = busy_cpu_s(), time.monotonic()
    subprocess.run([mpiexec, "-n", str(n), sys.executable, "-c", BARE_MPI], check=True, timeout=timeout,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.monotonic() - t0, busy_cpu_s() - cpu0


def make_job(work: Path, n: int, peer_timeout: float, rendezvous_timeout: float) -> JobSpec:
    cores = os.cpu_count() or 1
    all_cores = f"0-{cores - 1}" if cores > 1 else "0"
    gpu_cores = json.dumps({str(g): all_cores for g in range(TASKS_PER_NODE)})
    overrides = ["mode=control", f"site.node.gpus={TASKS_PER_NODE}", f"site.node.gpu_cores={gpu_cores}",
                 f"launch.peer_failure_timeout_s={peer_timeout:g}",
                 f"launch.rendezvous_timeout_s={rendezvous_timeout:g}"]
    run_dir = work / f"scale-{n}-{uuid.uuid4().hex[:6]}"
    spec = compose(None, "local", overrides, {"resources.nodes": n // TASKS_PER_NODE}, str(run_dir),
                   check_fit=False, check_inputs=False)
    rundir.create(spec.run_dir, spec.to_json(), None)
    return spec


class Launch:
    """One mpiexec launch of a run directory, its output lines stamped as they arrive, the
    machine's available memory sampled meanwhile."""

    def __init__(self, spec: JobSpec, fault: str | None, timeout: float, min_free_kb: int):
        self.spec, self.fault, self.timeout, self.min_free_kb = spec, fault, timeout, min_free_kb
        self.lines: list[tuple[float, str, str]] = []      # (seconds since the start, stream, text)
        self.stopped = ""                                   # why the bench ended it, if it did
        self.mem_before_kb = self.mem_low_kb = 0
        self.wall_s = self.cpu_s = 0.0
        self.code = None

    def run(self) -> "Launch":
        mpiexec = find_mpiexec()
        flavor = mpi_flavor(mpiexec)
        cmd = launch_command(mpiexec, flavor, self.spec.python, self.spec.plan().world_size, self.spec.run_dir)
        if self.fault and flavor == "hydra":
            cmd.insert(1, "-disable-auto-cleanup")          # the watchdog, not hydra, must end the others
        env = dict(os.environ)
        env.update({k: os.path.expandvars(v) for k, v in self.spec.environment().items()})
        env.update(HPCRL_RUN_DIR=self.spec.run_dir, HPCRL_LAUNCH_ID=f"bench-{uuid.uuid4().hex[:12]}",
                   PYTHONUNBUFFERED="1")
        env.pop("HPCRL_FAULT", None)
        if self.fault:
            env["HPCRL_FAULT"] = self.fault
        self.mem_before_kb = self.mem_low_kb = mem_available_kb()
        cpu0, t0 = busy_cpu_s(), time.monotonic()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
        lock = threading.Lock()

        def pump(src, name):
            for raw in iter(src.readline, b""):
                with lock:
                    self.lines.append((time.monotonic() - t0, name, raw.decode(errors="replace").rstrip("\n")))

        pumps = [threading.Thread(target=pump, args=(proc.stdout, "out"), daemon=True),
                 threading.Thread(target=pump, args=(proc.stderr, "err"), daemon=True)]
        for t in pumps:
            t.start()
        try:
            while proc.poll() is None:
                low = mem_available_kb()
                self.mem_low_kb = min(self.mem_low_kb, low)
                if low < self.min_free_kb:
                    self.stopped = f"MemAvailable fell to {low / 2**20:.1f} GiB"
                    break
                if time.monotonic() - t0 > self.timeout:
                    self.stopped = f"still running after {self.timeout:.0f} s"
                    break
                time.sleep(0.2)
        finally:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.code = proc.wait()
            self.wall_s, self.cpu_s = time.monotonic() - t0, busy_cpu_s() - cpu0
            for t in pumps:
                t.join(10)
        return self

    def reports(self) -> list[dict]:
        """Every task's row, as rank 0 wrote them (hpcrl/compute/launch/probe.py), by rank."""
        path = Path(self.spec.run_dir) / rundir.PROBE_FILE
        rows = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
        return sorted(rows, key=lambda r: r["plan"]["rank"])


def measure_ok(spec: JobSpec, args, min_free_kb: int) -> dict:
    n = spec.plan().world_size
    launch = Launch(spec, None, args.timeout, min_free_kb).run()
    out = {"n": n, "code": launch.code, "wall_s": launch.wall_s, "stopped": launch.stopped}
    if launch.stopped or launch.code != 0:
        out["error"] = launch.stopped or f"exit status {launch.code}: " + _tail(launch)
        return out
    rows = launch.reports()
    plan_rows = [json.loads(json.dumps(t.to_dict())) for t in JobSpec.load(spec.run_dir).plan().tasks]
    problems = []
    if [r["plan"] for r in rows] != plan_rows:
        problems.append(f"{len(rows)} reports, or rows unlike the plan's {len(plan_rows)}")
    for r in rows:
        seen, plan = r["observed"], r["plan"]
        if (seen["rank"], seen["node"], seen["local_rank"], seen["role"]) != \
                (plan["rank"], plan["node"], plan["local_rank"], plan["role"]):
            problems.append(f"rank {plan['rank']} landed elsewhere: {seen}")
        if not all(c["ok"] for c in r["checks"].values()):
            problems.append(f"rank {plan['rank']}: failed check {r['checks']}")
        if r["torch_imported"]:
            problems.append(f"rank {plan['rank']} imported torch")
    launched = next(((t, m.group(1)) for t, s, text in launch.lines if s == "err" and (m := LAUNCHED.search(text))), None)
    if launched is None:
        problems.append("no 'launched:' line from rank 0")
    if problems:
        out["error"] = "; ".join(problems[:3])
        return out
    phases = {k: float(v) for k, v in PHASE.findall(launched[1])}
    r0 = rows[0]["usage"]
    peaks = [r["usage"]["peak_rss_kb"] / 1024 for r in rows]
    out.update(
        launch_s=launched[0] - (phases["node_channel"] - phases["rendezvous"]),
        rdv_s=phases["rendezvous"], hub_cpu_s=r0.get("hub_cpu_s", float("nan")), r0_cpu_s=r0["cpu_s"],
        r0_mb=r0["peak_rss_kb"] / 1024, rank_mb_med=statistics.median(peaks), rank_mb_max=max(peaks),
        mem_mb_per_rank=(launch.mem_before_kb - launch.mem_low_kb) / 1024 / n, cpu_s_per_rank=launch.cpu_s / n,
        open_files_r0=r0.get("open_files"),
        allreduce_s_max=max(r["checks"]["allreduce"]["seconds"] for r in rows if "allreduce" in r["checks"]),
        echo_s_max=max(r["checks"]["channel"]["seconds"] for r in rows if "seconds" in r["checks"]["channel"]))
    return out


def measure_kill(spec: JobSpec, args, min_free_kb: int) -> dict:
    plan = spec.plan()
    n, victim = plan.world_size, plan.world_size - 1
    task = plan.task(victim)
    launch = Launch(spec, f"die-after-rendezvous:{victim}", args.timeout, min_free_kb).run()
    out = {"n": n, "code": launch.code, "wall_s": launch.wall_s, "stopped": launch.stopped, "victim": victim}
    if launch.stopped:
        out["error"] = launch.stopped
        return out
    killed_name = f"hpcrl: rank {victim} (node {task.node}, {task.role}) was killed by SIGKILL"
    killed_at = next((t for t, s, text in launch.lines if text.startswith(killed_name)), None)
    named = re.compile(rf"^hpcrl: rank (\d+) \(node \d+, \w+\): rank {victim} \(node {task.node}, {task.role}, "
                       rf"host .*\) is gone: .*; exiting$")
    namers = {int(m.group(1)) for _, s, text in launch.lines if (m := named.match(text))}
    others = set(range(n)) - {victim}
    failure = rundir.read_failure(Path(spec.run_dir)) or ""
    problems = []
    if killed_at is None:
        problems.append("no 'killed by SIGKILL' line for the victim")
    if namers != others:
        missing = sorted(others - namers)
        problems.append(f"{len(missing)} rank(s) did not name rank {victim}: {missing[:10]}")
    if f"rank {victim} (node {task.node}, {task.role}" not in failure:
        problems.append(f"failure.txt does not name rank {victim}: {failure!r}")
    if launch.code == 0:
        problems.append("the job exited 0")
    out["named_by"] = len(namers)
    out["job_line"] = failure.strip()
    if killed_at is not None:
        out["detect_s"] = launch.wall_s - killed_at
        gone_lines = [t for t, s, text in launch.lines if named.match(text)]
        out["all_named_s"] = (max(gone_lines) - killed_at) if gone_lines else float("nan")
        bound = spec.recipe.launch.peer_failure_timeout_s
        if out["detect_s"] > bound:
            problems.append(f"every rank out {out['detect_s']:.1f} s after the kill, over "
                            f"launch.peer_failure_timeout_s={bound:g}")
    if problems:
        out["error"] = "; ".join(problems)
    return out


# ---------------------------------------------------------------------------- the hub alone
def _hub_clients(ranks: list[int], n: int, address, secret: bytes, interval: float, ctl) -> None:
    """Many ranks' ends of the watchdog protocol in one single-threaded process (a fork)."""
    socks = {}
    for r in ranks:
        s = socket.create_connection(address, timeout=600)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        wire.authenticate_client_side(s, secret, 600)
        peer = Peer(r, r // TASKS_PER_NODE, r % TASKS_PER_NODE,
                    "server" if r % TASKS_PER_NODE == TASKS_PER_NODE - 1 else "trainer", "frontier00001", 100000 + r)
        wire.send_msg(s, {"t": "register", "peer": asdict(peer), "size": n})
        socks[r] = s
    sel = selectors.DefaultSelector()
    for r, s in socks.items():
        sel.register(s, selectors.EVENT_READ, r)
    tables, verdicts, victim, last_beat, said = set(), set(), None, 0.0, set()
    while True:
        for key, _ in sel.select(0.02):
            try:
                msg = wire.recv_msg(key.fileobj, None)
            except wire.ChannelClosed:
                sel.unregister(key.fileobj)
                continue
            if msg["t"] == "table":
                tables.add(key.data)
            elif msg["t"] == "gone":
                verdicts.add(key.data)
        if "registered" not in said and len(tables) == len(socks):
            ctl.send("registered")
            said.add("registered")
            last_beat = time.monotonic()
        if "registered" in said and time.monotonic() - last_beat >= interval:
            last_beat = time.monotonic()
            for s in socks.values():
                wire.send_msg(s, {"t": "hb"})
        if victim is not None and "named" not in said and verdicts >= set(socks):
            ctl.send("named")
            said.add("named")
        if ctl.poll():
            cmd, arg = ctl.recv()
            if cmd == "kill":
                victim = arg
                if victim in socks:
                    s = socks.pop(victim)
                    sel.unregister(s)
                    s.close()                        # no goodbye: as a process that died
            elif cmd == "end":
                for s in socks.values():
                    wire.send_msg(s, {"t": "bye"})
                ctl.send("bye")
                return


def _thread_cpu_s(name: str) -> float:
    t = next(t for t in threading.enumerate() if t.name == name)
    return time.clock_gettime(time.pthread_getcpuclockid(t.ident))


def measure_hub(n: int, peer_timeout: float, rounds: int = 3, clients: int = 2) -> dict:
    secret = os.urandom(32)
    hub = Hub(secret, n, peer_timeout, "127.0.0.1").start()
    interval = heartbeat_interval(peer_timeout)
    fork = multiprocessing.get_context("fork")
    pipes, procs = [], []
    t0 = time.monotonic()
    for i in range(clients):
        mine, theirs = fork.Pipe()
        proc = fork.Process(target=_hub_clients, args=(list(range(n))[i::clients], n, hub.address, secret,
                                                       interval, theirs), daemon=True)
        proc.start()
        pipes.append(mine)
        procs.append(proc)
    try:
        for p in pipes:
            p.recv()
        out = {"n": n, "hub_reg_s": time.monotonic() - t0, "hub_reg_cpu_s": _thread_cpu_s("hpcrl-hub")}
        time.sleep(interval * rounds)
        out["hub_beat_ms"] = (_thread_cpu_s("hpcrl-hub") - out["hub_reg_cpu_s"]) / rounds * 1000
        t1 = time.monotonic()
        for p in pipes:
            p.send(("kill", n - 1))
        for p in pipes:
            p.recv()
        out["hub_kill_s"] = time.monotonic() - t1
        for p in pipes:
            p.send(("end", None))
        for p in pipes:
            p.recv()
        failures = hub.close(wait_s=10)
        if list(failures) != [n - 1]:
            out["error"] = f"the hub's failures: {sorted(failures)[:10]}"
    finally:
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    return out


def _tail(launch: Launch) -> str:
    errs = [text for _, s, text in launch.lines if s == "err" and text.startswith("hpcrl:")]
    return (errs or [text for _, _, text in launch.lines][-3:] or ["(no output)"])[0][:300]


def fit(sizes: list[int], values: list[float]) -> tuple[float, float] | None:
    """(a, b) of log(v) = a + b log(n), least squares; None with fewer than 2 positive points."""
    pts = [(math.log(n), math.log(v)) for n, v in zip(sizes, values) if v and v > 0 and math.isfinite(v)]
    if len(pts) < 2:
        return None
    mx, my = statistics.fmean(x for x, _ in pts), statistics.fmean(y for _, y in pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    b = sum((x - mx) * (y - my) for x, y in pts) / sxx
    return my - b * mx, b


def fmt(v, digits=2) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


FIGURES = [  # (key, label, digits)
    ("launch_s", "rendezvous (launch_s)", 2), ("rdv_s", "rank 0 rendezvous", 2), ("hub_cpu_s", "hub CPU s", 3),
    ("r0_cpu_s", "rank 0 CPU s", 2), ("r0_mb", "rank 0 peak MiB", 1), ("rank_mb_med", "rank peak MiB, median", 1),
    ("rank_mb_max", "rank peak MiB, max", 1), ("mem_mb_per_rank", "machine MiB/rank", 1),
    ("wall_s", "wall s", 2), ("cpu_s_per_rank", "machine CPU s/rank", 3), ("bare_mpi_s", "bare MPI s", 2),
    ("bare_mpi_cpu_s_per_rank", "bare MPI CPU s/rank", 3), ("detect_s", "kill -> all out s", 2)]
HUB_FIGURES = [("hub_reg_s", "registered + table s", 2), ("hub_reg_cpu_s", "its hub CPU s", 3),
               ("hub_beat_ms", "hub CPU ms / heartbeat round", 1), ("hub_kill_s", "kill -> all told s", 3)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true",
                    help="that it runs, in seconds: --sizes 8,16 --hub-sizes 16,64 --hub-peer-timeout 2 (unless given)")
    ap.add_argument("--sizes", default=None, help="ranks per launch, multiples of 8 (default 16,64,128,256)")
    ap.add_argument("--peer-timeout", type=float, default=10.0, help="launch.peer_failure_timeout_s (default 10)")
    ap.add_argument("--rendezvous-timeout", type=float, default=300.0, help="launch.rendezvous_timeout_s (default 300)")
    ap.add_argument("--timeout", type=float, default=540.0, help="seconds a launch may take before it is stopped")
    ap.add_argument("--min-free-gb", type=float, default=3.0, help="never let MemAvailable fall below this (GiB)")
    ap.add_argument("--no-kill", action="store_true", help="skip the failure launches")
    ap.add_argument("--hub-sizes", default=None,
                    help="ranks for the hub alone (default 256,1024,2048,4096; '' skips it)")
    ap.add_argument("--hub-peer-timeout", type=float, default=None,
                    help="peer_failure_timeout_s of the hub alone (default 20: a heartbeat round every 5 s)")
    ap.add_argument("--work-dir", type=Path, default=None,
                    help=f"run directories go here (default {Path(tempfile.gettempdir()) / 'hpcrl-bench-scale'}; "
                         "--smoke: a temporary one, removed)")
    ap.add_argument("--json", type=Path, default=None, help="also write every measurement here")
    args = ap.parse_args(argv)
    for key, full, smoke in (("sizes", "16,64,128,256", "8,16"), ("hub_sizes", "256,1024,2048,4096", "16,64"),
                             ("hub_peer_timeout", 20.0, 2.0)):
        if getattr(args, key) is None:
            setattr(args, key, smoke if args.smoke else full)
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    if any(n % TASKS_PER_NODE or n < TASKS_PER_NODE for n in sizes):
        ap.error(f"--sizes: every size must be a multiple of {TASKS_PER_NODE}")
    if args.work_dir is None and args.smoke:
        with tempfile.TemporaryDirectory(prefix="hpcrl-bench-scale-") as tmp:
            args.work_dir = Path(tmp)
            return run(args, sizes)
    args.work_dir = args.work_dir or Path(tempfile.gettempdir()) / "hpcrl-bench-scale"
    args.work_dir.mkdir(parents=True, exist_ok=True)
    return run(args, sizes)


def run(args, sizes: list[int]) -> int:
    min_free_kb = int(args.min_free_gb * 2**20)

    results, per_rank_mb, skipped = [], None, []
    for n in sizes:
        avail = mem_available_kb()
        if per_rank_mb is not None:
            need_kb = n * per_rank_mb * 1024 * 1.2
            if avail - need_kb < min_free_kb:
                skipped.append(f"{n} ranks: needs ~{need_kb / 2**20:.1f} GiB ({per_rank_mb:.0f} MiB/rank x 1.2), "
                               f"{avail / 2**20:.1f} GiB available, {args.min_free_gb:g} GiB must stay free")
                print(f"bench_scale: skipping {skipped[-1]}", file=sys.stderr, flush=True)
                continue
        print(f"bench_scale: {n} ranks ({n // TASKS_PER_NODE} fake nodes x {TASKS_PER_NODE})...", file=sys.stderr, flush=True)
        spec = make_job(args.work_dir, n, args.peer_timeout, args.rendezvous_timeout)
        row = measure_ok(spec, args, min_free_kb)
        if "error" in row:
            print(f"bench_scale: {n} ranks failed: {row['error']}", file=sys.stderr, flush=True)
            results.append(row)
            break
        per_rank_mb = row["mem_mb_per_rank"]
        row["bare_mpi_s"], bare_cpu = measure_bare_mpi(n, args.timeout)
        row["bare_mpi_cpu_s_per_rank"] = bare_cpu / n
        print(f"bench_scale:   ok in {row['wall_s']:.1f} s (rendezvous {row['launch_s']:.1f} s, "
              f"{row['mem_mb_per_rank']:.0f} MiB/rank)", file=sys.stderr, flush=True)
        if not args.no_kill:
            kill = measure_kill(make_job(args.work_dir, n, args.peer_timeout, args.rendezvous_timeout), args, min_free_kb)
            row["kill"] = kill
            row["detect_s"] = kill.get("detect_s", float("nan"))
            print(f"bench_scale:   kill: {kill.get('error') or 'every rank named it'}; all out "
                  f"{fmt(kill.get('detect_s'))} s after the kill", file=sys.stderr, flush=True)
        results.append(row)

    hubs = []
    for n in [int(x) for x in args.hub_sizes.split(",") if x.strip()]:
        print(f"bench_scale: the hub alone, {n} ranks...", file=sys.stderr, flush=True)
        hubs.append(measure_hub(n, args.hub_peer_timeout))
        print(f"bench_scale:   {hubs[-1]}", file=sys.stderr, flush=True)

    done = [r for r in results if "error" not in r]
    if args.json:
        args.json.write_text(json.dumps({"results": results, "skipped": skipped, "hub": hubs}, indent=1, default=str))
    if not done:
        print("bench_scale: no size completed", file=sys.stderr)
        return 1
    headers = ["ranks", "nodes", "rendezvous s", "rank 0 rdv s", "hub CPU s", "rank 0 CPU s", "rank 0 MiB",
               "rank MiB med/max", "machine MiB/rank", "wall s", "CPU s/rank", "bare MPI s", "kill -> all out s",
               "named by"]
    rows = []
    for r in done:
        kill = r.get("kill", {})
        rows.append([str(r["n"]), str(r["n"] // TASKS_PER_NODE), fmt(r["launch_s"]), fmt(r["rdv_s"]),
                     fmt(r["hub_cpu_s"], 3), fmt(r["r0_cpu_s"]), fmt(r["r0_mb"], 1),
                     f"{r['rank_mb_med']:.1f} / {r['rank_mb_max']:.1f}", fmt(r["mem_mb_per_rank"], 1),
                     fmt(r["wall_s"]), fmt(r["cpu_s_per_rank"], 3), fmt(r["bare_mpi_s"]),
                     fmt(kill.get("detect_s")) + ("" if "error" not in kill else " (!)"),
                     f"{kill.get('named_by', '-')}/{r['n'] - 1}" if kill else "-"])
    print_table(f"control plane, mode=control under mpiexec, {TASKS_PER_NODE} tasks per fake node, "
                f"{os.cpu_count()} cores (peer_failure_timeout_s={args.peer_timeout:g})", headers, rows)
    for r in done:
        if "error" in r.get("kill", {}):
            print(f"kill at {r['n']} ranks: {r['kill']['error']}")
    sz = [r["n"] for r in done]
    fit_rows, exponents = [], {}
    for key, label, digits in FIGURES:
        ab = fit(sz, [r.get(key, float("nan")) for r in done])
        if ab is None:
            continue
        a, b = ab
        exponents[key] = b
        fit_rows.append([label, f"{b:.2f}", *(fmt(math.exp(a + b * math.log(x)), digits) for x in EXTRAPOLATE_TO)])
    hub_ok = [h for h in hubs if "error" not in h]
    if hub_ok:
        print_table(f"the hub alone: 2 client processes play every rank's end (peer_failure_timeout_s="
                    f"{args.hub_peer_timeout:g}, a heartbeat round every {heartbeat_interval(args.hub_peer_timeout):g} s)",
                    ["ranks", "registered + table s", "hub CPU s", "hub CPU ms / heartbeat round", "kill -> all told s"],
                    [[str(h["n"]), fmt(h["hub_reg_s"]), fmt(h["hub_reg_cpu_s"], 3), fmt(h["hub_beat_ms"], 1),
                      fmt(h["hub_kill_s"], 3)] for h in hub_ok])
        hz = [h["n"] for h in hub_ok]
        for key, label, digits in HUB_FIGURES:
            ab = fit(hz, [h[key] for h in hub_ok])
            if ab is not None:
                a, b = ab
                fit_rows.append([f"hub alone: {label} ({hz[0]}..{hz[-1]})", f"{b:.2f}",
                                 *(fmt(math.exp(a + b * math.log(x)), digits) for x in EXTRAPOLATE_TO)])
    print_table(f"growth: log-log fit over {','.join(map(str, sz))} ranks (exponent 1 = linear)",
                ["figure", "exponent", *(f"at {x}" for x in EXTRAPOLATE_TO)], fit_rows)
    for h in hubs:
        if "error" in h:
            print(f"failed: the hub alone at {h['n']} ranks: {h['error']}")
    for s in skipped:
        print(f"skipped: {s}")
    for r in results:
        if "error" in r:
            print(f"failed: {r['n']} ranks: {r['error']}")
    big = done[-1]
    print(f"rendezvous_s_at_{big['n']}={big['launch_s']:.2f} failure_detect_s_at_{big['n']}={fmt(big.get('detect_s'))} "
          f"growth_exponent_rendezvous={exponents.get('launch_s', float('nan')):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
