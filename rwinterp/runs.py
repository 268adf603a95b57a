"""Saved runs: a directory that rebuilds the trained model, its task and its history.

A run directory holds

* ``config.json``: ``{"format", "model_kind", "model", "task", "train"}``: everything needed to
  rebuild the model and its data;
* ``model.safetensors``: the weights (state dict), with a copy of the config in its metadata;
* ``history.json``: one object per evaluated step (step 0 is the initial model) and the run's summary;
* ``checkpoints/step-S/`` (with ``--checkpoint-every``): the model at step S, each a run directory of its
  own (its history ends at step S), loadable with :func:`load_run`.

:func:`save_run` writes into a temporary sibling directory and renames it into place, so an
interrupted write never leaves a half-written run; it replaces an existing run but refuses to
overwrite a directory that is not one. :func:`load_run` checks that the files agree with each other
and raises :class:`~rwinterp.errors.RwinterpError` with a one-line reason when they do not; a
``config.json`` edited after training (another p, another seed) no longer matches the copy saved
with the weights and is refused, since the probes would rebuild the wrong task or test walks.
Weights without that copy (written by another trainer) load on their ``config.json`` alone.

A group of runs that differ only in their seed (``rwinterp train --seeds``, :func:`save_group`) is a
directory holding a run directory per seed (``seed-S``, loadable and probeable like any run) and their index
``group.json`` (the seeds, the shared configs, each seed's run and summary, or its error);
:func:`read_group` and :func:`load_group` read it back.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from rwinterp.atomic import atomic_directory
from rwinterp.errors import RwinterpError, require
from rwinterp.tasks import Task, task_from_dict

FORMAT = 2
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
HISTORY_FILE = "history.json"
#: The key of the weights file's metadata that holds the config the weights were trained with.
CONFIG_METADATA = "rwinterp_config"
#: What a run directory holds (its marker first): an existing --out is replaced only if it holds no more.
RUN_FILES = (CONFIG_FILE, WEIGHTS_FILE, HISTORY_FILE, "checkpoints/")
CHECKPOINTS = "checkpoints"


@dataclass(frozen=True)
class ModelKind:
    """How a run rebuilds a model class: ``build(config_dict)``, ``config_of(model)`` (the dict a run saves) and
    ``full_config(config_dict)`` (every default filled in: two dicts that build the same model give the same full
    config; it raises on a bad one). ``train_forward(model, tokens, pattern_row=None, keys=None)``, where given,
    is the logits that training uses when it reads no hook: the model's own function computed faster (default
    ``model(tokens)``); with a ``pattern_row`` it returns ``(logits, rows)``, each layer's attention pattern at
    that query position (``[batch, head, pos]``, or at the key positions ``keys`` alone), as
    :func:`rwinterp.training.logits_and_pattern` records it."""

    name: str
    model_class: type
    build: Callable[[dict[str, Any]], nn.Module]
    config_of: Callable[[nn.Module], dict[str, Any]]
    full_config: Callable[[dict[str, Any]], dict[str, Any]]
    train_forward: Optional[Callable[..., Any]] = None


_MODEL_KINDS: dict[str, ModelKind] = {}


def register_model_kind(
    name: str,
    model_class: type,
    *,
    build: Optional[Callable[[dict[str, Any]], nn.Module]] = None,
    config_of: Optional[Callable[[nn.Module], dict[str, Any]]] = None,
    full_config: Optional[Callable[[dict[str, Any]], dict[str, Any]]] = None,
    train_forward: Optional[Callable[..., Any]] = None,
) -> None:
    """Make ``model_class`` savable as a run of kind ``name``: ``save_run``, ``load_run``, the probes and the
    command line then take it like the library's own models. The defaults suit a class built from its config
    dict whose ``cfg`` has ``to_dict()``::

        class MyModel(HookedRootModule):      # TransformerLens hook names, a cfg, logits [batch, pos, K]
            def __init__(self, config: dict): ...

        register_model_kind("mine", MyModel)
    """
    build = build or model_class
    config_of = config_of or (lambda model: model.cfg.to_dict())
    _MODEL_KINDS[name] = ModelKind(name, model_class, build, config_of,
                                   full_config or (lambda config: config_of(build(config))), train_forward)


#: Model kinds registered by a module of the library, imported when a run of that kind is loaded.
_KIND_MODULES = {"deep": "rwinterp.model", "bridge": "rwinterp.bridge"}


def _kind(name: str) -> ModelKind:
    if name in _KIND_MODULES and name not in _MODEL_KINDS:
        import importlib

        importlib.import_module(_KIND_MODULES[name])
    require(name in _MODEL_KINDS, f"unknown model kind {name!r}; known: {', '.join(sorted(set(_KIND_MODULES) | set(_MODEL_KINDS)))}")
    return _MODEL_KINDS[name]


def model_kind_of(model: nn.Module) -> str:
    """The registered kind of a model, by its class."""
    if type(model).__module__.startswith("transformer_lens"):
        _kind("bridge")  # (registered when first needed: its module imports TransformerLens)
    for kind in _MODEL_KINDS.values():
        if isinstance(model, kind.model_class):
            return kind.name
    raise RwinterpError(f"no saved-run format is registered for {type(model).__name__}; "
                        "see rwinterp.runs.register_model_kind")


def train_forward(model: nn.Module) -> Optional[Callable[..., Any]]:
    """The registered :attr:`ModelKind.train_forward` of ``model``'s kind (``None``: none, or no kind registered)."""
    try:
        return _kind(model_kind_of(model)).train_forward
    except RwinterpError:
        return None


