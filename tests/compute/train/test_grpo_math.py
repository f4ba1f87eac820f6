"""The GRPO math of hpcrl.compute.train (logprobs, advantages, loss, and the reward statistics training
logs) against TRL's own GRPOTrainer code, on identical random inputs.

A real (tiny) GRPOTrainer is built once; each test sets the attributes its branch reads and calls
TRL's methods themselves (``_generate_and_score_completions``, ``_compute_loss``), stubbing only the
generator (and, for the pure loss math, the forward pass that produces the log-probs). So any change
of TRL's math, or of ours, fails here.
"""

from __future__ import annotations

import dataclasses
import math
import random
from unittest import mock

import pytest
import torch

pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")

from hpcrl.compute.train import logprobs  # noqa: E402
from hpcrl.compute.train.advantages import combine_rewards, compute_advantages, group_advantages, nanstd  # noqa: E402
from hpcrl.compute.train.batch import truncated_mask  # noqa: E402
from hpcrl.compute.train.loss import (LOSS_TYPES, LossConfig, SamplerCorrection, grpo_loss,  # noqa: E402
                                      sampling_importance_ratio)
from hpcrl.compute.train.rank_metrics import Metric, reduce_metrics  # noqa: E402
from hpcrl.compute.train.rewards import (load_reward_functions, reward_statistics, reward_sums,  # noqa: E402
                                         score_completions)
from hpcrl.job import metric_keys as mk  # noqa: E402
from hpcrl.job.grpo_config import GRPOConfig  # noqa: E402

ATOL = 1e-6
TEMPERATURE = 0.7  # not 1, so that the temperature handling of the log-probs is exercised
MAX_COMPLETION = 6
G = 4  # generations per prompt


def r0(completions, r0, **kwargs):
    return r0


def r1(completions, r1, **kwargs):
    return r1


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    from hpcrl.compute.models.tiny import build_tokenizer

    tok = build_tokenizer()
    config = transformers.Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config)
    args = GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("grpo")), use_cpu=True, bf16=False, report_to=[],
        per_device_train_batch_size=8, num_generations=G, max_completion_length=MAX_COMPLETION,
        temperature=TEMPERATURE, save_strategy="no",
    )  # fmt: skip
    ds = datasets.Dataset.from_dict({"prompt": ["x"] * 8, "r0": [0.0] * 8, "r1": [0.0] * 8})
    tr = GRPOTrainer(model=model, reward_funcs=[r0, r1], args=args, train_dataset=ds, processing_class=tok)
    tr.current_gradient_accumulation_steps = 1  # set by the training loop, which we do not run
    return tr


def _last_metrics(tr, mode="train") -> dict[str, float]:
    return {k: v[-1] for k, v in tr._metrics[mode].items() if v}


def _assert_metrics(trl_metrics: dict[str, float], ours: dict[str, float], skip=()):
    for name, want in trl_metrics.items():
        if name in skip:
            continue
        assert name in ours, f"TRL reports {name!r}, we do not"
        got = ours[name]
        assert (math.isnan(want) and math.isnan(got)) or abs(got - want) <= ATOL, (name, got, want)


def _stub_generate(tr, monkeypatch, prompt_ids, completion_ids, sampling_logps=None):
    tok = tr.processing_class
    completions = tok.batch_decode(completion_ids, skip_special_tokens=True)

    def generate(prompts):
        return prompt_ids, completion_ids, None, completions, sampling_logps, {}, None, None

    monkeypatch.setattr(tr, "_generate", generate)
    return completions


def _random_ids(rng: random.Random, n: int, lo: int, hi: int, vocab: int = 384) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


# --------------------------------------------------------------------------------------------------
# Advantages


REWARDS = [  # 3 groups of G=4: spread out, all equal (zero std), with None and one unscorable row
    (0.1, 1.0), (0.9, None), (0.5, 0.0), (0.0, 1.0),
    (1.0, 0.5), (1.0, 0.5), (1.0, 0.5), (1.0, 0.5),
    (None, None), (0.3, None), (None, 0.7), (0.2, 0.2),
]  # fmt: skip


