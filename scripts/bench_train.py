#!/usr/bin/env python
"""Trainer-only GRPO step on this machine: time and per-rank memory at world sizes 1 and 2.

No generation: every rank builds a fixed batch of "generated" completions (random prompt and
completion tokens of random lengths and random advantages, seeded by the rank, so rank 0's batch is
the same at both world sizes), packed by the trainer's own `pack_batch`. The policy (and with the reference on, the reference model) is loaded and sharded by
hpcrl's FSDP2 code exactly as the trainer does it (hpcrl.compute.train.fsdp: `fully_shard` per decoder layer
and root, rank 0 streams the checkpoint); the step is the trainer's: per micro-batch
`completion_logps` -> `hpcrl.compute.train.loss.grpo_loss` (dapo, TRL's numerics) -> backward, then
gradient clipping and AdamW (hpcrl.compute.train.optim). Each rank keeps its own batch of
`--batch` completions (per_device_train_batch_size: at world size 2 the global batch is twice as big).

World size 1 is one process with all the cores' threads; world size 2 is two gloo processes (a
FileStore), each pinned to its half of the cores. Reference off and on run in the same processes
(the reference is loaded with the policy, as the trainer loads it when grpo.beta > 0, and left
unused by the reference-off steps).

Time (time.perf_counter, medians over the measured steps after --warmup steps):
  fwd/bwd    the reference forward (when on) + the policy's forward and backward of every micro-batch
  ref fwd    of which the reference forward
  optimizer  gradient clipping (a collective) + AdamW step + zeroing the gradients
  tok/s      completion tokens of all ranks per step / step time (the machine's training throughput)

Memory per rank (the larger of the ranks; MiB):
  params, ref params, grads, optim   bytes of this rank's tensors: the local shards of the policy's
             parameters, of the reference's, of the gradients, of AdamW's state (exp_avg, exp_avg_sq, step)
  activations   peak RSS during fwd/bwd minus the RSS just before it (the kernel's VmHWM, reset with
             /proc/self/clear_refs). Gradients already exist then (zeroed in place, not freed), so this
             is what the step adds on top of the state: activations kept for backward, the all-gathered
             layers, the logits and other temporaries. glibc's malloc is told to return every block of
             128 KiB or more to the kernel when freed (MALLOC_MMAP_THRESHOLD_), so that RSS follows
             the live tensors (torch has no CPU allocator statistics to ask instead).
  peak       params + ref params + grads + optim + activations

The same for trainer.engine=deepspeed (DeepSpeed ZeRO-3, full fine-tuning) in the same processes
after those: the model built partitioned and loaded as the trainer does it
(hpcrl.compute.train.deepspeed_engine, the config of hpcrl.job.deepspeed.build_config), the step
the trainer's (engine backward per micro-batch, then its step: DeepSpeed's clipping and hpcrl's
AdamW over this rank's partition), the reference a ZeRO-3 inference engine. Its memory columns
count DeepSpeed's tensors the same way: params = this rank's partitions plus the whole tensors
DeepSpeed keeps of its "persistent" parameters (below stage3_param_persistence_threshold, on every
rank), grads = its gradient partitions, optim = AdamW's state plus DeepSpeed's fp32 master copy of
the partitions (it keeps one even when training in fp32).

The same for LoRA (model.use_peft on every linear layer, TRL's r 16 and alpha 32) in the same
processes after the full fine-tuning rows: the frozen base counts in params, the adapters' gradients
and AdamW state in grads and optim, and with the reference on it is the base itself (ref = 0).

Last line: peak_mem_ratio_ws2_over_ws1=Y where Y = (params + grads + optim) per rank at world size 2
over world size 1, reference off: the policy with its optimizer state. Y near 0.5 means sharding
works (every rank holds half); the goal is Y <= 0.6. Then LoRA over full fine-tuning at world size
2: lora_over_full_state_ws2 (params + grads + optim), lora_over_full_peak_ws2_ref_on (the peak with
beta > 0: the reference copy LoRA does not have), lora_over_full_step_time_ws2. Then
deepspeed_ws2_over_ws1_memory: Y for the deepspeed rows (the goal is <= 0.6 too).

    .venv/bin/python scripts/bench_train.py            # the 100M model ("base"), about 2-3 minutes on 2 cores
    .venv/bin/python scripts/bench_train.py --quick    # the 10M model ("small"), about two minutes
    .venv/bin/python scripts/bench_train.py --smoke    # the 1M model ("tiny"), 4 short completions, 1 step:
                                                       # that it runs (tests/e2e/test_bench_smoke.py), seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchtable import print_table  # noqa: E402  (scripts/benchtable.py)
from rss import MMAP_THRESHOLD, peak_rss_bytes, reset_peak_rss, rss_bytes  # noqa: E402  (scripts/rss.py)

MIB = 2 ** 20


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def tensor_bytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def optimizer_state_bytes(opt) -> int:
    import torch

    return tensor_bytes(v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor))


# ------------------------------------------------------------------------------------------------
# One rank


def fixed_batch(cfg: dict, seed: int):
    """The trainer's packed batch for `cfg["batch"]` random completions of random prompts."""
    import torch

    from hpcrl.compute.inference.types import Completion
    from hpcrl.compute.models.tiny import VOCAB_SIZE
    from hpcrl.compute.train.batch import pack_batch

    g = torch.Generator().manual_seed(seed)
    n, groups = cfg["batch"], cfg["batch"] // cfg["num_generations"]
    prompts = [torch.randint(3, VOCAB_SIZE, (int(torch.randint(cfg["prompt_len"] // 2, cfg["prompt_len"] + 1, (1,), generator=g)),),
                             generator=g).tolist() for _ in range(groups)]
    prompt_ids, completions = [], []
    for i in range(n):
        length = int(torch.randint(cfg["completion_len"] // 2, cfg["completion_len"] + 1, (1,), generator=g))
        ids = torch.randint(3, VOCAB_SIZE, (length,), generator=g).tolist()
        logps = (-torch.rand(length, generator=g) * 3).tolist()
        prompt_ids.append(prompts[i // cfg["num_generations"]])
        completions.append(Completion(i // cfg["num_generations"], tuple(ids), tuple(logps), "", False, 0))
    batch = pack_batch(prompt_ids, completions, 0, torch.device("cpu"))
    advantages = torch.randn(n, generator=g)
    return batch, advantages


def rank_main(rank: int, world: int, cfg: dict, store: str, out_dir: str) -> None:
    try:
        _rank_main(rank, world, cfg, store, out_dir)
    except BaseException:
        Path(out_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    from hpcrl.compute.launch.leave import exit_finished

    exit_finished(0)        # as a trainer task leaves: gloo's last work can abort finalization


def _rank_main(rank: int, world: int, cfg: dict, store: str, out_dir: str) -> None:
    cores = cfg["cores"]
    per = max(1, len(cores) // world)
    mine = cores[rank * per:(rank + 1) * per] or cores
    os.sched_setaffinity(0, mine)
    threads = cfg.get("threads") or len(mine)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hpcrl.job.recipe import GRPOConfig, ModelConfig, Recipe

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    cpu = torch.device("cpu")
    grpo_cfg = GRPOConfig(learning_rate=1e-6, beta=BETA, per_device_train_batch_size=cfg["micro"],
                          num_generations=cfg["num_generations"], max_completion_length=cfg["completion_len"],
                          max_steps=1000, gradient_checkpointing=False)
    out = {"rank": rank, "world": world, "threads": threads, "cores": mine}
    for mode in cfg["modes"]:
        if mode == "lora":      # LoRA on every linear layer of the decoder, TRL's r and alpha
            recipe = Recipe(grpo=grpo_cfg, model=ModelConfig(use_peft=True, lora_target_modules="all-linear"))
        else:
            recipe = Recipe(grpo=grpo_cfg)
        t0 = time.perf_counter()
        trainer = DeepSpeedTrainer(recipe, world, cfg) if mode == "deepspeed" else FsdpTrainer(recipe, cfg, mesh, cpu)
        out[mode] = _measure(trainer, time.perf_counter() - t0, rank, world, cfg)
        del trainer
        gc.collect()
    Path(out_dir, f"ws{world}-rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


BETA = 0.04     # the KL weight of the reference-on rows


class FsdpTrainer:
    """The policy and the reference as the trainer loads them for trainer.engine fsdp2
    (hpcrl.compute.train.fsdp.load_policy_and_reference), the step the trainer's: backward per
    micro-batch, then clipping and AdamW (hpcrl.compute.train.optim). Gradients are zeroed in place
    rather than freed (the trainer frees them), so that a step's activations column counts what
    the step adds on top of the state, not the gradients again."""

    def __init__(self, recipe, cfg: dict, mesh, cpu) -> None:
        from hpcrl.compute.train import fsdp
        from hpcrl.compute.train.optim import build_optimizer

        self.fsdp = fsdp
        self.model, self.reference = fsdp.load_policy_and_reference(cfg["model_dir"], mesh, cpu, recipe)
        self.params = list(self.model.parameters())
        self.optimizer = build_optimizer(self.model, recipe.grpo)

    def backward(self, loss) -> None:
        loss.backward()

    def step(self, max_grad_norm: float) -> None:
        from hpcrl.compute.train.optim import clip_grad_norm

        clip_grad_norm(self.params, max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)

    def state_bytes(self) -> dict:
        return {"params": self.fsdp.local_param_bytes(self.model), "optim": optimizer_state_bytes(self.optimizer),
                "grads": tensor_bytes(p.grad for p in self.params if p.grad is not None),
                "ref_params": self.fsdp.local_param_bytes(self.reference),
                "params_global": self.fsdp.global_param_bytes(self.model)}


class DeepSpeedTrainer:
    """The same for trainer.engine deepspeed: ZeRO-3 built and loaded as the trainer does it
    (hpcrl.compute.train.deepspeed_engine, the config of hpcrl.job.deepspeed.build_config), the
    reference a ZeRO-3 inference engine; its step DeepSpeed's clipping and hpcrl's AdamW over this
    rank's partition (gradients zeroed there)."""

    def __init__(self, recipe, world: int, cfg: dict) -> None:
        from hpcrl.compute.train import deepspeed_engine
        from hpcrl.job.deepspeed import build_config

        config = build_config(recipe, num_trainers=world, device_type="cpu", hidden_size=cfg["hidden_size"])
        self.policy, self.reference = deepspeed_engine.load_policy_and_reference(cfg["model_dir"], recipe, config)
        self.engine = deepspeed_engine.DeepSpeedEngine(self.policy, config)
        self.engine.configure(recipe.grpo)
        self.model = self.engine.model

    def backward(self, loss) -> None:
        self.engine.backward(loss)

    def step(self, max_grad_norm: float) -> None:
        self.engine.step(max_grad_norm)

    def state_bytes(self) -> dict:
        out = deepspeed_state_bytes(self.policy, self.engine.ds.optimizer, self.engine.optimizer)
        out["ref_params"] = deepspeed_state_bytes(self.reference.module)["params"]
        out["params_global"] = sum(p.ds_numel * p.element_size() for p in self.policy.parameters())
        return out


def deepspeed_state_bytes(policy, ds_optimizer=None, client_optimizer=None) -> dict:
    """This rank's bytes of a ZeRO-3 model's tensors, each storage counted once: params (the
    partitions, and the whole tensors of parameters DeepSpeed keeps gathered: its "persistent"
    ones), grads (the optimizer's gradient partitions) and optim (everything else the ZeRO-3
    optimizer holds: the fp32 master partitions, and the client AdamW's state)."""
    import torch

    seen: set[int] = set()
    out = {"params": 0, "grads": 0, "optim": 0}

    def add(kind: str, t) -> None:
        if isinstance(t, torch.Tensor) and t.numel():
            storage = t.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                out[kind] += storage.nbytes()

    def walk(kind: str, value, depth: int = 0) -> None:
        if isinstance(value, torch.Tensor):
            add(kind, value)
            add("grads", value.grad)
        elif isinstance(value, (list, tuple)) and depth < 3:
            for v in value:
                walk(kind, v, depth + 1)
        elif isinstance(value, dict) and depth < 3:
            for v in value.values():
                walk(kind, v, depth + 1)

    params = list(policy.parameters())
    for p in params:
        add("params", p.ds_tensor)
        add("params", p.data)
    if ds_optimizer is not None:
        for name, value in vars(ds_optimizer).items():
            walk("grads" if "grad" in name.lower() else "optim", value)
    if client_optimizer is not None:
        walk("optim", client_optimizer.state)
    return out


def _measure(trainer, load_s: float, rank: int, world: int, cfg: dict) -> dict:
    """Time and measure steps with the reference off and on (loaded with the policy, as the
    trainer loads it when grpo.beta > 0; unused by the reference-off steps)."""
    import torch
    import torch.distributed as dist

    from hpcrl.compute.train.batch import completion_logps
    from hpcrl.compute.train.loss import LossConfig, grpo_loss

    batch, advantages = fixed_batch(cfg, seed=1000 + rank)
    rows, micro = batch["input_ids"].shape[0], cfg["micro"]
    tokens_local = float(batch["completion_mask"].sum())
    tokens_global = torch.tensor([tokens_local])
    dist.all_reduce(tokens_global)
    tokens_global = float(tokens_global)
    peak_ok = reset_peak_rss()
    model = trainer.model
    loss_config = LossConfig(loss_type="dapo", max_completion_length=cfg["completion_len"], num_processes=world,
                             gradient_accumulation_steps=rows // micro)

    def step(reference):
        dist.barrier()
        base = rss_bytes()
        reset_peak_rss()
        t_start = time.perf_counter()
        ref_logps = None
        if reference is not None:
            with torch.no_grad():
                ref_logps = completion_logps(reference, batch, 1.0)
        t_ref = time.perf_counter()
        model.train()
        for start in range(0, rows, micro):
            sl = slice(start, start + micro)
            logps = completion_logps(model, batch, 1.0, sl)
            config = dataclasses.replace(loss_config, beta=BETA if reference is not None else 0.0)
            loss, _ = grpo_loss(logps, None, None if ref_logps is None else ref_logps[sl], advantages[sl],
                                batch["completion_mask"][sl], config, num_items_in_batch=tokens_global)
            trainer.backward(loss)
        t_fb = time.perf_counter()
        fb_peak = peak_rss_bytes() - base
        reset_peak_rss()
        base_opt = rss_bytes()
        t_opt0 = time.perf_counter()
        trainer.step(1.0)
        t_opt = time.perf_counter()
        return {"fwd_bwd_s": t_fb - t_start, "ref_fwd_s": t_ref - t_start if reference is not None else 0.0,
                "optimizer_s": t_opt - t_opt0,
                "step_s": t_opt - t_start, "activations": fb_peak, "optimizer_peak": peak_rss_bytes() - base_opt}

    out = {"load_s": load_s, "peak_rss_resettable": peak_ok, "tokens_per_rank": tokens_local, "rows": rows}
    for ref_on in (False, True):
        steps = [step(trainer.reference if ref_on else None) for _ in range(cfg["warmup"] + cfg["steps"])][cfg["warmup"]:]
        res = {k: statistics.median(s[k] for s in steps) for k in steps[0]}
        res["activations"] = max(s["activations"] for s in steps)
        res.update(trainer.state_bytes())
        if not ref_on:
            res["ref_params"] = 0
        out["ref_on" if ref_on else "ref_off"] = res
    return out


def run_world(world: int, cfg: dict, work: Path, timeout: float) -> list[dict]:
    out_dir = Path(tempfile.mkdtemp(prefix=f"ws{world}-", dir=work))
    store = out_dir / "store"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=rank_main, args=(r, world, cfg, str(store), str(out_dir))) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = sorted(out_dir.glob("rank*.err"))
    if errors:
        raise SystemExit("\n".join(f"--- {e.name} ---\n{e.read_text()}" for e in errors))
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"world size {world}: exit codes {[p.exitcode for p in procs]} (timeout {timeout:.0f} s?)")
    return [json.loads((out_dir / f"ws{world}-rank{r}.json").read_text()) for r in range(world)]


# ------------------------------------------------------------------------------------------------
# Report

MEM_KEYS = ("params", "ref_params", "grads", "optim", "activations")
TIME_KEYS = ("fwd_bwd_s", "ref_fwd_s", "optimizer_s", "step_s")


def summarize(ranks: list[dict], mode: str, ref: str) -> dict:
    """One row: the larger rank's figure for every memory and time column."""
    rs = [r[mode] for r in ranks]
    row = {k: max(r[ref][k] for r in rs) for k in MEM_KEYS + TIME_KEYS}
    row["state"] = max(r[ref]["params"] + r[ref]["grads"] + r[ref]["optim"] for r in rs)
    row["peak"] = max(sum(r[ref][k] for k in MEM_KEYS) for r in rs)
    row["threads"] = ranks[0]["threads"]
    row["tokens_per_s"] = sum(r["tokens_per_rank"] for r in rs) / row["step_s"]
    return row


COLUMNS = [  # key, header, kind
    ("threads", "thr", "int"),
    ("fwd_bwd_s", "fwd/bwd s", "s"), ("ref_fwd_s", "ref fwd s", "s"), ("optimizer_s", "optim s", "s"),
    ("step_s", "step s", "s"), ("tokens_per_s", "tok/s", "int"),
    ("params", "params", "mib"), ("ref_params", "ref", "mib"), ("grads", "grads", "mib"),
    ("optim", "optim", "mib"), ("activations", "activ.", "mib"), ("state", "p+g+o", "mib"), ("peak", "peak", "mib"),
]


def _fmt(value, kind: str) -> str:
    if kind == "int":
        return str(round(value))
    if kind == "s":
        return f"{value:.3f}"
    return f"{value / MIB:.1f}"


def _ratio(a, b) -> str:
    return f"x{a / b:.2f}" if b else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help='the 10M model ("small") instead of the 100M one')
    parser.add_argument("--smoke", action="store_true",
                        help='that every row runs, in seconds: the 1M model ("tiny"), 4 completions of <= 8 tokens '
                             "in micro-batches of 2, 1 step, no warm-up")
    parser.add_argument("--size", default=None, help='hpcrl.compute.models.tiny size (default "base", ~100M; --quick: "small")')
    parser.add_argument("--batch", type=int, default=None, help="completions per rank and step (default 8)")
    parser.add_argument("--micro", type=int, default=None, help="completions per micro-batch (default: --batch)")
    parser.add_argument("--prompt-len", type=int, default=None, help="longest prompt, tokens (default 16)")
    parser.add_argument("--completion-len", type=int, default=None, help="longest completion, tokens (default 32)")
    parser.add_argument("--steps", type=int, default=None, help="measured steps per setting (default 3)")
    parser.add_argument("--warmup", type=int, default=None, help="unmeasured steps first (default 1)")
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "hpcrl-bench-train",
                        help="where the model is built (kept for the next run)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per world size")
    parser.add_argument("--no-lora", action="store_true", help="full fine-tuning rows only (no model.use_peft rows)")
    parser.add_argument("--no-deepspeed", action="store_true", help="no trainer.engine=deepspeed rows")
    args = parser.parse_args(argv)

    size = args.size or ("tiny" if args.smoke else "small" if args.quick else "base")
    batch = args.batch or (4 if args.smoke else 8)
    cfg = dict(batch=batch, micro=args.micro or (2 if args.smoke else batch), num_generations=4,
               prompt_len=args.prompt_len or (8 if args.smoke else 16),
               completion_len=args.completion_len or (8 if args.smoke else 32), steps=args.steps or (1 if args.smoke else 3),
               warmup=args.warmup if args.warmup is not None else 0 if args.smoke else 1)
    if cfg["batch"] % cfg["micro"] or cfg["batch"] % cfg["num_generations"]:
        parser.error("--batch must be a multiple of --micro and of 4 (generations per prompt)")
    # Before any child starts: glibc reads it at process start (see the module docstring).
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    cores = sorted(os.sched_getaffinity(0))
    cfg["cores"] = cores
    if args.smoke:
        # Matrices this small gain nothing from threads, and on busy cores OpenMP's spinning
        # threads made the smoke run twice as long.
        cfg["threads"] = 1
    deepspeed = not args.no_deepspeed and importlib.util.find_spec("deepspeed") is not None
    if not args.no_deepspeed and not deepspeed:
        print("deepspeed is not installed: no trainer.engine=deepspeed rows")
    modes = cfg["modes"] = ["full"] + ([] if args.no_lora else ["lora"]) + (["deepspeed"] if deepspeed else [])
    args.work_dir.mkdir(parents=True, exist_ok=True)

    from hpcrl.compute.models.tiny import SIZES, make_tiny_model

    t0 = time.perf_counter()
    model_dir = make_tiny_model(args.work_dir / f"model-{size}", size=size, seed=0)
    cfg["model_dir"] = str(model_dir)
    cfg["hidden_size"] = SIZES[size].hidden_size
    print(f"model: {size} ({SIZES[size].approx_params / 1e6:.1f}M parameters, fp32 policy), {model_dir} "
          f"({time.perf_counter() - t0:.1f} s)")
    print(f"batch per rank: {cfg['batch']} completions ({cfg['batch'] // cfg['num_generations']} prompts x "
          f"{cfg['num_generations']}), micro-batch {cfg['micro']}, prompts <= {cfg['prompt_len']} and completions "
          f"<= {cfg['completion_len']} tokens; {cfg['warmup']} warm-up + {cfg['steps']} measured steps per setting; "
          f"{len(cores)} cores, torch threads per rank = " + ("1" if cfg.get("threads") else "cores / world size"))

    load0 = os.getloadavg()[0]
    results: dict[int, list[dict]] = {}
    for world in (1, 2):
        t0 = time.perf_counter()
        results[world] = run_world(world, cfg, args.work_dir, args.timeout)
        print(f"world size {world}: {time.perf_counter() - t0:.0f} s (load "
              + ", ".join(f"{m} {results[world][0][m]['load_s']:.1f} s" for m in modes) + ")")
    if not all(r[m]["peak_rss_resettable"] for rs in results.values() for r in rs for m in modes):
        print("warning: /proc/self/clear_refs not writable: activations are peak RSS over the whole process life")

    rows_by = {(m, w, ref): summarize(results[w], m, ref) for m in modes for w in (1, 2) for ref in ("ref_off", "ref_on")}
    headers = ["model", "world", "reference"] + [h for _, h, _ in COLUMNS]
    rows = []
    for m in modes:
        for ref in ("ref_off", "ref_on"):
            for w in (1, 2):
                r = rows_by[(m, w, ref)]
                rows.append([m, str(w), "on" if ref == "ref_on" else "off"] + [_fmt(r[k], kind) for k, _, kind in COLUMNS])
    print_table("Per rank (the larger of the ranks): median times in s, memory in MiB", headers, rows)

    ratio_rows = []
    for m in modes:
        for ref in ("ref_off", "ref_on"):
            one, two = rows_by[(m, 1, ref)], rows_by[(m, 2, ref)]
            ratio_rows.append([m, "2 / 1", "on" if ref == "ref_on" else "off"]
                              + [_ratio(two[k], one[k]) for k, _, _ in COLUMNS])
    if "lora" in modes:
        for w in (1, 2):
            for ref in ("ref_off", "ref_on"):
                lora, full = rows_by[("lora", w, ref)], rows_by[("full", w, ref)]
                ratio_rows.append(["lora / full", str(w), "on" if ref == "ref_on" else "off"]
                                  + [_ratio(lora[k], full[k]) for k, _, _ in COLUMNS])
    if "deepspeed" in modes:
        for w in (1, 2):
            for ref in ("ref_off", "ref_on"):
                ds, full = rows_by[("deepspeed", w, ref)], rows_by[("full", w, ref)]
                ratio_rows.append(["deepspeed / full", str(w), "on" if ref == "ref_on" else "off"]
                                  + [_ratio(ds[k], full[k]) for k, _, _ in COLUMNS])
    print_table("Ratios (same run): world size 2 over 1; LoRA over full fine-tuning; DeepSpeed ZeRO-3 over FSDP2",
                headers, ratio_rows)
    print("model: full = every weight trains (fp32 masters); lora = model.use_peft on every linear layer (r 16,\n"
          "alpha 32), the base frozen in the training dtype (fp32 on CPU), the reference = the base itself;\n"
          "deepspeed = full fine-tuning with trainer.engine=deepspeed (ZeRO-3; the other rows are FSDP2): params =\n"
          "its partitions + the whole persistent parameters, optim = AdamW state + DeepSpeed's fp32 master copy.\n"
          "thr: torch threads per rank (pinned to its own cores). time: perf_counter; fwd/bwd includes the\n"
          "reference forward (ref fwd); optim = clipping + AdamW + zeroing; tok/s = completion tokens of all ranks\n"
          "/ step s. memory: params, ref, grads, optim = bytes of this rank's local shards; activ. = peak RSS\n"
          "delta over fwd/bwd (VmHWM; torch keeps no CPU allocator stats); p+g+o = params + grads + optim (the\n"
          "policy with its optimizer state); peak = p+g+o + ref + activ.")
    print(f"machine load average (1 min): {load0:.1f} at start, {os.getloadavg()[0]:.1f} at end "
          f"(other processes share these {len(cores)} cores: times are noisy, memory is not)")
    full1, full2 = rows_by[("full", 1, "ref_off")], rows_by[("full", 2, "ref_off")]
    y = full2["state"] / full1["state"]
    print(f"policy + optimizer state per rank: {full1['state'] / MIB:.1f} MiB at world size 1, "
          f"{full2['state'] / MIB:.1f} MiB at 2; with activations (peak) x{full2['peak'] / full1['peak']:.2f}")
    last = f"peak_mem_ratio_ws2_over_ws1={y:.3f}"
    if "lora" in modes:
        lora_on, full_on = rows_by[("lora", 2, "ref_on")], rows_by[("full", 2, "ref_on")]
        print(f"LoRA, world size 2, beta > 0: reference {lora_on['ref_params'] / MIB:.1f} MiB per rank (full fine-tuning: "
              f"{full_on['ref_params'] / MIB:.1f} MiB), peak {lora_on['peak'] / MIB:.1f} MiB "
              f"(full: {full_on['peak'] / MIB:.1f} MiB)")
        last += (f" lora_over_full_state_ws2={rows_by[('lora', 2, 'ref_off')]['state'] / full2['state']:.3f}"
                 f" lora_over_full_peak_ws2_ref_on={lora_on['peak'] / full_on['peak']:.3f}"
                 f" lora_over_full_step_time_ws2={rows_by[('lora', 2, 'ref_off')]['step_s'] / full2['step_s']:.3f}")
    if "deepspeed" in modes:
        ds1, ds2 = rows_by[("deepspeed", 1, "ref_off")], rows_by[("deepspeed", 2, "ref_off")]
        print(f"deepspeed ZeRO-3 policy + optimizer state per rank: {ds1['state'] / MIB:.1f} MiB at world size 1, "
              f"{ds2['state'] / MIB:.1f} MiB at 2; with activations (peak) x{ds2['peak'] / ds1['peak']:.2f}; "
              f"step time at 2 over FSDP2's x{ds2['step_s'] / full2['step_s']:.2f}")
        last += f" deepspeed_ws2_over_ws1_memory={ds2['state'] / ds1['state']:.3f}"
    print(last)
    return 0


if __name__ == "__main__":
    sys.exit(main())
