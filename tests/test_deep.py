"""The multi-layer model: the paper's model as a special case, TransformerLens compatibility,
learning a second-order chain, the zero-initialisation symmetry with depth, runs and the CLI."""

import json
import math
import re
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformer_lens.ActivationCache import ActivationCache
from transformer_lens.patching import get_act_patch_attn_head_out_all_pos, get_act_patch_resid_pre

from rwinterp.chains import PersistentWalk
from rwinterp.cli import main
from rwinterp.model import DeepConfig, DeepTransformer
from rwinterp.errors import RwinterpError
from rwinterp.metrics import accuracy
from rwinterp.runs import load_run, save_run
from rwinterp.tasks import CircleWalk
from rwinterp.training import TrainConfig, train
from tests.conftest import F32, assert_close, full_w_copy, paper_model


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These tensors are tiny: with two threads on a busy machine, thread hand-offs cost ten times
    the arithmetic. The previous setting is restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------- the rank-one query is a path
@pytest.mark.parametrize("options", [
    {},
    {"pos_embedding": "sine"},
    {"normalize_tokens": True},
    {"normalize_tokens": True, "normalize_query": False},
    {"mlp_width": 4},
    {"mlp_width": 4, "act_fn": "linear"},
])
def test_the_rank_one_query_gives_the_full_models_outputs(options):
    """Storing only u = W x~_N computes what the whole W computes: outputs, attention, hooked edits of the
    query slot's input, and the gradient at the embeddings."""
    task = CircleWalk(5, 0.7, 9)
    paper = paper_model(task, pos_dim=24, init="gaussian", init_sigma=0.3, seed=1, **options)
    full = full_w_copy(paper)
    tokens = task.sample(64, 0).tokens
    with torch.no_grad():
        expected = paper(tokens)
        assert expected.abs().max() > 0.1  # not a trivially zero output
        assert_close(full(tokens), expected)
        assert_close(full.attention(tokens), paper.attention(tokens))
    assert torch.equal(full.V, paper.V)
    # Hooks that edit the query slot's input reach the query in both (the rank-one path uses u = W x~_N only
    # while that row is x~_N), and the gradient includes the query's path through W.
    shift = torch.linspace(-1.0, 1.0, paper.cfg.d_model, dtype=torch.float64)
    for edit in (lambda a: a.flip(-1), lambda a: a + shift):
        def hook(act, hook):
            return torch.cat([act[:, :-1], edit(act[:, -1:])], dim=1)

        for name in ("hook_pos_embed", "blocks.0.hook_resid_pre"):
            with torch.no_grad():
                edited = paper.run_with_hooks(tokens, fwd_hooks=[(name, hook)])
                assert (edited - expected).abs().max() > 1e-3  # the edit changes the output
                assert_close(full.run_with_hooks(tokens, fwd_hooks=[(name, hook)]), edited)
    grads = []
    for model in (paper, full):
        store = {}

        def save(grad, hook):
            store["g"] = grad

        out = model.run_with_hooks(tokens, bwd_hooks=[("blocks.0.hook_resid_pre", save)], reset_hooks_end=False)
        out[:, -1].sum().backward()
        model.reset_hooks()
        model.zero_grad()
        grads.append(store["g"])
    assert grads[0][:, -1].abs().max() > 1e-3
    assert_close(grads[1], grads[0])


def test_the_rank_one_query_trains_like_the_whole_W():
    """Gradient descent on the whole merged W is gradient descent on u = W x~_N with the learning rate scaled
    by ||x~_N||^2: same W, V and history after 3 population steps."""
    task = CircleWalk(5, 0.7, 9)
    paper = paper_model(task, pos_dim=16, init="gaussian", init_sigma=0.05, seed=3)
    full = full_w_copy(paper)
    config = TrainConfig(lr=0.5, eps=1.0, steps=3, population=True)
    a = train(paper, task, config, progress=False)
    b = train(full, task, config, progress=False)
    assert_close(full.W.detach(), paper.W)
    assert_close(full.V.detach(), paper.V.detach())
    for ra, rb in zip(a.history, b.history):
        assert_close(rb["loss"], ra["loss"])
        assert rb["test_accuracy"] == ra["test_accuracy"]  # the same predictions, summed alike
        assert_close(rb["parent_attention"], ra["parent_attention"])


