"""Attribution methods against known answers: a hand-built induction circuit, exact identities of edge
ablation, TransformerLens' own attribution patching and DLA on a bridge, and the paper's model."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from probes.ablation import head_ablation, head_patching
from probes.attribution import agreement, direct_logit_attribution, spearman
from probes.circuits import (
    ablated_metric,
    circuit,
    edge_attribution,
    path_patching_through_keys,
    writer_replacements,
)
from probes.config import ProbeConfig
from probes.graph import model_graph
from probes.patching import _setup, patching_probe, sweep, walk_metric
from probes.targets import run_logits, targets_for
from rwinterp.bridge import build_bridge
from rwinterp.config import BridgeOptions
from rwinterp.errors import RwinterpError
from rwinterp.icl import InContextChain
from tests.conftest import assert_close

K, N, D, H = 3, 16, 32, 2
TOKENS, POSITIONS, PREVIOUS, OUTPUT = 0, 3, 3 + N, 6 + N  # residual coordinates of each subspace
CONFIG = ProbeConfig(progress=False, bootstrap=0)
GAIN = 2.0


def induction_weights(sharp: float = 12.0, gain: float = GAIN) -> dict[str, torch.Tensor]:
    """An induction circuit by hand, in TransformerLens conventions (float64). Layer 0 head 0 attends from
    position i to i - 1 (its queries and keys read the one-hot positions) and writes that token into the
    PREVIOUS coordinates; layer 1 head 0 attends from i to the positions j whose previous token equals
    x_i (queries read the token, keys the PREVIOUS coordinates: K-composition) and writes x_j into the
    OUTPUT coordinates, which alone the unembedding reads. Heads 1 of both layers write nothing (W_O = 0)."""
    f = dict(dtype=torch.float64)
    W_E = torch.zeros(K, D, **f)
    W_E[:, TOKENS:TOKENS + K] = torch.eye(K, **f)
    W_pos = torch.zeros(N, D, **f)
    W_pos[:, POSITIONS:POSITIONS + N] = torch.eye(N, **f)
    W_Q, W_K, W_V = (torch.zeros(2, H, D, D // H, **f) for _ in range(3))
    W_O = torch.zeros(2, H, D // H, D, **f)
    for i in range(1, N):  # previous-token head: q_i = sharp e_{i-1}, k_j = e_j
        W_Q[0, 0, POSITIONS + i, i - 1] = sharp * math.sqrt(D // H)  # (scores are divided by sqrt(d_head))
    for j in range(N):
        W_K[0, 0, POSITIONS + j, j] = 1.0
    for t in range(K):
        W_V[0, 0, TOKENS + t, t] = 1.0
        W_O[0, 0, t, PREVIOUS + t] = 1.0
        W_Q[1, 0, TOKENS + t, t] = sharp * math.sqrt(D // H)
        W_K[1, 0, PREVIOUS + t, t] = 1.0
        W_V[1, 0, TOKENS + t, t] = 1.0
        W_O[1, 0, t, OUTPUT + t] = 1.0
    W_U = torch.zeros(D, K, **f)
    W_U[OUTPUT:OUTPUT + K] = gain * torch.eye(K, **f)
    # Heads 1 read something (so their inputs have gradients) but write nothing.
    W_Q[:, 1] = W_K[:, 1] = W_V[:, 1] = torch.linspace(-1, 1, D * (D // H), **f).reshape(D, D // H)
    return dict(W_E=W_E, W_pos=W_pos, W_Q=W_Q, W_K=W_K, W_V=W_V, W_O=W_O, W_U=W_U)


def induction_bridge():

    model = build_bridge(BridgeOptions(n_states=K, n_ctx=N, d_model=D, n_layers=2, n_heads=H, attn_only=True, seed=0,
                                         dtype="float64"))
    w = induction_weights()
    state = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    state["embed.weight"] = w["W_E"]
    state["pos_embed.weight"] = w["W_pos"]
    for layer in range(2):
        for name, key in (("W_Q", "q"), ("W_K", "k"), ("W_V", "v")):
            state[f"blocks.{layer}.attn.{key}.weight"] = torch.cat([w[name][layer, h].T for h in range(H)])
        state[f"blocks.{layer}.attn.o.weight"] = torch.cat([w["W_O"][layer, h] for h in range(H)]).T
    state["unembed.weight"] = w["W_U"].T
    model.load_state_dict(state)
    for name in ("W_Q", "W_K", "W_V", "W_O", "W_U", "W_E", "W_pos"):
        assert torch.equal(getattr(model, name).detach(), w[name]), name  # the conventions are the ones set
    return model.eval()


def induction_deep():
    from rwinterp.model import DeepConfig, DeepTransformer

    model = DeepTransformer(DeepConfig.standard(K, N, D, n_layers=2, n_heads=H, d_head=D // H, dtype="float64"))
    w = induction_weights()
    with torch.no_grad():
        model.embed.zero_()
        model.embed[:K] = w["W_E"]
        model.pos_embed.copy_(w["W_pos"])
        model.unembed.copy_(w["W_U"])
        for layer, block in enumerate(model.blocks):
            for name in ("W_Q", "W_K", "W_V", "W_O"):
                getattr(block.attn, name).copy_(w[name][layer])
    return model.eval()


@pytest.fixture(scope="module")
def icl():
    task = InContextChain(K, N)
    return task, task.sample(48, 3)


@pytest.fixture(scope="module")
def bridge():
    return induction_bridge()


@pytest.fixture(scope="module")
def exact_edges(bridge, icl):
    task, data = icl
    return edge_attribution(bridge, task, data, "exact", "mean", config=CONFIG)


#: Edges whose mean ablation changes the hand-built circuit's loss. Every other edge has no effect at all:
#: the dead heads' (W_O = 0), and the embeddings' into layer 0's queries and keys, which read the
#: positions alone (the same in every walk, so their mean is themselves).
LIVE = {"embeddings->L0H0.v", "embeddings->L1H0.q", "embeddings->L1H0.v", "L0H0->L1H0.k", "L1H0->logits"}


def test_the_hand_built_model_is_an_induction_circuit(bridge, icl):
    task, data = icl
    with torch.no_grad():
        _, cache = bridge.run_with_cache(data.states)
    prev = cache["blocks.0.attn.hook_pattern"][:, 0].diagonal(offset=-1, dim1=-2, dim2=-1)
    assert float(prev.min()) > 0.999
    s = data.states
    match = torch.zeros(len(s), N, N, dtype=torch.bool)
    match[:, :, 1:] = s[:, None, :-1] == s[:, :, None]
    match[:, :, 0] = s[:, :1] == s  # position 0 has no previous token: layer 0 copies its own there
    induction = (cache["blocks.1.attn.hook_pattern"][:, 0] * match).sum(-1)
    has_match = match.tril().any(-1)
    assert float(induction[has_match].min()) > 0.99


def test_exact_edge_scores_are_zero_exactly_where_the_circuit_has_no_edge(exact_edges):
    scores = dict(zip([e.name for e in exact_edges.edges], exact_edges.scores().tolist()))
    assert len(scores) == 1 * 6 + 3 * 6 + 5  # into layer 0, into layer 1, into the logits
    for name, value in scores.items():
        if name in LIVE:
            assert abs(value) > 1e-3, name
        else:
            assert value == 0.0, name
    heads = {n: abs(v) for n, v in scores.items() if n.startswith("L0H")}
    assert max(heads, key=heads.get) == "L0H0->L1H0.k"  # K-composition: the largest edge between heads


@pytest.mark.parametrize("kind", ["induction", "mlp"])
def test_ablating_no_edge_is_the_clean_run_and_every_edge_the_donor_run(bridge, icl, kind):

    task, data = icl
    if kind == "mlp":  # a random bridge with MLPs: edges into and out of every MLP too
        bridge = build_bridge(BridgeOptions(n_states=K, n_ctx=N, d_model=16, n_layers=2, n_heads=2, attn_only=False,
                                         seed=4, dtype="float64"))
    setup = _setup(bridge, task, data, "z", "resample", "loss", CONFIG)
    structure = model_graph(bridge, setup.base.inputs)
    edges = structure.edges()
    replacement = writer_replacements(bridge, setup, structure, "resample", 10_000, None)
    coef = torch.stack([torch.zeros(len(edges)), torch.ones(len(edges))]).to(torch.float64)
    none, every = ablated_metric(bridge, setup, structure, edges, coef, replacement, 10_000)
    clean = walk_metric(run_logits(bridge, setup.base.inputs)[None], setup.base, "loss")[0]
    donor = walk_metric(run_logits(bridge, setup.donor)[None], setup.base, "loss")[0]
    assert_close(none, clean)
    torch.testing.assert_close(every, donor, rtol=1e-10, atol=1e-12 * float(donor.abs().max()))
    assert float((donor - clean).abs().mean()) > 0.01  # the two runs differ: the identity is not vacuous
    assert any(e.reader.kind == "mlp" for e in edges) == (kind == "mlp")


@pytest.mark.parametrize("method", ["eap", "eap-ig", "atp*"])
def test_gradient_methods_give_exactly_zero_where_the_circuit_has_no_edge(bridge, icl, method):
    task, data = icl
    result = edge_attribution(bridge, task, data, method, "mean", steps=3, config=CONFIG)
    for edge, value in zip(result.edges, result.scores().tolist()):
        if edge.writer.name in ("L0H1", "L1H1") or edge.reader.name.startswith(("L0H1", "L1H1")):
            assert value == 0.0, edge.name


def test_the_default_method_equals_exact_patching_on_the_hand_built_circuit(bridge, icl, exact_edges):
    task, data = icl
    result = edge_attribution(bridge, task, data, "default", "mean", config=CONFIG)
    assert bool(result.verified.all())  # closed form for layer 1 and the logits, the 10 left verified
    torch.testing.assert_close(result.scores(), exact_edges.scores(), rtol=1e-9, atol=1e-12)
    assert result.ranked()[0] == {**exact_edges.ranked()[0]}


def test_eap_is_exact_where_the_metric_is_linear_in_the_edge(bridge, icl):
    """With the logit difference, an edge into the logits, or into a last-layer head's values (pattern
    fixed), changes the metric linearly: EAP's first-order estimate is the exact effect."""
    task, data = icl
    exact = edge_attribution(bridge, task, data, "exact", "mean", "logit_diff", config=CONFIG)
    eap = edge_attribution(bridge, task, data, "eap", "mean", "logit_diff", config=CONFIG)
    linear = [i for i, e in enumerate(exact.edges) if e.reader.kind == "logits" or (
        e.reader.kind == "v" and e.reader.layer == 1)]
    other = [i for i, e in enumerate(exact.edges) if e.name == "L0H0->L1H0.k"]
    torch.testing.assert_close(eap.scores()[linear], exact.scores()[linear], rtol=1e-9, atol=1e-12)
    # ... and not through a key (attention saturation): the estimate misses most of the effect.
    assert abs(float(eap.scores()[other[0]] - exact.scores()[other[0]])) > 0.1 * abs(float(exact.scores()[other[0]]))


