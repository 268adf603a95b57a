"""The probes, unchanged, on a standard TransformerLens 4 model (``TransformerBridge.boot_native``)
trained on walks as next-token prediction: each prediction's parent is its own position."""

from __future__ import annotations

import pytest
import torch

from probes.config import ProbeConfig
from probes.scorecard import compare_to_random
from rwinterp.errors import RwinterpError
from rwinterp.standard import build_standard_model, train_standard_model
from rwinterp.tasks import Batch, CircleWalk

TASK = CircleWalk(6, 0.7, 12)
CFG = ProbeConfig(progress=False, bootstrap=50, gradient_walks=30)


@pytest.fixture(scope="module")
def bridge_comparison():
    model = build_standard_model(d_vocab=TASK.n_states, n_ctx=TASK.seq_len, d_model=32, seed=1)
    train_standard_model(model, TASK.sample(300, 1).states, steps=40, lr=3e-2)
    baselines = [build_standard_model(d_vocab=TASK.n_states, n_ctx=TASK.seq_len, d_model=32, seed=s) for s in (11, 12)]
    data = TASK.sample(300, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cmp = compare_to_random(model, TASK, data, config=CFG, baselines=baselines)
    return model, before, cmp


def test_bridge_probes_find_the_parent_at_the_predictions_own_position(bridge_comparison):
    _, _, cmp = bridge_comparison
    card = cmp.trained
    s = card.flat()
    assert card.kind == "autoregressive"
    assert abs(s["accuracy"] - 0.7) < 0.05 and s["bayes_accuracy"] == pytest.approx(0.7)
    assert s["patching.parent_effect"] > 0.95 and s["patching.localization"] > 0.95
    assert s["patching.necessity"] > 0.95 and s["patching.sufficiency"] > 0.95
    # Attention: trained to look at the current state, where an untrained bridge spreads evenly.
    assert s["parent_attention"] > 0.5 and s["parent_argmax_rate"] > 0.5
    for base in cmp.baselines:
        b = base.flat()
        assert b["parent_attention"] < 0.35 and b["attention.uniformity"] > 0.99


def test_bridge_ov_circuit_with_the_direct_path_reproduces_pi(bridge_comparison):
    _, _, cmp = bridge_comparison
    t = cmp.trained.transition
    assert t.direct is not None and t.total is not None  # a residual stream was detected
    s = cmp.trained.flat()
    assert s["transition.argmax_agreement"] == 1.0 and s["transition.kl"] < 0.1
    assert s["transition.behaviour.argmax_agreement"] == 1.0 and s["transition.behaviour.kl"] < 0.05
    assert (f"the model's logits reproduce the transition matrix (direct and attention paths together: "
            f"KL(Pi || softmax) = {s['transition.kl']:.3f}, top score right for 100% of states)") in \
        " ".join(cmp.trained.findings())
    assert "do not reproduce the transition matrix" in " ".join(cmp.baselines[0].findings())
    for base in cmp.baselines:
        b = base.flat()
        assert b["transition.kl"] > 0.5 and b["transition.behaviour.kl"] > 0.5


def test_bridge_is_left_as_it_was(bridge_comparison):
    model, before, _ = bridge_comparison
    assert not model.training
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_bridge_needs_whole_walks():
    model = build_standard_model(d_vocab=TASK.n_states, n_ctx=TASK.seq_len, d_model=16, seed=0)
    batch = TASK.sample(4, 0)
    from probes.scorecard import scorecard

    with pytest.raises(RwinterpError, match="no states"):
        scorecard(model, TASK, Batch(batch.tokens, batch.labels), CFG)
    with pytest.raises(RwinterpError, match="mismatched K"):
        scorecard(model, CircleWalk(5, 0.7, 12), CircleWalk(5, 0.7, 12).sample(4, 0), CFG)
    # Probed as a query-slot model, against what its vocabulary allows: one line, not an IndexError.
    with pytest.raises(RwinterpError, match=r"the model cannot read this task's walks \(K=6, N=12\): index out of"):
        scorecard(model, TASK, batch, ProbeConfig(progress=False, kind="query"))
