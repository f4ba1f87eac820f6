"""grpo.cast_lm_head_to_fp32 (TRL's option): under bf16 the LM head of policy and reference computes
in fp32 on 2 gloo ranks (FSDP2), for a head of its own, for one tied to the input embeddings, and for
a mixture-of-experts model's (Qwen3-MoE: its router and fused experts in the layers), and the
decoder layers compute exactly what they did without it."""

from __future__ import annotations

import pytest
import torch
from dist_harness import spawn
from test_export import tiny_model_dir  # a Qwen2 model of 2 layers, saved in fp32 (the head's values are not bf16's)

from hpcrl.job.errors import UserError


def _recipe(cast: bool):
    from hpcrl.job.recipe import GRPOConfig, Recipe

    return Recipe(grpo=GRPOConfig(beta=0.04, bf16=True, gradient_checkpointing=False, cast_lm_head_to_fp32=cast))


def _forward(model, x):
    with torch.no_grad():
        return model(input_ids=x, output_hidden_states=True)


def _w_fp32_head(rank: int, world: int, model_dirs: list) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    for tie, model_dir in model_dirs:
        _check_fp32_head(mesh, model_dir, tie)


def _check_fp32_head(mesh, model_dir: str, tie: bool) -> None:
    from hpcrl.compute.train import fsdp

    cpu = torch.device("cpu")
    x = torch.randint(3, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    bf16_policy, _ = fsdp.load_policy_and_reference(model_dir, mesh, cpu, _recipe(False))
    policy, reference = fsdp.load_policy_and_reference(model_dir, mesh, cpu, _recipe(True))
    embedded = []
    policy.get_input_embeddings().register_forward_hook(lambda module, args, out: embedded.append(out.dtype))
    before, after, ref = _forward(bf16_policy, x), _forward(policy, x), _forward(reference, x)

    assert before.logits.dtype == torch.bfloat16
    assert after.logits.dtype == ref.logits.dtype == torch.float32
    # The decoder layers saw what they saw before (a tied head's embeddings cast back to bf16).
    assert embedded == [torch.bfloat16]
    assert len(after.hidden_states) == len(before.hidden_states) == 3
    for a, b in zip(after.hidden_states[:-1], before.hidden_states[:-1]):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    # The logits are the final hidden state (the norm's output: fp32 in a tied head's fp32 root group)
    # times the fp32 head.
    hidden = after.hidden_states[-1]
    assert hidden.dtype == (torch.float32 if tie else torch.bfloat16)
    head = policy.get_output_embeddings().weight.full_tensor()
    assert head.dtype == torch.float32
    want = torch.nn.functional.linear(hidden.float(), head)
    assert torch.allclose(after.logits, want, rtol=1e-5, atol=1e-5)
    assert not torch.equal(after.logits, before.logits.float())
    assert (after.logits - before.logits.float()).abs().max().item() < 0.1
    # The reference stores what computes in fp32 in fp32, with the checkpoint's values: it starts equal
    # to the policy (a bf16 copy of the head would not).
    assert reference.get_output_embeddings().weight.dtype == torch.float32
    assert {p.dtype for n, p in reference.named_parameters() if ".layers." in n} == {torch.bfloat16}
    assert torch.equal(after.logits, ref.logits)
    if tie:
        assert policy.get_output_embeddings().weight is policy.get_input_embeddings().weight
        assert reference.get_output_embeddings().weight is reference.get_input_embeddings().weight

    # A step: the head's gradient comes back, in fp32 like its master weight.
    policy(input_ids=x).logits.logsumexp(-1).mean().backward()
    grad = policy.get_output_embeddings().weight.grad
    assert grad is not None and grad.dtype == torch.float32 and grad.full_tensor().abs().sum() > 0


def test_the_lm_head_computes_in_fp32_and_the_layers_as_before_for_its_own_head_a_tied_one_and_a_moes(tmp_path):
    from test_moe import make_moe_dir

    dirs = [(tie, str(tiny_model_dir(tmp_path, tie))) for tie in (False, True)]
    dirs.append((False, str(make_moe_dir(tmp_path / "moe", "qwen3_moe", square=False))))
    spawn(_w_fp32_head, tmp_path / "ranks", dirs)


def test_an_adapter_on_the_head_is_refused_in_one_line():
    """TRL refuses an adapter on the head with the option; model.lora_target_modules may match it by a
    regular expression, which only the job sees."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hpcrl.compute.train.fsdp import _fp32_head
    from hpcrl.compute.train.lora import add_adapters
    from hpcrl.job.recipe import ModelConfig

    config = Qwen2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    model = add_adapters(Qwen2ForCausalLM(config), ModelConfig(use_peft=True, lora_target_modules=".*lm_head"))
    with pytest.raises(UserError, match=r"^grpo.cast_lm_head_to_fp32: not with an adapter on the LM head"):
        _fp32_head(model, torch.bfloat16)
