"""`hpcrl plot`: one PNG of a run's metrics, for a registered job id or a run directory."""

from __future__ import annotations

from hpcrl.job.errors import UserError
from hpcrl.login import plot


def main(args) -> int:
    run_dir = plot.resolve_run_dir(args.target)
    try:
        path = plot.write_plot(run_dir, args.output)
    except ImportError as e:
        raise UserError(f"plot: matplotlib is not installed ({e}); pip install matplotlib") from None
    print(path)
    return 0
