"""The ``rwinterp`` command: train, probe, compare and reproduce.

Heavy imports (TransformerLens, plotting) happen inside the sub-command that needs them, so
``rwinterp --help`` and argument errors answer at once. Every user error is one line on stderr,
``rwinterp: error: ...``, with exit status 2; a diverging training run exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any, Callable, Sequence

from rwinterp.errors import RwinterpError

COMMANDS: dict[str, Callable[[argparse.ArgumentParser], Callable[[argparse.Namespace], int]]] = {}


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"rwinterp: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)


def command(name: str, help: str) -> Callable:
    """Register ``configure(parser) -> handler`` as the sub-command ``name``."""

    def wrap(configure: Callable) -> Callable:
        configure.help = help  # type: ignore[attr-defined]
        COMMANDS[name] = configure
        return configure

    return wrap


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(_json_safe(obj)) + "\n")


# ---------------------------------------------------------------------------------------- train
def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("task and model (PAPER.md sections 1-2)")
    g.add_argument("--K", type=int, default=6, help="number of nodes on the circle (default 6)")
    g.add_argument("--N", type=int, default=97, help="positions per sample, query slot included (default 97)")
    g.add_argument("--M", type=int, default=1000, help="positional embedding dimension (default 1000)")
    g.add_argument("--p", type=float, default=0.5, help="probability of a +1 step (default 0.5)")
    g.add_argument("--pe", choices=["orthogonal", "sine"], default="orthogonal",
                   help="positional embeddings, both with squared norm M/2 (default orthogonal)")
    g.add_argument("--init", choices=["zero", "gaussian"], default="zero", help="initialisation (default zero)")
    g.add_argument("--sigma", type=float, default=0.01, help="std of the Gaussian initialisation (default 0.01)")
    g.add_argument("--normalize-tokens", action="store_true",
                   help="use x~/||x~|| inside the attention (the paper's random-init runs)")
    g.add_argument("--mlp-width", type=int, default=None, help="FC+ReLU variant with this width m")
    g.add_argument("--dtype", choices=["float32", "float64"], default="float64", help="default float64")


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training (defaults: the paper's Fig 4)")
    g.add_argument("--lr", type=float, default=1.0, help="learning rate (default 1)")
    g.add_argument("--eps", type=float, default=0.1, help="eps of the loss -log(f_y + eps) (default 0.1)")
    g.add_argument("--steps", type=int, default=50, help="gradient steps (default 50)")
    g.add_argument("--loss", choices=["log", "xent", "squared"], default="log", help="default: the paper's log")
    g.add_argument("--optimizer", choices=["gd", "sgd", "adamw"], default="gd",
                   help="gd: full-batch gradient descent (the paper's)")
    g.add_argument("--batch-size", type=int, default=None, help="mini-batch size for sgd/adamw")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--n-train", type=int, default=1000, help="training walks (default 1000)")
    g.add_argument("--n-test", type=int, default=1000, help="test walks (default 1000)")
    g.add_argument("--population", action="store_true",
                   help="train and evaluate on the exact population of all walks (small N)")
    g.add_argument("--seed", type=int, default=0, help="seeds initialisation and data (default 0)")


@command("train", "train the paper's model on random walks on a circle")
def _train_command(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    add_model_arguments(parser)
    add_train_arguments(parser)
    parser.add_argument("--out", default=None, help="save the run to this directory")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return _train


def _train(args: argparse.Namespace) -> int:
    from rwinterp.tasks import CircleWalk
    from rwinterp.training import TrainConfig

    task = CircleWalk(args.K, args.p, args.N)
    train_cfg = TrainConfig(
        lr=args.lr, eps=args.eps, steps=args.steps, loss=args.loss, optimizer=args.optimizer,
        batch_size=args.batch_size, weight_decay=args.weight_decay, n_train=args.n_train,
        n_test=args.n_test, population=args.population, seed=args.seed,
    )
    if args.population:
        size = task.population_size()
        from rwinterp.tasks import MAX_POPULATION

        if size > MAX_POPULATION:
            raise RwinterpError(f"population mode would enumerate {size} walks (limit {MAX_POPULATION}); "
                                "use a smaller N or sampled walks")
    from rwinterp.config import WalkTransformerConfig
    from rwinterp.model import WalkTransformer
    from rwinterp.runs import save_run
    from rwinterp.training import TrainingDiverged, train

    cfg = WalkTransformerConfig(
        n_states=args.K, n_ctx=args.N, pos_dim=args.M, pos_embedding=args.pe, init=args.init,
        init_sigma=args.sigma, normalize_tokens=args.normalize_tokens, mlp_width=args.mlp_width,
        seed=args.seed, dtype=args.dtype,
    )
    model = WalkTransformer(cfg)
    try:
        result = train(model, task, train_cfg, progress=False if args.no_progress or args.json else None)
    except TrainingDiverged as exc:
        sys.stderr.write(f"rwinterp: error: {exc}\n")
        return 1
    final = result.final
    summary = {
        "test_accuracy": final["test_accuracy"],
        "train_accuracy": final["train_accuracy"],
        "bayes_accuracy": result.bayes_accuracy,
        "parent_attention": final["parent_attention"],
        "v_distance": final["v_distance"],
        "loss": final["loss"],
        "train_seconds": result.train_seconds,
    }
    if args.out:
        save_run(args.out, model, task, train_cfg.to_dict(), result.history, summary)
    V = model.V.detach().tolist()
    if args.json:
        print_json({**summary, "V": V, "history": result.history, "task": task.to_dict(),
                    "model": cfg.to_dict(), "train": train_cfg.to_dict(), "run": args.out})
        return 0
    print(f"task        {task.describe()}   (population: {args.population})")
    print(f"model       K={args.K} N={args.N} M={args.M} pe={args.pe} init={args.init} dtype={args.dtype}")
    print(f"training    {train_cfg.optimizer} lr={train_cfg.lr} eps={train_cfg.eps} steps={train_cfg.steps} "
          f"loss={train_cfg.loss} ({result.train_seconds:.2f} s)")
    print(f"accuracy    test {summary['test_accuracy']:.4f}  train {summary['train_accuracy']:.4f}  "
          f"Bayes max(p, 1-p) {summary['bayes_accuracy']:.4f}")
    print(f"attention   mean on the parent (position N-1): {summary['parent_attention']:.4f}")
    vd = summary["v_distance"]
    print(f"V vs Pi^T   ||V/||V|| - Pi^T/||Pi^T|| ||_F = {'n/a' if vd is None else f'{vd:.4f}'}")
    print("V (f = V X S; a trained V approaches Pi^T):")
    for row in V:
        print("   " + " ".join(f"{x:8.3f}" for x in row))
    if args.out:
        print(f"saved run   {args.out}")
    return 0


# ------------------------------------------------------------------------------------- entry
#: Modules that register further sub-commands with :func:`command` (imported lazily, so they must
#: keep heavy imports inside their handlers).
COMMAND_MODULES = ("probes.cli", "experiments.cli")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    for module in COMMAND_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
    parser = _Parser(prog="rwinterp", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    handlers = {}
    for name, configure in COMMANDS.items():
        p = sub.add_parser(name, help=configure.help, description=configure.help)
        handlers[name] = configure(p)
    parser.set_defaults(_handlers=handlers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args._handlers[args.command](args)
    except RwinterpError as exc:
        sys.stderr.write(f"rwinterp: error: {exc}\n")
        return 2
    except OSError as exc:
        sys.stderr.write(f"rwinterp: error: {exc.strerror or exc}: {exc.filename or ''}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("rwinterp: interrupted\n")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
