"""The computational graph of a model, read from its hooks and weights: writers, readers and edges.

A transformer with a residual stream and no normalisation is a sum: the input of every attention
head's query, key and value projection, of every MLP and of the unembedding is the sum of what the
components before it wrote into the stream,

    resid_pre[L] = embeddings + sum over earlier heads h of z_h W_O[h] + sum over earlier MLPs + biases,

and each reader is a linear map of that sum (``q = resid W_Q + b_Q`` and so on). So the part of a
reader's input that comes from one writer is that writer's output times the reader's matrix, and an
*edge* (writer -> reader) can be cut exactly by adding ``(replacement - actual output) @ matrix`` to
the reader's projection, at ``blocks.L.attn.hook_q/hook_k/hook_v``, ``blocks.L.mlp.hook_pre`` or the
last ``hook_resid_post`` (which only the unembedding reads), leaving every other reader of that
writer as it was. This is exact only where the sum and the linear maps hold, so
:func:`inspect_model` checks both on a few inputs against the hooks, and :func:`model_graph` refuses,
with a one-line error, a model where they do not (a normalisation, or no residual stream).

Nodes and names
---------------
* writers: ``embeddings`` (token and positional embeddings together), ``L{l}H{h}`` (a head's output
  ``z_h W_O[h]``), ``MLP{l}``;
* readers: ``L{l}H{h}.q``, ``.k``, ``.v``, ``MLP{l}`` (its input) and ``logits``;
* an edge joins a writer to every reader after it: ``embeddings -> L0H0.k``, ``L0H1 -> L1H2.k``, ...

Rows: a query-slot model (``attention = "query"``) computes its heads, MLPs and logits at the last
position only (a query axis of length 1), while keys and values read every position. Every writer's
output is therefore placed at the positions it was computed at (zeros elsewhere) before it is
projected into a reader, whose own rows are the last ``rows`` positions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from jaxtyping import Float
from torch import Tensor

from probes.targets import head_name, hook_names, model_dims, require_hooks
from rwinterp.errors import RwinterpError, require

#: Hook names of the graph's activations.
EMBED, POS_EMBED = "hook_embed", "hook_pos_embed"
RESID_PRE = "blocks.{layer}.hook_resid_pre"
RESID_POST = "blocks.{layer}.hook_resid_post"
ATTN_OUT = "blocks.{layer}.hook_attn_out"
MLP_OUT = "blocks.{layer}.hook_mlp_out"
MLP_PRE = "blocks.{layer}.mlp.hook_pre"
Z = "blocks.{layer}.attn.hook_z"
PATTERN = "blocks.{layer}.attn.hook_pattern"
QKV = {"q": "blocks.{layer}.attn.hook_q", "k": "blocks.{layer}.attn.hook_k", "v": "blocks.{layer}.attn.hook_v"}

#: Relative size of a residual, against the activation it should reproduce, that counts as a match.
TOLERANCE = 1e-4


@dataclass(frozen=True)
class Node:
    """A writer (``kind`` embed, head, mlp) or a reader (``kind`` q, k, v, mlp, logits) of the stream.

    ``layer`` is -1 for the embeddings and ``n_layers`` for the logits; ``head`` is -1 where there
    is none."""

    kind: str
    layer: int
    head: int = -1

    @property
    def name(self) -> str:
        if self.kind == "embed":
            return "embeddings"
        if self.kind == "logits":
            return "logits"
        if self.kind == "mlp":
            return f"MLP{self.layer}"
        base = head_name(self.layer, self.head)
        return base if self.kind == "head" else f"{base}.{self.kind}"

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Edge:
    writer: Node
    reader: Node

    @property
    def name(self) -> str:
        return f"{self.writer.name}->{self.reader.name}"

    def __str__(self) -> str:
        return self.name


def _padded(values: Tensor, n_pos: int) -> Tensor:
    """``[batch, rows, ...]`` computed at the last ``rows`` positions, as ``[batch, n_pos, ...]``."""
    rows = values.shape[1]
    if rows == n_pos:
        return values
    pad = values.new_zeros(values.shape[0], n_pos - rows, *values.shape[2:])
    return torch.cat([pad, values], dim=1)


@dataclass
class Structure:
    """What the probes need to know about a model's attention and residual stream.

    ``rows[l]``: query rows of layer ``l`` (1 in a query-slot model, ``n_pos`` in a causal one).
    ``weights``: float64 copies of ``W_Q W_K W_V`` ``[L, H, d_model, d]``, ``b_Q b_K b_V`` ``[L, H, d]``
    (zero where the model has none), ``W_O`` ``[L, H, d_head, d_model]``, ``W_U``, and ``W_in``
    ``[L, d_model, d_mlp]`` with an MLP. ``scale[l]``: the divisor of ``q . k`` in layer ``l``'s scores
    (NaN if none reproduces its pattern). The checks (each a list over layers):

    * ``projections[l]``: ``hook_q/k/v`` are ``resid_pre W + b`` (values: where the model exposes them);
    * ``stream[l]``: ``resid_pre[l]`` is the sum of the embeddings and every earlier head and MLP output
      (plus constants), i.e. a residual stream without normalisation;
    * ``mlp_input[l]``: the MLP's ``hook_pre`` is ``(resid_pre + attn_out) W_in`` (plus a constant);
    * ``logits``: the logits are the last ``hook_resid_post`` times ``W_U`` (plus a constant), and that
      residual is the sum of every writer.
    """

    n_layers: int
    n_heads: int
    n_pos: int
    rows: list[int]
    has_mlp: bool
    weights: dict[str, Tensor]
    scale: list[float]
    projections: list[bool]
    stream: list[bool]
    mlp_input: list[bool]
    logits: bool
    problems: list[str] = field(default_factory=list)

    @property
    def linear(self) -> bool:
        """Whether every edge of the graph can be cut exactly (all checks hold)."""
        return all(self.projections) and all(self.stream) and self.logits and (
            not self.has_mlp or all(self.mlp_input))

    def writers(self) -> list[Node]:
        out = [Node("embed", -1)]
        for layer in range(self.n_layers):
            out += [Node("head", layer, h) for h in range(self.n_heads)]
            if self.has_mlp:
                out.append(Node("mlp", layer))
        return out

    def readers(self) -> list[Node]:
        out = []
        for layer in range(self.n_layers):
            out += [Node(kind, layer, h) for h in range(self.n_heads) for kind in ("q", "k", "v")]
            if self.has_mlp:
                out.append(Node("mlp", layer))
        return out + [Node("logits", self.n_layers)]

    def upstream(self, writer: Node, reader: Node) -> bool:
        """Whether ``writer``'s output reaches ``reader``'s input through the stream."""
        if writer.kind == "embed":
            return True
        if reader.kind == "mlp" and writer.kind == "head":
            return writer.layer <= reader.layer
        return writer.layer < reader.layer

    def edges(self) -> list["Edge"]:
        """Every edge, readers in model order and, for each, its writers in model order."""
        return [Edge(w, r) for r in self.readers() for w in self.writers() if self.upstream(w, r)]

    # ------------------------------------------------------------------ writers' outputs and readers' maps
    def writer_hooks(self) -> list[str]:
        names = [EMBED, POS_EMBED] + [Z.format(layer=l) for l in range(self.n_layers)]
        return names + ([MLP_OUT.format(layer=l) for l in range(self.n_layers)] if self.has_mlp else [])

    def writer_output(self, acts: dict[str, Tensor], writer: Node) -> Float[Tensor, "batch pos d_model"]:
        """A writer's output in the stream, at every position (zeros where it computes nothing)."""
        if writer.kind == "embed":
            out = acts[EMBED].to(torch.float64) + acts[POS_EMBED].to(torch.float64)
        elif writer.kind == "head":
            z = acts[Z.format(layer=writer.layer)][:, :, writer.head].to(torch.float64)
            out = z @ self.weights["W_O"][writer.layer, writer.head]
        else:
            out = acts[MLP_OUT.format(layer=writer.layer)].to(torch.float64)
        return _padded(out, self.n_pos)

    def reader_hook(self, reader: Node) -> str:
        if reader.kind in QKV:
            return QKV[reader.kind].format(layer=reader.layer)
        if reader.kind == "mlp":
            return MLP_PRE.format(layer=reader.layer)
        return RESID_POST.format(layer=self.n_layers - 1)

    def reader_matrix(self, reader: Node) -> Optional[Tensor]:
        """The map from the stream into the reader's hook (None: the identity, for the logits)."""
        if reader.kind in QKV:
            return self.weights[f"W_{reader.kind.upper()}"][reader.layer, reader.head]
        if reader.kind == "mlp":
            return self.weights["W_in"][reader.layer]
        return None