def test_atp_star_recovers_a_saturated_key_edge_that_eap_misses(bridge, icl):
    task, data = icl
    exact = edge_attribution(bridge, task, data, "exact", "mean", "logit_diff", config=CONFIG)
    star = edge_attribution(bridge, task, data, "atp*", "mean", "logit_diff", config=CONFIG)
    # With the logit difference, everything after layer 1's pattern is linear: AtP* is exact on edges into its keys.
    keys = [i for i, e in enumerate(exact.edges) if e.reader.kind in ("k", "q") and e.reader.layer == 1]
    torch.testing.assert_close(star.scores()[keys], exact.scores()[keys], rtol=1e-9, atol=1e-12)


def test_eap_ig_converges_to_the_integrated_gradient_of_the_embeddings(bridge, icl):
    """Summed over the edges out of the embeddings (every path from the input), EAP-IG is a Riemann sum
    of the integral of the gradient along the embeddings' path: it tends to m(donor) - m(clean), with an
    error falling like 1/m."""
    task, data = icl
    setup = _setup(bridge, task, data, "z", "resample", "loss", CONFIG)
    clean = walk_metric(run_logits(bridge, setup.base.inputs)[None], setup.base, "loss")[0].mean()
    donor = walk_metric(run_logits(bridge, setup.donor)[None], setup.base, "loss")[0].mean()
    errors = []
    for m in (8, 32):
        r = edge_attribution(bridge, task, data, "eap-ig", "resample", steps=m, config=CONFIG)
        total = sum(float(s) for e, s in zip(r.edges, r.scores()) if e.writer.kind == "embed")
        errors.append(abs(total - float(donor - clean)))
    assert errors[1] < 0.4 * errors[0]
    assert errors[1] < 0.15 * abs(float(donor - clean))


