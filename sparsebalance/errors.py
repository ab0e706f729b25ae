"""Errors users see, and the small checks that raise them.

Every bad-input path raises :class:`ConfigError` (a ``ValueError``) whose message names the field and
what is allowed; the CLI prints it on one line and exits with code 2. A failure of the machine rather
than of the input (a full disk, an unreadable file, memory) is a :class:`HostError`: one line, exit 1. Turning a TOML/JSON table into
a validated dataclass lives in :mod:`sparsebalance.configmap`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class ConfigError(ValueError):
    """Bad user input (config, file, argument). The message is shown as is, without a traceback."""


class HostError(Exception):
    """The environment failed, not the input: a full disk, a file the user may not read, an I/O error,
    memory. The message names the file or store; the CLI prints it on one line and exits with code 1
    (a retry elsewhere can succeed, where a bad input never will)."""


class MeaningWarning(UserWarning, RuntimeWarning):
    """A warning that changes what a result means (the profile is for another device, a latency is
    extrapolated, an op costs nothing): the CLI always shows it, where other warnings off a terminal
    are only counted. Both a UserWarning and a RuntimeWarning, the categories these warnings had
    before, so filters written for those still catch them."""


def check(cond: bool, field: str, message: str) -> None:
    """Raise ``ConfigError("<field>: <message>")`` unless ``cond``."""
    if not cond:
        raise ConfigError(f"{field}: {message}")


def check_choice(value: Any, field: str, allowed: Iterable[Any]) -> None:
    allowed = list(allowed)
    if value not in allowed:
        raise ConfigError(f"{field}: {value!r} is not allowed; choose one of {', '.join(map(str, allowed))}")


def check_positive(value: float, field: str, *, allow_zero: bool = False) -> None:
    ok = value >= 0 if allow_zero else value > 0
    bound = ">= 0" if allow_zero else "> 0"
    if not ok:
        raise ConfigError(f"{field}: must be {bound}, got {value!r}")


def check_finite(values: dict[str, Any], where: str) -> None:
    """Raise ``ConfigError`` if any value is NaN or infinite: a non-finite result is an error (usually
    inputs so large that sums overflow), never a number written to a table or to JSON."""
    import math

    for name, v in values.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        if not math.isfinite(v):
            raise ConfigError(f"{where}: {name} is {v!r}, not a finite number; the inputs overflow "
                              "(durations, bandwidths or latencies too large or too small)")
