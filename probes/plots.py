"""Figures of the probes (seaborn). Each function draws one PNG and returns its caption: a sentence
saying what a trained walk model shows there, for a reader who has not read the paper.

The figures are drawn on :class:`matplotlib.figure.Figure` objects in seaborn's whitegrid style,
set only while one is drawn: importing or calling this module leaves the caller's matplotlib
backend, pyplot figures and theme as they were."""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence

import numpy as np
import seaborn as sns
from matplotlib.figure import Figure

from probes.attention import AttentionResult
from probes.patching import PatchingResult
from probes.scoring import direction
from probes.targets import Layout
from probes.transition import TransitionResult

#: Positions shown in the zoomed panels (the last ones before the prediction).
ZOOM = 8
#: Colour of the parents (bars, lines, tick labels) in every probe figure.
PARENT = "#d62728"
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
    """x values of an offset profile: input positions (1-based, as the text counts them: the query
    slot is position N) for a query-slot model, offsets from the predicting position for an
    autoregressive one."""
    offsets = np.arange(-(n_pos - 1), 1)
    if kind == "query":
        return offsets + n_pos, f"input position (1 = first state; N = {n_pos} is the query slot)"
    return offsets, "position relative to the predicting position (0 = itself)"


def _parent_x(layout: Layout, n_pos: int) -> list[int]:
    """x values (see :func:`_axis`) of the parents."""
    x, _ = _axis(layout.kind, n_pos)
    offsets = sorted({int(j) - int(layout.source[i]) for i, row in enumerate(layout.parents)
                      for j in row.nonzero().flatten()})
    return [int(x[o + n_pos - 1]) for o in offsets]


def _ticks(ax: Any, at: np.ndarray, x: np.ndarray, kind: str, n_pos: int, parents: Sequence[int]) -> None:
    """Label the positions ``x`` (drawn at ``at``) of a zoomed axis, every one; the parents in red, and
    for a query-slot model each parent and the query slot also as the text names them (N-1, N)."""
    def name(v: int) -> str:
        if kind != "query" or (v not in parents and v != n_pos):
            return str(v)
        return f"{v}\nN" if v == n_pos else f"{v}\nN-{n_pos - v}"

    ax.set_xticks(at, [name(int(v)) for v in x])
    for tick, v in zip(ax.get_xticklabels(), x):
        if int(v) in parents:
            tick.set_color(PARENT)
            tick.set_fontweight("bold")


def position_ticks(ax: Any, x: np.ndarray) -> None:
    """Ticks on positions only (no 0 before position 1): every one up to 16, else the first, the
    last and round numbers between."""
    lo, hi = int(x.min()), int(x.max())
    if hi - lo < 16:
        ticks = list(range(lo, hi + 1))
    else:
        step = 10 if hi - lo <= 60 else 20 if hi - lo <= 150 else 50
        inner = [v for v in range(lo - lo % step + step, hi, step) if v - lo >= step / 2 and hi - v >= step / 2]
        ticks = [lo, *inner, hi]
    ax.set_xticks(ticks)
    ax.set_xlim(lo - 1, hi + 1)


def _mark_parents(ax: Any, parents: Sequence[int], label: bool) -> None:
    """A dashed line at every parent, so that a parent given almost no attention is still seen."""
    for i, parent in enumerate(parents):
        ax.axvline(parent, color=PARENT, lw=0.9, ls="--", zorder=0,
                   label="parent" if label and i == 0 else "_nolegend_")


