"""`hpcrl plan`: the placement a job gets on a site, one row per task, and its memory per GPU.

Takes what `hpcrl render` takes (a recipe, key=value overrides, -N, ...) and writes nothing. The
memory estimate is hpcrl.job.fit's, the one `hpcrl render` and `submit` refuse a job by; here a job
that does not fit is shown with its fix, and the exit status stays 0.
"""

from __future__ import annotations

import json

from hpcrl.job.fit import estimate
from hpcrl.job.placement import format_cores
from hpcrl.login import compose
from hpcrl.login.table import print_table


def main(args) -> int:
    spec = compose.for_plan(args)
    plan = spec.plan()
    fit = estimate(spec, plan)
    est = {"trainer": fit.trainer.est_gb, "server": fit.server.est_gb}
    if args.json:
        print(json.dumps({"site": spec.site.name, "nodes": plan.nodes, "tasks_per_node": plan.tasks_per_node,
                          "tasks": [{**t.to_dict(), "est_memory_gb": est[t.role]} for t in plan.tasks],
                          "senders": {str(n): plan.sender_of(n).rank for n in range(plan.nodes)},
                          "model": spec.recipe.model.path, "fits": fit.fits, "memory": fit.to_dict()}, indent=2))
        return 0
    rows = [(str(t.rank), str(t.node), str(t.local_rank), t.role, ",".join(map(str, t.gpus)),
             format_cores(t.cores), "sender" if t.sender else "",
             "-" if est[t.role] is None else f"{est[t.role]:.1f}") for t in plan.tasks]
    print_table(("rank", "node", "local", "role", "gpus", "cores", "weights", "est. GB"), rows)
    for n in range(plan.nodes):
        s, server = plan.sender_of(n), plan.node_tasks(n)[-1]
        print(f"node {n}: rank {s.rank} (GPU {s.gpus[0]}) sends weights to the server, "
              f"rank {server.rank} (GPU {','.join(map(str, server.gpus))})")
    print(f"model {spec.recipe.model.path}: {fit.mesh.describe()}")
    print(fit.trainer.verdict())
    print(fit.server.verdict())
    return 0
