"""Every row's prompt, checked on the login node (hpcrl.login.inputs calls `check_prompts`). A row
with an empty or missing prompt otherwise fails only on the compute nodes, after the job waited in
the queue, in the engine's words ("The decoder prompt cannot be empty", "You need to specify either
text or text_target").

A good prompt is text that is not empty or whitespace only, or TRL's conversational form: a
non-empty list of {role, content} messages, each with a role and a content, the last a user, tool
or assistant turn (what hpcrl.compute.train.data.render_prompt renders, as TRL's
apply_chat_template does). A row without the column is as bad as one holding null: datasets fills
both with None. In a CSV file an empty field and the words pandas takes for a missing value (NA,
null, None, ...) are None to the job as well.

Bounded, because a login node is shared and the user waits for `hpcrl submit`:
- the first HEAD_ROWS rows, in order over the split's files: all of a usual prompt set (GSM8K has
  7.5k rows, MATH 12k), in about a second of JSON parsing on a slow core;
- beyond them, SAMPLE_ROWS rows spread evenly over the rest (JSON lines by byte offset: the line
  after a seek is exactly a row; tables by row index), so that a bad stretch in the middle or at the
  end of a huge set is still likely seen without reading it all. CSV files are not sampled: a seek
  can land inside a quoted field that spans lines, where no row boundary can be told;
- each of the two parts stops after TIME_BUDGET_S whatever it has read (very long prompts, a slow
  shared file system).
What the bound leaves unread fails on the compute nodes, as before.

Positions in the messages: a text file's line (JSON lines, CSV), counted from 1 as an editor counts
(a CSV's header is line 1); a table's row (a JSON array, parquet, a saved dataset's arrow file),
counted from 0 as dataset[i] counts.

A RowChecks may also name NamesColumns: the same rows are read again for each, a column every row
must name one of a few names in (agent.environment_factory's environments).

Lines that are not JSON objects are not this module's: the job's loader names the first of them in
one line (hpcrl.compute.train.data). No torch, no datasets: pyarrow reads parquet and arrow files
where it is importable (it comes with datasets); elsewhere those files are left to the job.
"""

from __future__ import annotations

import bisect
import csv
import itertools
import json
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from hpcrl.job.errors import UserError

HEAD_ROWS = 200_000
SAMPLE_ROWS = 2_000
TIME_BUDGET_S = 2.0
WHOLE_JSON_MAX_BYTES = 32 << 20         # a .json file is parsed whole only up to this size
BATCH_ROWS = 4096                       # a table's rows made Python objects at a time
# TRL's apply_chat_template either adds the assistant's header or continues an assistant turn.
LAST_ROLES = ("user", "tool", "assistant")
# pandas' default missing-value words, which datasets' CSV builder keeps (keep_default_na=True).
CSV_MISSING = frozenset({"", "#N/A", "#N/A N/A", "#NA", "-1.#IND", "-1.#QNAN", "-NaN", "-nan", "1.#IND",
                         "1.#QNAN", "<NA>", "N/A", "NA", "NULL", "NaN", "None", "n/a", "nan", "null"})
MISSING = object()                      # a row without the prompt's key
NEEDED = "every row needs a prompt to generate from"


@dataclass(frozen=True)
class NamesColumn:
    """A column whose every row holds one of `names`, which the field `owner` gives."""
    column: str
    names: tuple[str, ...]
    owner: str

    def problem(self, value) -> str | None:
        if isinstance(value, str) and not isinstance(value, _NaWord) and value in self.names:
            return None
        found = "is missing" if value is MISSING else "is null" if value is None or isinstance(value, _NaWord) \
            else f"is {_short(value)}"
        return f"{found}, not one of {self.owner}'s names ({', '.join(self.names)}): every row picks one"


@dataclass(frozen=True)
class RowChecks:
    """What the rows of a recipe's data are checked for: the prompt column (data.prompt_column), and
    columns that must name one of a few names."""
    prompt: str
    names: tuple[NamesColumn, ...] = ()


