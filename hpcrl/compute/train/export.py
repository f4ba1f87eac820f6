"""The trained model as a Hugging Face directory: what it holds, how it is written and committed, and
writing it from the sharded trainers (the end of a run, grpo.save_steps). From a training checkpoint
after the fact (``hpcrl export``): hpcrl.compute.train.export_checkpoint, with the same writer.

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
- From a checkpoint (hpcrl.compute.train.export_checkpoint), the names and shapes come from the
  model built on the meta device, and the engine that wrote it reads a bucket's worth of tensors
  at a time into tensors allocated for them alone.

Atomic: everything is written under a hidden temporary name beside the target and renamed when
complete; a killed writer leaves only that hidden directory (removed by the next save). An earlier
directory of the same name is replaced only once the new one is whole. The final model directory
keeps the checkpoint-<step>/ directories saved inside it (TRL's output_dir layout).

A LoRA run (model.use_peft) writes peft adapter directories instead (save_lora_from_trainers,
export_lora_checkpoint; the merged model on request, checkpoint.save_merged_model).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from hpcrl.compute.sync.gather import LiveBytes, ParamSpec, hf_name, iter_buckets, param_specs, sync_named_params
from hpcrl.compute.sync.layout import CheckpointLayout
from hpcrl.job.atomic import fsync_dir
from hpcrl.job import rundir

__all__ = ["DTYPES", "SINGLE_FILE", "INDEX_FILE", "GB", "ModelWriting", "export_dtype", "saved_dtype", "export_tensors",
           "plan_shards", "ShardWriter", "prepare_tmp", "write_metadata", "commit", "save_from_trainers",
           "save_lora_from_trainers"]

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
@dataclasses.dataclass(frozen=True)
class ModelWriting:
    """How a model directory is written, whatever the weights come from."""

    model_dir: str | os.PathLike        # the source model: config, generation config, custom code
    tokenizer: Any                      # saved beside the weights, with its chat template
    dtype: torch.dtype                  # the weights' (saved_dtype)
    max_shard_bytes: int
    bucket_bytes: int = 256 * 2**20     # tensors gathered or read before they are written
    trust_remote_code: bool = False

    @classmethod
    def for_run(cls, recipe, model_dir: str | os.PathLike, tokenizer: Any) -> ModelWriting:
        """As the recipe asks: model.dtype, checkpoint.model_max_shard_size_gb, inference.sync_bucket_mb."""
        return cls(model_dir=model_dir, tokenizer=tokenizer, dtype=saved_dtype(recipe, model_dir),
                   max_shard_bytes=int(recipe.checkpoint.model_max_shard_size_gb * GB),
                   bucket_bytes=recipe.inference.sync_bucket_mb * 2**20,
                   trust_remote_code=recipe.model.trust_remote_code)


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


def save_from_trainers(model: torch.nn.Module, final: Path, how: ModelWriting, *, writer: bool, group=None,
                       tracker: LiveBytes | None = None, on_file: Callable[[Path], None] | None = None,
                       on_tensor: Callable[[str, torch.Tensor], None] | None = None) -> Path | None:
    """Write ``model`` (FSDP2-sharded, or whole) to ``final``; call it on EVERY trainer rank (the
    gathers and the closing agreement are collectives). ``writer``: trainer rank 0, the rank that
    writes (global rank 0 of ``group``); ``on_tensor`` sees each tensor it writes (base_diff).
    Returns ``final`` on the writer, None elsewhere; raises on every rank when the writer failed
    (the ranks keep gathering after a write error, so none hangs)."""
    tensors = export_tensors(model)
    layout = CheckpointLayout(model, tensors)
    dtype = how.dtype
    cast = dtype if any(t.dtype.is_floating_point and t.dtype != dtype for _, t in tensors) else None
    error: BaseException | None = None
    tmp = shards = None
    if writer:
        try:
            tmp = prepare_tmp(final)
            shards = ShardWriter(tmp, layout.specs(param_specs(tensors, cast)), how.max_shard_bytes, on_file)
        except Exception as e:       # noqa: BLE001 - reported to every rank below
            error = e
    if _takes_part(tensors, 0):
        for bucket in layout.buckets(iter_buckets(tensors, how.bucket_bytes, keep=writer, cast_to=cast,
                                                  tracker=tracker)):
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
            write_metadata(tmp, how.model_dir, dtype, how.tokenizer, how.trust_remote_code)
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


def save_lora_from_trainers(model: torch.nn.Module, final: Path, how: ModelWriting, *, recipe_model, writer: bool,
                            merged: bool, group=None) -> Path | None:
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
            lora.write_adapter_dir(tmp, adapters, recipe_model=recipe_model, base_model=str(how.model_dir),
                                   tokenizer=how.tokenizer, wrappers=lora.parameter_wrappers(model),
                                   injected=lora.injected_config(model))
        except Exception as e:       # noqa: BLE001 - reported to every rank below
            error = e
    if merged:
        # Raises on every rank when its writer failed (its own agreement).
        save_from_trainers(model, (tmp or final) / lora.MERGED_DIR, how, writer=writer and error is None, group=group)
    if writer and error is None:
        try:
            commit(tmp, final)
        except Exception as e:      # noqa: BLE001
            error = e
    _raise_if_any_failed(error, group, f"writing the LoRA adapters to {final}")
    return final if writer else None
