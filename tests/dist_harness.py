"""A harness for tests that need several torch.distributed ranks: spawned processes, gloo, a
FileStore. Each worker asserts itself; a failing rank's traceback becomes the test failure."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
import traceback
from pathlib import Path

WORLD = 2




def _entry(fn, rank: int, world: int, store: str, err_dir: str, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        fn(rank, world, *args)
    except BaseException:
        Path(err_dir, f"rank{rank}.err").write_text(traceback.format_exc())
        os._exit(1)
    # The rank's work is done and checked. Skip gloo's teardown: its C++ destructors can race with
    # peers that already left and abort ("terminate called without an active exception", SIGABRT),
    # failing a test whose every assertion passed. Nothing of hpcrl's runs there.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, tmp: Path, *args, world: int = WORLD, timeout: float = 120.0, expect: dict | None = None) -> float:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; raise with the failing rank's traceback.

    ``expect``: rank -> exit code other than 0 that this test provokes on purpose. Returns seconds.
    """
    tmp.mkdir(parents=True, exist_ok=True)
    store = tmp / f"store-{time.monotonic_ns()}"
    err_dir = tmp / "errors"
    err_dir.mkdir(exist_ok=True)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(fn, r, world, str(store), str(err_dir), args)) for r in range(world)]
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


