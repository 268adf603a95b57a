"""Random initialisation (Figs 6, 11, 12, 13): the readings' options are exact, and the specs run.

The readings differ in two options: ``TrainConfig.reduction`` ("sum": the loss summed over the walks)
and ``DeepOptions.normalize_query`` (False: only the keys are normalised). Both are checked
against explicit formulas; the figure specs are run in reduced mode and their measurements checked
against exact values where the theory gives them.
"""

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from experiments.runner import evaluate_claims, execute, figure_results, plan, select, discover
from experiments.spec import Results, RunResult, walk_run
from experiments.specs import _random_init as ri
from rwinterp.errors import RwinterpError
from rwinterp.tasks import CircleWalk
from rwinterp.training import TrainConfig, reduction_scale, train
from tests.conftest import assert_close, full_w_copy, paper_model

TINY = dict(pos_dim=24, init="gaussian", init_sigma=0.05, normalize_tokens=True, seed=2)


def trained(task, model_kw, **train_kw):
    model = paper_model(task, **{**TINY, **model_kw})
    result = train(model, task, TrainConfig(**train_kw), progress=False)
    return model, result


@pytest.mark.parametrize("population", [False, True])
def test_summed_loss_is_the_mean_loss_at_n_times_the_learning_rate(population):
    """GD at lr on the sum over n walks = GD at n * lr on the mean (population: n_train * expectation)."""
    task = CircleWalk(5, 0.6, 9)
    n = 40
    common = dict(steps=3, n_train=n, n_test=20, population=population)
    summed, r_sum = trained(task, {}, lr=0.01, reduction="sum", **common)
    mean, r_mean = trained(task, {}, lr=0.01 * n, **common)
    assert_close(summed.V, mean.V)
    assert_close(summed.u, mean.u)
    # The recorded loss stays the mean per walk.
    assert [h["loss"] for h in r_sum.history] == pytest.approx([h["loss"] for h in r_mean.history], rel=1e-12)
    assert not torch.allclose(summed.V, paper_model(task, **TINY).V)  # training moved V


def test_one_summed_step_moves_V_n_times_as_far_as_one_mean_step():
    task = CircleWalk(5, 0.6, 9)
    start = paper_model(task, **TINY).V.detach().clone()
    moved = {red: trained(task, {}, lr=0.01, steps=1, n_train=30, n_test=10, reduction=red)[0].V.detach() - start
             for red in ("mean", "sum")}
    assert_close(moved["sum"], 30 * moved["mean"])
    batch = task.sample(30, 0)
    assert reduction_scale(TrainConfig(reduction="sum"), batch) == 30
    assert reduction_scale(TrainConfig(reduction="sum", n_train=77), task.population()) == 77
    assert reduction_scale(TrainConfig(), batch) == 1


def test_keys_only_normalisation_is_the_formula_with_the_raw_query():
    """Scores: x~_i/||x~_i|| . W x~_N with the query NOT normalised; u's GD rate is ||x~_N||^2 = M/2."""
    task = CircleWalk(5, 0.6, 9)
    model = paper_model(task, **TINY, normalize_query=False)
    tokens = task.sample(16, 1).tokens
    X = torch.nn.functional.one_hot(tokens, 6)[..., :5].double()
    Xt = torch.cat([X, model.W_pos[:, 5:].expand(16, -1, -1)], -1)
    S = torch.softmax((Xt / Xt.norm(dim=-1, keepdim=True)) @ (model.W @ Xt[0, -1]), -1)
    expected = torch.einsum("bn,bnk->bk", S, X) @ model.V.T
    assert_close(model.scores(tokens), expected)
    assert u_rate(model) == pytest.approx(24 / 2, rel=1e-14)
    assert u_rate(paper_model(task, **TINY)) == pytest.approx(1.0, rel=1e-14)
    with pytest.raises(RwinterpError):
        TrainConfig(reduction="median")


def u_rate(model) -> float:
    """The rate at which gradient descent moves u = W q (||q||^2 times the learning rate)."""
    return model.param_groups("gd", 1.0, 0.0)[-1]["lr"]


