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


#: Seeds are non-negative integers that fit torch's and numpy's generators (a signed 64-bit integer).
MAX_SEED = 2**63 - 1


def require_seed(value: object, name: str = "seed") -> None:
    """Refuse a seed that torch or numpy would not take, with a one-line error."""
    require(isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_SEED,
            f"{name} must be an integer in [0, 2^63 - 1], got {value!r}")


#: Field annotations (as written) whose JSON values :func:`from_dict_checked` type-checks.
_JSON_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}


def from_dict_checked(cls: type, data: dict, what: str):
    """``cls(**data)`` for a dataclass, refusing what is not a JSON object, fields it does not have and
    values of the wrong JSON type (for fields annotated int, float, str or bool) with a one-line error."""
    from dataclasses import fields

    require(isinstance(data, dict), f"the {what} must be a JSON object, got {type(data).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    require(not unknown, f"unknown {what} fields: {', '.join(unknown)}")
    for name, value in data.items():
        annotation = str(known[name].type).replace("Optional[", "").replace(" | None", "").rstrip("]")
        optional = value is None and ("Optional" in str(known[name].type) or "None" in str(known[name].type))
        types = _JSON_TYPES.get(annotation)
        if types is None or optional:
            continue
        ok = isinstance(value, types) and (bool in types or not isinstance(value, bool))
        require(ok, f"{what} field {name} must be a JSON {annotation}, got {value!r}")
    return cls(**data)
