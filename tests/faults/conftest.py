"""Fixtures of the fault-injection suite (helpers: faultkit.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from faultkit import SWEEP_BASE


@pytest.fixture
def sweep_base(tmp_path) -> Path:
    p = tmp_path / "base.toml"
    p.write_text(SWEEP_BASE)
    return p
