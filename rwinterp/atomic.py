"""Write a directory all at once: build it beside its target, then rename it into place.

An interrupted write (an error, Ctrl-C, a full disk) leaves the old directory, or nothing, never a
half-written one. An existing target is replaced only if it is empty, or if it holds the file that
marks a directory of the same kind (a run's ``config.json``) and nothing that such a directory does
not hold: a folder that merely contains a ``config.json`` beside other files is never deleted.
Commands call :func:`check_target` before their work starts, so that a bad ``--out`` is refused at
once rather than after minutes of training (it creates and removes an empty folder where the
directory will be built: permissions alone do not tell whether that can be done).

A process killed outright (SIGKILL, a power cut) cannot remove its temporary directory. Temporary
directories are named after the process that builds them (``.NAME.tmp-PID-XXXXXXXX``), and the next
write beside them removes those whose process is gone (:func:`remove_stale`).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import tempfile
import uuid
from fnmatch import fnmatch
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from rwinterp.errors import RwinterpError, require


def check_target(target: str | Path, kind: str, files: Sequence[str]) -> Path:
    """Refuse, with a one-line error, a ``target`` that :func:`atomic_directory` could not replace.

    ``files``: the names (``fnmatch`` patterns; a name ending in ``/`` is a folder) a directory of this
    ``kind`` holds; the first is its marker, the file that must be there for an existing, non-empty
    ``target`` to be replaced.
    """
    require(str(target) != "", "--out must name a directory")
    target = Path(target)
    if target.is_symlink():  # the directory the link names is replaced; the link stays, pointing at it
        target = target.resolve()
    if target.exists():
        require(target.is_dir(), f"{target} exists and is not a directory")
        require(target.resolve() != Path.cwd().resolve(), "--out cannot be the current directory (it is replaced)")
        entries = sorted(e.name for e in target.iterdir())
        require(not entries or files[0] in entries,
                f"{target} exists and is not a {kind} directory; choose another --out")
        foreign = [e for e in entries if not any(_matches(target / e, f) for f in files)]
        require(not foreign, f"{target} holds what a {kind} directory does not ({', '.join(foreign[:3])}"
                             f"{', ...' if len(foreign) > 3 else ''}), so it is not replaced; choose another --out")
        # Replacing renames the target away and deletes its files, which its own permissions must allow.
        require(not entries or os.access(target, os.W_OK | os.X_OK),
                f"cannot replace {target}: permission denied")
    ancestor = target.absolute().parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    require(ancestor.is_dir(), f"cannot write into {target.parent}: {ancestor} is not a directory")
    try:  # a real try: permissions alone do not tell (root passes os.access, yet /proc takes no folder)
        os.rmdir(tempfile.mkdtemp(prefix=f".{target.name}.probe-", dir=ancestor))
    except OSError as exc:
        raise RwinterpError(f"cannot write into {ancestor}: {exc.strerror or exc}") from None
    return target


def _matches(path: Path, pattern: str) -> bool:
    if pattern.endswith("/"):
        return path.is_dir() and not path.is_symlink() and fnmatch(path.name, pattern[:-1])
    return path.is_file() and fnmatch(path.name, pattern)


def temporary_sibling(target: Path, what: str = "tmp") -> Path:
    """A fresh, not yet created path beside ``target`` for building it, named after this process."""
    return target.parent / f".{target.name}.{what}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def atomic_file(path: Path, write: Callable[[Path], Any]) -> None:
    """Write the file ``path`` whole or not at all: ``write(tmp)`` fills a temporary sibling, which then
    replaces ``path`` in one rename; the sibling is removed if ``write`` fails."""
    tmp = temporary_sibling(path)
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


#: A temporary sibling's name (:func:`temporary_sibling`): ``.NAME.WHAT-PID-XXXXXXXX``.
_TEMPORARY = re.compile(r"\..+\.[a-z]+-(?P<pid>\d+)-[0-9a-f]{8}")


def _remove_orphans(paths: Iterable[Path]) -> None:
    """Remove those of ``paths`` that are temporary siblings of a process that no longer runs."""
    for path in paths:
        found = _TEMPORARY.fullmatch(path.name)
        if not found or path.is_symlink() or _alive(int(found["pid"])):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def remove_stale(target: Path) -> None:
    """Remove the temporary siblings of ``target`` left by processes that no longer run."""
    try:
        _remove_orphans(list(target.parent.glob(f".{glob.escape(target.name)}.*-*-*")))
    except OSError:
        return


def remove_stale_in(folder: str | Path) -> None:
    """Remove every temporary directory or file in ``folder`` (as :func:`temporary_sibling` names them) whose
    process no longer runs."""
    try:
        _remove_orphans(list(Path(folder).iterdir()))
    except OSError:
        return


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs. A process that has ended but is not yet reaped by its parent (a zombie,
    as a command killed outright is until its shell or caller waits for it) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        pass
    try:
        return proc_stat(f"/proc/{pid}/stat")[0] != "Z"
    except FileNotFoundError:  # gone since, or no /proc (then os.kill is all there is)
        return not os.path.isdir("/proc")
    except (OSError, IndexError):
        return True


def proc_stat(path: str) -> list[str]:
    """The fields of a process's or thread's ``/proc/.../stat`` file after its command name, the state first
    (``R`` running, ``S`` sleeping, ``Z`` a zombie, ...), then the parent's pid, .... The name, in parentheses,
    may itself hold spaces and parentheses: the fields start after the last ``)``. ``OSError`` where the file
    cannot be read (the process is gone, or there is no ``/proc``)."""
    with open(path) as f:
        return f.read().rpartition(")")[2].split()


def publish(tmp: Path, target: Path) -> None:
    """Rename the finished directory ``tmp`` (a sibling of ``target``) to ``target``, replacing it."""
    if target.exists():
        old = temporary_sibling(target, "old")
        target.rename(old)
        tmp.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(target)


def atomic_directory(target: str | Path, build: Callable[[Path], None], kind: str, files: Sequence[str]) -> Path:
    """Run ``build(tmp)`` in a fresh temporary sibling of ``target``, then move it to ``target``
    (``kind`` and ``files`` as for :func:`check_target`)."""
    target = check_target(target, kind, files)
    remove_stale(target)
    tmp = temporary_sibling(target)
    try:
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
        except OSError as exc:
            raise RwinterpError(f"cannot write into {target.parent}: {exc.strerror or exc}") from None
        build(tmp)
        publish(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
