"""In-context Markov chains: sampling, the reference predictors (exact small cases, the definitions of
Edelman et al.'s code, the Bayes posterior predictive by quadrature) and the task interface."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from probes.targets import is_chain, targets_for
from rwinterp.model import DeepConfig, DeepTransformer
from rwinterp.errors import RwinterpError
from rwinterp.icl import (InContextChain, bayes_key, bigram_predictor, kgram_predictor, reference_losses,
                          uniform_predictor, unigram_predictor)
from rwinterp.tasks import task_from_dict


def as_float(rows):
    return torch.tensor([[[float(Fraction(x)) for x in row] for row in rows]], dtype=torch.float64)


# ------------------------------------------------------------------------------ exact small cases
def test_unigram_and_bigram_by_hand():
    states = torch.tensor([[0, 0, 1, 0, 1]])
    # unigram: counts of 0 and 1 among positions 0..t, plus 1, over t + 1 + 2
    assert torch.equal(unigram_predictor(states, 2), as_float([["2/3", "1/3"], ["3/4", "1/4"], ["3/5", "2/5"],
                                                               ["4/6", "2/6"]]))
    # bigram: t=0 nothing seen from 0; t=1 0->0 seen once; t=2 nothing from 1; t=3 from 0: 0->0, 0->1
    assert torch.equal(bigram_predictor(states, 2), as_float([["1/2", "1/2"], ["2/3", "1/3"], ["1/2", "1/2"],
                                                              ["2/4", "2/4"]]))
    assert torch.equal(bigram_predictor(states, 2, alpha=0.5)[0, 1], torch.tensor([0.75, 0.25], dtype=torch.float64))
    assert torch.equal(unigram_predictor(states, 3)[0, 2], as_float([["3/6", "2/6", "1/6"]])[0, 0])
    assert torch.equal(uniform_predictor(states, 4), torch.full((1, 4, 4), 0.25, dtype=torch.float64))


def test_second_order_by_hand():
    states = torch.tensor([[0, 1, 0, 1, 1, 0]])
    # t=0: no full context; t=1: context (0,1), nothing seen yet; t=2: context (1,0) unseen;
    # t=3: context (0,1), seen once, followed by 0; t=4: context (1,1) unseen.
    expected = as_float([["1/2", "1/2"], ["1/2", "1/2"], ["1/2", "1/2"], ["2/3", "1/3"], ["1/2", "1/2"]])
    assert torch.equal(kgram_predictor(states, 2, order=2), expected)
    assert torch.equal(kgram_predictor(states, 2, order=1), bigram_predictor(states, 2))


def test_the_predictors_match_edelman_et_al_reference_code():
    """A port of the reference computation in Edelman et al.'s evaluation (float64 here): the unigram
    counts include the current state, the bigram counts the transitions up to the current position."""
    K, T, alpha = 3, 40, 1.0
    x = InContextChain(K, T + 1).sample(200, 5).states
    n = x.shape[0]
    uni = bi = 0.0
    cnt = torch.zeros(n, K, dtype=torch.float64)
    tc = torch.zeros(n, K, K, dtype=torch.float64)
    ar = torch.arange(n)
    for t in range(T):
        cnt[ar, x[:, t]] += 1
        if t > 0:
            tc[ar, x[:, t - 1], x[:, t]] += 1
        pu = (cnt + alpha) / (cnt.sum(1, keepdim=True) + K * alpha)
        row = tc[ar, x[:, t]]
        pb = (row + alpha) / (row.sum(1, keepdim=True) + K * alpha)
        uni -= pu[ar, x[:, t + 1]].log().mean().item()
        bi -= pb[ar, x[:, t + 1]].log().mean().item()
    ours = reference_losses(InContextChain(K, T + 1), x)
    assert ours["unigram"] == pytest.approx(uni / T, rel=1e-12)
    assert ours["bigram"] == pytest.approx(bi / T, rel=1e-12)
    assert ours["uniform"] == pytest.approx(math.log(K), rel=1e-12)
    assert set(ours) == {"uniform", "unigram", "bigram"} and bayes_key(1) == "bigram"


def test_the_kgram_predictor_is_the_bayes_posterior_predictive():
    """For K = 2 each row is Beta(alpha, alpha); P(next = j | prefix) = P(prefix, j) / P(prefix), with the
    marginal likelihoods integrated by Gauss-Legendre quadrature (exact for these polynomials)."""
    alpha = 2.0  # Beta(2, 2): density 6 x (1 - x)
    nodes, w = np.polynomial.legendre.leggauss(40)
    x, w = (nodes + 1) / 2, w / 2

    def likelihood(seq: list[int], order: int) -> float:
        total = 0.5 ** min(order, len(seq))  # the first k states are uniform
        for ctx in {tuple(seq[i - order:i]) for i in range(order, len(seq))}:
            nxt = [seq[i] for i in range(order, len(seq)) if tuple(seq[i - order:i]) == ctx]
            ones = sum(nxt)
            total *= float((w * 6 * x * (1 - x) * x**ones * (1 - x) ** (len(nxt) - ones)).sum())
        return total

    for order, seed in ((1, 0), (2, 1)):
        task = InContextChain(2, 14, order=order, concentration=alpha)
        states = task.sample(3, seed).states
        ours = task.predictive(states)
        for b in range(3):
            seq = states[b].tolist()
            for t in range(task.seq_len - 1):
                prefix = seq[: t + 1]
                direct = likelihood(prefix + [1], order) / likelihood(prefix, order)
                assert float(ours[b, t, 1]) == pytest.approx(direct, rel=1e-9), (order, b, t)


def test_bayes_beats_other_alphas_and_orders_on_average():
    """The Bayes predictor's mean loss is below that of the same counts with other priors or another
    order (paired per sequence, with a 4-standard-error margin)."""
    task = InContextChain(3, 32, order=1, concentration=0.5)
    states = task.sample(4000, 2).states
    labels = states[:, 1:, None]

    def per_seq(probs):
        return -probs.gather(-1, labels)[..., 0].log().mean(1)

    bayes = per_seq(task.predictive(states))
    for other in (kgram_predictor(states, 3, 1, 2.0), kgram_predictor(states, 3, 1, 0.1),
                  kgram_predictor(states, 3, 2, 0.5), unigram_predictor(states, 3, 0.5)):
        d = per_seq(other) - bayes
        assert float(d.mean()) > 4 * float(d.std()) / math.sqrt(len(d))


def test_reference_losses_are_ordered_on_long_sequences():
    for order in (1, 2):
        task = InContextChain(3, 200, order=order)
        states = task.sample(300, 7).states
        labels = states[:, 1:, None]
        per = {name: -p.gather(-1, labels)[..., 0].log().mean(1) for name, p in (
            ("uniform", uniform_predictor(states, 3)), ("unigram", unigram_predictor(states, 3)),
            ("bayes", task.predictive(states)))}
        for worse, better in (("uniform", "unigram"), ("unigram", "bayes")):
            d = per[worse] - per[better]
            assert float(d.mean()) > 4 * float(d.std()) / math.sqrt(len(d)), (order, worse, better)
        losses = reference_losses(task, states)
        assert losses[bayes_key(order)] == pytest.approx(float(per["bayes"].mean()), rel=1e-12)
        assert set(losses) == ({"uniform", "unigram", "bigram"} | ({"kgram"} if order == 2 else set()))


def test_last_only_losses_are_those_of_the_label():
    task = InContextChain(3, 20)
    states = task.sample(100, 3).states
    last = reference_losses(task, states, last_only=True)
    p = task.predictive(states)[:, -1]
    assert last["bigram"] == pytest.approx(float(-p.gather(1, states[:, -1:]).log().mean()), rel=1e-12)
    assert torch.allclose(task.conditional(task.batch_from_states(states).tokens), p, rtol=0, atol=0)


# ------------------------------------------------------------------------------ sampling
def test_sampling_is_seeded_and_keeps_the_layout():
    task = InContextChain(3, 16)
    a, b = task.sample(50, 4), task.sample(50, 4)
    assert torch.equal(a.states, b.states) and not torch.equal(a.states, task.sample(50, 5).states)
    assert torch.equal(a.tokens[:, :-1], a.states[:, :-1]) and bool((a.tokens[:, -1] == 3).all())
    assert torch.equal(a.labels, a.states[:, -1]) and a.weights is None
    _, T = task.sample_with_transitions(50, 4)
    assert T.shape == (50, 3, 3) and torch.allclose(T.sum(-1), torch.ones(50, 3, dtype=torch.float64))


@pytest.mark.parametrize("order", [1, 2])
def test_each_sequence_follows_its_own_chain(order):
    """E[1{s_{k+1} = j} - T_b[s_1..s_k, j]] = 0 for the sequence's own T_b, and the first states are
    uniform (4-standard-error margins); another sequence's T does not fit."""
    K, n = 3, 20000
    task = InContextChain(K, order + 3, order=order, concentration=0.7)
    batch, T = task.sample_with_transitions(n, 11)
    s = batch.states
    rows = T[(torch.arange(n),) + tuple(s[:, j] for j in range(order))]  # [n, K]
    hit = torch.nn.functional.one_hot(s[:, order], K).to(torch.float64)
    d = hit - rows
    se = d.std(0) / math.sqrt(n)
    assert bool((d.mean(0).abs() < 4 * se).all())
    wrong = hit - rows.roll(1, 0)
    assert bool(((wrong * (rows.roll(1, 0) - rows)).sum(1).mean() < 0))  # a foreign T predicts worse
    first = torch.nn.functional.one_hot(s[:, 0], K).to(torch.float64).mean(0)
    assert bool(((first - 1 / K).abs() < 4 * math.sqrt((1 / K) * (1 - 1 / K) / n)).all())


