"""Generation inside the trainer process, for tests of the training loop: every trainer rank owns an
engine copy (an hpcrl.compute.inference engine that takes weights as tensors: load_weights, set_version).
A job uses the node's server instead (hpcrl.compute.inference.client)."""

from __future__ import annotations

from typing import Sequence

from hpcrl.compute.inference.types import Generated, Sampling
from hpcrl.compute.sync.gather import iter_buckets, sync_named_params


class InProcessGenerator:
    def __init__(self, engine, bucket_bytes: int = 64 << 20):
        self.engine = engine
        self.bucket_bytes = bucket_bytes

    def submit(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> Generated:
        # The engine shares this process (and its cores): nothing to overlap, generate now.
        return Generated(self.engine.generate(prompts, sampling))

    def push_weights(self, model, version: int) -> dict:
        # Every rank gathers (a collective) and keeps what it gathered: each has its own engine.
        for bucket in iter_buckets(sync_named_params(model), self.bucket_bytes):
            self.engine.load_weights(bucket)
        self.engine.set_version(version)
        return {}