@pytest.mark.parametrize("aggregation", ["sum_then_normalize", "normalize_then_sum"])
@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none", True, False])
def test_advantages_match_trl(trainer, monkeypatch, scale_rewards, aggregation):
    tr = trainer
    rng = random.Random(0)
    weights = [1.0, 0.5]
    n = len(REWARDS)
    inputs = [{"prompt": f"p{i // G}", "r0": a, "r1": b} for i, (a, b) in enumerate(REWARDS)]
    completion_ids = _random_ids(rng, n, 1, MAX_COMPLETION)
    completions = _stub_generate(tr, monkeypatch, _random_ids(rng, n, 2, 4), completion_ids)
    monkeypatch.setattr(tr, "scale_rewards", {True: "group", False: "none"}.get(scale_rewards, scale_rewards))
    monkeypatch.setattr(tr, "multi_objective_aggregation", aggregation)
    monkeypatch.setattr(tr, "reward_weights", torch.tensor(weights))
    tr._metrics["train"].clear()

    out = tr._generate_and_score_completions(inputs)

    funcs = load_reward_functions([{"func": r0, "weight": weights[0]}, {"func": r1, "weight": weights[1]}])
    per_func = score_completions(
        funcs, [x["prompt"] for x in inputs], completions, completion_ids,
        {"r0": [x["r0"] for x in inputs], "r1": [x["r1"] for x in inputs]},
    )  # fmt: skip
    advantages, stats = compute_advantages(
        per_func, G, [f.weight for f in funcs], scale_rewards=scale_rewards, aggregation=aggregation
    )
    torch.testing.assert_close(advantages, out["advantages"], atol=ATOL, rtol=0)
    assert advantages[8] == 0  # the unscorable row
    # What training logs (hpcrl.compute.train.scoring, one trainer): the reward statistics from the
    # reward sums, and the share of zero-std groups from the advantages.
    logged = reward_statistics(reward_sums(per_func, weights), [f.name for f in funcs])
    logged[mk.FRAC_REWARD_ZERO_STD] = stats[mk.FRAC_REWARD_ZERO_STD]
    trl_metrics = _last_metrics(tr)
    assert {"reward", "reward_std", "frac_reward_zero_std", "rewards/r0/mean", "rewards/r1/std"} <= trl_metrics.keys()
    trl_rewards = {k: v for k, v in trl_metrics.items() if k.startswith(("reward", "frac"))}
    assert trl_rewards.keys() == logged.keys()
    _assert_metrics(trl_rewards, logged)

    if aggregation == "sum_then_normalize":  # the two-step API gives the same
        adv2, stats2 = group_advantages(combine_rewards(per_func, weights), G, scale_rewards)
        torch.testing.assert_close(adv2, advantages, atol=0, rtol=0)
        assert stats2 == stats


def test_nanstd_matches_trl():
    from trl.trainer.utils import nanstd as trl_nanstd

    x = torch.randn(5, 7)
    x[0, :6] = math.nan
    x[1, 2] = math.nan
    for dim in (None, 0, 1):
        torch.testing.assert_close(nanstd(x, dim=dim), trl_nanstd(x, dim=dim), equal_nan=True)
    torch.testing.assert_close(nanstd(x, 1, keepdim=True), trl_nanstd(x, 1, keepdim=True), equal_nan=True)


# --------------------------------------------------------------------------------------------------
# Log-probabilities, truncation masking, vLLM importance sampling


