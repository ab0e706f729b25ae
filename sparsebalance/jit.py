"""Optional compiled loops (numba), imported only when a caller asks for one.

A few hot loops (the timing core's recurrence over a few hundred candidate orders, LPT over
thousands of sequences) are Python or numpy elsewhere and compiled here, with the same arithmetic
in the same order, so both give the same numbers bit for bit (tests hold each pair equal). numba
is a declared dependency; where it cannot be imported (a machine that installs only what it needs,
such as a lent GPU box) :meth:`Compiled.get` returns None and callers keep their plain path.
Compiled code is cached on disk by numba (compiled once per machine, about a second; later
processes load it in ~0.1 s plus numba's import), so callers take this path only for work large
enough to repay the first load (:meth:`Compiled.loaded` tells them when it is already paid).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any


class Compiled:
    """A function compiled with ``numba.njit(cache=True)`` on first :meth:`get`."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn
        self._done = False
        self._compiled: Callable[..., Any] | None = None
        functools.update_wrapper(self, fn)

    def get(self) -> Callable[..., Any] | None:
        """The compiled function, or None where numba is missing."""
        if not self._done:
            self._done = True
            try:
                import numba
            except ImportError:
                return None
            self._compiled = numba.njit(cache=True, nogil=True)(self._fn)
        return self._compiled

    @property
    def loaded(self) -> bool:
        """Whether :meth:`get` has run (numba imported, or found missing): no first-load cost left."""
        return self._done


def compiled(fn: Callable[..., Any]) -> Compiled:
    """Decorator: ``fn`` (numba-compatible Python) compiled lazily, see :class:`Compiled`."""
    return Compiled(fn)
