"""Standard small transformers (TransformerLens 4.x ``TransformerBridge``) trained from scratch.

TransformerLens 4.x removed ``HookedTransformer`` / ``HookedTransformerConfig``. A model trained
from scratch is now a :class:`transformer_lens.model_bridge.TransformerBridge` wrapped around a
TL-native ``NativeModel`` and built by ``TransformerBridge.boot_native(cfg)`` with a
:class:`transformer_lens.config.TransformerBridgeConfig`. This module builds, trains, saves,
loads and reads the weights of such models; ``transformer_lens`` itself is imported lazily
(importing it takes several seconds).

Architecture built by :func:`build_standard_model`
--------------------------------------------------
Learned token embedding ``W_E`` and learned absolute positional embedding ``W_pos`` (added),
``n_layers`` residual blocks of causal multi-head attention (``d_head = d_model // n_heads``,
scores scaled by ``1/sqrt(d_head)``, biases ``b_Q b_K b_V b_O``), optionally a GELU MLP per
block, and a linear unembedding ``W_U``. **No normalization** (``normalization_type=None``; the
``ln1`` / ``ln_final`` slots are identities). Without normalization the residual stream is
linear in the embeddings, so circuits such as ``W_E @ W_V @ W_O @ W_U`` read off the logits
without LayerNorm folding; on a random walk (K=5, p=0.8, length 16, d_model 16, 200 full-batch
AdamW steps at lr 2e-2) the 1-layer model still reaches the Bayes accuracy (tests/test_standard.py).
The unembedding bias ``b_U`` is a zero, non-trainable buffer that the bridge adds (the native
head has no bias); it is in the state dict. Weights use the ``"gpt2"`` init,
N(0, (0.8/sqrt(d_model))^2) (output projections scaled by ``1/sqrt(2 n_layers)``), drawn from a
private generator seeded by ``seed``: the same seed gives the same weights and the caller's global
RNG is not touched.

Hook names on the bridge (verified with transformer-lens 4.3.0; ``L`` = layer index)
-------------------------------------------------------------------------------------
==============================  ===========================================================
``hook_embed``                  token embeddings ``W_E[tokens]``, ``[batch, pos, d_model]``
``hook_pos_embed``              positional embeddings ``W_pos[:pos]``, ``[batch, pos, d_model]``
``blocks.L.hook_resid_pre``     residual stream into block L (layer 0: embed + pos_embed)
``blocks.L.attn.hook_q/k/v``    ``[batch, pos, n_heads, d_head]`` (include ``b_Q/b_K/b_V``)
``blocks.L.attn.hook_pattern``  post-softmax pattern ``[batch, n_heads, query_pos, key_pos]``;
                                editing it in ``run_with_hooks`` changes the output
``blocks.L.attn.hook_z``        ``pattern @ v``, ``[batch, pos, n_heads, d_head]``
``blocks.L.hook_attn_out``      attention output ``[batch, pos, d_model]`` (incl. ``b_O``)
``blocks.L.hook_resid_post``    residual stream out of block L
``ln_final.hook_out``           final residual (identity norm here)
``hook_unembed``                logits ``[batch, pos, d_vocab]`` (what ``model(tokens)`` returns)
``blocks.L.mlp.hook_pre/post``  MLP hidden pre/post activation (models with MLPs only)
``blocks.L.hook_mlp_out``       MLP output ``[batch, pos, d_model]`` (= ``blocks.L.mlp.hook_out``)
==============================  ===========================================================

Quirks (each checked by running code against transformer-lens 4.3.0):

* ``blocks.L.attn.hook_attn_scores`` is **not** pre-softmax: it fires after ``hook_pattern``
  with the very same post-softmax tensor (rows sum to 1), and edits to it are discarded with a
  ``UserWarning``. No hook carries pre-softmax scores; :func:`attn_scores_from_cache` rebuilds
  them from ``hook_q``/``hook_k`` (``q.k / sqrt(d_head)``, ``-inf`` above the diagonal), and
  their softmax equals ``hook_pattern`` exactly.
* ``model.set_use_attn_result(True)`` (or assigning ``model.cfg.use_attn_result = True``) raises
  ``NotImplementedError`` (native ``AttentionBridge`` has no per-head result fork); passing
  ``use_attn_result=True`` in the config is accepted but ``blocks.L.attn.hook_result`` never
  fires. Per-head outputs are ``hook_z[:, :, h] @ W_O[L, h]``.
* ``boot_native`` returns the model in **training** mode; the bridge has no dropout, but
  ``transformer_lens.patching`` refuses a model in training mode. :func:`build_standard_model`,
  :func:`train_standard_model` and :func:`load_standard_model` all return it in eval mode.
* There is no tokenizer: pass integer token tensors ``[batch, pos]`` (``pos <= n_ctx``).
* ``model(tokens)`` returns logits; ``model(tokens, return_type="loss")`` the mean next-token
  loss.
* The bridge is saved as its state dict (safetensors) plus the config (JSON), not pickled.
* ``TransformerLensConfig.__post_init__`` defaults ``device`` to ``"cuda"`` when CUDA is
  available, whatever the model's real device (read in the source); the config is built with an
  explicit device here. ``TransformerBridge.to(dev)`` updates ``model.cfg.device``.
* These models are tiny: on a CPU shared with other work, PyTorch's extra intra-op threads can
  make them much slower than one thread; ``torch.set_num_threads(1)`` helps there.

What works on the bridge: ``model.run_with_cache(tokens)`` returns ``(logits, cache)`` with
``cache`` a ``transformer_lens.ActivationCache`` holding the hooks above;
``model.run_with_hooks(tokens, fwd_hooks=[(name, fn)])`` works (edits of ``hook_resid_pre``,
``hook_pattern``, ``hook_v``, ``hook_z`` all change the logits);
``transformer_lens.patching.get_act_patch_resid_pre(model, corrupted_tokens, clean_cache,
metric)`` works and returns ``[n_layers, pos]``, provided the model is in eval mode (it raises
``RwinterpError`` otherwise). The weight properties ``model.W_E``, ``model.W_pos``,
``model.W_Q/W_K/W_V/W_O`` (stacked over layers), ``model.blocks[L].attn.W_Q`` etc. and
``model.W_U`` exist and follow the TransformerLens conventions (``q = resid @ W_Q[L, h] +
b_Q[L, h]``, ``attn_out = sum_h z[:, :, h] @ W_O[L, h] + b_O[L]``, ``logits = resid @ W_U +
b_U``); :func:`standard_weights` returns detached copies of them.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor

from rwinterp import stopping
from rwinterp.errors import RwinterpError

if TYPE_CHECKING:  # pragma: no cover - typing only
    from transformer_lens import ActivationCache
    from transformer_lens.model_bridge import TransformerBridge

__all__ = [
    "CONFIG_FILE",
    "WEIGHTS_FILE",
    "attn_scores_from_cache",
    "build_standard_model",
    "load_standard_model",
    "save_standard_model",
    "standard_weights",
    "train_standard_model",
]

#: File names written by :func:`save_standard_model`.
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
_FORMAT = "rwinterp.standard/1"

# Config fields that define the architecture; saved to JSON and fed back to boot_native on load.
_ARCH_FIELDS = (
    "d_vocab",
    "n_ctx",
    "d_model",
    "d_head",
    "n_layers",
    "n_heads",
    "attn_only",
    "d_mlp",
    "act_fn",
    "normalization_type",
    "positional_embedding_type",
    "attention_dir",
    "init_mode",
    "seed",
)

_DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


def _dtype_name(dtype: torch.dtype) -> str:
    for name, value in _DTYPES.items():
        if value == dtype:
            return name
    raise RwinterpError(f"unsupported dtype {dtype}; use one of {sorted(_DTYPES)}")


def _boot(
    arch: dict[str, Any], dtype: torch.dtype, device: str | torch.device
) -> TransformerBridge:
    """Boot a native bridge from architecture fields and return it in eval mode."""
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge
    from transformer_lens.model_bridge.sources import native  # noqa: F401  (registers boot_native)

    cfg = TransformerBridgeConfig(
        **arch,
        use_attn_scale=True,
        final_rms=False,
        gated_mlp=False,
        init_weights=True,
        dtype=dtype,
        device=str(device),
    )
    model = TransformerBridge.boot_native(cfg, device=device, dtype=dtype)
    model.eval()
    return model


def build_standard_model(
    d_vocab: int,
    n_ctx: int,
    d_model: int = 32,
    n_layers: int = 1,
    n_heads: int = 1,
    attn_only: bool = True,
    d_mlp: int | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> TransformerBridge:
    """Build a randomly initialised standard transformer as a ``TransformerBridge``.

    Learned token and absolute positional embeddings, ``n_layers`` blocks of causal attention
    (``n_heads`` heads of size ``d_model // n_heads``, with biases) and, unless ``attn_only``,
    a GELU MLP of width ``d_mlp`` (default ``4 * d_model``); no normalization; an unembedding
    to ``d_vocab`` logits. Built by ``TransformerBridge.boot_native``.

    Args:
        d_vocab: Vocabulary size (tokens are ``0 .. d_vocab - 1``).
        n_ctx: Maximum sequence length (size of the positional embedding).
        d_model: Residual stream width; must be divisible by ``n_heads``.
        n_layers: Number of blocks.
        n_heads: Attention heads per block.
        attn_only: Leave out the MLPs.
        d_mlp: MLP hidden width (ignored when ``attn_only``); ``None`` means ``4 * d_model``.
        seed: Seed of the weight initialisation (a private generator; the global RNG is left
            alone). The same arguments give bitwise identical weights.
        dtype: Parameter dtype.
        device: Device the model is created on (``model.to(...)`` moves it later).

    Returns:
        The bridge, in eval mode. ``model(tokens)`` maps ``Int[Tensor, "batch pos"]`` to logits
        ``Float[Tensor, "batch pos d_vocab"]``.

    Raises:
        RwinterpError: on non-positive sizes or ``d_model`` not divisible by ``n_heads``.
    """
    for name, value in (
        ("d_vocab", d_vocab),
        ("n_ctx", n_ctx),
        ("d_model", d_model),
        ("n_layers", n_layers),
        ("n_heads", n_heads),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RwinterpError(f"{name} must be a positive integer, got {value!r}")
    if d_model % n_heads != 0:
        raise RwinterpError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
    if d_mlp is not None and (isinstance(d_mlp, bool) or not isinstance(d_mlp, int) or d_mlp < 1):
        raise RwinterpError(f"d_mlp must be a positive integer or None, got {d_mlp!r}")
    _dtype_name(dtype)
    arch: dict[str, Any] = {
        "d_vocab": d_vocab,
        "n_ctx": n_ctx,
        "d_model": d_model,
        "d_head": d_model // n_heads,
        "n_layers": n_layers,
        "n_heads": n_heads,
        "attn_only": bool(attn_only),
        "d_mlp": d_mlp if d_mlp is not None else 4 * d_model,
        "act_fn": "gelu",
        "normalization_type": None,
        "positional_embedding_type": "standard",
        "attention_dir": "causal",
        "init_mode": "gpt2",
        "seed": int(seed),
    }
    return _boot(arch, dtype, device)


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _check_tokens(model: TransformerBridge, tokens: Tensor, min_pos: int = 1) -> None:
    if not isinstance(tokens, Tensor) or tokens.dim() != 2:
        raise RwinterpError("tokens must be an integer tensor of shape [batch, pos]")
    if tokens.dtype.is_floating_point or tokens.dtype == torch.bool or tokens.is_complex():
        raise RwinterpError(f"tokens must be integer, got dtype {tokens.dtype}")
    batch, pos = tokens.shape
    if batch < 1 or pos < min_pos:
        raise RwinterpError(
            f"tokens need at least 1 row and {min_pos} positions, got {tuple(tokens.shape)}"
        )
    if pos > model.cfg.n_ctx:
        raise RwinterpError(f"sequence length {pos} exceeds n_ctx={model.cfg.n_ctx}")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= model.cfg.d_vocab:
        raise RwinterpError(f"token ids must lie in [0, {model.cfg.d_vocab}), got range [{lo}, {hi}]")


def train_standard_model(
    model: TransformerBridge,
    tokens: Int[Tensor, "batch pos"],
    steps: int,
    lr: float = 1e-2,
    weight_decay: float = 0.0,
    batch_size: int | None = None,
    seed: int = 0,
    progress: bool = False,
) -> list[float]:
    """Train ``model`` in place on next-token prediction; return the loss of every step.

    The loss is the cross-entropy of predicting ``tokens[:, t + 1]`` from the logits at
    position ``t``, averaged over every position ``t = 0 .. pos - 2`` and every sequence in the
    batch. The optimiser is ``torch.optim.AdamW(lr, weight_decay)`` over all parameters.

    Args:
        model: A bridge from :func:`build_standard_model` or :func:`load_standard_model`.
        tokens: Training sequences, ``Int[Tensor, "batch pos"]`` with ``2 <= pos <= n_ctx``.
        steps: Number of optimiser steps (0 leaves the model unchanged).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        batch_size: Sequences per step; ``None`` (or ``>= batch``) trains full-batch. Minibatches
            walk through a fresh seeded permutation of the rows each epoch.
        seed: Seed of the minibatch order (a private generator; the global RNG is left alone).
            Training is deterministic given the model's weights, the data and ``seed``.
        progress: Show a ``tqdm`` progress bar.

    Returns:
        ``steps`` floats, the training loss of each step (before its update).

    Raises:
        RwinterpError: on malformed tokens or arguments, or if the loss becomes non-finite.
    """
    from tqdm.auto import tqdm

    _check_tokens(model, tokens, min_pos=2)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise RwinterpError(f"steps must be a non-negative integer, got {steps!r}")
    if not (lr > 0 and math.isfinite(lr)):
        raise RwinterpError(f"lr must be positive and finite, got {lr!r}")
    if not (weight_decay >= 0 and math.isfinite(weight_decay)):
        raise RwinterpError(f"weight_decay must be non-negative, got {weight_decay!r}")
    n = tokens.shape[0]
    if batch_size is not None and (
        isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
    ):
        raise RwinterpError(f"batch_size must be a positive integer or None, got {batch_size!r}")
    full_batch = batch_size is None or batch_size >= n

    device = _model_device(model)
    data = tokens.to(device=device, dtype=torch.long)
    d_vocab = model.cfg.d_vocab
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    generator = torch.Generator().manual_seed(int(seed))
    order = torch.empty(0, dtype=torch.long)
    cursor = 0

    losses: list[float] = []
    model.train()
    try:
        for step in tqdm(range(steps), disable=not progress, desc="train", leave=False):
            stopping.check()  # a Ctrl-C or SIGTERM whose exception was lost (see rwinterp.stopping)
            if full_batch:
                batch = data
            else:
                assert batch_size is not None
                if cursor + batch_size > order.numel():
                    order = torch.randperm(n, generator=generator)
                    cursor = 0
                idx = order[cursor : cursor + batch_size].to(device)
                cursor += batch_size
                batch = data[idx]
            logits = model(batch)
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, d_vocab).float(), batch[:, 1:].reshape(-1)
            )
            value = float(loss.detach())
            if not math.isfinite(value):
                raise RwinterpError(f"training loss became non-finite ({value}) at step {step}")
            losses.append(value)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    finally:
        model.eval()
    return losses


def _arch_from_model(model: TransformerBridge) -> dict[str, Any]:
    cfg = model.cfg
    arch: dict[str, Any] = {}
    for field in _ARCH_FIELDS:
        value = getattr(cfg, field)
        if isinstance(value, bool) or value is None or isinstance(value, str):
            arch[field] = value
        elif isinstance(value, int):
            arch[field] = int(value)
        else:
            raise RwinterpError(f"config field {field}={value!r} cannot be saved as JSON")
    return arch


def save_standard_model(model: TransformerBridge, directory: str | os.PathLike[str]) -> Path:
    """Save ``model`` as ``model.safetensors`` (state dict) and ``config.json`` in ``directory``.

    The JSON holds the architecture fields of the bridge config (sizes, normalization,
    positional embedding type, init seed) and the dtype. The directory is written whole beside its
    target and renamed into place (:func:`rwinterp.atomic.atomic_directory`): an interrupted save
    leaves the old directory or none, an existing saved model is replaced, and a directory that
    holds anything else is refused. Meant for models from :func:`build_standard_model` /
    :func:`load_standard_model`: config fields outside that architecture (rotary embeddings, gated
    MLPs, ...) are not recorded.

    Returns:
        The directory as a :class:`pathlib.Path`.
    """
    from safetensors.torch import save

    from rwinterp.atomic import atomic_directory

    state = {
        key: value.detach().to("cpu").contiguous().clone()
        for key, value in model.state_dict().items()
    }
    dtype = next(model.parameters()).dtype
    config = {
        "format": _FORMAT,
        "dtype": _dtype_name(dtype),
        "architecture": _arch_from_model(model),
    }

    def build(tmp: Path) -> None:
        # (save_file would make it readable by its owner only)
        (tmp / WEIGHTS_FILE).write_bytes(save(state, metadata={"format": _FORMAT}))
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

    return atomic_directory(directory, build, "saved standard model", (CONFIG_FILE, WEIGHTS_FILE))


def load_standard_model(
    directory: str | os.PathLike[str], device: str | torch.device = "cpu"
) -> TransformerBridge:
    """Rebuild a model written by :func:`save_standard_model` (identical weights and logits).

    Args:
        directory: The directory holding ``config.json`` and ``model.safetensors``.
        device: Device to load onto.

    Returns:
        The bridge, in eval mode.

    Raises:
        RwinterpError: if the files are missing, of another format, or do not match each other.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(directory)
    config_path, weights_path = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise RwinterpError(f"{path} does not hold {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RwinterpError(f"unreadable {config_path}: {exc}") from None
    if not isinstance(config, dict) or config.get("format") != _FORMAT:
        raise RwinterpError(f"{config_path} is not a {_FORMAT} config")
    arch = config.get("architecture")
    if not isinstance(arch, dict) or set(arch) != set(_ARCH_FIELDS):
        raise RwinterpError(f"{config_path} has a malformed 'architecture' entry")
    dtype = _DTYPES.get(config.get("dtype", ""))
    if dtype is None:
        raise RwinterpError(f"{config_path} has an unknown dtype {config.get('dtype')!r}")
    model = _boot(arch, dtype, device)
    try:
        state = load_file(str(weights_path), device=str(device))
    except (SafetensorError, OSError) as exc:
        raise RwinterpError(f"unreadable {weights_path}: {exc}") from None
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise RwinterpError(f"{weights_path} does not match {config_path}: {exc}") from exc
    model.eval()
    return model


def standard_weights(model: TransformerBridge) -> dict[str, Tensor]:
    """Detached copies of the weights, in TransformerLens shapes and conventions.

    Keys and shapes (``L = n_layers``, ``H = n_heads``):

    * ``W_E`` ``[d_vocab, d_model]``, ``W_pos`` ``[n_ctx, d_model]``
    * ``W_Q``, ``W_K``, ``W_V`` ``[L, H, d_model, d_head]``; ``b_Q``, ``b_K``, ``b_V``
      ``[L, H, d_head]``
    * ``W_O`` ``[L, H, d_head, d_model]``; ``b_O`` ``[L, d_model]``
    * ``W_U`` ``[d_model, d_vocab]``; ``b_U`` ``[d_vocab]`` (zero for these models)

    Conventions: ``q[..., h, :] = resid @ W_Q[l, h] + b_Q[l, h]``, ``attn_out = sum_h z[..., h, :]
    @ W_O[l, h] + b_O[l]``, ``logits = resid_final @ W_U + b_U``. Read from the bridge's own
    ``W_E / W_pos / W_Q / ... / W_U`` properties.
    """
    names = ("W_E", "W_pos", "W_Q", "W_K", "W_V", "W_O", "W_U", "b_Q", "b_K", "b_V", "b_O", "b_U")
    with torch.no_grad():
        return {name: getattr(model, name).detach().clone() for name in names}


def attn_scores_from_cache(
    model: TransformerBridge, cache: ActivationCache, layer: int
) -> Float[Tensor, "batch head query_pos key_pos"]:
    """Pre-softmax attention scores of ``layer``, rebuilt from ``hook_q`` and ``hook_k``.

    The bridge has no hook carrying pre-softmax scores (``hook_attn_scores`` holds the
    post-softmax pattern). This returns ``q . k / scale`` with ``-inf`` at masked (future)
    positions, where ``scale`` is the model's attention scale (``sqrt(d_head)`` by default);
    its softmax over the last axis equals ``cache[f"blocks.{layer}.attn.hook_pattern"]``.
    """
    q = cache[f"blocks.{layer}.attn.hook_q"]
    k = cache[f"blocks.{layer}.attn.hook_k"]
    scale = getattr(model.blocks[layer].attn.original_component, "scale", math.sqrt(q.shape[-1]))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / scale
    n_q, n_k = scores.shape[-2], scores.shape[-1]
    if getattr(model.cfg, "attention_dir", "causal") == "causal":
        mask = torch.triu(torch.ones(n_q, n_k, dtype=torch.bool, device=scores.device), 1)
        scores = scores.masked_fill(mask, float("-inf"))
    return scores
