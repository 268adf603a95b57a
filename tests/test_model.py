"""The paper's model (the general model's paper configuration, with the rank-one query): exact forward,
TransformerLens compatibility, closed-form gradients."""

import math

import pytest
import torch
import transformer_lens.patching as tl_patching
from transformer_lens import ActivationCache
from transformer_lens.model_protocol import TransformerLensModel

from rwinterp.errors import RwinterpError
from rwinterp.metrics import predict
from rwinterp.model import DeepConfig, DeepTransformer, _column_sum, positional_embeddings, training_logits
from rwinterp.tasks import CircleWalk
from tests.conftest import F32, assert_close


def small(**kw):
    cfg = dict(n_states=5, n_ctx=9, pos_dim=24, init="gaussian", init_sigma=0.3, seed=3)
    cfg.update(kw)
    return DeepTransformer(DeepConfig(**cfg))


def reference_scores(model, tokens):
    """f(X) = V X softmax(X~^T W x~_N), written out with explicit matrices."""
    cfg = model.cfg
    K, N = cfg.n_states, cfg.n_ctx
    X = torch.nn.functional.one_hot(tokens, K + 1)[..., :K].to(cfg.dtype)  # [b, N, K], query row 0
    P = positional_embeddings(cfg.pos_embedding, N, cfg.pos_dim).to(cfg.dtype)
    Xt = torch.cat([X, P.expand(len(tokens), -1, -1)], dim=-1)  # x~_i
    keys = Xt / Xt.norm(dim=-1, keepdim=True) * cfg.token_norm if cfg.normalize_tokens else Xt
    q = keys[0, -1] if cfg.normalize_query else Xt[0, -1]  # keys-only normalisation keeps x~_N
    S = torch.softmax(keys @ (model.W @ q), dim=-1)
    h = torch.einsum("bn,bnk->bk", S, X)
    out = h @ model.V.T
    if cfg.mlp_width is not None:
        out = (torch.relu(out) if cfg.act_fn == "relu" else out) @ model.A.T
    return out


@pytest.mark.parametrize("normalize, r", [(False, 1.0), (True, 1.0), ("keys", 1.0), (True, 2.5), ("keys", 2.5)])
@pytest.mark.parametrize("pe", ["orthogonal", "sine"])
@pytest.mark.parametrize("mlp, act", [(None, "relu"), (7, "relu"), (7, "linear")])
def test_forward_matches_the_paper_formula(normalize, r, pe, mlp, act):
    """The fast path and the hooked (dense) path both compute f(X) as written, for x~ normalised to
    length r (``token_norm``) too."""
    model = small(normalize_tokens=normalize is not False, normalize_query=normalize != "keys",
                  pos_embedding=pe, mlp_width=mlp, act_fn=act, token_norm=r)
    tokens = CircleWalk(5, 0.6, 9).sample(64, 0).tokens
    expected = reference_scores(model, tokens)
    fast = model(tokens)[:, 0]
    dense, cache = model.run_with_cache(tokens)  # hooks on the embeddings force the dense path
    assert_close(fast, expected)
    assert_close(dense[:, 0], expected)
    if mlp is not None:  # the ReLU cuts some pre-activations, and the linear layer keeps them
        pre = cache["blocks.0.mlp.hook_pre"]
        assert (pre < -1e-3).any()
        assert torch.equal(cache["blocks.0.mlp.hook_post"], pre if act == "linear" else torch.relu(pre))


