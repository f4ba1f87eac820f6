"""JobSpec -> sbatch script text (jinja2). `hpcrl render` and `hpcrl submit` both use this one function."""

from __future__ import annotations

from pathlib import Path

import jinja2

from hpcrl import __version__

from hpcrl.job import rundir
from hpcrl.job.slurm_time import format_walltime
from hpcrl.job.spec import JobSpec
from hpcrl.login import job_env, python_env, user_cache
from hpcrl.login.shell_words import env_quote, quote


def _bytecode_cache() -> jinja2.BytecodeCache | None:
    """Compiling the template is a third of `hpcrl render` on a login node; jinja2 keeps the result
    (keyed by the template's checksum) in the user's cache directory. None where it cannot write."""
    directory = user_cache.directory("jinja2")
    return jinja2.FileSystemBytecodeCache(directory) if directory else None


def _environment() -> jinja2.Environment:
    loader = jinja2.FileSystemLoader(str(Path(__file__).parent.parent / "templates"))
    env = jinja2.Environment(loader=loader, undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             autoescape=False, bytecode_cache=_bytecode_cache())
    env.filters["q"] = quote
    env.filters["envq"] = env_quote
    return env


def _container(spec: JobSpec):
    """site.container's launch words; None without a container (its module is not imported then)."""
    if not spec.site.container.image:
        return None
    from hpcrl.login.launch_prefix import container_launch

    return container_launch(spec)


def render_sbatch(spec: JobSpec) -> str:
    site, plan = spec.site, spec.plan()
    cpus = site.node.cpus_per_task or (site.node.cores // plan.tasks_per_node if site.node.cores else 1)
    return _environment().get_template("sbatch.sh.j2").render(
        spec=spec, site=site, plan=plan, res=spec.recipe.resources, env=job_env.environment(spec),
        walltime=format_walltime(spec.time_s), cpus_per_task=max(1, cpus),
        gpu_request=site.gpu_request.format(gpus=site.node.gpus) if site.gpu_request else "",
        signal_name=site.signal_name, signal_lead=spec.signal_lead_s, hpcrl_version=__version__,
        rundir=rundir, max_restarts=spec.recipe.launch.max_restarts, container=_container(spec),
        kernel_cache=job_env.staged_kernel_cache(spec), env_pack=_env_pack(spec),
    )


def _env_pack(spec: JobSpec) -> str:
    """The command that packs the job's environment for staging (hpcrl.login.python_env), quoted."""
    return " ".join(f'"{w}"' if w == python_env.PART else quote(w) for w in python_env.pack_command(spec.python_env_source))
