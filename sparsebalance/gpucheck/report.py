"""What ``gpu-check`` leaves: the environment first, ``summary.md`` after every step, and a results
folder that fits what a lent machine gives back.

The limits (the device tool's): at most :data:`MAX_FILES` files of at most :data:`MAX_FILE_BYTES`
each, no deeper than :data:`MAX_DEPTH` folders below the results folder, names of letters, digits,
``.``, ``_`` and ``-``. ``gpu-check`` writes only flat files there: ``summary.md``, ``accuracy.csv``,
``speed.csv``, ``stages.csv``, ``rest.tar.gz`` (everything else: logs, profiles, per-step results)
and the results marker; ``scripts/gpu-check.sh`` adds ``gpu-check.log``.
"""

from __future__ import annotations

import io
import os
import platform
import re
import subprocess
import sys
import tarfile
from importlib import metadata
from pathlib import Path

from sparsebalance.fsutil import atomic_write_bytes, atomic_write_text

MAX_FILES = 8
MAX_FILE_BYTES = 16 * 2**20
MAX_DEPTH = 2
_NAME = re.compile(r"^[A-Za-z0-9._-]+$")
#: Packages whose versions the summary records (read from their metadata: nothing is imported).
PACKAGES = ("torch", "triton", "numpy", "pandas", "scipy", "transformers", "pyarrow", "simpy", "pytest")


def _run(cmd: list[str]) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError) as e:
        return f"unavailable ({type(e).__name__})"
    return r.stdout.strip() if r.returncode == 0 else f"unavailable (exit {r.returncode})"


def environment() -> dict[str, str]:
    """Python, package versions, GPUs (``nvidia-smi -L``), free GPU memory, the commit, and what
    ``scripts/gpu-check.sh`` installed from the carried wheels (``SPARSEBALANCE_WHEELS_INSTALLED``)."""
    env = {"python": f"{platform.python_version()} ({os.path.realpath(sys.executable)})",
           "host": platform.node() or "unknown"}
    for pkg in PACKAGES:
        try:
            env[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            env[pkg] = "not installed"
    env["gpus (nvidia-smi -L)"] = _run(["nvidia-smi", "-L"]).replace("\n", "; ")
    env["gpu memory free / total"] = _run(["nvidia-smi", "--query-gpu=memory.free,memory.total",
                                           "--format=csv,noheader"]).replace("\n", "; ")
    env["driver"] = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]).split("\n")[0]
    root = Path(__file__).resolve().parents[2]
    commit = _run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"])
    dirty = _run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"])
    env["commit"] = commit + (" (with uncommitted changes)" if dirty and not dirty.startswith("unavailable")
                              else "")
    env["installed from wheels/"] = os.environ.get("SPARSEBALANCE_WHEELS_INSTALLED", "") or "nothing"
    return env


def write_summary(rows: list[dict], env: dict, path: Path, notes: list[str] | None = None) -> Path:
    """``summary.md``: the environment, one table row per step (status, figures, file, seconds), notes."""
    lines = ["# sparsebalance gpu-check", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += ["", "| step | status | figures | file | seconds |", "|---|---|---|---|---|"]
    for r in rows:
        fig = str(r.get("figures", "")).replace("|", "/").replace("\n", " ")
        lines.append(f"| {r['step']} | {r['status']} | {fig} | {r.get('file', '')} | {r.get('seconds', 0):.0f} |")
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    return atomic_write_text(path, "\n".join(lines) + "\n")


def archive(work: Path, out: Path, name: str = "rest.tar.gz") -> Path:
    """Everything under ``work`` as one gzipped tar in ``out`` (written whole, then renamed)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for p in sorted(work.rglob("*")):
            if p.is_file() and not p.is_symlink():
                tar.add(p, arcname=str(p.relative_to(work)))
    return atomic_write_bytes(out / name, buf.getvalue())


def limit_problems(out: Path) -> list[str]:
    """What in ``out`` would not come back from a lent machine (empty when everything would)."""
    problems, files = [], 0
    for p in sorted(out.rglob("*")):
        rel = p.relative_to(out)
        if not _NAME.match(p.name):
            problems.append(f"{rel}: name has characters other than letters, digits, '.', '_', '-'")
        if p.is_symlink() or not (p.is_file() or p.is_dir()):
            problems.append(f"{rel}: not a plain file or folder")
        elif p.is_file():
            files += 1
            if len(rel.parts) - 1 > MAX_DEPTH:
                problems.append(f"{rel}: more than {MAX_DEPTH} folders down")
            if p.stat().st_size > MAX_FILE_BYTES:
                problems.append(f"{rel}: {p.stat().st_size} bytes, over {MAX_FILE_BYTES}")
    if files > MAX_FILES:
        problems.append(f"{files} files, over {MAX_FILES}")
    return problems
