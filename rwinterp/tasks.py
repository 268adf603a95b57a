"""Prediction tasks: random walks on a circle, and the Markov chains they are a case of.

Every task shares one small interface (:class:`Task`), so models, training and probes never ask
which task they hold:

* ``n_states`` (K) label classes, which are also the input tokens ``0..K-1``; token ``K`` is the
  reserved *query token* that fills the last position (the paper's all-zero query slot).
* ``seq_len`` (N) positions per sample: ``N - 1`` observed tokens and the query slot.
* :meth:`Task.sample` draws ``n`` samples reproducibly from a seed; :meth:`Task.population`
  enumerates every sample with its probability (exact expectations, small N only), and
  :meth:`Task.population_size` says how many that is before enumerating them.
* :meth:`Task.conditional` is the true distribution of the label given the tokens,
  :meth:`Task.bayes_accuracy` the accuracy of the Bayes-optimal predictor, and
  :meth:`Task.parent_positions` the positions whose tokens determine the label (the *parents*;
  for a first-order chain only the token just before the query slot).
* :attr:`Task.parents_move` says whether the task is a chain in the wide sense: every next state
  depends on the states before it as the label does on the tokens before the query slot, so a
  model can predict (and be probed) at every position, the parents moved back with the prediction;
  :meth:`Task.predictive` gives the true next-state distribution at every position.

A sample of a walk ``s_1 .. s_N`` is ``tokens = [s_1, ..., s_{N-1}, K]`` with label ``s_N``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
from jaxtyping import Float, Int
from torch import Tensor

from rwinterp.config import TASKS
from rwinterp.errors import RwinterpError, require

#: Largest number of samples :meth:`Task.population` will enumerate.
MAX_POPULATION = 1 << 20

_TASKS: dict[str, type["Task"]] = {}


def check_population_size(size: int) -> None:
    """Refuse, with a one-line error, a population of more than :data:`MAX_POPULATION` samples."""
    require(size <= MAX_POPULATION, f"population mode would enumerate {size} walks (limit {MAX_POPULATION}); "
                                    "use a smaller N or sampled walks")


def register_task(cls: type["Task"]) -> type["Task"]:
    """Class decorator: make a task constructible by :func:`task_from_dict` under ``cls.kind``."""
    _TASKS[cls.kind] = cls
    return cls


def task_class(kind: str) -> type["Task"]:
    """The task class registered under ``kind``; the library's kinds (:data:`rwinterp.config.TASKS`) are
    imported on first use."""
    if kind not in _TASKS and kind in TASKS:
        import importlib

        importlib.import_module(TASKS[kind].module)
    if kind not in _TASKS:
        raise RwinterpError(f"unknown task kind {kind!r}; known: {', '.join(sorted(set(TASKS) | set(_TASKS)))}")
    return _TASKS[kind]


def task_from_dict(data: dict[str, Any]) -> "Task":
    """Rebuild a task from :meth:`Task.to_dict` output."""
    require(isinstance(data, dict), f"a task must be a JSON object, got {type(data).__name__}")
    data = dict(data)
    cls = task_class(data.pop("kind", None))
    try:
        return cls.from_params(data)
    except TypeError as exc:
        raise RwinterpError(f"bad parameters for task {cls.kind!r}: {exc}") from None


@dataclass
class Batch:
    """Samples of a task.

    ``tokens`` holds the observed tokens and the query token in the last position, ``labels`` the
    token to predict. ``weights`` is ``None`` for sampled data and holds the probability of each
    sample (summing to one) for an enumerated population. ``states`` is, where the task has one,
    the whole underlying sequence ``s_1 .. s_N`` (observed tokens followed by the label): the input
    a standard autoregressive model is trained on.
    """

    tokens: Int[Tensor, "batch pos"]
    labels: Int[Tensor, " batch"]
    weights: Float[Tensor, " batch"] | None = None
    states: Int[Tensor, "batch pos"] | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def __getitem__(self, index: Any) -> "Batch":
        """The samples at ``index`` (weights renormalised to sum to one)."""
        weights = None
        if self.weights is not None:
            weights = self.weights[index]
            weights = weights / weights.sum()
        states = None if self.states is None else self.states[index]
        return Batch(self.tokens[index], self.labels[index], weights, states)


class Task(ABC):
    """What a model is trained on and probed with. See the module docstring."""

    kind: ClassVar[str]
    #: What one sample is called in reports ("walk", "sentence").
    sample_name: ClassVar[str] = "walk"
    #: Whether mini-batch training draws fresh samples for every batch (an unlimited supply, such as
    #: in-context chains) instead of resampling a fixed training set.
    fresh_batches: ClassVar[bool] = False
    #: Whether the parents move with the prediction: the state after ``s_1 .. s_{t+1}`` depends on the
    #: states at the parents' offsets from it (``p - (N - 1)`` for each ``p`` of :meth:`parent_positions`) as
    #: the label does on the parents, for every t. True for Markov chains of any order (fixed or drawn per
    #: sequence); False for tasks whose parents sit at fixed positions of a template (question answering).
    #: Autoregressive models, which predict at every position, need it.
    parents_move: ClassVar[bool] = False

    @property
    @abstractmethod
    def n_states(self) -> int:
        """K: the number of label classes, which are also tokens ``0..K-1``."""

    @property
    @abstractmethod
    def seq_len(self) -> int:
        """N: positions per sample, the query slot included."""

    @property
    def query_token(self) -> int:
        """The reserved token that fills the query slot (the last position)."""
        return self.n_states

    @property
    def d_vocab(self) -> int:
        """Input vocabulary: the K state tokens and the query token."""
        return self.n_states + 1

    @abstractmethod
    def sample(self, n: int, seed: int) -> Batch:
        """``n`` independent samples; the same seed gives the same samples."""

    @abstractmethod
    def population_size(self) -> int:
        """How many samples :meth:`population` holds (checked before enumerating them)."""

    @abstractmethod
    def population(self) -> Batch:
        """Every sample of non-zero probability, with its probability as weight."""

    @abstractmethod
    def conditional(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch K"]:
        """The true distribution of the label given the tokens, P(y | x_1 .. x_{N-1})."""

    @abstractmethod
    def bayes_accuracy(self) -> float:
        """Accuracy of the Bayes-optimal predictor (ties broken towards the smallest label)."""

    @abstractmethod
    def parent_positions(self) -> tuple[int, ...]:
        """Positions (0-indexed into ``tokens``) whose tokens determine the label."""

    def predictive(self, states: Int[Tensor, "batch N"]) -> Float[Tensor, "batch pred K"]:
        """The true distribution of every next state given the states before it: row ``t`` (``t = 0 ..
        N-2``) is ``P(s_{t+2} | s_1 .. s_{t+1})``, what an autoregressive model predicts at position t.

        For a task whose parents move (:attr:`parents_move`) it is :meth:`conditional` with the parents
        moved back with the prediction; rows whose parents would fall before the first state are NaN.
        """
        require(self.parents_move, f"{self.describe()} predicts its label only, not every next state")
        N = self.seq_len
        slots = list(self.parent_positions())
        offsets = torch.tensor(slots) - (N - 1)  # all < 0
        out = torch.full((states.shape[0], N - 1, self.n_states), math.nan, dtype=torch.float64)
        window = states.new_full(states.shape, self.query_token)
        for t in range(int(-offsets.min()) - 1, N - 1):
            window[:, slots] = states[:, t + 1 + offsets]
            out[:, t] = self.conditional(window).to(torch.float64)
        return out

    def batch_from_states(self, states: Int[Tensor, "batch N"], weights: Tensor | None = None) -> Batch:
        """Samples from whole sequences ``s_1 .. s_N``: the last one becomes the label, its slot the query."""
        tokens = states.clone()
        tokens[:, -1] = self.query_token
        return Batch(tokens, states[:, -1].clone(), weights, states)

    @abstractmethod
    def params(self) -> dict[str, Any]:
        """The constructor arguments, JSON-serialisable."""

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> "Task":
        return cls(**params)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, **self.params()}

    def describe(self) -> str:
        """``kind(K=6, p=0.5, N=97)``: the parameters, a start distribution as its probabilities (left out
        when uniform), a transition matrix left out."""
        def show(v: Any) -> str:
            return "[" + ", ".join(f"{x:g}" for x in v) + "]" if isinstance(v, list) else str(v)

        args = ", ".join(f"{k}={show(v)}" for k, v in self.params().items()
                         if v is not None and not (isinstance(v, list) and v and isinstance(v[0], list)))
        return f"{self.kind}({args})"


def _check_length(seq_len: int) -> None:
    require(isinstance(seq_len, int) and seq_len >= 2, f"N must be an integer >= 2, got {seq_len}")


def check_stochastic(transition: Tensor, what: str) -> None:
    """Entries finite and non-negative, every row (last axis) summing to one."""
    require(bool(torch.isfinite(transition).all()) and bool((transition >= 0).all()),
            "transition probabilities must be finite and non-negative")
    require(bool(torch.allclose(transition.sum(-1), torch.ones((), dtype=transition.dtype), atol=1e-9)),
            f"every row of the {what} must sum to 1")


def check_distribution(initial: Tensor) -> None:
    require(bool(torch.isfinite(initial).all()) and bool((initial >= 0).all())
            and abs(float(initial.sum()) - 1) < 1e-9,
            "the initial distribution must be non-negative and sum to 1")


def count_walks(initial: Tensor, transition: Tensor, N: int) -> int:
    """Walks of length N with non-zero probability, for a chain of order k = ``transition.ndim - 1``
    (``initial``: the first k states' joint distribution). Exact below 2^53, saturating at 2^62."""
    k = transition.ndim - 1
    counts = (initial > 0).to(torch.float64)
    support = (transition > 0).to(torch.float64)
    for _ in range(N - k):
        counts = (counts[..., None] * support).sum(0)
    total = float(counts.sum())
    return int(total) if math.isfinite(total) and total < 2**62 else 2**62


def enumerate_walks(initial: Tensor, transition: Tensor, N: int) -> tuple[Int[Tensor, "walks N"], Tensor]:
    """Every walk of length N with non-zero probability, and its probability (order k as above)."""
    k = transition.ndim - 1
    states = torch.nonzero(initial > 0)  # [tuples, k]
    probs = initial[tuple(states.T)]
    for _ in range(N - k):
        rows = transition[tuple(states[:, -k:].T)]  # [walks, K]
        walk, nxt = torch.nonzero(rows > 0, as_tuple=True)
        probs = probs[walk] * rows[walk, nxt]
        states = torch.cat([states[walk], nxt[:, None]], dim=1)
    return states, probs


class ChainOfOrder(Task):
    """Walks of a Markov chain of order k >= 1: ``P(s_t | past) = T[s_{t-k}, ..., s_{t-1}]``.

    What :class:`MarkovChain` (k = 1) and :class:`rwinterp.chains.HigherOrderChain` share: sampling,
    the exact population, the parents' distribution and the Bayes accuracy. ``transition`` has
    shape ``[K] * (k + 1)`` and ``initial`` (the joint distribution of the first k states) shape
    ``[K] * k``; subclasses validate them, each with its own messages. The label's parents are the
    last k observed tokens, positions ``N-1-k .. N-2``.
    """

    parents_move = True

    def __init__(self, transition: Tensor, N: int, initial: Optional[Tensor]):
        K, k = int(transition.shape[0]), transition.ndim - 1
        self._T = transition
        self._init = torch.full([K] * k, 1.0 / K**k, dtype=torch.float64) if initial is None else initial
        self._N = N
        self._uniform_start = initial is None

    @property
    def n_states(self) -> int:
        return int(self._T.shape[0])

    @property
    def seq_len(self) -> int:
        return self._N

    @property
    def order(self) -> int:
        """k: how many previous states the next one depends on."""
        return self._T.ndim - 1

    def initial_distribution(self) -> Float[Tensor, "..."]:
        return self._init.clone()

    def params(self) -> dict[str, Any]:
        return {"transition": self._T.tolist(), "N": self._N,
                "initial": None if self._uniform_start else self._init.tolist()}

    def parent_positions(self) -> tuple[int, ...]:
        return tuple(range(self._N - 1 - self.order, self._N - 1))

    def conditional(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch K"]:
        return self._T[tuple(tokens[:, i] for i in self.parent_positions())]

    def parent_marginal(self) -> Float[Tensor, "..."]:
        """Joint distribution of the k parents (s_{N-k} .. s_{N-1}), shape ``[K] * k``.

        The chain on k-tuples is first order: ``P'[b.., c] = sum_a P[a, b..] T[a, b.., c]``.
        """
        joint = self._init
        for _ in range(self._N - 1 - self.order):
            joint = (joint[..., None] * self._T).sum(0)
        return joint

    def bayes_accuracy(self) -> float:
        return float((self.parent_marginal() * self._T.amax(-1)).sum())

    def sample(self, n: int, seed: int) -> Batch:
        require(isinstance(n, int) and n >= 1, f"the number of samples must be >= 1, got {n}")
        K, k = self.n_states, self.order
        gen = torch.Generator().manual_seed(int(seed))
        uniforms = torch.rand(n, self._N - k + 1, generator=gen, dtype=torch.float64)
        states = torch.empty(n, self._N, dtype=torch.long)
        first = _inverse_cdf(self._init.reshape(1, -1).expand(n, -1), uniforms[:, 0])
        for j in range(k):  # unravel the flat index of the first k-tuple (row-major)
            states[:, j] = first // K ** (k - 1 - j) % K
        for t in range(k, self._N):
            rows = self._T[tuple(states[:, t - k + j] for j in range(k))]
            states[:, t] = _inverse_cdf(rows, uniforms[:, t - k + 1])
        return self.batch_from_states(states)

    def population_size(self) -> int:
        """Number of walks of non-zero probability."""
        return count_walks(self._init, self._T, self._N)

    def population(self) -> Batch:
        check_population_size(self.population_size())
        return self.batch_from_states(*enumerate_walks(self._init, self._T, self._N))


@register_task
class MarkovChain(ChainOfOrder):
    """Walks of a first-order Markov chain with transition matrix ``Pi`` (row = current state).

    The walk starts from ``initial`` (uniform when omitted). The label's parent is the last
    observed token (position ``N - 2``): ``P(y | x) = Pi[x_{N-1}]``.
    """

    kind = "markov"

    def __init__(self, transition: Any, N: int, initial: Any = None):
        _check_length(N)
        pi = torch.as_tensor(transition, dtype=torch.float64)
        require(pi.ndim == 2 and pi.shape[0] == pi.shape[1], "the transition matrix must be square")
        require(pi.shape[0] >= 2, "a Markov chain needs at least 2 states")
        check_stochastic(pi, "transition matrix")
        K = pi.shape[0]
        init = None
        if initial is not None:
            init = torch.as_tensor(initial, dtype=torch.float64)
            require(init.shape == (K,), f"the initial distribution must have {K} entries")
            check_distribution(init)
        super().__init__(pi, N, init)

    def transition_matrix(self) -> Float[Tensor, "K K"]:
        """Pi, row = current state, column = next state (float64)."""
        return self._T.clone()


def _inverse_cdf(probs: Float[Tensor, "n K"], u: Float[Tensor, " n"]) -> Int[Tensor, " n"]:
    """Draw one category per row by inverting the cumulative distribution at ``u``."""
    cdf = probs.cumsum(dim=1)
    idx = torch.searchsorted(cdf, u[:, None] * cdf[:, -1:], right=True).squeeze(1)
    # Never land on a zero-probability state through round-off at the top of the cdf.
    return torch.minimum(idx, (probs > 0).to(torch.long).cumsum(1).argmax(1))


def circle_transition(K: int, p: float) -> Float[Tensor, "K K"]:
    """Pi of the walk on a circle of K nodes: +1 (mod K) with probability p, -1 with 1 - p."""
    pi = torch.zeros(K, K, dtype=torch.float64)
    idx = torch.arange(K)
    pi[idx, (idx + 1) % K] += p
    pi[idx, (idx - 1) % K] += 1 - p
    return pi


@register_task
class CircleWalk(MarkovChain):
    """The paper's task: a walk on a circle of K nodes, uniform start, +1 w.p. p, -1 w.p. 1 - p.

    The Bayes-optimal predictor is ``Pi^T x_{N-1}`` and its accuracy is ``max(p, 1 - p)``.
    """

    kind = "circle"

    def __init__(self, K: int, p: float, N: int):
        require(isinstance(K, int) and not isinstance(K, bool) and K >= 3,
                f"a circle needs K >= 3 states (with 2 the +1 and -1 steps coincide), got {K!r}")
        require(isinstance(p, (int, float)) and 0.0 <= float(p) <= 1.0,
                f"p must be a number in [0, 1], got {p!r}")
        self.K = K
        self.p = float(p)
        super().__init__(circle_transition(K, self.p), N)

    def params(self) -> dict[str, Any]:
        return {"K": self.K, "p": self.p, "N": self.seq_len}

    def bayes_accuracy(self) -> float:
        return max(self.p, 1.0 - self.p)

    def sample(self, n: int, seed: int) -> Batch:
        """Vectorised: uniform start, then cumulative +-1 steps mod K."""
        require(isinstance(n, int) and n >= 1, f"the number of samples must be >= 1, got {n}")
        gen = torch.Generator().manual_seed(int(seed))
        uniforms = torch.rand(n, self.seq_len, generator=gen, dtype=torch.float64)
        start = (uniforms[:, :1] * self.K).floor().clamp(max=self.K - 1).to(torch.long)
        steps = torch.where(uniforms[:, 1:] < self.p, 1, -1)
        states = torch.cat([start, start + steps.cumsum(dim=1)], dim=1) % self.K
        return self.batch_from_states(states)
