"""A generation's tensors for the trainer's forward passes: prompts and completions packed
(``pack_batch``, ``truncated_mask``) and the completion tokens' log-probabilities under a model
(``completion_logps``, ``micro_batched_logps``, ``policy_forward``)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from hpcrl.compute.inference.types import Completion
from hpcrl.compute.train import logprobs

__all__ = ["pack_batch", "truncated_mask", "completion_logps", "micro_batched_logps", "policy_forward",
           "router_aux_coef"]


def pack_batch(prompt_ids: list[list[int]], completions: list[Completion], pad_id: int, device,
               mask_truncated: bool = False):
    """prompt (left padded) + completion (right padded) -> tensors for the forward pass. With
    ``mask_truncated`` (grpo.mask_truncated_completions) a completion cut at the length limit is left
    out of attention and loss, as TRL multiplies its completion_mask by ``~is_truncated``.

    ``loss_mask`` is the completion mask less the tokens a tool's result put in a multi-turn rollout
    (Completion.tool_mask 0): they are attended to, but take no loss (TRL's completion_mask * tool_mask)."""
    p_len = max(len(p) for p in prompt_ids)
    c_len = max(1, max(len(c.token_ids) for c in completions))
    b = len(completions)
    prompt = torch.full((b, p_len), pad_id, dtype=torch.long)
    p_mask = torch.zeros((b, p_len), dtype=torch.long)
    comp = torch.full((b, c_len), pad_id, dtype=torch.long)
    c_mask = torch.zeros((b, c_len), dtype=torch.long)
    sampling_logps = torch.zeros((b, c_len), dtype=torch.float32)
    tool_mask = torch.ones((b, c_len), dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompt_ids, completions)):
        prompt[i, p_len - len(p):] = torch.tensor(p)
        p_mask[i, p_len - len(p):] = 1
        if c.token_ids:
            comp[i, :len(c.token_ids)] = torch.tensor(c.token_ids)
            c_mask[i, :len(c.token_ids)] = 0 if mask_truncated and c.truncated else 1
            if c.logprobs:
                sampling_logps[i, :len(c.logprobs)] = torch.tensor(c.logprobs)
            if c.tool_mask is not None:
                tool_mask[i, :len(c.tool_mask)] = torch.tensor(c.tool_mask)
    ids = torch.cat([prompt, comp], 1)
    mask = torch.cat([p_mask, c_mask], 1)
    # Positions count real tokens only, as the engines did while sampling (left padding shifts them).
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return {k: v.to(device) for k, v in dict(input_ids=ids, attention_mask=mask, position_ids=positions,
                                             completion_ids=comp, completion_mask=c_mask, loss_mask=c_mask * tool_mask,
                                             sampling_logps=sampling_logps).items()}


def truncated_mask(
    completion_ids: Sequence[Sequence[int]], stop_token_ids: Iterable[int], device: torch.device | str | None = None
) -> torch.Tensor:
    """``[B]`` bool: True where a completion does not end in a stop token (EOS or pad), i.e. was cut at
    the length limit. With ``mask_truncated_completions`` TRL multiplies ``completion_mask`` by
    ``~truncated`` (for attention and loss) *before* counting ``num_items_in_batch``."""
    stops = set(stop_token_ids)
    return torch.tensor([len(ids) > 0 and ids[-1] not in stops for ids in completion_ids], device=device)


def completion_logps(model, batch: dict, temperature: float, rows=slice(None),
                     chunk_tokens: int = logprobs.DEFAULT_LOGPROB_CHUNK_TOKENS, *, return_entropy: bool = False):
    """The completion tokens' log-probabilities under ``model`` for the rows ``rows`` of ``batch``,
    computed ``chunk_tokens`` tokens at a time (trainer.logprob_chunk_tokens); with
    ``return_entropy``, ``(logps, entropies)``."""
    out = policy_forward(model, batch, temperature, rows, chunk_tokens, entropy=return_entropy)
    return (out.logps, out.entropies) if return_entropy else out.logps


def micro_batched_logps(model, batch: dict, temperature: float, micro: int,
                        chunk_tokens: int = logprobs.DEFAULT_LOGPROB_CHUNK_TOKENS) -> torch.Tensor:
    """``completion_logps`` of every row, ``micro`` rows at a time (the training micro-batch): the
    activations and logits of a whole generation at once would outgrow those of a training
    micro-batch, which is what the job's memory is sized for (hpcrl.job.memory)."""
    rows = batch["input_ids"].shape[0]
    return torch.cat([completion_logps(model, batch, temperature, slice(start, start + micro), chunk_tokens)
                      for start in range(0, rows, micro)])


@dataclass
class PolicyOutput:
    logps: torch.Tensor
    entropies: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None        # a mixture of experts' load-balancing loss (router_aux)


def policy_forward(model, batch: dict, temperature: float, rows=slice(None),
                   chunk_tokens: int = logprobs.DEFAULT_LOGPROB_CHUNK_TOKENS, *, entropy: bool = False,
                   router_aux: bool = False) -> PolicyOutput:
    """The training forward of ``rows``: completion log-probabilities, with ``entropy`` the
    entropies, with ``router_aux`` the model's own load-balancing loss of its routers over the rows'
    tokens (transformers' load_balancing_loss_func: what TRL adds to the loss of a MoE model)."""
    t = batch["completion_ids"].shape[1]
    extra = {"output_router_logits": True} if router_aux else {}
    out = model(input_ids=batch["input_ids"][rows], attention_mask=batch["attention_mask"][rows],
                position_ids=batch["position_ids"][rows], logits_to_keep=t + 1, use_cache=False, **extra)
    logps = logprobs.completion_logprobs(out.logits, batch["completion_ids"][rows], temperature,
                                         chunk_tokens=chunk_tokens, return_entropy=entropy)
    logps, entropies = logps if entropy else (logps, None)
    return PolicyOutput(logps, entropies, out.aux_loss if router_aux else None)


def router_aux_coef(model, asked: float | None) -> float:
    """The weight of a MoE model's load-balancing loss in the GRPO loss, as TRL decides it:
    grpo.router_aux_loss_coef, else the architecture's own (config.router_aux_loss_coef); 0 for a
    model without routers (no output_router_logits in its config)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if not hasattr(config, "output_router_logits"):
        if asked:
            raise ValueError(f"grpo.router_aux_loss_coef is {asked}, but {type(model).__name__} is not a "
                             f"mixture-of-experts model (it has no routers)")
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if asked is None else float(asked)
