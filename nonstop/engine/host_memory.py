"""Host memory reuse for the engine on the CPU backend.

Each decode step on the CPU backend allocates temporaries as large as the keys and values it
attends over (the block gather of the paged layout, the cache prefix of an attention bucket).
With glibc's defaults an allocation that large is served by a fresh `mmap` and handed back with
`munmap` when freed, so every step touches newly mapped pages and pays a page fault for each
4 KiB of them, in the kernel, on every layer. `keep_freed_host_memory` tells glibc to serve large
allocations from its heap and not to give freed memory back to the system, so the next step
reuses pages that are already mapped. The cost: the process's resident memory stays at its peak
instead of shrinking when buffers are freed.

It is process-wide and cannot be undone, so the engine applies it only on the CPU backend and
only when `EngineConfig.keep_host_memory` is true (the default).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_TRIM_THRESHOLD_BYTES = 1 << 30  # freed memory at the heap's top is kept up to this much

_lock = threading.Lock()
_applied: bool | None = None  # None: not tried yet


def keep_freed_host_memory() -> bool:
    """Make glibc's malloc keep and reuse freed memory; True where it took effect (once per
    process), False where the C library is not glibc or refused."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _keep_freed_memory()
        return _applied


def _keep_freed_memory() -> bool:
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return False
    # glibc only: other C libraries have no such knobs (musl's mallopt does nothing).
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    libc.mallopt.restype = ctypes.c_int
    # 1 is mallopt's success; both must hold for the pages to be kept.
    return (libc.mallopt(_M_MMAP_MAX, 0) == 1
            and libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES) == 1)
