"""In-context Markov chains: our training against Edelman et al.'s published code, side by side.

The setting of "The Evolution of Statistical Induction Heads" (Edelman et al. 2024): K = 3 states,
sequences of 64 tokens, each with its own transition matrix (rows Dirichlet(1)), a 2-layer
attention-only transformer with 1 head and width 16, AdamW, 64 fresh sequences per step.

* the peer: their own minGPT-derived training code (relative positions, dropout 0.1, AdamW lr 5e-3,
  betas (0.9, 0.95), weight decay 0.1, a constant learning rate), run by path through its ``run_ref.py``
  (an argument or ``RWINTERP_EDELMAN``, default ``../shared/peers/edelman`` beside the checkout), never
  copied here;
* ours: ``rwinterp.train`` on ``InContextChain`` with the library's deep model (``DeepConfig.standard``,
  float32, learned added positions) and with TransformerLens' own ``TransformerBridge``, AdamW with
  ``--lr`` (default 2e-2) and ``--lr-schedule`` (default cosine: decayed to 0 over the steps).

For each seed, each trains in a fresh process on one thread, one after the other, the same number of
steps. The seconds are the whole training call (model and optimizer built, every step), as the peer
times its ``train``; each side imports its modules before its clock starts, torch's compiler package
included (``torch.optim`` imports it when the first optimiser is built: about 3 s, once per process, in
either side's clock otherwise). Reported per seed and as
means over the seeds: milliseconds per step, each of ours as a fraction of the peer's (goal: at most
1/3), and how far each ends above the in-context bigram (Bayes) loss as a fraction of the
unigram-to-bigram gap, each on its own fixed test sequences (goal: ours no further than the peer).

Run: ``.venv/bin/python benchmarks/bench_icl.py [--steps 2000] [--seeds 0,1,2] [--peer DIR]``; prints
one JSON object (and a line per run on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

K, N, PEER_LR, BATCH = 3, 64, 5e-3, 64
MODULES = {"deep": "rwinterp.model", "bridge": "rwinterp.bridge"}
PRELOADED = "torch._dynamo"  # (what building an optimiser imports; both sides import it before their clock)
ONE_THREAD = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
PEER_LINE = re.compile(r"train [\d.]+s \((?P<ms_per_iter>[\d.]+) ms/iter\) test loss (?P<test_loss>[\d.]+) uniform "
                       r"[\d.]+ unigram (?P<unigram>[\d.]+) bigram (?P<bigram>[\d.]+)")


def ours(kind: str, steps: int, seed: int, lr: float, schedule: str) -> dict:
    """Train one of our models in this process (one thread); its seconds, loss and references."""
    import importlib

    import torch

    torch.set_num_threads(1)
    from rwinterp.config import standard_options
    from rwinterp.icl import InContextChain
    from rwinterp.runs import build_model
    from rwinterp.training import TrainConfig, held_out_data, train

    importlib.import_module(MODULES[kind])  # (before the clock, as the peer imports its model's module)
    importlib.import_module(PRELOADED)

    task = InContextChain(K, N)
    shape = {"n_states": K, "n_ctx": N, "n_layers": 2, "n_heads": 1, "seed": seed}
    model_config = ({**shape, "d_model": 16} if kind == "bridge" else
                    {**shape, **standard_options(16, dtype="float32")})
    config = TrainConfig(optimizer="adamw", lr=lr, lr_schedule=schedule, batch_size=BATCH, loss="xent",
                         next_token=True, steps=steps, eval_every=steps, seed=seed)
    start = time.perf_counter()
    model = build_model(kind, model_config)
    result = train(model, task, config, progress=False)
    seconds = time.perf_counter() - start
    test = held_out_data(task, config)
    refs = task.reference_losses(test.states)
    return {"seconds": seconds, "test_loss": result.history[-1]["test_loss"], "unigram": refs["unigram"],
            "bigram": refs["bigram"], "model": type(model).__name__}


def peer(path: Path, steps: int, seed: int) -> dict:
    """Run the peer's ``run_ref.py`` in its folder on one thread and parse its result line."""
    out = subprocess.run([sys.executable, "-c", f"import {PRELOADED}; import runpy; runpy.run_path('run_ref.py', "
                          "run_name='__main__')", str(K), str(N), str(steps), str(PEER_LR), str(seed)],
                         cwd=path, env=ONE_THREAD, capture_output=True, text=True, check=True).stdout
    match = PEER_LINE.search(out)
    if match is None:
        raise SystemExit(f"bench_icl: no result line in the peer's output: {out[-300:]!r}")
    found = {k: float(v) for k, v in match.groupdict().items()}
    # (its seconds from its milliseconds per iteration: it prints the seconds rounded to whole ones)
    return found | {"seconds": found.pop("ms_per_iter") * steps / 1000, "model": "Edelman et al. minGPT"}