@pytest.mark.parametrize("normalize_query", [True, False])
def test_token_norm_scales_the_normalised_keys_and_query(normalize_query):
    """Scores: (r x~_i/||x~_i||) . W q with q = r x~_N/||x~_N|| (or the raw x~_N with keys-only
    normalisation); u's GD rate is ||q||^2; the model storing the whole W agrees."""
    task = CircleWalk(5, 0.6, 9)
    r = 3.0
    model = paper_model(task, **TINY, token_norm=r, normalize_query=normalize_query)
    tokens = task.sample(16, 1).tokens
    X = torch.nn.functional.one_hot(tokens, 6)[..., :5].double()
    Xt = torch.cat([X, model.W_pos[:, 5:].expand(16, -1, -1)], -1)
    q = Xt[0, -1] / Xt[0, -1].norm() * r if normalize_query else Xt[0, -1]
    S = torch.softmax((r * Xt / Xt.norm(dim=-1, keepdim=True)) @ (model.W @ q), -1)
    expected = torch.einsum("bn,bnk->bk", S, X) @ model.V.T
    assert_close(model.scores(tokens), expected)
    assert u_rate(model) == pytest.approx(float(q @ q), rel=1e-14)
    assert_close(full_w_copy(model)(tokens)[:, -1, :], expected)
    with pytest.raises(RwinterpError, match="token norm"):
        paper_model(task, token_norm=0.0)


def test_kl_quantities_are_exact_on_known_outputs():
    """KL(P || q) is 0 when the scores are P itself and log K - H(P) for uniform scores."""
    for p, uniform_kl in ((0.5, math.log(3)), (1.0, math.log(6))):
        task = CircleWalk(6, p, 13)
        test = task.sample(50, 3)
        truth = task.conditional(test.tokens).double()

        def kl(scores, how):
            return ri.kl_to_truth(task, test.tokens, scores, how)

        assert kl(truth * 7.0, ri.clipped_normalised) == pytest.approx(0.0, abs=1e-12)
        assert kl(torch.log(truth.clamp_min(1e-300)), ri.softmax) == pytest.approx(0.0, abs=1e-9)
        flat = torch.ones_like(truth)
        assert kl(flat, ri.clipped_normalised) == pytest.approx(uniform_kl, rel=1e-12)
        assert kl(flat, ri.softmax) == pytest.approx(uniform_kl, rel=1e-12)
        # Negative scores are clipped: only the positive part is normalised.
        assert kl(truth - 0.1, ri.clipped_normalised) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("K", [5, 6, 8])
def test_kl_of_clipped_scores_halves_exactly_at_beta_over_c_sqrt_2K(K):
    """V = c 11^T + beta Pi^T read at the parent gives f = c 1 + beta Pi^T x_{N-1}: the fit recovers
    (c, beta), and the KL of f+/sum f+ at p = 0.5 is half the uniform prediction's exactly at
    beta / c = sqrt(2K), above half below it and below half above it."""
    task = CircleWalk(K, 0.5, 11)
    test = task.sample(40, 1)
    Pi = task.transition_matrix()
    half = ri.kl_uniform(SimpleNamespace(task=task, test=test)) / 2
    assert half == pytest.approx(math.log(K / 2) / 2, rel=1e-12)
    c = 0.7
    for ratio, side in ((ri.halving_ratio(K), 0), (0.9 * ri.halving_ratio(K), 1), (1.1 * ri.halving_ratio(K), -1)):
        V = c * torch.ones(K, K, dtype=torch.float64) + ratio * c * Pi.T
        assert ri.ones_and_transition(V.numpy(), Pi.numpy()) == pytest.approx((c, ratio * c), rel=1e-12)
        scores = torch.nn.functional.one_hot(test.tokens[:, -2], K).double() @ V.T
        kl = ri.kl_to_truth(task, test.tokens, scores, ri.clipped_normalised)
        assert (kl == pytest.approx(half, rel=1e-12)) if side == 0 else (np.sign(kl - half) == side)


