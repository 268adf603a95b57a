"""Stop requests (Ctrl-C, SIGTERM) that are not lost.

The command line turns SIGINT into ``KeyboardInterrupt`` and SIGTERM into :class:`Terminated`, raised
wherever the main thread is, so that every ``finally`` runs and no atomic write is left half done.
Python can lose such an exception: when the signal lands while a finaliser runs (a ``__del__``, a
weakref or garbage-collector callback), the exception is only reported as "Exception ignored" and
the interrupted code goes on. So the command line's handlers also :func:`request` the stop here, and
the points that go on working or commit work call :func:`check`: training stops at its next step,
a directory is never published (:func:`rwinterp.atomic.publish`), and a command never ends as a
success, after a stop was asked for.

Library users who install no handler see none of this: nothing is requested, and :func:`check`
does nothing.
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator


class Terminated(BaseException):
    """SIGTERM (``kill``, a timeout) while a command runs: unwound like Ctrl-C, so that what it was
    writing (a run, a report, a reproduction's scratch directory) is removed, not left half-written."""


#: The stops asked for since the last :func:`clear`, earliest first (as exception types).
_requested: list[type[BaseException]] = []


def request(kind: type[BaseException]) -> None:
    """Record that a stop of ``kind`` (``KeyboardInterrupt`` or :class:`Terminated`) was asked for."""
    if kind not in _requested:
        _requested.append(kind)


def check() -> None:
    """Raise the first stop asked for, if any: call it before committing work."""
    if _requested:
        raise _requested[0]()


def clear() -> None:
    """Forget the stops asked for (a command line's ``main`` does, before and after its command)."""
    _requested.clear()


def raise_on_signal(signum: int, frame: Any) -> None:
    """The signal handler: SIGINT raises ``KeyboardInterrupt``, any other signal :class:`Terminated`,
    each recorded first so that it survives being swallowed."""
    kind = KeyboardInterrupt if signum == signal.SIGINT else Terminated
    request(kind)
    raise kind()


def quiet_unraisable(previous: Callable[[Any], None]) -> Callable[[Any], None]:
    """A ``sys.unraisablehook`` that says nothing about a recorded stop lost in a finaliser (it is raised
    again at the next :func:`check`), and hands everything else to ``previous``."""

    def hook(unraisable: Any) -> None:
        if type(unraisable.exc_value) not in _requested:
            previous(unraisable)

    return hook


def install() -> Callable[[], None]:
    """Install :func:`raise_on_signal` for SIGINT and SIGTERM and :func:`quiet_unraisable`, with no stop
    recorded; return the function that puts back what they replaced. Off the main thread, where
    Python handles no signals, nothing is installed."""
    clear()
    if threading.current_thread() is not threading.main_thread():
        return clear
    previous = {s: signal.signal(s, raise_on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    previous_hook = sys.unraisablehook
    sys.unraisablehook = quiet_unraisable(previous_hook)

    def restore() -> None:
        for s, handler in previous.items():
            signal.signal(s, handler)
        sys.unraisablehook = previous_hook
        clear()

    return restore


@contextmanager
def held() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM back while the block runs, then raise the first that came.

    For loading extension modules (numpy, torch): an exception raised inside their initialisation
    can be swallowed or abort the process. Inside the block the signals are only noted (a signal mask
    would not hold them once other threads exist); after it, the first noted signal is raised again
    and reaches the handler that was there before. Off the main thread nothing is held."""
    noted: list[int] = []
    signals = (signal.SIGINT, signal.SIGTERM) if threading.current_thread() is threading.main_thread() else ()
    previous = {s: signal.signal(s, lambda signum, frame: noted.append(signum)) for s in signals}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if noted:
        signal.raise_signal(noted[0])
