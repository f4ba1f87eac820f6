"""Whether the model a run writes differs from the model it started from: the last word on "did
this run learn anything", since an update below the exported dtype's resolution (1e-6 steps on
bfloat16 weights) leaves every tensor as it was while the gradients and the learning rate say the
policy moved.

The writer compares each tensor as it streams it to the file with the base checkpoint's tensor of
the same name, read lazily (safetensors, memory-mapped): the base is read once, a tensor at a time,
and nothing more is held.
"""

from __future__ import annotations

import json
import os
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

__all__ = ["BaseDiff", "Comparison"]


@dataclass
class Comparison:
    compared: int = 0           # tensors found in the base under the same name and shape
    changed: int = 0            # of those, not equal in the exported dtype
    max_abs_diff: float = 0.0
    dtype: str = ""             # the exported dtype

    def save(self, path: str | os.PathLike) -> None:
        Path(path).write_text(json.dumps(asdict(self)) + "\n")


class BaseDiff:
    """Compares tensors, by name, against the safetensors files of ``base_dir``.

    A check, not part of the export: a base it cannot read (a .bin checkpoint, a file damaged or
    gone) ends the comparison quietly with nothing compared, so that the export, whose writer calls
    :meth:`add` between collectives, neither fails nor stalls its peers because of it."""

    def __init__(self, base_dir: str | os.PathLike):
        self._files = ExitStack()
        self._where: dict[str, object] = {}
        self.result = Comparison()
        self._failed = False
        try:
            from safetensors import safe_open

            for path in sorted(Path(base_dir).glob("*.safetensors")):
                f = self._files.enter_context(safe_open(str(path), framework="pt"))
                self._where.update(dict.fromkeys(f.keys(), f))
        except Exception:       # noqa: BLE001 - safetensors' own error types included: see the class
            self._give_up()

    def _give_up(self) -> None:
        self._failed, self._where, self.result = True, {}, Comparison()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._failed:
            return
        try:
            self._compare(name, tensor)
        except Exception:       # noqa: BLE001 - see the class
            self._give_up()

    def _compare(self, name: str, tensor: torch.Tensor) -> None:
        f = self._where.get(name)
        if f is None or not tensor.is_floating_point():
            return
        base = f.get_tensor(name)
        if tuple(base.shape) != tuple(tensor.shape):
            return
        self.result.dtype = str(tensor.dtype).removeprefix("torch.")
        self.result.compared += 1
        new = tensor.detach().to("cpu")
        if not torch.equal(base.to(new.dtype), new):
            self.result.changed += 1
            diff = (base.float() - new.float()).abs().max().item()
            self.result.max_abs_diff = max(self.result.max_abs_diff, diff)

    def close(self) -> Comparison:
        self._files.close()
        return self.result
