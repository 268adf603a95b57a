"""The probes on the paper's model: what Theorems 3.1 and 4.1 predict, against random models."""

from __future__ import annotations

import math

import pytest
import torch

from probes.config import ProbeConfig
from probes.scoring import compare_to_random, random_like, scorecard
from rwinterp.errors import RwinterpError
from rwinterp.tasks import CircleWalk
from rwinterp.training import TrainConfig, make_data, train
from tests.conftest import RTOL, paper_model

WALKS = 300
#: The value-vector sweep is left out here (it equals the embeddings sweep for the paper's model:
#: see test_probes_units); everything else is the full scorecard.
FAST = ProbeConfig(progress=False, bootstrap=100, gradient_walks=40, hooks=("resid_pre", "z", "pattern"))


@pytest.fixture(scope="module")
def comparisons(trained_paper_models):
    """Each trained Fig-4 model against two random-initialised models, on 300 of its test walks."""
    out = {}
    for p, (model, task, _) in trained_paper_models.items():
        data = make_data(task, TrainConfig())[1][:WALKS]
        out[p] = compare_to_random(model, task, data, seeds=2, config=FAST)
    return out


#: The thresholds a trained model must meet: (score, direction, bound).
TRAINED = [
    ("parent_attention", ">", 0.99),
    ("patching.parent_effect", ">", 0.95),
    ("patching.localization", ">", 0.95),
    ("patching.necessity", ">", 0.95),
    ("patching.sufficiency", ">", 0.95),
    ("transition.distance", "<", 0.35),
    ("transition.argmax_agreement", "==", 1.0),
]


@pytest.mark.parametrize("p", [0.5, 0.7])
def test_trained_paper_model_implements_the_walk(comparisons, p):
    card = comparisons[p].trained
    s = card.flat()
    for key, op, bound in TRAINED:
        value = s[key]
        assert {">": value > bound, "<": value < bound, "==": value == bound}[op], (key, value)
    # Attention is exactly on the parent and its value map is the paper's V.
    assert s["parent_argmax_rate"] == pytest.approx(1.0, rel=RTOL)
    assert s["attention.gradient_parent_share"] > 0.99 and s["attention.value_weighted_parent_share"] > 0.99
    assert card.kind == "query" and card.transition.total is None  # no residual stream
    # Patching z restores everything (the output is a function of z); the pattern carries nothing
    # walk-specific (attention is positional).
    assert s["patching.z.L0H0"] == pytest.approx(1.0, abs=1e-9)
    assert abs(s["patching.pattern.L0H0"]) < 1e-6
    # Accuracy within 4 standard errors of the Bayes accuracy max(p, 1 - p).
    assert s["bayes_accuracy"] == max(p, 1 - p)
    assert abs(s["accuracy"] - s["bayes_accuracy"]) < 4 * math.sqrt(p * (1 - p) / WALKS)
    # Bootstrap intervals bracket the point estimates.
    for key in ("accuracy", "parent_attention", "patching.parent_effect"):
        lo, hi = card.intervals[key]
        assert lo - 1e-9 <= s[key] <= hi + 1e-9


@pytest.mark.parametrize("p", [0.5, 0.7])
def test_random_models_score_far_worse_on_every_score(comparisons, p):
    cmp = comparisons[p]
    trained = cmp.trained.flat()
    assert len(cmp.baselines) == 2 and cmp.seeds == [1000, 1001]
    for card in cmp.baselines:
        s = card.flat()
        for key in ("parent_attention", "patching.parent_effect", "patching.localization",
                    "patching.necessity", "patching.sufficiency"):
            assert abs(s[key]) < 0.1, (key, s[key])
        assert s["transition.distance"] > 0.8 and s["transition.argmax_agreement"] <= 0.5
        assert s["accuracy"] < trained["accuracy"] - 0.15
    means = cmp.baseline_means()
    assert means["parent_attention"] == pytest.approx(sum(c.flat()["parent_attention"] for c in cmp.baselines) / 2,
                                                      rel=RTOL)
    spread = cmp.spreads["transition.distance"]
    values = [c.flat()["transition.distance"] for c in cmp.baselines]
    assert spread.mean == pytest.approx(sum(values) / 2, rel=RTOL) and spread.std > 0


def test_random_baseline_is_the_same_architecture_with_gaussian_init(trained_paper_models):
    model = trained_paper_models[0.5][0]
    fresh = random_like(model, 7)
    expected = {**model.cfg.to_dict(), "init": "gaussian", "seed": 7}
    assert fresh.cfg.to_dict() == expected and not fresh.training
    assert fresh.cfg.init_sigma == model.cfg.init_sigma == 0.01
    assert not torch.equal(fresh.V, model.V)


