"""The probes' pieces: where predictions and parents sit, exact patching identities, V against Pi."""

from __future__ import annotations

import math
from statistics import NormalDist
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformer_lens.hook_points import HookPoint
from transformer_lens.HookedRootModule import HookedRootModule

from probes.attention import attention_probe
from probes.config import ProbeConfig
from probes.patching import patching_probe
from probes.stats import Estimate, bootstrap_interval, bootstrap_weights, point_weights, ratio, wmean
from probes.targets import evaluating, targets_for
from probes.transition import compare_to_transition, transition_probe
from rwinterp.chains import PersistentWalk
from rwinterp.model import DeepConfig, DeepTransformer
from rwinterp.errors import RwinterpError
from rwinterp.qa import QAMajority
from rwinterp.tasks import Batch, CircleWalk, circle_transition
from tests.conftest import RTOL, assert_close, paper_model

CFG = ProbeConfig(progress=False, bootstrap=0, gradient_walks=20)
K, N, M = 5, 9, 16


def causal_model(task, d_model=16, seed=0):
    return DeepTransformer(DeepConfig.standard(task.n_states, task.seq_len, d_model, seed=seed))


# ------------------------------------------------------------------------------------ targets
def test_query_slot_model_reads_the_last_position_and_the_tasks_parents():
    task = CircleWalk(K, 0.7, N)
    batch = task.sample(6, 1)
    t = targets_for(paper_model(task, pos_dim=M), task, batch)
    assert t.kind == "query" and t.read.tolist() == [0] and t.source.tolist() == [N - 1]
    assert t.parent_sets() == [task.parent_positions()] == [(N - 2,)]
    assert torch.equal(t.labels[:, 0], batch.labels) and torch.equal(t.inputs, batch.tokens)
    assert bool(t.visible.all())


def test_autoregressive_model_predicts_every_next_state_from_its_own_position():
    task = CircleWalk(K, 0.7, N)
    batch = task.sample(6, 1)
    t = targets_for(causal_model(task), task, batch)
    assert t.kind == "autoregressive" and torch.equal(t.inputs, batch.states)
    assert t.source.tolist() == t.read.tolist() == list(range(N - 1))
    assert t.parent_sets() == [(i,) for i in range(N - 1)]
    assert torch.equal(t.labels, batch.states[:, 1:])
    assert torch.equal(t.visible, torch.arange(N)[None, :] <= torch.arange(N - 1)[:, None])


def test_parent_sets_of_a_second_order_chain():
    task = PersistentWalk(K, 0.8, N)
    batch = task.sample(4, 2)
    query = targets_for(paper_model(task, pos_dim=M), task, batch)
    assert query.parent_sets() == [(N - 3, N - 2)]
    auto = targets_for(causal_model(task), task, batch)
    assert auto.source.tolist() == list(range(1, N - 1))  # the first prediction has one parent only
    assert auto.parent_sets() == [(t - 1, t) for t in range(1, N - 1)]


def test_autoregressive_probing_needs_a_chain_with_states():
    task = CircleWalk(K, 0.7, N)
    model = causal_model(task)
    batch = task.sample(4, 0)
    with pytest.raises(RwinterpError, match="no states"):
        targets_for(model, task, Batch(batch.tokens, batch.labels))
    qa = QAMajority()
    with pytest.raises(RwinterpError, match="Markov-chain"):
        targets_for(DeepTransformer(DeepConfig.standard(qa.n_states, qa.seq_len, 16)), qa, qa.sample(4, 0))


# --------------------------------------------------------------------------- exact identities
@pytest.fixture(scope="module")
def positional_model():
    """Attention that depends on positions only (no token part in u): f is linear in the tokens."""
    task = CircleWalk(K, 0.5, N)
    model = paper_model(task, pos_dim=M, init="gaussian", init_sigma=0.5, seed=3)
    with torch.no_grad():
        model.u[:K] = 0.0
    return model, task


