"""The trainers' side of the node's engines: generation requests over the node channels, and the
weight sync (every trainer gathers; each engine's sender streams to it). Which sync feeds an engine
is the engine's to say (``InferenceEngine.trainer_sync``, its class found by the name the engine
gives in its health reply); the transports are in hpcrl.compute.sync."""

from __future__ import annotations

import itertools
import selectors
import threading
import time
from contextlib import nullcontext
from dataclasses import replace
from typing import Sequence

from hpcrl.compute.inference.engine import SyncPeer, engine_class
from hpcrl.compute.inference.types import Completion, Sampling
from hpcrl.compute.launch.context import LaunchContext
from hpcrl.compute.launch.wire import ChannelClosed
from hpcrl.compute.sync.api import TrainerSync


class ServerUnavailable(RuntimeError):
    """The node's server did not answer within its bound."""


def generation_timeout_s(inference, prompts: int, sampling: Sampling, trainers: int = 1) -> float:
    """How long a trainer waits for the completions of one generation request: the fixed
    ``inference.request_timeout_s`` plus ``inference.generation_s_per_ktoken`` for every 1,000
    completion tokens asked for (prompts x n x max_tokens). ``trainers``: the node's trainers,
    whose requests the server generates as one batch, so each waits for all of theirs."""
    ktokens = trainers * prompts * sampling.n * sampling.max_tokens / 1000
    return inference.request_timeout_s + inference.generation_s_per_ktoken * ktokens


class _Engine:
    """One engine of the node as a trainer sees it: its channel, on which several requests may be
    outstanding (generations asked for ahead, a sync meanwhile). Each message carries a request id
    (``rid``) that the server's reply repeats; replies read while waiting for another are kept for
    whoever waits on them: by rid (``early``), and a stream's in order (``streamed``).

    ``arrivals``: in flight (inference.weight_update), where a sync's replies and a stream's
    interleave on the channel and may be awaited from two threads (an agent's rollouts stream from
    a thread of their own while the trainer's pushes weights), one reader thread takes everything
    the engine sends and files it, and waiters wait on this condition, which all of the trainer's
    engines share; without it the waiting thread reads the channel itself."""

    def __init__(self, ctx: LaunchContext, rank: int, arrivals: threading.Condition | None = None):
        self.ctx, self.rank = ctx, rank
        self.channel = ctx.channels[rank]
        self.label = (f"the server on node {ctx.task.node} (rank {rank})" if ctx.plan.engines_per_node == 1 else
                      f"engine {ctx.plan.task(rank).engine} on node {ctx.task.node} (rank {rank})")
        self.in_flight = False          # a stream is open on it
        self.rids = itertools.count(1)
        self.sending = threading.Lock()         # one message at a time on the socket, whichever thread sends
        self.early: dict = {}           # rid -> a reply read before its turn
        self.streamed: list[dict] = []  # streams' replies, in order, until a take
        self.generating: dict[int, float] = {}      # rid -> the bound of a generation not yet answered
        self.reader = _Reader(self, arrivals) if arrivals is not None else None

    def send(self, msg: dict) -> int:
        with self.sending:
            rid = next(self.rids)
            self.channel.send({**msg, "rid": rid})
        return rid

    def request(self, msg: dict, timeout: float, setting: str = "inference.request_timeout_s") -> dict:
        # In flight (a reader files the replies) syncs go while streams are open: the engine takes
        # them between two steps.
        assert not self.in_flight or self.reader is not None, \
            f"{msg['op']!r} sent to {self.label} while a stream is open"
        if self.generating:
            # The server answers between two generations: those ahead of this message may run first.
            timeout += sum(self.generating.values())
            setting += " + the bounds of the generations queued ahead of it"
        return self.reply(self.send(msg), msg["op"], timeout, setting)

    def reply(self, rid, op: str, timeout: float, setting: str) -> dict:
        """The engine's answer to the message ``rid`` (an ``op``) within ``timeout``; ``setting``
        says which recipe fields set that bound, for the message of an engine that stays silent."""
        if not self.wait_for(lambda: rid in self.early, time.monotonic() + timeout):
            raise ServerUnavailable(f"{self.label} did not answer {op!r} within {timeout:.0f} s ({setting})")
        self.generating.pop(rid, None)
        return self.early.pop(rid)

    def wait_for(self, arrived, deadline: float) -> bool:
        """Until ``arrived()`` (what has been filed satisfies it), or False at ``deadline``."""
        if self.reader is not None:
            return _wait_filed([self], arrived, deadline)
        while not arrived():
            try:
                self.file(self.channel.recv(timeout=max(0.0, deadline - time.monotonic())))
            except TimeoutError:
                return False
        return True

    def file(self, got: dict) -> None:
        if got.get("rid") == "stream":
            self.streamed.append(got)       # several may come: each is kept, in order
        else:
            self.early[got.get("rid")] = got

    def take_streamed(self) -> list[dict]:
        """The streams' replies filed so far, in order (each taken once)."""
        with self.reader.arrivals if self.reader is not None else nullcontext():
            got, self.streamed = self.streamed, []
        return got


