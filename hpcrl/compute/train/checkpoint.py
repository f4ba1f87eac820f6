"""Training-state checkpoints for resume and requeue (torch.distributed.checkpoint).

Layout of a checkpoint directory (on a file system every trainer rank sees)::

    <dir>/step-<N>/            one complete checkpoint
        .metadata, __*.distcp  DCP: model + optimizer, sharded (every rank writes its shards);
                               trainable parameters only (LoRA: the adapters)
        deepspeed/             instead of DCP's files, an engine's own format (write_state):
                               DeepSpeed's ZeRO-3 files (hpcrl.compute.train.deepspeed_engine)
        rank-<r>.pt            per rank: RNG states, scheduler, the caller's `extra`, the step
        meta.json              step, world size, time (written last, by rank 0)
    <dir>/latest               the name of the newest complete checkpoint ("step-<N>")
    <dir>/.hpcrl-run.json      the run they belong to (rundir.RUN_IDENTITY_FILE), by the first save

Atomic by construction: everything is written into ``step-<N>.tmp/``; after every rank has finished
(a barrier), rank 0 renames it to ``step-<N>/`` and then replaces ``latest`` (temp file +
``os.replace``). A save killed at any point leaves the previous checkpoint intact and ``latest``
pointing at it; a leftover ``.tmp`` is removed by the next save. Only the newest ``keep`` are kept.

Model and optimizer state go through ``get_state_dict``/``set_state_dict``, so FSDP2's DTensor
shards are saved as such and can be loaded on another world size (DCP reshards). RNG state is per
rank (each rank draws its own dropout masks); on a different world size a rank without its own file
takes rank 0's scheduler/extra and keeps its current RNG (a warning says so).

Every wait is bounded: the barriers and DCP's own collectives run on a gloo group created with
``timeout_s`` (the ``monitored_barrier`` names the rank that did not arrive), so a dead or hung rank
makes the save fail with a message instead of hanging the job. Create that group at start-up with
:func:`control_group` (a collective) so that the first save does not have to.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from hpcrl.job import rundir
from hpcrl.job.atomic import atomic_write, fsync_dir
from hpcrl.job.recipe import LaunchConfig

__all__ = [
    "CheckpointError",
    "control_group",
    "barrier",
    "latest_checkpoint",
    "list_checkpoints",
    "checkpoint_step",
    "save",
    "load",
    "capture_rng",
    "restore_rng",
]

log = logging.getLogger(__name__)

PREFIX = "step-"
# The run directory both launchers give every task (the sbatch script and `hpcrl run` export it):
# its job.json says which run the checkpoints are saved for.
RUN_DIR_ENV = "HPCRL_RUN_DIR"
LATEST = "latest"
META = rundir.TRAINING_CHECKPOINT_META
_STEP_DIR = re.compile(r"^step-(\d+)$")
# The recipe's launch.collective_timeout_s by default: a save is collectives too.
DEFAULT_TIMEOUT_S = LaunchConfig.collective_timeout_s

_groups: dict[float, Any] = {}


class CheckpointError(RuntimeError):
    """A save or load that could not complete (a rank missing, a file system error)."""


# ----------------------------------------------------------------------------------------------
# Bounded waits


def _dist() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _dist() else 0


def control_group(timeout_s: float = DEFAULT_TIMEOUT_S):
    """The gloo process group (all ranks) that checkpoint barriers and DCP planning use.

    Created once per timeout (a collective: every rank must call it, e.g. at trainer start-up);
    its ``timeout_s`` bounds every wait of :func:`save` and :func:`load`. None when not distributed.
    """
    if not _dist():
        return None
    key = float(timeout_s)
    if key not in _groups:
        _groups[key] = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return _groups[key]


def barrier(what: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """A barrier that fails after ``timeout_s`` naming the missing rank, instead of hanging."""
    if not _dist():
        return
    group = control_group(timeout_s)
    try:
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise CheckpointError(f"rank {_rank()}: {what}: a rank did not arrive (it died, or hung for "
                              f"more than the {timeout_s:g} s timeout, launch.collective_timeout_s): {e}") from e


# ----------------------------------------------------------------------------------------------
# Finding checkpoints


def checkpoint_step(path: str | os.PathLike) -> int:
    """The step of a ``step-<N>`` directory."""
    m = _STEP_DIR.match(Path(path).name)
    if not m:
        raise ValueError(f"{path}: not a checkpoint directory (step-<N>)")
    return int(m.group(1))


def _complete(path: Path) -> bool:
    return _STEP_DIR.match(path.name) is not None and rundir.is_complete_training_checkpoint(path)


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Complete checkpoints under ``directory``, oldest first."""
    d = Path(directory)
    if not d.is_dir():
        return []
    found = [p for p in d.iterdir() if p.is_dir() and _complete(p)]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(directory: str | os.PathLike) -> Optional[Path]:
    """The checkpoint ``latest`` names, if complete; else the newest complete one; else None."""
    d = Path(directory)
    try:
        name = (d / LATEST).read_text().strip()
    except OSError:
        name = ""
    if name and _complete(d / name):
        return d / name
    found = list_checkpoints(d)
    return found[-1] if found else None


