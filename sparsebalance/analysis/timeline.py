"""Timeline (Gantt) plot of one iteration of a trace: one row per (dp_rank, stage)."""

from __future__ import annotations

from pathlib import Path

from sparsebalance.fsutil import atomic_savefig

#: Colour per op: F and B clearly apart, communication and optimizer muted; idle stays white.
COLOURS = {"F": "#4C72B0", "B": "#DD8452", "I": "#E9A66F", "W": "#8172B3", "P2P": "#8C8C8C",
           "ALLREDUCE": "#55A868", "OPTIM": "#C44E52", "CP": "#64B5CD",
           "CP_COMM": "#B0B0B0", "AG": "#937860", "RS": "#DA8BC3"}


SVG_MAX_ACTIONS = 20_000
"""Above this many drawn bars the SVG (one element per bar) is skipped; the PNG is always written."""


def plot_timeline(trace, path: str | Path, iteration: int = 0, title: str = "",
                  max_replicas: int = 8) -> Path:
    """Draw iteration ``iteration`` of ``trace`` (TRACE_COLUMNS table) and write ``path`` (PNG) and an
    SVG with the same stem (only up to :data:`SVG_MAX_ACTIONS` bars: a big plan's SVG is huge). Rows are (dp_rank, stage), top to bottom; F/B bars fill their row,
    P2P sends are thin bars under the sender's row; white gaps are idle time (bubbles). Only the
    first ``max_replicas`` DP ranks are drawn (the title says so) to keep large plans readable.
    Returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    from sparsebalance.simulator.engine.trace import check_trace

    check_trace(trace)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    df = trace[trace["iteration"] == iteration]
    ranks = sorted(df["dp_rank"].unique())
    shown = ranks[:max_replicas]
    df = df[df["dp_rank"].isin(shown)]
    rows = sorted({(int(r), int(s)) for r, s in zip(df["dp_rank"], df["stage"])})
    row_of = {key: i for i, key in enumerate(rows)}
    fig_h = min(1.2 + 0.35 * max(len(rows), 1), 30)
    fig, ax = plt.subplots(figsize=(12, fig_h))
    scale, unit = (1e3, "ms")
    if len(df) and df["end_s"].max() >= 10:
        scale, unit = (1.0, "s")
    for (r, s, op), grp in df.groupby(["dp_rank", "stage", "op"], sort=False):
        y = row_of[(int(r), int(s))]
        spans = list(zip(grp["start_s"] * scale, (grp["end_s"] - grp["start_s"]) * scale))
        if op == "P2P":
            ax.broken_barh(spans, (y + 0.3, 0.15), facecolors=COLOURS[op])
        elif op == "CP":  # ring steps of a context-parallel action: a thin band under its bar
            ax.broken_barh(spans, (y - 0.45, 0.1), facecolors=COLOURS[op], edgecolor="white", linewidth=0.2)
        elif op == "CP_COMM":  # its transfers: a thin band above the steps
            ax.broken_barh(spans, (y - 0.55, 0.1), facecolors=COLOURS[op], edgecolor="white", linewidth=0.2)
        elif op in ("AG", "RS"):  # FSDP's unit gathers / reduce-scatters: a thin band above the bar
            ax.broken_barh(spans, (y + 0.3 if op == "AG" else y + 0.4, 0.08), facecolors=COLOURS[op])
        else:
            ax.broken_barh(spans, (y - 0.4, 0.7), facecolors=COLOURS[op], edgecolor="white",
                           linewidth=0.3)
    # micro-batch numbers on wide enough F/B bars
    if len(df):
        total = (df["end_s"].max()) * scale
        fb = df[df["op"].isin(["F", "B", "I", "W"])]
        if len(fb) <= 600:
            for row in fb.itertuples(index=False):
                w = (row.end_s - row.start_s) * scale
                if w > total / 80:
                    ax.text(row.start_s * scale + w / 2, row_of[(int(row.dp_rank), int(row.stage))] - 0.05,
                            str(int(row.microbatch)), ha="center", va="center", fontsize=6, color="white")
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"dp{r} s{s}" for r, s in rows], fontsize=7)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_xlabel(f"time ({unit})")
    note = f" (first {len(shown)} of {len(ranks)} DP ranks)" if len(shown) < len(ranks) else ""
    ax.set_title((title or "pipeline timeline") + f", iteration {iteration}{note}", fontsize=10, loc="left")
    present = set(df["op"]) | {"F", "B", "P2P", "ALLREDUCE", "OPTIM"}  # I, W only when split
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLOURS.items() if k in present], ncol=7, fontsize=7,
              loc="lower right", bbox_to_anchor=(1.0, 1.0), frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=120)
    svg = path.with_suffix(".svg")
    if len(df) <= SVG_MAX_ACTIONS:
        atomic_savefig(fig, svg)
    elif svg.exists():
        svg.unlink()  # never leave an SVG of another run beside this PNG
    plt.close(fig)
    return path
