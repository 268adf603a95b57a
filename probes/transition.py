"""Value against transition: does the model's state-to-state map look like the chain's Pi?

The paper's model computes ``f = V X softmax(...)``: once attention sits on the parent ``x_{N-1}``,
``f = V x_{N-1}``, and Theorem 3.1 says V converges in direction to ``Pi^T``. Without naming the
model, the same matrix is its OV circuit restricted to the states,

    C = W_E[:K] W_V W_O W_U[:, :K]            (row = current state, column = next-state score),

which is ``V^T`` exactly for the paper's model (its ``W_V = [V^T; 0]``, ``W_O`` and ``W_U`` copy
coordinates). C is compared with Pi (equivalently V with ``Pi^T``) by

* ``distance``: the paper's ``|| V/||V||_F - Pi^T/||Pi^T||_F ||_F`` (0 = same direction, NaN if V = 0);
* ``cosine``: ``<V, Pi^T> / (||V|| ||Pi^T||)``;
* ``argmax_agreement``: the share of states whose highest score (smallest index among ties, as in
  prediction, with the tie tolerance of C's own dtype) is among the most likely next states under Pi
  (Pi has ties at p = 0.5); for a constant C (V = 0) every state predicts state 0, as the model does;
* ``affine_a``, ``affine_b``, ``r2``: the least-squares fit ``V ~ a Pi^T + b 1`` and its R^2 (NaN when V
  is constant);
* ``kl``: the mean over states of ``KL(Pi[k] || softmax(C[k]))``, meaningful for models whose outputs
  are logits (trained with softmax cross-entropy); the paper's raw scores are not;
* ``ones_cosine``: the cosine with the all-ones matrix (1 when V is proportional to all-ones, the
  paper's Theorem 4.1 fixed point).

For models with a residual stream (detected by zeroing every attention and MLP output and seeing
non-zero logits), the direct path ``W_E W_U`` and the total ``direct + OV + biases`` (the bias terms
``(b_V W_O + b_O) W_U + b_U``, where the model has them) are compared too, and the total is the
headline: it is what a prediction gets from a parent it attends to fully (apart from the position
terms). In a query-slot model the predicting position holds the query token, not the parent, so
its direct path is the query token's ``W_E[query] W_U``, the same row for every parent state;
in an autoregressive model it is the parent's own. Training splits the work between the paths in
no particular proportion, so neither path alone need match Pi. Each part is kept under ``ov.``,
``direct.`` and ``total.``. With several layers or heads, the OV circuit of the head that attends
to the parents most is used; with MLP layers, C skips them, and the headline is the behaviour below.

``behaviour.``: the same comparisons for the model's mean logits given the parent's state, over the
probed walks (first-order chains): what the model does, whatever the circuit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Optional

import torch
from jaxtyping import Float
from torch import Tensor

from probes.attention import attention_probe
from probes.config import ProbeConfig
from probes.stats import point_weights
from probes.targets import Targets, evaluating, hook_names, model_dims, run_logits, targets_for
from rwinterp.errors import require
from rwinterp.metrics import exact_scale, transition_distance
from rwinterp.metrics import predict
from rwinterp.tasks import Batch, Task


def transition_of(task: Task) -> Optional[Float[Tensor, "K K"]]:
    """The task's first-order transition matrix Pi (row = current state), or None."""
    get = getattr(task, "transition_matrix", None)
    if get is None:
        return None
    Pi = get().to(torch.float64)
    return Pi if Pi.shape == (task.n_states, task.n_states) else None


@dataclass
class MatrixComparison:
    """A state-to-state score matrix ``matrix`` (row = current state) against Pi."""

    matrix: Float[Tensor, "K K"]
    distance: float
    cosine: float
    argmax_agreement: float
    affine_a: float
    affine_b: float
    r2: float
    kl: float
    ones_cosine: float

    def scores(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "matrix"}


def _affine_fit(x: list[float], y: list[float]) -> tuple[float, float]:
    """(a, b) of the least-squares line ``y ~ a x + b``, with exactly rounded sums (``math.fsum``), so the
    fit is the same to the last bit whatever the memory layout (LAPACK's least squares is not).
    A constant ``x`` (nothing to tell the slope from the offset) gives the minimum-norm solution."""
    n = len(x)
    mx, my = math.fsum(x) / n, math.fsum(y) / n
    sxx = math.fsum((xi - mx) ** 2 for xi in x)
    if sxx == 0.0:  # x = mx everywhere: min ||(a, b)|| subject to a mx + b = my
        return my * mx / (mx * mx + 1.0), my / (mx * mx + 1.0)
    a = math.fsum((xi - mx) * (yi - my) for xi, yi in zip(x, y)) / sxx
    return a, my - a * mx


