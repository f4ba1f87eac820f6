"""Tiny Qwen2-architecture causal LMs and a byte-level BPE tokenizer, built locally.

The output is an ordinary Hugging Face model directory (config.json, model.safetensors,
generation_config.json, tokenizer files with a ChatML chat template), so ``AutoModelForCausalLM``,
``AutoTokenizer`` and vLLM load it like any hub checkpoint. Used for tests, the demo and benchmarks;
nothing is downloaded.

    python -m hpcrl.compute.models.tiny OUT_DIR --size small [--seed 0] [--dtype bfloat16] [--warm-up]

Sizes (parameters, embeddings tied): tiny ~1M, small ~10M, medium ~30M, base ~100M, large ~0.5B.

Weights are random unless the model is *warmed up* (``--warm-up``, ``make_tiny_model(...,
warmup=DEMO_WARMUP)``): a short, seeded supervised run on the demo task ("3+4=" -> "7", see
``hpcrl.compute.train.data.demo_dataset``) that stops once the model gives the right answer about 40% of
the time (:class:`WarmUp`). GRPO does not find the sums from random weights in a demo's time, but
it visibly improves such a half-trained model. Recipes name the two kinds ``model.path:
demo:<size>`` (warmed up; the demo's default is "demo:tiny") and ``demo:<size>:random`` (random
weights: the cheapest model where any model will do). The warm-up runs on one CPU core: ~100 steps,
~3 s for tiny, ~15 s for small, ~45 s for medium, minutes for base and large (use ":random" where
only the size matters, e.g. for benchmarks). The agent demo's model (``demo:<size>:agent``) has a
tokenizer and a warm-up of its own (hpcrl.compute.models.tiny_agent).

A warmed-up build is kept in a cache shared by runs ($HPCRL_MODEL_CACHE, else
$XDG_CACHE_HOME/hpcrl/models, i.e. ~/.cache/hpcrl/models; "" turns it off), keyed by the recipe and
by the source of the code that builds it, so that the next run with the same demo model copies a few
megabytes instead of warming up again (the agent demo's warm-up is ~45 s); runs that start together
wait for one warm-up instead of each doing its own. The cache is best effort:
where it cannot be read or written, the model is built in place as without it.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import inspect
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Protocol, Sequence

__all__ = [
    "ModelSpec",
    "SIZES",
    "WarmUpSettings",
    "WarmUp",
    "DEMO_WARMUP",
    "warm_up",
    "VOCAB_SIZE",
    "EOS_TOKEN",
    "PAD_TOKEN",
    "CHAT_TEMPLATE",
    "build_tokenizer",
    "model_config",
    "param_count",
    "make_tiny_model",
    "model_cache_dir",
    "main",
]

# Bump when the tokenizer or config recipe changes (tiny_agent's template and tokenizer too), so that
# existing directories get rebuilt.
RECIPE_VERSION = 1
MARKER = "hpcrl_tiny.json"

# One tokenizer for every size. The vocabulary is small on purpose: a randomly initialised model
# spreads its first samples over the whole vocabulary, and the demo task must hit a digit often
# enough for GRPO to see reward differences from the first step. Byte-level, so no text is lost.
VOCAB_SIZE = 384
MAX_POSITIONS = 2048
PAD_TOKEN = "<|endoftext|>"
BOS_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]

# transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX; isolates every digit.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML, as Qwen2 instruct models use it.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class ModelSpec:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    dtype: str  # of the saved weights

    @property
    def approx_params(self) -> int:
        """Parameter count from the shapes (Qwen2: q/k/v biases, tied embeddings)."""
        h, head = self.hidden_size, self.hidden_size // self.num_attention_heads
        q, kv = self.num_attention_heads * head, self.num_key_value_heads * head
        layer = (h * q + q) + 2 * (h * kv + kv) + q * h + 3 * h * self.intermediate_size + 2 * h
        return VOCAB_SIZE * h + self.num_hidden_layers * layer + h


# Head sizes are 32 or 64: both are supported by vLLM's CPU and GPU attention backends.
SIZES: dict[str, ModelSpec] = {
    "tiny": ModelSpec(128, 4, 4, 2, 512, "float32"),  # 1.03M
    "small": ModelSpec(256, 10, 4, 2, 1024, "float32"),  # 9.9M
    "medium": ModelSpec(512, 10, 8, 2, 1536, "bfloat16"),  # 30.4M
    "base": ModelSpec(768, 12, 12, 4, 3072, "bfloat16"),  # 104M
    "large": ModelSpec(1024, 28, 16, 4, 4864, "bfloat16"),  # 492M, about Qwen2.5-0.5B's layers
}


class WarmUpSettings(Protocol):
    """What make_tiny_model asks of a warm-up's settings, a frozen dataclass whose fields are part of
    the built model's marker: the tokenizer of the model it warms up, and the run itself (it trains
    the model in place and returns what it reached, kept in the marker too)."""

    def tokenizer(self): ...

    def run(self, model, tokenizer, seed: int) -> dict: ...


@dataclass(frozen=True)
class WarmUp:
    """Settings of the supervised warm-up on the demo task: AdamW on clean "a+b=c<eos>" examples
    (loss on the answer and end-of-turn tokens only), stopping at the first check where the mean
    probability of the right answer over every demo prompt reaches ``target``, or after
    ``max_steps``. Seeded (the model's seed) and run on ``threads`` CPU threads, so that the result
    does not depend on the machine's core count. Part of a built model's marker: changed settings
    rebuild the model."""

    target: float = 0.4  # mean P(right answer) over all prompts at which the warm-up stops
    max_steps: int = 2000
    check_every: int = 5  # steps between checks of the target
    batch_size: int = 32
    learning_rate: float = 1e-3
    max_sum: int = 9  # as hpcrl.compute.train.data.demo_dataset's
    threads: int = 1

    # WarmUpSettings
    def tokenizer(self):
        return build_tokenizer()

    def run(self, model, tokenizer, seed: int) -> dict:
        return warm_up(model, tokenizer, self, seed)


# The demo's model ("demo:<size>"): knows the format and is right ~40% of the time, so GRPO has room.
DEMO_WARMUP = WarmUp()


def _merge_corpus() -> list[str]:
    """Text the BPE merges are learnt from: demo prompts, chat roles, tags of common reward formats."""
    words = (
        "What is the sum of and Answer with number only Compute Reverse Copy string question answer "
        "user assistant system You are a helpful <think> </think> <answer> </answer> Let me think step "
        "by so result equals plus minus times The"
    ).split()
    lines = [f"{a}+{b}={a + b}" for a in range(10) for b in range(10)]
    lines += [" ".join(words)] * 20 + [w for w in words for _ in range(5)]
    lines.append("".join(chr(c) for c in range(32, 127)))
    return lines


def build_tokenizer(chat_template: str = CHAT_TEMPLATE, corpus: Sequence[str] = (), added_tokens: Sequence[str] = ()):
    """A byte-level BPE tokenizer of exactly VOCAB_SIZE tokens, with ChatML special tokens.

    Digits are always single tokens (as in Qwen2), so arithmetic answers are one token per digit.
    EOS is ``<|im_end|>`` (end of turn), PAD is ``<|endoftext|>``. A model of another chat format
    (hpcrl.compute.models.tiny_agent) brings its template, more text to learn merges from
    (``corpus``) and ``added_tokens``: whole tokens that are not special (decoding keeps them, as
    Qwen2.5 keeps ``<tool_call>``); they take the place of merges, so the vocabulary stays VOCAB_SIZE.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    # Qwen2's exact pipeline: AutoTokenizer maps model_type "qwen2" to Qwen2Tokenizer, which rebuilds
    # the normalizer and pre-tokenizer from its own code, so anything else would change on reload.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(added_tokens),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_merge_corpus() + list(corpus), trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in added_tokens])
    # Fill up to the model's vocabulary so that every id a random model samples decodes.
    reserved = [f"<|reserved_{i}|>" for i in range(VOCAB_SIZE - tok.get_vocab_size())]
    tok.add_special_tokens(reserved)
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=chat_template,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
    )