def plot_transition(result: TransitionResult, path: Path) -> str:
    """Pi^T beside the model's V (its OV circuit, plus the direct path with a residual stream).
    States are numbered 1 to K, as the text counts them."""
    Pi_T = result.Pi.T.numpy()
    logits = result.total is not None  # a residual stream: a standard model whose outputs are logits
    V = (result.main.matrix.softmax(1) if logits else result.main.matrix).T.numpy()
    K = Pi_T.shape[0]
    annotate = K <= 10
    drawn = "\nsoftmax over each column, as probabilities" if logits else "\nraw scores, not probabilities"
    with _figure(1, 2, figsize=(10, 4.4)) as (fig, axes):
        labels = [str(i + 1) for i in range(K)]
        for ax, mat, title, fmt in ((axes[0], Pi_T, "true transitions $\\Pi^T$ (probabilities)", ".2f"),
                                    (axes[1], V, TITLES[result.main_name] + drawn,
                                     ".2f" if abs(V).max() < 100 else ".0f")):
            sns.heatmap(mat, ax=ax, annot=annotate, fmt=fmt, cmap="viridis", square=True,
                        xticklabels=labels, yticklabels=labels, cbar=True)
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("current state")
            ax.set_ylabel("next state")
        _save(fig, path)
    right = ("the same map read off the model, as probabilities: its scores for each next state given the current "
             "one, through a softmax over each column" if logits else
             "the same map read off the model's weights, as raw scores (not probabilities: a column need not sum "
             "to 1)")
    return (f"Left: the true probability of moving from each current state (column) to each next state (row), "
            f"states numbered 1 to {K}. Right: {right}. A model that learned the walk shows the same pattern (up "
            "to scale), with its largest entries where the true map has its largest ones.")


def plot_attention(result: AttentionResult, path: Path, sample_name: str = "walk") -> str:
    """Mean attention by position, all positions and a zoom on the last ones, the parents marked
    (``sample_name``: what the caption calls one input)."""
    profile = np.nan_to_num(result.profile.numpy())
    n_pos = len(profile)
    kind = result.layout.kind
    x, label = _axis(kind, n_pos)
    parents = _parent_x(result.layout, n_pos)
    colors = np.array([PARENT if int(v) in parents else "#1f77b4" for v in x])
    zoom = slice(max(0, n_pos - ZOOM), n_pos)
    with _figure(1, 2, figsize=(12, 3.8), gridspec_kw={"width_ratios": [2.2, 1]}) as (fig, axes):
        for ax, part in ((axes[0], slice(None)), (axes[1], zoom)):
            ax.bar(x[part], profile[part], color=colors[part], width=0.9)
            _mark_parents(ax, parents, label=ax is axes[0])
            ax.set_ylim(0, max(1e-9, float(profile.max())) * 1.1)
        position_ticks(axes[0], x)
        axes[0].set_title(f"mean attention by position (layer {result.head[0]}, head {result.head[1]})")
        axes[0].set_xlabel(label)
        axes[0].set_ylabel("mean attention")
        axes[0].legend(loc="upper left", fontsize=8)
        axes[1].set_title(f"zoom: last {zoom.stop - zoom.start} positions (parents in red)")
        axes[1].set_xlabel(label.split(" (")[0])
        _ticks(axes[1], x[zoom], x[zoom], kind, n_pos, parents)
        _save(fig, path)
    where = ", ".join(map(str, parents))
    return ("How much each input position is attended to when the model makes its prediction, averaged over the "
            f"test {sample_name}s; the parents (red, dashed: position{'s' if len(parents) > 1 else ''} {where}) are "
            "the positions the label depends on (for a walk, the one holding the current state). A model that "
            "learned the task puts almost all attention on the parents; an untrained or stuck model spreads it out.")


