"""Hand the host allocator's free pages back to the operating system between phases.

On a CPU backend every device buffer is host memory from the C allocator. glibc's malloc keeps
the pages of freed buffers mapped (its dynamic mmap threshold moves large blocks into the heap
after the first free, and the heap is trimmed only from its top), so after the update the process
holds the update's whole working set as free heap, and the next phase (an evaluation with its KV
cache) grows on top of it: resident memory becomes the *sum* of the phases, not their maximum.
``malloc_trim(0)`` returns every whole free page of every arena (glibc >= 2.8, ``madvise``
``MADV_DONTNEED``), so calling it where one phase ends and another begins makes the peak the
largest phase's. Within a phase nothing changes: its own freed buffers are reused, which is
what keeps glibc fast (an allocator that returns pages on every free re-faults them on every step).

Elsewhere (jemalloc or tcmalloc preloaded, musl, macOS) the call does nothing and returns False.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Callable, Optional


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Optional[Callable[[int], int]]:
    """glibc's ``malloc_trim`` as the process resolves it, or None where the C library lacks it or
    a preloaded allocator replaces malloc (its ``malloc_trim`` would free nothing of ours)."""
    try:
        libc = ctypes.CDLL(None)  # the symbols the process links: a preloaded allocator's first
    except OSError:
        return None
    if not hasattr(libc, "malloc_trim") or _preloaded_allocator(libc):
        return None
    fn = libc.malloc_trim
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def _preloaded_allocator(libc) -> bool:
    """True when malloc is not glibc's (jemalloc / tcmalloc export these entry points)."""
    return any(hasattr(libc, name) for name in ("mallctl", "MallocExtension_ReleaseFreeMemory",
                                                  "tc_malloc"))


def release_free_memory() -> bool:
    """Return the C allocator's free pages to the OS (``malloc_trim(0)``).

    Call between phases, never inside a step's loop: it walks every arena and unmaps the free
    pages (its time grows with the pages returned; docs/log/2026-12.md) and the next phase re-faults
    the pages it then touches.

    Returns:
      True when glibc's ``malloc_trim`` ran and released memory, False when it released none or
      the process's allocator is not glibc's (no-op).
    """
    fn = _malloc_trim()
    return bool(fn(0)) if fn is not None else False
