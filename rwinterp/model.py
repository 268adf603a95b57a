"""rwinterp's transformer: any number of layers and heads, of which the paper's model is one configuration.

The paper's model (``docs/model.md``) reads N tokens, the last one the query slot, and outputs raw scores

    f(X) = V X softmax(X~^T W x~_N)                    (attention only)
    f(X) = A act(V X softmax(X~^T W x~_N))             (with an FC layer of width m; act = ReLU or none)

where ``x~_i = [x_i; p_i]`` concatenates the one-hot token ``x_i`` (zero for the query) with a fixed
positional embedding ``p_i`` of squared norm M/2, the softmax runs over all N positions with no
1/sqrt(d) scaling, values see only the token part, there is no residual stream and no output softmax.
Each of these choices is an option of :class:`DeepConfig` (see :class:`rwinterp.config.DeepOptions`),
so a variant is a configuration, not a copy:

====================  ======================================  ======================================
option                the paper                               alternatives
====================  ======================================  ======================================
``n_layers``          1                                       any
``n_heads``           1 (head outputs are summed)             any
``pos_mode``          ``concat``: ``x~_i = [x_i; p_i]``       ``added``: ``x_i + p_i`` in d_model dims
``pos_embedding``     ``orthogonal`` or ``sine`` (fixed,      ``learned``
                      squared norm = M / 2)
``token_embedding``   ``onehot`` (query token -> 0)           ``learned``
``key_query``         ``merged``: score = ``x_k^T W x_q``      ``factored``: ``(x_q W_Q) . (x_k W_K)``
``attn_scale``        1 (no 1/sqrt(d) scaling)                e.g. ``sqrt(d_head)``
``values``            ``tokens``: W_V reads token coords      ``all`` coordinates
``readout``           ``fixed``: W_O writes the first d_head  ``learned`` W_O and W_U (and MLP W_in)
                      coords, W_U reads the first K, an FC
                      layer reads the first m and writes K
``residual``          off: a block's output replaces its      on: added to it
                      input
``attention``         ``query``: only the last position       ``causal``: every position attends to
                      attends (and only it is updated)        itself and earlier ones
``mlp_width``         none (the FC variant: m = 19)           an FC layer per block
``init``              ``zero``                                ``gaussian`` (sigma), ``standard``
====================  ======================================  ======================================

:meth:`DeepConfig.paper` and :meth:`DeepConfig.standard` give the two ends.

The forward pass
----------------
``resid = W_E[tokens] + W_pos`` (in ``concat`` mode W_E and W_pos live in disjoint coordinates, so the
sum is the concatenation). Each block computes, per head, scores from the (optionally unit normalised)
residual stream, a softmax over key positions (causal mask, or the query slot's row only), ``z = pattern
@ (resid W_V)`` and ``attn_out = sum_h z_h W_O[h]``; the rows being updated (the last one in ``query``
mode, all in ``causal`` mode) become ``resid + attn_out`` (``attn_out`` without the residual stream),
then likewise with the MLP. Logits are ``resid @ W_U`` on the updated rows: ``[batch, 1, K]`` in
``query`` mode, ``[batch, N, K]`` in ``causal`` mode (position t predicts the next state). There is no
normalisation layer and no bias: logits are raw scores, as in the paper.

Two paths that compute the same function faster
-----------------------------------------------
* **The rank-one query** (the paper's configuration, ``rank_one_query``): when one layer attends from
  the query slot and the embeddings are fixed, the query ``x~_N = [0; p_N]`` is the same for every
  sample, so only ``u = W x~_N`` enters the forward pass and every gradient of W is an outer product
  ``g x~_N^T``. The model then stores ``u`` (``blocks.0.attn.u``) and never materialises the
  ``(K+M) x (K+M)`` matrix W: gradient descent on W is gradient descent on u with the learning rate
  scaled by ``||x~_N||^2`` (:meth:`DeepTransformer.param_groups`). The full W is
  :attr:`DeepTransformer.W`, rebuilt exactly from u and the stored initial W. Attention scores come
  from the tokens (``u_tok[x_i] + p_i . u_pos``) and values from token counts, without any
  ``[batch, pos, d_model]`` tensor, unless a hook asks for one; a hook that edits the query slot's row
  is followed (the scores then use W on the edited query). With raw (not normalised) tokens and no hook
  on the attention, the softmax separates too, ``exp(u_tok[x_i] + p_i . u_pos) = exp(u_tok[x_i])
  exp(p_i . u_pos)``, and neither the ``[batch, pos]`` scores nor the pattern is formed
  (:class:`SeparableAttention`; :func:`training_logits` gives training the pattern's rows from it).
* **Fixed rows** (any ``query``-mode model): the rows other than the query slot never change, so unless
  a hook asks for a tensor that holds them the model builds only the query slot's row and reads the
  others through ``[batch, heads, pos]`` tables (:class:`FixedRows`).

Both give the outputs and gradients of the dense computation to round-off (``tests/test_model.py``),
and the sums whose round-off would break the exact symmetry of the deterministic walk are done by
:class:`SymmetricReadout`, :class:`QueryProjection` and :class:`SeparableAttention`.

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
``blocks.L.hook_resid_mid``         ``[batch, rows, d_model]``   (with an MLP) after attention
``blocks.L.mlp.hook_pre/hook_post`` ``[batch, Q, d_mlp]``        ``resid W_in`` and its activation
``blocks.L.hook_mlp_out``           ``[batch, Q, d_model]``      ``post W_out``
``blocks.L.hook_resid_post``        ``[batch, rows, d_model]``   residual stream out of block L
==================================  ===========================  =====================================

``rows`` is ``pos``, except with the rank-one query, where the block output holds the query slot's row
alone (``[batch, 1, d_model]``). ``x_q``/``x_k`` are the residual rows divided by their norm (times
``token_norm``) when ``normalize_tokens`` is set (``normalize_query = False`` normalises the keys only).
With ``key_query = "merged"``, ``W_Q = W^T`` and ``W_K = I`` (``d_qk = d_model``), so ``W_Q W_K^T = W^T``
as TransformerLens expects (``score = q . k``); with the rank-one query the key-query circuit is the
rank-one ``W_Q = x~_N / ||x~_N||^2``, ``W_K = u`` (``d_qk = 1``): ``hook_q`` holds ones and ``hook_k``
the keys ``x~_i . u``, formed only when hooked.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor, nn
from transformer_lens.ActivationCache import ActivationCache
from transformer_lens.config import TransformerLensConfig
from transformer_lens.FactoredMatrix import FactoredMatrix
from transformer_lens.hook_points import HookPoint
from transformer_lens.HookedRootModule import HookedRootModule

from rwinterp.config import DeepOptions
from rwinterp.errors import RwinterpError, require
from rwinterp.runs import register_model_kind

DTYPES = {"float32": torch.float32, "float64": torch.float64}
#: Largest d_model x d_model for which a Gaussian-initialised rank-one model keeps its full initial W.
MAX_STORED_W = 1 << 22


def resolve_dtype(dtype: "str | torch.dtype") -> torch.dtype:
    """A supported torch dtype from its name or itself; anything else is a one-line error."""
    if isinstance(dtype, str):
        require(dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    require(dtype in DTYPES.values(), f"unsupported dtype {dtype}; use float32 or float64")
    return dtype


@dataclass
class DeepConfig(DeepOptions, TransformerLensConfig):
    """A :class:`rwinterp.config.DeepOptions` with the fields TransformerLens derives from it (``d_model``,
    ``d_head``, ``d_vocab = K + 1`` with the query token, ``d_vocab_out = K``, ...), so that the model
    satisfies TransformerLens' model protocol. Build it like the options: ``DeepConfig.paper(K, N, M)``,
    ``DeepConfig.standard(K, N, d_model)`` or ``DeepConfig(**fields)``."""

    device: Optional[str] = "cpu"
    normalization_type: Optional[str] = None
    positional_embedding_type: str = "concatenated"
    default_prepend_bos: bool = False

    def __post_init__(self) -> None:
        self.dtype = resolve_dtype(self.dtype)
        self.validate()
        self.d_token = self.token_width
        self.d_head = self.head_width
        self.d_model = self.width
        if self.pos_mode == "added":
            self.pos_dim = self.d_model
            self.positional_embedding_type = "standard"
        self.d_mlp = self.mlp_width
        self.attn_only = self.mlp_width is None
        self.d_vocab = self.n_states + 1
        self.d_vocab_out = self.n_states
        TransformerLensConfig.__post_init__(self)

    @property
    def d_qk(self) -> int:
        """Width of queries and keys: 1 with the rank-one query, d_model for a merged W, d_head factored."""
        if self.rank_one:
            return 1
        return self.d_model if self.key_query == "merged" else self.d_head

    @property
    def d_value_in(self) -> int:
        """Residual coordinates that values read: the token part (the paper's) or all of them."""
        return self.d_token if self.values == "tokens" else self.d_model

    @property
    def rank_one(self) -> bool:
        """Whether the model keeps only ``u = W x~_N`` of its key-query matrix (see the module docstring): the
        paper's configuration, whose one layer attends from a query slot whose row never changes."""
        return (self.rank_one_query and self.n_layers == 1 and self.n_heads == 1 and self.attention == "query"
                and self.key_query == "merged" and self.token_embedding == "onehot" and self.pos_mode == "concat"
                and self.pos_embedding != "learned" and self.values == "tokens" and self.readout == "fixed"
                and not self.residual and self.attn_scale == 1)

    @property
    def activation(self) -> Any:
        """The FC layer's activation: ReLU, or none (``linear``)."""
        return torch.relu if self.act_fn == "relu" else identity


def identity(x: Tensor) -> Tensor:
    """The ``linear`` activation."""
    return x


# ---------------------------------------------------------------------------------------- building blocks


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


def _inner_sum(a: Tensor, b: Tensor) -> Tensor:
    """``(a * b).sum(-1)`` with the product laid out contiguously, so the sum is a row reduction."""
    return (a.contiguous() * b.contiguous()).contiguous().sum(-1)


def _batch_first(info: Any, in_dims: tuple, *args: Any) -> list[Any]:
    """The arguments of a ``vmap`` rule with the vmapped dimension first: moved there, or (for a tensor that
    is not batched) added by expansion; other arguments as they are. Batched tensors are made contiguous: a
    batched result often comes out with the batch dimension innermost (a matmul with a stacked vector), and
    kernels that read such a tensor across its rows run several times slower."""
    out = []
    for arg, dim in zip(args, in_dims):
        if not isinstance(arg, Tensor):
            out.append(arg)
        elif dim is None:
            out.append(arg.expand(info.batch_size, *arg.shape))
        else:
            out.append(arg.movedim(dim, 0).contiguous())
    return out


# The Functions below take any number of leading dimensions (a stack of independent models, one per
# seed: see :func:`rwinterp.training.train_seeds`), called so directly (DeepTransformer.computes_stacks)
# or under ``torch.func.vmap``, where they run once on the stacked tensors (their ``vmap`` rule), so that
# each model's sums run in the same order as when it is run alone.


class SymmetricReadout(torch.autograd.Function):
    """``h V^T`` whose forward and backward sums every output entry and every gradient entry by the same code
    path in the same order, so that values equal in exact arithmetic stay bit-for-bit equal.

    A matmul (or a reduction over an outer axis) treats columns at the edge of its SIMD blocks differently, and
    the round-off that this injects into the value gradient is what otherwise breaks the exact symmetry of the
    deterministic walk (Theorem 4.1) after a few steps for K = 5, 7 or 20. Here the sums over the K states are
    elementwise additions in state order (:func:`_ordered_products`), and the value gradient's sums over walks
    are row reductions of a contiguous product.
    """

    @staticmethod
    def forward(h: Tensor, V: Tensor) -> Tensor:  # h [..., b, k], V [..., y, k] -> [..., b, y]
        return _ordered_products(h, V)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:  # grad [..., b, y]
        h, V = ctx.saved_tensors
        grad_h = _ordered_products(grad, V.mT)  # [..., b, k], summed over y
        grad_V = _inner_sum(grad.mT.contiguous()[..., :, None, :], h.mT.contiguous()[..., None, :, :])  # over b
        return grad_h, grad_V

    @staticmethod
    def vmap(info: Any, in_dims: tuple, h: Tensor, V: Tensor) -> tuple[Tensor, int]:
        return SymmetricReadout.apply(*_batch_first(info, in_dims, h, V)), 0


def _ordered_products(h: Float[Tensor, "... b k"], V: Float[Tensor, "... y k"]) -> Float[Tensor, "... b y"]:
    """``sum_k h[..., b, k] V[..., y, k]``, added up one ``k`` after another by elementwise products and sums
    laid out ``[..., y, b]`` (walks innermost, so each is one vectorised pass): the same operations, in the
    same order, for every entry. (``k`` is at least 1: K states, or d_head.)"""
    h_k = h.mT.contiguous()[..., None, :].unbind(-3)  # [..., 1, b] for each k
    V_k = V.mT[..., None].unbind(-3)  # [..., y, 1] for each k
    out = V_k[0] * h_k[0]
    for a, b in zip(V_k[1:], h_k[1:]):
        out += a * b
    return out.mT.contiguous()


class BroadcastOverBatch(torch.autograd.Function):
    """``x[..., None, :]`` expanded to ``[..., batch, n]``; the backward sums each column as a row reduction
    (see :class:`SymmetricReadout`: the default outer-axis sum rounds edge columns differently)."""

    @staticmethod
    def forward(x: Tensor, batch: int) -> Tensor:
        return x[..., None, :].expand(*x.shape[:-1], batch, x.shape[-1])

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        if grad.ndim == 2 or grad.device.type != "cpu":
            return grad.mT.contiguous().sum(-1), None
        # (one 2-D transpose per leading index: on the CPU copy_'s blocked transpose takes 2-D tensors only, and
        # the general strided copy of a [..., batch, n] stack is several times slower)
        transposed = grad.new_empty(*grad.shape[:-2], grad.shape[-1], grad.shape[-2])
        for out, g in zip(transposed.flatten(0, -3), grad.flatten(0, -3)):
            out.copy_(g.T)
        return transposed.sum(-1), None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x: Tensor, batch: int) -> tuple[Tensor, int]:
        return BroadcastOverBatch.apply(*_batch_first(info, in_dims, x, batch)), 0


