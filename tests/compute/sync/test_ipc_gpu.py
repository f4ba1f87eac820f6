"""The GPU tier's sender -> engine transfer between two processes on one GPU (CUDA IPC): the path
a node takes when its sender and its engine share a device (``weight_sync.backend: ipc``, vLLM's
packed ``IPCWeightTransferEngine``).

The trainer side is hpcrl's own: a policy sharded by FSDP2 (hpcrl.compute.train.fsdp), its
``sync_named_params`` gathered one tensor at a time in the engine's dtype (bf16) by
``iter_full_tensors``, into one buffer sized by ``ipc_buffer_bytes`` (here the bucket is smaller
than the embedding, so the buffer grows to it, as for a large model's vocabulary).

The engine is a STAND-IN, named as such: vLLM cannot be installed on the tier's GPU machine (no
network, and its wheel is far over what a call may carry). It is a process of its own on the same
GPU that holds the model in bf16 and takes the weights as vLLM's packed IPC engine does
(vllm/distributed/weight_transfer/packed_tensor.py): the trainer exports its buffer ONCE with
torch's ``reduce_tensor``; the engine rebuilds it once with the device index rewritten to its own;
each chunk names its tensors, shapes, dtypes and byte sizes in the buffer, the trainer drains its
stream before handing a chunk over and waits for the engine before refilling the buffer.

Checked: after a stand-in optimizer step (every weight changed), the engine's weights equal the
trainer's gathered bf16 weights bit for bit, every engine parameter was sent, and none equals the
weights it loaded. Measured: the throughput of a large transfer through the same buffer hand-off
(256 MiB chunks, 4 GiB), recorded as the junit property ``ipc_gbps`` (gpu-check.sh prints it).

Self-check without a GPU (HPCRL_GPU_TIER_DEVICE=cpu): the same code over a CPU buffer, which
``reduce_tensor`` shares through shared memory; it checks the test's logic, not CUDA IPC.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from dist_harness import spawn

pytestmark = pytest.mark.gpu

BUCKET_BYTES = 64 << 10            # smaller than the tiny model's embedding: the buffer grows to it
ENGINE_TIMEOUT_S = 120.0           # every wait on the other process
# (chunk bytes, chunks) of the throughput pass
THROUGHPUT = {"cuda": (256 << 20, 16), "cpu": (4 << 20, 4)}


def _expect(conn, what: str, peer: str):
    """The next message from ``peer``, within ENGINE_TIMEOUT_S; an error it sends is raised here."""
    if not conn.poll(ENGINE_TIMEOUT_S):
        raise TimeoutError(f"{peer} did not answer {what} within {ENGINE_TIMEOUT_S:.0f} s")
    kind, payload = conn.recv()
    if kind == "error":
        raise RuntimeError(f"{peer} failed on {what}:\n{payload}")
    return payload


def _packed_chunks(named_tensors, buffer):
    """vLLM's ``packed_ipc_producer``'s packing: tensors copied one after another into ``buffer`` as
    raw bytes; a chunk is handed over (its metadata yielded) when the next tensor would not fit and
    at the end, after the stream has drained. The caller must not resume before the engine is done
    with the chunk: the next one overwrites the buffer."""
    import torch

    names, shapes, dtypes, sizes, used = [], [], [], [], 0
    for name, tensor in named_tensors:
        flat = tensor.contiguous().view(-1).view(torch.uint8)
        assert flat.numel() <= buffer.numel(), f"{name}: {flat.numel()} bytes, the buffer holds {buffer.numel()}"
        if used and used + flat.numel() > buffer.numel():
            if buffer.is_cuda:
                torch.cuda.current_stream().synchronize()
            yield {"names": names, "shapes": shapes, "dtypes": dtypes, "sizes": sizes}
            names, shapes, dtypes, sizes, used = [], [], [], [], 0
        buffer[used:used + flat.numel()].copy_(flat)
        names.append(name)
        shapes.append(list(tensor.shape))
        dtypes.append(str(tensor.dtype).removeprefix("torch."))
        sizes.append(flat.numel())
        used += flat.numel()
    if used:
        if buffer.is_cuda:
            torch.cuda.current_stream().synchronize()
        yield {"names": names, "shapes": shapes, "dtypes": dtypes, "sizes": sizes}


def _engine(conn, device_type: str, model_dir: str) -> None:
    """The engine stand-in: the model in bf16 on the device; takes the trainer's exported buffer
    once, then applies chunks from it; answers every message; ends on "done"."""
    import pickle
    import traceback

    import torch

    try:
        from transformers import AutoModelForCausalLM

        device = torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")
        if device_type == "cuda":
            torch.cuda.set_device(device)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)
        params = dict(model.named_parameters())
        buffers, sink, applied = {}, None, set()
        conn.send(("ok", None))
        while True:
            if not conn.poll(ENGINE_TIMEOUT_S):
                raise TimeoutError(f"the trainer sent nothing for {ENGINE_TIMEOUT_S:.0f} s")
            kind, payload = conn.recv()
            if kind == "buffer":                          # one export, rebuilt once (vLLM's PackedBufferImporter)
                key, (rebuild, args) = payload
                args = list(args)
                if device_type == "cuda":
                    args[6] = device.index                # reduce_tensor's device index, as vLLM rewrites it
                buffers[key] = rebuild(*args)
                reply = buffers[key].device.type
            elif kind == "chunk":
                packed, offset = buffers["weights"], 0
                with torch.no_grad():
                    for name, shape, dtype, size in zip(payload["names"], payload["shapes"], payload["dtypes"],
                                                        payload["sizes"]):
                        params[name].copy_(packed[offset:offset + size].view(getattr(torch, dtype)).view(shape))
                        applied.add(name)
                        offset += size
                reply = None
            elif kind == "bytes":                         # the throughput pass: copy the chunk out
                if sink is None:
                    sink = torch.empty_like(buffers["bench"])
                sink.copy_(buffers["bench"])
                reply = None
            elif kind == "done":
                # Plain pickle, by value: through the pipe, CPU tensors would go as shared memory that
                # the trainer could map only while this process lives.
                reply = pickle.dumps({"params": {n: p.detach().cpu() for n, p in params.items()},
                                      "applied": sorted(applied), "sink_head": None if sink is None else sink[:4096].cpu()})
            else:
                raise ValueError(f"unknown message {kind!r}")
            if device_type == "cuda":
                torch.cuda.current_stream().synchronize()     # done with the buffer before the trainer refills it
            conn.send(("ok", reply))
            if kind == "done":
                break
        buffers.clear()               # release the mappings before the trainer, their owner, exits
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _w_ipc_sender(rank, world, device, model_dir, out):
    import multiprocessing
    import pickle

    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.multiprocessing.reductions import reduce_tensor

    from hpcrl.compute.sync.gather import iter_full_tensors, ipc_buffer_bytes, sync_named_params
    from hpcrl.compute.train import fsdp
    from hpcrl.job.recipe import GRPOConfig, Recipe

    recipe = Recipe(grpo=GRPOConfig(beta=0.0, bf16=True, gradient_checkpointing=False))
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("shard",))
    policy, _ = fsdp.load_policy_and_reference(model_dir, mesh, device, recipe)
    with torch.no_grad():                                 # an optimizer step's stand-in: every weight moves
        for p in policy.parameters():
            p.to_local().mul_(1.25).add_(0.01)
    params = sync_named_params(policy)
    size, grew_for = ipc_buffer_bytes(BUCKET_BYTES, params, torch.bfloat16)
    assert grew_for is not None, f"the tiny model's largest tensor fits the {BUCKET_BYTES}-byte bucket: no growth tested"

    ctx = multiprocessing.get_context("spawn")
    conn, engine_end = ctx.Pipe()
    engine = ctx.Process(target=_engine, args=(engine_end, device.type, model_dir), daemon=True)
    engine.start()
    peer = f"the engine process (pid {engine.pid})"
    try:
        _expect(conn, "its start", peer)
        buffer = torch.empty(size, dtype=torch.uint8, device=device)
        if device.type == "cpu":
            buffer.share_memory_()
        conn.send(("buffer", ("weights", reduce_tensor(buffer))))
        assert _expect(conn, "the buffer's export", peer) == device.type
        t0, chunks = time.perf_counter(), 0
        for chunk in _packed_chunks(iter_full_tensors(params, torch.bfloat16), buffer):
            conn.send(("chunk", chunk))
            _expect(conn, f"chunk {chunks}", peer)
            chunks += 1
        sync_s = time.perf_counter() - t0

        chunk_bytes, n = THROUGHPUT[device.type]
        source = torch.randint(0, 256, (n, chunk_bytes), dtype=torch.uint8, device=device)
        bench = torch.empty(chunk_bytes, dtype=torch.uint8, device=device)
        if device.type == "cpu":
            bench.share_memory_()
        conn.send(("buffer", ("bench", reduce_tensor(bench))))
        _expect(conn, "the throughput buffer's export", peer)
        t0 = time.perf_counter()
        for i in range(n):
            bench.copy_(source[i])
            if device.type == "cuda":
                torch.cuda.current_stream().synchronize()
            conn.send(("bytes", None))
            _expect(conn, f"throughput chunk {i}", peer)
        bench_s = time.perf_counter() - t0

        conn.send(("done", None))
        engine_state = pickle.loads(_expect(conn, "the end", peer))
        sent = {name: t.cpu() for name, t in iter_full_tensors(params, torch.bfloat16)}
    finally:
        engine.join(ENGINE_TIMEOUT_S)
        if engine.is_alive():
            engine.kill()
    assert engine.exitcode == 0, f"{peer} exited {engine.exitcode}"

    assert engine_state["applied"] == sorted(engine_state["params"]), (
        "engine parameters no chunk carried: " + str(sorted(set(engine_state["params"]) - set(engine_state["applied"]))))
    differ = [n for n, t in engine_state["params"].items() if not torch.equal(t, sent[n])]
    assert not differ, f"the engine's copy differs from the trainer's bf16 weights in {len(differ)}: {differ[:5]}"
    # The stand-in step changed every weight: the copy that matches is not the one the engine loaded.
    from transformers import AutoModelForCausalLM

    loaded = dict(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).named_parameters())
    assert sorted(loaded) == sorted(sent), "the trainer sent other names than the engine's model has"
    same = [n for n, t in loaded.items() if torch.equal(t.detach(), sent[n])]
    assert not same, f"weights the engine already had, so their transfer proves nothing: {same[:5]}"
    assert torch.equal(engine_state["sink_head"], source[-1, :4096].cpu()), "the throughput pass's last chunk arrived wrong"
    Path(out).write_text(json.dumps({
        "chunks": chunks, "buffer_bytes": size, "grew_for": grew_for,
        "sync_s": sync_s, "model_bytes": sum(t.numel() * t.element_size() for t in sent.values()),
        "bench_bytes": chunk_bytes * n, "bench_s": bench_s, "chunk_bytes": chunk_bytes}))


def test_ipc_sender_to_engine_on_one_gpu(tmp_path, gpu_device, record_property):
    from hpcrl.compute.models.tiny import make_tiny_model

    model_dir = str(make_tiny_model(tmp_path / "tiny", size="tiny", seed=0))
    out = tmp_path / "ipc.json"
    spawn(_w_ipc_sender, tmp_path, model_dir, str(out), world=1, timeout=600, device=gpu_device)
    r = json.loads(out.read_text())
    assert r["chunks"] >= 2, f"one chunk: the buffer's reuse across chunks was not exercised ({r})"
    gbps = r["bench_bytes"] / r["bench_s"] / 1e9
    record_property("ipc_gbps", f"{gbps:.1f}")
    record_property("ipc_sync", f"{r['model_bytes'] / 2**20:.1f} MiB in {r['chunks']} chunks, {r['sync_s'] * 1e3:.0f} ms")
    print(f"{gpu_device}: the tiny model ({r['model_bytes'] / 2**20:.1f} MiB bf16) in {r['chunks']} chunks through a "
          f"{r['buffer_bytes'] / 2**10:.0f} KiB buffer (grown for {r['grew_for']}) in {r['sync_s'] * 1e3:.0f} ms; "
          f"{r['bench_bytes'] / 2**30:.2f} GiB in {r['chunk_bytes'] >> 20} MiB chunks at {gbps:.1f} GB/s")
