"""The trained model as a Hugging Face directory: from the sharded trainers (the end of a run,
grpo.save_steps) or from a training checkpoint after the fact (``hpcrl export``).

What a directory holds: config.json (the source model's, its dtype set to the weights'),
generation_config.json, the tokenizer files with the chat template, and the weights in safetensors
files of at most ``max_shard_bytes`` (``model.safetensors`` alone, or ``model-0000i-of-0000n``
with ``model.safetensors.index.json``, as ``save_pretrained`` names them). Weights are in the
model's dtype (recipe model.dtype, else the source checkpoint's); the fp32 masters are cast tensor
by tensor, and each bucket is put in the checkpoint layout (hpcrl.compute.sync.layout: per-expert
MoE tensors, the names ``save_pretrained`` writes). ``AutoModelForCausalLM.from_pretrained`` and
vLLM load it as is.

Memory: no process ever holds the whole model.
- From the trainers, the tensors come through the weight sync's gather (``iter_buckets``, the same
  order and the same cast-before-gather) and only trainer rank 0 keeps them: it holds the bucket
  being written plus the tensor being gathered (about two buckets), never a whole shard file. The
  shard files are planned from the tensors' global shapes before anything is gathered, so each
  file's safetensors header is written first and every tensor is streamed to its place as it comes.
  Under HSDP only the ranks whose gathers include rank 0 (node 0's replica) take part; the other
  replicas hold the same weights and skip the gathers.
- From a checkpoint, the names and shapes come from the model built on the meta device, and
  torch.distributed.checkpoint loads a bucket's worth of tensors at a time into tensors allocated
  for them alone.

Atomic: everything is written under a hidden temporary name beside the target and renamed when
complete; a killed writer leaves only that hidden directory (removed by the next save). An earlier
directory of the same name is replaced only once the new one is whole. The final model directory
keeps the checkpoint-<step>/ directories saved inside it (TRL's output_dir layout).

A damaged training checkpoint (.metadata missing or garbled, a shard file missing, cut short or
corrupt) is a DamagedCheckpoint naming the file: found from the sizes .metadata gives before a byte
is written, else when the file's tensors fail to decode; either way the export leaves nothing (not
even the directory it made to hold its temporary), and ``hpcrl export`` says which step to export
instead, exit status 2.

A LoRA run (model.use_peft) writes peft adapter directories instead (save_lora_from_trainers,
export_lora_checkpoint; the merged model on request, checkpoint.save_merged_model).

    python -m hpcrl.compute.train.export RUN_DIR [--step N] [-o DIR]     (what `hpcrl export` runs)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from hpcrl.compute.sync.gather import LiveBytes, ParamSpec, hf_name, iter_buckets, param_specs, sync_named_params
from hpcrl.compute.sync.layout import CheckpointLayout
from hpcrl.compute.train.checkpoint import fsync_dir
from hpcrl.job import rundir

__all__ = ["DTYPES", "SINGLE_FILE", "INDEX_FILE", "export_dtype", "saved_dtype", "export_tensors", "plan_shards", "ShardWriter",
           "prepare_tmp", "write_metadata", "commit", "save_from_trainers", "save_lora_from_trainers",
           "export_checkpoint", "export_lora_checkpoint", "DamagedCheckpoint", "main"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_NAME = "model-{:05d}-of-{:05d}.safetensors"
_ST_DTYPE = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
             torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
             torch.bool: "BOOL"}
# Files of the source model directory that are not weights and not written here from objects:
# custom modelling code (trust_remote_code) travels with the model.
_CODE_GLOB = "*.py"
GB = 10**9


# ---------------------------------------------------------------------------------------- what is written
def saved_dtype(recipe, model_dir: str | os.PathLike) -> torch.dtype:
    """What the run's model directories are written in: checkpoint.model_dtype, else export_dtype's rule."""
    chosen = recipe.checkpoint.model_dtype
    return export_dtype(recipe.model.dtype if chosen == "auto" else chosen, model_dir)


def export_dtype(recipe_dtype: str, model_dir: str | os.PathLike) -> torch.dtype:
    """model.dtype when set, else the source checkpoint's (config.json dtype / torch_dtype), else fp32."""
    if recipe_dtype != "auto":
        return DTYPES[recipe_dtype]
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return DTYPES.get(str(name).removeprefix("torch."), torch.float32)


