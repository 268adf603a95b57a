"""How far the fast attribution methods agree with exact patching, what they cost, and how fast they are.

Models (trained here, cached under ``--cache``; see ``benchmarks/attribution_models.py``):

* the paper's model (K 6, N 97, M 1000, the Fig 4 training), seeds 0-2: its cells are the positions of the
  embeddings (``resid_pre`` of layer 0), clean walks patched into independent corrupted ones, metric the
  logit difference (the patching probe's setting). It has no residual stream, so it has no edge graph:
  EAP-IG runs at the node level (integrated gradients over the embeddings), EAP and the circuit do not apply.
* the in-context Markov-chain model (a TransformerBridge, 2 layers x 4 heads, d_model 32, d_head 8,
  attention only, no normalisation; K 3, N 64; AdamW lr 5e-3, 64 fresh walks a step, 2000 steps), seeds
  0-2: cells are every head x position (``hook_z``), and the 81 edges of its graph; mean ablation, metric
  the mean next-state cross-entropy (nats).
* for speed, a 4-layer, 8-head bridge (d_model 64) trained the same way (seed 0).

For each method against exact patching: Spearman correlation over the cells, top-5 and top-10 overlap by
magnitude, faithfulness of the method's top quarter of the cells (the metric with every other cell or edge
ablated, as a fraction from all ablated = 0 to none = 1), and the cost in passes and seconds. The default
circuit method is checked against its goals (top edge, top three among the exact top five,
faithfulness curve within 0.1 of the exact ranking's) on the whole graph and on the edges between heads.

Run: ``.venv/bin/python benchmarks/bench_attribution.py [--seeds 0 1 2] [--walks 128] [--json results.json]``;
prints the tables (markdown) and, with ``--json``, writes every number. ``--quick`` runs one seed of each
model on fewer walks and skips the 4-layer speed run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from attribution_models import icl_task, train_icl, train_paper  # noqa: E402

from probes.attribution import agreement, direct_logit_attribution  # noqa: E402
from probes.circuits import circuit, edge_attribution, faithfulness_curve, writer_replacements  # noqa: E402
from probes.config import ProbeConfig  # noqa: E402
from probes.patching import _setup, cell_faithfulness, element_rows, sweep  # noqa: E402

CONFIG = ProbeConfig(progress=False, bootstrap=0)
NODE_METHODS = [("AtP", "atp", 1), ("AtP*", "atp*", 1), ("IG m=1", "ig", 1), ("IG m=4", "ig", 4), ("IG m=16", "ig", 16)]
EDGE_METHODS = [("EAP", "eap", 1), ("AtP*", "atp*", 1), ("EAP-IG m=1", "eap-ig", 1), ("EAP-IG m=4", "eap-ig", 4),
                ("EAP-IG m=16", "eap-ig", 16), ("default", "default", 1)]


def ordering(values: torch.Tensor) -> list[int]:
    return sorted(range(values.numel()), key=lambda i: (-abs(float(values[i])), i))


def row(name: str, result: Any, exact: Any, faith: float, exact_faith: float) -> dict[str, Any]:
    a = agreement(result, exact, (name, "exact"), k=(1, 3, 5, 10))
    cost = result.cost
    return {"method": name, "spearman": a.spearman, "pearson": a.pearson, "top1": a.top_k[1], "top5": a.top_k[5],
            "top10": a.top_k[10], "faithfulness_quarter": faith, "exact_faithfulness_quarter": exact_faith,
            "forward": cost.forward, "backward": cost.backward, "passes": cost.passes, "seconds": cost.seconds}


def node_table(model: Any, task: Any, data: Any, family: str, granularity: str, source: str, metric: str,
               methods: list) -> tuple[list[dict], Any, dict]:
    exact = sweep(model, task, data, family, granularity, source, metric, "exact", CONFIG)
    n = exact.effects().numel()
    quarter = max(1, n // 4)
    exact_faith = float(cell_faithfulness(model, task, data, exact, ordering(exact.effects().flatten()), [quarter],
                                          CONFIG)[0])
    rows = [{"method": "exact", "spearman": 1.0, "pearson": 1.0, "top1": 1.0, "top5": 1.0, "top10": 1.0,
             "faithfulness_quarter": exact_faith, "exact_faithfulness_quarter": exact_faith,
             "forward": exact.cost.forward, "backward": 0, "passes": exact.cost.passes, "seconds": exact.cost.seconds}]
    results = {}
    for name, method, steps in methods:
        result = sweep(model, task, data, family, granularity, source, metric, method, CONFIG, steps=steps)
        faith = float(cell_faithfulness(model, task, data, result, ordering(result.effects().flatten()), [quarter],
                                        CONFIG)[0])
        rows.append(row(name, result, exact, faith, exact_faith))
        results[name] = result
    return rows, exact, results


def edge_table(model: Any, task: Any, data: Any, graph: str = "all") -> tuple[list[dict], dict]:
    exact = edge_attribution(model, task, data, "exact", "mean", config=CONFIG, graph=graph)
    E = len(exact.edges)
    setup = _setup(model, task, data, "z", "mean", "loss", CONFIG)
    rows_ = element_rows(model, setup.base.n_pos)
    replacement = writer_replacements(model, setup, exact.structure, "mean", rows_, data.weights)

    def curve(scores: Any, sizes: list[int]) -> Any:
        return faithfulness_curve(model, setup, exact.structure, exact.edges, scores.order(), sizes, replacement,
                                  data.weights, rows_)[0]

    quarter = max(1, E // 4)
    all_sizes = list(range(E + 1))
    exact_curve = curve(exact, all_sizes)
    exact_faith = exact_curve.at(quarter)
    rows = [{"method": "exact", "spearman": 1.0, "pearson": 1.0, "top1": 1.0, "top5": 1.0, "top10": 1.0,
             "faithfulness_quarter": exact_faith, "exact_faithfulness_quarter": exact_faith,
             "forward": exact.cost.forward, "backward": 0, "passes": exact.cost.passes, "seconds": exact.cost.seconds}]
    extra: dict[str, Any] = {"edges": E, "exact_top5": [e["source"] + "->" + e["target"] for e in exact.ranked()[:5]],
                             "exact_top_scores": [e["score"] for e in exact.ranked()[:5]]}
    for name, method, steps in EDGE_METHODS:
        result = edge_attribution(model, task, data, method, "mean", steps=steps, config=CONFIG, graph=graph)
        if method == "default":
            c = curve(result, all_sizes)
            gap = float((c.values - exact_curve.values).abs().max())
            top = [e["source"] + "->" + e["target"] for e in result.ranked()[:3]]
            extra["default"] = {
                "top3": top, "top_edge_is_exact_top": top[0] == extra["exact_top5"][0],
                "top3_within_exact_top5": all(t in extra["exact_top5"] for t in top),
                "curve_max_gap": gap, "verified": int(result.verified.sum()),
                "curve_sizes": c.sizes, "curve": [float(v) for v in c.values],
                "exact_curve": [float(v) for v in exact_curve.values]}
            faith = c.at(quarter)
        else:
            faith = curve(result, [quarter]).at(quarter)
        rows.append(row(name, result, exact, faith, exact_faith))
    return rows, extra


def head_roles(model: Any, data: Any) -> dict[str, str]:
    """Previous-token and induction heads by their attention (a stand-in for the per-head role probes)."""
    s = data.states
    n = s.shape[1]
    with torch.no_grad():
        _, cache = model.run_with_cache(s)
    match = torch.zeros(s.shape[0], n, n, dtype=torch.bool)
    match[:, :, 1:] = s[:, None, :-1] == s[:, :, None]
    match &= torch.ones(n, n, dtype=torch.bool).tril()
    roles = {}
    for layer in range(model.cfg.n_layers):
        p = cache[f"blocks.{layer}.attn.hook_pattern"]
        prev = p.diagonal(offset=-1, dim1=-2, dim2=-1).mean((0, 2))
        chance = (match.sum(-1).float() / torch.arange(1, n + 1)).mean()
        induction = (p * match[:, None]).sum(-1)[:, :, n // 4:].mean((0, 2))
        for h in range(model.cfg.n_heads):
            if prev[h] > 0.5:
                roles[f"L{layer}H{h}"] = f"previous-token {float(prev[h]):.2f}"
            elif layer > 0 and induction[h] > max(0.6, 1.5 * float(chance)):
                roles[f"L{layer}H{h}"] = f"induction {float(induction[h]):.2f}"
    return roles


def icl_reference_losses(data: Any) -> dict[str, float]:
    s = data.states
    B, n = s.shape
    K = int(s.max()) + 1
    counts, unigram = torch.ones(B, K, K), torch.ones(B, K)
    big, uni = [], []
    idx = torch.arange(B)
    for t in range(n - 1):
        if t > 0:
            counts[idx, s[:, t - 1], s[:, t]] += 1
        unigram[idx, s[:, t]] += 1
        row_ = counts[idx, s[:, t]]
        big.append(-(row_ / row_.sum(-1, keepdim=True)).gather(-1, s[:, t + 1, None]).log())
        uni.append(-(unigram / unigram.sum(-1, keepdim=True)).gather(-1, s[:, t + 1, None]).log())
    return {"uniform": math.log(K), "unigram": float(torch.cat(uni, 1).mean()), "bigram": float(torch.cat(big, 1).mean())}


def markdown(title: str, rows: list[dict]) -> str:
    out = [f"**{title}**", "", "| method | Spearman | top-5 | top-10 | faithfulness at 1/4 (exact's) | passes | seconds |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['method']} | {r['spearman']:.3f} | {r['top5']:.2f} | {r['top10']:.2f} | "
                   f"{r['faithfulness_quarter']:.3f} ({r['exact_faithfulness_quarter']:.3f}) | {r['passes']} | "
                   f"{r['seconds']:.2f} |")
    return "\n".join(out)


def summary(report: dict[str, Any]) -> str:
    """The agreement tables over seeds (mean, and the range over seeds) from a ``--json`` report."""
    def cell(values: list[float], digits: int = 2) -> str:
        if not values:
            return "n/a"
        mean = sum(values) / len(values)
        if len(values) == 1:
            return f"{mean:.{digits}f}"
        return f"{mean:.{digits}f} ({min(values):.{digits}f} to {max(values):.{digits}f})"

    out = []
    tables = [("paper", "nodes", "paper model: embeddings x position (97 cells), clean into corrupted, logit difference")]
    tables += [("icl", "nodes", "in-context model: head x position (512 cells), mean ablation, loss"),
               ("icl", "edges", "in-context model: all 81 edges, mean ablation, loss"),
               ("icl", "heads_graph", "in-context model: the 48 edges between heads, mean ablation, loss")]
    for model, key, title in tables:
        seeds = report.get(model, {})
        if not seeds:
            continue
        methods = [r["method"] for r in next(iter(seeds.values()))[key]]
        out += [f"**{title}; seeds {', '.join(str(x) for x in seeds)}: mean (range)**", "",
                "| method | Spearman | top-5 overlap | top-10 overlap | faithfulness at 1/4 | passes | seconds |",
                "|---|---|---|---|---|---|---|"]
        for m in methods:
            rows = [next(r for r in v[key] if r["method"] == m) for v in seeds.values()]
            out.append(f"| {m} | {cell([r['spearman'] for r in rows])} | {cell([r['top5'] for r in rows])} | "
                       f"{cell([r['top10'] for r in rows])} | {cell([r['faithfulness_quarter'] for r in rows])} | "
                       f"{rows[0]['passes']} | {cell([r['seconds'] for r in rows], 1)} |")
        out.append("")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--walks", type=int, default=128, help="walks each method is measured on (default 128)")
    parser.add_argument("--big-walks", type=int, default=48, help="walks of the 4-layer speed run (default 48)")
    parser.add_argument("--cache", default=os.environ.get("RWINTERP_BENCH_CACHE", "/tmp/rwinterp-bench-models"))
    parser.add_argument("--json", default=None, help="write every number here")
    parser.add_argument("--quick", action="store_true", help="one seed, 48 walks, no 4-layer speed run")
    parser.add_argument("--skip", nargs="*", default=[], choices=["paper", "icl", "big"])
    parser.add_argument("--summarize", nargs="+", default=None, metavar="JSON",
                        help="print the tables over seeds from earlier --json reports (merged), and stop")
    args = parser.parse_args()
    if args.summarize:
        merged: dict[str, Any] = {}
        for path in args.summarize:
            for key, value in json.loads(Path(path).read_text()).items():
                if isinstance(value, dict) and value:
                    merged.setdefault(key, {}).update(value)
        print(summary(merged))
        return
    torch.set_num_threads(1)
    cache = Path(args.cache)
    seeds = args.seeds[:1] if args.quick else args.seeds
    walks = 48 if args.quick else args.walks
    report: dict[str, Any] = {"load_average": os.getloadavg(), "walks": walks, "paper": {}, "icl": {}}
    for seed in seeds if "paper" not in args.skip else []:
        model, task, data = train_paper(seed, cache)
        data = data[:walks]
        rows, exact, results = node_table(model, task, data, "resid_pre", "position", "clean", "logit_diff", NODE_METHODS)
        parent = task.parent_positions()[0]
        share = {name: float(r.effects()[0, parent].abs() / r.effects()[0].abs().sum()) for name, r in
                 [("exact", exact)] + list(results.items())}
        dla = direct_logit_attribution(model, task, data, "logprob", CONFIG)
        from probes.attention import attention_probe

        value_share = attention_probe(model, task, data, ProbeConfig(progress=False, bootstrap=0, gradient_walks=0)).scores()[
            "value_weighted_parent_share"]
        report["paper"][seed] = {"nodes": rows, "parent_share": share, "dla_parent_share": dla.parent_share(),
                                 "value_weighted_parent_share": value_share}
        print(markdown(f"paper model, seed {seed}: the {exact.effects().numel()} positions of the embeddings", rows))
        print(f"parent share of |effect|: {json.dumps({k: round(v, 4) for k, v in share.items()})}; "
              f"DLA parent share {dla.parent_share():.4f}, attention x value share {value_share:.4f}\n", flush=True)
    for seed in seeds if "icl" not in args.skip else []:
        model, info = train_icl(seed, cache=cache)
        task = icl_task()
        data = task.sample(walks, 1000 + seed)
        with torch.no_grad():
            logits = model(data.states)
        loss = float(torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, task.n_states),
                                                       data.states[:, 1:].reshape(-1)))
        roles = head_roles(model, data)
        nodes, exact_nodes, node_results = node_table(model, task, data, "z", "head_position", "mean", "loss",
                                                      NODE_METHODS)
        edges, edge_extra = edge_table(model, task, data, "all")
        heads, head_extra = edge_table(model, task, data, "heads")
        atp = node_results["AtP"]
        speed = exact_nodes.cost.seconds / atp.cost.seconds
        previous = [name for name, role in roles.items() if role.startswith("previous-token")]
        sums = {}
        for name in previous:  # the head's single-position effects summed, as a sum over positions
            layer, head = (int(x) for x in name[1:].split("H"))
            sums[name] = {method: float(r.effects()[layer, head].sum()) for method, r in
                          [("exact", exact_nodes)] + list(node_results.items())}
        report["icl"][seed] = {"train": info, "test_loss": loss, "reference_losses": icl_reference_losses(data),
                               "roles": roles, "nodes": nodes, "edges": edges, "edges_extra": edge_extra,
                               "heads_graph": heads, "heads_extra": head_extra,
                               "atp_speedup_head_position": speed, "previous_token_head_sums": sums}
        print(f"ICL model seed {seed}: test loss {loss:.4f}, references "
              f"{json.dumps({k: round(v, 4) for k, v in icl_reference_losses(data).items()})}, roles {roles}")
        print(markdown(f"ICL seed {seed}: {exact_nodes.effects().numel()} head x position cells (mean ablation, loss)",
                       nodes))
        print(f"AtP over every head x position cell: {speed:.1f}x faster than exact patching of the same cells "
              f"({atp.cost.seconds:.2f} s against {exact_nodes.cost.seconds:.2f} s)")
        print(f"previous-token head, single-position effects summed (nats): "
              f"{json.dumps({h: {k: round(v, 4) for k, v in d.items()} for h, d in sums.items()})}\n")
        print(markdown(f"ICL seed {seed}: the {edge_extra['edges']} edges", edges))
        print(f"exact top 5: {edge_extra['exact_top5']}\ndefault: {json.dumps({k: v for k, v in edge_extra['default'].items() if 'curve' not in k or k == 'curve_max_gap'})}\n")
        print(markdown(f"ICL seed {seed}: the {head_extra['edges']} edges between heads", heads))
        print(f"exact top 5: {head_extra['exact_top5']}\ndefault: {json.dumps({k: v for k, v in head_extra['default'].items() if 'curve' not in k or k == 'curve_max_gap'})}\n",
              flush=True)
    if not args.quick and "big" not in args.skip:
        model, info = train_icl(0, layers=4, heads=8, d_model=64, cache=cache)
        task = icl_task()
        data = task.sample(args.big_walks, 2000)
        # Timed side by side in one process, the circuit before and after the exact sweep (the load of a
        # shared machine drifts): the ratio is the sweep's seconds over the circuit's mean.
        circuit_seconds = []
        for when in ("before", "after"):
            start = time.perf_counter()
            fast = circuit(model, task, data, config=CONFIG)
            circuit_seconds.append(time.perf_counter() - start)
            if when == "before":
                start = time.perf_counter()
                exact = edge_attribution(model, task, data, "exact", "mean", config=CONFIG)
                exact_seconds = time.perf_counter() - start
        fast_seconds = sum(circuit_seconds) / len(circuit_seconds)
        top = [e["source"] + "->" + e["target"] for e in fast.edges[:10]]
        exact_top = [e["source"] + "->" + e["target"] for e in exact.ranked()[:10]]
        verified_top = all(e["verified"] for e in fast.edges[:10])
        report["big"] = {"train": info, "edges": len(exact.edges), "circuit_seconds": fast_seconds,
                         "circuit_seconds_before_and_after": circuit_seconds,
                         "exact_sweep_seconds": exact_seconds, "speedup": exact_seconds / fast_seconds,
                         "circuit_passes": fast.cost.passes, "exact_passes": exact.cost.passes,
                         "top10_verified": verified_top, "top10_overlap_with_exact": len(set(top) & set(exact_top)) / 10,
                         "verified_edges": int(fast.scores.verified.sum()), "top10": top, "exact_top10": exact_top}
        print(f"4-layer 8-head model ({len(exact.edges)} edges, {args.big_walks} walks): rwinterp circuit "
              f"{fast_seconds:.1f} s (mean of {circuit_seconds[0]:.1f} s before and {circuit_seconds[1]:.1f} s after the "
              f"sweep; {fast.cost.passes} passes), exact sweep {exact_seconds:.1f} s "
              f"({exact.cost.passes} passes): {exact_seconds / fast_seconds:.1f}x; top 10 verified {verified_top}, "
              f"overlap with the exact top 10 {report['big']['top10_overlap_with_exact']:.1f}")
    report["load_average_end"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=float))


if __name__ == "__main__":
    main()
