"""In-context Markov chains: every sequence draws its own transition matrix.

The task of Edelman et al. (2024), "The Evolution of Statistical Induction Heads: In-Context
Learning Markov Chains" (also Nichani et al. 2024, Bietti et al. 2023). A chain of order k on K
states is drawn afresh for every sequence: each row of its transition tensor (one row per context,
the last k states) is an independent Dirichlet(alpha, ..., alpha) draw, the first k states are
uniform, and the sequence runs for N states. No single transition matrix fits all sequences, so a
model can only predict well by estimating the chain *in context*, from the transitions it has seen
so far in the sequence. Two-layer attention-only transformers learn to do that with a *statistical
induction head*: a layer-0 head copies the previous state into each position, and a layer-1 head
attends to the positions whose previous state equals the current one and reads what followed.

Layout (as every task of :mod:`rwinterp.tasks`): ``states`` = ``s_1 .. s_N``, ``tokens`` = the states
with the last replaced by the query token K, ``labels`` = ``s_N``. A model trained on next-token
prediction reads ``states`` and predicts at every position; a query-slot model reads ``tokens``.

Reference predictors
--------------------
Prediction ``t`` (``t = 0 .. N-2``) predicts ``s_{t+2}`` (0-indexed: ``states[:, t + 1]``) from the
states at positions ``0 .. t``. Three predictors mark the stages a trained model passes through
(the definitions of Edelman et al.'s code, so that numbers compare):

* :func:`uniform_predictor`: ``1 / K``, cross-entropy ``ln K``;
* :func:`unigram_predictor`: ``(count of j among positions 0..t + alpha) / (t + 1 + K alpha)`` (the
  current state is counted);
* :func:`kgram_predictor`: ``(count(context -> j) + alpha) / (count(context -> .) + K alpha)``, where the
  context is the last k states ending at position t and the counts are over the transitions seen so
  far (those into positions ``k .. t``). A prediction whose context is incomplete (``t < k - 1``) gets
  the empty count, i.e. uniform. With the task's own order and ``alpha = concentration`` this is the
  Bayes posterior predictive (the rows are independent Dirichlet, the posterior of a row is
  Dirichlet(alpha + counts), and the first k states are uniform): no predictor has a lower expected
  loss. :func:`bigram_predictor` is the order-1 case.

:func:`reference_losses` gives their mean cross-entropy over all predictions and sequences under the
keys ``"uniform"``, ``"unigram"``, ``"bigram"`` (always the order-1 in-context estimator, whatever the
task's order) and, for a task of order ``k >= 2``, ``"kgram"`` (the task's own order: the Bayes
predictor). So ``"bigram"`` is the Bayes loss exactly when ``"kgram"`` is absent; :func:`bayes_key`
names the one that is.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor

from rwinterp.errors import RwinterpError, require, require_seed
from rwinterp.tasks import Batch, Task, register_task

#: The most contexts times states (K^(k+1)) a transition tensor drawn per sequence may have.
MAX_ENTRIES = 1 << 16
#: Sequences of the Monte Carlo estimate of :meth:`InContextChain.bayes_accuracy`, and its seed.
BAYES_SAMPLES = 10_000
BAYES_SEED = 0
#: Elements of the largest temporary a sampling or counting step builds at once (chunked beyond).
_CHUNK_ELEMENTS = 1 << 22


# ------------------------------------------------------------------------------ predictors
def _check_states(states: Tensor, K: int) -> Tensor:
    require(isinstance(states, Tensor) and states.ndim == 2 and states.shape[1] >= 2,
            f"states must be a [batch, N] tensor with N >= 2, got {getattr(states, 'shape', type(states))}")
    require(not states.dtype.is_floating_point and not states.dtype.is_complex, "states must be integers")
    require(states.numel() == 0 or (int(states.min()) >= 0 and int(states.max()) < K),
            f"states must lie in 0 .. K-1 = {K - 1}")
    return states.to(torch.long)


def _check_alpha(alpha: float) -> float:
    require(isinstance(alpha, (int, float)) and not isinstance(alpha, bool) and math.isfinite(alpha)
            and alpha > 0, f"the Dirichlet concentration must be a positive number, got {alpha!r}")
    return float(alpha)


def uniform_predictor(states: Int[Tensor, "batch N"], K: int) -> Float[Tensor, "batch pred K"]:
    """``1 / K`` for every prediction ``t = 0 .. N-2`` (float64)."""
    states = _check_states(states, K)
    return torch.full((states.shape[0], states.shape[1] - 1, K), 1.0 / K, dtype=torch.float64)


def unigram_predictor(states: Int[Tensor, "batch N"], K: int, alpha: float = 1.0) -> Float[Tensor, "batch pred K"]:
    """In-context unigram: ``(count of j among positions 0..t + alpha) / (t + 1 + K alpha)`` (float64)."""
    states = _check_states(states, K)
    alpha = _check_alpha(alpha)
    seen = states[:, :-1]
    counts = torch.nn.functional.one_hot(seen, K).to(torch.float64).cumsum(1)  # [batch, pred, K]
    total = torch.arange(1, seen.shape[1] + 1, dtype=torch.float64)[None, :, None]
    return (counts + alpha) / (total + K * alpha)


def kgram_predictor(states: Int[Tensor, "batch N"], K: int, order: int = 1,
                    alpha: float = 1.0) -> Float[Tensor, "batch pred K"]:
    """In-context k-gram under the Dirichlet prior (see the module docstring), float64.

    Prediction t: ``(count(c -> j) + alpha) / (count(c -> .) + K alpha)`` with ``c`` the states at
    positions ``t-k+1 .. t`` and the counts over the transitions into positions ``k .. t``; uniform
    while ``t < k - 1``.
    """
    states = _check_states(states, K)
    require(isinstance(order, int) and not isinstance(order, bool) and order >= 1,
            f"the order must be an integer >= 1, got {order!r}")
    alpha = _check_alpha(alpha)
    return _kgram(states[:, :-1], K, order, alpha)


def bigram_predictor(states: Int[Tensor, "batch N"], K: int, alpha: float = 1.0) -> Float[Tensor, "batch pred K"]:
    """In-context bigram: :func:`kgram_predictor` of order 1 (Bayes for a first-order in-context chain)."""
    return kgram_predictor(states, K, 1, alpha)


def _contexts(seen: Tensor, K: int, k: int) -> Tensor:
    """Flat index (row-major, oldest state first) of the k states ending at each position ``t >= k-1``."""
    c = torch.zeros(seen.shape[0], seen.shape[1] - k + 1, dtype=torch.long)
    for j in range(k):
        c = c * K + seen[:, j: seen.shape[1] - k + 1 + j]
    return c


def _kgram(seen: Int[Tensor, "batch T"], K: int, k: int, alpha: float) -> Float[Tensor, "batch T K"]:
    """The k-gram predictive after each prefix ``seen[:, :t+1]``, ``t = 0 .. T-1``.

    Transition i (into position i >= k) has context ``c_{i-1}`` and next state ``seen[i]``; the counts of
    prediction t are a running sum of their one-hot codes up to i = t, read at the row of ``c_t``.
    """
    B, T = seen.shape
    out = torch.full((B, T, K), 1.0 / K, dtype=torch.float64)
    if T < k:
        return out
    contexts = _contexts(seen, K, k)  # [B, T-k+1]: c_t for t = k-1 .. T-1
    rows = K**k
    chunk = max(1, _CHUNK_ELEMENTS // max(1, T * rows * K))
    for lo in range(0, B, chunk):
        b = slice(lo, min(B, lo + chunk))
        codes = torch.zeros(b.stop - b.start, T, rows * K, dtype=torch.float64)
        if T > k:
            code = contexts[b, :-1] * K + seen[b, k:]  # transition into position i = k .. T-1
            codes[:, k:].scatter_(2, code[..., None], 1.0)
        counts = codes.cumsum(1)[:, k - 1:].view(b.stop - b.start, T - k + 1, rows, K)
        mine = counts.gather(2, contexts[b, :, None, None].expand(-1, -1, 1, K))[:, :, 0]  # [b, T-k+1, K]
        out[b, k - 1:] = (mine + alpha) / (mine.sum(-1, keepdim=True) + K * alpha)
    return out


def cross_entropy(probs: Float[Tensor, "batch pred K"], states: Int[Tensor, "batch N"]) -> float:
    """Mean of ``-ln probs[b, t, states[b, t + 1]]`` over sequences and predictions."""
    p = probs.gather(-1, states[:, 1:, None].to(torch.long))[..., 0]
    return float(-p.log().mean())


def bayes_key(order: int) -> str:
    """The key of :func:`reference_losses` that holds the Bayes predictor's loss."""
    return "bigram" if order == 1 else "kgram"


