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
    """Compares tensors, by name, against the safetensors files of ``base_dir``."""

    def __init__(self, base_dir: str | os.PathLike):
        from safetensors import safe_open

        self._files = ExitStack()
        self._where: dict[str, object] = {}
        for path in sorted(Path(base_dir).glob("*.safetensors")):
            f = self._files.enter_context(safe_open(str(path), framework="pt"))
            self._where.update(dict.fromkeys(f.keys(), f))
        self.result = Comparison()

    def add(self, name: str, tensor: torch.Tensor) -> None:
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
