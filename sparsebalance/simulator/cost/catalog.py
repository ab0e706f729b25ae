"""Where a run's profile comes from: a shipped name, a directory or CSV file, or ``analytical-<gpu>``
built on the fly by the roofline; :func:`load_profile` loads and validates it (the format:
``profile.py``), :func:`profile_fingerprint` names its bytes.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from sparsebalance.data.sequence import blocks
from sparsebalance.errors import ConfigError
from sparsebalance.readfile import load_json, os_error
from sparsebalance.simulator.cost.hardware import HARDWARE
from sparsebalance.simulator.cost.profile import ATTENTION_OPS, Profile, validate_table
from sparsebalance.simulator.cost.profilemeta import ProfileMeta

SHIPPED_DIR = Path(__file__).resolve().parents[2] / "data" / "profiles"


def shipped_profiles() -> list[str]:
    """Names of the profiles shipped with the package."""
    if not SHIPPED_DIR.is_dir():
        return []
    return sorted(p.name for p in SHIPPED_DIR.iterdir() if (p / "profile.csv").is_file())


def _locate(name_or_path: str | Path, base_dir: str | Path) -> tuple[Path, Path]:
    """(csv, sidecar) paths for a shipped name, a profile directory or the CSV itself."""
    text = str(name_or_path)
    if "/" not in text and "\\" not in text and (SHIPPED_DIR / text / "profile.csv").is_file():
        d = SHIPPED_DIR / text
        return d / "profile.csv", d / "profile.json"
    p = Path(text)
    if not p.is_absolute():
        p = Path(base_dir) / p
    if p.is_dir():
        return p / "profile.csv", p / "profile.json"
    if p.is_file():
        own = p.with_suffix(".json")  # data.csv + data.json, else the directory's profile.json
        return p, own if own.is_file() else p.parent / "profile.json"
    raise ConfigError(f"profile: {text!r} is neither a shipped profile ({', '.join(shipped_profiles())}) "
                      f"nor an existing directory or CSV file (looked in {p})")


def built_gpu(name_or_path: str | Path, base_dir: str | Path = ".") -> str | None:
    """The GPU of ``analytical-<gpu>`` when no shipped profile, directory or file has that name (the
    roofline builds it: ``hardware.HARDWARE``), else None. An unknown GPU is one line."""
    text = str(name_or_path)
    if not text.startswith("analytical-") or "/" in text or "\\" in text:
        return None
    try:
        csv_path, _ = _locate(text, base_dir)
        if csv_path.is_file():
            return None
    except ConfigError:
        pass
    gpu = text[len("analytical-"):]
    if gpu not in HARDWARE:
        raise ConfigError(f"profile: unknown GPU {gpu!r} in {text!r}; analytical profiles exist for: "
                          + ", ".join(f"analytical-{g}" for g in HARDWARE))
    return gpu


def profile_fingerprint(name_or_path: str | Path, base_dir: str | Path = ".") -> str:
    """SHA-256 of the profile's CSV and sidecar bytes: changes whenever a profile is re-measured (a
    sweep's run id includes it, so a new profile never reuses old results)."""
    import hashlib

    h = hashlib.sha256()
    gpu = built_gpu(name_or_path, base_dir)
    if gpu is not None:  # built by the roofline: its hardware and the code that builds it
        from dataclasses import asdict

        from sparsebalance import __version__

        h.update(f"{name_or_path} {asdict(HARDWARE[gpu])} {__version__}".encode())
        return h.hexdigest()
    for p in _locate(name_or_path, base_dir):
        h.update(p.read_bytes() if p.is_file() else b"-")
    return h.hexdigest()


def load_profile(name_or_path: str | Path, base_dir: str | Path = ".") -> Profile:
    """Load and validate a profile: a shipped name, a directory with profile.csv + profile.json,
    or the CSV path itself (sidecar ``<stem>.json`` or ``profile.json`` beside it)."""
    gpu = built_gpu(name_or_path, base_dir)
    if gpu is not None:  # the roofline's profile of the reference model; runs re-derive it for theirs
        from sparsebalance.simulator.config import qwen25_3b
        from sparsebalance.simulator.cost.roofline import build_profile

        prof = build_profile(HARDWARE[gpu], qwen25_3b(), 1)
        prof.source = str(name_or_path)
        return prof
    csv_path, json_path = _locate(name_or_path, base_dir)
    if not csv_path.is_file():
        raise ConfigError(f"profile: {csv_path}: no such file (a profile directory holds profile.csv)")
    if not json_path.is_file():
        raise ConfigError(f"profile: {json_path}: sidecar missing (the profile format needs "
                          f"profile.json beside {csv_path.name})")
    try:
        table = pd.read_csv(csv_path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as e:
        raise ConfigError(f"profile: {csv_path} is not a readable CSV: {e}") from None
    except OSError as e:
        raise os_error(e, "profile", f"cannot read {csv_path}") from None
    data = load_json(json_path, "profile")  # undecodable, invalid, nested too deep: one line
    table = validate_table(table, str(csv_path))
    meta = ProfileMeta.from_json(data, str(json_path))
    prof = Profile(table=table, meta=meta, source=str(csv_path))
    if not meta.analytical:
        _warn_foreign_blocks(prof)
    return prof


def _warn_foreign_blocks(prof: Profile) -> None:
    """A measured table whose attention budgets pass the block count of its longest length under the
    sidecar's block size measured dense work in those rows: the sign of a table measured with another
    block size (another model) under this sidecar. A user's grid may do it on purpose, so a shown
    warning (MeaningWarning), not an error."""
    import warnings

    from sparsebalance.errors import MeaningWarning

    attn = prof.table[prof.table["op"].isin(ATTENTION_OPS)]
    longest, top = int(attn["seq_len"].max()), int(attn["budget"].max())
    n = blocks(longest, prof.meta.block_size)
    if top > n:
        warnings.warn(f"profile {prof.source}: attention budgets reach {top} blocks, but its longest "
                      f"length ({longest} tokens) has {n} block(s) of {prof.meta.block_size} (the sidecar's "
                      "block_size): rows past it repeat dense work. Was the table measured for another "
                      "model than its sidecar names?", MeaningWarning, stacklevel=3)
