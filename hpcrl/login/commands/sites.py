"""`hpcrl sites`: the site profiles found, or one resolved (its `extends` and user files merged)."""

from __future__ import annotations

import json
import sys

from hpcrl.job.config import to_dict
from hpcrl.job.errors import UserError
from hpcrl.login import profiles, python_env
from hpcrl.login.table import print_table


def main(args) -> int:
    if args.name:
        site = profiles.load(args.name)
        print(json.dumps(to_dict(site), indent=2))
        print(f"tasks run: {interpreter(site)}", file=sys.stderr)
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


def interpreter(site) -> str:
    """Which Python the job's tasks start, in words: the commonest way a first job fails."""
    c = site.container
    if c.image:
        python = python_env.staged_python(site) if site.stage.python_env else site.python
        return f"{python} inside {c.image} ({c.runtime}, site.container)"
    if site.stage.python_env == "auto":
        return (f"{python_env.staged_python(site)}, staged from a pack of {_python(site)}'s environment "
                f"(stage.python_env = \"auto\")")
    if site.stage.python_env:
        return f"{python_env.staged_python(site)}, staged from {site.stage.python_env} (stage.python_env)"
    at_scale = (f"; at {site.stage.python_env_from_nodes} nodes or more, staged from a pack of its environment "
                f"(stage.python_env_from_nodes)" if site.stage.python_env_from_nodes else "")
    if site.python == "auto":
        return f"{sys.executable}, the interpreter hpcrl runs from now (python = \"auto\"){at_scale}"
    return (f"{site.python} as the job's shell finds it after its modules and setup lines (python = {site.python!r})"
            f"{at_scale}")


def _python(site) -> str:
    return sys.executable if site.python == "auto" else site.python