class TokenLookup(torch.autograd.Function):
    """``table[tokens]``: a table of one number per token (``[..., vocab]``) read at every token
    (``[..., batch, pos]``), by ``gather``. The backward adds up each entry's gradients in the order of the
    tokens, as ``table[tokens]``'s own backward does, by ``scatter_add``. (Under ``vmap``, indexing a stacked
    table with stacked tokens goes through a general advanced-indexing path several times slower.)"""

    @staticmethod
    def forward(table: Tensor, tokens: Tensor) -> Tensor:
        return table.gather(-1, tokens.reshape(*table.shape[:-1], -1)).view(tokens.shape)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        table, tokens = inputs
        ctx.save_for_backward(tokens)
        ctx.table_shape = table.shape

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (tokens,) = ctx.saved_tensors
        flat = tokens.reshape(*ctx.table_shape[:-1], -1)
        summed = grad.new_zeros(ctx.table_shape).scatter_add_(-1, flat, grad.reshape(flat.shape))
        return summed, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, table: Tensor, tokens: Tensor) -> tuple[Tensor, int]:
        return TokenLookup.apply(*_batch_first(info, in_dims, table, tokens)), 0


def _column_sum(x: Float[Tensor, "... batch n"]) -> Float[Tensor, "... n"]:
    """``x.sum(-2)`` with every column added up in row order: the rows are added one after another into one row
    (``index_add_``), elementwise additions that round every column alike. A sum over an outer axis vectorises
    across columns and rounds the columns at the edge of its SIMD blocks differently (see
    :class:`SymmetricReadout`): equal columns would not give equal sums."""
    into = x.new_zeros(*x.shape[:-2], 1, x.shape[-1])
    return into.index_add_(-2, x.new_zeros(x.shape[-2], dtype=torch.long), x)[..., 0, :]


