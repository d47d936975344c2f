"""Transparent huge pages for PyTorch's CPU allocations, on in the processes torchpipedream starts.

A backward allocates every weight gradient afresh (``zero_grad`` frees the last one) and the
engine allocates activations and message buffers per microbatch; on 4 KiB pages each fresh
megabyte costs 256 page faults on first touch. Measured on this project's 2-core machine
(torch 2.13, one thread): the 4096×4096 weight gradient's matrix product takes 54 ms into new
memory, 28 ms into reused memory and 31 ms into new memory advised as huge pages (544 page
faults instead of 16,385). PyTorch has the switch (``THP_MEM_ALLOC_ENABLE=1``: buffers of 2 MiB
and more are madvised ``MADV_HUGEPAGE``), read once, at a process's first CPU allocation
(``import torch`` allocates nothing, so a process may set it after importing torch).

Only processes torchpipedream owns turn it on (``tuning.tune_own_process``): the command line,
the workers of :func:`~torchpipedream.runtime.launch` and the host measurements' processes. A
value the user set (``0`` included) is kept. No torch import here.
"""

from __future__ import annotations

import os
from typing import MutableMapping

__all__ = ["HUGE_PAGES_ENV", "prefer_huge_pages", "huge_pages_on"]

#: PyTorch's switch for huge-page CPU allocations.
HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"


def huge_pages_on(environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether ``environ`` (default ``os.environ``) turns huge-page allocation on."""
    env = os.environ if environ is None else environ
    return env.get(HUGE_PAGES_ENV, "0").strip() not in ("", "0")


def prefer_huge_pages(environ: MutableMapping[str, str] | None = None) -> bool:
    """Turn huge-page allocation on in ``environ`` (default ``os.environ``) unless the user
    set it either way; returns whether it is on. It takes effect in processes started
    afterwards, and in this one only if it has not allocated a tensor yet."""
    env = os.environ if environ is None else environ
    env.setdefault(HUGE_PAGES_ENV, "1")
    return huge_pages_on(env)
