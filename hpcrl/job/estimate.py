"""Will it fit? A job's memory per GPU against what its GPUs have, estimated from the model's
config.json before submitting, with the changes that would make it fit where it does not.

Standard library only: `hpcrl plan` prints the estimate and the checks of `hpcrl render`/`submit`
refuse a job by it, on a login node. The parts are hpcrl.job.memory's formulas in the job's setting
(hpcrl.job.job_memory), for the trainers' mesh (hpcrl.job.mesh_choice).

No config.json (the locally built "demo:*" models, a path only the compute nodes see, a hub id), a
config that is not a decoder-only transformer's, or an unknown memory size: no estimate, no
verdict, no refusal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from hpcrl.job.job_memory import (compute_dtype, device_word, host_offload_bytes, lora_targets, server_parts_for,
                                  task_capacity, train_seq_len, trainer_parts_for)
from hpcrl.job.memory import GIB, gib_rounded, gib_text
from hpcrl.job.mesh_choice import MeshChoice, choose_mesh_for_shape
from hpcrl.job.model_shape import ModelShape, count_parameters, model_shape
from hpcrl.job.placement import Plan
from hpcrl.job.spec import JobSpec

# The largest gpu_memory_utilization a fix suggests: vLLM needs some room outside its budget.
MAX_SUGGESTED_UTILIZATION = 0.95


@dataclass(frozen=True)
class RoleFit:
    """One role's estimate per GPU (bytes), its parts, the memory it has, and what would fix it."""
    role: str                              # "trainers" or "server"
    device: str                            # "GPU", "GCD" or "task"
    est_bytes: int | None = None
    capacity_bytes: int | None = None
    parts: dict[str, int] = field(default_factory=dict)
    facts: dict = field(default_factory=dict)
    unknown: str = ""                      # why there is no estimate or no verdict
    fixes: tuple[str, ...] = ()

    @property
    def fits(self) -> bool | None:
        if self.est_bytes is None or not self.capacity_bytes:
            return None
        return self.est_bytes <= self.capacity_bytes

    @property
    def est_gb(self) -> float | None:
        return None if self.est_bytes is None else gib_rounded(self.est_bytes)

    def parts_text(self) -> str:
        labels = {"training_state": "training state", "frozen_weights": "frozen weights",
                  "gathered_layers": "gathered layers",
                  "logprob_chunk": "log-prob chunk", "kv_cache": "KV cache"}
        return ", ".join(f"{labels.get(k, k)} {gib_text(v) if v >= GIB / 20 else '<0.1'}"
                         for k, v in self.parts.items() if v)

    def capacity_text(self) -> str:
        if self.role == "server" and "gpu_memory_utilization" in self.facts.get("budget", ""):
            full = self.capacity_bytes / float(self.facts["utilization"])
            budget = f"{self.facts['budget']} of {gib_text(full)} GB"
            return f"{gib_text(self.capacity_bytes)} GB per {self.device} ({budget})"
        return f"{gib_text(self.capacity_bytes)} GB per {self.device}"

    def verdict(self) -> str:
        """One line for `hpcrl plan`."""
        if self.est_bytes is None:
            return f"{self.role}: no estimate: {self.unknown}"
        head = f"{self.role}: ~{gib_text(self.est_bytes)} GB"
        if self.fits is None:
            return f"{head} per {self.device}: no verdict: {self.unknown} ({self.parts_text()})"
        head += f" of {self.capacity_text()}"
        extra = self._kv_text() + self._host_text()
        if self.fits:
            return f"{head}: fits ({self.parts_text()}){extra}"
        return f"{head}: does not fit ({self.parts_text()}); {self.fix_text()}"

    def fix_text(self) -> str:
        if not self.fixes:
            return "fix: none found: a smaller model or shorter sequences"
        return "fix: " + ", or ".join(self.fixes)

    def _kv_text(self) -> str:
        at_once, batch = self.facts.get("kv_sequences_at_once"), self.facts.get("sequences_per_step")
        if at_once is None or batch is None:
            return ""
        if at_once >= batch:
            return f"; KV cache room for all {batch} of the node's sequences at once"
        more = self.facts.get("kv_all_at_once_with")
        return (f"; KV cache room for ~{at_once} of the node's {batch} sequences at once (generation runs in waves"
                + (f"; {more} would hold them all)" if more else ")"))

    def _host_text(self) -> str:
        """DeepSpeed's offload: the host memory it takes, against the node's where the site says."""
        per_trainer, node, have = (self.facts.get(k) for k in ("host_offload_gb", "host_offload_node_gb",
                                                               "host_memory_gb"))
        if not per_trainer:
            return ""
        text = f"; offloaded to host memory: ~{per_trainer:g} GB per trainer, ~{node:g} GB a node"
        if have:
            text += f" of its {have:g} GB" + ("" if node <= have else ": more than the node has")
        return text

    def to_dict(self) -> dict:
        return {"est_memory_gb": self.est_gb,
                "capacity_gb": None if not self.capacity_bytes else gib_rounded(self.capacity_bytes),
                "fits": self.fits, "device": self.device,
                "parts_gb": {k: gib_rounded(v) for k, v in self.parts.items()},
                "unknown": self.unknown or None, "fixes": list(self.fixes),
                **self.facts}


