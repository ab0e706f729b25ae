"""``sparsebalance <verb>``: the one console script. The only module that knows every part.

Each verb lives in ``sparsebalance/commands/<verb>.py`` with ``add_arguments(parser)`` and
``run(args) -> int``; they are imported lazily so ``--help`` and the simulator never import torch.
The shared flags (``--config``, ``--out``, ``--force``, ``--progress``, ``--verbose``) and their
rules are in ``commands/_args.py``; file formats in docs/formats.md.

Exit codes: 0 done; 2 bad input (``ConfigError`` or a usage error: one line naming the field, never a
traceback); 130 interrupted (SIGINT), 143 terminated (SIGTERM/SIGHUP; verbs with work in flight
clean it up first: a sweep keeps its finished runs, a launcher ends its process group); 141 the
reader of stdout went away (``sparsebalance sweep ... | head``), after the results were written.
Warnings print as one line each on a terminal; on other output they are counted and one line says
how many were hidden (``-v`` shows them).
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import warnings

from sparsebalance import __version__
from sparsebalance.errors import ConfigError, MeaningWarning

#: verb -> (module under sparsebalance.commands, one-line help)
VERBS = {
    "simulate": ("simulate", "simulate N iterations of a run config; write results/<run>/"),
    "pipeline": ("pipeline", "replay explicit F/B durations through a pipeline schedule"),
    "sweep": ("sweep", "run a grid of policies x anchors x p x seeds x clusters in parallel"),
    "ablation": ("ablation", "the paper's Table I ablation, simulated, beside the paper's numbers"),
    "profile": ("profile", "measure attention and dense-layer latency curves (needs torch)"),
    "validate": ("validate", "run realrun and the simulator on one config; predicted vs measured"),
    "train": ("train", "run the real executor alone under torchrun (needs torch)"),
    "accuracy": ("accuracy", "recall accuracy of dense / fixed / SAB + DST training on a tiny model "
                             "(CPU; `accuracy pretrain` makes its base model)"),
    "gpu-check": ("gpu_check", "on a CUDA GPU: kernel accuracy and speed, profiles, stage validation"),
}


class Terminated(KeyboardInterrupt):
    """SIGTERM/SIGHUP turned into an exception, so every ``except KeyboardInterrupt`` clean-up path
    (sweep workers, launcher process groups) runs for them too."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (``prog: error: ... (see prog --help)``), exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


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


def _raise_terminated(signum, frame):
    raise Terminated(signum)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # Import only the chosen verb's module: `--help` and `simulate` stay free of torch.
    verb = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(verb if verb in VERBS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "verb", None):
        parser.print_help()
        return 2
    old = {}
    if _main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            old[sig] = signal.signal(sig, _raise_terminated)
    hidden: list[str] = []
    from sparsebalance.commands._args import finish_outputs

    finish_outputs(False)  # nothing left open by an earlier verb in this process
    ended = False
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warning_printer(getattr(args, "verbose", False), hidden)
            rc = int(_load(args._module).run(args) or 0)
        ended = True
        finish_outputs(True)  # the verb returned: what it wrote is its result
        _flush_stdout()
        if hidden and rc == 0:
            print(f"sparsebalance: {len(hidden)} warning(s) not shown (stderr is not a terminal); "
                  "-v shows them", file=sys.stderr)
        return rc
    except ConfigError as e:
        print(f"sparsebalance {args.verb}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        if not _stdout_broken():
            raise  # a pipe of our own broke: a real error, not a reader that went away
        _silence_stdout()
        return 141
    except Terminated as e:
        print(f"sparsebalance {args.verb}: terminated ({e})", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print(f"sparsebalance {args.verb}: interrupted", file=sys.stderr)
        return 130
    finally:
        if not ended:
            finish_outputs(False)  # an error or a signal: a directory it left is marked incomplete
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _warning_printer(verbose: bool, hidden: list[str]):
    """``warnings.showwarning``: one line per distinct warning on a terminal (or with -v); counted
    otherwise, so logs of non-interactive runs are not flooded -- except a ``MeaningWarning`` (it
    changes what a result means), shown always."""
    shown: set[str] = set()
    loud = verbose or _isatty(sys.stderr)

    def show(message, category, filename, lineno, file=None, line=None):
        text = (str(message).strip().splitlines() or [category.__name__])[0]
        if text in shown or text in hidden:
            return
        if loud or issubclass(category, MeaningWarning):  # it changes what the result means: shown
            shown.add(text)
            print(f"sparsebalance: warning: {text}", file=sys.stderr)
        else:
            hidden.append(text)

    return show


def _flush_stdout() -> None:
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except (OSError, ValueError):
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
