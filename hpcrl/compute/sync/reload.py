"""What a vLLM worker needs around vLLM's layerwise reload, whatever brought the weights: an abort
that leaves no layer on the meta device, the re-pack of a tied lm_head that the reload leaves
stale on CPU, and the re-pack of mixture-of-experts weights that the reload leaves unpacked on CPU. Used by hpcrl_shm's worker engine (shm_vllm.py) and by the worker extension
(vllm_plugin.py) for every backend and for the checkpoint route.

Imports torch; vLLM only inside the functions (they run inside vLLM's workers).
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any

import torch

__all__ = ["PARTIAL_SYNCS_ENV", "abort_layerwise_reload", "refresh_tied_weights", "drop_expected_reload_warnings",
           "repack_moe_on_reload"]

_LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


@contextlib.contextmanager
def _quiet_layerwise():
    # An abort leaves most layers unloaded on purpose; vLLM would warn once per layer.
    log = logging.getLogger(_LAYERWISE_LOGGER)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


# Set (to "1") in the server's environment when the trainers send only the layers that change after
# the first sync (LoRA): every other layer then gets no weights in a sync, as intended.
PARTIAL_SYNCS_ENV = "HPCRL_PARTIAL_SYNCS"


class _ExpectedReloadWarnings(logging.Filter):
    """Drops layerwise reload's "Failed to load weights" for layers that never get checkpoint
    weights: rotary embeddings (computed caches) and a tied lm_head (it is the embedding); with
    partial syncs, for every layer (those left out keep their weights, which is the point)."""

    def __init__(self, tied: bool, partial: bool = False) -> None:
        super().__init__()
        self.layers = ("RotaryEmbedding", "ParallelLMHead") if tied else ("RotaryEmbedding",)
        self.partial = partial

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (msg.endswith("Failed to load weights") and (self.partial or msg.split(":")[0] in self.layers))


def drop_expected_reload_warnings(tied: bool) -> None:
    """Silence layerwise reload's warnings about layers that never get weights in a sync
    (``tied``: the model ties its lm_head to the embedding; PARTIAL_SYNCS_ENV: syncs after the
    first carry only the layers that train)."""
    partial = os.environ.get(PARTIAL_SYNCS_ENV) == "1"
    logging.getLogger(_LAYERWISE_LOGGER).addFilter(_ExpectedReloadWarnings(tied, partial))


def abort_layerwise_reload(model: torch.nn.Module, model_config: Any) -> None:
    """End an interrupted layerwise reload so that no layer is left on the meta device.

    Layers that were completely loaded keep their new weights; every layer still waiting for
    weights gets its previous (kernel) tensors back, through vLLM's own finalize path with the
    buffered partial loads dropped. The result is a servable but MIXED model: the caller must not
    serve it until a full sync has finished (``WeightReceiver`` refuses to).
    """
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    for module in model.modules():
        info = LAYERWISE_INFO.get(module)
        if info is not None and info.can_load():
            info.loaded_weights.clear()
            info.load_numel = 0
    with _quiet_layerwise():
        finalize_layerwise_reload(model, model_config)
    refresh_tied_weights(model)


def refresh_tied_weights(model: torch.nn.Module) -> int:
    """Re-run weight processing for modules that share a parameter with another module.

    Layerwise reload processes a shared (tied) parameter only through the module that loaded it
    (vLLM's reload/__init__.py, Limitation 2). On CPU that is a correctness bug: with tied
    embeddings the lm_head keeps its own packed GEMM copy of the embedding matrix, built by
    ``UnquantizedEmbeddingMethod.process_weights_after_loading``; after a reload the embedding is
    new but the logits still use the old copy. Re-packing it is idempotent (it reads
    ``weight``, which the reload updated) and costs one vocab x hidden repack. Only that method is
    re-run: others (quantization) may not be safe to process twice. Returns how many modules.
    """
    owners: dict[int, list[torch.nn.Module]] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(module)
    refreshed = 0
    for modules in owners.values():
        if len(modules) < 2:
            continue
        for module in modules:
            method = getattr(module, "quant_method", None)
            if type(method).__name__ == "UnquantizedEmbeddingMethod":
                method.process_weights_after_loading(module)
                refreshed += 1
    return refreshed


def repack_moe_on_reload(model: torch.nn.Module) -> int:
    """Make every reload of a mixture-of-experts layer end as its first load does, on CPU.

    vLLM 0.32's ``UnquantizedFusedMoEMethod.process_weights_after_loading`` runs the experts'
    own post-processing (``fused_experts.process_weights_after_loading``) only on the first load
    (unquantized_fused_moe_method.py, ``_setup_kernel``: "the kernel does not need to be
    re-built"). On CPU that post-processing is the prepack of w13/w2 into the grouped-GEMM layout
    (``CPUUnquantizedExperts``): after a layerwise reload the layer's weights are copied back into
    the packed storage UNPACKED, and the engine serves garbage (a reload of the very same weights
    moved the log-probs of a tiny Qwen3-MoE by 0.57). Wraps each such layer's method so that a
    reload prepacks the fresh weights before layerwise reload copies them into place. Idempotent;
    returns how many layers it wrapped. Only the CPU experts: GPU kernels have not been checked.
    """
    wrapped = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        kernel = getattr(method, "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if (type(method).__name__ != "UnquantizedFusedMoEMethod" or experts is None
                or type(experts).__name__ != "CPUUnquantizedExperts"
                or getattr(method.process_weights_after_loading, "_hpcrl_repacks", False)):
            continue
        original = method.process_weights_after_loading

        def process(layer, _original=original, _method=method):
            reloading = _method.moe_kernel is not None      # set by the first load
            _original(layer)
            if reloading:
                _method.moe_kernel.fused_experts.process_weights_after_loading(layer)

        process._hpcrl_repacks = True
        method.process_weights_after_loading = process
        wrapped += 1
    return wrapped
