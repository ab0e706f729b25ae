"""Figures whose labels do not overlap: point labels placed around their points, and a check.

:func:`label_points` annotates scatter points without collisions: points that coincide on screen
share one label ("max 0.1, 0.2, 0.3"); each label takes the first of a ring of candidate offsets
(growing outwards) where it overlaps no other label, no marker, the legend or the axes' edge, with a
thin leader line when it had to move away. :func:`overlapping_texts` lists pairs of visible texts
whose boxes intersect (tick labels, titles, legend entries, annotations): the tests call it on every
figure the tool writes.
"""

from __future__ import annotations

import itertools
import math


def _renderer(fig):
    fig.canvas.draw()
    return fig.canvas.get_renderer()


def visible_texts(fig) -> list:
    """Every drawn, non-empty Text artist of ``fig``: titles, labels, legend entries, annotations and
    the tick labels of ticks inside the view limits (matplotlib keeps labels of ticks beyond the
    limits as visible artists that it does not draw)."""
    from matplotlib.text import Text

    ticks, drawn = set(), []
    for ax in fig.axes:
        for axis, (lo, hi) in ((ax.xaxis, ax.get_xlim()), (ax.yaxis, ax.get_ylim())):
            lo, hi = min(lo, hi), max(lo, hi)
            eps = 1e-9 * max(1.0, abs(hi - lo))
            for tick in axis.get_major_ticks() + axis.get_minor_ticks():
                labels = (tick.label1, tick.label2)
                ticks.update(id(t) for t in labels)
                if lo - eps <= tick.get_loc() <= hi + eps:
                    drawn += [t for t in labels if t.get_visible() and t.get_text().strip()]
    out = [t for t in fig.findobj(Text) if id(t) not in ticks and t.get_visible()
           and t.get_text().strip() and (t.axes is None or t.axes.get_visible())]
    return out + drawn


def overlapping_texts(fig, pad: float = 0.0) -> list[tuple[str, str]]:
    """Pairs of visible texts whose window boxes intersect (``pad`` pixels shrink each box first)."""
    r = _renderer(fig)
    boxes = []
    for t in visible_texts(fig):
        bb = t.get_window_extent(r)
        if bb.width > 0 and bb.height > 0:
            boxes.append((t.get_text(), bb.expanded(1.0, 1.0).padded(-pad)))
    return [(a, b) for (a, ba), (b, bb) in itertools.combinations(boxes, 2) if ba.overlaps(bb)]


def label_points(ax, xs, ys, labels, *, fontsize: float = 7, marker_px: float = 5.0) -> list:
    """Annotate points (xs, ys) with ``labels`` so that no two labels overlap (see module doc).
    Returns the annotation artists."""
    fig = ax.figure
    r = _renderer(fig)
    to_px = ax.transData.transform
    pts = [(float(x), float(y), str(lab)) for x, y, lab in zip(xs, ys, labels)
           if math.isfinite(float(x)) and math.isfinite(float(y))]
    groups: dict[tuple[int, int], list] = {}
    for x, y, lab in pts:  # points closer than a marker on screen share one label
        px, py = to_px((x, y))
        groups.setdefault((round(px / marker_px), round(py / marker_px)), []).append((x, y, lab))
    placed = []  # window boxes taken by labels
    markers = {key: [to_px((x, y)) for x, y, _ in members] for key, members in groups.items()}
    frame = ax.get_window_extent(r)
    legend = ax.get_legend()
    blocked = [legend.get_window_extent(r)] if legend is not None else []
    out = []
    for key, members in groups.items():
        others = [m for k, ms in markers.items() if k != key for m in ms]
        x, y = members[0][0], members[0][1]
        text = _merge([m[2] for m in members])
        best = None
        for dx, dy in _ring():
            ann = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points",
                              fontsize=fontsize, ha="left" if dx >= 0 else "right",
                              va="bottom" if dy >= 0 else "top")
            bb = ann.get_window_extent(r)
            ok = (frame.contains(bb.x0, bb.y0) and frame.contains(bb.x1, bb.y1)
                  and not any(bb.overlaps(o) for o in placed + blocked)
                  and not any(_hits(bb, m, marker_px) for m in others))
            if ok:
                best = (ann, bb, dx, dy)
                break
            ann.remove()
        if best is None:  # nowhere free: the nearest spot, still a readable label
            ann = ax.annotate(text, (x, y), xytext=(4, 4), textcoords="offset points", fontsize=fontsize)
            best = (ann, ann.get_window_extent(r), 4, 4)
        ann, bb, dx, dy = best
        if math.hypot(dx, dy) > 12:  # moved away: a thin leader line back to the point
            ax.annotate("", (x, y), xytext=(dx, dy), textcoords="offset points",
                        arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "0.5", "shrinkA": 0,
                                    "shrinkB": 3})
        placed.append(bb)
        out.append(ann)
    return out


def _merge(labels: list[str]) -> str:
    """'max 0.1', 'max 0.2' -> 'max 0.1, 0.2' (a shared first word is written once)."""
    heads = {lab.split(" ", 1)[0] for lab in labels}
    if len(labels) > 1 and len(heads) == 1 and all(" " in lab for lab in labels):
        return f"{heads.pop()} " + ", ".join(lab.split(" ", 1)[1] for lab in labels)
    return ", ".join(dict.fromkeys(labels))


def _ring():
    """Candidate offsets (points): right-up first, then around the point, further out each ring."""
    for radius in (4, 10, 18, 28, 40, 55):
        for angle in (45, -45, 135, -135, 0, 180, 90, -90, 20, -20, 160, -160):
            a = math.radians(angle)
            yield radius * math.cos(a), radius * math.sin(a)


def _hits(bb, point, radius: float) -> bool:
    x, y = point
    return bb.x0 - radius < x < bb.x1 + radius and bb.y0 - radius < y < bb.y1 + radius
