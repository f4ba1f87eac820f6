"""hpcrl.compute.models.tiny, hpcrl.compute.train.data and hpcrl.compute.train.rewards."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import threading

import pytest
import torch

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

from hpcrl.compute.models import tiny  # noqa: E402
from hpcrl.compute.train import data, rewards  # noqa: E402

# --------------------------------------------------------------------------------------------------
# Tiny models


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny.make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", size="tiny", seed=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return transformers.AutoTokenizer.from_pretrained(tiny_dir)


def test_tiny_model_loads_and_generates(tiny_dir, tokenizer):
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == tiny.param_count("tiny")
    assert len(tokenizer) == model.config.vocab_size == tiny.VOCAB_SIZE
    assert tokenizer.eos_token == tiny.EOS_TOKEN and tokenizer.pad_token == tiny.PAD_TOKEN
    assert model.generation_config.eos_token_id == [tokenizer.eos_token_id, tokenizer.pad_token_id]

    enc = tokenizer(["3+4=", "12+30="], return_tensors="pt", padding=True, padding_side="left")
    torch.manual_seed(0)
    out = model.generate(**enc, max_new_tokens=5, do_sample=True)
    assert out.shape[0] == 2 and 0 < out.shape[1] - enc["input_ids"].shape[1] <= 5
    tokenizer.batch_decode(out, skip_special_tokens=True)  # every sampled id decodes


def test_tokenizer_round_trip_and_chat_template(tiny_dir, tokenizer):
    built = tiny.build_tokenizer()
    # AutoTokenizer maps model_type qwen2 to Qwen2Tokenizer, which rebuilds the pre-tokenizer itself:
    # the saved tokenizer must tokenise exactly as the built one.
    for text in ["What is 12+7=? é", " 123 abc\n\nxyz  ", "<think>a</think> Ünïcødé 日本", "<|im_start|>user\nhi<|im_end|>"]:
        assert tokenizer(text)["input_ids"] == built(text)["input_ids"]
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.tokenize("1234") == ["1", "2", "3", "4"]  # one token per digit
    text = tokenizer.apply_chat_template([{"role": "user", "content": "3+4="}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\n3+4=<|im_end|>\n<|im_start|>assistant\n"


def test_make_tiny_model_is_idempotent(tiny_dir, tmp_path):
    stamp = (tiny_dir / "model.safetensors").stat().st_mtime_ns
    assert tiny.make_tiny_model(tiny_dir, size="tiny", seed=0) == tiny_dir
    assert (tiny_dir / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    assert json.loads((tiny_dir / tiny.MARKER).read_text())["size"] == "tiny"
    # Not ours: never overwritten
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError):
        tiny.make_tiny_model(other)


def test_small_model_and_seed(tmp_path):
    path = tiny.make_tiny_model(tmp_path / "small", size="small", seed=1)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    n = sum(p.numel() for p in model.parameters())
    assert n == tiny.param_count("small") == tiny.SIZES["small"].approx_params
    # Rebuilt with another seed in place (the directory is ours): other weights
    first = model.model.embed_tokens.weight[:4, :4].clone()
    tiny.make_tiny_model(path, size="small", seed=2)
    model2 = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert not torch.equal(first, model2.model.embed_tokens.weight[:4, :4])


@pytest.mark.parametrize("size,nominal", [("tiny", 1e6), ("small", 10e6), ("medium", 30e6), ("base", 100e6), ("large", 500e6)])
def test_sizes_have_the_advertised_parameter_counts(size, nominal):
    n = tiny.param_count(size)  # meta device: no weights allocated
    assert n == tiny.SIZES[size].approx_params
    assert 0.75 * nominal <= n <= 1.25 * nominal, n


def test_cli(tmp_path, capsys):
    assert tiny.main([str(tmp_path / "m"), "--size", "tiny", "--dtype", "bfloat16"]) == 0
    assert "tiny" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["dtype"] == "bfloat16"


def _greedy_accuracy(model_dir) -> float:
    """Share of the demo prompts whose most likely next token is the right answer."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    pairs = data.demo_pairs()
    ids = torch.tensor([tok(f"{a}+{b}=")["input_ids"] for a, b in pairs])
    with torch.no_grad():
        best = model(ids).logits[:, -1].argmax(-1).tolist()
    return sum(tok.decode([t]) == str(a + b) for t, (a, b) in zip(best, pairs)) / len(pairs)


