"""A standard 1-layer attention-only TransformerLens model (rwinterp.bridge) trained on random walks by the
library's training loop and saved as a run.

Walks on a circle of K=5 states: uniform start, then each step is +1 (mod K) with probability
p=0.8 and -1 otherwise. The next state depends only on the current one, so the Bayes-optimal
next-token accuracy is 0.8 at every position and the optimal predictive distribution is the
row ``Pi[x_t]`` of the transition matrix.

What the trained model does (the tests below, one model and data seed; the ``-s`` output prints
the measured values): it reaches the Bayes accuracy and its predictive distributions are close to
``Pi``. Its attention does not sit on the diagonal: it spreads over the earlier positions that
hold the same state as the current one, which makes the attention output a function of the
current state alone, as attending to oneself would. The OV circuit alone,
``softmax(W_E W_V W_O W_U)``, is further from ``Pi`` than the whole logit function of the current
state, because the direct path carries part of it and the split of a constant vector between
``W_E`` and ``W_pos`` is arbitrary (``W_E + c``, ``W_pos - c`` is the same model), so that vector
acts as a column bias on the logits. The circuit that matches ``Pi`` is the direct path + OV path
applied to ``W_E + mean_t W_pos[t]``, plus the constant bias terms ``(b_V W_O + b_O) W_U + b_U``.

The module runs on one intra-op thread (see ``single_thread``); the setting is restored after it.
"""

from __future__ import annotations

import math

import pytest
import torch

from rwinterp.bridge import attn_scores_from_cache, build_bridge, hook_free_logits
from rwinterp.config import BridgeOptions, TrainConfig
from rwinterp.errors import RwinterpError
from rwinterp.runs import load_run, save_run, train_forward
from rwinterp.tasks import CircleWalk, circle_transition
from rwinterp.training import logits_and_pattern, train

K = 5
P = 0.8
LENGTH = 16
D_MODEL = 16
STEPS = 200
LR = 2e-2
N_TRAIN = 1024
N_TEST = 4000
MODEL_SEED = 0
DATA_SEED = 1
TEST_SEED = 2


TASK = CircleWalk(K, P, LENGTH)


def random_walks(n: int, seed: int) -> torch.Tensor:
    """``[n, LENGTH]`` walks on the circle of K states (the task's whole walks s_1..s_N)."""
    return TASK.sample(n, seed).states


def bridge(**options) -> torch.nn.Module:
    return build_bridge(BridgeOptions(**{"n_states": K, "n_ctx": LENGTH, "n_layers": 1, "d_model": D_MODEL,
                                         "seed": MODEL_SEED, **options}))


def weights(model) -> dict[str, torch.Tensor]:
    """Detached copies of the TransformerLens weight views."""
    names = ("W_E", "W_pos", "W_Q", "W_K", "W_V", "W_O", "W_U", "b_Q", "b_K", "b_V", "b_O", "b_U")
    with torch.no_grad():
        return {name: getattr(model, name).detach().clone() for name in names}


