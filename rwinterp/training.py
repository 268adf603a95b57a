"""One training loop for every model kind: the paper's full-batch gradient descent, and the usual
alternatives as options (:class:`rwinterp.config.TrainConfig`).

The paper trains V and W by plain gradient descent, ``theta <- theta - lr * grad``, on the loss
``-log(f[y] + eps)`` averaged over 1000 sampled walks (experiments) or its expectation over all walks
(theory, ``population=True``). Mini-batch SGD and AdamW, softmax cross-entropy and squared losses are
options. A model may say how its parameters are stepped (``model.param_groups``: the paper's model keeps
only ``u = W x~_N`` of W and steps it as gradient descent on W would); every other model is trained on all
its parameters with the plain learning rate.

What the model predicts:

* **Query-slot training** (the paper's): the loss is on the scores at the last position, the label.
* **Next-token training** (``next_token=True``): every position predicts the next state. A model that reads
  the query token (the library's own, ``d_vocab = K + 1``) reads ``batch.tokens`` and its position t predicts
  s_{t+2}, the query slot the label; a model whose vocabulary holds only the K states (a TransformerLens
  bridge) reads the whole sequence ``batch.states`` and its position t predicts ``states[t + 1]``. Each
  position's loss is averaged.

Every evaluated step records the loss, train and test accuracy (of the label), the test loss, the mean
attention on the label's parents (of every layer and head when there are several) and the distance of V
to Pi^T; a diverging loss stops training with the last good state kept. Tasks that draw fresh samples for
every batch (``task.fresh_batches``, the in-context chains) do so when the optimiser is mini-batch.

Many seeds at once: :func:`train_seeds` trains several models of one configuration (one per seed, each with
its own initialisation and data) in one batched computation, their parameters stacked and their forward
pass mapped over the stack with ``torch.func.vmap`` (:mod:`rwinterp.stack`; the paper's model computes the
stack itself, without ``vmap``: ``DeepTransformer.computes_stacks``), with the same loop as
:func:`train`: each model's history and weights are those of training it alone (float64: to 1e-10
relative, bit for bit on the paper's model in the library's tests).

Devices: training runs where the model is (``build_model(..., device=)``, ``model.to(device)``,
:func:`resolve_device` for ``--device``); tasks sample on the CPU and the samples are moved. Threads:
:func:`choose_threads` picks the intra-op threads (one for small models), and :func:`one_thread_per_worker`
makes a pool's worker train with one thread.
"""

from __future__ import annotations

import functools
import inspect
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from rwinterp import losses
from rwinterp.config import DEVICES, TrainConfig
from rwinterp.errors import RwinterpError, require
from rwinterp.metrics import accuracy_tensor, parent_attention_tensor, transition_distance_tensor
from rwinterp.tasks import Batch, Task

__all__ = ["TrainConfig", "TrainResult", "TrainingDiverged", "train", "train_seeds", "make_data", "held_out_data"]


@dataclass
class TrainResult:
    """Per-step history (step 0 is the initial model; with ``eval_every`` > 1 only the evaluated steps), the
    checkpoints kept (``(step, state_dict)``) and where training ended."""

    history: list[dict[str, Any]] = field(default_factory=list)
    train_seconds: float = 0.0
    checkpoints: list[tuple[int, dict[str, torch.Tensor]]] = field(default_factory=list)
    #: Why training stopped early (:func:`train_seeds`, where one model's diverging loss does not stop the
    #: others); None for a run that finished. :func:`train` raises :class:`TrainingDiverged` instead.
    diverged: Optional[str] = None
    task: Optional[Task] = field(default=None, repr=False, compare=False)

    @property
    def bayes_accuracy(self) -> float:
        """The task's Bayes accuracy, the ceiling of the test accuracy: computed when first asked (for some
        tasks a Monte Carlo estimate over 10,000 samples, which training itself does not need)."""
        return math.nan if self.task is None else self.task.bayes_accuracy()

    @property
    def final(self) -> dict[str, Any]:
        return self.history[-1]


class TrainingDiverged(RwinterpError):
    """The loss became NaN or infinite; the model keeps the last good state."""

    def __init__(self, message: str, result: TrainResult):
        super().__init__(message)
        self.result = result


def data_seeds(seed: int) -> tuple[int, int]:
    """Independent seeds for the training and the test samples, derived from one seed."""
    train, test = np.random.SeedSequence(seed).generate_state(2)
    return int(train), int(test)


def make_data(task: Task, config: TrainConfig) -> tuple[Batch, Batch]:
    """The training and test data: sampled, or the exact population for both."""
    if config.population:
        pop = task.population()
        return pop, pop
    return task.sample(config.n_train, data_seeds(config.seed)[0]), held_out_data(task, config)


def held_out_data(task: Task, config: TrainConfig) -> Batch:
    """The test data of :func:`make_data` alone (the training samples are not drawn)."""
    if config.population:
        return task.population()
    return task.sample(config.n_test, data_seeds(config.seed)[1])


def model_states(model: torch.nn.Module) -> int:
    """How many states the model predicts: ``cfg.n_states`` (the library's model), else its output vocabulary."""
    cfg = model.cfg
    states = getattr(cfg, "n_states", None) or getattr(cfg, "d_vocab_out", -1)
    return int(states) if states and states > 0 else int(cfg.d_vocab)


