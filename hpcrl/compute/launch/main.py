"""`python -m hpcrl.compute.launch RUN_DIR`: every task of a job (srun or mpiexec) runs this.

Load the job spec, find out who we are, pin to our GPU(s) and cores, meet the others, then do
our role: by `recipe.mode`, "probe" (print what this task got, check the links, exit),
"control" (the same without torch: no trainers' torch group, bytes over the node channel, an MPI
allreduce; probe.py) or "train" (hpcrl.compute.train.role:run_trainer /
hpcrl.compute.inference.server:run_server).

Order matters: mpi4py before torch; pinning before torch (CUDA reads the variable at init).
Nothing here imports mpi4py or torch at module level (see rendezvous.py).
"""

from __future__ import annotations

import importlib
import os
import socket
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

from hpcrl.job.errors import UserError
from hpcrl.compute.launch import faults, leave, outcome, pinning, rendezvous, shm_sweep
from hpcrl.compute.launch.node_channel import NodeChannel, NodeServerChannel
from hpcrl.compute.launch.context import LaunchContext, write_line
from hpcrl.compute.launch.mesh import build_mesh
from hpcrl.compute.launch.reason import explain, only_points_elsewhere
from hpcrl.job.mesh_choice import choose_mesh
from hpcrl.compute.launch.rendezvous import ArrivalBook, LaunchError
from hpcrl.compute.launch.stop import STOP
from hpcrl.compute.launch.supervisor import Supervisor
from hpcrl.compute.launch.watchdog import Hub, Peer, Watchdog
from hpcrl.job.spec import JobSpec

ROLE_ENTRIES = {"trainer": ("hpcrl.compute.train.role", "run_trainer"),
                "server": ("hpcrl.compute.inference.server", "run_server")}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1 or args[0].startswith("-"):
        print("usage: python -m hpcrl.compute.launch RUN_DIR", file=sys.stderr)
        return 2
    run_dir = Path(args[0]).absolute()
    try:
        spec = JobSpec.load(run_dir)
        plan = spec.plan()
    except UserError as e:
        print(f"hpcrl: error: {e}", file=sys.stderr)
        return 2
    launch = spec.recipe.launch
    outcome.record_to(run_dir)
    # Before MPI_Init: a killed attempt's segments would break it; its engines' buffers hold memory.
    stale = shm_sweep.sweep_run(run_dir)
    if stale:
        print(f"hpcrl: removed {len(stale)} shared-memory file(s) a killed run left in /dev/shm "
              f"({', '.join(stale[:3])}{', ...' if len(stale) > 3 else ''})", file=sys.stderr, flush=True)
    book = ArrivalBook(run_dir, rendezvous.launch_id(os.environ), plan)
    who = _who(plan)
    supervisor = Supervisor(who, launch.rendezvous_timeout_s, book.explain)
    if not supervisor.start():
        return supervisor.supervise()
    STOP.install()          # the task itself: a stop request from now on is kept, never fatal
    try:
        ctx = setup(spec, run_dir, supervisor, book)
    except (LaunchError, pinning.PinningError, TimeoutError, ConnectionError) as e:
        outcome.fatal(f"hpcrl: {who}: {e}; exiting")
        return leave.exit_failed(1)
    code = run_role(ctx)
    STOP.ignore_late_requests()
    code = teardown(ctx, code)
    if code != 0:
        return leave.exit_failed(code)
    if ctx.trainer_group is not None or ctx.is_server:
        # Never through finalization: leave.py says why. A server's engine is left to the process's
        # exit (InferenceEngine.close_before_exit), and finalization would report what it still
        # holds (nanobind's "leaked 514 functions" of triton, on stderr).
        leave.exit_finished(0)
    return 0


def _who(plan) -> str:
    """How messages name this task before MPI has confirmed its rank."""
    rank = rendezvous.rank_hint(os.environ)
    if rank is None:
        return f"pid {os.getpid()} on {socket.gethostname()}"
    if rank >= plan.world_size:
        return f"rank {rank} (beyond the plan's {plan.world_size} tasks)"
    task = plan.task(rank)
    return f"rank {rank} (node {task.node}, {plan.role_of(task)})"


