"""The server role: one engine of a node (inference.tensor_parallel_size GPUs) generates for the
trainers the plan gives it and takes the weights from its sender.

One loop in the role's main thread: take messages from the node channel, answer weight-sync
messages at once (the sender waits on them), and batch generation requests until every trainer
it serves has asked (or a short window passes), so the engine sees one large batch per step.
A trainer may have several generation requests queued (inference.max_staleness): they are
generated in turn, and a weight sync that arrives meanwhile lands between two of them: a trainer's
``weights_hold``, answered between two generations, announces it, and no generation starts from
then until it is done. Every reply carries the ``rid`` of the message it answers, so that a
trainer can tell a sync's answers from a generation's.
Streams (the agents' per-sample rollouts, types.Stream) are served continuously instead: their
requests join the engine's running batch as they come, and each goes back as soon as it is done;
while any is outstanding, weight-sync messages and batch requests wait for them to drain, so a
rollout's turns are all sampled with one version of the weights. With inference.weight_update =
in_flight (single-turn GRPO's generations served as streams, and agents' turns) a sync is taken
between two engine steps instead: the requests under way stop while it is open and go on with the
new weights, and each token is stamped with the version that sampled it. Completions carry the
weight version they were sampled with; between the start of a sync and its successful finish (or
after a failed one) the server generates nothing.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from dataclasses import replace
from pathlib import Path

from hpcrl.compute.inference.engine import InferenceEngine, chosen_engine
from hpcrl.compute.inference.types import Sampling
from hpcrl.compute.launch.node_channel import PeerClosed
from hpcrl.compute.launch.context import LaunchContext
from hpcrl.compute.launch.reason import Explained
from hpcrl.compute.launch.stop import STOP
from hpcrl.compute.launch.watchdog import die
from hpcrl.compute.sync.api import ServerSync
from hpcrl.job import rundir
from hpcrl.job.atomic import atomic_write

BATCH_WINDOW_S = 0.05      # after the first request, wait this long for the other trainers'
HEALTH_EVERY_S = 5.0


def engine_errors_log(ctx: LaunchContext) -> Path:
    """Where this engine's processes also log their errors (vllm_engine.log_engine_errors); named
    apart from the health files, which readers find as node-*.json."""
    health = rundir.server_health_file(ctx.run_dir, ctx.task.node, ctx.task.engine)
    return health.with_name(f"engine-errors-{health.stem}.log")


def make_engine(ctx: LaunchContext, model_dir: str, errors_log: Path | None = None) -> InferenceEngine:
    """The engine inference.engine names, on this server's device(s). An engine that fails to start
    raises its real cause: the reason its processes logged in ``errors_log``, where it has one."""
    recipe = ctx.spec.recipe
    requested = recipe.inference.engine
    structured = requested == "auto" and recipe.grpo.vllm_structured_outputs_regex is not None
    engine_cls = chosen_engine(requested, ctx.device,
                               vllm_for="grpo.vllm_structured_outputs_regex" if structured else "")
    try:
        return engine_cls.for_server(ctx, model_dir, errors_log)
    except Exception as e:
        raise _engine_cause(engine_cls, e, errors_log)


class Server:
    def __init__(self, ctx: LaunchContext, engine: InferenceEngine):
        self.ctx = ctx
        self.engine = engine
        self.receiver: ServerSync = engine.weight_receiver()
        self.pending: dict[int, deque[dict]] = {}     # trainer rank -> its generate requests, in order
        self.batch_opened = 0.0                         # when the oldest unserved request arrived
        self.held = False                               # a sync is announced: start no generation
        # Syncs land between two engine steps of the streams, not after them (inference.weight_update).
        self.in_flight = ctx.spec.recipe.inference.in_flight
        self.paused = False                             # the engine stopped for a sync in flight
        self.streams: dict[str, tuple[int, int]] = {}   # engine request id -> (trainer rank, its key)
        self.deferred: list[tuple[int, dict]] = []      # messages waiting for the streams to drain
        self.done: set[int] = set()
        self.requests = 0
        # Seconds spent generating since the first request: the engine's share of the run, against
        # which `hpcrl status` weighs the trainers' wait (hpcrl.job.balance). Not since start-up:
        # the trainers' model load is no idleness of the engine's.
        self.busy_s = 0.0
        self.serving_since: float | None = None
        self.last_health = 0.0
        self.health_version = None      # the weight version the health file shows
        self.health_file = rundir.server_health_file(ctx.run_dir, ctx.task.node, ctx.task.engine)
        self.health_file.parent.mkdir(exist_ok=True)

    # -------------------------------------------------------------- health for `hpcrl status`
    def write_health(self, state: str) -> None:
        data = {"node": self.ctx.task.node, "engine_index": self.ctx.task.engine, "rank": self.ctx.task.rank,
                "state": state, "engine": self.engine.name, "weight_version": self.engine.version,
                "requests": self.requests, "time": time.time(),
                "pid": os.getpid(), "busy_s": round(self.busy_s, 3), "serving_since": self.serving_since}
        atomic_write(self.health_file, json.dumps(data))
        self.last_health, self.health_version = time.time(), self.engine.version

    def health_due(self) -> bool:
        """Every HEALTH_EVERY_S, and at each new weight version: `hpcrl status` shows the version the
        engine serves, and a short run (a few steps between two periodic writes) leaves a true one."""
        return time.time() - self.last_health > HEALTH_EVERY_S or self.engine.version != self.health_version

    # -------------------------------------------------------------- the loop
    def serve(self) -> int:
        trainers = set(self.ctx.channel.expected)
        self.write_health("serving")
        while self.done != trainers:
            if self.health_due():
                # after a failed sync the server refuses to generate until a full one finishes
                self.write_health({"open": "syncing", "failed": "sync failed"}.get(self.receiver.state, "serving"))
            if self.streams and not self.receiver.consistent:
                # A sync in flight is open (or failed: the trainers end the job): the weights are
                # half loaded, so no step until it is done.
                received = self._receive(HEALTH_EVERY_S)
                if received is not None:
                    self.handle(*received)
                continue
            if self.streams:
                self._step_streams()
                while self.streams and (received := self._receive(0)) is not None:
                    self.handle(*received)
                continue
            if self.deferred:
                deferred, self.deferred = self.deferred, []
                for rank, msg in deferred:
                    self.handle(rank, msg)
                continue
            wait_s = self._batch_wait_s()
            if wait_s == 0.0:
                self._generate_pending()
                continue
            received = self._receive(wait_s)
            if received is not None:
                self.handle(*received)
        self.write_health("finished")
        return 0

    def _batch_wait_s(self) -> float:
        """How long to wait for more messages before the next batch (0: generate it now). A batch
        waits for every trainer still training to have asked, or BATCH_WINDOW_S from the oldest
        request; none starts once a sync is announced (``weights_hold``) or open, until it is done."""
        if not self.pending or self.held or self.receiver.state == "open":
            return HEALTH_EVERY_S
        if set(self.pending) >= set(self.ctx.channel.expected) - self.done:
            return 0.0
        return max(0.0, self.batch_opened + BATCH_WINDOW_S - time.monotonic())

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
        if self.streams and (op == "generate" or ((op or "").startswith("weights_") and not self.in_flight)):
            self.deferred.append((rank, msg))
        elif op == "stream":
            self._add_streamed(rank, msg)
        elif op == "generate":
            if not self.pending:
                self.batch_opened = time.monotonic()
            self.pending.setdefault(rank, deque()).append(msg)
        elif op == "weights_hold":
            self.held = True            # answered now, between two generations: the sync may begin
            self._reply(rank, msg, {"ok": True})
        elif op and op.startswith("weights_"):
            if op == "weights_start" and self.in_flight:
                # Paused even with no request under way: one may come while the sync is open (an
                # agent's next turn), and an engine core that steps by itself must not start it.
                self.engine.pause_for_sync()
                self.paused = True
            reply = self.receiver.handle(msg)
            if not reply.get("ok"):
                # vLLM's refusal only says "EngineDeadError: see the stack trace above"; the engine
                # watch would name the cause within a second, but the trainer, told this, could fail
                # the job first with the wrapper's words. A dead engine ends the job here, by its cause.
                end_if_engine_died(self.ctx, self.engine)
            if op == "weights_finish" and reply.get("ok"):
                self.engine.version = int(msg.get("version") or 0)
            if op in ("weights_finish", "weights_abort"):
                self.held = False
                if self.paused:
                    self.engine.resume_after_sync()
                    self.paused = False
            self._reply(rank, msg, reply)
        elif op == "health":
            self._reply(rank, msg, {"ok": True, "engine": self.engine.name, "weight_version": self.engine.version,
                                    "consistent": self.receiver.consistent, "dtype": self.engine.dtype})
        elif op == "done":
            self.done.add(rank)
            self.pending.pop(rank, None)
        else:
            self._reply(rank, msg, {"ok": False, "error": f"unknown request {op!r}"})

    def _reply(self, rank: int, msg: dict, reply: dict) -> None:
        try:
            self.ctx.channel.reply(rank, {**reply, "rid": msg.get("rid")})
        except PeerClosed:
            # A trainer that stopped (a checkpoint, then goodbye) leaves its generations ahead
            # unanswered; one that went without its goodbye is found when its channel is read to
            # the end (_receive), and ends the job there.
            pass

    def _generate_pending(self) -> None:
        """The oldest request of every trainer that has one, as one batch."""
        batch = [(rank, queue.popleft()) for rank, queue in sorted(self.pending.items())]
        self.pending = {rank: queue for rank, queue in self.pending.items() if queue}
        self.batch_opened = time.monotonic()
        if not self.receiver.consistent:
            for rank, msg in batch:
                self._reply(rank, msg, {"ok": False, "error": "weights are not servable (a sync failed)"})
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
        if self.engine.per_prompt_sampling:
            completions = self.engine.generate(prompts, samplings)
        else:   # one sampling setting per call: each request's draws as if it came alone
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
        for rank, msg in batch:
            self._reply(rank, msg, {"ok": True, "completions": by_rank[rank]})

    # -------------------------------------------------------------- streams
    def _add_streamed(self, rank: int, msg: dict) -> None:
        """A trainer's stream requests into the engine's running batch: (key, prompt ids, sampling)."""
        requests: list[tuple[int, list[int], Sampling]] = msg["requests"]
        # In flight, requests may come while a sync is open: queued, they wait for it like the rest.
        servable = self.receiver.state != "failed" if self.in_flight else self.receiver.consistent
        if not servable:
            self._reply(rank, msg, {"ok": False, "error": "weights are not servable (a sync is open or failed)"})
            return
        if self.serving_since is None:
            self.serving_since = time.time()
        ids = self.engine.add([(prompt, sampling) for _, prompt, sampling in requests])
        self.streams.update((i, (rank, key)) for i, (key, _, _) in zip(ids, requests))
        self.requests += len(requests)

    def _step_streams(self) -> None:
        """One step of the engine; each finished request back to its trainer."""
        t0 = time.perf_counter()
        finished = self.engine.step()
        self.busy_s += time.perf_counter() - t0
        by_rank: dict[int, list] = {}
        for request, completions in finished:
            rank, key = self.streams.pop(request)
            by_rank.setdefault(rank, []).extend((key, c) for c in completions)
        for rank, done in by_rank.items():
            if rank not in self.done:       # a trainer gone without its results: nothing to send
                self._reply(rank, {"rid": "stream"}, {"ok": True, "streamed": done})
        if self.streams and not self.engine.unfinished():
            # else the loop would step an idle engine forever while its trainers wait
            raise RuntimeError(f"the {self.engine.name} engine dropped {len(self.streams)} streamed request(s) "
                               f"without finishing them")


def signal_that_ends_the_engine(engine: InferenceEngine | type[InferenceEngine], flag=STOP) -> str | None:
    """The stop signal this task received that its engine's own processes end on too (vLLM's, on
    SIGTERM and SIGINT; SIGUSR2 they ignore), if any: then an engine gone is the signal's doing."""
    return min(flag.received & engine.ends_on, default=None)


