"""Standard TransformerLens models as runs: ``TransformerBridge.boot_native`` built from a
:class:`rwinterp.config.BridgeOptions`, trained by :func:`rwinterp.training.train` and saved by
:func:`rwinterp.runs.save_run` like the library's own model (kind ``"bridge"``).

TransformerLens 4 removed ``HookedTransformer``; a model trained from scratch is a
:class:`transformer_lens.model_bridge.TransformerBridge` around a TransformerLens-native model. It is the
implementation the field uses (biases, LayerNorm, GELU MLPs), where :class:`rwinterp.model.DeepTransformer`
is the paper's model with each of its choices an option, in float64 and with exact symmetric sums: the
bridge checks that a finding holds on a standard model, the deep model lets one change one choice at a time.

Architecture: learned token embedding ``W_E`` (``d_vocab = K``: the model reads whole sequences and predicts
the next state at every position) and learned absolute positional embedding ``W_pos`` (added);
``n_layers`` blocks of causal multi-head attention (scores scaled by ``1/sqrt(d_head)``, biases
``b_Q b_K b_V b_O``), optionally a GELU MLP of width ``4 d_model`` per block, optionally LayerNorm
(``norm="LN"``); a linear unembedding ``W_U`` (``b_U`` is a zero buffer). Weights use TransformerLens'
``"gpt2"`` initialisation from a generator seeded by ``seed`` (the caller's global RNG is not touched).

Hook names (``L`` = layer): ``hook_embed``, ``hook_pos_embed``, ``blocks.L.hook_resid_pre``,
``blocks.L.attn.hook_q/k/v`` ``[batch, pos, n_heads, d_head]``, ``blocks.L.attn.hook_pattern``
``[batch, n_heads, query_pos, key_pos]``, ``blocks.L.attn.hook_z``, ``blocks.L.hook_attn_out``,
``blocks.L.hook_resid_post``, ``blocks.L.mlp.hook_pre/post``, ``blocks.L.hook_mlp_out`` (with MLPs),
``hook_unembed`` (the logits). Quirks of TransformerLens 4.3, each checked against it:

* ``blocks.L.attn.hook_attn_scores`` is **not** pre-softmax: it fires after ``hook_pattern`` with the
  same post-softmax tensor, and edits to it are discarded. :func:`attn_scores_from_cache` rebuilds the
  pre-softmax scores from ``hook_q`` and ``hook_k``.
* There is no per-head ``hook_result``: a head's output is ``hook_z[:, :, h] @ W_O[L, h]``.
* ``boot_native`` returns a model in training mode, and ``transformer_lens.patching`` refuses one; models
  from :func:`build_bridge` are in eval mode.
* ``TransformerLensConfig.__post_init__`` sets ``device`` to ``"cuda"`` when CUDA is available whatever the
  model's device, so the config is built with an explicit device.
"""

from __future__ import annotations

import contextlib
import io
import math
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from jaxtyping import Float, Int
from torch import Tensor
from transformer_lens import ActivationCache
from transformer_lens.config import TransformerBridgeConfig
from transformer_lens.model_bridge import TransformerBridge
from transformer_lens.model_bridge.sources import native  # noqa: F401  (registers boot_native)
from transformer_lens.model_bridge.sources.native.model import NativeModel

from rwinterp.config import BridgeOptions
from rwinterp.model import resolve_dtype
from rwinterp.runs import register_model_kind


def build_bridge(options: BridgeOptions | dict[str, Any], device: str | torch.device = "cpu") -> TransformerBridge:
    """A freshly initialised bridge (in eval mode) of the given options; the same options give the same
    weights. The options travel with the model as ``model.rwinterp_options``."""
    if isinstance(options, dict):
        options = BridgeOptions.from_dict(options)
    dtype = resolve_dtype(options.dtype)
    cfg = TransformerBridgeConfig(
        d_vocab=options.n_states, n_ctx=options.n_ctx, d_model=options.d_model, d_head=options.head_width,
        n_layers=options.n_layers, n_heads=options.n_heads, attn_only=options.attn_only, d_mlp=4 * options.d_model,
        act_fn="gelu", normalization_type=None if options.norm == "none" else options.norm,
        positional_embedding_type="standard", attention_dir="causal", init_mode="gpt2", seed=options.seed,
        use_attn_scale=True, final_rms=False, gated_mlp=False, init_weights=True, dtype=dtype, device=str(device))
    with contextlib.redirect_stdout(io.StringIO()):  # boot_native prints "Moving model to device"
        model = TransformerBridge.boot_native(cfg, device=device, dtype=dtype)
    model.rwinterp_options = options
    model.eval()
    return model


def attn_scores_from_cache(
    model: TransformerBridge, cache: ActivationCache, layer: int
) -> Float[Tensor, "batch head query_pos key_pos"]:
    """Pre-softmax attention scores of ``layer``, rebuilt from ``hook_q`` and ``hook_k``: ``q . k / scale``
    with ``-inf`` at masked (future) positions; their softmax equals ``blocks.{layer}.attn.hook_pattern``."""
    q = cache[f"blocks.{layer}.attn.hook_q"]
    k = cache[f"blocks.{layer}.attn.hook_k"]
    scale = getattr(model.blocks[layer].attn.original_component, "scale", math.sqrt(q.shape[-1]))
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / scale
    n_q, n_k = scores.shape[-2], scores.shape[-1]
    mask = torch.triu(torch.ones(n_q, n_k, dtype=torch.bool, device=scores.device), 1)
    return scores.masked_fill(mask, float("-inf"))