# ---------------------------------------------------------------------------- setup
def setup(spec: JobSpec, run_dir: Path, supervisor: Supervisor, book: ArrivalBook) -> LaunchContext:
    env, site, plan, launch = os.environ, spec.site, spec.plan(), spec.recipe.launch
    started = time.monotonic()
    hint = rendezvous.rank_hint(env)
    faults.inject("before-rendezvous", hint)
    if hint is not None:
        book.mark(hint)
    supervisor.stage("in MPI_Init, which waits for every task")
    identity, world, node_comm, note = rendezvous.discover(env, launch.rendezvous, rendezvous.tasks_per_fake_node(spec))
    if hint != identity.rank:
        book.mark(identity.rank)
    problem, pinned = rendezvous.placement_problem(identity, plan), None
    if problem is None:
        try:
            pinned = pinning.resolve(site, plan.task(identity.rank), plan.tasks_per_node, env)
        except pinning.PinningError as e:
            problem = str(e)
    if world is not None:            # fail together now rather than one by one at the deadline
        problem = problem or next((p for p in world.allgather(problem) if p), None)
    if problem:
        raise LaunchError(problem)
    task = plan.task(identity.rank)
    pinning.apply_gpu_env(pinned)
    hub, info = _bootstrap(supervisor, book, task, world, spec)
    me = Peer(task.rank, task.node, task.local_rank, task.role, socket.gethostname(), os.getpid(),
              task.engine if plan.engines_per_node > 1 else None)
    watchdog = Watchdog(me, info["secret"], launch.peer_failure_timeout_s)
    supervisor.stage(f"registering with rank 0's watchdog hub at {info['hub'][0]}:{info['hub'][1]}")
    watchdog.connect(tuple(info["hub"]), plan.world_size, launch.rendezvous_timeout_s)
    supervisor.done()
    if task.rank == 0:
        rendezvous.write_ranks(run_dir, [asdict(p) for p in watchdog.peers])
        book.remove()
    faults.inject("after-rendezvous", task.rank)

    ctx = LaunchContext(spec=spec, plan=plan, task=task, identity=identity, run_dir=run_dir, pinning=pinned,
                        watchdog=watchdog, world=world, node_comm=node_comm, hub=hub, note=note)
    mark = lambda phase: ctx.timings.__setitem__(phase, round(time.monotonic() - started, 3))  # noqa: E731
    mark("rendezvous")
    if note and task.rank == 0:
        ctx.log(note)
    if pinned.warning:
        ctx.log(f"warning: {pinned.warning}")
    try:
        _connect_node_channel(ctx, info["secret"])
        mark("node_channel")
        if world is not None:
            from mpi4py import MPI
            sub = world.Split(0 if ctx.is_trainer else MPI.UNDEFINED, key=task.rank)
            ctx.trainer_comm = None if sub == MPI.COMM_NULL else sub
        if ctx.is_trainer and spec.recipe.mode != "control":      # control: no torch anywhere
            _join_trainers(ctx)
            mark("trainers_group")
        pinning.apply_affinity(pinned)
    except BaseException as e:
        _report_failure(ctx, e)
        raise LaunchError(explain(e)) from None
    if task.rank == 0:
        ctx.log("launched: " + ", ".join(f"{k} at {v:.1f} s" for k, v in ctx.timings.items()))
    return ctx


def _bootstrap(supervisor: Supervisor, book: ArrivalBook, task, world, spec: JobSpec):
    """Rank 0 opens the watchdog hub; its address and the job's secret reach everyone by MPI
    broadcast, or through a private file in the run directory without MPI."""
    launch, hub, info = spec.recipe.launch, None, None
    if task.rank == 0:
        try:
            host = rendezvous.rendezvous_host(spec.site, spec.nodes)
            secret = rendezvous.new_secret()
            hub = Hub(secret, spec.plan().world_size, launch.peer_failure_timeout_s, host).start()
            info = {"secret": secret, "hub": hub.address}
        except (LaunchError, OSError) as e:
            info = {"error": str(e)}
    if world is None and book.dir is None:
        raise LaunchError("no launch id (SLURM_JOB_ID/SLURM_STEP_ID or HPCRL_LAUNCH_ID) to meet by")
    if world is not None:
        supervisor.stage("waiting for rank 0's MPI broadcast")
        info = world.bcast(info, root=0)
    elif task.rank == 0:
        rendezvous.publish_bootstrap(book, info)
    else:
        supervisor.stage(f"waiting for rank 0's bootstrap file in {book.dir}")
        info = rendezvous.read_bootstrap(book, launch.rendezvous_timeout_s)
    if "error" in info:
        raise LaunchError(f"rank 0 could not open the rendezvous: {info['error']}")
    return hub, info


