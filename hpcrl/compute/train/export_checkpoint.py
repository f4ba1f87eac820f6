"""A training checkpoint after the fact as a Hugging Face model directory (``hpcrl export``), one
process, never more than a bucket of tensors in memory: the names and shapes come from the model
built on the meta device, the engine that wrote the checkpoint reads its tensors
(hpcrl.compute.train.engine: ``checkpoint_tensors``), and hpcrl.compute.train.export writes them
as the trainers would have.

A damaged training checkpoint (.metadata missing or garbled, a shard file missing, cut short or
corrupt) is a DamagedCheckpoint naming the file: found from the sizes .metadata gives before a byte
is written, else when the file's tensors fail to decode; either way the export leaves nothing (not
even the directory it made to hold its temporary), and ``hpcrl export`` says which step to export
instead, exit status 2.

    python -m hpcrl.compute.train.export_checkpoint RUN_DIR [--step N] [-o DIR]    (what `hpcrl export` runs)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from hpcrl.compute.sync.gather import LiveBytes, ParamSpec
from hpcrl.compute.sync.layout import CheckpointLayout
from hpcrl.compute.train.dcp_reader import DamagedCheckpoint, dcp_load, dcp_metadata
from hpcrl.compute.train.export import ModelWriting, ShardWriter, commit, export_tensors, prepare_tmp, write_metadata
from hpcrl.job import rundir

__all__ = ["export_checkpoint", "export_lora_checkpoint", "main"]


def _open_checkpoint(checkpoint: Path, specs: list[tuple[str, tuple[int, ...]]]
                     ) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], Callable]:
    """The checkpoint's tensors and their reader, once it is known to hold every one of ``specs``."""
    from hpcrl.compute.train.engine import engine_that_wrote

    stored, read = engine_that_wrote(checkpoint).checkpoint_tensors(checkpoint)
    missing = [name for name, _ in specs if name not in stored]
    if missing:
        raise RuntimeError(f"{checkpoint}: the checkpoint lacks {len(missing)} of the model's tensors: {missing[:5]}")
    for name, shape in specs:
        if tuple(stored[name][0]) != tuple(shape):
            raise RuntimeError(f"{checkpoint}: {name} has shape {tuple(stored[name][0])}, the model {tuple(shape)}")
    return stored, read


