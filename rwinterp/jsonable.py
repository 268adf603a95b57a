"""The one conversion of results to JSON: numbers, bools, strings, lists and dicts.

Tensors and arrays become (nested) lists, numpy scalars Python numbers, tuples lists, dict keys strings,
and NaN or infinite floats ``null`` (JSON has no NaN). Imports nothing heavy: torch and numpy values are
recognised by their methods.
"""

from __future__ import annotations

import math
from typing import Any


def jsonable(x: Any) -> Any:
    """``x`` as plain JSON values (see the module docstring)."""
    if hasattr(x, "detach"):  # a torch tensor
        x = x.detach().cpu().numpy()
    if hasattr(x, "tolist") and hasattr(x, "dtype"):  # a numpy array or scalar
        return jsonable(x.tolist())
    if isinstance(x, bool) or x is None or isinstance(x, (int, str)):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    return x
