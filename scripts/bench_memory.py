#!/usr/bin/env python
"""Peak memory of the GRPO log-probabilities and loss on this CPU: chunked against unchunked.

The setting is one training micro-batch of a 152k-vocabulary model: 4,096 completion tokens (2 rows of
2,048) and a vocabulary of 151,936 (Qwen2.5's). The logits come from a [tokens x hidden] x
[hidden x vocabulary] projection (hidden 256: the LM head of a small model; the projection only has
to be real, so that backward is) whose weight and input require gradients, in the compute dtype. One
measured step is: the projection, the completion log-probabilities, the dapo loss with a KL term
(hpcrl.compute.train.loss.grpo_loss, beta 0.04), and the backward to the weight and the input.

Variants, each in a fresh interpreter so that peaks cannot mix:
  unchunked  logprobs.token_logprobs_unchunked, the computation before issue 14 (TRL's form): one
             autograd expression over all tokens, the fp32 upcast and logsumexp of the whole
             [tokens x vocabulary] kept for backward
  chunked    logprobs.completion_logprobs with chunk_tokens = N (trainer.logprob_chunk_tokens; 512 is the
             recipe's default): fp32 work for N tokens at a time, forward and backward
As in the trainer, the logits are made inside the scoring function and only the log-probabilities
leave it, so each variant keeps exactly what its own autograd graph keeps.

Memory: peak RSS during the step minus the RSS just before it (the kernel's VmHWM, reset with
/proc/self/clear_refs), reset again between forward (projection, log-probs, loss) and backward.
glibc's malloc is told to give every block of 128 KiB or more back to the kernel when freed
(MALLOC_MMAP_THRESHOLD_, set before each child starts), so that RSS follows the live tensors; torch
keeps no allocator statistics on the CPU. Each child first runs the same step on 8 tokens, so that
kernel libraries' one-time buffers are not counted. The chunked variant keeps the logits for its
backward, which adds their gradient (2 x 1,188 MiB in bf16): a floor that chunking cannot lower (only
fusing the projection into the log-probs could); "over 2x logits" is what it adds on top, its fp32
temporaries. The unchunked graph frees the compute-dtype logits once it has upcast them.

Dtype: bf16 logits (what an accelerator job computes in) when this CPU computes bf16 natively
(avx512_bf16 or amx_bf16 in /proc/cpuinfo), else fp32. With fp32 logits the unchunked path's
`.float()` upcast is a no-op, so its cost, and the gain of chunking, are understated there; say
`--dtype` to choose (measured here: 0.45 with fp32 logits, whose gradient and saved logits are
twice as big). Temperature is the recipe's default, 1.0; another temperature makes the unchunked
path divide a second fp32 copy, but the upcast it divides is freed at once, so neither peak moves
(`--temperature 0.7`: the same figures).

The children's log-probabilities and gradients are compared: every variant must give the same
numbers (the chunked log-probs equal the unchunked ones exactly; tests/compute/train/test_grpo_math.py holds them
against TRL).

Layout: a function per measurement section returns its table and its key=value results; the last
line joins the results of all sections. (The fit estimate of issue 14 is to become a second section.)

A third section holds the plan's count for LoRA on expert stacks (model.lora_target_parameters) to
what a forward keeps for its backward (expert_lora_section).

Last line: logprob_peak_ratio_chunked_over_full=X fit_estimate_error=Y expert_lora_kept_over_estimate=Z.
X: the peak of the chunked variant at the recipe's default chunk over the unchunked peak (target X
<= 0.25). Y: the fit section's worst |estimate - measured| / measured (target Y <= 0.3). Z: what
adapters on expert stacks add to the kept tensors over the plan's count (target Z <= 1: never under).

    .venv/bin/python scripts/bench_memory.py          # a few minutes on 2 cores, ~12 GB free memory needed
    .venv/bin/python scripts/bench_memory.py --smoke  # that it runs (tests/e2e/test_bench_smoke.py): 256 tokens,
                                                      # vocabulary 4,096, chunk 64, the 1M model; seconds
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchtable import print_table  # noqa: E402  (scripts/benchtable.py)
from hpcrl.job.recipe import TrainerConfig  # noqa: E402
from rss import MMAP_THRESHOLD, peak_rss_bytes, reset_peak_rss, rss_bytes  # noqa: E402  (scripts/rss.py)

MIB = 2 ** 20
# The log-probs' setting (see the docstring), and the smallest one for --smoke.
SHAPE = dict(tokens=4_096, rows=2, vocab=151_936, hidden=256)
SMOKE_SHAPE = dict(tokens=256, rows=2, vocab=4_096, hidden=32)


def native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


# ------------------------------------------------------------------------------------------------
# One variant, in a child process


def logprob_step(cfg: dict) -> dict:
    """The measured step of one variant (run in a fresh interpreter); returns its figures."""
    import gc

    import torch

    from hpcrl.compute.train import logprobs
    from hpcrl.compute.train.loss import LossConfig, grpo_loss

    torch.set_num_threads(cfg["threads"])
    dtype = getattr(torch, cfg["dtype"])
    temperature, chunk, variant = cfg["temperature"], cfg["chunk"], cfg["variant"]

    def inputs(rows: int, t: int):
        g = torch.Generator().manual_seed(0)
        h = torch.randn(rows, t + 1, cfg["hidden"], generator=g).to(dtype).requires_grad_()
        w = (torch.randn(cfg["hidden"], cfg["vocab"], generator=g) * cfg["hidden"] ** -0.5).to(dtype).requires_grad_()
        ids = torch.randint(0, cfg["vocab"], (rows, t), generator=g)
        lengths = torch.tensor([t - i * (t // 4) for i in range(rows)])       # some right padding
        mask = (torch.arange(t)[None] < lengths[:, None]).long()
        ref = -torch.rand(rows, t, generator=g) * 4 - 5
        return h, w, ids, mask, torch.randn(rows, generator=g), ref

    def score(h, w, ids):
        logits = h @ w          # local: freed when it returns unless the log-probs' graph keeps it
        if variant == "unchunked":
            return logprobs.token_logprobs_unchunked(logits[:, :-1], ids, temperature)
        return logprobs.completion_logprobs(logits, ids, temperature, chunk_tokens=chunk)

    def step(h, w, ids, mask, adv, ref, between=None):
        logps = score(h, w, ids)
        loss, _ = grpo_loss(logps, None, ref, adv, mask, LossConfig(loss_type="dapo", beta=0.04))
        if between:
            between()
        loss.backward()
        return logps.detach(), loss.detach()

    step(*inputs(cfg["rows"], 8))       # warm-up: kernels' one-time buffers
    h, w, ids, mask, adv, ref = inputs(cfg["rows"], cfg["tokens"] // cfg["rows"])
    gc.collect()
    marks = {}

    def after_forward():
        marks["fwd_peak"] = peak_rss_bytes() - base
        marks["fwd_s"] = time.perf_counter() - t0
        reset_peak_rss()

    base = rss_bytes()
    resettable = reset_peak_rss()
    t0 = time.perf_counter()
    logps, loss = step(h, w, ids, mask, adv, ref, after_forward)
    total_s = time.perf_counter() - t0
    bwd_peak = peak_rss_bytes() - base
    m = mask.bool()
    return {
        "fwd_peak": marks["fwd_peak"], "bwd_peak": bwd_peak, "peak": max(marks["fwd_peak"], bwd_peak),
        "fwd_s": marks["fwd_s"], "bwd_s": total_s - marks["fwd_s"], "total_s": total_s,
        "logits_bytes": cfg["rows"] * (cfg["tokens"] // cfg["rows"] + 1) * cfg["vocab"] * h.element_size(),
        "resettable": resettable, "loss": loss.item(), "logps_sum": logps[m].double().sum().item(),
        "logps_max_abs": logps[m].abs().max().item(),
        "grad_w": w.grad.double().norm().item(), "grad_h": h.grad.double().norm().item(),
    }


def run_child(cfg: dict, timeout: float) -> dict:
    """``CHILD_STEPS[cfg["step"]](cfg)`` in a fresh interpreter, with malloc set up for RSS peaks."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD), OMP_NUM_THREADS=str(cfg["threads"]))
    proc = subprocess.run([sys.executable, __file__, "--child", json.dumps(cfg)], env=env, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"variant {cfg['variant']} (chunk {cfg['chunk']}) failed, exit {proc.returncode}:\n"
                         f"{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------
# Sections: each returns (title, headers, rows, notes, key=value results)


def logprob_section(args) -> tuple[str, list[str], list[list[str]], list[str], dict[str, str]]:
    threads = 1 if args.smoke else len(os.sched_getaffinity(0))
    dtype = args.dtype or ("bfloat16" if native_bf16() else "float32")
    shape = SMOKE_SHAPE if args.smoke else SHAPE
    base = dict(shape, dtype=dtype, temperature=args.temperature, threads=threads)
    variants = [("unchunked", 0)] + [("chunked", c) for c in args.chunks]
    results = []
    for variant, chunk in variants:
        t0 = time.perf_counter()
        r = run_child(dict(base, step="logprob", variant=variant, chunk=chunk), args.timeout)
        r["wall_s"] = time.perf_counter() - t0
        results.append((variant, chunk, r))
        print(f"  {variant:>9} chunk {chunk or '-':>5}: peak {r['peak'] / MIB:,.0f} MiB, step {r['total_s']:.1f} s "
              f"({r['wall_s']:.0f} s with start-up)", flush=True)

    full = results[0][2]
    for variant, chunk, r in results[1:]:     # the same computation: the same numbers
        for key, tol in (("loss", 1e-6), ("logps_sum", 1e-9), ("grad_w", 1e-3), ("grad_h", 1e-3)):
            if abs(r[key] - full[key]) > tol * max(1.0, abs(full[key])):
                raise SystemExit(f"chunk {chunk}: {key} {r[key]!r} differs from the unchunked {full[key]!r}")
    if not all(r["resettable"] for _, _, r in results):
        print("warning: /proc/self/clear_refs not writable: peaks are over each child's whole life")

    floor = 2 * full["logits_bytes"]
    headers = ["variant", "chunk", "fwd peak MiB", "bwd peak MiB", "peak MiB", "over 2x logits MiB",
               "x unchunked", "fwd s", "bwd s", "time s"]
    rows = []
    for variant, chunk, r in results:
        rows.append([variant, str(chunk) if chunk else "-", f"{r['fwd_peak'] / MIB:,.0f}",
                     f"{r['bwd_peak'] / MIB:,.0f}", f"{r['peak'] / MIB:,.0f}", f"{(r['peak'] - floor) / MIB:,.0f}", f"{r['peak'] / full['peak']:.4f}",
                     f"{r['fwd_s']:.1f}", f"{r['bwd_s']:.1f}", f"{r['total_s']:.1f}"])
    tokens, rows_ = shape["tokens"], shape["rows"]
    title = (f"Log-probs + dapo loss, forward and backward: {tokens} completion tokens ({rows_} x {tokens // rows_}), "
             f"vocabulary {shape['vocab']:,}, hidden {shape['hidden']}, {dtype} logits, "
             f"temperature {args.temperature:g}, {threads} thread{'s' if threads > 1 else ''}")
    notes = [
        f"peak: RSS high-water mark over the step minus RSS before it, in a fresh process per variant; the logits "
        f"are {full['logits_bytes'] / MIB:,.0f} MiB in {dtype}, their gradient as much (2x logits = "
        f"{floor / MIB:,.0f} MiB: what the chunked backward holds besides its fp32 chunk)",
        f"every variant gave the same loss ({full['loss']:.6f}), log-probs and gradient norms as the unchunked one",
    ]
    default_chunk, default = next(((c, r) for _, c, r in results if c == TrainerConfig.logprob_chunk_tokens), results[1][1:])
    if default_chunk != TrainerConfig.logprob_chunk_tokens:
        notes.append(f"the ratio below is for chunk {default_chunk}: the recipe's default {TrainerConfig.logprob_chunk_tokens} was not run")
    ratio = default["peak"] / full["peak"]
    return title, headers, rows, notes, {"logprob_peak_ratio_chunked_over_full": f"{ratio:.4f}"}


def fit_section(args) -> tuple[str, list[str], list[list[str]], list[str], dict[str, str]]:
    """hpcrl.job.memory's trainer estimate (what `hpcrl plan` and render use) against the peak of a real
    training step, measured by scripts/bench_train.py's ranks in its own setting (FSDP2 on gloo at
    world sizes 1 and 2, reference off and on). CPU: fp32 compute, no framework overhead counted."""
    import bench_train                                   # scripts/bench_train.py: the measured step
    from hpcrl.compute.models.tiny import make_tiny_model
    from hpcrl.job.memory import ModelStorage, TrainingStep, trainer_parts
    from hpcrl.job.model_shape import ModelShape, count_parameters

    work = Path(tempfile.gettempdir()) / "hpcrl-bench-train"      # bench_train's: the model is kept
    work.mkdir(parents=True, exist_ok=True)
    model_dir = make_tiny_model(work / f"model-{args.fit_size}", size=args.fit_size, seed=0)
    cfg = dict(batch=8, micro=8, num_generations=4, prompt_len=16, completion_len=32, steps=2, warmup=1,
               cores=sorted(os.sched_getaffinity(0)), model_dir=str(model_dir), modes=["full"])
    if args.smoke:          # bench_train --smoke's setting
        cfg.update(batch=4, micro=4, prompt_len=8, completion_len=8, steps=1, warmup=0, threads=1)
    params = count_parameters(str(model_dir))
    shape = ModelShape.from_config(json.loads((model_dir / "config.json").read_text()), params=params)
    headers = ["world", "reference", "measured MiB", "estimate MiB", "error", "state est/meas", "activ.+logits est/meas"]
    rows, errors = [], []
    for world in (1, 2):
        ranks = bench_train.run_world(world, cfg, work, args.timeout)
        for ref in ("ref_off", "ref_on"):
            measured = bench_train.summarize(ranks, "full", ref)
            step = TrainingStep(micro_batch=cfg["micro"], seq_len=cfg["prompt_len"] + cfg["completion_len"],
                                completion_len=cfg["completion_len"], compute_dtype="float32",
                                logprob_chunk_tokens=TrainerConfig.logprob_chunk_tokens, overhead_bytes=0)
            parts = trainer_parts(shape, step, ModelStorage(shard=world, params=params, reference=ref == "ref_on"))
            est = sum(parts.values())
            error = abs(est - measured["peak"]) / measured["peak"]
            errors.append(error)
            step_est = est - parts["training_state"] - parts["reference"]
            rows.append([str(world), "on" if ref == "ref_on" else "off", f"{measured['peak'] / MIB:,.0f}",
                         f"{est / MIB:,.0f}", f"{error:.3f}",
                         f"{(parts['training_state'] + parts['reference']) / (measured['state'] + measured['ref_params']):.2f}",
                         f"{step_est / measured['activations']:.2f}" if measured["activations"] else "-"])
    title = (f"Fit estimate (hpcrl.job.memory.trainer_parts) against a measured training step: {args.fit_size} model "
             f"({params / 1e6:.1f}M parameters, fp32), {cfg['micro']} completions of <= {cfg['prompt_len']} + "
             f"{cfg['completion_len']} tokens per rank")
    notes = ["measured: params + ref + grads + AdamW state (bytes of this rank's shards) + the fwd/bwd's peak RSS "
             "delta (scripts/bench_train.py); estimate: the formula for the same setting, sequences at full width, "
             "no overhead term; error = |estimate - measured| / measured, the worst row is the one reported"]
    return title, headers, rows, notes, {"fit_estimate_error": f"{max(errors):.3f}"}


# A Qwen3-MoE model whose expert stacks dominate a layer (the setting of expert_lora_section).
MOE_CONFIG = dict(model_type="qwen3_moe", vocab_size=4096, hidden_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=2,
                  moe_intermediate_size=256, intermediate_size=256, tie_word_embeddings=False)
STACKS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def expert_lora_step(cfg: dict) -> dict:
    """What a forward keeps for its backward (the saved tensors' storages, each once), with LoRA on
    q_proj, and on q_proj and the expert stacks (model.lora_target_parameters)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from hpcrl.compute.train.lora import add_adapters
    from hpcrl.job.recipe import ModelConfig

    torch.set_num_threads(cfg["threads"])
    config = {k: v for k, v in cfg["config"].items() if k != "model_type"}
    out = {}
    for name, parameters in (("modules", None), ("stacks", tuple(STACKS))):
        torch.manual_seed(0)
        model = add_adapters(Qwen3MoeForCausalLM(Qwen3MoeConfig(**config)), ModelConfig(
            use_peft=True, lora_r=8, lora_dropout=0.0, lora_target_modules=("q_proj",),
            lora_target_parameters=parameters))
        ids = torch.randint(0, config["vocab_size"], (1, cfg["tokens"]), generator=torch.Generator().manual_seed(1))
        # A parameter saved for the backward costs nothing beyond the model (grouped_mm saves the
        # plain stacks): only storages of the forward's own count.
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        kept: dict[int, int] = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(ids).logits.float().logsumexp(-1).mean()
        loss.backward()
        out[name] = sum(kept.values())
    return out


def expert_lora_section(args) -> tuple[str, list[str], list[list[str]], list[str], dict[str, str]]:
    """hpcrl.job.lora.LoraTargets.stack_bytes (what `hpcrl plan` counts for adapters on expert stacks:
    each layer's stacks merged, kept for the backward) against what a real forward keeps."""
    from hpcrl.job.lora import LoraTargets
    from hpcrl.job.model_shape import ModelShape

    shape = ModelShape.from_config(MOE_CONFIG)
    plain, stacks = (LoraTargets.of(shape, ("q_proj",), 8, parameters=p) for p in ((), STACKS))
    rows, ratios = [], []
    for tokens in ([64] if args.smoke else [16, 64, 1024]):
        # The plan's count without checkpointing: every layer's merged stacks, and the routed
        # tokens' inputs to them (LoraTargets.layer_activation_bytes).
        estimate = shape.num_layers * (stacks.stack_bytes(4) + tokens * (stacks.layer_activation_bytes(0, 4)
                                                                          - plain.layer_activation_bytes(0, 4)))
        kept = run_child(dict(step="expert_lora", variant="expert_lora", chunk=0, threads=1, tokens=tokens,
                              config=MOE_CONFIG), args.timeout)
        added = kept["stacks"] - kept["modules"]
        ratios.append(added / estimate)
        rows.append([str(tokens), f"{kept['modules'] / MIB:,.1f}", f"{kept['stacks'] / MIB:,.1f}",
                     f"{added / MIB:,.1f}", f"{estimate / MIB:,.1f}", f"{added / estimate:.2f}"])
    title = (f"Adapters on expert stacks (model.lora_target_parameters): kept for the backward, fp32, "
             f"{shape.num_layers} layers of {shape.experts} experts (top-{shape.experts_per_token}), hidden "
             f"{shape.hidden_size}, expert width {shape.expert_intermediate}")
    headers = ["tokens", "q_proj only MiB", "+ stacks MiB", "added MiB", "estimate MiB", "added / estimate"]
    notes = ["added: the storages a forward keeps for its backward, the parameters' own left out, beyond LoRA on "
             "q_proj alone; estimate: every layer's adapted stacks merged (experts x in x out) and each routed "
             "token's input to them, what the plan counts without checkpointing (target: added / estimate <= 1)"]
    return title, headers, rows, notes, {"expert_lora_kept_over_estimate": f"{max(ratios):.2f}"}


SECTIONS = [logprob_section, fit_section, expert_lora_section]
# What a section's children run, by cfg["step"].
CHILD_STEPS = {"logprob": logprob_step, "expert_lora": expert_lora_step}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--chunks", type=lambda s: [int(x) for x in s.split(",")], default=None,
                        help="chunk sizes to measure, comma separated "
                             f"(default {TrainerConfig.logprob_chunk_tokens},1024; --smoke: 64)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                        help="logits dtype (default: bfloat16 where this CPU computes it natively, else float32)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0)")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per variant or world size")
    parser.add_argument("--fit-size", default=None,
                        help='model of the fit section (hpcrl.compute.models.tiny size; default "base", ~100M; '
                             '--smoke: "tiny")')
    parser.add_argument("--smoke", action="store_true",
                        help="that it runs, in seconds: 256 tokens, vocabulary 4,096, chunk 64; the fit on the 1M "
                             "model, 1 step")
    args = parser.parse_args(argv)
    args.fit_size = args.fit_size or ("tiny" if args.smoke else "base")
    args.chunks = args.chunks or ([64] if args.smoke else [TrainerConfig.logprob_chunk_tokens, 1024])
    if args.child:
        cfg = json.loads(args.child)
        print(json.dumps(CHILD_STEPS[cfg["step"]](cfg)))
        return 0

    # Before any child starts: glibc reads it at process start (bench_train's ranks inherit it).
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results: dict[str, str] = {}
    load0 = os.getloadavg()[0]
    for section in SECTIONS:
        title, headers, rows, notes, values = section(args)
        print_table(title, headers, rows)
        for note in notes:
            print(note)
        results.update(values)
    print(f"machine load average (1 min): {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end "
          f"(times are noisy on shared cores, memory is not)")
    print(" ".join(f"{k}={v}" for k, v in results.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