# ---------------------------------------------------------------------- TransformerLens compatibility
def _small(**options):
    base = dict(n_layers=2, n_heads=2, residual=True, init="gaussian", init_sigma=0.3, seed=4)
    base.update(options)
    return DeepTransformer(DeepConfig.paper(5, 7, 12, **base))


@pytest.mark.parametrize("options", [
    {},
    {"key_query": "factored", "attention": "causal", "mlp_width": 6, "normalize_tokens": True},
    {"pos_mode": "added", "d_model": 16, "pos_embedding": "learned", "token_embedding": "learned",
     "values": "all", "readout": "learned", "attn_scale": 2.0},
])
def test_hooks_weights_and_cache_follow_transformer_lens(options):
    model = _small(**options)
    cfg = model.cfg
    tokens = CircleWalk(5, 0.7, 7).sample(8, 1).tokens
    logits, cache = model.run_with_cache(tokens)
    assert isinstance(cache, ActivationCache)
    Q = 1 if cfg.attention == "query" else 7
    assert logits.shape == (8, Q, 5)
    assert_close(cache["hook_embed"], model.W_E[tokens])
    resid = cache["hook_embed"] + cache["hook_pos_embed"]
    for layer in range(cfg.n_layers):
        pre = cache[f"blocks.{layer}.hook_resid_pre"]
        assert_close(pre, resid)
        scores = cache[f"blocks.{layer}.attn.hook_attn_scores"]
        pattern = cache[f"blocks.{layer}.attn.hook_pattern"]
        assert scores.shape == pattern.shape == (8, cfg.n_heads, Q, 7)
        assert_close(torch.softmax(scores, -1), pattern)  # hook_attn_scores is pre-softmax
        # W_Q, W_K reproduce the scores: q . k / attn_scale (normalised rows where configured).
        x = pre / pre.norm(dim=-1, keepdim=True) if cfg.normalize_tokens else pre
        q = torch.einsum("bqm,hmd->bhqd", x[:, -Q:], model.W_Q[layer])
        k = torch.einsum("bpm,hmd->bhpd", x, model.W_K[layer])
        expected = torch.einsum("bhqd,bhpd->bhqp", q, k) / cfg.attn_scale
        visible = torch.isfinite(scores)
        assert_close(scores[visible], expected[visible])
        # W_V, W_O: the head outputs add up to attn_out.
        v = torch.einsum("bpm,hmd->bphd", pre, model.W_V[layer])
        assert_close(cache[f"blocks.{layer}.attn.hook_v"], v)
        attn_out = torch.einsum("bqhd,hdm->bqm", cache[f"blocks.{layer}.attn.hook_z"], model.W_O[layer])
        assert_close(cache[f"blocks.{layer}.hook_attn_out"], attn_out)
        resid = cache[f"blocks.{layer}.hook_resid_post"]
        assert resid.shape == (8, 7, cfg.d_model)
    assert_close(logits, resid[:, -Q:] @ model.W_U)
    # Editing a hook changes the output: uniform attention in the last layer.
    last = f"blocks.{cfg.n_layers - 1}.attn.hook_pattern"
    edited = model.run_with_hooks(tokens, fwd_hooks=[(last, lambda p, hook: torch.ones_like(p) / p.shape[-1])])
    assert not torch.allclose(edited, logits)


def test_transformer_lens_patching_functions_run_on_the_model():
    """resid_pre patching at layer 0 is token substitution; head-output patching has one cell per head."""
    model = _small().eval()
    task = CircleWalk(5, 0.7, 7)
    clean, corrupted = task.sample(16, 1), task.sample(16, 2)
    _, cache = model.run_with_cache(clean.tokens)

    def metric(logits):
        return logits[:, -1].gather(1, clean.labels[:, None]).mean()

    with torch.no_grad():
        patched = get_act_patch_resid_pre(model, corrupted.tokens, cache, metric)
        assert patched.shape == (2, 7)
        for j in range(7):
            tokens = corrupted.tokens.clone()
            tokens[:, j] = clean.tokens[:, j]
            # (TransformerLens stores the patched metrics in float32)
            assert float(patched[0, j]) == pytest.approx(float(metric(model(tokens))), rel=F32)
        heads = get_act_patch_attn_head_out_all_pos(model, corrupted.tokens, cache, metric)
    assert heads.shape == (2, 2)


