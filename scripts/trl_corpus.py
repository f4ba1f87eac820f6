"""A corpus of small TRL projects, each a directory as a `trl grpo --config` user has it, run through
hpcrl as it is (issue #25's "first contact").

    .venv/bin/python scripts/trl_corpus.py make  DIR                 # write every project into DIR
    .venv/bin/python scripts/trl_corpus.py check DIR [NAME ...]      # make what is missing, check, print a table
    .venv/bin/python scripts/trl_corpus.py list                      # the projects and what each covers

A project is what a user would have beside `trl grpo --config cfg.yaml`: a tiny Hugging Face model
made here (random weights, the demo's tokenizer and ChatML template, one of eleven architectures),
its data in one of the forms TRL loads, a reward module beside the recipe and the recipe in TRL's
keys. Nothing is downloaded. Each project is checked five ways:

- trl:    TRL's own parser (trl.scripts.grpo.make_parser, what `trl grpo` parses with) takes the YAML;
          hpcrl's own sections (`inference:`, ...), which `trl grpo` would hand to accelerate, are
          set aside first and named.
- plan:   `hpcrl plan --site frontier cfg.yaml` exits 0 and gives a memory estimate.
- render: `hpcrl render --site frontier -A PRJ123 cfg.yaml` exits 0.
- run:    `hpcrl run cfg.yaml max_steps=2` (the one override, a TRL key) exits 0.
- export: the exported model (TRL's output_dir, else <run_dir>/model) loads with transformers'
          AutoModelForCausalLM (peft's AutoPeftModelForCausalLM for adapters), keeps the base's chat
          template, and differs from the base in at least one tensor.

The last line of `check` is `corpus: N passed, M failed`; its exit status is 1 when any failed.
tests/e2e/test_trl_corpus.py runs the fast checks of every project and `run` of three.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 2, 2, 1, 32, 128
# hpcrl's own sections of a recipe; `trl grpo` does not know them (the trl check sets them aside).
HPCRL_SECTIONS = ("inference", "trainer", "resources", "site", "logging", "checkpoint", "launch", "mode", "model",
                  "data", "rewards", "grpo", "name")
RUN_TIMEOUT_S = 900


# ------------------------------------------------------------------------------------ models
def _config(arch: str, tokenizer, max_positions: int, dtype: str):
    """A tiny transformers config of ``arch`` with the demo tokenizer's vocabulary and ids."""
    import transformers as tf

    ids = dict(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
               eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    common = dict(hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                  num_key_value_heads=KV_HEADS, intermediate_size=FFN, max_position_embeddings=max_positions,
                  dtype=dtype, **ids)
    if arch == "llama":
        return tf.LlamaConfig(**common, head_dim=HEAD_DIM)
    if arch == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=True)
    if arch == "qwen3":
        return tf.Qwen3Config(**common, head_dim=HEAD_DIM, tie_word_embeddings=True)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(**common, head_dim=HEAD_DIM, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[])
    if arch == "mixtral":
        return tf.MixtralConfig(**{**common, "intermediate_size": 32}, head_dim=HEAD_DIM, num_local_experts=4,
                                num_experts_per_tok=2)
    if arch == "mistral":
        return tf.MistralConfig(**common, head_dim=HEAD_DIM, sliding_window=None)
    if arch == "gemma2":
        return tf.Gemma2Config(**common, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, sliding_window=64)
    if arch == "gemma3_text":
        return tf.Gemma3TextConfig(**common, head_dim=HEAD_DIM, query_pre_attn_scalar=HEAD_DIM, sliding_window=64)
    if arch == "phi3":
        return tf.Phi3Config(**common, original_max_position_embeddings=max_positions)
    if arch == "olmo2":
        return tf.Olmo2Config(**common)
    if arch == "gpt_neox":
        common.pop("num_key_value_heads")
        return tf.GPTNeoXConfig(**common, rotary_pct=0.5, use_parallel_residual=True)
    raise ValueError(f"unknown architecture {arch!r}")


ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral", "mistral", "gemma2", "gemma3_text", "phi3", "olmo2",
         "gpt_neox")


