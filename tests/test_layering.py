"""The dependency rules of docs/architecture.md, checked on the source (every import, lazy ones too).

An arrow points from importer to imported; a part may import only the parts listed for it. Shared
top-level helpers (``errors``, ``configmap``, ``fsutil``, ``procutil``, ``readfile``) may be imported from anywhere.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "sparsebalance"
SHARED = {"errors", "configmap", "fsutil", "procutil", "readfile", "jit"}
ALLOWED = {
    "data": set(),
    "simulator": {"data"},
    "policies": {"simulator", "data"},
    "kernels": {"simulator", "data"},
    "analysis": {"simulator", "data"},
    "realrun": {"kernels", "policies", "simulator", "data", "loop", "runconfig", "runner", "analysis"},
    "accuracy": {"kernels", "policies", "simulator", "data", "loop", "realrun", "runconfig"},
    "gpucheck": {"kernels", "simulator", "data", "runconfig", "stagecheck"},
}
THIRD_PARTY_FORBIDDEN = {
    "data": {"torch", "triton"},
    "simulator": {"torch", "triton"},
    "policies": {"torch", "triton"},
}


def _imports(path: Path) -> set[str]:
    """Top-level names of every module ``path`` imports (sparsebalance.X -> 'sparsebalance.X')."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        else:
            continue
        for n in names:
            parts = n.split(".")
            out.add(".".join(parts[:2]) if parts[0] == "sparsebalance" else parts[0])
    return out


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_part_imports_only_what_the_rules_allow(part):
    bad = []
    for f in sorted((PKG / part).rglob("*.py")):
        for mod in _imports(f):
            if mod.startswith("sparsebalance."):
                target = mod.split(".")[1]
                if target != part and target not in SHARED and target not in ALLOWED[part]:
                    bad.append(f"{f.relative_to(PKG)} imports sparsebalance.{target}")
            elif mod in THIRD_PARTY_FORBIDDEN.get(part, ()):
                bad.append(f"{f.relative_to(PKG)} imports {mod}")
    assert not bad, "\n".join(bad)


#: The command line: the only modules that may import it (the CLI, its entry points and the demo,
#: which drives the verbs as a user would).
CLI = {"cli", "commands", "__main__", "demo"}


def test_library_never_imports_the_cli():
    """The house's layers point down: the verbs call the library, never the other way round (gpu-check
    measures its profiles with ``kernels.measure``, not ``cli.main(["profile", ...])``)."""
    bad = []
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG)
        if rel.parts[0] in CLI or (len(rel.parts) == 1 and f.stem in CLI):
            continue
        bad += [f"{rel} imports {m}" for m in _imports(f)
                if m.startswith("sparsebalance.") and m.split(".")[1] in CLI]
        bad += [f"{rel} imports sparsebalance.{a.name}" for node in ast.walk(ast.parse(f.read_text()))
                if isinstance(node, ast.ImportFrom) and node.module == "sparsebalance"
                for a in node.names if a.name in CLI]
    assert not bad, "\n".join(bad)


def test_shared_helpers_import_no_part():
    for name in SHARED:
        mods = _imports(PKG / f"{name}.py")
        assert not {m for m in mods if m.startswith("sparsebalance.") and m.split(".")[1] not in SHARED}


LATENCY_NAMES = {"lm", "latency", "lm0"}


def _probe_target(call: ast.Call) -> str | None:
    """The probed object's last name of a ``getattr`` / ``hasattr`` call (``self.latency`` -> latency)."""
    if not (isinstance(call.func, ast.Name) and call.func.id in ("getattr", "hasattr") and call.args):
        return None
    obj = call.args[0]
    return obj.id if isinstance(obj, ast.Name) else obj.attr if isinstance(obj, ast.Attribute) else None


def test_no_capability_probes_of_the_latency_model():
    """Policies and the simulator hold a typed ``LatencyQuery`` (simulator/cost/query.py) and call it: no
    ``getattr``/``hasattr`` on a latency model anywhere in the package."""
    bad = [f"{f.relative_to(PKG)}:{node.lineno}" for f in sorted(PKG.rglob("*.py"))
           for node in ast.walk(ast.parse(f.read_text()))
           if isinstance(node, ast.Call) and _probe_target(node) in LATENCY_NAMES]
    assert not bad, bad


#: Inside the simulator: the parts of ``simulator/`` each part may import (config: the configs and
#: presets, importable by all; base: layout and plan).
SIMULATOR_PARTS = {
    "config": {"config"},
    "schedule": {"schedule", "config"},
    "base": {"base", "schedule", "config"},
    "cost": {"cost", "base", "config"},
    "engine": {"engine", "cost", "schedule", "base", "config"},
}


def _simulator_part(name: str) -> str:
    return name if name in ("cost", "schedule", "engine", "config") else "base"


def test_simulator_parts_import_only_what_the_rules_allow():
    """schedule/ knows only configs; the base (config, layout, plan) may place stages by schedule;
    cost/ prices actions on the base; engine/ runs a schedule with costs."""
    sim = PKG / "simulator"
    bad = []
    for f in sorted(sim.rglob("*.py")):
        rel = f.relative_to(sim).parts
        if rel == ("__init__.py",):
            continue
        part = _simulator_part(rel[0] if len(rel) > 1 else f.stem)
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sparsebalance.simulator."):
                target = _simulator_part(node.module.split(".")[2])
                if target not in SIMULATOR_PARTS[part]:
                    bad.append(f"simulator/{'/'.join(rel)} ({part}) imports {node.module} ({target})")
    assert not bad, "\n".join(bad)