def compare_to_transition(C: Float[Tensor, "K K"], Pi: Float[Tensor, "K K"]) -> MatrixComparison:
    """Every comparison of the module docstring, for ``C`` in Pi's orientation (``C = V^T``)."""
    choice = predict(C.detach())  # (before the cast: a float32 model's ties are float32's)
    C = C.detach().to(torch.float64)
    Pi = Pi.to(torch.float64)
    K = Pi.shape[0]
    # Sums of squares are taken of C / scale (an exact power-of-two rescaling), so that weights as large
    # as 1e300 give the same cosines and fit as any other multiple of them.
    scale = exact_scale(C)
    unit = C / scale
    nonzero = bool((C != 0).any())

    def cos(a: Tensor, b: Tensor) -> float:
        a, b = a / exact_scale(a), b / exact_scale(b)
        return float((a * b).sum() / (a.norm() * b.norm())) if nonzero else math.nan

    best = Pi >= Pi.amax(1, keepdim=True) - 1e-12
    agreement = float(best[torch.arange(K), choice].to(torch.float64).mean())
    a, b = _affine_fit(Pi.flatten().tolist(), unit.flatten().tolist())
    y = unit.flatten()
    total = float(((y - y.mean()) ** 2).sum())
    resid = float(((y - (a * Pi.flatten() + b)) ** 2).sum())
    r2 = 1.0 - resid / total if total > 1e-24 * max(1.0, float((y**2).sum())) else math.nan
    a, b = a * scale, b * scale
    logq = torch.log_softmax(C, dim=1)
    kl = float(torch.where(Pi > 0, Pi * (Pi.clamp(min=1e-300).log() - logq), 0.0).sum(1).mean())
    return MatrixComparison(
        matrix=C,
        distance=transition_distance(C.T, Pi),
        cosine=cos(C, Pi),
        argmax_agreement=agreement,
        affine_a=a,
        affine_b=b,
        r2=r2,
        kl=kl,
        ones_cosine=cos(C, torch.ones_like(C)),
    )


@dataclass
class TransitionResult:
    """The OV circuit (and, with a residual stream, the direct path and their sum) against Pi."""

    Pi: Float[Tensor, "K K"]
    head: tuple[int, int]
    ov: MatrixComparison
    direct: Optional[MatrixComparison]
    total: Optional[MatrixComparison]
    behaviour: Optional[MatrixComparison]
    skips_mlp: bool

    @property
    def V(self) -> Float[Tensor, "K K"]:
        """The OV circuit in the paper's orientation (the paper's V for its model)."""
        return self.ov.matrix.T

    @property
    def main(self) -> MatrixComparison:
        """The headline comparison: the behaviour when the circuit skips MLP layers; otherwise what
        a prediction gets from a parent it attends to fully, ``direct + OV`` with a residual stream,
        the OV circuit (the paper's V) without one."""
        return getattr(self, self.main_name)

    @property
    def main_name(self) -> str:
        if self.skips_mlp and self.behaviour is not None:
            return "behaviour"
        return "total" if self.total is not None else "ov"

    def scores(self) -> dict[str, float]:
        out = self.main.scores()
        parts = ("ov", "direct", "total", "behaviour") if self.total is not None or self.skips_mlp else ("behaviour",)
        for name in parts:
            part = getattr(self, name)
            if part is not None:
                out.update({f"{name}.{k}": v for k, v in part.scores().items()})
        return out