def make_model(out: Path, arch: str, max_positions: int = 2048, dtype: str = "float32", seed: int = 0) -> Path:
    """A random tiny ``arch`` model with hpcrl's demo tokenizer (ChatML template), as save_pretrained
    writes it; the tokenizer's model_max_length is the model's context, as a release sets it."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from hpcrl.compute.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.model_max_length = max_positions
    config = _config(arch, tokenizer, max_positions, dtype)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to(getattr(torch, dtype))
    model.generation_config = GenerationConfig(eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id],
                                               pad_token_id=tokenizer.pad_token_id, do_sample=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def make_reward_model(out: Path, seed: int = 3) -> Path:
    """A one-logit sequence classifier on the demo tokenizer (as tests/support.py's make_reward_model)."""
    import torch
    from transformers import AutoModelForSequenceClassification, Qwen2Config

    from hpcrl.compute.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# ------------------------------------------------------------------------------------ data
SYSTEM = "You are a helpful assistant. Answer with the number only."


def rows(n: int, offset: int = 0, conversational: bool = False, extra: bool = False, missing: bool = False):
    """Sums as prompts, the answer in a column of its own (what a reward reads). ``missing``: every
    fourth row has no answer ("" : CSV has no null), the rows a reward returns None for."""
    out = []
    for i in range(offset, offset + n):
        a, b = i % 10, (i * 7) % 10
        prompt = f"{a}+{b}="
        if conversational:
            prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {a}+{b}?"}]
        row = {"prompt": prompt, "answer": "" if missing and i % 4 == 3 else str(a + b)}
        if extra:
            row.update(difficulty=1 + (a + b) // 10, max_chars=2 + i % 3)
        out.append(row)
    return out


def _write_jsonl(path: Path, items) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in items))


def write_data(root: Path, form: str, **kw) -> dict:
    """The project's data in ``form``; returns the TRL keys that name it."""
    import datasets

    train, test = rows(32, **kw), rows(8, offset=100, **kw)
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    if form == "jsonl":
        _write_jsonl(data / "train.jsonl", train)
        return {"dataset_name": "data/train.jsonl"}
    if form == "json":
        (data / "train.json").write_text(json.dumps(train, indent=1))
        return {"dataset_name": "data/train.json"}
    if form == "csv":
        datasets.Dataset.from_list(train).to_csv(str(data / "train.csv"), index=False)
        return {"dataset_name": "data/train.csv"}
    if form == "parquet":
        datasets.Dataset.from_list(train).to_parquet(str(data / "train.parquet"))
        return {"dataset_name": "data/train.parquet"}
    if form == "save_to_disk":
        datasets.DatasetDict({"train": datasets.Dataset.from_list(train),
                              "test": datasets.Dataset.from_list(test)}).save_to_disk(str(data / "sums"))
        return {"dataset_name": "data/sums"}
    if form == "directory":
        _write_jsonl(data / "sums" / "train.jsonl", train)
        _write_jsonl(data / "sums" / "test.jsonl", test)
        return {"dataset_name": "data/sums"}
    if form == "mixture":
        _write_jsonl(data / "a.jsonl", train[:16])
        datasets.Dataset.from_list(train[16:] + test).to_parquet(str(data / "b.parquet"))
        return {"datasets": [{"path": "json", "data_files": "data/a.jsonl", "columns": ["prompt", "answer"],
                              "fraction": 1.0},
                             {"path": "parquet", "data_files": "data/b.parquet", "columns": ["prompt", "answer"],
                              "fraction": 0.75}],
                "test_split_size": 0.2}
    raise ValueError(f"unknown data form {form!r}")


