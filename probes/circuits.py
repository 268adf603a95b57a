"""Edges and circuits: which paths between components carry a behaviour, scored exactly or by gradients.

The graph (:mod:`probes.graph`) has an edge from every writer (the embeddings, each head's output,
each MLP) to every reader after it (each head's query, key and value input, each MLP's input, the
logits). *Ablating* an edge replaces, in that reader's input only, the writer's output by its
replacement (its mean over the walks at that position, or its value on an independent walk), while
every other reader still sees the writer's actual output (the semantics of ACDC, Conmy et al. 2023,
and of TransformerLens' ``faithfulness``). Several edges are ablated at once the same way: each reader
sees the replacement for every ablated edge into it and the *live* output (in this run) of every
other writer.

Scores (each an estimate of the metric's change when the edge alone is ablated from the full model;
the default metric is the mean next-state cross-entropy, so a positive score is a loss increase):

* ``exact``: one ablated forward pass per edge (stacked many to a pass).
* ``eap``: edge attribution patching (Syed, Rager and Conmy 2023): ``(r_A - a_A) W_R . dm/d(input of R)``
  at the clean run, every edge from one forward and one backward pass.
* ``eap-ig``: EAP with integrated gradients (Hanna et al. 2024): the same deltas, the gradient averaged
  over ``m`` runs whose embeddings move from the replacement's towards the clean ones
  (``x_k = x_r + k/m (x - x_r)``, ``k = 0 .. m-1``).
* ``atp*``: EAP with the query-key fix of AtP* (Kramar et al. 2024): an edge into a head's queries or keys
  changes that head's scores by a known amount, so its new pattern is computed exactly through the
  softmax and only the rest is linearised (``dm/dpattern . (pattern' - pattern)``).
* ``default``: the method ``rwinterp circuit`` uses. Every edge is first scored by AtP*. Edges whose effect
  reaches the loss through nothing but the reader itself (edges into the logits, and, without an MLP in
  the last layer, into a last-layer head's query, key or value) are then computed exactly in closed form
  (the reader head's new pattern and output, the changed logits, the metric), and of the rest the
  ``verify`` edges with the largest estimates are patched exactly (the estimate-then-verify hybrid Syed et
  al. suggest). ``verify`` defaults to :data:`VERIFY`, as many passes as the faithfulness curve takes.

Why not gradients alone: a trained model sits near a minimum of its loss, where the first-order change of
the loss under an ablation averages out over walks and the change that remains is second order (the loss
is convex in the logits); and an edge into a head's keys moves a saturated softmax. On the in-context
model of ``benchmarks/bench_attribution.py`` EAP's Spearman correlation with exact edge scores is about 0.3,
while the largest effects sit on edges into the last layer and the logits, which the closed form gets
exactly.

*Faithfulness* of a circuit (a set of edges kept): the metric with every edge outside it ablated, as a
fraction of the way from the model with every edge ablated (0) to the full model (1). A circuit is
kept by a score threshold or as the top n edges; :func:`circuit` reports the faithfulness of the top-k
edges for a grid of k.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np
import torch
from jaxtyping import Float
from torch import Tensor

from probes.config import CURVE_POINTS, EDGE_METHODS, GRAPHS, VERIFY, ProbeConfig
from probes.graph import (
    EMBED,
    MLP_OUT,
    PATTERN,
    POS_EMBED,
    QKV,
    RESID_PRE,
    Edge,
    Node,
    Z,
    Structure,
    _qk,
    _padded,
    model_graph,
    causal_mask,
)
from probes.patching import (
    ELEMENT_BUDGET,
    Cost,
    _Leaves,
    _require_choice,
    _setup,
    _Setup,
    base_rows,
    element_rows,
    source_activations,
    unpatched_metric,
)
from probes.stats import point_weights, wmean
from probes.targets import evaluating, head_name, targets_for
from rwinterp.errors import require
from rwinterp.tasks import Batch, Task



def graph_edges(structure: Structure, graph: str = "all") -> list[Edge]:
    """The edges of ``structure``'s graph, or of its head-to-head part."""
    _require_choice(graph, GRAPHS, "graph")
    edges = structure.edges()
    if graph == "heads":
        edges = [e for e in edges if e.writer.kind == "head" and e.reader.kind in QKV]
        require(edges, "the model has no edges between heads (it has one layer)")
    return edges


