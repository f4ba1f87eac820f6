"""Which task does what, on which GPUs and cores: computed from the site profile alone.

Pure logic shared by the login side (`hpcrl plan`, the script's task counts) and the compute
side (each task looks up its own row), so that the plan a user reads is the one that runs.

Per node: the server takes the highest-numbered GPUs (physical ids); every other GPU runs one
trainer. Local ranks put the trainers first, in GPU order, and the server last. Tasks are laid
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
    sender: bool                   # this trainer streams weights to its node's server
    trainer_rank: int | None       # rank in the trainers' process group (None for servers)
    server_rank: int               # global rank of this node's server

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Plan:
    nodes: int
    tasks_per_node: int
    trainers_per_node: int
    server_gpus: int
    tasks: tuple[Task, ...]

    @property
    def world_size(self) -> int:
        return len(self.tasks)

    @property
    def num_trainers(self) -> int:
        return self.trainers_per_node * self.nodes

    def task(self, rank: int) -> Task:
        return self.tasks[rank]

    def node_tasks(self, node: int) -> tuple[Task, ...]:
        return self.tasks[node * self.tasks_per_node:(node + 1) * self.tasks_per_node]

    def sender_of(self, node: int) -> Task:
        return next(t for t in self.node_tasks(node) if t.sender)


def node_cores(site: Site) -> int:
    return site.node.cores or os.cpu_count() or 1


def _split_cores(n_tasks: int, n_cores: int) -> list[tuple[int, ...]]:
    """Cores per local rank when the site maps no cores to GPUs: an even split; on a machine with
    fewer cores than tasks the server (last) keeps one core to itself and trainers share the rest,
    because generation and training fighting for one core's threads is the slowest layout (on the
    2-core dev VM a training step of the demo took 10x longer with both roles on both cores)."""
    if n_cores >= n_tasks:
        return [tuple(range(i * n_cores // n_tasks, (i + 1) * n_cores // n_tasks)) for i in range(n_tasks)]
    if n_cores == 1:
        return [(0,)] * n_tasks
    trainers = [(i % (n_cores - 1),) for i in range(n_tasks - 1)]
    return trainers + [(n_cores - 1,)]


def _sender_gpu(site: Site, trainer_gpus: list[int], server_gpus: list[int]) -> int:
    """The trainer GPU with the fastest link to the server: one sharing a link group with it
    (on Frontier the other GCD of the same MI250X), else the highest-numbered trainer GPU."""
    linked = [g for group in site.node.gpu_links if set(group) & set(server_gpus)
              for g in group if g in trainer_gpus]
    return max(linked) if linked else max(trainer_gpus)


def make_plan(site: Site, nodes: int, server_gpus: int = 1) -> Plan:
    gpus = site.node.gpus
    if nodes < 1:
        raise UserError(f"nodes: must be at least 1, got {nodes}")
    if server_gpus >= gpus:
        raise UserError(f"inference.gpus: {server_gpus} server GPU(s) leave no trainer on a node "
                        f"with {gpus} GPUs (site {site.name}); allowed: 1..{gpus - 1}")
    server = list(range(gpus - server_gpus, gpus))
    trainer_gpus = list(range(gpus - server_gpus))
    sender = _sender_gpu(site, trainer_gpus, server)
    per_node = len(trainer_gpus) + 1
    split = None if site.node.gpu_cores else _split_cores(per_node, node_cores(site))

    def cores_for(local_rank: int, task_gpus: list[int]) -> tuple[int, ...]:
        if split is not None:
            return split[local_rank]
        return tuple(sorted({c for g in task_gpus for c in site.gpu_cores(g)}))

    tasks = []
    for node in range(nodes):
        server_rank = node * per_node + per_node - 1
        for local_rank, gpu in enumerate(trainer_gpus):
            rank = node * per_node + local_rank
            tasks.append(Task(rank, node, local_rank, "trainer", (gpu,), cores_for(local_rank, [gpu]),
                              gpu == sender, node * len(trainer_gpus) + local_rank, server_rank))
        tasks.append(Task(server_rank, node, per_node - 1, "server", tuple(server),
                          cores_for(per_node - 1, server), False, None, server_rank))
    return Plan(nodes, per_node, len(trainer_gpus), server_gpus, tuple(tasks))


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
