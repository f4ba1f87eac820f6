#!/usr/bin/env python
"""A MODEL of one GRPO step of Qwen2.5-14B on 1..256 Frontier nodes, not a measurement.

Two designs on the same nodes (8 MI250X GCDs each), both in order (generate, train, reduce the
gradients, sync the weights), as hpcrl and TRL run by default:

  hpcrl          every node: 7 trainers (HSDP: sharded inside the node, replicated across nodes)
                 and 1 vLLM engine (inference.gpus=1) that generates that node's share of the batch.
                 Sync: the node's trainers all-gather each weight inside the node (bf16), the
                 trainer on GCD 6 sends it to the engine on GCD 7 (same MI250X, 200 GB/s). Every
                 node at once, nothing across the network: constant in the node count.
  single server  TRL's server mode: one server of --server-gpus GCDs (default 8: a node of its
                 own, as TRL's multi-node docs lay it out, serving as 8 data-parallel engines; 14B
                 fits one GCD), all other GCDs train. The server generates the whole batch. Sync:
                 every trainer all-gathers each weight over all trainer ranks (full_tensor(), per
                 tensor), global rank 0 sends it over its one NIC to the server.

The training side (compute and the gradient all-reduce across nodes) is the same formula for both;
only the number of trainers differs. Every choice that is not measured is given to the single
server: bf16 on its wire (TRL gathers whatever its masters are), one packed send (TRL's server
mode posts and broadcasts per tensor: ~40 s for a 30B model in TRL #3557), no per-micro-batch
all-gathers of full sharding across nodes. Work divides evenly, prefill is free, every completion
runs to full length, nothing overlaps.

Each input carries its source (the table printed first): "published" (a note in ../shared/notes,
a vendor spec, a paper, a model card), "measured here" (this repo's bench outputs, README), "code"
(what hpcrl does), "assumed" (no figure found: a stated guess), "chosen" (the workload).

Sources beyond this repo: ../shared/notes/frontier.md (node, links), weight-sync.md and peers.md
(TRL's server mode and layouts); AMD's MI250X spec (383 TFLOP/s bf16, 3.28 TB/s HBM2e, for 2 GCDs);
Dash et al., "Optimizing Distributed Training on Frontier for Large Language Models" (2023: 22B
at 73.5 TFLOP/s a GCD, 38% of peak, Megatron-DeepSpeed pre-training, so optimistic for FSDP2 GRPO);
RCCL's own cost model, baseLat/hwLat in src/graph/tuning.cc (ROCm/rccl at 0023b9b, ring, simple
protocol); Qwen2.5-14B's config.json. This repo: bench_sync's figures in README (CPU) and the code.

Prints the inputs, a table per scaling (strong: a fixed global batch; weak: a fixed batch per
node), writes the figure (--out, default docs/step_model.png), and, last, one line:
    speedup_strong_at_256=X speedup_weak_at_256=Y sync_s_hpcrl=Z sync_s_single_server_at_256=W
    sync_share_at_256_hpcrl=... sync_share_at_256_single_server=... crossover_nodes_strong=C
    async_speedup_at_256_k1=... async_speedup_at_256_continuous=... engine_idle_at_256_k0=...
    engine_idle_at_256_continuous=...
X, Y = single server's step / hpcrl's step at 256 nodes; C = the fewest nodes at which hpcrl's step
is the shorter (strong scaling; inf where it never is). The async_* figures: hpcrl's step with a
long tail of completion lengths, in order against a batch generated ahead (k >= 1, between_requests)
and against engines that refill their freed slots (continuous per sample: weight_update in_flight),
at 256 nodes; engine idle = the share of an engine's decode capacity a step leaves unused. The same rule,
applied to bench_step --async's measured CPU phases, is printed beside the bench's measurements.

    .venv/bin/python scripts/model_step.py [--out docs/step_model.png] [--no-plot] [--server-gpus 8]
    .venv/bin/python scripts/model_step.py --smoke     # the same, the figure drawn into a temporary file
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchtable import print_table  # noqa: E402  (scripts/benchtable.py)

REPO = Path(__file__).resolve().parent.parent
NODES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
GB = 1e9


def _in(value, unit: str, source: str):
    return field(default=value, metadata={"unit": unit, "source": source})


@dataclass(frozen=True)
class Inputs:
    # The model: Qwen2.5-14B (hidden 5120, 48 layers, 40/8 heads, MLP 13824, vocab 152064, untied).
    params: float = _in(14.77e9, "", "published: Qwen2.5-14B config.json, counted (weight-sync.md: 29.5 GB bf16)")
    tensors: int = _in(579, "", "published: Qwen2.5-14B config.json, 12 a layer x 48 + embed, norm, lm_head")
    # A Frontier node.
    gpus_per_node: int = _in(8, "GCD", "published: frontier.md (4 MI250X = 8 GCDs)")
    engines_per_node: int = _in(1, "GCD", "code: hpcrl on Frontier, 7 trainers + 1 server (README, plan)")
    same_mi250x_gbs: float = _in(200.0, "GB/s", "published: frontier.md (GCD 6 <-> 7, one MI250X)")
    cross_mi250x_gbs: float = _in(50.0, "GB/s", "published: frontier.md (50-100 between MI250X; low end)")
    nic_gbs: float = _in(25.0, "GB/s", "published: frontier.md (Slingshot-11, one NIC)")
    nics_per_node: int = _in(4, "", "published: frontier.md (4 x 25 = 100 GB/s a node)")
    # A GCD.
    peak_tflops: float = _in(191.5, "TFLOP/s", "published: AMD MI250X spec, 383 bf16 / 2 GCDs")
    hbm_tbs: float = _in(1.638, "TB/s", "published: AMD MI250X spec, 3.28 / 2 GCDs")
    train_tflops: float = _in(73.5, "TFLOP/s", "published: Dash et al. 2023, Frontier, 22B (38% of peak)")
    decode_flops_fraction: float = _in(0.20, "", "assumed: decode at full batch, no MI250X vLLM figure found")
    decode_hbm_fraction: float = _in(0.60, "", "assumed: share of HBM bandwidth a decode step gets")
    # Links and collectives.
    link_efficiency: float = _in(0.85, "", "measured here (CPU): bench_sync handoff/memcpy 0.85; assumed for every link")
    coll_base_us: float = _in(27.9, "us", "published: RCCL cost model, src/graph/tuning.cc (ring, simple)")
    intra_hop_us: float = _in(2.7, "us", "published: RCCL cost model, a hop inside a node")
    net_hop_us: float = _in(4.5, "us", "published: RCCL cost model, a hop across the network")
    # What a step does.
    wire_bytes_per_param: float = _in(2.0, "B", "measured here: bench_sync gathered/wire bytes 1.00 (bf16 gathers)")
    grad_bytes_per_param: float = _in(4.0, "B", "code: fp32 gradient reduction (train/fsdp.py)")
    reduces_per_step: int = _in(49, "", "code: FSDP2, one reduction a layer + root, once a step")
    train_flops_per_token: float = _in(10.0, "x params", "chosen: fwd+bwd 6, recompute 2, reference 2 (beta > 0)")
    prompt_tokens: int = _in(256, "tokens", "chosen")
    completion_tokens: int = _in(1024, "tokens", "chosen")
    global_batch: int = _in(4096, "completions", "chosen: strong scaling (512 prompts x 8)")
    per_node_batch: int = _in(64, "completions", "chosen: weak scaling (8 prompts x 8 a node)")
    server_gpus: int = _in(8, "GCD", "chosen: a node of its own (TRL's multi-node docs, peers.md)")
    # Asynchronous generation (issue 31): a long tail of completion lengths, as bench_step --long-tail makes it.
    tail_every: int = _in(8, "", "chosen: 1 completion in 8 runs to completion_tokens (bench_step --long-tail)")
    tail_ratio: float = _in(8.0, "x", "chosen: the long ones 8x the others (the issue: some 8x the median)")
    cpu_gen_s: float = _in(4.73, "s", "measured here: bench_step --async, k=0, generation waited (README)")
    cpu_train_s: float = _in(22.0, "s", "measured here: bench_step --async, k=0, training (README)")
    cpu_steps_ratio_k4: float = _in(1.34, "x", "measured here: bench_step --async, steps/s k=4 over k=0")
    cpu_engine_idle_k0: float = _in(0.83, "", "measured here: bench_step --async, engine idle at k=0")
    cpu_engine_idle_k4: float = _in(0.79, "", "measured here: bench_step --async, engine idle at k=4")

    @property
    def wire_bytes(self) -> float:
        """Bytes of one sync: the model in bf16."""
        return self.params * self.wire_bytes_per_param

    @property
    def trainers_per_node(self) -> int:
        return self.gpus_per_node - self.engines_per_node


# ------------------------------------------------------------------ collectives

def ring_latency_s(inp: Inputs, ranks: int, nodes: int, steps_per_rank: int = 1) -> float:
    """RCCL's latency model for one ring collective: a base plus one hop per step (all-gather:
    ranks - 1 steps, all-reduce: twice that), hops between nodes at the network's latency."""
    if ranks <= 1:
        return 0.0
    steps = steps_per_rank * (ranks - 1)
    net_steps = steps_per_rank * (nodes - 1)
    return (inp.coll_base_us + (steps - net_steps) * inp.intra_hop_us + net_steps * inp.net_hop_us) / 1e6


