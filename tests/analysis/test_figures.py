"""Figures the tool writes have no overlapping labels (text boxes measured after drawing)."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest

from sparsebalance.analysis.figures import label_points, overlapping_texts


@pytest.fixture
def kept(monkeypatch):
    """The figures plot functions close, kept for inspection."""
    figs = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    return figs


def test_the_check_sees_an_overlap():
    fig, ax = plt.subplots()
    ax.text(0.5, 0.5, "one label")
    ax.text(0.5, 0.5, "another")
    assert ("one label", "another") in overlapping_texts(fig)
    plt.close(fig)


def test_label_points_never_overlaps_even_for_crowded_points():
    rng = np.random.default_rng(0)
    fig, ax = plt.subplots(figsize=(6, 4))
    x, y = rng.normal(size=25), rng.normal(size=25)
    x[:3], y[:3] = 0.5, 0.5  # three coincident points: one shared label
    ax.scatter(x, y)
    ax.margins(0.15)
    anns = label_points(ax, x, y, [f"max {i}" for i in range(25)])
    assert overlapping_texts(fig) == []
    assert len(anns) == 23 and any(a.get_text() == "max 0, 1, 2" for a in anns)
    plt.close(fig)


def test_pareto_and_ablation_figures(tmp_path, kept):
    from sparsebalance.analysis.ablation import CONFIGS, PAPER, plot_ablation
    from sparsebalance.analysis.sweep import plot_pareto

    rows = [{"anchor": a, "p": p, "mean_coverage": c, "speedup": s}
            for a, p, c, s in [("max", 0.1, 0.98, 1.06), ("max", 0.2, 0.98, 1.06), ("max", 0.3, 0.98, 1.06),
                               ("mean", 0.1, 0.957, 1.25), ("mean", 0.2, 0.943, 1.31),
                               ("mean", 0.3, 0.929, 1.35), ("min", 0.1, 0.920, 1.33),
                               ("dst-cp", 0.1, 0.941, 1.355), ("min", 0.2, 0.868, 1.45)]]
    plot_pareto(pd.DataFrame(rows), tmp_path / "p", title="anchor x p")
    t = PAPER.copy()
    t = pd.concat([t, pd.DataFrame({"config": ["+DST-CP", "+SAB+DST-CP"]})], ignore_index=True)
    t["speedup"] = np.linspace(1.0, 1.4, len(t))
    t["imbalance"] = np.linspace(1.8, 1.6, len(t))
    assert list(t.config[:6]) == list(CONFIGS)
    plot_ablation(t, tmp_path / "a")
    assert len(kept) == 2
    for fig in kept:
        assert overlapping_texts(fig) == []
    assert (tmp_path / "p.png").is_file() and (tmp_path / "a.svg").is_file()
