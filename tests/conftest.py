"""Shared tiny models and tasks. Everything is seeded; float64 where identities are exact."""

from __future__ import annotations

import pytest
import torch

from rwinterp.config import WalkTransformerConfig
from rwinterp.model import WalkTransformer
from rwinterp.tasks import CircleWalk
from rwinterp.training import TrainConfig, train

torch.set_num_threads(1)  # tiny tensors: one thread is fastest, and immune to a busy machine


def paper_model(task: CircleWalk, **kwargs) -> WalkTransformer:
    cfg = dict(n_states=task.n_states, n_ctx=task.seq_len, pos_dim=1000)
    cfg.update(kwargs)
    return WalkTransformer(WalkTransformerConfig(**cfg))


@pytest.fixture(scope="session")
def trained_paper_models():
    """The paper's Fig 4 setting (K 6, N 97, M 1000, zero init, lr 1, 50 steps) at p = 0.5 and 0.7."""
    out = {}
    for p in (0.5, 0.7):
        task = CircleWalk(6, p, 97)
        model = paper_model(task)
        result = train(model, task, TrainConfig(), progress=False)
        out[p] = (model, task, result)
    return out