def test_rows_are_dirichlet():
    """Mean 1/K and variance (1/K)(1 - 1/K) / (K alpha + 1) of the entries (4-standard-error margins)."""
    K, alpha = 4, 0.3
    _, T = InContextChain(K, 5, concentration=alpha).sample_with_transitions(20000, 1)
    x = T.reshape(-1, K)[:, 0]
    var = (1 / K) * (1 - 1 / K) / (K * alpha + 1)
    assert abs(float(x.mean()) - 1 / K) < 4 * math.sqrt(var / len(x))
    fourth = float(((x - 1 / K) ** 2).var())
    assert abs(float(x.var()) - var) < 4 * math.sqrt(fourth / len(x))


# ------------------------------------------------------------------------------ the task
def test_bayes_accuracy_against_the_exact_value_at_n_3():
    """N = 3: the label s_3 follows s_2; the prefix shows one transition s_1 -> s_2, which informs the
    row of s_2 only when s_1 = s_2. Exact: (1/K)(1 + a)/(1 + K a) + (1 - 1/K)/K."""
    K, a = 3, 1.0
    task = InContextChain(K, 3, concentration=a)
    exact = (1 / K) * (1 + a) / (1 + K * a) + (1 - 1 / K) / K
    assert task.bayes_accuracy() == task.bayes_accuracy()  # fixed seed: the same number every call
    # The estimate averages 10,000 values in {1/3, 1/2} (standard deviation <= 1/12).
    assert abs(task.bayes_accuracy() - exact) < 4 * (1 / 12) / math.sqrt(10_000)