def test_a_deep_model_computing_the_same_function_gets_the_same_scores(bridge, icl, exact_edges):
    task, data = icl
    deep = induction_deep()
    with torch.no_grad():
        torch.testing.assert_close(deep(data.states)[..., :K], bridge(data.states), rtol=1e-12, atol=1e-12)
    for method in ("exact", "eap", "atp*"):
        a = edge_attribution(deep, task, data, method, "mean", config=CONFIG)
        b = exact_edges if method == "exact" else edge_attribution(bridge, task, data, method, "mean", config=CONFIG)
        assert [e.name for e in a.edges] == [e.name for e in b.edges]
        torch.testing.assert_close(a.scores(), b.scores(), rtol=1e-8, atol=1e-12)


def test_path_patching_through_keys_finds_the_k_composition(bridge, icl):
    task, data = icl
    result = path_patching_through_keys(bridge, task, data, "mean", config=CONFIG)
    effect = result.effect
    assert effect.shape == (2, 2, 2, 2)
    assert float(effect[0, 0, 1, 0]) > 0.01
    live = effect.isfinite()
    assert int(live.sum()) == 4  # layer-0 heads into layer-1 heads only
    for index in live.nonzero().tolist():
        if tuple(index) != (0, 0, 1, 0):
            assert float(effect[tuple(index)]) == 0.0
    assert bool(effect[1].isnan().all()) and bool(effect[:, :, 0].isnan().all())