def model_config(size: str = "tiny", tokenizer=None):
    """The ``Qwen2Config`` of a size (ids of the special tokens from ``tokenizer`` or a fresh one)."""
    from transformers import Qwen2Config

    spec = _spec(size)
    tokenizer = tokenizer or build_tokenizer()
    return Qwen2Config(
        vocab_size=VOCAB_SIZE,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        dtype=spec.dtype,
        architectures=["Qwen2ForCausalLM"],
    )


def param_count(size: str) -> int:
    """Exact parameter count of a size, from a weightless (meta device) instance."""
    import torch
    from transformers import Qwen2ForCausalLM

    with torch.device("meta"):
        model = Qwen2ForCausalLM(model_config(size))
    return sum(p.numel() for p in model.parameters())


def _spec(size: str) -> ModelSpec:
    if size not in SIZES:
        raise ValueError(f"unknown tiny model size {size!r}; choose one of {', '.join(SIZES)}")
    return SIZES[size]


def _recipe(size: str, seed: int, dtype: str, warmup: WarmUpSettings | None = None) -> dict:
    recipe = {**asdict(_spec(size)), "recipe": RECIPE_VERSION, "size": size, "seed": seed, "dtype": dtype}
    if warmup is not None:
        recipe["warmup"] = asdict(warmup)
    return recipe


