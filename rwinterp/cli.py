"""The ``rwinterp`` command line.

Sub-commands are found through the ``rwinterp.commands`` entry points (``pyproject.toml``), the plugin pattern
of pytest: ``train`` lives here, the others in the packages above this one that declare them; each is a
:class:`Command`. The options of ``train`` and their help come from the config dataclasses of
:mod:`rwinterp.config`, the one table of defaults. Arguments are parsed and checked before torch and
TransformerLens load, so a mistyped one is refused at once. Every user error is one line on stderr,
``rwinterp: error: ...``, with exit status 2; a diverging training run exits with status 1; Ctrl-C ends a
command with status 130 and SIGTERM with 143, leaving nothing half written (a program started with
Ctrl-C ignored, in the background, keeps ignoring it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import rwinterp
from rwinterp.config import (
    DEVICES, PAPER_VARIANTS, TASK_PARAMETERS, TASKS, BridgeOptions, DeepOptions, TrainConfig, cli_options, defaults,
    parse_seeds, standard_options, unmet_need,
)
from rwinterp.errors import RwinterpError, require
from rwinterp.jsonable import jsonable

ENTRY_POINTS = "rwinterp.commands"


@dataclass(frozen=True)
class Command:
    """A sub-command: ``configure(parser)`` adds its options, ``run(args)`` does the work (heavy imports go
    inside ``run``) and returns the exit status."""

    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"rwinterp: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(2)


def print_json(obj: Any) -> None:
    """One JSON object on stdout (NaN and infinities as null)."""
    sys.stdout.write(json.dumps(jsonable(obj)) + "\n")


# ---------------------------------------------------------------------------------------- options from configs
def _python_type(annotation: str) -> type:
    name = str(annotation).replace("Optional[", "").replace(" | None", "").rstrip("]")
    return {"int": int, "float": float, "str": str, "bool": bool}.get(name, str)


def add_config_options(group: Any, classes: Sequence[type], skip: Sequence[str] = (), seen: Optional[set] = None,
                       extra: Optional[dict[str, str]] = None) -> None:
    """Add a ``--flag`` for every field of ``classes`` (:func:`rwinterp.config.cli_options`), once per flag, with
    the help text and default of each class that has it. Every flag defaults to ``None``: a config's own
    default applies when it is not given."""
    seen = set() if seen is None else seen
    flags: dict[str, list[tuple[type, Any]]] = {}
    for cls in classes:
        for flag, f in cli_options(cls):
            if f.name not in skip:
                flags.setdefault(flag, []).append((cls, f))
    for flag, owners in flags.items():
        if flag in seen:
            continue
        seen.add(flag)
        f = owners[0][1]
        values = {owner.__name__.removesuffix("Options").removesuffix("Config").lower(): defaults(owner)[f.name]
                  for owner, _ in owners}
        shown = sorted({repr(v) if isinstance(v, str) else str(v) for v in values.values()})
        default = (f"default {shown[0]}" if len(shown) == 1
                   else "default " + "; ".join(f"{k} {v!r}" if isinstance(v, str) else f"{k} {v}"
                                                for k, v in values.items()))
        text = f"{f.metadata['help']} ({default}{(extra or {}).get(f.name, '')})".replace("%", "%%")
        kind = _python_type(f.type)
        if kind is bool:
            group.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=text)
        else:
            group.add_argument(flag, dest=f.name, type=kind, default=None, choices=f.metadata.get("choices"),
                               metavar=None if f.metadata.get("choices") else f.name.upper(), help=text)


def given(args: argparse.Namespace, cls: type, skip: Sequence[str] = ()) -> dict[str, Any]:
    """The fields of ``cls`` that were given on the command line."""
    return {name: getattr(args, name) for _, f in cli_options(cls) for name in [f.name]
            if name not in skip and getattr(args, name, None) is not None}


# ---------------------------------------------------------------------------------------- train
MODELS = ("paper", "deep", "bridge")
#: The options class of each model kind a run saves.
OPTIONS = {"deep": DeepOptions, "bridge": BridgeOptions}
PRESETS = ("paper", "standard")
#: Fields that the paper's model may set and still be the paper's model (``--model paper``).
PAPER_FIELDS = PAPER_VARIANTS + ("pos_dim",)
#: Training defaults that a model needs, where they differ from the paper's (logits, every position).
NEXT_TOKEN = {"loss": "xent", "next_token": True}
TASK_SKIP = ("n_states", "n_ctx")


def _configure_train(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("task")
    g.add_argument("--task", choices=list(TASKS), default="circle",
                   help="; ".join(f"{name}: {kind.help}" for name, kind in TASKS.items()) + " (default circle)")
    params: dict[str, list[str]] = {}
    for name, kind in TASKS.items():
        for param, value in kind.params.items():
            params.setdefault(param, []).append(
                name if value is MISSING or value is None else f"{name} {value}")
    for param, uses in params.items():
        g.add_argument("--" + param.replace("_", "-"), dest=f"task_{param}", default=None, metavar=param.upper(),
                       help=f"{TASK_PARAMETERS[param][1]} ({', '.join(uses)})".replace("%", "%%"))
    g = parser.add_argument_group("model (rwinterp.config.DeepOptions, BridgeOptions)")
    g.add_argument("--model", choices=MODELS, default="paper",
                   help="paper: the paper's one-layer model (default); deep: the same model with every option open; "
                        "bridge: a standard TransformerLens model (TransformerBridge)")
    g.add_argument("--preset", choices=PRESETS, default=None,
                   help="with --model deep, the starting point: paper (default) or standard (learned added positions, "
                        "factored QK, residual stream, causal attention, GPT-2 init, d_model 32, trained with "
                        "--loss xent --next-token); the options override it")
    seen = {"--seed"}
    add_config_options(g, [DeepOptions, BridgeOptions], skip=TASK_SKIP + ("seed",), seen=seen)
    g = parser.add_argument_group("training (rwinterp.config.TrainConfig; defaults: the paper's Fig 4)")
    g.add_argument("--seed", dest="seed", type=int, default=None,
                   help="seeds the model's initialisation and the data (default 0)")
    add_config_options(g, [TrainConfig], skip=("seed",), seen=seen,
                       extra={"loss": "; xent for --model bridge and --preset standard",
                              "next_token": "; on for --model bridge and --preset standard"})
    parser.add_argument("--seeds", default=None, metavar="SEEDS",
                        help="train one model per seed (0-19, 0,3,7 or 0-4,10), each with its own initialisation and "
                             "data as --seed would draw them, in one batched computation; --out then holds a run "
                             "per seed (OUT/seed-S) and their index (OUT/group.json)")
    parser.add_argument("--out", default=None, help="save the run (with --seeds: the group of runs) to this directory")
    parser.add_argument("--device", choices=DEVICES, default="cpu",
                        help="where to train: cpu (default), cuda (a GPU; an error without one) or auto (the GPU if "
                             "there is one); float32 (--dtype float32) is allowed on a GPU")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads (default: 1 for a small model, else the cores that other "
                             "processes leave free)")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")


def _task_params(args: argparse.Namespace) -> dict[str, Any]:
    """The task's parameters from the command line (strings parsed to the types of the table's defaults)."""
    kind = TASKS[args.task]
    for param in {p for k in TASKS.values() for p in k.params}:
        if getattr(args, f"task_{param}") is not None and param not in kind.params:
            raise RwinterpError(f"--{param.replace('_', '-')} does not apply to --task {args.task}")
    out = {}
    for param, default in kind.params.items():
        text = getattr(args, f"task_{param}")
        if text is None:
            require(default is not MISSING, f"--task {args.task} needs --{param.replace('_', '-')}")
            out[param] = default
        else:
            out[param] = _parse_value(param, text)
    return out


def _parse_value(param: str, text: str) -> Any:
    flag = "--" + param.replace("_", "-")
    if param == "transition":
        source = Path(text).read_text() if not text.lstrip().startswith("[") and Path(text).is_file() else text
        try:
            return json.loads(source)
        except json.JSONDecodeError:
            raise RwinterpError(f"{flag} must be JSON or the path of a JSON file, got {text!r}") from None
    if param == "initial":
        if text == "uniform":
            return None
        try:
            values = json.loads(text) if text.lstrip().startswith("[") else [float(x) for x in text.split(",")]
        except (ValueError, json.JSONDecodeError):
            raise RwinterpError(f"{flag} must be 'uniform', a state or probabilities, got {text!r}") from None
        require(all(isinstance(v, (int, float)) and math.isfinite(v) for v in values),
                f"{flag} values must be finite numbers, got {text!r}")
        return values  # a single state is turned into a distribution once K is known
    kind = TASK_PARAMETERS[param][0]
    try:
        value = kind(text)
    except ValueError:
        raise RwinterpError(f"{flag} must be {'an integer' if kind is int else 'a number'}, got {text!r}") from None
    require(kind is not float or math.isfinite(value), f"{flag} must be a finite number, got {text!r}")
    return value


def _model_options(args: argparse.Namespace, K: Optional[int], N: Optional[int]) -> tuple[str, dict[str, Any]]:
    """The model kind and its options dict (checked), from the command line; K and N from the task."""
    deep_given = given(args, DeepOptions, TASK_SKIP + ("seed",))
    bridge_given = given(args, BridgeOptions, TASK_SKIP + ("seed",))
    seed = {} if args.seed is None else {"seed": args.seed}
    size = {k: v for k, v in (("n_states", K), ("n_ctx", N)) if v is not None}
    require(args.preset is None or args.model == "deep", "--preset needs --model deep")
    if args.model == "bridge":
        extra = sorted(set(deep_given) - set(bridge_given))
        if extra:
            raise RwinterpError(f"--{_flag(DeepOptions, extra[0])} does not apply to --model bridge")
        return "bridge", BridgeOptions(**{**size, **bridge_given, **seed}).to_dict()
    extra = sorted(set(bridge_given) - set(deep_given))
    if extra:
        raise RwinterpError(f"--{_flag(BridgeOptions, extra[0])} needs --model bridge")
    deep_only = [name for name in deep_given if name not in PAPER_FIELDS]
    if args.model == "paper" and deep_only:
        raise RwinterpError(f"--{_flag(DeepOptions, deep_only[0])} needs --model deep (the paper's model has one "
                            "layer with one head)")
    base = standard_options(deep_given.get("d_model", 32)) if args.preset == "standard" else {}
    options = DeepOptions(**{**size, **base, **deep_given, **seed})
    for name in deep_given:
        other = unmet_need(options, name)
        if other is not None:
            need = next(f.metadata["needs"][1] for _, f in cli_options(DeepOptions) if f.name == name)
            raise RwinterpError(f"--{_flag(DeepOptions, name)} needs --{_flag(DeepOptions, other)}"
                                f"{'' if need is None else ' ' + str(need)}")
    if args.model == "paper":
        for name, value, allowed in (("pos_embedding", options.pos_embedding, ("orthogonal", "sine")),
                                     ("init", options.init, ("zero", "gaussian"))):
            if value not in allowed:
                raise RwinterpError(f"--{_flag(DeepOptions, name)} {value} needs --model deep")
    return "deep", options.to_dict()


def _flag(cls: type, name: str) -> str:
    return next(flag for flag, f in cli_options(cls) if f.name == name).lstrip("-")


def _train_config(args: argparse.Namespace) -> TrainConfig:
    values = given(args, TrainConfig, ("seed",))
    needs_logits = args.model == "bridge" or args.preset == "standard"
    base = dict(NEXT_TOKEN) if needs_logits else {}
    if args.seed is not None:
        values["seed"] = args.seed
    config = TrainConfig(**{**base, **values})
    if config.population:
        for name in ("n_train", "n_test"):
            require(name not in values, f"--{name.replace('_', '-')} does not apply to --population (it trains and "
                                        "tests on the whole population)")
    require("eps" not in values or config.loss == "log",
            f"--eps applies to the paper's loss -log(f_y + eps) (--loss log), not to --loss {config.loss}")
    return config


def _train(args: argparse.Namespace) -> int:
    from rwinterp.atomic import check_target

    require(args.threads is None or args.threads >= 1, f"--threads must be >= 1, got {args.threads}")
    seeds = None
    if args.seeds is not None:
        require(args.seed is None, "--seed and --seeds do not go together: --seeds lists every seed to train")
        seeds = parse_seeds(args.seeds)
    params, train_config = check_train_options(args)
    if args.out is not None:  # refused now, not after the training
        from rwinterp.runs import GROUP_FILES, RUN_FILES

        check_target(args.out, "run" if seeds is None else "seed group", RUN_FILES if seeds is None else GROUP_FILES)
    from rwinterp.runs import build_model, save_run
    from rwinterp.training import TrainingDiverged, check_memory, choose_threads, resolve_device, train

    device = resolve_device(args.device)
    task, kind, options = build_train_setup(args, params, train_config)
    copies = 1 if seeds is None else len(seeds)
    check_memory(options, task, train_config, device, copies)
    set_threads(args.threads if args.threads is not None else choose_threads(options, task, train_config, copies))
    if seeds is not None:
        return _train_seeds(args, kind, options, task, train_config, seeds, device)
    model = build_model(kind, options.to_dict(), device)
    try:
        result = train(model, task, train_config, progress=False if args.no_progress or args.json else None)
    except TrainingDiverged as exc:
        sys.stderr.write(f"rwinterp: error: {exc}\n")
        return 1
    summary = run_summary(model, task, train_config, result)
    if args.out is not None:
        save_run(args.out, model, task, train_config.to_dict(), result.history, summary, result.checkpoints)
    if args.json:
        V = getattr(model, "V", None)
        print_json({**summary, "V": None if V is None else V.detach().tolist(), "history": result.history,
                    "task": task.to_dict(), "model_kind": kind, "model": options.to_dict(),
                    "train": train_config.to_dict(), "run": args.out})
        return 0
    for line in describe_run(model, task, train_config, summary):
        print(line)
    if args.out is not None:
        print(f"saved run   {args.out}")
    return 0


def check_train_options(args: argparse.Namespace) -> tuple[dict[str, Any], TrainConfig]:
    """The task's parameters and the training config that ``train``'s options (parsed into ``args``) give,
    checked, with the model's options where the task's sizes are known, before anything heavy loads (a
    task that fixes its own sizes, the QA tasks, has its model checked by :func:`build_train_setup`)."""
    train_config = _train_config(args)
    params = _task_params(args)
    K = params.get("K", (params.get("rows") or 0) * (params.get("cols") or 0) or None)
    N = params.get("N")
    if K is not None and N is not None:
        _model_options(args, K, N)
    return params, train_config


def build_train_setup(args: argparse.Namespace, params: dict[str, Any], train_config: TrainConfig
                      ) -> tuple[Any, str, Any]:
    """The task, the model kind and the model's options (a :class:`DeepOptions` or :class:`BridgeOptions`) that
    ``train``'s options give, from :func:`check_train_options`' results."""
    from rwinterp.tasks import check_population_size, task_from_dict

    params = dict(params)
    K = params.get("K", (params.get("rows") or 0) * (params.get("cols") or 0) or None)
    if isinstance(params.get("initial"), list) and len(params["initial"]) == 1:  # a state
        params["initial"] = _one_state(params["initial"][0], K)
    task = task_from_dict({"kind": args.task, **params})
    if train_config.population:  # refuse before building the model
        check_population_size(task.population_size())
    kind, options = _model_options(args, task.n_states, task.seq_len)
    return task, kind, OPTIONS[kind].from_dict(options)


def _train_seeds(args: argparse.Namespace, kind: str, options: Any, task: Any, train_config: TrainConfig,
                 seeds: list[int], device: Any) -> int:
    """``train --seeds``: every seed's model (its own initialisation and data, as ``--seed S`` would draw them)
    in one batched computation (:func:`train_seed_group`); with ``--out``, the group of runs."""
    from rwinterp.runs import save_group, seed_run_name

    members, seconds = train_seed_group(kind, options.to_dict(), task, train_config, seeds, device,
                                        progress=False if args.no_progress or args.json else None)
    for m in members:
        if m.model is None:
            sys.stderr.write(f"rwinterp: error: seed {m.seed}: {m.error}\n")
    trained = [m for m in members if m.model is not None]
    if args.out is not None and trained:
        save_group(args.out, task, members)
    status = 0 if len(trained) == len(members) else 1
    if args.json:
        runs = []
        for m in members:
            V = None if m.model is None else getattr(m.model, "V", None)
            run = None if args.out is None or m.model is None else str(Path(args.out) / seed_run_name(m.seed))
            runs.append({"seed": m.seed, **m.summary, "V": None if V is None else V.detach().tolist(),
                         "history": m.history, "error": m.error, "run": run})
        print_json({"seeds": seeds, "runs": runs, "task": task.to_dict(), "model_kind": kind,
                    "model": {k: v for k, v in options.to_dict().items() if k != "seed"},
                    "train": {k: v for k, v in train_config.to_dict().items() if k != "seed"},
                    "train_seconds": seconds,
                    "group": args.out if trained else None})
        return status
    if trained:
        for line in describe_seeds(task, train_config, members, seconds, trained[0].model):
            print(line)
    if args.out is not None and trained:
        print(f"saved group {args.out}  ({', '.join(seed_run_name(m.seed) for m in trained[:3])}"
              f"{', ...' if len(trained) > 3 else ''} and group.json)")
    return status


def train_seed_group(kind: str, options: dict[str, Any], task: Any, config: TrainConfig, seeds: Sequence[int],
                     device: Any = None, progress: Optional[bool] = None) -> tuple[list[Any], float]:
    """Train one model of ``kind`` and ``options`` per seed in one batch (:func:`rwinterp.training.train_seeds`):
    seed S sets both the model's seed and the training config's, as ``train --seed S`` does. Returns a
    :class:`rwinterp.runs.GroupMember` per seed (with its summary, :func:`run_summary`; a seed whose loss
    diverged has ``model=None`` and its ``error``), ready for :func:`rwinterp.runs.save_group`, and the seconds
    the batch took."""
    from rwinterp.runs import GroupMember, build_model
    from rwinterp.training import train_seeds

    models = [build_model(kind, {**options, "seed": seed}, device) for seed in seeds]
    configs = [config.replace(seed=seed) for seed in seeds]
    results = train_seeds(models, task, configs, progress=progress)
    members = []
    for seed, model, own, result in zip(seeds, models, configs, results):
        if result.diverged is not None:
            members.append(GroupMember(seed, None, own.to_dict(), error=result.diverged))
        else:
            members.append(GroupMember(seed, model, own.to_dict(), result.history,
                                       run_summary(model, task, own, result), result.checkpoints))
    return members, max(r.train_seconds for r in results)


def describe_seeds(task: Any, config: TrainConfig, members: list[Any], seconds: float, model: Any) -> list[str]:
    """The lines ``rwinterp train --seeds`` prints: the setting, then a row per seed and their mean."""
    trained = [m for m in members if m.model is not None]
    eps = f" eps={config.eps}" if config.loss == "log" else ""
    batch = "" if config.batch_size is None else f" batch={config.batch_size}"
    lines = [f"task        {task.describe()}   (population: {config.population})",
             f"model       {_describe_model(model)}",
             f"seeds       {_seed_list([m.seed for m in members])}: each its own initialisation and data (the "
             "model's seed and the training seed)",
             f"training    {config.optimizer} lr={config.lr}{eps}{batch} steps={config.steps} loss={config.loss}"
             f"{' (summed)' if config.reduction == 'sum' else ''}{' next-token' if config.next_token else ''}"
             f" ({len(members)} seeds in one batch: {seconds:.2f} s)",
             f"Bayes       {trained[0].summary['bayes_accuracy']:.4f}"]
    columns = [("test acc", "test_accuracy"), ("train acc", "train_accuracy"), ("parent att", "parent_attention"),
               ("V vs Pi^T", "v_distance"), ("test loss", "test_loss")]
    columns = [(title, key) for title, key in columns if any(m.summary.get(key) is not None for m in trained)]
    lines.append("seed    " + "".join(f"{title:>11}" for title, _ in columns))
    for m in members:
        if m.model is None:
            lines.append(f"{m.seed:<8d}diverged: {m.error}")
        else:
            lines.append(f"{m.seed:<8d}" + "".join(_cell(m.summary.get(key)) for _, key in columns))
    if len(trained) > 1:
        means = []
        for _, key in columns:
            values = [m.summary[key] for m in trained if m.summary.get(key) is not None]
            means.append(sum(values) / len(values) if values else None)
        lines.append("mean    " + "".join(_cell(v) for v in means))
    return lines


def _seed_list(seeds: list[int]) -> str:
    """``0-19`` for a run of consecutive seeds, else the seeds (the first 8)."""
    if seeds == list(range(seeds[0], seeds[0] + len(seeds))) and len(seeds) > 2:
        return f"{seeds[0]}-{seeds[-1]} ({len(seeds)})"
    return ", ".join(map(str, seeds[:8])) + (f", ... ({len(seeds)})" if len(seeds) > 8 else "")


def _cell(value: Any) -> str:
    return f"{'-':>11}" if value is None else f"{value:11.4f}"


def set_threads(threads: int) -> None:
    """Set torch's intra-op threads (``--threads``)."""
    import torch

    require(isinstance(threads, int) and threads >= 1, f"--threads must be >= 1, got {threads}")
    torch.set_num_threads(threads)


