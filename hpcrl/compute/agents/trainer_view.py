"""What a TRL rollout function gets as its ``trainer`` (GRPOTrainer's ``rollout_func(prompts, trainer)``)
when hpcrl calls it: the attributes such functions read, and generation through the node's engines in
the forms TRL's vLLM server mode offers (``trainer.vllm_generation.vllm_client.generate`` and ``.chat``,
``trainer.vllm_generation.generate``), with the same arguments and the same return shapes.

Generation goes through hpcrl's Generator (the node's engines, which hold the policy's weights); the
requests of one rollout call go one at a time (a function may generate from several threads) and the
weight versions of their completions are recorded, token by token, to stamp the rows the function
returns (EngineCalls.stamp). Whatever else a function reaches for (``trainer.model``,
``trainer.accelerator``, ``trainer.state``, vLLM's colocated ``llm``, ...) is one AttributeError that
names what hpcrl offers.
"""

from __future__ import annotations

import threading
from contextlib import nullcontext
from dataclasses import dataclass, fields, replace
from typing import Any, Sequence

from hpcrl.compute.agents.rollout import round_seed, token_versions
from hpcrl.compute.inference.types import Completion, Generator, Sampling

__all__ = ["ClientSampling", "EngineCalls", "EngineClient", "EngineGeneration", "TrainerView", "TrainingArgs"]

TRAINER_OFFERS = ("processing_class", "args", "num_generations", "num_generations_eval", "max_completion_length",
                  "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "chat_template_kwargs", "tools",
                  "chat_template", "use_vllm", "vllm_mode", "vllm_generation")


class EngineCalls:
    """The node's engines as one rollout call reaches them: a request at a time, each with a seed of
    its own (derived from the call's, so a resumed run samples the same), and the weight versions of
    every completion handed out since the call began, and each one's tokens with theirs."""

    def __init__(self, generator: Generator):
        self.generator = generator
        self.lock = threading.Lock()
        self.sampling: Sampling | None = None
        self.requests = 0
        self.versions: set[int] = set()
        self.sampled: dict[tuple[int, ...], tuple[int, ...]] = {}     # token ids -> each one's version

    def begin(self, sampling: Sampling) -> None:
        """A rollout call starts: ``sampling`` is the loop's (the recipe's grpo fields, the call's seed)."""
        self.sampling, self.requests, self.versions, self.sampled = sampling, 0, set(), {}

    def stamp(self, ids: Sequence[int], mask: Sequence[int]) -> tuple[int, ...] | None:
        """Each token's weight version in a row the function returned, where every run of its model
        tokens (``mask`` 1) is a completion handed out in this call, as it was handed out; the
        environment's tokens take the version of the model's before them. None where that is not so
        (the function cut or changed what the engines sampled): which weights sampled each token is
        then unknown."""
        out: list[int] = []
        i = 0
        while i < len(ids):
            j = i
            while j < len(ids) and mask[j] == mask[i]:
                j += 1
            if mask[i]:
                versions = self.sampled.get(tuple(ids[i:j]))
                if versions is None:
                    return None
                out += versions
            elif out:
                out += [out[-1]] * (j - i)
            else:
                return None         # the environment's tokens first: no version to give them
            i = j
        return tuple(out)

    def generate(self, prompt_ids: Sequence[Sequence[int]], **changes: Any) -> list[Completion]:
        """``n`` completions of each prompt, grouped by prompt; ``changes``: the call's Sampling fields replaced."""
        if not prompt_ids:
            return []
        with self.lock:
            seed = round_seed(self.sampling.seed, self.requests)
            self.requests += 1
            out = self.generator.submit([list(p) for p in prompt_ids],
                                        replace(self.sampling, seed=seed, **changes)).result()
            for c in out:
                versions = tuple(token_versions(c))
                self.versions.update(versions or (c.weight_version,))
                # The same tokens sampled again under other weights: the older version, token by
                # token (staleness is never undercounted).
                seen = self.sampled.get(tuple(c.token_ids), versions)
                self.sampled[tuple(c.token_ids)] = tuple(map(min, seen, versions))
        return sorted(out, key=lambda c: c.prompt_index)       # stable: a prompt's n keep their order


