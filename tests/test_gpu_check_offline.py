"""The device path of ``gpu-check``, proved on this CPU before any GPU is lent.

- ``scripts/gpu-check.sh`` on a copy of the working tree (what the device tool sends), inside a
  network namespace with no network (``unshare -n``), with an interpreter that has torch but neither
  the project nor simpy nor tqdm installed: it installs those two from ``wheels/`` only, creates no
  ``.venv``, reaches the documented no-CUDA exit (2) and leaves ``$OUT`` within the device limits.
- The import closure of every module the steps use holds no simpy and no ray (the lent machine has
  neither), checked by walking the imports and by importing them with both blocked.
- The orchestrator on the CPU (``--device cpu``: the profile and stages steps with the tiny model)
  with a relative ``--out``: each step in its own process, the measured profile found by the stages
  step, summary, flat files and archive within the limits.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "sparsebalance"


def _copy_tree(dst: Path) -> Path:
    """Tracked and untracked-not-ignored files of the checkout (what the device tool sends)."""
    r = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                       capture_output=True, check=False)
    if r.returncode != 0:
        pytest.skip("not a git checkout: cannot tell what travels")
    for rel in filter(None, r.stdout.decode().split("\0")):
        src = ROOT / rel
        if src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    return dst


#: What the bare interpreter must lack: the project (its editable hooks), and the pure-Python
#: dependencies the script may install from wheels/, and ray (absent on the lent machine).
WITHHELD = ("sparsebalance", "__editable__", "_sparsebalance", "simpy", "tqdm", "ray")


def _bare_python(where: Path) -> Path:
    """A venv whose site-packages links every package of this interpreter except :data:`WITHHELD`."""
    import venv

    venv.EnvBuilder(with_pip=False, symlinks=True).create(where)
    py = where / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.lower().startswith(WITHHELD):
            (site / entry.name).symlink_to(entry)
    return py


def _limits(out: Path) -> list[str]:
    from sparsebalance.gpucheck.report import limit_problems

    return limit_problems(out)


def test_script_offline_on_a_copy_with_a_bare_python_reaches_the_no_cuda_exit(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the no-CUDA exit cannot be reached")
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-n", "true"], capture_output=True,
                                                          check=False).returncode != 0:
        pytest.skip("unshare -n is not permitted here: the offline device-path test was skipped")
    tree = _copy_tree(tmp_path / "tree")
    py = _bare_python(tmp_path / "bare")
    find = "import importlib.util as u; print([m for m in ('torch', 'sparsebalance', 'simpy', 'tqdm') if u.find_spec(m)])"
    probe = subprocess.run([str(py), "-c", find],
                           capture_output=True, text=True, cwd=tmp_path, check=True)
    assert probe.stdout.strip() == "['torch']"
    out = tmp_path / "OUT"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PIP_"))}
    env |= {"OUT": str(out), "GPU_CHECK_PYTHON": str(py), "GPU_CHECK_SECONDS": "240", "HOME": str(tmp_path)}
    r = subprocess.run(["unshare", "-n", "bash", "scripts/gpu-check.sh"], cwd=tree, env=env, capture_output=True,
                       text=True, timeout=300, check=False)
    assert r.returncode == 2, r.stdout + r.stderr
    said = r.stdout + r.stderr  # the script tees gpu-check's output: its one line arrives on stdout
    assert said.count("gpu-check needs a CUDA GPU") == 1 and "Traceback" not in said, said
    summary = (out / "summary.md").read_text()  # the script's: gpu-check leaves no directory without CUDA
    assert "gpu-check exited 2 before any step: device: gpu-check needs a CUDA GPU" in summary
    assert "installed from wheels/: simpy-" in summary and "tqdm-" in summary
    assert f"torch: {torch.__version__.split('+')[0]}" in summary
    assert not (tree / ".venv").exists()
    assert {p.name for p in out.iterdir()} == {"summary.md", "gpu-check.log"}
    assert _limits(out) == []
    log = (out / "gpu-check.log").read_text()
    assert "Downloading" not in log and "Looking in indexes" not in log


def _source(mod: str) -> Path | None:
    """The file of a sparsebalance module (a module file or a package's __init__), None if neither."""
    base = PKG.parent / mod.replace(".", "/")
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def _imported(path: Path) -> list[str]:
    """Every name ``path`` imports (absolute imports, lazy ones included; ``from a import b`` gives
    ``a`` and ``a.b``, since ``b`` may be a module)."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return names


def _closure(roots: list[str]) -> set[str]:
    """Every sparsebalance module reachable from ``roots`` through any import, lazy ones included."""
    seen, todo = set(), list(roots)
    while todo:
        mod = todo.pop()
        if mod in seen or _source(mod) is None:
            continue
        seen.add(mod)
        todo += [n for n in _imported(_source(mod)) if n.startswith("sparsebalance")]
    return seen


STEP_ROOTS = ["sparsebalance.__main__", "sparsebalance.cli", "sparsebalance.commands.gpu_check",
              "sparsebalance.gpucheck.__main__", "sparsebalance.gpucheck.steps", "sparsebalance.gpucheck.report"]

BLOCKER = """import importlib.abc, sys
class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("simpy", "ray"):
            raise ImportError("blocked for the gpu-check test: " + name)
sys.meta_path.insert(0, _Blocked())
"""


def _tiny_config(where: Path) -> Path:
    """examples/cpu_pp2.toml cut to 2 micro-batches of at most 128 tokens (seconds on this CPU)."""
    cfg = (ROOT / "examples" / "cpu_pp2.toml").read_text()
    path = where / "tiny.toml"
    path.write_text(cfg.replace("global_batch = 8", "global_batch = 2").replace("max_length = 2048", "max_length = 128"))
    return path


def test_import_closure_of_the_steps_needs_neither_simpy_nor_ray():
    mods = _closure(STEP_ROOTS)
    assert {"sparsebalance.stagecheck", "sparsebalance.kernels.moba.triton_impl", "sparsebalance.kernels.measure",
            "sparsebalance.runner"} <= mods
    named = {m: {n.split(".")[0] for n in _imported(_source(m))} & {"simpy", "ray"} for m in mods}
    # the SimPy engine is reached only through engine.simulate(method="simpy"), which no step asks for
    assert {m: n for m, n in named.items() if n} == {"sparsebalance.simulator.engine.events": {"simpy"}}
    callers = mods - {"sparsebalance.simulator.engine", "sparsebalance.simulator.engine.events"}
    assert [m for m in callers if 'method="simpy"' in _source(m).read_text()] == []
    mods.discard("sparsebalance.simulator.engine.events")
    mods.discard("sparsebalance.__main__")  # runs the CLI when imported; its imports are cli's
    # and imported for real with both blocked (a module the walk missed would surface here)
    prog = BLOCKER + f"for m in {sorted(mods)!r}:\n    __import__(m)\n"
    r = subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, cwd=ROOT, timeout=300,
                       check=False)
    assert r.returncode == 0, r.stderr[-3000:]


def test_cpu_run_with_a_relative_out_finds_its_profile_and_stays_within_the_limits(tmp_path):
    """Also with simpy and ray blocked in every process (a ``sitecustomize`` on the path). In the
    default order (stages before profile), step profile predicts the stages again with the profile it
    measured."""
    pytest.importorskip("torch")
    _tiny_config(tmp_path)
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCKER)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(ROOT)]))
    r = subprocess.run([sys.executable, "-m", "sparsebalance", "gpu-check", "--device", "cpu", "--steps",
                        "stages,profile,accuracy", "--config", "tiny.toml", "--out", "gc", "--budget-s", "240"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    out = tmp_path / "gc"
    summary = (out / "summary.md").read_text()
    rows = {ln.split("|")[1].strip(): ln.split("|")[2].strip() for ln in summary.splitlines()
            if ln.startswith("| ") and not ln.startswith("| step")}
    assert rows == {"profile": "ok", "stages": "ok", "accuracy": "skipped"}
    assert "stages predicted again: " in summary
    import pandas as pd

    ops = pd.read_csv(out / "stages.csv")
    assert (ops["pred_measured-profile_s"] > 0).all() and (ops.measured_s > 0).all()
    assert len(ops) == 2 * 2 * 2  # PP 2 x 2 micro-batches x (F, B)
    with tarfile.open(out / "rest.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"profiles/cpu-tiny/profile.csv", "profiles/cpu-tiny/profile.json", "logs/stages.log",
            "results/stages.json", "stages_iteration.csv", "options.json"} <= names
    assert _limits(out) == []


def test_sigterm_mid_step_kills_the_step_and_leaves_the_summary(tmp_path):
    """What the script's hard deadline sends (``timeout`` -> SIGTERM): the running step's process
    group dies with the run, the summary keeps the rows so far plus a 'stopped' row, exit 124."""
    pytest.importorskip("torch")
    import signal
    import time

    _tiny_config(tmp_path)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "sparsebalance", "gpu-check", "--device", "cpu", "--steps",
                             "stages,profile", "--config", "tiny.toml", "--out", "gc", "--budget-s", "240"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    summary = tmp_path / "gc" / "summary.md"
    t0 = time.monotonic()
    while time.monotonic() - t0 < 120:  # until the first step is done and the second has started
        if summary.is_file() and "| stages | ok |" in summary.read_text():
            break
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 124, out + err
    text = summary.read_text()
    assert "| stages | ok |" in text and "| (stopped) | stopped | SIGTERM arrived" in text
    assert len([ln for ln in err.splitlines() if ln.strip()]) == 1 and "stopped by SIGTERM" in err
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=False).stdout
    assert str(tmp_path / "gc") not in ps  # no step process outlived the run
    assert _limits(tmp_path / "gc") == []
