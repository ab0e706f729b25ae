"""``train`` / ``validate`` refuse every bad ``[realrun]`` value and every unreadable start checkpoint
before the results directory or any process exists (issue 23, items 3 and 4): one line naming the
field (or the file) and what is allowed, exit 2. The verbs run in this process with ``launch`` and
``subprocess.Popen`` patched to fail the test if called, so "no process started" is observed, not
inferred from timing. Bad values are generated per field from a seed (in the test id)."""

from __future__ import annotations

import json
import math
import random

import pytest
from faultkit import TINY_REALRUN

from sparsebalance.realrun.config import MAX_THREADS, TIMEOUT_RANGE_S

RUN = TINY_REALRUN.format(iterations=3, extra="")
LAYERS, WORLD, ITERATIONS = 4, 2, 3  # the tiny preset's layers, pp x dp x tp, iterations above
SEEDS = range(4)


def _bad_values(field: str, rng: random.Random) -> list[tuple[str, list[str]]]:
    """(TOML value, further --set items) that ``field`` must refuse: non-finite, negative, zero where
    > 0 is needed, and past the upper bound (each magnitude drawn from ``rng``)."""
    huge = f"{rng.uniform(1, 9):.3f}e{rng.randint(6, 300)}"
    nonfinite = [rng.choice(["inf", "+inf", "-inf", "nan"])]
    neg = f"-{rng.uniform(1e-6, 1e6):.6g}"
    if field == "threads":
        return [(v, []) for v in (*nonfinite, "0", str(-rng.randint(1, 99)),
                                  str(rng.randint(MAX_THREADS + 1, 2**40)))]
    if field == "timeout_s":
        lo, hi = TIMEOUT_RANGE_S
        return [(v, []) for v in (*nonfinite, "0", neg, f"{rng.uniform(0, lo) * 0.999:.6g}",
                                  f"{rng.uniform(hi * 1.001, hi * 1e6):.6g}", huge)]
    if field == "lr":
        return [(v, []) for v in (*nonfinite, "0", neg, "1e400")]
    if field == "weight_decay":
        return [(v, []) for v in (*nonfinite, neg)]
    if field == "grad_clip":
        return [(v, []) for v in (*nonfinite, "0", neg)]
    if field == "coverage_layer":
        return [(v, []) for v in (*nonfinite, str(rng.randint(LAYERS, 10**6)), str(-rng.randint(2, 10**6)))]
    if field == "fail_rank":
        return [(v, []) for v in (*nonfinite, str(rng.randint(WORLD, 10**6)), str(-rng.randint(1, 99)))]
    if field == "fail_iteration":  # with fail_rank set, the injection must fall inside the run
        return [(v, ["realrun.fail_rank=0"]) for v in (*nonfinite, str(rng.randint(ITERATIONS, 10**9)),
                                                        str(-rng.randint(1, 99)))]
    raise AssertionError(field)


NUMERIC = ("threads", "timeout_s", "lr", "weight_decay", "grad_clip", "coverage_layer", "fail_rank",
           "fail_iteration")


def test_every_numeric_field_of_realrun_is_covered():
    """A numeric field added to RealrunConfig without a case here fails this test."""
    import dataclasses
    import typing

    from sparsebalance.realrun.config import RealrunConfig

    hints = typing.get_type_hints(RealrunConfig)
    numeric = {f.name for f in dataclasses.fields(RealrunConfig)
               if any(t in (int, float) for t in (hints[f.name], *typing.get_args(hints[f.name])))}
    assert numeric == set(NUMERIC)


def _refused(r, out, *needles: str) -> str:
    lines = [ln for ln in r.err.strip().splitlines() if ln.strip()]
    assert r.code == 2, (r.code, r.err[-2000:])
    assert len(lines) == 1 and "Traceback" not in r.err, r.err[-2000:]
    assert all(n in lines[0] for n in needles), (needles, lines[0])
    assert not out.exists(), f"{out} was created"
    return lines[0]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("field", NUMERIC)
def test_bad_realrun_number_is_one_line_before_anything_exists(tmp_path, run_cli, no_launch, field, seed):
    cfg = tmp_path / "run.toml"
    cfg.write_text(RUN)
    out = tmp_path / "out"
    for value, more in _bad_values(field, random.Random(f"{field}-{seed}")):
        sets = [x for s in (f"realrun.{field}={value}", *more) for x in ("--set", s)]
        line = _refused(run_cli("train", "--config", cfg, *sets, "--out", out, "--no-progress"), out,
                        f"realrun.{field}:")
        # the line says what is allowed: a range, a bound or "finite"
        assert any(w in line for w in ("must lie in", "must be", "expected an integer", "finite")), line


