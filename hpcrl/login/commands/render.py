"""`hpcrl render`: write the run directory and its standalone sbatch script; submit nothing."""

from __future__ import annotations

import shlex

from hpcrl.job import rundir
from hpcrl.job.atomic import atomic_write
from hpcrl.login import compose
from hpcrl.login.render import render_sbatch


def main(args) -> int:
    spec = compose.for_slurm(args)
    script = render_sbatch(spec)
    out = rundir.check_output_path(args.output) if args.output else None
    run_dir = rundir.create(spec.run_dir, spec.to_json(), script, spec.reward_modules)
    if out is not None:
        atomic_write(out, script, mode=0o755)
    print(f"run directory: {run_dir}")
    print(f"script:        {out or run_dir / rundir.SCRIPT_FILE}")
    print(f"submit with:   sbatch {shlex.quote(str(out or run_dir / rundir.SCRIPT_FILE))}")
    return 0
