"""Per-head probes on models wired by hand, where the answer is known: a previous-token head in layer 0
and an induction head in layer 1, on our own causal model and on a TransformerBridge alike."""

from __future__ import annotations

import json
import math

import einops
import pytest
import torch

from probes.ablation import head_ablation
from probes.config import ProbeConfig
from probes.heads import (SCORES, composition_scores, head_probe, head_table, heads_against_random,
                          heads_over_training, next_token_loss, pattern_scores, score_masks)
from probes.report import summary_json, write_probe_report
from probes.scoring import compare_to_random
from probes.targets import Layout, targets_for
from rwinterp.model import DeepConfig, DeepTransformer
from rwinterp.icl import InContextChain, reference_losses
from rwinterp.bridge import build_bridge
from rwinterp.config import BridgeOptions

K, N = 3, 12
D = N + 2 * K + 1  # positions | current token | previous token | a constant
TOK, PREV, CONST = N, N + K, N + 2 * K
CFG = ProbeConfig(progress=False, bootstrap=100, gradient_walks=10)
TASK = InContextChain(K, N)


def bridge(**options):
    """A TransformerBridge (attention only, no normalisation)."""
    return build_bridge(BridgeOptions(**options))


def wiring(d_vocab: int, c: float) -> dict[str, torch.Tensor]:
    """TransformerLens-convention weights of a two-layer, one-head, attention-only induction circuit.

    Layer 0 attends from t to t - 1 (positional query shifted by one) and copies the token there into the
    previous-token block. Layer 1 queries with the current token and keys with the copied previous token,
    so it attends to the positions j whose previous token equals the current one; a constant query
    coordinate against position 0's key keeps it off position 0 (which has no previous token: layer 0
    copied x_0 itself there). ``c`` sets the sharpness: score differences of ``c / sqrt(d_head)``."""
    W_E = torch.zeros(d_vocab, D, dtype=torch.float64)
    W_E[torch.arange(K), TOK + torch.arange(K)] = 1
    W_pos = torch.eye(N, D, dtype=torch.float64)
    W_pos[:, CONST] = 1
    W_Q, W_K, W_V, W_O = (torch.zeros(2, 1, D, D, dtype=torch.float64) for _ in range(4))
    t = torch.arange(1, N)
    W_Q[0, 0, t, t - 1] = c
    W_K[0, 0, torch.arange(N), torch.arange(N)] = 1
    s = torch.arange(K)
    W_V[0, 0, TOK + s, TOK + s] = 1
    W_O[0, 0, TOK + s, PREV + s] = 1
    W_Q[1, 0, TOK + s, TOK + s] = c
    W_Q[1, 0, CONST, CONST] = c
    W_K[1, 0, PREV + s, TOK + s] = 1
    W_K[1, 0, 0, CONST] = -2
    W_V[1, 0, TOK + s, TOK + s] = 1
    W_O[1, 0, TOK + s, TOK + s] = 1
    return dict(W_E=W_E, W_pos=W_pos, W_Q=W_Q, W_K=W_K, W_V=W_V, W_O=W_O)


def wired_deep(attention: str = "causal", n_layers: int = 2) -> DeepTransformer:
    model = DeepTransformer(DeepConfig.standard(K, N, D, n_layers=n_layers, n_heads=1, attention=attention, seed=0))
    w = wiring(K + 1, 1000.0 * math.sqrt(D))
    with torch.no_grad():
        model.embed.copy_(w["W_E"])
        model.pos_embed.copy_(w["W_pos"])
        for l, block in enumerate(model.blocks):
            for name in ("W_Q", "W_K", "W_V", "W_O"):
                getattr(block.attn, name).copy_(w[name][l])
    assert torch.equal(model.W_Q, w["W_Q"][:n_layers]) and torch.equal(model.W_O, w["W_O"][:n_layers])
    return model


