"""Where jobs run: one small interface over a local process pool and a Ray cluster.

An executor takes a picklable function and its arguments (:meth:`Executor.submit`) and hands back a
:class:`concurrent.futures.Future`; ``concurrent.futures.as_completed`` and ``wait`` then work alike for
every executor. Used in a ``with`` block, an executor shuts down after the work; after an error, Ctrl-C or
SIGTERM it cancels what is queued and ends its workers at once instead of waiting for their jobs.

* :class:`ProcessExecutor` (the default): ``jobs`` spawned worker processes on this machine.
* :class:`RayExecutor` (``--executor ray``): Ray tasks, on a local Ray instance this process starts (and
  stops), or on an existing cluster (``address``); Ray is imported only here. A task may ask for a fraction
  of a GPU, so that many small runs share one.

Every worker trains with one thread (:func:`rwinterp.training.one_thread_per_worker`): jobs that run side
by side each get a core. Jobs are seeded by their arguments alone, so the numbers do not depend on the
executor or on which worker runs a job.

Workers never outlive the command that started them: pool workers ask Linux to end them when their parent
dies (:func:`die_with_parent`), and :class:`Janitor`, a small process that outlives a command killed
outright (SIGKILL), ends whatever the command had started (a local Ray instance included) and removes the
temporary directories it was building.
"""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from rwinterp.atomic import proc_stat
from rwinterp.errors import RwinterpError, require

EXECUTORS = ("process", "ray")


def add_executor_options(parser: Any, what: str) -> None:
    """``--executor``, ``--address`` and ``--gpus-per-job`` on ``parser`` (or an argument group); ``what`` runs
    there ("runs", "jobs")."""
    parser.add_argument("--executor", default="process", choices=EXECUTORS,
                        help=f"where the {what} run: process (this machine's cores, default) or ray (a local Ray "
                             "instance, or the cluster at --address; docs/sweeps.md)")
    parser.add_argument("--address", default=None, help="with --executor ray: join this cluster (HOST:PORT of "
                                                        "`ray start --head`, or auto)")
    parser.add_argument("--gpus-per-job", type=float, default=None, metavar="F",
                        help=f"with --executor ray: the share of a GPU each of the {what} asks for (0.25: four per "
                             "GPU)")


def check_executor_options(executor: str, address: Optional[str], gpus_per_job: Optional[float]) -> None:
    """The options of :func:`add_executor_options`, checked together (one-line errors)."""
    require(executor in EXECUTORS, f"--executor must be one of {', '.join(EXECUTORS)}")
    require(address is None or executor == "ray", "--address applies to --executor ray")
    require(gpus_per_job is None or executor == "ray", "--gpus-per-job applies to --executor ray")
    require(gpus_per_job is None or (math.isfinite(gpus_per_job) and 0 < gpus_per_job <= 1),
            f"--gpus-per-job must be in (0, 1], got {gpus_per_job}")


def require_gpu_share(device: str, executor: str, gpus_per_job: Optional[float]) -> None:
    """A GPU run on Ray must ask for a share of a GPU: Ray hides the GPUs from a task that asks for none."""
    require(device == "cpu" or executor != "ray" or bool(gpus_per_job),
            f"--device {device} with --executor ray needs --gpus-per-job (Ray hides the GPUs from a task that asks "
            "for none; 0.25 lets four jobs share a GPU)")


class Executor:
    """What every executor offers (see the module docstring)."""

    #: Whether arguments may travel through shared memory (``multiprocessing.reduction.ForkingPickler``):
    #: only between processes this one started.
    shares_memory = False
    #: How many jobs run at once.
    slots = 1

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        raise NotImplementedError

    def shutdown(self) -> None:
        """Wait for the submitted jobs, then release the workers."""

    def stop(self) -> None:
        """Cancel what is queued and end the workers now."""

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        if kind is None:
            self.shutdown()
        else:
            self.stop()


class InlineExecutor(Executor):
    """Jobs run in this process, one after the other, as they are submitted (``--jobs 1``), with one torch
    thread (the process's own count is restored at the end)."""


    def __init__(self) -> None:
        import torch

        self.threads = torch.get_num_threads()
        torch.set_num_threads(1)

    def shutdown(self) -> None:
        import torch

        torch.set_num_threads(self.threads)

    stop = shutdown

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        future.set_running_or_notify_cancel()
        try:
            future.set_result(fn(*args))
        except Exception as exc:  # noqa: BLE001  (handed over as a pool would)
            future.set_exception(exc)
        return future


