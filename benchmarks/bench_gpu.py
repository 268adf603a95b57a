"""Training on a GPU: the theory regime, and many seeds of the Fig 4 setting as one batch.

1. The theory regime (K 6, N 1000, M 32000, 1000 training and 1000 test walks, 50 steps of gradient descent
   from zero initialisation): seconds of ``rwinterp.training.train`` and the device's peak memory.
2. The Fig 4 setting (K 6, N 97, M 1000, 1000/1000 walks, 50 steps, zero init, ``TrainConfig()``): one seed,
   and ``--seeds`` seeds (default 100) in one batch (``rwinterp.training.train_seeds``), each with its own
   data; the batch's first seed is checked against the one seed trained alone on the same device.
3. For reference, one seed of the Fig 4 setting on the CPU (one thread).

Both float64 (the library's default) and float32 (``--dtype``) are timed on the device. Times are whole calls
(building the models, drawing the data on the CPU and moving it, training), after a warm-up; the training loop
reads every step's loss, so each call ends with the device's work done.

Run on a GPU machine as is: ``python benchmarks/bench_gpu.py``. Without a GPU, ``--device cpu --reduced``
runs the same code at reduced sizes (theory regime N 100, M 3200, 200 walks; 10 seeds; 5 steps) to check it.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from fig4 import train_paper
from rwinterp.errors import RwinterpError
from rwinterp.model import DeepConfig
from rwinterp.tasks import CircleWalk
from rwinterp.training import TrainConfig, check_memory, resolve_device


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory(device: torch.device) -> float | None:
    return round(torch.cuda.max_memory_allocated(device) / 2**20, 1) if device.type == "cuda" else None


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def timed(K: int, N: int, M: int, config: TrainConfig, device: torch.device, dtype: str, seeds: int = 0) -> dict:
    """One seed (``seeds`` 0), or a batch of that many seeds, built and trained on ``device``."""
    check_memory(DeepConfig.paper(K, N, M, dtype=dtype), CircleWalk(K, 0.5, N), config, device, copies=max(seeds, 1))
    reset_peak(device)
    synchronize(device)
    start = time.perf_counter()
    models, results = train_paper(list(range(seeds)) if seeds else None, config, K, N, M, device, dtype)
    synchronize(device)
    accuracies = [r.final["test_accuracy"] for r in results]
    return {"seconds": round(time.perf_counter() - start, 3), "train_seconds": round(results[0].train_seconds, 3),
            "seeds": len(models), "mean_test_accuracy": round(sum(accuracies) / len(accuracies), 4),
            "peak_memory_mib": peak_memory(device), "model": models[0], "history": results[0].history}


def relative_difference(a: dict, b: dict) -> float:
    """The largest difference between two runs' losses and final weights, relative to the largest of each."""
    worst = max(abs(x["loss"] - y["loss"]) / max(abs(y["loss"]), 1e-300) for x, y in zip(a["history"], b["history"]))
    for name, tensor in b["model"].state_dict().items():
        if tensor.is_floating_point() and tensor.numel():
            other = a["model"].state_dict()[name]
            worst = max(worst, float((other - tensor).abs().max()) / max(float(tensor.abs().max()), 1e-300))
    return worst


def public(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in ("model", "history")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cpu or auto")
    parser.add_argument("--seeds", type=int, default=None, help="seeds in the batch (default 100; reduced 10)")
    parser.add_argument("--dtype", choices=("float64", "float32", "both"), default="both")
    parser.add_argument("--reduced", action="store_true", help="small sizes, to check the script on a CPU")
    args = parser.parse_args()
    try:
        device = resolve_device(args.device)
    except RwinterpError as exc:
        raise SystemExit(f"bench_gpu: {exc}") from None
    torch.set_num_threads(1)
    seeds = args.seeds or (10 if args.reduced else 100)
    steps = 5 if args.reduced else 50
    theory = dict(K=6, N=100, M=3200) if args.reduced else dict(K=6, N=1000, M=32000)
    theory_config = TrainConfig(steps=steps, n_train=200 if args.reduced else 1000,
                                n_test=200 if args.reduced else 1000)
    fig4, fig4_config = dict(K=6, N=97, M=1000), TrainConfig(steps=steps)
    dtypes = ("float64", "float32") if args.dtype == "both" else (args.dtype,)
    out: dict = {
        "benchmark": "bench_gpu", "date": time.strftime("%Y-%m-%d %H:%M"),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({platform.machine()})",
        "torch": torch.__version__, "cuda": torch.version.cuda, "reduced": args.reduced,
        "theory_regime": f"K {theory['K']}, N {theory['N']}, M {theory['M']}, {theory_config.n_train}/"
                         f"{theory_config.n_test} walks, {steps} steps, zero init",
        "fig4": f"K 6, N 97, M 1000, 1000/1000 walks, {steps} steps, zero init; a batch of {seeds} seeds",
    }
    timed(**fig4, config=TrainConfig(steps=2), device=device, dtype="float64")  # warm up
    timed(**fig4, config=TrainConfig(steps=2), device=device, dtype="float64", seeds=2)
    for dtype in dtypes:
        part: dict = {"theory_regime": public(timed(**theory, config=theory_config, device=device, dtype=dtype))}
        alone = timed(**fig4, config=fig4_config, device=device, dtype=dtype)
        many = timed(**fig4, config=fig4_config, device=device, dtype=dtype, seeds=seeds)
        part["fig4_one_seed"] = public(alone)
        part["fig4_batch"] = public(many)
        part["fig4_batch_over_one_seed"] = round(many["seconds"] / alone["seconds"], 2)
        part["fig4_batch_seconds_per_seed"] = round(many["seconds"] / seeds, 4)
        part["fig4_batch_seed0_vs_alone_max_relative_difference"] = relative_difference(many, alone)
        out[dtype] = part
    cpu = timed(**fig4, config=fig4_config, device=torch.device("cpu"), dtype="float64")
    out["fig4_one_seed_cpu_float64_one_thread"] = public(cpu)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