def test_patching_identities_of_a_model_linear_in_its_tokens(positional_model):
    model, task = positional_model
    result = patching_probe(model, task, task.sample(500, 4), CFG)
    s = result.scores()
    profile = result.profile("resid_pre.0")
    # Linear in the tokens: the per-position effects add up to the whole effect.
    assert float(profile.sum()) == pytest.approx(1.0, abs=1e-10)
    # With position-only attention, patching a token is patching its value vector.
    assert_close(result.profile("v.0"), profile)
    # The output is z W_O: patching z restores everything; the pattern is the same for every walk.
    assert s["z.L0H0"] == pytest.approx(1.0, abs=1e-12) and s["pattern.L0H0"] == pytest.approx(0.0, abs=1e-12)
    # Corrupting only the parent removes exactly what keeping only the parent preserves.
    assert s["necessity"] == pytest.approx(s["parent_effect"], abs=1e-10)
    assert s["sufficiency"] == pytest.approx(s["parent_effect"], abs=1e-10)
    assert result.embeddings_by_substitution
    parent = task.parent_positions()[0]
    assert s["localization"] == pytest.approx(float(profile[parent].abs() / profile.abs().sum()), rel=1e-12)


def test_a_set_of_parents_is_found_together():
    """A second-order chain and a model that attends half and half to its two parents."""
    task = PersistentWalk(K, 0.8, N)
    model = paper_model(task, pos_dim=M, init="gaussian", init_sigma=0.5, seed=1)
    with torch.no_grad():
        model.u.zero_()
        model.u[[K + j for j in task.parent_positions()]] = 40.0 / math.sqrt(M / 2)
    data = task.sample(300, 5)
    s = patching_probe(model, task, data, CFG).scores()
    for key in ("parent_effect", "localization", "necessity", "sufficiency"):
        assert s[key] == pytest.approx(1.0, abs=1e-9), key
    att = attention_probe(model, task, data, CFG)
    assert att.scores()["parent_attention"] == pytest.approx(1.0, abs=1e-9)
    assert att.profile[N - 3] == pytest.approx(0.5, abs=1e-9) and att.profile[N - 2] == pytest.approx(0.5, abs=1e-9)
    assert att.scores()["parent_argmax_rate"] == pytest.approx(1.0, rel=RTOL)  # a tie between the two parents


def test_patching_only_the_embeddings_needs_no_hooks():
    task = CircleWalk(K, 0.7, N)
    model = ParentReader(task)
    s = patching_probe(model, task, task.sample(200, 0), ProbeConfig(progress=False, hooks=("resid_pre",))).scores()
    assert s["parent_effect"] == pytest.approx(1.0, rel=RTOL) and s["localization"] == pytest.approx(1.0, rel=RTOL)
    with pytest.raises(RwinterpError, match="blocks.0.attn.hook_pattern"):
        attention_probe(model, task, task.sample(5, 0), CFG)
    with pytest.raises(RwinterpError, match="blocks.0.attn.hook_v"):
        patching_probe(model, task, task.sample(5, 0), CFG)


class ParentReader(HookedRootModule):
    """A hooked model that reads only the parent token, with no attention hooks."""

    def __init__(self, task):
        super().__init__()
        self.cfg = SimpleNamespace(n_layers=1, n_heads=1, n_ctx=task.seq_len, d_vocab=task.d_vocab)
        self.table = nn.Parameter(torch.randn(task.d_vocab, task.n_states, generator=torch.Generator().manual_seed(0)))
        self.hook_embed = HookPoint()
        self.setup()

    def forward(self, tokens):
        return self.hook_embed(self.table[tokens[:, -2]])[:, None, :]


