"""Figures of the probes (seaborn). Each function draws one PNG and returns its caption: a sentence
saying what a trained walk model shows there, for a reader who has not read the paper.

The figures are drawn on :class:`matplotlib.figure.Figure` objects in seaborn's whitegrid style,
set only while one is drawn: importing or calling this module leaves the caller's matplotlib
backend, pyplot figures and theme as they were."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
import seaborn as sns
from matplotlib.figure import Figure

from probes.attention import AttentionResult
from probes.patching import PatchingResult
from probes.targets import Layout
from probes.transition import TransitionResult

#: Positions shown in the zoomed panels (the last ones before the prediction).
ZOOM = 8
#: Title of the model's matrix, by the comparison the transition probe reports.
TITLES = {"ov": "model's V (the OV circuit, transposed)", "total": "model: direct + OV path",
          "behaviour": "model: mean scores given the parent's state"}


@contextlib.contextmanager
def _figure(*grid: int, **kwargs: Any) -> Iterator[tuple[Figure, Any]]:
    """A figure and its axes (``Figure.subplots(*grid, **kwargs)``), drawn in seaborn's style."""
    figsize = kwargs.pop("figsize")
    with sns.axes_style("whitegrid"), sns.plotting_context("notebook"):
        fig = Figure(figsize=figsize)
        yield fig, fig.subplots(*grid, **kwargs)


