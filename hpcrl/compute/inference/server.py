"""The server role: one engine of a node (inference.tensor_parallel_size GPUs) generates for the
trainers the plan gives it and takes the weights from its sender.

One loop in the role's main thread: take messages from the node channel, answer weight-sync
messages at once (the sender waits on them), and batch generation requests until every trainer
it serves has asked (or a short window passes), so the engine sees one large batch per step.
Completions carry the weight version they were sampled with; between the start of a sync and its
successful finish (or after a failed one) the server refuses to generate.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import replace
from pathlib import Path

from hpcrl.compute.inference.types import Sampling
from hpcrl.compute.launch.channel import PeerClosed
from hpcrl.compute.launch.context import LaunchContext
from hpcrl.compute.launch.reason import Explained
from hpcrl.compute.launch.stop import STOP
from hpcrl.compute.launch.watchdog import die
from hpcrl.compute.sync.api import ServerSync, default_backend
from hpcrl.job import rundir
from hpcrl.job.recipe import engine_dtype

BATCH_WINDOW_S = 0.05      # after the first request, wait this long for the other trainers'
HEALTH_EVERY_S = 5.0


def engine_errors_log(ctx: LaunchContext) -> Path:
    """Where this engine's processes also log their errors (vllm_engine.log_engine_errors); named
    apart from the health files, which readers find as node-*.json."""
    health = rundir.server_health_file(ctx.run_dir, ctx.task.node, ctx.task.engine)
    return health.with_name(f"vllm-errors-{health.stem}.log")


def make_engine(ctx: LaunchContext, model_dir: str, errors_log: Path | None = None):
    inf, model = ctx.spec.recipe.inference, ctx.spec.recipe.model
    from hpcrl.compute.inference.vllm_engine import VLLMEngine, vllm_available

    use_vllm = inf.engine == "vllm" or (inf.engine == "auto" and vllm_available())
    if inf.engine == "vllm" and not vllm_available():
        raise RuntimeError("inference.engine: vllm is not installed in this environment; "
                           "install a vLLM build for this site or use inference.engine=transformers")
    if inf.engine == "auto" and ctx.device == "cuda" and not vllm_available():
        # Falling back here would be silent and slow: the transformers engine generates without
        # paging or batching across requests and takes every sync's whole model over a socket.
        raise RuntimeError("inference.engine: auto found no vLLM in this environment on a GPU site; install "
                           "the site's vLLM build (on Frontier OLCF's ROCm vLLM container) or set "
                           "inference.engine=transformers to generate with the transformers engine on purpose")
    if use_vllm:
        if model.use_peft:
            # The engine's workers (spawned processes) inherit it: only adapted layers move after
            # the first sync, and the others' "Failed to load weights" is the intent.
            from hpcrl.compute.sync.reload import PARTIAL_SYNCS_ENV

            os.environ[PARTIAL_SYNCS_ENV] = "1"
        return VLLMEngine(model_dir, inf, model, device=ctx.device, cores=ctx.task.cores,
                          seed=ctx.spec.recipe.grpo.seed, backend=default_backend(ctx.device),
                          errors_log=errors_log)
    from hpcrl.compute.inference.hf_engine import TransformersEngine

    device = "cuda" if ctx.device == "cuda" else "cpu"
    return TransformersEngine(model_dir, device=device, dtype=engine_dtype(inf.dtype, model.dtype),
                              seed=ctx.spec.recipe.grpo.seed, tokenizer=model.tokenizer,
                              trust_remote_code=model.trust_remote_code,
                              attn_implementation=model.attn_implementation)


class Server:
    def __init__(self, ctx: LaunchContext, engine):
        self.ctx = ctx
        self.engine = engine
        self.receiver: ServerSync
        if engine.name == "vllm":
            from hpcrl.compute.sync.receiver import WeightReceiver

            self.receiver = WeightReceiver(engine.llm, version="0")
        else:
            from hpcrl.compute.sync.channel import ChannelReceiver

            self.receiver = ChannelReceiver(engine)
        self.pending: dict[int, dict] = {}     # trainer rank -> its generate request
        self.done: set[int] = set()
        self.requests = 0
        # Seconds spent generating since the first request: the engine's share of the run, against
        # which `hpcrl status` weighs the trainers' wait (hpcrl.job.balance). Not since start-up:
        # the trainers' model load is no idleness of the engine's.
        self.busy_s = 0.0
        self.serving_since: float | None = None
        self.last_health = 0.0
        self.health_file = rundir.server_health_file(ctx.run_dir, ctx.task.node, ctx.task.engine)
        self.health_file.parent.mkdir(exist_ok=True)

    # -------------------------------------------------------------- health for `hpcrl status`
    def write_health(self, state: str) -> None:
        data = {"node": self.ctx.task.node, "engine_index": self.ctx.task.engine, "rank": self.ctx.task.rank,
                "state": state, "engine": self.engine.name, "weight_version": self.engine.version,
                "requests": self.requests, "time": time.time(),
                "pid": os.getpid(), "busy_s": round(self.busy_s, 3), "serving_since": self.serving_since}
        tmp = self.health_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.health_file)
        self.last_health = time.time()

    # -------------------------------------------------------------- the loop
    def serve(self) -> int:
        trainers = set(self.ctx.channel.expected)
        self.write_health("serving")
        while self.done != trainers:
            if time.time() - self.last_health > HEALTH_EVERY_S:
                # after a failed sync the server refuses to generate until a full one finishes
                self.write_health({"open": "syncing", "failed": "sync failed"}.get(self.receiver.state, "serving"))
            received = self._receive(HEALTH_EVERY_S)
            if received is not None:
                self.handle(*received)
        self.write_health("finished")
        return 0

    def _receive(self, timeout: float) -> tuple[int, dict] | None:
        """The next message from any trainer, or None after `timeout`. A trainer may close its end
        once it has said goodbye; closing it before is a failure the job must end on."""
        try:
            return self.ctx.channel.recv_any(timeout=max(0.0, timeout))
        except TimeoutError:
            return None
        except PeerClosed as e:
            if e.rank in self.done:
                return None
            raise RuntimeError(f"trainer rank {e.rank} closed the channel without saying goodbye") from None

    def handle(self, rank: int, msg: dict) -> None:
        op = msg.get("op")
        ch = self.ctx.channel
        if op == "generate":
            self.pending[rank] = msg
            self._maybe_generate()
        elif op and op.startswith("weights_"):
            reply = self.receiver.handle(msg)
            if op == "weights_finish" and reply.get("ok"):
                self.engine.version = int(msg.get("version") or 0)
            ch.reply(rank, reply)
        elif op == "health":
            ch.reply(rank, {"ok": True, "engine": self.engine.name, "weight_version": self.engine.version,
                            "consistent": self.receiver.consistent, "dtype": getattr(self.engine, "dtype", None)})
        elif op == "done":
            self.done.add(rank)
            self.pending.pop(rank, None)
            self._maybe_generate()
        else:
            ch.reply(rank, {"ok": False, "error": f"unknown request {op!r}"})

    def _maybe_generate(self) -> None:
        """Generate once every trainer still training has asked, or after a short window. Other
        messages that arrive in the window are handled as they come."""
        deadline = time.monotonic() + BATCH_WINDOW_S
        while self.pending and set(self.pending) != set(self.ctx.channel.expected) - self.done:
            received = self._receive(deadline - time.monotonic())
            if received is None:
                break
            rank, msg = received
            if msg.get("op") == "generate":
                self.pending[rank] = msg
            else:
                self.handle(rank, msg)      # a "done" may generate the batch itself
        if self.pending:
            self._generate_pending()

    def _generate_pending(self) -> None:
        batch = sorted(self.pending.items())
        self.pending.clear()
        if not self.receiver.consistent:
            for rank, _ in batch:
                self.ctx.channel.reply(rank, {"ok": False, "error": "weights are not servable (a sync is open or failed)"})
            return
        prompts, samplings, owners = [], [], []
        for rank, msg in batch:
            sampling: Sampling = msg["sampling"]
            first = msg.get("first_index", 0)
            for i, p in enumerate(msg["prompts"]):
                prompts.append(p)
                # A per-prompt seed keeps each trainer's draws independent of how requests batch, and
                # of how a trainer fed by several engines splits its prompts (first_index).
                samplings.append(replace(sampling, seed=None if sampling.seed is None else sampling.seed * 1009 + first + i))
                owners.append((rank, i))
        t0 = time.perf_counter()
        if self.serving_since is None:
            self.serving_since = time.time()
        if self.engine.name == "vllm":
            completions = self.engine.generate(prompts, samplings)
        else:   # transformers: one sampling setting per call
            completions, offset = [], 0
            for _, msg in batch:
                out = self.engine.generate(msg["prompts"], msg["sampling"])
                completions += [replace(c, prompt_index=c.prompt_index + offset) for c in out]
                offset += len(msg["prompts"])
        self.busy_s += time.perf_counter() - t0
        self.write_health("serving")        # the busy time as of this generation, for the run's summary
        by_rank: dict[int, list] = {rank: [] for rank, _ in batch}
        for c in completions:
            rank, i = owners[c.prompt_index]
            by_rank[rank].append(replace(c, prompt_index=i))
        self.requests += len(batch)
        for rank, comps in by_rank.items():
            self.ctx.channel.reply(rank, {"ok": True, "completions": comps})


ENGINE_ENDS_ON = frozenset({"SIGTERM", "SIGINT"})   # vLLM's engine core stops on these


def signal_that_ends_the_engine(engine_name: str, flag=STOP) -> str | None:
    """The stop signal this task received that its engine's own processes end on too (vLLM's, on
    SIGTERM and SIGINT; SIGUSR2 they ignore), if any: then an engine gone is the signal's doing."""
    if engine_name != "vllm":
        return None
    return min(flag.received & ENGINE_ENDS_ON, default=None)


