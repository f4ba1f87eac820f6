"""A model's in-memory tensor names -> its checkpoint names, a bucket at a time.

transformers 5 keeps some weights in memory in another layout than its checkpoints: a
mixture-of-experts layer holds its experts fused (``mlp.experts.gate_up_proj`` [E, 2I, H],
``mlp.experts.down_proj`` [E, H, I]) where the checkpoint, and vLLM's ``load_weights``, have one
tensor per expert and projection (``mlp.experts.{e}.gate_proj.weight``, Mixtral's
``block_sparse_moe.experts.{e}.w1.weight``). Everything that leaves the trainer for vLLM or for a
Hugging Face directory goes through :class:`CheckpointLayout` (the transformers engine loads
in-memory names and is fed without it).

The conversion is transformers' own, ``core_model_loading.revert_weight_conversion`` (what
``save_pretrained`` applies), with the model's conversion list found once (the function would walk
the model's modules at every call): ``model._weight_conversions`` when ``from_pretrained`` built
it, else ``conversion_mapping.get_model_conversion_mapping`` without PrefixChange, as
transformers does for a model built from its config (hpcrl builds on the meta device).

Buckets: each bucket is converted alone, so a reverse conversion that needs several in-memory
tensors together could be split by a bucket boundary. None does for the models with expert fusion
(Qwen2/3-MoE and their kind, Mixtral): each fused tensor becomes per-expert tensors by itself.
The constructor checks this cheaply on meta tensors (each tensor converted alone must give what
the whole model converted at once gives) and refuses a model where it does not hold, naming the
tensors, rather than send torn weights.

A model without conversions (every dense model) is the identity: buckets pass through untouched,
the same list objects, at no cost.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["CheckpointLayout", "model_conversions"]

Bucket = list[tuple[str, torch.Tensor]]


def model_conversions(model: torch.nn.Module) -> list | None:
    """transformers' weight conversions of ``model`` (None: its checkpoint layout is its memory's)."""
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is not None:
        return conversions or None
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:     # an older transformers: no in-memory layout of its own
        return None
    if not any(isinstance(m, PreTrainedModel) for m in model.modules()):
        return None
    conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)]
    return conversions or None


class _Reverting:
    """The model as ``revert_weight_conversion`` sees it: its conversion list found once."""

    def __init__(self, model: torch.nn.Module, conversions: list) -> None:
        self._model = model
        self._weight_conversions = conversions

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)


class CheckpointLayout:
    """Turns ``(in-memory name, tensor)`` buckets into checkpoint ones.

    ``named``: every ``(name, tensor)`` that may be converted (a parameter, a DTensor, a
    ``gather.MergedWeight``...: only ``shape`` and ``dtype`` are read), in send order. What each
    name becomes is worked out here on the meta device, once.
    """

    def __init__(self, model: torch.nn.Module, named: Iterable[tuple[str, Any]]) -> None:
        conversions = model_conversions(model)
        self.identity = conversions is None
        self._outputs: dict[str, list[tuple[str, tuple[int, ...]]]] = {}
        if self.identity:
            return
        from transformers.core_model_loading import revert_weight_conversion

        self._revert = revert_weight_conversion
        self._model = _Reverting(model, conversions)
        meta = {name: torch.empty(tuple(t.shape), dtype=t.dtype, device="meta") for name, t in named}
        for name, t in meta.items():
            self._outputs[name] = [(n, tuple(o.shape)) for n, o in self._revert(self._model, {name: t}).items()]
        whole = {n: tuple(o.shape) for n, o in self._revert(self._model, meta).items()}
        alone = {n: s for outs in self._outputs.values() for n, s in outs}
        if alone != whole:
            torn = sorted(set(alone.items()) ^ set(whole.items()))[:4]
            raise NotImplementedError(
                f"{type(model).__name__}: transformers' conversion to the checkpoint layout needs several "
                f"in-memory tensors together ({', '.join(n for n, _ in torn)}), which a weight-sync or export "
                f"bucket could split; hpcrl cannot send this model yet")
        if all(outs == [(name, tuple(meta[name].shape))] for name, outs in self._outputs.items()):
            self.identity = True     # conversions that touch none of these tensors

    def names(self, name: str) -> list[tuple[str, tuple[int, ...]]]:
        """The checkpoint names and shapes ``name`` becomes."""
        return self._outputs[name] if not self.identity else []

    def convert(self, bucket: Bucket) -> Bucket:
        """One bucket in the checkpoint layout, its tensors in the bucket's order (each in-memory
        tensor's checkpoint tensors where it stood). Views of the gathered tensors: no copy."""
        if self.identity or not bucket:
            return bucket
        converted = self._revert(self._model, dict(bucket))
        return [(n, converted.pop(n)) for name, _ in bucket for n, _ in self._outputs[name]]

    def buckets(self, buckets: Iterable[Bucket]) -> Iterable[Bucket]:
        """``convert`` over a stream of buckets (the stream itself for the identity)."""
        if self.identity:
            return buckets
        return self._converted(buckets)

    def _converted(self, buckets: Iterable[Bucket]) -> Iterator[Bucket]:
        for bucket in buckets:
            out = self.convert(bucket)
            yield out
            out.clear()     # the consumer is done with it: drop the views, as iter_buckets does

    def specs(self, specs: list) -> list:
        """``gather.ParamSpec``s in the checkpoint layout, in the order ``convert`` gives."""
        if self.identity:
            return specs
        from hpcrl.compute.sync.gather import ParamSpec

        return [ParamSpec(n, s.dtype, shape) for s in specs for n, shape in self._outputs[s.name]]