# A reward module beside the recipe, as users write them (TRL's signature; plain and conversational).
REWARDS_PY = '''\
"""Rewards of this project (TRL's reward-function signature)."""
import asyncio


def _text(completion):
    return completion[-1]["content"] if isinstance(completion, list) else completion


def correct(prompts, completions, answer, **kwargs):
    """1 when the completion starts with the answer."""
    return [1.0 if _text(c).strip().startswith(str(a)) else 0.0 for c, a in zip(completions, answer)]


def correct_or_none(prompts, completions, answer, **kwargs):
    """As correct, but None (not scored) for rows without an answer."""
    return [None if a in (None, "") else float(_text(c).strip().startswith(str(a)))
            for c, a in zip(completions, answer)]


def short(completions, **kwargs):
    """Shorter is better (a reward every completion gets a different value from)."""
    return [-len(_text(c)) / 32.0 for c in completions]


def within_budget(completions, max_chars, difficulty, **kwargs):
    """Reads two extra columns of the dataset: closer to the budget is better, harder counts more."""
    return [d / (1 + abs(len(_text(c).strip()) - m)) for c, m, d in zip(completions, max_chars, difficulty)]


async def digits(completions, **kwargs):
    """An async reward, as TRL awaits them."""
    await asyncio.sleep(0)
    return [sum(ch.isdigit() for ch in _text(c)) / max(1, len(_text(c))) for c in completions]
'''


# ------------------------------------------------------------------------------------ projects
BASE = {
    "model_name_or_path": "model",
    "per_device_train_batch_size": 4,
    "num_generations": 4,
    "max_completion_length": 12,
    "learning_rate": 1.0e-4,
    "logging_steps": 1,
    "report_to": "none",
    "save_strategy": "no",
    "bf16": False,
    "seed": 0,
}


@dataclass
class Project:
    name: str
    arch: str
    data: str                       # write_data's form
    keys: dict                      # the recipe's keys beside BASE
    max_positions: int = 2048
    dtype: str = "float32"          # of the saved model
    conversational: bool = False
    extra: bool = False             # extra columns the reward reads
    missing: bool = False           # rows a reward returns None for
    reward_model: bool = False
    smoke: bool = False             # tests/e2e/test_trl_corpus.py runs it end to end
    notes: list[str] = field(default_factory=list)

    @property
    def lora(self) -> bool:
        return bool(self.keys.get("use_peft"))

    def settings(self) -> str:
        k = self.keys
        out = [k.get("loss_type", "dapo"), f"beta={k.get('beta', 0.0)}"]
        if "scale_rewards" in k:
            out.append(f"scale={k['scale_rewards']}")
        if "lr_scheduler_type" in k:
            out.append(k["lr_scheduler_type"])
        for flag, label in (("use_peft", "lora"), ("gradient_checkpointing", "ckpt"), ("bf16", "bf16")):
            if k.get(flag):
                out.append(label)
        if k.get("eval_strategy", "no") != "no":
            out.append("eval")
        if self.reward_model:
            out.append("rm")
        if "inference" in k:
            out.append(f"engine={k['inference'].get('engine')}")
        out.append(f"ctx={self.max_positions}")
        return " ".join(out)