def wired_bridge():
    model = bridge(n_states=K, n_ctx=N, d_model=D, n_layers=2, n_heads=1, attn_only=True, seed=0)
    w = {k: v.to(torch.float32) for k, v in wiring(K, 1000.0 * math.sqrt(D)).items()}
    state = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    state["embed.weight"] = w["W_E"]
    state["pos_embed.weight"] = w["W_pos"]
    for l in range(2):  # nn.Linear layout: out = x @ weight.T
        for name, key in (("W_Q", "q"), ("W_K", "k"), ("W_V", "v")):
            state[f"blocks.{l}.attn.{key}.weight"] = einops.rearrange(w[name][l], "h m d -> (h d) m")
        state[f"blocks.{l}.attn.o.weight"] = einops.rearrange(w["W_O"][l], "h d m -> m (h d)")
    state["unembed.weight"] = model.state_dict()["unembed.weight"]
    model.load_state_dict(state)
    for name in ("W_Q", "W_K", "W_V", "W_O"):
        assert torch.equal(getattr(model, name).detach(), w[name]), name
    return model


@pytest.fixture(scope="module")
def data():
    return TASK.sample(200, 3)


# ------------------------------------------------------------------------------ the pure part
def test_score_masks_by_hand():
    x = torch.tensor([[0, 1, 0, 1, 1]])
    P = 4
    layout = Layout("autoregressive", torch.arange(P), torch.eye(P, 5, dtype=torch.bool),
                    torch.arange(5)[None, :] <= torch.arange(P)[:, None])
    m = score_masks(x, layout)
    # t = 2 (state 0): j = 1 follows a 0; t = 3 (state 1): j = 2 follows a 1; t = 0, 1: none
    assert [row.nonzero().flatten().tolist() for row in m["induction"][0]] == [[], [], [1], [2]]
    assert [row.nonzero().flatten().tolist() for row in m["previous_token"][0]] == [[], [0], [1], [2]]
    assert torch.equal(m["self"][0], m["parent"][0])
    query = Layout("query", torch.tensor([4]), torch.tensor([[0, 0, 0, 1, 0]], dtype=torch.bool),
                   torch.ones(1, 5, dtype=torch.bool))
    q = score_masks(torch.tensor([[0, 1, 0, 1, 3]]), query)
    # the query slot continues the last state (1, position 3): keys 2 (after a 1) and not 4 (the slot)
    assert q["induction"][0, 0].nonzero().flatten().tolist() == [2]
    assert q["previous_token"][0, 0].nonzero().flatten().tolist() == [3]


def test_uniform_attention_scores_the_chance_level(data):
    model = DeepTransformer(DeepConfig.standard(K, N, 16, seed=0))
    targets = targets_for(model, TASK, data)
    masks = score_masks(targets.inputs, targets.layout())
    uniform = targets.visible.to(torch.float64) / targets.visible.sum(-1, keepdim=True)
    rows = uniform[None].expand(len(data), -1, -1)
    mass, count, chance = pattern_scores(rows, masks, targets.visible)
    for name in SCORES:
        assert float(mass[name].sum() / count[name].sum()) == pytest.approx(
            float(chance[name].sum() / count[name].sum()), rel=1e-12)
    # induction at K = 3: about a third of the keys, a little more (the current position matches itself
    # whenever it repeats the state before it)
    assert 0.3 < float(chance["induction"].sum() / count["induction"].sum()) < 0.45


# ------------------------------------------------------------------------------ wired models
@pytest.mark.parametrize("make", [wired_deep, wired_bridge], ids=["deep", "bridge"])
def test_wired_heads_score_one(make, data):
    model = make()
    before, mode = {k: v.clone() for k, v in model.state_dict().items()}, model.training
    result = head_probe(model, TASK, data, CFG)
    s = result.scores()
    tol = 1e-12 if make is wired_deep else 1e-6  # the bridge computes in float32
    assert s["L0H0.previous_token"] == pytest.approx(1.0, abs=tol)
    assert s["L1H0.induction"] == pytest.approx(1.0, abs=tol)
    # layer 0 attends to itself only at t = 0, the one position without a previous token
    assert s["L0H0.self"] == pytest.approx(1 / (N - 1), abs=tol)
    assert s["L1H0.previous_token"] < 0.6 and s["L0H0.induction"] < 0.7
    assert result.same_as == {"parent": "self"}  # first order, autoregressive: the parent is the own position
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and model.training == mode
    table = head_table(result, (), CFG)
    assert table.roles(0, 0) == ["previous_token"] and table.roles(1, 0) == ["induction"]
    text = table.describe({"L1H0": (0.31, 0.25, 0.37)})
    assert text.startswith("L0H0 previous-token 1.00 [1.00, 1.00] (chance ")
    assert "L1H0 induction 1.00 [1.00, 1.00] (chance 0.3" in text
    assert text.endswith("; ablating L1H0 costs 0.31 nats [0.25, 0.37]")


