"""Training beside a busy process: the Fig 4 training on a machine whose other core is taken.

The Fig 4 setting (K 6, N 97, M 1000, 1000/1000 walks, 50 steps, zero init, ``TrainConfig()``) is trained
``--repeats`` times with no process of ours beside it ("quiet"), then with one busy process beside it
(``python -c "while True: pass"``), first with the library's choice of threads
(``rwinterp.training.choose_threads``: one, for a model this small; made again beside the busy process) and
then with ``--threads`` threads (default 2, torch's default on 2 cores) for comparison. The goal: the
library's choice beside a busy process within 1.2 times its quiet time. ``--batch S`` times ``train_seeds`` of
S seeds the same way.

The machine may be shared with other work: the load average before and after is printed, and "quiet" means
only that this benchmark starts no other process. On a machine already loaded, the busy process takes a share
of the cores that no choice of threads gives back; the CPU seconds tell that apart from threads spinning.

Run: ``python benchmarks/bench_threads.py [--repeats 5] [--threads 2] [--batch 0]``; prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

import torch

from fig4 import K, M, N, SETTING, train_paper
from rwinterp.model import DeepConfig
from rwinterp.tasks import CircleWalk
from rwinterp.training import TrainConfig, choose_threads


def timed_call(seeds: int) -> tuple[float, float]:
    """Wall-clock and CPU seconds (of every thread of this process) of one training call (``seeds`` > 0: a
    batch of that many seeds)."""
    start, cpu = time.perf_counter(), time.process_time()
    train_paper(list(range(seeds)) if seeds else None)
    return time.perf_counter() - start, time.process_time() - cpu


def timed(threads: int, repeats: int, seeds: int = 0) -> list[tuple[float, float]]:
    torch.set_num_threads(threads)
    return [timed_call(seeds) for _ in range(repeats)]


def measure(threads: int | Callable[[], int], repeats: int, seeds: int = 0) -> dict:
    """The wall-clock seconds quiet and beside a busy process, and the CPU seconds: a thread that waits for a
    thread put off its core spins, so CPU time grows with the wall time; one that computes alone does not.
    ``threads``: a count, or the library's choice (made again beside the busy process, as a new command would)."""
    choose = threads if callable(threads) else (lambda: threads)
    quiet_threads = choose()
    quiet = timed(quiet_threads, repeats, seeds)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # (let it take its core)
        busy_threads = choose()
        loaded = timed(busy_threads, repeats, seeds)
    finally:
        busy.kill()
        busy.wait()
    wall_quiet, wall_busy = statistics.median(t for t, _ in quiet), statistics.median(t for t, _ in loaded)
    return {"threads": quiet_threads, "threads_busy": busy_threads, "quiet_seconds": [round(t, 3) for t, _ in quiet],
            "busy_seconds": [round(t, 3) for t, _ in loaded],
            "quiet_median": round(wall_quiet, 3), "busy_median": round(wall_busy, 3),
            "busy_over_quiet": round(wall_busy / wall_quiet, 2),
            "cpu_seconds_quiet_median": round(statistics.median(c for _, c in quiet), 3),
            "cpu_seconds_busy_median": round(statistics.median(c for _, c in loaded), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="the thread count to compare with (default 2)")
    parser.add_argument("--batch", type=int, default=0, help="also time train_seeds of this many seeds")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]

    def chosen(copies: int = 1) -> int:
        return choose_threads(DeepConfig.paper(K, N, M), CircleWalk(K, 0.5, N), TrainConfig(), copies=copies)

    timed_call(0)  # warm up
    out = {"benchmark": "bench_threads", "date": time.strftime("%Y-%m-%d %H:%M"),
           "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
           "torch": torch.__version__, "load_average_before": round(load_before, 2),
           "setting": SETTING,
           "library_choice": measure(chosen, args.repeats)}
    if args.threads != out["library_choice"]["threads"]:
        out["fixed_threads"] = measure(args.threads, args.repeats)
    if args.batch:
        out["batch_library_choice"] = {"seeds": args.batch, **measure(lambda: chosen(args.batch),
                                                                       max(1, args.repeats // 2), args.batch)}
    out["goal_busy_over_quiet"] = 1.2
    out["load_average_after"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
