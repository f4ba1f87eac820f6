"""`hpcrl plan`: the placement a job gets on a site, one row per task, and its memory per GPU.

Takes what `hpcrl render` takes (a recipe, key=value overrides, -N, ...) and writes nothing. The
memory estimate is hpcrl.job.estimate's, the one `hpcrl render` and `submit` refuse a job by; here a job
that does not fit is shown with its fix, and the exit status stays 0.
"""

from __future__ import annotations

import json

from hpcrl.job.batch import describe_global_batch, global_batch
from hpcrl.job.estimate import estimate
from hpcrl.job.job_memory import describe_lora
from hpcrl.job.mesh_choice import sync_traffic
from hpcrl.job.model_shape import model_shape
from hpcrl.job.placement import format_cores
from hpcrl.job.signal_lead import signal_lead
from hpcrl.login import compose, python_env
from hpcrl.login.table import print_table


def main(args) -> int:
    spec = compose.for_plan(args)
    plan = spec.plan()
    fit = estimate(spec, plan)
    est = {"trainer": fit.trainer.est_gb, "server": fit.server.est_gb}
    traffic = sync_traffic(spec, plan, fit.mesh)
    stop = signal_lead(spec, plan) if spec.site.scheduler != "none" else None
    if args.json:
        print(json.dumps({"site": spec.site.name, "nodes": plan.nodes, "tasks_per_node": plan.tasks_per_node,
                          "tasks": [{**t.to_dict(), "est_memory_gb": est[t.role]} for t in plan.tasks],
                          "engines_per_node": plan.engines_per_node,
                          "tensor_parallel_size": plan.tensor_parallel_size,
                          "senders": {str(s): r for s, r in plan.senders().items()},
                          "model": spec.recipe.model.path, "fits": fit.fits, "memory": fit.to_dict(),
                          "trainer_engine": _engine(spec, fit),
                          "sync_bytes_per_node": None if traffic is None else
                          {"in_node": traffic.in_node_bytes, "cross_node": traffic.cross_node_bytes,
                           "model": traffic.model_bytes, "dtype": traffic.dtype},
                          "global_batch": global_batch(spec, plan),
                          "python_env": python_env.describe(spec.site, plan.nodes, spec.python),
                          "stop_signal": None if stop is None else {"signal": spec.site.signal, **stop.to_dict()}},
                         indent=2))
        return 0
    rows = [(str(t.rank), str(t.node), str(t.local_rank), _role(t, plan), ",".join(map(str, t.gpus)),
             format_cores(t.cores), _weights(t), "-" if est[t.role] is None else f"{est[t.role]:.1f}")
            for t in plan.tasks]
    print_table(("rank", "node", "local", "role", "gpus", "cores", "weights", "est. GB"), rows)
    for n in range(plan.nodes):
        for server in plan.node_servers(n):
            s = plan.sender_of(server.rank)
            fed = ", ".join(str(t.rank) for t in plan.served_by(server.rank))
            print(f"node {n} engine {server.engine} (rank {server.rank}, GPU {','.join(map(str, server.gpus))}): "
                  f"weights from rank {s.rank} (GPU {s.gpus[0]}), prompts from rank(s) {fed}")
    if plan.sync_rounds > 1:
        print(f"engines outnumber trainers: each sync gathers {plan.sync_rounds} times (once per engine a "
              f"trainer feeds); fewer engines (inference.gpus / inference.tensor_parallel_size) sync faster")
    if spec.recipe.trainer.engine == "deepspeed":
        from hpcrl.job import deepspeed     # ZeRO++'s hpZ partition is its HSDP, chosen as the mesh

        print(f"model {spec.recipe.model.path}: {deepspeed.describe(fit.mesh)}")
    else:
        print(f"model {spec.recipe.model.path}: {fit.mesh.describe()}")
    shape, _ = model_shape(spec.recipe.model.path)
    lora = describe_lora(spec, shape) if shape is not None else None
    if lora:
        print(lora)
    if traffic is not None and plan.nodes > 1:
        print(traffic.describe())
    if stop is not None:
        print(stop.describe(spec.site.signal))
    print(python_env.describe(spec.site, plan.nodes, spec.python))
    print(describe_global_batch(spec, plan))
    print(fit.trainer.verdict())
    print(fit.server.verdict())
    return 0


def _engine(spec, fit) -> dict:
    """--json: the trainers' engine, and DeepSpeed's hpZ partition (the mesh's HSDP) with it."""
    t = spec.recipe.trainer
    if t.engine != "deepspeed":
        return {"engine": t.engine}
    return {"engine": t.engine, "zero_stage": 3, "hpz_partition_size": fit.mesh.hpz_partition_size,
            "offload_optimizer": t.offload_optimizer, "offload_params": t.offload_params}


def _role(t, plan) -> str:
    """"server" with one engine per node, else "engine <index on the node>"."""
    return t.role if t.engine is None or plan.engines_per_node == 1 else f"engine {t.engine}"


def _weights(t) -> str:
    """A sender's column: the engine(s) it streams weights to."""
    return ("sends to " + ",".join(map(str, t.sends_to))) if t.sends_to else ""
