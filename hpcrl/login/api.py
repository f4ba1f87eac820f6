"""A Python API for notebooks and workflow tools: the same path as `hpcrl submit`, returning a
submitit job handle (state polling through sacct with submitit's caching watcher, `done()`,
`wait()`, `cancel()`). The script is the one `hpcrl render` writes: one code path, one text."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Sequence

from hpcrl.job import rundir
from hpcrl.job.atomic import atomic_write
from hpcrl.job.spec import JobSpec
from hpcrl.login import slurm
from hpcrl.login.compose import compose, resource_flags
from hpcrl.login.render import render_sbatch


def submit_spec(spec: JobSpec, script: str | None = None) -> tuple[str, Path]:
    """Write the run directory, sbatch its script, register the job. On a Slurm error nothing stays
    behind (the run directory is removed) and the SlurmError propagates. `script`: the text
    render_sbatch(spec) already gave the caller (`hpcrl submit` shows or copies it too)."""
    from hpcrl.login.registry import Registry

    registry = Registry()
    if script is None:
        script = render_sbatch(spec)
    run_dir = rundir.create(spec.run_dir, spec.to_json(), script, spec.reward_modules)
    try:
        job_id = slurm.submit(run_dir / rundir.SCRIPT_FILE, cwd=run_dir)
    except slurm.SlurmError:
        shutil.rmtree(run_dir, ignore_errors=True)
        raise
    _register(registry, job_id, spec, run_dir)
    return job_id, run_dir


def _register(registry, job_id: str, spec: JobSpec, run_dir: Path) -> None:
    from hpcrl.login.registry import RegistryError

    try:
        registry.add(job_id, spec.name, spec.site.name, str(run_dir), str(run_dir / rundir.SCRIPT_FILE))
    except RegistryError as e:
        raise RegistryError(f"job {job_id} was submitted but not registered (`hpcrl status` will not list "
                            f"it; scancel {job_id} stops it): {e}") from None


def job_args_given(args) -> list[str]:
    """Flags that would change a job; a resumed run keeps the spec it was started with."""
    given = [f"--{k.replace('_', '-')}" for k in ("site", "nodes", "time", "account", "partition", "qos", "name",
                                                  "run_dir", "output") if getattr(args, k, None)]
    if args.recipe or args.overrides:
        given.append("recipe/key=value")
    return given


def resubmit(run_dir: str, bad_args: Sequence[str] = ()) -> tuple[str, Path]:
    """Submit a run directory again (a run that failed, was cancelled or ran out of time): the same
    job spec, continued from its latest checkpoint.

    The script is rendered again from job.json and replaces job.sbatch: the spec is what the run
    keeps, the script only says how this hpcrl starts it (an older one may name an entry point
    that is gone, such as `python -m hpcrl.launch`)."""
    from hpcrl.job.errors import UserError
    from hpcrl.login.registry import Registry

    if bad_args:
        raise UserError(f"--resume: takes no {', '.join(bad_args)}; the run keeps the spec it started with")
    registry = Registry()                   # a broken registry is found before anything is submitted
    path = Path(run_dir).expanduser().absolute()
    spec = JobSpec.load(path)                      # UserError when it is not a run directory
    script = path / rundir.SCRIPT_FILE
    if not script.is_file():
        raise UserError(f"--resume: {path} has no {rundir.SCRIPT_FILE} (was it made by `hpcrl run`?)")
    if (path / rundir.FINISHED_MARKER).exists():
        raise UserError(f"--resume: {path} already finished its training")
    atomic_write(script, render_sbatch(spec), mode=0o755)
    job_id = slurm.submit(script, cwd=path)
    _register(registry, job_id, spec, path)
    return job_id, path


def submit(recipe: str | None = None, *, site: str, overrides: Sequence[str] = (), nodes: int | None = None,
           time: str | None = None, account: str | None = None, partition: str | None = None,
           qos: str | None = None, name: str | None = None, run_dir: str | None = None) -> Any:
    """Submit a recipe; returns a `submitit.SlurmJob` whose folder is the run directory."""
    import submitit

    flags = resource_flags(nodes, time, account, partition, qos, name)
    spec = compose(recipe, site, list(overrides), flags, run_dir)
    if spec.site.scheduler != "slurm":
        from hpcrl.job.errors import UserError
        raise UserError(f"site: {spec.site.name} has no Slurm; use `hpcrl run`")
    job_id, folder = submit_spec(spec)
    return submitit.SlurmJob(folder=folder, job_id=job_id)