def test_task_interface_and_registry():
    task = InContextChain(3, 10, order=2, concentration=0.5)
    assert task.parent_positions() == (7, 8) and task.d_vocab == 4 and task.sample_name == "sequence"
    assert task_from_dict(task.to_dict()).params() == task.params()
    assert task_from_dict({"kind": "icl", "K": 3, "N": 10}).params() == {"K": 3, "N": 10, "order": 1,
                                                                           "concentration": 1.0}
    assert is_chain(task) and task.parents_move
    model = DeepTransformer(DeepConfig.standard(3, 10, 16, seed=0))
    t = targets_for(model, task, task.sample(4, 0))
    assert t.kind == "autoregressive" and t.parent_sets() == [(i - 1, i) for i in range(1, 9)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(K=3, N=10, order=0), "order must be an integer >= 1"),
    (dict(K=3, N=10, concentration=-1.0), "concentration must be a positive number"),
    (dict(K=3, N=10, concentration=float("nan")), "concentration must be a positive number"),
    (dict(K=1, N=10), "K must be an integer >= 2"),
    (dict(K=3, N=3, order=2), "needs N >= 4"),
    (dict(K=50, N=100, order=3), "too many"),
])
def test_bad_parameters_get_one_line_errors(kwargs, message):
    with pytest.raises(RwinterpError, match=message):
        InContextChain(**kwargs)


def test_what_the_task_cannot_do_gets_one_line_errors():
    task = InContextChain(3, 8)
    for call in (task.population, task.population_size):
        with pytest.raises(RwinterpError, match="no population to enumerate"):
            call()
    with pytest.raises(RwinterpError, match="states must lie in 0 .. K-1 = 2"):
        bigram_predictor(torch.tensor([[0, 3, 1]]), 3)
    with pytest.raises(RwinterpError, match="must be >= 1"):
        task.sample(0, 1)
    with pytest.raises(RwinterpError, match="seed"):
        task.sample(2, -1)