class Fit(NamedTuple):
    """The estimate for a job: the trainers, the server, and the mesh the trainers will get."""
    trainer: RoleFit
    server: RoleFit
    mesh: MeshChoice

    @property
    def fits(self) -> bool | None:
        verdicts = (self.trainer.fits, self.server.fits)
        if False in verdicts:
            return False
        return True if all(verdicts) else None

    def refusal(self, site_name: str) -> str | None:
        """The one line `hpcrl render`/`submit` refuse with, or None when nothing is known not to fit."""
        why = []
        for r in (self.trainer, self.server):
            if r.fits is False:
                need = "needs" if r.role == "server" else "need"
                why.append(f"the {r.role} {need} ~{gib_text(r.est_bytes)} GB per {r.device}, {site_name} has "
                           f"{r.capacity_text()} ({r.parts_text()}); {r.fix_text()}")
        if not why:
            return None
        return "memory: " + "; and ".join(why) + " (`hpcrl plan` with the same arguments shows the estimate)"

    def to_dict(self) -> dict:
        return {"unit": "GiB", "fits": self.fits,
                "mesh": {"kind": self.mesh.kind, "shape": list(self.mesh.shape),
                         "dims": list(self.mesh.dim_names), "reason": self.mesh.reason},
                "trainer": self.trainer.to_dict(), "server": self.server.to_dict()}


def estimate(spec: JobSpec, plan: Plan | None = None) -> Fit:
    """Memory per GPU of the job's trainers and servers, against what the site's GPUs have."""
    plan = plan or spec.plan()
    shape, why = model_shape(spec.recipe.model.path)
    params = shape.params if shape else count_parameters(spec.recipe.model.path)
    mesh = choose_mesh_for_shape(spec, plan, shape, params)
    word = device_word(spec)
    capacity = task_capacity(spec, plan)
    if shape is None:
        return Fit(RoleFit("trainers", word, capacity_bytes=capacity, unknown=why),
                   RoleFit("server", word, capacity_bytes=capacity, unknown=why), mesh)
    no_size = "" if capacity else f"site {spec.site.name} gives no memory size ({_memory_field(spec)})"
    parts = trainer_parts_for(spec, shape, mesh.shard)
    facts = {"mesh": mesh.kind, "shard": mesh.shard, "compute_dtype": compute_dtype(spec),
             "micro_batch_tokens": spec.recipe.grpo.per_device_train_batch_size * train_seq_len(spec)}
    lora = lora_targets(spec, shape)
    if lora is not None:
        facts["lora_params"] = lora.params
    if spec.recipe.trainer.engine == "deepspeed":
        host = host_offload_bytes(spec, shape.params, mesh.shard)
        facts.update(engine="deepspeed", hpz_partition_size=mesh.hpz_partition_size,
                     host_offload_gb=gib_rounded(host), host_offload_node_gb=gib_rounded(host * plan.trainers_per_node),
                     host_memory_gb=spec.site.node.memory_gb)
    trainer = RoleFit("trainers", word, sum(parts.values()), capacity, parts, facts, no_size)
    s_parts, s_capacity, facts = server_parts_for(spec, plan, shape)
    server = RoleFit("server", word, sum(s_parts.values()), s_capacity, s_parts, facts, no_size)
    base, after = spec, ""
    if server.fits is False:
        fixes, change = _server_fixes(spec, shape)
        server = replace(server, fixes=tuple(fixes))
        if change:
            # The server's tensor-parallel fix takes GPUs from the trainers: theirs must hold with it.
            base, after = _with(spec, "inference", **change), f" (with {_assignments(change)})"
    if trainer.fits is False:
        trainer = replace(trainer, fixes=tuple(f + after for f in _trainer_fixes(base, shape, params)))
    return Fit(trainer, server, mesh)


