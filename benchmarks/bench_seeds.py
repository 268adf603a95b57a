"""Seeds as one batched computation against one seed: the Fig 4 setting.

The Fig 4 setting (K 6, N 97, M 1000, 1000 training and 1000 test walks, 50 steps of gradient descent from
zero initialisation, ``TrainConfig()`` defaults) trained three ways, side by side in one process:

* one seed: ``rwinterp.training.train`` (seed 0);
* ``--seeds`` seeds (default 20) in one batch: ``rwinterp.training.train_seeds``, every seed with its own data
  (zero initialisation is the same for every seed);
* the same seeds one after another with ``train``, for reference (``--no-sequential`` leaves it out).

Each time is a whole call (building the models, drawing the data, training), the median over ``--repeats``
interleaved repeats. The threads are the library's choice (``choose_threads``: one for one seed; for the batch
the cores the load average leaves free) unless ``--threads`` fixes them for both. The goal is a batch of 20
in at most 3 times one seed on 2 cores. The batch's trajectories are checked against the sequential runs
(``max_relative_difference``: of every history number and final weight, relative to the largest).

Run: ``python benchmarks/bench_seeds.py [--seeds 20] [--repeats 3] [--threads N]``; prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch

from fig4 import K, M, N, SETTING, train_paper
from rwinterp.model import DeepConfig
from rwinterp.tasks import CircleWalk
from rwinterp.training import TrainConfig, choose_threads


def timed(threads: int, seeds: list[int] | None) -> tuple[float, list, list]:
    """Seconds, models and histories of one call: one seed (``seeds`` None; seed 0) or a batch of ``seeds``."""
    torch.set_num_threads(threads)
    start = time.perf_counter()
    models, results = train_paper(seeds)
    return time.perf_counter() - start, models, [r.history for r in results]


def sequential(seeds: list[int], threads: int) -> tuple[float, list, list]:
    torch.set_num_threads(threads)
    start = time.perf_counter()
    runs = [train_paper(config=TrainConfig(seed=s)) for s in seeds]
    return time.perf_counter() - start, [m for ms, _ in runs for m in ms], [r.history for _, rs in runs for r in rs]


def largest_difference(models_a: list, histories_a: list, models_b: list, histories_b: list) -> float:
    """The largest difference between two sets of trajectories, relative to the largest magnitude of each
    history number or weight tensor."""
    worst = 0.0
    for ma, ha, mb, hb in zip(models_a, histories_a, models_b, histories_b):
        for ra, rb in zip(ha, hb, strict=True):
            for key, value in rb.items():
                if isinstance(value, float):
                    worst = max(worst, abs(ra[key] - value) / max(abs(value), 1e-300))
        for name, tensor in mb.state_dict().items():
            if tensor.is_floating_point() and tensor.numel():
                scale = max(float(tensor.abs().max()), 1e-300)
                worst = max(worst, float((ma.state_dict()[name] - tensor).abs().max()) / scale)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="threads for every run (default the library's "
                                                                   "choice)")
    parser.add_argument("--no-sequential", action="store_true", help="leave out the sequential reference")
    args = parser.parse_args()
    seeds = list(range(args.seeds))
    options, task, config = DeepConfig.paper(K, N, M), CircleWalk(K, 0.5, N), TrainConfig()
    load_before = os.getloadavg()[0]
    one_threads = args.threads or choose_threads(options, task, config)
    batch_threads = args.threads or choose_threads(options, task, config, copies=len(seeds))
    # Warm up (imports, first-call set-up), then interleave the repeats so that the machine's load hits all alike.
    train_paper(config=TrainConfig(steps=2))
    train_paper([0, 1], TrainConfig(steps=2))
    ones, batches, sequentials = [], [], []
    checked = None
    for repeat in range(args.repeats):
        ones.append(timed(one_threads, None)[0])
        seconds, models, histories = timed(batch_threads, seeds)
        batches.append(seconds)
        if not args.no_sequential and repeat == 0:
            seq_seconds, seq_models, seq_histories = sequential(seeds, one_threads)
            sequentials.append(seq_seconds)
            checked = largest_difference(models, histories, seq_models, seq_histories)
    t_one, t_batch = statistics.median(ones), statistics.median(batches)
    print(json.dumps({
        "benchmark": "bench_seeds",
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip() + f", {os.cpu_count()} CPUs, "
                                                                               f"torch {torch.__version__}",
        "load_average_before": round(load_before, 2),
        "load_average_after": round(os.getloadavg()[0], 2),
        "setting": SETTING,
        "seeds": len(seeds),
        "threads_one_seed": one_threads,
        "threads_batch": batch_threads,
        "one_seed_seconds": [round(t, 3) for t in ones],
        "batch_seconds": [round(t, 3) for t in batches],
        "sequential_seconds": [round(t, 3) for t in sequentials],
        "one_seed_seconds_median": round(t_one, 3),
        "batch_seconds_median": round(t_batch, 3),
        "batch_over_one_seed": round(t_batch / t_one, 2),
        "sequential_over_one_seed": round(sequentials[0] / t_one, 2) if sequentials else None,
        "goal_batch_over_one_seed": 3.0,
        "max_relative_difference_batch_vs_sequential": checked,
    }, indent=1))


if __name__ == "__main__":
    main()
