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

Where the reduction can be taken exactly (``schedule.validate.update_barrier_problem``): every
rank must hold all of update ``t``'s gradients at its first step of ``t``, and the extra
collective must not deadlock the schedule. That holds for every kind with one stage per rank:
the synchronous ones at no cost (every rank reaches its update at the flush anyway), and
pipedream, 2bw and zb-2bw with a stall, since each stage's update ``t`` then waits for the
first stage's backward of ``t``. It fails for the kinds whose ranks hold several stages
(interleaved, zb-v: a later stage's update comes before an earlier stage's last backward on
the same rank), which are refused by name.
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
        total: ``total(local squared norm) -> the sum over every rank`` (a collective; identity
            in one process).
        timeout_s: the deadline of waiting for a shared parameter's posted all-reduce.
    """

    def __init__(self, max_norm: float, parts: list[NormPart], total: Callable[[torch.Tensor], torch.Tensor],
                 timeout_s: float) -> None:
        self.max_norm = max_norm
        self.parts = parts
        self._total = total
        self.timeout_s = timeout_s
        self.norms: list[float] = []  # every update's norm, before clipping (NaN: a skipped update)
        self._factors: dict[int, float] = {}

    def begin(self) -> None:
        """A new schedule starts (its update ids start at 0 again)."""
        self._factors = {}

    def factor(self, update: int, unscale: float, apply: bool) -> float:
        """What multiplies update ``update``'s gradient on this rank (1 when not clipped).
        ``unscale`` undoes float16's loss scale; an update skipped by every rank (``apply``
        False) takes no norm (every rank skips it, so no rank waits in the collective)."""
        if update not in self._factors:
            if not apply:
                self.norms.append(math.nan)
                self._factors[update] = 1.0
            else:
                local = torch.zeros((), dtype=torch.float64)
                for part in self.parts:
                    local = local + part.weights.squared_norm(unscale, self.timeout_s, part.posted) * part.share
                norm = math.sqrt(max(0.0, float(self._total(local))))
                self.norms.append(norm)
                self._factors[update] = min(1.0, self.max_norm / (norm + EPSILON))
        return self._factors[update]