def test_demo_model_paths_are_warm_or_random(tmp_path):
    from hpcrl.compute.train.sources import resolve_model
    from hpcrl.job.demo import parse_demo_model

    assert parse_demo_model("demo:tiny") == ("tiny", "") and parse_demo_model("demo:") == ("tiny", "")
    assert parse_demo_model("demo:small:random") == ("small", "random")
    assert parse_demo_model("demo::random") == ("tiny", "random")
    assert parse_demo_model("demo:tiny:agent") == ("tiny", "agent")
    random_dir = resolve_model("demo:tiny:random", tmp_path, seed=0)
    warm_dir = resolve_model("demo:tiny", tmp_path, seed=0)
    assert random_dir.endswith("model-tiny-random") and warm_dir.endswith("model-tiny")
    marker = json.loads((tmp_path / "model-tiny" / tiny.MARKER).read_text())
    assert marker["warmup"] == dataclasses.asdict(tiny.DEMO_WARMUP)
    result = marker["warmup_result"]
    assert result["p_correct"] >= tiny.DEMO_WARMUP.target and result["steps"] < tiny.DEMO_WARMUP.max_steps, result
    assert "warmup" not in json.loads((tmp_path / "model-tiny-random" / tiny.MARKER).read_text())
    # The warm model answers many sums right (and keeps the format); the random one hardly any.
    assert _greedy_accuracy(warm_dir) >= 0.3 and _greedy_accuracy(random_dir) <= 0.1
    with pytest.raises(ValueError, match="unknown tiny model size 'huge'"):
        resolve_model("demo:huge", tmp_path)
    with pytest.raises(ValueError, match="unknown demo model 'warm'"):
        resolve_model("demo:tiny:warm", tmp_path)


