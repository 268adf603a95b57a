"""Time and peak memory of ``rwinterp reproduce`` (goal for ``all``: under 10 minutes on 2 cores).

Runs ``rwinterp reproduce FIG ... --out DIR`` in a child process and, every 0.5 s, sums the resident
memory (VmRSS) of that process and all its descendants (the training workers), so the peak is that
of the whole reproduction, not of its largest process. Linux only (reads ``/proc``).

Run: ``.venv/bin/python benchmarks/bench_reproduce.py [FIG ...] [--out DIR]`` (default: ``all``
into a temporary folder); prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from experiments.report import cpu_name


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, from ``/proc/*/stat``."""
    out: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # the process ended meanwhile
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        out.setdefault(ppid, []).append(int(entry.name))
    return out


def _rss_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def tree_rss_kib(root: int) -> int:
    """Summed resident memory of ``root`` and all its descendants, in KiB."""
    children, total, todo = _children(), 0, [root]
    while todo:
        pid = todo.pop()
        total += _rss_kib(pid)
        todo += children.get(pid, [])
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("figures", nargs="*", default=["all"])
    parser.add_argument("--out", default=None, help="report folder (default: a temporary one)")
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between memory samples")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        out = args.out or os.path.join(scratch, "reproduction")
        cmd = [sys.executable, "-m", "rwinterp.cli", "reproduce", *args.figures, "--out", out, "--no-progress"]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        peak = 0
        while proc.poll() is None:
            peak = max(peak, tree_rss_kib(proc.pid))
            time.sleep(args.interval)
        seconds = time.perf_counter() - start
        lines = proc.stdout.read().splitlines()
    print(json.dumps({
        "figures": args.figures, "exit_status": proc.returncode, "seconds": round(seconds, 1),
        "peak_rss_gib": round(peak / 2**20, 3), "summary": lines[-1] if lines else "",
        "machine": f"{platform.machine()} ({cpu_name()})", "cpus": os.cpu_count(),
        "load_average_after": [round(x, 2) for x in os.getloadavg()], "date": time.strftime("%Y-%m-%d"),
    }))


if __name__ == "__main__":
    main()