def _token_ids(where: str, prompt: Any, index: int) -> list[int]:
    """A prompt of token ids as a list of ints, or a TypeError naming it (here, not as the engine's
    failure: a tokenizer's BatchEncoding passed on whole is a list of its keys)."""
    try:
        return [int(t) for t in prompt]
    except (TypeError, ValueError):
        raise TypeError(f"{where}: prompts[{index}] is neither a text nor a list of token ids: "
                        f"{type(prompt).__name__} {prompt!r:.60}") from None


def _unsupported(where: str, what: str, why: str = "") -> ValueError:
    return ValueError(f"{where}: {what} is not supported by hpcrl's engines{why}")


def _shaped(prompt_ids: list[list[int]], out: list[Completion], logprobs: int | None) -> dict[str, Any]:
    """TRL's VLLMClient return value: per-token log-probabilities as [[sampled token's]] (logprobs=0)."""
    return {"prompt_ids": prompt_ids, "completion_ids": [list(c.token_ids) for c in out],
            "logprobs": None if logprobs is None else [[[lp] for lp in c.logprobs] for c in out],
            "logprob_token_ids": None if logprobs is None else [[[t] for t in c.token_ids] for c in out]}


@dataclass(frozen=True)
class ClientSampling:
    """The sampling arguments of TRL's VLLMClient.generate and .chat, with the client's defaults."""
    n: int = 1
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 16
    logprobs: int | None = 0
    structured_outputs_regex: str | None = None
    generation_kwargs: dict | None = None

    @classmethod
    def of(cls, where: str, arguments: dict[str, Any]) -> "ClientSampling":
        unknown = sorted(set(arguments) - {f.name for f in fields(cls)})
        if unknown:
            raise TypeError(f"{where}() got an unexpected keyword argument {unknown[0]!r}")
        return cls(**arguments)


class EngineClient:
    """``trainer.vllm_generation.vllm_client``: TRL's VLLMClient (server mode) over the node's engines,
    its sampling arguments (ClientSampling) by keyword. Its defaults are the client's own
    (max_tokens=16, temperature=1.0, ...), as in TRL."""

    def __init__(self, engines: EngineCalls, tokenizer):
        self.engines, self.tokenizer = engines, tokenizer

    def generate(self, prompts: list[str] | list[list[int]], features: list | None = None,
                 **sampling: Any) -> dict[str, Any]:
        """Texts or token ids -> ``n`` completions of each, as VLLMClient.generate returns them. A text is
        tokenised as vLLM's completions endpoint does it (with the tokenizer's special tokens)."""
        where = "trainer.vllm_generation.vllm_client.generate"
        if features is not None:
            raise _unsupported(where, "features= (multimodal prompts)")
        ids = [self.tokenizer(p)["input_ids"] if isinstance(p, str) else _token_ids(where, p, i)
               for i, p in enumerate(prompts)]
        return self._sample(where, ids, ClientSampling.of(where, sampling))

    def chat(self, messages: list[list[dict]], chat_template_kwargs: dict | None = None, tools: list | None = None,
             chat_template: str | None = None, max_concurrent_requests: int = 64, **sampling: Any) -> dict[str, Any]:
        """Conversations -> ``n`` completions of each, as VLLMClient.chat returns them: each rendered with
        the tokenizer's chat template and the assistant's header, as vLLM's chat endpoint renders it.
        (``max_concurrent_requests`` bounds the client's HTTP requests; the engines take them in one.)"""
        where = "trainer.vllm_generation.vllm_client.chat"
        ids = []
        for conversation in messages:
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True,
                                                      tools=tools or None, chat_template=chat_template,
                                                      **(chat_template_kwargs or {}))
            ids.append(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        return self._sample(where, ids, ClientSampling.of(where, sampling))

    def _sample(self, where: str, ids: list[list[int]], asked: ClientSampling) -> dict[str, Any]:
        if asked.structured_outputs_regex is not None:
            raise _unsupported(where, "structured_outputs_regex=")
        if asked.logprobs not in (0, None):
            raise _unsupported(where, f"logprobs={asked.logprobs}", " (they return the sampled token's "
                                                                    "log-probability only: logprobs=0)")
        out = self.engines.generate(ids, n=asked.n, max_tokens=asked.max_tokens, temperature=asked.temperature,
                                    top_p=asked.top_p, top_k=asked.top_k, min_p=asked.min_p or None,
                                    repetition_penalty=asked.repetition_penalty,
                                    generation_kwargs=asked.generation_kwargs or None)
        return _shaped(ids, out, asked.logprobs)


class EngineGeneration:
    """``trainer.vllm_generation``: TRL's VLLMGeneration over the node's engines: ``generate`` samples
    as the trainer's own generation does (the recipe's grpo fields), ``vllm_client`` is the client."""

    def __init__(self, engines: EngineCalls, tokenizer):
        self.engines = engines
        self.vllm_client = EngineClient(engines, tokenizer)

    def generate(self, prompts: list[list[int]], images: list | None, num_generations: int,
                 profiler=None) -> tuple[list, list, list, list]:
        """Token ids, each prompt ``num_generations`` times in a row (TRL's RepeatSampler layout) ->
        (prompt_ids, completion_ids, logprobs, logprob_token_ids), one row per completion, as
        VLLMGeneration.generate returns them."""
        where = "trainer.vllm_generation.generate"
        if images is not None and any(i is not None for i in images):
            raise _unsupported(where, "images=")
        if len(prompts) % num_generations:
            raise ValueError(f"{where}: {len(prompts)} prompts are not groups of num_generations={num_generations} "
                             f"(each prompt num_generations times in a row)")
        unique = [_token_ids(where, p, i * num_generations) for i, p in enumerate(prompts[::num_generations])]
        with profiler or nullcontext():
            out = self.engines.generate(unique, n=num_generations)
        shaped = _shaped([p for p in unique for _ in range(num_generations)], out, 0)
        return shaped["prompt_ids"], shaped["completion_ids"], shaped["logprobs"], shaped["logprob_token_ids"]

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"trainer.vllm_generation.{name}: hpcrl's engines run in their own processes and "
                             f"take the policy's weights from the trainers; a rollout function may call "
                             f"trainer.vllm_generation.generate and trainer.vllm_generation.vllm_client's generate "
                             f"and chat")


