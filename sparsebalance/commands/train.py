"""``sparsebalance train --config RUN.toml [--nproc N] [--out DIR]``: validate, then run realrun under torchrun.

Everything that can fail without processes (config fields, realrun options, data, profile, policy
names) is checked here first, so a bad config costs one line and exit code 2, never N workers.
"""

from __future__ import annotations

import argparse
import sys

from sparsebalance.realrun.launch import torchrun_command  # noqa: F401  (public: the command line)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from sparsebalance.commands._args import (
        DeprecatedAlias,
        add_config,
        add_launch_flags,
        add_out,
        add_output_flags,
        positive_int,
    )

    add_config(p, help="run config (TOML or JSON) with a [realrun] table")
    p.add_argument("--nproc", type=positive_int, default=None,
                   help="processes on this node (default: cluster.pp x cluster.dp; must equal it)")
    add_out(p, "<output_dir>/<name>")
    p.add_argument("--output-dir", action=DeprecatedAlias, new="--out", dest="out", metavar="DIR",
                   help="deprecated spelling of --out")
    add_launch_flags(p, example="iterations=3")
    add_output_flags(p)


def validate_for_launch(config: str, overrides: list[str]):
    """Load and check everything rank 0 would; raises ConfigError. Returns the RunConfig."""
    from sparsebalance.errors import ConfigError
    from sparsebalance.realrun.__main__ import parse_overrides
    from sparsebalance.realrun.config import realrun_config
    from sparsebalance.runconfig import load_run_config
    from sparsebalance.runner import prepare

    cfg = load_run_config(config, parse_overrides(overrides))
    realrun_config(cfg)
    from sparsebalance.kernels.qwen2 import check_qwen2_architecture

    check_qwen2_architecture(cfg.model)  # the simulator prices any decoder; the real run builds Qwen2
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"train: needs the [train] extra (torch, transformers): {e}") from None
    prepared = prepare(cfg)
    lengths_only = next((s for s in prepared.sequences if s.tokens is None), None)
    if lengths_only is not None:  # a rank would find it only after torchrun started
        raise ConfigError(f"data.path: {cfg.resolve(cfg.data.path)} gives sequence lengths without text "
                          f"(sequence {lengths_only.id} has a 'length' but no 'text'); the real run trains on "
                          "tokens: give rows with a 'text' column, or source = \"text_dir\"")
    return cfg


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from sparsebalance.commands._args import finish_outputs, progress_enabled, resolve_out
    from sparsebalance.errors import ConfigError
    from sparsebalance.realrun.config import world_size
    from sparsebalance.realrun.launch import check_port_free, launch

    if args.allow_nonmonotone:
        args.set = [*args.set, "allow_nonmonotone=true"]
    cfg = validate_for_launch(args.config, args.set)
    n = world_size(cfg)
    nproc = args.nproc or n
    if nproc != n:
        raise ConfigError(f"--nproc: must equal cluster.pp x cluster.dp x cluster.tp = {n} on one node, got {nproc}")
    if args.master_port is not None:
        check_port_free(args.master_port)
    out = resolve_out(args.out, Path(cfg.output_dir) / cfg.name, force=args.force, verb="train")
    outcome = launch(args.config, nproc, out_dir=out, sets=args.set, master_port=args.master_port,
                     quiet=False, progress=progress_enabled(args), what="train")
    if outcome.returncode != 0:
        print(f"sparsebalance {outcome.message}", file=sys.stderr)
        finish_outputs(False)  # what the failed run wrote stays, marked incomplete (not a result)
    return outcome.returncode
