"""The baseline weight sync: write safetensors, have the engine reload them from the path.

This is the route hpcrl does NOT use for its trainer -> server hand-off, which never touches a
file system: trainer and server share the node's memory, and a file adds a write and a read of
every byte. It lives beside the benchmark (scripts/bench_sync.py), which measures the in-memory
route against this obvious alternative on the same machine and the same buckets, because on CPU
the obvious alternative is hard to beat: on the 2-core development VM, moving 524 MB between two
processes ran at 13 GB/s for a memcpy, 4.0 GB/s through a persistent shared-memory buffer,
2.2 GB/s for gloo per-tensor broadcasts and 3.1 GB/s through a safetensors file in the page cache,
so a naive in-memory transport can lose to the file. Files go to a local directory (the page cache;
on the development machines /tmp measured faster than /dev/shm for this), one file per bucket so
the writer's memory stays bounded by a bucket, and the engine reloads them in place through vLLM's
own ``reload_weights(weights_path=..., is_checkpoint_format=True)`` (layerwise reload, as the
in-memory route's apply).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path

import torch

__all__ = ["save_checkpoint", "reload_checkpoint"]

SHARD_GLOB = "hpcrl-bucket-*.safetensors"


def save_checkpoint(buckets: Iterable[list[tuple[str, torch.Tensor]]], out_dir: str | Path) -> tuple[Path, int]:
    """Write each bucket as one safetensors file in ``out_dir`` (old shards removed first).
    Returns the directory and the bytes written."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob(SHARD_GLOB):
        old.unlink()
    nbytes = 0
    for i, bucket in enumerate(buckets):
        tensors = {name: t.contiguous() for name, t in bucket}
        nbytes += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(out / f"hpcrl-bucket-{i:05d}.safetensors"))
    return out, nbytes


def reload_checkpoint(llm, path: str | Path, version: str | None = None, receiver=None) -> float:
    """Reload the engine's weights from ``path`` in place; reset the prefix cache. Returns seconds.

    Needs the engine built with ``hpcrl.compute.inference.vllm_engine.weight_transfer_kwargs`` (the
    worker extension). With a ``WeightReceiver``, the sync is bracketed like an in-memory one:
    unservable until the reload succeeded, then its version recorded.
    """
    t = time.perf_counter()
    if receiver is not None:
        receiver.state, receiver.open_version = "open", version
    try:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path), "is_checkpoint_format": True})
        # vLLM's reload leaves a tied lm_head's packed copy stale on CPU (see reload.refresh_tied_weights).
        llm.collective_rpc("hpcrl_refresh_tied_weights")
    except BaseException as exc:
        if receiver is not None:
            receiver.state, receiver.last_error = "failed", f"checkpoint reload failed: {exc!r}"
        raise
    if llm.reset_prefix_cache() is False:
        llm.reset_prefix_cache(reset_running_requests=True)
    if version is not None:
        llm.update_weight_version(str(version))
    if receiver is not None:
        receiver.state, receiver.version, receiver.open_version = "serving", version, None
    return time.perf_counter() - t
