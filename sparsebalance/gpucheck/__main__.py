"""``python -m sparsebalance.gpucheck STEP --out DIR --work DIR --seconds S [...]``: one step of
``gpu-check`` in this process; its result goes to ``WORK/results/STEP.json`` (status, figures,
file), a traceback to ``WORK/logs/STEP.error.txt``. Started by ``commands/gpu_check.py``."""

from __future__ import annotations

import argparse
import json
import time
import traceback
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparsebalance.gpucheck")
    p.add_argument("step")
    p.add_argument("--out", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--seconds", type=float, required=True, help="the step's time from now")
    p.add_argument("--device", default="cuda")
    p.add_argument("--config", default=None)
    p.add_argument("--validate-config", default=None)
    a = p.parse_args(argv)
    from sparsebalance.gpucheck.steps import STEPS, Step

    ctx = Step(out=Path(a.out).resolve(), work=Path(a.work).resolve(), deadline=time.monotonic() + a.seconds,
               device=a.device, config=a.config, validate_config=a.validate_config)
    (ctx.work / "results").mkdir(parents=True, exist_ok=True)
    (ctx.work / "logs").mkdir(parents=True, exist_ok=True)
    try:
        status, figures, file = STEPS[a.step](ctx)
    except Exception as e:  # noqa: BLE001 -- recorded: one broken step must not hide the others
        (ctx.work / "logs" / f"{a.step}.error.txt").write_text(traceback.format_exc())
        first = str(e).splitlines()[0] if str(e) else ""
        status, figures, file = "FAIL", f"{type(e).__name__}: {first}"[:300], f"rest.tar.gz: logs/{a.step}.error.txt"
    (ctx.work / "results" / f"{a.step}.json").write_text(json.dumps(
        {"step": a.step, "status": status, "figures": figures, "file": file}))
    print(f"gpu-check {a.step}: {status} ({figures})", flush=True)
    return 0 if status in ("ok", "skipped", "partial") else 1


if __name__ == "__main__":
    raise SystemExit(main())