@pytest.mark.parametrize(
    "mode,clip_min,clip_max,mask_truncated",
    [
        ("token_truncate", None, 1.2, False),
        ("token_mask", 0.9, 1.1, True),
        ("sequence_truncate", 0.5, 1.5, False),
        ("sequence_mask", None, 3.0, True),
        ("sequence_mask", 0.5, None, False),
    ],
)
def test_logprobs_truncation_and_importance_sampling_match_trl(
    trainer, monkeypatch, mode, clip_min, clip_max, mask_truncated
):
    tr = trainer
    rng = random.Random(1)
    n = 8
    eos, pad = tr.eos_token_ids[0], tr.processing_class.pad_token_id
    completion_ids = _random_ids(rng, n, 1, MAX_COMPLETION)
    for i in (0, 3, 5):  # these stopped; the others were cut at the length limit
        completion_ids[i][-1] = eos
    completion_ids[6][-1] = pad
    prompt_ids = _random_ids(rng, n, 2, 5)
    inputs = [{"prompt": "p", "r0": float(i % 3), "r1": 1.0} for i in range(n)]
    monkeypatch.setattr(tr, "mask_truncated_completions", mask_truncated)

    # Without the vLLM correction first: masks, token count, and TRL's padded tensors for our forward
    _stub_generate(tr, monkeypatch, prompt_ids, completion_ids)
    out = tr._generate_and_score_completions(inputs)
    truncated = truncated_mask(completion_ids, [*tr.eos_token_ids, pad])
    assert truncated.tolist() == [len(c) > 0 and c[-1] not in (eos, pad) for c in completion_ids]
    lengths = torch.tensor([len(c) for c in completion_ids])
    mask = (torch.arange(MAX_COMPLETION)[None, : out["completion_ids"].size(1)] < lengths[:, None]).long()
    if mask_truncated:
        mask = mask * (~truncated).unsqueeze(1).long()
    torch.testing.assert_close(out["completion_mask"], mask, atol=0, rtol=0)
    assert int(out["num_items_in_batch"]) == int(mask.sum())
    input_ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    attention = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    with torch.no_grad():
        logits = tr.model(input_ids=input_ids, attention_mask=attention).logits
    logps = logprobs.completion_logprobs(logits, out["completion_ids"], TEMPERATURE)

    # vLLM's sampling log-probs: the trainer's plus noise, so that ratios straddle the clip bounds;
    # one token unavailable (None)
    sampling = [[logps[i, j].item() + rng.gauss(0, 0.1) for j in range(len(c))] for i, c in enumerate(completion_ids)]
    sampling[2][0] = None
    _stub_generate(tr, monkeypatch, prompt_ids, completion_ids, sampling)
    for name, value in [
        ("use_vllm", True), ("vllm_importance_sampling_correction", True),
        ("vllm_importance_sampling_mode", mode), ("vllm_importance_sampling_clip_min", clip_min),
        ("vllm_importance_sampling_clip_max", clip_max),
    ]:  # fmt: skip
        monkeypatch.setattr(tr, name, value)
    tr._metrics["train"].clear()
    out = tr._generate_and_score_completions(inputs)

    # Our log-probs from plain logits equal TRL's fused-LM-head ones (temperature applied the same way)
    m = out["completion_mask"].bool()
    torch.testing.assert_close(logps[m], out["old_per_token_logps"][m], atol=ATOL, rtol=0)

    # Importance ratio and its metrics, from the same old log-probs
    T = out["completion_ids"].size(1)
    sampling_t = torch.tensor([[math.nan if x is None else x for x in s] + [0.0] * (T - len(s)) for s in sampling])
    ratio, metrics = sampling_importance_ratio(
        out["old_per_token_logps"], sampling_t, out["completion_mask"], mode=mode, clip_min=clip_min, clip_max=clip_max
    )
    torch.testing.assert_close(ratio, out["importance_sampling_ratio"], atol=ATOL, rtol=0)
    assert 0 < ratio[m if ratio.shape == m.shape else m.any(1, keepdim=True)].std()  # not all clipped/masked
    _assert_metrics(
        {k: v for k, v in _last_metrics(tr).items() if k.startswith("sampling/")}, reduce_metrics(metrics)
    )


def test_selective_log_softmax_and_entropy_match_trl():
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    logits = torch.randn(3, 5, 50) * 3
    ids = torch.randint(0, 50, (3, 5))
    torch.testing.assert_close(logprobs.selective_log_softmax(logits, ids), selective_log_softmax(logits, ids), atol=ATOL, rtol=0)
    logps, ent = logprobs.token_logprobs(logits, ids, 0.6, return_entropy=True)
    torch.testing.assert_close(logps, selective_log_softmax(logits / 0.6, ids), atol=ATOL, rtol=0)
    torch.testing.assert_close(ent, entropy_from_logits(logits / 0.6), atol=ATOL, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 7, 10_000])
def test_chunked_logprobs_and_gradients_equal_unchunked_and_trl(dtype, chunk):
    """The chunked autograd function against the one-expression form and TRL's selective_log_softmax:
    values, and gradients on the logits through log-probs alone, entropies alone and both."""
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    g = torch.Generator().manual_seed(5)
    B, T, V, temperature = 3, 9, 50, 0.6  # 27 tokens: chunks of 7 straddle rows, 10_000 is one chunk
    base = (torch.randn(B, T + 1, V, generator=g) * 4).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=g)
    w_lp, w_ent = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)

    def run(fn, weights):
        logits = base.clone().requires_grad_()
        lp, ent = fn(logits)
        (sum(w * x for w, x in zip(weights, (lp, ent)) if w is not None)).sum().backward()
        return lp.detach(), ent.detach(), logits.grad

    chunked = lambda x: logprobs.completion_logprobs(x, ids, temperature, return_entropy=True, chunk_tokens=chunk)
    unchunked = lambda x: logprobs.token_logprobs_unchunked(x[:, :-1], ids, temperature, return_entropy=True)
    trl = lambda x: (selective_log_softmax(x[:, :-1].float() / temperature, ids),
                     entropy_from_logits(x[:, :-1].float() / temperature))
    # fp32: rounding of the fp32 sums; bf16: one bf16 step (2**-8 relative) of a gradient element
    tol = dict(atol=4 * ATOL, rtol=1e-5) if dtype == torch.float32 else dict(atol=2**-7, rtol=2**-7)
    for weights in ((w_lp, None), (None, w_ent), (w_lp, w_ent)):
        lp, ent, grad = run(chunked, weights)
        lp_u, ent_u, grad_u = run(unchunked, weights)
        lp_t, ent_t, grad_t = run(trl, weights)
        assert lp.dtype == ent.dtype == torch.float32 and grad.dtype == dtype
        # The same operations per token: equal, not merely close.
        torch.testing.assert_close(lp, lp_u, atol=0, rtol=0)
        torch.testing.assert_close(ent, ent_u, atol=0, rtol=0)
        torch.testing.assert_close(lp, lp_t, atol=ATOL, rtol=0)
        torch.testing.assert_close(ent, ent_t, atol=ATOL, rtol=0)
        assert grad[:, -1].abs().max() == 0  # the last position scores nothing
        if weights[1] is None:  # the log-probs' backward repeats autograd's operations in its order
            torch.testing.assert_close(grad, grad_u, atol=0, rtol=0)
        else:  # the entropy's gradient is the same formula in another order: rounding apart
            torch.testing.assert_close(grad, grad_u, **tol)
        # TRL computes its fp32 gradient in other orders: one rounding of the bf16 cast apart at most
        torch.testing.assert_close(grad, grad_t, **tol)
        assert grad.abs().max() > 1e-3

    # 2-D and 3-D logits through token_logprobs, no gradient: the same values
    flat = base[:, :-1].reshape(-1, V)
    torch.testing.assert_close(logprobs.token_logprobs(flat, ids.reshape(-1), temperature, chunk_tokens=chunk),
                               lp_u.reshape(-1), atol=0, rtol=0)
    torch.testing.assert_close(logprobs.token_logprobs(base[:, :-1], ids, temperature, chunk_tokens=chunk), lp_u,
                               atol=0, rtol=0)