def export_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What a Hugging Face checkpoint of ``model`` holds, in the sync's order: the parameters under
    their checkpoint names (a tied lm_head left out), then the persistent buffers."""
    out = sync_named_params(model)
    seen = {name for name, _ in out}
    for module_name, module in model.named_modules():
        for name, buf in module.named_buffers(recurse=False):
            if buf is None or name in module._non_persistent_buffers_set:
                continue
            full = hf_name(f"{module_name}.{name}" if module_name else name)
            if full not in seen:
                seen.add(full)
                out.append((full, buf))
    return out


def plan_shards(specs: list[ParamSpec], max_shard_bytes: int) -> list[list[ParamSpec]]:
    """Tensors in order into files: a file takes tensors until the next would push it past the limit;
    a tensor larger than the limit is a file of its own (as ``save_pretrained`` does)."""
    shards: list[list[ParamSpec]] = []
    size = 0
    for spec in specs:
        if not shards or (shards[-1] and size + spec.nbytes > max_shard_bytes):
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards or [[]]


class ShardWriter:
    """Streams tensors, in the planned order, into the safetensors files of ``directory``.

    Each file's header (names, dtypes, shapes, offsets) is known from the plan, so it is written
    when the file is opened and each tensor's bytes are appended as the tensor arrives: the writer
    keeps no tensor after :meth:`write` returns.
    """

    def __init__(self, directory: Path, specs: list[ParamSpec], max_shard_bytes: int,
                 on_file: Callable[[Path], None] | None = None) -> None:
        self.directory = Path(directory)
        self.shards = plan_shards(specs, max_shard_bytes)
        n = len(self.shards)
        self.names = [SINGLE_FILE] if n == 1 else [_SHARD_NAME.format(i + 1, n) for i in range(n)]
        self.on_file = on_file
        self._order = [(i, spec) for i, shard in enumerate(self.shards) for spec in shard]
        self._next = 0
        self._file = None

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._order):
            raise RuntimeError(f"export: {name} is more than the {len(self._order)} tensors planned")
        shard, spec = self._order[self._next]
        if name != spec.name or tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise RuntimeError(f"export: got {name} {tuple(tensor.shape)} {tensor.dtype}, expected "
                               f"{spec.name} {spec.shape} {spec.dtype}")
        if self._file is None:
            self._open(shard)
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._file.write(memoryview(data.numpy()))
        self._next += 1
        if self._next == len(self._order) or self._order[self._next][0] != shard:
            self._close()

    def _open(self, shard: int) -> None:
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for spec in self.shards[shard]:
            header[spec.name] = {"dtype": _ST_DTYPE[spec.dtype], "shape": list(spec.shape),
                                 "data_offsets": [offset, offset + spec.nbytes]}
            offset += spec.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)           # the tensor data starts 8-byte aligned, as safetensors writes it
        path = self.directory / self.names[shard]
        self._file = open(path, "wb")
        self._file.write(len(raw).to_bytes(8, "little"))
        self._file.write(raw)
        if self.on_file is not None:
            self.on_file(path)

    def _close(self) -> None:
        f, self._file = self._file, None
        f.flush()
        os.fsync(f.fileno())
        f.close()

    def finish(self) -> None:
        """Check that every planned tensor came; write the index when there are several files."""
        if self._next != len(self._order):
            missing = [spec.name for _, spec in self._order[self._next:]]
            raise RuntimeError(f"export: {len(missing)} tensors never came: {missing[:5]}")
        if not self._order:             # a model without weights still gets its (empty) file
            self._open(0)
            self._close()
        if len(self.shards) > 1:
            weight_map = {spec.name: self.names[i] for i, spec in self._order}
            total = sum(spec.nbytes for _, spec in self._order)
            params = sum(spec.nbytes // spec.dtype.itemsize for _, spec in self._order)
            index = {"metadata": {"total_size": total, "total_parameters": params}, "weight_map": weight_map}
            (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


# ---------------------------------------------------------------------------------------- the directory
def _tmp_name(final: Path) -> Path:
    return final.parent / f".{final.name}.tmp-{os.getpid()}"


def _stale(final: Path, kind: str) -> list[Path]:
    return [p for p in final.parent.glob(f".{final.name}.{kind}-*") if p.is_dir()]


def prepare_tmp(final: Path) -> Path:
    """The empty hidden directory a model is written into, beside ``final``; leftovers of killed
    writes of ``final`` are removed first (their names say they never completed)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    for stale in _stale(final, "tmp"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = _tmp_name(final)
    tmp.mkdir()
    return tmp


def write_metadata(directory: Path, model_dir: str | os.PathLike, dtype: torch.dtype, tokenizer: Any,
                   trust_remote_code: bool = False) -> None:
    """config.json (dtype set to the weights'), generation_config.json, modelling code, tokenizer."""
    src = Path(model_dir)
    config = json.loads((src / "config.json").read_text())
    name = str(dtype).removeprefix("torch.")
    keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
    for key in keys:
        config[key] = name
    if (src / "generation_config.json").is_file():
        shutil.copyfile(src / "generation_config.json", directory / "generation_config.json")
    else:
        from transformers import AutoConfig, GenerationConfig

        hf_config = AutoConfig.from_pretrained(src, trust_remote_code=trust_remote_code)
        GenerationConfig.from_model_config(hf_config).save_pretrained(directory)
    for code in src.glob(_CODE_GLOB):
        shutil.copyfile(code, directory / code.name)
    tokenizer.save_pretrained(directory)
    # Last: config.json is what makes a directory look like a model (rundir.is_model_dir).
    (directory / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def commit(tmp: Path, final: Path) -> Path:
    """Make the complete ``tmp`` the directory ``final``.

    An earlier ``final`` is moved aside, then ``tmp`` renamed into place (a moment without ``final``,
    never a half-written one under its name); the earlier one's checkpoint-<step>/ directories move
    into the new one, and it goes. A kill between these leaves the aside directory, whose
    checkpoints the next commit takes over."""
    for f in tmp.iterdir():
        if f.is_file():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
    fsync_dir(tmp)
    asides = _stale(final, "old")
    if final.exists():
        aside = final.parent / f".{final.name}.old-{os.getpid()}"
        if aside.exists():
            shutil.rmtree(aside)
        os.rename(final, aside)
        asides.append(aside)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    for aside in asides:
        for child in sorted(aside.glob(f"{rundir.MODEL_CHECKPOINT_PREFIX}*")):
            if child.is_dir() and not (final / child.name).exists():
                os.rename(child, final / child.name)
        # Which run the directory belongs to (written at render) stays with it.
        identity = aside / rundir.RUN_IDENTITY_FILE
        if identity.is_file() and not (final / rundir.RUN_IDENTITY_FILE).exists():
            os.rename(identity, final / rundir.RUN_IDENTITY_FILE)
        shutil.rmtree(aside, ignore_errors=True)
    return final


# ---------------------------------------------------------------------------------------- from the trainers
def _takes_part(tensors: Iterable[tuple[str, torch.Tensor]], writer_rank: int) -> bool:
    """Whether this rank's gathers include the writer: every shard dimension's group holds it.
    Fully sharded: every rank. HSDP: node 0's replica (a replica of another node gathers among
    itself, and would only burn time)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return True
    for _, t in tensors:
        placements = getattr(t, "placements", None)
        if placements is None:
            continue
        for dim, placement in enumerate(placements):
            if placement.is_shard() and writer_rank not in dist.get_process_group_ranks(t.device_mesh.get_group(dim)):
                return False
    return True


def save_from_trainers(model: torch.nn.Module, final: Path, *, model_dir: str | os.PathLike, tokenizer: Any,
                       dtype: torch.dtype, max_shard_bytes: int, bucket_bytes: int, writer: bool, group=None,
                       tracker: LiveBytes | None = None, trust_remote_code: bool = False,
                       on_file: Callable[[Path], None] | None = None,
                       on_tensor: Callable[[str, torch.Tensor], None] | None = None) -> Path | None:
    """Write ``model`` (FSDP2-sharded, or whole) to ``final``; call it on EVERY trainer rank (the
    gathers and the closing agreement are collectives). ``writer``: trainer rank 0, the rank that
    writes (global rank 0 of ``group``); ``on_tensor`` sees each tensor it writes (base_diff).
    Returns ``final`` on the writer, None elsewhere; raises on every rank when the writer failed
    (the ranks keep gathering after a write error, so none hangs)."""
    tensors = export_tensors(model)
    layout = CheckpointLayout(model, tensors)
    cast = dtype if any(t.dtype.is_floating_point and t.dtype != dtype for _, t in tensors) else None
    error: BaseException | None = None
    tmp = shards = None
    if writer:
        try:
            tmp = prepare_tmp(final)
            shards = ShardWriter(tmp, layout.specs(param_specs(tensors, cast)), max_shard_bytes, on_file)
        except Exception as e:       # noqa: BLE001 - reported to every rank below
            error = e
    if _takes_part(tensors, 0):
        for bucket in layout.buckets(iter_buckets(tensors, bucket_bytes, keep=writer, cast_to=cast, tracker=tracker)):
            for name, t in bucket:
                if error is None:
                    try:
                        shards.write(name, t)
                        if on_tensor is not None:
                            on_tensor(name, t)
                    except Exception as e:      # noqa: BLE001 - keep gathering: the others are in the collectives
                        error = e
            t = None        # the bucket's last tensor goes with the bucket
    if writer and error is None:
        try:
            shards.finish()
            write_metadata(tmp, model_dir, dtype, tokenizer, trust_remote_code)
            commit(tmp, final)
        except Exception as e:      # noqa: BLE001
            error = e
    if shards is not None and error is not None:
        shards.abort()      # its hidden directory stays until the next save removes it
    _raise_if_any_failed(error, group, f"writing the model to {final}")
    return final if writer else None


def _raise_if_any_failed(error: BaseException | None, group, what: str) -> None:
    """Every trainer learns whether the writer failed (a collective), and all of them raise."""
    import torch.distributed as dist

    failed = error is not None
    if dist.is_available() and dist.is_initialized():
        flag = torch.tensor([1 if failed else 0], dtype=torch.int64)
        dist.all_reduce(flag, group=group)
        failed = bool(flag.item())
    if failed:
        if error is not None:
            raise RuntimeError(f"{what} failed: {error}") from error
        raise RuntimeError(f"{what} failed on trainer rank 0")


def save_lora_from_trainers(model: torch.nn.Module, final: Path, *, recipe_model, model_dir: str | os.PathLike,
                            tokenizer: Any, dtype: torch.dtype, max_shard_bytes: int, bucket_bytes: int, writer: bool,
                            merged: bool, group=None, trust_remote_code: bool = False) -> Path | None:
    """A LoRA policy's model directory: the peft adapter directory (hpcrl.compute.train.lora), and
    with ``merged`` the merged model in its ``merged/`` (:func:`save_from_trainers`: the sync's
    merged weights). Every trainer calls it; the same atomic commit and failure agreement."""
    from hpcrl.compute.train import lora

    error: BaseException | None = None
    tmp = None
    if writer:
        try:
            tmp = prepare_tmp(final)
        except Exception as e:       # noqa: BLE001 - reported to every rank below
            error = e
    adapters = lora.gather_adapters(model, writer)
    if writer and error is None:
        try:
            lora.write_adapter_dir(tmp, adapters, recipe_model=recipe_model, base_model=str(model_dir),
                                   tokenizer=tokenizer)
        except Exception as e:       # noqa: BLE001 - reported to every rank below
            error = e
    if merged:
        # Raises on every rank when its writer failed (its own agreement).
        save_from_trainers(model, (tmp or final) / lora.MERGED_DIR, model_dir=model_dir, tokenizer=tokenizer,
                           dtype=dtype, max_shard_bytes=max_shard_bytes, bucket_bytes=bucket_bytes,
                           writer=writer and error is None, group=group, trust_remote_code=trust_remote_code)
    if writer and error is None:
        try:
            commit(tmp, final)
        except Exception as e:      # noqa: BLE001
            error = e
    _raise_if_any_failed(error, group, f"writing the LoRA adapters to {final}")
    return final if writer else None


# ---------------------------------------------------------------------------------------- from a checkpoint
class DamagedCheckpoint(RuntimeError):
    """A training checkpoint whose files are missing or cannot be read: ``what`` names the file."""

    def __init__(self, checkpoint: Path, what: str) -> None:
        super().__init__(f"{checkpoint}: {what}")
        self.checkpoint, self.what = Path(checkpoint), what


def _cause(e: BaseException) -> str:
    """The error's type and first sentence (torch's unpickler goes on with advice that does not apply)."""
    text = str(e).strip().split("\n")[0].split(". ")[0][:80]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _dcp_metadata(checkpoint: Path):
    """DCP's index of ``checkpoint``, once the files that hold its model tensors are known to be there
    and long enough: a missing or cut-short file is named here, before anything is written. (The
    optimizer's tensors are not read by an export, so their files are not asked about.)"""
    import torch.distributed.checkpoint as dcp

    try:
        meta = dcp.FileSystemReader(str(checkpoint)).read_metadata()
    except FileNotFoundError:
        raise DamagedCheckpoint(checkpoint, ".metadata (DCP's index of the shard files) is missing") from None
    except OSError:
        raise
    except Exception as e:      # noqa: BLE001 - a garbled pickle raises anything
        raise DamagedCheckpoint(checkpoint, f".metadata is corrupt: it cannot be decoded ({_cause(e)})") from None
    ends: dict[str, int] = {}
    for index, info in meta.storage_data.items():
        if index.fqn.startswith("model."):
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        try:
            size = (checkpoint / name).stat().st_size
        except FileNotFoundError:
            raise DamagedCheckpoint(checkpoint, f"{name} is missing (.metadata lists it)") from None
        if size < end:
            raise DamagedCheckpoint(checkpoint, f"{name} is truncated ({size} bytes; .metadata places data "
                                                f"up to byte {end})")
    return meta


def _dcp_load(checkpoint: Path, state: dict[str, Any]) -> None:
    """dcp.load in this one process; a shard file that cannot be read is named (DamagedCheckpoint)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    class Reader(dcp.FileSystemReader):
        """Reads file by file, to remember which one failed (DCP's own error does not say)."""
        failed: tuple[str, BaseException] | None = None

        def read_data(self, plan, planner):
            per_file: dict[str, list] = {}
            for item in plan.items:
                per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
            for name, items in per_file.items():
                try:
                    done = super().read_data(dataclasses.replace(plan, items=items), planner)
                except Exception as e:
                    self.failed = (name, e)
                    raise
            return done

    reader = Reader(str(checkpoint))
    try:
        with warnings.catch_warnings():     # one process, no process group, on purpose
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(state, storage_reader=reader, no_dist=True)
    except (Exception, CheckpointException) as e:      # DCP wraps any error (Ctrl-C too) in a BaseException
        if reader.failed is not None and not isinstance(reader.failed[1], OSError):
            name, cause = reader.failed
            raise DamagedCheckpoint(checkpoint, f"{name} is corrupt: its tensors cannot be decoded "
                                                f"({_cause(cause)})") from None
        wrapped = [exc for exc, _ in getattr(e, "failures", {}).values()]
        if wrapped:
            raise wrapped[0] from None      # an OSError or a KeyboardInterrupt, as its caller knows them
        raise


def _dcp_tensors(checkpoint: Path) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], Callable]:
    """A torch.distributed.checkpoint's model tensors: name -> (shape, dtype), and a reader of some."""
    meta = _dcp_metadata(checkpoint).state_dict_metadata
    stored = {key[len("model."):]: (tuple(m.size), m.properties.dtype) for key, m in meta.items()
              if key.startswith("model.") and hasattr(m, "size")}

    def read(entries: list[tuple[str, tuple[int, ...], torch.dtype]], track) -> dict[str, torch.Tensor]:
        into = {name: track(torch.empty(shape, dtype=dt)) for name, shape, dt in entries}
        _dcp_load(checkpoint, {"model": into})
        return into

    return stored, read


def _deepspeed_tensors(checkpoint: Path) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], Callable]:
    """A DeepSpeed ZeRO-3 checkpoint's (trainer.engine deepspeed) fp32 weights, through DeepSpeed's own
    zero_to_fp32 in its lazy mode: each tensor is put together from the ranks' partitions only when read."""
    from hpcrl.compute.train.checkpoint import DEEPSPEED_DIR
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    lazy = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=DEEPSPEED_DIR, lazy_mode=True)
    stored = {name: (tuple(t.shape), t.dtype) for name, t in lazy.items()}

    def read(entries: list[tuple[str, tuple[int, ...], torch.dtype]], track) -> dict[str, torch.Tensor]:
        return {name: track(lazy[name].contiguous()) for name, _, _ in entries}

    return stored, read


