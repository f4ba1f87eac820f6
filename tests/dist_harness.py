"""A harness for tests that need several torch.distributed ranks: spawned processes, gloo (or the
trainers' gloo+NCCL group on a GPU, for the GPU tier), a FileStore. Each worker asserts itself; a failing rank's traceback becomes the test failure."""

from __future__ import annotations

import multiprocessing
import os
import time
import traceback
from pathlib import Path

WORLD = 2




def _entry(fn, rank: int, world: int, store: str, err_dir: str, args: tuple, device_type: str | None) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if device_type == "cuda":
        # As hpcrl's pinning does: the rank sees one GPU, its entry of what this process was given.
        held = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        os.environ["CUDA_VISIBLE_DEVICES"] = held[rank] if held else str(rank)
        # cuBLAS is deterministic only with a fixed workspace, read when its first handle is made.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    try:
        kw, device, backend = {}, torch.device("cpu"), "gloo"
        if device_type == "cuda":
            device = torch.device("cuda", 0)
            torch.cuda.set_device(device)
            # hpcrl's trainers' group (rendezvous.init_trainer_group): NCCL for the model, gloo for the
            # small CPU tensors the loop reduces (stop flags, token counts).
            backend, kw["device_id"] = "cpu:gloo,cuda:nccl", device
        else:
            torch.set_num_threads(1)
        dist.init_process_group(backend, store=dist.FileStore(store, world), rank=rank, world_size=world,
                                timeout=timedelta(seconds=120 if device_type else 60), **kw)
        fn(rank, world, *((device,) if device_type else ()), *args)
    except BaseException:
        Path(err_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    # The rank's work is done and checked; it leaves as a trainer task does, never through the
    # interpreter's finalization, which gloo's last work can abort (hpcrl/compute/launch/leave.py).
    from hpcrl.compute.launch.leave import exit_finished

    exit_finished(0)


def spawn(fn, tmp: Path, *args, world: int = WORLD, timeout: float = 120.0, expect: dict | None = None,
          device: str | None = None) -> float:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; raise with the failing rank's traceback.

    ``expect``: rank -> exit code other than 0 that this test provokes on purpose. Returns seconds.
    ``device`` ("cpu" or "cuda", the GPU tier's): ``fn(rank, world, torch_device, *args)`` instead,
    and on "cuda" every rank sees one GPU and joins the trainers' "cpu:gloo,cuda:nccl" group.
    """
    tmp.mkdir(parents=True, exist_ok=True)
    store = tmp / f"store-{time.monotonic_ns()}"
    err_dir = tmp / "errors"
    err_dir.mkdir(exist_ok=True)
    ctx = multiprocessing.get_context("spawn")     # never fork a process that may have touched CUDA
    procs = [ctx.Process(target=_entry, args=(fn, r, world, str(store), str(err_dir), args, device))
             for r in range(world)]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    deadline = t0 + timeout
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for r in hung:
        procs[r].kill()
        procs[r].join()
    errors = {r: (err_dir / f"rank{r}.err").read_text() for r in range(world) if (err_dir / f"rank{r}.err").exists()}
    if errors:
        raise AssertionError("\n".join(f"--- rank {r} ---\n{t}" for r, t in sorted(errors.items())))
    assert not hung, f"ranks {hung} still running after {timeout} s"
    codes = {r: p.exitcode for r, p in enumerate(procs)}
    assert codes == {r: (expect or {}).get(r, 0) for r in range(world)}, f"exit codes {codes}"
    return time.monotonic() - t0


