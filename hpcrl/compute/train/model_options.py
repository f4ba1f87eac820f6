"""The GRPO options that change the policy module itself, whichever engine holds it: dropout switched
off (grpo.disable_dropout) and NEFTune's noisy input embeddings (grpo.neftune_noise_alpha)."""

from __future__ import annotations

from typing import Optional

from torch import nn

from hpcrl.job.grpo_config import GRPOConfig

# The handle of the NEFTune hook, kept on the model so that applying the options again (another
# Trainer of the same policy) replaces it instead of adding a second one, and so that a run without
# NEFTune never asks the model for its embeddings (a remote-code model may not say).
_NEFTUNE_HANDLE = "_hpcrl_neftune_handle"


def apply(policy: nn.Module, reference: Optional[nn.Module], grpo: GRPOConfig) -> None:
    """grpo.disable_dropout on policy and reference; grpo.neftune_noise_alpha on the policy."""
    if grpo.disable_dropout:
        for model in (policy, reference):
            if model is not None:
                disable_dropout(model)
    set_neftune(policy, grpo.neftune_noise_alpha)


def disable_dropout(model: nn.Module) -> None:
    """grpo.disable_dropout: every dropout module's p set to 0 (TRL's disable_dropout_in_model)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0


def set_neftune(model: nn.Module, alpha: Optional[float]) -> None:
    """NEFTune as transformers' Trainer adds it for TRL (its own hook, on the module
    ``get_input_embeddings()`` returns): while the module is in training mode, its output gets
    uniform noise in +-alpha / sqrt(L x d) (L the forward's sequence length, d the hidden size).

    The policy trains in training mode, so the loss and the log-probabilities of the policy that
    sampled (num_iterations > 1, the importance-sampling correction) see the noise, as in TRL. The
    reference does not: a model of its own, or with LoRA the policy switched to eval mode for the
    reference's forward (hpcrl.compute.train.lora.BaseModel). The engines generate without it, as
    vLLM does under TRL. ``alpha`` None removes the hook."""
    handle = getattr(model, _NEFTUNE_HANDLE, None)
    if handle is not None:
        handle.remove()
        delattr(model, _NEFTUNE_HANDLE)
    if alpha is None:
        return
    from transformers.integrations.neftune import neftune_post_forward_hook

    embeddings = model.get_input_embeddings()
    embeddings.neftune_noise_alpha = alpha
    setattr(model, _NEFTUNE_HANDLE, embeddings.register_forward_hook(neftune_post_forward_hook))