def reads_states(model: torch.nn.Module, task: Task) -> bool:
    """Whether ``model`` reads whole sequences (its vocabulary holds the K states but not the query token)
    rather than ``batch.tokens``."""
    return int(model.cfg.d_vocab) < task.d_vocab


def model_inputs(batch: Batch, states: bool) -> torch.Tensor:
    require(not states or batch.states is not None, "this model reads whole sequences, which this task lacks")
    return batch.states if states else batch.tokens


def label_row(states: bool) -> int:
    """Index of the logits row that predicts the label: the query slot, or the position before it."""
    return -2 if states else -1


def logits_and_pattern(model: torch.nn.Module, inputs: torch.Tensor, row: int = -1,
                       keys: Optional[Sequence[int]] = None, **forward_kwargs: Any
                       ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Logits of ``inputs`` and, read from ``hook_pattern``, row ``row`` of each layer's attention pattern
    (``[batch, heads, pos]``, or only the key positions ``keys``; detached: the query slot's, or the row that
    predicts the label). ``forward_kwargs`` go to the model's forward pass."""
    heads: list[torch.Tensor] = []

    def grab(pattern: torch.Tensor, hook: Any) -> None:
        at_row = pattern[:, :, row if pattern.shape[2] > 1 else -1, :]
        heads.append((at_row if keys is None else at_row[..., list(keys)]).detach())

    hooks = [(f"blocks.{layer}.attn.hook_pattern", grab) for layer in range(model.cfg.n_layers)]
    return model.run_with_hooks(inputs, fwd_hooks=hooks, **forward_kwargs), heads


def next_token_targets(batch: Batch, states: bool) -> torch.Tensor:
    """What every position predicts (see the module docstring)."""
    require(batch.states is not None, "next-token training needs a task that provides whole sequences")
    return batch.states[:, 1:] if states else torch.cat([batch.states[:, 1:], batch.labels[:, None]], dim=1)


def objective(config: TrainConfig, logits: torch.Tensor, batch: Batch, states: bool = False,
              K: Optional[int] = None) -> torch.Tensor:
    """The training loss: on the label's scores, or (``next_token``) on every position's."""
    K = K or logits.shape[-1]
    if not config.next_token:
        return losses.loss(config.loss, logits[..., label_row(states), :K], batch.labels, batch.weights, config.eps)
    targets = next_token_targets(batch, states)
    logits = logits[:, : targets.shape[1], :K]
    require(logits.shape[1] == targets.shape[1],
            "next-token training needs a model that predicts at every position (attention='causal')")
    per_position = losses.per_sample_loss(config.loss, logits.flatten(0, 1), targets.flatten(), config.eps)
    return losses.average(per_position.view(targets.shape).mean(1), batch.weights)


def reduction_scale(config: TrainConfig, batch: Batch) -> float:
    """What the mean loss is multiplied by before the gradient step.

    ``reduction="mean"`` (the paper's reading): 1. ``reduction="sum"``: the loss summed over the samples of
    the batch rather than averaged, i.e. the mean times their number (with ``population=True``, ``n_train``
    times the expectation). Plain gradient descent on the sum with learning rate ``lr`` is gradient descent
    on the mean with learning rate ``lr * n``. The recorded ``loss`` stays the mean per sample.
    """
    if config.reduction == "mean":
        return 1.0
    return float(config.n_train if batch.weights is not None else len(batch))


class GradientDescent(torch.optim.Optimizer):
    """Plain ``p <- p - lr * (grad + weight_decay * p)`` with every operation rounded on its own.

    ``torch.optim.SGD`` fuses the update into one multiply-add whose SIMD lanes and scalar tail
    round differently, so entries that are equal in exact arithmetic can drift apart by one ulp
    (enough to break the exact symmetry of the deterministic walk, Theorem 4.1, when the number
    of entries is not a multiple of the vector width). Separate multiply and subtract kernels are
    each correctly rounded, whichever path computes an entry.
    """

    def __init__(self, params: Any, lr: float, weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                direction = p.grad
                if group["weight_decay"]:
                    direction = direction + group["weight_decay"] * p
                p.sub_(group["lr"] * direction)


def lr_factor(config: TrainConfig, step: int) -> float:
    """The learning rate of ``step`` (0-based) as a fraction of ``config.lr``: 1 with the constant schedule; with
    the cosine one ``(1 + cos(pi step / steps)) / 2``, from 1 at the first step down towards 0 at the last."""
    return 1.0 if config.lr_schedule == "constant" else 0.5 * (1 + math.cos(math.pi * step / config.steps))


def make_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.Optimizer:
    """The optimiser, on the model's own parameter groups where it has them (``model.param_groups``)."""
    groups = getattr(model, "param_groups", None)
    params = (groups(config.optimizer, config.lr, config.weight_decay) if callable(groups)
              else list(model.parameters()))
    return _optimizer(params, config)


def _optimizer(params: Any, config: TrainConfig) -> torch.optim.Optimizer:
    """``config``'s optimiser on ``params``. AdamW runs fused (one kernel for every parameter's update, on the
    CPU as on a GPU): the update of torch's default loop over the parameters to round-off, in one call instead of
    several per parameter, which is what the many small tensors of the models here cost."""
    if config.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, fused=True)
    return GradientDescent(params, lr=config.lr, weight_decay=config.weight_decay)


def _v_distances(Vs: Optional[torch.Tensor], task: Task, K: int, n: int) -> list[Optional[float]]:
    """The distance of each of the ``n`` models' V (``Vs [n, K, K]``) from the task's transition matrix
    (:func:`transition_distance`), ``None`` where V = 0; all ``None`` where the task has no transition matrix or the
    models no V of K x K."""
    Pi = getattr(task, "transition_matrix", None)
    if Pi is None or Vs is None or Vs.shape[-2] != K:
        return [None] * n
    # (on the CPU: K x K matrices, read with one transfer)
    distances = transition_distance_tensor(Vs.detach().cpu(), Pi()).tolist()
    return [None if math.isnan(d) else d for d in distances]


def model_device(model: torch.nn.Module) -> torch.device:
    tensor = next(iter(model.parameters()), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def _to(batch: Batch, device: torch.device) -> Batch:
    if batch.tokens.device == device:
        return batch
    move = (lambda t: None if t is None else t.to(device))
    return Batch(move(batch.tokens), move(batch.labels), move(batch.weights), move(batch.states))


def fresh_seed(seed: int, step: int) -> int:
    """The seed of the fresh batch of ``step`` (independent of the training and test samples' seeds)."""
    return int(np.random.SeedSequence([seed, 1, step]).generate_state(1)[0])


def _check_pair(model: torch.nn.Module, task: Task, config: TrainConfig) -> bool:
    """Refuse a model that cannot be trained on ``task`` as ``config`` says; returns whether it reads whole
    sequences (:func:`reads_states`)."""
    cfg = model.cfg
    require(model_states(model) == task.n_states,
            f"the model predicts K={model_states(model)} states but the task has {task.n_states}")
    require(cfg.n_ctx >= task.seq_len if reads_states(model, task) else cfg.n_ctx == task.seq_len,
            f"the model has N={cfg.n_ctx} positions but the task has {task.seq_len}")
    states = reads_states(model, task)
    require(not states or config.next_token,
            "this model reads whole sequences and predicts every next state: train it with next-token "
            "prediction (--next-token) and a loss on logits (--loss xent)")
    require(getattr(cfg, "mlp_width", None) is None or getattr(cfg, "init", "gaussian") != "zero",
            "an FC layer (mlp width) initialised at zero never trains: both of its weight matrices start at 0 and "
            "the gradient of each is a product with the other; use a Gaussian init (--init gaussian)")
    return states


def train(
    model: torch.nn.Module,
    task: Task,
    config: TrainConfig,
    data: Optional[tuple[Batch, Batch]] = None,
    progress: Optional[bool] = None,
    callback: Optional[Callable[[int, torch.nn.Module, dict[str, Any]], None]] = None,
) -> TrainResult:
    """Train ``model`` in place on ``task``; returns the history (and checkpoints if asked for).

    ``data`` (train, test) defaults to :func:`make_data`. ``progress=None`` shows a bar only on a
    terminal. ``callback(step, model, record)``, if given, runs after each evaluated step's record is
    taken, while the model still holds that step's parameters (step 0: the initial model); it must not
    change the model. Raises :class:`TrainingDiverged` (with the history so far) if the loss stops being
    finite; the model then holds the parameters of the last step whose loss was finite. Every tensor that
    training makes is on the model's device (the task samples on the CPU; its samples are moved).
    """
    states = _check_pair(model, task, config)
    result = _fit(_Alone(model, config, states), task, [config], [data], progress, callback)[0]
    if result.diverged is not None:
        raise TrainingDiverged(result.diverged, result)
    return result


def train_seeds(
    models: Sequence[torch.nn.Module],
    task: Task,
    configs: Sequence[TrainConfig],
    data: Optional[Sequence[Optional[tuple[Batch, Batch]]]] = None,
    progress: Optional[bool] = None,
    callback: Optional[Callable[[int, torch.nn.Module, dict[str, Any]], None]] = None,
) -> list[TrainResult]:
    """Train several independent models (one per seed) on ``task`` in one batched computation; returns one
    :class:`TrainResult` per model, as ``train(models[i], task, configs[i])`` would.

    ``models[i]`` is trained with ``configs[i]``: the models must be of one kind and configuration apart from
    their seed (``model_config(m)`` equal but for ``seed``), the configs equal but for ``seed``; typically::

        seeds = range(20)
        models = [build_model("deep", {**options, "seed": s}) for s in seeds]
        results = train_seeds(models, task, [config.replace(seed=s) for s in seeds])

    Each model draws its own data from its config's seed (``data[i]``, if given, replaces it), so that each
    model's initialisation, data, mini-batches and fresh batches are exactly those of training it alone. The
    models' parameters are stacked and their forward pass mapped over the stack with ``torch.func.vmap``
    (:mod:`rwinterp.stack`; a model that ``computes_stacks()``, the paper's, runs the stack itself): one forward
    and one backward pass per step for all of them (a single model is trained as :func:`train` trains it). Each
    model's history and final weights equal those of training it alone up to round-off (float64: to 1e-10
    relative; in the library's tests they are bit-identical on the paper's model), and ``train_seconds`` is the
    time of the whole batch.

    A model whose loss stops being finite stops there as with :func:`train` (it keeps the parameters of its
    last finite step, its history ends there) without stopping the others: its result's ``diverged`` holds
    the reason (:class:`TrainingDiverged`'s message) instead of an exception being raised. ``callback(step,
    model, record)`` runs for each model after each of its evaluated steps. The models are trained in place
    and left in eval mode. (The process's C library is asked to keep freed memory for the next step:
    :func:`keep_freed_memory`.)
    """
    models, configs = list(models), list(configs)
    require(len(models) >= 1, "train_seeds needs at least one model")
    require(len(configs) == len(models), f"{len(models)} models but {len(configs)} training configs")
    data = [None] * len(models) if data is None else list(data)
    require(len(data) == len(models), f"{len(models)} models but {len(data)} data sets")
    from rwinterp.runs import model_config, model_kind_of

    kind, first = model_kind_of(models[0]), _without_seed(model_config(models[0]))
    for i, model in enumerate(models[1:], 1):
        require(model_kind_of(model) == kind and _without_seed(model_config(model)) == first,
                f"model {i} differs from model 0 in more than its seed; train_seeds trains one configuration")
    for i, config in enumerate(configs[1:], 1):
        require(_without_seed(config.to_dict()) == _without_seed(configs[0].to_dict()),
                f"training config {i} differs from config 0 in more than its seed")
    states = [_check_pair(model, task, config) for model, config in zip(models, configs)]
    keep_freed_memory()
    # (one model alone needs no stack: vmap's machinery would cost it about as much as its own steps)
    trainees = _Alone(models[0], configs[0], states[0]) if len(models) == 1 else _Stacked(models, configs[0], states[0])
    return _fit(trainees, task, configs, data, progress, callback)


def _without_seed(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in config.items() if k != "seed"}


# ---------------------------------------------------------------------------------------- the loop
@dataclass
class _Pass:
    """One forward pass of every model: the mean loss (``[]`` alone, ``[models]`` stacked), the logits and, where
    asked for, each layer's attention rows (``[batch, heads, pos]``, with the models first when stacked)."""

    loss: torch.Tensor
    logits: torch.Tensor
    heads: list[torch.Tensor]


class _Alone:
    """:func:`train`'s one model, run as itself."""

    def __init__(self, model: torch.nn.Module, config: TrainConfig, states: bool):
        self.models = [model]
        self.config, self.states, self.K = config, states, model_states(model)
        self.optimizer = make_optimizer(model, config)
        self.decaying = model.decaying_buffers() if config.weight_decay and hasattr(model, "decaying_buffers") else []
        # Only the parameters change during training, and under weight decay what a model's parameters do not
        # hold (the paper's stored initial W): the other buffers need no copy.
        self.changing = [*model.parameters(), *self.decaying]
        self._set_forward(model)

    def _set_forward(self, model: torch.nn.Module) -> None:
        """How training calls the model, in its steps and its evaluations: its kind's ``train_forward`` where
        registered, else its forward pass (with hooks on the attention patterns to evaluate). The token values are
        checked once, when the data are joined, not by the model at every step (a check that reads the data,
        which also cannot run under ``vmap``)."""
        from rwinterp.runs import train_forward

        self.kwargs = {"check": False} if "check" in inspect.signature(model.forward).parameters else {}
        # (a model kind may compute its logits faster where no hook is read: the paper's model and the bridge do)
        self.fast = train_forward(model)
        self.d_vocab = int(model.cfg.d_vocab)

    def logits(self, model: torch.nn.Module, inputs: torch.Tensor, keys: Optional[Sequence[int]]
               ) -> tuple[torch.Tensor, tuple]:
        """The logits of ``inputs`` and, with ``keys``, each layer's attention at the label's row on those key
        positions."""
        row = label_row(self.states)
        if self.fast is not None:
            logits, heads = self.fast(model, inputs, row, keys) if keys is not None else (self.fast(model, inputs), ())
        elif keys is not None:
            logits, heads = logits_and_pattern(model, inputs, row, keys, **self.kwargs)
        else:
            logits, heads = model(inputs, **self.kwargs), ()
        return logits, tuple(heads)

    def check(self, batches: list[Batch]) -> None:
        """Refuse tokens outside the vocabulary in one line (what the model's own check would refuse)."""
        for batch in batches:
            if batch.tokens.numel():
                low, high = torch.aminmax(model_inputs(batch, self.states))
                require(int(low) >= 0 and int(high) < self.d_vocab,
                        f"tokens must lie in [0, {self.d_vocab - 1}], got [{int(low)}, {int(high)}]")

    def join(self, batches: list[Batch], check: bool = True) -> Batch:
        """The model's batch; ``check``: check the token values first (given data; the samples that training draws
        are the task's own)."""
        if check:
            self.check(batches)
        return batches[0]

    def one(self, tensor: torch.Tensor, i: int) -> torch.Tensor:
        return tensor

    def forward(self, batch: Batch, keys: Optional[Sequence[int]]) -> _Pass:
        logits, heads = self.logits(self.models[0], model_inputs(batch, self.states), keys)
        return _Pass(objective(self.config, logits, batch, self.states, self.K), logits, list(heads))

    def values(self, loss: torch.Tensor) -> list[float]:
        return [float(loss.detach())]

    def summaries(self, train: _Pass, test: _Pass, train_data: Batch, test_data: Batch, row: int, K: int
                  ) -> torch.Tensor:
        """``[models, 2 + heads]``: each model's accuracy on the training and the test data, then each head's
        attention on the parent positions (:func:`_summary`)."""
        return _summary(train.logits, test.logits, test.heads, train_data, test_data, row, K)[None]

    def value_matrices(self, live: list[int]) -> Optional[torch.Tensor]:
        """The paper's V of the models ``live`` (``[models, d_head, K]``), or None where a model has none."""
        Vs = [getattr(self.models[i], "V", None) for i in live]
        return None if any(V is None for V in Vs) else torch.stack(Vs)

    def backward(self, loss: torch.Tensor, scale: float) -> None:
        (loss * scale).backward()

    def snapshot(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.changing]

    def restore(self, i: int, snapshot: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, good in zip(self.changing, snapshot):
                p.copy_(good)

    def finish(self) -> None:
        pass


class _Stacked(_Alone):
    """:func:`train_seeds`'s models, run as one stack (:class:`rwinterp.stack.ModelStack`)."""

    def __init__(self, models: list[torch.nn.Module], config: TrainConfig, states: bool):
        from rwinterp.stack import ModelStack

        own = getattr(models[0], "decaying_buffers", None)
        decaying = own() if config.weight_decay and callable(own) else []
        names = [n for n, b in models[0].named_buffers() if any(b is t for t in decaying)]
        self.stack = stack = ModelStack(models, stacked_buffers=names)
        self.models = models
        self.config, self.states, self.K = config, states, model_states(models[0])
        self.optimizer = _stacked_optimizer(stack, config)
        self.decaying = [stack.buffers[n] for n in names]
        self.changing = [*stack.params.values(), *self.decaying]
        self._set_forward(models[0])
        # (a model that computes a stack itself is run without vmap; see DeepTransformer.computes_stacks)
        own = getattr(models[0], "computes_stacks", None)
        self.whole = self.fast is not None and callable(own) and own() and not config.next_token

    def join(self, batches: list[Batch], check: bool = True) -> "_Joined":  # type: ignore[override]
        """The models' batches as one (see :meth:`_Alone.join`)."""
        shared = all(b is batches[0] for b in batches)  # (the population: one for every model)
        if check:
            self.check(batches[:1] if shared else batches)
        if shared:
            return _Joined(batches[0], None)
        stack = (lambda ts: None if ts[0] is None else torch.stack(ts))
        return _Joined(Batch(stack([b.tokens for b in batches]), stack([b.labels for b in batches]),
                             stack([b.weights for b in batches]), stack([b.states for b in batches])), 0)

    def one(self, tensor: torch.Tensor, i: int) -> torch.Tensor:
        return tensor[i]

    def forward(self, joined: "_Joined", keys: Optional[Sequence[int]]) -> _Pass:  # type: ignore[override]
        config, states, K = self.config, self.states, self.K

        def one(model: torch.nn.Module, tokens: Any, labels: Any, weights: Any, seqs: Any) -> tuple:
            batch = Batch(tokens, labels, weights, seqs)
            logits, heads = self.logits(model, model_inputs(batch, states), keys)
            return objective(config, logits, batch, states, K), logits, heads

        b, dim = joined.batch, joined.dim
        if self.whole:  # every model at once, the shared data expanded along the models' axis
            data = [t if t is None or dim == 0 else t.expand(self.stack.size, *t.shape)
                    for t in (b.tokens, b.labels, b.weights, b.states)]
            loss, logits, heads = self.stack.call(one, *data)
        else:
            dims = [None if t is None else dim for t in (b.tokens, b.labels, b.weights, b.states)]
            loss, logits, heads = self.stack.map(one, b.tokens, b.labels, b.weights, b.states, in_dims=dims)
        return _Pass(loss, logits, list(heads))

    def values(self, loss: torch.Tensor) -> list[float]:
        return loss.detach().tolist()

    def summaries(self, train: _Pass, test: _Pass, train_data: "_Joined",  # type: ignore[override]
                  test_data: "_Joined", row: int, K: int) -> torch.Tensor:
        return _summary(train.logits, test.logits, test.heads, train_data.batch, test_data.batch, row, K).T

    def value_matrices(self, live: list[int]) -> Optional[torch.Tensor]:
        if not self.whole:
            return super().value_matrices(live)
        Vs = self.stack.call(lambda model: model.V)
        return None if Vs is None else Vs[live]

    def backward(self, loss: torch.Tensor, scale: float) -> None:
        # Each model's loss depends on its own slice alone: the sum's gradient is every model's gradient.
        (loss * scale).sum().backward()

    def restore(self, i: int, snapshot: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, good in zip(self.changing, snapshot):
                p[i].copy_(good[i])

    def finish(self) -> None:
        self.stack.release()


def _summary(logits: torch.Tensor, test_logits: torch.Tensor, heads: list[torch.Tensor], train_data: Batch,
             test_data: Batch, row: int, K: int) -> torch.Tensor:
    """The evaluation numbers, ``[numbers, *models]``: the accuracy of the scores at ``row`` on the training and the
    test data, then each layer's and head's attention on the parent positions (test data; ``heads`` holds the
    attention on those positions alone). The models of a stack come first in every tensor (``logits [*models,
    batch, pos, vocab]``, ``heads [*models, batch, head, parents]``), except in data that every model shares
    (``labels [batch]``)."""
    numbers = [accuracy_tensor(logits[..., row, :K].detach(), train_data.labels, train_data.weights),
               accuracy_tensor(test_logits[..., row, :K].detach(), test_data.labels, test_data.weights)]
    numbers += [parent_attention_tensor(layer[..., h, :], range(layer.shape[-1]), test_data.weights) for layer in heads
                for h in range(layer.shape[-2])]
    return torch.stack(numbers)


@dataclass
class _Joined:
    """The models' batches as one: stacked along a first dimension (``dim = 0``), or one batch for all."""

    batch: Batch
    dim: Optional[int]


def _stacked_optimizer(stack: Any, config: TrainConfig) -> torch.optim.Optimizer:
    """:func:`make_optimizer` on the stacked parameters: the first model's parameter groups, each parameter
    replaced by its stack (every model must step its parameters alike)."""
    def groups(model: torch.nn.Module) -> list[dict[str, Any]]:
        own = getattr(model, "param_groups", None)
        found = (own(config.optimizer, config.lr, config.weight_decay) if callable(own)
                 else [{"params": list(model.parameters())}])
        names = {id(p): n for n, p in model.named_parameters()}
        return [{**g, "params": [names[id(p)] for p in g["params"]]} for g in found]

    first = groups(stack.template)
    for i, model in enumerate(stack.models[1:], 1):
        require(groups(model) == first, f"model {i} steps its parameters unlike model 0 (its optimiser's "
                                        "parameter groups differ); train it alone")
    return _optimizer([{**g, "params": [stack.params[n] for n in g["params"]]} for g in first], config)


def _fit(
    trainees: _Alone,
    task: Task,
    configs: list[TrainConfig],
    data: list[Optional[tuple[Batch, Batch]]],
    progress: Optional[bool],
    callback: Optional[Callable[[int, torch.nn.Module, dict[str, Any]], None]],
) -> list[TrainResult]:
    """The training loop of :func:`train` (one model) and :func:`train_seeds` (a stack of them)."""
    models = trainees.models
    config = configs[0]  # (the configs differ only in their seeds)
    cfg = models[0].cfg
    device = model_device(models[0])
    n = len(models)
    sets = []
    for own, given in zip(configs, data):
        if given is None and config.population and sets and data[0] is None:
            sets.append(sets[0])  # one population for every model
            continue
        train_data, test_data = given if given is not None else make_data(task, own)
        moved = _to(train_data, device)
        sets.append((moved, moved if test_data is train_data else _to(test_data, device)))
    results = [TrainResult(task=task) for _ in models]
    parents = task.parent_positions()
    K = task.n_states
    states = trainees.states
    full_batch = config.full_batch
    fresh = not full_batch and getattr(task, "fresh_batches", False)
    gens = [torch.Generator().manual_seed(data_seeds(own.seed)[0] + 1) for own in configs]
    train_all = trainees.join([s[0] for s in sets])
    test_all = None if all(s[1] is s[0] for s in sets) else trainees.join([s[1] for s in sets])
    row = label_row(states)
    live = list(range(n))  # the models still training
    for model in models:
        model.train()
    start = time.perf_counter()
    bar = tqdm(range(config.steps + 1), desc="train", disable=(None if progress is None else not progress),
               leave=False)
    last_good = trainees.snapshot()
    schedule = (None if config.lr_schedule == "constant" else
                torch.optim.lr_scheduler.LambdaLR(trainees.optimizer, functools.partial(lr_factor, config)))
    frozen: dict[int, list[torch.Tensor]] = {}  # stopped models' last good parameters

    def stop(i: int, step: int, scores: Optional[torch.Tensor], batch: Batch, loss_value: float) -> None:
        """Model i's loss is not finite: it stops, and gets its last good parameters back after this step (not now:
        the other models' backward pass still reads the stack as it was)."""
        frozen[i] = last_good
        live.remove(i)
        results[i].train_seconds = time.perf_counter() - start
        results[i].diverged = _divergence(models[i], step, config, scores, batch, loss_value)

    for step in bar:
        evaluate = step % config.evaluation_interval == 0 or step == config.steps
        loss = None
        if evaluate or full_batch:
            with torch.set_grad_enabled(full_batch):  # a mini-batch step backpropagates its own batch, not this
                out = trainees.forward(train_all, keys=parents if test_all is None else None)  # (test rows recorded)
            loss = out.loss
            loss_values = trainees.values(loss)
            for i in list(live):
                if not math.isfinite(loss_values[i]):
                    scores = trainees.one(out.logits, i)[:, row, :K]
                    stop(i, step, scores, sets[i][0], loss_values[i])
            if not live:
                break
        if evaluate:
            with torch.no_grad():
                test = out if test_all is None else trainees.forward(test_all, keys=parents)
                test_values = loss_values if test_all is None else trainees.values(test.loss)
            # Every model's accuracies and attention, read back at once (one transfer from a GPU).
            summaries = trainees.summaries(out, test, train_all, train_all if test_all is None else test_all, row,
                                           K).tolist()
            distances = _v_distances(trainees.value_matrices(live), task, K, len(live))
            for i, v_distance in zip(live, distances):
                numbers = iter(summaries[i])
                record = {
                    "step": step,
                    "loss": loss_values[i],
                    "train_accuracy": next(numbers),
                    "test_accuracy": next(numbers),
                    "test_loss": test_values[i],
                }
                per_head = [[next(numbers) for _ in range(cfg.n_heads)] for _ in range(cfg.n_layers)]
                record["parent_attention"] = per_head[0][0]
                record["v_distance"] = v_distance
                if cfg.n_layers * cfg.n_heads > 1:
                    record["parent_attention_heads"] = per_head
                results[i].history.append(record)
                if callback is not None:
                    callback(step, models[i], record)
            shown = [results[i].history[-1] for i in live]
            bar.set_postfix(loss=f"{sum(r['loss'] for r in shown) / len(shown):.4f}",
                            acc=f"{sum(r['test_accuracy'] for r in shown) / len(shown):.3f}")
        if config.checkpoint_every and step % config.checkpoint_every == 0:
            for i in live:
                results[i].checkpoints.append(
                    (step, {k: v.detach().clone() for k, v in models[i].state_dict().items()}))
        if step == config.steps:
            break
        last_good = trainees.snapshot()
        trainees.optimizer.zero_grad(set_to_none=True)
        if not full_batch:
            minis = []
            for i, own in enumerate(configs):
                if fresh:
                    minis.append(_to(task.sample(config.batch_size, fresh_seed(own.seed, step)), device))
                else:
                    picked = torch.randint(len(sets[i][0]), (config.batch_size,), generator=gens[i])
                    minis.append(sets[i][0][picked.to(device)])
            out = trainees.forward(trainees.join(minis, check=False), keys=None)
            loss = out.loss
            if not evaluate:
                values = trainees.values(loss)
                for i in list(live):
                    if not math.isfinite(values[i]):
                        stop(i, step, None, minis[i], values[i])
                if not live:
                    break
        trainees.backward(loss, reduction_scale(config, sets[0][0] if full_batch else minis[0]))
        trainees.optimizer.step()
        with torch.no_grad():
            for t in trainees.decaying:  # W <- (1 - lr weight_decay) W, coupled (gd, sgd) or decoupled (adamw) alike
                t.mul_(1 - config.lr * lr_factor(config, step) * config.weight_decay)
        if schedule is not None:
            schedule.step()
        for i, good in frozen.items():  # (a stopped model keeps its last good parameters)
            trainees.restore(i, good)
    for i, good in frozen.items():
        trainees.restore(i, good)
    elapsed = time.perf_counter() - start
    for i, model in enumerate(models):
        model.eval()
        if results[i].diverged is None:
            results[i].train_seconds = elapsed
    trainees.finish()
    return results


def _divergence(model: torch.nn.Module, step: int, config: TrainConfig, scores: Optional[torch.Tensor], batch: Batch,
                loss_value: float) -> str:
    """Why training stopped at ``step``, in one line."""
    where = "at initialisation" if step == 0 else f"at step {step}; the model keeps the state after step {step - 1}"
    if (config.loss == "log" and scores is not None
            and bool((scores.detach().gather(1, batch.labels[:, None]) + config.eps <= 0).any())):
        # -log(f_y + eps) needs f_y > -eps: raw scores that can be negative (a large random
        # initialisation, a model whose outputs are logits) leave it undefined.
        if step:
            other = ", or a smaller --lr or --weight-decay"
        else:  # only a random initialisation has a scale to make smaller
            other = ", or a smaller --sigma" if getattr(model.cfg, "init", None) == "gaussian" else ""
        return (f"the loss -log(f_y + eps) is undefined {where}: some score f_y is at or "
                f"below -eps = {-config.eps:g} (use --loss xent{other})")
    return f"the loss became {loss_value} {where}"


# ---------------------------------------------------------------------------------------- memory
def check_memory(options: Any, task: Task, config: TrainConfig, device: "str | torch.device" = "cpu",
                 copies: int = 1) -> None:
    """Refuse, in one line naming the setting to lower, a run whose weights and activations would not fit in
    the memory available (the device's free memory on a GPU), before the model is built. ``options`` is a
    model's options with ``element_counts()`` (:class:`rwinterp.config.DeepOptions`, ``BridgeOptions``);
    a model kind without it is not checked. ``copies``: how many such models train at once (the seeds of
    :func:`train_seeds`, or jobs side by side on one machine)."""
    counts = getattr(options, "element_counts", None)
    if not callable(counts):
        return
    itemsize = 4 if getattr(options, "dtype", "float64") == "float32" else 8
    weights, per_sample = (n * itemsize * copies for n in counts())
    samples = task.population_size() if config.population else max(config.n_train, config.n_test)
    needed = samples * per_sample + weights
    device = torch.device(device)
    available = available_memory(device)
    if available is None or needed <= available:
        return
    many = f" for {copies} models" if copies > 1 else ""
    if samples * per_sample >= weights:
        lower = "use sampled data instead of --population" if config.population else "lower --n-train and --n-test"
        lower += (f", --N or the model's width ({samples} samples of about {per_sample / copies / 2**20:.3g} MiB "
                  "each)")
    else:
        lower = "lower the model's size (K, --M, --d-model, --layers, --heads)"
    if copies > 1:
        lower += " or the number of seeds"
    raise RwinterpError(f"not enough memory: this run needs about {needed / 2**30:.3g} GiB{many}, more than the "
                        f"{available / 2**30:.3g} GiB available{'' if device.type == 'cpu' else ' on ' + str(device)}; "
                        f"{lower}")


def available_memory(device: torch.device) -> Optional[int]:
    """Bytes free for a new allocation: the GPU's free memory, or the machine's available memory (Linux's
    MemAvailable); None where that cannot be read."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# ---------------------------------------------------------------------------------------- threads
#: Below this many numbers per step (activations times samples) a model is overhead-bound: a second intra-op
#: thread only adds hand-offs, and on a shared machine threads that spin while waiting for each other make it
#: several times slower.
SMALL_STEP = 5 * 10**7


def choose_threads(options: Any, task: Task, config: TrainConfig, copies: int = 1) -> int:
    """Intra-op threads for training a model of ``options`` (``copies`` of them at once, as
    :func:`train_seeds` does): one for a small step (fewer than :data:`SMALL_STEP` numbers), else the
    cores that other processes do not keep busy (:func:`busy_cores`), at least one."""
    import os

    counts = getattr(options, "element_counts", None)
    samples = config.batch_size or (task.population_size() if config.population else config.n_train)
    if callable(counts) and copies * samples * counts()[1] < SMALL_STEP:
        return 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cpus, round(cpus - busy_cores())))


def busy_cores() -> float:
    """The cores that other processes keep busy: the machine's 1-minute load average, but no more than the threads
    of other processes seen running now (the most of a few looks at ``/proc``, where there is one). The load
    average also counts this process's own recent work: a process that has just trained would otherwise see
    itself as a busy neighbour."""
    import os

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    elsewhere = running_elsewhere()
    return load if elsewhere is None else min(load, float(elsewhere))


def running_elsewhere(looks: int = 5, pause: float = 0.002) -> Optional[int]:
    """The most threads of other processes running at once in ``looks`` looks ``pause`` seconds apart: the
    machine's running threads (``/proc/loadavg``) less this process's own (``/proc/self/task``). ``None`` without
    ``/proc``."""
    import os

    from rwinterp.atomic import proc_stat

    most = 0
    try:
        for look in range(looks):
            with open("/proc/loadavg") as f:
                running = int(f.read().split()[3].split("/")[0])
            own = 0
            for task in os.listdir("/proc/self/task"):
                try:
                    own += proc_stat(f"/proc/self/task/{task}/stat")[0] == "R"
                except OSError:  # (a thread that has just ended)
                    pass
            most = max(most, running - own)
            if look + 1 < looks:
                time.sleep(pause)
    except (OSError, ValueError, IndexError):
        return None
    return most


#: The environment of a worker process that runs one job of a pool beside others: one thread for every
#: threading library torch may use. For ``ProcessPoolExecutor(initializer=one_thread_per_worker)`` this is set
#: by the initialiser; for a Ray task pass it as ``runtime_env={"env_vars": WORKER_ENV}`` (and call
#: :func:`one_thread_per_worker` first thing in the task, for a worker process Ray reuses).
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def one_thread_per_worker() -> None:
    """Make this process a pool worker that trains with one intra-op thread (and tells the processes it
    starts to do the same, :data:`WORKER_ENV`).

    Jobs that run side by side on one machine each get a core of their own: a worker with several threads
    on a shared machine spins waiting for threads that other processes have put off their cores, and a
    small model then trains several times slower than on one thread (``benchmarks/bench_threads.py``). Use
    it as a process pool's initialiser, or call it at the start of a Ray task."""
    import os

    os.environ.update(WORKER_ENV)
    torch.set_num_threads(1)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # (only possible before the first parallel work of this process)
        pass


_MEMORY_KEPT = False


def keep_freed_memory() -> None:
    """Ask glibc's malloc to keep the memory a training step frees for the next step (Linux; elsewhere
    nothing). Called by :func:`train_seeds`; once per process.

    A step allocates and frees the same tensors every time. glibc gives a freed block above its thresholds
    back to the operating system (``munmap``, or by trimming the heap) and maps fresh pages for the next
    step, whose first touch costs a page fault per 4 KiB: with 20 seeds of the Fig 4 setting (15 MB per
    activation) that was a third of the step's time. With ``M_MMAP_THRESHOLD`` at its largest (32 MiB) and
    a 2 GiB ``M_TRIM_THRESHOLD`` the blocks stay in the heap and are reused; the process keeps the memory
    of its largest step until it ends."""
    global _MEMORY_KEPT
    if _MEMORY_KEPT:
        return
    _MEMORY_KEPT = True
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        libc.mallopt(M_TRIM_THRESHOLD, 2**31 - 1)
        libc.mallopt(M_MMAP_THRESHOLD, 32 * 2**20)
    except (OSError, AttributeError):  # another C library (musl): nothing to ask
        pass


# ---------------------------------------------------------------------------------------- devices
def resolve_device(name: "str | torch.device | None") -> torch.device:
    """The device a ``--device`` (or ``device=``) names: ``cpu``; ``cuda`` or ``cuda:N`` (a one-line error
    where there is no such GPU); ``auto``: the GPU if there is one, else the CPU. None: the CPU."""
    if name is None:
        return torch.device("cpu")
    if isinstance(name, torch.device):
        name = str(name)
    require(isinstance(name, str) and (name in DEVICES or name.startswith("cuda:")),
            f"device must be one of {', '.join(DEVICES)} (or cuda:N), got {name!r}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise RwinterpError(f"device must be one of {', '.join(DEVICES)} (or cuda:N), got {name!r}") from None
    require(torch.cuda.is_available(), f"--device {name}: there is no CUDA GPU here (torch.cuda.is_available() "
                                       "is False); use --device cpu or auto")
    count = torch.cuda.device_count()
    require(device.index is None or device.index < count,
            f"--device {name}: there {'is' if count == 1 else 'are'} only {count} CUDA GPU{'s' * (count != 1)}")
    return device
