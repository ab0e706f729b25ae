"""Shared fixtures. ``run_cli("pipeline", "f.json", "--json")`` runs ``sparsebalance.cli.main`` in
process and returns a :class:`CliResult` (exit code, stdout, stderr)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest


@dataclass(slots=True)
class CliResult:
    code: int
    """Exit code: 0 success, 2 bad input (ConfigError or an argparse usage error)."""
    out: str
    """Captured stdout."""
    err: str
    """Captured stderr."""


@pytest.fixture
def run_cli(capsys):
    from sparsebalance import cli

    def _run(*argv) -> CliResult:
        capsys.readouterr()
        try:
            code = cli.main([str(a) for a in argv])
        except SystemExit as e:  # argparse: --help (0) or usage errors (2)
            code = e.code if isinstance(e.code, int) else 1
        out, err = capsys.readouterr()
        return CliResult(code=int(code), out=out, err=err)

    return _run


def _scaled_probe(profile, grid, factors):
    """What a calibration probe returns on a machine exactly ``factors[op]`` times the profile:
    the profile's own rows at the probe grid's points, scaled (deterministic, no timing)."""
    t = profile.table
    attn = t["op"].isin(["attn_fwd", "attn_bwd"])
    keep = ((attn & t["seq_len"].isin(grid.seq_lens) & t["budget"].isin(grid.budgets))
            | (~attn & (t["op"] != "optim") & t["seq_len"].isin(grid.tokens)))
    out = t[keep].copy()
    out["latency_s"] = out["latency_s"] * out["op"].map(factors)
    return out


@pytest.fixture
def scaled_probe():
    """``scaled_probe(profile, grid, factors)``: an exact fake of the calibration probe."""
    return _scaled_probe
