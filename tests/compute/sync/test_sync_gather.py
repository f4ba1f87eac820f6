"""Trainer side of a weight sync, without vLLM: the gather (hpcrl.compute.sync.gather: FSDP2 shards on 2
gloo ranks -> full tensors, in buckets, bitwise equal to the unsharded model, in one order, within
the memory bound) and the shared-memory transport (hpcrl.compute.sync.shm) against a stand-in worker."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from hpcrl.compute.sync.gather import LiveBytes, hf_name, iter_buckets, param_specs, sync_named_params

BUCKET = 20_000  # bytes: small enough that buckets split layers and the embedding is a bucket alone


def tiny_qwen2(tie: bool, seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=tie)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def checkpoint_names(model) -> list[str]:
    """The tensor names save_pretrained writes (what vLLM's load_weights expects)."""
    return [k for k in model.state_dict() if not (model.config.tie_word_embeddings and k == "lm_head.weight")]


@pytest.mark.parametrize("tie", [True, False])
def test_names_are_checkpoint_names(tie):
    model = tiny_qwen2(tie)
    names = [n for n, _ in sync_named_params(model)]
    assert names == checkpoint_names(model)
    assert ("lm_head.weight" in names) is (not tie)


def test_wrapper_prefixes_are_stripped():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    model = tiny_qwen2(tie=True)
    expected = [n for n, _ in sync_named_params(model)]
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer)
    compiled = torch.compile(model)  # lazy: names gain "_orig_mod." without compiling anything
    raw = [n for n, _ in compiled.named_parameters()]
    assert any("_checkpoint_wrapped_module." in n for n in raw) and all(n.startswith("_orig_mod.") for n in raw)
    assert [n for n, _ in sync_named_params(compiled, tie_word_embeddings=True)] == expected
    assert hf_name("_fsdp_wrapped_module.model._fsdp_wrapped_module.norm.weight") == "model.norm.weight"


def test_bucket_bound_and_live_bytes_single_process():
    model = tiny_qwen2(tie=False)
    params = sync_named_params(model)
    specs = param_specs(params, torch.bfloat16)
    tracker = LiveBytes()
    seen = []
    for bucket in iter_buckets(params, BUCKET, cast_to=torch.bfloat16, tracker=tracker):
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= BUCKET or len(bucket) == 1
        for name, t in bucket:
            assert t.dtype == torch.bfloat16
            assert torch.equal(t, dict(params)[name].detach().to(torch.bfloat16))
            seen.append(name)
        del t
    assert seen == [s.name for s in specs]
    assert 0 < tracker.peak <= max(BUCKET, max(s.nbytes for s in specs))
    assert tracker.live == 0


