"""Training against the paper's theory (``docs/model.md`` section 4)."""

import math

import pytest
import torch

from rwinterp.metrics import accuracy
from rwinterp.tasks import CircleWalk
from rwinterp.training import GradientDescent, TrainConfig, TrainingDiverged, make_data, train
from tests.conftest import RTOL, assert_close, paper_model


@pytest.mark.parametrize("eps", [0.1, 0.37])
def test_one_population_step_gives_the_closed_form_V(eps):
    """After one step from zero init: W = 0 and V = lr/(eps N K) sum_{i=1}^{N-1} (Pi^T)^{N-i}. The loss
    before it is -log(0 + eps): every score is 0."""
    K, N, lr = 5, 9, 0.7
    task = CircleWalk(K, 0.7, N)
    model = paper_model(task, pos_dim=16)
    result = train(model, task, TrainConfig(lr=lr, eps=eps, steps=1, population=True), progress=False)
    assert result.history[0]["loss"] == pytest.approx(-math.log(eps), rel=RTOL)  # a weighted mean of it
    # Attention stays uniform over all N positions until W moves (it is 0 after step 1 as well).
    assert result.history[1]["parent_attention"] == pytest.approx(1 / N, rel=1e-12)
    Pi_T = task.transition_matrix().T
    expected = sum(torch.linalg.matrix_power(Pi_T, N - i) for i in range(1, N)) * lr / (eps * N * K)
    assert_close(model.V, expected)
    assert torch.count_nonzero(model.W) == 0
    # V^(1) is circulant and its largest entry sits where Pi^T has p.
    V = model.V.detach()
    for i in range(K):
        assert_close(V[:, i], torch.roll(V[:, 0], i))
        assert V[:, i].argmax().item() == (i + 1) % K


@pytest.mark.parametrize("optimizer, weight_decay, model_options, schedule", [
    ("gd", 0.0, {}, "constant"),
    ("gd", 0.3, {}, "constant"),  # W_init, off the query direction, decays with W
    ("gd", 0.3, {}, "cosine"),  # ... at the step's learning rate
    ("gd", 0.3, {"normalize_tokens": True}, "constant"),
    ("adamw", 0.05, {"pos_embedding": "sine"}, "constant"),  # ||q||_1 = 10.2 and ||q||^2 = 8: neither scale is 1
    ("adamw", 0.05, {}, "cosine"),
])
def test_training_u_trains_the_papers_W(optimizer, weight_decay, model_options, schedule):
    """Explicit steps on the paper's full W (and V), with its own optimiser, move u = W q as the
    model's training does: exactly for gradient descent, with and without weight decay (the whole W
    then matches); up to Adam's eps for AdamW (only u = W q enters the forward pass there). With the cosine
    schedule step t of 4 runs at lr (1 + cos(pi t / 4)) / 2."""
    task = CircleWalk(5, 0.7, 9)
    options = dict(pos_dim=16, init="gaussian", init_sigma=0.05, seed=1, **model_options)
    model, ref = paper_model(task, **options), paper_model(task, **options)
    lr = 0.5 if optimizer == "gd" else 0.01
    q = ref.query_vector()
    W0, u0 = ref.W.clone(), ref.u.detach().clone()
    W = ref.W.clone().requires_grad_(True)
    V = ref.V.detach().clone().requires_grad_(True)
    explicit = (GradientDescent if optimizer == "gd" else torch.optim.AdamW)([W, V], lr=lr, weight_decay=weight_decay)
    pop = task.population()
    for t in range(4):
        for group in explicit.param_groups:
            group["lr"] = lr * (1 + math.cos(math.pi * t / 4)) / 2 if schedule == "cosine" else lr
        with torch.no_grad():
            ref.blocks[0].attn.W_V[0].copy_(V.T)
            ref.blocks[0].attn.u.copy_(W @ q)
        X = torch.nn.functional.one_hot(pop.tokens, 6)[..., :5].double()
        Xt = torch.cat([X, ref.W_pos[:, 5:].expand(len(pop), -1, -1)], -1)
        keys = Xt / Xt.norm(dim=-1, keepdim=True) if model.cfg.normalize_tokens else Xt
        S = torch.softmax(keys @ (W @ q), -1)
        f = torch.einsum("bn,bnk->bk", S, X) @ V.T
        loss = -(pop.weights * torch.log(f.gather(1, pop.labels[:, None])[:, 0] + 1.0)).sum()
        explicit.zero_grad()
        loss.backward()
        explicit.step()
    train(model, task, TrainConfig(lr=lr, eps=1.0, steps=4, population=True, optimizer=optimizer,
                                   weight_decay=weight_decay, lr_schedule=schedule), progress=False)
    if optimizer == "gd":
        assert_close(model.W, W)
        assert_close(model.V, V)
    else:
        moved = (W.detach() @ q - u0).abs().max()
        assert moved > 0.01
        assert (model.u.detach() - W.detach() @ q).abs().max() < 1e-3 * moved
        assert torch.allclose(model.V.detach(), V.detach(), atol=1e-6)
    assert not torch.allclose(W.detach(), W0)


