"""`hpcrl sites`: the site profiles found, or one resolved (its `extends` and user files merged)."""

from __future__ import annotations

import json

from hpcrl.job.config import to_dict
from hpcrl.job.errors import UserError
from hpcrl.login import profiles
from hpcrl.login.table import print_table


def main(args) -> int:
    if args.name:
        print(json.dumps(to_dict(profiles.load(args.name)), indent=2))
        return 0
    rows = []
    for name in profiles.available():
        try:
            s = profiles.load(name)
            rows.append((name, s.scheduler, f"{s.node.gpus} x {s.gpu_vendor}", s.description))
        except UserError as e:
            rows.append((name, "invalid", "", str(e)))
    print_table(("site", "scheduler", "gpus/node", "description"), rows)
    return 0
