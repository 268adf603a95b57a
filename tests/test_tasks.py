import math

import pytest
import torch

from rwinterp.errors import RwinterpError
from rwinterp.tasks import MAX_POPULATION, CircleWalk, MarkovChain, task_from_dict
from tests.conftest import RTOL, assert_close


def test_circle_transition_matrix_is_circulant_and_stochastic():
    task = CircleWalk(5, 0.3, 8)
    Pi = task.transition_matrix()
    assert_close(Pi.sum(1), torch.ones(5, dtype=Pi.dtype))
    for i in range(5):
        assert Pi[i, (i + 1) % 5] == 0.3 and Pi[i, (i - 1) % 5] == pytest.approx(0.7, rel=RTOL)
        assert torch.equal(Pi[i], torch.roll(Pi[0], i))  # circulant
    # The uniform start is stationary.
    assert_close(torch.full((5,), 0.2, dtype=Pi.dtype) @ Pi, torch.full((5,), 0.2, dtype=Pi.dtype))


@pytest.mark.parametrize("p", [0.0, 0.2, 0.5, 0.9, 1.0])
def test_bayes_accuracy_is_max_p(p):
    """max(p, 1-p), against the Bayes predictor's accuracy over the exact population of walks (the
    most likely next state of the parent, ties to the smaller index as in prediction)."""
    task = CircleWalk(6, p, 10)
    pop = task.population()
    conditional = task.conditional(pop.tokens)
    best = conditional.max(1, keepdim=True).values
    choice = (conditional >= best - 1e-12).to(torch.int8).argmax(1)
    exact = float((pop.weights * (choice == pop.labels).to(torch.float64)).sum())
    # Under a tie (p = 0.5) either neighbour is right half the time.
    assert task.bayes_accuracy() == max(p, 1 - p) == pytest.approx(exact, rel=1e-12)
    # The generic Markov-chain formula agrees.
    assert MarkovChain.bayes_accuracy(task) == pytest.approx(max(p, 1 - p), rel=RTOL)


def test_sampling_is_seeded_and_walks_move_by_one():
    task = CircleWalk(6, 0.7, 20)
    a, b, c = task.sample(500, 1), task.sample(500, 1), task.sample(500, 2)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.labels, b.labels)
    assert not torch.equal(a.tokens, c.tokens)
    assert (a.tokens[:, -1] == task.query_token).all()
    assert torch.equal(a.states[:, :-1], a.tokens[:, :-1]) and torch.equal(a.states[:, -1], a.labels)
    steps = (a.states[:, 1:] - a.states[:, :-1]) % 6
    assert set(steps.unique().tolist()) <= {1, 5}
    # Share of +1 steps within 4 standard errors of p, overall and for the first step from every start.
    n = steps.numel()
    share = (steps == 1).double().mean().item()
    assert abs(share - 0.7) < 4 * math.sqrt(0.7 * 0.3 / n)
    big = task.sample(6000, 3)
    for s in range(6):
        first = (big.states[:, 1] - big.states[:, 0])[big.states[:, 0] == s] % 6
        assert abs((first == 1).double().mean().item() - 0.7) < 4 * math.sqrt(0.7 * 0.3 / len(first)), s
    # The start is uniform: each state's count within 4 standard errors of n / K.
    counts = torch.bincount(big.states[:, 0], minlength=6).double()
    assert ((counts - 1000).abs() < 4 * math.sqrt(6000 * (1 / 6) * (5 / 6))).all()


def test_training_and_test_walks_are_drawn_independently():
    from rwinterp.training import TrainConfig, data_seeds, make_data

    train, test = data_seeds(0)
    assert train != test
    a, b = make_data(CircleWalk(6, 0.7, 20), TrainConfig(n_train=200, n_test=200))
    assert not torch.equal(a.states, b.states)


def test_population_enumerates_every_walk_with_its_probability():
    task = CircleWalk(4, 0.7, 6)
    pop = task.population()
    assert len(pop) == 4 * 2**5 == task.population_size()
    assert pop.weights.sum().item() == pytest.approx(1.0, abs=1e-12)
    assert len({tuple(s) for s in pop.states.tolist()}) == len(pop)
    # Label distribution given the parent matches Pi exactly.
    parent = pop.tokens[:, -2]
    for s in range(4):
        mask = parent == s
        for y in range(4):
            joint = pop.weights[mask & (pop.labels == y)].sum() / pop.weights[mask].sum()
            assert joint.item() == pytest.approx(task.transition_matrix()[s, y].item(), abs=1e-12)


