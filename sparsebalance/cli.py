"""``sparsebalance <verb>``: the one console script. The only module that knows every part.

Each verb lives in ``sparsebalance/commands/<verb>.py`` with ``add_arguments(parser)`` and
``run(args) -> int``; they are imported lazily so ``--help`` and the simulator never import torch.
The shared flags (``--config``, ``--out``, ``--force``, ``--progress``, ``--verbose``) and their
rules are in ``commands/_args.py``; file formats in docs/formats.md.

Exit codes: 0 done; 2 bad input (``ConfigError`` or a usage error: one line naming the field, never a
traceback); 1 the environment (``HostError``, or an ``OSError`` such as a full disk or an unreadable
file, SQLite's "database or disk is full", memory: one line naming the file); 130 interrupted (SIGINT), 143 terminated (SIGTERM/SIGHUP; verbs with work in flight
clean it up first: a sweep keeps its finished runs, a launcher ends its process group); 141 the
reader of stdout went away (``sparsebalance sweep ... | head``), after the results were written.
Warnings by weight (``commands/_warnings.py``): one that changes what a result means
(``errors.MeaningWarning``) is always printed and written into the results' ``summary.json``, and
``--strict`` (every verb) makes it an error, exit 2; the others are notes, one line each on a terminal
and counted otherwise (``-v`` shows them).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sqlite3
import sys

from sparsebalance import __version__
from sparsebalance.commands._signals import Terminated, installed
from sparsebalance.errors import ConfigError, HostError, MeaningWarning

#: verb -> (module under sparsebalance.commands, one-line help)
VERBS = {
    "simulate": ("simulate", "simulate N iterations of a run config; write results/<run>/"),
    "pipeline": ("pipeline", "replay explicit F/B durations through a pipeline schedule"),
    "sweep": ("sweep", "run a grid of policies x anchors x p x seeds x clusters in parallel"),
    "ablation": ("ablation", "the paper's Table I ablation, simulated, beside the paper's numbers"),
    "profile": ("profile", "measure attention and dense-layer latency curves (needs torch)"),
    "validate": ("validate", "run realrun and the simulator on one config; predicted vs measured"),
    "train": ("train", "run the real executor alone under torchrun (needs torch)"),
    "accuracy": ("accuracy", ("recall accuracy of dense / fixed / SAB + DST training on a tiny model "
                              "(CPU; `accuracy pretrain` makes its base model)")),
    "gpu-check": ("gpu_check", "on a CUDA GPU: kernel accuracy and speed, profiles, stage validation"),
}


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (``prog: error: ... (see prog --help)``), exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def _print_message(self, message, file=None):
        """argparse drops write errors (``--help > /dev/full`` would exit 0 with nothing written):
        a full device is one line and exit 1; a reader that went away (``| head``) stays quiet."""
        file = file or sys.stdout
        try:
            file.write(message)
            file.flush()
        except OSError as e:
            if file is not sys.stdout:
                return  # stderr refused: nothing is left to say it on
            _silence_stdout()
            if not isinstance(e, BrokenPipeError):
                self.exit(1, f"{self.prog}: error: {STDOUT}: {e.strerror or e}\n")


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``verb``'s module is imported (none for the top-level help)."""
    from sparsebalance.commands._args import EPILOG

    parser = _Parser(
        prog="sparsebalance",
        description="Load-balanced long-context training with dynamic sparse attention: "
                    "simulate, tune and validate batching and sparsity policies.",
        epilog=EPILOG)
    parser.add_argument("--version", action="version", version=f"sparsebalance {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for name, (module, help_) in VERBS.items():
        p = sub.add_parser(name, help=help_, description=help_, epilog=EPILOG)
        p.set_defaults(_module=module)
        p.add_argument("--strict", action="store_true",
                       help="a warning that changes what the result means is an error (exit 2, the "
                            "result not written); docs/reliability.md lists them")
        if verb == name:
            _load(module).add_arguments(p)
    return parser


def _load(module: str):
    return importlib.import_module(f"sparsebalance.commands.{module}")


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # Import only the chosen verb's module: `--help` and `simulate` stay free of torch.
    verb = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(verb if verb in VERBS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "verb", None):
        parser.print_help()
        return 2
    stdout = sys.stdout
    sys.stdout = _NamedStdout(stdout)  # a failed write to it says "standard output", not nothing
    with installed():  # SIGTERM/SIGHUP raise Terminated; commands/_signals.py
        try:
            return _run(args)
        finally:
            sys.stdout = stdout


def _run(args) -> int:
    from sparsebalance.commands import _warnings
    from sparsebalance.commands._args import MARKER, finish_outputs, open_outputs

    finish_outputs(False)  # nothing left open by an earlier verb in this process
    ended = False
    try:
        loud = getattr(args, "verbose", False) or _isatty(sys.stderr)
        with _warnings.handling(loud=loud, strict=args.strict) as seen:
            rc = int(_load(args._module).run(args) or 0)
        _warnings.record(open_outputs(), seen.meaning)  # beside the results: what they depend on
        finish_outputs(True)  # the verb returned: what it wrote is its result
        ended = True
        _flush_stdout()
        if seen.hidden and rc == 0:
            print(f"sparsebalance: {len(seen.hidden)} note(s) not shown (stderr is not a terminal); "
                  "-v shows them", file=sys.stderr)
        return rc
    except MeaningWarning as w:  # --strict
        print(f"sparsebalance {args.verb}: error: {_warnings.text_of(w, MeaningWarning)} (--strict: a "
              "warning that changes what the result means; that result is not written)", file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"sparsebalance {args.verb}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError as e:
        if not _stdout_broken():
            return _fail(args, f"{e.filename or 'a pipe'}: {e.strerror}", 1)  # a pipe of our own
        _silence_stdout()
        return 141
    except HostError as e:
        return _fail(args, str(e), 1)
    except OSError as e:  # a full disk, an I/O error, a permission: the machine, named by its file
        if e.filename == STDOUT:
            _silence_stdout()  # the interpreter's last flush must not fail again
        return _fail(args, _os_line(e), 1)
    except sqlite3.DatabaseError as e:  # the store wraps its own; this is the net for any other
        return _fail(args, f"SQLite: {e}", 1)
    except MemoryError:
        return _fail(args, "out of memory (lower the sizes: data.num_sequences, the grid, --jobs)", 1)
    except (RecursionError, OverflowError, UnicodeError) as e:  # an input past a limit, unnamed
        return _fail(args, f"an input is out of range ({type(e).__name__}: {e})", 2)
    except KeyboardInterrupt as e:  # Terminated too: the line says what a directory it left holds
        kept = _close_unfinished()
        said = "; ".join(f"{p} holds an unfinished run, marked incomplete in its {MARKER}" for p in kept)
        what = f"terminated ({e})" if isinstance(e, Terminated) else "interrupted"
        print(f"sparsebalance {args.verb}: {what}{'; ' + said if said else ''}", file=sys.stderr)
        return 128 + e.signum if isinstance(e, Terminated) else 130
    finally:
        if not ended:  # an error: a directory it left is marked incomplete
            _close_unfinished()


def _close_unfinished() -> list:
    """Close the verb's directories as unfinished (``_args.finish_outputs(False)``); those kept."""
    from sparsebalance.commands._args import finish_outputs

    try:
        return finish_outputs(False)
    except KeyboardInterrupt:  # a second signal while closing: they are closed all the same
        return []


STDOUT = "standard output"
"""The file name a failed write to stdout carries (``print`` raises an OSError without one)."""


class _NamedStdout:
    """``sys.stdout`` whose write errors name it (``> /dev/full``: ENOSPC with no file name would
    leave the one line unable to say what was full). BrokenPipeError passes as it is (exit 141)."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text):
        return self._call(self._stream.write, text)

    def flush(self):
        return self._call(self._stream.flush)

    def _call(self, fn, *a):
        try:
            return fn(*a)
        except BrokenPipeError:
            raise
        except OSError as e:
            raise OSError(e.errno, e.strerror, STDOUT) from None

    def __getattr__(self, name):
        return getattr(self._stream, name)


def _fail(args, line: str, code: int) -> int:
    """One line on stderr (with ``-v`` the traceback first: the line is for users, it for bugs)."""
    if getattr(args, "verbose", False):
        import traceback

        traceback.print_exc()
    print(f"sparsebalance {args.verb}: error: {line}", file=sys.stderr)
    return code


def _os_line(e: OSError) -> str:
    """``<file>: <what>`` for an OSError; the results directory when the error names no file."""
    where = e.filename
    if where is None:
        from sparsebalance.commands._args import open_outputs

        opened = open_outputs()
        where = f"writing into {opened[-1]}" if opened else None
    what = e.strerror or str(e) or type(e).__name__
    return f"{where}: {what}" if where else what


def _flush_stdout() -> None:
    """Flush what the verb printed: a full device (``> /dev/full``) is an OSError naming stdout."""
    try:
        sys.stdout.flush()
    except ValueError:  # closed by the verb
        pass


def _stdout_broken() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll reports an error on its write end)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _silence_stdout() -> None:
    """After EPIPE: point stdout at /dev/null so the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):
        pass


if __name__ == "__main__":
    sys.exit(main())