def _fsdp_rank(rank: int, world: int, init_file: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        for tie in (True, False):
            model = tiny_qwen2(tie)
            # A real optimizer step first, so the weights are not just the init.
            loss = model(torch.randint(0, 1000, (2, 16)), labels=torch.randint(0, 1000, (2, 16))).loss
            loss.backward()
            torch.optim.AdamW(model.parameters(), lr=1e-2).step()
            reference = {n: p.detach().clone() for n, p in sync_named_params(model)}
            order = list(reference)

            for layer in model.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            params = sync_named_params(model)
            assert all(isinstance(p, DTensor) for _, p in params)
            assert [n for n, _ in params] == order
            largest = max(s.nbytes for s in param_specs(params))

            # Every rank keeps: all get the full, bitwise-equal tensors in the same order.
            tracker = LiveBytes()
            got = []
            for bucket in iter_buckets(params, BUCKET, tracker=tracker):
                assert sum(t.numel() * t.element_size() for _, t in bucket) <= BUCKET or len(bucket) == 1
                for name, t in bucket:
                    assert t.dtype == reference[name].dtype and t.shape == reference[name].shape
                    assert torch.equal(t, reference[name]), name
                    got.append(name)
                del t
            assert got == order
            # Extra memory of gathered tensors: one bucket or the largest tensor, never the model.
            assert 0 < tracker.peak <= max(BUCKET, largest), (tracker.peak, BUCKET, largest)
            assert tracker.live == 0

            # Only rank 0 keeps, and it is slow (as if sending): rank 1 drains without hanging.
            n_buckets = 0
            for bucket in iter_buckets(params, BUCKET, keep=(rank == 0), cast_to=torch.bfloat16):
                n_buckets += 1
                for name, t in bucket:
                    assert torch.equal(t, reference[name].to(torch.bfloat16)), name
                time.sleep(0.01)
            assert (n_buckets > 1) if rank == 0 else (n_buckets == 0)
            dist.barrier()
    finally:
        dist.destroy_process_group()
    from hpcrl.compute.launch.leave import exit_finished

    exit_finished(0)        # as a trainer task leaves: gloo's last work can abort finalization


def test_fsdp2_gather_two_gloo_ranks(tmp_path):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(_fsdp_rank, args=(2, str(tmp_path / "rdzv")), nprocs=2, join=True)


# ------------------------------------------------------------------ the shared-memory transport

class FakeServer:
    """Stands in for the server and its vLLM worker: maps the region like HpcrlShmWeightTransferEngine
    and copies what it receives (the client protocol is vLLM's four calls)."""

    def __init__(self):
        self.region = self.signals = None
        self.received: dict[str, torch.Tensor] = {}
        self.version = None
        self.mode_bits = None
        self.fail_at = None  # raise while applying this slot number

    def init_weight_transfer_engine(self, info):
        from hpcrl.compute.sync.shm import ShmRegion, SignalPipe

        self.mode_bits = os.stat(info["path"]).st_mode & 0o777
        self.region = ShmRegion.open(info["path"], num_slots=info["num_slots"], slot_bytes=info["slot_bytes"],
                                     meta_bytes=info["meta_bytes"], token=info["token"])
        self.signals = SignalPipe.open_worker(info["path"]) if info.get("signals") else None
        return {"dtype": "bfloat16", "workers": 1}

    def start_weight_update(self):
        self.received = {}

    def _apply(self, tensors, slot):
        if self.fail_at is not None and len(self.received) >= self.fail_at:
            raise RuntimeError("worker failed")
        for name, t in tensors:
            self.received[name] = t.clone()

    def update_weights(self, info):
        from hpcrl.compute.sync.shm import receive_stream

        if info["slot"] >= 0:
            self._apply(self.region.read_slot(info["slot"], info["seq"]), info["slot"])
        else:
            receive_stream(self.region, self.signals, info["seq"], self._apply, info["stall_timeout_s"])

    def finish_weight_update(self, weight_version=None):
        self.version = weight_version


def _random_buckets(seed=0):
    g = torch.Generator().manual_seed(seed)
    tensors = [(f"t{i}", torch.randn(int(torch.randint(1, 3000, (1,), generator=g)), generator=g).to(torch.bfloat16))
               for i in range(40)]
    tensors.append(("big", torch.randn(50_000, generator=g)))  # fp32, larger than a bucket
    tensors.append(("scalar", torch.tensor(3, dtype=torch.int64)))
    return tensors


@pytest.mark.parametrize("mode", ["stream", "rpc"])
def test_shm_transport_round_trip(mode, tmp_path):
    from hpcrl.compute.sync.shm import ShmWeightSender

    server = FakeServer()
    tensors = _random_buckets()
    buckets = [[(n, t)] for n, t in tensors[:10]] + [tensors[10:41], tensors[41:]]
    sender = ShmWeightSender(server, bucket_bytes=16_384, max_tensor_bytes=200_000, shm_dir=tmp_path, mode=mode)
    assert server.mode_bits == 0o600
    assert list(tmp_path.iterdir()) == []  # region and FIFOs unlinked once both sides hold them
    for version in ("v1", "v2"):
        stats = sender.send(buckets, version=version)
        assert server.version == version and stats.slots >= len(buckets)
        assert list(server.received) == [n for n, _ in tensors]
        for name, t in tensors:
            assert server.received[name].dtype == t.dtype and torch.equal(server.received[name], t), name
    sender.close()


def test_shm_stream_failures_are_loud_and_bounded(tmp_path):
    import threading

    from hpcrl.compute.sync.api import SyncError
    from hpcrl.compute.sync.shm import ShmWeightSender

    tensors = _random_buckets()
    buckets = [[(n, t)] for n, t in tensors]

    # The worker fails midway: the sender raises the worker's error, not a hang.
    server = FakeServer()
    server.fail_at = 5
    sender = ShmWeightSender(server, bucket_bytes=16_384, max_tensor_bytes=200_000, shm_dir=tmp_path, stall_timeout_s=10)
    with pytest.raises(SyncError, match="worker failed"):
        sender.send(buckets, version="x")
    # ... and the next sync works (leftover records of the failed one are skipped).
    server.fail_at = None
    sender.send(buckets, version="y")
    assert server.version == "y" and len(server.received) == len(tensors)

    # The sender dies midway (its FIFO ends close): the worker sees EOF at once, no timeout.
    errors = []

    def worker_side(first_seq):
        try:
            server.update_weights({"slot": -1, "seq": first_seq, "stall_timeout_s": 30})
        except SyncError as exc:
            errors.append(exc)

    first = sender._seq
    sender.region.write_slot(first % 2, first, buckets[0])
    thread = threading.Thread(target=worker_side, args=(first,))
    t0 = time.perf_counter()
    thread.start()
    sender.signals.send(first)
    time.sleep(0.2)
    sender.signals.close()
    thread.join(10)
    assert errors and "gone" in str(errors[0]) and time.perf_counter() - t0 < 5
    sender.region.close()

    # A silent sender: the worker gives up after its stall timeout.
    server2 = FakeServer()
    quiet = ShmWeightSender(server2, bucket_bytes=16_384, max_tensor_bytes=200_000, shm_dir=tmp_path)
    t0 = time.perf_counter()
    with pytest.raises(SyncError, match="stalled"):
        server2.update_weights({"slot": -1, "seq": quiet._seq, "stall_timeout_s": 0.5})
    assert time.perf_counter() - t0 < 3
    quiet.close()


# ------------------------------------------------------------------ no weight bytes between nodes

FAKE_NODES = {0: 0, 1: 0, 2: 1, 3: 1}     # 4 trainers, 2 per (fake) node


def _traffic_rank(rank, world, mesh_kind, out_dir):
    import json

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hpcrl.compute.sync.gather import GatherTraffic
    from hpcrl.compute.train.fsdp import apply_fsdp

    shape, names = ((2, 2), ("replicate", "shard")) if mesh_kind == "hsdp" else ((4,), ("shard",))
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = apply_fsdp(tiny_qwen2(tie=True), mesh)
    params = sync_named_params(model)
    traffic = GatherTraffic(FAKE_NODES)
    for _ in iter_buckets(params, 1 << 16, keep=(rank == 0), traffic=traffic):
        pass
    total = sum(p.numel() * p.element_size() for _, p in params)
    # hpcrl_shm's sender gathers into its slot over the one group a tensor is split over (the
    # node's, under HSDP): the right group, or the tensor comes out wrong (or the ranks hang).
    from hpcrl.compute.sync.gather import _shard0_group, gather_into

    assert all(_shard0_group(p) is not None for _, p in params)
    for name, p in params:
        out = torch.empty(p.shape, dtype=p.dtype)
        gather_into(p, out)
        assert torch.equal(out, p.full_tensor()), name
    t = torch.tensor([traffic.in_node, traffic.cross_node])
    dist.all_reduce(t)
    if rank == 0:
        (out_dir / f"{mesh_kind}.json").write_text(json.dumps({"in": int(t[0]), "cross": int(t[1]), "total": total}))


@pytest.mark.parametrize("mesh_kind", ["hsdp", "fsdp"])
def test_sync_gathers_stay_inside_each_node_under_hsdp(mesh_kind, tmp_path):
    """Two fake nodes of two trainers: under HSDP (shard inside a node, replicate across) a sync's
    gathers move no byte between nodes; under FSDP over all four, the counter sees them cross."""
    import json

    from dist_harness import spawn

    spawn(_traffic_rank, tmp_path, mesh_kind, tmp_path, world=4, timeout=180)
    got = json.loads((tmp_path / f"{mesh_kind}.json").read_text())
    if mesh_kind == "hsdp":
        # Each of the 4 ranks receives half of every tensor from its node peer.
        assert got["cross"] == 0 and got["in"] == pytest.approx(4 * got["total"] / 2, rel=0.01), got
    else:
        assert got["cross"] == pytest.approx(4 * got["total"] * 3 / 4, rel=0.01) and got["in"] == 0, got


# ------------------------------------------------------------------ the wire dtype before the gather

def _uneven_qwen2(seed: int = 0):
    """Sizes that do not split evenly over 2 ranks (vocabulary 1001), so uneven shards are cast too."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=1001, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def _cast_first_rank(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from hpcrl.compute.sync.gather import GatherTraffic, full_tensor
    from hpcrl.compute.train.fsdp import apply_fsdp

    model = _uneven_qwen2()
    # An optimizer step: fp32 values that bf16/fp16 cannot hold exactly, so rounding is exercised.
    ids = torch.randint(0, 1001, (2, 16))
    model(ids, labels=ids).loss.backward()
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()
    apply_fsdp(model, init_device_mesh("cpu", (world,)))
    params = sync_named_params(model)
    assert any(p.to_local().shape[0] != (p.shape[0] + 1) // 2 or p.shape[0] % 2 for _, p in params)

    gathered_dtypes = []
    original = DTensor.full_tensor

    def spy(self, *args, **kwargs):
        gathered_dtypes.append(self.to_local().dtype)
        return original(self, *args, **kwargs)

    for wire in (torch.bfloat16, torch.float16):
        # What the sync did before: gather the fp32 master, then cast.
        expected = {n: original(p).to(wire) for n, p in params}
        traffic = GatherTraffic({0: 0, 1: 0})
        gathered_dtypes.clear()
        DTensor.full_tensor = spy
        try:
            got = [(n, t.clone()) for bucket in iter_buckets(params, BUCKET, cast_to=wire, traffic=traffic)
                   for n, t in bucket]
        finally:
            DTensor.full_tensor = original
        assert [n for n, _ in got] == list(expected)
        for name, t in got:
            # Bit for bit, not just equal values: the cast is elementwise, so where it runs cannot matter.
            assert t.dtype == wire and torch.equal(t.view(torch.int16), expected[name].view(torch.int16)), name
        assert gathered_dtypes and set(gathered_dtypes) == {wire}, gathered_dtypes   # the gathers moved wire bytes
        wire_bytes = sum(p.numel() * wire.itemsize for _, p in params)
        # Each of the 2 ranks receives the other's half of every tensor, counted in the wire dtype.
        assert traffic.cross_node == 0 and abs(traffic.in_node - wire_bytes / 2) <= len(params), (traffic.in_node, wire_bytes)
        one = full_tensor(params[0][1], wire)
        assert torch.equal(one, expected[params[0][0]])


def test_cast_before_the_gather_is_bit_identical_to_gather_then_cast(tmp_path):
    """Two gloo ranks, FSDP2 with uneven shards: each rank casts its shard to the wire dtype before
    the all-gather (the gathers see only wire-dtype shards), and the result equals, bit for bit,
    the fp32 master gathered and cast afterwards. The traffic counter counts wire bytes."""
    from dist_harness import spawn

    spawn(_cast_first_rank, tmp_path, timeout=180)


def _fake_notify(server: FakeServer):
    """The node channel's messages, answered by a FakeServer as WeightReceiver.handle would."""
    def notify(msg):
        op = msg["op"]
        extra = {}
        if op == "weights_init":
            extra = server.init_weight_transfer_engine(msg["init_info"])
        elif op == "weights_start":
            server.start_weight_update()
        elif op == "weights_update":
            server.update_weights(msg["update_info"])
        elif op == "weights_finish":
            server.finish_weight_update(msg.get("version"))
        return {"ok": True, **extra}
    return notify


def _agree_rank(rank, world, out_dir):
    import json

    from torch.distributed.device_mesh import init_device_mesh

    from hpcrl.compute.sync.api import ShmOptions, SyncError
    from hpcrl.compute.sync.trainer import TrainerWeightSync
    from hpcrl.compute.train.fsdp import apply_fsdp

    model = _uneven_qwen2()
    reference = {n: p.detach().to(torch.bfloat16) for n, p in sync_named_params(model)}
    apply_fsdp(model, init_device_mesh("cpu", (world,)))
    server = FakeServer() if rank == 0 else None
    # Only the sender is given the engine's dtype (bf16); the other rank has nothing to go by:
    # without the agreement it would gather fp32 against bf16.
    sync = TrainerWeightSync(model, _fake_notify(server) if rank == 0 else None, is_sender=rank == 0,
                             bucket_bytes=BUCKET, transport=ShmOptions(shm_dir=str(out_dir)), node_of_rank={0: 0, 1: 0},
                             wire_dtype=torch.bfloat16 if rank == 0 else None)
    assert sync.wire_dtype == torch.bfloat16 and sync.transport.wire_dtype == torch.bfloat16
    sync.sync("v1")
    if rank == 0:
        assert server.version == "v1" and list(server.received) == list(reference)
        for name, t in server.received.items():
            assert t.dtype == torch.bfloat16 and torch.equal(t.view(torch.int16), reference[name].view(torch.int16)), name
        wire_bytes = sum(t.numel() * 2 for t in reference.values())
        (out_dir / "traffic.json").write_text(json.dumps({**sync.last_traffic, "wire": wire_bytes}))
    sync.close()

    # Two ranks that know different dtypes refuse together, before any gather.
    try:
        TrainerWeightSync(model, None, is_sender=False, wire_dtype=torch.bfloat16 if rank == 0 else torch.float16)
    except SyncError as exc:
        assert "disagree" in str(exc)
    else:
        raise AssertionError("mismatched wire dtypes were accepted")


def _in_place_rank(rank, world, out_dir):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hpcrl.compute.sync.api import ShmOptions, SyncError
    from hpcrl.compute.sync.gather import LiveBytes, _shard0_group
    from hpcrl.compute.sync.trainer import TrainerWeightSync
    from hpcrl.compute.train.fsdp import apply_fsdp

    model = _uneven_qwen2()
    reference = {n: p.detach().to(torch.bfloat16) for n, p in sync_named_params(model)}
    apply_fsdp(model, init_device_mesh("cpu", (world,)))
    params = sync_named_params(model)
    even = {n for n, p in params if _shard0_group(p) is not None}
    uneven = {n: p for n, p in params if n not in even}
    assert even and uneven      # both paths: rows split evenly (the layers), and not (vocabulary 1001)
    server = FakeServer() if rank == 0 else None
    tracker = LiveBytes()
    sync = TrainerWeightSync(model, _fake_notify(server) if rank == 0 else None, is_sender=rank == 0,
                             bucket_bytes=BUCKET, transport=ShmOptions(shm_dir=str(out_dir), stall_timeout_s=20),
                             wire_dtype=torch.bfloat16, tracker=tracker)
    into_region = []
    original = dist.all_gather_into_tensor

    def spy(output, *args, **kwargs):
        if rank == 0:
            lo, hi = (sync.transport.sender.region.data_range(s) for s in (0, 1))
            into_region.append(any(a <= output.data_ptr() < b for a, b in (lo, hi)))
        return original(output, *args, **kwargs)

    dist.all_gather_into_tensor = spy
    try:
        sync.sync("v1")
        if rank == 0:
            assert server.version == "v1" and list(server.received) == list(reference)
            for name, t in server.received.items():
                assert torch.equal(t.view(torch.int16), reference[name].view(torch.int16)), name
            # Every evenly split tensor was gathered straight into a slot; only the others were
            # gathered as tensors of their own (then copied): the sender's extra memory.
            assert into_region == [True] * len(even), into_region
            assert 0 < tracker.peak <= max(p.numel() * 2 for p in uneven.values()), tracker.peak

        # The engine fails mid-sync: every rank raises (the other one finishes its gathers, no hang) ...
        if rank == 0:
            server.fail_at = 3
        try:
            sync.sync("v2")
        except SyncError as exc:
            assert rank == 1 or "worker failed" in str(exc), exc
        else:
            raise AssertionError("a failed sync returned")
        # ... and the next sync is whole.
        if rank == 0:
            server.fail_at = None
        sync.sync("v3")
        if rank == 0:
            assert server.version == "v3" and list(server.received) == list(reference)
    finally:
        dist.all_gather_into_tensor = original
        sync.close()


def test_the_sender_gathers_into_shared_memory_and_a_failed_sync_ends_on_every_rank(tmp_path):
    """hpcrl_shm's sender all-gathers each evenly split tensor straight into its slot (no gathered
    copy), the others through DTensor and a copy; the engine receives the model bit for bit. An
    engine failing midway raises on both ranks, and the next sync is whole."""
    from dist_harness import spawn

    spawn(_in_place_rank, tmp_path, tmp_path, timeout=180)


def test_trainers_agree_on_the_wire_dtype_the_sender_learnt(tmp_path):
    import json

    from dist_harness import spawn

    spawn(_agree_rank, tmp_path, tmp_path, timeout=180)
    got = json.loads((tmp_path / "traffic.json").read_text())
    # Both ranks' gathers, totalled: one copy of the model in bf16 (2 ranks: n - 1 = 1 copy).
    assert got["gathered_bytes_cross_node"] == 0
    assert got["gathered_bytes_in_node"] / got["wire"] == pytest.approx(1.0, abs=0.01), got
