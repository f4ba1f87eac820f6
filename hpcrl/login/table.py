"""The one way a login command prints a table: plain columns two spaces apart, padded to the
widest cell, no trailing blanks (grep/awk friendly, no rich)."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence


def print_table(header: Sequence[object], rows: Iterable[Sequence[object]], file=None) -> None:
    rows = list(rows)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    lines = ["  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip() for row in (header, *rows)]
    (file or sys.stdout).write("\n".join(lines) + "\n")
