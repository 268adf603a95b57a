"""The ``rwinterp`` command: train, probe, compare and reproduce.

Heavy imports (TransformerLens, plotting) happen inside the sub-command that needs them, so
``rwinterp --help`` and argument errors answer at once. Every user error is one line on stderr,
``rwinterp: error: ...``, with exit status 2; a diverging training run exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from typing import Any, Callable, Sequence

from rwinterp import stopping
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
    g.add_argument("--K", type=int, default=None, help="number of nodes on the circle (default 6)")
    g.add_argument("--N", type=int, default=None, help="positions per sample, query slot included (default 97)")
    g.add_argument("--M", type=int, default=None,
                   help="positional embedding dimension (default 1000; concatenated positions only)")
    g.add_argument("--p", type=float, default=None,
                   help="probability of a +1 step (default 0.5; --task circle and lazy)")
    g.add_argument("--pe", choices=["orthogonal", "sine", "learned"], default=None,
                   help="positional embeddings: orthogonal or sine (fixed, squared norm M/2; default "
                        "orthogonal) or learned (--model deep)")
    g.add_argument("--init", choices=["zero", "gaussian", "standard"], default=None,
                   help="initialisation (default zero; standard = GPT-2 style, --model deep)")
    g.add_argument("--sigma", type=float, default=None,
                   help="with --init gaussian: std of the initialisation (default 0.01)")
    g.add_argument("--normalize-tokens", action="store_true",
                   help="use x~/||x~|| inside the attention (the paper's random-init runs)")
    g.add_argument("--keys-only", action="store_true",
                   help="with --normalize-tokens: normalise the keys x~_1..x~_N but not the query")
    g.add_argument("--token-norm", type=float, default=None,
                   help="with --normalize-tokens: the length x~ is normalised to (default 1)")
    g.add_argument("--mlp-width", type=int, default=None,
                   help="FC+ReLU variant with this width m (--model deep: a head of value width d_head = m and a "
                        "learned MLP of width m; d_head + K must fit in d_model = K + M)")
    g.add_argument("--act-fn", choices=["relu", "linear"], default=None,
                   help="with --mlp-width: the FC layer's activation (default relu; linear: no ReLU, f = A V X S)")
    g.add_argument("--dtype", choices=["float32", "float64"], default="float64", help="default float64")


#: Options of ``--task`` (rwinterp.chains, rwinterp.qa), and which of the task options each one reads
#: (the QA tasks fix their vocabulary, K = 19, and their sentence length).
TASK_OPTIONS = {
    "circle": ("K", "N", "p"),
    "lazy": ("K", "N", "p", "stay", "start"),
    "torus": ("K", "N", "rows", "cols", "stay", "start"),
    "regular": ("K", "N", "degree", "graph_seed", "stay", "start"),
    "persistent": ("K", "N", "q"),
    "random-order": ("K", "N", "order", "concentration", "chain_seed"),
    "qa-majority": (),
    "qa-order": (),
}
_OPTION_NAMES = tuple(dict.fromkeys(name for names in TASK_OPTIONS.values() for name in names))

#: ``--model deep`` options and the :class:`rwinterp.deep.DeepConfig` fields they set.
DEEP_OPTIONS = {
    "layers": "n_layers", "heads": "n_heads", "d_model": "d_model", "d_head": "d_head",
    "pos_mode": "pos_mode", "token_embedding": "token_embedding", "d_token": "d_token",
    "key_query": "key_query", "attn_scale": "attn_scale", "values": "values", "readout": "readout",
    "residual": "residual", "attention": "attention",
}


def add_task_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("other tasks: Markov chains (rwinterp.chains) and the QA tasks (rwinterp.qa)")
    g.add_argument("--task", choices=list(TASK_OPTIONS), default="circle",
                   help="circle (the paper's), lazy (circle walk that may stay put), torus (grid walk), "
                        "regular (random regular graph), persistent (2nd-order circle walk with momentum), "
                        "random-order (random k-th order chain), qa-majority and qa-order (the paper's "
                        "question-answering tasks 1 and 2, section 4); default circle")
    g.add_argument("--stay", type=float, default=None, help="probability of staying put (lazy: default 0.5)")
    g.add_argument("--rows", type=int, default=None, help="torus rows (K = rows * cols)")
    g.add_argument("--cols", type=int, default=None, help="torus columns")
    g.add_argument("--degree", type=int, default=None, help="degree of the random regular graph (default 3)")
    g.add_argument("--graph-seed", type=int, default=None, help="seed of the random regular graph (default 0)")
    g.add_argument("--q", type=float, default=None,
                   help="persistent walk: probability of keeping direction (default 0.8)")
    g.add_argument("--order", type=int, default=None, help="random-order chain: its order k (default 2)")
    g.add_argument("--concentration", type=float, default=None,
                   help="random-order chain: Dirichlet concentration of its rows (default 1)")
    g.add_argument("--chain-seed", type=int, default=None, help="random-order chain: its seed (default 0)")
    g.add_argument("--start", default=None,
                   help="distribution of the first state of a lazy/torus/regular walk: uniform (default), "
                        "a state, or K comma-separated probabilities")


def add_deep_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("deeper and standard models (--model deep; rwinterp.deep)")
    g.add_argument("--model", choices=["paper", "deep"], default="paper",
                   help="paper: the paper's one-layer model (default); deep: rwinterp.deep.DeepTransformer "
                        "(attending from the query slot, it builds only the query's row; causal attention holds "
                        "[walks, N, d_model] activations, so keep d_model small there)")
    g.add_argument("--preset", choices=["paper", "standard"], default=None,
                   help="deep model starting point: paper (default; the paper's model as a DeepTransformer) or "
                        "standard (learned added positions, factored QK, residual, causal, GPT-2 init, d_model 32; "
                        "its logits need --loss xent); the options below override it")
    g.add_argument("--layers", type=int, default=None, help="number of layers")
    g.add_argument("--heads", type=int, default=None, help="heads per layer")
    g.add_argument("--d-model", type=int, default=None, help="residual width (added positions)")
    g.add_argument("--d-head", type=int, default=None, help="head width")
    g.add_argument("--pos-mode", choices=["concat", "added"], default=None,
                   help="positions concatenated (paper) or added")
    g.add_argument("--token-embedding", choices=["onehot", "learned"], default=None,
                   help="one-hot tokens (paper) or learned embeddings")
    g.add_argument("--d-token", type=int, default=None, help="width of learned token embeddings (concat)")
    g.add_argument("--key-query", choices=["merged", "factored"], default=None, help="merged W (paper) or W_Q, W_K")
    g.add_argument("--attn-scale", type=float, default=None, help="scores are divided by this (paper: 1)")
    g.add_argument("--values", choices=["tokens", "all"], default=None,
                   help="values read the token coordinates (paper) or all of the residual stream")
    g.add_argument("--readout", choices=["fixed", "learned"], default=None, help="fixed (paper) or learned W_O, W_U")
    g.add_argument("--residual", action=argparse.BooleanOptionalAction, default=None,
                   help="add block outputs to the residual stream (paper: no)")
    g.add_argument("--attention", choices=["query", "causal"], default=None,
                   help="attend from the query slot only (paper) or causally from every position")


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("training (defaults: the paper's Fig 4)")
    g.add_argument("--lr", type=float, default=1.0, help="learning rate (default 1)")
    g.add_argument("--eps", type=float, default=None, help="eps of the loss -log(f_y + eps) (default 0.1)")
    g.add_argument("--steps", type=int, default=50, help="gradient steps (default 50)")
    g.add_argument("--loss", choices=["log", "xent", "squared"], default="log", help="default: the paper's log")
    g.add_argument("--optimizer", choices=["gd", "sgd", "adamw"], default="gd",
                   help="gd: full-batch gradient descent (the paper's)")
    g.add_argument("--batch-size", type=int, default=None, help="mini-batch size (sgd, adamw; default full batch)")
    g.add_argument("--weight-decay", type=float, default=0.0,
                   help="shrink the weights by lr * this each step (default 0; gd and sgd: coupled, adamw: decoupled)")
    g.add_argument("--reduction", choices=["mean", "sum"], default="mean",
                   help="the loss averaged (the paper's stated reading) or summed over the training samples")
    g.add_argument("--n-train", type=int, default=None,
                   help="training samples, walks or sentences (default 1000; not with --population)")
    g.add_argument("--n-test", type=int, default=None, help="test samples (default 1000; not with --population)")
    g.add_argument("--population", action="store_true",
                   help="train and evaluate on the exact population of all samples (small N)")
    g.add_argument("--seed", type=int, default=0, help="seeds initialisation and data (default 0)")
    g.add_argument("--next-token", action="store_true",
                   help="train on next-state prediction at every position (causal deep models)")


@command("train", "train the paper's model (or a deeper one) on random walks on a circle (or other chains, or "
                  "the paper's QA tasks)")
def _train_command(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    add_model_arguments(parser)
    add_task_arguments(parser)
    add_deep_arguments(parser)
    add_train_arguments(parser)
    parser.add_argument("--out", default=None, help="save the run to this directory")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return _train


def _start(text: str | None, K: int) -> Any:
    """``--start``: None (uniform), a state, or K probabilities."""
    if text is None or text == "uniform":
        return None
    try:
        values = [float(x) for x in text.split(",")]
    except ValueError:
        raise RwinterpError(f"--start must be 'uniform', a state or {K} comma-separated probabilities, "
                            f"got {text!r}") from None
    if not all(math.isfinite(v) for v in values):
        raise RwinterpError(f"--start values must be finite, got {text!r}")
    if len(values) == 1:
        state = int(values[0])
        if state != values[0] or not 0 <= state < K:
            raise RwinterpError(f"--start state must be an integer in [0, {K - 1}], got {text}")
        values = [float(i == state) for i in range(K)]
    return values


def make_task(args: argparse.Namespace) -> Any:
    """The task that ``rwinterp train`` options describe."""
    from rwinterp.tasks import CircleWalk

    for name in _OPTION_NAMES:
        if getattr(args, name) is not None and name not in TASK_OPTIONS[args.task]:
            raise RwinterpError(f"--{name.replace('_', '-')} does not apply to --task {args.task}")

    def opt(name: str, default: Any) -> Any:
        value = getattr(args, name)
        return default if value is None else value

    if args.task.startswith("qa-"):
        from rwinterp.qa import QAMajority, QAOrder

        return QAMajority() if args.task == "qa-majority" else QAOrder()
    K, N, p = opt("K", 6), opt("N", 97), opt("p", 0.5)
    if args.task == "circle":
        return CircleWalk(K, p, N)
    from rwinterp import chains

    if args.task == "lazy":
        return chains.LazyWalk(K, p, opt("stay", 0.5), N, _start(args.start, K))
    if args.task == "torus":
        if args.rows is None or args.cols is None:
            raise RwinterpError("--task torus needs --rows and --cols")
        if args.K is not None and args.K != args.rows * args.cols:
            raise RwinterpError(f"a {args.rows} x {args.cols} torus has K = {args.rows * args.cols} states, "
                                f"not {args.K}")
        return chains.TorusWalk(args.rows, args.cols, N, opt("stay", 0.0),
                                _start(args.start, args.rows * args.cols))
    if args.task == "regular":
        return chains.RegularGraphWalk(K, opt("degree", 3), N, opt("graph_seed", 0), opt("stay", 0.0),
                                       _start(args.start, K))
    if args.task == "persistent":
        return chains.PersistentWalk(K, opt("q", 0.8), N)
    return chains.RandomOrderChain(K, opt("order", 2), N, opt("concentration", 1.0), opt("chain_seed", 0))


def _normalisation(args: argparse.Namespace) -> dict[str, Any]:
    """The model-config fields of ``--normalize-tokens``, ``--keys-only`` and ``--token-norm``."""
    if not args.normalize_tokens:
        for flag, given in (("keys-only", args.keys_only), ("token-norm", args.token_norm is not None)):
            if given:
                raise RwinterpError(f"--{flag} needs --normalize-tokens")
    return {"normalize_tokens": args.normalize_tokens, "normalize_query": not args.keys_only,
            "token_norm": 1.0 if args.token_norm is None else args.token_norm}


def make_model(args: argparse.Namespace, task: Any) -> Any:
    """The model that ``rwinterp train`` options describe, sized for ``task``."""
    if args.act_fn is not None and args.mlp_width is None:
        raise RwinterpError("--act-fn needs --mlp-width")
    if args.sigma is not None and args.init != "gaussian":
        raise RwinterpError("--sigma needs --init gaussian")
    for flag, value, deep_only in (("pe", args.pe, "learned"), ("init", args.init, "standard")):
        if value == deep_only and args.model == "paper":
            raise RwinterpError(f"--{flag} {value} needs --model deep")
    act_fn = args.act_fn or "relu"
    sigma = 0.01 if args.sigma is None else args.sigma
    M = 1000 if args.M is None else args.M  # the paper's (its positions may ignore it: refused below)
    deep = {field: getattr(args, name) for name, field in DEEP_OPTIONS.items() if getattr(args, name) is not None}
    if args.model == "paper":
        given = [name for name in DEEP_OPTIONS if getattr(args, name) is not None]
        if given or args.preset is not None:
            flag = "preset" if args.preset is not None else given[0]
            raise RwinterpError(f"--{flag.replace('_', '-')} needs --model deep")
        from rwinterp.config import WalkTransformerConfig
        from rwinterp.model import WalkTransformer

        return WalkTransformer(WalkTransformerConfig(
            n_states=task.n_states, n_ctx=task.seq_len, pos_dim=M, pos_embedding=args.pe or "orthogonal",
            init=args.init or "zero", init_sigma=sigma, mlp_width=args.mlp_width, act_fn=act_fn, seed=args.seed,
            dtype=args.dtype, **_normalisation(args),
        ))
    from rwinterp.deep import DeepConfig, DeepTransformer

    for name, value in (("pos_embedding", args.pe), ("init", args.init), ("mlp_width", args.mlp_width)):
        if value is not None:
            deep[name] = value
    deep.update(init_sigma=sigma, act_fn=act_fn, seed=args.seed, dtype=args.dtype, **_normalisation(args))
    if args.preset == "standard":
        cfg = DeepConfig.standard(task.n_states, task.seq_len, deep.pop("d_model", 32), **deep)
    else:
        cfg = DeepConfig.paper(task.n_states, task.seq_len, M, **deep)
    # Options the chosen positions would ignore are refused rather than dropped.
    if cfg.pos_mode == "added":
        for flag, given in (("M", args.M), ("d-token", args.d_token)):
            if given is not None:
                raise RwinterpError(f"--{flag} applies to concatenated positions; with added ones use --d-model")
    elif args.d_model is not None:
        raise RwinterpError("--d-model applies to added positions (--pos-mode added); concatenated ones give "
                            "d_model = d_token + M")
    return DeepTransformer(cfg)


def _train(args: argparse.Namespace) -> int:
    from rwinterp.atomic import check_target
    from rwinterp.runs import RUN_FILES
    from rwinterp.training import TrainConfig

    if args.out is not None:  # refused now, not after the training
        check_target(args.out, "run", RUN_FILES)
    for flag, given in (("n-train", args.n_train), ("n-test", args.n_test)):
        if args.population and given is not None:
            raise RwinterpError(f"--{flag} does not apply to --population (it trains and tests on the whole "
                                "population)")
    if args.eps is not None and args.loss != "log":
        raise RwinterpError(f"--eps applies to the paper's loss -log(f_y + eps) (--loss log), "
                            f"not to --loss {args.loss}")
    task = make_task(args)
    train_cfg = TrainConfig(
        lr=args.lr, steps=args.steps, loss=args.loss, optimizer=args.optimizer,
        batch_size=args.batch_size, weight_decay=args.weight_decay, population=args.population, seed=args.seed,
        next_token=args.next_token, reduction=args.reduction,
        # (eps and the sizes, when given: TrainConfig's defaults are the paper's 0.1, 1000 and 1000)
        **{k: v for k, v in (("eps", args.eps), ("n_train", args.n_train), ("n_test", args.n_test))
           if v is not None},
    )
    if args.population:  # refuse before building the model
        from rwinterp.tasks import check_population_size

        check_population_size(task.population_size())
    from rwinterp.runs import save_run
    from rwinterp.training import TrainingDiverged, train

    model = make_model(args, task)
    cfg = model.cfg
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
    if "parent_attention_heads" in final:
        summary["parent_attention_heads"] = final["parent_attention_heads"]
    if args.out is not None:
        save_run(args.out, model, task, train_cfg.to_dict(), result.history, summary)
    V = None if model.V is None else model.V.detach().tolist()
    if args.json:
        print_json({**summary, "V": V, "history": result.history, "task": task.to_dict(),
                    "model_kind": args.model, "model": cfg.to_dict(), "train": train_cfg.to_dict(),
                    "run": args.out})
        return 0
    parents = ", ".join(str(p + 1) for p in task.parent_positions())
    print(f"task        {task.describe()}   (population: {args.population})")
    if args.model == "paper":
        print(f"model       K={cfg.n_states} N={cfg.n_ctx} M={cfg.pos_dim} pe={cfg.pos_embedding}{cfg.mlp_label()} "
              f"dtype={args.dtype} init={cfg.init_label()}")
    else:
        print(f"model       {cfg.describe()}")
    eps = f" eps={train_cfg.eps}" if train_cfg.loss == "log" else ""
    print(f"training    {train_cfg.optimizer} lr={train_cfg.lr}{eps} steps={train_cfg.steps} "
          f"loss={train_cfg.loss}{' (summed)' if train_cfg.reduction == 'sum' else ''}"
          f"{' next-token' if train_cfg.next_token else ''} ({result.train_seconds:.2f} s)")
    # (a next-token model is scored here on the label alone; the probes score every position it predicts)
    on_label = "  (on the label, the last position)" if train_cfg.next_token else ""
    print(f"accuracy    test {summary['test_accuracy']:.4f}  train {summary['train_accuracy']:.4f}  "
          f"Bayes {summary['bayes_accuracy']:.4f}{on_label}")
    print(f"attention   mean on the parent(s) (position {parents}, 1-indexed): {summary['parent_attention']:.4f}")
    for layer, heads in enumerate(summary.get("parent_attention_heads", [])):
        print(f"   layer {layer}: " + "  ".join(f"head {h} {a:.4f}" for h, a in enumerate(heads)))
    vd = summary["v_distance"]
    if vd is not None:  # only the paper's model on a Markov chain has a V to compare with Pi^T
        print(f"V vs Pi^T   ||V/||V|| - Pi^T/||Pi^T|| ||_F = {vd:.4f}")
    if V is not None:
        form = "f = V X S"
        if args.model == "paper" and cfg.mlp_width is not None:
            form = "f = A ReLU(V X S)" if cfg.act_fn == "relu" else "f = A V X S"
        elif args.model == "deep" and (cfg.residual or cfg.readout == "learned" or cfg.values == "all"):
            form = "the head's state-to-score map (W_E W_V W_O W_U)^T"
        print(f"V ({form}{'; a trained V approaches Pi^T' if vd is not None else ''}):")
        cell = "{:8.3f}" if max(abs(x) for row in V for x in row) < 1e4 else "{:10.3e}"  # fixed point while it fits
        for row in V:
            print("   " + " ".join(cell.format(x) for x in row))
    if args.out is not None:
        print(f"saved run   {args.out}")
    return 0


# ------------------------------------------------------------------------------------- entry
#: Modules that register further sub-commands with :func:`command` (imported lazily, so they must
#: keep heavy imports inside their handlers).
COMMAND_MODULES = ("probes.cli", "experiments.cli")


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("rwinterp")
    except PackageNotFoundError:  # (run from a source tree that was not installed)
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    import importlib

    for module in COMMAND_MODULES:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
    parser = _Parser(prog="rwinterp", description=__doc__.splitlines()[0].replace("``", ""))
    parser.add_argument("--version", action="version", version=f"rwinterp {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    handlers, parsers = {}, {}
    for name, configure in COMMANDS.items():
        parsers[name] = sub.add_parser(name, help=configure.help, description=configure.help)
        handlers[name] = configure(parsers[name])
    parser.set_defaults(_handlers=handlers, _parsers=parsers)
    return parser


def _limit_memory() -> Callable[[], None]:
    """Cap the address space of this process (and of the workers it starts) at its present size plus the
    memory the machine has free, so that sizes too large for it fail with a MemoryError, reported in one
    line, instead of filling the machine until the kernel kills the process without a word. (Address
    space that libraries reserve without using counts too: torch and TransformerLens take 1.6 GiB of it
    and little memory.) Returns what undoes it."""
    try:
        import resource

        info = dict(line.split(":", 1) for line in open("/proc/meminfo"))
        free = sum(int(info[k].split()[0]) << 10 for k in ("MemAvailable", "SwapFree"))
        size = int(next(line for line in open("/proc/self/status") if line.startswith("VmSize")).split()[1]) << 10
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        limit = size + free
        if hard != resource.RLIM_INFINITY:
            limit = min(limit, hard)
        if soft != resource.RLIM_INFINITY and soft <= limit:
            return lambda: None
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
        return lambda: resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    except (ImportError, OSError, KeyError, ValueError, StopIteration):  # not Linux: no cap
        return lambda: None


def main(argv: Sequence[str] | None = None) -> int:
    restore = stopping.install()
    unlimit = _limit_memory()
    try:
        parser = build_parser()
        args, extra = parser.parse_known_args(argv)
        if args.command is None:
            if extra:
                parser.error(f"unrecognized arguments: {' '.join(extra)}")
            parser.print_help()
            return 2
        if extra:  # reported by the sub-command, whose --help is the one to read
            args._parsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
        _import_numerics()
        status = args._handlers[args.command](args)
        stopping.check()  # a stop whose exception a finaliser swallowed still ends the command as a stop
        return status
    except stopping.Terminated:
        sys.stderr.write("rwinterp: terminated\n")
        return 128 + signal.SIGTERM
    except RwinterpError as exc:
        sys.stderr.write(f"rwinterp: error: {exc}\n")
        return 2
    except (MemoryError, RuntimeError) as exc:
        too_large = ("allocate", "size calculation overflow")
        if not isinstance(exc, MemoryError) and not any(s in str(exc) for s in too_large):
            raise
        sys.stderr.write("rwinterp: error: not enough memory for the sizes asked for "
                         f"({str(exc).splitlines()[0] if str(exc) else 'MemoryError'})\n")
        return 2
    except BrokenPipeError:
        # The reader stopped reading (``| head``): stop quietly, with stdout pointed at /dev/null so
        # that flushing it at exit does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except OSError as exc:
        sys.stderr.write(f"rwinterp: error: {exc.strerror or exc}: {exc.filename or ''}\n")
        return 2
    except KeyboardInterrupt:
        sys.stderr.write("rwinterp: interrupted\n")
        return 130
    finally:
        unlimit()
        restore()


def _import_numerics() -> None:
    """Import numpy and torch (every command needs them) with Ctrl-C and SIGTERM held back until they
    are loaded (:func:`rwinterp.stopping.held`)."""
    with stopping.held():
        import numpy  # noqa: F401
        import torch  # noqa: F401


if __name__ == "__main__":
    # Sub-command modules register into ``rwinterp.cli``, not into ``__main__``.
    from rwinterp.cli import main as _main

    raise SystemExit(_main())