# Marker keys that describe the outcome of a build rather than its recipe.
_OUTCOME_KEYS = ("warmup_result",)


def _is_built(out: Path, recipe: dict) -> bool:
    try:
        marker = json.loads((out / MARKER).read_text())
        marker = {k: v for k, v in marker.items() if k not in _OUTCOME_KEYS}
        return marker == recipe and (out / "model.safetensors").is_file()
    except (OSError, ValueError, AttributeError):
        return False


def warm_up(model, tokenizer, settings: WarmUp = DEMO_WARMUP, seed: int = 0) -> dict:
    """Train ``model`` (float32, in place) on the demo task as ``settings`` say; returns
    ``{"steps", "p_correct", "seconds"}``: the steps taken and the mean probability of the right
    answer over every demo prompt at the end."""
    import time

    import torch

    from hpcrl.compute.train.data import demo_pairs

    pairs = demo_pairs(settings.max_sum)
    rows, answer_len = [], []
    for a, b in pairs:
        prompt = tokenizer(f"{a}+{b}=")["input_ids"]  # as the trainer encodes a plain prompt
        answer = tokenizer(str(a + b), add_special_tokens=False)["input_ids"]
        rows.append((prompt, answer + [tokenizer.eos_token_id]))
        answer_len.append(len(answer))
    width = max(len(p) + len(c) for p, c in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id)
    labels = torch.full((len(rows), width), -100)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (prompt, completion) in enumerate(rows):
        n = len(prompt) + len(completion)
        ids[i, :n] = torch.tensor(prompt + completion)
        labels[i, len(prompt):n] = torch.tensor(completion)
        mask[i, :n] = 1
    # Where the answer's tokens (not the end of turn) are predicted from, for P(right answer).
    answer_positions = torch.zeros_like(labels, dtype=torch.bool)
    for i, (prompt, _) in enumerate(rows):
        answer_positions[i, len(prompt) - 1 : len(prompt) - 1 + answer_len[i]] = True

    def p_correct() -> float:
        with torch.no_grad():
            logp = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float().log_softmax(-1)
            targets = ids[:, 1:].clamp(min=0)
            token_logp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * answer_positions[:, :-1]
            return token_logp.sum(1).exp().mean().item()

    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    t0 = time.perf_counter()
    try:
        generator = torch.Generator().manual_seed(seed)
        optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate)
        model.train()
        step, p = 0, p_correct()
        while p < settings.target and step < settings.max_steps:
            batch = torch.randint(len(rows), (settings.batch_size,), generator=generator)
            loss = model(input_ids=ids[batch], attention_mask=mask[batch], labels=labels[batch]).loss
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            step += 1
            if step % settings.check_every == 0 or step == settings.max_steps:
                p = p_correct()
        model.eval()
    finally:
        torch.set_num_threads(threads)
    return {"steps": step, "p_correct": round(p, 4), "seconds": round(time.perf_counter() - t0, 1)}


