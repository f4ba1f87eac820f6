"""A torch.distributed.checkpoint read in one process, without a process group: its index, its
model tensors a few at a time (how FSDP2's engine hands its checkpoints to ``hpcrl export``), and
a damaged file named (``DamagedCheckpoint``) before anything is written from it.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["DamagedCheckpoint", "dcp_metadata", "dcp_load", "dcp_tensors"]


class DamagedCheckpoint(RuntimeError):
    """A training checkpoint whose files are missing or cannot be read: ``what`` names the file."""

    def __init__(self, checkpoint: Path, what: str) -> None:
        super().__init__(f"{checkpoint}: {what}")
        self.checkpoint, self.what = Path(checkpoint), what


def _cause(e: BaseException) -> str:
    """The error's type and first sentence (torch's unpickler goes on with advice that does not apply)."""
    text = str(e).strip().split("\n")[0].split(". ")[0][:80]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def dcp_metadata(checkpoint: Path):
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


def dcp_load(checkpoint: Path, state: dict[str, Any]) -> None:
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


def dcp_tensors(checkpoint: Path) -> tuple[dict[str, tuple[tuple[int, ...], torch.dtype]], Callable]:
    """A torch.distributed.checkpoint's model tensors: name -> (shape, dtype), and a reader of some
    (hpcrl.compute.train.engine.StoredTensors: how FSDP2's engine reads its checkpoints)."""
    meta = dcp_metadata(checkpoint).state_dict_metadata
    stored = {key[len("model."):]: (tuple(m.size), m.properties.dtype) for key, m in meta.items()
              if key.startswith("model.") and hasattr(m, "size")}

    def read(entries: list[tuple[str, tuple[int, ...], torch.dtype]], track) -> dict[str, torch.Tensor]:
        into = {name: track(torch.empty(shape, dtype=dt)) for name, shape, dt in entries}
        dcp_load(checkpoint, {"model": into})
        return into

    return stored, read