def test_head_ablation_costs_nothing_for_a_head_that_writes_nothing(bridge, icl):
    task, data = icl
    config = ProbeConfig(progress=False, bootstrap=200)
    for mode in ("mean", "resample"):
        result = head_ablation(bridge, task, data, mode, config)
        assert result.loss_increase[0, 1] == 0.0 and result.loss_increase[1, 1] == 0.0
        # (the hand-built heads' effects are small and their sign depends on the sequences: they are not zero)
        assert abs(float(result.loss_increase[0, 0])) > 1e-3 and abs(float(result.loss_increase[1, 0])) > 1e-3
        assert bool((result.ci_low[:, 0] <= result.loss_increase[:, 0]).all())
        assert bool((result.loss_increase[:, 0] <= result.ci_high[:, 0]).all())
        assert result.scores()["L1H0"]["ablation_loss_increase"] == float(result.loss_increase[1, 0])
    targets = targets_for(bridge, task, data)
    with torch.no_grad():
        logits = bridge(targets.inputs)[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, K), targets.inputs[:, 1:].reshape(-1))
    assert result.clean_loss == pytest.approx(float(loss), rel=1e-12)


def test_head_ablation_by_hand(bridge, icl):
    """The sweep's mean ablation of one head equals writing the mean z into that head by hand."""
    task, data = icl
    result = head_ablation(bridge, task, data, "mean", CONFIG)
    s = data.states
    with torch.no_grad():
        _, cache = bridge.run_with_cache(s)
        mean_z = cache["blocks.1.attn.hook_z"][:, :, 0].mean(0)

        def put(act, hook):
            act = act.clone()
            act[:, :, 0] = mean_z
            return act

        logits = bridge.run_with_hooks(s, fwd_hooks=[("blocks.1.attn.hook_z", put)])
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, K), s[:, 1:].reshape(-1))
    assert float(result.loss_increase[1, 0]) == pytest.approx(float(loss) - result.clean_loss, rel=1e-10)


