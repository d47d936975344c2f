"""Progress marks: how the local launcher tells a busy worker from a stuck one.

A worker started by :func:`~torchpipedream.runtime.launch` gets one slot of a shared array; the
runtime writes the time into it whenever it finishes a unit of work (every action of a schedule,
every step of a checkpoint, every collective). The launcher reads the slots and stops the run
only when *no* worker has marked progress for its ``stall_timeout_s`` — a run that keeps working
is never cut short, however long it is. Outside such a worker (torchrun, a plain script)
:func:`mark` does nothing and costs a global lookup.

``time.monotonic`` is the clock: on Linux it is system-wide, so the launcher and its workers
read the same one.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["attach", "mark", "last_marks"]

_slot: tuple[Any, int] | None = None  # (shared array of doubles, this worker's index)


def attach(marks: Any, index: int) -> None:
    """Make :func:`mark` write into ``marks[index]`` (called once in a launched worker)."""
    global _slot
    _slot = (marks, index)
    marks[index] = time.monotonic()


def mark() -> None:
    """Record that this worker just made progress."""
    if _slot is not None:
        _slot[0][_slot[1]] = time.monotonic()


def last_marks(marks: Any) -> list[float]:
    """Seconds since each worker's last mark (for the launcher's messages)."""
    now = time.monotonic()
    return [now - float(t) for t in marks]