def plot_patching(result: PatchingResult, path: Path, sample_name: str = "walk") -> str:
    """Normalised patching effect by position for each position sweep, and head/parent scores
    (``sample_name``: what the caption calls one input)."""
    scores = result.scores()
    names = list(result.positions)
    with _figure(1, 3, figsize=(15, 3.8), gridspec_kw={"width_ratios": [2, 1, 1.2]}) as (fig, axes):
        n_pos = result.layout.parents.shape[1]
        kind = result.layout.kind
        x, label = _axis(kind, n_pos)
        parents = _parent_x(result.layout, n_pos)
        for i, name in enumerate(names):
            # Sweeps often agree exactly (the embeddings and the values of a one-layer model): the first
            # is drawn wide and pale, the others dashed on top, so every curve shows.
            if i == 0:
                axes[0].plot(x, result.profile(name).numpy(), "-o", lw=3.2, ms=4, alpha=0.55, label=_label(name))
            else:
                axes[0].plot(x, result.profile(name).numpy(), MARKERS[(i - 1) % len(MARKERS)],
                             ls=DASHES[(i - 1) % len(DASHES)], lw=1.3, ms=3.5, mfc="none", label=_label(name))
        _mark_parents(axes[0], parents, label=True)
        if not any(np.isfinite(result.profile(name).numpy()).any() for name in names):
            axes[0].text(0.5, 0.5, f"undefined: the model's output is the same for every {sample_name}", ha="center",
                         transform=axes[0].transAxes)
        position_ticks(axes[0], x)
        axes[0].set_title("patching one position at a time")
        axes[0].set_xlabel(label)
        axes[0].set_ylabel("share of clean output recovered")
        axes[0].legend(fontsize=8)
        if names:
            zoom = slice(max(0, n_pos - ZOOM), n_pos)
            grid = np.stack([result.profile(name).numpy()[zoom] for name in names])
            text = np.vectorize(lambda v: "n/a" if not np.isfinite(v) else f"{v:.2f}".replace("-0.00", "0.00"))(grid)
            sns.heatmap(grid, ax=axes[1], annot=text, fmt="", annot_kws={"size": 8}, cmap="rocket_r", vmin=0, vmax=1,
                        cbar=False, yticklabels=[_label(n) for n in names])
            _ticks(axes[1], np.arange(grid.shape[1]) + 0.5, x[zoom], kind, n_pos, parents)
            axes[1].set_title("zoom: effect by hook and position")
            axes[1].set_xlabel(label.split(" (")[0])
        keys = [k for k in scores if k.startswith(("z.", "pattern."))] + ["necessity", "sufficiency"]
        values = [scores[k] for k in keys]
        hbars(axes[2], np.arange(len(keys)), values, 0.7, "#4c72b0")
        axes[2].set_yticks(np.arange(len(keys)), keys)
        axes[2].invert_yaxis()
        shown = [v for v in values if finite(v)]
        axes[2].set_xlim(min([0.0] + shown) - 0.03, max([1.05] + shown))
        axes[2].set_title("whole heads; necessity and sufficiency")
        axes[2].set_xlabel("normalised effect (1 = all recovered)")
        _save(fig, path)
    return (f"Each point is a controlled experiment: run the model on an unrelated {sample_name}, copy back the "
            f"original {sample_name}'s internal state at one position (or one head), and see how much of the "
            "original prediction returns (1 = all of it; parents dashed and in red). A model that learned the task "
            "recovers everything from the parent positions alone and nothing from the others; its attention pattern "
            f"carries no {sample_name}-specific information (pattern near 0) while its head output carries all of "
            "it (z near 1). A dot marks each bar's end, so that a bar of exactly 0 still shows.")
def _label(name: str) -> str:
    kind, layer = name.split(".")
    return {"resid_pre": "embeddings" if layer == "0" else f"residual L{layer}", "v": f"values L{layer}"}[kind] \
        if kind in ("resid_pre", "v") else name


#: Dash patterns and markers of the curves after the first (see :func:`plot_patching`).
DASHES = ((0, (5, 2)), (0, (2, 2)), (0, (5, 2, 1, 2)))
MARKERS = ("x", "s", "^")


def hbars(ax: Any, y: np.ndarray, values: Sequence[Optional[float]], height: float, color: Any,
          err: Optional[np.ndarray] = None, label: Optional[str] = None) -> None:
    """Horizontal bars with a dot at each bar's end, so that a bar of exactly 0 is still seen, and
    "n/a" where a value is undefined."""
    vals = np.array([np.nan if v is None else v for v in values], dtype=float)
    ax.barh(y, np.nan_to_num(vals), height=height, color=color, label=label, xerr=err, capsize=2)
    ax.plot(vals, y, "o", color=color, mec="white", mew=0.8, ms=5.5, zorder=3, label="_nolegend_")
    for yi, v in zip(y, vals):
        if not np.isfinite(v):
            ax.text(0, yi, " n/a", va="center", ha="left", fontsize=7, color="0.3")


