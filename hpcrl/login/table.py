"""The one way a login command prints a table: plain columns two spaces apart, padded to the
widest cell, no trailing blanks (grep/awk friendly, no rich)."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence


def print_table(header: Sequence[object], rows: Iterable[Sequence[object]], file=None) -> None:
    # each cell made text once (a 1,000-job status prints 13,000 of them)
    cells = [[str(x) for x in row] for row in (header, *rows)]
    widths = [max(map(len, col)) for col in zip(*cells)]
    lines = ["  ".join([x.ljust(w) for x, w in zip(row, widths)]).rstrip() for row in cells]
    (file or sys.stdout).write("\n".join(lines) + "\n")