def run_server(ctx: LaunchContext) -> int:
    from hpcrl.compute.train.sources import job_model_dir, tokenizer_dir

    recipe = ctx.spec.recipe
    model_dir = job_model_dir(ctx.spec, ctx.run_dir)
    tokenizer_dir(recipe.model, model_dir)      # a missing one named here, not deep in the engine
    t0 = time.perf_counter()
    try:
        engine = make_engine(ctx, model_dir, engine_errors_log(ctx))
    except Exception as e:
        raise _engine_cause(ctx, e)
    ctx.log(f"{engine.name} engine{'' if ctx.task.engine is None else f' {ctx.task.engine}'} ready in {time.perf_counter() - t0:.1f} s on GPU(s) "
            f"{','.join(map(str, ctx.task.gpus))} (cores {','.join(map(str, ctx.task.cores))})")
    _record_shared_memory(ctx, engine)
    watching = _watch_engine(ctx, engine)
    try:
        return Server(ctx, engine).serve()
    except Exception as e:
        ended_by = signal_that_ends_the_engine(engine.name)
        if ended_by:
            return _stopped_with_the_job(ctx, engine, ended_by)
        raise _engine_cause(ctx, e, engine)
    finally:
        watching.set()
        engine.close()


def _stopped_with_the_job(ctx: LaunchContext, engine, signal_name: str) -> int:
    """vLLM's engine core ends on SIGTERM and SIGINT by design (scancel, `scontrol requeue`, a
    preemption without a warning signal): the signal is the cause, not the engine, so the job's line
    says so, without the EngineDeadError traceback that would send a reader looking for a bug.
    (SIGUSR2 is not among them: the engine ignores it, ShieldedChildren.)"""
    reason = f"the job was stopped by {signal_name}: the {engine.name} engine ends on it"
    ctx.log(reason)
    ctx.watchdog.fail(reason)
    return 1


