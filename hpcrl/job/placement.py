"""Which task does what, on which GPUs and cores: computed from the site profile alone.

Pure logic shared by the login side (`hpcrl plan`, the script's task counts) and the compute
side (each task looks up its own row), so that the plan a user reads is the one that runs.

Per node: inference.gpus GPUs generate, in engines of inference.tensor_parallel_size GPUs each; every
other GPU runs one trainer. Each engine sits where a trainer of its node has the fastest link to it
(on Frontier: one GCD of an MI250X, its sender the other GCD), and that trainer is its sender: the
bucketed gather leaves every trainer of the node holding each bucket, so all of a node's engines are
synced at once, each by its own sender. Trainers are spread evenly over the engines for their
prompts. When engines outnumber trainers, a trainer feeds and syncs several engines (one after
another: each is a gather round, see `Plan.sync_rounds`).

Local ranks put the trainers first, in GPU order, then the engines in engine order. Tasks are laid
out in blocks per node (Slurm's default distribution): rank = node * tasks_per_node + local_rank.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Literal

from hpcrl.job.errors import UserError
from hpcrl.job.site import Site


@dataclass(frozen=True)
class Task:
    rank: int
    node: int
    local_rank: int
    role: Literal["trainer", "server"]
    gpus: tuple[int, ...]          # physical GPU ids on the node
    cores: tuple[int, ...]         # CPU cores the task is pinned to
    sender: bool                   # this trainer streams weights to an engine of its node
    trainer_rank: int | None       # rank in the trainers' process group (None for servers)
    server_rank: int               # trainers: the engine that serves its prompts (first of `servers`); servers: itself
    engine: int | None = None      # servers: the engine's index on its node (0 = on the highest GPUs)
    servers: tuple[int, ...] = ()  # trainers: the engines (global ranks) its prompts are split over
    sends_to: tuple[int, ...] = () # trainers: the engines it streams weights to, in sync order

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Plan:
    nodes: int
    tasks_per_node: int
    trainers_per_node: int
    server_gpus: int               # inference.gpus: the node's GPUs that generate
    tasks: tuple[Task, ...]
    tensor_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        return len(self.tasks)

    @property
    def num_trainers(self) -> int:
        return self.trainers_per_node * self.nodes

    @property
    def engines_per_node(self) -> int:
        return self.server_gpus // self.tensor_parallel_size

    @property
    def sync_rounds(self) -> int:
        """Gathers per weight sync: one, unless a trainer feeds several engines (then one per engine
        it feeds, on every trainer, since a gather is a collective of all of them)."""
        return max(len(t.sends_to) for t in self.tasks if t.role == "trainer")

    def task(self, rank: int) -> Task:
        return self.tasks[rank]

    def node_tasks(self, node: int) -> tuple[Task, ...]:
        return self.tasks[node * self.tasks_per_node:(node + 1) * self.tasks_per_node]

    def node_servers(self, node: int) -> tuple[Task, ...]:
        return tuple(t for t in self.node_tasks(node) if t.role == "server")

    def served_by(self, server_rank: int) -> tuple[Task, ...]:
        """The trainers whose prompts the engine `server_rank` generates for."""
        node = self.task(server_rank).node
        return tuple(t for t in self.node_tasks(node) if server_rank in t.servers)

    def sender_of(self, server_rank: int) -> Task:
        node = self.task(server_rank).node
        return next(t for t in self.node_tasks(node) if server_rank in t.sends_to)

    def role_of(self, task: Task) -> str:
        """How messages name a task's role: "trainer", "server", or "server, engine <e>" when a node
        has several engines."""
        return task.role if task.engine is None or self.engines_per_node == 1 else f"server, engine {task.engine}"

    def senders(self) -> dict[int, int]:
        """Each engine's rank -> its sender's rank."""
        return {t.rank: self.sender_of(t.rank).rank for t in self.tasks if t.role == "server"}


def node_cores(site: Site) -> int:
    return site.node.cores or os.cpu_count() or 1


def _split_cores(n_trainers: int, n_servers: int, n_cores: int) -> list[tuple[int, ...]]:
    """Cores per local rank (trainers first) when the site maps no cores to GPUs: an even split; on
    a machine with fewer cores than tasks the engines keep the last core(s) to themselves and
    trainers share the rest, because generation and training fighting for one core's threads is
    the slowest layout (on the 2-core dev VM a training step of the demo took 10x longer with both
    roles on both cores)."""
    n_tasks = n_trainers + n_servers
    if n_cores >= n_tasks:
        return [tuple(range(i * n_cores // n_tasks, (i + 1) * n_cores // n_tasks)) for i in range(n_tasks)]
    if n_cores == 1:
        return [(0,)] * n_tasks
    server_cores = max(1, min(n_servers, n_cores - n_trainers, n_cores - 1))
    trainer_cores = n_cores - server_cores
    return ([(i % trainer_cores,) for i in range(n_trainers)]
            + [(trainer_cores + i % server_cores,) for i in range(n_servers)])


def _engine_gpus(site: Site, engines: int, tp: int) -> list[tuple[int, ...]]:
    """The GPUs of each engine, engine 0 on the highest. With link groups of equal size (Frontier's
    MI250X: two GCDs), an engine smaller than a group takes the top of one and leaves the rest of
    it to trainers (its sender among them); an engine of whole groups takes whole groups. Otherwise
    (NVSwitch: every GPU one hop away) the highest GPUs, in blocks."""
    groups = sorted((tuple(sorted(g)) for g in site.node.gpu_links), key=max, reverse=True)
    size = len(groups[0]) if groups else 0
    if groups and all(len(g) == size for g in groups):
        if tp < size and engines <= len(groups):
            return [g[-tp:] for g in groups[:engines]]
        if tp % size == 0 and engines * tp // size <= len(groups):
            k = tp // size
            return [tuple(sorted(x for g in groups[e * k:(e + 1) * k] for x in g)) for e in range(engines)]
    top = list(range(site.node.gpus - 1, -1, -1))
    return [tuple(sorted(top[e * tp:(e + 1) * tp])) for e in range(engines)]


def _senders(site: Site, engine_gpus: list[tuple[int, ...]], trainer_gpus: list[int]) -> list[int]:
    """Each engine's sender (a trainer GPU): one sharing a link group with it (on Frontier the
    other GCD of the same MI250X), else the highest trainer GPU not yet sending; once every trainer
    sends, engines are shared out among them again, highest first."""
    taken: list[int] = []
    for e, gpus in enumerate(engine_gpus):
        free = [g for g in trainer_gpus if g not in taken]
        linked = [g for group in site.node.gpu_links if set(group) & set(gpus) for g in group if g in free]
        if linked or free:
            taken.append(max(linked or free))
        else:
            taken.append(sorted(trainer_gpus, reverse=True)[e % len(trainer_gpus)])
    return taken


def make_plan(site: Site, nodes: int, server_gpus: int = 1, tensor_parallel_size: int = 1) -> Plan:
    gpus, tp = site.node.gpus, tensor_parallel_size
    if nodes < 1:
        raise UserError(f"nodes: must be at least 1, got {nodes}")
    if server_gpus >= gpus:
        raise UserError(f"inference.gpus: {server_gpus} server GPU(s) leave no trainer on a node "
                        f"with {gpus} GPUs (site {site.name}); allowed: 1..{gpus - 1}")
    if tp < 1 or server_gpus % tp:
        raise UserError(f"inference.tensor_parallel_size: {tp} must divide inference.gpus={server_gpus} "
                        f"(the node's GPUs that generate, in engines of tensor_parallel_size GPUs each); "
                        f"for one engine of {tp} GPUs set inference.gpus={tp}")
    engine_gpus = _engine_gpus(site, server_gpus // tp, tp)
    trainer_gpus = sorted(set(range(gpus)) - {g for e in engine_gpus for g in e})
    sender_gpus = _senders(site, engine_gpus, trainer_gpus)
    n_trainers, n_engines = len(trainer_gpus), len(engine_gpus)
    per_node = n_trainers + n_engines
    # The engines each trainer's prompts go to (as local engine indices): a sender to the engine(s)
    # it syncs, the others spread evenly (fewest served first).
    serves: dict[int, list[int]] = {g: [] for g in trainer_gpus}
    for e, g in enumerate(sender_gpus):
        serves[g].append(e)
    load = [sum(e in s for s in serves.values()) for e in range(n_engines)]
    for g in trainer_gpus:
        if not serves[g]:
            e = min(range(n_engines), key=lambda i: (load[i], i))
            serves[g].append(e)
            load[e] += 1
    split = (None if site.node.gpu_cores else _split_cores(n_trainers, n_engines, node_cores(site)))

    def cores_for(local_rank: int, task_gpus: tuple[int, ...]) -> tuple[int, ...]:
        if split is not None:
            return split[local_rank]
        return tuple(sorted({c for g in task_gpus for c in site.gpu_cores(g)}))

    tasks = []
    for node in range(nodes):
        base = node * per_node
        engine_rank = [base + n_trainers + e for e in range(n_engines)]
        for local_rank, gpu in enumerate(trainer_gpus):
            sends = tuple(engine_rank[e] for e, g in enumerate(sender_gpus) if g == gpu)
            servers = tuple(engine_rank[e] for e in serves[gpu])
            tasks.append(Task(base + local_rank, node, local_rank, "trainer", (gpu,), cores_for(local_rank, (gpu,)),
                              bool(sends), node * n_trainers + local_rank, servers[0], None, servers, sends))
        for e, egpus in enumerate(engine_gpus):
            local_rank = n_trainers + e
            tasks.append(Task(base + local_rank, node, local_rank, "server", egpus, cores_for(local_rank, egpus),
                              False, None, base + local_rank, e))
    return Plan(nodes, per_node, n_trainers, server_gpus, tuple(tasks), tp)


def format_cores(cores: tuple[int, ...]) -> str:
    """(1, 2, 3, 7) -> "1-3,7"."""
    parts, start = [], None
    for i, c in enumerate(cores):
        if start is None:
            start = c
        if i + 1 == len(cores) or cores[i + 1] != c + 1:
            parts.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(parts)