def _connect_node_channel(ctx: LaunchContext, secret: bytes) -> None:
    timeout = ctx.launch.rendezvous_timeout_s
    if ctx.is_server:
        ctx.channel = NodeServerChannel(secret, ctx.task.node, [t.rank for t in ctx.plan.served_by(ctx.task.rank)],
                                        ctx.task.rank)
        ctx.channel.accept_all(timeout)
    else:
        # Its plan row lists every engine it asks for prompts or streams weights to (servers).
        for server in ctx.task.servers:
            ctx.channels[server] = NodeChannel.connect(secret, ctx.task.node, ctx.task.rank, server, timeout)


def _join_trainers(ctx: LaunchContext) -> None:
    site, plan, launch = ctx.spec.site, ctx.plan, ctx.launch
    # Every trainer imports torch now, at once: else trainer rank 0 imports it to open the store while
    # the others wait for the store's address, and only then import theirs. From a shared file system at
    # scale one import takes a minute (OLCF measured 51 s from Lustre at 8 nodes): paid twice in a row.
    started = time.time()
    importlib.import_module("torch.distributed")
    ctx.torch_import = (started, time.time())
    store, address = None, None
    if ctx.task.trainer_rank == 0:
        host = ctx.hub.address[0]
        store = rendezvous.create_trainer_store(host, plan.num_trainers, launch.rendezvous_timeout_s)
        address = (host, store.port)
    if ctx.trainer_comm is not None:
        address = ctx.trainer_comm.bcast(address, root=0)
    elif ctx.task.trainer_rank == 0:
        ctx.watchdog.bcast("trainer_store", address)
    else:
        address = ctx.watchdog.wait_bcast("trainer_store", launch.rendezvous_timeout_s)
    ctx.trainer_group = rendezvous.init_trainer_group(site, ctx.task.trainer_rank, plan.num_trainers,
                                                      tuple(address), store, launch.rendezvous_timeout_s,
                                                      launch.collective_timeout_s)
    ctx.mesh_choice = choose_mesh(ctx.spec, plan)
    if ctx.task.trainer_rank == 0:
        ctx.log(ctx.mesh_choice.describe())
    ctx.mesh = build_mesh(ctx.mesh_choice, site.device)


# ---------------------------------------------------------------------------- roles
def run_role(ctx: LaunchContext) -> int:
    try:
        if ctx.spec.recipe.mode in ("probe", "control"):
            from hpcrl.compute.launch import probe
            return probe.run(ctx) if ctx.spec.recipe.mode == "probe" else probe.run_control(ctx)
        module_name, func_name = ROLE_ENTRIES[ctx.role]
        # Imported here: a probe job, and the other role, never pay for torch/vLLM imports they do not use.
        return int(getattr(importlib.import_module(module_name), func_name)(ctx) or 0)
    except BaseException as e:
        traceback.print_exc()
        _report_failure(ctx, e)
        return 1


ECHO_GRACE_S = 5.0      # how long an error that only points elsewhere waits for the real one


def _report_failure(ctx: LaunchContext, e: BaseException) -> None:
    """Tell the hub. An error that names no cause of its own (a trainer told "EngineDeadError: see
    the stack trace above" by its server) waits longer for the task that has one (the server names
    how its engine died); only if none speaks does it become the job's reason."""
    if only_points_elsewhere(e):
        ctx.watchdog.fail(explain(e), grace_s=ECHO_GRACE_S)
    else:
        ctx.watchdog.fail(explain(e))


def teardown(ctx: LaunchContext, code: int) -> int:
    if code == 0 and ctx.trainer_group is not None:
        import torch.distributed as dist

        dist.destroy_process_group()
    if ctx.channel is not None:
        ctx.channel.close()
    for channel in ctx.channels.values():
        channel.close()
    ctx.watchdog.close()
    if ctx.hub is not None:
        failures = ctx.hub.close(wait_s=ctx.launch.collective_timeout_s)
        # What the hub saw go wrong, said at the end. A task that failed kept its own reason as it
        # told the hub (Watchdog.fail); the record here is for a rank that vanished without a word,
        # or for a failure told a moment before its task kept it. A rank that failed outranks one
        # that merely vanished; an earlier record (first writer wins) is kept.
        own = [r for r, why in sorted(failures.items()) if why.startswith("failed:")] or sorted(failures)
        for rank, reason in sorted(failures.items()):
            line = f"hpcrl: rank 0: at the end, rank {rank} {reason}"
            if rank == own[0]:
                outcome.fatal(line, summary=f"rank {rank} {reason}")
            else:
                write_line(line, sys.stderr)
        if failures and code == 0:
            code = 1
    return code