# ---------------------------------------------------------------------- query mode without the stream
class LargestTensor(TorchDispatchMode):
    """Records the size of the largest tensor any operation returns while it is active, and every shape."""

    numel = 0

    def __init__(self):
        super().__init__()
        self.shapes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
                self.shapes.add(tuple(t.shape))
        return out


def with_and_without(model, tokens, hooks):
    """Logits, every parameter's gradient of ``sum(logits^2)`` and the :class:`LargestTensor` record, first with
    no hook, then with ``hooks``."""
    runs = []
    for fwd_hooks in ([], hooks):
        model.zero_grad()
        with LargestTensor() as largest:
            logits = model.run_with_hooks(tokens, fwd_hooks=fwd_hooks)
            logits.pow(2).sum().backward()
        runs.append((logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}, largest))
    return runs


@pytest.mark.parametrize("options", [
    {},
    {"n_layers": 2, "n_heads": 2, "residual": True},
    {"normalize_tokens": True, "token_norm": 3.0, "n_layers": 2},
    {"normalize_tokens": True, "normalize_query": False, "pos_embedding": "sine"},
    {"key_query": "factored", "attn_scale": 2.0, "n_heads": 2, "mlp_width": 4},
    {"values": "all", "readout": "learned", "n_layers": 2, "residual": True, "act_fn": "linear", "mlp_width": 3},
    {"token_embedding": "learned", "d_token": 3, "pos_embedding": "learned", "normalize_tokens": True},
    {"pos_mode": "added", "d_model": 12, "values": "all", "token_embedding": "learned",
     "pos_embedding": "learned", "normalize_tokens": True, "n_layers": 2, "residual": True},
])
def test_query_mode_without_the_stream_gives_the_streams_outputs_and_gradients(options):
    """In ``query`` mode the rows other than the query slot never change, and with no hook on them
    the model reads them through ``FixedRows`` tables instead of building ``[batch, pos, d_model]``.
    A hook on the residual stream forces the full stream: both give the same logits and the same
    gradient for every parameter, and the implicit path builds nothing of the stream's size."""
    K, N, B = 5, 9, 16
    options = {"n_ctx": N, "init": "gaussian", "init_sigma": 0.4, "seed": 2, **options}
    if options.get("pos_mode") == "added":
        cfg = DeepConfig(n_states=K, **options)
    else:
        cfg = DeepConfig.paper(K, pos_dim=24, **options)
    model = DeepTransformer(cfg)
    tokens = CircleWalk(K, 0.7, N).sample(B, 3).tokens
    (implicit, grads, small), (stream, stream_grads, large) = with_and_without(
        model, tokens, [("blocks.0.hook_resid_pre", lambda act, hook: act)])
    assert 0 < small.numel < B * (N - 1) * cfg.d_model / 2 < B * N * cfg.d_model <= large.numel
    assert stream.abs().max() > 0.1 and implicit.shape == stream.shape == (B, 1, K)
    assert_close(implicit, stream)
    assert set(grads) == set(stream_grads) and len(grads) >= 2
    for name, grad in grads.items():
        assert stream_grads[name].abs().max() > 0, name  # every parameter is reached
        assert_close(grad, stream_grads[name], what=name)


@pytest.mark.parametrize("attn_scale", [1.0, 4.0])
def test_fused_causal_attention_gives_the_explicit_paths_outputs_and_gradients(attn_scale):
    """With nothing hooking a causal layer's scores or pattern, it runs torch's fused attention and builds no
    ``[batch, H, pos, pos]`` pattern; a hook on the pattern forces the explicit softmax. Same logits and
    gradients for every parameter, up to round-off."""
    K, N, B = 5, 12, 16
    cfg = DeepConfig.standard(K, N, n_layers=2, n_heads=2, d_model=8, attn_scale=attn_scale, seed=4)
    model = DeepTransformer(cfg)
    tokens = CircleWalk(K, 0.7, N).sample(B, 3).tokens
    (fused, grads, fused_run), (explicit, explicit_grads, explicit_run) = with_and_without(
        model, tokens, [(f"blocks.{l}.attn.hook_pattern", lambda act, hook: act) for l in range(2)])
    pattern = (B, 2, N, N)
    assert pattern in explicit_run.shapes and pattern not in fused_run.shapes
    assert explicit.abs().max() > 0.1
    assert_close(fused, explicit)
    for name, grad in grads.items():
        assert explicit_grads[name].abs().max() > 0, name
        assert_close(grad, explicit_grads[name], what=name)