def _one_state(value: float, K: Optional[int]) -> list[float]:
    state = int(value)
    require(K is not None and state == value and 0 <= state < K,
            f"--initial state must be an integer in [0, {(K or 1) - 1}], got {value:g}")
    return [float(i == state) for i in range(K)]


def run_summary(model: Any, task: Any, config: TrainConfig, result: Any) -> dict[str, Any]:
    """What ``train`` prints and a run saves as its summary: the final record, the Bayes accuracy, the
    training time and, for tasks that have them, the reference predictors' test losses."""
    from rwinterp.training import held_out_data, reads_states

    final = result.final
    summary = {key: final[key] for key in ("test_accuracy", "train_accuracy", "parent_attention", "v_distance",
                                           "loss", "test_loss") if key in final}
    summary.update(bayes_accuracy=result.bayes_accuracy, train_seconds=result.train_seconds,
                   final_step=final["step"])
    if "parent_attention_heads" in final:
        summary["parent_attention_heads"] = final["parent_attention_heads"]
    references = getattr(task, "reference_losses", None)
    if callable(references):
        test = held_out_data(task, config)
        summary["reference_losses"] = references(test.states)
    summary["reads"] = "states" if reads_states(model, task) else "tokens"
    return summary


def describe_run(model: Any, task: Any, config: TrainConfig, summary: dict[str, Any]) -> list[str]:
    """The lines ``rwinterp train`` prints."""
    N = task.seq_len
    reads_states = summary["reads"] == "states"
    lines = [f"task        {task.describe()}   (population: {config.population})",
             f"model       {_describe_model(model)}"]
    eps = f" eps={config.eps}" if config.loss == "log" else ""
    batch = "" if config.batch_size is None else f" batch={config.batch_size}"
    lines.append(f"training    {config.optimizer} lr={config.lr}{eps}{batch} steps={config.steps} loss={config.loss}"
                 f"{' (summed)' if config.reduction == 'sum' else ''}{' next-token' if config.next_token else ''}"
                 f" ({summary['train_seconds']:.2f} s)")
    on_label = f"  (of s_{N}, predicted at position {N - 1 if reads_states else N})" if config.next_token else ""
    lines.append(f"accuracy    test {summary['test_accuracy']:.4f}  train {summary['train_accuracy']:.4f}  "
                 f"Bayes {summary['bayes_accuracy']:.4f}{on_label}")
    refs = summary.get("reference_losses")
    if refs:
        lines.append(f"test loss   {summary['test_loss']:.4f}   references: " + "  ".join(
            f"{name} {value:.4f}" for name, value in refs.items()))
        if "unigram" in refs and "bigram" in refs and refs["unigram"] > refs["bigram"]:
            gap = (summary["test_loss"] - refs["bigram"]) / (refs["unigram"] - refs["bigram"])
            lines.append(f"            {gap:.2f} of the unigram-to-bigram gap above the bigram loss")
    parents = ", ".join(str(p + 1) for p in task.parent_positions())
    row = f"position {N - 1}" if reads_states else f"the query slot (position {N})"
    lines.append(f"attention   layer 0 head 0, from {row}, on the parent(s) (position {parents}, 1-indexed): "
                 f"{summary['parent_attention']:.4f}")
    for layer, heads in enumerate(summary.get("parent_attention_heads", [])):
        lines.append(f"   layer {layer}: " + "  ".join(f"head {h} {a:.4f}" for h, a in enumerate(heads)))
    if summary.get("v_distance") is not None:  # a V to compare with Pi^T
        lines.append(f"V vs Pi^T   ||V/||V|| - Pi^T/||Pi^T|| ||_F = {summary['v_distance']:.4f}")
    V = getattr(model, "V", None)
    if V is not None:
        cfg = model.cfg
        form = "f = V X S"
        if cfg.mlp_width is not None:
            form = "f = A ReLU(V X S)" if cfg.act_fn == "relu" else "f = A V X S"
        elif cfg.residual or cfg.readout == "learned" or cfg.values == "all":
            form = "the head's state-to-score map (W_E W_V W_O W_U)^T"
        lines.append(f"V ({form}{'; a trained V approaches Pi^T' if summary.get('v_distance') is not None else ''}"
                     f"; rows and columns are states 1..{V.shape[1]}):")
        rows = V.detach().tolist()
        cell = "{:8.3f}" if max(abs(x) for row in rows for x in row) < 1e4 else "{:10.3e}"
        lines += ["   " + " ".join(cell.format(x) for x in row) for row in rows]
    return lines


