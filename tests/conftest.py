"""Shared tiny models and tasks, and the suite's tolerance policy.

Everything is seeded; float64 where identities are exact.

Floating-point comparisons follow one policy. Exact equality (``==``, ``torch.equal``) only where the
arithmetic is exact: integers, copies, and identities that hold bit for bit by construction (the
symmetric-readout, query-projection and gradient-descent kernels of Theorem 4.1's tests exist for
that). A result computed by two routes (another kernel, another reduction order, another CPU: MKL's
``MKL_CBWR`` modes, ATen's ``ATEN_CPU_CAPABILITY=default``, AVX-512 on Intel) is compared with
:func:`assert_close`, whose tolerance is relative to the largest magnitude involved.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np
import pytest
import torch

from rwinterp.model import DeepConfig, DeepTransformer
from rwinterp.tasks import CircleWalk
from rwinterp.training import TrainConfig, train

torch.set_num_threads(1)  # tiny tensors: one thread is fastest, and immune to a busy machine
# The same for every process the tests start (command lines, fresh interpreters, reproduction workers):
# OpenMP threads that spin while waiting for work cost far more than these tensors' arithmetic when
# another job shares the cores.
os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"

#: The default relative tolerance of :func:`assert_close` for float64 results: about 5e5 float64 ulps of
#: the largest magnitude, far above what another reduction order or CPU changes (a few ulps of the
#: terms summed), and 1e4 times below a relative error of 1e-6, which must always fail.
RTOL = 1e-10
#: The relative tolerance for a float64 result stored in float32 (as TransformerLens's patching functions
#: store their metrics): rounding moves it by at most 2**-24 relative; 2**-22 = 2.4e-7 leaves four times
#: that, and a relative error of 1e-6 still fails.
F32 = 2.0**-22


def assert_close(actual: Any, expected: Any, *, rtol: float = RTOL, scale: Any = None, what: str = "") -> None:
    """Assert ``|actual - expected| <= rtol * scale`` entry by entry, ``scale`` the largest magnitude
    of ``expected`` unless given: a number, or the terms whose largest magnitude it is. Give it where a
    result is a sum of larger terms that cancel (its round-off is relative to them, not to it).

    Round-off error of a sum or product is relative to the magnitude of the terms, not of each entry
    of the result, so the bound is the same for every entry: small entries of a large result are
    not held to their own relative precision, and entries of size 2e4 are not held to 1e-11. NaN
    must match NaN; shapes must broadcast to ``actual``'s.
    """
    a = _float64(actual)
    e = _float64(expected).expand_as(a)
    label = f"{what}: " if what else ""
    nan = a.isnan()
    assert torch.equal(nan, e.isnan()), f"{label}NaN in one and not the other"
    a, e = a[~nan], e[~nan]
    terms = e if scale is None else _float64(scale)
    terms = terms[~terms.isnan()]
    scale = float(terms.abs().max()) if terms.numel() else 0.0
    tol = rtol * scale
    diff = (a - e).abs()
    worst = float(diff.max()) if diff.numel() else 0.0
    assert worst <= tol, (f"{label}max |actual - expected| = {worst:.3g} > {tol:.3g} "
                          f"(rtol {rtol:g} x scale {scale:.3g})")


def _float64(x: Any) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64)
    return torch.from_numpy(np.asarray(x, dtype=np.float64))


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` are skipped where there is no CUDA GPU."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def paper_model(task: CircleWalk, **kwargs) -> DeepTransformer:
    """The paper's model sized for ``task`` (M = 1000 unless given)."""
    cfg = dict(n_states=task.n_states, n_ctx=task.seq_len, pos_dim=1000)
    cfg.update(kwargs)
    return DeepTransformer(DeepConfig(**cfg))


def full_w_copy(model: DeepTransformer) -> DeepTransformer:
    """The same model storing its whole merged W (``rank_one_query=False``), with the same weights."""
    full = DeepTransformer(model.cfg.replace(rank_one_query=False))
    with torch.no_grad():
        full.blocks[0].attn.W[0].copy_(model.W)
        full.blocks[0].attn.W_V.copy_(model.blocks[0].attn.W_V)
        if model.cfg.mlp_width is not None:
            full.blocks[0].mlp.A.copy_(model.blocks[0].mlp.A)
    assert model.cfg.rank_one and not full.cfg.rank_one
    return full


@pytest.fixture
def ctrl_c_handled():
    """SIGINT handled as Python does at a terminal (``KeyboardInterrupt``, and at its default in the
    processes the test starts) while the test runs, whatever pytest inherited: started in the
    background (``pytest &``, ``nohup``) it has SIGINT ignored, and so would they."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


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
