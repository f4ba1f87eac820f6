"""recipe.mode = "probe": each task prints one JSON line with its plan row and what it really
got (host, node, devices, cores, links), after checking the links: an all_reduce among the
trainers (and inside each mesh dimension), a round trip with its node's server, and one bucket of
weights from each sender to each engine it syncs over the job's transport (probe_transfer.py).

recipe.mode = "control": the same line from the control plane alone, with no torch anywhere
(40-55 MB a task on the dev VM, where importing torch alone takes 230 MB, so hundreds of ranks fit
one machine: tests/compute/launch/test_launch_scale.py, scripts/bench_scale.py): the round trip carries bytes, the trainers'
check is an MPI allreduce over their communicator, and the launch joins no torch group. Every
task then waits for all the others (an MPI barrier) before its line, so a rank lost on the way
is named by every other one (the watchdog's verdict) instead of some ranks ending cleanly."""

from __future__ import annotations

import hashlib
import json
import os
import resource
import socket
import sys
import threading
import time

from hpcrl.compute.launch import faults, probe_transfer
from hpcrl.compute.launch.context import LaunchContext, write_line
from hpcrl.job import rundir
from hpcrl.job.atomic import atomic_write

GPU_VARIABLES = ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")


def run(ctx: LaunchContext) -> int:
    checks = {}
    if ctx.is_server:
        receiver = probe_transfer.Receiver() if probe_transfer.probed(ctx) else None
        checks["channel"] = _serve(ctx, receiver)
        if receiver is not None:
            checks["transfer"] = receiver.check(ctx.plan.sender_of(ctx.task.rank).rank)
    else:
        if ctx.task.sends_to:       # before the echo, whose "done" ends the engine's part
            checks["transfer"] = probe_transfer.send(ctx)
        checks["channel"] = _echo(ctx)
        checks["all_reduce"] = _all_reduce(ctx)
    row = {"hpcrl_probe": 1, "plan": ctx.task.to_dict(), "observed": observe(ctx), "checks": checks}
    report(ctx, row)
    return 0 if all(c["ok"] for c in checks.values()) else 1


def run_control(ctx: LaunchContext) -> int:
    t0 = time.perf_counter()
    checks = {"channel": _serve(ctx) if ctx.is_server else _echo_bytes(ctx)}
    if ctx.is_trainer:
        checks["allreduce"] = _mpi_allreduce(ctx)
    if ctx.world is not None:
        ctx.world.Barrier()
    row = {"hpcrl_probe": 1, "mode": "control", "plan": ctx.task.to_dict(), "observed": observe(ctx),
           "checks": checks, "timings": {**ctx.timings, "checks_s": round(time.perf_counter() - t0, 3)},
           "usage": usage(ctx), "torch_imported": "torch" in sys.modules}
    report(ctx, row)
    if ctx.world is not None:
        # Every task stays until all have reported and rank 0 has written the rows: one lost
        # after its row still fails the job, named by every other. The second barrier is where
        # the others are when a test's task dies after the report (faults: die-after-report).
        ctx.world.Barrier()
        faults.inject("after-report", ctx.task.rank)
        ctx.world.Barrier()
    return 0 if all(c["ok"] for c in checks.values()) else 1


def report(ctx: LaunchContext, row: dict) -> None:
    """The row on this task's output, and to rank 0 over the watchdog hub, which writes every
    task's, one a line in rank order, to RUN_DIR/probe.jsonl: what reads the rows reads that file.
    The job's output is no record of them: srun splits a line over 1,024 bytes and splices other
    tasks' lines into it, and a row is longer."""
    write_line(json.dumps(row, sort_keys=True))
    ctx.watchdog.send_row("probe", row)
    if ctx.hub is not None:
        rows = ctx.hub.wait_rows("probe", ctx.launch.collective_timeout_s)
        atomic_write(ctx.run_dir / rundir.PROBE_FILE,
                     "".join(json.dumps(rows[rank], sort_keys=True) + "\n" for rank in sorted(rows)))


def usage(ctx: LaunchContext) -> dict:
    """This task's CPU time and memory so far; on rank 0 also its watchdog hub thread's CPU time."""
    ru = resource.getrusage(resource.RUSAGE_SELF)
    out = {"cpu_s": round(ru.ru_utime + ru.ru_stime, 3), "rss_kb": _status_kb("VmRSS"),
           "peak_rss_kb": _status_kb("VmHWM")}
    if ctx.hub is not None:
        hub = next((t for t in threading.enumerate() if t.name == "hpcrl-hub"), None)
        if hub is not None and hub.ident is not None:
            try:
                out["hub_cpu_s"] = round(time.clock_gettime(time.pthread_getcpuclockid(hub.ident)), 3)
            except (OSError, AttributeError):
                pass
        try:
            out["open_files"] = len(os.listdir("/proc/self/fd"))
        except OSError:
            pass
    return out


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def observe(ctx: LaunchContext) -> dict:
    ident = ctx.identity
    out = {
        "hostname": socket.gethostname(), "node_name": ident.node_name, "source": ident.source,
        "rank": ident.rank, "node": ident.node, "local_rank": ident.local_rank, "role": ctx.role,
        "sender": ctx.is_sender, "slurm_nodeid": os.environ.get("SLURM_NODEID"),
        "slurm_procid": os.environ.get("SLURM_PROCID"),
        "gpu_env": {v: os.environ[v] for v in GPU_VARIABLES if v in os.environ},
        "affinity": sorted(os.sched_getaffinity(0)), "dropped_cores": list(ctx.pinning.dropped_cores),
        "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
    }
    if ctx.torch_import is not None:
        out["torch_import"] = [round(t, 3) for t in ctx.torch_import]
    if ctx.mesh_choice is not None:
        out["mesh"] = {"kind": ctx.mesh_choice.kind, "shape": list(ctx.mesh_choice.shape),
                       "dims": list(ctx.mesh_choice.dim_names)}
    return out


