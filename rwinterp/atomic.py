"""Write a directory all at once: build it beside its target, then rename it into place.

An interrupted write (an error, Ctrl-C, a full disk) leaves the old directory, or nothing, never a
half-written one. An existing target is replaced only if it is empty or holds ``marker`` (the file
that says it is a directory of the same kind, e.g. a run's ``config.json``).
"""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Callable

from rwinterp.errors import require


def atomic_directory(target: str | Path, build: Callable[[Path], None], marker: str, kind: str) -> Path:
    """Run ``build(tmp)`` in a fresh temporary sibling of ``target``, then move it to ``target``."""
    target = Path(target)
    if target.exists():
        require(target.is_dir(), f"{target} exists and is not a directory")
        require((target / marker).exists() or not any(target.iterdir()),
                f"{target} exists and is not a {kind} directory; choose another --out")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        tmp.mkdir()
        build(tmp)
        if target.exists():
            old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