def _open_checkpoint(checkpoint: Path, specs: list[tuple[str, tuple[int, ...]]]
                     ) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], Callable]:
    """The checkpoint's tensors and their reader, once it is known to hold every one of ``specs``."""
    from hpcrl.compute.train.checkpoint import is_deepspeed

    stored, read = (_deepspeed_tensors if is_deepspeed(checkpoint) else _dcp_tensors)(checkpoint)
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


def export_checkpoint(checkpoint: str | os.PathLike, model_dir: str | os.PathLike, final: str | os.PathLike, *,
                      dtype: torch.dtype, tokenizer: Any, max_shard_bytes: int, bucket_bytes: int = 256 * 2**20,
                      trust_remote_code: bool = False, tracker: LiveBytes | None = None) -> Path:
    """A training checkpoint (``checkpoints/step-<N>``) -> a model directory ``final``, one process,
    never more than a bucket of tensors in memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    checkpoint, final = Path(checkpoint), Path(final)
    config = AutoConfig.from_pretrained(model_dir, trust_remote_code=trust_remote_code)
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
    shards = ShardWriter(tmp, layout.specs(specs), max_shard_bytes)
    try:
        for bucket in layout.buckets(_checkpoint_buckets(stored, read, wanted, bucket_bytes, cast, tracker)):
            for name, t in bucket:
                shards.write(name, t)
            t = None
        shards.finish()
        write_metadata(tmp, model_dir, dtype, tokenizer, trust_remote_code)
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
    stored = _dcp_metadata(checkpoint).state_dict_metadata
    missing = [name for name in into if f"model.{name}" not in stored]
    if missing:
        raise RuntimeError(f"{checkpoint}: the checkpoint lacks {len(missing)} of the recipe's LoRA adapters "
                           f"(model.lora_*: was it written with other settings?): {missing[:3]}")
    _dcp_load(checkpoint, {"model": into})
    made = _new_dirs(final)
    tmp = prepare_tmp(final)
    try:
        lora.write_adapter_dir(tmp, into, recipe_model=recipe_model, base_model=str(model_dir), tokenizer=tokenizer)
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

    p = argparse.ArgumentParser(prog="python -m hpcrl.compute.train.export")
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
        model_dir = resolve_model(recipe.model.path, args.run_dir, recipe.grpo.seed)
        tokenizer = load_tokenizer(recipe.model, model_dir)
        if recipe.model.use_peft:
            export_lora_checkpoint(rundir.training_checkpoint(ckpt_dir, step), model_dir, out,
                                   recipe_model=recipe.model, tokenizer=tokenizer)
            return 0
        export_checkpoint(rundir.training_checkpoint(ckpt_dir, step), model_dir, out,
                          dtype=saved_dtype(recipe, model_dir), tokenizer=tokenizer,
                          max_shard_bytes=int(recipe.checkpoint.model_max_shard_size_gb * GB),
                          bucket_bytes=recipe.inference.sync_bucket_mb * 2**20,
                          trust_remote_code=recipe.model.trust_remote_code)
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
