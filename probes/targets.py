"""Where a model's predictions are read, and where each prediction's parents sit.

The probes never ask which class a model is. They look at the model's shapes and ask the task:

* **Query-slot models** (the paper's model): the model reads ``batch.tokens`` (the observed
  states followed by the query token) and its logits have a position axis of length one, the
  query slot. There is one prediction per walk, read at input position ``N - 1``, and its
  parents are ``task.parent_positions()`` (the last observed state for a first-order chain, a
  set of positions for higher-order chains or question-answering tasks).
* **Autoregressive models** (a standard transformer trained on next-token prediction): the
  model reads ``batch.states`` (the whole walk ``s_1 .. s_N``) and returns logits
  ``[batch, pos, d_vocab]``. The logits at position ``t`` predict ``states[t + 1]``, so there is
  one prediction per position. Parents are the task's parents moved with the prediction: the
  label ``s_N`` of the query layout sits at position ``N - 1`` and has parents
  ``task.parent_positions()``, so the prediction of ``states[t + 1]`` has parents
  ``t + 1 - (N - 1) + p`` for each task parent ``p``: position ``t`` itself for a first-order
  chain, ``{t - 1, t}`` for a second-order one. Predictions whose parents would fall before the
  start of the walk are left out.

How the kind is decided (:func:`detect_kind`): a model whose input vocabulary cannot hold the
query token is autoregressive; otherwise two walks are run through it and a position axis of
length one means a query-slot model. Pass ``kind=`` to override.

Everything here is read-only: :func:`evaluating` puts a model in eval mode for the duration of a
probe and restores every submodule's own mode afterwards, and no probe touches a weight.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from rwinterp.errors import RwinterpError, require
from rwinterp.tasks import Batch, Task

KINDS = ("query", "autoregressive")


@contextlib.contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[None]:
    """Eval mode inside the block; every submodule gets its own previous mode back afterwards."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for module, mode in modes:
            module.training = mode


def head_name(layer: int, head: int) -> str:
    """A head's name in reports, JSON and graphs: ``L{layer}H{head}``."""
    return f"L{layer}H{head}"


def hook_names(model: Any) -> set[str]:
    """Names of the hook points a model offers (TransformerLens ``hook_dict``)."""
    hooks = getattr(model, "hook_dict", None)
    require(isinstance(hooks, dict), f"{type(model).__name__} has no TransformerLens hook points (hook_dict)")
    return set(hooks)


def require_hooks(model: Any, names: Sequence[str], probe: str) -> None:
    """Raise a one-line error naming the first hook the probe needs and the model lacks."""
    have = hook_names(model)
    for name in names:
        require(name in have, f"the {probe} probe needs the hook {name!r}, which {type(model).__name__} lacks")


def model_config(model: Any) -> Any:
    """The model's TransformerLens config (``model.cfg``), or a one-line error."""
    cfg = getattr(model, "cfg", None)
    require(cfg is not None, f"{type(model).__name__} has no TransformerLens config (cfg)")
    return cfg


def model_dims(model: Any) -> tuple[int, int]:
    """``(n_layers, n_heads)`` from the model's TransformerLens config."""
    cfg = model_config(model)
    return int(cfg.n_layers), int(cfg.n_heads)


