"""Markov chains beyond the circle: exact identities, seeded sampling, clear errors."""

import math
import re

import pytest
import torch

from rwinterp.chains import (
    HigherOrderChain,
    LazyWalk,
    PersistentWalk,
    RandomOrderChain,
    RegularGraphWalk,
    TorusWalk,
    random_regular_adjacency,
)
from rwinterp.errors import RwinterpError
from rwinterp.tasks import CircleWalk, MarkovChain, task_from_dict
from tests.conftest import RTOL, assert_close


def test_lazy_walk_is_the_circle_walk_that_may_stay():
    K, p, s = 6, 0.8, 0.3
    task = LazyWalk(K, p, s, 10)
    Pi = task.transition_matrix()
    expected = s * torch.eye(K, dtype=Pi.dtype) + (1 - s) * CircleWalk(K, p, 10).transition_matrix()
    assert torch.equal(Pi, expected)
    assert torch.equal(LazyWalk(K, p, 0.0, 10).transition_matrix(), CircleWalk(K, p, 10).transition_matrix())
    # Bayes: the largest of stay, (1-s) p, (1-s)(1-p) in every row (the uniform start is stationary).
    assert task.bayes_accuracy() == pytest.approx(max(s, (1 - s) * p, (1 - s) * (1 - p)), rel=RTOL)
    # A lazy deterministic walk is no longer deterministic.
    assert LazyWalk(K, 1.0, 0.5, 10).population_size() == K * 2**9


def test_torus_walk_moves_to_one_of_four_neighbours():
    rows, cols = 3, 4
    task = TorusWalk(rows, cols, 9)
    Pi = task.transition_matrix()
    assert task.n_states == 12
    for node in range(12):
        r, c = divmod(node, cols)
        neighbours = {((r + dr) % rows) * cols + (c + dc) % cols for dr, dc in ((1, 0), (-1, 0), (0, 1), (0, -1))}
        assert set(torch.nonzero(Pi[node]).flatten().tolist()) == neighbours
        assert torch.all(Pi[node, list(neighbours)] == 0.25)
    assert task.bayes_accuracy() == pytest.approx(0.25, rel=RTOL)
    assert TorusWalk(rows, cols, 9, stay=0.6).bayes_accuracy() == pytest.approx(0.6, rel=RTOL)
    # A side of length 2: the two neighbours along it coincide (probability 1/2).
    assert TorusWalk(2, 3, 5).transition_matrix()[0, 3] == 0.5


def test_random_regular_graph_is_simple_regular_and_seeded():
    A = random_regular_adjacency(10, 3, seed=4)
    assert torch.equal(A, A.T) and torch.all(A.diagonal() == 0) and set(A.unique().tolist()) == {0.0, 1.0}
    assert torch.all(A.sum(1) == 3)
    assert torch.equal(A, random_regular_adjacency(10, 3, seed=4))
    assert not torch.equal(A, random_regular_adjacency(10, 3, seed=5))
    task = RegularGraphWalk(10, 3, 8, graph_seed=4)
    assert torch.equal(task.transition_matrix(), A / 3)
    assert task.bayes_accuracy() == pytest.approx(1 / 3, rel=RTOL)


def test_non_uniform_start_changes_the_parent_marginal_and_the_bayes_accuracy():
    """Starting at node 0 of a lazy walk with p = 1: Bayes is computed from initial @ Pi^(N-2)."""
    K, N = 5, 4
    start = [1.0, 0, 0, 0, 0]
    task = LazyWalk(K, 1.0, 0.3, N, initial=start)
    Pi = task.transition_matrix()
    marginal = torch.tensor(start, dtype=torch.float64) @ torch.linalg.matrix_power(Pi, N - 2)
    assert_close(task.parent_marginal(), marginal)
    assert task.bayes_accuracy() == pytest.approx(float(marginal @ Pi.max(1).values), rel=RTOL)
    pop = task.population()
    assert torch.all(pop.states[:, 0] == 0) and pop.weights.sum().item() == pytest.approx(1.0, abs=1e-12)
    # Exact population accuracy of the Bayes predictor equals bayes_accuracy().
    hit = (task.conditional(pop.tokens).argmax(1) == pop.labels).double()
    assert float((hit * pop.weights).sum()) == pytest.approx(task.bayes_accuracy(), abs=1e-12)
    # Sampled walks start at 0 too.
    assert torch.all(task.sample(50, 3).states[:, 0] == 0)


