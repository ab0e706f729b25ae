"""The dependency rules of docs/architecture.md, checked on the source (every import statement, lazy
ones and type-only ones too), and the page's drawing of them checked against these rules.

An arrow points from importer to imported; a part may import only the parts listed for it. Shared
top-level helpers (``errors``, ``configmap``, ``fsutil``, ``procutil``, ``readfile``, ``jit``) may be
imported from anywhere. Inside the simulator: base <- schedule <- cost <- engine; policies never import
engine/; nothing in analysis/ reaches the executor; no import circle anywhere.
"""

from __future__ import annotations

import ast
import functools
import re
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
    "titan": {"kernels", "policies", "simulator", "data", "loop", "runconfig", "runner"},
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


def test_only_the_verbs_import_titan():
    """titan/ (the torchtitan plugin, extra [titan]) is a leaf of the house: only the CLI's verbs
    (commands/) import it, so no part needs torchtitan installed."""
    bad = []
    for f in sorted(PKG.rglob("*.py")):
        rel = f.relative_to(PKG)
        if rel.parts[0] in ("titan", "commands") or (len(rel.parts) == 1 and f.stem == "cli"):
            continue
        bad += [f"{rel} imports {m}" for m in _imports(f) if m == "sparsebalance.titan"]
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


#: Inside the simulator, four parts in a row, each importing only itself and those before it:
#: base <- schedule <- cost <- engine. base: the configs and presets, layout (the model's geometry,
#: the schedules' stage placement, a CP rank's share), plan, budget, flops, hfconfig; schedule/: in
#: what order and when; cost/: what an action takes (the latency model, its one stage cost, memory,
#: CP, profiles); engine/: one iteration end to end.
SIMULATOR_ORDER = ("base", "schedule", "cost", "engine")


def simulator_part(module: str) -> str:
    """The part of a ``sparsebalance.simulator.*`` module (base unless in schedule/, cost/, engine/)."""
    sub = module.split(".")[2] if module.count(".") >= 2 else ""
    return sub if sub in SIMULATOR_ORDER else "base"


def test_simulator_parts_import_only_what_the_rules_allow():
    """base <- schedule <- cost <- engine: a part imports itself and the parts before it only."""
    bad = []
    for f in sorted((PKG / "simulator").rglob("*.py")):
        me = _module(f)
        if me == "sparsebalance.simulator":
            continue
        part = simulator_part(me)
        for target in _graph()[me]:
            if target.startswith("sparsebalance.simulator."):
                other = simulator_part(target)
                if SIMULATOR_ORDER.index(other) > SIMULATOR_ORDER.index(part):
                    bad.append(f"{me} ({part}) imports {target} ({other})")
    assert not bad, "\n".join(bad)


def test_policies_import_the_simulator_but_not_its_engine():
    """Policies decide from the base, schedules and costs; the engine runs what they decided."""
    bad = [f"{me} imports {t}" for me, targets in _graph().items() if me.startswith("sparsebalance.policies.")
           for t in targets if t.startswith("sparsebalance.simulator.") and simulator_part(t) == "engine"]
    assert not bad, "\n".join(bad)


def test_analysis_never_reaches_the_executor():
    """analysis/ reads results and replays them through what it is given: no import path, direct
    or through another module, leads from it to the simulator's executor."""
    graph, target = _graph(), "sparsebalance.simulator.engine.executor"
    bad = []
    for start in (m for m in graph if m.startswith("sparsebalance.analysis")):
        seen, todo, via = {start}, [start], {start: None}
        while todo:
            m = todo.pop()
            for t in graph[m]:
                if t not in seen:
                    seen.add(t)
                    via[t] = m
                    todo.append(t)
        if target in seen:
            path, m = [], target
            while m is not None:
                path.append(m)
                m = via[m]
            bad.append(" -> ".join(reversed(path)))
    assert not bad, "\n".join(bad)


def test_every_import_is_absolute():
    """The checks here read ``import sparsebalance...`` / ``from sparsebalance... import`` statements;
    a relative import (``from . import x``) would pass by them unseen, so there is none."""
    bad = [f"{f.relative_to(PKG)}:{node.lineno}" for f in sorted(PKG.rglob("*.py"))
           for node in ast.walk(ast.parse(f.read_text()))
           if isinstance(node, ast.ImportFrom) and node.level > 0]
    assert not bad, bad


def test_no_import_circle_anywhere():
    """No module reaches itself through imports (every import counts: lazy ones and those only for
    type checking), so every part can be read, tested and replaced from the bottom up."""
    circles = _circles(_graph())
    assert not circles, "\n".join(" <-> ".join(c) for c in circles)


def test_simulator_tests_mirror_its_parts():
    """tests/simulator/ holds a folder per part that has one (schedule/, cost/, cost/cp/, engine/), the
    base's tests beside them, and no folder that names no part."""
    tests = Path(__file__).resolve().parent / "simulator"
    folders = {p.relative_to(tests).as_posix() for p in tests.rglob("*") if p.is_dir() and p.name != "__pycache__"}
    parts = {p.relative_to(PKG / "simulator").as_posix() for p in (PKG / "simulator").rglob("*")
             if p.is_dir() and p.name != "__pycache__"}
    assert folders == parts, (sorted(folders), sorted(parts))


def _module(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    name = ".".join(rel.parts)
    return name.removesuffix(".__init__")


@functools.cache
def _graph() -> dict[str, frozenset[str]]:
    """Module -> the package's modules it imports (every import statement, at any depth: lazy ones
    and ``if TYPE_CHECKING:`` ones too); ``from package import module`` names the module."""
    mods = {_module(f): f for f in PKG.rglob("*.py")}

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    out = {}
    for me, f in mods.items():
        targets = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                         for a in node.names]
            else:
                continue
            targets |= {t for n in names if n.startswith("sparsebalance") and (t := resolve(n)) and t != me}
        out[me] = frozenset(targets)
    return out


def _circles(graph: dict[str, frozenset[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_circle_finder_finds_circles():
    """The oracle for :func:`_circles` on a hand-made graph: one 3-circle, one 2-circle, a tail."""
    g = {"a": frozenset({"b"}), "b": frozenset({"c"}), "c": frozenset({"a", "d"}), "d": frozenset(),
         "e": frozenset({"f"}), "f": frozenset({"e", "d"})}
    assert sorted(_circles(g)) == [["a", "b", "c"], ["e", "f"]]


def test_the_architecture_page_draws_these_rules():
    """docs/architecture.md's drawing of the rules is these rules: each part's arrow lists what
    ALLOWED lets it import, and the simulator's parts stand in SIMULATOR_ORDER."""
    text = (PKG.parent / "docs" / "architecture.md").read_text()
    block = text[text.index("**Dependency rules**"):]
    block = block[block.index("```") + 3:]
    block = block[:block.index("```")]
    drawn = {}
    for line in block.splitlines():
        m = re.match(r"\s*(\w+)/\s+──>\s+([^(]*)", line)
        if m and m.group(1) in ALLOWED:
            targets = {t.rstrip("/") for t in m.group(2).split()} - {"nothing"}
            drawn[m.group(1)] = targets
    assert drawn == ALLOWED
    order = re.search(r"inside simulator/:\s+(.*)", block).group(1)
    assert tuple(p.rstrip("/") for p in order.split(" <── ")) == SIMULATOR_ORDER