PROJECTS = [
    Project("llama-jsonl", "llama", "jsonl", max_positions=512, keys={
        "reward_funcs": ["my_rewards.correct", "my_rewards.short", "get_soft_overlong_punishment"],
        "reward_weights": [1.0, 0.5, 1.0], "loss_type": "grpo", "beta": 0.04, "scale_rewards": True,
        "lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 0.1}, "warmup_steps": 0.1,
        "run_name": "llama-sums"}),
    Project("qwen2-json", "qwen2", "json", keys={
        "reward_funcs": ["my_rewards.correct", "my_rewards.short"], "loss_type": "dapo", "beta": 0.0,
        "scale_rewards": "batch", "lr_scheduler_type": "warmup_stable_decay", "warmup_steps": 1,
        "lr_scheduler_kwargs": {"num_decay_steps": 1}, "gradient_checkpointing": True,
        "gradient_checkpointing_kwargs": {"use_reentrant": False}, "output_dir": "out/qwen2-grpo"}),
    Project("qwen3-csv-32k", "qwen3", "csv", max_positions=32768, missing=True, keys={
        "reward_funcs": ["my_rewards.correct_or_none", "my_rewards.short"], "reward_weights": [1.0, 0.1],
        "loss_type": "dr_grpo", "scale_rewards": False, "beta": 0.0, "lr_scheduler_type": "cosine",
        "warmup_steps": 0.1}),
    Project("qwen3moe-parquet", "qwen3_moe", "parquet", smoke=True, keys={
        "reward_funcs": ["my_rewards.correct", "my_rewards.digits"], "loss_type": "bnpo", "beta": 0.0,
        "output_dir": "out/moe"}),
    Project("mixtral-save-to-disk", "mixtral", "save_to_disk", keys={
        "reward_funcs": ["my_rewards.correct", "my_rewards.digits"], "loss_type": "grpo", "beta": 0.02,
        "dataset_test_split": "test", "eval_strategy": "steps", "eval_steps": 1, "per_device_eval_batch_size": 4,
        "num_generations_eval": 2}),
    Project("mistral-dir-async", "mistral", "directory", keys={
        "reward_funcs": ["my_rewards.digits", "my_rewards.correct"], "reward_weights": [0.5, 1.0],
        "loss_type": "dapo", "beta": 0.0, "lr_scheduler_type": "constant_with_warmup", "warmup_steps": 1,
        "dataset_train_split": "train", "dataset_test_split": "test", "eval_strategy": "steps", "eval_steps": 2,
        "run_name": "mistral-dir"}),
    Project("gemma2-conv-lora-rm", "gemma2", "jsonl", conversational=True, reward_model=True, smoke=True, keys={
        "reward_model_name_or_path": "rm", "reward_funcs": ["my_rewards.correct"], "reward_weights": [0.5, 1.0],
        "use_peft": True, "lora_r": 8, "lora_alpha": 16, "lora_target_modules": "all-linear", "beta": 0.04,
        "loss_type": "grpo", "output_dir": "out/gemma2-lora", "inference": {"engine": "transformers"}}),
    Project("gemma3-mixture-eval", "gemma3_text", "mixture", smoke=True, keys={
        "reward_funcs": ["my_rewards.correct", "my_rewards.digits"], "loss_type": "dr_grpo", "beta": 0.0,
        "scale_rewards": "none", "eval_strategy": "steps", "eval_steps": 1, "per_device_eval_batch_size": 4,
        "num_generations_eval": 2}),
    Project("phi3-bf16", "phi3", "jsonl", dtype="bfloat16", keys={
        "reward_funcs": ["my_rewards.correct", "my_rewards.short"], "bf16": True, "dtype": "bfloat16",
        "loss_type": "dapo",
        "beta": 0.0, "learning_rate": 1.0e-3}),
    Project("olmo2-conv-extra", "olmo2", "jsonl", conversational=True, extra=True, keys={
        "reward_funcs": ["my_rewards.correct", "my_rewards.within_budget", "think_format_reward"],
        "loss_type": "bnpo", "beta": 0.0, "scale_rewards": "group", "lr_scheduler_type": "linear",
        "warmup_steps": 1}),
    Project("gptneox-csv-lora", "gpt_neox", "csv", keys={
        "reward_funcs": ["my_rewards.correct", "my_rewards.short"], "use_peft": True, "lora_r": 4,
        "lora_alpha": 8, "lora_target_modules": ["query_key_value", "dense"], "beta": 0.04, "loss_type": "grpo",
        "learning_rate": 1.0e-3}),
]
BY_NAME = {p.name: p for p in PROJECTS}


def recipe(p: Project) -> dict:
    return {**BASE, **p.keys}