def model_config(model: nn.Module) -> dict[str, Any]:
    """The config dict a run of ``model`` would save (rebuild it with :func:`build_model`)."""
    return dict(_kind(model_kind_of(model)).config_of(model))


def full_model_config(kind: str, config: dict[str, Any]) -> dict[str, Any]:
    """The config dict of a registered kind with every default filled in (:attr:`ModelKind.full_config`)."""
    return dict(_kind(kind).full_config(dict(config)))


def build_model(kind: str, config: dict[str, Any], device: "str | torch.device | None" = None) -> nn.Module:
    """A fresh model of a registered kind (``"deep"``, ``"bridge"``, ...) from its config dict, on ``device``
    (a ``torch.device`` or its name; default the CPU). The weights are drawn on the CPU, so a seed gives the
    same initial model on every device."""
    model = _kind(kind).build(dict(config))
    if device is None:
        return model
    # (not moved where it already is: a TransformerBridge's move prints a line to stdout)
    here = next(iter(model.parameters()), None)
    return model if here is not None and here.device == torch.device(device) else model.to(device)


@dataclass
class Run:
    """A loaded run: the model (in eval mode), its task, and what training recorded."""

    model: nn.Module
    task: Task
    train: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    path: Optional[Path] = None


def save_run(
    directory: str | os.PathLike,
    model: nn.Module,
    task: Task,
    train: Any,
    history: Any = (),
    summary: Optional[dict[str, Any]] = None,
    checkpoints: Sequence[tuple[int, dict[str, torch.Tensor]]] = (),
) -> Path:
    """Write a run atomically; returns its path. ``train`` is the training config (a
    :class:`~rwinterp.config.TrainConfig` or its dict); ``history`` the records of the steps, or the
    :class:`~rwinterp.training.TrainResult` itself (its history and checkpoints); ``checkpoints`` ``(step,
    state_dict)`` pairs kept beside the run."""
    return atomic_directory(directory, lambda tmp: write_run(tmp, model, task, train, history, summary, checkpoints),
                            "run", RUN_FILES)


def write_run(
    where: Path,
    model: nn.Module,
    task: Task,
    train: Any,
    history: Any = (),
    summary: Optional[dict[str, Any]] = None,
    checkpoints: Sequence[tuple[int, dict[str, torch.Tensor]]] = (),
) -> None:
    """Write a run's files into the existing, empty folder ``where`` (what :func:`save_run` does inside its
    temporary folder; a group of runs writes each of its runs so, inside its own)."""
    from rwinterp.jsonable import jsonable

    train = train.to_dict() if hasattr(train, "to_dict") else dict(train)
    if hasattr(history, "history"):  # a TrainResult
        checkpoints = checkpoints or history.checkpoints
        summary = {"train_seconds": history.train_seconds, **(summary or {})}
        history = history.history
    history, summary = list(history), dict(summary or {})

    config = {
        "format": FORMAT,
        "model_kind": model_kind_of(model),
        "model": model_config(model),
        "task": task.to_dict(),
        "train": jsonable(train),
    }
    history, summary = jsonable(history), jsonable(summary)
    _write_run(where, config, model.state_dict(), history, summary)
    for step, state in checkpoints:
        at = where / CHECKPOINTS / f"step-{step:09d}"
        at.mkdir(parents=True)
        _write_run(at, config, state, [h for h in history if h["step"] <= step], {"step": step})