def test_validate_refuses_before_its_directory_too(tmp_path, run_cli, no_launch):
    cfg = tmp_path / "run.toml"
    cfg.write_text(RUN + '[policy]\nbatching = "sab"\ntuning = "dst"\n')
    out = tmp_path / "v"
    _refused(run_cli("validate", "--config", cfg, "--set", "realrun.timeout_s=1e300", "--out", out),
             out, "realrun.timeout_s:", "must lie in [1, 604800]")


def test_bounds_are_the_documented_ones():
    """The refusals above are not of values any shipped example uses."""
    import tomllib
    from pathlib import Path

    for p in sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.toml")):
        rr = tomllib.loads(p.read_text()).get("realrun", {})
        if "threads" in rr:
            assert 1 <= rr["threads"] <= MAX_THREADS, p
        if "timeout_s" in rr:
            assert TIMEOUT_RANGE_S[0] <= rr["timeout_s"] <= TIMEOUT_RANGE_S[1], p
        assert math.isfinite(rr.get("lr", 1.0)), p


# -- a garbage or truncated start checkpoint (realrun.checkpoint) ----------------------------------
FORMATS = ("safetensors", "bin", "sharded")


def _checkpoint(d, fmt: str):
    """A checkpoint of the tiny run's model in ``fmt`` (as HF writes them)."""
    import torch
    from safetensors.torch import save_file

    from sparsebalance.kernels.qwen2 import build_qwen2
    from sparsebalance.runconfig import load_run_config

    cfg_path = d.parent / "run.toml"
    cfg_path.write_text(RUN)
    net = build_qwen2(load_run_config(str(cfg_path), {}).model, seed=3)
    d.mkdir(parents=True)
    net.config.to_json_file(str(d / "config.json"))
    sd = {k: v.contiguous() for k, v in net.state_dict().items()}
    if net.config.tie_word_embeddings:
        sd.pop("lm_head.weight")
    if fmt == "bin":
        torch.save(sd, d / "pytorch_model.bin")
    elif fmt == "safetensors":
        save_file(sd, str(d / "model.safetensors"))
    else:
        names = sorted(sd)
        shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
        for f, ks in shards.items():
            save_file({k: sd[k] for k in ks}, str(d / f))
        (d / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    return d, cfg_path


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("fmt", FORMATS)
def test_garbage_or_truncated_start_checkpoint_is_one_line(tmp_path, run_cli, no_launch, fmt, seed):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    from sparsebalance.realrun.checkpoint import check_checkpoint
    from sparsebalance.runconfig import load_run_config

    rng = random.Random(f"{fmt}-{seed}")
    ck, cfg = _checkpoint(tmp_path / "ck", fmt)
    check_checkpoint(ck, load_run_config(str(cfg), {}).model)  # intact, it is accepted
    victim = rng.choice(sorted(p for p in ck.iterdir() if p.suffix in (".safetensors", ".bin")))
    data = victim.read_bytes()
    how = ("garbage", "truncated", "emptied")[seed % 3]
    victim.write_bytes(rng.randbytes(rng.randint(1, 20_000)) if how == "garbage"
                       else data[: rng.randrange(1, len(data))] if how == "truncated" else b"")
    out = tmp_path / "out"
    r = run_cli("train", "--config", cfg, "--set", f'realrun.checkpoint="{ck}"', "--out", out, "--no-progress")
    _refused(r, out, "realrun.checkpoint:", str(victim))


def test_shard_missing_a_tensor_its_index_names(tmp_path, run_cli, no_launch):
    pytest.importorskip("safetensors")
    ck, cfg = _checkpoint(tmp_path / "ck", "sharded")
    index = ck / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    moved = min(k for k, f in doc["weight_map"].items() if f == "a.safetensors")
    doc["weight_map"][moved] = "b.safetensors"  # b does not hold it
    index.write_text(json.dumps(doc))
    out = tmp_path / "out"
    r = run_cli("train", "--config", cfg, "--set", f'realrun.checkpoint="{ck}"', "--out", out, "--no-progress")
    _refused(r, out, "realrun.checkpoint:", str(ck / "b.safetensors"), moved)
