"""``sparsebalance <verb>``: the one console script. The only module that knows every part.

Each verb lives in ``sparsebalance/commands/<verb>.py`` with ``add_arguments(parser)`` and
``run(args) -> int``; they are imported lazily so ``--help`` and the simulator never import torch.
Bad input (``ConfigError``/``ValueError`` raised as such) prints one line and exits with code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from sparsebalance import __version__
from sparsebalance.errors import ConfigError

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
}


def build_parser(verb: str | None = None) -> argparse.ArgumentParser:
    """The parser; only ``verb``'s module is imported (none for the top-level help)."""
    parser = argparse.ArgumentParser(
        prog="sparsebalance",
        description="Load-balanced long-context training with dynamic sparse attention: "
                    "simulate, tune and validate batching and sparsity policies.")
    parser.add_argument("--version", action="version", version=f"sparsebalance {__version__}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for name, (module, help_) in VERBS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_module=module)
        if verb == name:
            _load(module).add_arguments(p)
    return parser


def _load(module: str):
    return importlib.import_module(f"sparsebalance.commands.{module}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # Import only the chosen verb's module: `--help` and `simulate` stay free of torch.
    verb = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(verb if verb in VERBS else None)
    args = parser.parse_args(argv)
    if not getattr(args, "verb", None):
        parser.print_help()
        return 2
    try:
        return int(_load(args._module).run(args) or 0)
    except ConfigError as e:
        print(f"sparsebalance {args.verb}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
