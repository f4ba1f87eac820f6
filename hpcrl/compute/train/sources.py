"""Where the model and the prompts come from: a local Hugging Face directory or dataset, or the
built-in demo (a tiny model made locally, the addition task), resolved the same on every task."""

from __future__ import annotations

from pathlib import Path

from hpcrl.job.recipe import DataConfig, ModelConfig

DEMO_PREFIX = "demo:"
RANDOM_SUFFIX = ":random"


def parse_demo_model(path: str) -> tuple[str, bool]:
    """``(size, warmed_up)`` of a "demo:<size>" (warmed up on the demo task, see hpcrl.compute.models.tiny)
    or "demo:<size>:random" (random weights) model path; "demo:" alone is "demo:tiny"."""
    spec = path[len(DEMO_PREFIX):]
    return spec.removesuffix(RANDOM_SUFFIX) or "tiny", not spec.endswith(RANDOM_SUFFIX)


def resolve_model(path: str, run_dir: str | Path, seed: int = 0) -> str:
    """A model directory for `path`; "demo:<size>[:random]" builds a tiny model once per run, warmed
    up on the demo task or random (the build is atomic and locked, so every task of a node may call
    this at once and all get the same directory)."""
    if path.startswith(DEMO_PREFIX):
        from hpcrl.compute.models.tiny import DEMO_WARMUP, make_tiny_model

        size, warm = parse_demo_model(path)
        out = Path(run_dir) / (f"model-{size}" if warm else f"model-{size}-random")
        return str(make_tiny_model(out, size=size, seed=seed, warmup=DEMO_WARMUP if warm else None))
    if not Path(path).is_dir():
        raise FileNotFoundError(f"model.path: {path} is not a directory (compute nodes load models from disk)")
    return path


def tokenizer_dir(model: ModelConfig, model_dir: str) -> str:
    """model.tokenizer, else the model's directory."""
    if model.tokenizer and not Path(model.tokenizer).is_dir():
        raise FileNotFoundError(f"model.tokenizer: {model.tokenizer} is not a directory "
                                f"(compute nodes load tokenizers from disk)")
    return model.tokenizer or model_dir


def load_tokenizer(model: ModelConfig, model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir(model, model_dir), trust_remote_code=model.trust_remote_code)


def load_dataset(data_cfg: DataConfig, seed: int = 0):
    from hpcrl.compute.train import data

    if data_cfg.path == "demo":
        return data.demo_dataset(n=2000, seed=seed)
    return data.load_prompts(data_cfg.path, data_cfg.split, data_cfg.prompt_column)
