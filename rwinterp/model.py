"""The paper's one-layer transformer as a TransformerLens hooked model.

The model (PAPER.md section 2) reads N tokens, the last one the query slot, and outputs raw scores

    f(X) = V X softmax(X~^T W x~_N)                    (attention-only)
    f(X) = A ReLU(V X softmax(X~^T W x~_N))            (FC+ReLU variant, ``mlp_width = m``)
    f(X) = A V X softmax(X~^T W x~_N)                  (the same without its ReLU, ``act_fn = "linear"``)

where ``x~_i = [x_i; p_i]`` concatenates the one-hot token ``x_i`` (zero for the query) with a
fixed positional embedding ``p_i`` of squared norm M/2, the softmax runs over all N positions with
no 1/sqrt(d) scaling, and values see only the token part. There is no residual connection into the
output and no output softmax: ``logits`` are the paper's raw scores ``f``.

How it maps onto TransformerLens
--------------------------------
``d_model = K + M`` (token coordinates first), ``d_vocab = K + 1`` (the query token is ``K`` and
embeds to zero), ``d_vocab_out = K``, one layer, one head. Hook names follow HookedTransformer:

===============================  ================================  =================================
hook                             shape                             content
===============================  ================================  =================================
``hook_embed``                   ``[batch, pos, d_model]``         ``[x_i; 0]``
``hook_pos_embed``               ``[batch, pos, d_model]``         ``[0; p_i]``
``blocks.0.hook_resid_pre``      ``[batch, pos, d_model]``         ``x~_i``
``blocks.0.attn.hook_v``         ``[batch, pos, 1, d_head]``       ``V x_i`` (zero for the query)
``blocks.0.attn.hook_attn_scores`` ``[batch, 1, 1, pos]``          pre-softmax ``x~_i^T W x~_N``
``blocks.0.attn.hook_pattern``   ``[batch, 1, 1, pos]``            the softmax
``blocks.0.attn.hook_z``         ``[batch, 1, 1, d_head]``         ``V X softmax(...)``
``blocks.0.hook_attn_out``       ``[batch, 1, d_model]``           ``z W_O``
``blocks.0.hook_resid_mid``      ``[batch, 1, d_model]``           (FC+ReLU variant only)
``blocks.0.mlp.hook_pre/post``   ``[batch, 1, m]``                 ``V X S`` and its ReLU
``blocks.0.hook_mlp_out``        ``[batch, 1, d_model]``           (FC+ReLU variant only)
``blocks.0.hook_resid_post``     ``[batch, 1, d_model]``           the block output (no residual)
===============================  ================================  =================================

**The query dimension holds only the query position.** The paper's model attends from the query
slot alone, so attention, ``z`` and everything after it have a query/position axis of length one
(the last position); patching functions that index ``z`` or ``attn_out`` by position must use
position 0 of that axis. Logits are ``[batch, 1, K]``.

Structure used for speed
------------------------
The query ``x~_N = [0; p_N]`` is the same for every sample, so only ``u = W x~_N`` enters the forward
pass and every gradient of W is an outer product ``g x~_N^T``. The model therefore stores ``u``
(``blocks.0.attn.u``) and never materialises the ``(K+M) x (K+M)`` matrix W during training; plain
gradient descent on W is gradient descent on ``u`` with the learning rate scaled by
``||x~_N||^2`` (see :meth:`WalkTransformer.u_lr_scale`; Adam and weight decay in
:func:`rwinterp.training._optimizer`). The paper's W is available as :attr:`WalkTransformer.W`
(rebuilt exactly from ``u`` and the stored initial W). When no hook is
attached to the embeddings or ``resid_pre``, the forward pass computes attention scores from the
tokens directly (``u_tok[x_i] + p_i . u_pos``) without building ``[batch, pos, d_model]`` tensors.
A hook there that edits the query slot's row is followed: the scores then use ``W`` on the edited
query (:meth:`WalkTransformer._query_edit`), as :func:`rwinterp.deep.from_walk_transformer`'s
model, which builds W, does.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens.ActivationCache import ActivationCache
from transformer_lens.FactoredMatrix import FactoredMatrix
from transformer_lens.hook_points import HookPoint
from transformer_lens.HookedRootModule import HookedRootModule

from rwinterp.config import WalkTransformerConfig, resolve_dtype
from rwinterp.errors import RwinterpError, require
from rwinterp.runs import ModelKind, register_model_kind

#: Largest d_model for which a Gaussian-initialised model keeps its full initial W (float entries).
MAX_STORED_W = 1 << 22


def positional_embeddings(kind: str, N: int, M: int) -> Float[Tensor, "N M"]:
    """Mutually orthogonal positional embeddings with squared norm M/2 (float64).

    ``orthogonal``: ``p_i = sqrt(M/2) e_i`` (exactly orthogonal in floating point).
    ``sine``: ``[p_i]_k = sin(pi i k / M)``, ``i = 1..N``, ``k = 1..M`` (orthogonal in exact arithmetic,
    with round-off of order 1e-13 in the inner products).
    """
    if kind == "orthogonal":
        P = torch.zeros(N, M, dtype=torch.float64)
        P[torch.arange(N), torch.arange(N)] = math.sqrt(M / 2)
        return P
    if kind == "sine":
        i = torch.arange(1, N + 1, dtype=torch.float64)[:, None]
        k = torch.arange(1, M + 1, dtype=torch.float64)[None, :]
        return torch.sin(math.pi * i * k / M)
    raise RwinterpError(f"unknown positional embedding {kind!r}")


def predict(scores: Float[Tensor, "... K"]) -> Int[Tensor, "..."]:
    """The paper's prediction: the smallest index among the maximisers of the scores.

    Scores within a relative tolerance (64 machine epsilons of the row's largest magnitude) of the
    maximum count as ties, so floating-point round-off does not decide between equal scores.
    """
    tol = 64 * torch.finfo(scores.dtype).eps * scores.abs().amax(dim=-1, keepdim=True)
    top = scores.amax(dim=-1, keepdim=True)
    is_max = scores >= top - tol
    return is_max.to(torch.int8).argmax(dim=-1)


class SymmetricReadout(torch.autograd.Function):
    """``h V^T`` whose forward and backward sums all run along the innermost axis.

    Every output entry and every gradient entry is then reduced by the same code path in the same
    order, so values that are equal in exact arithmetic stay bit-for-bit equal. A matmul (or a
    reduction over an outer axis) treats columns at the edge of its SIMD blocks differently, and
    the round-off that this injects into the value gradient is what otherwise breaks the exact
    symmetry of the deterministic walk (Theorem 4.1) after a few steps for K = 5, 7 or 20.
    """

    @staticmethod
    def forward(ctx: Any, h: Tensor, V: Tensor) -> Tensor:  # h [b, k], V [y, k] -> [b, y]
        ctx.save_for_backward(h, V)
        return _inner_sum(h[:, None, :], V[None, :, :])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:  # grad [b, y]
        h, V = ctx.saved_tensors
        grad_h = _inner_sum(grad[:, None, :], V.T[None, :, :])  # [b, k], summed over y
        grad_V = _inner_sum(grad.T[:, None, :], h.T[None, :, :])  # [y, k], summed over b
        return grad_h, grad_V


class BroadcastOverBatch(torch.autograd.Function):
    """``x[None, :]`` expanded to ``[batch, n]``; the backward sums each column as a row reduction
    (see :class:`SymmetricReadout`: the default outer-axis sum rounds edge columns differently)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, batch: int) -> Tensor:
        return x[None, :].expand(batch, -1)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad.T.contiguous().sum(-1), None