class SeparableAttention(torch.autograd.Function):
    """The rank-one head's attention-weighted token counts when every score is a token part plus a position
    part: ``A[b, k] = sum_{i: x_bi = k} softmax_i(c[x_bi] + d_i)``, ``[..., batch, vocab]``. This is the paper's
    model with one-hot tokens, whose key ``x~_i . u`` is ``u_tok[x_i] + p_i . u_pos``.

    The exponential then separates, ``exp(c[x_bi] + d_i) = w[x_bi] e_i`` with ``w = exp(c - max c)`` and
    ``e = exp(d - max d)``, and so does the softmax::

        S[b, k] = sum_{i: x_bi = k} e_i        P = S w        A[b, k] = P[b, k] / Z_b,  Z_b = sum_k P[b, k]

    The forward pass is one scatter of ``e`` by token, with exponentials of vocab + N numbers instead of batch
    x N, and no ``[batch, pos]`` scores or pattern; the backward reads the tokens once more:
    ``dL/dd_i = e_i sum_b (g w)[b, x_bi]``, ``dL/dc_k = sum_b g[b, k] P[b, k]`` with
    ``g = (G - sum_k A G) / Z``. Every sum over walks is a row reduction or a column sum in walk order
    (:func:`_column_sum`), the same code for every token and position, so the exact symmetry of the
    deterministic walk survives (see :class:`SymmetricReadout`).

    A walk's terms ``w[x_bi] e_i`` are its softmax's terms times ``exp(-delta_b)``, ``delta_b >= 0`` the distance of
    its largest score from ``max c + max d``: terms that the softmax keeps in range can underflow here. Where some
    walk's ``Z_b`` is below the square root of the smallest normal number (a walk whose scores all lie far below
    the largest possible), the scores are formed and shifted by each walk's largest, as the softmax does;
    otherwise a term lost to underflow is below ``1e-150`` of its walk's total (float64; ``1e-18`` in float32).

    With ``keys`` (a list of key positions, or ``slice(None)`` for all) the second output is the pattern at those
    positions (``[..., batch, keys]``, no gradient: ``w[x_bj] e_j / Z_b``), else empty."""

    @staticmethod
    def forward(c: Tensor, d: Tensor, tokens: Tensor, keys: Optional[slice | list[int]]) -> tuple[Tensor, ...]:
        w = (c - c.amax(-1, keepdim=True)).exp()
        e = (d - d.amax(-1, keepdim=True)).exp()
        S = c.new_zeros(*tokens.shape[:-1], c.shape[-1]).scatter_add_(-1, tokens, e[..., None, :].expand(tokens.shape))
        P = S * w[..., None, :]
        Z = P.sum(-1, keepdim=True)
        per_walk = c.new_empty(0)  # exp(score - the walk's largest), where a walk's terms w e are all tiny
        if Z.numel() and float(Z.min()) < torch.finfo(c.dtype).tiny ** 0.5:
            scores = TokenLookup.forward(c, tokens) + d[..., None, :]
            per_walk = (scores - scores.amax(-1, keepdim=True)).exp()
            P = c.new_zeros(S.shape).scatter_add_(-1, tokens, per_walk)
            Z = P.sum(-1, keepdim=True)
        pattern = c.new_empty(*tokens.shape[:-1], 0)
        if keys is not None:
            pattern = (per_walk[..., keys] / Z if per_walk.numel()
                       else (w[..., None, :] / Z).gather(-1, tokens[..., keys]).mul_(e[..., None, keys]))
        return P / Z, pattern, P, Z, w, e, per_walk

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        ctx.mark_non_differentiable(*output[1:])
        ctx.save_for_backward(inputs[2], output[0], *output[2:])

    @staticmethod
    def backward(ctx: Any, grad: Tensor, *_: Any) -> tuple[Tensor, Tensor, None, None]:
        tokens, A, P, Z, w, e, per_walk = ctx.saved_tensors
        g = (grad - _inner_sum(A, grad)[..., None]) / Z
        grad_c = (g * P).mT.contiguous().sum(-1)  # summed over walks, as a row reduction
        if per_walk.numel():
            grad_d = _column_sum(g.gather(-1, tokens) * per_walk)
        else:
            grad_d = e * _column_sum((g * w[..., None, :]).gather(-1, tokens))
        return grad_c, grad_d, None, None

    @staticmethod
    def vmap(info: Any, in_dims: tuple, c: Tensor, d: Tensor, tokens: Tensor, keys: Any) -> tuple[tuple, tuple]:
        return SeparableAttention.apply(*_batch_first(info, in_dims, c, d, tokens, keys)), (0,) * 7


def _products(table: Float[Tensor, "n d"], u: Float[Tensor, "*models d"]) -> Float[Tensor, "*models n"]:
    """``table @ u``, for one model or a stack of models (``u`` with a leading model axis; a fixed embedding
    ``table`` is the same in every model, so a stack shares it)."""
    return table @ u if u.ndim == 1 else (table @ u.mT).mT


def _one_query(x_q: Tensor) -> bool:
    """Whether every walk has the same single query row (of every model, with leading dimensions)."""
    return x_q.shape[-2] == 1 and torch.equal(x_q, x_q[..., :1, :, :].expand_as(x_q))


class QueryProjection(torch.autograd.Function):
    """``q = W[h] x_q`` for merged key-query weights, whose W-gradient keeps equal rows bit-equal.

    When every walk has the same query row (the first layer's query slot, and any layer while the
    walks are symmetric), ``dW[h] = (sum_b dq_b) x_q^T``: the sum over walks runs along the innermost
    axis, the same code path for every row, and the outer product is exact entry by entry. A matmul
    over walks rounds rows at the edge of its SIMD blocks differently, which puts position-dependent
    round-off into the attention and breaks Theorem 4.1's exact symmetry on some CPUs (see
    :class:`SymmetricReadout` for the value side). The forward pass then computes ``W[h] x_q`` once
    for all walks. (With a stack of models, the shared path is taken when every model's walks share
    their query row.)"""

    @staticmethod
    def forward(x_q: Tensor, W: Tensor) -> Tensor:  # x_q [..., b, q, m], W [..., h, n, m] -> [..., b, q, h, n]
        if _one_query(x_q):  # (a copy, not a view: patching hooks write into q in place)
            one = torch.einsum("...bqm,...hnm->...bqhn", x_q[..., :1, :, :], W)
            return one.expand(*x_q.shape[:-3], x_q.shape[-3], -1, -1, -1).contiguous()
        return torch.einsum("...bqm,...hnm->...bqhn", x_q, W)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Tensor) -> None:
        x_q, W = inputs
        ctx.shared = _one_query(x_q)
        ctx.save_for_backward(x_q, W)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], Tensor]:
        x_q, W = ctx.saved_tensors
        grad_x = torch.einsum("...bqhn,...hnm->...bqm", grad, W) if ctx.needs_input_grad[0] else None
        if ctx.shared:
            summed = grad[..., 0, :, :].movedim(-3, -1).contiguous().sum(-1)  # [..., h, n], summed over walks
            grad_W = summed[..., None] * x_q[..., 0, 0, None, None, :]
        else:
            grad_W = torch.einsum("...bqhn,...bqm->...hnm", grad, x_q)
        return grad_x, grad_W

    @staticmethod
    def vmap(info: Any, in_dims: tuple, x_q: Tensor, W: Tensor) -> tuple[Tensor, int]:
        return QueryProjection.apply(*_batch_first(info, in_dims, x_q, W)), 0


def with_gradient(x: Tensor, *hooks: HookPoint) -> Tensor:
    """``x``, made a leaf with a gradient if it has none (it comes from fixed buffers) and one of ``hooks``
    holds a backward hook: otherwise that hook would never fire."""
    if x.requires_grad or not torch.is_grad_enabled() or not any(h.has_hooks(dir="bwd") for h in hooks):
        return x
    return x.detach().clone().requires_grad_()


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
    float64 at the paper's K 6, N 97, M 1000 and 1000 walks).
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
            positions = torch.arange(tokens.shape[1], device=tokens.device)
            norm = squared.clamp_min(0).sqrt().clamp_min(1e-30)[tokens, positions]
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


