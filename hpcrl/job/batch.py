"""A job's batch: how one optimizer step's completions spread over its trainers and engines.

Standard library only: `hpcrl plan` states the global batch, and the server's memory estimate
(hpcrl.job.job_memory) sizes an engine's KV cache for the sequences it generates per step.
"""

from __future__ import annotations

import math

from hpcrl.job.placement import Plan
from hpcrl.job.spec import JobSpec


def global_batch(spec: JobSpec, plan: Plan) -> int:
    """One optimizer step's completions, which TRL's per-device batch makes grow with the job."""
    return spec.recipe.grpo.completions_per_trainer_step * plan.num_trainers


def describe_global_batch(spec: JobSpec, plan: Plan) -> str:
    g, total = spec.recipe.grpo, global_batch(spec, plan)
    accumulation = f" x {g.gradient_accumulation_steps} accumulation steps" if g.gradient_accumulation_steps > 1 else ""
    return (f"global batch: {g.per_device_train_batch_size} completions per trainer{accumulation} x "
            f"{plan.num_trainers} trainers = {total} completions ({total // g.num_generations} prompts x "
            f"{g.num_generations}) per optimizer step; per_device_train_batch_size is per trainer, as in TRL, "
            f"so it grows with -N")


def sequences_per_engine(spec: JobSpec, plan: Plan) -> int:
    """The sequences one engine generates per step: those of the trainers it serves (the busiest
    engine of a node; a trainer fed by several engines splits its prompts evenly over them)."""
    per_trainer = spec.recipe.grpo.completions_per_trainer_step
    return max(math.ceil(sum(per_trainer / len(t.servers) for t in plan.served_by(s.rank)))
               for s in plan.node_servers(0))
