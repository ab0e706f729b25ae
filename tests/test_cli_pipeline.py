"""`sparsebalance pipeline --config FILE`: closed forms through the CLI, and one-line errors for bad files."""

from __future__ import annotations

import json

import numpy as np
import pytest


def _write(tmp_path, obj, name="d.json"):
    path = tmp_path / name
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


def test_1f1b_json_closed_form(tmp_path, run_cli):
    p, m, f, b = 4, 6, 0.5, 1.0
    path = _write(tmp_path, {"forward": [[f] * m] * p, "backward": [[b] * m] * p,
                             "p2p_latency": 0.0, "allreduce_time": 0.0})
    r = run_cli("pipeline", "--config", path, "--schedule", "1f1b", "--json", "--ops")
    assert r.code == 0, r.err
    out = json.loads(r.out)
    assert out["iteration_time"] == pytest.approx((m + p - 1) * (f + b))
    assert out["bubble_fraction"] == pytest.approx((p - 1) / (m + p - 1))
    assert out["stage_busy"] == pytest.approx([m * (f + b)] * p)
    fb = [o for o in out["ops"] if o["op"] in ("F", "B")]
    assert len(fb) == 2 * p * m
    assert set(out["ops"][0]) == {"replica", "stage", "microbatch", "op", "start", "end"}
    stage0 = sorted((o for o in fb if o["stage"] == 0), key=lambda o: o["start"])
    assert [f"{o['op']}{o['microbatch']}" for o in stage0][:6] == ["F0", "F1", "F2", "F3", "B0", "F4"]


def test_gpipe_replicas_with_p2p_and_allreduce(tmp_path, run_cli):
    p, m, f, b, c, ar = 3, 4, 1.0, 2.0, 0.25, 0.5
    rep = {"forward": [[f] * m] * p, "backward": [[b] * m] * p}
    path = _write(tmp_path, {"replicas": [rep, rep], "p2p_latency": c, "allreduce_time": ar})
    out = json.loads(run_cli("pipeline", "--config", path, "--schedule", "gpipe", "--json", "--ops").out)
    # stage 0 finishes last: (m+p-1)(f+b) + 2(p-1)c, then the all-reduce
    assert out["iteration_time"] == pytest.approx((m + p - 1) * (f + b) + 2 * (p - 1) * c + ar)
    assert {o["replica"] for o in out["ops"]} == {0, 1}
    assert sum(o["op"] == "ALLREDUCE" for o in out["ops"]) == 2 * p


def test_interleaved_virtual_stages(tmp_path, run_cli):
    p, v, m, f, b = 2, 2, 4, 1.0, 2.0
    path = _write(tmp_path, {"forward": [[f / v] * m] * (p * v), "backward": [[b / v] * m] * (p * v)})
    r = run_cli("pipeline", "--config", path, "--schedule", "interleaved", "--virtual-stages", v, "--json", "--ops")
    out = json.loads(r.out)
    assert out["iteration_time"] == pytest.approx((v * m + p - 1) * (f + b) / v)
    assert len(out["stage_busy"]) == p


def test_table_output(tmp_path, run_cli):
    path = _write(tmp_path, {"forward": [[1, 2], [1, 2]], "backward": [[2, 4], [2, 4]]})
    r = run_cli("pipeline", "--config", path, "--schedule", "gpipe")
    assert r.code == 0
    assert "iteration time" in r.out and "bubble fraction" in r.out and "F0 F1 B0 B1" in r.out


@pytest.mark.parametrize("content,needle", [
    ({"forward": [[1, 1], [1]], "backward": [[1, 1], [1, 1]]}, "ragged rows"),
    ({"forward": [[1, -1], [1, 1]], "backward": [[1, 1], [1, 1]]}, "forward[0][1]: must be >= 0"),
    ({"forward": [[1, 1], [1, 1]]}, "backward: missing key"),
    ("{not json", "is not valid JSON"),
    ({"forward": [[1, 1]], "backward": [[1, 1]], "p2p": 1}, "p2p: unknown key"),
    ({"forward": [[1, "x"]], "backward": [[1, 1]]}, "forward[0][1]: expected a number"),
    ({"forward": [[1, 1], [1, 1]], "backward": [[1, 1]]}, "backward: shape 1 x 2"),
    ({"replicas": [{"forward": [[1]], "backward": [[1]]}, {"forward": [[1]]}]}, "replicas[1].backward"),
    ({"forward": [[1]] * 3, "backward": [[1]] * 3}, "1f1b needs at least pp = 3"),
    ({"forward": [[1]], "backward": [[1]], "allreduce_time": [1, 2]}, "allreduce_time"),
])
def test_malformed_files_fail_with_one_line(tmp_path, run_cli, content, needle):
    path = _write(tmp_path, content)
    r = run_cli("pipeline", "--config", path, "--schedule", "1f1b", "--json", "--ops")
    assert r.code == 2
    assert r.out == ""
    lines = r.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.err
    assert needle in lines[0]


def test_missing_file_and_bad_schedule(tmp_path, run_cli):
    r = run_cli("pipeline", "--config", tmp_path / "nope.json")
    assert r.code == 2 and "no such file" in r.err
    r = run_cli("pipeline", "--config", _write(tmp_path, {"forward": [[1]], "backward": [[1]]}), "--schedule", "zb")
    assert r.code == 2 and "invalid choice" in r.err


def test_json_without_ops_and_streamed_ops_match_the_trace(tmp_path, run_cli):
    from sparsebalance.commands.pipeline import load_durations
    from sparsebalance.simulator.engine import simulate

    rng = np.random.default_rng(0)
    reps = [{"forward": rng.uniform(0.1, 1, (3, 5)).tolist(), "backward": rng.uniform(0.1, 2, (3, 5)).tolist()}
            for _ in range(2)]
    path = _write(tmp_path, {"replicas": reps, "p2p_latency": 0.01, "allreduce_time": 0.2})
    short = json.loads(run_cli("pipeline", "--config", path, "--json").out)
    full = json.loads(run_cli("pipeline", "--config", path, "--json", "--ops").out)
    assert "ops" not in short and short == {k: v for k, v in full.items() if k != "ops"}
    tr = simulate(load_durations(path, "1f1b", 1)).trace
    assert short["iteration_time"] == pytest.approx(tr["end_s"].max(), rel=1e-12)
    got = [(o["replica"], o["stage"], o["microbatch"], o["op"], o["start"], o["end"]) for o in full["ops"]]
    assert got == list(zip(tr["dp_rank"], tr["stage"], tr["microbatch"], tr["op"], tr["start_s"], tr["end_s"]))
    assert run_cli("pipeline", "--config", path, "--ops").code == 2