@pytest.mark.parametrize("init", ["zero", "gaussian"])
def test_W_maps_the_query_to_u_and_is_drawn_at_the_papers_scale(init):
    """Only u = W q enters the forward pass; the reported W must give it back (W q = u), and a Gaussian
    W with N(0, sigma^2) entries gives u entries of standard deviation sigma ||q||."""
    from rwinterp.training import TrainConfig, train

    task = CircleWalk(5, 0.7, 9)
    model = small(init=init, init_sigma=0.01)
    train(model, task, TrainConfig(lr=1.0, steps=3, n_train=64, n_test=16), progress=False)
    q = model.query_vector()
    assert_close(model.W @ q, model.u, scale=model.W.abs() @ q.abs())
    if init == "zero":
        assert torch.linalg.matrix_rank(model.W) == 1
        return
    # The paper's sizes (d_model 1006, FC layer m = 19) keep the initial W: every entry of W, V and A is
    # N(0, sigma^2), to within 3 standard errors of a standard deviation measured on n entries,
    # sigma * 3 / sqrt(2 n), and u = W_init q.
    paper = DeepTransformer(DeepConfig.paper(6, 97, 1000, init="gaussian", init_sigma=0.01, mlp_width=19, seed=0))
    assert paper.W_init.shape == (1006, 1006)
    for name, weights in {"W": paper.W_init, "V": paper.V, "A": paper.blocks[0].mlp.A}.items():
        w = weights.detach().flatten()
        assert float(w.std()) == pytest.approx(0.01, abs=0.01 * 3 / math.sqrt(2 * w.numel())), name
        assert abs(float(w.mean())) < 3 * 0.01 / math.sqrt(w.numel()), name
    q = paper.query_vector()
    assert_close(paper.u, paper.W_init @ q, scale=paper.W_init.abs() @ q.abs())
    # Large enough (d_model 3006) to draw u directly; its standard deviation is measured to about 1.3%.
    big = DeepTransformer(DeepConfig.paper(6, 9, 3000, init="gaussian", init_sigma=0.01, seed=0))
    expected = 0.01 * float(big.query_vector().norm())
    assert float(big.u.detach().std()) == pytest.approx(expected, rel=0.05)
    # Too large to keep its initial W: gradients through the embeddings still run (without the query's
    # path through W), and only an actual edit of the query slot's input is refused.
    assert big.W_init.numel() == 0
    tokens = CircleWalk(6, 0.7, 9).sample(4, 0).tokens
    grads = {}
    out = big.run_with_hooks(tokens, bwd_hooks=[("blocks.0.hook_resid_pre", lambda g, hook: grads.update(g=g))],
                             reset_hooks_end=False)
    out.sum().backward()
    big.reset_hooks()
    assert grads["g"].shape == (4, 9, 3006)

    def scale_query(act, hook):
        return torch.cat([act[:, :-1], 2 * act[:, -1:]], dim=1)

    with pytest.raises(RwinterpError, match="needs the initial W, which this Gaussian-initialised model was too"):
        big.run_with_hooks(tokens, fwd_hooks=[("hook_pos_embed", scale_query)])


def test_the_linear_fc_layer_is_the_product_of_A_and_V():
    """Without its ReLU the FC layer is f = (A V) X S: the attention-only model with V replaced by A V."""
    fc = small(mlp_width=7, act_fn="linear")
    plain = small()
    with torch.no_grad():
        plain.blocks[0].attn.W_V[0].copy_((fc.A @ fc.V).T)
        plain.blocks[0].attn.u.copy_(fc.blocks[0].attn.u)
    tokens = CircleWalk(5, 0.6, 9).sample(64, 0).tokens
    assert_close(fc(tokens), plain(tokens))
    with pytest.raises(RwinterpError, match="act fn must be one of relu, linear, got 'gelu'"):
        small(mlp_width=7, act_fn="gelu")
    assert DeepConfig.from_dict(fc.cfg.to_dict()).act_fn == "linear"


def test_positional_embeddings_have_gram_matrix_M_over_2():
    for kind in ("orthogonal", "sine"):
        P = positional_embeddings(kind, 30, 200)
        gram = P @ P.T
        # Sine: off by round-off only (4e-13 here); docs/model.md section 6 traces the p = 1 symmetry breaking to it.
        assert_close(gram, 100 * torch.eye(30, dtype=gram.dtype))
    P = positional_embeddings("orthogonal", 30, 200)
    assert torch.equal(P @ P.T, 100 * torch.eye(30, dtype=P.dtype))  # exactly, in floating point