def _write_run(where: Path, config: dict[str, Any], state: dict[str, torch.Tensor], history: list, summary: dict) -> None:
    from safetensors.torch import save

    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
    # (save_file would make it readable by its owner only)
    (where / WEIGHTS_FILE).write_bytes(save(state, metadata={CONFIG_METADATA: json.dumps(config)}))
    (where / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    (where / HISTORY_FILE).write_text(json.dumps({"summary": summary, "history": history}, indent=1))


def checkpoint_dirs(run: str | os.PathLike) -> list[tuple[int, Path]]:
    """The checkpoints of a run directory, ``(step, path)`` by step."""
    found = []
    folder = Path(run) / CHECKPOINTS
    if folder.is_dir():
        for path in folder.iterdir():
            step = path.name.removeprefix("step-")
            if path.name.startswith("step-") and step.isdigit() and (path / CONFIG_FILE).is_file():
                found.append((int(step), path))
    return sorted(found)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise RwinterpError(f"not a run directory: {path.parent} (missing {path.name})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RwinterpError(f"unreadable {path}: {exc}") from None


def first_difference(a: Any, b: Any, where: str = "") -> Optional[tuple[str, Any, Any]]:
    """The first key path (``"task.p"``) at which two JSON values differ, with the two values there;
    None if they are equal."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            found = first_difference(a.get(key), b.get(key), f"{where}.{key}" if where else key)
            if found is not None:
                return found
        return None
    return None if a == b and isinstance(a, bool) == isinstance(b, bool) else (where, a, b)


def _check_saved_config(path: Path, config: dict[str, Any], metadata: Optional[dict[str, str]]) -> None:
    """Refuse a ``config.json`` that differs from the config saved in the weights' metadata."""
    if not metadata or CONFIG_METADATA not in metadata:
        return
    try:
        saved = json.loads(metadata[CONFIG_METADATA])
    except json.JSONDecodeError:
        raise RwinterpError(f"unreadable {path / WEIGHTS_FILE}: its saved config is not JSON") from None
    found = first_difference(config, saved)
    if found is not None:
        key, here, there = found
        raise RwinterpError(f"{path / CONFIG_FILE} was changed after training: {key} is "
                            f"{json.dumps(here)}, the weights were trained with {json.dumps(there)}")


def load_run(directory: str | os.PathLike, device: "str | torch.device | None" = None) -> Run:
    """Rebuild a saved run; the model comes back in eval mode with identical outputs, on ``device`` (default
    the CPU)."""
    from safetensors import SafetensorError, safe_open

    require(str(directory) != "", "not a run directory: the name is empty")
    path = Path(directory)
    require(path.is_dir(), f"not a run directory: {path} does not exist or is not a directory")
    config = _read_json(path / CONFIG_FILE)
    require(isinstance(config, dict) and "format" in config, f"{path / CONFIG_FILE} is not a run config")
    require(config["format"] == FORMAT, f"{path} was written by another version of rwinterp (run format "
                                        f"{config['format']!r}, this one reads {FORMAT}): train it again")
    for key in ("model_kind", "model", "task", "train"):
        require(key in config, f"{path / CONFIG_FILE} lacks {key!r}")
        wanted = str if key == "model_kind" else dict
        require(isinstance(config[key], wanted),
                f"{path / CONFIG_FILE}: {key!r} must be a JSON {'string' if wanted is str else 'object'}")
    history = _read_json(path / HISTORY_FILE)
    require(isinstance(history, dict) and isinstance(history.get("history"), list)
            and isinstance(history.get("summary", {}), dict), f"{path / HISTORY_FILE} is malformed")
    task = task_from_dict(config["task"])
    try:
        model = _kind(config["model_kind"]).build(config["model"])
    except (TypeError, RwinterpError) as exc:
        raise RwinterpError(f"bad model config in {path / CONFIG_FILE}: {exc}") from None
    cfg = model.cfg
    require(getattr(cfg, "n_states", task.n_states) == task.n_states,
            f"mismatched run: the model has K={getattr(cfg, 'n_states', '?')} but the task has K={task.n_states}")
    require(getattr(cfg, "n_ctx", task.seq_len) >= task.seq_len,
            f"mismatched run: the model has N={cfg.n_ctx} but the task has N={task.seq_len}")
    try:
        with safe_open(str(path / WEIGHTS_FILE), framework="pt") as weights:
            metadata = weights.metadata()
            state = {name: weights.get_tensor(name) for name in weights.keys()}
    except FileNotFoundError:
        raise RwinterpError(f"not a run directory: {path} (missing {WEIGHTS_FILE})") from None
    except (SafetensorError, OSError) as exc:
        raise RwinterpError(f"unreadable {path / WEIGHTS_FILE}: {exc}") from None
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    require(not missing and not extra,
            f"mismatched weights in {path}: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, tensor in state.items():
        require(tensor.shape == expected[name].shape,
                f"mismatched weights in {path}: {name} has shape {list(tensor.shape)}, "
                f"the config implies {list(expected[name].shape)}")
        require(tensor.dtype == expected[name].dtype,
                f"mismatched weights in {path}: {name} is {tensor.dtype}, the config says {expected[name].dtype}")
        require(not tensor.is_floating_point() or bool(torch.isfinite(tensor).all()),
                f"non-finite weights in {path / WEIGHTS_FILE}: {name}")
    _check_saved_config(path, config, metadata)
    with torch.no_grad():
        model.load_state_dict(state)
    model.eval()
    if device is not None:
        model.to(device)
    return Run(model, task, config["train"], history["history"], history.get("summary", {}), path)


# ---------------------------------------------------------------------------------------- groups of seeds
GROUP_FILE = "group.json"
GROUP_FORMAT = 1
#: What a seed group's directory holds (its marker first): the index and one run directory per seed.
GROUP_FILES = (GROUP_FILE, "seed-*/")


@dataclass
class GroupMember:
    """One seed of a group: its trained model, training config (a dict), history and summary; or, for a seed
    whose training failed, ``model=None`` and the ``error``."""

    seed: int
    model: Optional[nn.Module]
    train: dict[str, Any]
    history: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    checkpoints: Sequence[tuple[int, dict[str, torch.Tensor]]] = ()
    error: Optional[str] = None


def seed_run_name(seed: int) -> str:
    """The run directory of a seed inside its group: ``seed-S``."""
    return f"seed-{seed}"


def save_group(directory: str | os.PathLike, task: Task, members: Sequence[GroupMember]) -> Path:
    """Write a group of runs that differ only in their seed (``rwinterp train --seeds``), all at once: a run
    directory per seed that trained (``seed-S``, a run like any other: :func:`load_run` reads it) and the
    index ``group.json``:

    ``{"format", "kind": "seeds", "seeds": [...], "task", "model_kind", "model", "train", "runs": [{"seed",
    "run", "summary"} or {"seed", "run": null, "error"}]}``, where ``model`` and ``train`` are the shared
    configs (their ``seed`` left out) and ``run`` the run directory relative to the group. Read it back with
    :func:`read_group` and :func:`load_group`."""
    from rwinterp.jsonable import jsonable

    require(len(members) >= 1, "a group needs at least one run")
    seeds = [m.seed for m in members]
    require(len(set(seeds)) == len(seeds), "a group lists each seed once")
    trained = [m for m in members if m.model is not None]
    require(len(trained) >= 1, "no seed of the group finished training: nothing to save")
    first = trained[0]
    index = {
        "format": GROUP_FORMAT,
        "kind": "seeds",
        "seeds": seeds,
        "task": task.to_dict(),
        "model_kind": model_kind_of(first.model),
        "model": {k: v for k, v in model_config(first.model).items() if k != "seed"},
        "train": {k: v for k, v in jsonable(first.train).items() if k != "seed"},
        "runs": [{"seed": m.seed, "run": seed_run_name(m.seed), "summary": jsonable(m.summary)}
                 if m.model is not None else {"seed": m.seed, "run": None, "error": m.error} for m in members],
    }

    def build(tmp: Path) -> None:
        for m in trained:
            where = tmp / seed_run_name(m.seed)
            where.mkdir()
            write_run(where, m.model, task, m.train, m.history, m.summary, m.checkpoints)
        (tmp / GROUP_FILE).write_text(json.dumps(index, indent=1))

    return atomic_directory(directory, build, "seed group", GROUP_FILES)


def is_group(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` is a group of runs (holds a ``group.json``)."""
    return (Path(directory) / GROUP_FILE).is_file()


def read_group(directory: str | os.PathLike) -> dict[str, Any]:
    """The index of a group of runs (see :func:`save_group`), checked, with each finished run's ``path``
    (absolute) added."""
    path = Path(directory)
    require(path.is_dir(), f"not a seed group: {path} does not exist or is not a directory")
    require((path / GROUP_FILE).is_file(), f"not a seed group: {path} has no {GROUP_FILE}")
    index = _read_json(path / GROUP_FILE)
    require(isinstance(index, dict) and index.get("kind") == "seeds" and isinstance(index.get("runs"), list),
            f"{path / GROUP_FILE} is not a seed group's index")
    require(index.get("format") == GROUP_FORMAT, f"{path} was written by another version of rwinterp (group format "
                                                 f"{index.get('format')!r}, this one reads {GROUP_FORMAT})")
    for entry in index["runs"]:
        require(isinstance(entry, dict) and "seed" in entry and "run" in entry,
                f"{path / GROUP_FILE}: malformed entry {entry!r}")
        if entry["run"] is not None:
            run = path / str(entry["run"])
            require(run.resolve().parent == path.resolve() and run.is_dir(),
                    f"{path / GROUP_FILE}: the run of seed {entry['seed']} ({entry['run']}) is not in the group")
            entry["path"] = str(run.resolve())
    return index


def load_group(directory: str | os.PathLike, device: "str | torch.device | None" = None) -> list[Run]:
    """The finished runs of a group, in the index's order (a seed whose training failed has none)."""
    return [load_run(entry["path"], device) for entry in read_group(directory)["runs"] if entry["run"] is not None]