@dataclass
class EdgeScores:
    """The metric of every walk with each edge ablated (``exact``) or its estimate (the gradient methods).

    ``values``: ``[edge, batch]``; ``base``: the full model's metric per walk; ``verified``: which edges'
    values are exact (all for ``exact``, the shortlist for ``default``).
    """

    structure: Structure
    edges: list[Edge]
    method: str
    source: str
    metric: str
    steps: int
    weights: Optional[Tensor]
    base: Float[Tensor, " batch"]
    values: Float[Tensor, "edge batch"]
    verified: Tensor
    cost: Cost

    @property
    def n_walks(self) -> int:
        return int(self.base.shape[0])

    def summary(self, w: Float[Tensor, "draws batch"]) -> Float[Tensor, "draws edge"]:
        return wmean(w, (self.values - self.base).T)

    def scores(self) -> Float[Tensor, " edge"]:
        """Each edge's effect (mean over walks of ``values - base``)."""
        return self.summary(point_weights(self.weights, self.n_walks))[0]

    def order(self) -> list[int]:
        """Edge indices from the largest ``|score|`` down (ties in graph order)."""
        s = self.scores().abs()
        return sorted(range(len(self.edges)), key=lambda i: (-float(s[i]), i))

    def ranked(self, roles: Optional[dict[str, str]] = None) -> list[dict[str, Any]]:
        """``[{"source", "target", "score", "verified"}]`` sorted by ``|score|``, with role names if given."""
        s = self.scores()
        out = []
        for i in self.order():
            edge = self.edges[i]
            row = {"source": edge.writer.name, "target": edge.reader.name, "score": float(s[i]),
                   "verified": bool(self.verified[i])}
            if roles:
                row["source_role"] = _role(roles, edge.writer)
                row["target_role"] = _role(roles, edge.reader)
            out.append(row)
        return out


def _role(roles: dict[str, str], node: Node) -> Optional[str]:
    if node.kind in ("head", "q", "k", "v"):
        return roles.get(head_name(node.layer, node.head))
    return None


def label(node: Node, roles: Optional[dict[str, str]] = None) -> str:
    """A node's name with its head's role, ``L0H0 previous-token`` or ``L1H2.k (induction)``."""
    role = _role(roles or {}, node)
    if role is None:
        return node.name
    return f"{node.name} {role}" if node.kind == "head" else f"{node.name} ({role})"


# ------------------------------------------------------------------------------ the exact runner
class _Ablation:
    """Forward hooks that ablate edges in a stack of runs: ``coef[run, edge]`` in [0, 1] scales how much of
    each edge's writer output is replaced (1: ablated, 0: kept). Writers are read live in the same pass;
    each reader hook gets ``sum over writers of coef (replacement - live) @ M``, with ``M`` the map from the
    writer's own activation into the hook: ``W_O[A] W_Q[l]`` (all of layer l's heads at once) for a head
    writer, ``W_Q[l]`` for the embeddings or an MLP, ``W_in`` into an MLP, the identity (or ``W_O[A]``) into
    the final residual stream. ``sources``: the writers' hooks' replacement activations, ``[1, ...]``
    (means) or ``[batch, ...]`` (donor walks)."""

    def __init__(self, structure: Structure, edges: list[Edge], coef: Tensor, sources: dict[str, Tensor],
                 n_walks: int):
        self.s = structure
        self.runs = coef.shape[0]
        self.n_walks = n_walks
        self.sources = sources
        self.live: dict[str, Tensor] = {}
        self.deltas: dict[Node, Tensor] = {}
        index = {edge: i for i, edge in enumerate(edges)}
        # per reader hook: its readers (all heads of a layer's q, k or v; one MLP; the logits), and for each
        # writer with an ablated edge into one of them the coefficients [run, reader]
        self.plan: dict[str, list[tuple[Node, Tensor]]] = {}
        self.kind: dict[str, Node] = {}
        readers: dict[str, list[Node]] = {}
        for reader in structure.readers():
            readers.setdefault(structure.reader_hook(reader), []).append(reader)
        for name, group in readers.items():
            for writer in structure.writers():
                columns = [index.get(Edge(writer, r)) for r in group]
                if all(i is None for i in columns):
                    continue
                c = torch.stack([coef[:, i] if i is not None else torch.zeros(self.runs, dtype=coef.dtype)
                                 for i in columns], dim=1)  # [run, reader]
                if bool(c.ne(0).any()):
                    self.plan.setdefault(name, []).append((writer, c))
                    self.kind[name] = group[0]

    def _native(self, acts: dict[str, Tensor], writer: Node) -> Tensor:
        """A writer's own activation: a head's z, ``[batch, rows, d_head]``; the embeddings' or an MLP's output."""
        if writer.kind == "embed":
            return acts[EMBED] + acts[POS_EMBED]
        if writer.kind == "head":
            return acts[Z.format(layer=writer.layer)][:, :, writer.head]
        return acts[MLP_OUT.format(layer=writer.layer)]

    def _delta(self, writer: Node, dtype: torch.dtype) -> Tensor:
        """``replacement - live`` of a writer's own activation, ``[run * batch, rows, width]``, once per pass."""
        if writer not in self.deltas:
            live = self._native(self.live, writer)
            source = self._native(self.sources, writer).to(dtype)
            live = live.reshape(self.runs, -1, *live.shape[1:])
            self.deltas[writer] = (source[None] - live).reshape(-1, *live.shape[2:])
        return self.deltas[writer]

    def _matrix(self, writer: Node, reader: Node, dtype: torch.dtype) -> Optional[Tensor]:
        """From the writer's own activation into the reader hook: ``[width, (head,) d]`` (None: identity)."""
        W = self.s.weights
        into = None
        if reader.kind in QKV:
            into = W[f"W_{reader.kind.upper()}"][reader.layer].permute(1, 0, 2)  # [d_model, head, d]
        elif reader.kind == "mlp":
            into = W["W_in"][reader.layer]
        if writer.kind == "head":
            out = W["W_O"][writer.layer, writer.head]  # [d_head, d_model]
            matrix = out if into is None else torch.tensordot(out, into, dims=([1], [0]))
        else:
            matrix = into
        return None if matrix is None else matrix.to(dtype)

    def hooks(self) -> list[tuple[str, Any]]:
        from functools import partial

        def keep(act: Tensor, hook: Any, name: str) -> None:
            self.live[name] = act

        def edit(act: Tensor, hook: Any, name: str) -> Tensor:
            reader = self.kind[name]
            rows = act.shape[1]
            total = torch.zeros_like(act)
            for writer, c in self.plan[name]:
                d = self._delta(writer, act.dtype)
                d = _aligned(d, rows, self.s.n_pos)
                matrix = self._matrix(writer, reader, act.dtype)
                weight = c.to(act.dtype)
                if reader.kind in QKV:  # [run, batch, rows, head, d] by [run, head], for the heads it reaches
                    heads = c.ne(0).any(0).nonzero().flatten()
                    change = torch.tensordot(d, matrix[:, heads], dims=([2], [0]))
                    change = change.reshape(self.runs, -1, *change.shape[1:]) * weight[:, None, None, heads, None]
                    view = total.reshape(self.runs, -1, *total.shape[1:])
                    view[:, :, :, heads] += change
                else:
                    change = d if matrix is None else torch.tensordot(d, matrix, dims=([2], [0]))
                    change = change.reshape(self.runs, -1, *change.shape[1:]) * weight[:, None, None, :]
                    total += change.reshape(act.shape)
            return act + total

        out = [(name, partial(keep, name=name)) for name in self.s.writer_hooks()]
        return out + [(name, partial(edit, name=name)) for name in self.plan]


