"""Config mapping: a TOML/JSON table -> a validated dataclass, and a dataclass -> a plain table.

:func:`from_mapping` names unknown keys and wrong types by their full path (``cluster.pp``) and lets
the dataclass's ``__post_init__`` validate values; :func:`to_dict` is its inverse for writing the
resolved config beside every result.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from sparsebalance.errors import ConfigError

T = TypeVar("T")
MAX_INT = 2**53 - 1
"""Largest integer a config field takes: exact as a float, far beyond any real count."""


def _short(value: int) -> str:
    """A huge integer for a message: ``1e+30``, or its digit count where even a float overflows."""
    try:
        return f"{value:.3g}"
    except OverflowError:
        return f"a {len(str(abs(value)))}-digit integer"


def _coerce(value: Any, tp: Any, field: str) -> Any:
    """Coerce a TOML/JSON scalar to the annotated type, or fail naming the field."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, field)
            except ConfigError as e:  # try the next member of the union
                errors.append(str(e))
        raise ConfigError(errors[0] if errors else f"{field}: bad value {value!r}")
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{field}: expected a list, got {type(value).__name__} {value!r}")
        args = typing.get_args(tp)
        inner = args[0] if args else Any
        items = [_coerce(v, inner, f"{field}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{field}: expected a table, got {type(value).__name__}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{field}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise ConfigError(f"{field}: expected an integer, got {value!r}")
        if abs(value) > MAX_INT:  # a count or size this large is a typo, and overflows numpy
            raise ConfigError(f"{field}: {_short(value)} is out of range (|value| <= 2^53 - 1)")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{field}: expected a number, got {value!r}")
        if not math.isfinite(value):  # inf would pass every "> 0" check and poison the run
            raise ConfigError(f"{field}: must be a finite number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{field}: expected a string, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{field}: expected a table, got {value!r}")
        return from_mapping(tp, value, field)
    return value


def from_mapping(cls: type[T], data: Mapping[str, Any], where: str = "") -> T:
    """Build dataclass ``cls`` from a mapping: unknown keys and wrong types are named in the error.

    Validation beyond types lives in the dataclass's ``__post_init__``; a ``ConfigError`` raised there
    gets ``where`` prefixed so the user sees the full path (``cluster.pp: must be > 0``).
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where or cls.__name__}: expected a table, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    prefix = f"{where}." if where else ""
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{prefix}{unknown[0]}: unknown field; allowed fields are {', '.join(sorted(fields))}"
        )
    kwargs = {name: _coerce(v, hints[name], prefix + name) for name, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as e:
        msg = str(e)
        raise ConfigError(prefix + msg if where and not msg.startswith(prefix) else msg) from None
    except TypeError as e:  # missing required field
        raise ConfigError(f"{where or cls.__name__}: {e}") from None


def to_dict(obj: Any) -> Any:
    """Dataclass → plain dict for TOML/JSON (drops None values, which TOML cannot hold)."""
    if dataclasses.is_dataclass(obj):
        out = {}
        for f in dataclasses.fields(obj):
            v = to_dict(getattr(obj, f.name))
            if v is not None:
                out[f.name] = v
        return out
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items() if v is not None}
    return obj