def make_project(root: Path, p: Project, force: bool = False) -> Path:
    """Write one project (model, data, rewards, cfg.yaml) under root/<name>; kept when already made."""
    d = root / p.name
    # what the project is made from: a changed definition rebuilds it
    stamp = hashlib.sha256(repr((p, BASE, REWARDS_PY, HIDDEN, LAYERS, FFN)).encode()).hexdigest()[:16]
    marker = d / ".corpus-stamp"
    if not force and marker.is_file() and marker.read_text() == stamp:
        return d
    if d.exists():
        shutil.rmtree(d)
    tmp = root / f".{p.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    make_model(tmp / "model", p.arch, p.max_positions, p.dtype)
    if p.reward_model:
        make_reward_model(tmp / "rm")
    data_keys = write_data(tmp, p.data, conversational=p.conversational, extra=p.extra, missing=p.missing)
    (tmp / "my_rewards.py").write_text(REWARDS_PY)
    cfg = {**recipe(p), **data_keys}
    (tmp / "cfg.yaml").write_text(f"# {p.name}: a `trl grpo --config cfg.yaml` project ({p.arch}, {p.data})\n"
                                  + yaml.safe_dump(cfg, sort_keys=False))
    (tmp / ".corpus-stamp").write_text(stamp)
    tmp.rename(d)
    return d