def _save(fig: Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _axis(kind: str, n_pos: int) -> tuple[np.ndarray, str]:
    """x values of an offset profile: input positions (1-based, as in the paper) for a query-slot
    model, offsets from the predicting position for an autoregressive one."""
    offsets = np.arange(-(n_pos - 1), 1)
    if kind == "query":
        return offsets + n_pos, "input position (the query slot is the last)"
    return offsets, "position relative to the predicting position (0 = itself)"


def _parent_x(layout: Layout, n_pos: int) -> list[int]:
    """x values (see :func:`_axis`) of the parents."""
    x, _ = _axis(layout.kind, n_pos)
    offsets = sorted({int(j) - int(layout.source[i]) for i, row in enumerate(layout.parents)
                      for j in row.nonzero().flatten()})
    return [int(x[o + n_pos - 1]) for o in offsets]


def plot_transition(result: TransitionResult, path: Path) -> str:
    """Pi^T beside the model's V (its OV circuit, plus the direct path with a residual stream)."""
    Pi_T = result.Pi.T.numpy()
    logits = result.total is not None  # a residual stream: a standard model whose outputs are logits
    V = (result.main.matrix.softmax(1) if logits else result.main.matrix).T.numpy()
    K = Pi_T.shape[0]
    annotate = K <= 10
    with _figure(1, 2, figsize=(10, 4.4)) as (fig, axes):
        labels = list(range(K))
        for ax, mat, title, fmt in ((axes[0], Pi_T, "true transitions $\\Pi^T$", ".2f"),
                                    (axes[1], V, TITLES[result.main_name] + (" (softmax)" if logits else ""),
                                     ".2f" if abs(V).max() < 100 else ".0f")):
            sns.heatmap(mat, ax=ax, annot=annotate, fmt=fmt, cmap="viridis", square=True,
                        xticklabels=labels, yticklabels=labels, cbar=True)
            ax.set_title(title)
            ax.set_xlabel("current state")
            ax.set_ylabel("next state (score)")
        _save(fig, path)
    return ("Left: the true chance of moving from each current state (column) to each next state (row). "
            "Right: the same map read off the model's weights (as probabilities, for a model whose outputs are "
            "logits); a model that learned the walk shows the same pattern (up to scale), with its largest "
            "entries where the true map has its largest ones.")


def plot_attention(result: AttentionResult, path: Path, sample_name: str = "walk") -> str:
    """Mean attention by position, all positions and a zoom on the last ones (``sample_name``: what the
    caption calls one input)."""
    profile = result.profile.numpy()
    n_pos = len(profile)
    x, label = _axis(result.layout.kind, n_pos)
    parents = set(_parent_x(result.layout, n_pos))
    colors = ["#d62728" if int(v) in parents else "#1f77b4" for v in x]
    with _figure(1, 2, figsize=(12, 3.8), gridspec_kw={"width_ratios": [2.2, 1]}) as (fig, axes):
        axes[0].bar(x, np.nan_to_num(profile), color=colors, width=0.9)
        axes[0].set_title(f"mean attention by position (layer {result.head[0]}, head {result.head[1]}; red = parent)")
        axes[0].set_xlabel(label)
        axes[0].set_ylabel("mean attention")
        zoom = slice(max(0, n_pos - ZOOM), n_pos)
        sns.barplot(x=[str(int(v)) for v in x[zoom]], y=np.nan_to_num(profile[zoom]), ax=axes[1],
                    palette=colors[zoom], hue=[str(int(v)) for v in x[zoom]], legend=False)
        axes[1].set_title(f"zoom: last {zoom.stop - zoom.start} positions")
        axes[1].set_xlabel(label.split(" (")[0])
        axes[1].set_ylim(0, max(1e-9, float(np.nanmax(profile))) * 1.1)
        _save(fig, path)
    return ("How much each input position is attended to when the model makes its prediction, averaged over the "
            f"test {sample_name}s. A model that learned the task puts almost all attention on the parents (red), "
            "the positions the label depends on (for a walk, the one holding the current state); an untrained or "
            "stuck model spreads it out.")


def plot_patching(result: PatchingResult, path: Path, sample_name: str = "walk") -> str:
    """Normalised patching effect by position for each position sweep, and head/parent scores
    (``sample_name``: what the caption calls one input)."""
    scores = result.scores()
    names = list(result.positions)
    with _figure(1, 3, figsize=(15, 3.8), gridspec_kw={"width_ratios": [2, 1, 1.2]}) as (fig, axes):
        n_pos = result.layout.parents.shape[1]
        x, label = _axis(result.layout.kind, n_pos)
        for name in names:
            axes[0].plot(x, result.profile(name).numpy(), marker=".", label=_label(name))
        for parent in _parent_x(result.layout, n_pos):
            axes[0].axvline(parent, color="#d62728", lw=0.8, ls="--")
        if not any(np.isfinite(result.profile(name).numpy()).any() for name in names):
            axes[0].text(0.5, 0.5, f"undefined: the model's output is the same for every {sample_name}", ha="center",
                         transform=axes[0].transAxes)
        axes[0].set_xlim(x.min() - 1, x.max() + 1)
        axes[0].set_title("patching one position at a time (dashed = parent)")
        axes[0].set_xlabel(label)
        axes[0].set_ylabel("share of clean output recovered")
        if names:
            axes[0].legend(fontsize=8)
            zoom = slice(max(0, n_pos - ZOOM), n_pos)
            grid = np.stack([result.profile(name).numpy()[zoom] for name in names])
            text = np.vectorize(lambda v: "n/a" if not np.isfinite(v) else f"{v:.2f}".replace("-0.00", "0.00"))(grid)
            sns.heatmap(grid, ax=axes[1], annot=text, fmt="", annot_kws={"size": 8}, cmap="rocket_r", vmin=0, vmax=1,
                        cbar=False,
                        xticklabels=[str(int(v)) for v in x[zoom]], yticklabels=[_label(n) for n in names])
            axes[1].set_title("zoom: effect by hook and position")
            axes[1].set_xlabel(label.split(" (")[0])
        keys = [k for k in scores if k.startswith(("z.", "pattern."))] + ["necessity", "sufficiency"]
        values = [scores[k] for k in keys]
        sns.barplot(x=values, y=keys, ax=axes[2], color="#4c72b0", orient="h")
        shown = [v for v in values if finite(v)]
        axes[2].set_xlim(min([0.0] + shown), max([1.05] + shown))
        axes[2].set_title("whole heads; necessity and sufficiency")
        axes[2].set_xlabel("normalised effect")
        _save(fig, path)
    return (f"Each point is a controlled experiment: run the model on an unrelated {sample_name}, copy back the "
            f"original {sample_name}'s internal state at one position (or one head), and see how much of the "
            "original prediction returns (1 = all of it). A model that learned the task recovers everything from "
            f"the parent positions alone and nothing from the others; its attention pattern carries no "
            f"{sample_name}-specific information (pattern near 0) while its head output carries all of it (z near 1).")


def _label(name: str) -> str:
    kind, layer = name.split(".")
    return {"resid_pre": "embeddings" if layer == "0" else f"residual L{layer}", "v": f"values L{layer}"}[kind] \
        if kind in ("resid_pre", "v") else name


def plot_bars(
    rows: Sequence[tuple[str, float, tuple[float, float], float, tuple[float, float]]],
    names: tuple[str, str],
    path: Path,
    title: str,
) -> None:
    """Grouped horizontal bars: ``(score, a, (lo, hi), b, (lo, hi))`` per row, with intervals."""
    with _figure(figsize=(9, 0.45 * len(rows) + 1.5)) as (fig, ax):
        y = np.arange(len(rows))
        h = 0.38
        palette = sns.color_palette("deep")
        for offset, idx, name, color in ((-h / 2, 1, names[0], palette[0]), (h / 2, 3, names[1], palette[3])):
            vals = np.array([np.nan if r[idx] is None else r[idx] for r in rows], dtype=float)
            lo = np.array([r[idx + 1][0] for r in rows], dtype=float)
            hi = np.array([r[idx + 1][1] for r in rows], dtype=float)
            err = np.vstack([np.nan_to_num(vals - lo), np.nan_to_num(hi - vals)]).clip(min=0)
            ax.barh(y + offset, np.nan_to_num(vals), height=h, color=color, label=name, xerr=err, capsize=2)
        ax.set_yticks(y, [r[0] for r in rows])
        ax.invert_yaxis()
        ax.axvline(0, color="black", lw=0.6)
        ax.set_title(title)
        ax.legend(loc="lower right", fontsize=9)
        _save(fig, path)


def finite(value: float) -> bool:
    return value is not None and math.isfinite(value)
