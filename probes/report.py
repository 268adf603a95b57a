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

from probes.scorecard import HEADLINE, MEANING, Comparison, RunComparison, Scorecard, findings, nest
from rwinterp.cli import _json_safe
from rwinterp.atomic import atomic_directory as _atomic_directory

SCORES_FILE = "scores.json"
REPORT_FILE = "report.md"
#: What a report directory holds (its marker first): an existing --out is replaced only if it holds no more.
REPORT_FILES = (SCORES_FILE, REPORT_FILE, "*.png")


def atomic_directory(target: Path, build: Callable[[Path], None]) -> Path:
    """Run ``build(tmp)`` in a fresh temporary directory, then move it to ``target``."""
    return _atomic_directory(target, build, "report", REPORT_FILES)


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
    under ``baseline`` (means over seeds), with their spread under ``baseline_spread``."""
    out: dict[str, Any] = dict(card.scores())
    if comparison is not None:
        out["baseline"] = nest(comparison.baseline_means())
        out["baseline_spread"] = nest({k: {"std": s.std, "ci_low": s.ci_low, "ci_high": s.ci_high}
                                       for k, s in comparison.spreads.items()})
        out["baseline_seeds"] = comparison.seeds
    return out


def _payload(card: Scorecard, flat: dict[str, float], source: str) -> dict[str, Any]:
    return {
        "source": source,
        "task": card.task,
        "model": card.model,
        "kind": card.kind,
        "n_walks": card.n_walks,
        "probe_config": card.config.to_dict(),
        "scores": nest(flat),
        "intervals": nest({k: list(v) for k, v in card.intervals.items()}),
        "findings": findings(flat, card.kind),
    }


def _figures(card: Scorecard, tmp: Path, prefix: str = "") -> list[tuple[str, str, str]]:
    """Draw one scorecard's figures; returns ``(file, title, caption)``."""
    from probes.plots import plot_attention, plot_patching, plot_transition

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


def write_probe_report(out: Path, card: Scorecard, source: str, comparison: Optional[Comparison] = None) -> Path:
    """Write ``scores.json``, ``report.md`` and the figures of one run's scorecard."""
    from probes.plots import plot_bars

    def build(tmp: Path) -> None:
        flat = card.flat()
        figures = _figures(card, tmp)
        payload = _payload(card, flat, source)
        if comparison is not None:
            rows = [(k, flat.get(k, math.nan), _interval(card, k), comparison.spreads[k].mean,
                     (comparison.spreads[k].ci_low, comparison.spreads[k].ci_high))
                    for k in HEADLINE if k in comparison.spreads and k != "bayes_accuracy"]
            plot_bars(rows, ("trained", f"random init ({len(comparison.seeds)} seeds)"),
                      tmp / "trained_vs_random.png", "trained model against random-initialised models")
            figures.append(("trained_vs_random.png", "Trained against random-initialised models",
                            f"Each score for this run (with its interval over test {card.sample_name}s) beside the "
                            "mean over random-initialised models of the same architecture (interval over seeds). "
                            "Learning the task shows as scores far from the random ones."))
            payload["baseline"] = {
                "kind": "random", "seeds": comparison.seeds,
                **{stat: nest({k: getattr(s, stat) for k, s in comparison.spreads.items()})
                   for stat in ("mean", "std", "ci_low", "ci_high")},
                "values": nest({k: s.values for k, s in comparison.spreads.items()}),
            }
        (tmp / SCORES_FILE).write_text(json.dumps(_json_safe(payload), indent=1))
        lines = ["# Probe report", ""] + _header(card, source) + ["## What the probes find", ""]
        lines += [f"- {s}" for s in payload["findings"]] + ["", "## Scores", ""]
        lines += _score_table(card, flat, comparison) + ["", "## Figures", ""] + _figure_markdown(figures)
        (tmp / REPORT_FILE).write_text("\n".join(lines))

    return atomic_directory(out, build)


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
        row = f"| `{key}` | {MEANING[key]} | {_cell(card, flat, key)} |"
        if comparison is not None:
            s = comparison.spreads.get(key)
            row += (f" {_fmt(s.mean)} ± {_fmt(s.std)} [{_fmt(s.ci_low)}, {_fmt(s.ci_high)}] |" if s else " |")
        lines.append(row)
    lines += ["", "All scores, with every hook and head, are in `scores.json`."]
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
        plot_bars(rows, (na, nb), tmp / "comparison.png", f"{na} against {nb}")
        payload = {na: _payload(a, fa, sources[0]), nb: _payload(b, fb, sources[1]),
                   "difference": nest({k: fb[k] - fa[k] for k in fa if k in fb})}
        (tmp / SCORES_FILE).write_text(json.dumps(_json_safe(payload), indent=1))
        lines = ["# Comparison report", "", f"- {na}: `{sources[0]}`, task {a.task}, {a.model}",
                 f"- {nb}: `{sources[1]}`, task {b.task}, {b.model}", "", "## What the probes find", ""]
        for name in (na, nb):
            lines += [f"**{name}**", ""] + [f"- {s}" for s in payload[name]["findings"]] + [""]
        lines += ["## Scores", "", f"| score | meaning | {na} [interval] | {nb} [interval] | {nb} - {na} |",
                  "|---|---|---|---|---|"]
        for key in HEADLINE:
            if key in fa and key in fb:
                lines.append(f"| `{key}` | {MEANING[key]} | {_cell(a, fa, key)} | {_cell(b, fb, key)} | "
                             f"{_fmt(fb[key] - fa[key])} |")
        figures = [("comparison.png", f"{na} against {nb}",
                    f"Each score of the two runs side by side, with intervals over test {a.sample_name}s.")]
        figures += _figures(a, tmp, "a_") + _figures(b, tmp, "b_")
        figures = [(f, f"{t} ({na if f.startswith('a_') else nb})" if f[:2] in ("a_", "b_") else t, c)
                   for f, t, c in figures]
        lines += ["", "## Figures", ""] + _figure_markdown(figures)
        (tmp / REPORT_FILE).write_text("\n".join(lines))

    return atomic_directory(out, build)