def _assignments(change: dict) -> str:
    """{"gpus": 4, "tensor_parallel_size": 4} -> "inference.gpus=4 inference.tensor_parallel_size=4"."""
    return " ".join(f"inference.{k}={v}" for k, v in change.items())


def _memory_field(spec: JobSpec) -> str:
    return "node.gpu_memory_gb" if spec.site.device == "cuda" else "node.memory_gb"


# ------------------------------------------------------------------------------------- fixes
def _with(spec: JobSpec, section: str, **changes) -> JobSpec:
    recipe = spec.recipe
    return replace(spec, recipe=replace(recipe, **{section: replace(getattr(recipe, section), **changes)}))


def _trainer_need(spec: JobSpec, shape: ModelShape, params: int | None) -> tuple[int, int | None]:
    plan = spec.plan()
    mesh = choose_mesh_for_shape(spec, plan, shape, params)
    return sum(trainer_parts_for(spec, shape, mesh.shard).values()), task_capacity(spec, plan)


def _fits(spec: JobSpec, shape: ModelShape, params: int | None) -> bool:
    need, capacity = _trainer_need(spec, shape, params)
    return bool(capacity) and need <= capacity


def _node_limit(spec: JobSpec) -> int | None:
    site, res = spec.site, spec.recipe.resources
    limits = [p.max_nodes for p in (site.partitions.get(res.partition),) if p and p.max_nodes]
    limits += [q.max_nodes for q in (site.qos_limits.get(res.qos),) if q and q.max_nodes]
    return min(limits) if limits else None


def _nodes_fix(spec: JobSpec, shape: ModelShape, params: int | None) -> tuple[str, JobSpec] | None:
    """The fewest nodes at which FSDP over every trainer fits: only the training state, the
    frozen weights (LoRA), the reference and the reward models shrink with the shard, the rest per
    GPU stays."""
    plan = spec.plan()
    capacity = task_capacity(spec, plan)
    one = trainer_parts_for(spec, shape, 1)
    sharded = one["training_state"] + one["reference"] + one["reward_models"] + one.get("frozen_weights", 0)
    room = (capacity or 0) - (sum(one.values()) - sharded)
    if room <= 0:
        return None
    nodes = max(1, math.ceil(sharded / (plan.trainers_per_node * room)))
    limit = _node_limit(spec)
    if limit is not None and nodes > limit:
        return None
    fix, variant = [], spec
    if spec.recipe.trainer.mesh == "hsdp":
        fix.append("trainer.mesh=fsdp")
        variant = _with(variant, "trainer", mesh="fsdp")
    if nodes > spec.nodes:
        fix.insert(0, f"-N {nodes}")
        variant = replace(variant, recipe=replace(variant.recipe, resources=replace(
            variant.recipe.resources, nodes=nodes)))
    if not fix or not _fits(variant, shape, params):
        return None
    return " ".join(fix), variant


