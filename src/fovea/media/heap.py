"""Hand the C heap's free memory back to the system after a large decode (glibc; elsewhere a no-op).

A decoded 40-megapixel image is over 100 MB of PIL blocks (16 MiB each), freed once the image is
reduced. glibc keeps freed blocks of that size in the heap of the thread that freed them (its
threshold for mmap rises to 32 MiB after the first large free), and each decoding thread has a
heap (an "arena") of its own: freed memory then stays resident, scattered over the arenas, and a
burst of large images leaves the server larger after each round. ``malloc_trim(0)`` returns every
arena's free pages at once (madvise); it costs a walk of the free lists, so it runs only after a
large decode, not after every image.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("fovea.media")


def _glibc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        libc.gnu_get_libc_version  # only glibc has it (and malloc_trim)
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):
        log.debug("not glibc: freed image memory is returned as the C library sees fit")
        return None
    return libc


_LIBC = _glibc()


def release_free_memory() -> bool:
    """Give the heap's free pages back to the system; True where the C library can (glibc)."""
    if _LIBC is None:
        return False
    _LIBC.malloc_trim(0)
    return True