def test_transformer_lens_protocol_cache_and_hook_shapes():
    model = small()
    assert isinstance(model, TransformerLensModel)
    tokens = CircleWalk(5, 0.6, 9).sample(4, 0).tokens
    logits, cache = model.run_with_cache(tokens)
    assert isinstance(cache, ActivationCache)
    D = 5 + 24
    shapes = {
        "hook_embed": (4, 9, D), "hook_pos_embed": (4, 9, D), "blocks.0.hook_resid_pre": (4, 9, D),
        "blocks.0.attn.hook_q": (4, 1, 1, 1), "blocks.0.attn.hook_k": (4, 9, 1, 1),
        "blocks.0.attn.hook_v": (4, 9, 1, 5), "blocks.0.attn.hook_attn_scores": (4, 1, 1, 9),
        "blocks.0.attn.hook_pattern": (4, 1, 1, 9), "blocks.0.attn.hook_z": (4, 1, 1, 5),
        "blocks.0.hook_attn_out": (4, 1, D), "blocks.0.hook_resid_post": (4, 1, D),
    }
    for name, shape in shapes.items():
        assert tuple(cache[name].shape) == shape, name
    assert logits.shape == (4, 1, 5)
    # Pre-softmax scores, post-softmax pattern.
    assert_close(cache["pattern", 0][:, 0, 0], torch.softmax(cache["attn_scores", 0][:, 0, 0], -1))
    # Per-head results (through the block's W_O) are the attention output of the query row.
    # (W_O puts z into the first coordinates: a product with zeros and ones, exact)
    assert torch.equal(cache.stack_head_results(layer=-1, pos_slice=-1)[0], cache["blocks.0.hook_attn_out"][:, -1])
    # run_with_hooks can intervene: zeroing V's output zeroes f.
    out = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_z", lambda z, hook: z * 0)])
    assert torch.equal(out, torch.zeros_like(out))
    # Backward hooks (attribution patching) fire at every hook point, the fixed embeddings included.
    for name in shapes:
        grads = {}
        out = model.run_with_hooks(tokens, bwd_hooks=[(name, lambda g, hook: grads.update({hook.name: g}))],
                                   reset_hooks_end=False)
        out[:, 0, 0].sum().backward()
        model.reset_hooks()
        assert tuple(grads[name].shape) == shapes[name], name


def test_weights_in_transformer_lens_form():
    model = small()
    cfg = model.cfg
    tokens = CircleWalk(5, 0.6, 9).sample(8, 1).tokens
    _, cache = model.run_with_cache(tokens)
    resid = cache["resid_pre", 0]
    # Attention scores: query . W_Q W_K^T . key, on the model's domain (query slot).
    q = resid[0, -1]
    scores = resid @ model.QK.AB[0, 0].T @ q
    assert_close(scores, cache["attn_scores", 0][:, 0, 0])
    # QK equals W^T applied to the query.
    assert_close(model.QK.AB[0, 0] .T @ q, model.W @ q)
    # Full OV circuit on the states is V^T (row = current state, column = output).
    full_ov = model.W_E[: cfg.n_states] @ model.OV.AB[0, 0] @ model.W_U
    assert_close(full_ov, model.V.T)
    # Embedding views build resid_pre.
    assert_close(model.W_E[tokens] + model.W_pos, resid)


def test_prediction_breaks_ties_towards_the_smallest_label():
    scores = torch.tensor([[1.0, 3.0, 3.0 + 1e-15, 0.0], [0.0, 0.0, 0.0, 0.0], [2.0, 1.0, 5.0, 5.5]],
                          dtype=torch.float64)
    assert predict(scores).tolist() == [1, 0, 3]
    # Ties are what round-off makes (64 machine epsilons of the row's scale), no more.
    assert predict(torch.tensor([[1.0, 1.0 + 1e-9]], dtype=torch.float64)).tolist() == [1]
    assert predict(torch.tensor([[1e8, 1e8 * (1 + 1e-14)]], dtype=torch.float64)).tolist() == [0]
    assert predict(torch.tensor([[1.0, 1.0 + 2**-16]], dtype=torch.float32)).tolist() == [1]
    assert predict(torch.tensor([[1.0, 1.0 + 2**-20]], dtype=torch.float32)).tolist() == [0]  # 8 ulps in float32
    assert predict(torch.tensor([[1.0, 1.0 + 2**-20]], dtype=torch.float64)).tolist() == [1]


