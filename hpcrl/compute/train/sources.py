"""Where the model and the prompts come from: a local Hugging Face directory or dataset, a hub id
in the Hugging Face cache, or the built-in demo (a tiny model made locally, the addition task),
resolved the same on every task."""

from __future__ import annotations

import os
from pathlib import Path

from hpcrl.job import hfcache
from hpcrl.job.demo import AGENT, RANDOM, SUMS, is_demo, parse_demo_model
from hpcrl.job.recipe import DataConfig, ModelConfig


def resolve_model(path: str, run_dir: str | Path, seed: int = 0, revision: str = hfcache.MAIN) -> str:
    """A model directory for `path`; "demo:<size>[:random|:agent]" builds a tiny model once per run,
    warmed up on the demo task, random, or warmed up on calculator conversations with a tool (the
    build is atomic and locked, so every task of a node may call this at once and all get the same
    directory)."""
    if is_demo(path):
        from hpcrl.compute.models.tiny import DEMO_WARMUP, make_tiny_model
        from hpcrl.compute.models.tiny_agent import AGENT_WARMUP

        size, variant = parse_demo_model(path)
        warmups = {SUMS: DEMO_WARMUP, RANDOM: None, AGENT: AGENT_WARMUP}
        if variant not in warmups:
            raise ValueError(f"model.path: {path}: unknown demo model {variant!r}; "
                             f"choose demo:<size>, demo:<size>:{RANDOM} or demo:<size>:{AGENT}")
        out = Path(run_dir) / "-".join(filter(None, ("model", size, variant)))
        return str(make_tiny_model(out, size=size, seed=seed, warmup=warmups[variant]))
    return local_or_cached(path, "model.path", revision)


def job_model_dir(spec, run_dir: str | Path) -> str:
    """The model this task loads: its node's staged copy (site.stage.model_dest), else model.path
    resolved by :func:`resolve_model`."""
    staged = spec.node_model_dir()
    if staged is None:
        return resolve_model(spec.recipe.model.path, run_dir, spec.recipe.grpo.seed, spec.recipe.model.revision)
    if not Path(staged, "config.json").is_file():
        raise FileNotFoundError(f"site.stage.model_dest: {staged} holds no staged model on this node")
    return staged


def local_or_cached(path: str, where: str, revision: str = hfcache.MAIN) -> str:
    """A local directory as it is; a hub id as its snapshot at `revision` in the Hugging Face cache
    (compute nodes run offline: never downloaded here)."""
    if Path(path).is_dir():
        return path
    if hfcache.is_hub_id(path):
        hub_cache, _ = hfcache.hub_cache_dirs(os.environ)
        snapshot = hfcache.cached_snapshot(path, "model", hub_cache, revision)
        if snapshot is not None:
            return str(snapshot)
        at = "" if revision == hfcache.MAIN else f" at revision {revision} (model.revision)"
        raise FileNotFoundError(f"{where}: {path}{at} is neither a local directory nor a model in the Hugging Face "
                                f"cache ({hub_cache}); {hfcache.download_hint(path, revision=revision)}")
    raise FileNotFoundError(f"{where}: {path} is not a directory (compute nodes load models from disk)")


def tokenizer_dir(model: ModelConfig, model_dir: str) -> str:
    """model.tokenizer, else the model's directory."""
    return local_or_cached(model.tokenizer, "model.tokenizer") if model.tokenizer else model_dir


def load_tokenizer(model: ModelConfig, model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir(model, model_dir), trust_remote_code=model.trust_remote_code)


def load_eval_dataset(data_cfg: DataConfig, seed: int = 0):
    """data.eval_split of the same data (grpo.eval_strategy); the demo task's is 64 sums drawn apart
    from its training prompts' seed."""
    from hpcrl.compute.train import data

    if data_cfg.path == "demo" and not data_cfg.data_files and not data_cfg.datasets:
        return data.demo_dataset(n=64, seed=seed + 1)
    return load_dataset(data_cfg, seed, split=data_cfg.eval_split, split_field="data.eval_split")


def load_dataset(data_cfg: DataConfig, seed: int = 0, split: str | None = None, split_field: str = "data.split"):
    """The recipe's prompts: data.split's, or `split`'s (named `split_field` in errors, e.g.
    data.eval_split), from any form data.path or data.data_files take (data.load_prompts), or a
    mixture, data.datasets (data.mixture_prompts)."""
    from hpcrl.compute.train import data

    if data_cfg.datasets:
        return data.mixture_prompts(data_cfg.datasets, split or data_cfg.split, data_cfg.prompt_column,
                                    test_split_size=data_cfg.test_split_size, seed=seed,
                                    split_field=split_field if split else "data.split")
    if data_cfg.path == "demo" and not data_cfg.data_files:
        return data.demo_dataset(n=2000, seed=seed)
    return data.load_prompts(data_cfg.path, split or data_cfg.split, data_cfg.prompt_column, config=data_cfg.config,
                             data_files=data_cfg.data_files, split_field=split_field if split else "data.split")