def _micro_batch_fix(spec: JobSpec, shape: ModelShape, params: int | None) -> tuple[str, JobSpec] | None:
    """The largest smaller micro-batch that fits, with the completions per step kept (a divisor of
    per_device_train_batch_size x gradient_accumulation_steps)."""
    g = spec.recipe.grpo
    per_rank = g.completions_per_trainer_step
    for micro in sorted((m for m in range(1, g.per_device_train_batch_size) if per_rank % m == 0), reverse=True):
        variant = _with(spec, "grpo", per_device_train_batch_size=micro, gradient_accumulation_steps=per_rank // micro)
        if _fits(variant, shape, params):
            return (f"grpo.per_device_train_batch_size={micro} "
                    f"grpo.gradient_accumulation_steps={per_rank // micro}"), variant
    return None


def _trainer_fixes(spec: JobSpec, shape: ModelShape, params: int | None) -> list[str]:
    """Each change that alone makes the trainers fit; else one combination of them that does."""
    r = spec.recipe
    switches = []
    if not (r.trainer.activation_checkpointing or r.grpo.gradient_checkpointing):
        switches.append("activation_checkpointing")
    if r.grpo.beta > 0 and not r.trainer.reference_offload and spec.site.device == "cuda" and not r.model.use_peft:
        switches.append("reference_offload")       # with LoRA there is no reference copy to offload
    if r.trainer.engine == "deepspeed" and spec.site.device == "cuda":
        # ZeRO-3's offload: the optimizer state first (the parameter stays for the forward), then the parameters
        switches += [name for name in ("offload_optimizer", "offload_params") if not getattr(r.trainer, name)]
    alone = [f"trainer.{name}=true" for name in switches
             if _fits(_with(spec, "trainer", **{name: True}), shape, params)]
    for search in (_micro_batch_fix, _nodes_fix):
        found = search(spec, shape, params)
        if found:
            alone.append(found[0])
    if alone:
        return alone
    # Nothing alone: the switches on, then the micro-batch, then nodes, until it fits.
    combined, variant = [], spec
    for name in switches:
        combined.append(f"trainer.{name}=true")
        variant = _with(variant, "trainer", **{name: True})
        if _fits(variant, shape, params):
            return ["all of " + " ".join(combined)]
    for search in (_micro_batch_fix, _nodes_fix):
        found = search(variant, shape, params)
        if found:
            return ["all of " + " ".join(combined + [found[0]])]
    per_rank = r.grpo.completions_per_trainer_step
    if r.grpo.per_device_train_batch_size > 1:
        found = _nodes_fix(_with(variant, "grpo", per_device_train_batch_size=1,
                                 gradient_accumulation_steps=per_rank), shape, params)
        if found:
            return ["all of " + " ".join(combined + ["grpo.per_device_train_batch_size=1",
                                                     f"grpo.gradient_accumulation_steps={per_rank}", found[0]])]
    return []


def _server_fixes(spec: JobSpec, shape: ModelShape) -> tuple[list[str], dict | None]:
    """The changes that make a server rank fit, and the inference fields of the tensor-parallel one
    among them (or None)."""
    fixes, chosen = [], None
    inf, gpus = spec.recipe.inference, spec.site.node.gpus
    if inf.engine == "transformers":
        # It has no tensor parallelism and keeps the whole batch's cache and scores: vLLM pages both.
        variant = _with(spec, "inference", engine="vllm")
        parts, capacity, _ = server_parts_for(variant, variant.plan(), shape)
        return (["inference.engine=vllm"] if capacity and sum(parts.values()) <= capacity else []), None
    engines = inf.gpus // inf.tensor_parallel_size
    for tp in range(inf.tensor_parallel_size + 1, gpus):
        # vLLM splits the attention heads evenly over the tensor-parallel ranks.
        if shape.num_heads % tp:
            continue
        # As many engines as now, as long as a trainer is left on the node.
        n = max(1, min(engines, (gpus - 1) // tp))
        change = {"gpus": n * tp, "tensor_parallel_size": tp}
        variant = _with(spec, "inference", **change)
        parts, capacity, _ = server_parts_for(variant, variant.plan(), shape)
        if capacity and sum(parts.values()) <= capacity:
            fixes.append(f"{_assignments(change)} ({n} engine(s) of {tp} GPUs, tensor parallel; leaves "
                         f"{gpus - n * tp} trainers per node)")
            chosen = change
            break
    if spec.site.device == "cuda" and inf.engine != "transformers" and spec.site.node.gpu_memory_gb:
        parts, _, _ = server_parts_for(spec, spec.plan(), shape)
        wanted = math.ceil(100 * sum(parts.values()) / (spec.site.node.gpu_memory_gb * GIB)) / 100
        if inf.gpu_memory_utilization < wanted <= MAX_SUGGESTED_UTILIZATION:
            fixes.append(f"inference.gpu_memory_utilization={wanted:g}")
    return fixes, chosen
