"""Optional compiled loops (numba), loaded only when a large decision asks for them.

A few hot loops (the timing core's recurrences over a few hundred candidate orders, LPT over
thousands of sequences) are Python or numpy elsewhere and compiled here, with the same arithmetic
in the same order, so both give the same numbers bit for bit (tests hold each pair equal).

**When.** Loading costs about 0.5 s per process on the project's VM (numba's import, then its
on-disk cache; the first process on a machine also compiles, about 1 s more), which pays only when
many large decisions follow. So nothing loads by itself: a policy about to take a large decision
calls :func:`warm` (SAB from 2,048 sequences per global batch, ``dst-cp`` from 256 micro-batches),
and from then on :func:`loaded` tells the hot paths to take their compiled form. A small run, the
executor alone, or a machine without numba (a lent GPU box installs only what it needs) keep the
plain paths: same numbers, slower.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

_REGISTRY: list[Compiled] = []
_STATE = {"tried": False, "ok": False}


class Compiled:
    """A function compiled with ``numba.njit(cache=True)`` when :func:`warm` loads the registry."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._fn = fn
        self._compiled: Callable[..., Any] | None = None
        functools.update_wrapper(self, fn)
        _REGISTRY.append(self)

    def get(self) -> Callable[..., Any]:
        """The compiled function (loads the registry first if needed); raises ImportError where
        numba is missing (check :func:`loaded` or :func:`available` before calling)."""
        if self._compiled is None:
            if not _load():
                raise ImportError("numba is not installed: use the plain path")
            self._compiled = _njit(self._fn)
        return self._compiled


def compiled(fn: Callable[..., Any]) -> Compiled:
    """Decorator: ``fn`` (numba-compatible Python) compiled when loaded, see :class:`Compiled`."""
    return Compiled(fn)


def _njit(fn):
    import numba

    return numba.njit(cache=True, nogil=True)(fn)


def _load() -> bool:
    if not _STATE["tried"]:
        _STATE["tried"] = True
        try:
            import numba  # noqa: F401
        except ImportError:
            return False
        _STATE["ok"] = True
    return _STATE["ok"]


def warm(needed: bool = True) -> bool:
    """Load the compiled loops when ``needed`` (a large decision ahead); returns :func:`loaded`."""
    if needed and not _STATE["tried"]:
        _load()
    return _STATE["ok"]


def loaded() -> bool:
    """Whether the compiled loops are loaded (and hot paths should take them)."""
    return _STATE["ok"]


def available() -> bool:
    """Whether numba can be imported here (loads it: for tests and the check of a machine)."""
    return _load()
