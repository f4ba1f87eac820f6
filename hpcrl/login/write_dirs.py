"""The directories a job will write, checked before it is queued: its run directory,
checkpoint.dir and checkpoint.output_dir (TRL's output_dir) must be writable from the compute
nodes, and must not be another run's (whose checkpoints this one would resume from, or whose model
it would replace). Also the run directory's default name."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from hpcrl.job import rundir
from hpcrl.job.config import to_dict
from hpcrl.job.demo import is_demo
from hpcrl.job.errors import UserError
from hpcrl.job.site import Site
from hpcrl.job.spec import JobSpec

OUTPUT_DIR_FIELD = "checkpoint.output_dir (TRL's output_dir)"


def check_writable_on_compute(site: Site, path: Path, where: str) -> None:
    """The job writes its run and checkpoint directories from the compute nodes. Symlinks are
    followed: ~/runs linked to a scratch file system is fine."""
    real = path.resolve()
    for readonly in site.readonly_on_compute:
        top = Path(readonly)
        if real == top or top in real.parents:
            raise UserError(f"{where}: {path} is under {readonly}, which {site.name}'s compute nodes cannot write; "
                            f"put it on a scratch file system (--run-dir DIR, or runs_dir in your site file "
                            f"~/.config/hpcrl/sites/{site.name}.toml)")
    # From the login node's view too: its nearest existing directory must take new files (found
    # here, not after all the training, when the model is written).
    existing = next((p for p in (real, *real.parents) if p.exists()), None)
    if existing is not None and existing.is_dir():
        try:    # a file made and gone at once: permissions, read-only mounts and immutable bits alike
            with tempfile.TemporaryFile(dir=existing):
                pass
        except OSError as e:
            raise UserError(f"{where}: {path} cannot be written: {existing}: {e.strerror}") from None


def check_output_dir(site: Site, path: Path, model_path: str = "") -> None:
    """TRL's output_dir: the final model replaces a model directory there, as TRL overwrites it;
    anything else there is the user's and is never replaced, nor is the base model. (Control
    characters in `path` are refused by compose, as in every path the sbatch script names.)"""
    where = OUTPUT_DIR_FIELD
    base = Path(model_path).expanduser() if model_path and not is_demo(model_path) else None
    if base is not None and base.is_dir():
        out, base = path.expanduser().resolve(), base.resolve()
        if out == base or base in out.parents or out in base.parents:
            raise UserError(f"{where}: {path} is {'the base model' if out == base else 'in or around the base model'}"
                            f" ({model_path}), which the run's model would overwrite: name another directory")
    if path.exists() and not path.is_dir():
        raise UserError(f"{where}: {path} is a file, not a directory")
    if path.is_dir() and any(p.name != rundir.RUN_IDENTITY_FILE for p in path.iterdir()) and not _holds_model(path):
        raise UserError(f"{where}: {path} holds files that are not a model; the final model would replace "
                        f"them: name a new or empty directory")
    check_writable_on_compute(site, path, where)


def _holds_model(path: Path) -> bool:
    return rundir.is_model_dir(path) or any(p.name.startswith(rundir.MODEL_CHECKPOINT_PREFIX) for p in path.iterdir())


def check_dirs_are_this_runs(spec: JobSpec) -> None:
    """checkpoint.dir and checkpoint.output_dir belong to one run (rundir.RUN_IDENTITY_FILE): in
    another run's, this one would resume from that run's weights and optimizer (another recipe's)
    and move its `latest`, or replace its model. A new run is never the owner: a run continues
    from its own run directory (`hpcrl submit --resume`), which is not composed again. A claim
    whose run directory is gone and that holds nothing (a render whose submission failed) is free."""
    # The recipe as job.json will hold it (JSON's keys), without job.json's indented dump: an indent
    # makes json use its pure-Python encoder, a few ms of every render.
    ours = rundir.run_identity({"run_dir": spec.run_dir, "recipe": json.loads(json.dumps(to_dict(spec.recipe)))})
    checkpoint = spec.recipe.checkpoint
    if checkpoint.dir:
        path = Path(checkpoint.dir).expanduser().absolute()
        owner = _other_owner(path, ours, rundir.CHECKPOINTS_DIR)
        if owner is not None and rundir.is_run_dir(owner):
            raise UserError(f"checkpoint.dir: {path} is the checkpoint directory of run {owner}; this run would "
                            f"resume from its checkpoints and write over them: {_continue_hint(owner)}name another "
                            f"directory")
        if rundir.read_identity(path) != ours and rundir.training_checkpoint_steps(path):
            if owner is not None:
                raise UserError(f"checkpoint.dir: {path} holds the training checkpoints of run {owner}, whose run "
                                f"directory is gone; this run would resume from them: remove them or name another "
                                f"directory")
            raise UserError(f"checkpoint.dir: {path} holds training checkpoints that no run claims (written before "
                            f"hpcrl recorded whose); this run would resume from them: to continue the run that wrote "
                            f"them, `hpcrl submit --resume RUN_DIR` with its run directory; otherwise remove them or "
                            f"name another directory")
    if checkpoint.output_dir:
        where = OUTPUT_DIR_FIELD
        path = Path(checkpoint.output_dir).expanduser().absolute()
        owner = _other_owner(path, ours, rundir.MODEL_DIR)
        if owner is not None and rundir.is_run_dir(owner):
            raise UserError(f"{where}: {path} is the output directory of run {owner}, whose model this run's would "
                            f"replace: {_continue_hint(owner)}name another directory")
        if rundir.read_identity(path) != ours and path.is_dir() and _holds_model(path):
            whose = f"of run {owner}, whose run directory is gone" if owner else "that this run did not write"
            raise UserError(f"{where}: {path} holds a model {whose}; the final model would replace it: name a new "
                            f"or empty directory")


def _continue_hint(run_dir: str) -> str:
    if (Path(run_dir) / rundir.FINISHED_MARKER).exists():
        return "that run has finished; "
    return f"to continue that run, `{rundir.resume_command(run_dir)}`; otherwise "


def _other_owner(path: Path, ours: dict, own_name: str) -> str | None:
    """The run directory of the run other than ours that ``path`` belongs to, None where none does.
    Ours only where a deleted run directory's run is rendered again as it was: the same path and
    the same recipe."""
    return None if rundir.read_identity(path) == ours else rundir.owner(path, own_name)


def default_run_dir(site: Site, name: str) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(site.runs_dir).expanduser()
    path = base / f"{name}-{stamp}"
    n = 1
    while path.exists():
        n += 1
        path = base / f"{name}-{stamp}-{n}"
    return path