def _record_shared_memory(ctx: LaunchContext, engine) -> None:
    """The engine's /dev/shm files, for the sweep after a kill (hpcrl.compute.launch.shm_sweep)."""
    pids = getattr(engine, "process_ids", None)
    if pids is None:
        return
    from hpcrl.compute.launch import shm_sweep

    names = [n for n in shm_sweep.mapped_by(pids()) if n.startswith(shm_sweep.ENGINE_PATTERNS)]
    if names:
        shm_sweep.record(rundir.engine_shm_record(ctx.run_dir, ctx.task.node, ctx.task.engine), names)


def _watch_engine(ctx: LaunchContext, engine, every_s: float = 1.0) -> threading.Event:
    """A thread that ends the job within seconds of an engine process's death, with how it died.
    The serving loop cannot: vLLM's generate may wait forever on a killed engine core. Set the
    returned event to stop watching (before the engine is closed on purpose)."""
    stop = threading.Event()
    death = getattr(engine, "death", None)
    if death is None:
        return stop             # an engine in this process (transformers) dies with the server

    def watch() -> None:
        while not stop.wait(every_s):
            reason = None if signal_that_ends_the_engine(engine.name) else death()
            if reason and not stop.is_set():
                ctx.watchdog.fail(reason, grace_s=0)
                die(ctx.watchdog.who, reason)

    threading.Thread(target=watch, name="hpcrl-engine-watch", daemon=True).start()
    return stop


def _engine_cause(ctx: LaunchContext, e: Exception, engine=None) -> Exception:
    """`e`, or where vLLM only says "see root cause above", the error its engine's processes logged
    (the job's failure line names it), chained to `e` for the traceback."""
    from hpcrl.compute.inference.vllm_engine import logged_cause

    cause = logged_cause(e, engine_errors_log(ctx))
    if cause is e and engine is not None and getattr(engine, "death", None) is not None:
        reason = engine.death()         # killed by a signal: no last words in its log
        cause = Explained(reason) if reason else e
    if cause is not e:
        cause.__cause__ = e
    return cause
