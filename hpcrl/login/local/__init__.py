"""`hpcrl run`: the same compute-side entry as a Slurm job, started by mpiexec on this machine.

run() composes the spec (or loads a run directory's, to resume it), makes the run directory,
starts mpiexec under supervision and, after it, says how the run went. A training run shows a
progress bar under the job's own lines and ends with a summary; a failed run ends with its reason.

mpiexec.py     which mpiexec (the mpich wheel's beside the interpreter, then PATH) and its command line
supervise.py   runs mpiexec: tees its output to run.log, bounds a failure's aftermath, Ctrl-C, SIGTERM
processes.py   a launch's processes found by its id: the stop request, and SIGKILL to all of them
console.py     which of the job's lines reach the console; the failure's one line at the end
progress.py    a training run's progress bar over metrics.jsonl, and its summary
exit_codes.py  INTERRUPTED, the exit status of a run the user stopped
"""

from __future__ import annotations

import os
import shlex
import sys
import time
import uuid
from pathlib import Path

from hpcrl.job import rundir
from hpcrl.job.errors import UserError
from hpcrl.job.rundir import LOCAL_LOG_FILE
from hpcrl.login import job_env
from hpcrl.login.local.console import ConsoleFilter, print_failure
from hpcrl.login.local.mpiexec import find_mpiexec, launch_command, mpi_flavor
from hpcrl.login.local.progress import Progress, print_summary
from hpcrl.login.local.supervise import AFTER_FAILURE_GRACE_S, supervise


def run(args) -> int:
    from hpcrl.login import compose

    spec = _resumed(args) if args.resume else compose.from_args(args)
    site = spec.site
    if site.launcher != "mpiexec":
        raise UserError(f"--site: {site.name} starts its tasks with srun; `hpcrl run` runs on this machine "
                        f"without Slurm (use `hpcrl submit --site {site.name}`)")
    plan = spec.plan()
    mpiexec = find_mpiexec()
    cmd = launch_command(mpiexec, mpi_flavor(mpiexec), spec.python, plan.world_size, spec.run_dir)
    if args.dry_run:
        print(shlex.join(cmd))
        return 0
    env = dict(os.environ)
    # The site's variables, as the sbatch script exports them; no shell runs between here and the
    # ranks, so $HOME and the like in them are expanded here.
    env.update({k: os.path.expandvars(v) for k, v in job_env.environment(spec).items()})
    env.update(HPCRL_RUN_DIR=spec.run_dir, HPCRL_LAUNCH_ID=f"local-{uuid.uuid4().hex[:12]}", PYTHONUNBUFFERED="1")
    if args.resume:
        run_dir = Path(spec.run_dir)
        (run_dir / rundir.FAILURE_FILE).unlink(missing_ok=True)     # the last attempt's, not this one's
        steps = rundir.training_checkpoint_steps(Path(spec.recipe.checkpoint.dir or run_dir / rundir.CHECKPOINTS_DIR))
        print(f"hpcrl: resuming {run_dir} " + (f"from its checkpoint of step {steps[-1]}" if steps
                                                else "from the start: it has no checkpoint"),
              file=sys.stderr, flush=True)
    else:
        run_dir = rundir.create(spec.run_dir, spec.to_json(), None, spec.reward_modules)
        print(f"hpcrl: run directory {run_dir}; {plan.world_size} tasks ({plan.num_trainers} trainer(s), "
              f"{plan.nodes * plan.engines_per_node} engine(s))", file=sys.stderr, flush=True)
    grace = spec.recipe.launch.peer_failure_timeout_s + AFTER_FAILURE_GRACE_S
    console = ConsoleFilter()
    if spec.recipe.mode != "train":
        code = supervise(cmd, env, run_dir / LOCAL_LOG_FILE, grace, console=console)
        print_failure(run_dir, code, console)
        return code
    progress = Progress(run_dir, spec.recipe.grpo.max_steps)
    t0 = time.monotonic()
    try:
        code = supervise(cmd, env, run_dir / LOCAL_LOG_FILE, grace, progress, console=console)
    finally:
        progress.close()
    print_summary(run_dir, spec.recipe.grpo.max_steps, time.monotonic() - t0, code,
                  output_dir=spec.recipe.checkpoint.output_dir)
    print_failure(run_dir, code, console)
    return code


def _resumed(args):
    """`hpcrl run --resume RUN_DIR`: the run's own spec, continued from its latest checkpoint."""
    from hpcrl.job.spec import JobSpec
    from hpcrl.login.api import job_args_given

    given = [g for g in job_args_given(args) if not (g == "--site" and args.site == "local")]   # run's default
    if given:
        raise UserError(f"--resume: takes no {', '.join(given)}; the run keeps the spec it started with")
    path = Path(args.resume).expanduser().absolute()
    spec = JobSpec.load(path)                      # UserError when it is not a run directory
    if spec.site.launcher != "mpiexec":
        raise UserError(f"--resume: {path} is a Slurm job's run directory (site {spec.site.name}); "
                        f"resume it with `hpcrl submit --resume {shlex.quote(str(path))}`")
    if (path / rundir.FINISHED_MARKER).exists():
        raise UserError(f"--resume: {path} already finished its training")
    return spec

