"""What a user chooses: the model's options, the bridge's options and how to train, with their defaults.

These dataclasses are the one table of defaults. The command line builds its options and their help
text from them (:func:`cli_options`), experiments write them as dicts, and a run saves them in its
``config.json``. They import nothing heavy, so arguments are checked before torch and
TransformerLens load; :class:`rwinterp.model.DeepConfig` adds to :class:`DeepOptions` the fields
TransformerLens derives from them.

Every config shares one pattern: ``Config.from_dict(d)`` (unknown fields and values of the wrong JSON
type refused in one line) and ``config.to_dict()`` (JSON-serialisable, only the fields a user sets).
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Optional

from rwinterp.errors import from_dict_checked, require, require_seed

DTYPES = ("float32", "float64")
#: Where a model may train (``--device``): the CPU, a CUDA GPU, or the GPU where there is one.
DEVICES = ("auto", "cpu", "cuda")
#: The most layers, and the most heads per layer, a model may have.
MAX_LAYERS_OR_HEADS = 256
#: The most training steps a config accepts (far beyond any run here; larger counts are typos).
MAX_STEPS = 10**8


def option(default: Any, help: str, flag: Optional[str] = None, **metadata: Any) -> Any:
    """A dataclass field with its command-line help (``flag``: the option's name, default ``--field-name``)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, "flag": flag, **metadata})
    return field(default=default, metadata={"help": help, "flag": flag, **metadata})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def require_int(value: Any, name: str, low: int, high: Optional[int] = None) -> None:
    """A one-line error unless ``value`` is an integer in ``[low, high]``."""
    span = f">= {low}" if high is None else f"in [{low}, {high}]"
    require(_is_int(value) and value >= low and (high is None or value <= high),
            f"{name} must be an integer {span}, got {value!r}")


def require_choice(value: Any, name: str, choices: tuple[str, ...]) -> None:
    require(value in choices, f"{name} must be one of {', '.join(choices)}, got {value!r}")


class Config:
    """The to_dict / from_dict pattern every config shares (see the module docstring)."""

    #: The fields a user sets and a run saves (default: every dataclass field).
    user_fields: ClassVar[Optional[tuple[str, ...]]] = None
    #: What the config is called in errors.
    what: ClassVar[str] = "config"

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return cls.user_fields if cls.user_fields is not None else tuple(f.name for f in fields(cls))

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for name in self.field_names():
            value = getattr(self, name)
            out[name] = list(value) if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Any:
        require(isinstance(data, dict), f"the {cls.what} must be a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - set(cls.field_names()))
        require(not unknown, f"unknown {cls.what} fields: {', '.join(unknown)}")
        return from_dict_checked(cls, data, cls.what)

    def replace(self, **changes: Any) -> Any:
        """A copy with some fields changed (validated again)."""
        return type(self).from_dict({**self.to_dict(), **changes})


def defaults(cls: type) -> dict[str, Any]:
    """Every field of a config class with its default (fields without one are left out)."""
    out = {}
    for f in fields(cls):
        if f.name not in cls.field_names():
            continue
        if f.default is not MISSING:
            out[f.name] = f.default
        elif f.default_factory is not MISSING:
            out[f.name] = f.default_factory()
    return out


def unmet_need(options: Any, name: str) -> Optional[str]:
    """The field that a field of ``options`` needs and that is not set as it needs (its metadata ``needs``:
    ``(field, value)``, ``value`` None for any true value), or None."""
    need = next(f for f in fields(options) if f.name == name).metadata.get("needs")
    if need is None:
        return None
    other, value = need
    have = getattr(options, other)
    return None if (bool(have) and have is not None if value is None else have == value) else other


def cli_options(cls: type) -> list[tuple[str, Any]]:
    """``(flag, field)`` for every field of ``cls`` that has command-line help, in declaration order."""
    return [(f.metadata.get("flag") or "--" + f.name.replace("_", "-"), f)
            for f in fields(cls) if f.metadata.get("help") and f.name in cls.field_names()]


# ---------------------------------------------------------------------------------------- the model
CHOICES = {
    "pos_mode": ("concat", "added"),
    "pos_embedding": ("orthogonal", "sine", "learned"),
    "token_embedding": ("onehot", "learned"),
    "key_query": ("merged", "factored"),
    "values": ("tokens", "all"),
    "readout": ("fixed", "learned"),
    "attention": ("query", "causal"),
    "init": ("zero", "gaussian", "standard"),
    "act_fn": ("relu", "linear"),
}


@dataclass
class DeepOptions(Config):
    """The options of :class:`rwinterp.model.DeepTransformer`. The defaults are the paper's model
    (see ``docs/model.md``): one layer, one head, one-hot tokens concatenated with fixed orthogonal
    positional embeddings of squared norm M/2, a merged key-query matrix W, values that read only the
    token coordinates, attention from the query slot alone, no residual stream, zero initialisation.

    ``d_model`` is the residual width with ``pos_mode="added"``; with concatenated positions it is
    ``d_token + pos_dim`` and must be left unset. ``d_head`` defaults to K with the fixed readout (the
    paper's V is K x K) and to ``d_model // n_heads`` otherwise.
    """

    n_states: int = option(6, "number of states K", flag="--K")
    n_ctx: int = option(97, "positions per sample N, the query slot included", flag="--N")
    n_layers: int = option(1, "number of layers", flag="--layers")
    n_heads: int = option(1, "heads per layer", flag="--heads")
    pos_mode: str = option("concat", "positions concatenated to the tokens (the paper's) or added to them",
                           choices=CHOICES["pos_mode"])
    pos_embedding: str = option("orthogonal", "positional embeddings: fixed orthogonal or sine (squared norm M/2), "
                                "or learned", flag="--pe", choices=CHOICES["pos_embedding"])
    pos_dim: int = option(1000, "positional embedding dimension M (concatenated positions)", flag="--M")
    d_model: Optional[int] = option(None, "residual width (added positions; concatenated ones give d_token + M)")
    d_head: Optional[int] = option(None, "head width (default K with the fixed readout, else d_model / heads)")
    token_embedding: str = option("onehot", "one-hot tokens (the paper's) or learned embeddings",
                                  choices=CHOICES["token_embedding"])
    d_token: Optional[int] = option(None, "width of learned token embeddings (concatenated positions)")
    key_query: str = option("merged", "one merged key-query matrix W (the paper's) or factored W_Q, W_K",
                            choices=CHOICES["key_query"])
    attn_scale: float = option(1.0, "attention scores are divided by this (the paper's: 1)")
    values: str = option("tokens", "values read the token coordinates (the paper's) or all of the residual stream",
                         choices=CHOICES["values"])
    readout: str = option("fixed", "fixed W_O, W_U that read and write the first coordinates (the paper's) or "
                          "learned", choices=CHOICES["readout"])
    residual: bool = option(False, "add block outputs to the residual stream (the paper's: replace it)")
    attention: str = option("query", "attend from the query slot only (the paper's) or causally from every position",
                            choices=CHOICES["attention"])
    mlp_width: Optional[int] = option(None, "an FC layer of this width m after each attention layer: with the fixed "
                                      "readout f = A act(V X S) as in the paper's FC+ReLU variant")
    act_fn: str = option("relu", "the FC layer's activation (linear: none, f = A V X S)", choices=CHOICES["act_fn"],
                         needs=("mlp_width", None))
    init: str = option("zero", "initialisation: zero (the paper's), gaussian (sigma) or standard (GPT-2's "
                       "N(0, (0.8/sqrt(d_model))^2))", choices=CHOICES["init"])
    init_sigma: float = option(0.01, "with --init gaussian: the standard deviation", flag="--sigma",
                               needs=("init", "gaussian"))
    normalize_tokens: bool = option(False, "the attention uses x~/||x~|| (the paper's random-initialisation runs)")
    normalize_query: bool = option(True, "with --normalize-tokens: normalise the query too (off: the keys only)",
                                   needs=("normalize_tokens", None))
    token_norm: float = option(1.0, "with --normalize-tokens: the length x~ is normalised to",
                               needs=("normalize_tokens", None))
    rank_one_query: bool = option(True, "where the query row is fixed (one layer attending from the query slot with "
                                  "fixed embeddings), keep only u = W x~_N of W: exact under gradient descent")
    seed: int = option(0, "seeds the initialisation")
    dtype: str = option("float64", "floating point type", choices=DTYPES)

    user_fields: ClassVar[tuple[str, ...]] = (
        "n_states", "n_ctx", "n_layers", "n_heads", "pos_mode", "pos_embedding", "pos_dim", "d_model", "d_head",
        "token_embedding", "d_token", "key_query", "attn_scale", "values", "readout", "residual", "attention",
        "mlp_width", "act_fn", "init", "init_sigma", "normalize_tokens", "normalize_query", "token_norm",
        "rank_one_query", "seed", "dtype")
    what: ClassVar[str] = "model config"

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Refuse, in one line, any option or combination of options the model cannot take."""
        for name, allowed in CHOICES.items():
            require_choice(getattr(self, name), name.replace("_", " "), allowed)
        require_choice(self.dtype if isinstance(self.dtype, str) else _dtype_str(self.dtype), "dtype", DTYPES)
        require_int(self.n_states, "the number of states K", 2)
        require_int(self.n_ctx, "N", 2)
        require_int(self.n_layers, "the number of layers", 1, MAX_LAYERS_OR_HEADS)
        require_int(self.n_heads, "the number of heads", 1, MAX_LAYERS_OR_HEADS)
        for name in ("residual", "normalize_tokens", "normalize_query", "rank_one_query"):
            require(isinstance(getattr(self, name), bool), f"{name} must be true or false, got {getattr(self, name)!r}")
        require(_is_number(self.token_norm) and self.token_norm > 0,
                f"token norm must be a positive number, got {self.token_norm!r}")
        require(_is_number(self.init_sigma) and self.init_sigma >= 0,
                f"sigma must be a non-negative number, got {self.init_sigma!r}")
        require(_is_number(self.attn_scale) and self.attn_scale > 0,
                f"attn_scale must be a positive number, got {self.attn_scale!r}")
        require_seed(self.seed)
        K, N = self.n_states, self.n_ctx
        if self.pos_mode == "concat":
            require(self.d_model is None or self.d_model == self.token_width + self.pos_dim,
                    f"d_model applies to added positions (pos_mode added); concatenated ones give d_model = d_token + M"
                    f" = {self.token_width + self.pos_dim}, not {self.d_model}")
            require(self.token_embedding == "learned" or self.d_token in (None, K),
                    f"one-hot tokens take d_token = K = {K}, got {self.d_token!r}")
            if self.d_token is not None:
                require_int(self.d_token, "d_token", 1)
            require_int(self.pos_dim, "M (pos_dim)", 1)
            room, name = self.pos_dim, "M"
        else:
            require(self.d_model is not None, "added positional embeddings need d_model")
            require_int(self.d_model, "d_model", 1)
            require(self.values == "all", "values='tokens' needs concatenated positional embeddings "
                    "(added ones share the token coordinates); use values='all'")
            require(self.token_embedding == "learned" or self.d_model >= K,
                    f"one-hot tokens need d_model >= K = {K}, got {self.d_model}")
            require(self.d_token in (None, self.d_model),
                    "d_token applies to concatenated positions; with added ones use d_model")
            room, name = self.d_model, "d_model"
        if self.pos_embedding == "orthogonal":
            require(room >= N, f"orthogonal positional embeddings need {name} >= N (got {name}={room}, N={N})")
        elif self.pos_embedding == "sine":
            require(room > N, f"sine positional embeddings need {name} > N (got {name}={room}, N={N})")
        if self.mlp_width is not None:
            require_int(self.mlp_width, "the mlp width", 1)
        if self.d_head is not None:
            require_int(self.d_head, "d_head", 1)
        elif self.readout == "learned":
            require(self.width % self.n_heads == 0,
                    f"d_model = {self.width} is not divisible by {self.n_heads} heads: give d_head")
        if self.readout == "fixed":
            require(self.head_width <= self.width and K <= self.width,
                    f"the fixed readout needs d_head <= d_model and K <= d_model (got d_head={self.head_width}"
                    f"{', set by the mlp width' if self.head_width == self.mlp_width else ''}, K={K}, "
                    f"d_model={self.width})")
            require(self.mlp_width is None or self.mlp_width <= self.width,
                    f"the mlp width must be at most d_model = {self.width}, got {self.mlp_width}")

    @property
    def token_width(self) -> int:
        """Width of the token part of the residual stream (K for one-hot tokens)."""
        if self.pos_mode == "added":
            return self.width
        return self.n_states if self.token_embedding == "onehot" or self.d_token is None else self.d_token

    @property
    def width(self) -> int:
        """d_model: given with added positions, ``d_token + M`` with concatenated ones."""
        return self.token_width + self.pos_dim if self.pos_mode == "concat" else self.d_model

    @property
    def head_width(self) -> int:
        """d_head: given, or the mlp width / K with the fixed readout, or d_model / heads."""
        if self.d_head is not None:
            return self.d_head
        if self.readout == "fixed":
            return self.mlp_width if self.mlp_width is not None else self.n_states
        return max(1, self.width // self.n_heads)

    def element_counts(self) -> tuple[int, int]:
        """About how many numbers the model holds (weights with their gradients and optimiser state, and fixed
        embeddings) and how many one sample's forward and backward pass keep: ``[pos]`` tables with the
        rank-one query, ``[heads, pos]`` tables with fixed rows (``query`` attention), the whole
        ``[pos, d_model]`` stream and ``[heads, pos, pos]`` patterns otherwise. For the memory check."""
        K, N, D, H, L, d = self.n_states, self.n_ctx, self.width, self.n_heads, self.n_layers, self.head_width
        qk = 2 * D * d if self.key_query == "factored" else D * D
        per_layer = H * (qk + 2 * D * d) + 2 * D * (self.mlp_width or 0)
        weights = 4 * (L * per_layer + D * K) + (K + 1 + N) * D
        if self.attention == "causal":
            per_sample = L * (16 * N * D + 4 * H * N * N + 4 * N * (self.mlp_width or 0))
        else:
            per_sample = L * (16 * H * N + 4 * N * self.token_width + 16 * D)
        return weights, per_sample

    @classmethod
    def paper(cls, n_states: int = 6, n_ctx: int = 97, pos_dim: int = 1000, **overrides: Any) -> Any:
        """The paper's model (``docs/model.md``); ``overrides`` change single options. With
        ``mlp_width = m`` the head has ``d_head = m`` and the FC layer computes ``f = A act(V X S)``."""
        if overrides.get("mlp_width") is not None:
            overrides.setdefault("d_head", overrides["mlp_width"])
        return cls(n_states=n_states, n_ctx=n_ctx, pos_dim=pos_dim, **overrides)

    @classmethod
    def standard(cls, n_states: int = 6, n_ctx: int = 97, d_model: int = 32, **overrides: Any) -> Any:
        """A standard small transformer, K and N aside: learned token embeddings, added learned positions,
        factored QK scaled by ``1/sqrt(d_head)``, a residual stream, causal attention, a learned readout and
        GPT-2's initialisation; ``overrides`` change single options."""
        return cls(n_states=n_states, n_ctx=n_ctx, **standard_options(d_model, **overrides))

    def describe(self) -> str:
        """One line naming every option."""
        if self == type(self).paper(self.n_states, self.n_ctx, self.pos_dim, **{
                k: getattr(self, k) for k in PAPER_VARIANTS}):
            return (f"paper K={self.n_states} N={self.n_ctx} M={self.pos_dim} pe={self.pos_embedding}"
                    f"{self.mlp_label()} dtype={self.dtype_name} init={self.init_label()}")
        pos = f"{self.pos_mode} {self.pos_embedding}" + (f" M={self.pos_dim}" if self.pos_mode == "concat" else "")
        return (f"deep {self.n_layers} layer(s) x {self.n_heads} head(s), K={self.n_states} N={self.n_ctx} "
                f"d_model={self.width} d_head={self.head_width}, positions {pos}, tokens {self.token_embedding}, "
                f"{self.key_query} QK / {self.attn_scale:g}, values {self.values}, readout {self.readout}, "
                f"residual {'on' if self.residual else 'off'}, {self.attention} attention{self.mlp_label()}, "
                f"init {self.init_label()}, {self.dtype_name}")

    @property
    def dtype_name(self) -> str:
        return self.dtype if isinstance(self.dtype, str) else _dtype_str(self.dtype)

    def mlp_label(self) -> str:
        """`` mlp=m`` (`` mlp=m linear`` without the ReLU), or nothing without an FC layer."""
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
        out = super().to_dict()
        out["dtype"] = self.dtype_name
        return out


#: Options the paper's model may set and still be the paper's model (its variants).
PAPER_VARIANTS = ("pos_embedding", "init", "init_sigma", "normalize_tokens", "normalize_query", "token_norm",
                  "mlp_width", "act_fn", "rank_one_query", "seed", "dtype")


def _dtype_str(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def standard_options(d_model: int, **overrides: Any) -> dict[str, Any]:
    """The :class:`DeepOptions` fields of :meth:`DeepOptions.standard`, K and N aside."""
    options: dict[str, Any] = dict(
        pos_mode="added", pos_embedding="learned", token_embedding="learned", key_query="factored",
        values="all", readout="learned", residual=True, attention="causal", init="standard", d_model=d_model)
    options.update(overrides)
    if "attn_scale" not in options:
        heads = options.get("n_heads", 1)
        options["attn_scale"] = math.sqrt(options.get("d_head") or max(1, options["d_model"] // heads))
    return options


# ---------------------------------------------------------------------------------------- the bridge
NORMALIZATIONS = ("none", "LN")


@dataclass
class BridgeOptions(Config):
    """A standard TransformerLens 4 transformer (``TransformerBridge.boot_native``, :mod:`rwinterp.bridge`):
    learned token and absolute positional embeddings (added), causal multi-head attention with biases
    scaled by ``1/sqrt(d_head)``, optionally a GELU MLP per block, optionally LayerNorm, a linear
    unembedding; GPT-2 initialisation from ``seed``. It reads whole sequences (``d_vocab = K``) and predicts
    the next state at every position."""

    n_states: int = option(6, "number of states K", flag="--K")
    n_ctx: int = option(97, "positions per sample N", flag="--N")
    n_layers: int = option(2, "number of layers", flag="--layers")
    n_heads: int = option(1, "heads per layer", flag="--heads")
    d_model: int = option(16, "residual width")
    d_head: Optional[int] = option(None, "head width (default d_model / heads)")
    attn_only: bool = option(True, "attention only, no MLP (--no-attn-only: a GELU MLP of width 4 d_model)")
    norm: str = option("none", "normalisation: none, or LayerNorm before each sublayer and the unembedding",
                       choices=NORMALIZATIONS)
    seed: int = option(0, "seeds the initialisation")
    dtype: str = option("float32", "floating point type", choices=DTYPES)

    what: ClassVar[str] = "bridge config"

    def __post_init__(self) -> None:
        require_int(self.n_states, "the number of states K", 2)
        require_int(self.n_ctx, "N", 2)
        require_int(self.n_layers, "the number of layers", 1, MAX_LAYERS_OR_HEADS)
        require_int(self.n_heads, "the number of heads", 1, MAX_LAYERS_OR_HEADS)
        require_int(self.d_model, "d_model", 1)
        if self.d_head is None:
            require(self.d_model % self.n_heads == 0,
                    f"d_model = {self.d_model} is not divisible by {self.n_heads} heads: give d_head")
        else:
            require_int(self.d_head, "d_head", 1)
        require(isinstance(self.attn_only, bool), f"attn_only must be true or false, got {self.attn_only!r}")
        require_choice(self.norm, "norm", NORMALIZATIONS)
        require_choice(self.dtype, "dtype", DTYPES)
        require_seed(self.seed)

    @property
    def head_width(self) -> int:
        return self.d_head if self.d_head is not None else self.d_model // self.n_heads

    def element_counts(self) -> tuple[int, int]:
        """As :meth:`DeepOptions.element_counts`, for a dense causal transformer."""
        D, N, H, L = self.d_model, self.n_ctx, self.n_heads, self.n_layers
        mlp = 0 if self.attn_only else 4 * D
        weights = 4 * (L * (4 * D * H * self.head_width + 2 * D * mlp) + 2 * D * self.n_states + N * D)
        return weights, L * (16 * N * D + 4 * H * N * N + 4 * N * mlp)

    def describe(self) -> str:
        return (f"bridge {self.n_layers} layer(s) x {self.n_heads} head(s), K={self.n_states} N={self.n_ctx} "
                f"d_model={self.d_model} d_head={self.head_width}, {'attention only' if self.attn_only else 'MLPs'}, "
                f"norm {self.norm}, init gpt2 (seed {self.seed}), {self.dtype}")


# ---------------------------------------------------------------------------------------- training
OPTIMIZERS = ("gd", "sgd", "adamw")
LR_SCHEDULES = ("constant", "cosine")
REDUCTIONS = ("mean", "sum")
LOSSES = ("log", "xent", "squared")


@dataclass
class TrainConfig(Config):
    """How to train. Defaults are the paper's (Fig 4: gradient descent, lr 1, eps 0.1, 50 steps, 1000/1000
    walks)."""

    lr: float = option(1.0, "learning rate")
    eps: float = option(0.1, "eps of the paper's loss -log(f_y + eps) (--loss log)")
    steps: int = option(50, "training steps")
    loss: str = option("log", "the paper's -log(f_y + eps) on raw scores, softmax cross-entropy, or squared",
                       choices=LOSSES)
    optimizer: str = option("gd", "gd: full-batch gradient descent (the paper's); sgd or adamw", choices=OPTIMIZERS)
    batch_size: Optional[int] = option(None, "mini-batch size (sgd, adamw; default the full batch)")
    lr_schedule: str = option("constant", "the learning rate at every step, or decayed from lr to 0 over the steps "
                              "along a half cosine: lr (1 + cos(pi t / steps)) / 2 at step t", choices=LR_SCHEDULES)
    weight_decay: float = option(0.0, "shrink the weights by lr x this each step (gd, sgd: coupled; adamw: "
                                 "decoupled)")
    n_train: int = option(1000, "training samples (walks, sentences, sequences)")
    n_test: int = option(1000, "test samples")
    population: bool = option(False, "train and test on the exact population of all samples (small N)")
    seed: int = option(0, "seeds the data and the mini-batches (the model's seed is its own option)")
    next_token: bool = option(False, "train on next-state prediction at every position (causal models)")
    reduction: str = option("mean", "the loss averaged (the paper's stated reading) or summed over the samples",
                            choices=REDUCTIONS)
    eval_every: Optional[int] = option(None, "record test scores every this many steps (and at the last); default: "
                                       "every step with full batches (the step's forward pass is reused), about "
                                       "100 times over the run with mini-batches")
    checkpoint_every: Optional[int] = option(None, "keep the model every this many steps in the run directory "
                                             "(checkpoints/step-S, each loadable as a run)")

    what: ClassVar[str] = "training config"

    @property
    def full_batch(self) -> bool:
        """Whether every step uses all the training samples (gradient descent, or no batch size)."""
        return self.optimizer == "gd" or self.batch_size is None

    @property
    def evaluation_interval(self) -> int:
        """The steps between two evaluations: ``eval_every``, or its default (see the option)."""
        if self.eval_every is not None:
            return self.eval_every
        return 1 if self.full_batch else max(1, self.steps // 100)

    def __post_init__(self) -> None:
        require(_is_number(self.lr) and self.lr > 0, f"lr must be positive and finite, got {self.lr!r}")
        require(_is_number(self.eps) and self.eps > 0, f"eps must be positive and finite, got {self.eps!r}")
        require_int(self.steps, "steps", 0, MAX_STEPS)
        require_choice(self.loss, "loss", LOSSES)
        require_choice(self.optimizer, "optimizer", OPTIMIZERS)
        require_choice(self.lr_schedule, "lr schedule", LR_SCHEDULES)
        require_choice(self.reduction, "reduction", REDUCTIONS)
        if self.batch_size is not None:
            require_int(self.batch_size, "batch size", 1)
        require(_is_number(self.weight_decay) and self.weight_decay >= 0,
                f"weight decay must be a non-negative number, got {self.weight_decay!r}")
        require(self.batch_size is None or self.optimizer != "gd",
                "a batch size needs --optimizer sgd or adamw (gd is full-batch gradient descent)")
        require_seed(self.seed)
        require_int(self.n_train, "n-train", 1)
        require_int(self.n_test, "n-test", 1)
        require(isinstance(self.population, bool) and isinstance(self.next_token, bool),
                "population and next_token must be true or false")
        require(not (self.population and self.batch_size is not None),
                "population mode trains on the exact expectation, in one full batch: a batch size does not apply")
        require(self.batch_size is None or self.batch_size <= self.n_train,
                f"batch size {self.batch_size} is larger than the {self.n_train} training samples")
        require(not (self.population and self.optimizer == "sgd"),
                "population mode trains on the exact expectation: use --optimizer gd or adamw")
        if self.eval_every is not None:
            require_int(self.eval_every, "eval-every", 1)
        if self.checkpoint_every is not None:
            require_int(self.checkpoint_every, "checkpoint-every", 1)
            require(self.checkpoint_every <= self.steps,
                    f"checkpoint-every {self.checkpoint_every} is larger than the {self.steps} steps: no checkpoint "
                    "would be kept")


# ---------------------------------------------------------------------------------------- tasks
#: A task parameter the command line must be given (no default).
REQUIRED = MISSING


@dataclass(frozen=True)
class TaskKind:
    """A kind of task the command line builds (by :func:`rwinterp.tasks.task_from_dict`): the module that
    defines it and the parameters the command line sets, with their defaults (``REQUIRED``: none)."""

    module: str
    params: dict[str, Any]
    help: str


#: Every task kind of the library, by the name its runs save (``--task``). The task classes register
#: themselves under these names when their module is imported.
TASKS: dict[str, TaskKind] = {
    "circle": TaskKind("rwinterp.tasks", {"K": 6, "p": 0.5, "N": 97},
                       "the paper's walk on a circle of K nodes: +1 with probability p, -1 otherwise"),
    "markov": TaskKind("rwinterp.tasks", {"transition": REQUIRED, "N": 97, "initial": None},
                       "a first-order chain with a given transition matrix"),
    "lazy": TaskKind("rwinterp.chains", {"K": 6, "p": 0.5, "stay": 0.5, "N": 97, "initial": None},
                     "the circle walk that stays put with probability stay"),
    "torus": TaskKind("rwinterp.chains", {"rows": REQUIRED, "cols": REQUIRED, "N": 97, "stay": 0.0, "initial": None},
                      "the walk on a rows x cols torus (K = rows x cols)"),
    "regular": TaskKind("rwinterp.chains", {"K": 6, "degree": 3, "N": 97, "graph_seed": 0, "stay": 0.0,
                                            "initial": None},
                        "the walk on a random degree-regular graph"),
    "persistent": TaskKind("rwinterp.chains", {"K": 6, "q": 0.8, "N": 97},
                           "a second-order circle walk that keeps its direction with probability q"),
    "order": TaskKind("rwinterp.chains", {"transition": REQUIRED, "N": 97, "initial": None},
                      "a k-th order chain with a given transition tensor ([K] * (k + 1))"),
    "random-order": TaskKind("rwinterp.chains", {"K": 6, "order": 2, "N": 97, "concentration": 1.0, "chain_seed": 0},
                             "a random k-th order chain with Dirichlet(concentration) rows"),
    "icl": TaskKind("rwinterp.icl", {"K": 3, "N": 64, "order": 1, "concentration": 1.0},
                    "in-context chains: every sequence draws its own transition matrix, rows Dirichlet(concentration)"),
    "qa_majority": TaskKind("rwinterp.qa", {}, "the paper's question-answering task 1 (the majority fruit)"),
    "qa_order": TaskKind("rwinterp.qa", {}, "the paper's question-answering task 2 (the preferred fruit)"),
}

#: What each task parameter is (its type on the command line) and means, for the command line's help
#: (``--name``, underscores as hyphens).
TASK_PARAMETERS: dict[str, tuple[type, str]] = {
    "K": (int, "number of states"),
    "N": (int, "positions per sample, the query slot included"),
    "p": (float, "probability of a +1 step"),
    "stay": (float, "probability of staying put"),
    "rows": (int, "torus rows"),
    "cols": (int, "torus columns"),
    "degree": (int, "degree of the random regular graph"),
    "graph_seed": (int, "seed of the random regular graph"),
    "q": (float, "probability of keeping the direction"),
    "order": (int, "the chain's order k (rows indexed by the last k states)"),
    "concentration": (float, "Dirichlet concentration alpha of the transition rows"),
    "chain_seed": (int, "seed of the random chain"),
    "transition": (str, "the transition matrix or tensor: JSON, or the path of a JSON file"),
    "initial": (str, "distribution of the first state(s): 'uniform', a state, or probabilities (comma-separated "
                     "or JSON)"),
}


# ---------------------------------------------------------------------------------------- seeds
#: The most seeds one ``--seeds`` may list (more is a typo, and a list that large would not fit anyway).
MAX_SEEDS = 100_000


def parse_seeds(text: str, flag: str = "--seeds") -> list[int]:
    """The seeds a ``--seeds`` value lists, in its order: single seeds and inclusive ranges, comma-separated
    (``0-19``, ``0,3,7``, ``0-4,10``). An empty list, a range that goes down (``5-2``), a seed listed twice or
    anything else is a one-line error."""
    require(isinstance(text, str) and text.strip() != "", f"{flag} is empty: give seeds such as 0-19 or 0,3,7")
    seeds: list[int] = []
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        require(low.isascii() and low.isdigit() and (not dash or (high.isascii() and high.isdigit())),
                f"{flag} must list seeds (0,3,7) or ranges of them (0-19), got {text!r}")
        first, last = int(low), int(high) if dash else int(low)
        require(first <= last, f"{flag} {part.strip()}: a range runs from its lower seed to its higher one "
                               f"({last}-{first})")
        require(len(seeds) + last - first + 1 <= MAX_SEEDS, f"{flag} lists more than {MAX_SEEDS} seeds")
        seeds.extend(range(first, last + 1))
    for seed in seeds:
        require_seed(seed, f"every seed of {flag}")
    seen: set[int] = set()
    for seed in seeds:
        require(seed not in seen, f"{flag} lists seed {seed} twice")
        seen.add(seed)
    return seeds