# ---------------------------------------------------------------------- Theorem 4.1 with depth
@pytest.mark.parametrize("options", [
    {"n_layers": 2, "residual": True},
    {"n_layers": 2, "residual": False},
    {"n_heads": 3},
    {"n_layers": 2, "residual": True, "values": "all"},
])
def test_depth_and_heads_keep_the_deterministic_walk_symmetric(options):
    """p = 1, N = rK + 1, zero init, population GD: every sequence has the same uniformly averaged
    token, so (as in Theorem 4.1) attention stays uniform over the real tokens in every layer and
    head and accuracy is exactly 1/K at every step, however deep or wide the model."""
    K, r = 4, 3
    N = r * K + 1
    task = CircleWalk(K, 1.0, N)
    pop = task.population()
    model = DeepTransformer(DeepConfig.paper(K, N, 16, **options))
    for step in range(4):
        train(model, task, TrainConfig(steps=1, population=True), progress=False)
        with torch.no_grad():
            real = model.attention(pop.tokens)[..., : N - 1]
            assert torch.allclose(real, real[..., :1].expand_as(real), rtol=1e-12, atol=0), step
            assert accuracy(model.scores(pop.tokens), pop.labels, pop.weights) == pytest.approx(1 / K, abs=1e-12)
    assert model.blocks[0].attn.W_V.detach().abs().max() > 0  # it did train


@pytest.mark.parametrize("K, options", [(6, {}), (6, {"n_heads": 2}), (7, {}), (5, {"n_layers": 2})])
def test_deterministic_walk_keeps_exact_symmetry_with_sampled_walks(K, options):
    """Theorem 4.1 with a finite training set, bit for bit, as for the paper's model: the rows of W_V
    (one per input token) stay equal and attention stays uniform over the real tokens. (Computing
    the values as ``pattern @ (X W_V)`` broke this on AVX-512 CPUs for K = 6 after about 25 steps.)"""
    N = 4 * K + 1
    task = CircleWalk(K, 1.0, N)
    model = DeepTransformer(DeepConfig.paper(K, N, 64, **options))
    result = train(model, task, TrainConfig(steps=40, n_train=500, n_test=300), progress=False)
    for block in model.blocks:
        W_V = block.attn.W_V.detach()
        assert torch.equal(W_V, W_V[:, :1].expand_as(W_V))
    pattern = model.attention(task.sample(20, 1).tokens)[..., : N - 1]
    assert torch.equal(pattern, pattern[..., :1].expand_as(pattern))
    assert model.blocks[0].attn.W_V.detach().abs().max() > 0  # it did train
    assert all(abs(h["test_accuracy"] - 1 / K) < 4 * math.sqrt((1 / K) * (1 - 1 / K) / 300)
               for h in result.history)


# ---------------------------------------------------------------------- a second-order chain
@pytest.fixture(scope="module")
def second_order():
    """A standard two-layer transformer (added learned positions, causal attention, residual
    stream, GPT-2 init) trained with AdamW on next-state prediction over the exact population of
    a persistent walk (K 5, q 0.8, N 6): the label depends on the last two states."""
    task = PersistentWalk(5, 0.8, 6)
    model = DeepTransformer(DeepConfig.standard(5, 6, 16, n_layers=2))
    result = train(model, task, TrainConfig(optimizer="adamw", lr=0.02, loss="xent", steps=200,
                                            next_token=True, population=True), progress=False)
    return model, task, result


def test_two_layer_model_reaches_the_bayes_accuracy_of_a_second_order_chain(second_order):
    model, task, result = second_order
    pop = task.population()
    acc = accuracy(model.scores(pop.tokens).detach(), pop.labels, pop.weights)  # exact expectation
    assert acc >= task.bayes_accuracy() - 0.02
    assert result.final["test_accuracy"] == acc