def summarise(result: dict, steps: int) -> dict:
    result["ms_per_step"] = 1000 * result["seconds"] / steps
    result["gap_fraction"] = (result["test_loss"] - result["bigram"]) / (result["unigram"] - result["bigram"])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds (each run by both sides)")
    parser.add_argument("--lr", type=float, default=2e-2, help="our learning rate")
    parser.add_argument("--lr-schedule", default="cosine", choices=("constant", "cosine"), help="our schedule")
    parser.add_argument("--peer", type=Path, default=Path(os.environ.get(
        "RWINTERP_EDELMAN", Path(__file__).resolve().parents[2] / "shared" / "peers" / "edelman")))
    parser.add_argument("--models", default="deep,bridge", help="ours to time (comma-separated: deep, bridge)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a worker: train one of ours, print JSON
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    if args.one:
        print(json.dumps(ours(args.one, args.steps, seeds[0], args.lr, args.lr_schedule)))
        return
    if not (args.peer / "run_ref.py").exists():
        raise SystemExit(f"bench_icl: no run_ref.py in {args.peer} (give --peer DIR or RWINTERP_EDELMAN)")
    kinds = args.models.split(",")
    runs = {side: [] for side in ["peer", *kinds]}
    for seed in seeds:
        mine = summarise(peer(args.peer, args.steps, seed), args.steps)
        runs["peer"].append(mine)
        print(f"seed {seed} peer   {mine['ms_per_step']:.1f} ms/step, gap {mine['gap_fraction']:.3f}", file=sys.stderr)
        for kind in kinds:
            out = subprocess.run([sys.executable, __file__, "--one", kind, "--steps", str(args.steps), "--seeds",
                                  str(seed), "--lr", str(args.lr), "--lr-schedule", args.lr_schedule],
                                 env=ONE_THREAD, capture_output=True, text=True, check=True)
            r = summarise(json.loads(out.stdout.strip().splitlines()[-1]), args.steps)
            r["time_ratio_to_peer"] = r["seconds"] / mine["seconds"]
            runs[kind].append(r)
            print(f"seed {seed} {kind:6s} {r['ms_per_step']:.1f} ms/step ({r['time_ratio_to_peer']:.2f} x the "
                  f"peer's), gap {r['gap_fraction']:.3f}", file=sys.stderr)
    means = {side: {key: statistics.mean(r[key] for r in rs) for key in ("ms_per_step", "gap_fraction")}
             for side, rs in runs.items()}
    for kind in kinds:
        means[kind]["time_ratio_to_peer"] = statistics.mean(r["time_ratio_to_peer"] for r in runs[kind])
    print(json.dumps({"steps": args.steps, "seeds": seeds, "ours": {"lr": args.lr, "lr_schedule": args.lr_schedule},
                      "peer_lr": PEER_LR, "machine": platform.processor() or platform.machine(),
                      "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d"),
                      "load_average_after": round(os.getloadavg()[0], 2), "means": means, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
