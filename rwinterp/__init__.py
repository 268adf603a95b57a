"""rwinterp: train small transformers on Markov chains and probe how they implement them.

The names a user needs, imported on first use (``import rwinterp`` loads neither torch nor TransformerLens)::

    import rwinterp
    task = rwinterp.CircleWalk(K=6, p=0.5, N=97)                       # the task (rwinterp.tasks, chains, icl, qa)
    model = rwinterp.DeepTransformer(rwinterp.DeepConfig.paper(6, 97, 1000))   # the paper's model
    result = rwinterp.train(model, task, rwinterp.TrainConfig())        # full-batch gradient descent, 50 steps
    rwinterp.save_run("runs/p05", model, task, rwinterp.TrainConfig().to_dict(), result.history, {})
    run = rwinterp.load_run("runs/p05")                                 # model, task, history
    models = [rwinterp.build_model("deep", {"seed": s}) for s in range(20)]  # 20 seeds, trained as one batch
    results = rwinterp.train_seeds(models, task, [rwinterp.TrainConfig(seed=s) for s in range(20)])

The probes and the figure reproductions are packages of their own, built on this one.
"""

from __future__ import annotations

import importlib
from typing import Any

#: Every exported name and the module that defines it.
_EXPORTS = {
    # tasks
    "Task": "rwinterp.tasks", "Batch": "rwinterp.tasks", "CircleWalk": "rwinterp.tasks",
    "MarkovChain": "rwinterp.tasks", "task_from_dict": "rwinterp.tasks",
    "LazyWalk": "rwinterp.chains", "TorusWalk": "rwinterp.chains", "RegularGraphWalk": "rwinterp.chains",
    "HigherOrderChain": "rwinterp.chains", "PersistentWalk": "rwinterp.chains", "RandomOrderChain": "rwinterp.chains",
    "InContextChain": "rwinterp.icl", "QAMajority": "rwinterp.qa", "QAOrder": "rwinterp.qa",
    # models
    "DeepOptions": "rwinterp.config", "BridgeOptions": "rwinterp.config", "TrainConfig": "rwinterp.config",
    "DeepConfig": "rwinterp.model", "DeepTransformer": "rwinterp.model", "build_bridge": "rwinterp.bridge",
    # training and runs
    "train": "rwinterp.training", "TrainResult": "rwinterp.training", "TrainingDiverged": "rwinterp.training",
    "train_seeds": "rwinterp.training", "resolve_device": "rwinterp.training",
    "save_run": "rwinterp.runs", "load_run": "rwinterp.runs", "Run": "rwinterp.runs", "build_model": "rwinterp.runs",
    "save_group": "rwinterp.runs", "load_group": "rwinterp.runs", "read_group": "rwinterp.runs",
    "register_model_kind": "rwinterp.runs", "RwinterpError": "rwinterp.errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("rwinterp")
        except PackageNotFoundError:  # a source tree that was not installed
            return "unknown"
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rwinterp' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)


def __dir__() -> list[str]:
    return __all__
