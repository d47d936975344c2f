"""When each action of a schedule ran, timed where the work runs, with one synchronisation
per schedule at most.

On the CPU an action's work is done when its call returns, so the host clock
(``time.perf_counter``) times it, read at once: :attr:`ActionClock.mark` *is*
``time.perf_counter``, as cheap as before there was a clock. On a CUDA device the call returns
once its kernels are queued, so the host clock would time the launches, not the work: there
each mark records a ``torch.cuda.Event(enable_timing=True)`` on the current stream, and
:meth:`ActionClock.seconds` converts them once, after the schedule, with one synchronize:
relative to a reference event recorded when the clock started, whose host time is known.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

__all__ = ["ActionClock", "event_seconds"]


def event_seconds(reference: Any, reference_s: float, events: Sequence[Any]) -> list[float]:
    """Times of ``events`` in seconds on the host clock's scale: ``reference_s`` (the reference
    event's time) plus each event's ``reference.elapsed_time(event)`` (milliseconds, CUDA's unit)."""
    return [reference_s + reference.elapsed_time(e) / 1000.0 for e in events]


class ActionClock:
    """Marks of the start and end of actions, converted to seconds since ``t0`` (a
    ``time.perf_counter`` reading) by :meth:`seconds`.

    Args:
        device: the device the actions compute on (CUDA: events; anything else: the host clock).
        t0: the common start of the schedule's times.
        new_event: makes a timing event (default ``torch.cuda.Event(enable_timing=True)``;
            tests pass a stand-in).
        synchronize: waits for every recorded event (default ``torch.cuda.synchronize(device)``).
    """

    def __init__(self, device: torch.device | str, t0: float, new_event: Callable[[], Any] | None = None,
                 synchronize: Callable[[], None] | None = None) -> None:
        self.device = torch.device(device)
        self.t0 = t0
        self._reference: Any = None
        #: ``mark()`` -> a mark of now: a perf_counter reading, or a recorded event on CUDA.
        self.mark: Callable[[], Any] = time.perf_counter
        if self.device.type == "cuda" or new_event is not None:
            self._new_event = new_event or (lambda: torch.cuda.Event(enable_timing=True))
            self._synchronize = synchronize or (lambda: torch.cuda.synchronize(self.device))
            self._reference = self._record()
            self._reference_s = time.perf_counter() - t0
            self.mark = self._record

    @property
    def uses_events(self) -> bool:
        """True when marks are device events (converted by :meth:`seconds`)."""
        return self._reference is not None

    def _record(self) -> Any:
        event = self._new_event()
        event.record()
        return event

    def seconds(self, marks: Sequence[Any]) -> list[float]:
        """Each mark in seconds since ``t0``; with events, after one synchronize."""
        if self._reference is None:
            t0 = self.t0
            return [m - t0 for m in marks]
        self._synchronize()
        return event_seconds(self._reference, self._reference_s, marks)
