"""The table every bench_*.py script prints, and its reader.

A table is its title on one line, then rows of cells between pipes, right-aligned, the header first
and a rule under it (a Markdown table: it pastes into the notes as it is):

    login commands, median ms of 15 runs each, taking turns
    |      command | median ms |
    |-------------:|----------:|
    | hpcrl render |      81.2 |

A person reads the columns; a line-oriented reader takes every line that starts with "|", and
splits it on the pipes (no cell holds one: print_table writes "/" for it). The bench's contract
with its callers stays its last line of key=value figures; the table is for reading and grepping.
"""

from __future__ import annotations


def print_table(title: str, headers: list[str], rows: list[list[str]]) -> None:
    cells = [[str(c).replace("|", "/") for c in row] for row in [headers, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    print(title)
    print(_line(c.rjust(w) for c, w in zip(cells[0], widths)))
    print("|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|")
    for row in cells[1:]:
        print(_line(c.rjust(w) for c, w in zip(row, widths)))


def _line(cells) -> str:
    return "| " + " | ".join(cells) + " |"


def read_tables(text: str) -> list[tuple[str, list[str], list[list[str]]]]:
    """Every table print_table wrote into `text`: (title, headers, rows), cells stripped."""
    tables: list[tuple[str, list[str], list[list[str]]]] = []
    lines = text.splitlines()
    i = 0
    while i + 1 < len(lines):
        if lines[i].startswith("| ") and lines[i + 1].startswith("|-") and set(lines[i + 1]) <= set("|-:"):
            title = lines[i - 1] if i else ""
            headers, rows = _cells(lines[i]), []
            i += 2
            while i < len(lines) and lines[i].startswith("| "):
                rows.append(_cells(lines[i]))
                i += 1
            tables.append((title, headers, rows))
        else:
            i += 1
    return tables


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]
