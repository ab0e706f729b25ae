"""Reading the files users give (configs, grids, durations, JSONL rows, checkpoint sidecars): every way
a file can be unreadable becomes one line naming the field and the file.

Bad bytes are bad input (:class:`ConfigError`, exit 2): text that is not UTF-8 (UTF-16, binary),
invalid JSON or TOML, a number of more digits than Python reads (``sys.get_int_max_str_digits``),
brackets nested deeper than the parser's recursion allows. A file the machine will not give us
(permissions, an I/O error, no memory for it) is the environment's fault (:class:`HostError`, exit 1).
Imports nothing heavy: used by the config loader, which ``--help`` paths import.
"""

from __future__ import annotations

import errno
import json
import sys
from pathlib import Path
from typing import Any

from sparsebalance.errors import ConfigError, HostError

#: A path the user named wrongly is bad input; any other OSError is the machine's.
_INPUT_ERRNOS = {errno.ENOENT, errno.EISDIR, errno.ENOTDIR, errno.ENAMETOOLONG, errno.ELOOP}


def read_text(path: str | Path, field: str) -> str:
    """``path``'s text (UTF-8, a leading byte-order mark dropped), or one line naming ``field``."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except MemoryError:
        raise HostError(f"{field}: not enough memory to read {path}") from None
    except OSError as e:
        raise os_error(e, field, f"cannot read {path}") from None
    return decode(data, f"{field}: {path}")


def decode(data: bytes, where: str) -> str:
    """UTF-8 text of ``data``; otherwise ConfigError saying what the bytes look like."""
    try:
        return data.decode("utf-8-sig")  # a UTF-8 BOM (some editors write one) is harmless
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where} is not UTF-8 text: {_what_bytes(data, e)}; save it as UTF-8") from None


def _what_bytes(data: bytes, e: UnicodeDecodeError) -> str:
    if data[:2] in (b"\xff\xfe", b"\xfe\xff"):
        return "it starts with a UTF-16 byte-order mark"
    if len(data) > 1 and b"\x00" in data[:64] and data[:64].count(b"\x00") * 3 >= min(len(data), 64):
        return "every other byte is 0 (UTF-16 without a byte-order mark?)"
    return f"byte 0x{data[e.start]:02x} at offset {e.start} is not UTF-8 (a binary file?)"


def parse_json(text: str, where: str) -> Any:
    """``json.loads(text)`` or ConfigError ``"<where> is not valid JSON: ..."``."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where} is not valid JSON: line {e.lineno}, column {e.colno}: {e.msg}") from None
    except (ValueError, RecursionError, MemoryError) as e:
        raise _parse_limit(e, where) from None


def parse_toml(text: str, where: str) -> dict[str, Any]:
    """``tomllib.loads(text)`` or ConfigError ``"<where> is not valid TOML: ..."``."""
    import tomllib

    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{where} is not valid TOML: {e}") from None
    except (ValueError, RecursionError, MemoryError) as e:
        raise _parse_limit(e, where) from None


def _parse_limit(e: BaseException, where: str) -> Exception:
    """What a parser hitting one of Python's limits means, as one line with the limit stated."""
    if isinstance(e, RecursionError):
        return ConfigError(f"{where}: brackets nested too deep to read (the limit is about "
                           f"{sys.getrecursionlimit()} levels)")
    if isinstance(e, MemoryError):
        return HostError(f"{where}: not enough memory to parse it")
    if "digits" in str(e):  # CPython's int-from-string limit (CVE-2020-10735)
        return ConfigError(f"{where}: a number has more than {sys.get_int_max_str_digits():,} digits")
    return ConfigError(f"{where} cannot be read: {e}")


def load_json(path: str | Path, field: str) -> Any:
    return parse_json(read_text(path, field), f"{field}: {path}")


def load_toml(path: str | Path, field: str) -> dict[str, Any]:
    return parse_toml(read_text(path, field), f"{field}: {path}")


def load_config_file(path: str | Path, field: str) -> Any:
    """A config in JSON (``.json``) or TOML (anything else)."""
    return (load_json if Path(path).suffix == ".json" else load_toml)(path, field)


def os_error(e: OSError, field: str, doing: str) -> Exception:
    """ConfigError for a path the user named wrongly, HostError for what the machine refused."""
    cls = ConfigError if e.errno in _INPUT_ERRNOS else HostError
    return cls(f"{field}: {doing}: {e.strerror or e}")