class _Reader:
    """In flight: the thread that reads an engine's channel (see _Engine) and files what comes."""

    POLL_S = 1.0        # how often it looks whether the trainer has closed (a read has no end else)

    def __init__(self, engine: _Engine, arrivals: threading.Condition):
        self.engine, self.arrivals = engine, arrivals
        self.failed: BaseException | None = None
        self.closing = False
        threading.Thread(target=self._read, name=f"hpcrl-engine-{engine.rank}-reader", daemon=True).start()

    def _read(self) -> None:
        while not self.closing:
            try:
                got = self.engine.channel.recv(timeout=self.POLL_S)
            except TimeoutError:
                continue
            except BaseException as e:      # the channel closed (a dead engine): every waiter raises it
                with self.arrivals:
                    self.failed = e
                    self.arrivals.notify_all()
                return
            with self.arrivals:
                self.engine.file(got)
                self.arrivals.notify_all()


def _wait_filed(engines: list[_Engine], arrived, deadline: float) -> bool:
    """In flight: until ``arrived()`` (what the readers of ``engines`` filed satisfies it), or False at
    ``deadline``; a reader whose channel failed first raises the channel's error at once."""
    arrivals = engines[0].reader.arrivals           # one condition for all of a trainer's engines
    with arrivals:
        arrivals.wait_for(lambda: arrived() or any(e.reader.failed for e in engines),
                          max(0.0, deadline - time.monotonic()))
        if arrived():
            return True
        for e in engines:
            if e.reader.failed is not None:
                raise e.reader.failed
        return False