def _raw(component: torch.nn.Module) -> torch.nn.Module:
    """The PyTorch module a TransformerLens component wraps (its hooks left out)."""
    return getattr(component, "_original_component", component)


def _hooked(model: TransformerBridge) -> bool:
    """Whether any hook point holds a hook: torch's own hook tables, which also see hooks registered without
    TransformerLens, and read in half the time of ``HookPoint.has_hooks`` (this runs at every training step)."""
    return any(hook._forward_hooks or hook._backward_hooks for hook in model.hook_dict.values())


def hook_free_logits(
    model: TransformerBridge, tokens: Int[Tensor, "batch pos"], pattern_row: Optional[int] = None,
    keys: Optional[Sequence[int]] = None,
) -> Float[Tensor, "batch pos d_vocab"] | tuple[Tensor, list[Float[Tensor, "batch head pos"]]]:
    """The bridge's logits computed from its own weights without TransformerLens' wrappers: no hook fires, and
    causal attention is one fused ``scaled_dot_product_attention`` where the native model masks and normalises
    explicitly. The same function as ``model(tokens)`` up to round-off (tested); training uses it, since it
    reads no hook, and a training step takes about two thirds of the time (``benchmarks/bench_icl.py``).

    With ``pattern_row`` it returns ``(logits, rows)``: each layer's attention pattern at query position
    ``pattern_row`` (``[batch, head, pos]``, or the key positions ``keys`` alone; detached), what
    :func:`rwinterp.training.logits_and_pattern` reads from ``hook_pattern``, here from ``q`` and ``k`` for that
    one query (training's evaluation steps).

    A model with hooks attached, or of a layout this does not compute (rotary positions, grouped keys, gated
    MLPs, soft caps), runs through its hooks as usual."""
    native = model.original_model
    if _hooked(model) or not _plain(native):
        if pattern_row is None:
            return model(tokens)
        from rwinterp.training import logits_and_pattern

        return logits_and_pattern(model, tokens, pattern_row, keys)
    batch, n = tokens.shape
    rows = []
    resid = _raw(native.tok_embed)(tokens) + _raw(native.pos).weight[:n]
    for layer in native.layers:
        block = _raw(layer)
        attn = _raw(block.attn)
        x = _raw(block.ln1)(resid)
        q, k, v = (_raw(getattr(attn, name))(x).view(batch, n, -1, attn.d_head).transpose(1, 2) for name in "qkv")
        if pattern_row is not None:
            row = _pattern_row(q.detach(), k.detach(), pattern_row % n, attn.scale)
            rows.append(row if keys is None else row[..., list(keys)])
        z = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / attn.scale)
        resid = resid + _raw(attn.o)(z.transpose(1, 2).reshape(batch, n, -1))
        if not block.cfg.attn_only:
            mlp = _raw(block.mlp)
            resid = resid + _raw(mlp.fc_out)(mlp.act(_raw(mlp.fc_in)(_raw(block.ln2)(resid))))
    logits = _raw(native.head)(_raw(native.ln_out)(resid))
    return logits if pattern_row is None else (logits, rows)


def _pattern_row(q: Float[Tensor, "batch head pos d"], k: Float[Tensor, "batch head pos d"], t: int,
                 scale: float) -> Float[Tensor, "batch head pos"]:
    """Causal attention of query position ``t`` over every key position (0 after ``t``)."""
    scores = torch.einsum("bhd,bhpd->bhp", q[:, :, t], k) / scale
    future = torch.arange(k.shape[2], device=k.device) > t
    return torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)


def _plain(native: torch.nn.Module) -> bool:
    """Whether ``native`` has the layout :func:`hook_free_logits` computes (what :func:`build_bridge` builds)."""
    if (not isinstance(native, NativeModel) or native.pos is None or native.cfg.gated_mlp
            or native.output_logits_soft_cap > 0):
        return False
    blocks = [_raw(layer) for layer in native.layers]
    return all(_raw(b.attn).causal and _raw(b.attn).kv_repeats == 1 and _raw(b.attn).attn_scores_soft_cap <= 0
               and (b.cfg.attn_only or _raw(b.mlp).ln is None) for b in blocks)


def _options_of(model: TransformerBridge) -> dict[str, Any]:
    options = getattr(model, "rwinterp_options", None)
    if options is None:  # a bridge built elsewhere: read what its config says
        cfg = model.cfg
        options = BridgeOptions(
            n_states=int(cfg.d_vocab), n_ctx=int(cfg.n_ctx), n_layers=int(cfg.n_layers), n_heads=int(cfg.n_heads),
            d_model=int(cfg.d_model), d_head=int(cfg.d_head), attn_only=bool(cfg.attn_only),
            norm="none" if cfg.normalization_type is None else str(cfg.normalization_type),
            seed=int(getattr(cfg, "seed", 0) or 0), dtype=str(next(model.parameters()).dtype).removeprefix("torch."))
    return options.to_dict()


register_model_kind("bridge", TransformerBridge, build=build_bridge, config_of=_options_of,
                    full_config=lambda config: BridgeOptions.from_dict(config).to_dict(),
                    train_forward=hook_free_logits)
