"""Clipping by the global gradient norm (``Pipeline(clip_grad_norm=)``): the norm over *all*
the model's gradients, as ``torch.nn.utils.clip_grad_norm_`` takes it in one process.

Each rank holds a part of the model, so the norm is a sum over ranks: at its first step (U or
TR) of update ``t``, every rank adds up the squared norms of the gradients it is about to
apply (``WeightVersions.squared_norm``: after the replicas' all-reduce, divided by the
update's samples), each counted once in the whole pipeline: a replicated stage's gradient is
the same on each of its replicas (each adds its share, 1 / replicas), and a shared parameter's
summed gradient the same on each rank holding a copy (each adds 1 / copies). One all-reduce
over every rank makes the total; every rank then multiplies the update's gradients by
``min(1, max_norm / (norm + 1e-6))`` (torch's coefficient) before its optimizer steps.

The all-reduce is started at the rank's first step of the update and waited for only when the
update's weights are needed (``WeightVersions.defer``): a stage defers its step until the
first forward or backward that uses the weights it produces. Under 2bw and zb-2bw those are
the next batch but one's, so by then every stage has long finished its backward of the update
and nothing waits; the synchronous kinds reach the update at the flush anyway; under pipedream,
whose next forward uses the new weights at once, update ``t`` waits for the first stage's
backward of ``t`` (the price of exactness, benchmarks/clipping.py).

Where the reduction can be taken exactly (``schedule.validate.update_barrier_problem``): every
rank must hold all of update ``t``'s gradients at its first step of ``t``, and the extra
collective must not deadlock the schedule. That holds for every kind with one stage per rank.
It fails for the kinds whose ranks hold several stages (interleaved, zb-v: a later stage's
update comes before an earlier stage's last backward on the same rank), which are refused by
name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from .weights import WeightVersions

__all__ = ["GradientClipper", "NormPart", "check_max_norm"]

#: torch.nn.utils.clip_grad_norm_'s guard against a zero norm.
EPSILON = 1e-6


def check_max_norm(value: object) -> float | None:
    """``Pipeline(clip_grad_norm=)`` checked: None, or a positive finite number."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"clip_grad_norm must be a positive finite number (the largest gradient norm), got {value!r}")
    return float(value)


@dataclass
class NormPart:
    """A gradient this rank applies, and the share of its squared norm it adds to the total."""

    weights: WeightVersions
    share: float  # 1 / the ranks that apply the same gradient
    posted: bool = False  # a shared parameter's copy: its gradient is the posted all-reduce's sum


class GradientClipper:
    """One rank's side of the global norm: computed once per update, at the rank's first step
    of it, and remembered for its other stages' steps of the same update.

    Args:
        max_norm: the largest norm an update applies.
        parts: the gradients this rank applies (its stages', its shared parameters' copies).
        start: ``start(local squared norm) -> wait``: starts the sum over every rank (a
            collective) and returns the function that waits for it and returns the sum.
        timeout_s: the deadline of waiting for a shared parameter's posted all-reduce.
    """

    def __init__(self, max_norm: float, parts: list[NormPart],
                 start: Callable[[torch.Tensor], Callable[[], torch.Tensor]], timeout_s: float) -> None:
        self.max_norm = max_norm
        self.parts = parts
        self._start = start
        self.timeout_s = timeout_s
        self._norms: list[float] = []  # earlier schedules' updates' norms, in order
        self._current: dict[int, float] = {}  # this schedule's, by update (they may resolve out of order)
        self._factors: dict[int, float] = {}
        self._waiting: dict[int, Callable[[], torch.Tensor]] = {}

    def begin(self) -> None:
        """A new schedule starts (its update ids start at 0 again)."""
        if self._waiting:
            raise RuntimeError(f"updates {sorted(self._waiting)} took a norm that nothing waited for")
        self._norms += [self._current[u] for u in sorted(self._current)]
        self._current, self._factors = {}, {}

    @property
    def norms(self) -> list[float]:
        """Every update's norm so far, before clipping, in update order (NaN: a skipped update)."""
        return self._norms + [self._current[u] for u in sorted(self._current)]

    def start(self, update: int, unscale: float, apply: bool) -> None:
        """At the rank's first step of ``update``: start summing its squared norm over every rank
        (once; later calls for the same update do nothing). ``unscale`` undoes float16's loss
        scale; an update skipped by every rank (``apply`` False) takes no norm (every rank skips
        it, so no rank waits in the collective)."""
        if update in self._factors or update in self._waiting:
            return
        if not apply:
            self._current[update] = math.nan
            self._factors[update] = 1.0
            return
        local = torch.zeros((), dtype=torch.float64)
        for part in self.parts:
            posted = update if part.posted else None  # a shared parameter: its sum posted for this update
            local = local + part.weights.squared_norm(unscale, self.timeout_s, posted) * part.share
        self._waiting[update] = self._start(local)

    def factor(self, update: int) -> float:
        """What multiplies update ``update``'s gradient on this rank (1 when not clipped); waits
        for the norm :meth:`start` started."""
        if update not in self._factors:
            norm = math.sqrt(max(0.0, float(self._waiting.pop(update)())))
            self._current[update] = norm
            self._factors[update] = min(1.0, self.max_norm / (norm + EPSILON))
        return self._factors[update]
