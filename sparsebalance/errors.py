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
    """A warning that changes what a result means (the profile is another device's or another model's,
    a latency extrapolated past the profile, an op with no rows costing 0 s, a plan that does not fit
    in the device's memory). The CLI prints it whatever stderr is, writes it into the results'
    ``summary.json`` (``warnings``), and ``--strict`` makes it an error (exit 2). Both a UserWarning and
    a RuntimeWarning, the categories these warnings had before, so filters written for those still
    catch them. Every warning the package emits is this or a :class:`NoteWarning`
    (docs/reliability.md lists them)."""


class NoteWarning(UserWarning, RuntimeWarning):
    """A warning safe to hide from a script: the result means what it says (an accepted, documented
    approximation). Off a terminal the CLI counts it in one line; ``-v`` shows it. Both categories
    too, as :class:`MeaningWarning`."""


def is_meaning(category: type[Warning]) -> bool:
    """Whether warnings of ``category`` change what a result means (see :class:`MeaningWarning`)."""
    return issubclass(category, MeaningWarning)


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
