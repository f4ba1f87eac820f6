"""What each `hpcrl` subcommand does. Heavy or optional modules are imported inside the command."""

from __future__ import annotations

import json
import shlex
import sys

from hpcrl.job.errors import UserError


def cmd_render(args) -> int:
    from hpcrl.job import rundir
    from hpcrl.login.render import render_sbatch

    spec = _compose_for_slurm(args)
    script = render_sbatch(spec)
    out = rundir.check_output_path(args.output) if args.output else None
    run_dir = rundir.create(spec.run_dir, spec.to_json(), script)
    if out is not None:
        rundir.write_file_atomic(out, script, 0o755)
    print(f"run directory: {run_dir}")
    print(f"script:        {out or run_dir / rundir.SCRIPT_FILE}")
    print(f"submit with:   sbatch {shlex.quote(str(out or run_dir / rundir.SCRIPT_FILE))}")
    return 0


def cmd_submit(args) -> int:
    from hpcrl.job import rundir
    from hpcrl.login import slurm
    from hpcrl.login.api import resubmit, submit_spec
    from hpcrl.login.render import render_sbatch

    if args.resume:
        try:
            job_id, run_dir = resubmit(args.resume, bad_args=_job_args_given(args))
        except slurm.SlurmError as e:
            print(f"hpcrl: error: {e}", file=sys.stderr)
            return 1 if isinstance(e, slurm.SlurmUnavailable) else 2
        print(job_id)
        print(f"resubmitted {run_dir} as job {job_id}; it resumes from its last checkpoint", file=sys.stderr)
        return 0
    spec = _compose_for_slurm(args)
    script = render_sbatch(spec)
    if args.dry_run:
        sys.stdout.write(script)
        return 0
    out = rundir.check_output_path(args.output) if args.output else None
    try:
        job_id, run_dir = submit_spec(spec)
    except slurm.SlurmError as e:
        print(f"hpcrl: error: {e}", file=sys.stderr)
        return 1 if isinstance(e, slurm.SlurmUnavailable) else 2
    if out is not None:
        rundir.write_file_atomic(out, script, 0o755)
    print(job_id)
    print(f"submitted {spec.name} as job {job_id} on {spec.site.name}; run directory {run_dir}", file=sys.stderr)
    return 0


def _job_args_given(args) -> list[str]:
    """Flags that would change a job; a resumed run keeps the spec it was started with."""
    given = [f"--{k.replace('_', '-')}" for k in ("site", "nodes", "time", "account", "partition", "qos", "name",
                                                  "run_dir", "output") if getattr(args, k, None)]
    if args.recipe or args.overrides:
        given.append("recipe/key=value")
    return given


def _compose_for_slurm(args):
    from hpcrl.login import compose

    if not args.site:
        raise UserError(f"{args.command}: --site is required (see `hpcrl sites`)")
    spec = compose.from_args(args)
    if spec.site.scheduler != "slurm":
        raise UserError(f"--site: {spec.site.name} has no Slurm; use `hpcrl run` for it")
    return spec


def cmd_plan(args) -> int:
    from hpcrl.login import profiles
    from hpcrl.job.placement import format_cores, make_plan

    site = profiles.load(args.site)
    plan = make_plan(site, args.nodes, args.server_gpus)
    if args.json:
        print(json.dumps({"site": site.name, "nodes": plan.nodes, "tasks_per_node": plan.tasks_per_node,
                          "tasks": [t.to_dict() for t in plan.tasks],
                          "senders": {str(n): plan.sender_of(n).rank for n in range(plan.nodes)}}, indent=2))
        return 0
    rows = [(str(t.rank), str(t.node), str(t.local_rank), t.role, ",".join(map(str, t.gpus)),
             format_cores(t.cores), "sender" if t.sender else "") for t in plan.tasks]
    _print_table(("rank", "node", "local", "role", "gpus", "cores", "weights"), rows)
    for n in range(plan.nodes):
        s, server = plan.sender_of(n), plan.node_tasks(n)[-1]
        print(f"node {n}: rank {s.rank} (GPU {s.gpus[0]}) sends weights to the server, "
              f"rank {server.rank} (GPU {','.join(map(str, server.gpus))})")
    return 0


def cmd_sites(args) -> int:
    from hpcrl.login import profiles
    from hpcrl.job.config import to_dict

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
    _print_table(("site", "scheduler", "gpus/node", "description"), rows)
    return 0


def cmd_run(args) -> int:
    from hpcrl.login import local as local_run

    return local_run.run(args)


def cmd_status(args) -> int:
    from hpcrl.login import status

    return status.cmd_status(args)


def cmd_logs(args) -> int:
    from hpcrl.login import status

    return status.cmd_logs(args)


def cmd_cancel(args) -> int:
    from hpcrl.login import status

    return status.cmd_cancel(args)


def cmd_plot(args) -> int:
    from hpcrl.login import plot

    run_dir = plot.resolve_run_dir(args.target)
    try:
        path = plot.write_plot(run_dir, args.output)
    except ImportError as e:
        raise UserError(f"plot: matplotlib is not installed ({e}); pip install matplotlib") from None
    print(path)
    return 0


def _print_table(header, rows) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for row in (header, *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip())