# ------------------------------------------------------------------------ value vs transition
def test_comparisons_of_a_matrix_with_pi():
    Pi = circle_transition(6, 0.5)
    same = compare_to_transition(Pi, Pi)
    assert same.distance == pytest.approx(0, abs=1e-12) and same.cosine == pytest.approx(1, rel=RTOL)
    assert same.argmax_agreement == 1.0 and same.r2 == pytest.approx(1, rel=RTOL)
    fit = compare_to_transition(3 * Pi + 2, Pi)
    assert (fit.affine_a, fit.affine_b, fit.r2) == pytest.approx((3, 2, 1), rel=RTOL)
    assert fit.distance > 0.1  # the offset changes the direction
    # p = 0.5: both neighbours are maximisers in Pi, so either arg-max agrees.
    tilted = Pi + 1e-3 * torch.arange(6, dtype=torch.float64)[None, :]
    assert compare_to_transition(tilted, Pi).argmax_agreement == 1.0
    wrong = torch.eye(6, dtype=torch.float64)  # "stay": never a possible next state
    assert compare_to_transition(wrong, Pi).argmax_agreement == 0.0
    # p = 0.7: Pi is not symmetric, so comparing against Pi^T instead of Pi would show here.
    skew = circle_transition(6, 0.7)
    assert compare_to_transition(skew, skew).cosine == pytest.approx(1, abs=1e-12)
    assert compare_to_transition(skew.T, skew).cosine == pytest.approx(2 * 0.7 * 0.3 / (0.7**2 + 0.3**2), rel=RTOL)
    logits = torch.log(circle_transition(6, 0.7).clamp(min=1e-30))
    assert compare_to_transition(logits, circle_transition(6, 0.7)).kl == pytest.approx(0, abs=1e-9)
    ones = compare_to_transition(torch.ones(6, 6, dtype=torch.float64), Pi)
    assert ones.ones_cosine == pytest.approx(1, rel=RTOL) and math.isnan(ones.r2)
    assert math.isnan(compare_to_transition(torch.zeros(6, 6, dtype=torch.float64), Pi).distance)
    # Ties are judged in the matrix's own dtype: a float32 score one float32 ulp above its rival ties
    # with it (the smallest index wins), though it would not in float64.
    Pi7 = circle_transition(6, 0.7)  # state k goes to k+1 (likely) or k-1
    near_tie = torch.zeros(6, 6, dtype=torch.float32)
    rows = torch.arange(6)
    near_tie[rows, (rows - 1) % 6] = 1.0
    near_tie[rows, (rows + 1) % 6] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0))
    # Tied in float32, the smaller index wins: k-1, except for states 0 and 5 (k+1 is 1 and 0): 2 of 6 agree.
    assert compare_to_transition(near_tie, Pi7).argmax_agreement == pytest.approx(2 / 6, rel=RTOL)
    assert compare_to_transition(near_tie.double(), Pi7).argmax_agreement == 1.0
    # Weights so large (or small) that their norm overflows (or their squares underflow) compare as any
    # multiple of them does.
    for size in (1e300, 1e-300):
        huge = compare_to_transition((3 * Pi + 2) * size, Pi)
        assert (huge.cosine, huge.ones_cosine, huge.distance, huge.r2) == pytest.approx(
            (fit.cosine, fit.ones_cosine, fit.distance, 1), rel=RTOL)
        assert (huge.affine_a, huge.affine_b) == pytest.approx((3 * size, 2 * size), rel=RTOL, abs=0)