def test_theorem_4_1_uniform_attention_and_all_ones_value_matrix():
    """p = 1, N = 16 K + 1, zero init, population gradient descent: attention is uniform over the
    N - 1 real tokens and V is proportional to all-ones, at every step; the scorecard says so."""
    task = CircleWalk(6, 1.0, 97)
    model = paper_model(task)
    train(model, task, TrainConfig(steps=3, population=True), progress=False)
    card = scorecard(model, task, task.population(), ProbeConfig(progress=False, bootstrap=0, gradient_walks=6))
    s = card.flat()
    real = card.attention.profile[:-1]  # positions 1 .. N-1; the last entry is the query slot
    assert float(real.max() - real.min()) <= 1e-12
    assert float(real.mean()) == pytest.approx(1 / 96, rel=1e-9)
    assert s["attention.uniformity"] == pytest.approx(96 / 97, rel=1e-9)
    assert s["parent_argmax_rate"] == pytest.approx(1 / 96, rel=RTOL)
    assert s["transition.ones_cosine"] == pytest.approx(1.0, abs=1e-12)
    assert math.isnan(s["transition.r2"])  # V is constant: nothing to fit
    assert s["accuracy"] == pytest.approx(1 / 6, rel=RTOL)
    # The output is the same for every walk: patching has nothing to recover (undefined, not large).
    assert math.isnan(s["patching.parent_effect"]) and math.isnan(s["patching.localization"])
    text = " ".join(card.findings())
    assert "spread evenly" in text and "all-ones" in text and "cannot localise" in text


def test_patching_says_when_only_the_parents_can_differ(tmp_path):
    """On QA task 1 the clean and corrupted sentences differ only at the fruit slots (the parents),
    so patching elsewhere cannot matter and localization is 1 even for an untrained model: the
    scorecard measures that and says so; on a walk most other positions differ too. The report
    calls the QA samples sentences."""
    from probes.report import REPORT_FILE, write_probe_report
    from rwinterp.qa import QAMajority

    task = QAMajority()
    model = paper_model(task, pos_dim=40, init="gaussian")
    card = scorecard(model, task, task.sample(40, 1), ProbeConfig(progress=False, bootstrap=0, gradient_walks=4))
    s = card.flat()
    assert s["patching.contrast_outside_parents"] == 0.0
    assert s["patching.localization"] == pytest.approx(1.0, abs=1e-12)
    assert "differ only at the parents" in " ".join(card.findings())
    report = (write_probe_report(tmp_path / "qa", card, "qa") / REPORT_FILE).read_text()
    assert "- sentences probed: 40; intervals:" in report and "walk" not in report.split("## Figures")[0]
    walk = CircleWalk(5, 0.5, 11)
    card = scorecard(paper_model(walk, pos_dim=16, init="gaussian"), walk, walk.sample(40, 1),
                     ProbeConfig(progress=False, bootstrap=0, gradient_walks=4))
    assert card.flat()["patching.contrast_outside_parents"] > 0.5
    assert "differ only at the parents" not in " ".join(card.findings())


def test_probes_change_neither_weights_nor_modes(trained_paper_models):
    model, task, _ = trained_paper_models[0.7]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.train()
    model.blocks[0].attn.eval()  # a mixed state must come back as it was
    rng = torch.get_rng_state()
    try:
        scorecard(model, task, task.sample(30, 3), ProbeConfig(progress=False, bootstrap=40, gradient_walks=10))
        assert model.training and model.blocks[0].training and not model.blocks[0].attn.training
    finally:
        model.eval()
    # No hook left attached, and the global random state untouched (the probes draw from their own seeds).
    assert all(not hp.fwd_hooks and not hp.bwd_hooks for hp in model.hook_dict.values())
    assert torch.equal(torch.get_rng_state(), rng)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    for p, g in zip(model.parameters(), grads):  # no gradient reaches the weights either
        assert (p.grad is None and g is None) or torch.equal(p.grad, g)


@pytest.mark.parametrize(
    "task, message",
    [
        (CircleWalk(5, 0.5, 97), "mismatched K"),
        (CircleWalk(6, 0.5, 51), "N=51"),
    ],
)
def test_model_from_another_task_is_refused(trained_paper_models, task, message):
    model = trained_paper_models[0.5][0]
    with pytest.raises(RwinterpError, match=message):
        scorecard(model, task, task.sample(10, 0), FAST)


def test_objects_that_are_not_hooked_models_are_refused():
    task = CircleWalk(6, 0.5, 9)
    with pytest.raises(RwinterpError, match="TransformerLens config"):
        scorecard(torch.nn.Linear(3, 3), task, task.sample(5, 0), FAST)
