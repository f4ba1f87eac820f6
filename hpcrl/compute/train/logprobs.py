"""Log-probabilities of sampled tokens under a model's logits, as TRL's GRPOTrainer scores completions.

One job: the per-token log-probabilities (and entropies) of completions, computed in fp32 a chunk of
tokens at a time in forward and backward (:class:`_ChunkedLogprobs`), so that no fp32
``[tokens x vocabulary]`` tensor of all the tokens ever exists. tests/compute/train/test_grpo_math.py holds them
against TRL's ``selective_log_softmax`` and ``entropy_from_logits`` on identical inputs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from hpcrl.job.recipe import TrainerConfig

__all__ = [
    "DEFAULT_LOGPROB_CHUNK_TOKENS",
    "selective_log_softmax",
    "entropy_from_logits",
    "token_logprobs",
    "token_logprobs_unchunked",
    "completion_logprobs",
]

DEFAULT_LOGPROB_CHUNK_TOKENS = TrainerConfig.logprob_chunk_tokens      # the recipe's default


def selective_log_softmax(logits: Tensor, index: Tensor) -> Tensor:
    """``log_softmax(logits)[..., index]`` without materialising the full log-softmax."""
    logz = torch.logsumexp(logits, dim=-1)
    return logits.gather(-1, index.unsqueeze(-1)).squeeze(-1) - logz


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Shannon entropy (nats) of softmax(logits) over the last axis."""
    # -sum p log p rather than logZ - E[z]: no cancellation between two large numbers.
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def _tempered_chunk(logits: Tensor, start: int, t: int, lo: int, hi: int, temperature: float) -> Tensor:
    """The fp32 tempered logits of the scored tokens ``lo..hi`` (flat over ``[B, T]``), ``[hi - lo, V]``.

    Token ``k`` is position ``start + k % t`` of row ``k // t`` of ``logits`` ``[B, L, V]``. Always a
    fresh buffer (never a view of ``logits``), so callers may work in it in place.
    """
    z = torch.empty((hi - lo, logits.shape[-1]), dtype=torch.float32, device=logits.device)
    for row in range(lo // t, (hi - 1) // t + 1):
        a, b = max(lo - row * t, 0), min(hi - row * t, t)
        z[row * t + a - lo : row * t + b - lo].copy_(logits[row, start + a : start + b])
    if temperature != 1.0:
        z.div_(temperature)
    return z


class _ChunkedLogprobs(torch.autograd.Function):
    """Selected-token log-probabilities (and optionally entropies) of ``logits / temperature`` in fp32,
    ``chunk`` tokens at a time, in forward and in backward.

    Autograd over the plain expression keeps the fp32 upcast of every token's logits for
    logsumexp's backward, and chunking it under autograd would not help (each chunk's input is
    saved all the same). So this function keeps for backward only the logits as they came (compute
    dtype, shared with the caller, no copy) and the per-token logsumexp, and its backward recomputes
    the softmax a chunk at a time, writing each chunk's gradient straight into the logits' gradient.

    The backward performs the operations autograd performs on the unchunked expression, in the same
    order: ``(-g) * exp(z - lse)``, then ``+ g`` at the target (the gather's scatter), then ``/ T``,
    then the cast to the logits' dtype; so the gradient of the log-probabilities equals the
    unchunked one, not merely to a tolerance (tests/compute/train/test_grpo_math.py checks it on the CPU). The
    gradient with the entropy's, ``g_lp * onehot - p * (g_H * (log p + H) + g_lp)`` with
    ``log p = z - lse``, is autograd's quantity in another order of operations: equal to rounding.

    ``logits`` is ``[B, L, V]`` and ``ids`` ``[B, T]``: positions ``start .. start + T - 1`` score
    ``ids``. Taking the whole logits tensor with an offset (rather than a slice of it) makes the
    gradient come out in the logits' own shape: a slice would cost autograd a second, zero-padded
    copy of it.
    """

    @staticmethod
    def forward(ctx, logits, ids, start, temperature, chunk, want_entropy):
        b, t = ids.shape
        n = b * t
        flat_ids = ids.reshape(-1, 1)
        logps = torch.empty((b, t), dtype=torch.float32, device=logits.device)
        entropies = torch.empty_like(logps) if want_entropy else None
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        flat_logps = logps.view(-1)
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            z = _tempered_chunk(logits, start, t, lo, hi, temperature)
            lse[lo:hi] = torch.logsumexp(z, dim=-1)
            flat_logps[lo:hi] = z.gather(-1, flat_ids[lo:hi]).squeeze(-1) - lse[lo:hi]
            if want_entropy:
                # entropy_from_logits's own operations, so that the value is the same.
                logp = torch.log_softmax(z, dim=-1)
                del z
                entropies.view(-1)[lo:hi] = -logp.exp().mul_(logp).sum(-1)
                del logp
        ctx.set_materialize_grads(False)
        ctx.start, ctx.temperature, ctx.chunk = start, temperature, chunk
        ctx.save_for_backward(logits, ids, lse, entropies)
        return (logps, entropies) if want_entropy else logps

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logps, grad_entropies=None):
        logits, ids, lse, entropies = ctx.saved_tensors
        start, temperature, chunk = ctx.start, ctx.temperature, ctx.chunk
        b, t = ids.shape
        n = b * t
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        grad[:, :start].zero_()
        grad[:, start + t :].zero_()
        flat_ids = ids.reshape(-1, 1)
        flat_ent = None if entropies is None else entropies.reshape(-1, 1)
        g_lp = None if grad_logps is None else grad_logps.reshape(-1, 1).float()
        g_ent = None if grad_entropies is None else grad_entropies.reshape(-1, 1).float()
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            z = _tempered_chunk(logits, start, t, lo, hi, temperature)
            z.sub_(lse[lo:hi, None])
            if g_ent is None:
                gz = z.exp_().mul_(-g_lp[lo:hi])
            else:
                p = z.exp()
                z.add_(flat_ent[lo:hi]).mul_(g_ent[lo:hi])
                if g_lp is not None:
                    z.add_(g_lp[lo:hi])
                gz = z.neg_().mul_(p)
                del p
            if g_lp is not None:
                gz.scatter_add_(-1, flat_ids[lo:hi], g_lp[lo:hi])
            if temperature != 1.0:
                gz.div_(temperature)
            for row in range(lo // t, (hi - 1) // t + 1):
                a, e = max(lo - row * t, 0), min(hi - row * t, t)
                grad[row, start + a : start + e].copy_(gz[row * t + a - lo : row * t + e - lo])
            del z, gz
        return grad, None, None, None, None, None


def _check_logprob_args(temperature: float, chunk_tokens: int) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be at least 1, got {chunk_tokens}")


def _chunked(logits, ids, start, temperature, chunk_tokens, return_entropy):
    return _ChunkedLogprobs.apply(logits, ids, start, float(temperature), int(chunk_tokens), return_entropy)


def token_logprobs(
    logits: Tensor,
    ids: Tensor,
    temperature: float = 1.0,
    *,
    return_entropy: bool = False,
    chunk_tokens: int = DEFAULT_LOGPROB_CHUNK_TOKENS,
) -> Tensor | tuple[Tensor, Tensor]:
    """Log-probabilities of ``ids`` under ``logits / temperature``, as TRL scores completions.

    TRL's fused LM head upcasts the logits to float32 *before* dividing by the sampling temperature,
    so that the scores match what the sampler (vLLM) drew from; we do the same. With
    ``return_entropy`` also returns the entropy of the tempered distribution (TRL's ``entropy`` metric).

    The fp32 work is done ``chunk_tokens`` tokens at a time, forward and backward (see
    :class:`_ChunkedLogprobs`): no fp32 ``[tokens x vocabulary]`` tensor of all the tokens ever
    exists, and the values equal :func:`token_logprobs_unchunked`'s.
    """
    _check_logprob_args(temperature, chunk_tokens)
    if logits.dim() < 2 or ids.shape != logits.shape[:-1]:
        raise ValueError(f"ids of shape {tuple(ids.shape)} for logits of shape {tuple(logits.shape)}")
    lead = ids.shape
    if logits.dim() == 2:
        logits, ids = logits.unsqueeze(0), ids.unsqueeze(0)
    elif logits.dim() != 3:
        logits, ids = logits.reshape(-1, *logits.shape[-2:]), ids.reshape(-1, ids.shape[-1])
    out = _chunked(logits, ids, 0, temperature, chunk_tokens, return_entropy)
    if return_entropy:
        return out[0].view(lead), out[1].view(lead)
    return out.view(lead)


def token_logprobs_unchunked(
    logits: Tensor, ids: Tensor, temperature: float = 1.0, *, return_entropy: bool = False
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`token_logprobs` as one autograd expression over all the tokens at once (TRL's form).

    The reference that the chunked computation is tested and benchmarked against: it upcasts every
    token's logits to fp32 and autograd keeps ``[tokens x vocabulary]`` fp32 tensors for backward.
    """
    _check_logprob_args(temperature, 1)
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    logps = selective_log_softmax(z, ids)
    if not return_entropy:
        return logps
    return logps, entropy_from_logits(z)


def completion_logprobs(
    logits: Tensor,
    completion_ids: Tensor,
    temperature: float = 1.0,
    *,
    return_entropy: bool = False,
    chunk_tokens: int = DEFAULT_LOGPROB_CHUNK_TOKENS,
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`token_logprobs` of the completion from the logits of the whole ``prompt + completion``.

    The logit at position ``i`` predicts token ``i + 1``, so the ``T`` completion tokens are scored by
    the ``T`` positions before the last one. ``logits`` may already be cut to the last ``T + 1``
    positions (HF ``logits_to_keep=T + 1``).
    """
    _check_logprob_args(temperature, chunk_tokens)
    b, t = completion_ids.shape
    if logits.dim() != 3 or logits.shape[0] != b or logits.shape[1] < t + 1:
        raise ValueError(f"logits of shape {tuple(logits.shape)} cannot score completions of shape {(b, t)}: "
                         f"[B, at least T + 1, vocabulary] needed")
    return _chunked(logits, completion_ids, logits.shape[1] - t - 1, temperature, chunk_tokens, return_entropy)