def test_the_affine_fit_is_least_squares_and_the_same_to_the_last_bit_for_any_memory_layout():
    """V ~ a Pi^T + b 1: the same (a, b) as LAPACK's least squares (minimum norm when Pi is constant),
    and bit-identical for copies of V at every memory offset, where LAPACK's can differ in the last bit."""
    import numpy as np

    from probes.transition import _affine_fit

    Pi = circle_transition(6, 0.7)
    V = torch.randn(6, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    for x in (Pi.flatten(), torch.full((36,), 0.25, dtype=torch.float64)):
        X = np.stack([x.numpy(), np.ones(36)], 1)
        expected = np.linalg.lstsq(X, V.flatten().numpy(), rcond=None)[0]
        assert _affine_fit(x.tolist(), V.flatten().tolist()) == pytest.approx(tuple(expected), rel=1e-12)
    fits = set()
    for offset in range(8):
        buffer = torch.empty(36 + offset, dtype=torch.float64)
        copy = buffer[offset:].view(6, 6)
        copy.copy_(V)
        fit = compare_to_transition(copy, Pi)
        fits.add((fit.affine_a, fit.affine_b))
    assert len(fits) == 1


def test_the_ov_circuit_of_the_paper_model_is_its_value_matrix():
    task = CircleWalk(K, 0.7, N)
    model = paper_model(task, pos_dim=M, init="gaussian", seed=2)
    result = transition_probe(model, task, task.sample(50, 0), CFG)
    assert torch.equal(result.V, model.V.detach())  # V read through one-hot embeddings and readout: exact
    assert result.direct is None and result.total is None  # no residual stream
    assert result.scores()["distance"] == result.ov.distance  # the headline is that score


# ------------------------------------------------------------------------------- statistics
def test_ratio_of_batch_means_and_bootstrap_weights():
    assert math.isnan(float(ratio(torch.tensor(1.0), torch.tensor(1e-12), 1.0)))
    assert float(ratio(torch.tensor(1.0), torch.tensor(4.0), 1.0)) == 0.25
    w = bootstrap_weights(None, 20, 50, seed=3)
    assert w.shape == (50, 20) and torch.equal(w.sum(1), torch.full((50,), 20.0, dtype=torch.float64))
    assert torch.equal(w, w.round()) and torch.equal(w, bootstrap_weights(None, 20, 50, seed=3))
    probs = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    assert torch.equal(point_weights(probs, 3)[0], probs)
    # With walk probabilities, a resample's weights are its draw counts times the probabilities (the same
    # seed draws the same counts).
    counts = bootstrap_weights(None, 3, 40, seed=5)
    assert torch.equal(bootstrap_weights(probs, 3, 40, seed=5), counts * probs[None])
    # Weighted means normalise each row; with whole-number weights a rate of n hits in n walks is exactly 1
    # (a sum of 1000 copies of 1/1000 is 1 + 1e-16).
    hits = torch.ones(1000, dtype=torch.float64)
    assert float(wmean(point_weights(None, 1000), hits)[0]) == 1.0
    assert torch.equal(wmean(bootstrap_weights(None, 1000, 30, seed=1), hits), torch.ones(30, dtype=torch.float64))
    assert float(wmean(probs[None], torch.tensor([1.0, 0.0, 2.0]))[0]) == 1.0
    assert float(wmean(3 * probs[None], torch.tensor([1.0, 0.0, 2.0]))[0]) == 1.0


def test_bias_corrected_bootstrap_interval():
    draws = torch.linspace(0, 1, 1001, dtype=torch.float64)
    # A point at the draws' median: z0 = 0, the plain 95% percentile interval (2.5% and 97.5% quantiles;
    # the draws are evenly spaced from 0 to 1, so each quantile is its level).
    assert bootstrap_interval(draws, 0.5) == pytest.approx((0.025, 0.975), rel=RTOL)
    # A point with 90% of the draws below it (draws biased low): z0 = Phi^-1(0.9), and the interval moves
    # up to the quantiles Phi(2 z0 -+ 1.96), around the point.
    z0, z = NormalDist().inv_cdf(900.5 / 1001), NormalDist().inv_cdf(0.975)
    lo, hi = bootstrap_interval(draws, 0.9)
    assert (lo, hi) == pytest.approx((NormalDist().cdf(2 * z0 - z), NormalDist().cdf(2 * z0 + z)), rel=RTOL)
    assert 0.5 < lo < 0.9 < hi
    # Constant draws collapse to the point; NaN draws are left out; nothing defined gives NaN.
    assert bootstrap_interval(torch.full((50,), 0.3, dtype=torch.float64), 0.3) == (0.3, 0.3)
    assert bootstrap_interval(torch.cat([draws, torch.full((99,), math.nan)]), 0.5) == bootstrap_interval(draws, 0.5)
    assert all(math.isnan(x) for x in bootstrap_interval(torch.full((5,), math.nan), 0.5))
    assert all(math.isnan(x) for x in bootstrap_interval(draws, math.nan))


def test_a_score_over_models():
    spread = Estimate.of([1.0, 2.0, 3.0, float("nan")])
    # NaN left out; of three values a resample is all 1s (or all 3s) with chance 1/27 > 2.5%, so the 95%
    # percentile interval of the mean is exactly [1, 3].
    assert (spread.mean, spread.std, spread.interval) == (2.0, 1.0, (1.0, 3.0))
    assert math.isnan(Estimate.of([1.0, float("nan")]).std)


def test_evaluating_restores_every_submodule_mode():
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5))
    model.train()
    model[1].eval()
    with evaluating(model):
        assert not any(m.training for m in model.modules())
    assert model.training and model[0].training and not model[1].training


