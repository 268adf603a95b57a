"""Markov chains beyond the circle: lazy walks, walks on graphs, and k-th order chains.

The paper's task is a walk on a circle (:class:`rwinterp.tasks.CircleWalk`). Its theory only uses
the Markov property: the label's distribution depends on the last observed token alone. This module
provides the tasks that test how far that carries:

First-order chains (subclasses of :class:`rwinterp.tasks.MarkovChain`; one parent, position N-2)
    * :class:`LazyWalk`: the circle walk that stays put with probability ``stay``:
      ``Pi = stay I + (1 - stay) Pi_circle``.
    * :class:`TorusWalk`: the simple random walk on a ``rows x cols`` grid with wrap-around
      (each step goes to one of the 4 neighbours with probability 1/4, times ``1 - stay``).
    * :class:`RegularGraphWalk`: the simple random walk on a random ``degree``-regular graph on K
      nodes, drawn reproducibly from ``graph_seed`` (pairing model, simple graphs only).

    All take ``initial``, the distribution of the first state (uniform when omitted), so a walk can
    start anywhere: a non-uniform start changes the distribution of the parent and hence the Bayes
    accuracy, but not the label's conditional distribution.

k-th order chains (:class:`HigherOrderChain`; k parents, positions N-1-k .. N-2)
    The next state is drawn from ``T[s_{t-k}, ..., s_{t-1}]``, a distribution over the K states:
    ``T`` is a tensor of shape ``[K] * (k + 1)`` whose last axis sums to one. The first k states
    are drawn jointly from ``initial`` (shape ``[K] * k``, uniform when omitted). A k-th order chain
    is a first-order chain on k-tuples, which is how :meth:`HigherOrderChain.parent_marginal`
    (the distribution of the parents) and the Bayes accuracy are computed exactly.

    * :class:`PersistentWalk`: a circle walk with momentum (k = 2): the next step repeats the
      previous step's direction with probability ``q`` and reverses it otherwise. The label needs
      both parents, s_{N-1} for where the walk is and s_{N-2} for where it is heading; the Bayes
      accuracy is ``max(q, 1 - q)``.
    * :class:`RandomOrderChain`: a k-th order chain whose rows are drawn from a symmetric Dirichlet
      distribution (``concentration``; small values give nearly deterministic rows), seeded.

Every task keeps the token layout of :mod:`rwinterp.tasks`: ``tokens = [s_1 .. s_{N-1}, K]``,
``label = s_N``, and ``Batch.states`` holds the whole walk.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from rwinterp.errors import RwinterpError, require, require_seed
from rwinterp.tasks import (
    MAX_POPULATION,
    ChainOfOrder,
    CircleWalk,
    MarkovChain,
    check_distribution,
    check_stochastic,
    register_task,
)

# ------------------------------------------------------------------------------ first order


def lazy_transition(transition: Float[Tensor, "K K"], stay: float) -> Float[Tensor, "K K"]:
    """``stay I + (1 - stay) Pi``: each step is skipped (the walk stays) with probability ``stay``."""
    require(isinstance(stay, (int, float)) and 0.0 <= float(stay) <= 1.0,
            f"the staying probability must lie in [0, 1], got {stay}")
    pi = torch.as_tensor(transition, dtype=torch.float64)
    return float(stay) * torch.eye(pi.shape[0], dtype=torch.float64) + (1.0 - float(stay)) * pi


def graph_walk_transition(adjacency: Any, stay: float = 0.0) -> Float[Tensor, "K K"]:
    """The simple random walk on a graph: from node i, move to a uniformly random neighbour.

    ``adjacency[i, j]`` counts the edges between i and j (multi-edges weigh more). Every node needs
    at least one edge. With ``stay > 0`` the walk is lazy (see :func:`lazy_transition`).
    """
    A = torch.as_tensor(adjacency, dtype=torch.float64)
    require(A.ndim == 2 and A.shape[0] == A.shape[1], "the adjacency matrix must be square")
    require(bool((A >= 0).all()), "adjacency counts must be non-negative")
    degree = A.sum(1)
    require(bool((degree > 0).all()), "every node of the graph needs at least one edge")
    return lazy_transition(A / degree[:, None], stay)


def torus_adjacency(rows: int, cols: int) -> Float[Tensor, "K K"]:
    """The ``rows x cols`` grid with wrap-around; node ``r * cols + c`` is cell (r, c).

    Each node has 4 neighbours (up, down, left, right); with a side of length 2 the two neighbours
    along it coincide and count as a double edge.
    """
    require(isinstance(rows, int) and isinstance(cols, int) and rows >= 2 and cols >= 2,
            f"a torus needs at least 2 rows and 2 columns, got {rows} x {cols}")
    K = rows * cols
    A = torch.zeros(K, K, dtype=torch.float64)
    for r in range(rows):
        for c in range(cols):
            node = r * cols + c
            for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1)):
                A[node, ((r + dr) % rows) * cols + (c + dc) % cols] += 1
    return A


def random_regular_adjacency(K: int, degree: int, seed: int, tries: int = 1000) -> Float[Tensor, "K K"]:
    """A uniformly random simple ``degree``-regular graph on K nodes (pairing model with rejection).

    Each node gets ``degree`` half-edges; a seeded random perfect matching of all half-edges gives
    the edges, and matchings with self-loops or double edges are rejected and redrawn. The same
    seed gives the same graph.
    """
    require(isinstance(K, int) and K >= 3, f"a regular graph needs K >= 3 nodes, got {K}")
    require(isinstance(degree, int) and 1 <= degree < K, f"the degree must lie in [1, K-1], got {degree}")
    require(K * degree % 2 == 0, f"K * degree must be even for a {degree}-regular graph on {K} nodes")
    require_seed(seed, "the graph seed")
    if degree == K - 1:  # the complete graph, the only one (which the pairing model rarely draws)
        return torch.ones(K, K, dtype=torch.float64) - torch.eye(K, dtype=torch.float64)
    rng = np.random.default_rng(seed)
    stubs = np.repeat(np.arange(K), degree)
    for _ in range(tries):
        pairs = rng.permutation(stubs).reshape(-1, 2)
        a, b = pairs[:, 0], pairs[:, 1]
        edges = set(zip(np.minimum(a, b).tolist(), np.maximum(a, b).tolist()))
        if (a != b).all() and len(edges) == len(pairs):
            A = torch.zeros(K, K, dtype=torch.float64)
            A[a, b] = 1.0
            A[b, a] = 1.0
            return A
    raise RwinterpError(f"no simple {degree}-regular graph on {K} nodes found in {tries} draws; lower the degree")


class _NamedChain(MarkovChain):
    """A first-order chain built from a few named parameters: :meth:`params` gives them
    (``param_names``, stored as attributes), then ``N`` and ``initial`` (``None`` = uniform)."""

    param_names: ClassVar[tuple[str, ...]]

    def params(self) -> dict[str, Any]:
        return {**{name: getattr(self, name) for name in self.param_names}, "N": self.seq_len,
                "initial": None if self._uniform_start else self._init.tolist()}


@register_task
class LazyWalk(_NamedChain):
    """The circle walk (+1 w.p. p, -1 w.p. 1-p) that stays put with probability ``stay``.

    ``Pi = stay I + (1 - stay) Pi_circle``; with ``stay = 0`` it is the paper's walk. A lazy walk
    is never deterministic when ``0 < stay < 1``, even at p = 1.
    """

    kind = "lazy"
    param_names = ("K", "p", "stay")

    def __init__(self, K: int, p: float, stay: float, N: int, initial: Any = None):
        circle = CircleWalk(K, p, N)  # checks K, p and N
        self.K, self.p, self.stay = K, circle.p, float(stay)
        super().__init__(lazy_transition(circle.transition_matrix(), stay), N, initial)


@register_task
class TorusWalk(_NamedChain):
    """The simple random walk on a ``rows x cols`` torus (K = rows * cols states), optionally lazy."""

    kind = "torus"
    param_names = ("rows", "cols", "stay")

    def __init__(self, rows: int, cols: int, N: int, stay: float = 0.0, initial: Any = None):
        self.rows, self.cols, self.stay = rows, cols, float(stay)
        super().__init__(graph_walk_transition(torus_adjacency(rows, cols), stay), N, initial)


@register_task
class RegularGraphWalk(_NamedChain):
    """The simple random walk on a random ``degree``-regular graph on K nodes (``graph_seed``)."""

    kind = "regular"
    param_names = ("K", "degree", "graph_seed", "stay")

    def __init__(self, K: int, degree: int, N: int, graph_seed: int = 0, stay: float = 0.0,
                 initial: Any = None):
        require_seed(graph_seed, "the graph seed")
        self.K, self.degree, self.graph_seed, self.stay = K, degree, int(graph_seed), float(stay)
        self.adjacency = random_regular_adjacency(K, degree, self.graph_seed)
        super().__init__(graph_walk_transition(self.adjacency, stay), N, initial)


# ------------------------------------------------------------------------------ k-th order


@register_task
class HigherOrderChain(ChainOfOrder):
    """A k-th order Markov chain: ``P(s_t | past) = T[s_{t-k}, ..., s_{t-1}]``.

    ``transition`` has shape ``[K] * (k + 1)`` (the order k is read off it), entries finite and
    non-negative, last axis summing to one; ``initial`` is the joint distribution of the first k
    states, shape ``[K] * k`` (uniform when omitted). The parents of the label are the last k
    observed tokens, positions ``N-1-k .. N-2``. With k = 1 this is :class:`MarkovChain` (the same
    walks from the same seed: both are :class:`~rwinterp.tasks.ChainOfOrder`).
    """

    kind = "order"

    def __init__(self, transition: Any, N: int, initial: Any = None):
        T = torch.as_tensor(transition, dtype=torch.float64)
        require(T.ndim >= 2, "a k-th order transition tensor needs k + 1 >= 2 axes")
        K, k = int(T.shape[0]), T.ndim - 1
        require(K >= 2, "a Markov chain needs at least 2 states")
        require(all(s == K for s in T.shape), f"every axis of the transition tensor must have length K = {K}, "
                f"got shape {list(T.shape)}")
        check_stochastic(T, "transition tensor (its last axis)")
        require(isinstance(N, int) and N >= k + 2,
                f"a chain of order {k} needs N >= {k + 2} (k parents, then the label, then the query slot), got {N}")
        init = None
        if initial is not None:
            init = torch.as_tensor(initial, dtype=torch.float64)
            require(tuple(init.shape) == (K,) * k,
                    f"the initial distribution of the first {k} states must have shape {[K] * k}")
            check_distribution(init)
        super().__init__(T, N, init)

    def transition_tensor(self) -> Float[Tensor, "..."]:
        """T with shape ``[K] * (k + 1)`` (float64): ``T[s_{t-k}, ..., s_{t-1}, s_t]``."""
        return self._T.clone()


def persistent_transition(K: int, q: float) -> Float[Tensor, "K K K"]:
    """``T[a, b, c]`` of a circle walk with momentum: repeat the last step (b - a) w.p. q.

    Pairs (a, b) that are not neighbours never occur in the walk; they get the symmetric step
    (+1 or -1 with probability 1/2 each) so that ``T`` is a valid transition tensor.
    """
    require(isinstance(K, int) and not isinstance(K, bool) and K >= 3,
            f"a circle needs K >= 3 states (with 2 the +1 and -1 steps coincide), got {K!r}")
    require(isinstance(q, (int, float)) and 0.0 <= float(q) <= 1.0, f"q must lie in [0, 1], got {q}")
    q = float(q)
    T = torch.zeros(K, K, K, dtype=torch.float64)
    for a in range(K):
        for b in range(K):
            if (b - a) % K in (1, K - 1):
                step = 1 if (b - a) % K == 1 else -1
                T[a, b, (b + step) % K] += q
                T[a, b, (b - step) % K] += 1.0 - q
            else:
                T[a, b, (b + 1) % K] += 0.5
                T[a, b, (b - 1) % K] += 0.5
    return T


@register_task
class PersistentWalk(HigherOrderChain):
    """A circle walk with momentum (a second-order chain): keep direction w.p. q, reverse w.p. 1-q.

    s_1 is uniform and the first step is +1 or -1 with probability 1/2. Given the parents
    ``(s_{N-2}, s_{N-1})`` the label is ``s_{N-1} + (s_{N-1} - s_{N-2})`` w.p. q, so the Bayes
    accuracy is ``max(q, 1 - q)``; either parent alone predicts at most 1/2 (K >= 5).
    """

    kind = "persistent"

    def __init__(self, K: int, q: float, N: int):
        T = persistent_transition(K, q)
        init = torch.zeros(K, K, dtype=torch.float64)
        idx = torch.arange(K)
        init[idx, (idx + 1) % K] += 0.5 / K
        init[idx, (idx - 1) % K] += 0.5 / K
        self.K, self.q = K, float(q)
        super().__init__(T, N, init)

    def params(self) -> dict[str, Any]:
        return {"K": self.K, "q": self.q, "N": self.seq_len}

    def bayes_accuracy(self) -> float:
        return max(self.q, 1.0 - self.q)


def random_order_transition(K: int, order: int, concentration: float, seed: int) -> Float[Tensor, "..."]:
    """A k-th order transition tensor with rows drawn from Dirichlet(concentration, ..., concentration)."""
    require(isinstance(K, int) and K >= 2, f"K must be an integer >= 2, got {K}")
    require(isinstance(order, int) and order >= 1, f"the order must be an integer >= 1, got {order}")
    require(K ** (order + 1) <= MAX_POPULATION, f"K^(k+1) = {K ** (order + 1)} entries is too many")
    require(isinstance(concentration, (int, float)) and concentration > 0,
            f"the Dirichlet concentration must be positive, got {concentration}")
    rows = np.random.default_rng(seed).dirichlet(np.full(K, float(concentration)), size=K**order)
    return torch.as_tensor(rows, dtype=torch.float64).reshape([K] * (order + 1))


@register_task
class RandomOrderChain(HigherOrderChain):
    """A seeded random k-th order chain (Dirichlet rows), uniform over the first k states."""

    kind = "random-order"

    def __init__(self, K: int, order: int, N: int, concentration: float = 1.0, chain_seed: int = 0):
        require_seed(chain_seed, "the chain seed")
        self.K, self.concentration, self.chain_seed = K, float(concentration), int(chain_seed)
        super().__init__(random_order_transition(K, order, self.concentration, self.chain_seed), N)

    def params(self) -> dict[str, Any]:
        return {"K": self.K, "order": self.order, "N": self.seq_len,
                "concentration": self.concentration, "chain_seed": self.chain_seed}
