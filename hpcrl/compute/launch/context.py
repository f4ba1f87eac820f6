"""What a role function receives: everything the launch established for this task."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcrl.compute.launch.node_channel import NodeChannel, NodeServerChannel
from hpcrl.job.mesh_choice import MeshChoice
from hpcrl.compute.launch.pinning import Pinning
from hpcrl.compute.launch.rendezvous import Identity
from hpcrl.compute.launch.watchdog import Hub, Watchdog
from hpcrl.job.placement import Plan, Task
from hpcrl.job.spec import JobSpec


@dataclass
class LaunchContext:
    spec: JobSpec
    plan: Plan
    task: Task                       # this task's plan row
    identity: Identity               # what the launcher said (equals the row, or we stopped)
    run_dir: Path
    pinning: Pinning
    watchdog: Watchdog
    # Servers: a NodeServerChannel to the trainers they serve.
    channel: NodeServerChannel | None = None
    # Trainers: a NodeChannel to each engine of its row's `servers` (prompts, weights), by its rank.
    channels: dict[int, NodeChannel] = field(default_factory=dict)
    world: Any = None                # mpi4py COMM_WORLD; None under the SLURM_* fallback
    node_comm: Any = None            # mpi4py communicator of this node's tasks (same condition)
    trainer_comm: Any = None         # mpi4py communicator of all trainers (None on servers, or no MPI)
    trainer_group: Any = None        # torch.distributed default group = all trainers (None on servers)
    mesh: Any = None                 # torch DeviceMesh over the trainers (None on servers)
    mesh_choice: MeshChoice | None = None
    hub: Hub | None = None           # rank 0 only: the job's watchdog hub
    note: str = ""                   # why identity came from where it did (fallbacks)
    # Seconds from the task's start to the end of each launch phase (rendezvous, node_channel,
    # trainers_group): where start-up time goes at scale.
    timings: dict[str, float] = field(default_factory=dict)
    # Trainers: when (wall clock) this task's import of torch began and ended; the probe reports it,
    # so that a test can see every trainer's import overlap the others'.
    torch_import: tuple[float, float] | None = None

    @property
    def role(self) -> str:
        return self.task.role

    @property
    def is_trainer(self) -> bool:
        return self.task.role == "trainer"

    @property
    def is_server(self) -> bool:
        return self.task.role == "server"

    @property
    def is_sender(self) -> bool:
        """This trainer streams the weights to one or more engines of its node."""
        return self.task.sender

    @property
    def device(self) -> str:
        """The torch device type this task computes on ("cuda" is also ROCm)."""
        return self.spec.site.device

    @property
    def launch(self):
        return self.spec.recipe.launch

    def log(self, message: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        role = self.task.role if self.task.engine is None or self.plan.engines_per_node == 1 else f"engine {self.task.engine}"
        write_line(f"[hpcrl {stamp} rank {self.task.rank} node {self.task.node} {role}] {message}", sys.stderr)


def write_line(text: str, stream=None) -> None:
    """One write() per line: the launcher merges every task's output, and a line written in
    pieces (print writes the text and the newline separately) comes out spliced with others'."""
    stream = stream or sys.stdout
    stream.flush()
    os.write(stream.fileno(), (text + "\n").encode(errors="replace"))
