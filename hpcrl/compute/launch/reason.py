"""A failed task's reason in one line: the text the hub passes on, failure.txt keeps and the
console's last line and `hpcrl status` show.

An exception's type and headline often do not say why: pydantic's "1 validation error for
ModelConfig" leaves the reason to the lines below it, vLLM's "Engine core initialization failed.
See root cause above." points at another process's log, and `raise X from Y` may put the cause in
Y. `explain` picks the exception of the chain that says why and the line of it that does;
`root_cause` does the same for the tracebacks in a log (vLLM's engine core reports its own error
only so).
"""

from __future__ import annotations

import itertools
import os
import re

LIMIT = 300
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep
# Messages that only point elsewhere for the reason (vLLM's engine-core and worker wrappers).
_WRAPPER = re.compile(r"see (the )?(stack trace|root cause)|root cause above|for (the )?root cause", re.I)
_WRAPPER_TYPES = {"EngineDeadError"}
_VALIDATION_HEADLINE = re.compile(r"^\d+ validation errors? for (\S+)$")
_PYDANTIC_TAIL = re.compile(r"\s*\[type=[^\]]*(\]|$)")
_EXCEPTION_NAME = re.compile(r"^[A-Za-z_][\w.]*$")
_TRACEBACK = "Traceback (most recent call last):"


class Explained(RuntimeError):
    """An error whose message is already the reason (no type name is put before it)."""


def explain(e: BaseException, limit: int = LIMIT) -> str:
    """The line that says why `e` happened, at most `limit` characters."""
    return _trim(_describe(_why(e)), limit)


def points_elsewhere(e: BaseException) -> bool:
    """Whether `e` itself only points at another place for its reason (a log, "see root cause above")."""
    return type(e).__name__ in _WRAPPER_TYPES or bool(_WRAPPER.search(str(e)))


def only_points_elsewhere(e: BaseException) -> bool:
    """Whether `e` names no cause of its own and points at another's ("server refused
    weights_start: EngineDeadError: see the stack trace above"): the echo of a failure elsewhere,
    whose own reason is on its way from there. An error that is merely terse (a KeyboardInterrupt,
    an empty TimeoutError) is no echo."""
    chain = _chain(e)
    return any(points_elsewhere(c) for c in chain) and all(_says_nothing(c) for c in chain)


def _says_nothing(e: BaseException) -> bool:
    return not str(e).strip() or points_elsewhere(e)


def _chain(e: BaseException) -> list[BaseException]:
    """`e` and its causes, outermost first. An implicit context ("during handling of ...") is
    followed only from an error that says nothing itself: otherwise it is the error being
    handled, which the newer one usually explains."""
    chain: list[BaseException] = []
    while e is not None and all(e is not c for c in chain):
        chain.append(e)
        nxt = e.__cause__
        if nxt is None and not e.__suppress_context__ and _says_nothing(e):
            nxt = e.__context__
        e = nxt
    return chain


def _why(e: BaseException) -> BaseException:
    """The innermost exception that says why, unless an outer one already quotes it (its own
    words add where: `raise RuntimeError(f"loading {path}: {e}") from e`) or hpcrl raised it: a
    message of ours names the field at fault and the cause, where the library's says neither."""
    told = [c for c in _chain(e) if not _says_nothing(c)]
    if not told:
        return e
    for outer, inner in zip(told, told[1:]):
        if _first_line(str(inner)) in str(outer) or _raised_by_hpcrl(outer):
            return outer
    return told[-1]


def _raised_by_hpcrl(e: BaseException) -> bool:
    tb = e.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    return os.path.abspath(tb.tb_frame.f_code.co_filename).startswith(_PACKAGE)


def _describe(e: BaseException) -> str:
    if isinstance(e, KeyboardInterrupt):
        return "interrupted (SIGINT: Ctrl-C, or the launcher passing on a stop)"
    if isinstance(e, Explained):
        return _first_line(str(e))
    if _is_validation_error(e):
        try:
            errors = e.errors(include_url=False)
        except TypeError:
            errors = e.errors()
        parts = []
        for err in errors:
            loc = ".".join(str(p) for p in err.get("loc", ()))
            parts.append(f"{loc}: {err.get('msg', '')}" if loc else str(err.get("msg", "")))
        return f"{e.title}: {'; '.join(parts)}" if parts else _first_line(str(e))
    text = _first_line(str(e))
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _is_validation_error(e: BaseException) -> bool:
    # By shape, not import: pydantic (v2's pydantic_core) is the engine's, not a dependency of ours.
    return type(e).__name__ == "ValidationError" and callable(getattr(e, "errors", None)) and hasattr(e, "title")


def _first_line(text: str) -> str:
    """The first line of a message that says something; for pydantic's text, the error under its
    headline ("ModelConfig: Value error, ...")."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return ""
    m = _VALIDATION_HEADLINE.match(lines[0].split(": ", 1)[-1])
    if m and len(lines) > 1:
        detail = lines[1]
        if len(lines) > 2 and " " not in detail:      # a field's error: its location, then the message
            detail = f"{detail}: {lines[2]}"
        return f"{m.group(1)}: {_PYDANTIC_TAIL.split(detail)[0]}"
    return lines[0]


def _trim(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3].rstrip() + "..."


def root_cause(log: str, limit: int = LIMIT) -> str | None:
    """The last error of the tracebacks in `log` that says why (a wrapper's "see root cause
    above" is passed over for the error it points at), worded as `explain` words it; None if none.
    A traceback may have a prefix on each of its lines (vLLM's "(EngineCore pid=1) ERROR ... "):
    the lines with its headline's prefix are its own, others interleaved with them are not."""
    found = None
    lines = log.splitlines()
    for i, line in enumerate(lines):
        at = line.find(_TRACEBACK)
        if at < 0 or line[at:].strip() != _TRACEBACK:
            continue
        prefix = line[:at]
        own = (rest[at:] for rest in itertools.islice(lines, i + 1, None) if rest.startswith(prefix))
        message = []
        for rest in itertools.dropwhile(lambda r: not r.strip() or r.startswith(" "), own):   # past the frames
            if not rest.strip() or rest.startswith((_TRACEBACK, "The above exception", "During handling of")):
                break
            message.append(rest)
        if not message:
            continue
        name, _, text = message[0].partition(": ")
        if not _EXCEPTION_NAME.match(name):
            continue                                   # cut short: another process's line follows
        name = name.rsplit(".", 1)[-1]
        if _WRAPPER.search(text) or name in _WRAPPER_TYPES:
            continue
        first = _first_line("\n".join([text, *message[1:]]))
        found = first if _VALIDATION_HEADLINE.match(text.strip()) else (f"{name}: {first}" if first else name)
    return None if found is None else _trim(found, limit)
