"""Signals of a verb call: SIGTERM/SIGHUP as an exception, and a short hold for steps that are one.

``cli.main`` installs the handlers for the verb's lifetime (:func:`installed`): SIGTERM and SIGHUP
raise :class:`Terminated` (a KeyboardInterrupt, so every ``except KeyboardInterrupt`` clean-up path,
sweep workers and launcher process groups, runs for them too), SIGINT raises KeyboardInterrupt as
Python's own handler does. Inside :func:`held` a signal is only noted and raised on leaving: a
results directory is created and registered, or its marker closed, as one step (a signal between
``mkdir`` and the marker left an unmarked directory no clean-up knew of).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


class Terminated(KeyboardInterrupt):
    """SIGTERM/SIGHUP turned into an exception (exit code 128 + ``signum``)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_HOLD = {"depth": 0, "pending": 0}


def _raise(signum: int):
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Terminated(signum)


def _handler(signum, frame):
    if _HOLD["depth"]:
        _HOLD["pending"] = _HOLD["pending"] or signum
        return
    _raise(signum)


@contextmanager
def installed() -> Iterator[None]:
    """The handlers above for SIGTERM, SIGHUP and (where Python's default handles it) SIGINT; the
    previous ones restored on exit. Outside the main thread (a test's), nothing is installed."""
    old = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            if sig != signal.SIGINT or signal.getsignal(sig) is signal.default_int_handler:
                old[sig] = signal.signal(sig, _handler)
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@contextmanager
def held() -> Iterator[None]:
    """Inside, a signal the handlers above receive waits; it is raised on leaving the outermost
    ``held``. For short steps only (a mkdir and a small file)."""
    _HOLD["depth"] += 1
    try:
        yield
    finally:
        _HOLD["depth"] -= 1
        if not _HOLD["depth"] and _HOLD["pending"]:
            signum, _HOLD["pending"] = _HOLD["pending"], 0
            _raise(signum)