def test_chunked_logprobs_keep_no_fp32_copy_for_backward():
    """Saved for backward: the logits themselves (no copy) and one fp32 number per token."""
    logits = torch.randn(2, 5, 40, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, 40, (2, 4))
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lp = logprobs.completion_logprobs(logits, ids, 0.7, chunk_tokens=3)
    big = [t for t in saved if t.numel() >= logits.numel() // 5]
    assert len(big) == 1 and big[0].data_ptr() == logits.data_ptr() and big[0].dtype == torch.bfloat16
    assert sum(t.numel() for t in saved if t.data_ptr() != logits.data_ptr()) <= 3 * ids.numel()
    lp.sum().backward()
    assert logits.grad.shape == logits.shape


def test_bad_logprob_arguments():
    logits, ids = torch.zeros(2, 4, 10), torch.zeros(2, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="chunk_tokens"):
        logprobs.completion_logprobs(logits, ids, 1.0, chunk_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        logprobs.completion_logprobs(logits, ids, 0.0)
    with pytest.raises(ValueError, match="T \\+ 1"):
        logprobs.completion_logprobs(logits[:, :3], ids)
    with pytest.raises(ValueError, match="ids of shape"):
        logprobs.token_logprobs(logits, ids)


def test_no_grad_passes_run_in_micro_batches(trainer, monkeypatch):
    """The old-policy and reference log-probabilities, a training micro-batch at a time and with the
    recipe's chunk, equal those of all rows at once."""
    from types import SimpleNamespace

    from hpcrl.compute.inference.types import Completion
    from hpcrl.compute.train import trainer as trainer_mod
    from hpcrl.compute.train.batch import completion_logps, pack_batch

    rng = random.Random(4)
    n, micro = 8, 3  # a last micro-batch of 2 rows
    prompts = _random_ids(rng, n, 2, 5)
    completions = [Completion(i, tuple(ids), (), "", False, 0)
                   for i, ids in enumerate(_random_ids(rng, n, 1, MAX_COMPLETION))]
    batch = pack_batch(prompts, completions, trainer.processing_class.pad_token_id, "cpu")
    model = trainer.model.eval()
    with torch.no_grad():
        whole = completion_logps(model, batch, TEMPERATURE)
    seen = []
    real = logprobs.completion_logprobs

    def spy(logits, ids, temperature, **kw):
        seen.append((logits.shape[0], kw["chunk_tokens"]))
        return real(logits, ids, temperature, **kw)

    monkeypatch.setattr(logprobs, "completion_logprobs", spy)
    fake = SimpleNamespace(grpo=SimpleNamespace(per_device_train_batch_size=micro, temperature=TEMPERATURE),
                           logprob_chunk_tokens=5)
    with torch.no_grad():
        parts = trainer_mod.Trainer._micro_batched_logps(fake, model, batch)
    model.train()
    assert seen == [(3, 5), (3, 5), (2, 5)]
    m = batch["completion_mask"].bool()
    torch.testing.assert_close(parts[m], whole[m], atol=ATOL, rtol=0)


# --------------------------------------------------------------------------------------------------
# The loss


def _cases():
    variants = [
        {},
        {"beta": 0.04},
        {"beta": 0.04, "use_bias_correction_kl": False},
        {"epsilon_high": 0.28},
        {"delta": 1.15},
        {"importance_sampling_level": "sequence"},
        {"importance_weights": "token"},
        {"importance_weights": "sequence"},
        {"off_policy_mask_threshold": 0.05},
        {"entropy_coef": 0.01},
        {"gradient_accumulation_steps": 4, "steps_per_generation": 2, "num_processes": 2},
        {"training": False},
        {"on_policy": True},
        {"beta": 0.1, "delta": 1.3, "importance_weights": "token", "epsilon_high": 0.28, "entropy_coef": 0.02},
    ]
    for loss_type in LOSS_TYPES:
        for v in variants:
            if "delta" in v and loss_type not in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
                continue
            yield pytest.param(loss_type, v, id=f"{loss_type}-" + ("-".join(f"{k}={x}" for k, x in v.items()) or "default"))


def _loss_inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    B, T = 8, MAX_COMPLETION
    lengths = torch.tensor([6, 1, 3, 6, 0, 2, 5, 4])  # one empty completion (all masked)
    mask = (torch.arange(T)[None] < lengths[:, None]).long()
    logps = -torch.rand(B, T, generator=g) * 4 - 0.1
    return {
        "logps": logps,
        "entropies": torch.rand(B, T, generator=g) * 3,
        "old": logps + 0.3 * torch.randn(B, T, generator=g),  # ratios on both sides of the clip range
        "ref": logps + 0.5 * torch.randn(B, T, generator=g),
        "sampling": logps + 0.2 * torch.randn(B, T, generator=g),
        "advantages": torch.randn(B, generator=g),
        "is_token": 0.5 + torch.rand(B, T, generator=g),
        "is_sequence": 0.5 + torch.rand(B, 1, generator=g),
        "mask": mask,
        "num_items": torch.tensor(int(mask.sum()) * 3),  # the generation batch is bigger than this micro-batch
    }


def _trl_inputs(x: dict) -> dict:
    """What TRL's _compute_loss takes of ``_loss_inputs``, its forward replaced by their log-probs."""
    B, T = x["mask"].shape
    return {
        "prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": x["mask"],
        "advantages": x["advantages"], "num_items_in_batch": x["num_items"],
    }  # fmt: skip


@pytest.mark.parametrize("loss_type,variant", list(_cases()))
def test_loss_matches_trl(trainer, monkeypatch, loss_type, variant):
    tr = trainer
    v = dict(variant)
    x = _loss_inputs(seed=LOSS_TYPES.index(loss_type))
    beta = v.get("beta", 0.0)
    eps_low, eps_high = 0.2, v.get("epsilon_high", 0.2)
    if loss_type == "cispo":
        eps_high = v.get("epsilon_high", 0.2) + 1.0  # cispo's epsilon_high is a ratio cap (ScaleRL uses 5)
    ga, spg = v.get("gradient_accumulation_steps", 1), v.get("steps_per_generation", 1)
    nproc = v.get("num_processes", 1)
    training = v.get("training", True)
    is_kind = v.get("importance_weights")
    is_weights = None if is_kind is None else x[f"is_{is_kind}"]
    on_policy = v.get("on_policy", False)

    # TRL: its attributes, and its forward pass replaced by our log-prob tensors
    for name, value in {
        "loss_type": loss_type, "beta": beta, "epsilon_low": eps_low, "epsilon_high": eps_high,
        "importance_sampling_level": v.get("importance_sampling_level", "token"),
        "off_policy_mask_threshold": v.get("off_policy_mask_threshold"),
        "use_vllm": is_weights is not None, "vllm_importance_sampling_correction": is_weights is not None,
        "current_gradient_accumulation_steps": ga, "max_completion_length": MAX_COMPLETION,
        "_entropy_bonus_enabled": "entropy_coef" in v, "entropy_coef": v.get("entropy_coef", 0.0),
        "use_adaptive_entropy": False,
    }.items():  # fmt: skip
        monkeypatch.setattr(tr, name, value)
    for name, value in {
        "delta": v.get("delta"), "use_bias_correction_kl": v.get("use_bias_correction_kl", True),
        "steps_per_generation": spg,
    }.items():  # fmt: skip
        monkeypatch.setattr(tr.args, name, value)
    trl_logps = x["logps"].clone().requires_grad_()
    trl_ent = x["entropies"].clone().requires_grad_()
    monkeypatch.setattr(tr, "_get_per_token_logps_and_entropies", lambda *a, **k: (trl_logps, trl_ent, None))
    inputs = _trl_inputs(x) | {"sampling_per_token_logps": x["sampling"]}
    if not on_policy:
        inputs["old_per_token_logps"] = x["old"]
    if beta:
        inputs["ref_per_token_logps"] = x["ref"]
    if is_weights is not None:
        inputs["importance_sampling_ratio"] = is_weights
    mode = "train" if training else "eval"
    tr._metrics[mode].clear()
    tr.model.train(training)
    try:
        with mock.patch.object(type(tr.accelerator), "num_processes", new_callable=mock.PropertyMock) as np_:
            np_.return_value = nproc
            trl_loss = tr._compute_loss(tr.model, inputs)
    finally:
        tr.model.train(True)
    trl_loss.backward()

    # Ours on the same tensors
    logps = x["logps"].clone().requires_grad_()
    ent = x["entropies"].clone().requires_grad_()
    config = LossConfig(
        loss_type=loss_type, beta=beta, epsilon_low=eps_low, epsilon_high=eps_high, delta=v.get("delta"),
        importance_sampling_level=v.get("importance_sampling_level", "token"),
        max_completion_length=MAX_COMPLETION, num_processes=nproc,
        gradient_accumulation_steps=ga, steps_per_generation=spg, training=training,
        off_policy_mask_threshold=v.get("off_policy_mask_threshold"),
        use_bias_correction_kl=v.get("use_bias_correction_kl", True), entropy_coef=v.get("entropy_coef", 0.0),
    )  # fmt: skip
    loss, metrics = grpo_loss(
        logps, None if on_policy else x["old"], x["ref"] if beta else None, x["advantages"], x["mask"], config,
        num_items_in_batch=x["num_items"], sampler=SamplerCorrection(x["sampling"], is_weights), entropies=ent,
    )  # fmt: skip
    loss.backward()

    torch.testing.assert_close(loss, trl_loss, atol=ATOL, rtol=0)
    assert loss.item() != 0.0 or trl_loss.item() == 0.0
    torch.testing.assert_close(logps.grad, trl_logps.grad, atol=ATOL, rtol=0)
    if trl_ent.grad is not None:
        torch.testing.assert_close(ent.grad, trl_ent.grad, atol=ATOL, rtol=0)
    trl_metrics = _last_metrics(tr, mode)
    assert "entropy" in trl_metrics
    _assert_metrics(trl_metrics, reduce_metrics(metrics), skip={"entropy_coef"})


def test_adaptive_entropy_control_matches_trl(trainer, monkeypatch):
    """grpo.use_adaptive_entropy: 4 optimizer steps of 2 micro-batches through TRL's _compute_loss and
    through hpcrl.compute.train.entropy_control with grpo_loss: each micro-batch's loss and gradients,
    and the coefficient after each step (TRL's entropy_coef metric). The entropies are scaled so that
    the coefficient rises twice, then falls, and the last step applies none."""
    from hpcrl.compute.train.entropy_control import EntropyControl

    tr = trainer
    grpo = GRPOConfig(use_adaptive_entropy=True, entropy_coef=0.01, entropy_coef_delta=0.004, entropy_target=1.5,
                      entropy_coef_min=0.002, entropy_coef_max=0.02)
    for name, value in {
        "loss_type": "grpo", "beta": 0.0, "epsilon_low": 0.2, "epsilon_high": 0.2, "use_vllm": False,
        "vllm_importance_sampling_correction": False, "current_gradient_accumulation_steps": 2,
        "max_completion_length": MAX_COMPLETION, "off_policy_mask_threshold": None,
        "importance_sampling_level": "token", "_entropy_bonus_enabled": True, "use_adaptive_entropy": True,
        "entropy_coef": grpo.entropy_coef, "_last_world_entropy": float("inf"), "_entropy_window_stats": None,
    }.items():  # fmt: skip
        monkeypatch.setattr(tr, name, value)
    for name in ("entropy_coef_delta", "entropy_target", "entropy_coef_min", "entropy_coef_max"):
        monkeypatch.setattr(tr.args, name, getattr(grpo, name))
    monkeypatch.setattr(tr.args, "delta", None)
    monkeypatch.setattr(tr.args, "steps_per_generation", 2)
    control = EntropyControl(grpo)
    config = LossConfig(loss_type="grpo", max_completion_length=MAX_COMPLETION, gradient_accumulation_steps=2,
                        steps_per_generation=2)
    coefs, applied = [], []
    tr._metrics["train"].clear()
    for step, scale in enumerate((0.5, 0.5, 2.0, 0.5)):
        step_config = dataclasses.replace(config, entropy_coef=control.applied())
        applied.append(step_config.entropy_coef)
        for micro in range(2):
            x = _loss_inputs(seed=10 * step + micro)
            x["entropies"] = x["entropies"] * scale
            trl_logps, trl_ent = x["logps"].clone().requires_grad_(), x["entropies"].clone().requires_grad_()
            monkeypatch.setattr(tr, "_get_per_token_logps_and_entropies", lambda *a, **k: (trl_logps, trl_ent, None))
            inputs = _trl_inputs(x) | {"old_per_token_logps": x["old"]}
            with mock.patch.object(type(tr.accelerator), "sync_gradients", new_callable=mock.PropertyMock) as sync:
                sync.return_value = micro == 1
                trl_loss = tr._compute_loss(tr.model, inputs)
            trl_loss.backward()

            logps, ent = x["logps"].clone().requires_grad_(), x["entropies"].clone().requires_grad_()
            loss, _ = grpo_loss(logps, x["old"], None, x["advantages"], x["mask"], step_config,
                                num_items_in_batch=x["num_items"], entropies=ent)
            control.observe(ent, x["mask"])
            loss.backward()
            torch.testing.assert_close(loss, trl_loss, atol=ATOL, rtol=0)
            # A coefficient of 0 leaves the bonus out (TRL subtracts 0 x the entropy): no gradient either way.
            ours = torch.zeros_like(ent) if ent.grad is None else ent.grad
            torch.testing.assert_close(ours, trl_ent.grad, atol=ATOL, rtol=0)
        control.step_done(reduce=lambda values, group: values)
        coefs.append(control.coef)
        assert control.coef == pytest.approx(tr.entropy_coef, abs=1e-12)
        assert control.last_entropy == pytest.approx(tr._last_world_entropy, rel=1e-6)
    assert tr._metrics["train"]["entropy_coef"] == pytest.approx(coefs)
    assert applied == pytest.approx([0.0, 0.014, 0.018, 0.0])           # none before a measurement, none above
    assert coefs == pytest.approx([0.014, 0.018, 0.014, 0.018])
    fresh = EntropyControl(grpo)
    fresh.load_state_dict(control.state_dict())                          # what a checkpoint keeps
    assert (fresh.coef, fresh.applied()) == (control.coef, control.applied())


@pytest.mark.parametrize("loss_type,beta", [("dapo", 0.04), ("grpo", 0.0), ("dr_grpo", 0.0)])
def test_loss_and_gradients_through_the_model_match_trl(trainer, monkeypatch, loss_type, beta):
    """End to end: TRL's fused LM head vs our logits -> log-probs, gradients on the weights."""
    tr = trainer
    g = torch.Generator().manual_seed(3)
    B, P, T = 8, 3, MAX_COMPLETION
    prompt_ids = torch.randint(3, 384, (B, P), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[0, 0] = prompt_mask[3, :2] = 0  # left padding
    completion_ids = torch.randint(3, 384, (B, T), generator=g)
    mask = (torch.arange(T)[None] < torch.tensor([6, 1, 3, 6, 2, 2, 5, 4])[:, None]).long()
    with torch.no_grad():
        ids, att = torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, mask], 1)
        base = logprobs.completion_logprobs(tr.model(input_ids=ids, attention_mask=att).logits, completion_ids, TEMPERATURE)
    old = base + 0.2 * torch.randn(B, T, generator=g)
    ref = base + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    for name, value in {
        "loss_type": loss_type, "beta": beta, "epsilon_low": 0.2, "epsilon_high": 0.28, "use_vllm": False,
        "current_gradient_accumulation_steps": 2, "_entropy_bonus_enabled": False,
        "off_policy_mask_threshold": None, "importance_sampling_level": "token",
    }.items():  # fmt: skip
        monkeypatch.setattr(tr, name, value)
    monkeypatch.setattr(tr.args, "delta", None)
    monkeypatch.setattr(tr.args, "steps_per_generation", 2)
    inputs = {
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
        "completion_mask": mask, "advantages": adv, "num_items_in_batch": mask.sum() * 2,
        "old_per_token_logps": old, "ref_per_token_logps": ref,
    }  # fmt: skip
    params = list(tr.model.parameters())
    tr._metrics["train"].clear()
    trl_loss = tr._compute_loss(tr.model, inputs)
    trl_grads = torch.autograd.grad(trl_loss, params)

    logits = tr.model(input_ids=ids, attention_mask=att).logits
    logps, ent = logprobs.completion_logprobs(logits, completion_ids, TEMPERATURE, return_entropy=True)
    config = LossConfig(
        loss_type=loss_type, beta=beta, epsilon_low=0.2, epsilon_high=0.28, max_completion_length=MAX_COMPLETION,
        gradient_accumulation_steps=2, steps_per_generation=2,
    )  # fmt: skip
    loss, metrics = grpo_loss(
        logps, old, ref if beta else None, adv, mask, config, num_items_in_batch=mask.sum() * 2, entropies=ent
    )
    grads = torch.autograd.grad(loss, params)

    torch.testing.assert_close(loss, trl_loss, atol=ATOL, rtol=0)
    for p, a, b in zip(params, grads, trl_grads):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=1e-4)
    assert any(a.abs().max() > 1e-4 for a in grads)  # the comparison is not between zeros
    _assert_metrics(_last_metrics(tr), reduce_metrics(metrics))


