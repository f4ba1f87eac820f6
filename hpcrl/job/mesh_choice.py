"""The trainers' mesh: FSDP over every trainer, or HSDP (shard inside a group of nodes, replicate
across groups), chosen from the recipe and the memory estimate; and what a weight sync then moves
across nodes.

Standard library only: `hpcrl plan` runs it on the login node and the launch
(hpcrl.compute.launch.mesh) makes its choice with the same code, so the plan a user reads is the
mesh that runs.
"""

from __future__ import annotations

from typing import NamedTuple

from hpcrl.job.job_memory import device_word, frozen_dtype, serve_dtype, task_capacity, trainer_parts_for
from hpcrl.job.memory import (GIB, REFERENCE_BYTES_PER_PARAM, TRAIN_BYTES_PER_PARAM, adam_moment_bytes, gib_text,
                              with_moments)
from hpcrl.job.model_shape import DTYPE_BYTES, ModelShape, count_parameters, model_shape
from hpcrl.job.placement import Plan
from hpcrl.job.spec import JobSpec

# The fallback mesh rule where the model's shape is unknown (safetensors only, or demo sizes):
# the share of device memory the training state may take; activations and FSDP's gathered layers
# need the rest.
STATE_MEMORY_SHARE = 0.6


class MeshChoice(NamedTuple):
    kind: str                          # "fsdp" or "hsdp"
    shape: tuple[int, ...]             # (trainers,) or (nodes, trainers per node)
    dim_names: tuple[str, ...]
    reason: str
    params: int | None = None
    nodes_per_shard: int = 1           # HSDP: the nodes one shard group (one copy of the state) spans

    def describe(self) -> str:
        dims = " x ".join(f"{n}={s}" for n, s in zip(self.dim_names, self.shape))
        return f"mesh {self.kind} ({dims}): {self.reason}"

    @property
    def shard(self) -> int:
        """How many trainers share one copy of the model's state."""
        return self.shape[-1]

    @property
    def hpz_partition_size(self) -> int:
        """trainer.engine=deepspeed: ZeRO++'s secondary partition (zero_hpz_partition_size), the
        HSDP of DeepSpeed: each node's trainers for HSDP over several nodes, else 1 (plain ZeRO-3,
        also where a shard group spans nodes: hpZ's secondary copy is a node's)."""
        return self.shard if self.kind == "hsdp" and self.shape[0] > 1 and self.nodes_per_shard == 1 else 1


def choose_mesh(spec: JobSpec, plan: Plan) -> MeshChoice:
    """FSDP over every trainer, or HSDP (shard inside a group of nodes, replicate across groups).

    HSDP inside one node keeps the all-gathers of a weight sync inside the node, where the node's
    sender hands the weights to its server: no weight bytes cross the interconnect for a sync.
    `auto` picks it where one node's trainers hold the whole training step (the trainers' estimate,
    when the model's config.json and the GPU's memory are known; else the training state alone
    within 60% of the node's memory). Where they do not, the state is sharded over the fewest nodes
    that hold it (a number of nodes that divides the job's), replicated beyond: every all-gather,
    a sync's included, then spans those nodes only, not the whole job; FSDP over every trainer is
    left for a model no smaller group holds."""
    shape, _ = model_shape(spec.recipe.model.path)
    params = shape.params if shape else count_parameters(spec.recipe.model.path)
    return choose_mesh_for_shape(spec, plan, shape, params)


