"""``rwinterp reproduce``: run figure specs and write the figures and the reproduction report."""

from __future__ import annotations

import argparse
import os

from experiments.executors import add_executor_options, check_executor_options
from rwinterp.cli import Command


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("figures", nargs="*", metavar="FIG",
                        help="figure numbers (2, 4, ...), extra studies by name, or 'all'")
    parser.add_argument("--out", help="directory for the figures and the report (required unless --list)")
    parser.add_argument("--reduced", action="store_true",
                        help="small sizes and few steps (a smoke test; claims are not expected to hold)")
    parser.add_argument("--list", action="store_true", help="list the known figures and exit")
    parser.add_argument("--jobs", type=int, default=None, metavar="N",
                        help="runs trained at once, in worker processes (default: the number of CPUs, "
                             "at most 8); the numbers do not depend on it")
    add_executor_options(parser, "runs")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cpu",
                        help="where the runs train: cpu (default), cuda (an error without a GPU) or auto")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _reproduce(args: argparse.Namespace) -> int:
    from experiments.runner import discover, reproduce
    from rwinterp.errors import require

    if args.list:
        require(not (args.figures or args.out or args.reduced), "--list takes no figures, --out or --reduced")
        for spec_id, spec in discover().items():
            print(f"{spec_id:>12}  {spec.title}")
        return 0
    require(bool(args.figures), "name at least one figure, or 'all' (see --list)")
    require(bool(args.out), "--out DIR is required")
    cpus = os.cpu_count() or 1
    jobs = args.jobs if args.jobs is not None else min(cpus, 8)
    require(1 <= jobs <= 4 * cpus, f"--jobs must be between 1 and 4 x the {cpus} CPUs, got {jobs}: more workers "
            f"only wait for a CPU, each holding its own copy of torch")
    check_executor_options(args.executor, args.address, args.gpus_per_job)
    rep = reproduce(args.figures, args.out, reduced=args.reduced,
                    progress=False if args.no_progress else None, jobs=jobs, executor=args.executor,
                    address=args.address, device=args.device, gpus_per_job=args.gpus_per_job or 0.0)
    claims = rep.claims
    held = sum(c.holds for c in claims)
    for c in claims:
        print(f"{'holds' if c.holds else 'FAILS':>5}  fig {c.figure:>10}  {c.claim}")
    print(f"{held} of {len(claims)} claims hold; {rep.seconds:.1f} s; report: {args.out}/REPRODUCTION.md")
    return 0


REPRODUCE = Command("reproduce", "reproduce the paper's figures: PNGs, results.json and REPRODUCTION.md",
                    _configure, _reproduce)
