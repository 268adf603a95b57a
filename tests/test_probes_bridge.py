"""The probes, unchanged, on a standard TransformerLens 4 model (``TransformerBridge.boot_native``)
trained on walks as next-token prediction: each prediction's parent is its own position."""

from __future__ import annotations

import pytest
import torch

from probes.config import ProbeConfig
from probes.patching import corrupted_walks
from probes.scoring import compare_to_random
from rwinterp.errors import RwinterpError
from rwinterp.bridge import build_bridge
from rwinterp.config import BridgeOptions, TrainConfig
from rwinterp.tasks import Batch, CircleWalk
from rwinterp.training import train
from tests.conftest import RTOL

TASK = CircleWalk(6, 0.7, 12)
CFG = ProbeConfig(progress=False, bootstrap=50, gradient_walks=30)


def bridge(**options):
    return build_bridge(BridgeOptions(n_states=TASK.n_states, n_ctx=TASK.seq_len, n_layers=1, **options))


@pytest.fixture(scope="module")
def bridge_comparison():
    model = bridge(d_model=32, seed=1)
    train(model, TASK, TrainConfig(optimizer="adamw", lr=3e-2, steps=40, loss="xent", next_token=True, n_train=300,
                                   eval_every=40), data=(TASK.sample(300, 1), TASK.sample(300, 2)), progress=False)
    baselines = [bridge(d_model=32, seed=s) for s in (11, 12)]
    data = TASK.sample(300, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    cmp = compare_to_random(model, TASK, data, config=CFG, baselines=baselines)
    return model, before, cmp


def test_bridge_probes_find_the_parent_at_the_predictions_own_position(bridge_comparison):
    _, _, cmp = bridge_comparison
    card = cmp.trained
    s = card.flat()
    assert card.kind == "autoregressive"
    assert abs(s["accuracy"] - 0.7) < 0.05 and s["bayes_accuracy"] == pytest.approx(0.7, rel=RTOL)  # (a mean over positions)
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
    model = bridge(d_model=16, seed=0)
    batch = TASK.sample(4, 0)
    from probes.scoring import scorecard

    with pytest.raises(RwinterpError, match="no states"):
        scorecard(model, TASK, Batch(batch.tokens, batch.labels), CFG)
    with pytest.raises(RwinterpError, match="mismatched K"):
        scorecard(model, CircleWalk(5, 0.7, 12), CircleWalk(5, 0.7, 12).sample(4, 0), CFG)
    # Probed as a query-slot model, against what its vocabulary allows: one line, not an IndexError.
    with pytest.raises(RwinterpError, match=r"the model cannot read this task's walks \(K=6, N=12\): index out of"):
        scorecard(model, TASK, batch, ProbeConfig(progress=False, kind="query"))


def test_bridge_patching_and_value_shares_match_hook_patches_run_one_at_a_time(bridge_comparison):
    """The probes' shortcuts (stacked runs, token swaps for the embeddings, value patches applied to z,
    ``||v W_O||`` from a Gram matrix) against plain hook patches run one at a time. On a trained bridge
    the attention depends on the tokens and ``W_O`` is not the identity, so a value patch under the clean
    pattern, ``||v||`` without ``W_O``, or necessity and sufficiency swapped would all show here."""
    model, _, cmp = bridge_comparison
    patching, attention = cmp.trained.patching, cmp.trained.attention
    clean = TASK.sample(300, 2).states
    corrupted = corrupted_walks(TASK, 300, CFG.seed).states
    n_pred = TASK.seq_len - 1  # prediction i is made at position i, its own parent
    good, bad = clean[:, 1:, None], corrupted[:, 1:, None]

    def logit_diff(tokens: torch.Tensor, **hooks) -> torch.Tensor:
        with torch.no_grad():
            logits = model.run_with_hooks(tokens, fwd_hooks=list(hooks.items()))[:, :n_pred].to(torch.float64)
        return (logits.gather(-1, good) - logits.gather(-1, bad))[..., 0]

    ld_clean, ld_corrupted = logit_diff(clean), logit_diff(corrupted)
    assert torch.allclose(patching.clean, ld_clean, rtol=1e-9, atol=1e-9)
    assert torch.allclose(patching.corrupted, ld_corrupted, rtol=1e-9, atol=1e-9)
    own = torch.eye(TASK.seq_len, dtype=torch.bool)
    only_corrupted = torch.stack([logit_diff(torch.where(own[i], corrupted, clean))[:, i] for i in range(n_pred)], 1)
    only_clean = torch.stack([logit_diff(torch.where(own[i], clean, corrupted))[:, i] for i in range(n_pred)], 1)
    assert torch.allclose(patching.only_parents_corrupted, only_corrupted, rtol=1e-9, atol=1e-9)
    assert torch.allclose(patching.only_parents_clean, only_clean, rtol=1e-9, atol=1e-9)
    s = cmp.trained.flat()
    den = float((ld_clean - ld_corrupted).mean())
    necessity = float((ld_clean - only_corrupted).mean()) / den
    sufficiency = float((only_clean - ld_corrupted).mean()) / den
    assert (s["patching.necessity"], s["patching.sufficiency"]) == (pytest.approx(necessity, rel=1e-9),
                                                                    pytest.approx(sufficiency, rel=1e-9))
    assert abs(necessity - sufficiency) > 1e-5  # they differ here (by 3e-4), far beyond the 1e-9 checked above

    # Value vectors: one position at a time, a real hook_v patch into the corrupted run.
    _, clean_cache = model.run_with_cache(clean, names_filter=["blocks.0.attn.hook_v", "blocks.0.attn.hook_pattern"])
    v_clean = clean_cache["blocks.0.attn.hook_v"]

    def put(j: int):
        def hook(v: torch.Tensor, hook) -> torch.Tensor:
            v = v.clone()
            v[:, j] = v_clean[:, j]
            return v
        return hook

    for j in range(TASK.seq_len):
        patched = logit_diff(corrupted, **{"blocks.0.attn.hook_v": put(j)})
        # (the bridge computes in float32: the two routes differ by round-off, 3e-6 on logits of size 20)
        assert torch.allclose(patching.positions["v.0"][j], patched, rtol=0, atol=2e-5), j

    # Attention x value norm: a[i, j] ||v_j W_O|| over the positions prediction i sees, share at j = i.
    layer, h = attention.head
    a = clean_cache["blocks.0.attn.hook_pattern"][:, h, :n_pred, :].to(torch.float64)  # [batch, pred, pos]
    norms = (v_clean[:, :, h].to(torch.float64) @ model.W_O[layer, h].detach().to(torch.float64)).norm(dim=-1)
    weighted = a * norms[:, None, :] * torch.ones(n_pred, TASK.seq_len).tril().bool()
    share = weighted.diagonal(dim1=1, dim2=2) / weighted.sum(-1)
    assert torch.allclose(attention.value_share, share, rtol=1e-9, atol=1e-12)