def test_a_query_slot_models_direct_path_is_the_query_tokens_own():
    """With a residual stream, the query slot's logits get the query token's W_E W_U directly, never the
    parent's: the direct part is that one row for every parent state, and the total adds it to the OV
    circuit (and biases)."""
    task = CircleWalk(K, 0.7, N)
    cfg = DeepConfig(n_states=K, n_ctx=N, pos_mode="added", d_model=8, pos_embedding="learned",
                     token_embedding="learned", key_query="factored", values="all", readout="learned",
                     residual=True, attention="query", init="standard", dtype="float64")
    model = DeepTransformer(cfg)
    result = transition_probe(model, task, task.sample(50, 0), CFG)
    query_row = model.W_E.detach()[K] @ model.W_U.detach()[:, :K]
    assert_close(result.direct.matrix, query_row.expand(K, K))
    own = model.W_E.detach()[:K] @ model.W_U.detach()[:, :K]
    assert (own - query_row).abs().max() > 0.1  # the parent's own direct path, which the slot never reads
    rest = result.total.matrix - result.ov.matrix - query_row
    terms = torch.stack([result.total.matrix, result.ov.matrix, query_row.expand(K, K)])
    assert_close(rest, rest[:1].expand(K, K), scale=terms)  # what is left is the same bias row


def test_attribution_shares_leave_out_the_walks_where_they_are_undefined():
    """A walk whose attribution is 0 at every position (here a ReLU dead on it) has no share; the mean
    is over the others rather than NaN. A population is attributed whole, not its first walks."""
    task = CircleWalk(6, 0.5, 12)
    model = paper_model(task, pos_dim=30, init="gaussian", normalize_tokens=True, mlp_width=7)
    result = attention_probe(model, task, task.sample(200, 5), ProbeConfig(progress=False, bootstrap=0))
    share = result.gradient_share[:, 0]
    assert 0 < int(share.isnan().sum()) < len(share)
    assert result.scores()["gradient_parent_share"] == pytest.approx(float(share[~share.isnan()].mean()), rel=1e-12)
    population = CircleWalk(5, 0.7, 6).population()
    model = paper_model(CircleWalk(5, 0.7, 6), pos_dim=16, init="gaussian", seed=3)
    result = attention_probe(model, CircleWalk(5, 0.7, 6), population,
                             ProbeConfig(bootstrap=0, progress=False, gradient_walks=10))
    assert result.gradient_share.shape[0] == len(population) > 10