def reference_losses(task: "InContextChain", states: Int[Tensor, "batch N"],
                     last_only: bool = False) -> dict[str, float]:
    """Mean next-state cross-entropy (nats) of the reference predictors on ``states``.

    ``{"uniform", "unigram", "bigram"}`` and, for a task of order >= 2, ``"kgram"`` (see the module
    docstring), averaged over all predictions ``t = 0 .. N-2`` of every sequence (what a model trained
    on next-token prediction is scored on), or over the last prediction only (``last_only``: the
    label ``s_N``, what a query-slot model predicts). ``alpha`` is the task's concentration.
    """
    require(isinstance(task, InContextChain), f"reference losses need an in-context chain task, got {task!r}")
    K, k, alpha = task.n_states, task.order, task.concentration
    states = _check_states(states, K)
    require(states.shape[1] == task.seq_len, f"the sequences have {states.shape[1]} states but the task has "
            f"N={task.seq_len}")
    predictors = {"uniform": uniform_predictor(states, K), "unigram": unigram_predictor(states, K, alpha),
                  "bigram": kgram_predictor(states, K, 1, alpha)}
    if k >= 2:
        predictors["kgram"] = kgram_predictor(states, K, k, alpha)
    if last_only:  # the last prediction, whose label is the last state
        return {name: cross_entropy(p[:, -1:], states[:, -2:]) for name, p in predictors.items()}
    return {name: cross_entropy(p, states) for name, p in predictors.items()}