def _per_head(x: Float[Tensor, "batch pos m"], W: Float[Tensor, "H m d"]) -> Float[Tensor, "batch H pos d"]:
    """``x W[h]`` for every head ``h``, as one matrix product."""
    H, m, d = W.shape
    return (x @ W.transpose(0, 1).reshape(m, H * d)).unflatten(-1, (H, d)).transpose(1, 2)


class Attention(nn.Module):
    """Multi-head attention with merged (``W``, or only ``u = W x~_N`` with the rank-one query) or factored
    (``W_Q``, ``W_K``) key-query weights."""

    def __init__(self, cfg: DeepConfig):
        super().__init__()
        self.cfg = cfg
        H, D, d = cfg.n_heads, cfg.d_model, cfg.d_head
        if cfg.rank_one:
            self.u = nn.Parameter(torch.zeros(D, dtype=cfg.dtype))  # W x~_N
        elif cfg.key_query == "merged":
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
        :class:`SymmetricReadout`.

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
        self, resid: Float[Tensor, "batch rows d_model"], fixed: Optional[FixedRows] = None
    ) -> Float[Tensor, "batch Q d_model"]:
        """The attention output of the rows being updated. ``resid`` is the whole residual stream, or,
        with ``fixed`` (``query`` mode, see :class:`FixedRows`), the query slot's row alone."""
        cfg = self.cfg
        x = (resid / resid.norm(dim=-1, keepdim=True).clamp_min(1e-30) * cfg.token_norm
             if cfg.normalize_tokens else resid)
        x_q = x if cfg.normalize_query else resid
        x_q = x_q[:, -1:] if cfg.attention == "query" else x_q
        if fixed is None and cfg.attention == "causal" and cfg.key_query == "factored" and not any(
                hook.has_hooks() for hook in (self.hook_q, self.hook_k, self.hook_v, self.hook_attn_scores,
                                              self.hook_pattern)):
            return self._fused(x_q, x, resid)
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

    def _fused(
        self, x_q: Float[Tensor, "batch pos d_model"], x: Float[Tensor, "batch pos d_model"],
        resid: Float[Tensor, "batch pos d_model"],
    ) -> Float[Tensor, "batch pos d_model"]:
        """Causal attention when nothing hooks its queries, keys, values, scores or pattern (training): torch's
        fused ``scaled_dot_product_attention``, the same function as the explicit path (equal up to round-off)
        without building the ``[batch, H, pos, pos]`` scores and pattern, which the tiny models of this library
        spend most of a training step on. The projections are plain matrix products over all heads at once
        (the einsums of the explicit path cost these small models more in reshapes than in arithmetic)."""
        q, k = _per_head(x_q, self.W_Q), _per_head(x, self.W_K)
        v = _per_head(resid[..., : self.cfg.d_value_in], self.W_V)
        z = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / self.cfg.attn_scale)
        z = self.hook_z(z.transpose(1, 2))  # [batch, pos, H, d_head]
        return z.flatten(2) @ self.W_O.flatten(0, 1)

    def separable(
        self,
        token_keys: Float[Tensor, "*models d_vocab"],
        position_keys: Float[Tensor, "*models pos"],
        tokens: Int[Tensor, "*models batch pos"],
        keys: Optional[slice | list[int]] = None,
    ) -> tuple[Float[Tensor, "*models batch 1 1 d_head"], Float[Tensor, "*models batch 1 keys"]]:
        """``z`` of the rank-one query path when every key is ``token_keys[x_i] + position_keys[i]`` and nothing
        hooks the queries, keys, scores, pattern or values (:class:`SeparableAttention`); with ``keys`` (positions,
        or ``slice(None)``), also the query slot's pattern at those key positions (else an empty tensor). With
        leading model axes on the keys, the tokens and ``W_V`` (a stack of models), one for each model."""
        summed, pattern = SeparableAttention.apply(token_keys, position_keys, tokens, keys)[:2]
        V = self.W_V[..., 0, :, :].mT
        z = SymmetricReadout.apply(summed[..., : self.cfg.n_states], V)[..., None, None, :]
        return self.hook_z(z), pattern[..., None, :]

    def rank_one(
        self,
        keys_in: Float[Tensor, "batch pos"],
        tokens: Int[Tensor, "batch pos"],
        token_part: Optional[Float[Tensor, "batch pos K"]] = None,
    ) -> Float[Tensor, "batch 1 1 d_head"]:
        """``z`` of the rank-one query path from ``keys_in[b, i] = x~_i . u`` (already normalised if configured).

        In TransformerLens's terms the key-query circuit has ``d_qk = 1``: ``hook_q`` is the query slot's
        ``q = x~_N . W_Q = 1`` (``[batch, 1, 1, 1]``), ``hook_k`` the keys ``x~_i . u`` (``[batch, pos, 1, 1]``)
        and the score their product. They are formed only when hooked.

        ``token_part`` (``X^T``, from the residual stream) is given on the dense path; otherwise values are
        read from the tokens, and when nothing hooks them the weighted sum of values ``V X S`` is formed as
        ``V (sum_i S_i x_i)`` by a scatter, never building ``[batch, pos, K]``.
        """
        K = self.cfg.n_states
        V = self.W_V[0].T  # the paper's V, [d_head, K]
        if self.hook_q.has_hooks() or self.hook_k.has_hooks():
            q = self.hook_q(with_gradient(keys_in.new_ones(keys_in.shape[0], 1, 1, 1), self.hook_q))
            k = self.hook_k(keys_in[:, :, None, None])
            scores = torch.einsum("bqhd,bphd->bhqp", q, k)
        else:
            scores = keys_in[:, None, None, :]
        scores = self.hook_attn_scores(scores)
        pattern = self.hook_pattern(torch.softmax(scores, dim=-1))
        if token_part is None and not self.hook_v.has_hooks():
            weights = pattern.flatten(1)  # [batch, pos] (a view: its backward copies nothing, unlike indexing)
            summed = weights.new_zeros(weights.shape[0], K + 1).scatter_add_(1, tokens, weights)
            z = SymmetricReadout.apply(summed[:, :K], V)[:, None, None, :]
        else:
            if token_part is None:
                token_part = F.one_hot(tokens, K + 1)[..., :K].to(V.dtype)
            v = self.hook_v((token_part @ V.T)[:, :, None, :])
            z = torch.einsum("bhqp,bphd->bqhd", pattern, v)
        return self.hook_z(z)


class MLP(nn.Module):
    """``act(x W_in) W_out``, no biases. With the fixed readout this is the paper's FC layer ``f = A act(V X S)``:
    ``W_in`` selects the head output (the first m residual coordinates) and the learned ``A`` (K x m) writes
    the K scores, so ``W_out = [A^T 0]``; with a learned readout ``W_in`` and ``W_out`` are learned."""

    def __init__(self, cfg: DeepConfig):
        super().__init__()
        self.cfg = cfg
        self.activation = cfg.activation
        if cfg.readout == "learned":
            self.W_in = nn.Parameter(torch.zeros(cfg.d_model, cfg.mlp_width, dtype=cfg.dtype))
            self.W_out = nn.Parameter(torch.zeros(cfg.mlp_width, cfg.d_model, dtype=cfg.dtype))
        else:
            self.A = nn.Parameter(torch.zeros(cfg.n_states, cfg.mlp_width, dtype=cfg.dtype))
        self.hook_pre = HookPoint()
        self.hook_post = HookPoint()

    def forward(self, x: Float[Tensor, "batch Q width"]) -> Float[Tensor, "batch Q out"]:
        """The MLP output: ``[..., d_model]`` with a learned readout, the K scores with the fixed one."""
        if self.cfg.readout == "learned":
            return self.hook_post(self.activation(self.hook_pre(x @ self.W_in))) @ self.W_out
        return self.hook_post(self.activation(self.hook_pre(x[..., : self.cfg.mlp_width]))) @ self.A.T


