"""Draw a figure spec's panels with seaborn, one PNG per figure, laid out like the paper's panels.

Every panel kind of :class:`experiments.spec.Panel` has a drawer here. A panel whose source fails
(for instance a run that diverged) is drawn as a boxed message and reported, never silently blank.
The figure's caption (the sentence saying what to see) is printed under the panels.
"""

from __future__ import annotations

import textwrap
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from experiments.spec import FigureSpec, Panel, Results


def _array(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=float)


def _unstep(x: Any) -> tuple[str, Any]:
    """A :class:`Snapshot` gives (step, value): return a title suffix and the value."""
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], (int, np.integer)):
        return f" (step {int(x[0])})", x[1]
    return "", x


#: Line styles of a panel's reference lines, in turn, so that two of them can be told apart in the legend.
REF_STYLES = ("--", ":", "-.")
#: With the ``dashes`` option, series after the first are drawn with these dash patterns, in turn, so that a
#: curve lying exactly on an earlier one still shows through it.
DASHES = ((0, (6, 2)), (0, (2, 2)), (0, (6, 2, 2, 2)), (0, (1, 3)))


#: The y ticks of a log panel whose data are all exactly 0 (drawn on a symlog axis).
SYMLOG_TICKS = (0, 1e-12, 1e-8, 1e-4, 1)


def resolved(value: Any, results: Results) -> Any:
    """A panel field that may be a source (a callable of the results): its value for these results."""
    return value(results) if callable(value) else value


def panel_refs(panel: Panel, results: Results) -> dict[str, float]:
    """The panel's reference lines, label -> value, with sources resolved."""
    return {label: resolved(value, results) for label, value in panel.ref.items()}


def draw_refs(ax: Any, refs: dict[str, float]) -> list[Any]:
    """Horizontal reference lines (label -> value) in grey, one style of :data:`REF_STYLES` each, under
    the data (a curve lying on a reference line stays visible); the lines, tagged ``gid="ref"``."""
    return [ax.axhline(value, ls=REF_STYLES[i % len(REF_STYLES)], color="0.35", lw=1, label=label, zorder=1.5,
                       gid="ref")
            for i, (label, value) in enumerate(refs.items())]


def mark_off_scale(ax: Any) -> None:
    """Where a fixed y range cuts off a curve, a triangle in the curve's colour on the edge it leaves by
    (at its most extreme point) and a note of how far it goes, so a clipped curve is never mistaken
    for one that stays inside."""
    lo, hi = ax.get_ylim()
    beyond: dict[str, list[float]] = {"above": [], "below": []}
    for line in ax.get_lines():
        if line.get_gid() == "ref":
            continue
        x, y = np.asarray(line.get_xdata(), float), np.asarray(line.get_ydata(), float)
        if x.shape != y.shape:
            continue
        for side, out, edge, marker in (("above", y > hi, hi, "^"), ("below", y < lo, lo, "v")):
            out = out & np.isfinite(y)
            if out.any():
                i = int(np.argmax(np.where(out, np.abs(y - edge), -np.inf)))
                ax.scatter([x[i]], [edge], marker=marker, s=24, color=line.get_color(), clip_on=False, zorder=5,
                           gid="off-scale")
                beyond[side].append(float(y[i]))
    notes = ([f"▲ off the scale: up to {max(beyond['above']):.3g}"] if beyond["above"] else []) + (
        [f"▼ off the scale: down to {min(beyond['below']):.3g}"] if beyond["below"] else [])
    if notes:
        ax.text(0.99, 0.98, "\n".join(notes), transform=ax.transAxes, ha="right", va="top", fontsize=6, color="0.3",
                gid="off-scale")