def test_the_probe_reads_the_hooks_of_a_bridge_as_computed_by_hand(data):
    """On a random bridge (diffuse, token-dependent attention): every score against loops over the cached
    patterns, prediction by prediction."""
    model = bridge(n_states=K, n_ctx=N, d_model=16, n_layers=2, n_heads=2, seed=4)
    s = head_probe(model, TASK, data, CFG).scores()
    _, cache = model.run_with_cache(data.states)
    x = data.states.tolist()
    for l in range(2):
        a = cache[f"blocks.{l}.attn.hook_pattern"].to(torch.float64)
        for h in range(2):
            sums = {name: [0.0, 0] for name in SCORES}
            for b in range(len(x)):
                for t in range(N - 1):
                    row = a[b, h, t]
                    sums["self"][0] += float(row[t]); sums["self"][1] += 1
                    sums["parent"][0] += float(row[t]); sums["parent"][1] += 1
                    if t >= 1:
                        sums["previous_token"][0] += float(row[t - 1]); sums["previous_token"][1] += 1
                    match = [j for j in range(1, t + 1) if x[b][j - 1] == x[b][t]]
                    if match:
                        sums["induction"][0] += float(row[match].sum()); sums["induction"][1] += 1
            for name in SCORES:
                assert s[f"L{l}H{h}.{name}"] == pytest.approx(sums[name][0] / sums[name][1], rel=1e-9), (l, h, name)


def test_a_query_slot_model_is_read_at_its_slot():
    """The paper-style query-slot layout: a wired layer-0 head attends from the query slot to the last
    observed state, its previous token and (first order) the parent."""
    model = wired_deep(attention="query", n_layers=1)
    batch = TASK.sample(50, 1)
    result = head_probe(model, TASK, batch, CFG)
    s = result.scores()
    assert result.layout.kind == "query" and result.same_as == {"parent": "previous_token"}
    assert s["L0H0.previous_token"] == pytest.approx(1.0, abs=1e-12) and s["L0H0.self"] == pytest.approx(0, abs=1e-12)
    # induction at the slot: the last state's own position counts when it repeats the state before it
    repeat = (batch.tokens[:, N - 3] == batch.tokens[:, N - 2]).to(torch.float64)
    assert s["L0H0.induction"] == pytest.approx(float(repeat.sum()) / float(result.count["induction"].sum()))


def test_against_random_models_the_wired_heads_stand_out(data):
    table = heads_against_random(wired_deep(), TASK, data, seeds=[1, 2], config=CFG)
    assert table.n_random == 2
    for (l, name) in ((0, "previous_token"), (1, "induction")):
        lo, hi = table.difference_interval[name][l, 0].tolist()
        assert 0 < lo <= float(table.difference[name][l, 0]) <= hi
        assert float(table.random_interval[name][l, 0, 1]) < float(table.interval[name][l, 0, 0])
    text = table.describe()
    assert "L0H0 previous-token 1.00 [1.00, 1.00] (random " in text and "L1H0 induction 1.00" in text
    js = table.to_json()
    assert set(js["L1H0"]) >= {"previous_token", "induction", "self", "parent", "ablation_loss_increase",
                               "induction_interval", "induction_random", "induction_difference_interval"}
    assert js["L1H0"]["roles"] == ["induction"] and js["L1H0"]["ablation_loss_increase"] is None


def test_random_models_are_not_named(data):
    model = DeepTransformer(DeepConfig.standard(K, N, 16, n_layers=2, seed=7))
    table = heads_against_random(model, TASK, data, seeds=[1, 2, 3], config=CFG)
    assert all(table.roles(l, h) == [] for l, h in table.heads())
    assert "no clear role" in table.describe()