def run_server(ctx: LaunchContext) -> int:
    from hpcrl.compute.train.sources import job_model_dir, tokenizer_dir

    recipe = ctx.spec.recipe
    model_dir = job_model_dir(ctx.spec, ctx.run_dir)
    tokenizer_dir(recipe.model, model_dir)      # a missing one named here, not deep in the engine
    t0 = time.perf_counter()
    errors_log = engine_errors_log(ctx)
    engine = make_engine(ctx, model_dir, errors_log)
    ctx.log(f"{engine.name} engine{'' if ctx.task.engine is None else f' {ctx.task.engine}'} ready in {time.perf_counter() - t0:.1f} s on GPU(s) "
            f"{','.join(map(str, ctx.task.gpus))} (cores {','.join(map(str, ctx.task.cores))})")
    _record_shared_memory(ctx, engine)
    watching = _watch_engine(ctx, engine)
    try:
        return Server(ctx, engine).serve()
    except Exception as e:
        ended_by = signal_that_ends_the_engine(engine)
        if ended_by:
            return _stopped_with_the_job(ctx, engine, ended_by)
        raise _engine_cause(type(engine), e, errors_log, engine)
    finally:
        watching.set()
        engine.close_before_exit()      # the task ends next (launch.main.teardown)


def _stopped_with_the_job(ctx: LaunchContext, engine, signal_name: str) -> int:
    """vLLM's engine core ends on SIGTERM and SIGINT by design (scancel, `scontrol requeue`, a
    preemption without a warning signal): the signal is the cause, not the engine, so the job's line
    says so, without the EngineDeadError traceback that would send a reader looking for a bug.
    (SIGUSR2 is not among them: the engine ignores it, ShieldedChildren.)"""
    reason = f"the job was stopped by {signal_name}: the {engine.name} engine ends on it"
    ctx.log(reason)
    ctx.watchdog.fail(reason)
    return 1


