"""What many tests build the same way: a trainer's parts on the CPU and generators that stand in for
the node's server (hpcrl.compute.inference.client) in tests of the training loop; and the builders
and checks that test files in different folders share (greedy decoding, a reward model, a TRL
user's project and what its run leaves, the reward's means at a run's two ends, a scripted model
that calls tools). The tiny model
directory every such test reads is conftest.py's ``model_dir`` fixture."""

from __future__ import annotations

import json
import os
import re
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Sequence

import pytest
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


# ----------------------------------------------------------------------------------------------
# Builders and checks that test files in different folders share

def fresh_cpu_engine_env() -> dict[str, str]:
    """The environment of a process of its own that starts a fresh vLLM engine on CPU as hpcrl's
    server does (hpcrl.compute.inference.vllm_engine): a 1 GiB KV cache, torch.compile off, vLLM
    inside that process."""
    from hpcrl.compute.inference.vllm_engine import EAGER_ENV, MULTIPROCESSING_ENV

    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", EAGER_ENV: "1", MULTIPROCESSING_ENV: "0"}


def eager_cpu_llm(**kwargs):
    """vllm.LLM(**kwargs) as hpcrl's eager engine on CPU starts: torch.compile off in the engine's
    processes (hpcrl.compute.inference.vllm_engine.EAGER_ENV), which take the variable as they spawn;
    this process's environment is left as it was."""
    from unittest import mock

    from vllm import LLM

    from hpcrl.compute.inference.vllm_engine import EAGER_ENV

    with mock.patch.dict(os.environ, {EAGER_ENV: "1"}):
        return LLM(**kwargs)


def run_survivors(run_dir) -> list[str]:
    """Processes still carrying the run's directory in their environment: ranks, vLLM's engine."""
    marker = f"HPCRL_RUN_DIR={run_dir}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker in (proc / "environ").read_bytes().split(b"\0"):
                found.append(f"{proc.name} {(proc / 'cmdline').read_bytes()[:80]!r}")
        except OSError:
            continue
    return found


def spy_on_packing(trainer_module) -> list[tuple[list, int, int]]:
    """What the trainer loop packs, from now on in this process: (prompt ids, loss tokens, attended
    completion tokens) of every generation (trainer_module: hpcrl.compute.train.trainer)."""
    packed, real = [], trainer_module.pack_batch

    def spy(prompt_ids, completions, *args, **kwargs):
        out = real(prompt_ids, completions, *args, **kwargs)
        packed.append((prompt_ids, int(out["loss_mask"].sum()), int(out["completion_mask"].sum())))
        return out

    trainer_module.pack_batch = spy
    return packed


def greedy(model, tokenizer, prompts: list[str], n: int = 8) -> list[str]:
    out = []
    for p in prompts:
        ids = tokenizer(p, return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        out.append(tokenizer.decode(gen[0, ids.shape[1]:]))
    return out


def make_reward_model(out: Path, tiny_dir: str) -> str:
    """The tiny demo model's architecture with a one-logit classification head, and its tokenizer."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    config = AutoConfig.from_pretrained(tiny_dir)
    config.num_labels = 1
    torch.manual_seed(3)
    model = AutoModelForSequenceClassification.from_config(config)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return str(out)


def write_trl_user_files(tmp_path: Path) -> Path:
    """What a TRL user brings, made here: a Hugging Face model with its tokenizer and chat template,
    a reward model, a conversational dataset with train and test splits (save_to_disk) and an
    answer column, a reward module beside the `trl grpo --config` YAML using TRL 1.x's extras, a
    TRL helper reward, evaluation every 3 steps, TRL's adaptive entropy control (its target above any
    token entropy here: the coefficient rises each step, to its max). Returns the YAML's path."""
    import datasets

    from hpcrl.compute.models.tiny import make_tiny_model

    model = make_tiny_model(tmp_path / "my-model", size="tiny", seed=0)
    make_reward_model(tmp_path / "my-rm", model)
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{b}="}], "answer": str(a + b)} for a in range(3) for b in range(4)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:5])}
                         ).save_to_disk(str(tmp_path / "sums"))
    (tmp_path / "my_rewards.py").write_text(
        "def correct(prompts, completions, answer, trainer_state, log_metric, **kwargs):\n"
        "    log_metric('my/global_step', trainer_state.global_step)\n"
        "    return [1.0 if c[0]['content'].strip().startswith(a) else 0.0 for c, a in zip(completions, answer)]\n")
    (tmp_path / "cfg.yaml").write_text("""\
model_name_or_path: my-model
dataset_name: sums
reward_funcs: [my_rewards.correct, think_format_reward]
reward_model_name_or_path: my-rm
reward_weights: [0.1, 1.0, 0.5]
num_train_epochs: 1
per_device_train_batch_size: 8
num_generations: 4
max_completion_length: 8
learning_rate: 1.0e-4
save_steps: 2
save_total_limit: 1
output_dir: out
logging_steps: 1
eval_strategy: steps
eval_steps: 3
num_generations_eval: 2
use_vllm: true
attn_implementation: eager
use_adaptive_entropy: true
entropy_target: 1000.0
entropy_coef_delta: 0.01
entropy_coef_max: 0.015
inference: {engine: transformers, max_model_len: 64}
""")
    return tmp_path / "cfg.yaml"