def _weights(model: Any, n_layers: int, n_heads: int) -> dict[str, Tensor]:
    def get(name: str) -> Optional[Tensor]:
        value = getattr(model, name, None)
        return value.detach().to(torch.float64) if isinstance(value, Tensor) else None

    out: dict[str, Tensor] = {}
    for name in ("W_Q", "W_K", "W_V", "W_O", "W_U"):
        value = get(name)
        require(value is not None, f"the graph needs the model's {name} (TransformerLens weights), which "
                                   f"{type(model).__name__} lacks")
        out[name] = value
    require(out["W_Q"].ndim == 4 and out["W_Q"].shape[:2] == (n_layers, n_heads),
            f"the graph needs W_Q of shape [n_layers, n_heads, d_model, d_head]; got {tuple(out['W_Q'].shape)}: "
            f"the model's attention cannot be split by head")
    for name in ("b_Q", "b_K", "b_V"):
        value = get(name)
        width = out[f"W_{name[-1]}"].shape[-1]
        out[name] = value if value is not None and value.shape == (n_layers, n_heads, width) else \
            torch.zeros(n_layers, n_heads, width, dtype=torch.float64)
    try:
        W_in = getattr(model, "W_in", None)
    except RwinterpError:
        W_in = None
    if isinstance(W_in, Tensor):
        out["W_in"] = W_in.detach().to(torch.float64)
    return out