def _line(ax: Any, panel: Panel, results: Results) -> str:
    import seaborn as sns

    chosen = panel.options.get("colours", {})
    palette = sns.color_palette(panel.options.get("palette", "colorblind"),
                                max(len(panel.series), 1 + max(chosen.values(), default=0)))
    xs = []
    for i, (label, source) in enumerate(panel.series.items()):
        colour = palette[chosen.get(label, i)]
        data = source(results)
        if isinstance(data, tuple) and len(data) == 2:
            x, y = _array(data[0]), _array(data[1])
        else:
            y = _array(data)
            x = np.arange(len(y))
        style = panel.options.get("styles", {}).get(label, panel.options.get("style", "-"))
        if panel.options.get("dashes") and i:  # the format keeps its marker, the dash pattern replaces its line
            marker = style.replace("-", "").replace(":", "")
            ax.plot(x, y, *([marker] if marker else []), linestyle=DASHES[(i - 1) % len(DASHES)], label=label,
                    color=colour, lw=1.4, ms=3, zorder=2.5)
        elif panel.options.get("dashes") and len(panel.series) > 1:
            # The first curve, solid, is drawn wide and under the dashed ones: where they lie on it, it
            # still shows on both sides of them and in their gaps.
            ax.plot(x, y, style, label=label, color=colour, lw=3.2, ms=4, alpha=0.7, zorder=2)
        else:
            ax.plot(x, y, style, label=label, color=colour, lw=1.6, ms=3)
        xs.append(x)
    draw_refs(ax, panel_refs(panel, results))
    if panel.logx and any(np.any(x > 0) for x in xs):
        ax.set_xscale("log")  # (a panel with no points, such as a run too short for its events, stays linear)
    if panel.logy:
        has_positive = any(line.get_ydata().size and np.nanmax(np.asarray(line.get_ydata(), float)) > 0
                           for line in ax.get_lines())
        # All-zero data (an exactly kept symmetry) cannot be log-scaled: show it on a symlog axis, with 0
        # a little above the bottom edge (a curve on the edge would hide under the axis) and its tick
        # well apart from the first decade's.
        if has_positive:
            ax.set_yscale("log")
        else:
            ax.set_yscale("symlog", linthresh=1e-16)
            ax.set_ylim(-0.5e-16, 1)
            ax.set_yticks(SYMLOG_TICKS)
    if "yticks" in panel.options:  # e.g. only the meaningful ticks where ylim leaves room for a legend
        ax.set_yticks(panel.options["yticks"])
    if panel.options.get("legend", len(panel.series) + len(panel.ref) > 1):
        anchor = panel.options.get("legend_anchor")
        legend = ax.legend(fontsize=7, loc=panel.options.get("legend_loc", "best"),
                           ncol=panel.options.get("legend_columns", 1), bbox_to_anchor=anchor)
        if anchor is not None:
            # Placed beside the panel (over empty space there): the grid keeps its size.
            legend.set_in_layout(False)
    return ""