def choose_mesh_for_shape(spec: JobSpec, plan: Plan, shape: ModelShape | None, params: int | None) -> MeshChoice:
    """choose_mesh for a model already read (hpcrl.job.estimate reads it once for the mesh and the
    estimate): its shape, or None with its parameter count, or None for both."""
    nodes, per_node = plan.nodes, plan.trainers_per_node

    def fsdp(reason: str) -> MeshChoice:
        return MeshChoice("fsdp", (plan.num_trainers,), ("shard",), reason, params)

    def hsdp(reason: str) -> MeshChoice:
        return MeshChoice("hsdp", (nodes, per_node), ("replicate", "shard"), reason, params)

    wanted = spec.recipe.trainer.mesh
    if wanted == "fsdp":
        return fsdp("set in the recipe (trainer.mesh)")
    if wanted == "hsdp":
        return hsdp("set in the recipe (trainer.mesh)")
    if nodes == 1:
        return fsdp("one node: sharding over its trainers is HSDP already")
    capacity = task_capacity(spec, plan)

    def over(k: int) -> str:
        return f"one node's {per_node} trainers" if k == 1 else f"{k} nodes' {k * per_node} trainers"

    if shape is not None and capacity:
        def holds(k: int) -> bool:
            return sum(trainer_parts_for(spec, shape, k * per_node).values()) <= capacity

        def facts(k: int) -> str:
            need = sum(trainer_parts_for(spec, shape, k * per_node).values())
            return (f"~{gib_text(need)} GB per {device_word(spec)} with the state sharded over {over(k)}, "
                    f"of {gib_text(capacity)} GB")
    elif params is None:
        return fsdp(f"the size of {spec.recipe.model.path} is unknown: shard over all trainers to be safe")
    elif not capacity:
        return hsdp("the site gives no memory size; assuming the model fits one node")
    else:
        if spec.recipe.model.use_peft:
            # frozen weights only (the adapters, unknown without the shape, are a small fraction)
            per_param = DTYPE_BYTES[frozen_dtype(spec)]
        else:
            per_param = (with_moments(TRAIN_BYTES_PER_PARAM, adam_moment_bytes(spec.recipe.grpo.optim))
                         + (REFERENCE_BYTES_PER_PARAM if spec.recipe.grpo.beta > 0 else 0))
        need_gb = params * per_param / 1e9

        def have_gb(k: int) -> float:
            return k * per_node * capacity / GIB * STATE_MEMORY_SHARE

        def holds(k: int) -> bool:
            return need_gb <= have_gb(k)

        def facts(k: int) -> str:
            return f"{params / 1e9:.2f}B parameters need ~{need_gb:.0f} GB of training state; {over(k)} have ~{have_gb(k):.0f} GB for it"

    fewest = next((k for k in range(1, nodes + 1) if nodes % k == 0 and holds(k)), None)
    if fewest == 1:
        return hsdp(f"{facts(1)}: shard inside each node, replicate across nodes")
    if fewest is not None and fewest < nodes:
        groups = nodes // fewest
        return MeshChoice("hsdp", (groups, fewest * per_node), ("replicate", "shard"),
                          f"{facts(1)}: too much; {facts(fewest)}: shard over each {fewest} nodes, replicate "
                          f"across the {groups} groups (a sync gathers inside its group)", params,
                          nodes_per_shard=fewest)
    if fewest == nodes:
        return fsdp(f"{facts(1)}: too much, and no group of fewer nodes holds it: shard over all "
                    f"{plan.num_trainers} trainers")
    return fsdp(f"{facts(1)}: too much, shard over all {plan.num_trainers} trainers")


class SyncTraffic(NamedTuple):
    """What one weight sync gathers, per node: every trainer of a shard group all-gathers each
    weight in the engine's dtype (FSDP2's gathers deliver the whole tensor to every member), and
    what its group's members on other nodes hold crosses the network."""
    model_bytes: int                   # the whole model in the engine's dtype
    dtype: str
    in_node_bytes: int                 # per node, per sync
    cross_node_bytes: int

    def describe(self) -> str:
        gathered = f"the model is {gib_text(self.model_bytes)} GB in {self.dtype}"
        if not self.cross_node_bytes:
            return f"weight sync: no weight bytes cross nodes (each shard group is one node; {gathered})"
        return (f"weight sync: each node takes in ~{gib_text(self.cross_node_bytes)} GB from other nodes per sync "
                f"(its trainers' gathers from their shard group's other nodes; {gathered})")


def sync_traffic(spec: JobSpec, plan: Plan, mesh: MeshChoice) -> SyncTraffic | None:
    """None where the model's shape is unknown on this machine."""
    shape, _ = model_shape(spec.recipe.model.path)
    if shape is None:
        return None
    dtype = serve_dtype(spec, shape)
    full = shape.params * DTYPE_BYTES[dtype]
    per_node, group = plan.trainers_per_node, mesh.shard
    # Each trainer receives (group - 1) / group of every weight; the part held on other nodes is
    # (group - per_node) / group, a shard group being whole nodes.
    return SyncTraffic(full, dtype, per_node * full * (min(per_node, group) - 1) // group,
                       per_node * full * max(group - per_node, 0) // group)