# ------------------------------------------------------------------------------------- process pool
class ProcessExecutor(Executor):
    """``jobs`` spawned worker processes with one torch thread each (``threads`` to change it); ``setup``
    (an importable function) runs once in each worker, e.g. to register what its jobs need."""

    shares_memory = True

    def __init__(self, jobs: int, threads: int = 1, setup: Optional[Callable[[], Any]] = None) -> None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        require(isinstance(jobs, int) and jobs >= 1, f"jobs must be a positive integer, got {jobs!r}")
        self.slots = jobs
        self.pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                                        initializer=_init_process, initargs=(threads, setup))

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """``pool.submit`` with Ctrl-C blocked while a worker may start: a worker inherits the mask and starts
        with SIGINT blocked, so the Ctrl-C a terminal sends the whole process group never interrupts its
        imports; its initialiser then ignores SIGINT for good (this process answers it and ends the workers)."""
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            return self.pool.submit(fn, *args)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    def shutdown(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)

    def stop(self) -> None:
        import multiprocessing

        self.pool.shutdown(wait=False, cancel_futures=True)
        children = multiprocessing.active_children()
        for child in children:
            child.terminate()
        for child in children:  # (so that what they were writing can be removed once they are gone)
            child.join(5)
            if child.is_alive():
                child.kill()


def _init_process(threads: int, setup: Optional[Callable[[], Any]]) -> None:
    import threading

    from tqdm import tqdm

    from rwinterp.training import one_thread_per_worker

    # tqdm's default lock is a multiprocessing semaphore, which a worker ended by ``stop`` could not release:
    # the workers' bars (never shown) share a thread lock instead.
    tqdm.set_lock(threading.RLock())
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    die_with_parent()
    one_thread_per_worker()
    if threads != 1:
        import torch

        torch.set_num_threads(threads)
    if setup is not None:
        setup()


def die_with_parent() -> None:
    """Ask Linux to end this process when its parent dies, however it dies (SIGKILL included): a worker never
    outlives the command that started it. Elsewhere, nothing."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() == 1:  # the parent died before the request was made
            os._exit(1)
    except (OSError, AttributeError):
        pass


# ------------------------------------------------------------------------------------------------- Ray
class RayExecutor(Executor):
    """Jobs as Ray tasks of one CPU each (and ``gpus_per_job`` of a GPU, a fraction to share one).

    Without ``address``, a local Ray instance of ``jobs`` CPUs (default: this machine's) is started here
    and stopped at the end; with one (``HOST:PORT`` of a head started by ``ray start --head``, or
    ``auto``), the jobs go to that cluster, whose nodes must have this package installed. ``setup`` runs
    in a worker before each job (Ray reuses its workers).
    """


    def __init__(self, jobs: Optional[int] = None, address: Optional[str] = None, gpus_per_job: float = 0.0,
                 setup: Optional[Callable[[], Any]] = None) -> None:
        require(gpus_per_job >= 0, f"--gpus-per-job must be >= 0, got {gpus_per_job}")
        require(address is None or address == "auto" or address.strip() != "", "--address is empty")
        ray = import_ray()
        if address not in (None, "auto"):
            check_reachable(address)
        self.ray, self.address, self.setup, self.gpus = ray, address, setup, gpus_per_job
        self.refs: list[Any] = []
        env = {"env_vars": _worker_env()}
        # Ray answers SIGTERM in a driver with sys.exit(15); the command's own answer (unwind, status 143) stays.
        sigterm = signal.getsignal(signal.SIGTERM)
        try:
            if address is None:
                # ("local": a new instance, even where `ray start` left this machine an address to join)
                ray.init(address="local", num_cpus=jobs or os.cpu_count() or 1, include_dashboard=False,
                         log_to_driver=False,
                         configure_logging=False, runtime_env=env)
            else:
                ray.init(address=address, log_to_driver=False, configure_logging=False, runtime_env=env)
        except Exception as exc:  # noqa: BLE001  (Ray raises several kinds; each is one line here)
            hint = ("" if address is None or os.environ.get("RAY_AUTH_MODE") else
                    " (if the cluster uses token authentication, recent Ray's default, set RAY_AUTH_MODE=token and "
                    "give this machine its token: docs/sweeps.md)")
            raise RwinterpError(f"cannot start Ray{'' if address is None else ' at ' + address}: "
                                f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}{hint}") from None
        finally:
            import threading

            if sigterm is not None and threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, sigterm)
        cpus = int(ray.cluster_resources().get("CPU", 1))
        self.slots = max(1, min(cpus, jobs) if jobs else cpus)
        if gpus_per_job > 0:
            gpus = ray.cluster_resources().get("GPU", 0)
            if gpus <= 0:
                self.stop()
                raise RwinterpError(f"--gpus-per-job {gpus_per_job}: the Ray cluster has no GPU")
        self.remote = ray.remote(num_cpus=1, num_gpus=gpus_per_job, max_retries=0)(_ray_job)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        ref = self.remote.remote(fn, args, self.setup)
        self.refs.append(ref)
        return ref.future()

    def shutdown(self) -> None:
        self.ray.shutdown()

    def stop(self) -> None:
        for ref in self.refs:
            try:
                self.ray.cancel(ref, force=True)
            except Exception:  # noqa: BLE001  (already finished)
                pass
        self.ray.shutdown()


def _worker_env() -> dict[str, str]:
    from rwinterp.training import WORKER_ENV

    return dict(WORKER_ENV)


def _ray_job(fn: Callable[..., Any], args: Sequence[Any], setup: Optional[Callable[[], Any]]) -> Any:
    from rwinterp.training import one_thread_per_worker

    one_thread_per_worker()
    if setup is not None:
        setup()
    return fn(*args)


def import_ray() -> Any:
    """The ``ray`` module, or a one-line error saying how to install it."""
    try:
        import ray
    except ImportError:
        raise RwinterpError("--executor ray needs Ray: pip install -e '.[ray]' (or pip install 'ray>=2.9')") from None
    return ray


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """Refuse, in one line, a Ray ``HOST:PORT`` where nothing answers (Ray itself would retry for a minute)."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    require(host != "" and port.isdigit(), f"--address must be HOST:PORT (or auto), got {address!r}")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as exc:
        raise RwinterpError(f"--address {address}: nothing answers there ({exc.strerror or exc}); start a head "
                            "with `ray start --head` and pass the address it prints") from None


def make_executor(kind: str, jobs: int, address: Optional[str] = None, gpus_per_job: float = 0.0,
                  setup: Optional[Callable[[], Any]] = None) -> Executor:
    """The executor ``kind`` names (:data:`EXECUTORS`) for ``jobs`` jobs at once."""
    require(kind in EXECUTORS, f"--executor must be one of {', '.join(EXECUTORS)}, got {kind!r}")
    if kind == "ray":
        return RayExecutor(jobs, address, gpus_per_job, setup)
    require(address is None, "--address applies to --executor ray")
    require(not gpus_per_job, "--gpus-per-job applies to --executor ray")
    return ProcessExecutor(jobs, setup=setup)


# --------------------------------------------------------------------------------------------- janitor
class Janitor:
    """A process that outlives this one to clean up after it, however it ends (SIGKILL included).

    While this process runs, the janitor notes every process it started, their children included (it
    reads ``/proc`` five times a second). If this process ends without calling :meth:`close` (killed
    outright), the janitor kills every process it noted that still runs, waits for them to end, and
    removes the temporary directories of :mod:`rwinterp.atomic` (``.NAME.tmp-PID-XXXXXXXX``) in the
    ``folders`` it was given whose process is gone. Where there is no ``/proc``, nothing.
    """

    def __init__(self, folders: Sequence[str | os.PathLike] = ()) -> None:
        self.proc: Optional[subprocess.Popen] = None
        if not os.path.isdir("/proc"):
            return
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from experiments.executors import _janitor; _janitor()", str(os.getpid()),
             *map(str, folders)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True, close_fds=True)
        self.proc.stdout.readline()  # it has seen what runs now: what this process starts next is noted
        self.proc.stdout.close()

    def close(self) -> None:
        """This process ends normally: the janitor leaves without doing anything."""
        if self.proc is not None and self.proc.stdin is not None:
            try:
                self.proc.stdin.write(b"done\n")
                self.proc.stdin.close()
            except OSError:
                pass
            self.proc.wait()
            self.proc = None


