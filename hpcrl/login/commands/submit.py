"""`hpcrl submit`: render, sbatch, register; or `--resume RUN_DIR` to submit a run directory again.

A SlurmError propagates: cli.main turns it into the message and the exit status.
"""

from __future__ import annotations

import sys

from hpcrl.job import rundir
from hpcrl.job.atomic import atomic_write
from hpcrl.login import compose
from hpcrl.login.api import job_args_given, resubmit, submit_spec
from hpcrl.login.render import render_sbatch


def main(args) -> int:
    if args.resume:
        job_id, run_dir = resubmit(args.resume, bad_args=job_args_given(args))
        print(job_id)
        print(f"resubmitted {run_dir} as job {job_id}; it resumes from its last checkpoint", file=sys.stderr)
        return 0
    spec = compose.for_slurm(args)
    script = render_sbatch(spec)
    if args.dry_run:
        sys.stdout.write(script)
        return 0
    out = rundir.check_output_path(args.output) if args.output else None
    job_id, run_dir = submit_spec(spec, script)
    if out is not None:
        atomic_write(out, script, mode=0o755)
    print(job_id)
    print(f"submitted {spec.name} as job {job_id} on {spec.site.name}; run directory {run_dir}", file=sys.stderr)
    return 0