class Block(nn.Module):
    """One block: attention, then (with ``mlp_width``) the FC layer, each writing the rows being updated."""

    def __init__(self, cfg: DeepConfig):
        super().__init__()
        self.cfg = cfg
        self.attn = Attention(cfg)
        self.hook_resid_pre = HookPoint()
        self.hook_attn_out = HookPoint()
        self.hook_resid_post = HookPoint()
        if cfg.mlp_width is not None:
            self.mlp = MLP(cfg)
            self.hook_resid_mid = HookPoint()
            self.hook_mlp_out = HookPoint()

    def _update(self, resid: Tensor, out: Tensor) -> Tensor:
        """Replace the rows being computed (the last ``Q``) by ``resid + out`` or ``out``."""
        Q = out.shape[1]
        rows = resid[:, -Q:] + out if self.cfg.residual else out
        return rows if resid.shape[1] == Q else torch.cat([resid[:, : resid.shape[1] - Q], rows], dim=1)

    def _mlp_out(self, rows: Tensor) -> Tensor:
        out = self.mlp(rows)
        return out if self.cfg.readout == "learned" else F.pad(out, (0, self.cfg.d_model - self.cfg.n_states))

    def forward(
        self, resid: Float[Tensor, "batch rows d_model"], fixed: Optional[FixedRows] = None
    ) -> Float[Tensor, "batch rows d_model"]:
        """The residual stream out of the block: all of it, or with ``fixed`` the query slot's row."""
        resid = self.hook_resid_pre(resid)
        attn_out = self.hook_attn_out(self.attn(resid, fixed))
        resid = self._update(resid, attn_out)
        if self.cfg.mlp_width is not None:
            resid = self.hook_resid_mid(resid)
            mlp_out = self.hook_mlp_out(self._mlp_out(resid[:, -attn_out.shape[1]:]))
            resid = self._update(resid, mlp_out)
        return self.hook_resid_post(resid)


#: Hooks whose activations TransformerLens stacks over layers in the residual-stream methods of
#: :class:`ActivationCache`.
RESIDUAL_HOOKS = ("hook_embed", "hook_pos_embed", "hook_resid_pre", "hook_resid_mid", "hook_resid_post",
                  "hook_attn_out", "hook_mlp_out")


class WalkActivationCache(ActivationCache):
    """A TransformerLens :class:`ActivationCache` that says in one line when a residual-stream method
    cannot apply to the cached model, instead of failing inside ``torch.stack``:

    * a model that attends from the query slot alone keeps ``attn_out`` (and, with the rank-one query,
      ``resid_post``) at the last position only, so ``accumulated_resid``, ``decompose_resid`` and
      ``get_full_resid_decomposition`` need ``pos_slice=-1`` to stack them with the embeddings;
    * a model without a residual stream (``residual=False``, the paper's) replaces the stream with each
      block's output, so the stream is no sum of components and the two decompositions do not exist
      (``accumulated_resid``, the stream's state at each layer, does).
    """

    def __getitem__(self, key: Any) -> Tensor:
        """As in TransformerLens; a hook the model does not have is a one-line error naming the ones it has."""
        try:
            return super().__getitem__(key)
        except KeyError:
            name = key if isinstance(key, str) else None
            hooks = sorted({n.split(".")[-1] for n in self.cache_dict})
            raise RwinterpError(f"this model caches no {name or key!r}"
                                f"{' (it has no MLP)' if 'mlp' in str(key) or 'resid_mid' in str(key) else ''}; "
                                f"its hooks: {', '.join(hooks)}") from None

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


# ---------------------------------------------------------------------------------------- the model
#: TransformerLens patching sweeps that patch every position of an attention or MLP output (functions of
#: ``transformer_lens.patching``; the others go through ``generic_activation_patch``).
_EVERY_POSITION = ("get_act_patch_block_every", "get_act_patch_attn_head_by_pos_every")


def refuse_position_patching(model: "DeepTransformer") -> None:
    """Raise a one-line error when called (through ``run_with_hooks``) from a ``transformer_lens.patching`` sweep
    over the positions of an activation that a model attending from the query slot holds at that slot alone
    (``attn_out``, ``z``, ``q``, ``pattern``, ``mlp_out``; with the rank-one query also the block outputs):
    TransformerLens would index positions that do not exist and stop with a bare ``IndexError``, or after
    sweeping every other activation first."""
    import sys

    query_only = {"attn_out", "z", "q", "pattern", "attn_scores", "mlp_out", "pre", "post"}
    if model.cfg.attention != "query":
        query_only = set()
    elif model.cfg.rank_one:
        query_only |= {"resid_mid", "resid_post"}
    if not query_only:  # a causal model holds every position: nothing to refuse, no frames to walk
        return
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__") == "transformer_lens.patching":
            name = frame.f_code.co_name
            where = None
            if name in _EVERY_POSITION:
                where = f"transformer_lens.patching.{name}"
            elif name == "generic_activation_patch":
                activation, index = frame.f_locals.get("activation_name"), frame.f_locals.get("index_df")
                columns = set(getattr(index, "columns", ()))
                if activation in query_only and columns & {"pos", "dest_pos", "src_pos"}:
                    where = f"transformer_lens.patching of {activation} by position"
            if where is not None:
                raise RwinterpError(
                    f"{where}: this model attends from the query slot alone, so its attention outputs hold that "
                    f"position only (position N = {model.cfg.n_ctx}); use the *_all_pos functions, or patch "
                    f"resid_pre, k or v by position")
        frame = frame.f_back