def check_trl_user_run(run_dir: Path, out: Path, steps: int) -> None:
    """What write_trl_user_files' configuration must leave behind after `steps` optimizer steps."""
    from transformers import AutoModelForCausalLM

    from hpcrl.job import rundir

    # Saved every 2 steps and at the last (TRL's checkpoint-<last>: hard links to the final model's
    # files), save_total_limit 1: the newest stays, as in TRL.
    assert (out / "config.json").is_file() and rundir.model_checkpoint_steps(out) == [steps]
    last = out / f"checkpoint-{steps}"
    assert (last / "model.safetensors").stat().st_ino == (out / "model.safetensors").stat().st_ino
    assert AutoModelForCausalLM.from_pretrained(out) is not None
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, steps + 1)) and metrics[-1]["max_steps"] == steps
    # trainer_state as TRL's: the step being trained is global_step + 1 when the rewards are scored.
    assert [m["my/global_step"] for m in metrics] == list(range(steps))
    assert "rewards/think_format_reward/mean" in metrics[-1] and "rewards/my-rm/mean" in metrics[-1]
    assert (run_dir / "rewards" / "my_rewards.py").is_file()
    # Adaptive entropy control, after each step: 0 + 0.01 a step, at most 0.015 (the bonus acts from step 2).
    assert [m["entropy_coef"] for m in metrics] == pytest.approx([min(0.01 * k, 0.015) for k in range(1, steps + 1)])
    # Evaluation on the test split every 3 steps and at the end: 5 prompts x 2 completions.
    evaluated = {m["step"]: m for m in metrics if "eval_reward" in m}
    assert sorted(evaluated) == sorted({*range(3, steps + 1, 3), steps})
    assert evaluated[steps]["eval_completions"] == 10
    assert {"eval_rewards/correct/mean", "eval_rewards/think_format_reward/mean",
            "eval_rewards/my-rm/mean"} <= set(evaluated[steps])


WINDOW = 20  # steps averaged at each end: a single step's mean reward swings by ~0.1


def window_means(steps: list[dict], key: str, window: int = WINDOW) -> tuple[float, float]:
    """Mean of `key` over the first and over the last `window` steps."""
    values = [s[key] for s in steps]
    return sum(values[:window]) / window, sum(values[-window:]) / window


# --------------------------------------------------------------------------------------------------
# Agents: a scripted "model" that calls tools, for the tool loop's tests (tests/compute/agents)

# Tools the scripted model calls: one that answers, one that raises, one whose result is too long.
TOOL_MODULE = textwrap.dedent('''
    def add(a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return a + b


    def boom(x: int) -> int:
        """Always fails.

        Args:
            x: Anything.
        """
        raise ValueError("boom went the tool")


    def repeat(text: str, times: int) -> str:
        """Repeat a text.

        Args:
            text: The text.
            times: How many times.
        """
        return text * times
''')