def _echo(ctx: LaunchContext) -> dict:
    import torch

    def check(server: int) -> dict:
        sent = {"op": "echo", "rank": ctx.task.rank,
                "token_ids": torch.arange(32, dtype=torch.int64) + 1000 * ctx.task.rank,
                "logprobs": -torch.rand(32), "hidden": torch.randn(4, 8).to(torch.bfloat16)}
        reply, seconds = _round_trip(ctx, server, sent)
        ok = (reply.get("server_rank") == server
              and all(torch.equal(reply[k], sent[k]) for k in ("token_ids", "logprobs", "hidden")))
        return {"ok": ok, "server_rank": reply.get("server_rank"), "seconds": round(seconds, 4)}
    return _each_server(ctx, check)


def _echo_bytes(ctx: LaunchContext) -> dict:
    payload = hashlib.sha256(b"hpcrl-echo/%d" % ctx.task.rank).digest() * 32       # 1 KiB, this rank's own

    def check(server: int) -> dict:
        reply, seconds = _round_trip(ctx, server, {"op": "echo", "rank": ctx.task.rank, "payload": payload})
        ok = (reply.get("server_rank") == server and reply.get("rank") == ctx.task.rank
              and reply.get("payload") == payload)
        return {"ok": ok, "server_rank": reply.get("server_rank"), "bytes": len(payload), "seconds": round(seconds, 4)}
    return _each_server(ctx, check)


def _each_server(ctx: LaunchContext, check) -> dict:
    """A round trip with every engine the trainer's row names; one engine's result as it is."""
    results = [check(server) for server in ctx.task.servers]
    if len(results) == 1:
        return results[0]
    return {"ok": all(r["ok"] for r in results), "servers": results}


def _round_trip(ctx: LaunchContext, server: int, sent: dict) -> tuple[dict, float]:
    """Send `sent` to the engine `server`, wait (bounded) for its echo, then say "done"."""
    channel = ctx.channels[server]
    t0 = time.perf_counter()
    try:
        reply = channel.request(sent, timeout=ctx.launch.collective_timeout_s)
    except TimeoutError:
        raise TimeoutError(f"the server rank {server} did not echo within {ctx.launch.collective_timeout_s:.0f} s "
                           f"(launch.collective_timeout_s)") from None
    seconds = time.perf_counter() - t0
    channel.send({"op": "done"})
    return reply, seconds


def _serve(ctx: LaunchContext, receiver: "probe_transfer.Receiver | None" = None) -> dict:
    """The engine's part: echo each trainer it serves until that trainer is done; ``receiver`` takes
    the weight-transfer check's messages (the node's sender's)."""
    from hpcrl.compute.launch.node_channel import PeerClosed

    expected = sorted(t.rank for t in ctx.plan.served_by(ctx.task.rank))
    pending, served = set(expected), []
    while pending:
        try:
            rank, msg = ctx.channel.recv_any(timeout=ctx.launch.collective_timeout_s)
        except PeerClosed as e:
            if e.rank in pending:
                raise
            continue
        except TimeoutError:
            raise TimeoutError(f"trainer(s) {sorted(pending)} sent nothing for {ctx.launch.collective_timeout_s:.0f} s "
                               f"(launch.collective_timeout_s)") from None
        if msg.get("op") == "echo":
            ctx.channel.reply(rank, {**msg, "server_rank": ctx.task.rank})
            served.append(rank)
        elif receiver is not None and (msg.get("op", "").startswith("weights_") or msg.get("op") == "probe_transfer"):
            ctx.channel.reply(rank, receiver.handle(rank, msg))
        elif msg.get("op") == "done":
            pending.discard(rank)
    return {"ok": sorted(served) == expected, "served": sorted(served)}


def _all_reduce(ctx: LaunchContext) -> dict:
    import torch
    import torch.distributed as dist

    device = "cuda" if ctx.device == "cuda" else "cpu"
    n = ctx.plan.num_trainers
    total = torch.tensor([float(ctx.task.trainer_rank + 1)], device=device)
    dist.all_reduce(total)
    result = {"ok": total.item() == n * (n + 1) / 2, "sum": total.item(), "world": dist.get_world_size()}
    for dim, size in zip(ctx.mesh_choice.dim_names, ctx.mesh_choice.shape):
        one = torch.ones(1, device=device)
        dist.all_reduce(one, group=ctx.mesh.get_group(dim))
        result[f"mesh_{dim}"] = one.item()
        result["ok"] = result["ok"] and one.item() == size
        # Which nodes the group spans: a shard group is one node, or the nodes choose_mesh named.
        nodes = torch.zeros(ctx.plan.nodes, device=device)
        nodes[ctx.task.node] = 1
        dist.all_reduce(nodes, group=ctx.mesh.get_group(dim))
        result[f"mesh_{dim}_nodes"] = [i for i, n in enumerate(nodes.tolist()) if n > 0]
    return result


def _mpi_allreduce(ctx: LaunchContext) -> dict:
    comm, n = ctx.trainer_comm, ctx.plan.num_trainers
    if comm is None:
        return {"ok": True, "skipped": "no MPI (identity from SLURM_* variables): no trainers' communicator"}
    t0 = time.perf_counter()
    total = comm.allreduce(ctx.task.trainer_rank + 1)           # a sum
    seconds = time.perf_counter() - t0
    return {"ok": total == n * (n + 1) // 2 and comm.Get_size() == n, "sum": total, "world": comm.Get_size(),
            "seconds": round(seconds, 4)}