def test_head_patching_recovers_the_corrupted_runs_loss(bridge, icl):
    task, data = icl
    result = head_patching(bridge, task, data, CONFIG)
    assert result.loss_change[0, 1] == 0.0 and result.loss_change[1, 1] == 0.0
    assert float(result.loss_change[1, 0]) < 0.0  # the induction head's clean output lowers the clean labels' loss
    assert result.corrupted_loss > result.clean_loss


@pytest.mark.parametrize("family, granularity", [("z", "head_position"), ("k", "head_position"),
                                                 ("resid_pre", "position"), ("pattern", "head"), ("v", "layer")])
def test_atp_agrees_with_exact_patching_to_first_order(bridge, icl, family, granularity):
    """AtP is the first-order term of the exact effect: for a small replacement (the clean activation
    moved a little towards the mean) the two agree to second order."""
    task, data = icl
    soft = induction_bridge()
    with torch.no_grad():  # blunt the circuit so that the metric is smooth at this scale
        for p in soft.parameters():
            p.mul_(0.25)
    exact = sweep(soft, task, data, family, granularity, "mean", "loss", "exact", CONFIG)
    atp = sweep(soft, task, data, family, granularity, "mean", "loss", "atp", CONFIG)
    e, a = exact.effects().flatten(), atp.effects().flatten()
    assert e.shape == a.shape
    assert float((a - e).abs().max()) <= 0.2 * float(e.abs().max())
    assert spearman(a, e) > 0.8


def test_atp_star_is_exact_on_a_last_layer_key_when_the_rest_is_linear(bridge, icl):
    task, data = icl
    exact = sweep(bridge, task, data, "k", "head_position", "mean", "logit_diff", "exact", CONFIG)
    star = sweep(bridge, task, data, "k", "head_position", "mean", "logit_diff", "atp*", CONFIG)
    plain = sweep(bridge, task, data, "k", "head_position", "mean", "logit_diff", "atp", CONFIG)
    torch.testing.assert_close(star.effects()[1], exact.effects()[1], rtol=1e-8, atol=1e-10)
    assert float((plain.effects()[1] - exact.effects()[1]).abs().max()) > 0.1 * float(exact.effects()[1].abs().max())


def test_graddrop_ranks_every_cell_and_is_refused_on_one_layer(bridge, icl, trained_paper_models):
    task, data = icl
    result = sweep(bridge, task, data, "z", "head", "mean", "loss", "atp", CONFIG, graddrop=True)
    assert result.graddrop.shape == (2, 2) and bool((result.graddrop >= 0).all())
    assert float(result.graddrop[0, 1]) == 0.0 and float(result.graddrop[1, 1]) == 0.0
    assert result.cost.backward == 3  # one pass, and one per dropped layer
    model, walk_task, _ = trained_paper_models[0.5]
    with pytest.raises(RwinterpError, match="at least 2 layers"):
        sweep(model, walk_task, walk_task.sample(8, 1), "z", "head", "mean", "loss", "atp", CONFIG, graddrop=True)