def test_counterfactual_edits_show_the_model_uses_both_parents(second_order):
    """Reversing the last step by editing one parent reverses the Bayes prediction; editing a
    token that is not a parent leaves it. The model follows in nearly every walk."""
    model, task, _ = second_order
    pop = task.population()
    K, N = 5, 6
    a, b = pop.tokens[:, N - 3], pop.tokens[:, N - 2]
    step = (b - a) % K  # 1 or K - 1
    with torch.no_grad():
        before = model.scores(pop.tokens).argmax(1)
        assert float(pop.weights[before == (b + step) % K].sum()) > 0.99  # keeps the direction
        edits = {  # position -> new token, and the prediction it should produce
            N - 3: ((b + step) % K, (b - step) % K),  # s_{N-2} moved to b's other side
            N - 2: ((a - step) % K, (a - 2 * step) % K),  # s_{N-1} moved to a's other side
        }
        for pos, (token, expected) in edits.items():
            tokens = pop.tokens.clone()
            tokens[:, pos] = token
            after = model.scores(tokens).argmax(1)
            assert float(pop.weights[after == expected].sum()) > 0.95, pos
        tokens = pop.tokens.clone()
        tokens[:, 0] = (tokens[:, 0] + 2) % K  # a non-parent
        assert float(pop.weights[model.scores(tokens).argmax(1) == before].sum()) > 0.98


def test_probes_locate_both_parents(second_order):
    from probes.attention import attention_probe
    from probes.config import ProbeConfig
    from probes.patching import patching_probe

    model, task, _ = second_order
    data = task.sample(300, 11)
    config = ProbeConfig(bootstrap=0, progress=False)
    scores = patching_probe(model, task, data, config).scores()
    assert scores["localization"] > 0.9  # the parents carry the effect of the input ...
    assert scores["necessity"] > 0.9  # ... corrupting them destroys the output ...
    assert scores["sufficiency"] > 0.9  # ... and keeping them keeps it
    # The query slot's first-layer attention goes to the two parents, both of them.
    with torch.no_grad():
        row = model.attention(data.tokens)[:, 0].mean((0, 1))  # [pos], layer 0, heads averaged
    assert float(row[[3, 4]].sum()) > 0.8 and float(row[3]) > 0.15 and float(row[4]) > 0.15
    result = attention_probe(model, task, data, config)
    assert result.per_head.shape[:2] == (2, 1)
    assert float(result.per_head.mean((2, 3)).max()) > 0.8


# ---------------------------------------------------------------------- errors, runs and the CLI
@pytest.mark.parametrize("options, message", [
    ({"n_layers": 0}, "the number of layers must be an integer in [1, 256], got 0"),
    ({"n_heads": 1.5}, "the number of heads must be an integer in [1, 256], got 1.5"),
    ({"pos_mode": "stacked"}, "pos mode must be one of concat, added"),
    ({"pos_dim": 5}, "orthogonal positional embeddings need M >= N"),
    ({"pos_mode": "added", "values": "all"}, "added positional embeddings need d_model"),
    ({"pos_mode": "added", "d_model": 32}, "values='tokens' needs concatenated positional embeddings"),
    ({"pos_mode": "added", "d_model": 4, "values": "all", "pos_embedding": "learned"},
     "one-hot tokens need d_model >= K"),
    ({"d_head": 40}, "the fixed readout needs d_head <= d_model"),
    ({"d_token": 3}, "one-hot tokens take d_token = K"),
    ({"attn_scale": 0}, "attn_scale must be a positive number, got 0"),
    ({"init": "xavier"}, "init must be one of zero, gaussian, standard"),
    ({"mlp_width": 0}, "the mlp width must be an integer >= 1, got 0"),
    ({"dtype": "float16"}, "dtype must be one of float32, float64"),
])
def test_invalid_configs_have_clear_errors(options, message):
    with pytest.raises(RwinterpError, match=re.escape(message)):
        DeepConfig(**{"n_states": 5, "n_ctx": 9, "pos_dim": 16, **options})


def test_bad_tokens_are_refused():
    model = _small()
    with pytest.raises(RwinterpError, match=re.escape("tokens must have shape [batch, 7]")):
        model(torch.zeros(2, 6, dtype=torch.long))
    with pytest.raises(RwinterpError, match=re.escape("tokens must lie in [0, 5]")):
        model(torch.full((2, 7), 6))


