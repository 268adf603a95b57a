"""Options shared by the probes. The defaults are what ``rwinterp probe`` uses."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Optional

from rwinterp.config import Config
from rwinterp.errors import require, require_seed

#: Activations the patching probe sweeps: the residual stream at the start of each layer (layer 0
#: is the embeddings) and the value vectors, position by position; each head's output z and
#: attention pattern, head by head.
HOOKS = ("resid_pre", "v", "z", "pattern")


#: Edge-scoring methods of :func:`probes.circuits.edge_attribution` (and ``rwinterp circuit --method``).
EDGE_METHODS = ("exact", "eap", "eap-ig", "atp*", "default")
#: Which edges a graph holds: ``all``, or ``heads``, only the edges from a head's output into a later
#: head's query, key or value (the composition between heads; every other edge is always kept).
GRAPHS = ("all", "heads")
#: Circuit sizes at which the faithfulness curve is measured by default (at most).
CURVE_POINTS = 16
#: Edges the default method patches exactly (beyond those it computes in closed form): as many as the
#: faithfulness curve takes ablated passes, so that verifying costs no more than measuring the curve.
VERIFY = CURVE_POINTS

#: Resamples beyond this change an interval's ends far less than the walks' own sampling noise (each
#: resample is a [walks] row of weights: 10^5 of them on 1000 walks take 0.8 GB).
MAX_BOOTSTRAP = 100_000


@dataclass(frozen=True)
class ProbeConfig(Config):
    """How to probe.

    * ``seed``: seeds the corrupted walks of the patching probe and the bootstrap.
    * ``kind``: ``None`` detects query-slot or autoregressive models from their shapes
      (:func:`probes.targets.detect_kind`); ``"query"`` or ``"autoregressive"`` forces one.
    * ``hooks``: which activations the patching probe sweeps (a subset of :data:`HOOKS`).
    * ``max_rows``: rows per forward pass when several patched runs are stacked in one batch
      (each run is a copy of the walks; larger is faster and takes more memory).
    * ``gradient_walks``: walks used for gradient-times-input attribution (the one attribution
      that needs the dense ``[walk, position, d_model]`` embeddings and a backward pass).
    * ``bootstrap``: resamples of the test walks for the confidence intervals (0: none);
      ``confidence``: their level.
    * ``progress``: show progress bars (``None``: only on a terminal).

    Frozen, so that the default ``ProbeConfig()`` every probe takes is shared safely; change a field with
    ``dataclasses.replace``.
    """

    seed: int = 0
    kind: Optional[str] = None
    hooks: tuple[str, ...] = HOOKS
    max_rows: int = 16384
    gradient_walks: int = 100
    bootstrap: int = 200
    confidence: float = 0.95
    progress: Optional[bool] = None

    what: ClassVar[str] = "probe config"

    def __post_init__(self) -> None:
        object.__setattr__(self, "hooks", tuple(self.hooks))
        for hook in self.hooks:
            require(hook in HOOKS, f"unknown patching hook {hook!r}; known: {', '.join(HOOKS)}")
        require(self.max_rows >= 1, f"max_rows must be >= 1, got {self.max_rows}")
        require(self.gradient_walks >= 0, f"gradient_walks must be >= 0, got {self.gradient_walks}")
        require(0.0 < self.confidence < 1.0, f"confidence must lie in (0, 1), got {self.confidence}")
        # Fewer resamples leave no draw beyond a tail: the "interval" is then one or two draws.
        least = math.ceil(2 / (1 - self.confidence) - 1e-9)
        require(self.bootstrap == 0 or least <= self.bootstrap <= MAX_BOOTSTRAP,
                f"bootstrap must be 0 (no intervals) or between {least} and {MAX_BOOTSTRAP} resamples for a "
                f"{self.confidence:.0%} interval, got {self.bootstrap}")
        require_seed(self.seed)
