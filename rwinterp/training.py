"""Training: the paper's full-batch gradient descent, and the usual alternatives as options.

The paper trains V and W by plain gradient descent, ``theta <- theta - lr * grad``, on the loss
``-log(f[y] + eps)`` averaged over 1000 sampled walks (experiments) or its expectation over all
walks (theory, ``population=True``). The model stores ``u = W x~_N`` instead of W (see
``rwinterp.model``), and gradient descent on W is reproduced exactly by scaling the learning rate
of ``u`` by ``||x~_N||^2``. Mini-batch SGD (same scaling) and AdamW (on V and u directly) are
options, as are softmax cross-entropy and squared losses.

Every step records the loss, train and test accuracy, the mean attention on the parent position
and the distance of V to Pi^T; a diverging loss stops training with the last good state kept.

The same loop trains any hooked model with the paper's interface (``cfg.n_states``, ``cfg.n_ctx``,
``cfg.n_layers``, ``cfg.n_heads``, logits ``[batch, pos, K]`` whose last row is the query slot, and
``blocks.L.attn.hook_pattern``), such as :class:`rwinterp.deep.DeepTransformer`: models without the
paper's ``u`` are trained on all their parameters with the plain learning rate. With
``next_token=True`` a model that predicts at every position (causal attention) is trained on
next-state prediction: position t predicts s_{t+2} (the walk's next state) and the query slot the
label, each position's loss averaged. Models with several heads also record the parent attention
of every layer and head (``parent_attention_heads``).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional

import numpy as np
import torch
from tqdm.auto import tqdm

from rwinterp import losses, stopping
from rwinterp.errors import RwinterpError, from_dict_checked, require, require_seed
from rwinterp.metrics import accuracy, parent_attention, transition_distance
from rwinterp.model import WalkTransformer
from rwinterp.tasks import Batch, Task

OPTIMIZERS = ("gd", "sgd", "adamw")
REDUCTIONS = ("mean", "sum")


#: The most training steps a config accepts (far beyond any run here; larger counts are typos).
MAX_STEPS = 10**8


@dataclass
class TrainConfig:
    """How to train. Defaults are the paper's (Fig 4: lr 1, eps 0.1, 50 steps, 1000/1000 walks)."""

    lr: float = 1.0
    eps: float = 0.1
    steps: int = 50
    loss: str = "log"
    optimizer: str = "gd"
    batch_size: Optional[int] = None
    weight_decay: float = 0.0
    n_train: int = 1000
    n_test: int = 1000
    population: bool = False
    seed: int = 0
    next_token: bool = False
    reduction: str = "mean"

    def __post_init__(self) -> None:
        require(isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0,
                f"lr must be positive and finite, got {self.lr}")
        require(isinstance(self.eps, (int, float)) and math.isfinite(self.eps) and self.eps > 0,
                f"eps must be positive and finite, got {self.eps}")
        require(isinstance(self.steps, int) and 0 <= self.steps <= MAX_STEPS,
                f"steps must be in [0, {MAX_STEPS}], got {self.steps}")
        require(self.loss in losses.LOSSES, f"loss must be one of {', '.join(losses.LOSSES)}, got {self.loss!r}")
        require(self.optimizer in OPTIMIZERS,
                f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        require(self.batch_size is None or self.batch_size >= 1, "batch size must be >= 1")
        require(isinstance(self.weight_decay, (int, float)) and math.isfinite(self.weight_decay)
                and self.weight_decay >= 0, f"weight decay must be a non-negative number, got {self.weight_decay}")
        require(self.batch_size is None or self.optimizer != "gd",
                "a batch size needs --optimizer sgd or adamw (gd is full-batch gradient descent)")
        require_seed(self.seed)
        require(self.n_train >= 1 and self.n_test >= 1, "n-train and n-test must be >= 1")
        require(not (self.population and self.batch_size is not None),
                "population mode trains on the exact expectation, in one full batch: a batch size does not apply")
        require(self.batch_size is None or self.batch_size <= self.n_train,
                f"batch size {self.batch_size} is larger than the {self.n_train} training samples")
        require(self.reduction in REDUCTIONS,
                f"reduction must be one of {', '.join(REDUCTIONS)}, got {self.reduction!r}")
        require(not (self.population and self.optimizer == "sgd"),
                "population mode trains on the exact expectation: use --optimizer gd or adamw")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        return from_dict_checked(cls, data, "training config")


@dataclass
class TrainResult:
    """Per-step history (step 0 is the initial model) and where training ended."""

    history: list[dict[str, Any]] = field(default_factory=list)
    train_seconds: float = 0.0
    bayes_accuracy: float = math.nan

    @property
    def final(self) -> dict[str, Any]:
        return self.history[-1]


class TrainingDiverged(RwinterpError):
    """The loss became NaN or infinite; the model keeps the last good state."""

    def __init__(self, message: str, result: TrainResult):
        super().__init__(message)
        self.result = result


def data_seeds(seed: int) -> tuple[int, int]:
    """Independent seeds for the training and the test walks, derived from one seed."""
    train, test = np.random.SeedSequence(seed).generate_state(2)
    return int(train), int(test)


def make_data(task: Task, config: TrainConfig) -> tuple[Batch, Batch]:
    """The training and test data: sampled walks, or the exact population for both."""
    if config.population:
        pop = task.population()
        return pop, pop
    return task.sample(config.n_train, data_seeds(config.seed)[0]), held_out_data(task, config)


def held_out_data(task: Task, config: TrainConfig) -> Batch:
    """The test data of :func:`make_data` alone (the training walks are not drawn)."""
    if config.population:
        return task.population()
    return task.sample(config.n_test, data_seeds(config.seed)[1])


def logits_and_pattern(model: WalkTransformer, tokens: torch.Tensor, store: dict) -> torch.Tensor:
    """Logits of ``tokens``; ``store["heads"][L]`` gets the query slot's attention ``[batch, heads, pos]`` of layer
    L and ``store["pattern"]`` that of the first head (the paper's model has only that one)."""
    heads: list[torch.Tensor] = []
    store["heads"] = heads

    def grab(pattern: torch.Tensor, hook: Any) -> None:
        heads.append(pattern[:, :, -1, :].detach())

    hooks = [(f"blocks.{layer}.attn.hook_pattern", grab) for layer in range(model.cfg.n_layers)]
    logits = model.run_with_hooks(tokens, fwd_hooks=hooks)
    store["pattern"] = heads[0][:, 0]
    return logits


def objective(config: TrainConfig, logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The training loss: on the query slot's scores, or (``next_token``) on every position's."""
    if not config.next_token:
        return losses.loss(config.loss, logits[:, -1, :], batch.labels, batch.weights, config.eps)
    require(logits.shape[1] == batch.tokens.shape[1],
            "next-token training needs a model that predicts at every position (attention='causal')")
    require(batch.states is not None, "next-token training needs a task that provides whole walks")
    targets = torch.cat([batch.states[:, 1:], batch.labels[:, None]], dim=1)
    per_position = losses.per_sample_loss(config.loss, logits.flatten(0, 1), targets.flatten(), config.eps)
    return losses.average(per_position.view(targets.shape).mean(1), batch.weights)


def reduction_scale(config: TrainConfig, batch: Batch) -> float:
    """What the mean loss is multiplied by before the gradient step.

    ``reduction="mean"`` (the paper's reading): 1. ``reduction="sum"``: the loss summed over the
    walks of the batch rather than averaged, i.e. the mean times the number of walks (with
    ``population=True``, ``n_train`` times the expectation: the expected summed loss over ``n_train``
    walks). Plain gradient descent on the sum with learning rate ``lr`` is gradient descent on the
    mean with learning rate ``lr * n``. The recorded ``loss`` stays the mean per walk.
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


def _optimizer(model: WalkTransformer, config: TrainConfig) -> torch.optim.Optimizer:
    """The optimiser of the paper's parameters, V and W (and A), whichever way the model stores them.

    :class:`~rwinterp.model.WalkTransformer` keeps only ``u = W q`` of the paper's W (q the query
    vector), and every W-gradient is ``g q^T`` with ``g = dL/du``. Gradient descent on W therefore
    moves u by ``||q||^2`` times gradient descent's step on u. Adam on W normalises each entry
    ``g_i q_j`` by its own running size, which leaves ``sign(q_j)`` times Adam's step for ``g_i``:
    it moves u by ``||q||_1`` times Adam's step on u (up to Adam's small eps). Weight decay shrinks
    W, and so u, by ``lr * weight_decay`` per step whatever the scale; the part of W that u does not
    hold (a stored Gaussian ``W_init`` off the query direction) is shrunk by :func:`train`.
    """
    cls = torch.optim.AdamW if config.optimizer == "adamw" else GradientDescent
    u = getattr(model, "u", None)
    if not isinstance(u, torch.nn.Parameter):  # a model that stores its weights as they are
        return cls(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    scale = float(model.query_vector().abs().sum()) if config.optimizer == "adamw" else model.u_lr_scale()
    others = [p for p in model.parameters() if p is not u]
    return cls([{"params": others},
                {"params": [u], "lr": config.lr * scale, "weight_decay": config.weight_decay / scale}],
               lr=config.lr, weight_decay=config.weight_decay)


def _v_distance(model: WalkTransformer, task: Task) -> Optional[float]:
    Pi = getattr(task, "transition_matrix", None)
    V = getattr(model, "V", None)
    if Pi is None or V is None or V.shape[0] != model.cfg.n_states:
        return None
    d = transition_distance(V, Pi())
    return None if math.isnan(d) else d


def train(
    model: WalkTransformer,
    task: Task,
    config: TrainConfig,
    data: Optional[tuple[Batch, Batch]] = None,
    progress: Optional[bool] = None,
    callback: Optional[Callable[[int, WalkTransformer, dict[str, Any]], None]] = None,
) -> TrainResult:
    """Train ``model`` in place on ``task``; returns the per-step history.

    ``data`` (train, test) defaults to :func:`make_data`. ``progress=None`` shows a bar only on a
    terminal. ``callback(step, model, record)``, if given, runs after each step's record is taken,
    while the model still holds that step's parameters (step 0: the initial model); it must not
    change the model. Raises :class:`TrainingDiverged` (with the history so far) if the loss stops being
    finite; the model then holds the parameters of the last step whose loss was finite.
    """
    require(model.cfg.n_states == task.n_states,
            f"the model has K={model.cfg.n_states} states but the task has {task.n_states}")
    require(model.cfg.n_ctx == task.seq_len,
            f"the model has N={model.cfg.n_ctx} positions but the task has {task.seq_len}")
    require(getattr(model.cfg, "mlp_width", None) is None or model.cfg.init != "zero",
            "an FC layer (mlp width) initialised at zero never trains: both of its weight matrices start at 0 and "
            "the gradient of each is a product with the other; use a Gaussian init (--init gaussian)")
    train_data, test_data = data if data is not None else make_data(task, config)
    result = TrainResult(bayes_accuracy=task.bayes_accuracy())
    optimizer = _optimizer(model, config)
    parents = task.parent_positions()
    full_batch = config.optimizer == "gd" or config.batch_size is None
    gen = torch.Generator().manual_seed(data_seeds(config.seed)[0] + 1)
    model.train()
    start = time.perf_counter()
    bar = tqdm(range(config.steps + 1), desc="train", disable=(None if progress is None else not progress),
               leave=False)
    # Only the parameters change during training, and under weight decay a stored Gaussian W_init (the part
    # of W off the query direction, which decays with W): the other buffers need no copy.
    W_init = getattr(model, "W_init", None)
    decaying = [W_init] if config.weight_decay and W_init is not None and W_init.numel() else []
    changing = [*model.parameters(), *decaying]
    last_good = [p.detach().clone() for p in changing]
    for step in bar:
        stopping.check()  # a Ctrl-C or SIGTERM whose exception was lost (see rwinterp.stopping)
        store: dict[str, Any] = {}
        logits = logits_and_pattern(model, train_data.tokens, store)
        scores = logits[:, -1, :]
        loss = objective(config, logits, train_data)
        loss_value = float(loss.detach())
        if not math.isfinite(loss_value):
            with torch.no_grad():
                for p, good in zip(changing, last_good):
                    p.copy_(good)
            model.eval()
            result.train_seconds = time.perf_counter() - start
            where = ("at initialisation" if step == 0
                     else f"at step {step}; the model keeps the state after step {step - 1}")
            if config.loss == "log" and bool((scores.detach().gather(1, train_data.labels[:, None]) + config.eps
                                              <= 0).any()):
                # -log(f_y + eps) needs f_y > -eps: raw scores that can be negative (a large random
                # initialisation, a model whose outputs are logits) leave it undefined.
                if step:
                    other = ", or a smaller --lr or --weight-decay"
                else:  # only a Gaussian initialisation has a scale to make smaller
                    other = ", or a smaller --sigma" if getattr(model.cfg, "init", None) == "gaussian" else ""
                raise TrainingDiverged(f"the loss -log(f_y + eps) is undefined {where}: some score f_y is at or "
                                       f"below -eps = {-config.eps:g} (use --loss xent{other})", result)
            raise TrainingDiverged(f"the loss became {loss_value} {where}", result)
        with torch.no_grad():
            test_scores = scores if test_data is train_data else logits_and_pattern(
                model, test_data.tokens, store)[:, -1, :]
        record = {
            "step": step,
            "loss": loss_value,
            "train_accuracy": accuracy(scores.detach(), train_data.labels, train_data.weights),
            "test_accuracy": accuracy(test_scores.detach(), test_data.labels, test_data.weights),
            "parent_attention": parent_attention(store["pattern"], parents, test_data.weights),
            "v_distance": _v_distance(model, task),
        }
        if model.cfg.n_layers * model.cfg.n_heads > 1:
            record["parent_attention_heads"] = [
                [parent_attention(layer[:, h], parents, test_data.weights) for h in range(layer.shape[1])]
                for layer in store["heads"]]
        result.history.append(record)
        if callback is not None:
            callback(step, model, record)
        bar.set_postfix(loss=f"{loss_value:.4f}", acc=f"{record['test_accuracy']:.3f}")
        if step == config.steps:
            break
        last_good = [p.detach().clone() for p in changing]
        optimizer.zero_grad(set_to_none=True)
        if not full_batch:
            idx = torch.randint(len(train_data), (config.batch_size,), generator=gen)
            mini = train_data[idx]
            loss = objective(config, model(mini.tokens), mini)
        (loss * reduction_scale(config, train_data if full_batch else mini)).backward()
        optimizer.step()
        with torch.no_grad():
            for t in decaying:  # W <- (1 - lr weight_decay) W, coupled (gd, sgd) or decoupled (adamw) alike
                t.mul_(1 - config.lr * config.weight_decay)
    model.eval()
    result.train_seconds = time.perf_counter() - start
    return result
