"""The flags every verb shares and the rules behind them: one surface for all of ``sparsebalance``.

* ``--config FILE``: the verb's input config (a run config; the durations JSON for ``pipeline``).
* ``--out DIR`` and ``--force``: where results go. A results directory is never silently overwritten:
  an explicit ``--out`` that already holds files is refused unless ``--force``; the default directory
  (``results/<name>``...) gets a new timestamped sibling instead. ``--force`` replaces only a
  directory this tool wrote for that path (its :data:`MARKER` names it), never someone else's files,
  and never one another sparsebalance process holds locked. ``--out`` is always a directory of its
  own (never ``""``, ``.``, ``..``, the working directory, its parents, home or ``/``). The
  directory is created, locked and probed for writing before any work starts.
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
def comma_list(text: str, flag: str, conv=str, *, what: str = "values", unique: bool = True,
               allowed=None) -> list:
    """``"a,b,c"`` -> ``[conv("a"), conv("b"), conv("c")]``, or one line naming ``flag`` when the
    text holds no item (``--seeds ,,``), an empty one (a stray comma), a value ``conv`` cannot read,
    (``unique``) the same value twice, or a value not in ``allowed`` (when given): never an empty
    list that runs nothing, or a silent fallback to a default."""
    items = [t.strip() for t in str(text).split(",")]
    if not any(items):
        raise ConfigError(f"{flag}: no {what} in {text!r}; give one or more, comma-separated")
    if "" in items:
        raise ConfigError(f"{flag}: an empty item in {text!r} (a stray comma?); give comma-separated {what}")
    try:
        vals = [conv(t) for t in items]
    except (ValueError, TypeError, OverflowError):
        raise ConfigError(f"{flag}: cannot read {text!r} as comma-separated {what}") from None
    if unique:
        dup = next((v for i, v in enumerate(vals) if v in vals[:i]), None)
        if dup is not None:
            raise ConfigError(f"{flag}: {dup!r} is given twice in {text!r}; give each once")
    bad = [v for v in vals if allowed is not None and v not in allowed]
    if bad:
        raise ConfigError(f"{flag}: {', '.join(map(str, bad))}: choose from {', '.join(map(str, allowed))}")
    return vals


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


def add_launch_flags(p: argparse.ArgumentParser, *, example: str) -> None:
    """The flags of the verbs that launch the real run under torchrun (train, validate): config
    overrides, a profile whose latency falls as work grows, the rendezvous port. ``example``: a
    ``--set`` override shown in the help."""
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help=f"override a config value, e.g. --set {example} (repeatable)")
    p.add_argument("--allow-nonmonotone", action="store_true",
                   help="use a profile whose latency falls as work grows (a warning lists the points)")
    p.add_argument("--master-port", type=port, default=None,
                   help="rendezvous port on localhost (default: a free one)")


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
def check_out(requested: str | None, default: str | Path, *, force: bool, ours=None) -> None:
    """:func:`resolve_out`'s refusals without touching the disk, for a verb to call before slow
    checks of its own (``simulate``'s calibration probe): a bad ``--out`` then costs nothing.
    ``resolve_out`` decides again when it creates the directory."""
    path = _out_path(requested, default)
    if not path.exists() or not any(path.iterdir()):
        return
    if _marker_for(path) is True and (_read_marker(path) or {}).get("complete") is False:
        return  # an unfinished run of ours: replaced
    if force:
        _refuse_foreign(path, ours)
    elif requested:
        raise _holds_results(path)


def _out_path(requested: str | None, default: str | Path) -> Path:
    """``--out`` (None: ``default``) as a path, refused when it is empty or not a directory of its own."""
    if requested is not None and not str(requested).strip():
        raise ConfigError("--out: empty path (an unset shell variable?); name a directory of its own")
    path = Path(requested) if requested else Path(default)
    _refuse_shared(path)
    _check_parents(path)
    return path


def _refuse_foreign(path: Path, ours) -> None:
    """``--force`` clears only a directory whose marker was written for it (or that ``ours`` knows)."""
    mine = _marker_for(path)
    if mine is False or (mine is None and not (ours is not None and ours(path))):
        why = ("its results marker was written for another directory" if mine is False
               else "it holds files sparsebalance did not write")
        raise ConfigError(f"--out: {path}: {why}; refusing to replace them even with --force "
                          "(choose another --out)")


def _holds_results(path: Path) -> ConfigError:
    return ConfigError(f"--out: {path} already holds results; pass --force to replace them, "
                       "or leave --out out for a new timestamped directory")


def resolve_out(requested: str | None, default: str | Path, *, force: bool, verb: str,
                reuse=None, ours=None) -> Path:
    """The directory a verb writes, created, probed for writing, locked and marked; before any work.

    ``requested`` is ``--out`` (None = ``default``). ``reuse(path) -> bool`` accepts an existing
    directory as is (a sweep resumes its own store); ``ours(path) -> bool`` recognises a directory
    this tool wrote before the marker existed. Raises ConfigError naming ``--out``.

    A results directory is always a directory of its own: a path that is empty (an unset shell
    variable), ends in ``.`` or ``..``, or resolves to the working directory, one of its parents,
    the home directory or the root is refused. Before anything is cleared the directory is locked
    (``flock`` on the directory itself, held until the verb ends), so ``--force`` never clears a
    directory another sparsebalance process is writing; and ``--force`` clears only a directory whose
    marker was written for that very directory (a marker copied elsewhere does not count)."""
    path = _out_path(requested, default)
    clear = False
    fresh = not path.exists() or not any(path.iterdir())
    if not fresh:
        if reuse is not None and reuse(path) and not force:
            _lock(path)
        elif _marker_for(path) is True and (_read_marker(path) or {}).get("complete") is False:
            _lock(path)  # a run of ours that did not finish (failed, killed): its files are no result
            print(f"sparsebalance: {path} holds the files of a run that did not finish; replacing them",
                  file=sys.stderr)
            clear = True
        elif force:
            _lock(path)
            _refuse_foreign(path, ours)
            clear = True
        elif requested:
            raise _holds_results(path)
        else:
            path = _timestamped(path)
            print(f"sparsebalance: {Path(default)} exists; writing to {path}", file=sys.stderr)
    from sparsebalance import __version__
    from sparsebalance.commands._signals import held
    from sparsebalance.fsutil import atomic_write_json

    with held():  # created, marked and registered as one step: a signal waits until it is known
        try:
            path.mkdir(parents=True, exist_ok=True)
            _lock(path)
            if clear:
                _clear(path)
            fd, probe = tempfile.mkstemp(prefix=".probe.", dir=path)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            if fresh and path.is_dir() and not any(path.iterdir()):
                path.rmdir()
            raise _out_error(e, path) from None
        try:
            atomic_write_json(path / MARKER, {"verb": verb, "version": __version__, "path": str(path.resolve()),
                                              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "complete": False})
        except OSError as e:  # the disk filled between the probe and the marker: leave no empty directory
            if fresh and not any(path.iterdir()):
                path.rmdir()
            raise _out_error(e, path) from None
        _OPENED.append((path, fresh))
    return path


#: Results directories this verb opened: (path, whether it was new or empty). ``cli.main`` closes
#: them with :func:`finish_outputs` when the verb ends.
_OPENED: list[tuple[Path, bool]] = []


def _out_error(e: OSError, path: Path) -> Exception:
    """A path that cannot hold results is bad input (exit 2); a disk that is full or failing is the
    machine's (HostError, exit 1): the same --out works once there is room."""
    import errno

    from sparsebalance.errors import HostError

    cls = HostError if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO) else ConfigError
    return cls(f"--out: cannot write to {path}: {e.strerror or e}")