BUILD_LOCK_TIMEOUT_S = 900.0   # the largest size warms up for minutes on one core


@contextlib.contextmanager
def _build_lock(out: Path, timeout_s: float = BUILD_LOCK_TIMEOUT_S):
    """One builder at a time per directory (the others wait, bounded, then find it built). Where
    the file system has no locks, every caller builds and the atomic rename still keeps the result
    whole. A builder that dies releases the lock with its process."""
    import time

    try:
        import fcntl

        path = out.parent / f".{out.name}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a")
    except (ImportError, OSError):
        yield
        return
    with f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been building {out} for over {timeout_s:.0f} s "
                                       f"(it holds {path})") from None
                time.sleep(0.2)
            except OSError:
                break             # no locks on this file system: build anyway
        yield


def make_tiny_model(
    out_dir: str | os.PathLike,
    size: str = "tiny",
    seed: int = 0,
    dtype: str | None = None,
    warmup: WarmUpSettings | None = None,
) -> Path:
    """Build (or reuse) a model + tokenizer directory and return its path: randomly initialised, or
    warmed up on the demo task with ``warmup`` (e.g. :data:`DEMO_WARMUP`; or another task's settings,
    which bring their own tokenizer: hpcrl.compute.models.tiny_agent.AGENT_WARMUP).

    Idempotent: a directory already built with the same size, seed, dtype and warm-up is left alone.
    The build goes to a temporary sibling that is renamed into place, so concurrent callers (several
    ranks on a shared file system) never see a half-written model; callers on one machine wait for
    the first one's build instead of repeating it. A directory built by us with a different recipe is
    replaced; any other existing non-empty directory is an error, never overwritten.
    """
    spec = _spec(size)
    dtype = dtype or spec.dtype
    out = Path(out_dir)
    recipe = _recipe(size, seed, dtype, warmup)
    if _is_built(out, recipe):
        return out
    if out.exists() and any(out.iterdir()) and not (out / MARKER).exists():
        raise FileExistsError(f"{out} exists and is not a tiny model directory; not overwriting it")
    out.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(out):
        if not _is_built(out, recipe):  # else another caller built it while this one waited
            cached = _cache_entry(recipe, warmup)
            if cached is None:
                _build(out, size, seed, dtype, warmup, recipe)
                return out
            # One warm-up per cache entry on this machine: runs that start together, for other
            # directories, wait for the first one's build and copy it.
            with _build_lock(cached):
                if not _copy_from_cache(cached, out, recipe):
                    _build(out, size, seed, dtype, warmup, recipe)
                    _copy_to_cache(out, cached, recipe)
    return out


CACHE_ENV = "HPCRL_MODEL_CACHE"


def model_cache_dir() -> Path | None:
    """Where warmed-up builds are kept between runs; None where the cache is off (the variable set to "")."""
    if CACHE_ENV in os.environ:
        return Path(os.environ[CACHE_ENV]) if os.environ[CACHE_ENV] else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base, "hpcrl", "models")