def test_ones_part_drift_is_measured_from_the_step_attention_locks():
    """On a recorded V whose all-ones part grows until the step the parent attention passes 0.9 and then
    stays, the drift is 0 and beta / c is read at the last step; a run that never locks gives NaN."""
    task = CircleWalk(6, 0.5, 13)
    Pi = task.transition_matrix().numpy()
    steps = range(0, 101, 10)
    c = {s: min(s, 40) / 10 + 0.1 for s in steps}
    V = {s: c[s] * np.ones((6, 6)) + s / 20 * Pi.T for s in steps}
    for lock, drift in ((40, 0.0), (30, 1 / 4.1), (math.inf, math.nan)):
        history = [{"step": s, "parent_attention": 0.95 if s >= lock else 0.1} for s in range(101)]
        results = Results(run=RunResult(walk_run("run", 6, 0.5, 13), history, {"V": V}, task=task))
        assert ri.ones_part_drift(results, "run") == pytest.approx(drift, rel=1e-12, nan_ok=True)
        assert ri.transition_to_ones(results, "run") == pytest.approx(5 / 4.1, rel=1e-12)


def test_attention_ceiling_bounds_every_position_and_grows_with_u():
    """With unit-norm keys and query no position gets more than 1/(1 + (N-1) e^{-2||u||})."""
    task = CircleWalk(5, 0.6, 9)
    tokens = task.sample(64, 4).tokens
    for sigma in (0.05, 0.5, 3.0):
        model = paper_model(task, **{**TINY, "init_sigma": sigma})
        _, cache = model.run_with_cache(tokens)
        ceiling = ri.attention_ceiling(model)
        u = float(model.u.detach().norm())
        assert ceiling == pytest.approx(1 / (1 + 8 * math.exp(-2 * u)), rel=1e-14)
        assert float(cache["blocks.0.attn.hook_pattern"].max()) <= ceiling
    # u along one key makes that key's logit ||u||: its weight approaches the ceiling as u grows.
    model = paper_model(task, **TINY)
    _, cache = model.run_with_cache(tokens[:1])
    keys = cache["blocks.0.hook_resid_pre"][0]
    keys = keys / keys.norm(dim=-1, keepdim=True)
    with torch.no_grad():
        model.blocks[0].attn.u.copy_(40.0 * keys[3])
    _, cache = model.run_with_cache(tokens[:1])
    assert float(cache["blocks.0.attn.hook_pattern"][0, 0, 0, 3]) <= ri.attention_ceiling(model)
    assert float(cache["blocks.0.attn.hook_pattern"][0, 0, 0, 3]) > 0.99
    with pytest.raises(RwinterpError):
        ri.attention_ceiling(paper_model(task, **TINY, normalize_query=False))


def _timeline_run(name: str, broken_from: float, full_from: float, top_weight: float) -> RunResult:
    """A p = 1 run recorded every 10 steps to 1000: variance 0.5 from ``broken_from`` on (1e-6 before),
    test accuracy 1 from ``full_from`` on (1/6 before), the example walk's largest weight ``top_weight``."""
    steps = range(0, 1001, 10)
    history = [{"step": s, "test_accuracy": 1.0 if s >= full_from else 1 / 6} for s in steps]
    example = np.array([top_weight] + [(1 - top_weight) / 5] * 5)
    tokens = {s: {"example": example, "var": np.full(6, 0.5 if s >= broken_from else 1e-6)} for s in steps}
    return RunResult(walk_run(name, 6, 1.0, 97), history, {"averaged_token": tokens})


def test_break_and_full_accuracy_timeline_on_known_runs():
    results = Results(early=_timeline_run("early", 880, 950, 0.9), late=_timeline_run("late", 960, math.inf, 0.6),
                      faint=_timeline_run("faint", 960, math.inf, 0.4),
                      never=_timeline_run("never", math.inf, math.inf, 1 / 6))
    assert [ri.breaking_step(results, r) for r in results] == [880, 960, 960, math.inf]
    assert [ri.full_step(results, r) for r in results] == [950, math.inf, math.inf, math.inf]
    # As the paper shows p = 1 at step 1000: broken after about 700, one token > 0.5, never 100%.
    assert [ri.broken_below_full(results, r) for r in results] == [False, True, False, False]
    assert ri.longest_gap(results, ["early", "late", "never"]) == 70
    assert math.isnan(ri.longest_gap(results, ["late", "never"]))