def test_reduce_metrics_local():
    m = {
        "a": Metric(torch.tensor(6.0), torch.tensor(3.0)),
        "lo": Metric(torch.tensor(math.nan), op="min"),
        "hi": Metric(torch.tensor(2.5), op="max"),
    }
    out = reduce_metrics(m)
    assert out["a"] == 2.0 and math.isnan(out["lo"]) and out["hi"] == 2.5


def test_bad_arguments():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="Unknown loss type"):
        LossConfig(loss_type="ppo")
    with pytest.raises(ValueError, match="Unknown importance sampling level"):
        LossConfig(importance_sampling_level="per-token")
    with pytest.raises(ValueError, match="max_completion_length"):
        LossConfig(loss_type="dr_grpo")
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(torch.zeros(4), 2, "per-token")
    with pytest.raises(ValueError, match="ref_per_token_logps"):
        grpo_loss(z, None, None, torch.zeros(2), z, LossConfig(beta=0.1))


def test_loss_config_from_the_recipe():
    """LossConfig.from_grpo carries every loss field of the recipe's grpo section (epsilon as
    epsilon_low), and the micro-batches of a generation's whole optimizer steps."""
    changed = dict(loss_type="cispo", beta=0.04, epsilon=0.3, epsilon_high=5.0, delta=1.5,
                   importance_sampling_level="sequence", max_completion_length=64, off_policy_mask_threshold=0.1,
                   use_bias_correction_kl=False, sapo_temperature_pos=0.9, sapo_temperature_neg=1.1,
                   vespo_k_pos=2.5, vespo_lambda_pos=3.5, vespo_k_neg=3.5, vespo_lambda_neg=2.5, entropy_coef=0.01,
                   gradient_accumulation_steps=2, steps_per_generation=6)
    config = LossConfig.from_grpo(GRPOConfig(**changed), num_trainers=4)
    assert config.epsilon_low == 0.3 and config.num_processes == 4 and config.training
    assert config.steps_per_generation == 6
    for name, value in changed.items():
        if name not in ("epsilon", "steps_per_generation"):
            assert getattr(config, name) == value, name
    defaults = LossConfig.from_grpo(GRPOConfig())
    assert defaults.epsilon_high == defaults.epsilon_low and defaults.steps_per_generation == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        defaults.beta = 1.0


