"""What many tests build the same way: a trainer's parts on the CPU and generators that stand in for
the node's server (hpcrl.compute.inference.client) in tests of the training loop. The tiny model
directory every such test reads is conftest.py's ``model_dir`` fixture."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Sequence

import torch

from hpcrl.compute.inference.types import Completion, Generated, Sampling
from hpcrl.compute.sync.gather import iter_buckets, sync_named_params


def cpu_trainer_setup(recipe, run_dir, model_dir: str, policy, reference, *, rank: int, world: int, **fields):
    """hpcrl.compute.train.trainer.TrainerSetup on the CPU as the tests' trainers take it: the recipe's
    tokenizer and dataset, a silent log, a 60 s collective timeout; ``fields`` override any of it."""
    from hpcrl.compute.train.sources import load_dataset, load_tokenizer
    from hpcrl.compute.train.trainer import TrainerSetup

    parts = dict(recipe=recipe, run_dir=Path(run_dir), device=torch.device("cpu"), policy=policy, reference=reference,
                 tokenizer=load_tokenizer(recipe.model, model_dir), dataset=None, trainer_rank=rank,
                 num_trainers=world, log=lambda line: None, collective_timeout_s=60)
    parts.update(fields)
    if parts["dataset"] is None:
        parts["dataset"] = load_dataset(recipe.data, recipe.grpo.seed)
    return TrainerSetup(**parts)


class FixedGenerator:
    """A generator without an engine: fixed completions with sampling log-probabilities; it records
    what it was asked."""

    def __init__(self, vocab: int):
        self.vocab, self.asked, self.version = vocab, [], 0

    def submit(self, prompts, sampling):
        self.asked.append((prompts, sampling))
        out = [Completion(i, tuple((7 * i + 3 * j + k) % self.vocab for k in range(sampling.max_tokens)),
                          tuple(-1.0 - 0.1 * k for k in range(sampling.max_tokens)),
                          "7" if j % 2 else "no", True, self.version)
               for i in range(len(prompts)) for j in range(sampling.n)]
        return SimpleNamespace(result=lambda: out)

    def push_weights(self, model, version):
        self.version = version          # what the next completions are sampled with
        return {}


class InProcessGenerator:
    """Generation inside the trainer process: every trainer rank owns an engine copy (an
    hpcrl.compute.inference engine that takes weights as tensors: load_weights, set_version)."""

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