class ServerGenerator:
    """A trainer's generation and weight sync through the engines its plan row names: its prompts
    are split evenly over ``task.servers`` (one engine, unless engines outnumber trainers), and it
    streams the weights to each engine of ``task.sends_to``. Every trainer syncs in
    ``plan.sync_rounds`` gather rounds, sending in a round only if it feeds an engine in it."""

    def __init__(self, ctx: LaunchContext, model):
        self.ctx = ctx
        self.model = model
        self.inf = ctx.spec.recipe.inference
        arrivals = threading.Condition() if self.inf.in_flight else None
        self.engines = {rank: _Engine(ctx, rank, arrivals) for rank in ctx.task.servers}
        self.engine = None              # the engines' name and dtype, from their first health replies
        self.engine_dtype: str | None = None
        self.syncs: list[TrainerSync] = []
        self.hold_group = None          # inference.max_staleness > 1: the trainers' barrier before a sync
        self.in_flight: _ServerStream | None = None
        # inference.weight_update = in_flight: generations go per sample on one stream that stays open.
        self.feed: _Feed | None = _Feed(self) if self.inf.in_flight else None

    def wait_ready(self) -> None:
        """The engines load while the trainers load the model: wait for them, bounded."""
        t0 = time.perf_counter()
        for e in self.engines.values():
            reply = e.request({"op": "health"}, self.inf.start_timeout_s, "inference.start_timeout_s")
            self.engine, self.engine_dtype = reply["engine"], reply.get("dtype")
        names = ", ".join(e.label for e in self.engines.values())
        self.ctx.log(f"{names} ready ({self.engine}) after {time.perf_counter() - t0:.1f} s of waiting")
        self._make_syncs()

    def _make_syncs(self) -> None:
        if self.inf.staleness > 1 and self.feed is None:
            import torch.distributed as dist        # (choosing an engine imports no torch: not at the top)

            # The trainers' barrier before a sync that meets generations in flight (_hold_engines):
            # a gloo group of its own, whose wait each trainer bounds by call (a collective: every
            # trainer builds it here).
            self.hold_group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        sends_to = self.ctx.task.sends_to
        for round_ in range(self.ctx.plan.sync_rounds):
            target = self.engines[sends_to[round_]] if round_ < len(sends_to) else None
            self.syncs.append(self._make_sync(target, round_))

    def _make_sync(self, target: _Engine | None, round_: int) -> TrainerSync:
        node_of_rank = {t.trainer_rank: t.node for t in self.ctx.plan.tasks if t.trainer_rank is not None}
        peer = SyncPeer(self.ctx, round_, target.request if target is not None else None, self.engine_dtype,
                        node_of_rank)
        return engine_class(self.engine).trainer_sync(self.model, peer)

    def submit(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> "_ServerGeneration | _FedGeneration":
        """Ask the engine(s) for completions and return at once; `result()` takes them. Several
        may be outstanding: each engine generates them in the order asked (or, in flight, its
        completions join the engine's running batch at once)."""
        if self.feed is not None:
            return self.feed.submit(prompts, sampling)
        assert self.in_flight is None, "a generation submitted while a stream is open"
        parts, start, n = [], 0, len(self.engines)
        for i, e in enumerate(self.engines.values()):
            end = start + len(prompts) // n + (i < len(prompts) % n)
            rid = e.send({"op": "generate", "prompts": [list(p) for p in prompts[start:end]], "sampling": sampling,
                          "first_index": start})
            served = max(1, len(self.ctx.plan.served_by(e.rank)))
            e.generating[rid] = generation_timeout_s(self.inf, end - start, sampling, served)
            parts.append((e, start, rid))
            start = end
        return _ServerGeneration(self, parts)

    def open_stream(self) -> "_ServerStream":
        """A stream of single requests to the engine(s) (types.Stream); nothing else may be in
        flight until it is closed."""
        assert self.in_flight is None and not any(e.generating for e in self.engines.values()), \
            "a stream opened while a generation is in flight"
        self.in_flight = _ServerStream(self)
        return self.in_flight

    def push_weights(self, model, version: int) -> dict:
        """Generations may be in flight (inference.max_staleness): the engines take the weights
        between two of them. A stream may not: its rollouts' turns share one version (the trainer
        waits for them first, hpcrl.compute.agents.sync_gate), unless the engines take syncs in
        flight, between two of their steps (the feed's stream, or an agent's)."""
        if not self.inf.in_flight:
            assert self.in_flight is None, "weights pushed while a stream is open"
            if self.inf.staleness > 1:
                self._hold_engines()
        # In flight, no hold: each engine stops its streams while the sync is open and goes on after.
        traffic: dict[str, int] = {}
        for sync in self.syncs:
            sync.sync(version)
            for k, v in sync.last_traffic.items():
                traffic[k] = traffic.get(k, 0) + v
        return traffic

    def _hold_engines(self) -> None:
        """Before a sync that meets generations in flight: every trainer has its engines finish the
        generation they are on and start no other (``weights_hold``), then waits for the others.
        Without it the trainers would wait for a busy engine inside the sync's gathers, bounded by
        launch.collective_timeout_s instead of the generation's own bound.

        Rollouts run from a thread of their own (agents, a rollout function) have none in flight
        here: the trainer waited for them (hpcrl.compute.agents.sync_gate), and the wait for the
        others is the wait for their rollouts, whose turns and tools are bounded one by one, so
        the whole is bounded as a collective is (launch.collective_timeout_s)."""
        from datetime import timedelta

        import torch.distributed as dist

        agent = self.ctx.spec.recipe.agent
        if agent.enabled or agent.rollout_func:
            bound = self.ctx.spec.recipe.launch.collective_timeout_s
            setting = ("launch.collective_timeout_s: the trainers wait for each other's rollouts in flight "
                       "(agent tools, environments, agent.rollout_func)")
        else:
            bound = self.inf.request_timeout_s + sum(sum(e.generating.values()) for e in self.engines.values())
            setting = "inference.request_timeout_s + the bounds of the generations in flight"
        for e in self.engines.values():
            if not e.generating:
                continue        # nothing of this trainer's to finish first (another's asks, if it has)
            reply = e.request({"op": "weights_hold"}, self.inf.request_timeout_s)
            if not reply.get("ok"):
                raise RuntimeError(f"{e.label} refused to hold for a weight sync: {reply.get('error')}")
        if self.hold_group is not None and dist.get_world_size(self.hold_group) > 1:
            try:
                dist.monitored_barrier(group=self.hold_group, timeout=timedelta(seconds=bound))
            except RuntimeError as err:
                raise ServerUnavailable(
                    f"a trainer's engines were not ready for a weight sync within {bound:.0f} s of the first "
                    f"({setting}, inference.max_staleness={self.inf.max_staleness}): {err}") from None

    def close(self) -> None:
        """Goodbye to each engine. Generations may still be in flight (a stop: the checkpoint kept
        their prompts only); in flight, whoever waits for one (an agent's rollout thread) raises now."""
        for e in self.engines.values():
            if e.reader is not None:
                with e.reader.arrivals:
                    e.reader.closing = True
                    e.reader.failed = e.reader.failed or ChannelClosed(f"the trainer closed its channel to {e.label}")
                    e.reader.arrivals.notify_all()
            try:
                e.channel.send({"op": "done"})
            except Exception:
                pass
        for sync in self.syncs:
            sync.close()


class _ServerGeneration:
    """Generate requests on the channels whose replies have not been read yet."""

    def __init__(self, client: ServerGenerator, parts: list[tuple[_Engine, int, int]]):
        self.client = client
        self.parts = parts              # (engine, index of its first prompt, request id)
        self.completions: list[Completion] | None = None

    def result(self) -> list[Completion]:
        if self.completions is None:
            c, out = self.client, []
            setting = (f"inference.request_timeout_s={c.inf.request_timeout_s:g} + inference.generation_s_per_ktoken="
                       f"{c.inf.generation_s_per_ktoken:g} per 1,000 completion tokens requested")
            for engine, start, rid in self.parts:
                # Its own bound, and those of the generations asked for before it, which go first.
                ahead = [bound for r, bound in engine.generating.items() if r <= rid]
                why = setting + (f", for it and the {len(ahead) - 1} generation(s) asked for before it"
                                 if len(ahead) > 1 else "")
                reply = engine.reply(rid, "generate", sum(ahead), why)
                if not reply.get("ok"):
                    raise RuntimeError(f"{engine.label} refused to generate: {reply.get('error')}")
                out += [replace(comp, prompt_index=comp.prompt_index + start) for comp in reply["completions"]]
            self.completions = out
        return self.completions


class _ServerStream:
    """Stream requests on the trainer's engines (types.Stream). A key's requests all go to one
    engine (``key`` modulo the engines), whose prefix cache then holds its conversation so far."""

    def __init__(self, client: ServerGenerator):
        self.client = client
        self.engines = list(client.engines.values())
        self.unsent: dict[_Engine, list] = {e: [] for e in self.engines}
        self.waiting: dict[_Engine, int] = {e: 0 for e in self.engines}     # requests sent, not yet back
        self.longest: Sampling | None = None        # the largest request yet, for the bound
        self.heard = time.monotonic()               # when an engine last answered (or the stream began)

    @property
    def outstanding(self) -> int:
        return sum(self.waiting.values()) + sum(map(len, self.unsent.values()))

    def add(self, key: int, prompt_ids, sampling: Sampling, engine: int | None = None) -> None:
        """``engine``: the index of the trainer's engine it goes to (None: ``key`` modulo the engines)."""
        assert sampling.n == 1, "a stream request is one completion"
        if self.outstanding == 0:
            self.heard = time.monotonic()       # the engines' silence counts from the first request on
        to = self.engines[(key if engine is None else engine) % len(self.engines)]
        self.unsent[to].append((key, list(prompt_ids), sampling))
        if self.longest is None or sampling.max_tokens > self.longest.max_tokens:
            self.longest = sampling

    def take(self, timeout: float | None = None) -> list[tuple[int, Completion]]:
        self._send()
        busy = [e for e in self.engines if self.waiting[e]]
        if not busy:
            return []
        wait = timeout if timeout is not None else max(0.0, self._deadline() - time.monotonic())
        ready = _streams_arrived(busy, time.monotonic() + wait)
        if not ready:
            if timeout is None:
                raise ServerUnavailable(self._silence())
            return []
        done = []
        for e in ready:
            for reply in e.take_streamed():
                if not reply.get("ok"):
                    raise RuntimeError(f"{e.label} refused to generate: {reply.get('error')}")
                done += reply["streamed"]
                self.waiting[e] -= len(reply["streamed"])
            e.in_flight = self.waiting[e] > 0
        self.heard = time.monotonic()
        return done

    def close(self) -> None:
        assert self.outstanding == 0, f"a stream closed with {self.outstanding} request(s) not taken"
        self.client.in_flight = None

    def _send(self) -> None:
        for e, requests in self.unsent.items():
            if requests:
                e.send({"op": "stream", "requests": requests})
                self.waiting[e] += len(requests)
                e.in_flight = True
                self.unsent[e] = []

    def _deadline(self) -> float:
        """The bound on an engine's silence: as long as a batch request of all that is outstanding
        on the busiest engine would get (generation_timeout_s), from its last answer."""
        served = max(max(1, len(self.client.ctx.plan.served_by(e.rank))) for e in self.engines)
        return self.heard + generation_timeout_s(self.client.inf, max(self.waiting.values()), self.longest, served)

    def _silence(self) -> str:
        inf = self.client.inf
        who = ", ".join(f"{e.label} ({n} outstanding)" for e, n in self.waiting.items() if n)
        return (f"{who} returned no completion within {self._deadline() - self.heard:.0f} s "
                f"(inference.request_timeout_s={inf.request_timeout_s:g} + inference.generation_s_per_ktoken="
                f"{inf.generation_s_per_ktoken:g} per 1,000 completion tokens outstanding)")


def _streams_arrived(engines: list[_Engine], deadline: float) -> list[_Engine]:
    """The engines of ``engines`` with a stream's reply filed, waiting for one until ``deadline``."""
    ready = [e for e in engines if e.streamed]          # filed while a reply to another was awaited
    if ready:
        return ready
    if engines[0].reader is not None:       # in flight: the readers file them
        _wait_filed(engines, lambda: any(e.streamed for e in engines), deadline)
    else:
        with selectors.DefaultSelector() as sel:
            for e in engines:
                sel.register(e.channel, selectors.EVENT_READ, e)
            for key, _ in sel.select(max(0.0, deadline - time.monotonic())):
                key.data.file(key.data.channel.recv(timeout=0))
    return [e for e in engines if e.streamed]


class _Feed:
    """Single-turn generations served per sample (inference.weight_update = in_flight): every
    completion is a request on one stream that stays open, which the engines batch with all others
    under way, whatever generation they belong to, so a slot freed by a short completion is taken by
    the next request at once. A generation's ``result()`` takes from the stream until its own
    completions are in, keeping the others' for theirs."""

    def __init__(self, client: ServerGenerator):
        self.client = client
        self.stream: _ServerStream | None = None
        self.keys = itertools.count()
        self.done: dict[int, Completion] = {}

    def submit(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> "_FedGeneration":
        if self.stream is None:
            self.stream = _ServerStream(self.client)
        engines, n = len(self.stream.engines), sampling.n
        one = replace(sampling, n=1)
        keys = []
        for i, prompt in enumerate(prompts):
            # A prompt's n completions on one engine (its prefix cache), prompts spread as a batch's are.
            engine = i * engines // max(1, len(prompts))
            for j in range(n):
                key = next(self.keys)
                seed = None if sampling.seed is None else sampling.seed * 1009 + i * n + j
                self.stream.add(key, prompt, replace(one, seed=seed), engine=engine)
                keys.append((key, i))
        self.collect(0)             # sends them now; whatever is done already is kept
        return _FedGeneration(self, keys)

    def collect(self, timeout: float | None) -> None:
        for key, completion in self.stream.take(timeout):
            self.done[key] = completion


class _FedGeneration:
    """A generation's completions on the feed (their keys, in prompt order, each with its prompt)."""

    def __init__(self, feed: _Feed, keys: list[tuple[int, int]]):
        self.feed, self.keys = feed, keys
        self.completions: list[Completion] | None = None

    def result(self) -> list[Completion]:
        if self.completions is None:
            while missing := [k for k, _ in self.keys if k not in self.feed.done]:
                if not self.feed.stream.outstanding:
                    raise RuntimeError(f"the engines answered every request but {len(missing)} of this generation's")
                self.feed.collect(None)     # bounded: the engines' silence (inference.request_timeout_s ...)
            self.completions = [replace(self.feed.done.pop(k), prompt_index=i) for k, i in self.keys]
        return self.completions