# TRL's chat templates (trl/chat_templates) the agent tests run on: template -> the tokens that end
# a sampled turn (the first is the tokenizer's end of sequence), and how a tool's result reads in a
# rendered conversation.
TOOL_TEMPLATES = {
    "qwen2_5": (("<|im_end|>",), r"<tool_response>\n(.*?)\n</tool_response>"),
    "qwen3": (("<|im_end|>",), r"<tool_response>\n(.*?)\n</tool_response>"),     # not prefix-preserving
    "llama3_1": (("<|eot_id|>", "<|eom_id|>"), r"ipython<\|end_header_id\|>\n\n(.*?)<\|eot_id\|>"),
    "gptoss": (("<|return|>", "<|call|>", "<|end|>"), r"to=assistant<\|channel\|>commentary<\|message\|>(.*?)<\|end\|>"),
}


def _call(name: str, **arguments) -> dict:
    return {"role": "assistant", "content": "",
            "tool_calls": [{"type": "function", "function": {"name": name, "arguments": arguments}}]}


def script_turn(text: str, variant: int, template: str = "qwen2_5") -> dict:
    """What the scripted model says next (an assistant message), given the conversation so far
    (decoded, rendered by ``template``) and, for a first turn, which of a prompt's rollouts this is."""
    a, b = map(int, re.findall(r"(\d)\+(\d)=", text)[-1])
    responses = re.findall(TOOL_TEMPLATES[template][1], text, re.S)
    if not responses:
        return [_call("add", a=a, b=b), {"role": "assistant", "content": str(a + b)}, _call("mul", a=a, b=b),
                _call("boom", x=1) if a == 3 else _call("repeat", text="ab", times=300)][variant]
    if "error" in responses[-1] and len(responses) < 2:
        return _call("add", a=a, b=b)
    answer = responses[-1].strip('"')
    return {"role": "assistant", "content": f"The answer is {answer}" +
            (". I added the two numbers carefully, digit by digit" * 8 if a == 5 else "")}


def turn_text(tok, message: dict) -> str:
    """``message`` as a model of ``tok``'s chat template samples it: the template's rendering of the
    turn, up to and with the first token that ends a turn."""
    from hpcrl.compute.agents.conversation import ToolChat

    template = ToolChat(tok).chat_template      # the training template where TRL swaps one in
    user = [{"role": "user", "content": "1+1="}]
    prompt = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False, chat_template=template)
    full = tok.apply_chat_template(user + [message], tokenize=False, chat_template=template)
    assert full.startswith(prompt), (prompt, full)
    turn = full[len(prompt):]
    end = min((turn.index(t) + len(t) for t in TOOL_TEMPLATES[tok.hpcrl_template][0] if t in turn), default=None)
    assert end is not None, turn
    return turn[:end]


def scripted_ids(tok, message: dict, max_tokens: int) -> tuple[list[int], list[float], bool]:
    """The ids of a scripted turn (closed by its end-of-turn token), cut at ``max_tokens``, with
    made-up sampling log-probabilities, and whether it was cut."""
    ids = tok(turn_text(tok, message), add_special_tokens=False)["input_ids"]
    cut = len(ids) > max_tokens
    ids = ids[:max_tokens]
    return ids, [-0.01 * (1 + (t + i) % 50) for i, t in enumerate(ids)], cut


def tool_tokenizer(template: str = "qwen2_5"):
    """The tiny models' tokenizer with one of TRL's chat templates that render tools (Qwen2.5's by
    default); the template's own special tokens are added, and its end of turn is the end of sequence."""
    import trl

    from hpcrl.compute.models.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = (Path(trl.__file__).parent / "chat_templates" / f"{template}.jinja").read_text()
    if template != "qwen2_5":
        specials = sorted(set(re.findall(r"<\|[A-Za-z0-9_]+\|>", tok.chat_template)) - set(tok.all_special_tokens))
        tok.add_special_tokens({"additional_special_tokens": specials})
        tok.eos_token = TOOL_TEMPLATES[template][0][0]
    tok.hpcrl_template = template
    return tok