def _heatmap(ax: Any, panel: Panel, results: Results) -> str:
    """A matrix as a seaborn-styled heatmap (drawn with ``pcolormesh``: ``sns.heatmap`` redraws the
    whole figure once per call to check its tick labels, which is quadratic in the panel count)."""
    import matplotlib.pyplot as plt
    import seaborn as sns

    suffix, value = _unstep(panel.data(results))
    matrix = _array(value)
    if matrix.ndim == 1:
        matrix = matrix[None, :]
    rows, cols = matrix.shape
    cmap = sns.color_palette(panel.options.get("cmap", "viridis"), as_cmap=True)
    center = panel.options.get("center")
    finite = matrix[np.isfinite(matrix)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    lo, hi = panel.options.get("range", (lo, hi))
    if panel.options.get("zero"):  # the colour scale starts at 0, so that a near-constant matrix looks constant
        lo, hi = min(lo, 0.0), max(hi, 0.0)
    if center is not None:
        span = max(abs(lo - center), abs(hi - center)) or 1.0
        lo, hi = center - span, center + span
    mesh = ax.pcolormesh(matrix, cmap=cmap, vmin=lo, vmax=hi if hi > lo else lo + 1)
    ax.invert_yaxis()
    # The colour bar sits in the heatmap's own axes coordinates, so it is as tall as the drawn matrix
    # (a bar stolen from the panel's slot would span the slot, not the equal-aspect matrix inside it).
    ax.figure.colorbar(mesh, cax=ax.inset_axes((1.03, 0.0, 0.035, 1.0)))
    if panel.options.get("annot", matrix.size <= 64):
        fmt = panel.options.get("fmt", ".2f")
        norm = plt.Normalize(lo, hi if hi > lo else lo + 1)
        for (i, j), v in np.ndenumerate(matrix):
            if np.isfinite(v):
                r, g, b, _ = cmap(norm(v))
                dark = 0.2126 * r + 0.7152 * g + 0.0722 * b < 0.45
                ax.text(j + 0.5, i + 0.5, format(v, fmt), ha="center", va="center", fontsize=6,
                        color="white" if dark else "black")
    labels = panel.options.get("ticklabels", [str(i + 1) for i in range(max(matrix.shape))])
    for axis, n, which in ((ax.xaxis, cols, "xticklabels"), (ax.yaxis, rows, "yticklabels")):
        if 1 < n <= 40:
            # Named rows or columns, and up to 12 numbered ones, are all labelled; beyond that the first
            # and every fifth number.
            shown = [i for i in range(n) if which in panel.options or n <= 12 or i == 0 or (i + 1) % 5 == 0]
            axis.set_ticks(np.asarray(shown) + 0.5)
            axis.set_ticklabels([panel.options.get(which, labels)[i] for i in shown])
        else:
            axis.set_ticks([])
    ax.set_aspect("equal" if rows > 1 and max(rows, cols) / min(rows, cols) < 4 else "auto")
    ax.grid(False)
    ax.tick_params(labelsize=6)
    return suffix


def _bar(ax: Any, panel: Panel, results: Results) -> str:
    import seaborn as sns

    suffix, value = _unstep(panel.data(results))
    if isinstance(value, dict):
        labels, y = list(value), _array(list(value.values()))
    else:
        y = _array(value)
        labels = panel.options.get("xticklabels") or [str(i + 1) for i in range(len(y))]
    many = len(y) > 25  # e.g. one bar per position: solid bars that touch, else the edges hide them
    x = np.arange(1, len(y) + 1) if many else np.arange(len(y))  # many: the axis counts from 1, as labels do
    colour = sns.color_palette("colorblind")[panel.options.get("colour", 0)]
    ax.bar(x, y, color=colour, width=1.0 if many else 0.8, linewidth=0 if many else None)
    if many:
        from probes.plots import position_ticks

        position_ticks(ax, x)  # 1, round numbers, N: no tick at a position 0 that does not exist
    else:
        # A dot at each bar's end: a bar of exactly 0 is seen, not mistaken for a missing one.
        ax.scatter(x, y, s=20, color=colour, edgecolors="white", linewidths=0.6, zorder=3, clip_on=False)
        ax.set_xticks(x)
        rotation = panel.options.get("rotation", 0)
        ax.set_xticklabels(labels, rotation=rotation, fontsize=7, ha="right" if rotation else "center",
                           rotation_mode="anchor")
    draw_refs(ax, panel_refs(panel, results))
    if panel.ref:
        ax.legend(fontsize=7)
    if panel.logy:
        ax.set_yscale("log")
    if "range" in panel.options and panel.ylim is None:
        lo, hi = panel.options["range"]
        top = max(hi, 0.0) * 1.05
        ax.set_ylim(min(lo, 0.0), top if top > 0 else 1.0)
    return suffix


def _text(ax: Any, panel: Panel, results: Results) -> str:
    """Lines of text in the figure's own (proportional) font; ``$...$`` is rendered as mathtext."""
    ax.axis("off")
    ax.grid(False)
    ax.text(0.0, 1.0, str(panel.data(results)), va="top", ha="left", fontsize=7, linespacing=1.25,
            transform=ax.transAxes)
    return ""


#: Height of a table row, as a share of its panel's height.
ROW_HEIGHT = 0.075


def _table(ax: Any, panel: Panel, results: Results) -> str:
    """A :class:`experiments.spec.Table` as a table with a header row (and its note under it)."""
    table = panel.data(results)
    ax.axis("off")
    ax.grid(False)
    rows = [[str(c) for c in row] for row in table.rows] or [["" for _ in table.columns]]
    drawn = ax.table(cellText=rows, colLabels=list(table.columns), cellLoc="center", colLoc="center",
                     loc="upper center")
    drawn.auto_set_font_size(False)
    drawn.set_fontsize(7)
    drawn.auto_set_column_width(list(range(len(table.columns))))  # each column as wide as its widest cell
    for (row, _), cell in drawn.get_celld().items():
        cell.set_edgecolor("0.8")
        cell.set_height(ROW_HEIGHT)
        if row == 0:
            cell.set_facecolor("0.92")
            cell.set_text_props(fontweight="bold")
    height = ROW_HEIGHT * (len(rows) + 1)
    if table.note:
        ax.text(0.0, 1.0 - height - 0.04, table.note, va="top", ha="left", fontsize=7, transform=ax.transAxes)
    return ""


def _custom(ax: Any, panel: Panel, results: Results) -> str:
    panel.draw(ax, results)
    return ""


DRAWERS: dict[str, Callable[[Any, Panel, Results], str]] = {
    "line": _line, "heatmap": _heatmap, "bar": _bar, "text": _text, "table": _table, "custom": _custom,
}


def _title(ax: Any, text: str, width_in: float) -> None:
    """Set a panel title, wrapped onto more lines if it is wider than the panel's axes (about 0.8 of its
    share of the figure): otherwise it runs into its neighbour's title or off the figure's edge."""
    title = ax.set_title(text, fontsize=9)
    figure = ax.figure
    room = 0.8 * width_in * figure.dpi
    chars = len(text)
    while chars > 10 and title.get_window_extent(figure.canvas.get_renderer()).width > room:
        chars -= 1
        title.set_text(textwrap.fill(text, chars))


def _value_range(panel: Panel, results: Results) -> tuple[float, float] | None:
    _, value = _unstep(panel.data(results))
    values = _array(list(value.values()) if isinstance(value, dict) else value)
    finite = values[np.isfinite(values)]
    return (float(finite.min()), float(finite.max())) if finite.size else None


def shared_scales(panels: list[Panel], results: Results) -> list[Panel]:
    """Give the panels whose ``share`` option names the same group one value scale, as their ``range``
    option: heatmaps one colour range, bars one y range. Each panel scaled to its own data would make
    a variance of 1e-11 look as large as one of 0.03; on one scale magnitudes compare across the group."""
    ranges: dict[str, tuple[float, float]] = {}
    for panel in panels:
        group = panel.options.get("share")
        if group is None or panel.data is None:
            continue
        try:
            found = _value_range(panel, results)
        except Exception:  # noqa: BLE001  (the panel's own drawing reports it)
            continue
        if found is not None:
            lo, hi = ranges.get(group, found)
            ranges[group] = (min(lo, found[0]), max(hi, found[1]))
    return [replace(panel, options={**panel.options, "range": ranges[panel.options["share"]]})
            if panel.options.get("share") in ranges else panel for panel in panels]


def render(fig: FigureSpec, results: Results, out_dir: Path) -> tuple[str | None, list[str]]:
    """Draw ``fig`` into ``out_dir / fig<id>.png``; returns (file name, panel errors)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import seaborn as sns

    if not fig.panels:
        return None, []
    sns.set_theme(style="whitegrid", context="paper")
    rows, cols = fig.layout or (1, len(fig.panels))
    w, h = fig.panel_size
    caption = textwrap.fill(fig.caption, int(17 * w * cols))
    caption_in = 0.25 + 0.16 * (caption.count("\n") + 1)
    height = h * rows + caption_in + 0.4
    figure, axes = plt.subplots(rows, cols, figsize=(w * cols, height), squeeze=False)
    errors = []
    flat = axes.ravel()
    for ax, panel in zip(flat, shared_scales(fig.panels, results)):
        try:
            suffix = DRAWERS[panel.kind](ax, panel, results)
            _title(ax, panel.title + suffix, w)
            ax.set_xlabel(resolved(panel.xlabel, results), fontsize=8)
            ax.set_ylabel(panel.ylabel, fontsize=8)
            if panel.ylim is not None:
                ax.set_ylim(*panel.ylim)
                if panel.kind == "line":
                    mark_off_scale(ax)
        except Exception as exc:  # noqa: BLE001  (drawn as a message and reported)
            ax.cla()
            ax.axis("off")
            message = f"{panel.title}: {type(exc).__name__}: {exc}"
            ax.text(0.5, 0.5, textwrap.fill(message, 40), ha="center", va="center", fontsize=7,
                    transform=ax.transAxes, bbox={"fc": "mistyrose"})
            errors.append(message)
    for ax in flat[len(fig.panels):]:
        ax.axis("off")
    title = f"Figure {fig.id}: {fig.title}" if fig.id.isdigit() else fig.title
    if results.reduced:
        title += "  [reduced mode]"
    figure.suptitle(title, fontsize=11)
    figure.text(0.01, 0.1 / height, caption, fontsize=8, va="bottom")
    figure.tight_layout(rect=(0, caption_in / height, 1, 1 - 0.4 / height))
    name = file_name(fig)
    figure.savefig(out_dir / name, dpi=110)
    plt.close(figure)
    return name, errors


def file_name(fig: FigureSpec) -> str:
    return f"fig{int(fig.id):02d}.png" if fig.id.isdigit() else f"{fig.id}.png"