@pytest.fixture(scope="module")
def reduced_results():
    figures = select(discover(), ["6", "11", "12", "13"])
    runs, names = plan(figures, reduced=True)
    trained_runs = execute(runs, progress=False)
    return {fig.id: (fig, figure_results(fig, names, trained_runs, True)) for fig in figures}, runs


def test_reduced_specs_share_runs_and_every_claim_is_measured(reduced_results):
    figures, runs = reduced_results
    # The four figures share one run per reading and p; Fig 6 adds its sweeps (learning rate, length, AdamW),
    # Fig 13 the other seeds of the summed and tuned readings at p = 1, and its sigma sweep at p = 1.
    sweeps = sum(len(sweep.values) * len(sweep.ps) for sweep in ri.SWEEPS + (ri.SIGMA_SWEEP,))
    assert len(runs) == 2 * len(ri.READINGS) + sweeps + 2 * (len(ri.SEEDS) - 1)
    for fig, results in figures.values():
        for claim in evaluate_claims(fig, results):
            assert claim.error is None, (fig.id, claim.claim, claim.error)
        text = ri.verdict(results, {"6": ri.fig6_claims, "11": ri.fig11_claims,
                                    "12": ri.fig12_claims, "13": ri.fig13_claims}[fig.id])
        assert len(text.splitlines()) == len(ri.READINGS)


def test_reduced_measurements_are_sane(reduced_results):
    figures, _ = reduced_results
    results = figures["6"][1]
    for reading in ri.READINGS:
        for p, uniform_kl in ((0.5, math.log(3)), (1.0, math.log(6))):
            run = results[ri.run_name(reading, p)]
            assert ri.kl_uniform(run) == pytest.approx(uniform_kl, rel=1e-12)
            steps, kl = run.series("kl_softmax")
            assert list(steps) == list(range(0, 21, 5)) and np.all(kl >= 0) and np.all(np.isfinite(kl))
            for step, avg in run.snapshots["averaged_token"].items():
                # Attention on the N-1 real tokens: the averaged token is a sub-probability vector.
                assert 0 < avg["example"].sum() <= 1 + 1e-12 and np.asarray(avg["var"]).shape == (6,)
            # The spread is the formula on the V recorded at that step.
            V = torch.as_tensor(np.asarray(run.at("V", 20)[1]), dtype=torch.float64)
            spread = float((V - V[:, :1]).abs().max() / V.abs().max())
            assert ri.spread_at(results, ri.run_name(reading, p), 20) == pytest.approx(spread, rel=1e-12)
            # Step 1000 was not trained in reduced mode: the last step's accuracy is returned.
            assert ri.accuracy_at(results, ri.run_name(reading, p), 1000) == run.history[-1]["test_accuracy"]
    # As stated (mean loss, lr 0.01) 20 steps cannot move unit-norm attention: it stays uniform,
    # and the deterministic walk's averaged token is the same for every walk (variance ~ sigma^2).
    paper_p1 = results[ri.run_name(ri.READINGS[0], 1.0)]
    assert ri.max_variance(paper_p1.final["averaged_token"]) < 1e-5
    assert math.isinf(ri.breaking_step(results, ri.run_name(ri.READINGS[0], 1.0)))
    attention = paper_p1.final["attention"]
    assert attention.max() / attention.min() < math.exp(0.1)  # scores within +-0.05 (5 sigma)


@pytest.mark.parametrize("t05, t1, speedup", [
    (100.0, 500.0, 5.0),
    (250.0, math.inf, (1000 + ri.EVERY) / 250),  # p = 1 never halves: a lower bound, as if just after step 1000
    (math.inf, 300.0, math.nan),  # p = 0.5 never halves: undefined
])
def test_kl_speedup_and_its_lower_bound(monkeypatch, t05, t1, speedup):
    reading = ri.READINGS[0]
    runs = {ri.run_name(reading, 0.5): t05, ri.run_name(reading, 1.0): t1}
    monkeypatch.setattr(ri, "kl_half_step", lambda results, run, key: runs[run])
    results = Results({run: RunResult(walk_run(run, 6, 1.0, 97), [{"step": 1000}], {}) for run in runs})
    measured = ri.kl_speedup(results, reading, "kl")
    assert (math.isnan(measured) and math.isnan(speedup)) or measured == pytest.approx(speedup, rel=1e-15)