@pytest.mark.parametrize(
    "transition, N, initial, message",
    [
        (torch.ones(3, 3, 2) / 2, 6, None, "every axis of the transition tensor must have length K"),
        (-torch.ones(2, 2, 2), 6, None, "finite and non-negative"),
        (torch.full((2, 2, 2), 0.4), 6, None, "must sum to 1"),
        (torch.full((2, 2, 2), 0.5), 3, None, "needs N >= 4"),
        (torch.full((2, 2, 2), 0.5), 6, [0.5, 0.5], "must have shape [2, 2]"),
        (torch.full((2, 2, 2), 0.5), 6, [[0.5, 0.5], [0.5, 0.5]], "non-negative and sum to 1"),
        (torch.ones(2), 6, None, "needs k + 1 >= 2 axes"),
    ],
)
def test_invalid_higher_order_chains(transition, N, initial, message):
    with pytest.raises(RwinterpError, match=re.escape(message)):
        HigherOrderChain(transition, N, initial)


@pytest.mark.parametrize(
    "build, message",
    [
        (lambda: MarkovChain([[0.5, 0.6], [0.5, 0.5]], 5), "must sum to 1"),
        (lambda: MarkovChain([[1.5, -0.5], [0.5, 0.5]], 5), "non-negative"),
        (lambda: LazyWalk(5, 0.5, 1.5, 6), "staying probability must lie in [0, 1]"),
        (lambda: TorusWalk(1, 4, 6), "at least 2 rows"),
        (lambda: RegularGraphWalk(5, 3, 6), "must be even"),
        (lambda: RegularGraphWalk(5, 5, 6), "degree must lie in [1, K-1]"),
        (lambda: PersistentWalk(5, 1.2, 6), "q must lie in [0, 1]"),
        (lambda: RandomOrderChain(4, 2, 6, concentration=0.0), "concentration must be positive"),
        (lambda: LazyWalk(5, 0.5, 0.2, 6, initial=[0.5, 0.5]), "must have 5 entries"),
    ],
)
def test_invalid_chains_have_clear_errors(build, message):
    with pytest.raises(RwinterpError, match=re.escape(message)):
        build()


def test_first_order_chain_is_the_k1_case():
    circle = CircleWalk(5, 0.7, 7)
    chain = HigherOrderChain(circle.transition_matrix(), 7)
    assert chain.order == 1 and chain.parent_positions() == circle.parent_positions() == (5,)
    assert chain.bayes_accuracy() == pytest.approx(circle.bayes_accuracy(), rel=RTOL)
    assert chain.population_size() == circle.population_size() == 5 * 2**6
    a, b = chain.sample(40, 3), MarkovChain(circle.transition_matrix(), 7).sample(40, 3)
    assert torch.equal(a.states, b.states) and torch.equal(a.tokens, b.tokens)
    pop = chain.population()
    assert_close(chain.conditional(pop.tokens), circle.conditional(pop.tokens))


def test_persistent_walk_needs_both_parents():
    K, q, N = 5, 0.8, 8
    task = PersistentWalk(K, q, N)
    assert task.parent_positions() == (N - 3, N - 2)
    assert task.bayes_accuracy() == q
    assert HigherOrderChain.bayes_accuracy(task) == pytest.approx(q, rel=RTOL)  # the generic formula
    pop = task.population()
    assert len(pop) == task.population_size() == K * 2 ** (N - 1)
    # Given both parents the label continues the last step with probability q, exactly.
    a, b = pop.tokens[:, N - 3], pop.tokens[:, N - 2]
    keep = pop.labels == (2 * b - a) % K
    assert float(pop.weights[keep].sum()) == pytest.approx(q, abs=1e-12)
    # Either parent alone predicts worse: the best accuracy from s_{N-1} alone is 1/2 (either
    # direction), from s_{N-2} alone q/2 (two steps on, either way; back to s_{N-2} w.p. 1 - q).
    for pos, best in ((N - 2, 0.5), (N - 3, q / 2)):
        joint = torch.zeros(K, K, dtype=torch.float64)
        joint.index_put_((pop.tokens[:, pos], pop.labels), pop.weights, accumulate=True)
        assert float(joint.max(1).values.sum()) == pytest.approx(best, abs=1e-12)
    # Sampled walks keep their direction in a share q of steps (within 4 standard errors).
    states = task.sample(400, 1).states
    steps = (states[:, 1:] - states[:, :-1]) % K
    kept = (steps[:, 1:] == steps[:, :-1]).double()
    assert abs(kept.mean().item() - q) < 4 * math.sqrt(q * (1 - q) / kept.numel())