def _record_shared_memory(ctx: LaunchContext, engine: InferenceEngine) -> None:
    """The engine's /dev/shm files, for the sweep after a kill (hpcrl.compute.launch.shm_sweep)."""
    if not engine.own_processes:
        return
    from hpcrl.compute.launch import shm_sweep

    names = [n for n in shm_sweep.mapped_by(engine.process_ids()) if n.startswith(shm_sweep.ENGINE_PATTERNS)]
    if names:
        shm_sweep.record(rundir.engine_shm_record(ctx.run_dir, ctx.task.node, ctx.task.engine), names)


def _watch_engine(ctx: LaunchContext, engine: InferenceEngine, every_s: float = 1.0) -> threading.Event:
    """A thread that ends the job within seconds of an engine process's death, with how it died.
    The serving loop cannot: vLLM's generate may wait forever on a killed engine core. Set the
    returned event to stop watching (before the engine is closed on purpose)."""
    stop = threading.Event()
    if not engine.own_processes:
        return stop             # an engine in this process (transformers) dies with the server

    def watch() -> None:
        while not stop.wait(every_s):
            end_if_engine_died(ctx, engine, unless=stop)

    threading.Thread(target=watch, name="hpcrl-engine-watch", daemon=True).start()
    return stop


def end_if_engine_died(ctx: LaunchContext, engine: InferenceEngine, unless: threading.Event | None = None) -> None:
    """End the job now, with how the engine's process died, if one has (and no stop signal of the
    job's explains it), unless `unless` is set (the engine is being closed on purpose)."""
    reason = None if signal_that_ends_the_engine(engine) else engine.death()
    if reason and not (unless and unless.is_set()):
        ctx.watchdog.fail(reason, grace_s=0)
        die(ctx.watchdog.who, reason)


def _engine_cause(engine_cls: type[InferenceEngine], e: Exception, errors_log: Path | None,
                  engine: InferenceEngine | None = None) -> BaseException:
    """`e`, or where vLLM only says "see root cause above", the error its engine's processes logged
    in ``errors_log`` (the job's failure line names it), chained to `e` for the traceback."""
    cause = engine_cls.failure_cause(e, errors_log)
    if cause is e and engine is not None and engine.own_processes:
        reason = engine.death()         # killed by a signal: no last words in its log
        cause = Explained(reason) if reason else e
    if cause is not e:
        cause.__cause__ = e
    return cause
