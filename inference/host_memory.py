"""Large CPU tensors from reused memory instead of fresh pages: mimalloc preloaded where installed, else glibc tuned.

glibc's malloc serves every block over its mmap threshold (adapted at run time, at most 32 MB) with fresh mmap'd
pages and unmaps them on free. A training step's [1024, 8192] float32 loss temporaries are such blocks, so each of
them was page-faulted and zeroed again: a pass over 32 MB took ~13 ms instead of ~2 on this 2-core machine.

run_under_mimalloc() re-executes a command once with mimalloc (the `cmeel-mimalloc` wheel, a Linux dependency)
in LD_PRELOAD, before anything heavy is imported. mimalloc keeps freed blocks in per-size pages and arenas, and
with MIMALLOC_PURGE_DELAY=-1 (set unless the user set it) never hands their pages back: by default it purges a freed
block's pages after 10 ms, so a training step's temporaries, reused a step later, were faulted afresh. 100 training
steps of the default experiment on this 2-core machine (medians of 20-step windows, one run each):

| allocator | tokens/s | forward / backward ms | minor page faults | peak RSS |
|---|---|---|---|---|
| glibc, tuned as below | 746 | 406 / 536 | 2.96M | 4.8 GB |
| mimalloc, its default purge delay | 718 | 544 / 455 | 1.42M | 3.4 GB |
| mimalloc, MIMALLOC_PURGE_DELAY=-1 | 993 | 306 / 405 | 0.22M | 3.9 GB |

The re-executed process takes LD_PRELOAD out of its environment again, so the processes it starts (torchrun ranks, a
vLLM server) decide for themselves. It changes nothing when the user chose: their own LD_PRELOAD, MALLOC_* variables,
or DRAFTHEADS_MALLOC=glibc.

Without mimalloc, keep_freed_memory() raises glibc's thresholds so freed blocks go back to the heap and are reused.
Blocks of varying sizes then fragment the heap (torch asks for 64-byte aligned blocks, which glibc pads, so a freed
block rarely takes the next request of its own size): a training process grew from 3 to 7.5 GB within a 25-step
window, so release_freed_memory() returns the heap's free pages to the kernel (malloc_trim) every log window.
Only training turns that fallback on: with it on from the start of a default run, feature extraction after
regeneration grew to 15.7 GB of anonymous memory, cause not found.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import os
import sys
import warnings

KEEP_BYTES = 1 << 30  # blocks up to this size come from (and return to) the heap
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_USER_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
CHOICE_ENV = "DRAFTHEADS_MALLOC"  # "glibc": keep glibc's allocator (no re-execution)
_REEXECUTED = "_DRAFTHEADS_MIMALLOC_PRELOAD"  # set across the one re-execution only
_policy = "glibc default"


def mimalloc_library() -> str | None:
    """The installed mimalloc shared library (Linux, `cmeel-mimalloc`), or None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        files = importlib.metadata.distribution("cmeel-mimalloc").files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    paths = sorted(str(f.locate()) for f in files if f.name.startswith("libmimalloc.so"))
    return paths[0] if paths else None


@functools.lru_cache(maxsize=1)
def preloaded_mimalloc() -> str | None:
    """mimalloc's version when it is this process's allocator (preloaded; fixed for the process's life), else None."""
    try:
        version = ctypes.CDLL(None).mi_version()
    except (AttributeError, OSError):
        return None
    return f"{version // 10000}.{version // 100 % 100}.{version % 100}"


def run_under_mimalloc() -> None:
    """Re-execute this command (same interpreter, flags and arguments) with mimalloc preloaded, unless the user chose
    an allocator or it is not installed. Call it first in a command's __main__, before torch is imported: the
    re-execution repeats every import made before it."""
    if _REEXECUTED in os.environ:  # the re-executed process: its children start from the user's environment
        os.environ.pop(_REEXECUTED)
        os.environ.pop("LD_PRELOAD", None)
        if preloaded_mimalloc() is None:
            warnings.warn(f"mimalloc ({mimalloc_library()}) did not load; glibc's allocator is in use")
        return
    if os.environ.get(CHOICE_ENV) == "glibc" or "LD_PRELOAD" in os.environ or \
            any(name in os.environ for name in _USER_ENV) or preloaded_mimalloc() is not None:
        return
    library = mimalloc_library()
    if library is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]],
              {"MIMALLOC_PURGE_DELAY": "-1", **os.environ, "LD_PRELOAD": library, _REEXECUTED: "1"})


@functools.lru_cache(maxsize=1)
def _glibc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") and hasattr(libc, "gnu_get_libc_version") \
        else None


def keep_freed_memory() -> str:
    """Reuse freed blocks up to KEEP_BYTES (glibc only; once per process). Returns the policy in force (policy())."""
    global _policy
    if preloaded_mimalloc() is not None:
        return policy()
    if any(os.environ.get(name) for name in _USER_ENV):
        _policy = "set by the environment (" + ", ".join(f"{n}={os.environ[n]}" for n in _USER_ENV if n in os.environ) \
            + ")"
        return _policy
    libc = _glibc()
    if libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, KEEP_BYTES) == 1 and \
            libc.mallopt(_M_TRIM_THRESHOLD, KEEP_BYTES) == 1:
        _policy = f"freed blocks up to {KEEP_BYTES >> 20} MB reused"
    return _policy


def release_freed_memory() -> bool:
    """Give the heap's free pages back to the kernel (a no-op where keep_freed_memory changed nothing)."""
    if not _policy.startswith("freed blocks"):
        return False
    _glibc().malloc_trim(0)
    return True


def policy() -> str:
    """The allocation policy of this process, for benchmark records."""
    version = preloaded_mimalloc()
    if version is not None:
        return f"mimalloc {version} (preloaded, MIMALLOC_PURGE_DELAY={os.environ.get('MIMALLOC_PURGE_DELAY', '10')})"
    return f"LD_PRELOAD={os.environ['LD_PRELOAD']}" if "LD_PRELOAD" in os.environ else _policy