def _checkpoint_buckets(stored: dict[str, tuple[tuple[int, ...], torch.dtype]], read: Callable,
                        specs: list[tuple[str, tuple[int, ...]]], bucket_bytes: int,
                        dtype_of: Callable[[torch.dtype], torch.dtype], tracker: LiveBytes | None
                        ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The checkpoint's model tensors in ``specs``' order, a bucket at a time, each cast."""
    pending: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    size = 0
    track = tracker.track if tracker is not None else (lambda t: t)

    def load(entries):
        into = read(entries, track)
        out = []
        for name, _, dt in entries:
            loaded = into.pop(name)
            t = loaded.to(dtype_of(dt))
            out.append((name, t if t is loaded else track(t)))
        return out

    for name, shape in specs:
        dt = stored[name][1]
        nbytes = torch.Size(shape).numel() * dt.itemsize
        if pending and size + nbytes > bucket_bytes:
            bucket = load(pending)
            pending, size = [], 0
            yield bucket
            bucket.clear()
        pending.append((name, tuple(shape), dt))
        size += nbytes
    if pending:
        bucket = load(pending)
        yield bucket
        bucket.clear()


def _new_dirs(path: Path) -> list[Path]:
    """The ancestors of ``path`` that do not exist yet, innermost first."""
    return [p for p in path.parents if not p.exists()]


def _remove_new_dirs(dirs: list[Path]) -> None:
    """Remove the directories an export made for itself, innermost first, if still empty."""
    for d in dirs:
        try:
            d.rmdir()
        except OSError:
            return


def export_checkpoint(checkpoint: str | os.PathLike, final: str | os.PathLike, how: ModelWriting, *,
                      tracker: LiveBytes | None = None) -> Path:
    """A training checkpoint (``checkpoints/step-<N>``) -> a model directory ``final``, one process,
    never more than a bucket of tensors in memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    checkpoint, final = Path(checkpoint), Path(final)
    dtype, trust_remote_code = how.dtype, how.trust_remote_code
    config = AutoConfig.from_pretrained(how.model_dir, trust_remote_code=trust_remote_code)
    with torch.device("meta"):      # names, shapes and tying, without a byte of weights
        meta = AutoModelForCausalLM.from_config(config, dtype=torch.float32, trust_remote_code=trust_remote_code)
    tensors = export_tensors(meta)
    layout = CheckpointLayout(meta, tensors)
    cast = lambda dt: dtype if dt.is_floating_point else dt       # noqa: E731
    specs = [ParamSpec(name, cast(t.dtype), tuple(t.shape)) for name, t in tensors]
    wanted = [(s.name, s.shape) for s in specs]
    stored, read = _open_checkpoint(checkpoint, wanted)     # a damaged checkpoint is found before any write
    made = _new_dirs(final)
    tmp = prepare_tmp(final)
    shards = ShardWriter(tmp, layout.specs(specs), how.max_shard_bytes)
    try:
        for bucket in layout.buckets(_checkpoint_buckets(stored, read, wanted, how.bucket_bytes, cast, tracker)):
            for name, t in bucket:
                shards.write(name, t)
            t = None
        shards.finish()
        write_metadata(tmp, how.model_dir, dtype, how.tokenizer, trust_remote_code)
        return commit(tmp, final)
    except BaseException:
        shards.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_new_dirs(made)      # `hpcrl export` makes <run_dir>/model for checkpoint-<step>: no empty one left
        raise


def export_lora_checkpoint(checkpoint: str | os.PathLike, model_dir: str | os.PathLike, final: str | os.PathLike, *,
                           recipe_model, tokenizer) -> Path:
    """A LoRA run's training checkpoint (its adapters) -> a peft adapter directory ``final``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hpcrl.compute.train import lora

    checkpoint, final = Path(checkpoint), Path(final)
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=recipe_model.trust_remote_code)
    with torch.device("meta"):      # the adapters' names and shapes
        meta = lora.add_adapters(AutoModelForCausalLM.from_config(
            config, trust_remote_code=recipe_model.trust_remote_code), recipe_model)
    into = {name: torch.empty(tuple(p.shape), dtype=torch.float32) for name, p in lora.adapter_tensors(meta)}
    stored = dcp_metadata(checkpoint).state_dict_metadata
    missing = [name for name in into if f"model.{name}" not in stored]
    if missing:
        raise RuntimeError(f"{checkpoint}: the checkpoint lacks {len(missing)} of the recipe's LoRA adapters "
                           f"(model.lora_*: was it written with other settings?): {missing[:3]}")
    dcp_load(checkpoint, {"model": into})
    made = _new_dirs(final)
    tmp = prepare_tmp(final)
    try:
        lora.write_adapter_dir(tmp, into, recipe_model=recipe_model, base_model=str(model_dir), tokenizer=tokenizer,
                               wrappers=lora.parameter_wrappers(meta), injected=lora.injected_config(meta))
        return commit(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_new_dirs(made)
        raise


def main(argv: list[str] | None = None) -> int:
    """``hpcrl export``'s compute side (the login side has checked the arguments)."""
    from hpcrl.compute.train.sources import load_tokenizer, resolve_model
    from hpcrl.job.errors import UserError
    from hpcrl.job.spec import JobSpec

    p = argparse.ArgumentParser(prog="python -m hpcrl.compute.train.export_checkpoint")
    p.add_argument("run_dir")
    p.add_argument("--step", type=int)
    p.add_argument("-o", "--output")
    args = p.parse_args(argv)
    try:
        spec = JobSpec.load(args.run_dir)
        recipe = spec.recipe
        ckpt_dir = Path(recipe.checkpoint.dir or Path(args.run_dir) / rundir.CHECKPOINTS_DIR)
        steps = rundir.training_checkpoint_steps(ckpt_dir)
        step = args.step if args.step is not None else (steps[-1] if steps else None)
        if step is None or step not in steps:
            raise UserError(f"export: no training checkpoint {'' if step is None else f'of step {step} '}in {ckpt_dir}")
    except UserError as e:
        print(f"hpcrl: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.output) if args.output else rundir.model_dir(args.run_dir, step, recipe.checkpoint.output_dir)
    try:
        model_dir = resolve_model(recipe.model.path, args.run_dir, recipe.grpo.seed, recipe.model.revision)
        tokenizer = load_tokenizer(recipe.model, model_dir)
        if recipe.model.use_peft:
            export_lora_checkpoint(rundir.training_checkpoint(ckpt_dir, step), model_dir, out,
                                   recipe_model=recipe.model, tokenizer=tokenizer)
            return 0
        export_checkpoint(rundir.training_checkpoint(ckpt_dir, step), out,
                          ModelWriting.for_run(recipe, model_dir, tokenizer))
    except DamagedCheckpoint as e:
        # The input, not the machine: the same command can only fail again; another step may not.
        print(f"hpcrl: error: export: {e}; {rundir.other_steps_hint(args.run_dir, step, steps, args.output)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:       # the partial directory is gone; `hpcrl` says it was interrupted
        return 130
    except (OSError, RuntimeError, ValueError) as e:
        # A checkpoint that does not fit the model, a full disk: one line, the hidden directory removed.
        print(f"hpcrl: error: export of step {step} to {out} failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