def open_outputs() -> list[Path]:
    """The results directories the running verb has open (an error naming no file names these)."""
    return [path for path, _ in _OPENED]


def finish_outputs(ok: bool) -> list[Path]:
    """Close the results directories of the verb that just ended. ``ok`` (it returned): the marker
    says complete. Otherwise (an error, a signal) a directory it created and left with nothing but
    the marker is removed; one holding files keeps ``"complete": false``, so it is never taken for a
    result and the next run replaces it without ``--force``. Returns those kept incomplete. A signal
    arriving meanwhile waits until all are closed."""
    from sparsebalance.commands._signals import held
    from sparsebalance.fsutil import atomic_write_json

    kept = []
    with held():
        while _OPENED:
            path, fresh = _OPENED.pop()
            data = _read_marker(path)
            if data is None:
                continue
            try:
                if ok:
                    atomic_write_json(path / MARKER, {**data, "complete": True,
                                                      "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
                elif fresh and {p.name for p in path.iterdir()} <= {MARKER}:
                    (path / MARKER).unlink()
                    path.rmdir()
                else:
                    kept.append(path)
            except OSError:  # a full disk or a vanished directory: the marker keeps saying incomplete
                kept.append(path)
        while _LOCKS:  # the verb is over: its directories are free (a removed one must not stay "held")
            os.close(_LOCKS.popitem()[1])
    return kept


def _refuse_shared(path: Path) -> None:
    """A results directory is a child of its own, never a directory the user works in."""
    if path.name in ("", ".", ".."):
        raise ConfigError(f"--out: {str(path)!r} must name a directory of its own, not '.', '..' or '/'")
    resolved, cwd = path.resolve(), Path.cwd().resolve()
    shared = {cwd, *cwd.parents, Path(resolved.anchor)}
    try:
        shared.add(Path.home().resolve())
    except RuntimeError:  # no home directory known
        pass
    if resolved in shared:
        raise ConfigError(f"--out: {path} resolves to {resolved}, the working directory, one of its parents, "
                          "the home directory or the root; results go into a directory of their own")


#: Directories the running verb holds locked (resolved path -> open descriptor), released by
#: :func:`finish_outputs` when it ends (and by the kernel if the process dies).
_LOCKS: dict[Path, int] = {}


def _lock(path: Path) -> None:
    """Lock ``path`` for this process (exclusive ``flock`` on the directory) or refuse in one line."""
    import fcntl

    key = path.resolve()
    if key in _LOCKS:
        return
    fd = os.open(key, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        holder = _marker_verb(path) or "sparsebalance process"
        raise ConfigError(f"--out: another {holder} is writing to {path}; wait for it or choose another "
                          "--out") from None
    _LOCKS[key] = fd


def _read_marker(path: Path) -> dict | None:
    import json

    try:
        data = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _marker_verb(path: Path) -> str | None:
    verb = (_read_marker(path) or {}).get("verb")
    return verb if isinstance(verb, str) else None


def _marker_for(path: Path) -> bool | None:
    """True: a marker written for this directory (or, older, one that names none); False: a marker
    naming another directory (copied or moved here); None: no readable marker."""
    data = _read_marker(path)
    if data is None:
        return None
    where = data.get("path")
    return where is None or Path(str(where)) == path.resolve()


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