def test_autograd_gradients_equal_the_closed_form():
    """Lemma B.1: dL/dV = E[g e_y (X S)^T], dL/dW = E[X~ (diag S - S S^T) X^T V^T g e_y x~_N^T]."""
    model = small(n_states=6, n_ctx=11, pos_dim=30, init_sigma=0.2)
    eps = 5.0  # keeps f_y + eps > 0 for a random model
    batch = CircleWalk(6, 0.7, 11).sample(50, 4)
    f = model(batch.tokens)[:, 0]
    loss = -torch.log(f.gather(1, batch.labels[:, None]) + eps).mean()
    loss.backward()
    auto_V = model.blocks[0].attn.W_V.grad[0].T.clone()
    auto_W = torch.outer(model.u.grad, model.query_vector())  # u = W x~_N, so dL/dW = dL/du x~_N^T

    cfg = model.cfg
    K, N, n = cfg.n_states, cfg.n_ctx, len(batch)
    with torch.no_grad():
        P = positional_embeddings("orthogonal", N, cfg.pos_dim).to(cfg.dtype)
        W, V = model.W, model.V
        closed_V = torch.zeros_like(V)
        closed_W = torch.zeros_like(W)
        for b in range(n):
            X = torch.nn.functional.one_hot(batch.tokens[b], K + 1)[:, :K].T.to(cfg.dtype)  # K x N
            Xt = torch.cat([X, P.T], dim=0)  # (K+M) x N
            q = Xt[:, -1]
            S = torch.softmax(Xt.T @ W @ q, dim=0)
            y = batch.labels[b]
            fy = (V @ X @ S)[y]
            g = -1.0 / (fy + eps) / n  # dl/df_y
            e_y = torch.zeros(K, dtype=cfg.dtype)
            e_y[y] = 1
            closed_V += g * torch.outer(e_y, X @ S)
            closed_W += g * torch.outer(Xt @ (torch.diag(S) - torch.outer(S, S)) @ X.T @ V.T @ e_y, q)
    assert_close(auto_V, closed_V)
    assert_close(auto_W, closed_W)
    assert closed_W.abs().max() > 1e-6  # a non-trivial check


def set_keys(model, token_keys, position_keys):
    """Set the rank-one model's u so that the key of token k at position i is ``token_keys[k] + position_keys[i]``
    (the one-hot token coordinates come first; ``W_pos`` holds the positions' coordinates)."""
    with torch.no_grad():
        u = model.u
        u.zero_()
        u[: model.cfg.n_states] = token_keys
        u.add_(torch.linalg.lstsq(model.W_pos, position_keys.to(u.dtype)[:, None]).solution[:, 0])
    return model


def walks_underflow(model, tokens) -> bool:
    """Whether some walk's separated terms ``w[x_i] e_i`` (see SeparableAttention) all lie below sqrt(tiny)."""
    c, d = (model.W_E @ model.u).detach(), (model.W_pos @ model.u).detach()
    terms = (c - c.max()).exp()[tokens] * (d - d.max()).exp()
    return bool(terms.sum(-1).min() < torch.finfo(terms.dtype).tiny ** 0.5)


KEYS = {  # token keys (K = 5; the query token's is 0), position keys (N = 9)
    "moderate": (torch.tensor([0.3, -1.0, 2.0, 0.5, -0.2]), torch.linspace(-2.0, 3.0, 9)),
    # as after training (Fig 4): the parent's key far above the others, whose terms underflow to 0
    "trained": (torch.tensor([0.5, -0.5, 1.0, 0.0, 0.2]), torch.cat([torch.full((7,), -1900.0),
                                                                          torch.tensor([5.0, -1900.0])])),
    # state 0's key 1000 above the others: a walk that never visits it has every term below 1e-430
    "underflow": (torch.tensor([1000.0, 0.0, 0.3, -0.4, 0.1]), torch.linspace(-2.0, 3.0, 9)),
}


