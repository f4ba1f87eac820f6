"""The table the bench_*.py scripts print (rich when installed, plain columns otherwise)."""

from __future__ import annotations


def print_table(title: str, headers: list[str], rows: list[list[str]]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
        print(title)
        print("  ".join(h.rjust(w) for h, w in zip(headers, widths)))
        for r in rows:
            print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        return
    table = Table(title=title, title_justify="left")
    for h in headers:
        table.add_column(h, justify="right")
    for r in rows:
        table.add_row(*r)
    Console(width=max(120, len(" ".join(headers)) + 3 * len(headers) + 10)).print(table)