@pytest.mark.parametrize("p", [0.0, 1.0])
@pytest.mark.parametrize("loss", ["log", "xent", "squared"])
def test_theorem_4_1_deterministic_walk_never_breaks_symmetry(loss, p):
    """p in {0, 1}, N = rK + 1, zero init, population GD, any loss: uniform attention over the real tokens,
    V proportional to all-ones and accuracy exactly 1/K, at every step."""
    K, r = 4, 3
    N = r * K + 1
    task = CircleWalk(K, p, N)
    model = paper_model(task, pos_dim=32)
    pop = task.population()
    for step in range(6):
        train(model, task, TrainConfig(lr=1.0, steps=1, loss=loss, population=True), progress=False)
        pattern = model.attention(pop.tokens).detach()[:, 0, 0]  # layer 0, head 0
        real = pattern[:, : N - 1]
        assert torch.allclose(real, real[:, :1].expand_as(real), rtol=1e-12, atol=0), step
        V = model.V.detach()
        # Proportional to all-ones (for cross-entropy the constant stays 0 up to round-off).
        assert (V.max() - V.min()).item() <= 1e-12 * V.abs().max().item() + 1e-15, step
        if loss != "xent":
            assert V.abs().min() > 0
        f = model(pop.tokens)[:, 0].detach()
        assert accuracy(f, pop.labels, pop.weights) == pytest.approx(1 / K, abs=1e-12)


@pytest.mark.parametrize("p", [0.5, 0.7])
def test_paper_setting_reaches_bayes_accuracy_and_attends_to_the_parent(trained_paper_models, p):
    model, task, result = trained_paper_models[p]
    final = result.final
    bayes = max(p, 1 - p)
    se = math.sqrt(bayes * (1 - bayes) / 1000)
    assert abs(final["test_accuracy"] - bayes) < 3 * se
    assert final["parent_attention"] > 0.99
    assert final["v_distance"] < 0.35
    # The step-2 lock-on: W is still 0 after step 1 (attention uniform, 1/N on every position), and the
    # second step puts the attention on the parent up to exp(-Omega(N)) (Theorem 3.1, part 4).
    assert [h["parent_attention"] for h in result.history[:2]] == pytest.approx([1 / 97, 1 / 97], rel=1e-12)
    assert result.history[2]["parent_attention"] > 1 - 1e-6


def test_V_grows_like_the_square_root_of_lr_t_along_Pi_T():
    """Once attention sits on the parent, f = V x_{N-1} and the population gradient on V's entry (y, x) is
    -Pi[x, y] / (K (V[y, x] + eps)): so (V + eps)^2 grows by 2 lr Pi[x, y] / K per step on the entries
    where Pi^T is non-zero (beta(t) ~ sqrt(lr t) of Theorem 3.1's proof), up to a discretisation term
    of relative size lr Pi / (K (V + eps)^2), below 1e-3 here."""
    K, N, lr, eps = 5, 9, 1.0, 0.1
    task = CircleWalk(K, 0.7, N)
    model = paper_model(task, pos_dim=16)
    seen = {}
    train(model, task, TrainConfig(lr=lr, eps=eps, steps=400, population=True), progress=False,
          callback=lambda step, m, record: seen.update({step: m.V.detach().clone()}) if step in (200, 400) else None)
    Pi_T = task.transition_matrix().T
    on = Pi_T > 0
    growth = ((seen[400] + eps) ** 2 - (seen[200] + eps) ** 2) / 200
    assert torch.allclose(growth[on], 2 * lr * Pi_T[on] / K, rtol=2e-3)


def test_the_loss_is_minus_log_of_the_raw_score_plus_eps():
    """Not softmax cross-entropy: the raw score of the label, and negative once it exceeds 1 - eps."""
    from rwinterp.losses import per_sample_loss

    scores = torch.tensor([[2.0, 0.0, -0.05], [0.3, 0.1, 0.0]], dtype=torch.float64)
    loss = per_sample_loss("log", scores, torch.tensor([0, 2]), 0.1)
    assert loss.tolist() == pytest.approx([-math.log(2.1), -math.log(0.1)], rel=1e-15)
    assert loss[0] < 0
    # The squared loss is half the squared distance to the one-hot label.
    squared = per_sample_loss("squared", scores, torch.tensor([0, 2]), 0.1)
    assert squared.tolist() == pytest.approx([0.5 * (1 + 0 + 0.0025), 0.5 * (0.09 + 0.01 + 1)], rel=1e-15)


def test_training_is_reproducible():
    task = CircleWalk(6, 0.7, 17)
    runs = []
    for _ in range(2):
        model = paper_model(task, pos_dim=64, init="gaussian", seed=5)
        runs.append((train(model, task, TrainConfig(steps=5, seed=9), progress=False).history, model.V.detach()))
    assert runs[0][0] == runs[1][0] and torch.equal(runs[0][1], runs[1][1])


