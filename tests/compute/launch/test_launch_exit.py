"""How a finished trainer task leaves (hpcrl/compute/launch/leave.py).

Two FSDP2 gloo ranks that train, barrier and destroy their group abort at interpreter exit about
one run in five ("terminate called without an active exception": gloo's worker frees the last
work's tensors after Python began finalizing), which failed finished 2-trainer jobs on the
testbed. That race cannot be provoked on demand, so this test checks, on every run, the parts of
the cure: the task never enters finalization, and still does what finalization would have done
that matters (atexit handlers, buffered output, MPI_Finalize) and exits 0 under a real mpiexec.
MPICH tells mpiexec that a rank finalized only from a C atexit handler, without which hydra kills
the ranks still running: test_launch_local's probe of 3 trainers and a server fails then (5 runs
of 6 ended "Killed (signal 9)" when the task left by os._exit).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

PY = sys.executable
MPIEXEC = str(Path(PY).parent / "mpiexec")

TRAINER = textwrap.dedent("""
    import atexit, os, sys
    from datetime import timedelta
    from mpi4py import MPI
    import torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from hpcrl.compute.launch.leave import exit_finished

    out = sys.argv[1]
    rank = MPI.COMM_WORLD.rank
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(f"{out}/store", 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=60))
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(3)])
    for layer in model:
        fully_shard(layer, mesh=init_device_mesh("cpu", (2,)))
    model(torch.randn(4, 32)).sum().backward()
    dist.barrier()
    dist.destroy_process_group()

    marks = f"{out}/rank{rank}"
    atexit.register(lambda: open(marks, "a").write("atexit\\n"))

    class Finalized:        # freed only when the interpreter finalizes (module globals cleared)
        def __del__(self, open=open, marks=marks):
            open(marks, "a").write("finalized\\n")

    keep = Finalized()
    # MPICH's segments this rank maps: the test checks that these are gone (other jobs on the machine
    # make and strand segments of their own meanwhile).
    with open(f"{out}/segments{rank}", "w") as f:
        f.write(" ".join(sorted({word.rsplit("/", 1)[1] for line in open("/proc/self/maps")
                                 for word in line.split() if word.startswith("/dev/shm/mpich_shm_")})))
    print(f"rank {rank} trained", end="")   # no newline, no flush: still buffered at exit
    exit_finished(0)
""")


def test_a_finished_trainer_leaves_without_finalizing_yet_flushes_runs_atexit_and_finalizes_mpi(tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([MPIEXEC, "-n", "2", PY, str(script), str(tmp_path)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0 trained" in proc.stdout and "rank 1 trained" in proc.stdout, proc.stdout
    for rank in (0, 1):
        assert (tmp_path / f"rank{rank}").read_text() == "atexit\n"      # and never "finalized"
    # A rank that leaves without MPI_Finalize strands MPICH's shared-memory segment in /dev/shm.
    segments = {name for rank in (0, 1) for name in (tmp_path / f"segments{rank}").read_text().split()}
    assert segments, "the ranks mapped none of MPICH's segments: nothing to check"
    assert not [name for name in segments if Path("/dev/shm", name).exists()], segments