# ------------------------------------------------------------------------------ the task
@register_task
class InContextChain(Task):
    """Markov chains of order ``order`` on K states, a fresh chain per sequence (see the module docstring).

    Every sequence draws each row of its transition tensor ``T[s_{t-k} .. s_{t-1}, :]`` from
    Dirichlet(concentration * 1); its first ``order`` states are uniform; it has N states. The label
    ``s_N`` depends on the whole sequence (through the counts of its transitions); its *parents*, the
    positions that index the row it is drawn from, are the last ``order`` observed states (positions
    ``N-1-k .. N-2``), as for a fixed chain, and they move with the prediction (:attr:`parents_move`).
    """

    kind = "icl"
    sample_name = "sequence"
    parents_move = True
    fresh_batches = True

    def __init__(self, K: int, N: int, order: int = 1, concentration: float = 1.0):
        require(isinstance(K, int) and not isinstance(K, bool) and K >= 2, f"K must be an integer >= 2, got {K!r}")
        require(isinstance(order, int) and not isinstance(order, bool) and order >= 1,
                f"the order must be an integer >= 1, got {order!r}")
        require(K ** (order + 1) <= MAX_ENTRIES,
                f"K^(order+1) = {K ** (order + 1)} transition probabilities per sequence is too many "
                f"(limit {MAX_ENTRIES})")
        require(isinstance(N, int) and not isinstance(N, bool) and N >= order + 2,
                f"an in-context chain of order {order} needs N >= {order + 2} (the first {order} state(s), "
                f"then the label, then the query slot), got {N!r}")
        self.K, self.N, self.order = K, N, order
        self.concentration = _check_alpha(concentration)
        self._bayes_accuracy: Optional[float] = None

    @property
    def n_states(self) -> int:
        return self.K

    @property
    def seq_len(self) -> int:
        return self.N

    def params(self) -> dict[str, Any]:
        return {"K": self.K, "N": self.N, "order": self.order, "concentration": self.concentration}

    def parent_positions(self) -> tuple[int, ...]:
        return tuple(range(self.N - 1 - self.order, self.N - 1))

    def reference_losses(self, states: Int[Tensor, "batch N"]) -> dict[str, float]:
        """The reference predictors' mean cross-entropy on ``states`` (:func:`reference_losses`)."""
        return reference_losses(self, states)

    # ------------------------------------------------------------------ sampling
    def sample_with_transitions(self, n: int, seed: int) -> tuple[Batch, Float[Tensor, "n ..."]]:
        """:meth:`sample`, and each sequence's transition tensor, ``[n] + [K] * (order + 1)`` (float64).

        Vectorised over sequences: numpy draws the rows (``Generator.dirichlet``, which stays exact for
        small concentrations) and one uniform per state; the next state for every context at every step
        is the inverse cdf of its row at that step's uniform (the count of the row's first K - 1 cumulative
        sums at or below it), a table built by K - 1 comparisons; the walk then follows the table, one
        lookup per step.
        """
        require(isinstance(n, int) and not isinstance(n, bool) and n >= 1,
                f"the number of samples must be >= 1, got {n!r}")
        require_seed(seed)
        K, k, N = self.K, self.order, self.N
        rows = K**k
        rng = np.random.default_rng(seed)
        transitions = rng.dirichlet(np.full(K, self.concentration), size=(n, rows))  # [n, K^k, K]
        uniforms = rng.random((n, N))
        cdf = transitions.cumsum(-1)  # (its last column, 1 up to round-off, is never compared with)
        first = np.minimum((uniforms[:, :k] * K).astype(np.int64), K - 1)
        context = first @ (K ** np.arange(k - 1, -1, -1))
        shift = (np.arange(rows) % (rows // K)) * K  # a context's last k-1 states, moved up one place
        states = np.empty((n, N), dtype=np.int64)
        states[:, :k] = first
        step = max(1, _CHUNK_ELEMENTS // (n * rows * K))
        for lo in range(k, N, step):
            hi = min(N, lo + step)
            # each context's successor at each step (its last k-1 states and the drawn one), flat; a walk's
            # next context is one lookup, and its state the last digit of that context
            successor = np.broadcast_to(shift, (n, hi - lo, rows)).copy()
            for j in range(K - 1):  # (the inverse cdf: the count of cdf values at or below the uniform)
                successor += uniforms[:, lo:hi, None] >= cdf[:, None, :, j]
            successor = successor.reshape(-1)
            at = np.arange(n)[:, None] * ((hi - lo) * rows) + np.arange(hi - lo) * rows  # [n, steps]
            for t in range(lo, hi):
                context = successor.take(at[:, t - lo] + context)
                states[:, t] = context
        states[:, k:] %= K
        batch = self.batch_from_states(torch.from_numpy(states))
        return batch, torch.from_numpy(transitions).reshape([n] + [K] * (k + 1))

    def sample(self, n: int, seed: int) -> Batch:
        """``n`` sequences, each from its own chain; the same seed gives the same sequences."""
        return self.sample_with_transitions(n, seed)[0]

    def population_size(self) -> int:
        raise RwinterpError("an in-context chain draws a transition matrix per sequence, from a continuous "
                            "distribution: there is no population to enumerate; use sampled sequences")

    def population(self) -> Batch:
        return self.population_size()  # raises

    # ------------------------------------------------------------------ the Bayes predictor
    def predictive(self, states: Int[Tensor, "batch N"]) -> Float[Tensor, "batch pred K"]:
        """The Bayes posterior predictive at every position: :func:`kgram_predictor` of the task's order
        with ``alpha`` = the concentration (no NaN rows: incomplete contexts are uniform, which is exact)."""
        return kgram_predictor(states, self.K, self.order, self.concentration)

    def conditional(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch K"]:
        """``P(s_N | s_1 .. s_{N-1})``: the k-gram posterior predictive after the observed tokens."""
        require(isinstance(tokens, Tensor) and tokens.ndim == 2 and tokens.shape[1] == self.N,
                f"tokens must be [batch, N={self.N}], got {getattr(tokens, 'shape', type(tokens))}")
        seen = _check_states(tokens[:, :-1], self.K)
        return _kgram(seen, self.K, self.order, self.concentration)[:, -1]

    def bayes_accuracy(self) -> float:
        """Accuracy of the Bayes predictor on the label ``s_N``, a Monte Carlo estimate.

        There is no closed form. The estimate is the mean of ``max_j P(s_N = j | s_1 .. s_{N-1})`` (the
        Bayes predictor's chance of being right given the prefix; ties broken towards the smallest label
        change nothing) over :data:`BAYES_SAMPLES` = 10,000 sequences drawn with seed :data:`BAYES_SEED`
        = 0: the same number every call, with a standard error of at most 0.005 (a mean of 10,000
        numbers in [0, 1]). Computed once per task object.
        """
        if self._bayes_accuracy is None:
            batch = self.sample(BAYES_SAMPLES, BAYES_SEED)
            self._bayes_accuracy = float(self.conditional(batch.tokens).amax(-1).mean())
        return self._bayes_accuracy