def all_gather_s(inp: Inputs, ranks: int, nodes: int, gbs: float) -> float:
    """Every tensor of the model all-gathered over `ranks` (a ring whose slowest hop is `gbs`),
    one collective per tensor as full_tensor() does."""
    if ranks <= 1:
        return 0.0
    wire = (ranks - 1) / ranks * inp.wire_bytes / (gbs * GB * inp.link_efficiency)
    return wire + inp.tensors * ring_latency_s(inp, ranks, nodes)


# ------------------------------------------------------------------ the four phases

def generation_s(inp: Inputs, completions: float, engines: int) -> float:
    """Each engine decodes its share at once: completion_tokens decode steps, each one the longer
    of reading the weights from HBM and the batch's FLOPs (a roofline). For 14B the two meet at ~39
    sequences an engine; the KV cache left on a 64 GB GCD (~100 sequences of 1,280 tokens) caps the
    batch in flight, which changes nothing above that point: the engine is FLOP-bound either way."""
    per_engine = math.ceil(completions / engines)
    weights_s = inp.params * 2 / (inp.hbm_tbs * 1e12 * inp.decode_hbm_fraction)
    flops_s = per_engine * 2 * inp.params / (inp.peak_tflops * 1e12 * inp.decode_flops_fraction)
    return inp.completion_tokens * max(weights_s, flops_s)