def test_circuit_keeps_the_top_edges_and_measures_faithfulness(bridge, icl, exact_edges):
    task, data = icl
    result = circuit(bridge, task, data, "exact", top=5, config=CONFIG, roles={"L0H0": "previous-token"})
    assert {f"{e['source']}->{e['target']}" for e in result.circuit} == LIVE
    assert result.faithfulness == pytest.approx(1.0, abs=1e-9)  # the other edges do nothing
    # the ends are the fully ablated and the full model themselves: exactly 0 and 1, each run once
    assert result.curve.at(0) == 0.0 and result.curve.at(len(exact_edges.edges)) == 1.0
    assert result.cost.forward == exact_edges.cost.forward + len(result.curve.sizes)
    payload = result.to_json()
    scores = [abs(e["score"]) for e in payload["edges"]]
    assert scores == sorted(scores, reverse=True)
    assert payload["edges"][0].keys() >= {"source", "target", "score", "verified"}
    assert [e for e in payload["edges"] if e["source"] == "L0H0"][0]["source_role"] == "previous-token"
    heads = circuit(bridge, task, data, "default", graph="heads", config=CONFIG)
    assert len(heads.scores.edges) == 2 * 2 * 3 and heads.edges[0]["target"] == "L1H0.k"


@pytest.mark.parametrize("call, message", [
    (lambda m, t, d: circuit(m, t, d, top=0, config=CONFIG), "between 1 and the 29 edges"),
    (lambda m, t, d: circuit(m, t, d, top=30, config=CONFIG), "between 1 and the 29 edges"),
    (lambda m, t, d: edge_attribution(m, t, d, "eap-ig", steps=0, config=CONFIG), "m >= 1"),
    (lambda m, t, d: edge_attribution(m, t, d, "acdc", config=CONFIG), "unknown edge method"),
    (lambda m, t, d: sweep(m, t, d, "hook_nothing", config=CONFIG), "unknown hook family"),
    (lambda m, t, d: sweep(m, t, d, "resid_pre", "head", config=CONFIG), "no head axis"),
    (lambda m, t, d: sweep(m, t, d, metric="accuracy", config=CONFIG), "unknown metric"),
    (lambda m, t, d: head_ablation(m, t, d, "zero", CONFIG), "unknown ablation mode"),
    (lambda m, t, d: direct_logit_attribution(m, t, d, "loss"), "unknown DLA metric"),
])
def test_bad_input_is_one_line(bridge, icl, call, message):
    task, data = icl
    with pytest.raises(RwinterpError, match=message) as info:
        call(bridge, task, data)
    assert "\n" not in str(info.value)


def test_models_whose_edges_cannot_be_cut_are_refused(trained_paper_models, icl):
    from rwinterp.model import DeepConfig, DeepTransformer

    model, walk_task, _ = trained_paper_models[0.5]
    with pytest.raises(RwinterpError, match="cannot be built") as info:
        edge_attribution(model, walk_task, walk_task.sample(8, 1), config=CONFIG)
    assert "\n" not in str(info.value)
    task, data = icl
    for options in (dict(residual=False), dict(normalize_tokens=True)):
        deep = DeepTransformer(DeepConfig.standard(K, N, 8, n_layers=2, n_heads=2, dtype="float64", **options))
        with pytest.raises(RwinterpError, match="cannot be built"):
            edge_attribution(deep, task, data, config=CONFIG)


def test_probes_leave_the_model_and_the_random_state_alone(icl):
    task, data = icl
    model = induction_bridge()
    model.train()
    before = copy.deepcopy(model.state_dict())
    rng = torch.get_rng_state()
    circuit(model, task, data, "default", config=CONFIG)
    head_ablation(model, task, data, "resample", CONFIG)
    sweep(model, task, data, "z", "head_position", "mean", "loss", "atp*", CONFIG, graddrop=True)
    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    assert not any(hp.has_hooks() for hp in model.hook_dict.values())


# ------------------------------------------------------------------------------ TransformerLens' own numbers
def _tl_metric(labels: torch.Tensor):
    """TransformerLens calls its metric once per example on the clean and then the corrupt run: a
    per-example loss needs that example's labels, found by counting the calls."""
    calls = {"n": 0}

    def metric(logits: torch.Tensor) -> torch.Tensor:
        index = calls["n"] // 2
        calls["n"] += 1
        lp = logits[0, :-1, :K].log_softmax(-1)
        return -lp.gather(-1, labels[index][:, None])[:, 0].mean()

    return metric


