"""Report directories: ``scores.json``, a readable ``report.md`` and the figures.

A report is written into a temporary sibling directory and renamed into place, so an interrupted
run never leaves a half-written report; an existing report is replaced, any other non-empty
directory is refused.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Optional

from probes.heads import ROLE_NAMES, SCORES, HeadTable, TrainingCurve
from probes.targets import head_name
from probes.scoring import HEADLINE, MEANING, Comparison, RunComparison, Scorecard, direction, nest_scores
from rwinterp.jsonable import jsonable
from rwinterp.atomic import atomic_directory as _atomic_directory

SCORES_FILE = "scores.json"
REPORT_FILE = "report.md"
#: What a report directory holds (its marker first): an existing --out is replaced only if it holds no more.
REPORT_FILES = (SCORES_FILE, REPORT_FILE, "*.png")


def atomic_directory(target: Path, build: Callable[[Path], None]) -> Path:
    """Run ``build(tmp)`` in a fresh temporary directory, then move it to ``target``."""
    return _atomic_directory(target, build, "report", REPORT_FILES)


#: The note under a score table.
ARROWS = "↑ / ↓ after a score: the way it moves when a model learns the task (higher / lower)."


def _fmt(value: Optional[float], digits: int = 3) -> str:
    if value is None or not math.isfinite(value):
        return "n/a"
    return f"{value:.{digits}f}"


def _interval(card: Scorecard, key: str) -> tuple[float, float]:
    return card.intervals.get(key, (math.nan, math.nan))


def _cell(card: Scorecard, flat: dict[str, float], key: str) -> str:
    """A score (from ``flat = card.flat()``) with its interval, where it has one."""
    lo, hi = _interval(card, key)
    value = flat.get(key, math.nan)
    return _fmt(value) + (f" [{_fmt(lo)}, {_fmt(hi)}]" if math.isfinite(lo) else "")


def summary_json(card: Scorecard, comparison: Optional[Comparison] = None) -> dict[str, Any]:
    """What ``rwinterp probe --json`` prints: the nested scores and, with a baseline, the same keys
    under ``baseline`` (means over seeds), with their spread under ``baseline_spread``. Per head
    (``heads.L{l}H{h}``) the random models' mean and the difference trained - random sit beside each
    score, with their intervals."""
    out: dict[str, Any] = dict(card.scores())
    if comparison is not None:
        table = comparison.head_table()
        if table is not None:
            out["heads"] = table.to_json(card.head_ablation)
        out["baseline"] = nest_scores(comparison.baseline_means())
        out["baseline_spread"] = nest_scores({k: {"std": s.std, "interval": s.interval}
                                              for k, s in comparison.spreads.items()})
        out["baseline_seeds"] = comparison.seeds
    return out


def _payload(card: Scorecard, flat: dict[str, float], source: str,
             comparison: Optional[Comparison] = None) -> dict[str, Any]:
    table = comparison.head_table() if comparison is not None else card.head_table()
    return {
        "source": source,
        "task": card.task,
        "model": card.model,
        "kind": card.kind,
        "n_walks": card.n_walks,
        "probe_config": card.config.to_dict(),
        "scores": nest_scores(flat, table, card.head_ablation),
        "intervals": nest_scores({k: list(v) for k, v in card.intervals.items()}),
        "findings": comparison.findings() if comparison is not None else card.findings(),
    }


def _figures(card: Scorecard, tmp: Path, prefix: str = "",
             table: Optional[HeadTable] = None) -> list[tuple[str, str, str]]:
    """Draw one scorecard's figures; returns ``(file, title, caption)``. ``table``: the per-head scores to
    draw (default: the card's own, without random models)."""
    from probes.plots import plot_attention, plot_composition, plot_head_scores, plot_patching, plot_transition

    figures = []
    if card.transition is not None:
        name = f"{prefix}transition.png"
        figures.append((name, "The model's value map against the transition matrix",
                        plot_transition(card.transition, tmp / name)))
    name = f"{prefix}attention.png"
    figures.append((name, "Attention by position", plot_attention(card.attention, tmp / name, card.sample_name)))
    name = f"{prefix}patching.png"
    figures.append((name, "Activation patching by position and hook",
                    plot_patching(card.patching, tmp / name, card.sample_name)))
    table = table if table is not None else card.head_table()
    if table is not None:
        name = f"{prefix}heads.png"
        figures.append((name, "Attention scores of every head", plot_head_scores(table, tmp / name)))
    if card.composition is not None:
        name = f"{prefix}composition.png"
        figures.append((name, "Composition between heads (from the weights)",
                        plot_composition(card.composition, tmp / name)))
    return figures


def _figure_markdown(figures: list[tuple[str, str, str]]) -> list[str]:
    lines = []
    for file, title, caption in figures:
        lines += [f"### {title}", "", f"![{title}]({file})", "", caption, ""]
    return lines


def _header(card: Scorecard, source: str) -> list[str]:
    noun = card.sample_name
    reads = (f"one prediction per {noun}, at the query slot" if card.kind == "query"
             else "a prediction at every position")
    return [
        f"- run: `{source}`",
        f"- task: {card.task}",
        f"- model: {card.model} ({reads})",
        f"- {noun}s probed: {card.n_walks}; intervals: " + (
            f"{100 * card.config.confidence:.0f}% bootstrap over {noun}s ({card.config.bootstrap} resamples)"
            if card.config.bootstrap else "none (no bootstrap resamples)"),
        "",
    ]


def over_training_json(curve: TrainingCurve) -> dict[str, Any]:
    """A :class:`probes.heads.TrainingCurve` as JSON: the steps, the test loss, the reference losses, and per head
    (``L{layer}H{head}``) each score at every step and the step at which it rises (halfway from its first value to
    its last; null if it does not rise)."""
    L, H = curve.scores["induction"].shape[1:]
    heads = {}
    for layer in range(L):
        for head in range(H):
            entry = {}
            for name, values in curve.scores.items():
                entry[name] = values[:, layer, head].tolist()
                entry[f"{name}_rises_at"] = curve.rise_step(name, layer, head)
            heads[head_name(layer, head)] = entry
    return {"steps": curve.steps, "test_loss": curve.test_loss.tolist(), "references": curve.references,
            "chance": curve.chance, "heads": heads}


def write_probe_report(out: Path, card: Scorecard, source: str, comparison: Optional[Comparison] = None,
                       curve: Optional[TrainingCurve] = None) -> Path:
    """Write ``scores.json``, ``report.md`` and the figures of one run's scorecard (with the scores over training
    of its checkpoints where ``curve`` is given)."""
    from probes.plots import plot_bars, plot_over_training

    def build(tmp: Path) -> None:
        flat = card.flat()
        table = comparison.head_table() if comparison is not None else card.head_table()
        figures = _figures(card, tmp, table=table)
        payload = _payload(card, flat, source, comparison)
        if curve is not None:
            payload["over_training"] = over_training_json(curve)
            figures.append(("over_training.png", "Over training",
                            plot_over_training(curve, tmp / "over_training.png")))
        if comparison is not None:
            rows = [(k, flat.get(k, math.nan), _interval(card, k), comparison.spreads[k].mean,
                     comparison.spreads[k].interval)
                    for k in HEADLINE if k in comparison.spreads and k != "bayes_accuracy"]
            bayes = flat.get("bayes_accuracy")
            plot_bars(rows, ("trained", f"random init ({len(comparison.seeds)} seeds)"),
                      tmp / "trained_vs_random.png", "trained model against random-initialised models",
                      references={"accuracy": (bayes, bayes)}, reference_label="Bayes accuracy of the task")
            figures.append(("trained_vs_random.png", "Trained against random-initialised models",
                            f"Each score for this run (with its interval over test {card.sample_name}s) beside the "
                            "mean over random-initialised models of the same architecture (interval over seeds); "
                            "the arrow after a score's name says which way learning the task moves it, and the "
                            "dashed mark on the accuracy bars is the Bayes accuracy. Learning the task shows as "
                            "scores far from the random ones."))
            payload["baseline"] = {
                "kind": "random", "seeds": comparison.seeds,
                **{stat: nest_scores({k: getattr(s, stat) for k, s in comparison.spreads.items()})
                   for stat in ("mean", "std", "interval")},
                "values": nest_scores({k: s.values for k, s in comparison.spreads.items()}),
            }
        (tmp / SCORES_FILE).write_text(json.dumps(jsonable(payload), indent=1))
        lines = ["# Probe report", ""] + _header(card, source) + ["## What the probes find", ""]
        lines += [f"- {s}" for s in payload["findings"]] + ["", "## Scores", ""]
        lines += _score_table(card, flat, comparison) + _head_section(card, table, flat, comparison)
        lines += ["", "## Figures", ""] + _figure_markdown(figures)
        (tmp / REPORT_FILE).write_text("\n".join(lines))

    return atomic_directory(out, build)


def _pair(t: Any) -> str:
    lo, hi = float(t[0]), float(t[1])
    return f" [{_fmt(lo)}, {_fmt(hi)}]" if math.isfinite(lo) else ""


def _head_section(card: Scorecard, table: Optional[HeadTable], flat: dict[str, float],
                  comparison: Optional[Comparison]) -> list[str]:
    """The per-head scores, their chance levels and (with random models) the differences, and the
    composition scores, as markdown."""
    if table is None:
        return []
    random = table.random is not None
    lines = ["", "## Heads", "", f"{table.describe(card.head_ablation)}.", "",
             "A head is named for a score at least 0.3 of the way from its chance level to 1 whose interval "
             "lies above " + ("the random models' interval." if random else "the chance level's interval."), ""]
    head = "| head | score | this run [interval] | chance |"
    rule = "|---|---|---|---|"
    if random:
        head += f" random init, {table.n_random} model{'s' * (table.n_random != 1)} [interval] | difference [interval] |"
        rule += "---|---|"
    lines += [head, rule]
    for l, h in table.heads():
        for name in SCORES:
            label = ROLE_NAMES[name] + (f" (= {ROLE_NAMES[table.same_as[name]]})" if name in table.same_as else "")
            row = (f"| {head_name(l, h)} | {label} | {_fmt(float(table.value[name][l, h]))}"
                   f"{_pair(table.interval[name][l, h])} | {_fmt(table.chance[name])} |")
            if random:
                row += (f" {_fmt(float(table.random[name][l, h]))}{_pair(table.random_interval[name][l, h])} |"
                        f" {_fmt(float(table.difference[name][l, h]))}{_pair(table.difference_interval[name][l, h])} |")
            lines.append(row)
    pairs = [k for k in flat if k.startswith("composition.")]
    if pairs:
        lines += ["", "Composition scores (TransformerLens, from the weights):", "",
                  "| heads | mode | this run |" + (" random init (mean) |" if comparison is not None else ""),
                  "|---|---|---|" + ("---|" if comparison is not None else "")]
        for key in pairs:
            mode, pair = key.split(".", 2)[1:]
            row = f"| {pair} | {mode} | {_fmt(flat[key])} |"
            if comparison is not None:
                spread = comparison.spreads.get(key)
                row += f" {_fmt(spread.mean) if spread else 'n/a'} |"
            lines.append(row)
    return lines


def _score_table(card: Scorecard, flat: dict[str, float], comparison: Optional[Comparison]) -> list[str]:
    head = "| score | meaning | this run [interval] |"
    rule = "|---|---|---|"
    if comparison is not None:
        head += " random init: mean ± std [interval of mean] |"
        rule += "---|"
    lines = [head, rule]
    for key in HEADLINE:
        if key not in flat:
            continue
        row = f"| `{key}`{direction(key)} | {MEANING[key]} | {_cell(card, flat, key)} |"
        if comparison is not None:
            s = comparison.spreads.get(key)
            row += (f" {_fmt(s.mean)} ± {_fmt(s.std)} [{_fmt(s.interval[0])}, {_fmt(s.interval[1])}] |" if s else " |")
        lines.append(row)
    lines += ["", ARROWS, "All scores, with every hook and head, are in `scores.json`."]
    return lines


def write_compare_report(out: Path, comparison: RunComparison, sources: tuple[str, str]) -> Path:
    """Write ``scores.json``, ``report.md`` and figures comparing two runs."""
    from probes.plots import plot_bars

    a, b = comparison.a, comparison.b
    na, nb = comparison.names

    def build(tmp: Path) -> None:
        fa, fb = a.flat(), b.flat()
        keys = [k for k in HEADLINE if k in fa and k in fb and k != "bayes_accuracy"]
        rows = [(k, fa[k], _interval(a, k), fb[k], _interval(b, k)) for k in keys]
        # The runs by letter and path, each accuracy against its own task's Bayes accuracy: two runs at
        # Bayes on different tasks (0.5 and 0.7) must not read as one better than the other.
        plot_bars(rows, (f"{na}: {sources[0]}", f"{nb}: {sources[1]}"), tmp / "comparison.png",
                  f"{na} ({Path(sources[0]).name}) against {nb} ({Path(sources[1]).name})",
                  references={"accuracy": (fa.get("bayes_accuracy"), fb.get("bayes_accuracy"))},
                  reference_label="Bayes accuracy of each run's task")
        payload = {na: _payload(a, fa, sources[0]), nb: _payload(b, fb, sources[1]),
                   "difference": nest_scores({k: fb[k] - fa[k] for k in fa if k in fb})}
        (tmp / SCORES_FILE).write_text(json.dumps(jsonable(payload), indent=1))
        lines = ["# Comparison report", "", f"- {na}: `{sources[0]}`, task {a.task}, {a.model}",
                 f"- {nb}: `{sources[1]}`, task {b.task}, {b.model}", "", "## What the probes find", ""]
        for name in (na, nb):
            lines += [f"**{name}**", ""] + [f"- {s}" for s in payload[name]["findings"]] + [""]
        lines += ["## Scores", "", f"| score | meaning | {na} [interval] | {nb} [interval] | {nb} - {na} |",
                  "|---|---|---|---|---|"]
        for key in HEADLINE:
            if key in fa and key in fb:
                lines.append(f"| `{key}`{direction(key)} | {MEANING[key]} | {_cell(a, fa, key)} | "
                             f"{_cell(b, fb, key)} | {_fmt(fb[key] - fa[key])} |")
        figures = [("comparison.png", f"{na} against {nb}",
                    f"Each score of the two runs side by side, with intervals over test {a.sample_name}s; the arrow "
                    "after a score's name says which way learning the task moves it. Each run's accuracy is to be "
                    "read against the Bayes accuracy of its own task (dashed marks): two runs at their tasks' Bayes "
                    "accuracies have both learned, however far apart their accuracies are.")]
        figures += _figures(a, tmp, "a_") + _figures(b, tmp, "b_")
        figures = [(f, f"{t} ({na if f.startswith('a_') else nb})" if f[:2] in ("a_", "b_") else t, c)
                   for f, t, c in figures]
        lines += ["", ARROWS, "", "## Figures", ""] + _figure_markdown(figures)
        (tmp / REPORT_FILE).write_text("\n".join(lines))

    return atomic_directory(out, build)


# ------------------------------------------------------------------------------ groups of runs
#: Titles of the figures of a group's score families (:func:`probes.group.families`).
FAMILY_TITLES = {"overview": "Accuracy and attention on the parents", "attention": "Attention scores",
                 "patching": "Activation and attribution patching", "transition": "The value map against Pi",
                 "heads": "Each head's attention scores", "ablation": "Each head's ablation loss increase"}


def estimate_text(e: Any, digits: int = 3) -> str:
    """``mean [low, high]`` of a :class:`probes.stats.Estimate`; ``[undefined]`` where it has no interval."""
    lo, hi = e.interval
    return f"{_fmt(e.mean, digits)} " + (f"[{_fmt(lo, digits)}, {_fmt(hi, digits)}]" if math.isfinite(lo)
                                         else "[undefined]")


def _meaning(key: str) -> str:
    from probes.group import ABLATION

    if key.startswith("heads."):
        name = key.rsplit(".", 1)[1]
        return ("loss increase (nats) of mean-ablating the head" if name == ABLATION
                else f"attention on the {ROLE_NAMES.get(name, name)} position(s)")
    return MEANING.get(key, "")


def _group_header(group: Any, source: str) -> list[str]:
    runs = ", ".join(f"`{s}`" + (f" (seed {seed})" if seed is not None else "")
                     for s, seed in zip(group.sources, group.seeds))
    walks = sorted(set(group.n_walks))
    lines = [f"- group: `{source}`", f"- runs ({group.n_runs}): {runs}", f"- task: {group.description or group.task}",
             f"- model: {group.model}",
             f"- {group.sample_name}s probed per run: {', '.join(map(str, walks))} (each run on its own test "
             f"{group.sample_name}s)"]
    if group.n_runs >= 2:
        lines.append(f"- intervals: {100 * group.config.confidence:.0f}% bootstrap over the runs "
                     f"({group.resamples} resamples of the {group.n_runs} runs): where the mean would move with "
                     "other seeds")
    else:
        lines.append("- intervals: undefined (one run: an interval over runs needs two or more)")
    if group.baseline_seeds is not None:
        lines.append(f"- random baseline: {len(group.baseline_seeds[0])} random-initialised models per run (seeds "
                     "no other run uses), on that run's test walks; a run's random value is their mean, and "
                     "trained - random is paired run by run")
    return lines + [""]


def _group_figures(keys: list[str], series: list[tuple[str, dict]], tmp: Path, what: str) -> list[tuple[str, str, str]]:
    from probes.group import families, score_label
    from probes.plots import plot_across_runs

    figures = []
    for family, members in families(keys).items():
        name = f"runs_{family}.png"
        title = f"{FAMILY_TITLES.get(family, family)}: {what}"
        caption = plot_across_runs(members, series, tmp / name, title, {k: score_label(k) for k in members},
                                   unit="nats" if family == "ablation" else "score")
        figures.append((name, FAMILY_TITLES.get(family, family), caption))
    return figures


def group_series(group: Any, keys: list[str]) -> dict:
    """``{key: (values, mean, interval)}`` of a group's trained runs, for :func:`probes.plots.plot_across_runs`."""
    return {k: (group.scores[k].trained.values, group.scores[k].trained.mean, group.scores[k].trained.interval)
            for k in keys}


def write_group_report(out: Path, group: Any, source: str) -> Path:
    """Write ``scores.json``, ``report.md`` and a figure per score family of a group of runs
    (:class:`probes.group.GroupScores`)."""
    from probes.group import score_label
    from probes.scoring import findings

    def build(tmp: Path) -> None:
        keys = group.keys()
        series = [(f"trained ({group.n_runs} runs)", "one run", group_series(group, keys))]
        random = group.baseline_seeds is not None
        if random:
            per_model = {k: [v.get(k, math.nan) for models in group.random_values for v in models] for k in keys}
            series.append((f"random init ({len(group.baseline_seeds[0])} models per run)", "one random model",
                           {k: (per_model[k], group.scores[k].random.mean, group.scores[k].random.interval)
                            for k in keys if k != "bayes_accuracy"}))
        figures = _group_figures(keys, series, tmp, f"{group.n_runs} runs"
                                 + (" against random-initialised models" if random else ""))
        payload = {"source": source, **group.to_json(), "probe_config": group.config.to_dict()}
        means = {k: s.trained.mean for k, s in group.scores.items()}
        accuracy = group.scores["accuracy"].trained.interval if "accuracy" in group.scores else None
        payload["findings"] = findings(means, group.kind, accuracy)
        (tmp / SCORES_FILE).write_text(json.dumps(jsonable(payload), indent=1))
        lines = ["# Probe report: a group of runs", ""] + _group_header(group, source)
        lines += ["## What the probes find (read from the means over runs)", ""]
        lines += [f"- {s}" for s in payload["findings"]] + ["", "## Scores", ""]
        head = "| score | meaning | mean [interval] | per run |"
        rule = "|---|---|---|---|"
        if random:
            head += " random init [interval] | trained - random [interval] |"
            rule += "---|---|"
        lines += [head, rule]
        for key in keys:
            s = group.scores[key]
            row = (f"| `{score_label(key)}`{direction(key)} | {_meaning(key)} | {estimate_text(s.trained)} | "
                   f"{', '.join(_fmt(v) for v in s.trained.values)} |")
            if random:
                row += f" {estimate_text(s.random)} | {estimate_text(s.difference)} |"
            lines.append(row)
        lines += ["", ARROWS, "Every score of every run (each hook's and head's) is in `scores.json`, with its "
                  "per-run values.", "", "## Figures", ""] + _figure_markdown(figures)
        (tmp / REPORT_FILE).write_text("\n".join(lines))

    return atomic_directory(out, build)


def write_group_compare_report(out: Path, comparison: Any, sources: tuple[str, str]) -> Path:
    """Write ``scores.json``, ``report.md`` and a figure per score family comparing two groups of runs
    (:class:`probes.group.GroupComparison`)."""
    from probes.group import score_label

    a, b = comparison.a, comparison.b
    na, nb = comparison.names

    def build(tmp: Path) -> None:
        keys = comparison.keys()
        series = [(f"{na}: {Path(sources[0]).name} ({a.n_runs} runs)", "one run", group_series(a, keys)),
                  (f"{nb}: {Path(sources[1]).name} ({b.n_runs} runs)", "one run", group_series(b, keys))]
        figures = _group_figures(keys, series, tmp, f"{na} against {nb}")
        payload = {"sources": {na: sources[0], nb: sources[1]}, **comparison.to_json(),
                   "probe_config": a.config.to_dict()}
        (tmp / SCORES_FILE).write_text(json.dumps(jsonable(payload), indent=1))
        lines = ["# Comparison report: two groups of runs", "", f"## {na}", ""] + _group_header(a, sources[0])
        lines += [f"## {nb}", ""] + _group_header(b, sources[1])
        lines += [f"The difference {nb} - {na} is of the two means; its interval resamples each group's runs on "
                  "its own (the runs of two groups are not paired).", "", "## Scores", "",
                  f"| score | meaning | {na} mean [interval] | {nb} mean [interval] | {nb} - {na} [interval] |",
                  "|---|---|---|---|---|"]
        for key in keys:
            lines.append(f"| `{score_label(key)}`{direction(key)} | {_meaning(key)} | "
                         f"{estimate_text(a.scores[key].trained)} | {estimate_text(b.scores[key].trained)} | "
                         f"{estimate_text(comparison.difference[key])} |")
        lines += ["", ARROWS, "", "## Figures", ""] + _figure_markdown(figures)
        (tmp / REPORT_FILE).write_text("\n".join(lines))

    return atomic_directory(out, build)