def _aligned(values: Tensor, rows: int, n_pos: int) -> Tensor:
    """``[batch, rows_w, ...]`` computed at the last ``rows_w`` positions, at the last ``rows`` positions."""
    have = values.shape[1]
    if have == rows:
        return values
    if have > rows:
        return values[:, have - rows:]
    pad = values.new_zeros(values.shape[0], rows - have, *values.shape[2:])
    return torch.cat([pad, values], dim=1)


def ablated_metric(model: Any, setup: _Setup, structure: Structure, edges: list[Edge], coef: Tensor,
                   sources: dict[str, Tensor], rows: int) -> Float[Tensor, "run batch"]:
    """The metric of every walk in each run of ``coef`` (``[run, edge]``, see :class:`_Ablation`)."""
    base = setup.base
    B = base.n_walks
    out = []
    per = max(1, rows // B)
    for start in range(0, coef.shape[0], per):
        chunk = coef[start : start + per]
        ablation = _Ablation(structure, edges, chunk, sources, B)
        with torch.no_grad():
            logits = model.run_with_hooks(base.inputs.repeat(chunk.shape[0], 1), fwd_hooks=ablation.hooks())
        out.append(setup.metric(logits.reshape(chunk.shape[0], B, *logits.shape[1:]), base))
    return torch.cat(out)


def writer_replacements(model: Any, setup: _Setup, structure: Structure, source: str, rows: int,
                        weights: Optional[Tensor]) -> dict[str, Tensor]:
    """The writers' hooks' replacement activations: ``[1, ...]`` means or ``[batch, ...]`` donor walks'
    (a writer's output is ``structure.writer_output(these, writer)``)."""
    names = structure.writer_hooks()
    donor = _Setup(setup.base, setup.donor, setup.bad, names, setup.kind)
    return source_activations(model, donor, source, rows, weights)


def writer_outputs(model: Any, inputs: Tensor, structure: Structure, rows: int) -> dict[Node, Tensor]:
    """Each writer's output on ``inputs`` (the clean run)."""
    names = structure.writer_hooks()
    parts: dict[str, list[Tensor]] = {n: [] for n in names}
    with torch.no_grad():
        for start in range(0, inputs.shape[0], rows):
            _, cache = model.run_with_cache(inputs[start : start + rows], names_filter=names)
            for n in names:
                parts[n].append(cache[n])
    acts = {n: torch.cat(p) for n, p in parts.items()}
    return {w: structure.writer_output(acts, w) for w in structure.writers()}


# ------------------------------------------------------------------------------ scores
def edge_attribution(
    model: Any,
    task: Task,
    data: Batch,
    method: str = "eap",
    source: str = "mean",
    metric: str = "loss",
    steps: int = 1,
    verify: int = VERIFY,
    config: ProbeConfig | None = None,
    graph: str = "all",
) -> EdgeScores:
    """Score every edge of the model's graph (see the module docstring for the methods).

    ``source``: ``mean`` or ``resample`` (ablation into the clean run); ``steps``: the m of ``eap-ig``;
    ``verify``: how many top edges ``default`` patches exactly; ``graph``: ``all`` edges or only those
    between ``heads``. A pure function of its inputs.
    """
    config = config or ProbeConfig()
    _check_edge_options(method, source, metric, steps, verify)
    with evaluating(model):
        start = time.perf_counter()
        setup = _setup(model, task, data, "z", source, metric, config)
        structure = model_graph(model, setup.base.inputs)
        edges = graph_edges(structure, graph)
        result = _edge_scores(model, setup, structure, edges, method, source, metric, steps, verify, data.weights)
        result.cost.seconds = time.perf_counter() - start
        return result


def _check_edge_options(method: str, source: str, metric: str, steps: int, verify: int) -> None:
    _require_choice(method, EDGE_METHODS, "edge method")
    _require_choice(source, ("mean", "resample"), "edge ablation source")
    _require_choice(metric, ("loss", "logit_diff"), "metric")
    require(isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1,
            f"EAP-IG needs m >= 1 integration steps, got {steps!r}")
    require(isinstance(verify, int) and verify >= 0, f"verify must be a non-negative integer, got {verify!r}")


def _edge_scores(model: Any, setup: _Setup, structure: Structure, edges: list[Edge], method: str, source: str,
                 metric: str, steps: int, verify: int, weights: Optional[Tensor],
                 replacement: Optional[dict] = None) -> EdgeScores:
    """:func:`edge_attribution` on a prepared setup; ``replacement``: the writers' ablated outputs, if the caller
    has them already (:func:`writer_replacements`; counted by the caller)."""
    base = setup.base
    rows = element_rows(model, base.n_pos)
    cost = Cost()
    if replacement is None:
        replacement = writer_replacements(model, setup, structure, source, rows, weights)
        cost.forward += 1
    base_metric = unpatched_metric(model, setup, rows)
    cost.forward += 1
    verified = torch.zeros(len(edges), dtype=torch.bool)
    if method == "exact":
        coef = torch.eye(len(edges), dtype=torch.float64)
        values = ablated_metric(model, setup, structure, edges, coef, replacement, rows)
        cost.forward += len(edges)
        verified[:] = True
    else:
        clean = writer_outputs(model, base.inputs, structure, rows)
        cost.forward += 1
        deltas = {w: structure.writer_output(replacement, w) - clean[w] for w in structure.writers()}
        estimate, passes = _gradient_scores(model, setup, structure, edges, deltas, method, steps, rows, replacement)
        cost.forward += passes
        cost.backward += passes
        values = base_metric + estimate
        if method == "default":
            exact, n_heads = _closed_form(model, setup, structure, edges, deltas, rows)
            for i, v in exact.items():
                values[i] = v
                verified[i] = True
            cost.forward += math.ceil(n_heads / (structure.n_layers * structure.n_heads))
        if method == "default" and verify:
            w = point_weights(weights, base.n_walks)
            score = wmean(w, estimate.T)[0].abs()
            pending = [i for i in range(len(edges)) if not bool(verified[i])]
            top = sorted(pending, key=lambda i: (-float(score[i]), i))[: min(verify, len(pending))]
            coef = torch.zeros(len(top), len(edges), dtype=torch.float64)
            coef[torch.arange(len(top)), torch.tensor(top, dtype=torch.long)] = 1.0
            if top:
                values[top] = ablated_metric(model, setup, structure, edges, coef, replacement, rows)
            verified[top] = True
            cost.forward += len(top)
    return EdgeScores(structure, edges, method, source, metric, steps, weights, base_metric, values, verified, cost)


def _reader_gradients(model: Any, setup: _Setup, structure: Structure, rows: int, start: int,
                      interpolate: Optional[tuple[dict[str, Tensor], float]] = None,
                      patterns: bool = False) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Activations and metric gradients at every reader hook (and the patterns and ``resid_pre``s when
    ``patterns``) for walks ``start .. start + rows``; with ``interpolate = (embeddings, t)`` the run's
    embeddings are ``e_r + t (e - e_r)``."""
    base = setup.base
    chunk = base_rows(base, start, rows)
    names = [structure.reader_hook(r) for r in structure.readers()]
    if patterns:
        names += [PATTERN.format(layer=l) for l in range(structure.n_layers)]
        names += [RESID_PRE.format(layer=l) for l in range(structure.n_layers)]
    leaves = _Leaves(names)
    hooks = leaves.hooks()
    if interpolate is not None:
        source, t = interpolate

        def mix(act: Tensor, hook: Any, name: str) -> Tensor:
            r = source[name]
            r = r if r.shape[0] == 1 else r[start : start + act.shape[0]]
            return (r.to(act.dtype) + t * (act - r.to(act.dtype)))

        from functools import partial

        hooks = [(n, partial(mix, name=n)) for n in (EMBED, POS_EMBED)] + hooks
    with torch.enable_grad():
        logits = model.run_with_hooks(base.inputs[start : start + rows], fwd_hooks=hooks)
        total = setup.metric(logits[None], chunk, start)[0].sum()
        wanted = [n for n in leaves.names if n in leaves.leaves]
        grads = torch.autograd.grad(total, [leaves.leaves[n] for n in wanted], allow_unused=True)
    g = {n: (torch.zeros_like(leaves.acts[n]) if x is None else x).to(torch.float64) for n, x in zip(wanted, grads)}
    return leaves.acts, g


def _gradient_scores(model: Any, setup: _Setup, structure: Structure, edges: list[Edge], deltas: dict[Node, Tensor],
                     method: str, steps: int, rows: int, replacement: dict[str, Tensor]) -> tuple[Tensor, int]:
    """Per-walk estimates ``[edge, batch]`` of each edge's ablation effect, and the passes spent."""
    base = setup.base
    B = base.n_walks
    qk_fix = method in ("atp*", "default")
    m = steps if method == "eap-ig" else 1
    embed_source = None
    if method == "eap-ig":
        donor = _Setup(base, setup.donor, setup.bad, [EMBED, POS_EMBED], setup.kind)
        source = "mean" if setup.donor is None else "resample"
        embed_source = source_activations(model, donor, source, rows, base.weights)
    out = torch.zeros(len(edges), B, dtype=torch.float64)
    index = {edge: i for i, edge in enumerate(edges)}
    for start in range(0, B, rows):
        stop = min(B, start + rows)
        grad_sum: dict[str, Tensor] = {}
        acts: dict[str, Tensor] = {}
        for k in range(m):
            interpolate = (embed_source, k / m) if embed_source is not None else None
            acts, g = _reader_gradients(model, setup, structure, rows, start, interpolate, patterns=qk_fix)
            for n, x in g.items():
                grad_sum[n] = x if n not in grad_sum else grad_sum[n] + x
        grads = {n: x / m for n, x in grad_sum.items()}
        for reader in structure.readers():
            hook = structure.reader_hook(reader)
            g = grads[hook]
            if reader.kind in QKV:
                g = g[:, :, reader.head]
            matrix = structure.reader_matrix(reader)
            g_stream = g if matrix is None else g @ matrix.T  # [b, rows, d_model]
            g_stream = _padded(g_stream, structure.n_pos)
            for writer in structure.writers():
                edge = Edge(writer, reader)
                if edge not in index:
                    continue
                d = deltas[writer]
                d = d[start:stop] if d.shape[0] == B else d
                out[index[edge], start:stop] = (d * g_stream).sum((-2, -1))
        if qk_fix:
            _fix_qk_edges(structure, edges, index, deltas, acts, grads, out, start, stop, B)
    return out, m


def _stacked(deltas: dict[Node, Tensor], writers: list[Node], start: int, stop: int, B: int) -> Tensor:
    """The writers' deltas for walks ``start .. stop``, stacked: ``[writer, batch, pos, d_model]``."""
    parts = []
    for w in writers:
        d = deltas[w]
        parts.append(d[start:stop] if d.shape[0] == B else d.expand(stop - start, -1, -1))
    return torch.stack(parts)


def _new_pattern(structure: Structure, q: Tensor, k: Tensor, d: Tensor, layer: int, head: int, kind: str) -> Tensor:
    """Head ``head``'s pattern ``[writer, batch, rows, pos]`` when each writer's delta ``d`` (``[writer, batch,
    pos, d_model]``) is added to its query (``kind`` q) or key (k) input. Computed in ``d``'s dtype (the
    model's: its own softmax is no more precise)."""
    W = structure.weights
    scale = structure.scale[layer]
    qh, kh = q[:, :, head].to(d.dtype) / scale, k[:, :, head].to(d.dtype)  # [b, rows, d], [b, pos, d]
    if kind == "k":
        scores = torch.einsum("bqd,wbkd->wbqk", qh, kh[None] + d @ W["W_K"][layer, head].to(d.dtype))
    else:
        dq = d[:, :, d.shape[2] - q.shape[1]:] @ (W["W_Q"][layer, head].to(d.dtype) / scale)
        scores = torch.einsum("wbqd,bkd->wbqk", qh[None] + dq, kh)
    future = torch.zeros(q.shape[1], k.shape[1], dtype=d.dtype).masked_fill(~causal_mask(q.shape[1], k.shape[1]),
                                                                            float("-inf"))
    return torch.softmax(scores + future, -1)


def _fix_qk_edges(structure: Structure, edges: list[Edge], index: dict[Edge, int], deltas: dict[Node, Tensor],
                  acts: dict[str, Tensor], grads: dict[str, Tensor], out: Tensor, start: int, stop: int,
                  B: int) -> None:
    """AtP*'s query-key fix for every edge into a query or key: the head's new pattern exactly, times
    ``dm/dpattern``, in place of the linear estimate."""
    for layer in range(structure.n_layers):
        if not math.isfinite(structure.scale[layer]):
            continue
        resid = acts[RESID_PRE.format(layer=layer)].to(torch.float64)
        q, k = _qk(structure, acts, resid, layer)
        dtype = acts[PATTERN.format(layer=layer)].dtype
        p = acts[PATTERN.format(layer=layer)]
        g = grads[PATTERN.format(layer=layer)].to(dtype)
        for head in range(structure.n_heads):
            for kind in ("q", "k"):
                reader = Node(kind, layer, head)
                writers = [w for w in structure.writers() if Edge(w, reader) in index]
                size = max(1, ELEMENT_BUDGET // max(1, p[:, head].numel()))
                for first in range(0, len(writers), size):  # (a few writers at a time: [writer, batch, rows, pos])
                    some = writers[first : first + size]
                    d = _stacked(deltas, some, start, stop, B).to(dtype)
                    new_p = _new_pattern(structure, q, k, d, layer, head, kind)
                    change = (g[:, head] * (new_p - p[:, head].to(dtype))).sum((-2, -1))  # [writer, batch]
                    for w, row in zip(some, change):
                        out[index[Edge(w, reader)], start:stop] = row


def _closed_form(model: Any, setup: _Setup, structure: Structure, edges: list[Edge], deltas: dict[Node, Tensor],
                 rows: int) -> tuple[dict[int, Tensor], int]:
    """Exact per-walk metrics of the edges whose effect reaches the loss through nothing but the reader
    itself: edges into the logits (the unembedding is linear), and, in a model without an MLP in its last
    layer, edges into a last-layer head's query, key or value (only that head's own softmax and the
    unembedding lie between its input and the logits). For these, ablating the edge changes the logits by
    a computable amount: ``delta W_U``, or ``(pattern' @ v' - pattern @ v) W_O W_U`` with the head's new
    pattern and values recomputed; the metric is then evaluated on the changed logits. Returns the
    metrics by edge index and how many head recomputations that took."""
    base = setup.base
    B = base.n_walks
    W = structure.weights
    last = structure.n_layers - 1
    K = base.n_states
    index = {edge: i for i, edge in enumerate(edges)}
    readers = [Node("logits", structure.n_layers)]
    if not structure.has_mlp:
        readers += [Node(kind, last, h) for h in range(structure.n_heads) for kind in ("q", "k", "v")]
    groups = [(r, [w for w in structure.writers() if Edge(w, r) in index]) for r in readers]
    groups = [(r, ws) for r, ws in groups if ws]
    out = {index[Edge(w, r)]: torch.zeros(B, dtype=torch.float64) for r, ws in groups for w in ws}
    names = [RESID_PRE.format(layer=last), PATTERN.format(layer=last)]
    widest = max((len(ws) for _, ws in groups), default=1)
    step = max(1, rows // widest)
    for start in range(0, B, step):
        stop = min(B, start + step)
        chunk = base_rows(base, start, step)
        with torch.no_grad():
            logits, cache = model.run_with_cache(base.inputs[start:stop], names_filter=names)
        acts = {n: cache[n] for n in names}
        dtype = logits.dtype  # (the model's precision: its own forward pass is no more exact)
        read = base.read + (structure.n_pos - logits.shape[1])
        resid = acts[RESID_PRE.format(layer=last)].to(torch.float64)
        q, k = _qk(structure, acts, resid, last)
        pattern = acts[PATTERN.format(layer=last)]
        v = (torch.einsum("bpm,hmd->bphd", resid, W["W_V"][last]) + W["b_V"][last]).to(dtype)
        for reader, writers in groups:
            d = _stacked(deltas, writers, start, stop, B).to(dtype)  # [writer, b, pos, d_model]
            if reader.kind == "logits":
                change = d
            else:
                h = reader.head
                if reader.kind == "v":
                    dz = torch.einsum("bqp,wbpd->wbqd", pattern[:, h], d @ W["W_V"][last, h].to(dtype))
                else:
                    new_p = _new_pattern(structure, q, k, d, last, h, reader.kind)
                    dz = torch.einsum("wbqp,bpd->wbqd", new_p - pattern[:, h], v[:, :, h])
                change = dz @ W["W_O"][last, h].to(dtype)
                pad = structure.n_pos - change.shape[2]
                if pad:
                    change = torch.cat([change.new_zeros(*change.shape[:2], pad, change.shape[-1]), change], 2)
            new = logits.expand(len(writers), *logits.shape).clone()
            new[:, :, base.read, :K] += (change[:, :, read] @ W["W_U"].to(dtype))[..., :K]
            values = setup.metric(new, chunk, start)  # [writer, b]
            for w, row in zip(writers, values):
                out[index[Edge(w, reader)]][start:stop] = row
    n_heads = sum(len(ws) for r, ws in groups if r.kind != "logits")
    return out, n_heads


# ------------------------------------------------------------------------------ faithfulness and circuits
@dataclass
class Faithfulness:
    """Faithfulness of the top-``k`` edges of a ranking for each ``k`` in ``sizes``."""

    sizes: list[int]
    values: Float[Tensor, " size"]
    full: float
    empty: float
    metrics: Float[Tensor, " size"]

    def at(self, k: int) -> float:
        require(k in self.sizes, f"the curve was not measured at {k} edges")
        return float(self.values[self.sizes.index(k)])

    def to_dict(self) -> dict[str, Any]:
        return {"sizes": self.sizes, "faithfulness": [float(v) for v in self.values],
                "metric": [float(v) for v in self.metrics], "full_model": self.full, "all_ablated": self.empty}


def curve_sizes(n_edges: int, points: int = CURVE_POINTS, extra: Sequence[int] = ()) -> list[int]:
    """About ``points`` circuit sizes from 0 to ``n_edges`` (every size when there are few), plus ``extra``."""
    if n_edges + 1 <= points:
        sizes = set(range(n_edges + 1))
    else:
        sizes = {int(round(x)) for x in np.linspace(0, n_edges, points)}
    return sorted(sizes | {int(k) for k in extra if 0 <= k <= n_edges})


def faithfulness_curve(model: Any, setup: _Setup, structure: Structure, edges: list[Edge], order: list[int],
                       sizes: list[int], replacement: dict[str, Tensor], weights: Optional[Tensor],
                       rows: int) -> tuple[Faithfulness, int]:
    """Faithfulness of the first ``k`` edges of ``order`` for every ``k`` in ``sizes``: one run each, the full
    model (``k`` = every edge) and the fully ablated one (``k = 0``) among them, measured once whether asked for
    or not. Returns the curve at ``sizes`` and the forward passes spent."""
    E = len(edges)
    measured = sorted(set(sizes) | {0, E})
    coef = torch.ones(len(measured), E, dtype=torch.float64)
    for row, k in enumerate(measured):
        coef[row, torch.tensor(order[:k], dtype=torch.long)] = 0.0
    values = ablated_metric(model, setup, structure, edges, coef, replacement, rows)
    w = point_weights(weights, setup.base.n_walks)
    every = wmean(w, values.T)[0]
    means, full, empty = every[[measured.index(k) for k in sizes]], float(every[-1]), float(every[0])
    gap = full - empty
    faith = (means - empty) / gap if abs(gap) > 1e-12 * max(abs(full), 1.0) else torch.full((len(sizes),), math.nan)
    return Faithfulness(list(sizes), faith, full, empty, means), coef.shape[0]


@dataclass
class CircuitResult:
    """A scored graph, the circuit kept from it, and the faithfulness-against-size curve."""

    scores: EdgeScores
    kept: int
    curve: Faithfulness
    cost: Cost
    roles: Optional[dict[str, str]] = None
    selection: str = ""
    graph: str = "all"

    @property
    def edges(self) -> list[dict[str, Any]]:
        return self.scores.ranked(self.roles)

    @property
    def circuit(self) -> list[dict[str, Any]]:
        return self.edges[: self.kept]

    @property
    def faithfulness(self) -> float:
        """Faithfulness of the kept circuit."""
        return self.curve.at(self.kept)

    def to_json(self) -> dict[str, Any]:
        s = self.scores
        return {
            "method": s.method, "source": s.source, "metric": s.metric, "graph": self.graph,
            "ig_steps": s.steps if s.method == "eap-ig" else None,
            "verified": int(s.verified.sum()), "n_edges": len(s.edges), "selection": self.selection,
            "circuit_size": self.kept, "circuit_faithfulness": self.faithfulness,
            "edges": self.edges, "circuit": self.circuit, "curve": self.curve.to_dict(),
            "cost": self.cost.to_dict(), "roles": self.roles or {},
        }


def circuit(
    model: Any,
    task: Task,
    data: Batch,
    method: str = "default",
    top: Optional[int] = None,
    threshold: Optional[float] = None,
    source: str = "mean",
    metric: str = "loss",
    steps: int = 1,
    verify: int = VERIFY,
    curve_points: int = CURVE_POINTS,
    roles: Optional[dict[str, str]] = None,
    config: ProbeConfig | None = None,
    graph: str = "all",
) -> CircuitResult:
    """Score every edge by ``method``, keep the ``top`` n edges (or those with ``|score| >= threshold``;
    default: the smallest top-k on the curve whose faithfulness reaches 0.9) and measure the
    faithfulness of the top-k edges for about ``curve_points`` sizes k.

    ``roles``: a mapping ``{"L0H0": "previous-token", ...}`` to name heads by (from the per-head role
    probes); ``graph``: ``all`` edges or only those between ``heads``. A pure function of its inputs.
    """
    config = config or ProbeConfig()
    require(top is None or threshold is None, "give a circuit size (top) or a threshold, not both")
    require(threshold is None or (isinstance(threshold, (int, float)) and math.isfinite(threshold) and threshold >= 0),
            f"the threshold must be a finite number >= 0, got {threshold!r}")
    require(isinstance(curve_points, int) and curve_points >= 2, f"curve points must be >= 2, got {curve_points!r}")
    _check_edge_options(method, source, metric, steps, verify)
    start = time.perf_counter()
    with evaluating(model):
        setup = _setup(model, task, data, "z", source, metric, config)
        structure = model_graph(model, setup.base.inputs)
        edges = graph_edges(structure, graph)
        E = len(edges)
        require(top is None or (isinstance(top, int) and not isinstance(top, bool) and 1 <= top <= E),
                f"the circuit size must be between 1 and the {E} edges of the graph, got {top!r}")
        rows = element_rows(model, setup.base.n_pos)
        # (one ablated output per writer, for the scores and the faithfulness curve alike)
        replacement = writer_replacements(model, setup, structure, source, rows, data.weights)
        scores = _edge_scores(model, setup, structure, edges, method, source, metric, steps, verify, data.weights,
                              replacement)
        scores.cost.seconds = time.perf_counter() - start
        order = scores.order()
        extra = [top] if top is not None else []
        if threshold is not None:
            s = scores.scores().abs()
            extra.append(int((s >= threshold).sum()))
        sizes = curve_sizes(E, curve_points, extra)
        curve, passes = faithfulness_curve(model, setup, scores.structure, scores.edges, order, sizes, replacement,
                                           data.weights, rows)
    if top is not None:
        kept, selection = top, f"top {top}"
    elif threshold is not None:
        kept, selection = extra[-1], f"|score| >= {threshold:g}"
    else:
        reach = [k for k, f in zip(curve.sizes, curve.values.tolist()) if f >= 0.9]
        kept = reach[0] if reach else E
        selection = "smallest measured size with faithfulness >= 0.9"
    cost = scores.cost + Cost(forward=passes + 1)  # (+1: the writers' ablated outputs)
    cost.seconds = time.perf_counter() - start
    return CircuitResult(scores, kept, curve, cost, roles, selection, graph)


def path_patching_through_keys(model: Any, task: Task, data: Batch, mode: str = "mean", metric: str = "loss",
                               config: ProbeConfig | None = None) -> "KeyPathResult":
    """The effect of each head through each later head's keys: the metric change (loss increase, nats) when
    the edge ``L{l}H{h} -> L{l'}H{h'}.k`` alone is ablated (``mode``: mean or resample ablation), exactly.

    ``effect[l, h, l', h']`` is NaN where ``l' <= l``. This is the path-patching measure of K-composition:
    in an induction circuit, the previous-token head's output through the induction head's keys.
    """
    config = config or ProbeConfig()
    _require_choice(mode, ("mean", "resample"), "ablation mode")
    with evaluating(model):
        start = time.perf_counter()
        setup = _setup(model, task, data, "z", mode, metric, config)
        structure = model_graph(model, setup.base.inputs)
        rows = element_rows(model, setup.base.n_pos)
        edges = structure.edges()
        replacement = writer_replacements(model, setup, structure, mode, rows, data.weights)
        base = unpatched_metric(model, setup, rows)
        wanted = [i for i, e in enumerate(edges) if e.writer.kind == "head" and e.reader.kind == "k"]
        coef = torch.zeros(len(wanted), len(edges), dtype=torch.float64)
        coef[torch.arange(len(wanted)), torch.tensor(wanted, dtype=torch.long)] = 1.0
        values = ablated_metric(model, setup, structure, edges, coef, replacement, rows)
        L, H = structure.n_layers, structure.n_heads
        full = torch.full((L, H, L, H, setup.base.n_walks), math.nan, dtype=torch.float64)
        for row, i in enumerate(wanted):
            e = edges[i]
            full[e.writer.layer, e.writer.head, e.reader.layer, e.reader.head] = values[row]
        cost = Cost(forward=len(wanted) + 2, seconds=time.perf_counter() - start)
        return KeyPathResult(full, base, data.weights, mode, metric, cost)


@dataclass
class KeyPathResult:
    """Per-walk metric with each head -> later head's key edge ablated, ``[l, h, l', h', batch]``."""

    values: Tensor
    base: Tensor
    weights: Optional[Tensor]
    mode: str
    metric: str
    cost: Cost

    @property
    def effect(self) -> Tensor:
        """``[l, h, l', h']`` mean metric change (NaN where the reader is not later)."""
        w = point_weights(self.weights, self.base.shape[0])
        return wmean(w, (self.values - self.base).movedim(-1, 0))[0]

    def intervals(self, draws: int = 200, seed: int = 0, confidence: float = 0.95) -> tuple[Tensor, Tensor]:
        from probes.stats import bootstrap_interval, bootstrap_weights

        w = bootstrap_weights(self.weights, self.base.shape[0], draws, seed)
        samples = wmean(w, (self.values - self.base).movedim(-1, 0)).flatten(1)
        point = self.effect.flatten()
        lo = torch.full_like(point, math.nan)
        hi = torch.full_like(point, math.nan)
        for i in range(point.numel()):
            if math.isfinite(float(point[i])):
                lo[i], hi[i] = bootstrap_interval(samples[:, i], float(point[i]), confidence)
        return lo.reshape(self.effect.shape), hi.reshape(self.effect.shape)