def _close(a: Tensor, b: Tensor, constant: bool = True) -> bool:
    """``a == b`` up to a constant over the batch (biases) and float round-off."""
    diff = (a.to(torch.float64) - b.to(torch.float64))
    if constant:
        diff = diff - diff.mean(0, keepdim=True)
    scale = max(float(a.abs().max()), float(b.abs().max()), 1e-30)
    return bool(diff.abs().max() <= TOLERANCE * scale)


def inspect_model(model: Any, inputs: Tensor, n: int = 8) -> Structure:
    """Read the model's structure from its hooks on the first ``n`` of ``inputs`` (see :class:`Structure`)."""
    n_layers, n_heads = model_dims(model)
    have = hook_names(model)
    has_mlp = MLP_OUT.format(layer=0) in have and MLP_PRE.format(layer=0) in have and bool(
        getattr(model.cfg, "d_mlp", None)) and not getattr(model.cfg, "attn_only", False)
    needed = [EMBED, POS_EMBED] + [RESID_PRE.format(layer=l) for l in range(n_layers)] + [
        Z.format(layer=l) for l in range(n_layers)] + [PATTERN.format(layer=l) for l in range(n_layers)] + [
        RESID_POST.format(layer=n_layers - 1)] + [ATTN_OUT.format(layer=l) for l in range(n_layers)]
    require_hooks(model, needed, "graph")
    weights = _weights(model, n_layers, n_heads)
    has_mlp = has_mlp and "W_in" in weights
    names = list(needed)
    names += [QKV[k].format(layer=l) for l in range(n_layers) for k in QKV if QKV[k].format(layer=l) in have]
    if has_mlp:
        names += [f(layer=l) for l in range(n_layers) for f in (MLP_OUT.format, MLP_PRE.format)]
    small = inputs[:n]
    with torch.no_grad():
        logits, cache = model.run_with_cache(small, names_filter=names)
    acts = {k: cache[k] for k in names}
    n_pos = acts[EMBED].shape[1]
    rows = [int(acts[Z.format(layer=l)].shape[1]) for l in range(n_layers)]
    problems: list[str] = []
    projections, stream, mlp_input, scale = [], [], [], []
    structure = Structure(n_layers, n_heads, n_pos, rows, has_mlp, weights, scale, projections, stream,
                          mlp_input, True, problems)
    total = structure.writer_output(acts, Node("embed", -1))
    for layer in range(n_layers):
        resid = acts[RESID_PRE.format(layer=layer)].to(torch.float64)
        ok = _close(resid, total)
        stream.append(ok)
        if not ok:
            problems.append(f"blocks.{layer}.hook_resid_pre is not the sum of the embeddings and the earlier "
                            f"heads' and MLPs' outputs (no residual stream, or a normalisation)")
        q, k = _qk(structure, acts, resid, layer)
        proj_ok = True
        for kind in QKV:
            name = QKV[kind].format(layer=layer)
            if name not in acts:
                proj_ok = False
                problems.append(f"the model has no hook blocks.{layer}.attn.hook_{kind} to cut edges into")
                continue
            hook = acts[name].to(torch.float64)
            built = {"q": q, "k": k}.get(kind)
            if built is None:
                built = torch.einsum("bpm,hmd->bphd", resid, weights["W_V"][layer]) + weights["b_V"][layer]
            if built.shape != hook.shape or not _close(hook, built, constant=False):
                proj_ok = False
                problems.append(f"blocks.{layer}.attn.hook_{kind} is not blocks.{layer}.hook_resid_pre @ "
                                f"W_{kind.upper()} + b_{kind.upper()} (a normalisation of the attention's input)")
        projections.append(proj_ok)
        scale.append(_scale(model, acts[PATTERN.format(layer=layer)], q, k, layer))
        attn_out = acts[ATTN_OUT.format(layer=layer)].to(torch.float64)
        heads = [structure.writer_output(acts, Node("head", layer, h)) for h in range(n_heads)]
        head_sum = sum(heads)
        if not _close(_padded(attn_out, n_pos), head_sum):
            stream[-1] = False
            problems.append(f"blocks.{layer}.hook_attn_out is not the sum of its heads' z W_O (a normalisation "
                            f"or scale after the heads)")
        total = total + head_sum
        if has_mlp:
            mid = resid + _padded(attn_out, n_pos)
            pre = acts[MLP_PRE.format(layer=layer)].to(torch.float64)
            built = mid[:, n_pos - pre.shape[1]:] @ weights["W_in"][layer]
            mlp_ok = built.shape == pre.shape and _close(pre, built)
            mlp_input.append(mlp_ok)
            if not mlp_ok:
                problems.append(f"blocks.{layer}.mlp.hook_pre is not the residual stream @ W_in (a normalisation)")
            total = total + structure.writer_output(acts, Node("mlp", layer))
    final = acts[RESID_POST.format(layer=n_layers - 1)].to(torch.float64)
    logits_ok = _close(_padded(final, n_pos), total)
    read = final[:, final.shape[1] - logits.shape[1]:] @ weights["W_U"]
    logits_ok = logits_ok and read.shape[-1] >= logits.shape[-1] and _close(
        logits.to(torch.float64), read[..., : logits.shape[-1]])
    if not logits_ok:
        problems.append("the logits are not the sum of every writer's output @ W_U (no residual stream into "
                        "the unembedding, or a final normalisation)")
    structure.logits = logits_ok
    return structure