def check_prompts(files: list[Path], rows: RowChecks, where: str, split: str = "train") -> None:
    """The prompts in the prompt column of a split's data files (read by suffix; a file that cannot
    be read here is skipped), within the bound above, and the NamesColumns of ``rows``. A bad one is
    a UserError naming `where`, the file, the position and what was found."""
    _check_column(files, rows.prompt, where, split, problem)
    for extra in rows.names:
        _check_column(files, extra.column, where, split, extra.problem)


def _check_column(files: list[Path], column: str, where: str, split: str, judge) -> None:
    shown_split = "" if split == "train" else f" (split {split!r})"

    def bad(reader, position, found: str) -> UserError:
        return UserError(f"{where}: {reader.file}{shown_split} {reader.where(position)}: column "
                         f"{json.dumps(column)} {found}")

    deadline, budget, unfinished = time.monotonic() + TIME_BUDGET_S, HEAD_ROWS, []
    for file in map(Path, files):
        reader = None
        if budget > 0 and time.monotonic() < deadline:
            reader = _reader(file, column, where)
            if reader is None:
                continue
            read, finished = _check_rows(reader.head(), reader, budget, deadline, bad, judge)
            budget -= read
            if finished:
                continue
        unfinished.append(reader or file)       # a file not begun is opened only if sampled
    if not unfinished:
        return
    # Thousands of unread shards: one row from each of SAMPLE_ROWS of them, spread over their order.
    count = min(SAMPLE_ROWS, len(unfinished))
    chosen = [unfinished[i * len(unfinished) // count] for i in range(count)]
    deadline = time.monotonic() + TIME_BUDGET_S
    for reader in chosen:
        if time.monotonic() >= deadline:
            return
        if isinstance(reader, Path):
            reader = _reader(reader, column, where)
        if reader is not None:
            _check_rows(reader.spread(SAMPLE_ROWS // len(chosen)), reader, SAMPLE_ROWS, deadline, bad, judge)


def saved_files(directory: Path) -> list[Path]:
    """The arrow files of a save_to_disk Dataset directory (one split of a DatasetDict), in order."""
    try:
        state = json.loads((directory / "state.json").read_text())
        return [directory / str(f["filename"]) for f in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError):
        return []                       # the job's loader says what is wrong with the directory


def problem(value) -> str | None:
    """What is wrong with a prompt, or None."""
    if value is MISSING:
        return f"is missing ({NEEDED})"
    if value is None:
        return f"is null ({NEEDED})"
    if isinstance(value, _NaWord):
        return f"is {str(value)!r}, which datasets' CSV reader (pandas) takes for a missing value ({NEEDED})"
    if isinstance(value, str):
        if not value:
            return "is empty (an empty prompt cannot be generated from)"
        return f"is whitespace only ({_short(value)}; {NEEDED})" if value.isspace() else None
    if isinstance(value, list):
        return _conversation_problem(value)
    return (f"is {_short(value)} ({type(value).__name__}), not text or a list of {{role, content}} messages "
            f"(TRL's conversational form)")


def _conversation_problem(messages: list) -> str | None:
    if not messages:
        return "is an empty conversation (a list of no messages)"
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            return f"is a list whose item {i} is {_short(message)}, not a {{role, content}} message"
        role = message.get("role")
        if not isinstance(role, str) or not role:
            return f"holds a message without a role (message {i}: {_short(dict(message))})"
        if message.get("content") is None:
            return f"holds a message without content (message {i}, role {role!r})"
    last = messages[-1]["role"]
    if last not in LAST_ROLES:
        return (f"ends with a {last!r} message; the last message of a prompt is a user, tool or assistant turn "
                f"(TRL's apply_chat_template)")
    return None


def _short(value, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _check_rows(rows: Iterator, reader, limit: int, deadline: float, bad, judge) -> tuple[int, bool]:
    """Check `rows` ((position, value) pairs of `reader`) up to `limit` of them or the deadline;
    (rows read, whether `rows` ran out). A value judge() finds bad raises bad(reader, position, what)."""
    read = 0
    every = judge is not problem
    try:
        for position, value in rows:
            # Text with something in it is nearly every prompt: no call for it.
            if every or value.__class__ is not str or not value or value.isspace():
                found = judge(value)
                if found:
                    raise bad(reader, position, found)
            read += 1
            if read >= limit or (read % 1024 == 0 and time.monotonic() > deadline):
                return read, False
    except (OSError, UnicodeDecodeError):
        pass                            # a file that cannot be read on: the job's loader says so
    finally:
        rows.close()
    return read, True


# ---------------------------------------------------------------------------- one file's rows
def _reader(file: Path, column: str, where: str):
    """The reader for `file`'s format; None where there is nothing to read here (an unknown suffix,
    pyarrow missing for a binary format, a JSON document too big to parse, a saved dataset's arrow
    file without the column)."""
    try:
        if file.suffix == ".jsonl":
            return _JsonLines(file, column)
        if file.suffix == ".json":
            return _json_file(file, column)
        if file.suffix == ".csv":
            return _Csv(file, column)
        if file.suffix == ".parquet":
            return _parquet(file, column, where)
        if file.suffix == ".arrow":
            return _arrow(file, column)
    except (OSError, UnicodeDecodeError):
        return None                     # the column check (hpcrl.login.inputs) names an unreadable file
    return None


class _JsonLines:
    """A JSON lines file, read as bytes so that where the head stopped is known."""

    def __init__(self, file: Path, column: str):
        self.file, self.column = file, column
        self.offset = 0                 # the end of the last line head() gave

    def head(self) -> Iterator:
        with open(self.file, "rb") as f:
            for number, line in enumerate(f, 1):
                self.offset += len(line)
                row = _json_object(line)
                if row is not None:
                    yield number, row.get(self.column, MISSING)

    def spread(self, count: int) -> Iterator:
        """`count` rows at evenly spread offsets after the head: each the line after the offset."""
        end = self.file.stat().st_size
        last = -1
        with open(self.file, "rb") as f:
            for k in range(count):
                at = self.offset + (end - self.offset) * (2 * k + 1) // (2 * count)
                f.seek(max(at - 1, 0))
                if at > 0:
                    f.readline()        # the rest of the line holding byte at-1: the next one starts a row
                start = f.tell()
                line = f.readline()
                row = _json_object(line) if start != last else None
                last = start
                if row is not None:
                    yield ("byte", start), row.get(self.column, MISSING)

    def where(self, position) -> str:
        if isinstance(position, tuple):         # a sampled line's offset: its number, counted only now
            position = _line_number(self.file, position[1])
        return f"line {position}"


def _json_object(line: bytes) -> dict | None:
    """A JSON lines row; None for a blank line, and for one that is no JSON object (the job's loader
    names those)."""
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


def _line_number(file: Path, offset: int) -> int:
    lines = 1
    with open(file, "rb") as f:
        while offset > 0:
            chunk = f.read(min(offset, 1 << 20))
            if not chunk:
                break
            lines += chunk.count(b"\n")
            offset -= len(chunk)
    return lines


def _json_file(file: Path, column: str):
    """A .json file: a JSON array of rows or an object of columns, parsed whole up to
    WHOLE_JSON_MAX_BYTES; else JSON lines (datasets reads either)."""
    if file.stat().st_size > WHOLE_JSON_MAX_BYTES:
        with open(file, "rb") as f:
            return _JsonLines(file, column) if _json_object(f.readline()) is not None else None
    try:
        whole = json.loads(file.read_bytes())
    except ValueError:
        return _JsonLines(file, column)
    if isinstance(whole, list) and whole and isinstance(whole[0], dict):
        return _Table(file, len(whole), lambda a, b: [r.get(column, MISSING) if isinstance(r, dict) else MISSING
                                                     for r in whole[a:b]])
    if isinstance(whole, dict) and whole and all(isinstance(v, list) for v in whole.values()):
        # A column that is not there at all is missing from every row: the first one says so.
        values = whole[column] if column in whole else [MISSING] * min(1, len(next(iter(whole.values()))))
        return _Table(file, len(values), lambda a, b: values[a:b])
    return None


class _Csv:
    """A CSV file, as datasets' CSV builder (pandas) reads it; read in order only (see the module's
    docstring)."""

    def __init__(self, file: Path, column: str):
        self.file, self.column = file, column

    def head(self) -> Iterator:
        with open(self.file, newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            header = next(reader, None)
            if not header:
                return
            index = header.index(self.column) if self.column in header else None
            line = reader.line_num + 1
            for fields in reader:
                if fields:                      # pandas skips blank lines
                    if index is None:           # no such column: every row lacks it, the first one says so
                        yield line, MISSING
                        return
                    value = fields[index] if index < len(fields) else ""
                    yield line, _NaWord(value) if value and value in CSV_MISSING else value
                line = reader.line_num + 1

    def spread(self, count: int) -> Iterator:
        yield from ()

    def where(self, position) -> str:
        return f"line {position}"


class _NaWord(str):
    """A CSV field pandas reads as a missing value (its own class, so that the check looks at it)."""


class _Table:
    """A table's prompts by row index: `values(start, stop)` gives rows start..stop-1."""

    def __init__(self, file: Path, length: int, values):
        self.file, self.length, self.values = file, length, values
        self.next = 0                   # the row after the last head() gave

    def head(self) -> Iterator:
        for start in range(0, self.length, BATCH_ROWS):
            for row, value in enumerate(self.values(start, min(start + BATCH_ROWS, self.length)), start):
                self.next = row + 1
                yield row, value

    def spread(self, count: int) -> Iterator:
        left = self.length - self.next
        last = -1
        for k in range(count if left > 0 else 0):
            row = self.next + left * (2 * k + 1) // (2 * count)
            if row != last:
                last = row
                yield row, self.values(row, row + 1)[0]

    def where(self, position) -> str:
        return f"row {position} (0-based)"


def _parquet(file: Path, column: str, where: str) -> _Table | None:
    try:
        import pyarrow.parquet as pq      # not a login-side dependency: used when present
    except ImportError:
        return None
    try:
        parquet = pq.ParquetFile(file)
    except Exception as e:                # noqa: BLE001 - any unreadable file, in one line
        raise _unreadable_parquet(where, file, e) from None
    if column not in parquet.schema_arrow.names:
        return _Table(file, min(1, parquet.metadata.num_rows), lambda a, b: [MISSING] * (b - a))
    sizes = [parquet.metadata.row_group(g).num_rows for g in range(parquet.num_row_groups)]
    starts = [0, *itertools.accumulate(sizes)][:-1]
    held: dict[int, object] = {}         # the row group read last: its prompt column

    def values(start: int, stop: int) -> list:
        out = []
        while start < stop:
            group = bisect.bisect_right(starts, start) - 1
            if group not in held:
                held.clear()
                try:
                    held[group] = parquet.read_row_group(group, columns=[column]).column(0)
                except Exception as e:    # noqa: BLE001 - any unreadable file, in one line
                    raise _unreadable_parquet(where, file, e) from None
            end = min(stop, starts[group] + sizes[group])
            out += held[group].slice(start - starts[group], end - start).to_pylist()
            start = end
        return out

    return _Table(file, sum(sizes), values)


def _unreadable_parquet(where: str, file: Path, e: Exception) -> UserError:
    return UserError(f"{where}: {file}: not a readable parquet file "
                     f"({str(e).splitlines()[0] if str(e).strip() else type(e).__name__})")


def _arrow(file: Path, column: str) -> _Table | None:
    """A save_to_disk arrow file (an IPC stream), memory-mapped: only the rows asked for are read."""
    try:
        import pyarrow as pa              # not a login-side dependency: used when present
    except ImportError:
        return None
    try:
        table = pa.ipc.open_stream(pa.memory_map(str(file))).read_all()
    except Exception:                     # noqa: BLE001 - not this module's to explain: the job's loader does
        return None
    if column not in table.column_names:
        return None
    prompts = table.column(column)
    return _Table(file, len(prompts), lambda a, b: prompts.slice(a, b - a).to_pylist())
