"""Copy the job's model to this node's local storage: ``python -m hpcrl.compute.stage RUN_DIR``, one
task per node, before the launch (the sbatch script runs it when site.stage.model_via is "srun").

site.stage.model_dest is expanded here, in the node's own environment, so nodes that share one disk
(the testbed's) can each name their own copy. A copy that is already complete (a requeued job's) is
kept; an interrupted one is replaced: the copy is made beside the destination and renamed into place.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path

from hpcrl.compute.launch import outcome
from hpcrl.job.errors import UserError
from hpcrl.job.spec import JobSpec

__all__ = ["stage_model", "MANIFEST"]

# Written last into a complete copy: the source's files and sizes.
MANIFEST = ".hpcrl-staged.json"


def _manifest(source: Path) -> dict[str, int]:
    """Every file under ``source`` (symlinks followed: a hub snapshot's files are links to blobs)."""
    return {str(p.relative_to(source)): p.stat().st_size for p in sorted(source.rglob("*")) if p.is_file()}


def stage_model(source: str | Path, dest: str | Path) -> tuple[bool, int]:
    """Copy ``source`` to ``dest`` unless ``dest`` already holds it; (copied, bytes)."""
    source, dest = Path(source), Path(dest)
    if not source.is_dir():
        raise FileNotFoundError(f"model.path: {source} is not a directory on {socket.gethostname()}")
    want = _manifest(source)
    try:
        if json.loads((dest / MANIFEST).read_text()) == want:
            return False, sum(want.values())
    except (OSError, ValueError):
        pass
    partial = dest.with_name(f"{dest.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(source, partial, symlinks=False)
    (partial / MANIFEST).write_text(json.dumps(want))
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(partial, dest)
    return True, sum(want.values())


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m hpcrl.compute.stage RUN_DIR", file=sys.stderr)
        return 2
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    outcome.record_to(args[0])      # a failure here is the job's reason in `hpcrl status`
    try:
        spec = JobSpec.load(args[0])
        dest = spec.node_model_dir()
        if dest is None:
            print(f"hpcrl: {node}: the job stages no model", file=sys.stderr)
            return 0
        t0 = time.monotonic()
        copied, size = stage_model(spec.model_source, dest)
    except (UserError, OSError) as e:
        outcome.fatal(f"hpcrl: {node}: staging the model failed: {e}")
        return 1
    what = f"copied {size / 2**20:.1f} MiB in {time.monotonic() - t0:.1f} s" if copied else "already there"
    print(f"hpcrl: {node}: model staged at {dest} ({what})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