def _inner_sum(a: Tensor, b: Tensor) -> Tensor:
    """``(a * b).sum(-1)`` with the product laid out contiguously, so the sum is a row reduction."""
    return (a.contiguous() * b.contiguous()).contiguous().sum(-1)


def with_gradient(x: Tensor, *hooks: HookPoint) -> Tensor:
    """``x``, made a leaf with a gradient if it has none (it comes from fixed buffers) and one of ``hooks``
    holds a backward hook: otherwise that hook would never fire."""
    if x.requires_grad or not torch.is_grad_enabled() or not any(h.has_hooks(dir="bwd") for h in hooks):
        return x
    return x.detach().clone().requires_grad_()


class WalkAttention(nn.Module):
    """Single-head attention from the query slot, with merged key-query W and value matrix V."""

    def __init__(self, cfg: WalkTransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.V = nn.Parameter(torch.zeros(cfg.d_head, cfg.n_states, dtype=cfg.dtype))
        self.u = nn.Parameter(torch.zeros(cfg.d_model, dtype=cfg.dtype))
        self.hook_q = HookPoint()
        self.hook_k = HookPoint()
        self.hook_v = HookPoint()
        self.hook_attn_scores = HookPoint()
        self.hook_pattern = HookPoint()
        self.hook_z = HookPoint()

    @property
    def W_O(self) -> Float[Tensor, "n_heads d_head d_model"]:
        """Writes the head output into the first ``d_head`` residual coordinates (TransformerLens's
        per-block view, as ``ActivationCache.stack_head_results`` reads it)."""
        cfg = self.cfg
        W_O = self.V.new_zeros(cfg.d_head, cfg.d_model)
        W_O[torch.arange(cfg.d_head), torch.arange(cfg.d_head)] = 1.0
        return W_O[None]

    def forward(
        self,
        keys_in: Float[Tensor, "batch pos"],
        tokens: Int[Tensor, "batch pos"],
        token_part: Optional[Float[Tensor, "batch pos K"]] = None,
    ) -> Float[Tensor, "batch 1 1 d_head"]:
        """``keys_in[b, i] = x~_i . u`` (already normalised if configured).

        In TransformerLens's terms the key-query circuit has ``d_head = 1`` (``W_Q``, ``W_K``): ``hook_q``
        is the query slot's ``q = x~_N . W_Q = 1`` (``[batch, 1, 1, 1]``), ``hook_k`` the keys ``x~_i . u``
        (``[batch, pos, 1, 1]``) and the score their product. They are formed only when hooked.

        ``token_part`` (``X^T``, from the residual stream) is given on the dense path; otherwise
        values are read from the tokens, and when nothing hooks them the weighted sum of values
        ``V X S`` is formed as ``V (sum_i S_i x_i)`` by a scatter, never building ``[batch, pos, K]``.
        """
        K = self.cfg.n_states
        if self.hook_q.has_hooks() or self.hook_k.has_hooks():
            q = self.hook_q(with_gradient(keys_in.new_ones(keys_in.shape[0], 1, 1, 1), self.hook_q))
            k = self.hook_k(keys_in[:, :, None, None])
            scores = torch.einsum("bqhd,bphd->bhqp", q, k)
        else:
            scores = keys_in[:, None, None, :]
        scores = self.hook_attn_scores(scores)
        pattern = self.hook_pattern(torch.softmax(scores, dim=-1))
        if token_part is None and not self.hook_v.has_hooks():
            weights = pattern[:, 0, 0, :]
            summed = weights.new_zeros(weights.shape[0], K + 1).scatter_add_(1, tokens, weights)
            z = SymmetricReadout.apply(summed[:, :K], self.V)[:, None, None, :]
        else:
            if token_part is None:
                token_part = F.one_hot(tokens, K + 1)[..., :K].to(self.V.dtype)
            v = self.hook_v((token_part @ self.V.T)[:, :, None, :])
            z = torch.einsum("bhqp,bphd->bqhd", pattern, v)
        return self.hook_z(z)


class WalkMLP(nn.Module):
    """The FC+ReLU variant's output layer: ``f = A ReLU(h)`` (PAPER.md appendix F.2); with
    ``act_fn = "linear"``, ``f = A h``."""

    def __init__(self, cfg: WalkTransformerConfig):
        super().__init__()
        self.activation = cfg.activation
        self.A = nn.Parameter(torch.zeros(cfg.n_states, cfg.d_mlp, dtype=cfg.dtype))
        self.hook_pre = HookPoint()
        self.hook_post = HookPoint()

    def forward(self, h: Float[Tensor, "batch 1 m"]) -> Float[Tensor, "batch 1 K"]:
        post = self.hook_post(self.activation(self.hook_pre(h)))
        return post @ self.A.T


class WalkBlock(nn.Module):
    """One block's modules and its HookedTransformer hook points (resid_mid and mlp_out only with
    an MLP). The forward pass lives in the model that owns the block."""

    def __init__(self, cfg: Any, attn: nn.Module, mlp: Optional[nn.Module] = None):
        super().__init__()
        self.cfg = cfg
        self.attn = attn
        self.hook_resid_pre = HookPoint()
        self.hook_attn_out = HookPoint()
        self.hook_resid_post = HookPoint()
        if mlp is not None:
            self.mlp = mlp
            self.hook_resid_mid = HookPoint()
            self.hook_mlp_out = HookPoint()


#: Hooks whose activations TransformerLens stacks over layers in the residual-stream methods of
#: :class:`ActivationCache`.
RESIDUAL_HOOKS = ("hook_embed", "hook_pos_embed", "hook_resid_pre", "hook_resid_mid", "hook_resid_post",
                  "hook_attn_out", "hook_mlp_out")


class WalkActivationCache(ActivationCache):
    """A TransformerLens :class:`ActivationCache` that says in one line when a residual-stream method
    cannot apply to the cached model, instead of failing inside ``torch.stack``:

    * a model that attends from the query slot alone keeps ``attn_out`` (and, in the paper's model,
      ``resid_post``) at the last position only, so ``accumulated_resid``, ``decompose_resid`` and
      ``get_full_resid_decomposition`` need ``pos_slice=-1`` to stack them with the embeddings;
    * a model without a residual stream (the paper's, or a ``DeepTransformer`` with ``residual=False``)
      replaces the stream with each block's output, so the stream is no sum of components and the two
      decompositions do not exist (``accumulated_resid``, the stream's state at each layer, does).
    """

    def _check(self, method: str, pos_slice: Any, decomposition: bool) -> None:
        if decomposition:
            require(bool(getattr(self.model.cfg, "residual", False)),
                    f"ActivationCache.{method}: this model has no residual stream (each block's output replaces "
                    f"its input), so the stream is no sum of components; read the block outputs "
                    f"(blocks.L.hook_resid_post) or cache.stack_head_results(pos_slice=-1)")
        if pos_slice is None and self.has_batch_dim:
            lengths = {int(t.shape[1]) for name, t in self.cache_dict.items()
                       if name.rsplit(".", 1)[-1] in RESIDUAL_HOOKS and t.ndim == 3}
            require(len(lengths) <= 1,
                    f"ActivationCache.{method}: this model attends from the query slot alone, so its attention "
                    f"outputs hold only the last position; pass pos_slice=-1")

    def accumulated_resid(self, layer: Optional[int] = None, incl_mid: bool = False, apply_ln: bool = False,
                          pos_slice: Any = None, *args: Any, **kwargs: Any) -> Any:
        self._check("accumulated_resid", pos_slice, decomposition=False)
        return super().accumulated_resid(layer, incl_mid, apply_ln, pos_slice, *args, **kwargs)

    def decompose_resid(self, layer: Optional[int] = None, mlp_input: bool = False, mode: str = "all",
                        apply_ln: bool = False, pos_slice: Any = None, *args: Any, **kwargs: Any) -> Any:
        self._check("decompose_resid", pos_slice, decomposition=True)
        return super().decompose_resid(layer, mlp_input, mode, apply_ln, pos_slice, *args, **kwargs)

    def get_full_resid_decomposition(self, layer: Optional[int] = None, mlp_input: bool = False,
                                     expand_neurons: bool = True, apply_ln: bool = False, pos_slice: Any = None,
                                     *args: Any, **kwargs: Any) -> Any:
        self._check("get_full_resid_decomposition", pos_slice, decomposition=True)
        return super().get_full_resid_decomposition(layer, mlp_input, expand_neurons, apply_ln, pos_slice,
                                                    *args, **kwargs)


class HookedWalkModel(HookedRootModule):
    """What the library's hooked models share beyond :class:`HookedRootModule`: ``run_with_cache``
    returning an :class:`ActivationCache` (a :class:`WalkActivationCache`), and ``QK = W_Q W_K^T`` and
    ``OV = W_V W_O`` per layer and head as TransformerLens :class:`FactoredMatrix` objects (from the
    subclass's weight views; for the paper's model QK equals ``W^T`` on its domain, the query slot)."""

    def run_with_cache(self, *args: Any, **kwargs: Any) -> tuple[Tensor, ActivationCache]:
        """As in TransformerLens, returning an :class:`ActivationCache` (a :class:`WalkActivationCache`)."""
        out, cache = super().run_with_cache(*args, **kwargs)
        if isinstance(cache, ActivationCache):
            cache = cache.cache_dict
        return out, WalkActivationCache(cache, self, has_batch_dim=not kwargs.get("remove_batch_dim", False))

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> "HookedWalkModel":
        """``.to(dtype)``, ``.float()``, ``.double()``: as TransformerLens's ``to`` does, ``cfg.dtype``
        follows the weights, so a saved run rebuilds in the dtype it was saved in. A conversion to an
        unsupported dtype (``.half()``) is refused before any weight is converted."""
        resolve_dtype(fn(torch.zeros((), dtype=self.cfg.dtype)).dtype)
        super()._apply(fn, *args, **kwargs)
        dtype = next((p.dtype for p in self.parameters() if p.is_floating_point()), None)
        if dtype is not None and dtype != self.cfg.dtype:
            self.cfg.dtype = resolve_dtype(dtype)
        return self

    def _embeddings(self, tokens: Int[Tensor, "batch pos"]) -> tuple[Tensor, Tensor]:
        """``hook_embed(W_E[tokens])`` and ``hook_pos_embed(W_pos)``, each ``[batch, pos, d_model]``.

        Fixed (one-hot, sine or orthogonal) embeddings are buffers with no gradient of their own: when a
        backward hook waits on them or on ``blocks.0.hook_resid_pre`` (attribution patching), they are
        given one here, or the hook would never fire."""
        embed, pos = self.W_E[tokens], self.W_pos.expand(tokens.shape[0], -1, -1)
        hooks = (self.hook_embed, self.hook_pos_embed, self.blocks[0].hook_resid_pre)
        return self.hook_embed(with_gradient(embed, *hooks)), self.hook_pos_embed(with_gradient(pos, *hooks))

    def tokens_to_residual_directions(self, tokens: int | Int[Tensor, "..."]) -> Float[Tensor, "... d_model"]:
        """As in TransformerLens: the unembedding direction of each output token (a column of ``W_U``), for
        ``ActivationCache.logit_attrs``."""
        if isinstance(tokens, Tensor) and tokens.numel() > 1:
            return self.W_U[:, tokens].movedim(0, -1)
        return self.W_U[:, int(tokens)]

    def accumulated_bias(self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True) -> Tensor:
        """As in TransformerLens: the biases added to the residual stream before ``layer``; these models
        have none."""
        return self.W_U.new_zeros(self.cfg.d_model)

    @property
    def QK(self) -> FactoredMatrix:
        return FactoredMatrix(self.W_Q, self.W_K.transpose(-2, -1))

    @property
    def OV(self) -> FactoredMatrix:
        return FactoredMatrix(self.W_V, self.W_O)


class WalkTransformer(HookedWalkModel):
    """The paper's model. Build with ``WalkTransformer(WalkTransformerConfig(...))``."""

    run_kind = "walk"

    def __init__(self, cfg: WalkTransformerConfig):
        super().__init__()
        # A copy: ``.float()`` on this model updates its cfg.dtype, not that of another model built
        # from the same config.
        cfg = WalkTransformerConfig.from_dict(cfg) if isinstance(cfg, dict) else copy.deepcopy(cfg)
        self.cfg = cfg
        K, M, N, D = cfg.n_states, cfg.pos_dim, cfg.n_ctx, cfg.d_model
        W_E = torch.zeros(K + 1, D, dtype=cfg.dtype)
        W_E[torch.arange(K), torch.arange(K)] = 1.0
        W_pos = torch.zeros(N, D, dtype=cfg.dtype)
        W_pos[:, K:] = positional_embeddings(cfg.pos_embedding, N, M).to(cfg.dtype)
        self.register_buffer("W_E", W_E, persistent=False)
        self.register_buffer("W_pos", W_pos, persistent=False)
        self.register_buffer("tok_sq", W_E.pow(2).sum(-1), persistent=False)
        self.register_buffer("pos_sq", W_pos.pow(2).sum(-1), persistent=False)
        self.hook_embed = HookPoint()
        self.hook_pos_embed = HookPoint()
        mlp = WalkMLP(cfg) if cfg.mlp_width is not None else None
        self.blocks = nn.ModuleList([WalkBlock(cfg, WalkAttention(cfg), mlp)])
        self.register_buffer("W_init", torch.zeros(0, dtype=cfg.dtype))
        self.setup()
        self.reset_parameters()

    # ------------------------------------------------------------------ parameters
    @property
    def attn(self) -> WalkAttention:
        return self.blocks[0].attn

    @property
    def V(self) -> Float[Tensor, "d_head K"]:
        """The paper's value matrix (K x K, or m x K with the FC+ReLU variant)."""
        return self.attn.V

    @property
    def u(self) -> Float[Tensor, " d_model"]:
        """``W q`` with ``q`` the :meth:`query_vector` (``x~_N``, or ``x~_N/||x~_N||``): all of W the model uses."""
        return self.attn.u

    @property
    def A(self) -> Float[Tensor, "K m"]:
        require(self.cfg.mlp_width is not None, "this model has no FC+ReLU layer")
        return self.blocks[0].mlp.A

    def query_vector(self) -> Float[Tensor, " d_model"]:
        """The query as the attention sees it: ``x~_N``, or ``r x~_N/||x~_N||`` with normalised tokens
        (``r = cfg.token_norm``, 1 by default; unless ``normalize_query`` is off: then only the keys
        are normalised, to length r)."""
        q = self.W_pos[-1]
        cfg = self.cfg
        return q / q.norm() * cfg.token_norm if cfg.normalize_tokens and cfg.normalize_query else q

    def u_lr_scale(self) -> float:
        """``||query||^2``: gradient descent on W moves ``u`` by this factor times ``-lr dL/du``."""
        return float(self.query_vector().pow(2).sum())

    def reset_parameters(self) -> None:
        """Zero or Gaussian(sigma) initialisation of V, W (through u) and A, from ``cfg.seed``."""
        cfg = self.cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        gaussian = cfg.init == "gaussian"

        def draw(*shape: int) -> Tensor:
            if not gaussian:
                return torch.zeros(*shape, dtype=torch.float64)
            return torch.randn(*shape, generator=gen, dtype=torch.float64) * cfg.init_sigma

        with torch.no_grad():
            self.attn.V.copy_(draw(*self.attn.V.shape))
            q = self.query_vector().to(torch.float64)
            if gaussian and cfg.d_model**2 <= MAX_STORED_W:
                W0 = draw(cfg.d_model, cfg.d_model)
                self.W_init = W0.to(cfg.dtype)
                self.attn.u.copy_(W0 @ q)
            else:
                # W_init x~_N has i.i.d. N(0, sigma^2 ||x~_N||^2) entries: draw it directly.
                self.W_init = torch.zeros(0, dtype=cfg.dtype)
                self.attn.u.copy_(draw(cfg.d_model) * q.norm())
            if cfg.mlp_width is not None:
                self.blocks[0].mlp.A.copy_(draw(*self.blocks[0].mlp.A.shape))

    @property
    def W(self) -> Float[Tensor, "d_model d_model"]:
        """The paper's merged key-query matrix.

        Gradient descent only ever adds multiples of ``g q^T`` (q the query vector), so
        ``W = W_init + (u - W_init q) q^T / ||q||^2`` exactly, with ``W_init = 0`` for zero init.
        """
        cfg = self.cfg
        q = self.query_vector()
        if cfg.init == "gaussian" and self.W_init.numel() == 0:
            raise RwinterpError("the initial W of this Gaussian-initialised model was too large to keep")
        require(cfg.d_model**2 <= 4 * MAX_STORED_W, f"W is {cfg.d_model} x {cfg.d_model}: too large to build")
        u = self.u.detach()
        if self.W_init.numel():
            base = self.W_init
            return base + torch.outer(u - base @ q, q) / q.pow(2).sum()
        return torch.outer(u, q) / q.pow(2).sum()

    # ------------------------------------------------------------------ TransformerLens weights
    @property
    def W_U(self) -> Float[Tensor, "d_model K"]:
        """Reads the output scores off the token coordinates of the residual stream."""
        return self.W_E[: self.cfg.n_states].T.contiguous()

    @property
    def W_Q(self) -> Float[Tensor, "n_layers n_heads d_model 1"]:
        """With ``W_K``, a rank-one factorisation of the query-key circuit on the model's domain:
        the query ``q`` gives ``q . W_Q = 1`` and keys are ``x~_i . u``, so the score is ``x~_i^T W q``.
        With ``normalize_tokens`` the score is this circuit applied to the normalised tokens
        ``x~_i / ||x~_i||`` (times ``token_norm``), not to the residual stream ``hook_resid_pre``.
        """
        q = self.query_vector()
        return (q / q.pow(2).sum())[None, None, :, None]

    @property
    def W_K(self) -> Float[Tensor, "n_layers n_heads d_model 1"]:
        return self.u[None, None, :, None]

    @property
    def W_V(self) -> Float[Tensor, "n_layers n_heads d_model d_head"]:
        """``[V^T; 0]``: values read only the token coordinates."""
        cfg = self.cfg
        W_V = self.V.new_zeros(cfg.d_model, cfg.d_head)
        W_V[: cfg.n_states] = self.V.T
        return W_V[None, None]

    @property
    def W_O(self) -> Float[Tensor, "n_layers n_heads d_head d_model"]:
        """Writes the head output into the first ``d_head`` residual coordinates."""
        return self.attn.W_O[None]

    @property
    def W_in(self) -> Float[Tensor, "n_layers d_model d_mlp"]:
        return self.W_O[0, 0].T.contiguous()[None]

    @property
    def W_out(self) -> Float[Tensor, "n_layers d_mlp d_model"]:
        W_out = self.A.new_zeros(self.cfg.d_mlp, self.cfg.d_model)
        W_out[:, : self.cfg.n_states] = self.A.T
        return W_out[None]

    # ------------------------------------------------------------------ forward
    def to_tokens(self, tokens: Any) -> Int[Tensor, "batch pos"]:
        """Tokens are already integer tensors (no tokenizer); accepts a task ``Batch`` too."""
        tokens = getattr(tokens, "tokens", tokens)
        return self._check_tokens(torch.as_tensor(tokens))

    def _check_tokens(self, tokens: Tensor) -> Tensor:
        cfg = self.cfg
        if tokens.ndim == 1:
            tokens = tokens[None]
        require(tokens.ndim == 2 and tokens.shape[1] == cfg.n_ctx,
                f"tokens must have shape [batch, {cfg.n_ctx}], got {list(tokens.shape)}")
        require(not tokens.is_floating_point(), "tokens must be an integer tensor")
        if tokens.numel():
            low, high = torch.aminmax(tokens)
            require(int(low) >= 0 and int(high) <= cfg.n_states,
                    f"tokens must lie in [0, {cfg.n_states}] ({cfg.n_states} is the query token)")
        return tokens

    def _dense_outputs(self) -> bool:
        block = self.blocks[0]
        names = ("hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post")
        return any(getattr(block, n).has_hooks() for n in names if hasattr(block, n))

    def _dense_inputs(self) -> bool:
        return any(h.has_hooks() for h in (self.hook_embed, self.hook_pos_embed,
                                            self.blocks[0].hook_resid_pre))

    def _query_edit(self, resid: Float[Tensor, "batch pos d_model"]) -> Optional[Float[Tensor, "batch pos"]]:
        """What a hook's edit of the query slot's input adds to the scores ``x~_i^T W q``.

        The forward pass uses ``u = W x~_N`` for the query, which holds while the query slot's row of
        the residual stream is ``x~_N``. A hook may change that row (zero it, scale it, add a
        direction); the query ``q`` is then that row (normalised like the keys if configured), and
        the scores gain ``x~_i^T W (q - x~_N)``, with ``W s = W_init s + (u - W_init x~_N)
        (x~_N . s) / ||x~_N||^2`` (:attr:`W`). The shift is exactly zero for an unedited row, so the
        outputs stay bit-identical; it is still formed when a gradient is wanted (backward hooks,
        gradient x input), so that the query's gradient includes its path through W, except for a
        Gaussian-initialised model too large to keep its initial W. None when neither applies.
        """
        cfg = self.cfg

        def seen(rows: Tensor) -> Tensor:  # as the attention sees them
            return rows / rows.norm(dim=-1, keepdim=True) * cfg.token_norm if cfg.normalize_tokens else rows

        as_query = seen if cfg.normalize_query else (lambda rows: rows)
        rows = resid[:, -1]
        shift = as_query(rows) - as_query(self.W_pos[-1].expand_as(rows))
        edited = bool(shift.ne(0).any())
        if not edited and not shift.requires_grad:
            return None
        if cfg.init == "gaussian" and self.W_init.numel() == 0:
            require(not edited, "an edit of the query slot's input needs the initial W, which this "
                                "Gaussian-initialised model was too large to keep")
            return None  # (unedited: the query's gradient leaves out its path through W, which is not kept)
        q = self.query_vector()
        along = (shift @ q / q.pow(2).sum())[:, None]  # [batch, 1]
        W_shift = along * self.u[None]
        if self.W_init.numel():
            W_shift = W_shift + shift @ self.W_init.T - along * (self.W_init @ q)[None]
        return torch.einsum("bpd,bd->bp", seen(resid), W_shift)

    def forward(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch 1 K"]:
        """The raw scores ``f(X)`` at the query slot, shaped ``[batch, 1, K]`` like logits."""
        tokens = self._check_tokens(tokens)
        cfg = self.cfg
        block = self.blocks[0]
        u = self.u
        K = cfg.n_states
        token_part = None
        if self._dense_inputs():
            embed, pos = self._embeddings(tokens)
            resid = block.hook_resid_pre(embed + pos)
            keys = resid @ u
            if cfg.normalize_tokens:
                keys = keys / resid.norm(dim=-1) * cfg.token_norm
            edit = self._query_edit(resid)
            if edit is not None:
                keys = keys + edit
            token_part = resid[..., :K]
        else:
            # x~_i . u = u_tok[x_i] + p_i . u_pos, without building [batch, pos, d_model].
            keys = (self.W_E @ u)[tokens] + BroadcastOverBatch.apply(self.W_pos @ u, tokens.shape[0])
            if cfg.normalize_tokens:  # ||x~_i||^2 = ||embedding||^2 + ||p_i||^2 (disjoint coordinates)
                keys = keys / (self.tok_sq[tokens] + self.pos_sq[None, :]).sqrt() * cfg.token_norm
        z = block.attn(keys, tokens, token_part)  # [batch, 1, 1, d_head]
        head_out = z[:, :, 0, :]
        if not self._dense_outputs():
            # Nothing reads the d_model-wide output stream: skip embedding into it.
            return head_out if cfg.mlp_width is None else block.mlp(head_out)
        # W_O writes the head output into the first d_head residual coordinates.
        attn_out = block.hook_attn_out(F.pad(head_out, (0, cfg.d_model - cfg.d_head)))
        if cfg.mlp_width is None:
            resid_post = block.hook_resid_post(attn_out)
        else:
            resid_mid = block.hook_resid_mid(attn_out)
            scores = block.mlp(resid_mid[..., : cfg.mlp_width])
            mlp_out = block.hook_mlp_out(F.pad(scores, (0, cfg.d_model - K)))
            resid_post = block.hook_resid_post(mlp_out)
        return resid_post[..., :K]

    def scores(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch K"]:
        """``f(X)`` as a ``[batch, K]`` tensor."""
        return self(tokens)[:, 0, :]

    def attention(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch pos"]:
        """The attention pattern of the query slot over all N positions."""
        store: dict[str, Tensor] = {}

        def grab(pattern: Tensor, hook: HookPoint) -> None:
            store["pattern"] = pattern

        self.run_with_hooks(tokens, fwd_hooks=[("blocks.0.attn.hook_pattern", grab)])
        return store["pattern"][:, 0, 0, :]



register_model_kind("walk", ModelKind(build=WalkTransformer, config_of=lambda model: model.cfg.to_dict(),
                                       full_config=lambda config: WalkTransformerConfig.from_dict(config).to_dict()))
