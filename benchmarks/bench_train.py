"""Training speed and memory of the paper's model.

1. Fig 4 setting (K 6, N 97, M 1000, 1000/1000 walks, 50 steps, zero init, lr 1, eps 0.1): seconds
   in ``rwinterp.training.train`` against a minimal hand-written numpy implementation of the same
   full-batch gradient descent that records the same per-step numbers (loss, train and test
   accuracy, parent attention), in the same process. Reports the ratio (goal: <= 1.5).
2. The theory regime (N 1000, M 32000, 1000 walks, 50 steps): training-loop seconds and the peak
   resident memory of a fresh process (goal: under a minute and under 2 GB).
3. The paper's configuration storing its whole W (``rank_one_query=False``) in the Fig 4 setting (5 steps):
   seconds per step reading the unchanged rows through ``FixedRows`` against the same model made to
   build the full ``[batch, pos, d_model]`` residual stream (an identity hook on
   ``blocks.0.hook_resid_pre``), and against the rank-one query path the paper's configuration takes.

Run: ``.venv/bin/python benchmarks/bench_train.py [--repeats 5]``; prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import time

import numpy as np
import torch


def numpy_gd(K, N, M, p, n_train, n_test, steps, lr, eps, seed):
    """The paper's GD written out in numpy: returns (seconds in the loop, final test accuracy)."""
    from rwinterp.model import positional_embeddings
    from rwinterp.tasks import CircleWalk
    from rwinterp.training import TrainConfig, make_data

    task = CircleWalk(K, p, N)
    train, test = make_data(task, TrainConfig(n_train=n_train, n_test=n_test, seed=seed))
    P = positional_embeddings("orthogonal", N, M).numpy()  # N x M
    q = P[-1]
    scale = float(q @ q)
    tok_tr, y_tr = train.tokens.numpy(), train.labels.numpy()
    tok_te, y_te = test.tokens.numpy(), test.labels.numpy()
    oh_tr = np.eye(K + 1)[tok_tr][..., :K]  # query rows are zero
    oh_te = np.eye(K + 1)[tok_te][..., :K]
    V = np.zeros((K, K))
    u_tok = np.zeros(K + 1)  # token coordinates of u (the query token's is unused: its x is 0)
    u_pos = np.zeros(M)

    def forward(tok, oh):
        s = np.where(tok < K, u_tok[tok], 0.0) + (P @ u_pos)[None, :]
        s = s - s.max(1, keepdims=True)
        S = np.exp(s)
        S /= S.sum(1, keepdims=True)
        h = np.einsum("nj,njk->nk", S, oh)
        return S, h, h @ V.T

    def acc(f, y):
        tol = 64 * np.finfo(f.dtype).eps * np.abs(f).max(1, keepdims=True)
        return float(((f >= f.max(1, keepdims=True) - tol).argmax(1) == y).mean())

    history = []
    start = time.perf_counter()
    n = len(y_tr)
    rows = np.arange(n)
    for step in range(steps + 1):
        S, h, f = forward(tok_tr, oh_tr)
        fy = f[rows, y_tr] + eps
        loss = -np.log(fy).mean()
        S_te, _, f_te = forward(tok_te, oh_te)
        history.append((step, loss, acc(f, y_tr), acc(f_te, y_te), S_te[:, N - 2].mean()))
        if step == steps:
            break
        gf = np.zeros_like(f)
        gf[rows, y_tr] = -1.0 / (n * fy)
        gV = gf.T @ h
        gh = gf @ V
        gS = np.einsum("njk,nk->nj", oh_tr, gh)
        gs = S * (gS - (S * gS).sum(1, keepdims=True))
        g_tok = np.bincount(tok_tr.ravel(), weights=gs.ravel(), minlength=K + 1)
        g_pos = P.T @ gs.sum(0)
        V -= lr * gV
        u_tok -= lr * scale * g_tok
        u_pos -= lr * scale * g_pos
    return time.perf_counter() - start, history[-1][3]