@pytest.mark.parametrize("keys", list(KEYS))
@pytest.mark.parametrize("mlp", [None, 7])
def test_separable_attention_matches_the_dense_path(keys, mlp):
    """The paper's model without hooks takes SeparableAttention (each key a token part plus a position part):
    its logits and gradients equal those of the dense path (a hook on the embeddings forces it), the underflow of a
    walk's separated terms included, where it forms the scores and shifts them as the softmax does."""
    model = set_keys(small(mlp_width=mlp), *KEYS[keys])
    tokens = CircleWalk(5, 0.6, 9).sample(64, 0).tokens
    assert walks_underflow(model, tokens) == (keys == "underflow")
    results = []
    for hooks in ([], [("hook_embed", lambda x, hook: x)]):
        model.zero_grad()
        logits = model.run_with_hooks(tokens, fwd_hooks=hooks)
        (logits * torch.arange(1.0, 6.0, dtype=logits.dtype)).sum().backward()
        results.append([logits.detach()] + [p.grad.clone() for p in model.parameters()])
    (separable, *grads), (dense, *dense_grads) = results
    assert_close(separable, dense)
    assert_close(separable[:, 0], reference_scores(model, tokens))
    assert all(g.abs().max() > 0 for g in dense_grads)
    for got, want in zip(grads, dense_grads):
        assert_close(got, want)


@pytest.mark.parametrize("keys", list(KEYS))
@pytest.mark.parametrize("normalize", [False, True])
def test_training_logits_return_the_attention_rows(keys, normalize):
    """What training runs: the logits and the query slot's attention pattern (``[batch, head, pos]``, detached), from
    SeparableAttention, or through the hooks where the keys do not separate (normalised tokens); with ``keys``, the
    same numbers at those key positions alone."""
    model = set_keys(small(normalize_tokens=normalize), *KEYS[keys])
    tokens = CircleWalk(5, 0.6, 9).sample(64, 0).tokens
    logits, rows = training_logits(model, tokens, -1)
    assert len(rows) == 1 and rows[0].shape == (64, 1, 9) and not rows[0].requires_grad
    assert_close(rows[0], model.attention(tokens)[:, 0])
    assert_close(rows[0].sum(-1), torch.ones(64, 1))
    assert_close(logits, model(tokens))
    assert_close(training_logits(model, tokens), logits)
    picked = training_logits(model, tokens, -1, keys=[7, 2, 7])[1]
    assert len(picked) == 1 and torch.equal(picked[0], rows[0][..., [7, 2, 7]])


def test_column_sums_add_each_column_in_row_order():
    """Equal columns give bit-equal sums (a sum over an outer axis rounds edge columns differently), for a stack of
    matrices as for one."""
    gen = torch.Generator().manual_seed(0)
    for rows in (3, 300, 1001):
        column = torch.randn(5, rows, 1, generator=gen, dtype=torch.float64) * 1e3
        x = column.expand(5, rows, 97).contiguous()
        sums = _column_sum(x)
        assert torch.equal(sums, sums[:, :1].expand_as(sums))
        assert torch.equal(_column_sum(x[2]), sums[2])
        assert_close(sums, x.sum(-2), scale=x.abs().sum(-2))