class ScriptedToolGenerator:
    """script_turn behind hpcrl's Generator interface, as the node's engines would answer: a first
    turn's rollouts of a prompt take its variants in turn."""

    def __init__(self, tok):
        self.tok, self.version = tok, 0

    def push_weights(self, model, version: int) -> dict:
        self.version = version
        return {}

    def submit(self, prompts, sampling: Sampling) -> Generated:
        out = []
        for k, p in enumerate(prompts):
            for j in range(sampling.n):
                out.append(self._completion(k, p, j, sampling))
        return Generated(out)

    def _completion(self, index: int, prompt, variant: int, sampling: Sampling) -> Completion:
        turn = script_turn(self.tok.decode(prompt), variant, self.tok.hpcrl_template)
        ids, lps, cut = scripted_ids(self.tok, turn, sampling.max_tokens)
        return Completion(index, tuple(ids), tuple(lps), self.tok.decode(ids, skip_special_tokens=True), cut,
                          self.version)


class ScriptedStreamingGenerator(ScriptedToolGenerator):
    """The same script behind a Stream (the per-sample rollouts'), answering out of order: each take
    returns what was asked since the last, last asked first. ``group``: rollouts per prompt (a
    first turn's variant is its key modulo the group)."""

    def __init__(self, tok, group: int):
        super().__init__(tok)
        self.group = group
        self.seeds: list[tuple[int, int | None]] = []     # (key, seed) of every request, in order

    def open_stream(self):
        gen = self

        class Stream:
            outstanding = 0
            asked: list = []

            def add(self, key, prompt_ids, sampling):
                assert sampling.n == 1
                gen.seeds.append((key, sampling.seed))
                self.asked.append(gen._completion(0, prompt_ids, key % gen.group, sampling))
                self.asked[-1] = (key, self.asked[-1])
                self.outstanding += 1

            def take(self, timeout=None):
                done, self.asked = self.asked[::-1], []
                self.outstanding -= len(done)
                return done

            def close(self):
                assert self.outstanding == 0

        return Stream()


def check_trainer_imports_overlap(rows: list[dict]) -> None:
    """Probe rows: every trainer began importing torch before any had finished (issue #27, item 7: trainer
    rank 0 imported it to open the store while the others waited, and only then did they import theirs)."""
    spans = {r["plan"]["rank"]: r["observed"]["torch_import"] for r in rows if r["plan"]["role"] == "trainer"}
    assert len(spans) >= 2 and all(end > start for start, end in spans.values()), spans
    last_start, first_end = max(s for s, _ in spans.values()), min(e for _, e in spans.values())
    assert last_start < first_end, f"a trainer began importing torch only once another had finished " \
                                   f"(wall-clock spans): {spans}"


def check_probe_transfer(rows: list[dict], bucket_bytes: int = 256 << 20) -> None:
    """Probe rows (issue #27, item 3): every sender moved one bucket (inference.sync_bucket_mb) to each
    engine it syncs over hpcrl_shm, each engine read back the same bytes, and said whose they were."""
    senders = {r["plan"]["rank"]: r for r in rows if r["plan"]["role"] == "trainer" and r["plan"]["sends_to"]}
    assert senders, "no sender among the rows"
    for rank, row in senders.items():
        transfer = row["checks"]["transfer"]
        assert transfer["ran"] and transfer["ok"] and transfer["transport"] == "hpcrl_shm", transfer
        assert [p["server_rank"] for p in transfer["pairs"]] == row["plan"]["sends_to"], transfer
        for pair in transfer["pairs"]:
            assert pair["bytes"] == pair["received"]["bytes"] == bucket_bytes and pair["gb_per_s"] > 0, pair
    for row in rows:
        if row["plan"]["role"] == "server":
            got = row["checks"]["transfer"]
            assert got["ok"] and got["bytes"] == bucket_bytes and got["from"] in senders, got
            assert row["plan"]["rank"] in senders[got["from"]]["plan"]["sends_to"]
        elif row["plan"]["rank"] not in senders:
            assert "transfer" not in row["checks"], row["checks"]
