"""Keep freed memory in the process on CPU instead of returning it to the OS.

glibc serves every allocation above a threshold (at most 32 MB) with a fresh ``mmap`` and unmaps it
on free, so each training step page-faults its large activations (and the token copies of an MoE
layer, T * K rows of width D) in again: gathering 32k rows of 512 floats took 40 ms into fresh
memory and 11 ms into reused memory on a 2-core machine. Turning off mmap-backed allocations and
heap trimming makes the second and later steps reuse the same pages, as CUDA's caching allocator
does on GPUs. The cost is that the process keeps its peak heap size.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("moe")

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4


def keep_freed_memory() -> bool:
    """Configure glibc malloc to reuse freed memory; False where glibc is not the allocator
    (another libc, or an allocator such as tcmalloc preloaded, which caches already)."""
    name = ctypes.util.find_library("c")
    if not name:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = all(
        mallopt(opt, val) == 1
        for opt, val in ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, 2**31 - 1), (_M_TOP_PAD, 64 << 20))
    )
    if not ok:
        log.warning("could not configure malloc to keep freed memory; continuing without")
    return ok
