"""The one exception type that the command line turns into a one-line error.

Library code raises :class:`RwinterpError` (a ``ValueError``) for every problem caused by the
caller's input: invalid task or model parameters, a population too large to enumerate, an
unreadable run directory, a diverging loss. The CLI prints ``error: <message>`` and exits with
status 2; library users can catch it like any ``ValueError``.
"""

from __future__ import annotations


class RwinterpError(ValueError):
    """A user-facing error with a message that fits on one line."""


def require(condition: bool, message: str) -> None:
    """Raise :class:`RwinterpError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise RwinterpError(message)


def from_dict_checked(cls: type, data: dict, what: str):
    """``cls(**data)`` for a dataclass, refusing fields it does not have with a one-line error."""
    from dataclasses import fields

    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    require(not unknown, f"unknown {what} fields: {', '.join(unknown)}")
    return cls(**data)
