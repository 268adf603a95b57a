"""``docs/discussion.md`` quotes only numbers the reproduction recorded, so it cannot drift from them.

Each section (``## Figure F``) may cite a number that is

* a measured value of one of figure F's claims in ``docs/reproduction/results.json``, rounded as
  cited (to the digits written; a rounded value keeps at least two significant digits, so that 1
  does not pass for 0.511), a percentage being that value times 100;
* a number written in one of those claims or their expected values (a setting the spec states);
* the final value of a run figure F trains, in ``docs/reproduction/runs.json``.

Figure and theorem references (``Fig 7``, ``Figs 11, 12 and 13``, ``Theorem 4.1``), code spans and
numbers inside words (``theorem31``) are not citations.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "discussion.md"
REPRODUCTION = ROOT / "docs" / "reproduction"

#: A number standing alone (not part of a word, a path or an exponent such as r^2), with its % sign.
NUMBER = re.compile(r"(?<![\w.^/~])(\d+(?:\.\d+)?(?:e-?\d+)?)(%?)(?![\w^])")
#: What is not a citation: code spans, link targets, figure and theorem references.
NOT_CITED = (re.compile(r"`[^`]*`"), re.compile(r"\]\([^)]*\)"),
             re.compile(r"\b(?:Figs?|Figures?)\.?\s+\d+(?:\s*(?:,|and|to|or)\s*\d+)*"),
             re.compile(r"\bTheorem\s+\d+(?:\.\d+)?"))


def citations(text: str) -> list[tuple[str, bool]]:
    """The numbers a text cites, each as written, and whether it is a percentage."""
    for pattern in NOT_CITED:
        text = pattern.sub(" ", text)
    return [(m.group(1), m.group(2) == "%") for m in NUMBER.finditer(text)]


def sections(text: str) -> dict[str, str]:
    """The doc's sections by figure id; the opening, before the first section, under ""."""
    out, current = {"": []}, ""
    for line in text.splitlines():
        heading = re.fullmatch(r"## Figure (\S+)", line.strip())
        if heading:
            current = heading.group(1)
            assert current not in out, f"two sections for figure {current}"
            out[current] = []
        elif not line.startswith("#"):
            out[current].append(line)
    return {k: "\n".join(v) for k, v in out.items()}


def recorded(figure: str, results: list[dict], runs: list[dict]) -> tuple[set[float], list[float]]:
    """(numbers written in figure's claims, numbers measured for it) from results.json and runs.json."""
    written, measured = set(), []
    for claim in (c for c in results if c["figure"] == figure):
        written |= {float(n) for n, _ in citations(claim["claim"] + " " + claim["expected"])}
        values = claim["measured"] if isinstance(claim["measured"], list) else [claim["measured"]]
        measured += [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    for run in runs:
        if any(use.split(":")[0] == figure for use in run["used_by"]):
            measured += [float(v) for v in run["final"].values()
                         if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return written, measured


def matches(cited: str, percent: bool, written: set[float], measured: list[float]) -> bool:
    value = float(cited)
    if value in written:
        return True
    scale = 100.0 if percent else 1.0
    if any(m * scale == value for m in measured):
        return True
    if "e" in cited:  # a setting, written as the spec writes it: never a rounding
        return False
    digits = len(cited.split(".")[1]) if "." in cited else 0
    significant = len(cited.replace(".", "").lstrip("0"))
    return significant >= 2 and any(abs(m * scale - value) <= 0.5 * 10 ** -digits + 1e-9 for m in measured)


@pytest.fixture(scope="module")
def recorded_numbers():
    results = json.loads((REPRODUCTION / "results.json").read_text())
    runs = json.loads((REPRODUCTION / "runs.json").read_text())["runs"]
    return results, runs


def test_every_number_in_the_discussion_is_one_the_reproduction_recorded(recorded_numbers):
    results, runs = recorded_numbers
    parts = sections(DOC.read_text())
    assert set(parts) > {""} and all(any(c["figure"] == f for c in results) for f in parts if f), \
        "every section is about a figure of results.json"
    unmatched = []
    for figure, text in parts.items():
        written, measured = recorded(figure, results, runs) if figure else (set(), [])
        unmatched += [(figure or "opening", n + "%" * p) for n, p in citations(text)
                      if not matches(n, p, written, measured)]
    assert not unmatched, f"numbers not recorded for their figure: {unmatched}"


def test_the_citation_check_tells_a_recorded_number_from_one_that_is_not():
    results = [{"figure": "6", "claim": "p = 1 stays below 100% within 1000 steps", "expected": "≤ 0.999",
                "measured": 0.2466}]
    runs = [{"used_by": ["6:run", "13:run"], "final": {"test_accuracy": 0.511, "step": 1000}},
            {"used_by": ["7:other"], "final": {"test_accuracy": 0.9}}]
    written, measured = recorded("6", results, runs)
    for cited, percent in (("0.25", False), ("0.247", False), ("0.2466", False), ("24.7", True), ("0.511", False),
                           ("0.51", False), ("1000", False), ("100", True), ("0.999", False)):
        assert matches(cited, percent, written, measured), cited
    for cited, percent in (("0.2", False), ("0.246", False), ("0.26", False), ("0.5", False), ("2", False),
                           ("0.9", False), ("0.512", False), ("24", True)):
        assert not matches(cited, percent, written, measured), cited
    assert citations("Figs 11, 12 and 13 show `lr 0.01` at 0.22% (r^2 = 30, theorem31, Theorem 4.1, x~_1)") == [
        ("0.22", True), ("30", False)]


def test_the_readme_is_short_its_commands_come_first_and_ci_runs_its_test_command():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 8 * 1024
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    commands = [line for line in blocks[0].splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2 and all(c.startswith("bash scripts/setup.sh && ") for c in commands)
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.startswith("bash ")]
    assert ci == [commands[1]]
    assert not re.search(r"^[A-Z][A-Z_]+$|\b[A-Z]{2,}_[A-Z_]{2,}\b", readme, re.M), "a placeholder is left"
