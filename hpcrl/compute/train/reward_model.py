"""A Hugging Face sequence-classification model as a reward function (TRL's
reward_model_name_or_path, or a model's path in reward_funcs; recipe ``rewards[i].model``).

As TRL scores with one: the prompt and completion joined (through the reward model's own chat
template for conversational data), tokenized by the reward model's tokenizer without special tokens,
right padded; the reward is the first logit. Unlike TRL, the model is not on every GPU whole: it is
sharded over the trainers with FSDP2 like the reference model, stored and computed in the
reference's dtype, so every trainer must call it with the same number of micro-batches (a forward
is a collective): the trainer scores equal counts of completions on every rank.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from hpcrl.compute.train.data import is_conversational
from hpcrl.compute.train.rewards import completion_text
from hpcrl.job.recipe import Recipe


class RewardModel:
    def __init__(self, model: nn.Module, tokenizer, device: torch.device, micro_batch: int, name: str):
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.micro_batch = micro_batch
        self.__name__ = name            # TRL names a reward model's metrics after its directory

    def texts(self, prompts: list, completions: list) -> list[str]:
        if prompts and is_conversational(prompts[0]):
            return [self.tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions)]
        return [p + completion_text(c) for p, c in zip(prompts, completions)]

    @torch.no_grad()
    def __call__(self, prompts: list, completions: list, **kwargs) -> list[float]:
        texts = self.texts(prompts, completions)
        out: list[float] = []
        for start in range(0, len(texts), self.micro_batch):
            inputs = self.tokenizer(texts[start:start + self.micro_batch], return_tensors="pt", padding=True,
                                    padding_side="right", add_special_tokens=False).to(self.device)
            out += self.model(**inputs).logits[:, 0].float().tolist()
        return out


def load_reward_model(path: str, mesh, device: torch.device, recipe: Recipe, name: str | None = None) -> RewardModel:
    """``path`` sharded on ``mesh`` as the reference model is (every trainer calls this together).
    ``name``: what its metrics are called, as TRL names a reward model (the last part of the
    directory or hub id the recipe gave); default: ``path``'s."""
    from transformers import AutoTokenizer

    from hpcrl.compute.train.fsdp import LoadOptions, frozen_dtype, load_sharded_model, mixed_precision_for

    param_dtype, _ = mixed_precision_for(torch.device(device).type, recipe.grpo.bf16)
    model = load_sharded_model(path, mesh, device, LoadOptions(
        dtype=frozen_dtype(recipe, param_dtype), param_dtype=param_dtype, offload=bool(recipe.trainer.reference_offload),
        trust_remote_code=recipe.model.trust_remote_code, load_timeout_s=recipe.launch.model_load_timeout_s,
        auto_class="AutoModelForSequenceClassification"))
    model.eval()
    model.requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=recipe.model.trust_remote_code)
    if tokenizer.pad_token_id is None:          # as TRL: padding needs a token, and the model must know it
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    return RewardModel(model, tokenizer, torch.device(device), recipe.grpo.per_device_train_batch_size,
                       name or Path(path).name)
