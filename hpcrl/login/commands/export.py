"""`hpcrl export RUN_DIR [--step N] [-o DIR]`: a training checkpoint -> a Hugging Face model directory.

The arguments are checked here, without torch; the work is hpcrl.compute.train.export_checkpoint in a
subprocess of this interpreter (it reads the checkpoint tensor by tensor). Its exit status is passed
through. A damaged checkpoint (a file missing here, missing, cut short or corrupt there) is one line
naming the file and the step to export instead, exit status 2, like any input that cannot be used:
the same command can only fail again.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hpcrl.job import rundir
from hpcrl.job.demo import is_demo
from hpcrl.job.errors import UserError


def main(args) -> int:
    from hpcrl.job.spec import JobSpec

    run_dir = Path(args.run_dir).expanduser()
    if not (run_dir / rundir.SPEC_FILE).is_file():
        raise UserError(f"export: {args.run_dir} is not a run directory (no {rundir.SPEC_FILE})")
    spec = JobSpec.load(run_dir)
    model_path = spec.recipe.model.path
    # The config and tokenizer come from the source model; a demo model is rebuilt in the run directory.
    if not is_demo(model_path) and not Path(model_path).is_dir():
        raise UserError(f"export: model.path {model_path} is not a directory here: the export takes the "
                        f"model's config and tokenizer from it (run it where the job's files are)")
    ckpt_dir = Path(spec.recipe.checkpoint.dir or run_dir / rundir.CHECKPOINTS_DIR)
    steps = rundir.training_checkpoint_steps(ckpt_dir)
    damaged = _damaged_steps(ckpt_dir, steps)
    # A step-<N> is renamed into place only once whole, so one that lacks a file was damaged since;
    # the newest being damaged is said, not silently passed over for an older one.
    wanted = args.step if args.step is not None else max([*steps, *damaged], default=None)
    if wanted in damaged:
        raise UserError(f"export: {damaged[wanted]}; {rundir.other_steps_hint(args.run_dir, wanted, steps, args.output)}")
    if args.step is not None and args.step not in steps:
        have = f"it has steps {', '.join(map(str, steps))}" if steps else "it has none"
        raise UserError(f"export: --step {args.step}: no training checkpoint of that step in {ckpt_dir} ({have})")
    if not steps:
        raise UserError(f"export: no training checkpoint in {ckpt_dir}")
    step = args.step if args.step is not None else steps[-1]
    out = rundir.model_dir(run_dir, step, spec.recipe.checkpoint.output_dir)
    cmd = [sys.executable, "-m", "hpcrl.compute.train.export_checkpoint", str(run_dir), "--step", str(step)]
    if args.output:
        out = Path(args.output).expanduser()
        # Only a directory of ours is ever replaced: -o naming anything else would delete it.
        if out.exists() and not (out.is_dir() and rundir.is_model_dir(out)) and not _empty_dir(out):
            raise UserError(f"export: -o {args.output} exists and is not a model directory; not replacing it")
        if not out.parent.is_dir():
            raise UserError(f"export: -o {args.output}: directory {out.parent} does not exist")
        if not os.access(out.parent, os.W_OK):
            raise UserError(f"export: -o {args.output}: directory {out.parent} is not writable")
        cmd += ["-o", str(out)]
    print(f"hpcrl: exporting step {step} of {run_dir} to {out}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(cmd)
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        # The export got the same Ctrl-C and is removing its partial directory: let it finish
        # (subprocess.call would kill it in the middle and leave that directory behind).
        proc.wait()
        raise
    if code == 0:
        print(f"model: {out}")
    return code


def _damaged_steps(ckpt_dir: Path, complete: list[int]) -> dict[int, str]:
    """step -> what is wrong, for the step-<N> directories that lack a file of a complete checkpoint."""
    out = {}
    for path in ckpt_dir.glob(f"{rundir.TRAINING_CHECKPOINT_PREFIX}*"):
        tail = path.name.removeprefix(rundir.TRAINING_CHECKPOINT_PREFIX)
        if not tail.isdigit() or int(tail) in complete or not path.is_dir():
            continue
        if not any((path / f).exists() for f in rundir.TRAINING_CHECKPOINT_STATE):
            what = f"{rundir.TRAINING_CHECKPOINT_STATE[0]} (the index of the model and optimizer shards) is missing"
        else:
            what = f"{rundir.TRAINING_CHECKPOINT_META} (the save's last file) is missing"
        out[int(tail)] = f"{path}: {what}"
    return out



def _empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())
