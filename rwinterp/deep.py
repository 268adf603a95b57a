"""A transformer with any number of layers and heads, of which the paper's model is one configuration.

The paper (PAPER.md section 2) studies one attention layer with one head, concatenated large-norm
positional embeddings, a merged key-query matrix W, values that read only the token coordinates,
no residual stream, zero initialisation and attention from the query slot alone. Reviewers asked
what happens when each of these choices is changed. :class:`DeepTransformer` makes every one of
them an option of a single readable model (one file, nanoGPT style), so a variant is a config, not
a copy:

====================  ======================================  ======================================
option                the paper                               alternatives
====================  ======================================  ======================================
``n_layers``          1                                       any
``n_heads``           1 (head outputs are summed)             any
``pos_mode``          ``concat``: ``x~_i = [x_i; p_i]``       ``added``: ``x_i + p_i`` in d_model dims
``pos_embedding``     ``orthogonal`` or ``sine`` (fixed,      ``learned``
                      squared norm = dim / 2)
``token_embedding``   ``onehot`` (query token -> 0)           ``learned``
``key_query``         ``merged``: score = ``x_k^T W x_q``      ``factored``: ``(x_q W_Q) . (x_k W_K)``
``attn_scale``        1 (no 1/sqrt(d) scaling)                e.g. ``sqrt(d_head)``
``values``            ``tokens``: W_V reads token coords      ``all`` coordinates
``readout``           ``fixed``: W_O writes the first d_head  ``learned`` W_O and W_U
                      coords, W_U reads the first K
``residual``          off: a block's output replaces its      on: added to it
                      input
``attention``         ``query``: only the last position       ``causal``: every position attends to
                      attends (and only it is updated)        itself and earlier ones
``mlp_width``         none (appendix F.2: m = 19)             a ReLU MLP per block
``act_fn``            ``relu``                                ``linear``: the MLP without its ReLU
``init``              ``zero``                                ``gaussian`` (sigma), ``standard``
====================  ======================================  ======================================

:meth:`DeepConfig.paper` and :meth:`DeepConfig.standard` give the two ends; :func:`from_walk_transformer`
copies a trained :class:`rwinterp.model.WalkTransformer` into the equivalent one-layer model (same
outputs to float round-off). With the paper's configuration, gradient descent on the merged W is
literally the paper's gradient descent on W (the paper's model stores only ``u = W x~_N``).

The forward pass
----------------
``resid = W_E[tokens] + W_pos`` (in ``concat`` mode W_E and W_pos live in disjoint coordinates, so
the sum is the concatenation). Each block computes, per head, scores from the (optionally unit
normalised) residual stream, a softmax over key positions (causal mask, or the query slot's row
only), ``z = pattern @ (resid W_V)`` and ``attn_out = sum_h z_h W_O[h]``; the rows being updated (the
last one in ``query`` mode, all in ``causal`` mode) become ``resid + attn_out`` (``attn_out`` without
the residual stream), then likewise with the MLP. Logits are ``resid @ W_U`` on the updated rows:
``[batch, 1, K]`` in ``query`` mode (like the paper's model), ``[batch, N, K]`` in ``causal`` mode
(position t predicts the next state; the query slot predicts the label). There is no
normalisation layer and no bias: logits are raw scores, as in the paper.

In ``query`` mode the other rows never change, so unless a hook asks for a tensor that holds them
(embeddings, residual stream, keys, values) the model builds only the query slot's row and reads
the others through ``[batch, heads, pos]`` tables (:class:`FixedRows`): at the paper's size (K 6,
N 97, M 1000, 1000 walks) a training step never materialises a 780 MB ``[batch, pos, d_model]``
tensor.

Hooks (HookedTransformer names; Q = 1 in ``query`` mode, N in ``causal`` mode)
------------------------------------------------------------------------------
==================================  ===========================  =====================================
hook                                shape                        content
==================================  ===========================  =====================================
``hook_embed``, ``hook_pos_embed``  ``[batch, pos, d_model]``    ``W_E[tokens]``, ``W_pos``
``blocks.L.hook_resid_pre``         ``[batch, pos, d_model]``    residual stream into block L
``blocks.L.attn.hook_q``            ``[batch, Q, H, d_qk]``      ``x_q W_Q`` (merged: ``W x_q``)
``blocks.L.attn.hook_k``            ``[batch, pos, H, d_qk]``    ``x_k W_K`` (merged: ``x_k``)
``blocks.L.attn.hook_v``            ``[batch, pos, H, d_head]``  ``resid W_V``
``blocks.L.attn.hook_attn_scores``  ``[batch, H, Q, pos]``       PRE-softmax scores (-inf masked)
``blocks.L.attn.hook_pattern``      ``[batch, H, Q, pos]``       softmax
``blocks.L.attn.hook_z``            ``[batch, Q, H, d_head]``    ``pattern @ v``
``blocks.L.hook_attn_out``          ``[batch, Q, d_model]``      ``sum_h z_h W_O[h]``
``blocks.L.hook_resid_mid``         ``[batch, pos, d_model]``    (with an MLP) after attention
``blocks.L.mlp.hook_pre/hook_post`` ``[batch, Q, d_mlp]``        ``resid W_in`` and its ReLU
``blocks.L.hook_mlp_out``           ``[batch, Q, d_model]``      ``post W_out``
``blocks.L.hook_resid_post``        ``[batch, pos, d_model]``    residual stream out of block L
==================================  ===========================  =====================================

``x_q``/``x_k`` are the residual rows divided by their norm (times ``token_norm``, default 1) when
``normalize_tokens`` is set (the paper's random-initialisation runs; ``normalize_query = False``
normalises the keys only). In
``query`` mode the rows other than the query slot pass through every block unchanged. With
``key_query = "merged"``, ``W_Q = W^T`` and ``W_K = I`` (``d_qk = d_model``), so ``W_Q W_K^T = W^T``
as TransformerLens expects (``score = q . k``).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from rwinterp.config import LibraryConfig, WalkTransformerConfig, dtype_name, resolve_dtype
from rwinterp.errors import require
from rwinterp.model import (HookedWalkModel, SymmetricReadout, WalkBlock, WalkTransformer, positional_embeddings,
                            with_gradient)
from rwinterp.runs import ModelKind, register_model_kind

#: The most layers, and the most heads per layer, a deep model may have.
MAX_LAYERS_OR_HEADS = 256
CHOICES = {
    "pos_mode": ("concat", "added"),
    "pos_embedding": ("orthogonal", "sine", "learned"),
    "token_embedding": ("onehot", "learned"),
    "key_query": ("merged", "factored"),
    "values": ("tokens", "all"),
    "readout": ("fixed", "learned"),
    "attention": ("query", "causal"),
    "init": ("zero", "gaussian", "standard"),
}

#: Fields a user sets (the rest of the config is derived from them).
USER_FIELDS = ("n_states", "n_ctx", "n_layers", "n_heads", "pos_mode", "pos_embedding", "pos_dim",
               "d_model", "d_head", "token_embedding", "d_token", "key_query", "attn_scale", "values",
               "readout", "residual", "attention", "mlp_width", "act_fn", "init", "init_sigma",
               "normalize_tokens", "normalize_query", "token_norm", "seed", "dtype")


@dataclass
class DeepConfig(LibraryConfig):
    """Configuration of :class:`DeepTransformer`. The defaults are the paper's model.

    ``d_model`` is the residual width in ``added`` mode; in ``concat`` mode it is derived as
    ``d_token + pos_dim`` (``d_token = K`` for one-hot tokens). ``d_head`` defaults to K with the
    fixed readout (the paper's V is K x K) and to ``d_model // n_heads`` otherwise.
    """

    user_fields: ClassVar[tuple[str, ...]] = USER_FIELDS

    # The model's options beyond the shared ones of LibraryConfig (see the module docstring).
    pos_mode: str = "concat"
    token_embedding: str = "onehot"
    d_token: Optional[int] = None
    key_query: str = "merged"
    attn_scale: float = 1.0
    values: str = "tokens"
    readout: str = "fixed"
    residual: bool = False
    attention: str = "query"

    def __post_init__(self) -> None:
        self.dtype = resolve_dtype(self.dtype)
        for name, allowed in CHOICES.items():
            value = getattr(self, name)
            require(value in allowed, f"{name.replace('_', ' ')} must be one of {', '.join(allowed)}, got {value!r}")
        K, N = self.n_states, self.n_ctx
        for name, value, low in (("the number of states K", K, 2), ("N", N, 2),
                                 ("the number of layers", self.n_layers, 1),
                                 ("the number of heads", self.n_heads, 1)):
            require(isinstance(value, int) and not isinstance(value, bool) and value >= low,
                    f"{name} must be an integer >= {low}, got {value}")
        for name, value in (("layers", self.n_layers), ("heads", self.n_heads)):
            require(value <= MAX_LAYERS_OR_HEADS,
                    f"a deep model takes at most {MAX_LAYERS_OR_HEADS} {name}, got {value}")
        concat = self.pos_mode == "concat"
        if concat:
            d_token = K if self.token_embedding == "onehot" or self.d_token is None else self.d_token
            require(self.token_embedding == "learned" or self.d_token in (None, K),
                    f"one-hot tokens take d_token = K = {K}, got {self.d_token}")
            require(isinstance(d_token, int) and d_token >= 1, f"d_token must be a positive integer, got {d_token}")
            require(isinstance(self.pos_dim, int) and self.pos_dim >= 1,
                    f"M (pos_dim) must be a positive integer, got {self.pos_dim}")
            self.d_token = d_token
            self.d_model = d_token + self.pos_dim
            self.positional_embedding_type = "concatenated"
        else:
            require(isinstance(self.d_model, int) and self.d_model >= 1,
                    "added positional embeddings need d_model, a positive integer")
            require(self.values == "all", "values='tokens' needs concatenated positional embeddings "
                    "(added ones share the token coordinates); use values='all'")
            require(self.token_embedding == "learned" or self.d_model >= K,
                    f"one-hot tokens need d_model >= K = {K}, got {self.d_model}")
            self.d_token = self.d_model
            self.pos_dim = self.d_model
            self.positional_embedding_type = "standard"
        M = self.pos_dim
        if self.pos_embedding == "orthogonal":
            require(M >= N, f"orthogonal positional embeddings need {'M' if concat else 'd_model'} >= N "
                    f"(got {M}, N={N})")
        elif self.pos_embedding == "sine":
            require(M > N, f"sine positional embeddings need {'M' if concat else 'd_model'} > N (got {M}, N={N})")
        if self.mlp_width is not None:
            require(isinstance(self.mlp_width, int) and self.mlp_width >= 1,
                    f"mlp width must be a positive integer, got {self.mlp_width}")
        if self.d_head in (-1, None):
            self.d_head = K if self.readout == "fixed" else max(1, self.d_model // self.n_heads)
        require(isinstance(self.d_head, int) and self.d_head >= 1,
                f"d_head must be a positive integer, got {self.d_head}")
        if self.readout == "fixed":
            require(self.d_head <= self.d_model and K <= self.d_model,
                    f"the fixed readout needs d_head <= d_model and K <= d_model (got d_head={self.d_head}"
                    f"{', set by the mlp width' if self.d_head == self.mlp_width else ''}, K={K}, "
                    f"d_model={self.d_model})")
        require(isinstance(self.attn_scale, (int, float)) and math.isfinite(self.attn_scale) and self.attn_scale > 0,
                f"attn_scale must be positive, got {self.attn_scale}")
        self.d_mlp = self.mlp_width
        self.attn_only = self.mlp_width is None
        self.d_vocab = K + 1
        self.d_vocab_out = K
        super().__post_init__()

    @property
    def d_qk(self) -> int:
        """Width of queries and keys: d_model for the merged W, d_head when factored."""
        return self.d_model if self.key_query == "merged" else self.d_head

    @property
    def d_value_in(self) -> int:
        """Residual coordinates that values read: the token part (paper) or all of them."""
        return self.d_token if self.values == "tokens" else self.d_model

    @classmethod
    def paper(cls, n_states: int, n_ctx: int, pos_dim: int, **overrides: Any) -> "DeepConfig":
        """The paper's model (PAPER.md section 2); ``overrides`` change single options.

        With ``mlp_width = m`` (appendix F.2) the head has ``d_head = m`` and an MLP follows it. It
        computes the paper's ``f = A ReLU(V X S)`` while ``W_in`` selects the head output (as
        :func:`from_walk_transformer` sets it), but ``W_in`` and all of ``W_out`` are learned and drawn
        from ``init`` like every other weight: a general one-hidden-layer MLP on the residual stream, of
        which the paper's variant is one point. ``WalkTransformer`` with ``mlp_width`` trains exactly the
        paper's A and V.
        """
        if overrides.get("mlp_width") is not None:
            overrides.setdefault("d_head", overrides["mlp_width"])
        return cls(n_states=n_states, n_ctx=n_ctx, pos_dim=pos_dim, **overrides)

    @classmethod
    def standard(cls, n_states: int, n_ctx: int, d_model: int, **overrides: Any) -> "DeepConfig":
        """A standard small transformer (see :func:`standard_options`)."""
        return cls(n_states=n_states, n_ctx=n_ctx, **standard_options(d_model, **overrides))

    def describe(self) -> str:
        """One line naming every option."""
        pos = f"{self.pos_mode} {self.pos_embedding}" + (f" M={self.pos_dim}" if self.pos_mode == "concat" else "")
        mlp = self.mlp_label()
        return (f"deep {self.n_layers} layer(s) x {self.n_heads} head(s), K={self.n_states} N={self.n_ctx} "
                f"d_model={self.d_model} d_head={self.d_head}, positions {pos}, tokens {self.token_embedding}, "
                f"{self.key_query} QK / {self.attn_scale:g}, values {self.values}, readout {self.readout}, "
                f"residual {'on' if self.residual else 'off'}, {self.attention} attention{mlp}, "
                f"init {self.init_label()}, {dtype_name(self.dtype)}")


def standard_options(d_model: int, **overrides: Any) -> dict[str, Any]:
    """The :class:`DeepConfig` fields of a standard small transformer, K and N aside: learned
    embeddings, added learned positions, factored QK scaled by ``1/sqrt(d_head)``, residual stream,
    causal attention, learned readout, GPT-2 init; ``overrides`` change single options."""
    options: dict[str, Any] = dict(
        pos_mode="added", pos_embedding="learned", token_embedding="learned", key_query="factored",
        values="all", readout="learned", residual=True, attention="causal", init="standard", d_model=d_model)
    options.update(overrides)
    if "attn_scale" not in options:
        heads = options.get("n_heads", 1)
        options["attn_scale"] = math.sqrt(options.get("d_head") or max(1, options["d_model"] // heads))
    return options


# ---------------------------------------------------------------------------------------- layers


class QueryProjection(torch.autograd.Function):
    """``q = W[h] x_q`` for merged key-query weights, whose W-gradient keeps equal rows bit-equal.

    When every walk has the same query row (the first layer's query slot, and any layer while the
    walks are symmetric), ``dW[h] = (sum_b dq_b) x_q^T``: the sum over walks runs along the innermost
    axis, the same code path for every row, and the outer product is exact entry by entry. A matmul
    over walks rounds rows at the edge of its SIMD blocks differently, which puts position-dependent
    round-off into the attention and breaks Theorem 4.1's exact symmetry on some CPUs (see
    :class:`rwinterp.model.SymmetricReadout` for the value side). The forward pass then computes
    ``W[h] x_q`` once for all walks."""

    @staticmethod
    def forward(ctx: Any, x_q: Tensor, W: Tensor) -> Tensor:  # x_q [b, q, m], W [h, n, m] -> [b, q, h, n]
        ctx.shared = x_q.shape[1] == 1 and torch.equal(x_q, x_q[:1].expand_as(x_q))
        ctx.save_for_backward(x_q, W)
        if ctx.shared:  # (a copy, not a view: patching hooks write into q in place)
            return torch.einsum("bqm,hnm->bqhn", x_q[:1], W).expand(x_q.shape[0], -1, -1, -1).contiguous()
        return torch.einsum("bqm,hnm->bqhn", x_q, W)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], Tensor]:
        x_q, W = ctx.saved_tensors
        grad_x = torch.einsum("bqhn,hnm->bqm", grad, W) if ctx.needs_input_grad[0] else None
        if ctx.shared:
            summed = grad[:, 0].permute(1, 2, 0).contiguous().sum(-1)  # [h, n], summed over walks
            grad_W = summed[:, :, None] * x_q[0, 0][None, None, :]
        else:
            grad_W = torch.einsum("bqhn,bqm->hnm", grad, x_q)
        return grad_x, grad_W


@dataclass
class FixedRows:
    """The rows of the residual stream that no block changes in ``query`` mode, without building them.

    In ``query`` mode only the query slot's row is updated: every other row ``i`` keeps its
    embedding ``W_E[t_i] + W_pos[i]`` through every block. A block reads those rows only through
    dot products (keys: ``row_i . a`` for a vector ``a`` per walk and head) and through the value
    inputs, and both are sums over the K + 1 token embeddings and the N positional ones:
    ``row_i . a = (W_E a)[t_i] + (W_pos a)[i]``, and with normalised keys ``||row_i||^2 =
    ||W_E[t_i]||^2 + 2 W_E[t_i] . W_pos[i] + ||W_pos[i]||^2``. So the forward pass needs
    ``[batch, heads, pos]`` tables, not the ``[batch, pos, d_model]`` stream (780 MB per copy in
    float64 at the paper's K 6, N 97, M 1000 and 1000 walks). :class:`DeepTransformer` uses this
    whenever no hook asks for a tensor that holds those rows (embeddings, residual stream, keys,
    values).
    """

    tokens: Int[Tensor, "batch fixed"]
    W_E: Float[Tensor, "d_vocab d_model"]
    W_pos: Float[Tensor, "fixed d_model"]
    norm: Optional[Float[Tensor, "batch fixed"]]  # ||row_i|| / token_norm with normalised keys, else None

    @classmethod
    def split(
        cls, model: "DeepTransformer", tokens: Int[Tensor, "batch pos"]
    ) -> tuple["FixedRows", Float[Tensor, "batch 1 d_model"]]:
        """``model``'s residual stream on ``tokens`` as its fixed rows (all but the last) and the
        query slot's row, which the blocks update."""
        cfg = model.cfg
        W_E, W_pos = model.W_E, model.W_pos
        query_row = W_E[tokens[:, -1:]] + W_pos[-1:]
        W_pos, tokens = W_pos[:-1], tokens[:, :-1]
        norm = None
        if cfg.normalize_tokens:
            squared = (W_E.pow(2).sum(-1)[:, None] + 2 * W_E @ W_pos.T + W_pos.pow(2).sum(-1)[None, :])
            norm = squared.clamp_min(0).sqrt().clamp_min(1e-30)[tokens, torch.arange(tokens.shape[1])]
            norm = norm / cfg.token_norm
        return cls(tokens, W_E, W_pos, norm), query_row

    def dot(self, a: Float[Tensor, "batch H d_model"]) -> Float[Tensor, "batch H fixed"]:
        """``x_i . a[b, h]`` for every fixed row, ``x_i`` the row as the keys see it (normalised if
        configured)."""
        by_token = torch.einsum("vm,bhm->bhv", self.W_E, a)
        dots = (by_token.gather(2, self.tokens[:, None, :].expand(-1, a.shape[1], -1))
                + torch.einsum("pm,bhm->bhp", self.W_pos, a))
        return dots if self.norm is None else dots / self.norm[:, None, :]

    def token_rows(self, width: int) -> Float[Tensor, "batch fixed width"]:
        """The first ``width`` coordinates of every fixed row, where the positional embeddings are
        zero (the token part in ``concat`` mode)."""
        return self.W_E[:, :width][self.tokens]

    def values(self, W_V: Float[Tensor, "H width d_head"]) -> Float[Tensor, "batch fixed H d_head"]:
        """``row_i[:width] W_V[h]`` for every fixed row and head."""
        width = W_V.shape[1]
        by_token = torch.einsum("vm,hmd->vhd", self.W_E[:, :width], W_V)
        return by_token[self.tokens] + torch.einsum("pm,hmd->phd", self.W_pos[:, :width], W_V)


class Attention(nn.Module):
    """Multi-head attention with merged (``W``) or factored (``W_Q``, ``W_K``) key-query weights."""

    def __init__(self, cfg: DeepConfig):
        super().__init__()
        self.cfg = cfg
        H, D, d = cfg.n_heads, cfg.d_model, cfg.d_head
        if cfg.key_query == "merged":
            self.W = nn.Parameter(torch.zeros(H, D, D, dtype=cfg.dtype))  # score = x_k^T W[h] x_q
        else:
            self.W_Q = nn.Parameter(torch.zeros(H, D, d, dtype=cfg.dtype))
            self.W_K = nn.Parameter(torch.zeros(H, D, d, dtype=cfg.dtype))
        self.W_V = nn.Parameter(torch.zeros(H, cfg.d_value_in, d, dtype=cfg.dtype))
        if cfg.readout == "learned":
            self.W_O = nn.Parameter(torch.zeros(H, d, D, dtype=cfg.dtype))
        else:  # every head writes into the first d_head residual coordinates (the paper's f = V X S)
            self.register_buffer("W_O", torch.eye(d, D, dtype=cfg.dtype).expand(H, d, D).clone(), persistent=False)
        for name in ("hook_q", "hook_k", "hook_v", "hook_attn_scores", "hook_pattern", "hook_z"):
            setattr(self, name, HookPoint())

    def averaged_values(
        self, pattern: Float[Tensor, "batch H 1 pos"], resid: Float[Tensor, "batch pos d_model"]
    ) -> Float[Tensor, "batch 1 H d_head"]:
        """``z = (X S) W_V`` per head: the attention-weighted average of the value inputs ``X S``,
        summed over positions in position order (a cumulative sum), then read out by
        :class:`rwinterp.model.SymmetricReadout`.

        Equal to ``pattern @ (X W_V)`` in exact arithmetic. That einsum form sums each row of W_V's
        gradient over a different set of (walk, position) entries, and the round-off this leaves
        between rows breaks Theorem 4.1's exact symmetry of the deterministic walk on some CPUs. Here
        equal one-hot token counts are bit-equal and every gradient row is reduced by the same code
        path. Used in ``query`` mode with token values (``[batch, H, pos, d_token]`` is small)."""
        x = resid[:, None, :, : self.cfg.d_value_in]  # [b, 1, pos, m]
        weights = pattern[:, :, 0, :, None]  # [b, H, pos, 1]
        averaged = (weights * x).cumsum(dim=2)[:, :, -1]  # [b, H, m]
        z = [SymmetricReadout.apply(averaged[:, h], self.W_V[h].T) for h in range(self.cfg.n_heads)]
        return torch.stack(z, dim=1)[:, None]

    def forward(
        self, resid: Float[Tensor, "batch rows d_model"], fixed: Optional["FixedRows"] = None
    ) -> Float[Tensor, "batch Q d_model"]:
        """The attention output of the rows being updated. ``resid`` is the whole residual stream, or,
        with ``fixed`` (``query`` mode, see :class:`FixedRows`), the query slot's row alone."""
        cfg = self.cfg
        x = (resid / resid.norm(dim=-1, keepdim=True).clamp_min(1e-30) * cfg.token_norm
             if cfg.normalize_tokens else resid)
        x_q = x if cfg.normalize_query else resid
        x_q = x_q[:, -1:] if cfg.attention == "query" else x_q
        if cfg.key_query == "merged":
            q = self.hook_q(QueryProjection.apply(x_q, self.W))  # W[h] x_q
        else:
            q = self.hook_q(torch.einsum("bqm,hmd->bqhd", x_q, self.W_Q))
        if fixed is None:
            if cfg.key_query == "merged":
                k = with_gradient(x[:, :, None, :].expand(-1, -1, cfg.n_heads, -1), self.hook_k)
            else:
                k = torch.einsum("bpm,hmd->bphd", x, self.W_K)
            scores = torch.einsum("bqhd,bphd->bhqp", q, self.hook_k(k)) / cfg.attn_scale
        else:  # score = key_row . a with a = W_K[h] q (merged: a = q)
            a = q[:, 0] if cfg.key_query == "merged" else torch.einsum("bhd,hmd->bhm", q[:, 0], self.W_K)
            own = (x[:, -1:] * a).sum(-1, keepdim=True)  # the query slot as its own key
            scores = torch.cat([fixed.dot(a), own], dim=-1)[:, :, None, :] / cfg.attn_scale
        if cfg.attention == "causal":
            n = scores.shape[-1]
            future = torch.triu(torch.ones(n, n, dtype=torch.bool, device=scores.device), diagonal=1)
            scores = scores.masked_fill(future, float("-inf"))
        scores = self.hook_attn_scores(scores)
        pattern = self.hook_pattern(torch.softmax(scores, dim=-1))
        if cfg.attention == "query" and cfg.values == "tokens" and not self.hook_v.has_hooks():
            rows = resid if fixed is None else torch.cat([fixed.token_rows(cfg.d_value_in),
                                                          resid[..., : cfg.d_value_in]], dim=1)
            z = self.averaged_values(pattern, rows)
        else:
            v = torch.einsum("bpm,hmd->bphd", resid[..., : cfg.d_value_in], self.W_V)
            v = self.hook_v(v if fixed is None else torch.cat([fixed.values(self.W_V), v], dim=1))
            z = torch.einsum("bhqp,bphd->bqhd", pattern, v)
        z = self.hook_z(z)
        return torch.einsum("bqhd,hdm->bqm", z, self.W_O)


class MLP(nn.Module):
    """``ReLU(x W_in) W_out``, no biases (the paper's FC+ReLU variant when W_in selects z); with
    ``act_fn = "linear"``, ``x W_in W_out``."""

    def __init__(self, cfg: DeepConfig):
        super().__init__()
        self.activation = cfg.activation
        self.W_in = nn.Parameter(torch.zeros(cfg.d_model, cfg.mlp_width, dtype=cfg.dtype))
        self.W_out = nn.Parameter(torch.zeros(cfg.mlp_width, cfg.d_model, dtype=cfg.dtype))
        self.hook_pre = HookPoint()
        self.hook_post = HookPoint()

    def forward(self, x: Float[Tensor, "batch Q d_model"]) -> Float[Tensor, "batch Q d_model"]:
        return self.hook_post(self.activation(self.hook_pre(x @ self.W_in))) @ self.W_out


class Block(WalkBlock):
    def __init__(self, cfg: DeepConfig):
        super().__init__(cfg, Attention(cfg), MLP(cfg) if cfg.mlp_width is not None else None)

    def _update(self, resid: Tensor, out: Tensor) -> Tensor:
        """Replace the rows being computed (the last ``Q``) by ``resid + out`` or ``out``."""
        Q = out.shape[1]
        rows = resid[:, -Q:] + out if self.cfg.residual else out
        return rows if resid.shape[1] == Q else torch.cat([resid[:, : resid.shape[1] - Q], rows], dim=1)

    def forward(
        self, resid: Float[Tensor, "batch rows d_model"], fixed: Optional["FixedRows"] = None
    ) -> Float[Tensor, "batch rows d_model"]:
        """The residual stream out of the block: all of it, or with ``fixed`` the query slot's row."""
        resid = self.hook_resid_pre(resid)
        attn_out = self.hook_attn_out(self.attn(resid, fixed))
        resid = self._update(resid, attn_out)
        if self.cfg.mlp_width is not None:
            resid = self.hook_resid_mid(resid)
            mlp_out = self.hook_mlp_out(self.mlp(resid[:, -attn_out.shape[1]:]))
            resid = self._update(resid, mlp_out)
        return self.hook_resid_post(resid)


# ---------------------------------------------------------------------------------------- model


class DeepTransformer(HookedWalkModel):
    """See the module docstring. Build with ``DeepTransformer(DeepConfig(...))``."""

    run_kind = "deep"

    def __init__(self, cfg: DeepConfig | dict):
        super().__init__()
        # A copy: ``.float()`` on this model updates its cfg.dtype, not that of another model built
        # from the same config.
        cfg = DeepConfig.from_dict(cfg) if isinstance(cfg, dict) else copy.deepcopy(cfg)
        self.cfg = cfg
        K, N = cfg.n_states, cfg.n_ctx
        if cfg.token_embedding == "learned":
            self.embed = nn.Parameter(torch.zeros(K + 1, cfg.d_token, dtype=cfg.dtype))
        else:  # one-hot; the query token embeds to zero (the paper's query slot x_N = 0)
            onehot = torch.eye(K + 1, cfg.d_token, dtype=cfg.dtype) * (torch.arange(K + 1) < K)[:, None]
            self.register_buffer("embed", onehot, persistent=False)
        if cfg.pos_embedding == "learned":
            self.pos_embed = nn.Parameter(torch.zeros(N, cfg.pos_dim, dtype=cfg.dtype))
        else:
            self.register_buffer("pos_embed", positional_embeddings(cfg.pos_embedding, N, cfg.pos_dim).to(cfg.dtype),
                                 persistent=False)
        if cfg.readout == "learned":
            self.unembed = nn.Parameter(torch.zeros(cfg.d_model, K, dtype=cfg.dtype))
        else:  # read the scores off the first K residual coordinates
            self.register_buffer("unembed", torch.eye(cfg.d_model, K, dtype=cfg.dtype), persistent=False)
        self.hook_embed = HookPoint()
        self.hook_pos_embed = HookPoint()
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layers)])
        self.setup()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw every learned parameter from ``cfg.init`` with a generator seeded by ``cfg.seed``.

        ``zero``: all zero (the paper's). ``gaussian``: i.i.d. N(0, init_sigma^2) (the paper's random
        initialisation). ``standard``: N(0, (0.8 / sqrt(d_model))^2), TransformerLens's GPT-2
        initialisation (as in :mod:`rwinterp.standard`). Fixed embeddings and readouts stay as built.
        Note that zero-initialised factored key-query weights never move (their gradients are
        products of each other) and zero-initialised learned embeddings see no gradient through zero
        values: zero initialisation is meant for the paper's merged W and one-hot tokens.
        """
        cfg = self.cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        std = {"zero": 0.0, "gaussian": cfg.init_sigma, "standard": 0.8 / math.sqrt(cfg.d_model)}[cfg.init]
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float64) * std)

    # ------------------------------------------------------------------ TransformerLens weights
    @property
    def W_E(self) -> Float[Tensor, "d_vocab d_model"]:
        """Token embeddings, zero on the positional coordinates in ``concat`` mode."""
        return F.pad(self.embed, (0, self.cfg.d_model - self.embed.shape[1]))

    @property
    def W_pos(self) -> Float[Tensor, "n_ctx d_model"]:
        """Positional embeddings, on the coordinates after the token part in ``concat`` mode."""
        return F.pad(self.pos_embed, (self.cfg.d_model - self.pos_embed.shape[1], 0))

    @property
    def W_U(self) -> Float[Tensor, "d_model K"]:
        return self.unembed

    def _stack(self, name: str) -> Tensor:
        return torch.stack([getattr(block.attn, name) for block in self.blocks])

    @property
    def W_Q(self) -> Float[Tensor, "n_layers n_heads d_model d_qk"]:
        """Merged: ``W^T`` (with ``W_K = I``, ``q . k = x_k^T W x_q``)."""
        if self.cfg.key_query == "merged":
            return self._stack("W").transpose(-2, -1)
        return self._stack("W_Q")

    @property
    def W_K(self) -> Float[Tensor, "n_layers n_heads d_model d_qk"]:
        if self.cfg.key_query == "merged":
            cfg = self.cfg
            return torch.eye(cfg.d_model, dtype=cfg.dtype).expand(cfg.n_layers, cfg.n_heads, -1, -1)
        return self._stack("W_K")

    @property
    def W_V(self) -> Float[Tensor, "n_layers n_heads d_model d_head"]:
        """Zero on the positional rows when values read only the token coordinates."""
        W_V = self._stack("W_V")
        return F.pad(W_V, (0, 0, 0, self.cfg.d_model - W_V.shape[-2]))

    @property
    def W_O(self) -> Float[Tensor, "n_layers n_heads d_head d_model"]:
        return self._stack("W_O")

    @property
    def W_in(self) -> Float[Tensor, "n_layers d_model d_mlp"]:
        require(self.cfg.mlp_width is not None, "this model has no MLP")
        return torch.stack([block.mlp.W_in for block in self.blocks])

    @property
    def W_out(self) -> Float[Tensor, "n_layers d_mlp d_model"]:
        require(self.cfg.mlp_width is not None, "this model has no MLP")
        return torch.stack([block.mlp.W_out for block in self.blocks])

    @property
    def V(self) -> Optional[Float[Tensor, "K K"]]:
        """The single head's token-to-score map ``(W_E[:K] W_V W_O W_U)^T`` (the paper's V when
        configured like the paper); ``None`` unless the model has one layer, one head and no MLP."""
        cfg = self.cfg
        if cfg.n_layers != 1 or cfg.n_heads != 1 or cfg.mlp_width is not None:
            return None
        return (self.W_E[: cfg.n_states] @ self.W_V[0, 0] @ self.W_O[0, 0] @ self.W_U).T

    # ------------------------------------------------------------------ forward
    # Tokens: integer tensors [batch, N] in [0, K] (no tokenizer), checked as for the paper's model.
    to_tokens = WalkTransformer.to_tokens
    _check_tokens = WalkTransformer._check_tokens

    def forward(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch Q K"]:
        """Logits (raw scores) at the query slot (``[batch, 1, K]``) or at every position (causal)."""
        tokens = self._check_tokens(tokens)
        fixed = None
        if self._rows_stay_implicit():
            fixed, resid = FixedRows.split(self, tokens)
        else:
            embed, pos = self._embeddings(tokens)
            resid = embed + pos
        for block in self.blocks:
            resid = block(resid, fixed)
        rows = 1 if self.cfg.attention == "query" else self.cfg.n_ctx
        return resid[:, -rows:] @ self.W_U

    def _rows_stay_implicit(self) -> bool:
        """``query`` mode with no hook on a tensor that holds the rows the blocks leave unchanged:
        those rows are then read through :class:`FixedRows`, and only the query slot's row is built
        (the same outputs and gradients to round-off, ``tests/test_deep.py``)."""
        if self.cfg.attention != "query":
            return False
        points = [self.hook_embed, self.hook_pos_embed]
        for block in self.blocks:
            points += [block.hook_resid_pre, block.hook_resid_post, block.attn.hook_k, block.attn.hook_v]
            points += [block.hook_resid_mid] if self.cfg.mlp_width is not None else []
        return not any(point.has_hooks() for point in points)

    def scores(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch K"]:
        """The scores of the label at the query slot, ``[batch, K]``."""
        return self(tokens)[:, -1, :]

    def attention(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch n_layers n_heads pos"]:
        """The attention pattern of the query slot over all N positions, for every layer and head."""
        names = {f"blocks.{layer}.attn.hook_pattern" for layer in range(self.cfg.n_layers)}
        _, cache = self.run_with_cache(tokens, names_filter=lambda name: name in names)
        return torch.stack([cache[f"blocks.{layer}.attn.hook_pattern"][:, :, -1, :]
                            for layer in range(self.cfg.n_layers)], dim=1)



# ---------------------------------------------------------------------------------------- the paper


def paper_config(walk_cfg: WalkTransformerConfig) -> DeepConfig:
    """The :class:`DeepConfig` equivalent to a :class:`rwinterp.config.WalkTransformerConfig`."""
    return DeepConfig.paper(
        walk_cfg.n_states, walk_cfg.n_ctx, walk_cfg.pos_dim, pos_embedding=walk_cfg.pos_embedding,
        normalize_tokens=walk_cfg.normalize_tokens, normalize_query=walk_cfg.normalize_query,
        token_norm=walk_cfg.token_norm, mlp_width=walk_cfg.mlp_width, act_fn=walk_cfg.act_fn, init=walk_cfg.init,
        init_sigma=walk_cfg.init_sigma, seed=walk_cfg.seed, dtype=walk_cfg.dtype)


@torch.no_grad()
def from_walk_transformer(walk: WalkTransformer) -> DeepTransformer:
    """A one-layer :class:`DeepTransformer` holding a paper model's weights (same outputs).

    W is rebuilt from the paper model's ``u`` (see ``WalkTransformer.W``); V becomes ``W_V = V^T``;
    the FC+ReLU variant's ``A`` becomes ``W_out = [A^T 0]`` with ``W_in`` selecting the head output.
    """
    model = DeepTransformer(paper_config(walk.cfg))
    attn = model.blocks[0].attn
    attn.W[0].copy_(walk.W)  # score_i = x~_i^T W x~_N in both models
    attn.W_V[0].copy_(walk.V.detach().T)
    if walk.cfg.mlp_width is not None:
        mlp = model.blocks[0].mlp
        mlp.W_in.copy_(torch.eye(model.cfg.d_model, walk.cfg.mlp_width, dtype=model.cfg.dtype))
        mlp.W_out.zero_()
        mlp.W_out[:, : walk.cfg.n_states] = walk.A.detach().T
    model.eval()
    return model


register_model_kind("deep", ModelKind(build=DeepTransformer, config_of=lambda model: model.cfg.to_dict(),
                                       full_config=lambda config: DeepConfig.from_dict(config).to_dict()))
