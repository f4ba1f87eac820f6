"""The inference engine seam (hpcrl.compute.inference.engine): every registered engine is an
InferenceEngine under its own name, the server and the trainers' client learn what differs between
engines from the engine (never from its name: tests/architecture/test_seams.py holds that), and choosing an engine
imports neither vLLM nor torch."""

from __future__ import annotations

import os
import select
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest

from hpcrl.compute.inference.engine import ENGINES, InferenceEngine, engine_class
from hpcrl.compute.inference.types import Completion, Sampling
from hpcrl.job.recipe import InferenceConfig


def test_every_registered_engine_is_an_inference_engine_under_its_name():
    for name in ENGINES:
        cls = engine_class(name)
        assert issubclass(cls, InferenceEngine) and cls.name == name
    with pytest.raises(ValueError, match=r"^unknown inference engine 'tgi'; choose one of vllm, transformers"):
        engine_class("tgi")


def test_choosing_an_engine_imports_neither_vllm_nor_torch():
    code = ("import sys\n"
            "import hpcrl.compute.inference.server, hpcrl.compute.inference.client\n"
            "from hpcrl.compute.inference.engine import chosen_engine, engine_class\n"
            "chosen_engine('auto', 'cpu')\nassert engine_class('vllm').per_prompt_sampling\n"
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_engines_dtype_is_the_wire_dtype_of_every_sync():
    """The dtype an engine names in its health reply is the torch dtype every trainer's gathers
    cast to, whichever engine: None where the engine named none a torch dtype goes by."""
    import torch

    from hpcrl.compute.inference.engine import SyncPeer

    def wire(name):
        return SyncPeer(ctx=None, round=0, request=None, engine_dtype=name, node_of_rank={}).wire_dtype()

    assert wire("bfloat16") is torch.bfloat16 and wire("float32") is torch.float32
    assert wire(None) is None and wire("auto") is None and wire("Size") is None


# ------------------------------------------------------------------ the server, with a third engine
class _Channel:
    def __init__(self, expected):
        self.expected, self.replies = expected, []

    def reply(self, rank, msg):
        self.replies.append((rank, msg))


class EchoEngine(InferenceEngine):
    """A mock third engine: one completion per prompt, its first token the prompt's seed."""

    name = "echo"
    per_prompt_sampling = True

    def __init__(self):
        self.calls = []

    @classmethod
    def for_server(cls, ctx, model_dir, errors_log=None):
        return cls()

    @classmethod
    def trainer_sync(cls, model, peer):
        raise NotImplementedError

    def generate(self, prompts, sampling):
        self.calls.append(sampling)
        per_prompt = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        return [Completion(i, (s.seed,), (0.0,), "", False, self.version) for i, s in enumerate(per_prompt)]

    @property
    def dtype(self):
        return "float32"

    def weight_receiver(self):
        return SimpleNamespace(consistent=True, state="serving")


@pytest.mark.parametrize("per_prompt", [True, False])
def test_the_server_batches_by_what_the_engine_says_it_can(tmp_path, monkeypatch, per_prompt):
    from hpcrl.compute.inference import server

    monkeypatch.setitem(ENGINES, "echo", f"{__name__}:EchoEngine")
    monkeypatch.setattr(EchoEngine, "per_prompt_sampling", per_prompt)
    recipe = SimpleNamespace(inference=InferenceConfig(engine="echo"))
    ctx = SimpleNamespace(spec=SimpleNamespace(recipe=recipe), device="cpu", run_dir=tmp_path,
                          task=SimpleNamespace(node=0, engine=None, rank=2), channel=_Channel({0, 1}))
    engine = server.make_engine(ctx, "/m")
    s = server.Server(ctx, engine)
    s.handle(0, {"op": "generate", "prompts": [[1], [2]], "sampling": Sampling(n=1, max_tokens=1, seed=5),
                 "first_index": 0, "rid": 3})
    s.handle(1, {"op": "generate", "prompts": [[3]], "sampling": Sampling(n=1, max_tokens=1, seed=7),
                 "first_index": 4, "rid": 8})
    assert s._batch_wait_s() == 0.0         # every trainer has asked
    s._generate_pending()
    assert [(rank, msg["rid"]) for rank, msg in ctx.channel.replies] == [(0, 3), (1, 8)]
    got = {rank: [(c.prompt_index, c.token_ids[0]) for c in msg["completions"]] for rank, msg in ctx.channel.replies}
    if per_prompt:      # one call, a seed per prompt: the trainer's seed, its first index and position
        assert len(engine.calls) == 1
        assert got == {0: [(0, 5 * 1009), (1, 5 * 1009 + 1)], 1: [(0, 7 * 1009 + 4)]}
    else:               # one call per request, with the request's own sampling
        assert engine.calls == [Sampling(n=1, max_tokens=1, seed=5), Sampling(n=1, max_tokens=1, seed=7)]
        assert got == {0: [(0, 5), (1, 5)], 1: [(0, 7)]}
    health = server.json.loads(s.health_file.read_text())
    assert health["engine"] == "echo"


def test_a_sync_refused_by_a_dead_engine_ends_the_job_with_how_it_died_not_the_refusal(tmp_path, monkeypatch):
    """vLLM refuses a weight sync on a killed engine core with "EngineDeadError: ... see the stack
    trace above". Passed on as it is, the trainer could fail the job with those words before the
    engine watch (once a second) named the cause: the server ends the job first, with the engine's
    own end, and sends no reply."""
    from hpcrl.compute.inference import server

    class Ended(Exception):
        pass

    def die(who, reason, callbacks=()):
        raise Ended(who, reason)

    refusal = {"ok": False, "error": "EngineDeadError: EngineCore encountered an issue. See stack trace (above) "
                                     "for the root cause.", "state": "failed"}
    monkeypatch.setitem(ENGINES, "echo", f"{__name__}:EchoEngine")
    monkeypatch.setattr(EchoEngine, "weight_receiver", lambda self: SimpleNamespace(consistent=True, handle=lambda m: refusal))
    monkeypatch.setattr(server, "die", die)
    recipe = SimpleNamespace(inference=InferenceConfig(engine="echo"))
    failed = []
    ctx = SimpleNamespace(spec=SimpleNamespace(recipe=recipe), device="cpu", run_dir=tmp_path,
                          task=SimpleNamespace(node=0, engine=None, rank=2), channel=_Channel({0}),
                          watchdog=SimpleNamespace(who="rank 2 (node 0, server)",
                                                   fail=lambda reason, grace_s=1.0: failed.append((reason, grace_s))))
    engine = server.make_engine(ctx, "/m")
    s = server.Server(ctx, engine)
    s.handle(0, {"op": "weights_start", "version": 1, "rid": 1})        # the engine lives: the refusal goes back
    assert ctx.channel.replies == [(0, {**refusal, "rid": 1})] and failed == []
    death = "vLLM's EngineCore (pid 4242) was killed by SIGKILL"
    monkeypatch.setattr(EchoEngine, "death", lambda self: death, raising=False)
    with pytest.raises(Ended) as ended:
        s.handle(0, {"op": "weights_start", "version": 2, "rid": 2})
    assert ended.value.args == ("rank 2 (node 0, server)", death)
    assert failed == [(death, 0)] and len(ctx.channel.replies) == 1


# ------------------------------------------------------------------ the transformers engine
@pytest.fixture(scope="module")
def transformers_engine(tmp_path_factory):
    from hpcrl.compute.inference.hf_engine import TransformersEngine
    from hpcrl.compute.models.tiny import make_tiny_model

    return TransformersEngine(str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny", size="tiny", seed=0)))


def test_the_transformers_engine_takes_a_sampling_per_prompt_as_one_call_per_setting(transformers_engine):
    prompts = [[25, 13, 25, 31], [26, 13, 27, 31], [25, 13, 25, 31]]
    a, b = Sampling(n=2, max_tokens=6, seed=1), Sampling(n=2, max_tokens=6, seed=2)
    got = transformers_engine.generate(prompts, [a, a, b])
    first, second = transformers_engine.generate(prompts[:2], a), transformers_engine.generate(prompts[2:], b)
    assert [(c.prompt_index, c.token_ids) for c in got] == \
        [(c.prompt_index, c.token_ids) for c in first] + [(c.prompt_index + 2, c.token_ids) for c in second]


def test_the_server_streams_each_request_back_and_holds_syncs_until_its_streams_drain(tmp_path, monkeypatch):
    """Stream requests (the agents' per-sample rollouts) go to the engine as they come and back to
    their trainer under their keys; a sync or a batch request that arrives meanwhile waits, so a
    rollout's turns are sampled with one version of the weights."""
    from hpcrl.compute.inference import server

    monkeypatch.setitem(ENGINES, "echo", f"{__name__}:EchoEngine")
    recipe = SimpleNamespace(inference=InferenceConfig(engine="echo"))
    ctx = SimpleNamespace(spec=SimpleNamespace(recipe=recipe), device="cpu", run_dir=tmp_path,
                          task=SimpleNamespace(node=0, engine=None, rank=2), channel=_Channel({0, 1}))
    s = server.Server(ctx, server.make_engine(ctx, "/m"))
    s.handle(0, {"op": "stream", "requests": [(5, [1], Sampling(n=1, max_tokens=1, seed=11)),
                                              (9, [2], Sampling(n=1, max_tokens=1, seed=12))]})
    s.handle(1, {"op": "stream", "requests": [(5, [3], Sampling(n=1, max_tokens=1, seed=13))]})
    sync = {"op": "weights_begin", "version": 1}
    batch = {"op": "generate", "prompts": [[4]], "sampling": Sampling(n=1, max_tokens=1, seed=1), "first_index": 0}
    s.handle(1, sync)
    s.handle(0, batch)
    assert ctx.channel.replies == [] and s.deferred == [(1, sync), (0, batch)]
    s._step_streams()       # the default step: everything queued, as one batch
    got = {rank: [(key, c.token_ids[0]) for key, c in msg["streamed"]] for rank, msg in ctx.channel.replies}
    assert got == {0: [(5, 11), (9, 12)], 1: [(5, 13)]}       # each request's own seed, whatever its batch
    assert s.streams == {} and s.requests == 3


class TickEngine(EchoEngine):
    """A mock engine that steps token by token, as vLLM does: every running request gets one token
    a step (the weight version it holds, so a token shows what sampled it), and ends at max_tokens.
    Counts steps taken while its weights are half loaded."""

    name = "tick"

    def __init__(self):
        super().__init__()
        self.running, self.counter, self.steps_while_open = {}, 0, 0
        self.receiver = _Receiver()
        self.pauses = []

    def pause_for_sync(self):
        self.pauses.append("pause")

    def resume_after_sync(self):
        self.pauses.append("resume")

    def weight_receiver(self):
        return self.receiver

    def add(self, requests):
        ids = []
        for _, sampling in requests:
            self.counter += 1
            self.running[str(self.counter)] = (sampling.max_tokens, [])
            ids.append(str(self.counter))
        return ids

    def step(self):
        self.steps_while_open += not self.receiver.consistent
        done = []
        for rid, (length, tokens) in list(self.running.items()):
            tokens.append(self.version)
            self.note_progress(rid, len(tokens))
            if len(tokens) == length:
                del self.running[rid]
                done.append((rid, [self.stamped(rid, Completion(0, tuple(tokens), (0.0,) * length, "", True,
                                                                self.version))]))
        return done

    def unfinished(self):
        return len(self.running)


class _Receiver:
    def __init__(self):
        self.state = "serving"

    @property
    def consistent(self):
        return self.state == "serving"

    def handle(self, msg):
        self.state = "open" if msg["op"] == "weights_start" else "serving"
        return {"ok": True}


class _ScriptedChannel(_Channel):
    """The trainers' messages in order, one a receive; then silence."""

    def __init__(self, expected, script):
        super().__init__(expected)
        self.script = list(script)

    def recv_any(self, timeout=None):
        if not self.script:
            raise TimeoutError
        return self.script.pop(0)


def test_in_flight_a_sync_lands_between_two_engine_steps_and_each_token_keeps_its_version(tmp_path, monkeypatch):
    """inference.weight_update = in_flight: a sync that comes while streams run is taken at once, not
    after they drain; the engine takes no step while it is open, the requests under way go on with
    the new weights after it, and each completion says which version sampled each of its tokens."""
    from hpcrl.compute.inference import server

    monkeypatch.setitem(ENGINES, "tick", f"{__name__}:TickEngine")
    recipe = SimpleNamespace(inference=InferenceConfig(engine="tick", weight_update="in_flight", max_staleness=2))
    one = Sampling(n=1, max_tokens=4, seed=1)
    script = [(0, {"op": "stream", "requests": [(7, [1], one), (8, [2], replace(one, max_tokens=2))]}),
              (0, {"op": "weights_start", "version": 3, "rid": 1}),      # read after the first step
              (0, {"op": "health", "rid": 2}),                           # the sync is open: no step
              (0, {"op": "weights_finish", "version": 3, "rid": 3})]
    ctx = SimpleNamespace(spec=SimpleNamespace(recipe=recipe), device="cpu", run_dir=tmp_path,
                          task=SimpleNamespace(node=0, engine=None, rank=2), channel=_ScriptedChannel({0}, script))
    s = server.Server(ctx, server.make_engine(ctx, "/m"))
    s.handle(*ctx.channel.recv_any())           # the stream's requests, into the engine
    s._step_streams()                           # a token each, with version 0
    while s.streams:                            # the serving loop's stream branch, as serve() runs it
        if not s.receiver.consistent:
            s.handle(*ctx.channel.recv_any())
            continue
        s._step_streams()
        while s.streams and ctx.channel.script:
            s.handle(*ctx.channel.recv_any())
    assert s.engine.steps_while_open == 0 and s.deferred == [] and s.engine.pauses == ["pause", "resume"]
    streamed = {key: c for _, msg in ctx.channel.replies for key, c in msg.get("streamed", [])}
    # Two steps, then the sync: request 8 (2 tokens) ended before it landed; 7 was under way and
    # took its last two tokens with the new weights. A completion's version is its oldest token's.
    assert streamed[8].token_ids == (0, 0) and streamed[8].token_versions is None and streamed[8].weight_version == 0
    assert streamed[7].token_ids == (0, 0, 3, 3)
    assert streamed[7].token_versions == (0, 0, 3, 3) and streamed[7].weight_version == 0
    assert [msg.get("rid") for _, msg in ctx.channel.replies if "streamed" not in msg] == [1, 2, 3]


def test_the_transformers_engine_serves_a_stream_a_batch_a_step_each_request_as_if_alone(transformers_engine):
    """The default add/step (an engine without continuous batching): a step generates every queued
    request, each with its own seed's draws, the same as that request generated alone."""
    a, b = Sampling(n=1, max_tokens=6, seed=11), Sampling(n=1, max_tokens=6, seed=12)
    ids = transformers_engine.add([([25, 13, 25, 31], a), ([26, 13, 27, 31], b)])
    assert transformers_engine.unfinished() == 2
    done = dict(transformers_engine.step())
    assert set(done) == set(ids) and transformers_engine.unfinished() == 0 and transformers_engine.step() == []
    alone = transformers_engine.generate([[26, 13, 27, 31]], b)
    assert [c.token_ids for c in done[ids[1]]] == [c.token_ids for c in alone]


def _echo_server(tmp_path, monkeypatch):
    """A server of the echo engine taking syncs over the node channel (hpcrl_shm's stand-in), one
    trainer (rank 0) on its channel; (server, context)."""
    from hpcrl.compute.inference import server
    from hpcrl.compute.sync.channel_sync import ChannelReceiver

    monkeypatch.setitem(ENGINES, "echo", f"{__name__}:EchoEngine")
    monkeypatch.setattr(EchoEngine, "weight_receiver", lambda self: ChannelReceiver(self))
    monkeypatch.setattr(EchoEngine, "load_weights", lambda self, tensors: None, raising=False)
    recipe = SimpleNamespace(inference=InferenceConfig(engine="echo"))
    ctx = SimpleNamespace(spec=SimpleNamespace(recipe=recipe), device="cpu", run_dir=tmp_path,
                          task=SimpleNamespace(node=0, engine=None, rank=2), channel=_Channel({0}))
    return server.Server(ctx, server.make_engine(ctx, "/m")), ctx


def test_queued_generations_are_served_in_order_with_a_sync_landing_between_two(tmp_path, monkeypatch):
    """inference.max_staleness: a trainer has several generations queued on the server; a sync that
    arrives while they are queued lands between two of them, no generation starts while it is open,
    and each reply carries the request id (rid) of the message it answers."""
    from hpcrl.compute.inference import server

    s, ctx = _echo_server(tmp_path, monkeypatch)

    def generate(rid):
        return {"op": "generate", "prompts": [[rid]], "sampling": Sampling(n=1, max_tokens=1, seed=rid),
                "first_index": 0, "rid": rid}

    for rid in (1, 2, 3):
        s.handle(0, generate(rid))
    assert s._batch_wait_s() == 0.0
    s._generate_pending()                                   # the oldest first
    s.handle(0, {"op": "weights_hold", "rid": 4})           # a sync announced: nothing starts
    assert s._batch_wait_s() == server.HEALTH_EVERY_S
    s.handle(0, {"op": "weights_start", "version": 4, "rid": 5})
    s.handle(0, {"op": "weights_bucket", "tensors": [], "rid": 6})
    assert s._batch_wait_s() == server.HEALTH_EVERY_S       # nor while the sync is open
    s.handle(0, {"op": "weights_finish", "version": 4, "rid": 7})
    assert s._batch_wait_s() == 0.0
    while s.pending:
        s._generate_pending()
    replies = [(msg["rid"], [c.weight_version for c in msg.get("completions", [])]) for _, msg in ctx.channel.replies]
    assert replies == [(1, [0]), (4, []), (5, []), (6, []), (7, []), (2, [4]), (3, [4])]


def test_the_health_file_shows_each_new_weight_version_at_once(tmp_path, monkeypatch):
    """The engine's health file (what `hpcrl status` reads) is written every HEALTH_EVERY_S and at
    each new weight version, so a run of a few steps between two periodic writes leaves the version
    the engine served last, not its first."""
    import json

    s, _ = _echo_server(tmp_path, monkeypatch)
    s.write_health("serving")
    assert not s.health_due()
    s.handle(0, {"op": "weights_start", "version": 3, "rid": 1})
    s.handle(0, {"op": "weights_bucket", "tensors": [], "rid": 2})
    assert not s.health_due()                   # open: the version is still the old one
    s.handle(0, {"op": "weights_finish", "version": 3, "rid": 3})
    assert s.health_due()
    s.write_health("serving")
    assert json.loads(s.health_file.read_text())["weight_version"] == 3 and not s.health_due()


def test_a_trainer_tells_a_syncs_reply_from_a_generations_by_its_request_id():
    """The client's side: a sync message sent while a generation is outstanding gets its own reply
    even when the generation's comes first; the generation's is kept for result(), and the sync's
    bound grows by the generation's (the server answers it only between two generations)."""
    from hpcrl.compute.inference.client import ServerGenerator
    from hpcrl.job.placement import make_plan
    from hpcrl.job.recipe import InferenceConfig
    from hpcrl.login import profiles

    class Channel:
        def __init__(self):
            self.sent, self.waited, self.queue = [], [], []

        def send(self, msg):
            self.sent.append(msg)
            if msg["op"] == "weights_start":    # the generation's reply is read first
                self.queue += [{"ok": True, "rid": 1, "completions": [Completion(0, (9,), (0.0,), "", False, 0)]},
                               {"ok": True, "rid": msg["rid"], "state": "open"}]

        def recv(self, timeout=None):
            self.waited.append(timeout)
            return self.queue.pop(0)

    local = profiles.load("local")
    plan = make_plan(local, 1)
    inf = InferenceConfig(request_timeout_s=100, generation_s_per_ktoken=1.0)
    channel = Channel()
    ctx = SimpleNamespace(spec=SimpleNamespace(recipe=SimpleNamespace(inference=inf)), plan=plan,
                          task=plan.task(0), channels={plan.task(0).servers[0]: channel})
    gen = ServerGenerator(ctx, model=None)
    pending = gen.submit([[1, 2]], Sampling(n=1, max_tokens=1000))     # 1,000 tokens: a bound of 101 s
    engine = gen.engines[plan.task(0).servers[0]]
    reply = engine.request({"op": "weights_start", "version": 1}, 100)
    assert reply == {"ok": True, "rid": 2, "state": "open"}
    assert channel.waited[0] == pytest.approx(201, abs=0.5)             # its own 100 s and the generation's 101 s
    assert [c.token_ids for c in pending.result()] == [(9,)]           # kept, not read again
    assert len(channel.waited) == 2 and engine.generating == {} and engine.early == {}


def test_in_flight_a_trainer_keeps_what_its_stream_sends_during_a_sync_for_the_generation_it_belongs_to():
    """inference.weight_update = in_flight: a trainer's generations go per sample on one stream that
    stays open through its syncs. Completions the engine sends while the trainer waits for a sync's
    reply are kept in order, and each generation's result() gets its own, in prompt order, with the
    others' kept for theirs; every completion is its own request, with its own seed."""
    class Channel(PipeChannel):
        def send(self, msg):
            super().send(msg)
            if msg["op"] == "weights_start":     # the engine sends completions before the sync's reply
                self.push(_streamed(4, 0))
                self.push(_streamed(1))
                self.push({"ok": True, "rid": msg["rid"], "state": "open"})

    channel = Channel()
    # A completion lost would leave a result() waiting: 1 s of the engine's silence ends the test.
    gen, plan = _in_flight_client(channel)
    first = gen.submit([[1], [2]], Sampling(n=2, max_tokens=4, seed=5))      # keys 0-3
    second = gen.submit([[3]], Sampling(n=2, max_tokens=4, seed=6))          # keys 4-5
    asked = [r for msg in channel.sent for r in msg["requests"]]
    assert [(key, ids) for key, ids, _ in asked] == [(0, [1]), (1, [1]), (2, [2]), (3, [2]), (4, [3]), (5, [3])]
    assert len({s.seed for _, _, s in asked}) == 6 and all(s.n == 1 for _, _, s in asked)
    engine = gen.engines[plan.task(0).servers[0]]
    assert engine.request({"op": "weights_start", "version": 1}, 10)["state"] == "open"
    channel.push(_streamed(2, 3, 5))
    assert [(c.prompt_index, c.token_ids) for c in first.result()] == [(0, (0,)), (0, (1,)), (1, (2,)), (1, (3,))]
    assert [(c.prompt_index, c.token_ids) for c in second.result()] == [(0, (4,)), (0, (5,))]
    assert channel.queue == [] and gen.feed.done == {}


def test_in_flight_an_agents_stream_and_a_push_wait_on_one_channel_from_two_threads():
    """In flight an agent's rollouts take their stream's replies in a thread of their own while the
    trainer's thread waits for a sync's: one reader thread files what the engine sends, and each
    waiter gets its own, whatever their order on the channel. A channel that closes (a dead engine)
    ends the stream's wait at once with the channel's error, not at the end of its bound."""
    import threading

    from hpcrl.compute.launch.wire import ChannelClosed

    channel = PipeChannel()
    gen, plan = _in_flight_client(channel, request_timeout_s=30)
    engine = gen.engines[plan.task(0).servers[0]]
    stream = gen.open_stream()
    stream.add(7, [1, 2], Sampling(n=1, max_tokens=4))
    stream.add(8, [1, 3], Sampling(n=1, max_tokens=4))
    taken, sync_reply = [], []
    rollouts = threading.Thread(target=lambda: [taken.extend(stream.take()) for _ in range(2)])
    rollouts.start()                    # it sends the requests, then waits on the engine
    sync = threading.Thread(target=lambda: sync_reply.append(engine.request({"op": "weights_start", "version": 1}, 30)))
    sync.start()
    while len(channel.sent) < 2:
        threading.Event().wait(0.01)
    # The engine answers the rollouts' first, then the sync, then the rollouts' second.
    start = next(m for m in channel.sent if m["op"] == "weights_start")
    channel.push(_streamed(7))
    channel.push({"ok": True, "rid": start["rid"], "state": "open"})
    channel.push(_streamed(8))
    rollouts.join(5)
    sync.join(5)
    assert [k for k, _ in taken] == [7, 8] and sync_reply == [{"ok": True, "rid": start["rid"], "state": "open"}]
    stream.add(9, [1, 4], Sampling(n=1, max_tokens=4))
    failed = []
    waiting = threading.Thread(target=lambda: failed.append(_raised(stream.take)))
    waiting.start()
    channel.close_writer()
    waiting.join(5)
    assert not waiting.is_alive() and isinstance(failed[0], ChannelClosed), failed


def _raised(call):
    try:
        call()
    except BaseException as e:
        return e
    return None


def _streamed(*keys):
    """A stream's reply from the engine: the completions of requests ``keys``."""
    return {"ok": True, "rid": "stream", "streamed": [(k, Completion(0, (k,), (0.0,), "", False, 0)) for k in keys]}


class PipeChannel:
    """A node channel's trainer end: replies queued by the test, readable through a pipe (a reader
    thread waits on it as on the socket, with a timeout); closing the pipe's end is a dead engine."""

    def __init__(self):
        self.sent, self.queue = [], []
        self.r, self.w = os.pipe()

    def fileno(self):
        return self.r

    def push(self, reply):
        self.queue.append(reply)
        os.write(self.w, b"x")

    def close_writer(self):
        os.close(self.w)

    def send(self, msg):
        self.sent.append(msg)

    def recv(self, timeout=None):
        from hpcrl.compute.launch.wire import ChannelClosed

        if not select.select([self.r], [], [], timeout)[0]:
            raise TimeoutError(f"no message within {timeout} s")
        if not os.read(self.r, 1):
            raise ChannelClosed("peer closed the connection")
        return self.queue.pop(0)


def _in_flight_client(channel, request_timeout_s: float = 1):
    """A trainer's ServerGenerator in flight (inference.weight_update) over ``channel``."""
    from hpcrl.compute.inference.client import ServerGenerator
    from hpcrl.job.placement import make_plan
    from hpcrl.login import profiles

    plan = make_plan(profiles.load("local"), 1)
    inf = InferenceConfig(max_staleness=2, weight_update="in_flight", request_timeout_s=request_timeout_s)
    ctx = SimpleNamespace(spec=SimpleNamespace(recipe=SimpleNamespace(inference=inf)), plan=plan,
                          task=plan.task(0), channels={plan.task(0).servers[0]: channel})
    return ServerGenerator(ctx, model=None), plan