def test_a_part_of_a_population_keeps_its_relative_probabilities_summing_to_one():
    pop = CircleWalk(4, 0.7, 6).population()
    part = pop[:10]
    assert float(part.weights.sum()) == pytest.approx(1.0, abs=1e-12)
    assert_close(part.weights, pop.weights[:10] / pop.weights[:10].sum())


def test_parent_attention_is_the_total_on_all_parents():
    from rwinterp.metrics import parent_attention

    pattern = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.0, 0.5, 0.5, 0.0]], dtype=torch.float64)
    assert parent_attention(pattern, [1, 2]) == pytest.approx(0.75, rel=RTOL)
    assert parent_attention(pattern, [1, 2], torch.tensor([0.25, 0.75], dtype=torch.float64)) == pytest.approx(0.875,
                                                                                                               rel=RTOL)


def test_deterministic_population_keeps_only_possible_walks():
    task = CircleWalk(5, 1.0, 41)  # far too long to enumerate 5 * 2^40 walks, but only 5 are possible
    pop = task.population()
    assert len(pop) == 5
    assert_close(pop.weights, torch.full((5,), 0.2, dtype=torch.float64))


def test_population_too_large_is_refused():
    task = CircleWalk(6, 0.5, 40)
    assert task.population_size() > MAX_POPULATION
    with pytest.raises(RwinterpError, match="population mode would enumerate"):
        task.population()


@pytest.mark.parametrize(
    "args, message",
    [((2, 0.5, 10), "a circle needs K >= 3 states"), ((6, 1.5, 10), "p must be a number in"), ((6, -0.1, 10), "p must be a number in"),
     ((6, 0.5, 1), "N must be")],
)
def test_bad_circle_parameters(args, message):
    with pytest.raises(RwinterpError, match=message):
        CircleWalk(*args)


@pytest.mark.parametrize(
    "matrix, message",
    [([[0.5, 0.4], [0.5, 0.5]], "sum to 1"), ([[1.5, -0.5], [0.5, 0.5]], "non-negative"),
     ([[1.0, 0.0, 0.0]], "square")],
)
def test_bad_transition_matrices(matrix, message):
    with pytest.raises(RwinterpError, match=message):
        MarkovChain(matrix, 5)


def test_task_round_trips_through_dict():
    task = CircleWalk(7, 0.25, 12)
    again = task_from_dict(task.to_dict())
    assert isinstance(again, CircleWalk) and again.to_dict() == task.to_dict()
    chain = MarkovChain([[0.1, 0.9], [0.6, 0.4]], 5, initial=[0.3, 0.7])
    assert torch.equal(task_from_dict(chain.to_dict()).transition_matrix(), chain.transition_matrix())
    with pytest.raises(RwinterpError, match="unknown task kind"):
        task_from_dict({"kind": "nope"})


def test_generic_markov_sampler_matches_its_transition_matrix():
    Pi = torch.tensor([[0.1, 0.9, 0.0], [0.5, 0.0, 0.5], [0.3, 0.3, 0.4]], dtype=torch.float64)
    chain = MarkovChain(Pi, 30, initial=[1.0, 0.0, 0.0])
    batch = chain.sample(400, 3)
    assert (batch.states[:, 0] == 0).all()
    prev, nxt = batch.states[:, :-1].flatten(), batch.states[:, 1:].flatten()
    for i in range(3):
        from_i = nxt[prev == i]
        for j in range(3):
            share = (from_i == j).double().mean().item()
            se = math.sqrt(max(Pi[i, j].item() * (1 - Pi[i, j].item()), 1e-12) / len(from_i))
            assert abs(share - Pi[i, j].item()) <= 4 * se + 1e-12
    # The Bayes accuracy agrees with the exact population of a short walk of the same chain.
    short = MarkovChain(Pi, 6, initial=[1.0, 0.0, 0.0])
    pop = short.population()
    best = Pi[pop.tokens[:, -2]].argmax(1)
    assert short.bayes_accuracy() == pytest.approx(float((pop.weights * (best == pop.labels)).sum()), abs=1e-12)
