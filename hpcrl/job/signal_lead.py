"""How long before the time limit Slurm's stop signal comes: site.signal's own lead ("USR2@300"),
or for "USR2@auto" one derived for the job. On the signal the trainers finish the step in progress,
then write a checkpoint; both must be done before the limit, or the job ends with the last periodic
checkpoint only.

  checkpoint, per node  trainable parameters x 12 B (fp32 weights and two fp32 Adam moments, as DCP
                        and DeepSpeed's ZeRO-3 save them; no gradients) / nodes: each node writes its
                        trainers' shards, and DCP writes a shard that HSDP replicates once, from the
                        replica with the least to write so far, so the replicas share the work. With
                        grpo.sync_ref_model, + every trainer's shards of the reference (saved per rank).
                        LoRA: the adapters only. The small per-rank files (RNG, sampler, the batch
                        asked for ahead) are not counted.
  write                 those bytes / site.shared_fs_write_gb_s
  step                  STEP_ALLOWANCE_S: hpcrl has no estimate of a step before the job runs one
  lead                  write + step, rounded up to whole minutes (Slurm may send the signal up to a
                        minute early anyway), at most the 65535 s --signal takes

Standard library only: `hpcrl render`/`submit` render the lead and check the time limit against it,
`hpcrl plan` says how it came about.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from hpcrl.job.job_memory import frozen_dtype, lora_targets
from hpcrl.job.mesh_choice import choose_mesh_for_shape
from hpcrl.job.model_shape import DTYPE_BYTES, count_parameters, model_shape
from hpcrl.job.placement import Plan
from hpcrl.job.site import SLURM_MAX_SIGNAL_LEAD_S
from hpcrl.job.spec import JobSpec

GB = 10 ** 9                     # file systems quote bandwidth in decimal GB/s
CHECKPOINT_BYTES_PER_PARAM = 12
# The step in progress when the signal comes: the lead every shipped GPU site gave before leads were
# derived. A step of a large model on few nodes may take longer (scripts/model_step.py models
# minutes for 14B on 2 Frontier nodes): site.signal=USR2@<seconds> then.
STEP_ALLOWANCE_S = 300
ROUND_TO_S = 60


class SignalLead(NamedTuple):
    """The lead a job's script gives Slurm's --signal, and what it is made of."""
    lead_s: int
    derived: bool                   # site.signal "NAME@auto"; else the site's own lead
    bytes_per_node: int | None      # the checkpoint's; None where unknown (why: `unknown`)
    bandwidth_gb_s: float
    unknown: str = ""
    capped: bool = False            # derived over Slurm's limit, and cut to it

    @property
    def write_s(self) -> float | None:
        return None if self.bytes_per_node is None else self.bytes_per_node / (self.bandwidth_gb_s * GB)

    def describe(self, signal: str) -> str:
        """One line for `hpcrl plan`."""
        name = signal.partition("@")[0]
        if not signal:
            return ("stop signal: none (site.signal is \"\"): at the time limit the job ends with its last "
                    "checkpoint.every checkpoint")
        head = f"stop signal: {name} {self.lead_s} s before the time limit (site.signal {signal})"
        write = self._write_text()
        if not self.derived:
            if self.write_s is None or self.write_s < self.lead_s:
                return head + (f"; {write}" if write else "")
            return (f"{head}; {write}, longer than the lead: a checkpoint at the signal would not be done "
                    f"before the limit (site.signal={name}@auto derives a lead)")
        step = (f"{STEP_ALLOWANCE_S} s for the step in progress (hpcrl has no estimate of a step; if yours "
                f"take longer, set site.signal={name}@<seconds>)")
        if write is None:
            return f"{head}: the checkpoint's size is unknown ({self.unknown}), so {step} only"
        rounded = (f", at most Slurm's {SLURM_MAX_SIGNAL_LEAD_S} s" if self.capped
                   else ", rounded up to whole minutes")
        return f"{head}: {write}, + {step}{rounded}"

    def _write_text(self) -> str | None:
        if self.bytes_per_node is None:
            return None
        if self.bytes_per_node == 0:
            return f"no checkpoint ({self.unknown})"
        return (f"a checkpoint of ~{self.bytes_per_node / GB:.1f} GB a node takes ~{math.ceil(self.write_s)} s "
                f"at {self.bandwidth_gb_s:g} GB/s (site.shared_fs_write_gb_s)")

    def to_dict(self) -> dict:
        return {"lead_s": self.lead_s, "derived": self.derived, "checkpoint_bytes_per_node": self.bytes_per_node,
                "write_s": None if self.write_s is None else round(self.write_s, 1),
                "shared_fs_write_gb_s": self.bandwidth_gb_s,
                "step_allowance_s": STEP_ALLOWANCE_S if self.derived else None, "capped": self.capped,
                "unknown": self.unknown or None}


def signal_lead(spec: JobSpec, plan: Plan) -> SignalLead:
    """The job's lead: site.signal's, or derived from its checkpoint for "NAME@auto"."""
    site = spec.site
    size, why = checkpoint_bytes_per_node(spec, plan)
    bandwidth = site.shared_fs_write_gb_s
    given = site.signal_lead_s
    if given is not None:
        return SignalLead(given, False, size, bandwidth, why)
    write_s = 0.0 if size is None else size / (bandwidth * GB)
    lead = math.ceil((write_s + STEP_ALLOWANCE_S) / ROUND_TO_S) * ROUND_TO_S
    return SignalLead(min(lead, SLURM_MAX_SIGNAL_LEAD_S), True, size, bandwidth, why,
                      capped=lead > SLURM_MAX_SIGNAL_LEAD_S)


def checkpoint_bytes_per_node(spec: JobSpec, plan: Plan) -> tuple[int | None, str]:
    """(bytes one node writes for a checkpoint, ""), or (None, why unknown), or (0, why none)."""
    recipe = spec.recipe
    if recipe.mode != "train":
        return 0, f"mode {recipe.mode} trains nothing"
    shape, why = model_shape(recipe.model.path)
    params = shape.params if shape else count_parameters(recipe.model.path)
    if params is None:
        return None, why
    lora = lora_targets(spec, shape) if shape else None
    trainable = lora.params if lora is not None else params
    size = math.ceil(trainable * CHECKPOINT_BYTES_PER_PARAM / plan.nodes)
    g = recipe.grpo
    if g.sync_ref_model and g.beta > 0 and not recipe.model.use_peft:
        shard = choose_mesh_for_shape(spec, plan, shape, params).shard
        size += math.ceil(params * DTYPE_BYTES[frozen_dtype(spec)] / shard) * plan.trainers_per_node
    return size, ""