def test_bad_model_configs():
    with pytest.raises(RwinterpError, match="M >= N"):
        DeepConfig(n_states=6, n_ctx=97, pos_dim=50)
    with pytest.raises(RwinterpError, match="M > N"):
        DeepConfig(n_states=6, n_ctx=97, pos_dim=97, pos_embedding="sine")
    with pytest.raises(RwinterpError, match="dtype"):
        DeepConfig(dtype="float16")
    model = small()
    with pytest.raises(RwinterpError, match="tokens must have shape"):
        model(torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(RwinterpError, match="tokens must lie"):
        model(torch.full((2, 9), 7, dtype=torch.long))


def test_transformer_lens_patching_runs_unchanged(trained_paper_models):
    """transformer_lens.patching on the trained model: only the parent's residual stream matters."""
    model, task, _ = trained_paper_models[0.7]
    clean = task.sample(40, 11)
    corrupted = task.sample(40, 12)
    _, clean_cache = model.run_with_cache(clean.tokens)
    labels = clean.labels

    def metric(logits):
        return logits[torch.arange(len(labels)), 0, labels].mean()

    with torch.no_grad():
        clean_value = metric(model(clean.tokens))
        corrupt_value = metric(model(corrupted.tokens))
    resid = tl_patching.get_act_patch_resid_pre(model, corrupted.tokens, clean_cache, metric)
    assert resid.shape == (1, task.seq_len)
    parent = task.parent_positions()[0]
    assert resid[0, parent].item() == pytest.approx(clean_value.item(), rel=1e-3)
    others = torch.cat([resid[0, :parent], resid[0, parent + 1:]])
    assert torch.allclose(others, corrupt_value.to(others.dtype), rtol=1e-2, atol=1e-3)
    pattern = tl_patching.get_act_patch_attn_head_pattern_all_pos(model, corrupted.tokens, clean_cache, metric)
    z = tl_patching.get_act_patch_attn_head_out_all_pos(model, corrupted.tokens, clean_cache, metric)
    assert pattern.shape == (1, 1) and z.shape == (1, 1)
    assert z.item() == pytest.approx(clean_value.item(), rel=F32)  # z is the whole output (stored in float32)
    # The pattern carries no walk-specific information: patching it leaves the corrupted output.
    assert pattern.item() == pytest.approx(corrupt_value.item(), rel=1e-2, abs=1e-3)
    # The key-query circuit in TransformerLens's terms: the query is the same for every walk (patching it
    # changes nothing), and the keys are almost all positional (patching them barely does).
    # Patching the values by position: only the parent's carry the walk, as only it is attended to.
    v = tl_patching.get_act_patch_attn_head_v_by_pos(model, corrupted.tokens, clean_cache, metric)
    assert v.shape == (1, task.seq_len, 1)
    assert v[0, parent, 0].item() == pytest.approx(clean_value.item(), rel=1e-3)
    v_others = torch.cat([v[0, :parent, 0], v[0, parent + 1:, 0]])
    assert torch.allclose(v_others, corrupt_value.to(v.dtype), rtol=1e-2, atol=1e-3)
    q = tl_patching.get_act_patch_attn_head_q_all_pos(model, corrupted.tokens, clean_cache, metric)
    k = tl_patching.get_act_patch_attn_head_k_by_pos(model, corrupted.tokens, clean_cache, metric)
    assert q.item() == pytest.approx(corrupt_value.item(), rel=F32)  # (patching stores float32)
    assert k.shape == (1, task.seq_len, 1)
    assert torch.allclose(k, corrupt_value.to(k.dtype), rtol=1e-2, atol=1e-3)
    every = tl_patching.get_act_patch_attn_head_all_pos_every(model, corrupted.tokens, clean_cache, metric)
    assert every.shape == (5, 1, 1) and every[0].item() == pytest.approx(z.item(), rel=F32)  # output, q, k, v, pattern


@pytest.mark.parametrize("rank_one", [True, False])
def test_a_dtype_conversion_follows_into_the_config_of_that_model_only(rank_one, tmp_path):
    """``.float()`` sets the model's cfg.dtype, so its saved run rebuilds in float32; another model built
    from the same config object keeps float64; ``.half()`` is refused and converts nothing."""
    from rwinterp.runs import load_run, save_run

    task = CircleWalk(5, 0.7, 9)
    cfg = DeepConfig.paper(5, 9, 16, init="gaussian", init_sigma=0.1, rank_one_query=rank_one)
    a, b = DeepTransformer(cfg), DeepTransformer(cfg)
    assert a.cfg.rank_one == rank_one
    a.float()
    assert a.cfg.dtype == torch.float32 and b.cfg.dtype == cfg.dtype == torch.float64
    tokens = task.sample(8, 0).tokens
    loaded = load_run(save_run(tmp_path / "a", a, task, {}, [], {})).model
    assert loaded.cfg.dtype == torch.float32 and torch.equal(loaded(tokens), a(tokens))
    before = {k: v.clone() for k, v in b.state_dict().items()}
    with pytest.raises(RwinterpError, match="unsupported dtype torch.float16"):
        b.half()
    assert all(torch.equal(v, before[k]) and v.dtype == before[k].dtype for k, v in b.state_dict().items())
    assert b.cfg.dtype == torch.float64