def test_warm_up_is_deterministic_and_part_of_the_recipe(tmp_path, monkeypatch):
    monkeypatch.setenv(tiny.CACHE_ENV, "")       # every build warms up (the cache: the next test)
    quick = dataclasses.replace(tiny.DEMO_WARMUP, target=0.2)
    calls = []
    real = tiny.warm_up
    monkeypatch.setattr(tiny, "warm_up", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    # Two builders at once (as the trainer and the server of a node): one warms up, the other waits.
    out = tmp_path / "warm"
    threads = [threading.Thread(target=tiny.make_tiny_model, args=(out,), kwargs={"warmup": quick}) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    first = json.loads((out / tiny.MARKER).read_text())["warmup_result"]
    assert tiny.make_tiny_model(out, warmup=quick) == out and len(calls) == 1  # built: left alone
    # Other settings rebuild, the same settings and seed give the same model again.
    tiny.make_tiny_model(out, warmup=dataclasses.replace(quick, target=0.25))
    assert len(calls) == 2
    tiny.make_tiny_model(out, warmup=quick)
    again = json.loads((out / tiny.MARKER).read_text())["warmup_result"]
    assert (again["steps"], again["p_correct"]) == (first["steps"], first["p_correct"])
    assert 0.2 <= first["p_correct"] < 0.5


def test_the_next_run_copies_a_warmed_up_model_from_the_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv(tiny.CACHE_ENV, str(cache))
    quick = dataclasses.replace(tiny.DEMO_WARMUP, target=0.2)
    calls = []
    real = tiny.warm_up
    monkeypatch.setattr(tiny, "warm_up", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    first = tiny.make_tiny_model(tmp_path / "run-1" / "model-tiny", warmup=quick)
    second = tiny.make_tiny_model(tmp_path / "run-2" / "model-tiny", warmup=quick)
    assert len(calls) == 1
    assert sorted(p.name for p in second.iterdir()) == sorted(p.name for p in first.iterdir())
    assert all((second / p.name).read_bytes() == p.read_bytes() for p in first.iterdir())
    # Another seed is another model; a random model is not cached (built in about a second).
    tiny.make_tiny_model(tmp_path / "run-3" / "model-tiny", seed=1, warmup=quick)
    tiny.make_tiny_model(tmp_path / "run-3" / "model-tiny-random")
    entries = [e for e in cache.iterdir() if not e.name.startswith(".")]       # beside them, their locks
    assert len(calls) == 2 and len(entries) == 2
    # A damaged entry is built again and replaced, not copied.
    for e in entries:
        (e / "model.safetensors").unlink()
    tiny.make_tiny_model(tmp_path / "run-4" / "model-tiny", warmup=quick)
    assert len(calls) == 3
    tiny.make_tiny_model(tmp_path / "run-5" / "model-tiny", warmup=quick)
    assert len(calls) == 3, "the replaced entry was not used"
    # A cache that cannot be written (here a file where its directory should be) costs a build only.
    monkeypatch.setenv(tiny.CACHE_ENV, str(tmp_path / "run-1" / "model-tiny" / "config.json"))
    assert tiny.make_tiny_model(tmp_path / "run-6" / "model-tiny", warmup=quick).is_dir() and len(calls) == 4
    monkeypatch.setenv(tiny.CACHE_ENV, "")
    assert tiny.model_cache_dir() is None
    monkeypatch.delenv(tiny.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tiny.model_cache_dir() == tmp_path / "xdg" / "hpcrl" / "models"


def test_runs_that_start_together_warm_up_once_through_the_cache(tmp_path, monkeypatch):
    """Two runs of one machine (or a test session's background warm-up and its first run) building
    the same demo model, each in its own directory: one warms up, the other waits and copies."""
    monkeypatch.setenv(tiny.CACHE_ENV, str(tmp_path / "cache"))
    quick = dataclasses.replace(tiny.DEMO_WARMUP, target=0.2)
    calls = []
    real = tiny.warm_up
    monkeypatch.setattr(tiny, "warm_up", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    outs = [tmp_path / f"run-{i}" / "model-tiny" for i in range(2)]
    threads = [threading.Thread(target=tiny.make_tiny_model, args=(out,), kwargs={"warmup": quick}) for out in outs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert all((outs[1] / p.name).read_bytes() == p.read_bytes() for p in outs[0].iterdir())


def test_the_cache_key_is_the_same_in_every_process(tmp_path):
    """The agent's warm-up lives in a module of its own: the key read both sources in a set's order,
    which differs between processes (string hashing is seeded per process), so the next run's
    lookup missed and warmed up again."""
    code = ("from hpcrl.compute.models import tiny; from hpcrl.compute.models.tiny_agent import AGENT_WARMUP; "
            "print(tiny._cache_entry(tiny._recipe('tiny', 0, 'float32', AGENT_WARMUP), AGENT_WARMUP))")
    keys = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, tiny.CACHE_ENV: str(tmp_path), "PYTHONHASHSEED": str(seed)}).stdout
            for seed in range(6)}
    assert len(keys) == 1, keys


def test_cli_warm_up(tmp_path, capsys):
    assert tiny.main([str(tmp_path / "m"), "--warm-up", "--warm-up-target", "0.2"]) == 0
    out = capsys.readouterr().out
    assert "warmed up: P(right answer) 0.2" in out, out
    assert json.loads((tmp_path / "m" / tiny.MARKER).read_text())["warmup"]["target"] == 0.2


# --------------------------------------------------------------------------------------------------
# Data

ROWS = [
    {"prompt": "2+2=", "answer": "4", "level": 1},
    {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+4="}], "answer": "7", "level": 2},
]


def _write_all_formats(tmp_path, rows):
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds = datasets.Dataset.from_list(rows)
    parquet = tmp_path / "p.parquet"
    ds.to_parquet(str(parquet))
    disk = tmp_path / "disk"
    datasets.DatasetDict({"train": ds}).save_to_disk(str(disk))
    return [jsonl, parquet, disk]


def test_load_prompts_from_every_format(tmp_path, tokenizer):
    plain = [{"prompt": f"{i}+1=", "answer": str(i + 1), "level": i} for i in range(5)]
    conv = [{"prompt": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1)} for i in range(3)]
    for rows, sub in ((plain, "plain"), (conv, "conv")):
        (tmp_path / sub).mkdir()
        for path in _write_all_formats(tmp_path / sub, rows):
            ds = data.load_prompts(path)
            assert len(ds) == len(rows) and ds[0]["answer"] == rows[0]["answer"], path
            batch = data.make_batch(ds, [1, 0], tokenizer)
            assert batch.prompts[0] == rows[1]["prompt"] and batch.columns["answer"] == ["2", "1"]
            if sub == "plain":
                assert batch.texts == ["1+1=", "0+1="] and batch.columns["level"] == [1, 0]
            else:
                assert batch.texts[0] == "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
            assert batch.prompt_ids[0] == tokenizer(batch.texts[0], add_special_tokens=False)["input_ids"]


def test_chat_template_applied_as_trl_does(tokenizer):
    from trl.data_utils import apply_chat_template

    for prompt in (
        ROWS[1]["prompt"],
        [{"role": "user", "content": "3+4="}, {"role": "assistant", "content": "The answer is"}],  # prefill
    ):
        assert data.is_conversational(prompt)
        assert data.render_prompt(prompt, tokenizer) == apply_chat_template({"prompt": prompt}, tokenizer)["prompt"]
    assert not data.is_conversational("2+2=") and data.render_prompt("2+2=", tokenizer) == "2+2="


def test_load_prompts_errors(tmp_path):
    bad = tmp_path / "x.jsonl"
    bad.write_text(json.dumps({"question": "hi"}) + "\n")
    with pytest.raises(ValueError, match="no 'prompt' column"):
        data.load_prompts(bad)
    # data.prompt_column names another column: it becomes "prompt".
    assert data.load_prompts(bad, prompt_column="question")["prompt"] == ["hi"]
    with pytest.raises(FileNotFoundError):
        data.load_prompts(tmp_path / "missing.jsonl")
    disk = tmp_path / "d"
    datasets.DatasetDict({"test": datasets.Dataset.from_list(ROWS[:1])}).save_to_disk(str(disk))
    with pytest.raises(ValueError, match="no split 'train'"):
        data.load_prompts(disk)
    assert len(data.load_prompts(disk, split="test")) == 1


def test_batch_repeat_is_group_layout(tokenizer):
    ds = datasets.Dataset.from_list([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}])
    batch = data.make_batch(ds, [0, 1], tokenizer).repeat(3)
    assert batch.prompts == ["a"] * 3 + ["b"] * 3 and batch.columns["answer"] == ["1"] * 3 + ["2"] * 3
    assert len(batch) == 6 and batch.indices == [0, 0, 0, 1, 1, 1]


def test_sampler_is_deterministic_and_resumable():
    s = data.PromptSampler(10, batch_size=4, seed=3)
    stream = [next(s) for _ in range(7)]  # 28 rows: crosses two epoch boundaries
    flat = [i for b in stream for i in b]
    assert sorted(flat[:10]) == list(range(10)) and sorted(flat[10:20]) == list(range(10))
    assert flat[:10] != flat[10:20]  # reshuffled each epoch

    s2 = data.PromptSampler(10, batch_size=4, seed=3)
    for _ in range(3):
        next(s2)
    state = json.loads(json.dumps(s2.state_dict()))  # survives a checkpoint file
    s3 = data.PromptSampler(10, batch_size=4, seed=3)
    s3.load_state_dict(state)
    assert [next(s3) for _ in range(4)] == stream[3:]
    with pytest.raises(ValueError, match="rows"):
        data.PromptSampler(11, batch_size=4).load_state_dict(state)
    assert data.PromptSampler(10, 4, seed=4).__next__() != stream[0]


def test_sampler_shards_by_rank():
    full = data.PromptSampler(12, batch_size=6, seed=0)
    shards = [data.PromptSampler(12, batch_size=6, seed=0, rank=r, world_size=3) for r in range(3)]
    for _ in range(3):
        assert next(full) == [i for s in shards for i in next(s)]
    with pytest.raises(ValueError):
        data.PromptSampler(12, batch_size=5, world_size=2)


def test_demo_dataset():
    ds = data.demo_dataset(200, seed=1)
    assert len(ds) == 200 and set(ds.column_names) == {"prompt", "answer"}
    for prompt, answer in zip(ds["prompt"], ds["answer"]):
        a, b = prompt.removesuffix("=").split("+")
        assert int(a) + int(b) == int(answer) <= 9  # one-token answers by default
    assert data.demo_dataset(200, seed=1)["prompt"] == ds["prompt"] and data.demo_dataset(200, seed=2)["prompt"] != ds["prompt"]
    assert max(int(x) for x in data.demo_dataset(200, seed=1, max_sum=18)["answer"]) > 9
    conv = data.demo_dataset(3, seed=1, conversational=True)
    assert conv[0]["prompt"] == [{"role": "user", "content": ds[0]["prompt"]}]


# --------------------------------------------------------------------------------------------------
# Rewards


def test_demo_rewards_prefer_the_right_answer():
    completions = ["7", " 7", "7x", "6", "2", "73", "1111", "abc", ""]
    got = rewards.demo_correct(prompts=["3+4="] * 9, completions=completions, answer=["7"] * 9)
    assert got == pytest.approx([1.0, 1.0, 1.0, 0.45, 0.25, 0.0, 0.0, 0.0, 0.0])
    assert rewards.demo_format(prompts=None, completions=completions) == [1, 1, 0, 1, 1, 1, 0, 0, 0]
    # Weighted as the demo weighs them: right > close > far > a run of digits or junk
    funcs = rewards.load_reward_functions(rewards.DEMO_REWARDS)
    per_func = rewards.score_completions(funcs, ["3+4="] * 9, completions, columns={"answer": ["7"] * 9})
    total = (per_func * torch.tensor([f.weight for f in funcs])).sum(1).tolist()
    assert total[0] > total[3] > total[4] > total[6] == total[7]
    conv = rewards.as_completions([[{"role": "user", "content": "3+4="}]] * 2, ["7", "6"])
    assert conv[0] == [{"role": "assistant", "content": "7"}]
    assert rewards.demo_correct(prompts=None, completions=conv, answer=["7", "7"]) == pytest.approx([1.0, 0.45])
    two_digits = rewards.demo_correct(prompts=None, completions=["12", "13", "1", "21"], answer=["12"] * 4)
    assert two_digits == pytest.approx([1.0, 0.45, 0.0, 0.05])


def test_load_reward_functions_and_score():
    funcs = rewards.load_reward_functions(
        [*rewards.DEMO_REWARDS, "hpcrl.compute.train.rewards.demo_format", {"func": lambda completions, **kw: [None, 2.0]}]
    )
    assert [f.name for f in funcs] == ["demo_correct", "demo_format", "demo_format", "<lambda>"]
    assert [f.weight for f in funcs] == [1.0, 0.5, 1.0, 1.0]
    scores = rewards.score_completions(funcs, ["3+4=", "1+1="], ["7", "x"], [[1], [2]], {"answer": ["7", "2"]})
    assert scores.shape == (2, 4) and scores[0, :3].tolist() == [1.0, 1.0, 1.0] and math.isnan(scores[0, 3])
    assert scores[1].tolist() == [0.0, 0.0, 0.0, 2.0]


def test_async_reward_and_wrong_length():
    async def slow(completions, **kw):
        return [1.0] * len(completions)

    funcs = rewards.load_reward_functions([slow, lambda completions, **kw: [0.0]])
    with pytest.raises(ValueError, match="returned 1 rewards, but 2"):
        rewards.score_completions(funcs, ["a", "b"], ["x", "y"])
    assert rewards.score_completions(funcs[:1], ["a", "b"], ["x", "y"]).tolist() == [[1.0], [1.0]]


@pytest.mark.parametrize(
    "path,kind",
    [
        ("no_such_pkg.mod:f", "ModuleNotFoundError"),
        ("hpcrl.compute.train.rewards:no_such_func", "AttributeError"),
        ("hpcrl.compute.train.rewards.no_such_func", "AttributeError"),
        ("justaname", "ImportError"),
    ],
)
def test_bad_reward_paths_give_one_line_errors(path, kind):
    with pytest.raises(ValueError) as err:
        rewards.load_reward_functions(["hpcrl.compute.train.rewards:demo_format", {"func": path, "weight": 2}])
    msg = str(err.value)
    assert msg.startswith(f"rewards[1].func: cannot import {path!r} ({kind}: ") and "\n" not in msg


def test_bad_reward_specs():
    with pytest.raises(ValueError, match=r"rewards\[0\].func: .* is not callable"):
        rewards.load_reward_functions(["hpcrl.compute.models.tiny:VOCAB_SIZE"])
    with pytest.raises(ValueError, match=r"rewards\[0\]: unknown keys \['wieght'\]"):
        rewards.load_reward_functions([{"func": "hpcrl.compute.train.rewards:demo_format", "wieght": 1}])
    with pytest.raises(ValueError, match=r"rewards\[0\].weight"):
        rewards.load_reward_functions([{"func": "hpcrl.compute.train.rewards:demo_format", "weight": "heavy"}])


def test_trl_reward_functions_work_unchanged():
    funcs = rewards.load_reward_functions(
        [
            "trl.rewards:think_format_reward",
            {"func": "trl.rewards.get_soft_overlong_punishment", "kwargs": {"max_completion_len": 4, "soft_punish_cache": 2}},
        ]
    )
    assert funcs[0].name == "think_format_reward"
    prompts = [[{"role": "user", "content": "2+2="}]] * 2
    completions = rewards.as_completions(prompts, ["<think>\nadd\n</think>\n4", "4"])
    scores = rewards.score_completions(funcs, prompts, completions, completion_ids=[[1, 2, 3], [1]])
    assert funcs[1].name == "soft_overlong_punishment_reward"
    assert scores[:, 0].tolist() == [1.0, 0.0]
    assert scores[:, 1].tolist() == [-0.5, 0.0]  # 3 tokens: one into the 2-token punishment zone of 4


# That a fresh vLLM engine loads the tiny model's kind, decodes as its tokenizer does and applies
# its chat template: tests/compute/train/test_export.py, test_fresh_vllm_engine_loads_the_model.


def test_recipe_knows_every_loss_type_of_the_trainer():
    """The login side validates loss_type without torch: its list must be the trainer's."""
    from hpcrl.job.grpo_config import LOSS_TYPES
    from hpcrl.compute.train.loss import LOSS_TYPES as TRAINER_LOSS_TYPES

    assert set(LOSS_TYPES) == set(TRAINER_LOSS_TYPES)


def test_a_stuck_builder_is_waited_for_with_a_bound(tmp_path):
    """Another process holding the build lock: a second builder gives up after the bound, naming it."""
    import fcntl

    out = tmp_path / "model"
    with open(tmp_path / ".model.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        # flock locks belong to the open file: a second open in this process contends like another process.
        with pytest.raises(TimeoutError, match=r"another process has been building .*model.* for over 1 s"):
            with tiny._build_lock(out, timeout_s=1.0):
                pass
    with tiny._build_lock(out, timeout_s=1.0):     # released: taken at once
        pass