def _qk(structure: Structure, acts: dict[str, Tensor], resid: Tensor, layer: int) -> tuple[Tensor, Tensor]:
    """Queries and keys of ``layer`` as its projections of ``resid_pre`` (float64)."""
    W = structure.weights
    rows = structure.rows[layer]
    q = torch.einsum("bpm,hmd->bphd", resid[:, resid.shape[1] - rows:], W["W_Q"][layer]) + W["b_Q"][layer]
    k = torch.einsum("bpm,hmd->bphd", resid, W["W_K"][layer]) + W["b_K"][layer]
    return q, k


def causal_mask(rows: int, n_pos: int) -> Tensor:
    """``[rows, n_pos]``: True where query row ``i`` (input position ``n_pos - rows + i``) sees key ``j``."""
    position = torch.arange(n_pos - rows, n_pos)[:, None]
    return torch.arange(n_pos)[None, :] <= position


def softmax_scores(q: Tensor, k: Tensor, scale: float) -> Tensor:
    """``[batch, head, rows, pos]`` masked scores ``q . k / scale``."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / scale
    mask = causal_mask(q.shape[1], k.shape[1])
    return scores.masked_fill(~mask, float("-inf"))


def _scale(model: Any, pattern: Tensor, q: Tensor, k: Tensor, layer: int) -> float:
    """The divisor of ``q . k`` that reproduces ``pattern`` (NaN if none of the usual ones does)."""
    cfg = model.cfg
    candidates = [getattr(cfg, "attn_scale", None), math.sqrt(q.shape[-1]), 1.0]
    use = getattr(cfg, "use_attn_scale", True)
    for value in candidates:
        if not isinstance(value, (int, float)) or not value > 0 or (value != 1.0 and use is False):
            continue
        rebuilt = torch.softmax(softmax_scores(q, k, float(value)), dim=-1)
        if rebuilt.shape == pattern.shape and _close(rebuilt, pattern, constant=False):
            return float(value)
    return math.nan


def model_graph(model: Any, inputs: Tensor) -> Structure:
    """:func:`inspect_model`, refusing with a one-line error a model whose edges cannot be cut exactly."""
    structure = inspect_model(model, inputs)
    if not structure.linear:
        raise RwinterpError(f"the edge graph of {type(model).__name__} cannot be built: "
                            f"{structure.problems[0]}")
    return structure