def training_s(inp: Inputs, completions: float, trainers: int) -> float:
    """Prompt and completion tokens through the policy (forward, backward, recompute) and the
    reference, spread evenly over the trainers."""
    tokens = completions * (inp.prompt_tokens + inp.completion_tokens)
    return tokens * inp.train_flops_per_token * inp.params / (trainers * inp.train_tflops * 1e12)


def allreduce_s(inp: Inputs, nodes: int) -> float:
    """The fp32 gradients all-reduced across nodes (a ring of nodes; each node's shards share
    its NICs), once a step."""
    if nodes <= 1:
        return 0.0
    node_gbs = inp.nic_gbs * inp.nics_per_node * inp.link_efficiency
    wire = 2 * (nodes - 1) / nodes * inp.params * inp.grad_bytes_per_param / (node_gbs * GB)
    return wire + inp.reduces_per_step * ring_latency_s(inp, nodes, nodes, steps_per_rank=2)


def sync_s_hpcrl(inp: Inputs) -> float:
    """Per node, every node at once: gather inside the node, then GCD 6 -> GCD 7."""
    gather = all_gather_s(inp, inp.trainers_per_node, 1, inp.cross_mi250x_gbs)
    send = inp.wire_bytes / (inp.same_mi250x_gbs * GB * inp.link_efficiency)
    return gather + send


def sync_s_single(inp: Inputs, nodes: int) -> float:
    """Gather over every trainer rank of the job, then rank 0 -> the server: through one NIC when
    the server has a node of its own, else across the node (a cross-MI250X link)."""
    trainers = single_trainers(inp, nodes)
    trainer_nodes = math.ceil(trainers / inp.gpus_per_node)
    gather = all_gather_s(inp, trainers, trainer_nodes, inp.cross_mi250x_gbs)
    link = inp.nic_gbs if inp.server_gpus >= inp.gpus_per_node else inp.cross_mi250x_gbs
    return gather + inp.wire_bytes / (link * GB * inp.link_efficiency)


# ------------------------------------------------------------------ a step of each design

# ------------------------------------------------------------------ asynchronous generation (hpcrl)

def decode_step_s(inp: Inputs, batch: float) -> float:
    """One decode step of an engine holding `batch` sequences (the roofline of generation_s)."""
    weights_s = inp.params * 2 / (inp.hbm_tbs * 1e12 * inp.decode_hbm_fraction)
    return max(weights_s, max(batch, 1) * 2 * inp.params / (inp.peak_tflops * 1e12 * inp.decode_flops_fraction))