def _cache_entry(recipe: dict, warmup: WarmUpSettings | None) -> Path | None:
    """The cache's directory for this recipe, or None (no warm-up: a random model is built in about a
    second; or no cache). The key holds the source of this module and of the warm-up's, so that an
    edited warm-up never hands back a model built by the old one."""
    root = model_cache_dir()
    if warmup is None or root is None:
        return None
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode())
    for module in sorted({__file__, inspect.getfile(type(warmup))}):     # sorted: a set's order is per process
        try:
            key.update(Path(module).read_bytes())
        except OSError:
            return None
    return root / f"{recipe['size']}-{type(warmup).__name__.lower()}-{key.hexdigest()[:20]}"


def _copy_from_cache(cached: Path, out: Path, recipe: dict) -> bool:
    """Copy a cached build into place (atomically, as a build); False where there is none to copy."""
    if not _is_built(cached, recipe):
        return False
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        shutil.copytree(cached, tmp, dirs_exist_ok=True)
        if not _is_built(tmp, recipe):        # the entry changed while it was copied
            return False
        _put_in_place(tmp, out, recipe)
        return True
    except OSError:
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _copy_to_cache(out: Path, cached: Path, recipe: dict) -> None:
    """Best effort: a cache that cannot be written (read-only home on a compute node, a full disk)
    costs the next run a build, nothing more. A damaged entry is replaced."""
    tmp = None
    try:
        if cached.exists() and not _is_built(cached, recipe):
            shutil.rmtree(cached)
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{cached.name}.", dir=cached.parent))
        shutil.copytree(out, tmp, dirs_exist_ok=True)
        os.rename(tmp, cached)          # fails where another run stored it first: theirs is the same
    except OSError:
        pass
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _build(out: Path, size: str, seed: int, dtype: str, warmup: WarmUpSettings | None, recipe: dict) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    marker = dict(recipe)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tokenizer = warmup.tokenizer() if warmup is not None else build_tokenizer()
        config = model_config(size, tokenizer)
        # The caller's random state stays as it was, whether this process builds or another one did.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = Qwen2ForCausalLM(config)  # float32, also while warming up
            if warmup is not None:
                marker["warmup_result"] = warmup.run(model, tokenizer, seed)
        model = model.to(getattr(torch, dtype))
        model.generation_config = GenerationConfig(
            eos_token_id=[tokenizer.eos_token_id, tokenizer.pad_token_id],  # end of turn, end of text
            pad_token_id=tokenizer.pad_token_id,
            do_sample=True,
        )
        with _quiet_progress_bars():
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
        _put_in_place(tmp, out, recipe)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _put_in_place(tmp: Path, out: Path, recipe: dict) -> None:
    """Rename a whole model directory to `out`, replacing one of ours with another recipe."""
    if out.exists():
        if _is_built(out, recipe):  # another process finished first
            return
        shutil.rmtree(out)  # ours (marker checked by make_tiny_model), stale recipe
    try:
        os.rename(tmp, out)
    except OSError:
        if not _is_built(out, recipe):
            raise


@contextlib.contextmanager
def _quiet_progress_bars():
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcrl.compute.models.tiny", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--size", default="tiny", choices=list(SIZES))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None)
    parser.add_argument("--warm-up", action="store_true",
                        help="warm up on the demo task (as model.path demo:<size>) instead of random weights")
    parser.add_argument("--warm-up-target", type=float, default=DEMO_WARMUP.target, metavar="P",
                        help=f"mean P(right answer) at which the warm-up stops (default {DEMO_WARMUP.target})")
    args = parser.parse_args(argv)
    warmup = replace(DEMO_WARMUP, target=args.warm_up_target) if args.warm_up else None
    path = make_tiny_model(args.out_dir, args.size, args.seed, args.dtype, warmup)
    line = f"{path} ({args.size}, {SIZES[args.size].approx_params / 1e6:.1f}M parameters"
    if warmup is not None:
        result = json.loads((path / MARKER).read_text()).get("warmup_result") or {}
        line += (f", warmed up: P(right answer) {result.get('p_correct')} after {result.get('steps')} steps"
                 if result else ", warmed up")
    print(line + ")")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