def rwinterp_gd(K, N, M, p, n_train, n_test, steps, lr, eps, seed):
    from rwinterp.model import DeepConfig, DeepTransformer
    from rwinterp.tasks import CircleWalk
    from rwinterp.training import TrainConfig, train

    task = CircleWalk(K, p, N)
    model = DeepTransformer(DeepConfig.paper(K, N, M))
    result = train(model, task, TrainConfig(lr=lr, eps=eps, steps=steps, n_train=n_train,
                                            n_test=n_test, seed=seed), progress=False)
    return result.train_seconds, result.final["test_accuracy"]


#: Training steps of the deep-model comparison (part 3).
DEEP_STEPS = 5


def deep_gd(stream: bool) -> tuple[float, dict]:
    """The Fig 4 setting on the paper's configuration of the deep model: (seconds per step, last
    record). ``stream``: keep a hook on the residual stream, so every step builds it."""
    from rwinterp.model import DeepConfig, DeepTransformer
    from rwinterp.tasks import CircleWalk
    from rwinterp.training import TrainConfig, train

    task = CircleWalk(6, 0.5, 97)
    model = DeepTransformer(DeepConfig.paper(6, 97, 1000, rank_one_query=False))
    if stream:
        model.add_hook("blocks.0.hook_resid_pre", lambda act, hook: act, is_permanent=True)
    config = TrainConfig(lr=1.0, eps=0.1, steps=DEEP_STEPS, n_train=1000, n_test=1000, seed=0)
    result = train(model, task, config, progress=False)
    return result.train_seconds / DEEP_STEPS, result.final


def theory_regime() -> dict:
    """Run in a fresh process so that the peak RSS is this run's alone."""
    t0 = time.perf_counter()
    seconds, acc = rwinterp_gd(6, 1000, 32000, 0.5, 1000, 1000, 50, 1.0, 0.1, 0)
    return {"train_seconds": seconds, "test_accuracy": acc, "total_seconds": time.perf_counter() - t0,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--theory-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)  # one thread for every part (choose_threads picks it for the Fig 4 sizes only)
    if args.theory_only:
        print(json.dumps(theory_regime()))
        return
    # First: on Linux a child's peak RSS starts from its parent's RSS at the fork, which the deep
    # model's full-stream runs below raise to gigabytes.
    proc = subprocess.run([sys.executable, __file__, "--theory-only"], capture_output=True, text=True, check=True)
    setting = dict(K=6, N=97, M=1000, p=0.5, n_train=1000, n_test=1000, steps=50, lr=1.0, eps=0.1, seed=0)
    ours, base = [], []
    for _ in range(args.repeats):  # interleaved, so machine noise hits both alike
        ours.append(rwinterp_gd(**setting))
        base.append(numpy_gd(**setting))
    assert abs(ours[0][1] - base[0][1]) < 1e-12, "the two implementations disagree"
    t_ours = float(np.median([s for s, _ in ours]))
    t_base = float(np.median([s for s, _ in base]))
    deep, deep_stream, paper = [], [], []
    for _ in range(min(args.repeats, 3)):
        deep.append(deep_gd(stream=False))
        deep_stream.append(deep_gd(stream=True))
        paper.append(rwinterp_gd(**{**setting, "steps": DEEP_STEPS}))
    for key in ("loss", "test_accuracy", "parent_attention"):
        assert abs(deep[0][1][key] - deep_stream[0][1][key]) < 1e-12, f"the two deep paths disagree on {key}"
    t_deep = float(np.median([s for s, _ in deep]))
    t_stream = float(np.median([s for s, _ in deep_stream]))
    t_paper = float(np.median([s / DEEP_STEPS for s, _ in paper]))
    print(json.dumps({
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
        "date": time.strftime("%Y-%m-%d"),
        "fig4_rwinterp_seconds_median": round(t_ours, 4),
        "fig4_numpy_seconds_median": round(t_base, 4),
        "fig4_ratio": round(t_ours / t_base, 3),
        "fig4_test_accuracy": ours[0][1],
        "theory_regime": json.loads(proc.stdout),
        "whole_W_fig4_seconds_per_step": round(t_deep, 4),
        "whole_W_fig4_full_stream_seconds_per_step": round(t_stream, 4),
        "whole_W_fig4_speedup_over_full_stream": round(t_stream / t_deep, 1),
        "rank_one_fig4_seconds_per_step": round(t_paper, 4),
        "rank_one_speedup_over_whole_W": round(t_deep / t_paper, 1),
    }, indent=1))


if __name__ == "__main__":
    main()
