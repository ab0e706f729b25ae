"""docs/formats.md names every field of every config table (a new field needs its line there)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

DOC = (Path(__file__).resolve().parents[1] / "docs" / "formats.md").read_text()


def _classes():
    from sparsebalance.data.config import DataConfig
    from sparsebalance.policies.config import PolicyConfig
    from sparsebalance.runconfig import RunConfig
    from sparsebalance.simulator.config import ClusterConfig, ModelConfig

    out = [RunConfig, ModelConfig, ClusterConfig, DataConfig, PolicyConfig]
    try:
        from sparsebalance.realrun.config import RealrunConfig

        out.append(RealrunConfig)
    except ImportError:  # pragma: no cover
        pass
    return out


@pytest.mark.parametrize("cls", _classes(), ids=lambda c: c.__name__)
def test_every_field_is_documented(cls):
    skip = {"base_dir", "model", "cluster", "data", "policy", "realrun"}
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in skip and f"`{f.name}`" not in DOC]
    assert not missing, f"docs/formats.md does not name {cls.__name__} field(s) {missing}"
