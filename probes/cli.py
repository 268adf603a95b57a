"""``rwinterp probe RUN_DIR --out REPORT_DIR`` and ``rwinterp compare RUN_A RUN_B --out DIR``.

Heavy imports (TransformerLens, plotting) happen inside the handlers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from rwinterp.cli import command, print_json
from rwinterp.errors import require

#: The most random-initialised models a --baseline may hold (each is built and probed in full).
MAX_SEEDS = 1000


def _probe_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("probing")
    g.add_argument("--walks", type=int, default=None,
                   help="probe on the first N of the run's test walks (default: all of them)")
    g.add_argument("--seed", type=int, default=0, help="seeds the corrupted walks and the bootstrap (default 0)")
    g.add_argument("--bootstrap", type=int, default=200, help="bootstrap resamples for intervals (default 200)")
    g.add_argument("--gradient-walks", type=int, default=None,
                   help="walks used for gradient x input attribution (default 100, or all if fewer; a "
                        "population run attributes every walk)")
    parser.add_argument("--json", action="store_true", help="print the scores as one JSON object on stdout")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


@command("probe", "probe a trained run: attention, activation patching, V against Pi, with a report")
def _probe_command(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    parser.add_argument("run", metavar="RUN_DIR", help="a run directory written by `rwinterp train --out`")
    parser.add_argument("--out", required=True, metavar="REPORT_DIR", help="write the report here")
    parser.add_argument("--baseline", choices=["random"], default=None,
                        help="compare with random-initialised models of the same architecture")
    parser.add_argument("--seeds", type=int, default=None, help="with --baseline: random models in it (default 5)")
    _probe_arguments(parser)
    return _probe


def _config(args: argparse.Namespace) -> Any:
    from probes.config import ProbeConfig

    require(args.walks is None or args.walks >= 2, f"--walks must be >= 2, got {args.walks}")
    given = {} if args.gradient_walks is None else {"gradient_walks": args.gradient_walks}
    return ProbeConfig(seed=args.seed, bootstrap=args.bootstrap, progress=False if (args.no_progress or args.json)
                       else None, **given)


def _load(path: str, args: argparse.Namespace) -> tuple[Any, Any]:
    """The run and the test data it is probed on; options the data cannot honour are refused."""
    from probes.targets import restrict, run_test_walks
    from rwinterp.runs import load_run

    run = load_run(path)
    data = run_test_walks(run)
    name = run.task.sample_name
    require(args.walks is None or args.walks <= len(data),
            f"--walks {args.walks}, but {path} has {len(data)} test {name}s")
    data = restrict(data, args.walks)
    if args.gradient_walks is not None:
        require(data.weights is None, f"--gradient-walks does not apply to {path}: its test data is the whole "
                                      f"population, and every {name} of it is attributed")
        require(args.gradient_walks <= len(data),
                f"--gradient-walks {args.gradient_walks}, but {path} is probed on {len(data)} test {name}s")
    return run, data


def _check_out(path: str, runs: Sequence[str]) -> None:
    """A bad --out is refused before any probing, and so is one inside a run directory (the run
    would then hold what a run does not, and could not be replaced by training again)."""
    from probes.report import REPORT_FILES
    from rwinterp.atomic import check_target

    target = check_target(path, "report", REPORT_FILES).resolve()
    for run in runs:
        require(run == "" or not target.is_relative_to(Path(run).resolve()),
                f"--out {path} lies inside the run directory {run}; write the report elsewhere")


def _probe(args: argparse.Namespace) -> int:
    require(args.seeds is None or args.baseline is not None, "--seeds needs --baseline random")
    seeds = 5 if args.seeds is None else args.seeds
    require(1 <= seeds <= MAX_SEEDS, f"--seeds must be in [1, {MAX_SEEDS}], got {seeds}")
    _check_out(args.out, [args.run])
    config = _config(args)
    from probes.report import summary_json, write_probe_report
    from probes.scorecard import compare_to_random, scorecard

    run, data = _load(args.run, args)
    card = scorecard(run.model, run.task, data, config)
    comparison = None
    if args.baseline == "random":
        comparison = compare_to_random(run.model, run.task, data, seeds, config, trained=card)
    out = write_probe_report(args.out, card, str(args.run), comparison)
    if args.json:
        print_json({**summary_json(card, comparison), "report": str(out)})
        return 0
    flat = card.flat()
    print(f"run         {args.run}  ({run.task.describe()}, {len(data)} {run.task.sample_name}s)")
    for line in card.findings():
        print(f"  - {line}")
    keys = ("accuracy", "bayes_accuracy", "parent_attention", "parent_argmax_rate", "patching.parent_effect",
            "patching.localization", "patching.necessity", "patching.sufficiency", "transition.distance",
            "transition.cosine")
    means = comparison.baseline_means() if comparison else {}
    for key in keys:
        base = f"   random {_number(means[key])}" if key in means else ""
        print(f"{key:28s} {_number(flat.get(key))}{base}")
    print(f"report      {out / 'report.md'}")
    sys.stdout.flush()
    return 0


def _number(value: float | None) -> str:
    return f"{value:8.4f}" if value is not None and value == value else f"{'n/a':>8s}"


@command("compare", "compare the probe scores of two runs side by side")
def _compare_command(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    parser.add_argument("run_a", metavar="RUN_A", help="first run directory")
    parser.add_argument("run_b", metavar="RUN_B", help="second run directory")
    parser.add_argument("--out", required=True, metavar="DIR", help="write the comparison report here")
    _probe_arguments(parser)
    return _compare


def _compare(args: argparse.Namespace) -> int:
    _check_out(args.out, [args.run_a, args.run_b])
    config = _config(args)
    from probes.report import write_compare_report
    from probes.scorecard import compare, scorecard

    cards, sources = [], []
    for path in (args.run_a, args.run_b):
        run, data = _load(path, args)
        cards.append(scorecard(run.model, run.task, data, config))
        sources.append(f"{path}  ({run.task.describe()}, {len(data)} {run.task.sample_name}s)")
    result = compare(cards[0], cards[1], ("A", "B"))
    out = write_compare_report(args.out, result, (str(args.run_a), str(args.run_b)))
    if args.json:
        print_json({"A": cards[0].scores(), "B": cards[1].scores(),
                    "difference": {k: d for k, _, _, d in result.rows()}, "report": str(out)})
        return 0
    for name, source in zip("AB", sources):
        print(f"{name:11s} {source}")
    if cards[0].task != cards[1].task:
        print("            (the runs' tasks differ: each is scored on its own task's test data)")
    print(f"{'score':40s} {'A':>8s} {'B':>8s} {'B - A':>8s}")
    for key, a, b, d in result.rows():
        if key.count(".") <= 1:
            print(f"{key:40s} {_number(a)} {_number(b)} {_number(d)}")
    print(f"report      {out / 'report.md'}")
    return 0
