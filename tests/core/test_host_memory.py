"""release_free_memory against the process's real glibc malloc: free heap pages held after a
phase are handed back to the OS."""

import ctypes

import pytest

from mempo_jax.core import host_memory

MIB = 1 << 20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(host_memory._malloc_trim() is None, reason="the C allocator is not glibc's (no malloc_trim)")
def test_free_heap_between_phases_is_returned():
    libc = ctypes.CDLL(None)
    libc.malloc.argtypes, libc.malloc.restype = [ctypes.c_size_t], ctypes.c_void_p
    libc.free.argtypes, libc.free.restype = [ctypes.c_void_p], None
    # One mmapped 24 MiB block freed raises glibc's dynamic mmap threshold above 16 MiB: the
    # blocks below then come from the heap, like an XLA:CPU phase's buffers after its first step.
    libc.free(libc.malloc(24 * MIB))
    blocks = [libc.malloc(16 * MIB) for _ in range(17)]
    for b in blocks:
        ctypes.memset(b, 1, 16 * MIB)
    pin = blocks.pop()  # kept above the others: their pages are not the heap's top, so free() keeps them
    held = _rss_bytes()
    for b in blocks:
        libc.free(b)
    kept = _rss_bytes()
    try:
        assert kept > held - 64 * MIB, "glibc returned the freed blocks by itself: nothing to test"
        assert host_memory.release_free_memory() is True
        assert _rss_bytes() < kept - 192 * MIB  # of the 256 MiB freed, at least 3/4 is returned
    finally:
        libc.free(pin)


def test_no_op_without_glibc(monkeypatch):
    host_memory._malloc_trim.cache_clear()
    monkeypatch.setattr(host_memory, "_preloaded_allocator", lambda libc: True)  # as under jemalloc
    try:
        assert host_memory._malloc_trim() is None
        assert host_memory.release_free_memory() is False
    finally:
        host_memory._malloc_trim.cache_clear()