def generation_tail_s(inp: Inputs, completions: float, engines: int) -> tuple[float, float]:
    """(a batch generated to its last token, the same tokens with every slot kept full).
    In a batch the short completions end at L / tail_ratio, and the long ones (1 in tail_every)
    decode the remaining steps at a batch tail_every times smaller; an engine that refills freed
    slots with the next step's requests (continuous, per sample) does the same tokens at full batch."""
    b = math.ceil(completions / engines)
    long_len = inp.completion_tokens
    short_len = long_len / inp.tail_ratio
    batch = short_len * decode_step_s(inp, b) + (long_len - short_len) * decode_step_s(inp, b / inp.tail_every)
    mean_len = (long_len + (inp.tail_every - 1) * short_len) / inp.tail_every
    return batch, mean_len * decode_step_s(inp, b)


def async_step(inp: Inputs, nodes: int, completions: float) -> dict[str, float]:
    """hpcrl's step with the long tail, in three schedules. The sync stops the engines in each.
    k = 0: generate (to the last token), then train. k >= 1 between requests: the next batch is
    generated while this one trains, a batch at a time (the server runs each trainer's oldest request
    to its end), so the tail stays in the generation. Continuous (weight_update in_flight): engines
    refill freed slots, so generation is the tokens at full batch. Engine idle: the share of the step its decode
    capacity was not used (1 - tokens at full batch / step)."""
    batch, steady = generation_tail_s(inp, completions, nodes * inp.engines_per_node)
    train = training_s(inp, completions, nodes * inp.trainers_per_node) + allreduce_s(inp, nodes)
    sync = sync_s_hpcrl(inp)
    steps = {"k0": batch + train + sync, "k1": max(batch, train) + sync, "continuous": max(steady, train) + sync}
    return {"batch gen": batch, "steady gen": steady, "train": train, "sync": sync,
            **{f"step {k}": v for k, v in steps.items()}, **{f"idle {k}": 1 - steady / v for k, v in steps.items()}}


def async_check_on_cpu(inp: Inputs) -> dict[str, float]:
    """The same rule (generation hidden behind training once k >= 1) on bench_step's CPU phases:
    predicted steps/s ratio and engine idle, beside what the bench measured."""
    k0, k4 = inp.cpu_gen_s + inp.cpu_train_s, max(inp.cpu_gen_s, inp.cpu_train_s)
    return {"ratio": k0 / k4, "idle k0": 1 - inp.cpu_gen_s / k0, "idle k4": 1 - inp.cpu_gen_s / k4}


def single_trainers(inp: Inputs, nodes: int) -> int:
    return nodes * inp.gpus_per_node - inp.server_gpus


def step_hpcrl(inp: Inputs, nodes: int, completions: float) -> dict[str, float]:
    phases = {
        "generation": generation_s(inp, completions, nodes * inp.engines_per_node),
        "training": training_s(inp, completions, nodes * inp.trainers_per_node),
        "all-reduce": allreduce_s(inp, nodes),
        "sync": sync_s_hpcrl(inp),
    }
    return {**phases, "step": sum(phases.values())}


def step_single(inp: Inputs, nodes: int, completions: float) -> dict[str, float] | None:
    """None where the server leaves no GCD to train on."""
    trainers = single_trainers(inp, nodes)
    if trainers <= 0:
        return None
    phases = {
        "generation": generation_s(inp, completions, inp.server_gpus),
        "training": training_s(inp, completions, trainers),
        "all-reduce": allreduce_s(inp, math.ceil(trainers / inp.gpus_per_node)),
        "sync": sync_s_single(inp, nodes),
    }
    return {**phases, "step": sum(phases.values())}


def scaling(inp: Inputs, kind: str, nodes: list[int] = NODES) -> list[dict]:
    """One row per node count: {'nodes', 'completions', 'hpcrl': phases, 'single': phases or None}."""
    rows = []
    for n in nodes:
        completions = inp.global_batch if kind == "strong" else inp.per_node_batch * n
        rows.append({"nodes": n, "completions": completions, "async": async_step(inp, n, completions),
                     "hpcrl": step_hpcrl(inp, n, completions), "single": step_single(inp, n, completions)})
    return rows


# ------------------------------------------------------------------ output