def run_logits(model: Any, inputs: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch lpos vocab"]:
    """The model's logits, checked to be ``[batch, pos, vocab]``."""
    with torch.no_grad():
        logits = model(inputs)
    require(isinstance(logits, Tensor) and logits.ndim == 3,
            f"the model must return logits [batch, pos, vocab], got {getattr(logits, 'shape', type(logits))}")
    return logits


def detect_kind(model: Any, task: Task) -> str:
    """``"query"`` or ``"autoregressive"``, from the model's vocabulary and output shape."""
    cfg = model_config(model)
    require(int(cfg.n_ctx) >= task.seq_len,
            f"the model reads at most {cfg.n_ctx} positions but the task's walks have N={task.seq_len}")
    if int(cfg.d_vocab) < task.d_vocab:
        return "autoregressive"
    logits = _task_logits(model, task, task.sample(2, seed=0).tokens)
    return "query" if logits.shape[1] == 1 else "autoregressive"


def _task_logits(model: Any, task: Task, inputs: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch lpos vocab"]:
    """:func:`run_logits`, with a model's refusal of the task's inputs as a one-line error."""
    try:
        return run_logits(model, inputs)
    except Exception as exc:  # the model refused the task's walks
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise RwinterpError(f"the model cannot read this task's walks (K={task.n_states}, "
                            f"N={task.seq_len}): {message}") from None


def is_chain(task: Task) -> bool:
    """Whether the task's parents move with the prediction (:attr:`rwinterp.tasks.Task.parents_move`: a
    Markov chain of some order, fixed or drawn per sequence)."""
    return bool(getattr(task, "parents_move", False))


@dataclass
class Layout:
    """Where each prediction is made and where its parents sit (the same for every walk).

    Prediction ``i`` is made at input position ``source[i]``; ``parents[i]`` marks the input
    positions of its parents and ``visible[i]`` those it can attend to.
    """

    kind: str
    source: Int[Tensor, " pred"]
    parents: Bool[Tensor, "pred pos"]
    visible: Bool[Tensor, "pred pos"]

    def layout(self) -> "Layout":
        return Layout(self.kind, self.source, self.parents, self.visible)

    def by_offset(self, values: Float[Tensor, "... pred pos"]) -> tuple[Tensor, Tensor]:
        """Sums of ``values[..., i, j]`` by offset ``j - source[i]`` (``-(n_pos - 1) .. 0``, index
        ``offset + n_pos - 1``), and how many predictions see each offset."""
        n_pos = values.shape[-1]
        sums = values.new_zeros(*values.shape[:-2], n_pos)
        counts = torch.zeros(n_pos, dtype=values.dtype)
        for i, s in enumerate(self.source.tolist()):
            idx = torch.arange(s + 1) - s + n_pos - 1
            sums.index_add_(-1, idx, values[..., i, : s + 1])
            counts.index_add_(0, idx, torch.ones(s + 1, dtype=values.dtype))
        return sums, counts


@dataclass
class Targets(Layout):
    """Predictions of a model on a batch of walks: what it reads and where to look.

    ``labels[b, i]`` is the true next state of prediction ``i`` of walk ``b``; the prediction is
    ``logits[b, read[i]]``, made at input position ``source[i]`` (see :class:`Layout`).
    """

    inputs: Int[Tensor, "batch pos"]
    labels: Int[Tensor, "batch pred"]
    read: Int[Tensor, " pred"]
    n_states: int
    n_logit_pos: int
    weights: Float[Tensor, " batch"] | None = None

    @property
    def n_walks(self) -> int:
        return int(self.inputs.shape[0])

    @property
    def n_pos(self) -> int:
        return int(self.inputs.shape[1])

    @property
    def n_pred(self) -> int:
        return int(self.read.shape[0])

    def parent_sets(self) -> list[tuple[int, ...]]:
        """The parent positions of every prediction, as tuples."""
        return [tuple(int(j) for j in torch.nonzero(row).flatten()) for row in self.parents]

    def with_batch(self, task: Task, batch: Batch) -> "Targets":
        """The same predictions on other walks of the same task (e.g. the corrupted walks)."""
        return _build(self.kind, task, batch, self.n_logit_pos)

    def query_index(self, q_len: int) -> Int[Tensor, " pred"]:
        """Index of each prediction along an activation's query axis of length ``q_len``
        (``hook_pattern``'s ``query_pos``, ``hook_z``'s ``pos``)."""
        if q_len == self.n_pos:
            return self.source
        require(q_len == self.n_logit_pos,
                f"an activation has a query axis of length {q_len}; expected {self.n_pos} or {self.n_logit_pos}")
        return self.read

    def select(self, logits: Float[Tensor, "... batch lpos vocab"]) -> Float[Tensor, "... batch pred K"]:
        """The state logits of every prediction."""
        return logits[..., self.read, : self.n_states]


def targets_for(model: Any, task: Task, batch: Batch, kind: str | None = None) -> Targets:
    """The predictions of ``model`` on ``batch`` (see the module docstring). Checks that the
    model and the task agree (states K, walk length N, output size) and raises a one-line
    :class:`~rwinterp.errors.RwinterpError` where they do not."""
    require(kind is None or kind in KINDS, f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    cfg = model_config(model)
    K = task.n_states
    n_states = getattr(cfg, "n_states", None)
    require(n_states is None or int(n_states) == K,
            f"mismatched K: the model has {n_states} states but the task has K={K}")
    require(batch.tokens.shape[1] == task.seq_len,
            f"the walks have {batch.tokens.shape[1]} positions but the task has N={task.seq_len}")
    kind = kind or detect_kind(model, task)
    first = _build(kind, task, batch[:2], 1)
    logits = _task_logits(model, task, first.inputs)
    out = int(logits.shape[-1])
    require(out == K, f"mismatched K: the model predicts {out} classes but the task has K={K} states")
    if kind == "query":
        require(logits.shape[1] in (1, task.seq_len),
                f"a query-slot model must return logits at 1 or N={task.seq_len} positions, got {logits.shape[1]}")
    else:
        require(logits.shape[1] == task.seq_len,
                f"an autoregressive model must return logits at every position, got {logits.shape[1]}")
    return _build(kind, task, batch, int(logits.shape[1]))


def _build(kind: str, task: Task, batch: Batch, n_logit_pos: int) -> Targets:
    N = task.seq_len
    parents = tuple(task.parent_positions())
    require(len(parents) >= 1 and all(0 <= p < N - 1 for p in parents),
            f"the task's parent positions {parents} must lie in [0, N - 2]")
    if kind == "query":
        parent_mask = torch.zeros(1, N, dtype=torch.bool)
        parent_mask[0, list(parents)] = True
        return Targets(kind=kind, source=torch.tensor([N - 1]), parents=parent_mask,
                       visible=torch.ones(1, N, dtype=torch.bool), inputs=batch.tokens,
                       labels=batch.labels[:, None], read=torch.tensor([n_logit_pos - 1]),
                       n_states=task.n_states, n_logit_pos=n_logit_pos, weights=batch.weights)
    require(is_chain(task), f"an autoregressive model predicts every next state, which needs a Markov-chain "
            f"task (parents that move with the prediction); {task.describe()} is not one")
    require(batch.states is not None,
            "an autoregressive model reads whole walks, but this task's batches have no states")
    rel = torch.tensor(parents) - (N - 1)  # parent offsets from the label position, all < 0
    t = torch.arange(int(-rel.min()) - 1, N - 1)  # predictions whose parents all exist
    require(len(t) >= 1, "the walks are too short for any prediction to see all of its parents")
    parent_pos = t[:, None] + 1 + rel[None, :]
    parent_mask = torch.zeros(len(t), N, dtype=torch.bool)
    parent_mask.scatter_(1, parent_pos, True)
    visible = torch.arange(N)[None, :] <= t[:, None]
    return Targets(kind=kind, source=t.clone(), parents=parent_mask, visible=visible, inputs=batch.states,
                   labels=batch.states[:, t + 1], read=t, n_states=task.n_states, n_logit_pos=n_logit_pos,
                   weights=batch.weights)


def logit_diff(
    logits: Float[Tensor, "... batch lpos vocab"],
    targets: Targets,
    good: Int[Tensor, "batch pred"],
    bad: Int[Tensor, "batch pred"],
) -> Float[Tensor, "... batch pred"]:
    """``logit[good] - logit[bad]`` at every prediction (float64)."""
    sel = targets.select(logits).to(torch.float64)
    shape = sel.shape[:-1]
    g = good.expand(shape)[..., None]
    b = bad.expand(shape)[..., None]
    return (sel.gather(-1, g) - sel.gather(-1, b))[..., 0]


def restrict(batch: Batch, n: int | None) -> Batch:
    """The first ``n`` walks (all when ``n`` is None or larger than the batch)."""
    if n is None or n >= len(batch):
        return batch
    return batch[:n]


def run_test_walks(run: Any) -> Batch:
    """The walks a saved run was evaluated on: its test walks (the population in population
    mode), rebuilt from the run's training config without drawing its training walks. A run of
    another trainer may record other keys too, which are ignored; the keys of a
    :class:`~rwinterp.training.TrainConfig` it records are checked as any training config's are
    (the defaults, e.g. 1000 test walks from seed 0, fill in the rest)."""
    from dataclasses import fields

    from rwinterp.training import TrainConfig, held_out_data

    known = {f.name for f in fields(TrainConfig)}
    config = TrainConfig.from_dict({k: v for k, v in run.train.items() if k in known})
    return held_out_data(run.task, config)