def mean_kl_from_pi(logits: torch.Tensor, pi: torch.Tensor) -> float:
    """Mean over rows (every leading index) of KL(pi[i] || softmax(logits[i]))."""
    log_q = logits.float().log_softmax(dim=-1)
    return float((torch.xlogy(pi, pi) - pi * log_q).sum(dim=-1).mean())


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """Run this module on one intra-op thread, restoring the setting afterwards.

    The models are tiny; on a CPU shared with other work, extra intra-op threads can make them
    far slower than one thread.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


CONFIG = TrainConfig(optimizer="adamw", lr=LR, steps=STEPS, loss="xent", next_token=True, n_train=N_TRAIN,
                     n_test=N_TEST, eval_every=STEPS)


@pytest.fixture(scope="module")
def trained(single_thread):
    model = bridge()
    result = train(model, TASK, CONFIG, data=(TASK.sample(N_TRAIN, DATA_SEED), TASK.sample(N_TEST, TEST_SEED)),
                   progress=False)
    losses = [h["loss"] for h in result.history]
    test = random_walks(N_TEST, seed=TEST_SEED)
    with torch.no_grad():
        logits, cache = model.run_with_cache(test)
    return model, losses, test, logits, cache


def test_training_reduces_loss_to_entropy(trained):
    _, losses, _, _, _ = trained
    entropy = -(P * math.log(P) + (1 - P) * math.log(1 - P))  # 0.5004 nats
    assert len(losses) == 2  # evaluated at the first and the last step
    assert losses[0] > 1.5  # ~log(5) at init
    assert abs(losses[-1] - entropy) < 0.05, (losses[-1], entropy)


def test_accuracy_matches_bayes(trained):
    model, _, test, logits, _ = trained
    assert not model.training
    pred = logits.argmax(dim=-1)[:, :-1]  # prediction made at position t for target t + 1
    per_position = (pred == test[:, 1:]).float().mean(dim=0)  # targets at positions 1..15
    mean_acc = float(per_position.mean())
    assert abs(mean_acc - P) < 0.03, per_position
    assert float((per_position - P).abs().max()) < 0.05, per_position
    # Stronger: the argmax is the Bayes prediction (current state + 1) almost everywhere.
    agree = float((pred == (test[:, :-1] + 1) % K).float().mean())
    assert agree > 0.99, agree
    # And the predictive distributions are close to Pi[x_t].
    pi = circle_transition(K, P)
    target = pi[test[:, :-1]]
    model_kl = mean_kl_from_pi(logits[:, :-1], target)
    assert model_kl < 0.03, model_kl


def test_attention_reads_the_current_state(trained):
    _, _, test, _, cache = trained
    pattern = cache["blocks.0.attn.hook_pattern"][:, 0]  # [batch, query, key], 1 head
    assert torch.allclose(pattern.sum(dim=-1), torch.ones(()), atol=1e-5)
    assert float(pattern.triu(diagonal=1).abs().max()) == 0.0  # causal
    # Mass on keys that hold the same state as the query, for queries t >= 1.
    same_state = (test[:, :, None] == test[:, None, :]).float()
    mass_same = (pattern * same_state).sum(dim=-1)[:, 1:].mean(dim=0)
    assert float(mass_same.mean()) > 0.9, mass_same
    assert float(mass_same.min()) > 0.85, mass_same
    # The diagonal alone is not where the mass goes (printed below): the model attends to
    # every earlier occurrence of the current state, not only to itself. Kept as a report,
    # not an assertion on a particular value.
    diag = pattern.diagonal(dim1=-2, dim2=-1)[:, 1:].mean()
    print(f"self-attention (t>=1) {float(diag):.3f}, same-state mass {float(mass_same.mean()):.3f}")


def test_circuit_matches_transition_matrix(trained):
    model, _, _, _, _ = trained
    w = weights(model)
    pi = circle_transition(K, P)
    ov = w["W_V"][0, 0] @ w["W_O"][0, 0] @ w["W_U"]  # [d_model, d_vocab]
    kl_ov = mean_kl_from_pi(w["W_E"] @ ov, pi)
    kl_direct = mean_kl_from_pi(w["W_E"] @ w["W_U"], pi)
    kl_sum = mean_kl_from_pi(w["W_E"] @ (w["W_U"] + ov), pi)
    # Current-state part of the logits: embedding of state i at the mean position, through the
    # direct path and (attention reads the same state) the OV path, plus constant biases.
    embed = w["W_E"] + w["W_pos"][: LENGTH - 1].mean(dim=0)
    bias = (w["b_V"][0, 0] @ w["W_O"][0, 0] + w["b_O"][0]) @ w["W_U"] + w["b_U"]
    circuit = embed @ (w["W_U"] + ov) + bias  # [K, K], row = current state
    kl_full = mean_kl_from_pi(circuit, pi)
    print(
        f"KL(Pi || softmax(.)): OV only {kl_ov:.3f}, direct only {kl_direct:.3f}, "
        f"W_E(direct+OV) {kl_sum:.3f}, with mean W_pos and biases {kl_full:.4f}"
    )
    assert kl_full < 0.03, (kl_ov, kl_direct, kl_sum, kl_full)
    probs = circuit.softmax(dim=-1)
    up = probs[torch.arange(K), (torch.arange(K) + 1) % K]
    down = probs[torch.arange(K), (torch.arange(K) - 1) % K]
    assert torch.equal(probs.argmax(dim=-1), (torch.arange(K) + 1) % K)
    # Rows deviate a little from Pi because W_pos is replaced by its mean.
    assert float((up - P).abs().max()) < 0.15, probs
    assert float((down - (1 - P)).abs().max()) < 0.15, probs
    # The OV path alone is not the transition matrix: the direct path carries part of it.
    assert kl_ov > kl_full


def test_a_bridge_is_a_run_like_any_model(trained, tmp_path):
    model, _, test, logits, _ = trained
    save_run(tmp_path / "run", model, TASK, CONFIG.to_dict(), [], {})
    run = load_run(tmp_path / "run")
    config = __import__("json").loads((tmp_path / "run" / "config.json").read_text())
    assert config["model_kind"] == "bridge" and config["model"]["d_model"] == D_MODEL
    assert not run.model.training and run.task.to_dict() == TASK.to_dict()
    with torch.no_grad():
        assert torch.equal(run.model(test), logits)
    for name, value in weights(model).items():
        assert torch.equal(weights(run.model)[name], value), name


def test_run_with_cache_and_hooks(trained):
    from transformer_lens import ActivationCache

    model, _, test, logits, cache = trained
    batch = test.shape[0]
    assert isinstance(cache, ActivationCache)
    assert cache["blocks.0.attn.hook_pattern"].shape == (batch, 1, LENGTH, LENGTH)
    assert cache["hook_embed"].shape == (batch, LENGTH, D_MODEL)
    assert cache["hook_pos_embed"].shape == (batch, LENGTH, D_MODEL)
    assert cache["blocks.0.hook_resid_pre"].shape == (batch, LENGTH, D_MODEL)
    assert cache["blocks.0.attn.hook_v"].shape == (batch, LENGTH, 1, D_MODEL)
    assert cache["blocks.0.attn.hook_z"].shape == (batch, LENGTH, 1, D_MODEL)
    assert cache["blocks.0.hook_attn_out"].shape == (batch, LENGTH, D_MODEL)
    assert logits.shape == (batch, LENGTH, K)
    # Quirk: hook_attn_scores carries the post-softmax pattern, not the scores.
    assert torch.equal(cache["blocks.0.attn.hook_attn_scores"], cache["blocks.0.attn.hook_pattern"])
    scores = attn_scores_from_cache(model, cache, 0)
    assert torch.allclose(scores.softmax(dim=-1), cache["blocks.0.attn.hook_pattern"], atol=1e-6)
    # run_with_hooks: editing the pattern changes the output.
    tokens = test[:8]
    uniform = torch.tril(torch.ones(LENGTH, LENGTH))
    uniform = uniform / uniform.sum(dim=-1, keepdim=True)
    with torch.no_grad():
        edited = model.run_with_hooks(
            tokens, fwd_hooks=[("blocks.0.attn.hook_pattern", lambda p, hook: uniform.expand_as(p))]
        )
    assert float((edited - logits[:8]).abs().max()) > 1e-2


def test_activation_patching_resid_pre(trained):
    from transformer_lens.patching import get_act_patch_resid_pre

    model, _, test, _, _ = trained
    clean, corrupted = test[:16], (test[:16] + 1) % K
    with torch.no_grad():
        clean_logits, clean_cache = model.run_with_cache(clean)
    answer = (clean[:, -1] + 1) % K

    def metric(logits: torch.Tensor) -> torch.Tensor:
        return logits[torch.arange(len(answer)), -1, answer].mean()

    with torch.no_grad():
        result = get_act_patch_resid_pre(model, corrupted, clean_cache, metric)
    assert result.shape == (1, LENGTH)
    # Corrupted = every state shifted by +1. Patching the clean residual into the last position
    # restores most of the clean metric there: the last query then looks for its (clean) state,
    # and the corrupted positions holding that state carry the same token embedding.
    clean_value = float(metric(clean_logits))
    with torch.no_grad():
        corrupted_value = float(metric(model(corrupted)))
    gap = clean_value - corrupted_value
    assert gap > 5.0, (clean_value, corrupted_value)
    assert abs(float(result[0, -1]) - clean_value) < 0.1 * gap, result
    # Patching any earlier position leaves the last-position metric at its corrupted value.
    assert float((result[0, :-1] - corrupted_value).abs().max()) < 0.1 * gap, result


def test_build_is_reproducible_and_weights_have_tl_shapes():
    a = build_bridge(BridgeOptions(n_states=7, n_ctx=12, d_model=16, n_layers=2, n_heads=4, seed=3))
    b = build_bridge(BridgeOptions(n_states=7, n_ctx=12, d_model=16, n_layers=2, n_heads=4, seed=3))
    c = build_bridge(BridgeOptions(n_states=7, n_ctx=12, d_model=16, n_layers=2, n_heads=4, seed=4))
    wa, wb, wc = weights(a), weights(b), weights(c)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["W_E"], wc["W_E"])
    assert wa["W_E"].shape == (7, 16)
    assert wa["W_pos"].shape == (12, 16)
    for name in ("W_Q", "W_K", "W_V"):
        assert wa[name].shape == (2, 4, 16, 4), name
    assert wa["W_O"].shape == (2, 4, 4, 16)
    assert wa["W_U"].shape == (16, 7)
    # Conventions: q = resid @ W_Q + b_Q, logits = resid_final @ W_U + b_U.
    tokens = torch.randint(0, 7, (3, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, cache = a.run_with_cache(tokens)
    q = torch.einsum("bpd,hde->bphe", cache["blocks.1.hook_resid_pre"], wa["W_Q"][1]) + wa["b_Q"][1]
    torch.testing.assert_close(q, cache["blocks.1.attn.hook_q"])
    final = cache["blocks.1.hook_resid_post"]
    torch.testing.assert_close(final @ wa["W_U"] + wa["b_U"], logits)


@pytest.mark.parametrize("options", [dict(), dict(norm="LN", n_heads=2, d_head=3),
                                     dict(attn_only=False, norm="LN", n_heads=2), dict(attn_only=False, d_head=3)])
def test_training_computes_the_bridge_without_its_hooks(options):
    """Training reads no hook, so it computes the bridge's logits from its weights (``hook_free_logits``, fused
    attention): the logits and every gradient equal those of ``model(tokens)`` up to round-off (float64, two
    layers); with a hook attached the model runs through its hooks, and the hook fires."""
    model = bridge(n_layers=2, dtype="float64", **options)
    assert train_forward(model) is hook_free_logits
    tokens = random_walks(8, seed=3)
    weight = torch.randn(8, LENGTH, K, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    params = list(model.parameters())
    fast, slow = hook_free_logits(model, tokens), model(tokens)
    torch.testing.assert_close(fast, slow, rtol=1e-12, atol=1e-12 * float(slow.detach().abs().max()))
    expected = torch.autograd.grad((slow * weight).sum(), params)
    scale = max(float(g.abs().max()) for g in expected)  # (b_K's gradient is 0 but for round-off)
    for got, want in zip(torch.autograd.grad((fast * weight).sum(), params), expected):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12 * scale)
    # evaluation steps: each layer's attention row at the label's query, as the hooks record it
    for row in (-1, -2):
        with torch.no_grad():
            slow, heads = logits_and_pattern(model, tokens, row)
            fast, rows = hook_free_logits(model, tokens, row)
        torch.testing.assert_close(fast, slow, rtol=1e-12, atol=1e-12 * float(slow.abs().max()))
        assert len(rows) == len(heads) == 2
        for got, want in zip(rows, heads):
            assert got.shape == (8, options.get("n_heads", 1), LENGTH) and not got.requires_grad
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
        picked = hook_free_logits(model, tokens, row, keys=[0, LENGTH - 2])[1]
        assert [p.shape[-1] for p in picked] == [2, 2] and torch.equal(picked[1], rows[1][..., [0, LENGTH - 2]])
    fired = []
    model.blocks[1].attn.hook_pattern.add_hook(lambda pattern, hook: fired.append(pattern.shape))
    try:
        torch.testing.assert_close(hook_free_logits(model, tokens), model(tokens), rtol=0, atol=0)
        logits, rows = hook_free_logits(model, tokens, -2)
        torch.testing.assert_close(rows[1], heads[1], rtol=0, atol=0)  # (the hooks' own row -2, above)
    finally:
        model.reset_hooks()
    assert fired == [(8, options.get("n_heads", 1), LENGTH, LENGTH)] * 3


def test_training_without_hooks_follows_the_bridge_itself():
    """Training the bridge through ``hook_free_logits`` follows the trajectory of training it through its own
    forward pass (a model with a do-nothing hook attached): every loss, every evaluation's attention on the
    parents (each head's, from its hook-free row) and every weight to 1e-10 relative (float64)."""
    config = TrainConfig(optimizer="adamw", lr=1e-2, steps=20, loss="xent", next_token=True, batch_size=16,
                         n_train=64, n_test=64, seed=7, eval_every=5)
    fast, hooked = bridge(n_layers=2, dtype="float64"), bridge(n_layers=2, dtype="float64")
    hooked.blocks[0].hook_resid_pre.add_hook(lambda resid, hook: None)
    runs = [train(model, TASK, config, progress=False).history for model in (fast, hooked)]
    hooked.reset_hooks()
    for a, b in zip(*runs):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-10)
        assert a["test_loss"] == pytest.approx(b["test_loss"], rel=1e-10)
        assert sum(a["parent_attention_heads"], []) == pytest.approx(sum(b["parent_attention_heads"], []), rel=1e-10)
    # b_K moves the scores of a query by a constant, which the softmax ignores: its gradient is round-off, which
    # Adam scales up to full steps, so it is the one weight that the two paths leave apart
    for name, value in weights(hooked).items():
        if name != "b_K":
            torch.testing.assert_close(weights(fast)[name], value, rtol=1e-10, atol=1e-10 * float(value.abs().max()))
    tokens = random_walks(8, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(fast(tokens), hooked(tokens), rtol=1e-10, atol=0)


def test_training_is_deterministic():
    config = TrainConfig(optimizer="adamw", lr=1e-2, steps=6, loss="xent", next_token=True, batch_size=16,
                         n_train=64, n_test=64, seed=7)
    runs = []
    for _ in range(2):
        model = bridge(d_model=8, seed=1)
        history = train(model, TASK, config, progress=False).history
        runs.append((history, weights(model)))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(runs[0][1][k], runs[1][1][k]) for k in runs[0][1])
    other = train(bridge(d_model=8, seed=1), TASK, config.replace(seed=8), progress=False).history
    assert [h["loss"] for h in other] != [h["loss"] for h in runs[0][0]]  # other data and mini-batches


def test_bad_inputs_raise():
    """Each refusal is the library's own one-line error (TransformerLens would raise ValueErrors of its own)."""
    with pytest.raises(RwinterpError, match="d_model = 10 is not divisible by 3 heads: give d_head"):
        BridgeOptions(n_states=5, n_ctx=16, d_model=10, n_heads=3)
    with pytest.raises(RwinterpError, match="norm must be one of none, LN, got 'RMS'"):
        BridgeOptions(norm="RMS")
    with pytest.raises(RwinterpError, match="train it with next-token prediction"):
        train(bridge(), TASK, TrainConfig(steps=1), progress=False)
