"""Keep the memory of freed tensors in the process, so that the next step reuses it without
page faults (glibc's malloc, on Linux).

A training step frees and re-allocates the same buffers every microbatch: activations,
gradients, message buffers. glibc serves a large request with its own ``mmap`` and gives it
back to the kernel at ``free``, and trims the top of its heap whenever the free space there
passes a threshold that follows the largest buffer freed so far; either way the next
allocation of the same size touches fresh pages, and the kernel zeroes each one on its first
touch. Measured on this project's 2-core machine (torch 2.13, one thread, huge pages on,
compare.py's small CNN, one training step on 16 samples): 3,700-8,100 page faults and
8-19 ms of kernel time per 41-53 ms step; with the thresholds below, 0-40 faults, no kernel
time and 33 ms. The transformer LM gains 5-10%; the FC-heavy model, whose 64 MB gradients
already sit on huge pages, about as much as the machine's noise.

:func:`keep_freed_memory` raises both thresholds with ``mallopt``: requests below
``mmap_threshold`` come from the heap, and the heap's top is given back only beyond
``trim_threshold``. The process then holds on to its peak heap, which a training process
reaches again every step anyway. It acts on the calling process only and at once, so the
launcher's workers, :class:`~torchpipedream.runtime.Pipeline` (for workers that torchrun
starts) and the command line each call it. Settings the user made (``MALLOC_*`` or
``GLIBC_TUNABLES`` malloc tunables in the environment) are kept, and
``TORCHPIPEDREAM_KEEP_FREED_MEMORY=0`` turns it off. No torch import here.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from typing import Mapping

__all__ = ["KEEP_FREED_MEMORY_ENV", "keep_freed_memory", "user_tuned_malloc"]

logger = logging.getLogger(__name__)

#: Set to ``0`` to leave glibc's malloc as it is.
KEEP_FREED_MEMORY_ENV = "TORCHPIPEDREAM_KEEP_FREED_MEMORY"

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
_INT_MAX = 2**31 - 1  # mallopt takes a C int
_FALLBACK_MMAP_THRESHOLD = 32 << 20  # the largest glibc accepted before 2.26 on 64-bit
_USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")

_applied: tuple[int, int] | None = None


def user_tuned_malloc(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``environ`` (default ``os.environ``) sets glibc's malloc thresholds itself."""
    env = os.environ if environ is None else environ
    return any(k in env for k in _USER_VARIABLES) or "glibc.malloc." in env.get("GLIBC_TUNABLES", "")


def _glibc() -> ctypes.CDLL | None:
    """This process's C library if it is glibc (which has ``mallopt``), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # absent from musl and other C libraries
        return libc
    except (OSError, AttributeError):
        return None


def keep_freed_memory(mmap_threshold: int = 1 << 30, trim_threshold: int = _INT_MAX) -> bool:
    """Make this process's malloc keep freed memory for reuse (see the module docstring).

    Args:
        mmap_threshold: requests of at least this many bytes still get their own ``mmap``
            (and return to the kernel when freed); default 1 GiB.
        trim_threshold: free bytes at the heap's top beyond which malloc gives them back;
            default (and at most) 2 GiB - 1.

    Returns whether the thresholds are in effect: False off Linux/glibc, when the user's
    environment sets malloc's thresholds or ``TORCHPIPEDREAM_KEEP_FREED_MEMORY=0``.
    Calling it again is free.
    """
    global _applied
    if os.environ.get(KEEP_FREED_MEMORY_ENV, "1").strip() == "0" or user_tuned_malloc():
        return False
    if not (0 < mmap_threshold <= _INT_MAX and 0 < trim_threshold <= _INT_MAX):
        raise ValueError(f"thresholds must be in 1..{_INT_MAX} bytes (mallopt takes an int), "
                         f"got mmap_threshold={mmap_threshold}, trim_threshold={trim_threshold}")
    if _applied == (mmap_threshold, trim_threshold):
        return True
    libc = _glibc()
    if libc is None:
        logger.debug("not glibc: malloc left as it is")
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if not mallopt(_M_MMAP_THRESHOLD, mmap_threshold):
        mmap_threshold = min(mmap_threshold, _FALLBACK_MMAP_THRESHOLD)
        if not mallopt(_M_MMAP_THRESHOLD, mmap_threshold):
            logger.debug("mallopt refused the mmap threshold: malloc left as it is")
            return False
    if not mallopt(_M_TRIM_THRESHOLD, trim_threshold):
        logger.debug("mallopt refused the trim threshold")
        return False
    _applied = (mmap_threshold, trim_threshold)
    logger.debug("malloc keeps freed memory: mmap threshold %d, trim threshold %d bytes", *_applied)
    return True
