"""A transformers engine: the fallback where vLLM is not installed (a laptop, a cluster without a
vLLM build), and the in-process generator of the trainer's tests. It generates with one Sampling a
call and takes weights as tensors (load_weights) over the node channel (sync/channel_sync.py), where vLLM
takes them through its weight-transfer API."""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Sequence

import torch

from hpcrl.compute.inference.engine import InferenceEngine, SyncPeer
from hpcrl.compute.inference.types import Completion, Sampling
from hpcrl.job.recipe import engine_dtype


class TransformersEngine(InferenceEngine):
    name = "transformers"
    # One call draws from one random stream seeded per call, and lives in the server's process.
    per_prompt_sampling = False
    own_processes = False

    def __init__(self, model_dir: str, device: str = "cpu", dtype: str = "auto", seed: int = 0, *,
                 tokenizer: str = "", trust_remote_code: bool = False, attn_implementation: str = ""):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch_dtype, trust_remote_code=trust_remote_code,
            attn_implementation=attn_implementation or None).to(device).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or model_dir, trust_remote_code=trust_remote_code)
        self.device = torch.device(device)
        self.version = 0
        self._seed = seed
        self._calls = 0
        self._params = dict(self.model.named_parameters())
        self._tied = bool(getattr(self.model.config, "tie_word_embeddings", False))
        eos = self.model.generation_config.eos_token_id
        eos = eos if isinstance(eos, (list, tuple)) else [eos if eos is not None else self.tokenizer.eos_token_id]
        self.stop_tokens = tuple(t for t in eos if t is not None)

    @classmethod
    def for_server(cls, ctx, model_dir: str, errors_log=None) -> "TransformersEngine":
        inf, model = ctx.spec.recipe.inference, ctx.spec.recipe.model
        return cls(model_dir, device="cuda" if ctx.device == "cuda" else "cpu",
                   dtype=engine_dtype(inf.dtype, model.dtype), seed=ctx.spec.recipe.grpo.seed,
                   tokenizer=model.tokenizer, trust_remote_code=model.trust_remote_code,
                   attn_implementation=model.attn_implementation)

    @classmethod
    def trainer_sync(cls, model, peer: SyncPeer):
        """Buckets as tensors over the node channel, in the engine's dtype."""
        from hpcrl.compute.sync.channel_sync import ChannelWeightSync

        inf = peer.ctx.spec.recipe.inference
        return ChannelWeightSync(model, peer.request or _no_request, is_sender=peer.request is not None,
                                 bucket_bytes=inf.sync_bucket_mb << 20, timeout_s=inf.request_timeout_s,
                                 wire_dtype=peer.wire_dtype(), node_of_rank=peer.node_of_rank)

    def weight_receiver(self):
        from hpcrl.compute.sync.channel_sync import ChannelReceiver

        return ChannelReceiver(self)

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling | Sequence[Sampling]) -> list[Completion]:
        if isinstance(sampling, Sampling):
            return self._generate(prompts, sampling)
        # One call per run of prompts with the same setting (one Sampling a call).
        completions: list[Completion] = []
        start = 0
        while start < len(prompts):
            end = start + 1
            while end < len(prompts) and sampling[end] == sampling[start]:
                end += 1
            completions += [replace(c, prompt_index=c.prompt_index + start)
                            for c in self._generate(prompts[start:end], sampling[start])]
            start = end
        return completions

    @torch.no_grad()
    def _generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[Completion]:
        tok = self.tokenizer
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        width = max(len(p) for p in prompts)
        # Left padding: generation continues every row from the same position.
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(list(p))
            mask[i, width - len(p):] = 1
        self._calls += 1
        # A request's own seed alone decides its samples (the trainer makes one per step and rank), so
        # that a resumed trainer or a restarted engine samples what the first did; without one, the
        # engine's seed and its call count.
        seed = sampling.seed if sampling.seed is not None else self._seed * 1_000_003 + self._calls
        greedy = sampling.temperature == 0
        kwargs = dict(do_sample=not greedy, temperature=None if greedy else sampling.temperature,
                      top_p=None if greedy else sampling.top_p, top_k=None if greedy else sampling.top_k,
                      min_p=None if greedy else sampling.min_p, repetition_penalty=sampling.repetition_penalty,
                      max_new_tokens=sampling.max_tokens, num_return_sequences=sampling.n,
                      pad_token_id=pad, eos_token_id=list(self.stop_tokens))
        kwargs.update(sampling.generation_kwargs or {})     # TRL's: over the settings above
        if sampling.structured_outputs_regex is not None:
            raise ValueError("grpo.vllm_structured_outputs_regex: structured outputs need the vLLM engine "
                             "(inference.engine: vllm); the transformers engine samples free text")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=mask.to(self.device),
                output_scores=True, return_dict_in_generate=True, **kwargs)
        new = out.sequences[:, width:].cpu()
        # `scores` are the processed logits (after temperature/top-k/top-p): the sampling distribution.
        logp = torch.stack(out.scores, dim=1).float().log_softmax(-1).cpu() if out.scores else None
        completions = []
        for row in range(new.shape[0]):
            tokens = new[row].tolist()
            end = next((i + 1 for i, t in enumerate(tokens) if t in self.stop_tokens), None)
            kept = tokens[:end] if end else tokens
            lps = [float(logp[row, i, t]) for i, t in enumerate(kept)] if logp is not None else []
            completions.append(Completion(row // sampling.n, tuple(kept), tuple(lps),
                                          tok.decode(kept, skip_special_tokens=True), end is None, self.version))
        return completions

    @property
    def dtype(self) -> str | None:
        """The one dtype of the model's floating parameters ("bfloat16"), which the trainers send
        weights in; None when they differ (a module kept in fp32), so nothing is rounded."""
        dtypes = {p.dtype for p in self._params.values() if p.is_floating_point()}
        return str(dtypes.pop()).removeprefix("torch.") if len(dtypes) == 1 else None

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named_tensors:
            if self._tied and name == "lm_head.weight":
                continue
            self._params[name].copy_(tensor)

    def set_version(self, version: int) -> None:
        self.version = version

    def close(self) -> None:
        """Nothing to stop: the model lives in this process."""


def _no_request(msg: dict, timeout: float) -> dict:
    raise AssertionError(f"{msg.get('op')!r}: a trainer that feeds no engine in this sync round sends nothing")
