"""The flags every verb shares and the rules behind them: one surface for all of ``sparsebalance``.

* ``--config FILE``: the verb's input config (a run config; the durations JSON for ``pipeline``).
* ``--out DIR`` and ``--force``: where results go. A results directory is never silently overwritten:
  an explicit ``--out`` that already holds files is refused unless ``--force``; the default directory
  (``results/<name>``...) gets a new timestamped sibling instead. ``--force`` replaces only a
  directory this tool wrote (it holds :data:`MARKER`), never someone else's files. The directory is
  created and probed for writing before any work starts.
* ``--progress`` / ``--no-progress``: progress bars; by default only when stderr is a terminal.
* ``-v`` / ``--verbose``: show warnings on non-terminal output too (see ``cli.py``).
* Old spellings (``--output``, ``--output-dir``, positional configs) still work for one release and
  print one deprecation line (:class:`DeprecatedAlias`).

Numbers are checked by argparse types (:func:`positive_int`, :func:`port`), so ``--iterations 0`` or
``--jobs 0`` is refused with one line before anything runs. Formats of every file: docs/formats.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from sparsebalance.errors import ConfigError

MARKER = ".sparsebalance.json"
"""Written into every results directory: which verb wrote it, when, and the package version."""
FORMATS_DOC = "docs/formats.md"
EPILOG = (f"Every file this verb reads or writes is described in {FORMATS_DOC} (in the source tree). "
          "Bad input exits with code 2 and one line naming the field.")
REMOVED_IN = "0.3"
"""Release that drops the deprecated spellings."""


# -- argparse value types -------------------------------------------------------------------------
def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    return _int_at_least(text, 1)


def nonneg_int(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _int_at_least(text, 0)


def _int_at_least(text: str, low: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    return value


def port(text: str) -> int:
    """argparse type: a TCP port 1..65535."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must lie in 1..65535, got {value}")
    return value


# -- deprecated spellings -------------------------------------------------------------------------
def deprecated(old: str, new: str) -> None:
    """One line on stderr: ``old`` still works but goes away in :data:`REMOVED_IN`."""
    print(f"sparsebalance: warning: {old} is deprecated and will be removed in {REMOVED_IN}; "
          f"use {new}", file=sys.stderr)


class DeprecatedAlias(argparse.Action):
    """An old option spelling: stores like the new one and prints a deprecation line."""

    def __init__(self, option_strings, dest, new: str = "", **kw):
        self.new = new
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        deprecated(option_string or self.option_strings[0], self.new)
        setattr(namespace, self.dest, values)


def take_positional_config(args: argparse.Namespace, positional: str = "config_positional") -> None:
    """Fold a deprecated positional config into ``args.config`` (an error when both are given)."""
    pos = getattr(args, positional, None)
    if pos is None:
        if args.config is None:
            raise ConfigError("--config: required (the input file)")
        return
    if args.config is not None and args.config != pos:
        raise ConfigError(f"--config: given twice ({args.config!r} and positional {pos!r}); keep --config")
    deprecated("a positional config file", "--config FILE")
    args.config = pos


# -- shared flags -----------------------------------------------------------------------------------
def add_config(p: argparse.ArgumentParser, *, required: bool = True, help: str = "run config (TOML or JSON)",
               positional: bool = False) -> None:
    """``--config FILE``; ``positional=True`` also accepts the old positional spelling."""
    p.add_argument("--config", metavar="FILE", default=None,
                   required=required and not positional, help=help)
    if positional:
        p.add_argument("config_positional", nargs="?", metavar="FILE", default=None,
                       help=f"deprecated spelling of --config FILE (removed in {REMOVED_IN})")


def add_out(p: argparse.ArgumentParser, default: str) -> None:
    """``--out DIR`` and ``--force``."""
    p.add_argument("--out", metavar="DIR", default=None,
                   help=f"results directory (default {default}); an existing one is refused "
                        "unless --force, a default one gets a timestamped sibling")
    p.add_argument("--force", action="store_true",
                   help="replace the results in --out (only a directory sparsebalance wrote)")


def add_output_flags(p: argparse.ArgumentParser) -> None:
    """``--progress``/``--no-progress`` and ``--verbose``."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--progress", dest="progress", action="store_true", default=None,
                   help="show progress bars (default: only when stderr is a terminal)")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="show warnings even when stderr is not a terminal")


def progress_enabled(args: argparse.Namespace) -> bool:
    """Progress bars on: asked for, or (not refused and) stderr is a terminal."""
    flag = getattr(args, "progress", None)
    if flag is not None:
        return bool(flag)
    return _isatty(sys.stderr)


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


# -- results directories --------------------------------------------------------------------------
def resolve_out(requested: str | None, default: str | Path, *, force: bool, verb: str,
                reuse=None, ours=None) -> Path:
    """The directory a verb writes, created, probed for writing and marked; before any work.

    ``requested`` is ``--out`` (None = ``default``). ``reuse(path) -> bool`` accepts an existing
    directory as is (a sweep resumes its own store); ``ours(path) -> bool`` recognises a directory
    this tool wrote before the marker existed. Raises ConfigError naming ``--out``."""
    path = Path(requested) if requested else Path(default)
    _check_parents(path)
    clear = False
    if path.exists() and any(path.iterdir()):
        if reuse is not None and reuse(path) and not force:
            pass
        elif force:
            if not ((path / MARKER).is_file() or (ours is not None and ours(path))):
                raise ConfigError(f"--out: {path} holds files sparsebalance did not write; "
                                  "refusing to replace them even with --force (choose another --out)")
            clear = True
        elif requested:
            raise ConfigError(f"--out: {path} already holds results; pass --force to replace them, "
                              "or leave --out out for a new timestamped directory")
        else:
            path = _timestamped(path)
            print(f"sparsebalance: {Path(default)} exists; writing to {path}", file=sys.stderr)
    try:
        path.mkdir(parents=True, exist_ok=True)
        if clear:
            _clear(path)
        fd, probe = tempfile.mkstemp(prefix=".probe.", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"--out: cannot write to {path}: {e.strerror or e}") from None
    from sparsebalance import __version__
    from sparsebalance.fsutil import atomic_write_json

    atomic_write_json(path / MARKER, {"verb": verb, "version": __version__,
                                      "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    return path


def _check_parents(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise ConfigError(f"--out: {path} exists and is not a directory")
    for parent in path.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"--out: {path}: {parent} is a file, not a directory")
            break


def _timestamped(path: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    cand = path.with_name(f"{path.name}-{stamp}")
    n = 2
    while cand.exists():
        cand = path.with_name(f"{path.name}-{stamp}-{n}")
        n += 1
    return cand


def _clear(path: Path) -> None:
    import shutil

    for child in path.iterdir():
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child)
        else:
            child.unlink()
