"""Speed of the full scorecard on the paper's model.

Setting: the Fig 4 model (K 6, N 97, M 1000, zero init, lr 1, 50 steps of gradient descent) probed
on its 1000 test walks with the default ``ProbeConfig``: every position patched at the embeddings
and the value vectors, every head's z and pattern, necessity and sufficiency, attention with
gradient x input on 100 walks, V against Pi, 200 bootstrap resamples. Goal: under 10 seconds.

The machine is shared, so seconds alone say little. Two references are timed in the same process,
interleaved with the scorecard:

* ``reference_matmul``: 20 float64 512 x 512 matrix products (a fixed amount of arithmetic);
* ``reference_numpy_sweep``: the embeddings sweep alone written out in numpy for this model (for
  every position j, the model's scores on the corrupted walks with token j taken from the clean
  walks): the least work any implementation of that one sweep must do.

Reported: median seconds of each (``--repeats`` runs), the scorecard's ratio to each reference,
the seconds of each probe, and the load average. Run:
``.venv/bin/python benchmarks/bench_probes.py [--repeats 3]``; prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np
import torch


def reference_matmul() -> float:
    a = torch.randn(512, 512, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    for _ in range(20):
        a @ a
    return time.perf_counter() - start


def reference_numpy_sweep(model, clean, corrupted) -> float:
    """Embeddings sweep of the paper's model in numpy: scores with one clean token swapped in."""
    K = model.cfg.n_states
    key_tok = np.append((model.W_E[:K] @ model.u).detach().numpy(), 0.0)  # query token: x = 0
    key_pos = (model.W_pos @ model.u).detach().numpy()
    V = model.V.detach().numpy()
    base, donor = corrupted.tokens.numpy(), clean.tokens.numpy()
    eye = np.eye(K + 1)[:, :K]
    start = time.perf_counter()
    for j in range(base.shape[1]):
        tok = base.copy()
        tok[:, j] = donor[:, j]
        s = key_tok[tok] + key_pos[None, :]
        s -= s.max(1, keepdims=True)
        a = np.exp(s)
        a /= a.sum(1, keepdims=True)
        f = np.einsum("bn,bnk->bk", a, eye[tok]) @ V.T
        assert f.shape == (base.shape[0], K)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from probes.attention import attention_probe
    from probes.config import ProbeConfig
    from probes.patching import corrupted_walks, patching_probe
    from probes.scoring import scorecard
    from probes.transition import transition_probe
    from rwinterp.model import DeepConfig, DeepTransformer
    from rwinterp.tasks import CircleWalk
    from rwinterp.training import TrainConfig, make_data, train

    task = CircleWalk(6, 0.5, 97)
    model = DeepTransformer(DeepConfig.paper(6, 97, 1000))
    train(model, task, TrainConfig(), progress=False)
    test = make_data(task, TrainConfig())[1]
    config = ProbeConfig(progress=False)
    corrupted = corrupted_walks(task, len(test), config.seed)
    scorecard(model, task, test[:50], config)  # warm up

    times: dict[str, list[float]] = {k: [] for k in ("scorecard", "reference_matmul", "reference_numpy_sweep",
                                                     "attention", "patching", "transition")}
    loads = []
    for _ in range(args.repeats):
        loads.append(os.getloadavg()[0])
        times["reference_matmul"].append(reference_matmul())
        times["reference_numpy_sweep"].append(reference_numpy_sweep(model, test, corrupted))
        start = time.perf_counter()
        card = scorecard(model, task, test, config)
        times["scorecard"].append(time.perf_counter() - start)
        for name, probe in (("attention", attention_probe), ("patching", patching_probe),
                            ("transition", transition_probe)):
            start = time.perf_counter()
            probe(model, task, test, config)
            times[name].append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    s = card.flat()
    print(json.dumps({
        "setting": "Fig 4 model (K 6, N 97, M 1000), 1000 test walks, default ProbeConfig",
        "median_seconds": med,
        "all_seconds": times,
        "goal_seconds": 10.0,
        "scorecard_over_matmul_reference": med["scorecard"] / med["reference_matmul"],
        "scorecard_over_numpy_sweep_reference": med["scorecard"] / med["reference_numpy_sweep"],
        "load_average_1min": loads,
        "threads": args.threads,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "check": {k: s[k] for k in ("parent_attention", "patching.parent_effect", "patching.localization",
                                    "transition.distance")},
    }, indent=1))


if __name__ == "__main__":
    main()
