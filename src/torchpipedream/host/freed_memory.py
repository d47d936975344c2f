"""Keep the memory of freed tensors in the process, so that the next step reuses it without
page faults (glibc's malloc, on Linux).

A training step frees and re-allocates the same buffers every microbatch: activations,
gradients, message buffers. glibc serves a large request with its own ``mmap`` and gives it
back to the kernel at ``free``, and trims the top of its heap whenever the free space there
passes a threshold that follows the largest buffer freed so far; PyTorch's 2 MiB-aligned
huge-page requests never settle into the heap at all. Either way the next allocation of the
same size touches fresh pages, and the kernel zeroes each one on its first touch.

:func:`keep_freed_memory` fixes both thresholds with ``mallopt``: requests below
``mmap_threshold`` come from the heap, and the heap's top is given back only beyond
``trim_threshold``. Measured on this project's 2-core machine (torch 2.13, one thread, huge
pages on, one training step of compare.py's models, glibc's defaults against these
thresholds, alternating processes): the small CNN on 16 samples 41-57 ms with 3,700-10,000
page faults and 8-20 ms of kernel time, against 31 ms with none; on 64 samples 158 against
141 ms; the transformer LM on 16 sequences 61 against 55 ms; the FC-heavy model on 16
samples 113 against 103 ms. The threshold is 16 MiB, not more: with every buffer on the
heap (1 GiB) the FC-heavy model's long-lived 16-64 MiB weight versions and gradients
fragmented it, and the peak RSS of its 2bw ranks grew from 722-744 MB to 939-1,164 MB (at
16 MiB: 724-820 MB) for no measurable speed; below 16 MiB (4 MiB) the small CNN's 8 MiB
activations at 64 samples went back to faulting. The process keeps its peak heap, which a
training process reaches again every step.

It acts on the calling process, at once and for the rest of its life, so torchpipedream calls it
only in processes it owns (``tuning.tune_own_process``: the command line, the workers of
:func:`~torchpipedream.runtime.launch`, the host measurements' processes). In a process of
your own (under torchrun, in a notebook) it is your choice: ``torchpipedream.keep_freed_memory()``
or ``Pipeline(..., tune_allocator=True)``. Settings the user made (``MALLOC_*_`` variables, or
malloc tunables in ``GLIBC_TUNABLES``) are kept, and ``TORCHPIPEDREAM_KEEP_FREED_MEMORY=0``
turns it off. No torch import here.
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


def keep_freed_memory(mmap_threshold: int = 16 << 20, trim_threshold: int = _INT_MAX) -> bool:
    """Make this process's malloc keep freed memory for reuse (see the module docstring).

    Args:
        mmap_threshold: requests of at least this many bytes still get their own ``mmap``
            (and return to the kernel when freed); default 16 MiB (see the module docstring).
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
    # glibc before 2.26 refuses mmap thresholds above 32 MiB on 64-bit systems
    if not (mallopt(_M_MMAP_THRESHOLD, mmap_threshold) and mallopt(_M_TRIM_THRESHOLD, trim_threshold)):
        logger.debug("mallopt refused mmap threshold %d or trim threshold %d", mmap_threshold, trim_threshold)
        return False
    _applied = (mmap_threshold, trim_threshold)
    logger.info("this process's malloc now keeps freed memory for reuse (mmap threshold %d, trim threshold %d "
                "bytes; process-wide, for its lifetime)", *_applied)
    return True
