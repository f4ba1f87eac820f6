"""A mixture of experts' load-balancing loss in the GRPO loss, as TRL 1.16 adds it (issue #25):
coef x the routers' aux loss / gradient_accumulation_steps, coef = grpo.router_aux_loss_coef, else
the model config's own; none for a dense model, and a coefficient for one is refused."""

from __future__ import annotations

import pytest
import torch

from hpcrl.compute.train.batch import policy_forward, router_aux_coef


def _qwen3_moe(coef: float = 0.001):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                         num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=coef,
                         max_position_embeddings=64)
    return Qwen3MoeForCausalLM(cfg).float()


def _dense():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2))


def _batch():
    ids = torch.randint(1, 64, (3, 10))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0                                 # a left-padded prompt
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
            "completion_ids": ids[:, 6:]}


def test_the_coefficient_is_trls():
    assert router_aux_coef(_qwen3_moe(0.001), None) == 0.001          # the architecture's own
    assert router_aux_coef(_qwen3_moe(0.001), 0.05) == 0.05           # the recipe's
    assert router_aux_coef(_dense(), None) == 0.0
    with pytest.raises(ValueError, match="not a mixture-of-experts model"):
        router_aux_coef(_dense(), 0.01)


def test_the_aux_loss_is_the_models_own_and_has_a_gradient():
    model, batch = _qwen3_moe(), _batch()
    out = policy_forward(model, batch, 1.0, router_aux=True)
    ref = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                position_ids=batch["position_ids"], output_router_logits=True)
    assert out.aux_loss is not None and torch.allclose(out.aux_loss, ref.aux_loss)
    assert out.aux_loss.item() > 0
    out.aux_loss.backward()
    gate = model.model.layers[0].mlp.gate.weight
    assert gate.grad is not None and gate.grad.abs().sum() > 0      # it trains the routers
    plain = policy_forward(model, batch, 1.0)
    assert plain.aux_loss is None and torch.allclose(plain.logps, out.logps)


def test_login_refuses_a_coefficient_for_a_dense_model(tmp_path):
    import json

    from conftest import run_hpcrl

    model = tmp_path / "dense"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 32, "num_hidden_layers": 1,
                                                   "vocab_size": 64, "num_attention_heads": 4}))
    proc = run_hpcrl("plan", "--site", "local", f"model.path={model}", "grpo.router_aux_loss_coef=0.01", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "grpo.router_aux_loss_coef: 0.01 is set, but" in proc.stderr and "not a mixture-of-experts" in proc.stderr
