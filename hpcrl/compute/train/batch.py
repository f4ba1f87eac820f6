"""A generation's tensors for the trainer's forward passes: prompts and completions packed
(``pack_batch``) and the completion tokens' log-probabilities under a model (``completion_logps``)."""

from __future__ import annotations

import torch

from hpcrl.compute.inference.types import Completion
from hpcrl.compute.train import grpo

__all__ = ["pack_batch", "completion_logps"]


def pack_batch(prompt_ids: list[list[int]], completions: list[Completion], pad_id: int, device,
               mask_truncated: bool = False):
    """prompt (left padded) + completion (right padded) -> tensors for the forward pass. With
    ``mask_truncated`` (grpo.mask_truncated_completions) a completion cut at the length limit is left
    out of attention and loss, as TRL multiplies its completion_mask by ``~is_truncated``."""
    p_len = max(len(p) for p in prompt_ids)
    c_len = max(1, max(len(c.token_ids) for c in completions))
    b = len(completions)
    prompt = torch.full((b, p_len), pad_id, dtype=torch.long)
    p_mask = torch.zeros((b, p_len), dtype=torch.long)
    comp = torch.full((b, c_len), pad_id, dtype=torch.long)
    c_mask = torch.zeros((b, c_len), dtype=torch.long)
    sampling_logps = torch.zeros((b, c_len), dtype=torch.float32)
    for i, (p, c) in enumerate(zip(prompt_ids, completions)):
        prompt[i, p_len - len(p):] = torch.tensor(p)
        p_mask[i, p_len - len(p):] = 1
        if c.token_ids:
            comp[i, :len(c.token_ids)] = torch.tensor(c.token_ids)
            c_mask[i, :len(c.token_ids)] = 0 if mask_truncated and c.truncated else 1
            if c.logprobs:
                sampling_logps[i, :len(c.logprobs)] = torch.tensor(c.logprobs)
    ids = torch.cat([prompt, comp], 1)
    mask = torch.cat([p_mask, c_mask], 1)
    # Positions count real tokens only, as the engines did while sampling (left padding shifts them).
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return {k: v.to(device) for k, v in dict(input_ids=ids, attention_mask=mask, position_ids=positions,
                                             completion_ids=comp, completion_mask=c_mask,
                                             sampling_logps=sampling_logps).items()}


def completion_logps(model, batch: dict, temperature: float, rows=slice(None),
                     chunk_tokens: int = grpo.DEFAULT_LOGPROB_CHUNK_TOKENS, *, return_entropy: bool = False):
    """The completion tokens' log-probabilities under ``model`` for the rows ``rows`` of ``batch``,
    computed ``chunk_tokens`` tokens at a time (trainer.logprob_chunk_tokens); with
    ``return_entropy``, ``(logps, entropies)``."""
    t = batch["completion_ids"].shape[1]
    out = model(input_ids=batch["input_ids"][rows], attention_mask=batch["attention_mask"][rows],
                position_ids=batch["position_ids"][rows], logits_to_keep=t + 1, use_cache=False)
    return grpo.completion_logprobs(out.logits, batch["completion_ids"][rows], temperature,
                                    chunk_tokens=chunk_tokens, return_entropy=return_entropy)
