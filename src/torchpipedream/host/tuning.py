"""Process-wide tuning for the processes torchpipedream starts, and only for those.

A CPU training process runs faster when its allocations use huge pages (``huge_pages.py``) and
when malloc keeps the memory its steps free for the next step (``freed_memory.py``). Both change
the whole process for its lifetime, so the library applies them only where the process is its
own: the ``torchpipedream`` command (``cli.console_main``), the workers that
:func:`~torchpipedream.runtime.launch` spawns, and the host measurements' spawned processes.
A caller's own process is changed only when the caller asks (``keep_freed_memory()``,
``Pipeline(..., tune_allocator=True)``). No torch import here.
"""

from __future__ import annotations

from .freed_memory import keep_freed_memory
from .huge_pages import prefer_huge_pages

__all__ = ["tune_own_process"]


def tune_own_process(huge_pages: bool = True, keep_freed: bool = True) -> None:
    """Apply the tuning in a process that torchpipedream started, before its first tensor
    (huge pages take effect only then). The user's environment wins: a ``THP_MEM_ALLOC_ENABLE``
    or malloc setting of theirs is kept, ``TORCHPIPEDREAM_KEEP_FREED_MEMORY=0`` turns the malloc
    part off."""
    if huge_pages:
        prefer_huge_pages()
    if keep_freed:
        keep_freed_memory()