def plot_bars(
    rows: Sequence[tuple[str, float, tuple[float, float], float, tuple[float, float]]],
    names: tuple[str, str],
    path: Path,
    title: str,
    references: Optional[Mapping[str, tuple[Optional[float], Optional[float]]]] = None,
    reference_label: str = "Bayes accuracy of the run's task",
) -> Figure:
    """Grouped horizontal bars: ``(score, a, (lo, hi), b, (lo, hi))`` per row, with intervals; each
    score's label carries its :func:`direction`. ``references`` maps a score to a reference value per
    run (such as each run's Bayes accuracy), drawn as a black dashed mark across that run's bar.
    Returns the figure (for inspection; it is already saved)."""
    references = references or {}
    with _figure(figsize=(9, 0.45 * len(rows) + 1.9)) as (fig, ax):
        y = np.arange(len(rows))
        h = 0.38
        palette = sns.color_palette("deep")
        for offset, idx, name, color in ((-h / 2, 1, names[0], palette[0]), (h / 2, 3, names[1], palette[3])):
            vals = np.array([np.nan if r[idx] is None else r[idx] for r in rows], dtype=float)
            lo = np.array([r[idx + 1][0] for r in rows], dtype=float)
            hi = np.array([r[idx + 1][1] for r in rows], dtype=float)
            err = np.vstack([np.nan_to_num(vals - lo), np.nan_to_num(hi - vals)]).clip(min=0)
            hbars(ax, y + offset, vals, h, color, err, name)
        drawn = False
        for i, row in enumerate(rows):
            for offset, value in zip((-h / 2, h / 2), references.get(row[0], ())):
                if value is not None and math.isfinite(value):
                    ax.plot([value, value], [i + offset - h / 2, i + offset + h / 2], color="black", ls="--",
                            lw=1.6, zorder=4, label="_nolegend_" if drawn else reference_label)
                    drawn = True
        ax.set_yticks(y, [r[0] + direction(r[0]) for r in rows])
        ax.invert_yaxis()
        ax.axvline(0, color="black", lw=0.6)
        lo, hi = ax.get_xlim()
        ax.set_xlim(min(lo, -0.03 * (hi - lo)), hi)  # room for the dot of a bar at 0
        ax.set_title(title)
        ax.set_xlabel("score   (↑ higher, ↓ lower for a model that learned the task)")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.5 / (0.45 * len(rows) + 1.9) - 0.04), fontsize=9,
                  ncol=1, frameon=False)
        _save(fig, path)
    return fig


def finite(value: float) -> bool:
    return value is not None and math.isfinite(value)


# ------------------------------------------------------------------------------ per-head scores
def plot_head_scores(table: Any, path: Path) -> str:
    """Heatmaps (layer x head) of each per-head score of a :class:`probes.heads.HeadTable`; with random
    models, a second row of the differences trained - random."""
    from probes.heads import ROLE_NAMES, SCORES

    rows = 2 if table.difference is not None else 1
    L, H = table.n_layers, table.n_heads
    width = max(3.2, 1.1 * H + 1.8)
    with _figure(rows, len(SCORES), figsize=(width * len(SCORES), (0.7 * L + 1.6) * rows),
                 squeeze=False) as (fig, axes):
        for col, name in enumerate(SCORES):
            grid = table.value[name].numpy()
            text = np.vectorize(lambda v: "n/a" if not np.isfinite(v) else f"{v:.2f}")(grid)
            if table.random is not None:
                rand = table.random[name].numpy()
                text = np.array([[f"{text[l, h]}\n(random {rand[l, h]:.2f})" for h in range(H)] for l in range(L)])
            sns.heatmap(grid, ax=axes[0, col], annot=text, fmt="", vmin=0, vmax=1, cmap="rocket_r", cbar=col == 3,
                        xticklabels=[f"H{h}" for h in range(H)], yticklabels=[f"L{l}" for l in range(L)],
                        annot_kws={"size": 8})
            same = f", = {ROLE_NAMES[table.same_as[name]]}" if name in table.same_as else ""
            axes[0, col].set_title(f"{ROLE_NAMES[name]} (chance {table.chance[name]:.2f}{same})", fontsize=10)
            if rows == 2:
                diff = table.difference[name].numpy()
                lo, hi = (table.difference_interval[name][..., i].numpy() for i in (0, 1))
                text = np.array([[f"{diff[l, h]:+.2f}" + (f"\n[{lo[l, h]:+.2f}, {hi[l, h]:+.2f}]"
                                                         if np.isfinite(lo[l, h]) else "")
                                  for h in range(H)] for l in range(L)])
                sns.heatmap(diff, ax=axes[1, col], annot=text, fmt="", vmin=-1, vmax=1, cmap="vlag",
                            cbar=col == 3, xticklabels=[f"H{h}" for h in range(H)],
                            yticklabels=[f"L{l}" for l in range(L)], annot_kws={"size": 8})
                axes[1, col].set_title(f"trained - random ({table.n_random} model{'s' * (table.n_random != 1)})", fontsize=10)
        _save(fig, path)
    return ("Each cell is one attention head (row = layer, column = head): the share of its attention on the "
            "previous position, on the positions that followed earlier occurrences of the current state "
            "(induction), on its own position, and on the prediction's parents, averaged over the test "
            "sequences; the chance level is what evenly spread attention would give. "
            + ("The lower row subtracts random-initialised models of the same architecture, with its interval. "
               if rows == 2 else "")
            + "A statistical induction circuit shows as a previous-token head in layer 0 and an induction head "
              "in layer 1, both far above chance.")


