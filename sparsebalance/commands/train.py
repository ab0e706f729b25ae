"""``sparsebalance train --config RUN.toml [--nproc N] [--out DIR]``: validate, then run realrun under torchrun.

Everything that can fail without processes (config fields, realrun options, data, profile, policy
names) is checked here first, so a bad config costs one line and exit code 2, never N workers.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    from sparsebalance.commands._args import (
        DeprecatedAlias,
        add_config,
        add_out,
        add_output_flags,
        port,
        positive_int,
    )

    add_config(p, help="run config (TOML or JSON) with a [realrun] table")
    p.add_argument("--nproc", type=positive_int, default=None,
                   help="processes on this node (default: cluster.pp x cluster.dp; must equal it)")
    add_out(p, "<output_dir>/<name>")
    p.add_argument("--output-dir", action=DeprecatedAlias, new="--out", dest="out", metavar="DIR",
                   help="deprecated spelling of --out")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. --set iterations=3 (repeatable)")
    p.add_argument("--allow-nonmonotone", action="store_true",
                   help="use a profile whose latency falls as work grows (a warning lists the points)")
    p.add_argument("--master-port", type=port, default=None,
                   help="rendezvous port on localhost (default: a free one)")
    add_output_flags(p)


def torchrun_command(config: str, nproc: int, *, master_port: int | None = None,
                     extra: list[str] | None = None) -> list[str]:
    """The torchrun command line that starts ``nproc`` realrun workers on this node (on a free port
    when ``master_port`` is None)."""
    if master_port is None:
        from sparsebalance.realrun.launch import free_port

        master_port = free_port()
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
            "--master-addr", "127.0.0.1", "--master-port", str(master_port),
            "-m", "sparsebalance.realrun", "--config", config, *(extra or [])]


def validate_for_launch(config: str, overrides: list[str]):
    """Load and check everything rank 0 would; raises ConfigError. Returns the RunConfig."""
    from sparsebalance.errors import ConfigError
    from sparsebalance.realrun.__main__ import parse_overrides
    from sparsebalance.realrun.config import realrun_config
    from sparsebalance.runconfig import load_run_config
    from sparsebalance.runner import prepare

    cfg = load_run_config(config, parse_overrides(overrides))
    realrun_config(cfg)
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"train: needs the [train] extra (torch, transformers): {e}") from None
    prepare(cfg)
    return cfg


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from sparsebalance.commands._args import progress_enabled, resolve_out
    from sparsebalance.errors import ConfigError
    from sparsebalance.realrun.config import world_size

    if args.allow_nonmonotone:
        args.set = [*args.set, "allow_nonmonotone=true"]
    cfg = validate_for_launch(args.config, args.set)
    n = world_size(cfg)
    nproc = args.nproc or n
    if nproc != n:
        raise ConfigError(f"--nproc: must equal cluster.pp x cluster.dp = {n} on one node, got {nproc}")
    out = resolve_out(args.out, Path(cfg.output_dir) / cfg.name, force=args.force, verb="train")
    extra = [x for s in args.set for x in ("--set", s)] + ["--output-dir", str(out)]
    if not progress_enabled(args):
        extra.append("--quiet")
    cmd = torchrun_command(args.config, nproc, master_port=args.master_port, extra=extra)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    res = subprocess.run(cmd, check=False, env=env)
    if res.returncode != 0:
        print(f"sparsebalance train: realrun failed (exit {res.returncode}); the failing rank's "
              "'realrun: rank ...' line above names it", file=sys.stderr)
    return res.returncode