def ov_circuit(model: Any, head: tuple[int, int], K: int) -> Float[Tensor, "K K"]:
    """``W_E[:K] W_V[l, h] W_O[l, h] W_U[:, :K]`` from the model's TransformerLens weight views."""
    views = {}
    for name in ("W_E", "W_V", "W_O", "W_U"):
        value = getattr(model, name, None)
        require(isinstance(value, Tensor),
                f"the transition probe needs the weight view {name}, which {type(model).__name__} lacks")
        views[name] = value.detach().to(torch.float64)
    layer, h = head
    W_V = views["W_V"][layer, h * views["W_V"].shape[1] // model_dims(model)[1]]
    return views["W_E"][:K] @ W_V @ views["W_O"][layer, h] @ views["W_U"][:, :K]


def bias_logits(model: Any, head: tuple[int, int], K: int) -> Float[Tensor, " K"]:
    """``(b_V W_O + b_O) W_U + b_U`` over the states, from whichever biases the model has."""
    def view(name: str) -> Optional[Tensor]:
        value = getattr(model, name, None)
        return value.detach().to(torch.float64) if isinstance(value, Tensor) else None

    layer, h = head
    W_O, W_U = view("W_O")[layer, h], view("W_U")
    resid = torch.zeros(W_U.shape[0], dtype=torch.float64)
    b_V, b_O, b_U = view("b_V"), view("b_O"), view("b_U")
    if b_V is not None and b_V.ndim == 3:
        resid = resid + b_V[layer, h * b_V.shape[1] // model_dims(model)[1]] @ W_O
    if b_O is not None and b_O.ndim == 2:
        resid = resid + b_O[layer]
    out = resid @ W_U[:, :K]
    return out + b_U[:K] if b_U is not None and b_U.ndim == 1 else out


def has_direct_path(model: Any, inputs: Tensor) -> bool:
    """Whether logits stay non-zero with every attention and MLP output zeroed (a residual stream)."""
    n_layers, _ = model_dims(model)
    names = hook_names(model)
    zero = [(f"blocks.{l}.{part}", lambda act, hook: torch.zeros_like(act))
            for l in range(n_layers) for part in ("hook_attn_out", "hook_mlp_out")
            if f"blocks.{l}.{part}" in names]
    require(zero, f"{type(model).__name__} has no hook_attn_out to ablate")
    with torch.no_grad():
        logits = model.run_with_hooks(inputs, fwd_hooks=zero)
    return bool(logits.abs().max() > 0)


def behaviour_matrix(model: Any, targets: Targets) -> Optional[Float[Tensor, "K K"]]:
    """Mean state logits given the parent's state (single-parent predictions; None if a state
    never occurs as a parent)."""
    K = targets.n_states
    if int(targets.parents.sum(1).max()) != 1:
        return None
    logits = targets.select(run_logits(model, targets.inputs)).to(torch.float64)  # [B, T, K]
    parent_pos = targets.parents.to(torch.long).argmax(1)  # [T]
    states = targets.inputs[:, parent_pos]  # [B, T]
    w = point_weights(targets.weights, targets.n_walks)[0][:, None].expand_as(states)
    weighted = (logits * w[..., None]).reshape(-1, K)
    totals = torch.zeros(K, K, dtype=torch.float64).index_add_(0, states.flatten(), weighted)
    mass = torch.zeros(K, dtype=torch.float64).index_add_(0, states.flatten(), w.flatten())
    return totals / mass[:, None] if bool((mass > 0).all()) else None


def transition_probe(
    model: Any, task: Task, data: Batch, config: ProbeConfig = ProbeConfig(),
    head: Optional[tuple[int, int]] = None,
) -> TransitionResult:
    """Compare the model's OV circuit (and direct path) with the task's transition matrix.

    ``head`` defaults to the only head, or to the head attending most to the parents on ``data``.
    A pure function of (model, task, data, config): the model's weights and mode are untouched.
    """
    Pi = transition_of(task)
    require(Pi is not None, f"the transition probe needs a first-order Markov chain; {task.describe()} is not one")
    with evaluating(model):
        targets = targets_for(model, task, data, config.kind)
        n_layers, n_heads = model_dims(model)
        if head is None:
            if n_layers * n_heads == 1:
                head = (0, 0)
            else:
                head = attention_probe(model, task, data, replace(config, gradient_walks=0)).head
        K = task.n_states
        ov = ov_circuit(model, head, K)
        direct = total = None
        if has_direct_path(model, targets.inputs[:4]):
            W_E, W_U = (w.detach().to(torch.float64) for w in (model.W_E, model.W_U))
            if targets.kind == "query":  # the slot's residual stream starts from the query token, not the parent
                D = (W_E[int(targets.inputs[0, -1])] @ W_U[:, :K]).expand(K, K)
            else:
                D = W_E[:K] @ W_U[:, :K]
            direct = compare_to_transition(D, Pi)
            total = compare_to_transition(D + ov + bias_logits(model, head, K)[None, :], Pi)
        behaviour = behaviour_matrix(model, targets)
        skips_mlp = not bool(getattr(model.cfg, "attn_only", True))
        return TransitionResult(Pi, head, compare_to_transition(ov, Pi), direct, total,
                                None if behaviour is None else compare_to_transition(behaviour, Pi), skips_mlp)
