"""Saved runs: a directory that rebuilds the trained model, its task and its history.

A run directory holds

* ``config.json``: ``{"format", "model_kind", "model", "task", "train"}``: everything needed to
  rebuild the model and its data;
* ``model.safetensors``: the weights (state dict), with a copy of the config in its metadata;
* ``history.json``: one object per step (step 0 is the initial model) and the run's summary.

:func:`save_run` writes into a temporary sibling directory and renames it into place, so an
interrupted write never leaves a half-written run; it replaces an existing run but refuses to
overwrite a directory that is not one. :func:`load_run` checks that the files agree with each other
and raises :class:`~rwinterp.errors.RwinterpError` with a one-line reason when they do not; a
``config.json`` edited after training (another p, another seed) no longer matches the copy saved
with the weights and is refused, since the probes would rebuild the wrong task or test walks.
Weights without that copy (written by another trainer) load on their ``config.json`` alone.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from rwinterp.atomic import atomic_directory
from rwinterp.errors import RwinterpError, require
from rwinterp.tasks import Task, task_from_dict

FORMAT = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
HISTORY_FILE = "history.json"
#: The key of the weights file's metadata that holds the config the weights were trained with.
CONFIG_METADATA = "rwinterp_config"
#: What a run directory holds (its marker first): an existing --out is replaced only if it holds no more.
RUN_FILES = (CONFIG_FILE, WEIGHTS_FILE, HISTORY_FILE)


@dataclass
class ModelKind:
    """How to rebuild a model class from its config dict, and read its config back.

    ``full_config`` turns a config dict into the one a built model would save, every default filled in
    (two dicts that build the same model give the same full config); it raises on a bad one.
    """

    build: Callable[[dict[str, Any]], nn.Module]
    config_of: Callable[[nn.Module], dict[str, Any]]
    full_config: Callable[[dict[str, Any]], dict[str, Any]]


_MODEL_KINDS: dict[str, ModelKind] = {}


def register_model_kind(name: str, kind: ModelKind) -> None:
    _MODEL_KINDS[name] = kind


def model_kind_of(model: nn.Module) -> str:
    """The registered kind of a model: its class's ``run_kind``."""
    name = getattr(model, "run_kind", None)
    require(name in _MODEL_KINDS, f"no saved-run format is registered for {type(model).__name__}")
    return name


#: Model kinds registered by a module of the library, imported when a run of that kind is loaded.
_KIND_MODULES = {"walk": "rwinterp.model", "deep": "rwinterp.deep"}


def _kind(name: str) -> ModelKind:
    if name in _KIND_MODULES and name not in _MODEL_KINDS:
        import importlib

        importlib.import_module(_KIND_MODULES[name])
    require(name in _MODEL_KINDS, f"unknown model kind {name!r} in the run's config")
    return _MODEL_KINDS[name]


def model_config(model: nn.Module) -> dict[str, Any]:
    """The config dict a run of ``model`` would save (rebuild it with :func:`build_model`)."""
    return dict(_kind(model_kind_of(model)).config_of(model))


def full_model_config(kind: str, config: dict[str, Any]) -> dict[str, Any]:
    """The config dict of a registered kind with every default filled in (:attr:`ModelKind.full_config`)."""
    return dict(_kind(kind).full_config(dict(config)))


def build_model(kind: str, config: dict[str, Any]) -> nn.Module:
    """A fresh model of a registered kind (``"walk"``, ``"deep"``, ...) from its config dict."""
    return _kind(kind).build(dict(config))


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
    train: dict[str, Any],
    history: list[dict[str, Any]],
    summary: dict[str, Any],
) -> Path:
    """Write a run atomically; returns its path."""
    from safetensors.torch import save

    kind = model_kind_of(model)
    config = {
        "format": FORMAT,
        "model_kind": kind,
        "model": model_config(model),
        "task": task.to_dict(),
        "train": train,
    }
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}

    def build(tmp: Path) -> None:
        # (save_file would make it readable by its owner only)
        (tmp / WEIGHTS_FILE).write_bytes(save(state, metadata={CONFIG_METADATA: json.dumps(config)}))
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2))
        (tmp / HISTORY_FILE).write_text(json.dumps({"summary": summary, "history": history}, indent=1))

    return atomic_directory(directory, build, "run", RUN_FILES)


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


def load_run(directory: str | os.PathLike) -> Run:
    """Rebuild a saved run; the model comes back in eval mode with identical outputs."""
    from safetensors import SafetensorError, safe_open

    require(str(directory) != "", "not a run directory: the name is empty")
    path = Path(directory)
    require(path.is_dir(), f"not a run directory: {path} does not exist or is not a directory")
    config = _read_json(path / CONFIG_FILE)
    require(isinstance(config, dict) and config.get("format") == FORMAT,
            f"{path / CONFIG_FILE} is not a version-{FORMAT} run config")
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
    except TypeError as exc:
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
    return Run(model, task, config["train"], history["history"], history.get("summary", {}), path)
