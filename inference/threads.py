"""How many threads a process should use on a CPU it may share, and a competing load to measure that with.

threads=0 (auto) takes the CPUs this process may run on (its affinity mask) less those other processes keep busy (the
runnable processes besides this one, sampled for 0.1 s): OpenMP threads that outnumber the free cores spin-wait on
each other, and decoding collapses (the README's loaded rows show by how much).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def available_threads(requested: int = 0) -> int:
    """`requested` when > 0; else the free CPUs of this process (at least 1)."""
    if requested > 0:
        return requested
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cpus - busy_cpus())


def busy_cpus(samples: int = 5) -> int:
    """Runnable processes other than this one (Linux /proc/loadavg's running count, median of a few samples)."""
    try:
        counts = []
        for _ in range(samples):
            running = int(open("/proc/loadavg").read().split()[3].split("/")[0])
            counts.append(running - 1)
            time.sleep(0.02)
        return sorted(counts)[len(counts) // 2]
    except (OSError, ValueError, IndexError):
        return round(os.getloadavg()[0]) if hasattr(os, "getloadavg") else 0


class CompetingLoad:
    """`n` single-threaded busy processes for the duration of a `with` block: a machine that is not idle, so a
    benchmark can report "under load" as a row rather than an anecdote."""

    def __init__(self, n: int):
        self.n, self.procs = n, []

    def __enter__(self):
        self.procs = [subprocess.Popen([sys.executable, "-c", "x = 0\nwhile True:\n    x += 1"]) for _ in range(self.n)]
        if self.procs:
            time.sleep(0.3)  # running before anything measures
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.kill()
            p.wait()