class DeepTransformer(HookedRootModule):
    """See the module docstring. Build with ``DeepTransformer(DeepConfig.paper(K, N, M))`` (or any
    :class:`DeepConfig`, or its dict)."""

    def __init__(self, cfg: DeepConfig | DeepOptions | dict):
        super().__init__()
        # A copy: ``.float()`` on this model updates its cfg.dtype, not that of another model built
        # from the same config.
        if isinstance(cfg, DeepOptions) and not isinstance(cfg, DeepConfig):
            cfg = cfg.to_dict()
        cfg = DeepConfig.from_dict(cfg) if isinstance(cfg, dict) else copy.deepcopy(cfg)
        self.cfg = cfg
        K, N = cfg.n_states, cfg.n_ctx
        # Learned embeddings hold their own width (padded into d_model by W_E, W_pos); fixed ones are kept at
        # full width, so that the forward pass reads them without a copy.
        D = cfg.d_model
        if cfg.token_embedding == "learned":
            self.embed = nn.Parameter(torch.zeros(K + 1, cfg.d_token, dtype=cfg.dtype))
        else:  # one-hot; the query token embeds to zero (the paper's query slot x_N = 0)
            onehot = torch.eye(K + 1, D, dtype=cfg.dtype) * (torch.arange(K + 1) < K)[:, None]
            self.register_buffer("embed", onehot, persistent=False)
        if cfg.pos_embedding == "learned":
            self.pos_embed = nn.Parameter(torch.zeros(N, cfg.pos_dim, dtype=cfg.dtype))
        else:
            fixed = positional_embeddings(cfg.pos_embedding, N, cfg.pos_dim).to(cfg.dtype)
            self.register_buffer("pos_embed", F.pad(fixed, (D - cfg.pos_dim, 0)), persistent=False)
        if cfg.readout == "learned":
            self.unembed = nn.Parameter(torch.zeros(cfg.d_model, K, dtype=cfg.dtype))
        else:  # read the scores off the first K residual coordinates
            self.register_buffer("unembed", torch.eye(cfg.d_model, K, dtype=cfg.dtype), persistent=False)
        self.hook_embed = HookPoint()
        self.hook_pos_embed = HookPoint()
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layers)])
        if cfg.rank_one:
            # the initial W (Gaussian init): u holds only W x~_N, and edits of the query need the rest
            self.register_buffer("W_init", torch.zeros(0, dtype=cfg.dtype))
        self.setup()
        self.reset_parameters()
        if cfg.device not in (None, "cpu"):  # (drawn on the CPU: a seed gives the same model on every device)
            self.to(cfg.device)

    # ------------------------------------------------------------------ initialisation
    def reset_parameters(self) -> None:
        """Draw every learned parameter from ``cfg.init`` with a generator seeded by ``cfg.seed``.

        ``zero``: all zero (the paper's). ``gaussian``: i.i.d. N(0, init_sigma^2) (the paper's random
        initialisation). ``standard``: N(0, (0.8 / sqrt(d_model))^2), TransformerLens's GPT-2
        initialisation. Fixed embeddings and readouts stay as built. With the rank-one query the paper's
        weights are drawn in the paper's order and shapes (V, then W, then A), u = W x~_N: so a seed gives
        the same model whichever way W is stored. Note that zero-initialised factored key-query weights
        never move (their gradients are products of each other), nor does a zero-initialised FC layer.
        """
        cfg = self.cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        std = {"zero": 0.0, "gaussian": cfg.init_sigma, "standard": 0.8 / math.sqrt(cfg.d_model)}[cfg.init]

        def draw(*shape: int) -> Tensor:
            if std == 0.0:
                return torch.zeros(*shape, dtype=torch.float64)
            return torch.randn(*shape, generator=gen, dtype=torch.float64) * std

        with torch.no_grad():
            if not cfg.rank_one:
                for param in self.parameters():
                    param.copy_(draw(*param.shape))
                return
            attn = self.blocks[0].attn
            attn.W_V[0].copy_(draw(cfg.d_head, cfg.n_states).T)
            q = self.query_vector().to("cpu", torch.float64)  # (drawn on the CPU, whatever the model's device)
            device = attn.u.device
            if std and cfg.d_model**2 <= MAX_STORED_W:
                W0 = draw(cfg.d_model, cfg.d_model)
                self.W_init = W0.to(device, cfg.dtype)
                attn.u.copy_(W0 @ q)
            else:  # W_init x~_N has i.i.d. N(0, sigma^2 ||x~_N||^2) entries: draw it directly.
                self.W_init = torch.zeros(0, dtype=cfg.dtype, device=device)
                attn.u.copy_(draw(cfg.d_model) * q.norm())
            if cfg.mlp_width is not None:
                self.blocks[0].mlp.A.copy_(draw(cfg.n_states, cfg.mlp_width))

    def param_groups(self, optimizer: str, lr: float, weight_decay: float) -> list[dict[str, Any]]:
        """The optimiser's parameter groups: all parameters, except that the rank-one query's ``u`` is
        stepped as the paper's W would be.

        Every W-gradient is ``g q^T`` with ``g = dL/du`` (q the :meth:`query_vector`). Gradient descent on W
        therefore moves u by ``||q||^2`` times gradient descent's step on u. Adam on W normalises each entry
        ``g_i q_j`` by its own running size, which leaves ``sign(q_j)`` times Adam's step for ``g_i``: it
        moves u by ``||q||_1`` times Adam's step on u (up to Adam's small eps). Weight decay shrinks W, and
        so u, by ``lr * weight_decay`` per step whatever the scale; the part of W that u does not hold (a
        stored Gaussian ``W_init``) is in :meth:`decaying_buffers`."""
        if not self.cfg.rank_one:
            return [{"params": list(self.parameters())}]
        u = self.u
        q = self.query_vector()
        scale = float(q.abs().sum()) if optimizer == "adamw" else float(q.pow(2).sum())
        others = [p for p in self.parameters() if p is not u]
        return [{"params": others}, {"params": [u], "lr": lr * scale, "weight_decay": weight_decay / scale}]

    def decaying_buffers(self) -> list[Tensor]:
        """What weight decay shrinks besides the parameters: the rank-one query's stored initial W (the part of W
        off the query direction, which decays with W)."""
        return [self.W_init] if self.cfg.rank_one and self.W_init.numel() else []

    # ------------------------------------------------------------------ TransformerLens weights
    @property
    def W_E(self) -> Float[Tensor, "d_vocab d_model"]:
        """Token embeddings, zero on the positional coordinates in ``concat`` mode."""
        width = self.embed.shape[1]
        return self.embed if width == self.cfg.d_model else F.pad(self.embed, (0, self.cfg.d_model - width))

    @property
    def W_pos(self) -> Float[Tensor, "n_ctx d_model"]:
        """Positional embeddings, on the coordinates after the token part in ``concat`` mode."""
        width = self.pos_embed.shape[1]
        return self.pos_embed if width == self.cfg.d_model else F.pad(self.pos_embed, (self.cfg.d_model - width, 0))

    @property
    def W_U(self) -> Float[Tensor, "d_model K"]:
        return self.unembed

    def _stack(self, name: str) -> Tensor:
        return torch.stack([getattr(block.attn, name) for block in self.blocks])

    @property
    def W_Q(self) -> Float[Tensor, "n_layers n_heads d_model d_qk"]:
        """Merged: ``W^T`` (with ``W_K = I``, ``q . k = x_k^T W x_q``). Rank-one: ``q / ||q||^2`` (with ``W_K = u``,
        the score ``x~_i . u`` on the query ``q``; with ``normalize_tokens`` this circuit applies to the
        normalised tokens, not to ``hook_resid_pre``)."""
        if self.cfg.rank_one:
            q = self.query_vector()
            return (q / q.pow(2).sum())[None, None, :, None]
        if self.cfg.key_query == "merged":
            return self._stack("W").transpose(-2, -1)
        return self._stack("W_Q")

    @property
    def W_K(self) -> Float[Tensor, "n_layers n_heads d_model d_qk"]:
        cfg = self.cfg
        if cfg.rank_one:
            return self.u[None, None, :, None]
        if cfg.key_query == "merged":
            eye = torch.eye(cfg.d_model, dtype=cfg.dtype, device=self.W_U.device)
            return eye.expand(cfg.n_layers, cfg.n_heads, -1, -1)
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
        cfg = self.cfg
        require(cfg.mlp_width is not None, "this model has no MLP")
        if cfg.readout == "learned":
            return torch.stack([block.mlp.W_in for block in self.blocks])
        eye = torch.eye(cfg.d_model, cfg.mlp_width, dtype=cfg.dtype, device=self.W_U.device)
        return eye.expand(cfg.n_layers, -1, -1)

    @property
    def W_out(self) -> Float[Tensor, "n_layers d_mlp d_model"]:
        cfg = self.cfg
        require(cfg.mlp_width is not None, "this model has no MLP")
        if cfg.readout == "learned":
            return torch.stack([block.mlp.W_out for block in self.blocks])
        return F.pad(torch.stack([block.mlp.A.T for block in self.blocks]), (0, cfg.d_model - cfg.n_states))

    @property
    def QK(self) -> FactoredMatrix:
        return FactoredMatrix(self.W_Q, self.W_K.transpose(-2, -1))

    @property
    def OV(self) -> FactoredMatrix:
        return FactoredMatrix(self.W_V, self.W_O)

    def tokens_to_residual_directions(self, tokens: int | Int[Tensor, "..."]) -> Float[Tensor, "... d_model"]:
        """As in TransformerLens: the unembedding direction of each output token (a column of ``W_U``), for
        ``ActivationCache.logit_attrs``."""
        if isinstance(tokens, Tensor) and tokens.numel() > 1:
            return self.W_U[:, tokens].movedim(0, -1)
        return self.W_U[:, int(tokens)]

    def accumulated_bias(self, layer: int, mlp_input: bool = False, include_mlp_biases: bool = True) -> Tensor:
        """As in TransformerLens: the biases added to the residual stream before ``layer``; there are none."""
        return self.W_U.new_zeros(self.cfg.d_model)

    # ------------------------------------------------------------------ the paper's quantities
    @property
    def V(self) -> Optional[Float[Tensor, "d_head K"]]:
        """The paper's value matrix (a copy): with one layer and one head whose values read one-hot tokens through
        the fixed readout, ``W_V^T`` (K x K, or m x K with the FC layer); else, for one attention-only head, its
        token-to-score map ``(W_E[:K] W_V W_O W_U)^T``; ``None`` otherwise."""
        cfg = self.cfg
        if cfg.n_layers != 1 or cfg.n_heads != 1:
            return None
        if cfg.values == "tokens" and cfg.readout == "fixed" and cfg.token_embedding == "onehot":
            return self.blocks[0].attn.W_V[..., 0, :, :].mT.contiguous()  # (of every model of a stack, at once)
        if cfg.mlp_width is None:
            return (self.W_E[: cfg.n_states] @ self.W_V[0, 0] @ self.W_O[0, 0] @ self.W_U).T
        return None

    @property
    def A(self) -> Float[Tensor, "K m"]:
        """The paper's FC layer output map (one layer with the fixed readout and an FC layer)."""
        require(self.cfg.n_layers == 1 and self.cfg.mlp_width is not None and self.cfg.readout == "fixed",
                "A is the FC layer of a one-layer model with the fixed readout")
        return self.blocks[0].mlp.A

    @property
    def u(self) -> Float[Tensor, " d_model"]:
        """``W q``, q the :meth:`query_vector`: all of layer 0's W that the query slot uses (the stored parameter
        with the rank-one query)."""
        if self.cfg.rank_one:
            return self.blocks[0].attn.u
        require(self.cfg.attention == "query" and self.cfg.key_query == "merged",
                "u = W x~_N is defined for a merged key-query matrix attending from the query slot")
        return self.blocks[0].attn.W[0] @ self.query_vector()

    def query_vector(self) -> Float[Tensor, " d_model"]:
        """Layer 0's query as the attention sees it: ``x~_N``, or ``r x~_N/||x~_N||`` with normalised tokens
        (``r = cfg.token_norm``; unless ``normalize_query`` is off: then only the keys are normalised)."""
        q = self.W_E[self.cfg.n_states] + self.W_pos[-1]
        cfg = self.cfg
        return q / q.norm() * cfg.token_norm if cfg.normalize_tokens and cfg.normalize_query else q

    @property
    def W(self) -> Float[Tensor, "d_model d_model"]:
        """Layer 0's first merged key-query matrix (score ``x~_i^T W x~_N``). With the rank-one query it is
        rebuilt: gradient descent only ever adds multiples of ``g q^T`` (q the query vector), so
        ``W = W_init + (u - W_init q) q^T / ||q||^2`` exactly, with ``W_init = 0`` for zero init."""
        cfg = self.cfg
        if not cfg.rank_one:
            require(cfg.key_query == "merged", "this model has factored key-query weights (W_Q, W_K), not W")
            return self.blocks[0].attn.W[0]
        q = self.query_vector()
        if cfg.init != "zero" and self.W_init.numel() == 0:
            raise RwinterpError("the initial W of this Gaussian-initialised model was too large to keep")
        require(cfg.d_model**2 <= 4 * MAX_STORED_W, f"W is {cfg.d_model} x {cfg.d_model}: too large to build")
        u = self.u.detach()
        if self.W_init.numel():
            base = self.W_init
            return base + torch.outer(u - base @ q, q) / q.pow(2).sum()
        return torch.outer(u, q) / q.pow(2).sum()

    # ------------------------------------------------------------------ forward
    def run_with_cache(self, *args: Any, **kwargs: Any) -> tuple[Tensor, ActivationCache]:
        """As in TransformerLens, returning an :class:`ActivationCache` (a :class:`WalkActivationCache`)."""
        out, cache = super().run_with_cache(*args, **kwargs)
        if isinstance(cache, ActivationCache):
            cache = cache.cache_dict
        return out, WalkActivationCache(cache, self, has_batch_dim=not kwargs.get("remove_batch_dim", False))

    def run_with_hooks(self, *args: Any, **kwargs: Any) -> Any:
        """As in TransformerLens. A ``transformer_lens.patching`` sweep that patches, position by position, an
        activation this model holds at the query slot alone is refused at its first run, in one line."""
        if kwargs.get("fwd_hooks"):
            refuse_position_patching(self)
        return super().run_with_hooks(*args, **kwargs)

    def set_use_split_qkv_input(self, use_split_qkv_input: bool) -> None:
        """TransformerLens' switch to a copy of the residual stream per head for its queries, keys and values (what
        ``transformer_lens.patching.get_act_patch_direct_path`` needs): this model has none; refused in one line."""
        require(not use_split_qkv_input,
                "this model does not split the residual stream into a query, key and value input per head "
                "(use_split_qkv_input); patch blocks.L.attn.hook_q, hook_k or hook_v instead")

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> "DeepTransformer":
        """``.to(dtype)``, ``.float()``, ``.double()``: as TransformerLens's ``to`` does, ``cfg.dtype``
        follows the weights, so a saved run rebuilds in the dtype it was saved in. A conversion to an
        unsupported dtype (``.half()``) is refused before any weight is converted."""
        resolve_dtype(fn(torch.zeros((), dtype=self.cfg.dtype)).dtype)
        super()._apply(fn, *args, **kwargs)
        dtype = next((p.dtype for p in self.parameters() if p.is_floating_point()), None)
        if dtype is not None and dtype != self.cfg.dtype:
            self.cfg.dtype = resolve_dtype(dtype)
        device = next((t.device for t in (*self.parameters(), *self.buffers())), None)
        if device is not None:  # (``.to(device)``: the config says where the weights are, as TransformerLens's)
            self.cfg.device = str(device)
        return self

    def to_tokens(self, tokens: Any) -> Int[Tensor, "batch pos"]:
        """Tokens are already integer tensors (no tokenizer); accepts a task ``Batch`` too."""
        tokens = getattr(tokens, "tokens", tokens)
        return self._check_tokens(torch.as_tensor(tokens))

    def _check_tokens(self, tokens: Tensor, values: bool = True) -> Tensor:
        cfg = self.cfg
        if tokens.ndim == 1:
            tokens = tokens[None]
        require(tokens.ndim == 2 and tokens.shape[1] == cfg.n_ctx,
                f"tokens must have shape [batch, {cfg.n_ctx}], got {list(tokens.shape)}")
        require(not tokens.is_floating_point(), "tokens must be an integer tensor")
        if values and tokens.numel():
            low, high = torch.aminmax(tokens)
            require(int(low) >= 0 and int(high) <= cfg.n_states,
                    f"tokens must lie in [0, {cfg.n_states}] ({cfg.n_states} is the query token)")
        return tokens

    def _embeddings(self, tokens: Int[Tensor, "batch pos"]) -> tuple[Tensor, Tensor]:
        """``hook_embed(W_E[tokens])`` and ``hook_pos_embed(W_pos)``, each ``[batch, pos, d_model]``.

        Fixed (one-hot, sine or orthogonal) embeddings are buffers with no gradient of their own: when a
        backward hook waits on them or on ``blocks.0.hook_resid_pre`` (attribution patching), they are
        given one here, or the hook would never fire."""
        embed, pos = self.W_E[tokens], self.W_pos.expand(tokens.shape[0], -1, -1)
        hooks = (self.hook_embed, self.hook_pos_embed, self.blocks[0].hook_resid_pre)
        return self.hook_embed(with_gradient(embed, *hooks)), self.hook_pos_embed(with_gradient(pos, *hooks))

    def forward(self, tokens: Int[Tensor, "batch pos"], *, check: bool = True) -> Float[Tensor, "batch Q K"]:
        """Logits (raw scores) at the query slot (``[batch, 1, K]``) or at every position (causal).

        ``check=False`` leaves out the check of the token values (the shape is always checked): a check that
        reads the data, which cannot run under ``torch.func.vmap``; :func:`rwinterp.training.train_seeds`
        checks its data before it runs the models' stack."""
        tokens = self._check_tokens(tokens, values=check)
        if self.cfg.rank_one:
            return self._rank_one_forward(tokens)
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
        those rows are then read through :class:`FixedRows`, and only the query slot's row is built."""
        if self.cfg.attention != "query":
            return False
        points = [self.hook_embed, self.hook_pos_embed]
        for block in self.blocks:
            points += [block.hook_resid_pre, block.hook_resid_post, block.attn.hook_k, block.attn.hook_v]
            points += [block.hook_resid_mid] if self.cfg.mlp_width is not None else []
        return not any(point.has_hooks() for point in points)

    def _rank_one_forward(self, tokens: Int[Tensor, "batch pos"], rows: Optional[list] = None,
                          keys: Optional[Sequence[int]] = None) -> Float[Tensor, "batch 1 K"]:
        """The forward pass with the rank-one query (see the module docstring). ``rows``, a list, gets the query
        slot's attention pattern (``[batch, 1, pos]``, or at the key positions ``keys``; no gradient) where the
        separable path computes it. (The separable path also computes a stack of models: :meth:`computes_stacks`.)"""
        cfg = self.cfg
        block = self.blocks[0]
        attn = block.attn
        u = self.u
        K = cfg.n_states
        token_part = z = None
        if any(h.has_hooks() for h in (self.hook_embed, self.hook_pos_embed, block.hook_resid_pre)):
            embed, pos = self._embeddings(tokens)
            resid = block.hook_resid_pre(embed + pos)
            keys = resid @ u
            if cfg.normalize_tokens:
                keys = keys / resid.norm(dim=-1) * cfg.token_norm
            edit = self._query_edit(resid)
            if edit is not None:
                keys = keys + edit
            token_part = resid[..., :K]
        elif self._separable():
            # The scores u_tok[x_i] + p_i . u_pos separate into a token part and a position part.
            wanted = None if rows is None else slice(None) if keys is None else list(keys)
            z, pattern = attn.separable(_products(self.W_E, u), _products(self.W_pos, u), tokens, wanted)
            if rows is not None:
                rows.append(pattern)
        else:
            # x~_i . u = u_tok[x_i] + p_i . u_pos, without building [batch, pos, d_model].
            W_E, W_pos = self.W_E, self.W_pos
            keys = TokenLookup.apply(W_E @ u, tokens) + BroadcastOverBatch.apply(W_pos @ u, tokens.shape[0])
            if cfg.normalize_tokens:  # ||x~_i||^2 = ||embedding||^2 + ||p_i||^2 (disjoint coordinates)
                squared = TokenLookup.apply(W_E.pow(2).sum(-1), tokens) + W_pos.pow(2).sum(-1)[None, :]
                keys = keys / squared.sqrt() * cfg.token_norm
        if z is None:
            z = attn.rank_one(keys, tokens, token_part)
        head_out = z.flatten(-3, -2)  # [batch, 1, d_head] (with the models first: see computes_stacks)
        if not self._output_stream_hooked():
            # Nothing reads the d_model-wide output stream: skip embedding into it.
            return head_out if cfg.mlp_width is None else block.mlp(head_out)
        # W_O writes the head output into the first d_head residual coordinates.
        attn_out = block.hook_attn_out(F.pad(head_out, (0, cfg.d_model - cfg.d_head)))
        if cfg.mlp_width is None:
            resid_post = block.hook_resid_post(attn_out)
        else:
            resid_mid = block.hook_resid_mid(attn_out)
            mlp_out = block.hook_mlp_out(block._mlp_out(resid_mid))
            resid_post = block.hook_resid_post(mlp_out)
        return resid_post[..., :K]

    def computes_stacks(self) -> bool:
        """Whether :func:`training_logits` computes a stack of these models as it is, with the stacked parameters
        in place of the model's own and a leading model axis on the tokens (:meth:`rwinterp.stack.ModelStack.call`),
        without ``torch.func.vmap``: the paper's model on the separable path (:meth:`_separable`) with nothing
        hooked on its output stream. (Its Functions take leading axes; ``vmap`` adds a fixed cost to every
        operation: a tenth to a fifth of the time of 20 seeds of the Fig 4 setting.)"""
        return self._separable() and self.cfg.mlp_width is None and not self._output_stream_hooked()

    def _output_stream_hooked(self) -> bool:
        """Whether a hook reads the rank-one block's d_model-wide output stream (else it is not formed)."""
        block = self.blocks[0]
        dense = [getattr(block, n) for n in ("hook_attn_out", "hook_resid_mid", "hook_mlp_out", "hook_resid_post")
                 if hasattr(block, n)]
        return any(h.has_hooks() for h in dense)

    def _separable(self) -> bool:
        """Whether the rank-one query path takes :class:`SeparableAttention`: raw (not normalised) tokens, and no
        hook on a tensor that it does not form (the embeddings, the residual stream into the block, the queries,
        keys, scores, pattern or values)."""
        attn = self.blocks[0].attn
        points = (self.hook_embed, self.hook_pos_embed, self.blocks[0].hook_resid_pre, attn.hook_q, attn.hook_k,
                  attn.hook_attn_scores, attn.hook_pattern, attn.hook_v)
        return self.cfg.rank_one and not self.cfg.normalize_tokens and not any(p.has_hooks() for p in points)

    def _query_edit(self, resid: Float[Tensor, "batch pos d_model"]) -> Optional[Float[Tensor, "batch pos"]]:
        """What a hook's edit of the query slot's input adds to the rank-one scores ``x~_i^T W q``.

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
        shift = as_query(rows) - as_query((self.W_E[cfg.n_states] + self.W_pos[-1]).expand_as(rows))
        edited = bool(shift.ne(0).any())
        if not edited and not shift.requires_grad:
            return None
        if cfg.init != "zero" and self.W_init.numel() == 0:
            require(not edited, "an edit of the query slot's input needs the initial W, which this "
                                "Gaussian-initialised model was too large to keep")
            return None  # (unedited: the query's gradient leaves out its path through W, which is not kept)
        q = self.query_vector()
        along = (shift @ q / q.pow(2).sum())[:, None]  # [batch, 1]
        W_shift = along * self.u[None]
        if self.W_init.numel():
            W_shift = W_shift + shift @ self.W_init.T - along * (self.W_init @ q)[None]
        return torch.einsum("bpd,bd->bp", seen(resid), W_shift)

    def scores(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch K"]:
        """The scores of the label at the query slot, ``[batch, K]``."""
        return self(tokens)[:, -1, :]

    def attention(self, tokens: Int[Tensor, "batch pos"]) -> Float[Tensor, "batch n_layers n_heads pos"]:
        """The attention pattern of the query slot over all N positions, for every layer and head."""
        names = {f"blocks.{layer}.attn.hook_pattern" for layer in range(self.cfg.n_layers)}
        _, cache = self.run_with_cache(tokens, names_filter=lambda name: name in names)
        return torch.stack([cache[f"blocks.{layer}.attn.hook_pattern"][:, :, -1, :]
                            for layer in range(self.cfg.n_layers)], dim=1)


def training_logits(
    model: DeepTransformer, tokens: Int[Tensor, "batch pos"], pattern_row: Optional[int] = None,
    keys: Optional[Sequence[int]] = None,
) -> Float[Tensor, "batch Q K"] | tuple[Tensor, list[Float[Tensor, "batch head pos"]]]:
    """What training runs (the deep kind's ``train_forward``): the logits, without the check of the token values
    (training checks its data once), and with ``pattern_row`` also each layer's attention pattern at that row
    (``[batch, head, pos]``, or only the key positions ``keys``; detached), as
    :func:`rwinterp.training.logits_and_pattern` reads it from ``hook_pattern``. The paper's model forms its
    pattern on the separable path (:class:`SeparableAttention`), without hooks and only at ``keys``; any other
    model, or one with hooks attached, runs through its hooks. A model that :meth:`~DeepTransformer.computes_stacks`
    takes a stack's tensors as they are (``tokens [models, batch, pos]``; logits and pattern with the models
    first)."""
    if model._separable():
        rows: list = []
        if tokens.ndim <= 2:  # (not a stack of models)
            tokens = model._check_tokens(tokens, values=False)
        logits = model._rank_one_forward(tokens, None if pattern_row is None else rows, keys)
        return logits if pattern_row is None else (logits, rows)
    if pattern_row is None:
        return model(tokens, check=False)
    from rwinterp.training import logits_and_pattern

    return logits_and_pattern(model, tokens, pattern_row, keys, check=False)


register_model_kind("deep", DeepTransformer, config_of=lambda model: model.cfg.to_dict(),
                    full_config=lambda config: DeepConfig.from_dict(config).to_dict(), train_forward=training_logits)