PHASES = ["generation", "training", "all-reduce", "sync"]
CAPTION = ("Each step in order: generate, train, all-reduce the gradients, sync the weights. Training is the same formula "
           "for both designs.\nEvery unmeasured choice favours the single server (bf16 on its wire, one packed send, no "
           "per-tensor HTTP). hpcrl's generation stops falling at 128 nodes:\n1,024 decode steps, each reading the 29.5 GB "
           "of weights from HBM. No figure here was measured on a GPU: this is arithmetic on the inputs below.")


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if x >= 100 else f"{x:.2f}" if x < 10 else f"{x:.1f}"


def inputs_rows(inp: Inputs) -> list[list[str]]:
    return [[f.name, f"{getattr(inp, f.name):g}", f.metadata["unit"], f.metadata["source"]] for f in fields(inp)]


def print_tables(inp: Inputs, runs: dict[str, list[dict]]) -> None:
    print_table("inputs (model, not measurement)", ["input", "value", "unit", "source"], inputs_rows(inp))
    short = {"generation": "gen", "training": "train", "all-reduce": "allred", "sync": "sync"}
    for kind, rows in runs.items():
        headers = ["nodes", "completions"]
        headers += [f"hpcrl {short[p]}" for p in PHASES] + ["hpcrl step"]
        headers += [f"single {short[p]}" for p in PHASES] + ["single step", "single/hpcrl"]
        table = []
        for r in rows:
            h, s = r["hpcrl"], r["single"]
            line = [str(r["nodes"]), f"{r['completions']:,}"]
            line += [_fmt(h[p]) for p in PHASES + ["step"]]
            line += [_fmt(s[p]) if s else "-" for p in PHASES + ["step"]]
            line.append(f"{s['step'] / h['step']:.2f}x" if s else "-")
            table.append(line)
        title = (f"{kind} scaling, seconds a step (single server: {inp.server_gpus} GCDs)"
                 + (f", {inp.global_batch:,} completions" if kind == "strong" else f", {inp.per_node_batch} completions a node"))
        print_table(title, headers, table)
    rows = runs["strong"]
    keys = ["batch gen", "steady gen", "train", "sync", "step k0", "step k1", "step continuous"]
    table = [[str(r["nodes"])] + [_fmt(r["async"][k]) for k in keys]
             + [f"{r['async']['step k0'] / r['async'][f'step {k}']:.2f}x" for k in ("k1", "continuous")]
             + [f"{r['async'][f'idle {k}']:.2f}" for k in ("k0", "k1", "continuous")] for r in rows]
    print_table(f"hpcrl with a long tail (1 completion in {inp.tail_every} {inp.tail_ratio:g}x the others), strong "
                f"scaling, seconds a step: in order (k0), a batch ahead (k>=1, between_requests), continuous per sample "
                f"(in_flight)", ["nodes", "batch gen", "steady gen", "train+allred", "sync", "step k0", "step k>=1",
                                 "step contin.", "k>=1/k0", "contin./k0", "idle k0", "idle k>=1", "idle contin."], table)
    cpu = async_check_on_cpu(inp)
    print_table("the async rule on this CPU (bench_step --async phases): predicted against measured",
                ["figure", "predicted", "measured"],
                [["steps/s k=4 over k=0", f"{cpu['ratio']:.2f}", f"{inp.cpu_steps_ratio_k4:.2f}"],
                 ["engine idle k=0", f"{cpu['idle k0']:.2f}", f"{inp.cpu_engine_idle_k0:.2f}"],
                 ["engine idle k=4", f"{cpu['idle k4']:.2f}", f"{inp.cpu_engine_idle_k4:.2f}"]])


def summary(inp: Inputs, runs: dict[str, list[dict]]) -> dict[str, float | int]:
    strong, weak = runs["strong"][-1], runs["weak"][-1]
    n = strong["nodes"]
    cross = next((r["nodes"] for r in runs["strong"] if r["single"] and r["single"]["step"] > r["hpcrl"]["step"]),
                 math.inf)
    return {
        f"speedup_strong_at_{n}": strong["single"]["step"] / strong["hpcrl"]["step"],
        f"speedup_weak_at_{n}": weak["single"]["step"] / weak["hpcrl"]["step"],
        "sync_s_hpcrl": strong["hpcrl"]["sync"],
        f"sync_s_single_server_at_{n}": strong["single"]["sync"],
        f"sync_share_at_{n}_hpcrl": strong["hpcrl"]["sync"] / strong["hpcrl"]["step"],
        f"sync_share_at_{n}_single_server": strong["single"]["sync"] / strong["single"]["step"],
        "crossover_nodes_strong": cross,
        f"async_speedup_at_{n}_k1": strong["async"]["step k0"] / strong["async"]["step k1"],
        f"async_speedup_at_{n}_continuous": strong["async"]["step k0"] / strong["async"]["step continuous"],
        f"engine_idle_at_{n}_k0": strong["async"]["idle k0"],
        f"engine_idle_at_{n}_continuous": strong["async"]["idle continuous"],
    }