def _describe_model(model: Any) -> str:
    options = getattr(model, "rwinterp_options", None) or model.cfg
    return options.describe()


TRAIN = Command("train", "train a model (the paper's, a deeper one, or a TransformerLens bridge) on a task and save "
                         "the run", _configure_train, _train)


# ---------------------------------------------------------------------------------------- entry
def commands() -> dict[str, Command]:
    """The sub-commands installed as ``rwinterp.commands`` entry points (``train`` always)."""
    from importlib.metadata import entry_points

    found = {"train": TRAIN}
    for point in entry_points(group=ENTRY_POINTS):
        if point.name not in found:
            command = point.load()
            require(isinstance(command, Command), f"the entry point {point.value} is not an rwinterp.cli.Command")
            found[point.name] = command
    return found


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = Parser(prog="rwinterp", description="Train small transformers on Markov chains and probe how they "
                                                 "implement them.")
    parser.add_argument("--version", action="version", version=f"rwinterp {rwinterp.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    parsers = {}
    for name, command in commands().items():
        parsers[name] = sub.add_parser(name, help=command.help, description=command.help)
        command.configure(parsers[name])
    return parser, parsers


class Terminated(BaseException):
    """SIGTERM while a command runs: unwound like Ctrl-C, so that what it was writing is removed."""


def _terminate(signum: int, frame: Any) -> None:
    raise Terminated()


def main(argv: Sequence[str] | None = None) -> int:
    parser, parsers = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        if extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        parser.print_help()
        return 2
    if extra:  # reported by the sub-command, whose --help is the one to read
        parsers[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    # SIGTERM unwinds like Ctrl-C (Python's own SIGINT handling, which a program started with Ctrl-C ignored
    # leaves ignored); a handler someone else installed is left alone.
    restore = signal.getsignal(signal.SIGTERM)
    if restore == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _terminate)
    try:
        return commands()[args.command].run(args)
    except RwinterpError as exc:
        sys.stderr.write(f"rwinterp: error: {exc}\n")
        return 2
    except (MemoryError, RuntimeError) as exc:
        too_large = ("allocate", "size calculation overflow", "out of memory")
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
    except Terminated:
        sys.stderr.write("rwinterp: terminated\n")
        return 128 + signal.SIGTERM
    finally:
        if restore == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


if __name__ == "__main__":
    # Commands are found as rwinterp.cli.Command objects: run the module's own copy, not this one.
    from rwinterp.cli import main as _main

    raise SystemExit(_main())
