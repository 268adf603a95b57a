"""``rwinterp probe RUN_DIR --out REPORT_DIR`` and ``rwinterp compare RUN_A RUN_B --out DIR``.

Either also takes a group of runs (``rwinterp train --seeds ... --out G``; ``probe`` also several run
directories): each score is then the mean over the runs with a 95% interval over them, and with
``--baseline random`` the paired difference trained - random (:mod:`probes.group`).

Heavy imports (TransformerLens, plotting) happen inside the handlers.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from rwinterp.cli import Command, print_json
from rwinterp.errors import RwinterpError, require
from rwinterp.jsonable import jsonable

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


def _configure_probe(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", metavar="RUN_DIR", nargs="+",
                        help="a run directory written by `rwinterp train --out`; or a group of runs (the directory "
                             "`rwinterp train --seeds ... --out` writes), or several run directories of one task and "
                             "architecture: then each score is the mean over the runs with a 95%% bootstrap interval "
                             "over them")
    parser.add_argument("--out", required=True, metavar="REPORT_DIR", help="write the report here")
    parser.add_argument("--baseline", choices=["random"], default=None,
                        help="compare with random-initialised models of the same architecture")
    parser.add_argument("--baseline-models", type=int, default=None,
                        help="with --baseline: how many random models it holds (default 5; for a group, per run)")
    parser.add_argument("--seeds", default=None, help=argparse.SUPPRESS)  # the old name: refused, naming the new
    parser.add_argument("--over-training", action="store_true",
                        help="also score every checkpoint of the run (train --checkpoint-every): the test loss and "
                             "each head's scores against the step")
    _probe_arguments(parser)


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
    if getattr(args, "gradient_walks", None) is not None:
        require(data.weights is None, f"--gradient-walks does not apply to {path}: its test data is the whole "
                                      f"population, and every {name} of it is attributed")
        require(args.gradient_walks <= len(data),
                f"--gradient-walks {args.gradient_walks}, but {path} is probed on {len(data)} test {name}s")
    return run, data


def _check_out(path: str, runs: Sequence[str], what: str = "report", files: Optional[Sequence[str]] = None) -> None:
    """A bad --out is refused before any probing, and so is one inside a run directory (the run
    would then hold what a run does not, and could not be replaced by training again). ``what`` and
    ``files`` name what the directory holds (default: a probe report)."""
    from probes.report import REPORT_FILES
    from rwinterp.atomic import check_target

    target = check_target(path, what, REPORT_FILES if files is None else files).resolve()
    for run in runs:
        require(run == "" or not target.is_relative_to(Path(run).resolve()),
                f"--out {path} lies inside the run directory {run}; write the {what} elsewhere")


def _probe(args: argparse.Namespace) -> int:
    require(args.seeds is None, "--seeds lists the seeds of runs; the number of random models of a baseline is "
                                "--baseline-models")
    require(args.baseline_models is None or args.baseline is not None, "--baseline-models needs --baseline random")
    seeds = 5 if args.baseline_models is None else args.baseline_models
    require(1 <= seeds <= MAX_SEEDS, f"--baseline-models must be in [1, {MAX_SEEDS}], got {seeds}")
    runs, grouped = _runs(args.run)
    if len(runs) > 1 or grouped:
        return _probe_group(args, runs, seeds if args.baseline == "random" else 0)
    args.run = runs[0]
    _check_out(args.out, [args.run])
    config = _config(args)
    from probes.report import summary_json, write_probe_report
    from probes.scoring import compare_to_random, scorecard

    from rwinterp.runs import checkpoint_dirs

    checkpoints = checkpoint_dirs(args.run) if args.over_training else []
    require(not args.over_training or checkpoints,
            f"--over-training needs a run with checkpoints ({args.run} has none: train it with --checkpoint-every)")
    run, data = _load(args.run, args)
    card = scorecard(run.model, run.task, data, config)
    comparison = None
    if args.baseline == "random":
        comparison = compare_to_random(run.model, run.task, data, seeds, config, trained=card)
    curve = _over_training(run, checkpoints, data, config) if checkpoints else None
    out = write_probe_report(args.out, card, str(args.run), comparison, curve)
    if args.json:
        from probes.report import over_training_json

        extra = {"over_training": over_training_json(curve)} if curve is not None else {}
        print_json({**summary_json(card, comparison), **extra, "report": str(out)})
        return 0
    flat = card.flat()
    print(f"run         {args.run}  ({run.task.describe()}, {len(data)} {run.task.sample_name}s)")
    for line in (comparison.findings() if comparison else card.findings()):
        print(f"  - {line}")
    keys = ("accuracy", "bayes_accuracy", "parent_attention", "parent_argmax_rate", "patching.parent_effect",
            "attribution_patching.parent_share", "patching.localization", "patching.necessity",
            "patching.sufficiency", "transition.distance", "transition.cosine")
    means = comparison.baseline_means() if comparison else {}
    layer, head = card.attention.head
    where = (f"the query slot (position {run.task.seq_len})" if card.kind == "query"
             else f"each of the {card.attention.per_head.shape[-1]} predicting positions")
    print(f"(parent_attention and parent_argmax_rate: head L{layer}H{head}, the one that attends to the parents "
          f"most, from {where})")
    for key in keys:
        base = f"   random {_number(means[key])}" if key in means else ""
        print(f"{key:28s} {_number(flat.get(key))}{base}")
    if curve is not None:
        print(f"over training: {len(curve.steps)} checkpoints, steps {curve.steps[0]} to {curve.steps[-1]}; test loss "
              f"{float(curve.test_loss[0]):.4f} -> {float(curve.test_loss[-1]):.4f} (" +
              ", ".join(f"{k} {v:.4f}" for k, v in curve.references.items()) + ")")
        for name in ("previous_token", "induction"):
            L, H = curve.scores[name].shape[1:]
            rises = [f"L{layer}H{head} {curve.rise_step(name, layer, head)}" for layer in range(L) for head in range(H)]
            print(f"  {name} score rises (halfway from its first value to its last) at step: " + ", ".join(rises))
    print(f"report      {out / 'report.md'}")
    sys.stdout.flush()
    return 0


def _runs(paths: Sequence[str]) -> tuple[list[str], bool]:
    """The run directories that ``paths`` name (a run directory itself, a group's finished runs ``seed-S``), and
    whether a group was among them. A path that is neither, or a run named twice, is refused."""
    from rwinterp.runs import CONFIG_FILE, GROUP_FILE, is_group, read_group

    out: list[str] = []
    grouped = False
    for path in paths:
        require(str(path) != "", "not a run directory: the name is empty")
        if is_group(path):
            grouped = True
            index = read_group(path)
            finished = [str(Path(path) / entry["run"]) for entry in index["runs"] if entry["run"] is not None]
            require(finished, f"the group {path} holds no finished run")
            for entry in index["runs"]:
                if entry["run"] is None:
                    sys.stderr.write(f"rwinterp: seed {entry['seed']} of {path} did not finish training "
                                     f"({entry.get('error')}); it is left out\n")
            out += finished
        else:
            require(Path(path).is_dir(), f"not a run directory: {path} does not exist or is not a directory")
            require((Path(path) / CONFIG_FILE).is_file(), f"not a run directory nor a group of runs: {path} holds "
                                                          f"neither {CONFIG_FILE} nor {GROUP_FILE}")
            out.append(str(path))
    seen: dict[Path, str] = {}
    for run in out:
        where = Path(run).resolve()
        if where in seen:
            also = "" if seen[where] == run else f" (also as {seen[where]})"
            raise RwinterpError(f"the run {run} is named twice{also}")
        seen[where] = run
    return out, grouped


def _score_group(args: argparse.Namespace, runs: list[str], config: Any, baseline_models: int = 0) -> Any:
    """Load every run (refusing what its test data cannot honour) and score them as a group."""
    from probes.group import score_group

    loaded = [_load(path, args) for path in runs]
    return score_group([run.model for run, _ in loaded], [run.task for run, _ in loaded],
                       [data for _, data in loaded], config, baseline_models, sources=runs)


def _group_name(paths: Sequence[str]) -> str:
    return paths[0] if len(paths) == 1 else f"{len(paths)} run directories"


def _probe_group(args: argparse.Namespace, runs: list[str], baseline_models: int) -> int:
    """``rwinterp probe GROUP`` (or several runs): each score's mean over the runs with its interval."""
    require(not args.over_training, "--over-training scores the checkpoints of one run; give one run directory")
    _check_out(args.out, [*args.run, *runs])
    config = _config(args)
    from probes.report import write_group_report

    group = _score_group(args, runs, config, baseline_models)
    out = write_group_report(args.out, group, _group_name(args.run))
    if args.json:
        print_json({**group.to_json(), "report": str(out)})
        return 0
    _print_group_header(group, _group_name(args.run))
    random = group.baseline_seeds is not None
    columns = ["mean [95% interval]"] + (["random [95% interval]", "trained - random [95% interval]"]
                                         if random else [])
    print(f"{'score':40s} " + " ".join(f"{c:30s}" for c in columns))
    for key in group.keys():
        s = group.scores[key]
        cells = [s.trained] + ([s.random, s.difference] if random else [])
        print(f"{_label(key):40s} " + " ".join(f"{_estimate(e):30s}" for e in cells).rstrip())
    print(f"report      {out / 'report.md'}")
    sys.stdout.flush()
    return 0


def _print_group_header(group: Any, name: str, letter: str = "group") -> None:
    seeds = [str(s) for s in group.seeds if s is not None]
    walks = sorted(set(group.n_walks))
    print(f"{letter:11s} {name}: {group.n_runs} run{'s' if group.n_runs > 1 else ''}"
          + (f" (seed{'s' if len(seeds) > 1 else ''} {', '.join(seeds)})" if seeds else "")
          + f", {group.description}, {'/'.join(map(str, walks))} test {group.sample_name}s each")
    if group.n_runs < 2:
        print(f"{'':11s} intervals undefined: one run (an interval over runs needs two or more)")
    if group.baseline_seeds is not None:
        print(f"{'':11s} random baseline: {len(group.baseline_seeds[0])} random-initialised models per run")


def _label(key: str) -> str:
    from probes.group import score_label
    from probes.scoring import direction

    return score_label(key) + direction(key)


def _estimate(e: Any) -> str:
    from probes.report import estimate_text

    return estimate_text(e, digits=4)


def _over_training(run: Any, checkpoints: list, data: Any, config: Any) -> Any:
    """The head scores and test loss at every checkpoint of ``run`` and at its end."""
    from probes.heads import heads_over_training
    from rwinterp.runs import load_run

    final = run.history[-1]["step"] if run.history else None
    models = ((step, load_run(path).model) for step, path in checkpoints)
    tail = [] if final is None or final in {step for step, _ in checkpoints} else [(final, run.model)]
    return heads_over_training([*models, *tail], run.task, data, config)


def _number(value: float | None) -> str:
    return f"{value:8.4f}" if value is not None and value == value else f"{'n/a':>8s}"


def _configure_compare(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_a", metavar="RUN_A", help="first run directory, or group of runs (`train --seeds`)")
    parser.add_argument("run_b", metavar="RUN_B", help="second run directory, or group of runs: with a group, each "
                                                       "score is the mean over its runs, with a 95%% interval, and "
                                                       "B - A the difference of the means")
    parser.add_argument("--out", required=True, metavar="DIR", help="write the comparison report here")
    _probe_arguments(parser)


def _compare(args: argparse.Namespace) -> int:
    require(Path(args.run_a).resolve() != Path(args.run_b).resolve(),
            f"RUN_A and RUN_B are the same run ({args.run_a}): every difference would be zero")
    (runs_a, group_a), (runs_b, group_b) = _runs([args.run_a]), _runs([args.run_b])
    if group_a or group_b:
        return _compare_groups(args, runs_a, runs_b)
    _check_out(args.out, [args.run_a, args.run_b])
    config = _config(args)
    from probes.report import write_compare_report
    from probes.scoring import compare, scorecard

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


def _compare_groups(args: argparse.Namespace, runs_a: list[str], runs_b: list[str]) -> int:
    """``rwinterp compare GROUP_A GROUP_B``: per score each group's mean with its interval, and B - A."""
    both = {Path(r).resolve() for r in runs_a} & {Path(r).resolve() for r in runs_b}
    require(not both, f"the groups share runs ({', '.join(sorted(p.name for p in both)[:3])}): compare disjoint groups")
    _check_out(args.out, [args.run_a, args.run_b, *runs_a, *runs_b])
    config = _config(args)
    from probes.group import compare_groups
    from probes.report import write_group_compare_report

    result = compare_groups(_score_group(args, runs_a, config), _score_group(args, runs_b, config))
    out = write_group_compare_report(args.out, result, (str(args.run_a), str(args.run_b)))
    if args.json:
        print_json({**result.to_json(), "report": str(out)})
        return 0
    _print_group_header(result.a, args.run_a, "A")
    _print_group_header(result.b, args.run_b, "B")
    if result.a.task != result.b.task:
        print("            (the groups' tasks differ: each run is scored on its own task's test data)")
    print(f"{'score':40s} {'A mean [95% interval]':30s} {'B mean [95% interval]':30s} B - A [95% interval]")
    for key in result.keys():
        print(f"{_label(key):40s} {_estimate(result.a.scores[key].trained):30s} "
              f"{_estimate(result.b.scores[key].trained):30s} {_estimate(result.difference[key])}")
    print(f"report      {out / 'report.md'}")
    return 0


PROBE = Command("probe", "probe a trained run (or a group of runs: means over seeds with intervals): attention, "
                         "activation patching, V against Pi, with a report",
                _configure_probe, _probe)
COMPARE = Command("compare", "compare the probe scores of two runs, or of two groups of runs, side by side",
                  _configure_compare, _compare)


#: What a circuit directory holds (its marker first).
CIRCUIT_FILES = ("circuit.json", "circuit.md", "*.png")
#: EAP-IG's integration steps when --ig-steps is not given.
IG_STEPS = 4


def _configure_circuit(parser: argparse.ArgumentParser) -> None:
    from probes.config import EDGE_METHODS, VERIFY

    parser.add_argument("run", metavar="RUN_DIR", help="a run directory written by `rwinterp train --out`")
    parser.add_argument("--out", required=True, metavar="DIR", help="write circuit.json, circuit.md and figures here")
    parser.add_argument("--method", choices=EDGE_METHODS, default="default",
                        help="edge scores: exact (one ablated pass per edge), eap, eap-ig, atp* (EAP with the "
                             "query-key fix), default (atp*; edges into the last layer and the logits in closed form, "
                             "then the top --verify other edges patched exactly)")
    parser.add_argument("--ig-steps", type=int, default=None, metavar="M",
                        help=f"integration steps of eap-ig (default {IG_STEPS})")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--top", type=int, default=None, metavar="N", help="keep the N highest-scoring edges")
    size.add_argument("--threshold", type=float, default=None, metavar="X", help="keep the edges with |score| >= X")
    parser.add_argument("--graph", choices=["all", "heads"], default="all",
                        help="score all edges, or only those from a head into a later head's q, k or v (default all)")
    parser.add_argument("--ablation", choices=["mean", "resample"], default="mean",
                        help="what an ablated edge's writer is replaced by (default mean)")
    parser.add_argument("--verify", type=int, default=VERIFY, metavar="N",
                        help=f"edges the default method patches exactly (default {VERIFY})")
    parser.add_argument("--roles", default=None, metavar="JSON",
                        help='a JSON file naming heads by role, e.g. {"L0H1": "previous-token"}')
    parser.add_argument("--walks", type=int, default=None, help="use the first N of the run's test walks")
    parser.add_argument("--seed", type=int, default=0, help="seeds the resampled walks (default 0)")
    parser.add_argument("--json", action="store_true", help="print the circuit as one JSON object on stdout")
    parser.add_argument("--no-progress", action="store_true", help="hide progress bars")


def _roles(path: str | None) -> dict[str, str] | None:
    import json

    if path is None:
        return None
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise RwinterpError(f"cannot read the roles file {path}: {exc}") from None
    require(isinstance(data, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()),
            f"the roles file {path} must hold a JSON object of head names to role names")
    return data


def _circuit(args: argparse.Namespace) -> int:
    require(args.ig_steps is None or args.method == "eap-ig", "--ig-steps applies to --method eap-ig only")
    steps = IG_STEPS if args.ig_steps is None else args.ig_steps
    require(steps >= 1, f"--ig-steps must be >= 1, got {steps}")
    require(args.verify >= 0, f"--verify must be >= 0, got {args.verify}")
    require(args.walks is None or args.walks >= 2, f"--walks must be >= 2, got {args.walks}")
    from rwinterp.atomic import atomic_directory

    _check_out(args.out, [args.run], "circuit", CIRCUIT_FILES)
    roles = _roles(args.roles)
    from probes.circuits import circuit
    from probes.config import ProbeConfig

    run, data = _load(args.run, args)
    config = ProbeConfig(seed=args.seed, progress=False if (args.no_progress or args.json) else None)
    result = circuit(run.model, run.task, data, args.method, args.top, args.threshold, args.ablation, "loss", steps,
                     args.verify, roles=roles, config=config, graph=args.graph)
    payload = {"run": str(args.run), **result.to_json()}

    def build(tmp: Path) -> None:
        import json

        from probes.plots import plot_circuit, plot_faithfulness

        (tmp / "circuit.json").write_text(json.dumps(jsonable(payload), indent=1))
        captions = [("circuit.png", plot_circuit(result, tmp / "circuit.png")),
                    ("faithfulness.png", plot_faithfulness(result, tmp / "faithfulness.png"))]
        (tmp / "circuit.md").write_text(_circuit_markdown(payload, captions))

    out = atomic_directory(args.out, build, "circuit", CIRCUIT_FILES)
    if args.json:
        print_json({**payload, "out": str(out)})
        return 0
    print(f"run         {args.run}  ({run.task.describe()}, {len(data)} {run.task.sample_name}s)")
    print(f"method      {result.scores.method}, {len(result.scores.edges)} edges, "
          f"{int(result.scores.verified.sum())} exact, {result.cost.passes} passes, {result.cost.seconds:.1f} s")
    print(f"circuit     {result.kept} edges ({result.selection}), faithfulness {_number(result.faithfulness).strip()}")
    for edge in result.circuit[:10]:
        src = edge["source"] + (f" {edge['source_role']}" if edge.get("source_role") else "")
        dst = edge["target"] + (f" ({edge['target_role']})" if edge.get("target_role") else "")
        print(f"  {src:28s} -> {dst:28s} {edge['score']:+.4f}{'' if edge['verified'] else '  (estimate)'}")
    print(f"written     {out}")
    return 0


def _circuit_markdown(payload: dict, captions: list[tuple[str, str]]) -> str:
    lines = [f"# Circuit of {payload['run']}", "",
             f"Method {payload['method']} ({payload['verified']} of {payload['n_edges']} edges patched exactly), "
             f"{payload['source']} ablation, metric {payload['metric']}. Kept: {payload['circuit_size']} edges "
             f"({payload['selection']}), faithfulness {payload['circuit_faithfulness']:.3f}.", "",
             "| source | target | score | exact |", "|---|---|---|---|"]
    for e in payload["circuit"]:
        lines.append(f"| {e['source']} | {e['target']} | {e['score']:.5f} | {'yes' if e['verified'] else 'no'} |")
    lines.append("")
    for name, caption in captions:
        lines += [f"![{name}]({name})", "", caption, ""]
    return "\n".join(lines)


CIRCUIT = Command("circuit", "score every edge between a run's components and keep a circuit, with its faithfulness",
                  _configure_circuit, _circuit)