def plot(inp: Inputs, runs: dict[str, list[dict]], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    colors = {"hpcrl": "#1f77b4", "single": "#d62728"}
    styles = {"step": "-", "generation": "--", "training": ":", "all-reduce": (0, (1, 3)), "sync": "-."}
    fig, axes = plt.subplots(1, 2, figsize=(12, 7.8), sharey=True)
    fig.subplots_adjust(left=0.07, right=0.99, top=0.9, bottom=0.43, wspace=0.06)
    titles = {"strong": f"strong scaling: {inp.global_batch:,} completions a step",
              "weak": f"weak scaling: {inp.per_node_batch} completions a node"}
    for ax, (kind, rows) in zip(axes, runs.items()):
        for design in ("hpcrl", "single"):
            pts = [(r["nodes"], r[design]) for r in rows if r[design]]
            xs = [n for n, _ in pts]
            for phase in ["step"] + PHASES:
                ys = [p[phase] if p[phase] > 0 else float("nan") for _, p in pts]
                ax.plot(xs, ys, color=colors[design], linestyle=styles[phase],
                        linewidth=2.4 if phase == "step" else 1.3, marker="o" if phase == "step" else None,
                        markersize=4)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(NODES, [str(n) for n in NODES])
        ax.set_xlabel("Frontier nodes (8 MI250X GCDs each)")
        ax.set_title(titles[kind], fontsize=11)
        ax.grid(True, which="major", alpha=0.3)
    axes[0].set_ylabel("seconds per GRPO step (model)")
    handles = [Line2D([], [], color=colors["hpcrl"], linewidth=2.4, label="hpcrl: an engine a node, sync inside each node"),
               Line2D([], [], color=colors["single"], linewidth=2.4,
                      label=f"single server ({inp.server_gpus} GCDs) fed by global rank 0 (TRL server mode)")]
    handles += [Line2D([], [], color="gray", linestyle=styles[p], linewidth=2.4 if p == "step" else 1.3,
                       label="whole step" if p == "step" else p) for p in ["step"] + PHASES]
    axes[1].legend(handles=handles, fontsize=8, loc="upper left", framealpha=0.9)
    fig.suptitle("GRPO step of Qwen2.5-14B on Frontier: a MODEL, not a measurement "
                 "(scripts/model_step.py)", fontsize=13, fontweight="bold")
    fig.text(0.01, 0.345, CAPTION, fontsize=8, va="top")
    lines = [f"{f.name} = {getattr(inp, f.name):g} {f.metadata['unit']}  [{f.metadata['source']}]" for f in fields(inp)]
    half = (len(lines) + 1) // 2
    fig.text(0.01, 0.265, "Inputs [source]:", fontsize=8, fontweight="bold", va="top")
    for col, chunk in enumerate((lines[:half], lines[half:])):
        fig.text(0.01 + 0.5 * col, 0.24, "\n".join(chunk), fontsize=6.5, family="monospace", va="top")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90, pil_kwargs={"optimize": True})
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=REPO / "docs" / "step_model.png", help="the figure (PNG)")
    ap.add_argument("--no-plot", action="store_true", help="tables and the last line only")
    ap.add_argument("--server-gpus", type=int, default=Inputs.server_gpus,
                    help="GCDs of the single server (8: a node of its own; 1: one GCD of node 0)")
    ap.add_argument("--smoke", action="store_true",
                    help="check that the script runs (tests/e2e/test_bench_smoke.py): the figure goes to a temporary file")
    args = ap.parse_args(argv)
    inp = replace(Inputs(), server_gpus=args.server_gpus)
    runs = {"strong": scaling(inp, "strong"), "weak": scaling(inp, "weak")}
    print_tables(inp, runs)
    if args.smoke and not args.no_plot:
        with tempfile.TemporaryDirectory() as tmp:     # the figure in docs/ is the full run's
            plot(inp, runs, Path(tmp) / "step_model.png")
            print(f"figure: drawn ({(Path(tmp) / 'step_model.png').stat().st_size:,} bytes), not kept")
    elif not args.no_plot:
        plot(inp, runs, args.out)
        print(f"figure: {args.out}")
    print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary(inp, runs).items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