def test_a_diverging_loss_stops_and_keeps_the_last_good_state():
    task = CircleWalk(4, 0.7, 9)
    model = paper_model(task, pos_dim=16)
    with pytest.raises(TrainingDiverged, match="at step 1; the model keeps the state after step 0"):
        train(model, task, TrainConfig(lr=1e200, loss="squared", steps=3, population=True), progress=False)
    assert torch.count_nonzero(model.V) == 0  # the state after step 0 is the zero initialisation
    assert not model.training  # left in evaluation mode, as after training (transformer_lens.patching needs it)


@pytest.mark.parametrize("optimizer, extra", [("sgd", {"batch_size": 64}), ("adamw", {"lr": 0.05})])
def test_other_optimizers_learn_the_walk(optimizer, extra):
    task = CircleWalk(5, 0.8, 17)
    model = paper_model(task, pos_dim=64)
    cfg = dict(steps=40, optimizer=optimizer, n_train=300, n_test=500, loss="xent")
    cfg.update(extra)
    result = train(model, task, TrainConfig(**cfg), progress=False)
    assert result.final["test_accuracy"] > 0.7


@pytest.mark.parametrize("K, dtype", [(5, "float64"), (7, "float32")])
def test_deterministic_walk_keeps_exact_symmetry_with_sampled_walks(K, dtype):
    """Theorem 4.1 with a finite training set, for K whose V has entries beyond a SIMD block: exactly
    orthogonal embeddings keep attention uniform and every row of V constant, bit for bit."""
    N = 4 * K + 1
    task = CircleWalk(K, 1.0, N)
    # After one step from zero init (f = 0, so -dl/df_y = 1/eps; uniform attention 1/N on the N - 1 = 4K
    # tokens, each state 4 times): V = lr/(eps N n) count_y 4 1^T, count_y the training walks labelled y.
    model = paper_model(task, pos_dim=64, dtype=dtype)
    config = TrainConfig(steps=1, n_train=300, n_test=300)
    train(model, task, config, progress=False)
    counts = torch.bincount(make_data(task, config)[0].labels, minlength=K).to(torch.float64)
    expected = (counts * 4 / (0.1 * N * 300))[:, None].expand(K, K)
    if dtype == "float64":
        assert_close(model.V, expected)
    else:  # sums over 300 walks in float32: a few float32 ulps (1.2e-7 each)
        assert torch.allclose(model.V.detach().double(), expected, rtol=1e-5)
    model = paper_model(task, pos_dim=64, dtype=dtype)
    result = train(model, task, TrainConfig(steps=30, n_train=300, n_test=300), progress=False)
    V = model.V.detach()
    assert torch.equal(V, V[:, :1].expand_as(V))
    pattern = model.attention(task.sample(20, 1).tokens).detach()[:, 0, 0, : N - 1]
    assert torch.equal(pattern, pattern[:, :1].expand_as(pattern))
    assert all(abs(h["test_accuracy"] - 1 / K) < 4 * math.sqrt((1 / K) * (1 - 1 / K) / 300)
               for h in result.history)


@pytest.mark.parametrize("weighted", [False, True])
def test_evaluation_numbers_of_a_stack_are_each_models_own(weighted):
    """Training evaluates a stack of models at once: each model's accuracy and parent attention equal, bit for bit,
    those of the model alone (its samples summed as one row), and each V's distance from Pi that of V alone."""
    from rwinterp.metrics import (accuracy_tensor, parent_attention_tensor, transition_distance,
                                  transition_distance_tensor)

    gen = torch.Generator().manual_seed(0)
    models, batch, K, N = 4, 300, 5, 9
    scores = torch.randn(models, batch, K, generator=gen, dtype=torch.float64)
    scores[0, :10] = 1.0  # ties, broken towards the smallest label
    labels = torch.randint(K, (models, batch), generator=gen)
    pattern = torch.softmax(torch.randn(models, batch, N, generator=gen, dtype=torch.float64), -1)
    weights = torch.rand(models, batch, generator=gen, dtype=torch.float64) if weighted else None
    own = (lambda i: None) if weights is None else (lambda i: weights[i])
    stacked = accuracy_tensor(scores, labels, weights)
    attention = parent_attention_tensor(pattern, (6, 7), weights)
    assert stacked.shape == attention.shape == (models,)
    for i in range(models):
        assert torch.equal(stacked[i], accuracy_tensor(scores[i], labels[i], own(i)))
        assert torch.equal(attention[i], parent_attention_tensor(pattern[i], (6, 7), own(i)))
        w = torch.full((batch,), 1 / batch, dtype=torch.float64) if weights is None else weights[i]
        assert_close(attention[i], (pattern[i, :, 6:8].sum(-1) * w).sum())
    Pi = CircleWalk(K, 0.3, N).transition_matrix()
    scales = torch.tensor([1e-300, 1.0, 1e300, 0.0], dtype=torch.float64)
    Vs = torch.randn(models, K, K, generator=gen, dtype=torch.float64) * scales[:, None, None]
    distances = transition_distance_tensor(Vs, Pi)
    assert distances[3].isnan() and math.isnan(transition_distance(Vs[3], Pi))
    for i in range(3):
        assert distances[i] == transition_distance(Vs[i], Pi)
        V = Vs[i] / Vs[i].abs().max()
        assert_close(distances[i], (V / V.norm() - Pi.T / Pi.norm()).norm())
