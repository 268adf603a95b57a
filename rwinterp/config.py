"""Configuration of the paper's model, as a TransformerLens config.

:class:`WalkTransformerConfig` subclasses :class:`transformer_lens.config.TransformerLensConfig`
so that the model satisfies :class:`transformer_lens.model_protocol.TransformerLensModel`. The
paper's quantities map onto TransformerLens names as follows:

=====================  ==================  ==============================================
paper                  field               TransformerLens meaning
=====================  ==================  ==============================================
K states               ``n_states``        ``d_vocab = K + 1`` (query token), ``d_vocab_out = K``
N positions            ``n_ctx``           sequence length, query slot included
M positional dims      ``pos_dim``         ``d_model = K + M`` (token and position concatenated)
V (K x K or m x K)     (parameter)         ``d_head = K``, or ``m`` with the FC+ReLU variant
m (appendix F.2)       ``mlp_width``       ``d_mlp = m``; ``attn_only`` when ``None``
ReLU (appendix F.2)    ``act_fn``          ``relu``, or ``linear`` for the layer without it
=====================  ==================  ==============================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

import torch
from transformer_lens.config import TransformerLensConfig

from rwinterp.errors import RwinterpError, from_dict_checked, require, require_seed

POS_EMBEDDINGS = ("orthogonal", "sine")
INITS = ("zero", "gaussian")
DTYPES = {"float32": torch.float32, "float64": torch.float64}


def identity(x: torch.Tensor) -> torch.Tensor:
    """The ``linear`` activation."""
    return x


#: The MLP's activation (``act_fn``, TransformerLens's field): the paper's ReLU, or none at all.
ACTIVATIONS = {"relu": torch.relu, "linear": identity}


def resolve_dtype(dtype: "str | torch.dtype") -> torch.dtype:
    """A supported torch dtype from its name or itself; anything else is a one-line error."""
    if isinstance(dtype, str):
        require(dtype in DTYPES, f"dtype must be one of {', '.join(DTYPES)}, got {dtype}")
        dtype = DTYPES[dtype]
    dtype_name(dtype)
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise RwinterpError(f"unsupported dtype {dtype}; use float32 or float64")


@dataclass
class LibraryConfig(TransformerLensConfig):
    """Fields shared by the library's model configs (the paper's model and :mod:`rwinterp.deep`).

    TransformerLens's required fields are re-declared with defaults (the derived ones are set by
    each subclass's ``__post_init__``); the rest are the paper's: K states, fixed positional
    embeddings of dimension M, initialisation, token normalisation inside the attention, seed, dtype.
    """

    d_model: int = -1
    d_head: int = -1
    n_layers: int = 1
    n_ctx: int = 97
    n_heads: int = 1
    d_vocab_out: int = -1
    n_states: int = 6
    pos_dim: int = 1000
    pos_embedding: str = "orthogonal"
    init: str = "zero"
    init_sigma: float = 0.01
    normalize_tokens: bool = False
    #: With ``normalize_tokens``: normalise the query x~_N too (True, the natural reading) or only
    #: the keys x~_1..x~_N (False). Ignored without ``normalize_tokens``.
    normalize_query: bool = True
    #: With ``normalize_tokens``: the length the normalised vectors are scaled to (1, the paper's unit
    #: length; ``r`` multiplies every attention logit by ``r^2`` when the query is normalised too).
    token_norm: float = 1.0
    mlp_width: Optional[int] = None
    #: The MLP's activation: ``relu`` (the paper's FC+ReLU layer) or ``linear`` (the same layer without
    #: its ReLU, so ``f = A V X S``: the function class of the attention-only model, factorised).
    act_fn: str = "relu"
    seed: int = 0
    device: Optional[str] = "cpu"
    normalization_type: Optional[str] = None
    positional_embedding_type: str = "concatenated"
    default_prepend_bos: bool = False
    dtype: torch.dtype = torch.float64

    #: The fields a user sets; the rest are derived in ``__post_init__`` and not saved.
    user_fields: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        require(isinstance(self.token_norm, (int, float)) and not isinstance(self.token_norm, bool)
                and math.isfinite(self.token_norm) and self.token_norm > 0,
                f"token norm must be a positive number, got {self.token_norm!r}")
        require(self.act_fn in ACTIVATIONS,
                f"act_fn must be one of {', '.join(ACTIVATIONS)}, got {self.act_fn!r}")
        require(isinstance(self.init_sigma, (int, float)) and not isinstance(self.init_sigma, bool)
                and math.isfinite(self.init_sigma) and self.init_sigma >= 0,
                f"sigma must be a non-negative number, got {self.init_sigma!r}")
        require_seed(self.seed)
        super().__post_init__()

    @property
    def activation(self) -> Any:
        """The MLP's activation function (:data:`ACTIVATIONS`)."""
        return ACTIVATIONS[self.act_fn]

    def mlp_label(self) -> str:
        """`` mlp=m`` (`` mlp=m linear`` without the ReLU), or nothing without an MLP."""
        if self.mlp_width is None:
            return ""
        return f" mlp={self.mlp_width}" + ("" if self.act_fn == "relu" else f" {self.act_fn}")

    def init_label(self) -> str:
        """The initialisation and the attention's token normalisation, for one-line summaries."""
        init = self.init + (f"({self.init_sigma:g})" if self.init == "gaussian" else "")
        if not self.normalize_tokens:
            return init
        which = "keys and query" if self.normalize_query else "keys only"
        return f"{init}, x~ normalised to length {self.token_norm:g} ({which})"

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable: only the fields a user sets (derived ones are recomputed)."""
        out = {k: getattr(self, k) for k in self.user_fields}
        out["dtype"] = dtype_name(self.dtype)
        return out

    @classmethod
    def from_dict(cls, config_dict: dict[str, Any]) -> "LibraryConfig":
        return from_dict_checked(cls, config_dict, "model config")


@dataclass
class WalkTransformerConfig(LibraryConfig):
    """The paper's one-layer model (PAPER.md section 2). Derived fields are filled in for you."""

    user_fields: ClassVar[tuple[str, ...]] = (
        "n_states", "n_ctx", "pos_dim", "pos_embedding", "init", "init_sigma", "normalize_tokens",
        "normalize_query", "token_norm", "mlp_width", "act_fn", "seed", "dtype")

    def __post_init__(self) -> None:
        self.dtype = resolve_dtype(self.dtype)
        K, M, N = self.n_states, self.pos_dim, self.n_ctx
        require(isinstance(K, int) and K >= 2, f"the number of states K must be >= 2, got {K}")
        require(isinstance(N, int) and N >= 2, f"N must be an integer >= 2, got {N}")
        require(isinstance(M, int) and M >= 1, f"M must be a positive integer, got {M}")
        require(self.pos_embedding in POS_EMBEDDINGS,
                f"positional embedding must be one of {', '.join(POS_EMBEDDINGS)}, got {self.pos_embedding!r}")
        if self.pos_embedding == "orthogonal":
            require(M >= N, f"orthogonal positional embeddings need M >= N (got M={M}, N={N})")
        else:
            require(M > N, f"sine positional embeddings need M > N (got M={M}, N={N})")
        require(self.init in INITS, f"init must be one of {', '.join(INITS)}, got {self.init!r}")
        if self.mlp_width is not None:
            require(isinstance(self.mlp_width, int) and 1 <= self.mlp_width <= K + M,
                    f"mlp width must be an integer in [1, K + M], got {self.mlp_width}")
        self.d_model = K + M
        self.d_head = self.mlp_width if self.mlp_width is not None else K
        self.d_mlp = self.mlp_width
        self.attn_only = self.mlp_width is None
        self.d_vocab = K + 1
        self.d_vocab_out = K
        self.n_layers = 1
        self.n_heads = 1
        super().__post_init__()

