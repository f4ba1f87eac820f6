"""`hpcrl plan`: the placement a job gets on a site, one row per task."""

from __future__ import annotations

import json

from hpcrl.job.placement import format_cores, make_plan
from hpcrl.login import profiles
from hpcrl.login.table import print_table


def main(args) -> int:
    site = profiles.load(args.site)
    plan = make_plan(site, args.nodes, args.server_gpus)
    if args.json:
        print(json.dumps({"site": site.name, "nodes": plan.nodes, "tasks_per_node": plan.tasks_per_node,
                          "tasks": [t.to_dict() for t in plan.tasks],
                          "senders": {str(n): plan.sender_of(n).rank for n in range(plan.nodes)}}, indent=2))
        return 0
    rows = [(str(t.rank), str(t.node), str(t.local_rank), t.role, ",".join(map(str, t.gpus)),
             format_cores(t.cores), "sender" if t.sender else "") for t in plan.tasks]
    print_table(("rank", "node", "local", "role", "gpus", "cores", "weights"), rows)
    for n in range(plan.nodes):
        s, server = plan.sender_of(n), plan.node_tasks(n)[-1]
        print(f"node {n}: rank {s.rank} (GPU {s.gpus[0]}) sends weights to the server, "
              f"rank {server.rank} (GPU {','.join(map(str, server.gpus))})")
    return 0