def _process_table() -> dict[int, tuple[int, str]]:
    """``{pid: (parent pid, start time)}`` of every process."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = proc_stat(f"/proc/{entry}/stat")
                out[int(entry)] = (int(fields[1]), fields[19])
            except (OSError, IndexError, ValueError):
                pass
    return out


def _janitor() -> None:
    import select
    import time

    from rwinterp.atomic import remove_stale_in

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C at the terminal is the command's to answer
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent, folders = int(sys.argv[1]), [Path(p) for p in sys.argv[2:]]
    seen: dict[int, str] = {}  # pid -> start time, of every process the command started
    first = True
    while True:
        ready, _, _ = select.select([sys.stdin], [], [], 0.0 if first else 0.2)
        if ready:
            line = sys.stdin.readline()
            if line.strip() == "done":
                return
            if line == "":  # the command ended without saying so: clean up after it
                break
        table = _process_table()
        roots = {parent, *seen}
        for pid, (ppid, start) in table.items():
            if ppid in roots and pid not in seen and pid != os.getpid():
                seen[pid] = start
                roots.add(pid)
        if first:
            sys.stdout.write("ready\n")
            sys.stdout.close()
            first = False
    # Stop (SIGSTOP) every noted process that still runs and what it started, until a pass finds no new one:
    # a stopped process starts nothing, so the set is then closed. Then kill them all.
    stopped: set[int] = set()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        table = _process_table()
        alive = {pid for pid, start in seen.items() if table.get(pid, (0, None))[1] == start}
        grown = True
        while grown:
            grown = False
            for pid, (ppid, start) in table.items():
                if ppid in alive and pid not in alive and pid != os.getpid():
                    seen[pid] = start
                    alive.add(pid)
                    grown = True
        if alive <= stopped:
            break
        for pid in alive - stopped:
            try:
                os.kill(pid, signal.SIGSTOP)
            except OSError:
                pass
        stopped |= alive
    for pid in stopped:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    while time.monotonic() < deadline:  # until they are gone (their temporary folders are then stale)
        table = _process_table()
        if not any(table.get(pid, (0, None))[1] == seen[pid] for pid in stopped):
            break
        time.sleep(0.05)
    for folder in folders:
        remove_stale_in(folder)