@pytest.mark.slow  # every probe figure drawn
def test_drawing_the_probe_figures_leaves_matplotlib_as_it_was(tmp_path):
    """A library draws without touching the caller's backend or theme, on import or when drawing (in a
    fresh process, where the import is the first)."""
    import subprocess
    import sys

    script = f"""
import matplotlib
matplotlib.use("svg")
before = dict(matplotlib.rcParams)
from probes.plots import plot_bars
plot_bars([("score", 0.5, (0.4, 0.6), 0.2, (0.1, 0.3))], ("trained", "random"), {str(tmp_path / "b.png")!r}, "t")
assert matplotlib.get_backend() == "svg", matplotlib.get_backend()
assert dict(matplotlib.rcParams) == before, "rcParams changed"
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-500:]
    assert (tmp_path / "b.png").read_bytes().startswith(b"\x89PNG")


def test_attributions_under_uniform_attention_have_closed_forms():
    """With u = 0 attention is 1/N everywhere and f_y = V[y] . (sum_j x_j) / N: gradient x input at token
    j is V[y, x_j] / N, and attention x value norm is ||V[:, x_j]|| / N (the query slot writes 0)."""
    task = CircleWalk(K, 0.7, N)
    model = paper_model(task, pos_dim=M, init="gaussian", init_sigma=0.5, seed=4)
    with torch.no_grad():
        model.u.zero_()
    data = task.sample(40, 2)
    scores = attention_probe(model, task, data, ProbeConfig(progress=False, bootstrap=0, gradient_walks=40)).scores()
    V, x, y = model.V.detach(), data.tokens[:, : N - 1], data.labels
    parent = task.parent_positions()[0]
    grad = V[y[:, None], x].abs()
    assert scores["gradient_parent_share"] == pytest.approx(float((grad[:, parent] / grad.sum(1)).mean()), rel=1e-12)
    norms = V.norm(dim=0)[x]
    assert scores["value_weighted_parent_share"] == pytest.approx(float((norms[:, parent] / norms.sum(1)).mean()),
                                                                  rel=1e-12)


def test_attention_ties_and_weights():
    """The arg-max rate splits a tie within round-off between the tied positions; parent attention is a
    weighted mean when the walks carry probabilities (a population)."""
    from probes.attention import _argmax_hits
    from rwinterp.metrics import parent_attention

    a = torch.tensor([[[0.1, 0.45, 0.45 * (1 + 2e-16), 0.0]]], dtype=torch.float64)
    layout = SimpleNamespace(visible=torch.tensor([[True, True, True, False]]),
                             parents=torch.tensor([[False, False, True, False]]))
    assert _argmax_hits(a, layout).item() == 0.5
    assert _argmax_hits(a * torch.tensor([1, 1, 1.01, 1]), layout).item() == 1.0
    pattern = torch.tensor([[0.2, 0.8], [0.6, 0.4]], dtype=torch.float64)
    assert parent_attention(pattern, [1], torch.tensor([0.25, 0.75])) == pytest.approx(0.5, rel=1e-15)
    assert parent_attention(pattern, [1]) == pytest.approx(0.6, rel=1e-15)


def test_findings_warn_when_a_patching_ratio_leaves_the_unit_interval():
    from probes.scoring import findings

    base = {"patching.localization": 0.5, "patching.necessity": 0.4, "patching.sufficiency": 0.5}
    warning = "outside [0, 1]"
    assert not any(warning in line for line in findings({**base, "patching.parent_effect": 0.95}))
    assert any(warning in line for line in findings({**base, "patching.parent_effect": 3.74}))


def test_the_package_exports_resolve_to_what_they_name():
    """Each exported name is the function or class it names, whichever way it is imported; no export
    shares its name with a module (``from probes import scorecard`` would then give either)."""
    import importlib
    import inspect
    import pkgutil

    import probes

    modules = {m.name for m in pkgutil.iter_modules(probes.__path__)}
    for name in probes.__all__:
        assert name not in modules, name
        value = getattr(probes, name)
        assert not inspect.ismodule(value) and value.__name__ == name, name
        assert getattr(importlib.import_module(value.__module__), name) is value


def test_a_float32_models_attention_ties_are_judged_in_float32():
    """The deterministic walk from zero init attends evenly to the N-1 tokens (Theorem 4.1); in float32,
    with the sine embeddings' round-off, the weights differ by about one float32 ulp. They are ties
    in the model's precision, so the arg-max rate is 1/(N-1), not whichever position round-off favours."""
    from rwinterp.training import TrainConfig, train

    task = CircleWalk(6, 1.0, 25)
    model = paper_model(task, pos_dim=100, pos_embedding="sine", dtype="float32")
    train(model, task, TrainConfig(steps=3, population=True), progress=False)
    pop = task.population()
    a = model.attention(pop.tokens).detach()[:, 0, 0, :-1]
    assert 0 < float(a.amax() - a.amin()) < 1e-6  # not exactly even
    scores = attention_probe(model, task, pop, ProbeConfig(progress=False, gradient_walks=0, bootstrap=0)).scores()
    assert scores["parent_argmax_rate"] == pytest.approx(1 / 24, rel=1e-12)


def test_the_transition_headline_of_a_model_with_an_mlp_is_its_behaviour():
    """With the FC+ReLU layer between V and the output, V alone is not what the model predicts from:
    the headline is the behaviour matrix, the mean scores given the parent's state (computed here
    directly from the model's outputs), compared with Pi."""
    task = CircleWalk(5, 0.7, 9)
    model = paper_model(task, pos_dim=24, init="gaussian", init_sigma=0.3, seed=2, mlp_width=7)
    data = task.sample(400, 1)
    result = transition_probe(model, task, data, ProbeConfig(progress=False))
    assert result.main_name == "behaviour" and result.skips_mlp
    with torch.no_grad():
        scores = model.scores(data.tokens).to(torch.float64)
    parent = data.tokens[:, -2]
    expected = torch.stack([scores[parent == k].mean(0) for k in range(5)])
    assert_close(result.behaviour.matrix, expected, scale=scores)  # means of the scores
    s = result.scores()
    direct = compare_to_transition(expected, circle_transition(5, 0.7))
    assert s["distance"] == s["behaviour.distance"]  # the headline is that score
    assert s["distance"] == pytest.approx(direct.distance, rel=1e-10)
    assert "ov.distance" in s and s["ov.distance"] != s["distance"]