def test_our_atp_and_eap_equal_transformer_lens_attribution_patching_on_a_bridge(icl):
    from transformer_lens.tools.analysis.attribution_patching import attribution_patch

    task, data = icl
    data = data[:12]
    model = build_bridge(BridgeOptions(n_states=K, n_ctx=N, d_model=16, n_layers=2, n_heads=2, attn_only=False,
                                         seed=3, dtype="float64"))
    atp = sweep(model, task, data, "z", "head_position", "resample", "loss", "atp", CONFIG)
    mlp = sweep(model, task, data, "mlp_out", "position", "resample", "loss", "atp", CONFIG)
    setup = _setup(model, task, data, "z", "resample", "loss", CONFIG)
    clean, donor = setup.base.inputs, setup.donor
    # TransformerLens takes the gradient at its "corrupt" run and moves towards its "clean" one: our
    # resample ablation of the clean walks is its attribution with the roles swapped.
    tl = attribution_patch(model, donor, clean, _tl_metric(setup.base.labels)).node_scores
    ours = atp.effects()
    theirs = torch.zeros_like(ours)
    mlp_theirs = torch.zeros_like(mlp.effects())
    for node, value in tl.items():
        if node.kind == "attn_head_out":
            theirs[node.layer, node.head, node.position] = value
        elif node.kind == "mlp_out":
            mlp_theirs[node.layer, node.position] = value
    torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-14)
    torch.testing.assert_close(mlp.effects(), mlp_theirs, rtol=1e-9, atol=1e-14)
    assert float(ours.abs().max()) > 1e-4
    # EAP splits each head's node score over its outgoing edges (TransformerLens' own identity between
    # its edge and node sweeps); its edge sweep does not run on a native bridge (no per-head result hook).
    eap = edge_attribution(model, task, data, "eap", "resample", config=CONFIG)
    for layer in range(2):
        for head in range(2):
            out = sum(float(s) for e, s in zip(eap.edges, eap.scores()) if e.writer.name == f"L{layer}H{head}")
            assert out == pytest.approx(float(theirs[layer, head].sum()), rel=1e-9, abs=1e-14)


def test_direct_logit_attribution_equals_transformer_lens_on_a_bridge(icl):
    from transformer_lens.tools.analysis import direct_logit_attribution as tl_dla

    task, data = icl
    data = data[:10]
    model = build_bridge(BridgeOptions(n_states=K, n_ctx=N, d_model=16, n_layers=2, n_heads=2, attn_only=True,
                                         seed=5, dtype="float64"))
    ours = direct_logit_attribution(model, task, data, "logit_diff", CONFIG)
    setup = _setup(model, task, data, "z", "resample", "loss", CONFIG)
    copy_ = copy.deepcopy(model)
    copy_.enable_compatibility_mode()  # changes the weights: a copy, never the model probed
    last = N - 2  # the last prediction of each walk
    tl = tl_dla(copy_, data.states, answer_tokens=setup.base.labels[:, last], incorrect_tokens=setup.bad[:, last],
                unit="head", pos=last)
    index = ours.components.index
    for name in ("L0H0", "L0H1", "L1H0", "L1H1"):
        theirs = tl.attribution[tl.labels.index(name)].detach().to(torch.float64)  # (compatibility mode rounds in float32)
        torch.testing.assert_close(ours.terms[index(name), :, last], theirs, rtol=1e-5, atol=1e-7 * float(theirs.abs().max()))
    # The terms sum to the logit difference itself.
    with torch.no_grad():
        logits = model(data.states)[:, :-1]
    ld = logits.gather(-1, setup.base.labels[..., None])[..., 0] - logits.gather(-1, setup.bad[..., None])[..., 0]
    torch.testing.assert_close(ours.total, ld, rtol=1e-10, atol=1e-12)


def test_dla_splits_a_head_by_source_position(bridge, icl):
    task, data = icl
    result = direct_logit_attribution(bridge, task, data, "logit_diff", CONFIG)
    by_source = result.by_source[1, 0]  # [batch, pred, pos]
    torch.testing.assert_close(by_source.nan_to_num().sum(-1), result.terms[result.components.index("L1H0")],
                               rtol=1e-10, atol=1e-12)
    assert result.means()["L0H0"] == 0.0 and result.means()["embeddings"] == 0.0  # W_U reads neither