class TrainingArgs:
    """``trainer.args``: the recipe's grpo section, TRL's GRPOConfig fields by their names."""

    def __init__(self, grpo):
        self._grpo = grpo

    def __getattr__(self, name: str):
        if name.startswith("_"):        # copy and pickle probe for hooks before __init__ has run
            raise AttributeError(name)
        try:
            return getattr(self._grpo, name)
        except AttributeError:
            raise AttributeError(f"trainer.args.{name}: not a field of hpcrl's grpo section (TRL's GRPOConfig "
                                 f"fields hpcrl implements; `hpcrl recipe` lists them)") from None


class TrainerView:
    """What a rollout function gets as ``trainer``: TRL's GRPOTrainer attributes of the same names,
    from the recipe's grpo section (``grpo``) and the run's tokenizer; generation through the node's
    engines as TRL's server mode does it (``use_vllm``, ``vllm_mode == "server"``)."""

    use_vllm = True
    vllm_mode = "server"

    def __init__(self, tokenizer, grpo, engines: EngineCalls, tools: list[dict] | None = None,
                 chat_template: str | None = None):
        self.processing_class = tokenizer
        # Beside agent.tools: the tools' JSON schemas, which apply_chat_template(tools=) and the client's
        # chat(tools=) take as they take TRL's functions (the functions live in the tool workers), and
        # the template they are rendered with where the tokenizer's is not prefix-preserving (TRL's
        # training template); None and None without tools, as GRPOTrainer's.
        self.tools = tools or None
        self.chat_template = chat_template
        self.args = TrainingArgs(grpo)
        self.num_generations = grpo.num_generations
        self.num_generations_eval = grpo.num_generations_eval or grpo.num_generations
        self.max_completion_length = grpo.max_completion_length
        self.temperature, self.top_p, self.top_k = grpo.temperature, grpo.top_p, grpo.top_k
        self.min_p, self.repetition_penalty = grpo.min_p, grpo.repetition_penalty
        self.chat_template_kwargs = grpo.chat_template_kwargs or {}
        self.vllm_generation = EngineGeneration(engines, tokenizer)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(f"trainer.{name}: hpcrl calls a rollout function beside its own trainer, and the "
                             f"`trainer` it gets offers only {', '.join(TRAINER_OFFERS)}")
