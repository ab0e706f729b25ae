"""Files that a kill cannot leave half-written: write a temporary sibling, fsync, rename over.

``os.replace`` is atomic on POSIX within one file system, so a reader (or the next run) sees either
the old complete file or the new complete file, never a truncated one. The temporary name starts
with ``.`` and ends with ``.tmp`` so globs over results skip it; a kill between write and rename
leaves only such a file behind. Imports no part of the package (usable from anywhere).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def _umask() -> int:
    old = os.umask(0o022)
    os.umask(old)
    return old


_MODE = 0o666 & ~_umask()
"""Mode of new files as ``open()`` would give them (mkstemp's 0600 would hide results from others)."""


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (temporary sibling, fsync, rename)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), _MODE)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)  # nothing half-written stays behind
        except FileNotFoundError:
            pass
        if isinstance(e, OSError) and e.filename is None:  # a full disk: say which file it hit
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode())


def atomic_write_json(path: str | Path, obj: Any, **kw) -> Path:
    """JSON without NaN/Infinity (``allow_nan=False``): a non-finite value is an error, not a file
    other JSON readers reject."""
    return atomic_write_text(path, json.dumps(obj, allow_nan=False, **kw) + "\n")


def atomic_to_csv(df, path: str | Path, **kw) -> Path:
    """``df.to_csv(path, index=False)`` through a temporary sibling and a rename."""
    kw.setdefault("index", False)
    return atomic_write_text(path, df.to_csv(**kw))


def atomic_savefig(fig, path: str | Path, **kw) -> Path:
    """``fig.savefig(path, **kw)`` rendered in memory, then written atomically (a kill while
    matplotlib writes leaves no truncated PNG/SVG); the format follows the suffix."""
    import io

    path = Path(path)
    buf = io.BytesIO()
    fig.savefig(buf, format=path.suffix.lstrip(".") or None, **kw)
    return atomic_write_bytes(path, buf.getvalue())