# ------------------------------------------------------------------------------ the paper's model
def test_on_the_paper_model_atp_exact_patching_and_dla_put_the_effect_on_the_parent(trained_paper_models):
    from probes.attention import attention_probe

    model, task, _ = trained_paper_models[0.5]
    data = task.sample(100, 11)
    config = ProbeConfig(progress=False, bootstrap=0, hooks=("resid_pre",), gradient_walks=0)
    exact = patching_probe(model, task, data, config)
    atp = patching_probe(model, task, data, config, method="atp")
    star = patching_probe(model, task, data, config, method="atp*")
    for result in (exact, atp, star):
        assert result.scores()["localization"] >= 0.9
        assert result.scores()["parent_effect"] >= 0.9
    assert atp.scores()["parent_effect"] == pytest.approx(exact.scores()["parent_effect"], rel=1e-3)
    assert agreement(atp, exact).top_k[1] == 1.0
    dla = direct_logit_attribution(model, task, data, "logprob", config)
    share = attention_probe(model, task, data, config).scores()["value_weighted_parent_share"]
    assert dla.parent_share() >= 0.9 and share >= 0.9
    assert dla.parent_share() == pytest.approx(share, abs=0.05)
    assert dla.components == ["L0H0", "bias"]  # no residual stream: the head alone writes the output


def test_node_integrated_gradients_converge_to_the_whole_change(bridge, icl):
    """Integrated gradients over the embeddings, summed over every position of them (one layer-0 cell of
    ``resid_pre``), tend to the metric's whole change from the donor's embeddings to the clean ones."""
    task, data = icl
    setup = _setup(bridge, task, data, "z", "resample", "loss", CONFIG)
    clean = walk_metric(run_logits(bridge, setup.base.inputs)[None], setup.base, "loss")[0].mean()
    donor = walk_metric(run_logits(bridge, setup.donor)[None], setup.base, "loss")[0].mean()
    errors = [abs(float(sweep(bridge, task, data, "resid_pre", "layer", "resample", "loss", "ig", CONFIG,
                              steps=m).effects()[0]) - float(donor - clean)) for m in (8, 32)]
    assert errors[1] < 0.4 * errors[0] and errors[1] < 0.15 * abs(float(donor - clean))


def test_cell_faithfulness_runs_from_every_cell_patched_to_none(bridge, icl):
    from probes.patching import cell_faithfulness

    task, data = icl
    result = sweep(bridge, task, data, "z", "head", "mean", "loss", "exact", CONFIG)
    order = [0, 2, 1, 3]  # L0H0, L1H0 (the circuit), then the heads that write nothing
    f = cell_faithfulness(bridge, task, data, result, order, [0, 1, 2, 4], CONFIG)
    assert float(f[0]) == pytest.approx(0.0, abs=1e-12) and float(f[3]) == pytest.approx(1.0, abs=1e-12)
    assert float(f[2]) == pytest.approx(1.0, abs=1e-12)  # the dead heads change nothing
    assert float(f[1]) == pytest.approx(0.0, abs=1e-12)  # the previous-token head alone: nothing reaches the logits


def test_the_scorecard_reports_the_attribution_patching_parent_share(trained_paper_models):
    from probes.scoring import scorecard

    model, task, _ = trained_paper_models[0.5]
    card = scorecard(model, task, task.sample(60, 5), ProbeConfig(progress=False, bootstrap=50, gradient_walks=40))
    flat = card.flat()
    assert flat["attribution_patching.parent_share"] >= 0.9
    assert flat["attribution_patching.parent_effect"] == pytest.approx(flat["patching.parent_effect"], rel=1e-2)
    lo, hi = card.intervals["attribution_patching.parent_share"]
    assert lo <= flat["attribution_patching.parent_share"] <= hi