def test_save_and_load_give_identical_outputs(tmp_path, second_order):
    model, task, result = second_order
    save_run(tmp_path / "run", model, task, {"lr": 0.02}, result.history, {"x": 1})
    run = load_run(tmp_path / "run")
    assert type(run.model) is DeepTransformer and run.model.cfg.to_dict() == model.cfg.to_dict()
    tokens = task.sample(20, 3).tokens
    assert torch.equal(run.model(tokens), model(tokens))
    assert torch.equal(run.model.W_E, model.W_E) and torch.equal(run.model.W_Q, model.W_Q)
    assert run.task.to_dict() == task.to_dict() and run.history == result.history


@pytest.mark.slow  # a fresh Python process imports torch and TransformerLens
def test_cli_trains_a_deep_model_on_a_chain_and_a_fresh_process_loads_it(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["train", "--model", "deep", "--layers", "2", "--residual", "--task", "persistent", "--K", "5",
            "--N", "6", "--M", "12", "--init", "gaussian", "--sigma", "0.1", "--optimizer", "adamw",
            "--lr", "0.05", "--loss", "xent", "--steps", "3", "--population", "--json", "--out", str(out)]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model_kind"] == "deep" and data["model"]["n_layers"] == 2 and data["model"]["residual"]
    assert data["task"]["kind"] == "persistent" and data["bayes_accuracy"] == 0.8
    assert len(data["parent_attention_heads"]) == 2 and data["V"] is None
    code = ("from rwinterp.runs import load_run; from rwinterp.metrics import accuracy; "
            f"r = load_run({str(out)!r}); p = r.task.population(); "
            "print(accuracy(r.model(p.tokens)[:, -1].detach(), p.labels, p.weights))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout) == data["test_accuracy"]


@pytest.mark.parametrize("args, message", [
    (["--K", "5", "--layers", "2"], "--layers needs --model deep"),
    (["--K", "5", "--model", "deep", "--heads", "100000"],
     "the number of heads must be an integer in [1, 256], got 100000"),
    (["--K", "5", "--model", "deep", "--layers", "257"], "the number of layers must be an integer in [1, 256], got 257"),
    (["--K", "5", "--q", "0.7"], "--q does not apply to --task circle"),
    (["--task", "torus"], "--task torus needs --rows"),
    (["--task", "torus", "--rows", "2", "--K", "5"], "--K does not apply to --task torus"),
    (["--K", "5", "--task", "lazy", "--initial", "9"], "--initial state must be an integer in [0, 4], got 9"),
    (["--task", "persistent", "--K", "5", "--model", "deep", "--pos-mode", "added"],
     "added positional embeddings need d_model"),
    (["--model", "deep", "--pe", "learned", "--init", "standard", "--key-query", "factored", "--attention",
      "causal", "--loss", "xent", "--next-token", "--task", "regular", "--K", "5"], "must be even"),
])
def test_cli_bad_deep_and_chain_options_are_one_line(args, message, capsys):
    argv = ["train", "--N", "6", "--M", "12", "--steps", "1", "--n-train", "20", "--n-test", "20", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_cli_next_token_training_of_a_standard_model(capsys):
    argv = ["train", "--model", "deep", "--preset", "standard", "--d-model", "16", "--task", "lazy", "--K", "5",
            "--N", "6", "--p", "0.9", "--stay", "0.05", "--initial", "0", "--optimizer", "adamw", "--lr", "0.02",
            "--loss", "xent", "--next-token", "--steps", "60", "--n-train", "300", "--n-test", "300", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["model"]["attention"] == "causal" and data["train"]["next_token"]
    assert data["task"]["initial"] == [1.0, 0.0, 0.0, 0.0, 0.0]
    bayes = data["bayes_accuracy"]
    assert bayes == pytest.approx(0.95 * 0.9, abs=1e-12)
    assert data["test_accuracy"] > bayes - 0.08  # 300 test walks: 3 standard errors is about 0.06


@pytest.mark.parametrize("options", [{}, {"pos_mode": "added", "d_model": 16, "values": "all"}])
def test_backward_hooks_fire_at_every_hook_point(options):
    """Attribution patching needs gradients at every activation, the fixed embeddings and the merged
    key-query's first-layer keys (the embeddings themselves) included."""
    task = CircleWalk(6, 0.5, 12)
    cfg = (DeepConfig.paper(6, 12, 30, init="gaussian", init_sigma=0.1, n_layers=2) if not options
           else DeepConfig(n_states=6, n_ctx=12, init="gaussian", **options))
    model = DeepTransformer(cfg)
    tokens = task.sample(4, 0).tokens
    for name in model.hook_dict:
        fired = []
        out = model.run_with_hooks(tokens, bwd_hooks=[(name, lambda g, hook: fired.append(hook.name))],
                                   reset_hooks_end=False)
        out[:, -1, 0].sum().backward()
        model.reset_hooks()
        assert fired == [name]


def test_the_merged_W_stays_rank_one_from_zero_initialisation():
    """The query x~_N = [0; p_N] is the same for every walk, so every W-gradient is g x~_N^T (what the
    rank-one query relies on). Stored whole, W stays rank one from zero init, its only non-zero column the
    query's coordinate K + N - 1 (orthogonal embeddings), and the columns that multiply the query's token
    coordinates (W_11, W_21) stay zero."""
    K, N = 5, 9
    task = CircleWalk(K, 0.7, N)
    model = DeepTransformer(DeepConfig.paper(K, N, 16, rank_one_query=False))
    train(model, task, TrainConfig(steps=5, population=True), progress=False)
    W = model.blocks[0].attn.W.detach()[0]  # score = x_k^T W x_q
    nonzero = sorted({int(j) for j in torch.nonzero(W.abs().sum(0)).flatten()})
    assert nonzero == [K + N - 1]
    assert torch.count_nonzero(W[:, :K]) == 0 and int(torch.linalg.matrix_rank(W)) == 1


def test_activation_cache_decompositions_on_a_standard_model():
    """TransformerLens's residual-stream tools work on a causal deep model: the full decomposition sums
    to the final residual stream, and the logit attribution of the final accumulated residual is the
    logit itself (no biases, no final normalisation)."""
    task = CircleWalk(5, 0.7, 10)
    model = DeepTransformer(DeepConfig.standard(5, 10, 16, n_layers=2, dtype="float64")).eval()
    states = task.sample(4, 0).states
    logits, cache = model.run_with_cache(states)
    parts = cache.get_full_resid_decomposition()
    assert_close(parts.sum(0), cache["blocks.1.hook_resid_post"], scale=parts)
    y = states[:, -1]
    attrs = cache.logit_attrs(cache.accumulated_resid(), tokens=y)  # [layer, batch, pos]
    assert_close(attrs[-1], logits.gather(-1, y[:, None, None].expand(-1, 10, 1))[..., 0])


def test_residual_stream_methods_on_query_slot_models_ask_for_the_last_position():
    """A model that attends from the query slot alone has attention outputs at the last position only:
    the residual-stream methods of ActivationCache ask for ``pos_slice=-1`` in one line, and with it the
    decomposition of a residual model sums to its last row. Without a residual stream (the paper's
    model) there is no decomposition, and the cache says so."""
    tokens = CircleWalk(5, 0.7, 7).sample(8, 1).tokens
    model = _small()  # query attention, residual stream, two layers
    logits, cache = model.run_with_cache(tokens)
    for method in ("accumulated_resid", "decompose_resid", "get_full_resid_decomposition"):
        with pytest.raises(RwinterpError, match=rf"^ActivationCache.{method}: .*pass pos_slice=-1$"):
            getattr(cache, method)()
    last = cache["blocks.1.hook_resid_post"][:, -1]
    for parts in (cache.decompose_resid(pos_slice=-1), cache.get_full_resid_decomposition(pos_slice=-1)):
        assert_close(parts.sum(0), last, scale=parts)
    y = tokens[:, 0]
    attrs = cache.logit_attrs(cache.decompose_resid(pos_slice=-1), tokens=y)  # [component, batch]
    assert_close(attrs.sum(0), logits[:, 0].gather(-1, y[:, None])[:, 0], scale=attrs)
    paper = paper_model(CircleWalk(5, 0.7, 7), pos_dim=12, init="gaussian", init_sigma=0.3)
    _, cache = paper.run_with_cache(tokens)
    with pytest.raises(RwinterpError, match="no residual stream"):
        cache.decompose_resid(pos_slice=-1)
    with pytest.raises(RwinterpError, match="pass pos_slice=-1"):
        cache.accumulated_resid()
    states = cache.accumulated_resid(pos_slice=-1)  # the stream's state before and after the block
    assert torch.equal(states[1], cache["blocks.0.hook_resid_post"][:, -1])
