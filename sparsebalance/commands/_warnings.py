"""Warnings by weight: what every verb does with the two kinds the package emits (docs/reliability.md).

* a :class:`~sparsebalance.errors.MeaningWarning` changes what a result means (another device's
  profile, a latency extrapolated past the profile, a plan over the device's memory...): printed on
  stderr whatever stderr is, written into the results' ``summary.json`` (``warnings``), and under
  ``--strict`` an error (exit 2) at the point it is raised, before the result it would qualify is
  written;
* anything else (a :class:`~sparsebalance.errors.NoteWarning`, or a library's warning) is a note: one
  line each on a terminal (or with ``-v``), otherwise counted in one line at the end.

Lines are deduplicated by their text. :func:`captured` lets a sweep's run carry its own warnings in
its record (``sweep_exec.run_point``), so the coordinator shows, stores and judges them the same way
whichever backend ran it.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from sparsebalance.errors import MeaningWarning

SUMMARY = "summary.json"
"""The results file whose ``warnings`` key lists the meaning warnings of the call that wrote it."""


@dataclass(slots=True)
class Seen:
    """The warnings of one verb call, first lines in the order they came."""

    meaning: list[str] = field(default_factory=list)
    """MeaningWarnings (shown, recorded in summary.json)."""
    hidden: list[str] = field(default_factory=list)
    """Notes not shown (stderr not a terminal, no -v)."""
    shown: list[str] = field(default_factory=list)
    """Notes shown."""


_CURRENT: list[Seen] = []


def text_of(message, category: type[Warning]) -> str:
    """A warning's first line (what is printed and recorded)."""
    return (str(message).strip().splitlines() or [category.__name__])[0]


@contextmanager
def handling(*, loud: bool, strict: bool) -> Iterator[Seen]:
    """Inside: meaning warnings printed (every distinct one) and collected, or raised (``strict``);
    notes printed when ``loud``, else counted. Every occurrence reaches the handler (no once-per-place
    filtering): a sweep's runs each report theirs."""
    seen = Seen()

    def show(message, category, filename, lineno, file=None, line=None):
        text = text_of(message, category)
        if issubclass(category, MeaningWarning):
            if text not in seen.meaning:
                seen.meaning.append(text)
                print(f"sparsebalance: warning: {text}", file=sys.stderr)
        elif text not in seen.hidden and text not in seen.shown:
            (seen.shown if loud else seen.hidden).append(text)
            if loud:
                print(f"sparsebalance: warning: {text}", file=sys.stderr)

    with warnings.catch_warnings():
        warnings.simplefilter("error" if strict else "always", MeaningWarning)
        warnings.showwarning = show
        _CURRENT.append(seen)
        try:
            yield seen
        finally:
            _CURRENT.remove(seen)


def meaning_warnings() -> list[str]:
    """The meaning warnings the running verb has emitted so far (for a verb writing its own
    ``summary.json`` before it returns; the CLI adds any that come later)."""
    return list(_CURRENT[-1].meaning) if _CURRENT else []


@contextmanager
def captured() -> Iterator[list[str]]:
    """Inside: meaning warnings are recorded into the yielded list (each distinct text once), neither
    shown nor raised, so that the caller hands them on with its result; other warnings pass to the
    handler in force."""
    texts: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("always", MeaningWarning)
        outer = warnings.showwarning

        def show(message, category, *rest, **kw):
            if issubclass(category, MeaningWarning):
                text = text_of(message, category)
                if text not in texts:
                    texts.append(text)
            else:
                outer(message, category, *rest, **kw)

        warnings.showwarning = show
        yield texts


def record(dirs: list[Path], texts: list[str]) -> None:
    """Write ``texts`` as ``warnings`` into each directory's ``summary.json``: merged into the one the
    verb wrote (the key added even when there are none, so its readers always find it), created
    holding only them where the verb wrote none and there are some."""
    import json

    from sparsebalance.fsutil import atomic_write_json

    for d in dirs:
        path = d / SUMMARY
        data = {}
        if path.is_file():
            try:
                data = json.loads(path.read_text())
            except (OSError, ValueError):
                continue  # not ours to rewrite
            if not isinstance(data, dict):
                continue
        elif not texts:
            continue
        have = [w for w in data.get("warnings", []) if isinstance(w, str)]
        data["warnings"] = have + [t for t in texts if t not in have]
        atomic_write_json(path, data, indent=2, default=str)
