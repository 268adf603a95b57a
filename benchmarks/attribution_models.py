"""The models the attribution benchmark measures, trained by the library and cached as runs.

* ``icl``: the in-context Markov chain (``rwinterp.icl.InContextChain``: every sequence draws its own K x K
  transition matrix, rows Dirichlet(1), the first state uniform, N states); a TransformerBridge (attention
  only, no normalisation) trained by ``rwinterp.training.train`` on next-state cross-entropy with AdamW
  (lr 5e-3, no weight decay), 64 fresh sequences per step: ``rwinterp train --task icl --model bridge ...``.
* ``paper``: the paper's model (``DeepConfig.paper(6, 97, 1000)``) trained with the default ``TrainConfig``
  (the Fig 4 setting).

Trained models are cached as run directories under ``--cache`` (named by every setting), so a rerun of the
benchmark measures the same models.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from rwinterp.tasks import Batch, Task


def icl_task(K: int = 3, N: int = 64) -> Task:
    from rwinterp.icl import InContextChain

    return InContextChain(K, N)


def _cached(cache: Optional[Path], name: str, make: Any) -> Any:
    """The run ``cache/name``: loaded if it is there, else trained by ``make()`` (model, task, config, result) and
    saved there."""
    from rwinterp.runs import load_run, save_run

    if cache is not None and (cache / name / "config.json").is_file():
        return load_run(cache / name)
    model, task, config, result = make()
    if cache is not None:
        save_run(cache / name, model, task, config, result)
        return load_run(cache / name)
    from rwinterp.runs import Run

    return Run(model, task, config.to_dict(), result.history, {"train_seconds": result.train_seconds})


def train_icl(seed: int, layers: int = 2, heads: int = 4, d_model: int = 32, K: int = 3, N: int = 64,
              steps: int = 2000, lr: float = 5e-3, batch: int = 64, cache: Path | None = None) -> tuple[Any, dict]:
    """A bridge trained on the in-context chain; returns it (eval mode) and what training recorded."""
    from rwinterp.bridge import build_bridge
    from rwinterp.config import BridgeOptions, TrainConfig
    from rwinterp.training import train

    def make() -> tuple:
        task = icl_task(K, N)
        model = build_bridge(BridgeOptions(n_states=K, n_ctx=N, n_layers=layers, n_heads=heads, d_model=d_model,
                                           seed=seed))
        config = TrainConfig(optimizer="adamw", lr=lr, batch_size=batch, steps=steps, loss="xent", next_token=True,
                             eval_every=steps, seed=seed)
        return model, task, config, train(model, task, config, progress=False)

    run = _cached(cache, f"icl-K{K}-N{N}-L{layers}-H{heads}-d{d_model}-s{steps}-lr{lr}-b{batch}-seed{seed}", make)
    final = run.history[-1]
    return run.model, {"train_seconds": run.summary.get("train_seconds"), "final_train_loss": final["loss"],
                       "test_loss": final.get("test_loss")}


def train_paper(seed: int = 0, cache: Path | None = None) -> tuple[Any, Task, Batch]:
    """The paper's model at the Fig 4 setting (seed ``seed``), its task and its test walks."""
    from rwinterp.model import DeepConfig, DeepTransformer
    from rwinterp.tasks import CircleWalk
    from rwinterp.training import TrainConfig, held_out_data, train

    def make() -> tuple:
        task = CircleWalk(6, 0.5, 97)
        model = DeepTransformer(DeepConfig.paper(6, 97, 1000, seed=seed))
        config = TrainConfig(seed=seed)
        return model, task, config, train(model, task, config, progress=False)

    run = _cached(cache, f"paper-seed{seed}", make)
    return run.model, run.task, held_out_data(run.task, TrainConfig(seed=seed))