def test_mismatch_kl_and_effective_sample_size_of_the_sampler():
    """sampling/mismatch_kl is the k3 estimate of KL(sampler || trainer) over the completion tokens,
    and sampling/importance_sampling_ess the sequences' importance weights' (sum w)^2 / (n sum w^2),
    combined exactly over micro-batches; both read "no mismatch" (0 and 1) when the two agree."""
    from hpcrl.compute.train.loss import effective_sample_size, mismatch_metrics
    from hpcrl.compute.train.rank_metrics import merge_metrics
    from hpcrl.job import metric_keys as mk

    g = torch.Generator().manual_seed(3)
    trainer = -torch.rand(4, 6, generator=g) * 3
    sampler = trainer + torch.randn(4, 6, generator=g) * 0.3
    mask = torch.ones(4, 6)
    mask[1, 4:] = 0
    mask[3, 2:] = 0
    sampler[0, 1] = math.nan                    # an engine without this log-prob: no correction there
    merged: dict = {}
    for rows in (slice(0, 3), slice(3, 4)):     # two micro-batches
        merge_metrics(merged, mismatch_metrics(trainer[rows], sampler[rows], mask[rows]))
    out = reduce_metrics(merged)
    effective_sample_size(out)
    log_r = torch.nan_to_num(trainer - sampler, nan=0.0) * mask
    k3 = ((log_r.exp() - 1 - log_r) * mask).sum() / mask.sum()
    w = log_r.sum(1).exp()
    assert set(out) == {mk.SAMPLING_MISMATCH_KL, mk.SAMPLING_IS_ESS}
    assert out[mk.SAMPLING_MISMATCH_KL] == pytest.approx(k3.item(), rel=1e-5) and k3 > 0
    assert out[mk.SAMPLING_IS_ESS] == pytest.approx((w.sum() ** 2 / (4 * (w * w).sum())).item(), rel=1e-5)
    assert 0 < out[mk.SAMPLING_IS_ESS] < 1
    same = reduce_metrics(mismatch_metrics(trainer, trainer, mask))
    effective_sample_size(same)
    assert same == {mk.SAMPLING_MISMATCH_KL: 0.0, mk.SAMPLING_IS_ESS: pytest.approx(1.0)}