def plot_composition(result: Any, path: Path) -> str:
    """Q-, K- and V-composition scores (:class:`probes.heads.CompositionResult`) between every head
    (rows) and every head of a later layer (columns)."""
    L, H = result.K.shape[:2]
    labels = [f"L{l}H{h}" for l in range(L) for h in range(H)]
    later = np.array([[a // H < b // H for b in range(L * H)] for a in range(L * H)])
    with _figure(1, 3, figsize=(4.2 * 3, 0.45 * L * H + 2.4)) as (fig, axes):
        for ax, mode in zip(axes, ("Q", "K", "V")):
            grid = getattr(result, mode).reshape(L * H, L * H).numpy()
            sns.heatmap(np.where(later, grid, np.nan), ax=ax, annot=L * H <= 12, fmt=".2f", vmin=0,
                        vmax=max(0.5, float(np.nanmax(np.where(later, grid, np.nan)))), cmap="rocket_r",
                        xticklabels=labels, yticklabels=labels, cbar=mode == "V")
            ax.set_title(f"{mode}-composition")
            ax.set_xlabel("reading head (later layer)")
            ax.set_ylabel("writing head")
        _save(fig, path)
    return ("How strongly what each head writes (its OV circuit) is read by a later head's queries (Q), keys (K) "
            "or values (V), as TransformerLens measures it from the weights: ||W_A W_B|| / (||W_A|| ||W_B||). An "
            "induction head reads the previous-token head through its keys, so their K-composition stands out; "
            "compare with random-initialised models.")


def plot_over_training(curve: Any, path: Path) -> str:
    """The test loss against the step with the reference losses as lines, and the per-head previous-token
    and induction scores against the step (:class:`probes.heads.TrainingCurve`)."""
    steps = np.array(curve.steps)
    L, H = curve.scores["induction"].shape[1:]
    rise = curve.rise_step("induction") if len(steps) > 1 else None
    palette = sns.color_palette("deep", max(3, L * H))
    with _figure(2, 1, figsize=(9, 7), sharex=True) as (fig, axes):
        axes[0].plot(steps, curve.test_loss.numpy(), color="black", marker=".", label="model (test)")
        styles = {"uniform": ("#7f7f7f", ":"), "unigram": ("#ff7f0e", "--"), "bigram": ("#2ca02c", "--"),
                  "kgram": ("#d62728", "--")}
        for name, value in curve.references.items():
            color, ls = styles.get(name, ("#9467bd", "-."))
            axes[0].axhline(value, color=color, ls=ls, lw=1.2, label=f"{name} {value:.3f}")
        axes[0].set_ylabel("next-token loss (nats)")
        axes[0].set_title("test loss against the in-context reference predictors")
        axes[0].legend(fontsize=8, loc="upper right")
        for i, (l, h) in enumerate((l, h) for l in range(L) for h in range(H)):
            axes[1].plot(steps, curve.scores["previous_token"][:, l, h].numpy(), color=palette[i], ls="-",
                         label=f"L{l}H{h} previous-token")
            axes[1].plot(steps, curve.scores["induction"][:, l, h].numpy(), color=palette[i], ls="--",
                         label=f"L{l}H{h} induction")
        for name, ls in (("previous_token", "-"), ("induction", "--")):
            axes[1].axhline(curve.chance[name], color="#7f7f7f", ls=ls, lw=0.8)
        if rise is not None:
            for ax in axes:
                ax.axvline(rise, color="#d62728", lw=0.8, ls=":")
        axes[1].set_ylim(0, 1.02)
        axes[1].set_xlabel("training step")
        axes[1].set_ylabel("attention score")
        axes[1].set_title("per-head scores (grey: chance levels" + (f"; dotted red: induction rises at step {rise})"
                                                                    if rise is not None else ")"))
        axes[1].legend(fontsize=8, loc="center right", ncol=max(1, L * H // 4))
        _save(fig, path)
    return ("Top: the model's test loss during training, against predicting uniformly, from the in-context state "
            "counts (unigram) and from the in-context transition counts (bigram, the best possible for a first-order "
            "chain). Bottom: each head's previous-token score (solid) and induction score (dashed); a statistical "
            "induction head forms where the layer-1 induction score leaves its chance level, and the loss falls "
            "towards the bigram line with it.")


# ------------------------------------------------------------------------------ circuits
#: Colour of an edge by what its reader reads: a head's query, key or value input, an MLP, the logits.
EDGE_COLOURS = {"q": 0, "k": 3, "v": 2, "mlp": 4, "logits": 7}


def plot_circuit(result: Any, path: Path, max_edges: int | None = None) -> str:
    """The kept circuit of a :class:`probes.circuits.CircuitResult` as a graph: components by layer from the
    embeddings (left) to the logits (right), each kept edge a line whose width is its effect and whose
    colour says which input of the reader it enters (q, k, v marked)."""
    from probes.circuits import label

    structure = result.scores.structure
    L, H = structure.n_layers, structure.n_heads
    kept = result.circuit if max_edges is None else result.circuit[:max_edges]
    palette = sns.color_palette("deep")

    def position(name: str) -> tuple[float, float]:
        base = name.split(".")[0]
        if base == "embeddings":
            return 0.0, (H - 1) / 2
        if base == "logits":
            return 2.0 * L + 1, (H - 1) / 2
        if base.startswith("MLP"):
            return 2.0 * int(base[3:]) + 1.6, -1.2
        layer, head = base[1:].split("H")
        return 2.0 * int(layer) + 1, float(head)

    offsets = {"q": -0.18, "k": 0.0, "v": 0.18}
    with _figure(figsize=(2.2 * L + 4, 0.8 * H + 2.5)) as (fig, ax):
        roles = result.roles or {}
        nodes = ["embeddings", "logits"] + [f"L{l}H{h}" for l in range(L) for h in range(H)]
        nodes += [f"MLP{l}" for l in range(L)] if structure.has_mlp else []
        for name in nodes:
            x, y = position(name)
            ax.scatter([x], [y], s=260, color="white", edgecolor="black", zorder=3)
            role = roles.get(name)
            ax.annotate(name + (f"\n{role}" if role else ""), (x, y), xytext=(0, 13), textcoords="offset points",
                        ha="center", fontsize=7)
        top = max((abs(e["score"]) for e in kept), default=1.0) or 1.0
        for edge in kept:
            x0, y0 = position(edge["source"])
            x1, y1 = position(edge["target"])
            kind = edge["target"].split(".")[1] if "." in edge["target"] else (
                "logits" if edge["target"] == "logits" else "mlp")
            y1 += offsets.get(kind, 0.0)
            ax.plot([x0, x1], [y0, y1], color=palette[EDGE_COLOURS[kind]], lw=0.5 + 6 * abs(edge["score"]) / top,
                    alpha=0.8, zorder=2)
            if kind in offsets:
                ax.annotate(kind, (x1 - 0.12, y1), fontsize=7, color=palette[EDGE_COLOURS[kind]], ha="right")
        handles = [ax.plot([], [], color=palette[c], lw=3, label=k)[0] for k, c in EDGE_COLOURS.items()]
        ax.legend(handles=handles, loc="upper left", fontsize=8, ncol=5, frameon=False)
        ax.invert_yaxis()  # head 0 on top
        ax.set_axis_off()
        ax.set_title(f"circuit: {len(kept)} of {len(result.scores.edges)} edges ({result.scores.method}), "
                     f"faithfulness {result.faithfulness:.2f}")
        _save(fig, path)
    best = kept[0] if kept else None
    return ("The circuit: the edges kept, from the embeddings on the left to the logits on the right; a line's width "
            "is the loss its edge costs when ablated alone, its colour the input of the reader it enters (query, key, "
            "value, MLP or logits)." + (f" The strongest edge runs from {label_name(best['source'], roles)} into "
                                       f"{label_name(best['target'], roles)}." if best else ""))


def label_name(name: str, roles: dict[str, str]) -> str:
    base = name.split(".")[0]
    role = roles.get(base)
    return name if role is None else f"{name} ({role})"


def plot_faithfulness(result: Any, path: Path, reference: Any = None) -> str:
    """Faithfulness against circuit size of a :class:`probes.circuits.CircuitResult` (and of a reference
    ranking, e.g. the exact one, on the same sizes)."""
    with _figure(figsize=(6.5, 4)) as (fig, ax):
        ax.plot(result.curve.sizes, result.curve.values.numpy(), marker="o", ms=3, label=result.scores.method)
        if reference is not None:
            ax.plot(reference.curve.sizes, reference.curve.values.numpy(), marker="s", ms=3, ls="--",
                    label=reference.scores.method)
        ax.axvline(result.kept, color="gray", lw=0.8, ls=":")
        ax.axhline(1.0, color="black", lw=0.6)
        ax.set_xlabel("edges kept (top k by |score|)")
        ax.set_ylabel("faithfulness")
        ax.legend(fontsize=9)
        _save(fig, path)
    return ("Faithfulness of the top-k edges: the metric with every other edge ablated, as a fraction of the way from "
            "the model with every edge ablated (0) to the full model (1). A ranking that puts the edges that matter "
            "first climbs to 1 with few edges.")


# ------------------------------------------------------------------------------ scores across runs
def plot_across_runs(
    keys: Sequence[str],
    series: Sequence[tuple[str, str, Mapping[str, tuple[Sequence[float], float, tuple[float, float]]]]],
    path: Path,
    title: str,
    labels: Optional[Mapping[str, str]] = None,
    unit: str = "score",
) -> str:
    """Each score of ``keys`` (a row, labelled ``labels[key]`` or the key, with its :func:`direction`) across runs:
    per series ``(name, dot, {key: (values, mean, (low, high))})`` every run's value (``dot``: what one dot is,
    e.g. "one run") as a dot, the mean as a diamond
    and its interval over runs as a line through it; the series side by side in their own colours. Returns the
    caption."""
    labels = labels or {}
    palette = sns.color_palette("deep")
    colors = [palette[0], palette[3], palette[2], palette[1]]
    step = 0.8 / max(1, len(series))
    with _figure(figsize=(9, 0.5 * len(keys) * max(1, len(series)) ** 0.5 + 2.0)) as (fig, ax):
        for j, (name, dot, data) in enumerate(series):
            color = colors[j % len(colors)]
            offset = (j - (len(series) - 1) / 2) * step
            for i, key in enumerate(keys):
                if key not in data:
                    continue
                values, mean, (lo, hi) = data[key]
                vals = np.array([np.nan if v is None else v for v in values], dtype=float)
                jitter = np.linspace(-step / 4, step / 4, len(vals)) if len(vals) > 1 else np.zeros(len(vals))
                ax.plot(vals, i + offset + jitter, "o", color=color, alpha=0.55, ms=4.5, mec="none",
                        label=f"{name}: {dot} per dot" if i == 0 else "_nolegend_")
                if finite(lo) and finite(hi):
                    ax.plot([lo, hi], [i + offset] * 2, color=color, lw=2.6, solid_capstyle="butt",
                            label=f"{name}: mean and its 95% interval" if i == 0 else "_nolegend_")
                if finite(mean):
                    ax.plot([mean], [i + offset], "D", color=color, mec="black", mew=0.8, ms=7, zorder=4,
                            label="_nolegend_")
                if not np.isfinite(vals).any():
                    ax.text(0, i + offset, " n/a", va="center", ha="left", fontsize=7, color="0.3")
        ax.set_yticks(np.arange(len(keys)), [labels.get(k, k) + direction(k) for k in keys])
        ax.set_ylim(len(keys) - 0.5, -0.5)
        ax.set_title(title)
        ax.set_xlabel(f"{unit}   (↑ higher, ↓ lower for a model that learned the task)")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.5 / (0.5 * len(keys) + 2.0) - 0.06), fontsize=8,
                  ncol=2, frameon=False)
        _save(fig, path)
    dots = "; ".join(f"{name}: {dot}" for name, dot, _ in series)
    return (f"Each dot is one value of the score ({dots}); the diamond is the mean over runs and the line "
            "through it the 95% bootstrap interval of that mean (resampling runs: how far the mean could move with "
            "other seeds; no line where fewer than two runs define the score). The arrow after a score's name says "
            "which way learning the task moves it. A difference between series is clear when the dots separate, "
            "not only the diamonds.")