def test_random_order_chain_bayes_accuracy_matches_its_population():
    task = RandomOrderChain(3, 2, 6, concentration=0.5, chain_seed=2)
    assert torch.equal(task.transition_tensor(), RandomOrderChain(3, 2, 6, 0.5, 2).transition_tensor())
    assert not torch.equal(task.transition_tensor(), RandomOrderChain(3, 2, 6, 0.5, 3).transition_tensor())
    pop = task.population()
    hit = (task.conditional(pop.tokens).argmax(1) == pop.labels).double()
    assert float((hit * pop.weights).sum()) == pytest.approx(task.bayes_accuracy(), abs=1e-12)
    # Empirical label frequencies given the parents match T (chi-square-free check: 5 standard errors).
    batch = task.sample(3000, 9)
    T = task.transition_tensor()
    a, b = batch.tokens[:, 3], batch.tokens[:, 4]
    mask = (a == 0) & (b == 1)
    freq = torch.bincount(batch.labels[mask], minlength=3).double() / mask.sum()
    se = (T[0, 1] * (1 - T[0, 1]) / mask.sum()).sqrt()
    assert torch.all((freq - T[0, 1]).abs() <= 5 * se + 1e-12)


@pytest.mark.parametrize("task", [
    LazyWalk(5, 0.7, 0.2, 6, initial=[0.2, 0.2, 0.2, 0.2, 0.2]),
    TorusWalk(3, 3, 6, stay=0.1),
    RegularGraphWalk(8, 3, 6, graph_seed=1),
    PersistentWalk(5, 0.9, 6),
    RandomOrderChain(3, 3, 7, concentration=0.3, chain_seed=4),
    HigherOrderChain(torch.full((2, 2, 2), 0.5), 5),
])
def test_tasks_round_trip_through_dicts(task):
    again = task_from_dict(task.to_dict())
    assert type(again) is type(task) and again.to_dict() == task.to_dict()
    assert torch.equal(again.sample(10, 1).tokens, task.sample(10, 1).tokens)
    assert again.bayes_accuracy() == task.bayes_accuracy()


def test_a_first_order_higher_order_chain_is_the_markov_chain():
    """k = 1: the same walks from the same seed, the same population and Bayes accuracy."""
    pi = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.0, 0.5], [0.2, 0.2, 0.6]], dtype=torch.float64)
    initial = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    first, general = MarkovChain(pi, 6, initial), HigherOrderChain(pi, 6, initial)
    a, b = first.sample(300, 4), general.sample(300, 4)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.labels, b.labels)
    pa, pb = first.population(), general.population()
    assert torch.equal(pa.tokens, pb.tokens) and torch.equal(pa.weights, pb.weights)
    assert first.bayes_accuracy() == general.bayes_accuracy()
    # The Bayes accuracy against its definition: the weighted share of walks whose label is the most
    # likely next state of their parent.
    hit = (pi[pa.tokens[:, -2]].argmax(1) == pa.labels).to(torch.float64)
    assert first.bayes_accuracy() == pytest.approx(float((pa.weights * hit).sum()), rel=1e-12)


def test_a_chain_describes_its_start_unless_it_is_uniform():
    assert LazyWalk(5, 0.5, 0.2, 6).describe() == "lazy(K=5, p=0.5, stay=0.2, N=6)"
    assert LazyWalk(5, 0.5, 0.2, 6, initial=[0, 0, 1, 0, 0]).describe() == \
        "lazy(K=5, p=0.5, stay=0.2, N=6, initial=[0, 0, 1, 0, 0])"
    assert MarkovChain([[0.1, 0.9], [0.6, 0.4]], 5, initial=[0.25, 0.75]).describe() == \
        "markov(N=5, initial=[0.25, 0.75])"  # the transition matrix is not spelled out
