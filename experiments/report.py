"""Write a reproduction's ``results.json``, ``runs.json`` and ``REPRODUCTION.md``.

``results.json`` is the list of claims, each ``{figure, claim, expected, measured, holds, note,
error}``. ``REPRODUCTION.md`` opens with one table of every claim with its figure beside it, then
gives each figure with its caption and its claims; a claim that does not hold keeps its note saying
why and what was tried.
"""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

from experiments.spec import format_measured


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one), else the machine type."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _link(fig: Any) -> str:
    """The figure's id, linked to its image when it has one."""
    return f"[{fig.spec.id}]({fig.image})" if fig.image else fig.spec.id


def markdown(rep: Any) -> str:
    claims = rep.claims
    held = sum(c.holds for c in claims)
    lines = [
        "# Reproduction of Shi and Cao, \"Towards Understanding Transformers in Learning Random Walks\"",
        "",
        "| figure | claims that hold | why the others do not |",
        "|---|---|---|",
    ]
    for fig in rep.figures:
        n_held = sum(c.holds for c in fig.claims)
        verdict = "all " + str(n_held) if n_held == len(fig.claims) else f"**{n_held} of {len(fig.claims)}**"
        why = "" if n_held == len(fig.claims) else _cell(fig.spec.shortfall or "see the claims' notes below")
        lines.append(f"| {_link(fig)}: {_cell(fig.spec.title)} | {verdict} | {why} |")
    lines += [
        "",
        f"{held} of {len(claims)} claims hold"
        + (" (REDUCED MODE: small sizes, claims not expected to hold)" if rep.reduced else "") + ".",
        f"Total time {rep.seconds:.1f} s on {platform.machine()} ({cpu_name()}) with {os.cpu_count()} CPUs, "
        f"{rep.jobs} training process{'es' if rep.jobs > 1 else ''}"
        + (f" (load average at start: {rep.load[0]:.2f} over 1 min, {rep.load[1]:.2f} over 5 min)."
           if rep.load else "."),
        "Regenerate with `rwinterp reproduce all --out DIR`. What is reproducible: the verdicts, and the values to "
        "a tolerance (between two AMD EPYC models, every value agreed to 1e-10 relative, most to the last digit); "
        "bit for bit only on one machine and code path (another CPU's arithmetic kernels round differently, and "
        "the runs that break a symmetry amplify that round-off). The discussion of each figure is in "
        "`docs/discussion.md`.",
    ]
    lines += [
        "",
        "## Every claim",
        "",
        "| figure | claim | expected | measured | holds |",
        "|---|---|---|---|---|",
    ]
    for fig in rep.figures:
        link = _link(fig)
        for c in fig.claims:
            lines.append(f"| {link} | {_cell(c.claim)} | {_cell(c.expected)} | {_cell(format_measured(c.measured))} | "
                         f"{'**yes**' if c.holds else '**NO**'} |")
    for fig in rep.figures:
        spec = fig.spec
        heading = f"Figure {spec.id}: {spec.title}" if spec.id.isdigit() else spec.title
        lines += ["", f"## {heading}", ""]
        if fig.image:
            lines += [f"![{heading}]({fig.image})", ""]
        lines += [spec.caption, ""]
        if fig.draw_errors:
            lines += ["Panels that could not be drawn:", ""] + [f"* {e}" for e in fig.draw_errors] + [""]
        if fig.claims:
            lines += ["| claim | expected | measured | holds | note |", "|---|---|---|---|---|"]
            for c in fig.claims:
                lines.append(f"| {_cell(c.claim)} | {_cell(c.expected)} | {_cell(format_measured(c.measured))} | "
                             f"{'yes' if c.holds else '**NO**'} | {_cell(c.note)} |")
        lines.append(f"\n({fig.seconds:.1f} s to evaluate and draw)")
    lines += ["", "## Runs", "", "| run (figure:name) | task | seconds | test accuracy | error |",
              "|---|---|---|---|---|"]
    for r in rep.runs:
        task = ", ".join(f"{k}={v}" for k, v in r["task"].items() if not isinstance(v, list))
        acc = r["final"].get("test_accuracy")
        lines.append(f"| {', '.join(r['used_by'])} | {task} | {r['seconds']} | {format_measured(acc)} | "
                     f"{r['error'] or ''} |")
    return "\n".join(lines) + "\n"


def write(rep: Any, out: Path) -> None:
    (out / "results.json").write_text(json.dumps([c.to_dict() for c in rep.claims], indent=1) + "\n")
    (out / "runs.json").write_text(json.dumps(
        {"reduced": rep.reduced, "seconds": rep.seconds, "jobs": rep.jobs, "load_average": rep.load, "runs": rep.runs},
        indent=1) + "\n")
    (out / "REPRODUCTION.md").write_text(markdown(rep))

