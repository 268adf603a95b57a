"""The paper's model trained as the seed, thread and GPU benchmarks train it: by default the Fig 4 setting (K 6,
N 97, M 1000, 1000 training and 1000 test walks, 50 steps of gradient descent from zero initialisation,
``TrainConfig()``), one seed alone or many seeds in one batch."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from rwinterp.model import DeepConfig, DeepTransformer
from rwinterp.tasks import CircleWalk
from rwinterp.training import TrainConfig, TrainResult, train, train_seeds

K, N, M = 6, 97, 1000
SETTING = f"Fig 4: K {K}, N {N}, M {M}, 1000/1000 walks, 50 steps, zero init, TrainConfig()"


def train_paper(seeds: Optional[Sequence[int]] = None, config: TrainConfig = TrainConfig(), K: int = K, N: int = N,
                M: int = M, device: "str | torch.device" = "cpu", dtype: str = "float64"
                ) -> tuple[list[DeepTransformer], list[TrainResult]]:
    """Build and train the paper's model on the circle walk with p = 0.5: ``seeds`` None, one model of
    ``config.seed`` by ``train``; else one model per seed in one batch by ``train_seeds`` (each seed's config is
    ``config`` with that seed). Returns the models and their results."""
    task = CircleWalk(K, 0.5, N)
    if seeds is None:
        model = DeepTransformer(DeepConfig.paper(K, N, M, dtype=dtype, seed=config.seed)).to(device)
        return [model], [train(model, task, config, progress=False)]
    models = [DeepTransformer(DeepConfig.paper(K, N, M, dtype=dtype, seed=s)).to(device) for s in seeds]
    return models, train_seeds(models, task, [config.replace(seed=s) for s in seeds], progress=False)