def _this_run() -> Optional[dict[str, str]]:
    """This run's identity (rundir.run_identity); None outside a job (no run directory given)."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    return rundir.job_identity(run_dir) if run_dir else None


def _check_owner(directory: Path, ours: Optional[dict[str, str]]) -> None:
    """Every rank, before anything is read or written: another run's checkpoints are never resumed
    from nor written among (compose refuses such a checkpoint.dir; two runs rendered before either
    wrote one, or by an hpcrl without identities, still meet here). The run directory alone is
    compared: a run's job.json may be edited between its resumes (more steps)."""
    theirs = rundir.read_identity(directory)
    if ours is None or theirs is None or theirs["run_dir"] == ours["run_dir"]:
        return
    raise CheckpointError(f"{directory} holds the checkpoints of run {theirs['run_dir']}, not of this run "
                          f"({ours['run_dir']}): two runs cannot share a checkpoint.dir; continue that run with "
                          f"`{rundir.resume_command(theirs['run_dir'])}` and give this one another checkpoint.dir")


# ----------------------------------------------------------------------------------------------
# RNG


def capture_rng() -> dict[str, Any]:
    """This process's RNG states: python, numpy, torch CPU, and CUDA/ROCm when in use."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        if len(state["cuda"]) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(state["cuda"])
        else:
            log.warning("checkpoint has CUDA RNG for %d devices, %d visible: CUDA RNG not restored",
                        len(state["cuda"]), torch.cuda.device_count())


# ----------------------------------------------------------------------------------------------
# Files


def _rank_file(path: Path, rank: int) -> Path:
    return path / f"rank-{rank:05d}.pt"


def _torch_save_synced(obj: Any, path: Path) -> None:
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _commit(directory: Path, tmp: Path, final: Path, step: int, keep: int, world: int) -> None:
    """Rank 0, once every rank has written: make ``tmp`` the checkpoint ``final`` and point ``latest`` at it."""
    meta = {"step": step, "world_size": world, "time": time.time(), "host": socket.gethostname(),
            "torch": torch.__version__}
    with open(tmp / META, "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    old = None
    if final.exists():          # the same step saved again (e.g. on a signal right after resume)
        old = final.with_name(final.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(directory)
    atomic_write(directory / LATEST, final.name + "\n", durable=True)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    _prune(directory, keep, final)


def _prune(directory: Path, keep: int, newest: Path) -> None:
    """Keep the newest ``keep`` complete checkpoints; drop leftovers of interrupted saves."""
    for p in directory.iterdir():
        if p.is_dir() and p.name.startswith(PREFIX) and (p.name.endswith(".tmp") or p.name.endswith(".old")):
            shutil.rmtree(p, ignore_errors=True)
    complete = list_checkpoints(directory)
    for p in complete[:-max(1, keep)]:
        if p != newest:
            shutil.rmtree(p, ignore_errors=True)


# ----------------------------------------------------------------------------------------------
# Save / load


# Frozen parameters (LoRA's base weights) are left out: they never change, and come from model.path
# again on resume, so a LoRA checkpoint holds the adapters and their optimizer state only.
_OPTIONS = StateDictOptions(ignore_frozen_params=True)


def _load_options(model: nn.Module) -> StateDictOptions:
    # load_state_dict's strictness would ask for the frozen parameters left out; DCP has already
    # checked that every tensor asked for was in the checkpoint.
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(ignore_frozen_params=True, strict=not frozen)


def _without_frozen(model: nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    # ignore_frozen_params drops each frozen parameter under its first name only: a tied alias
    # (lm_head.weight, the embedding) would still be saved, the largest frozen matrix there is.
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {k: v for k, v in state.items() if k not in frozen}


def _state_dicts(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> dict[str, Any]:
    if optimizer is None:
        return {"model": _without_frozen(model, get_model_state_dict(model, options=_OPTIONS))}
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_OPTIONS)
    return {"model": _without_frozen(model, model_sd), "optim": optim_sd}


def save(directory: str | os.PathLike, step: int, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
         scheduler: Any, extra: Optional[dict[str, Any]] = None, keep: int = 2, *,
         timeout_s: float = DEFAULT_TIMEOUT_S, write_state: Optional[Callable[[Path], None]] = None) -> Path:
    """Save the training state after ``step`` optimizer steps; every trainer rank calls it.

    ``extra``: the caller's per-rank picklable state (data sampler position, ...), given back by
    :func:`load`. Returns the committed ``<directory>/step-<step>``. Raises :class:`CheckpointError`
    when a rank does not arrive within ``timeout_s``; the previous checkpoint then stays the latest.
    ``write_state(tmp)``: writes the model and optimizer into the uncommitted directory instead of
    DCP (an engine with a checkpoint format of its own); the commit is the same.
    """
    rng = capture_rng()     # first: nothing below may consume randomness before it is recorded
    directory = Path(directory)
    final = directory / f"{PREFIX}{step}"
    tmp = directory / f"{PREFIX}{step}.tmp"
    rank = _rank()
    world = dist.get_world_size() if _dist() else 1
    group = control_group(timeout_s)
    t0 = time.perf_counter()
    ours = _this_run()
    _check_owner(directory, ours)
    if rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        if ours is not None and rundir.read_identity(directory) is None:
            rundir.write_identity(directory, ours)      # the run's own checkpoints/, or a pre-identity run's
        if tmp.exists():
            shutil.rmtree(tmp)      # from an interrupted save of the same step
        tmp.mkdir()
    barrier(f"checkpoint step {step}: preparing {tmp}", timeout_s)
    try:
        if write_state is not None:
            write_state(tmp)
        else:
            dcp.save(_state_dicts(model, optimizer), checkpoint_id=str(tmp), process_group=group)
    except Exception as e:  # DCP gathers every rank's failure into one exception on all ranks
        raise CheckpointError(f"rank {rank}: checkpoint step {step}: writing {tmp} failed: {e}") from e
    _torch_save_synced({"step": step, "rank": rank, "world_size": world, "rng": rng,
                        "scheduler": scheduler.state_dict() if scheduler is not None else None,
                        "extra": dict(extra or {})}, _rank_file(tmp, rank))
    barrier(f"checkpoint step {step}: written, before commit", timeout_s)
    if rank == 0:
        _commit(directory, tmp, final, step, keep, world)
    barrier(f"checkpoint step {step}: commit", timeout_s)
    if rank == 0:
        log.info("checkpoint %s saved in %.2f s", final, time.perf_counter() - t0)
    return final


def load(path: str | os.PathLike, model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
         scheduler: Any, *, timeout_s: float = DEFAULT_TIMEOUT_S, restore_rng_state: bool = True,
         read_state: Optional[Callable[[Path], None]] = None) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save` into ``model``/``optimizer``/``scheduler`` (in place).

    Every trainer rank calls it, with the model already sharded and the optimizer built. Returns this
    rank's ``extra`` plus ``"step"`` (the steps done). RNG states are restored last, so the next
    random draw is the one the saving run made after its save. ``read_state(path)``: the
    counterpart of save's ``write_state``.
    """
    path = Path(path)
    if not _complete(path):
        raise CheckpointError(f"{path}: not a complete checkpoint (no .metadata or {META})")
    _check_owner(path.parent, _this_run())
    rank = _rank()
    try:
        if read_state is not None:
            read_state(path)
        else:
            state = _state_dicts(model, optimizer)
            dcp.load(state, checkpoint_id=str(path), process_group=control_group(timeout_s))
            if optimizer is None:
                set_model_state_dict(model, state["model"], options=_load_options(model))
            else:
                set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                               options=_load_options(model))
    except CheckpointError:
        raise
    except Exception as e:
        raise CheckpointError(f"rank {rank}: loading {path} failed: {e}") from e
    own = _rank_file(path, rank)
    mine = own.is_file()
    ranked = torch.load(own if mine else _rank_file(path, 0), map_location="cpu", weights_only=False)
    if scheduler is not None and ranked["scheduler"] is not None:
        scheduler.load_state_dict(ranked["scheduler"])
    barrier(f"loading {path}", timeout_s)
    if restore_rng_state:
        if mine:
            restore_rng(ranked["rng"])
        else:
            log.warning("%s was saved by %d ranks: rank %d has no RNG state there and keeps its own",
                        path, ranked["world_size"], rank)
    return {**ranked["extra"], "step": int(ranked["step"])}