# ------------------------------------------------------------------------------ weights
def test_composition_of_the_wired_circuit_is_k_composition():
    """Layer 0 writes the previous-token block, which layer 1's keys alone read: K-composition
    ||OV_0 (W_Q1 W_K1^T)^T|| / (||OV_0|| ||W_Q1 W_K1^T||) = c sqrt(K) / (sqrt(K) c sqrt(K + 4))."""
    comp = composition_scores(wired_deep())
    assert float(comp.K[0, 0, 1, 0]) == pytest.approx(1 / math.sqrt(K + 4), rel=1e-12)
    assert float(comp.Q[0, 0, 1, 0]) == 0.0 and float(comp.V[0, 0, 1, 0]) == 0.0
    assert float(comp.K[1, 0, 0, 0]) == 0.0 and float(comp.K[0, 0, 0, 0]) == 0.0  # only later layers
    assert comp.flat()["K.L0H0->L1H0"] == pytest.approx(1 / math.sqrt(K + 4), rel=1e-12)
    assert composition_scores(wired_deep(n_layers=1)) is None


def test_composition_agrees_with_the_bridges_own():
    model = bridge(n_states=K, n_ctx=N, d_model=16, n_layers=3, n_heads=2, seed=5)
    comp = composition_scores(model)
    for mode in ("Q", "K", "V"):
        theirs = model.all_composition_scores(mode).scores.to(torch.float64)
        assert torch.allclose(getattr(comp, mode), theirs, rtol=1e-5, atol=0), mode


# ------------------------------------------------------------------------------ scorecard, report, training
def test_scorecard_and_report_carry_the_heads(data, tmp_path):
    model = wired_deep()
    cmp = compare_to_random(model, TASK, data[:60], seeds=[1, 2], config=CFG)
    card = cmp.trained
    js = json.loads(json.dumps(summary_json(card, cmp), allow_nan=True))
    head = js["heads"]["L1H0"]
    assert head["induction"] == pytest.approx(1.0, abs=1e-12)
    ablated = head_ablation(model, TASK, data[:60], "mean", CFG).loss_increase[1, 0]  # the scorecard mean-ablates
    assert head["ablation_loss_increase"] == pytest.approx(float(ablated), rel=1e-9)
    assert head["induction_random"] < 0.6 and head["induction_difference_interval"][0] > 0.3
    assert js["heads"]["chance"]["induction"] == pytest.approx(card.flat()["heads.chance.induction"])
    assert js["composition"]["K"]["L0H0->L1H0"] == pytest.approx(1 / math.sqrt(K + 4), rel=1e-12)
    assert "L1H0" in js["baseline"]["heads"] and "composition" in js["baseline"]
    assert card.scores()["heads"]["L0H0"]["previous_token"] == pytest.approx(1.0, abs=1e-12)
    assert any(line.startswith("Heads: L0H0 previous-token 1.00") for line in cmp.findings())
    card.head_ablation = {"L1H0": 0.5}
    assert card.scores()["heads"]["L1H0"]["ablation_loss_increase"] == 0.5
    assert "ablating L1H0 costs 0.50 nats" in card.findings()[-1]
    out = write_probe_report(tmp_path / "report", card, "wired", cmp)
    text = (out / "report.md").read_text()
    assert "## Heads" in text and "| L1H0 | induction | 1.000 [1.000, 1.000] |" in text
    assert (out / "heads.png").exists() and (out / "composition.png").exists()
    scores = json.loads((out / "scores.json").read_text())
    assert scores["scores"]["heads"]["L1H0"]["induction_random"] < 0.6


def test_over_training_scores_every_checkpoint(data, tmp_path):
    from probes.plots import plot_over_training

    start = DeepTransformer(DeepConfig.standard(K, N, D, n_layers=2, seed=3))
    wired = wired_deep()
    curve = heads_over_training([(0, start), (50, wired), (100, wired)], TASK, data, CFG)
    assert curve.steps == [0, 50, 100]
    assert curve.scores["previous_token"].shape == (3, 2, 1)
    assert float(curve.scores["induction"][2, 1, 0]) == pytest.approx(1.0, abs=1e-12)
    assert curve.rise_step("induction", layer=1) == 50 and curve.rise_step("previous_token", layer=0, head=0) == 50
    assert curve.references == reference_losses(TASK, data.states)
    assert float(curve.test_loss[0]) == pytest.approx(next_token_loss(start, TASK, data), rel=1e-12)
    # a model that attends uniformly at random init is near ln K
    assert abs(float(curve.test_loss[0]) - math.log(K)) < 0.2
    caption = plot_over_training(curve, tmp_path / "curve.png")
    assert (tmp_path / "curve.png").stat().st_size > 0 and "bigram" in caption