# ------------------------------------------------------------------------------------ checks
def _hpcrl(args: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.Popen([sys.executable, "-m", "hpcrl", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        import signal

        proc.send_signal(signal.SIGINT)         # hpcrl run stops its own ranks on Ctrl-C
        try:
            out, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        return subprocess.CompletedProcess(proc.args, 124, out, err + f"\n(timed out after {timeout:.0f} s)")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _last_line(proc: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in (proc.stderr + proc.stdout).strip().splitlines() if ln.strip()]
    err = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    return (err or lines or ["(no output)"])[-1][:300]


def trl_parse(path: Path, num_generations: int) -> None:
    """What `trl grpo --config PATH` parses with (trl/scripts/grpo.py's make_parser: its script
    arguments, GRPOConfig, ModelConfig, DatasetMixtureConfig); raises where TRL would refuse."""
    from trl.scripts.grpo import make_parser

    *parsed, config_rest, cli_rest = make_parser().parse_args_and_config(
        ["--config", str(path)], return_remaining_strings=True, separate_remaining_strings=True)
    if config_rest or cli_rest:
        raise ValueError(f"keys TRL does not take: {config_rest + cli_rest}")
    script, grpo, model, mixture = parsed
    if grpo.num_generations != num_generations or not model.model_name_or_path:
        raise ValueError(f"parsed as num_generations={grpo.num_generations}, model={model.model_name_or_path!r}")
    if not (mixture.datasets or script.dataset_name):
        raise ValueError("no dataset_name and no datasets")


def check_trl(d: Path) -> str:
    """TRL's own parser takes the YAML (hpcrl's sections set aside); '' when it does."""
    cfg = yaml.safe_load((d / "cfg.yaml").read_text())
    aside = [k for k in HPCRL_SECTIONS if k in cfg]
    trl_only = {k: v for k, v in cfg.items() if k not in aside}
    if trl_only.get("bf16") and not _has_gpu():
        # transformers refuses bf16 on a machine without a GPU unless told to train on the CPU
        trl_only["use_cpu"] = True
        aside.append("use_cpu: true added, no GPU here")
    path = d / ".trl-cfg.yaml"
    path.write_text(yaml.safe_dump(trl_only, sort_keys=False))
    try:
        trl_parse(path, cfg["num_generations"])
    except (Exception, SystemExit) as e:      # argparse exits on a bad value
        return f"{type(e).__name__}: {e}".splitlines()[0][:300]
    return "" if not aside else f"(set aside: {', '.join(aside)})"


def _has_gpu() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def check_plan(d: Path, env: dict) -> str:
    proc = _hpcrl(["plan", "--site", "frontier", "cfg.yaml"], d, env, 300)
    if proc.returncode != 0:
        return f"exit {proc.returncode}: {_last_line(proc)}"
    if not any(ln.startswith("trainers: ~") for ln in proc.stdout.splitlines()):
        return "no estimate: " + next((ln for ln in proc.stdout.splitlines() if "estimate" in ln), "")[:200]
    return ""


def check_render(d: Path, env: dict) -> str:
    out = d / ".render"
    shutil.rmtree(out, ignore_errors=True)
    proc = _hpcrl(["render", "--site", "frontier", "-A", "PRJ123", "--run-dir", str(out), "cfg.yaml"], d, env, 300)
    shutil.rmtree(out, ignore_errors=True)
    return "" if proc.returncode == 0 else f"exit {proc.returncode}: {_last_line(proc)}"


def run_dir_of(d: Path) -> Path:
    return d / "run"


def check_run(d: Path, env: dict, steps: int = 2) -> str:
    rd = run_dir_of(d)
    shutil.rmtree(rd, ignore_errors=True)
    cfg = yaml.safe_load((d / "cfg.yaml").read_text())
    if cfg.get("output_dir"):
        shutil.rmtree(d / cfg["output_dir"], ignore_errors=True)
    proc = _hpcrl(["run", "cfg.yaml", f"max_steps={steps}", "--run-dir", str(rd)], d, env, RUN_TIMEOUT_S)
    (d / "run.out").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode != 0:
        return f"exit {proc.returncode}: {_last_line(proc)}"
    # the run's learning check (its summary's last line when nothing could have been learned)
    nothing = [ln for ln in proc.stdout.splitlines() if "learned nothing" in ln]
    if nothing:
        return nothing[-1][:300]
    if cfg.get("eval_strategy", "no") != "no":
        metrics = [json.loads(ln) for ln in (rd / "metrics.jsonl").read_text().splitlines() if ln.strip()]
        if not any("eval_reward" in m for m in metrics):
            return "eval_strategy is set but no step logged an eval_reward"
    return ""


def export_dir(d: Path) -> Path:
    cfg = yaml.safe_load((d / "cfg.yaml").read_text())
    return d / cfg["output_dir"] if cfg.get("output_dir") else run_dir_of(d) / "model"


def _tensors(directory: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _template(directory: Path) -> str | None:
    f = directory / "chat_template.jinja"
    if f.is_file():
        return f.read_text()
    tc = directory / "tokenizer_config.json"
    return json.loads(tc.read_text()).get("chat_template") if tc.is_file() else None


def check_export(d: Path) -> str:
    """The export loads, keeps the chat template and differs from the base."""
    import torch

    out, base = export_dir(d), d / "model"
    if not out.is_dir():
        return f"no export at {out.relative_to(d)}"
    template = _template(out)
    if template is None:
        return f"no chat template in {out.relative_to(d)}"
    if template != _template(base):
        return "chat template differs from the base's"
    if (out / "adapter_config.json").is_file():
        from peft import AutoPeftModelForCausalLM

        AutoPeftModelForCausalLM.from_pretrained(str(out))
        adapters = _tensors(out)
        if not adapters:
            return "adapter directory without tensors"
        # peft starts lora_B at zero: any nonzero B means the adapters moved the model.
        if not any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapters.items()):
            return f"adapters are the identity: every lora_B is zero ({len(adapters)} tensors)"
        return ""
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(out))
    got, ref = _tensors(out), _tensors(base)
    if set(got) != set(ref):
        only = sorted(set(got) ^ set(ref))
        return f"tensor names differ from the base's ({len(got)} vs {len(ref)}: {', '.join(only[:3])} ...)"
    changed = sum(not torch.equal(got[k].float(), ref[k].float()) for k in ref)
    return "" if changed else f"equal to the base (0 of {len(ref)} tensors changed)"


CHECKS = ("trl", "plan", "render", "run", "export")


def check_project(root: Path, p: Project, which=CHECKS, env: dict | None = None) -> dict:
    d = make_project(root, p)
    env = env or _env(root)
    result = {}
    for name in which:
        t0 = time.perf_counter()
        try:
            if name == "export" and result.get("run", ("", 0))[0] not in ("",):
                why = "skipped: run failed"
            else:
                why = {"trl": lambda: check_trl(d), "plan": lambda: check_plan(d, env),
                       "render": lambda: check_render(d, env), "run": lambda: check_run(d, env),
                       "export": lambda: check_export(d)}[name]()
        except Exception as e:      # a check that crashes fails with its reason, the others go on
            why = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            traceback.print_exc(file=sys.stderr)
        result[name] = (why, time.perf_counter() - t0)
    return result


def passed(why: str) -> bool:
    return why == "" or why.startswith("(")


def _env(root: Path) -> dict:
    env = dict(os.environ)
    env.update(HF_DATASETS_DISABLE_PROGRESS_BARS="1", HPCRL_HOME=str(root / ".hpcrl-home"),
               XDG_CONFIG_HOME=str(root / ".xdg"),
               HF_DATASETS_CACHE=str(root / ".hf-datasets"), HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")])))
    return env


def print_results(results: list[tuple[Project, dict]], which=CHECKS) -> int:
    sys.path.insert(0, str(REPO))
    from hpcrl.login.table import print_table

    rows, failures, notes = [], [], []
    for p, res in results:
        cells = []
        for name in which:
            why, secs = res[name]
            cells.append(f"{'ok' if passed(why) else 'FAIL'} {secs:.0f}s")
            if not passed(why):
                failures.append(f"{p.name} {name}: {why}")
            elif why:
                notes.append(f"{p.name} {name}: {why}")
        rows.append([p.name, p.arch, p.data + (" conv" if p.conversational else "") + (" +cols" if p.extra else ""),
                     p.settings(), *cells])
    print_table(["project", "architecture", "data", "settings", *which], rows)
    for line in notes + failures:
        print(line)
    n_failed = sum(any(not passed(res[c][0]) for c in which) for _, res in results)
    print(f"corpus: {len(results) - n_failed} passed, {n_failed} failed")
    return 1 if n_failed else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write the corpus into DIR")
    m.add_argument("dir", type=Path)
    m.add_argument("names", nargs="*")
    m.add_argument("--force", action="store_true", help="rewrite projects already there")
    c = sub.add_parser("check", help="check every project (or those named) and print the table")
    c.add_argument("dir", type=Path)
    c.add_argument("names", nargs="*")
    c.add_argument("--checks", default=",".join(CHECKS), help=f"comma-separated subset of {','.join(CHECKS)}")
    sub.add_parser("list", help="the projects")
    args = ap.parse_args(argv)
    if args.cmd == "list":
        for p in PROJECTS:
            print(f"{p.name:24} {p.arch:12} {p.data:13} {p.settings()}")
        return 0
    unknown = [n for n in args.names if n not in BY_NAME]
    if unknown:
        print(f"trl_corpus: unknown project(s) {', '.join(unknown)}; choose from {', '.join(BY_NAME)}", file=sys.stderr)
        return 2
    chosen = [BY_NAME[n] for n in args.names] or PROJECTS
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    root = args.dir.resolve()
    root.mkdir(parents=True, exist_ok=True)
    if args.cmd == "make":
        for p in chosen:
            print(make_project(root, p, force=args.force))
        return 0
    which = tuple(x for x in args.checks.split(",") if x)
    bad = [x for x in which if x not in CHECKS]
    if bad:
        print(f"trl_corpus: --checks: unknown {', '.join(bad)}; choose from {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    results = []
    for p in chosen:
        res = check_project(root, p, which)
        results.append((p, res))
        print(f"[{p.name}] " + "  ".join(f"{k}={'ok' if passed(v[0]) else 'FAIL'}" for k, v in res.items()),
              file=sys.stderr, flush=True)
    return print_results(results, which)


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
