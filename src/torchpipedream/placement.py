"""Placement rules shared by the schedule generators and the validator: which replica of a
stage runs a microbatch, which update its gradient joins, how deep each stage's warm-up is.

Plain functions of the plan and the kind's properties (see ``kinds.py``), so that the
generators (``schedules.py``) and the independent checks (``validate.py``) ask the same
questions without importing each other.
"""

from __future__ import annotations

import math

from .kinds import ScheduleKind, schedule_kind
from .plans import Plan

__all__ = ["replica_of", "update_of", "num_updates", "warmup_depth"]


def replica_of(plan: Plan, stage: int, microbatch: int) -> int:
    """Replica of ``stage`` that runs ``microbatch`` (forward and backward): ``microbatch mod r``.

    Round robin over the global microbatch id for every kind (1F1B-RR for pipedream, where a
    microbatch is a minibatch). For the microbatched kinds this equals "microbatch j of a batch
    → replica j mod r" when r divides m, and otherwise keeps every replica busy and the
    rank-local order consistent across batches (per-batch j mod r deadlocks 2bw when r ∤ m).
    """
    return microbatch % plan.stages[stage].replicas


def update_of(plan: Plan, kind: str | ScheduleKind, stage: int, microbatch: int, microbatches: int) -> int:
    """Index u of the optimizer step of ``stage`` that ``microbatch``'s gradient goes into."""
    if schedule_kind(kind).round_robin:
        return microbatch // plan.stages[stage].replicas
    return microbatch // microbatches


def num_updates(plan: Plan, kind: str | ScheduleKind, stage: int, minibatches: int) -> int:
    """Number of optimizer steps stage ``stage`` takes over ``minibatches`` minibatches."""
    if schedule_kind(kind).round_robin:
        return math.ceil(minibatches / plan.stages[stage].replicas)
    return minibatches


def warmup_depth(plan: Plan, stage: int) -> int:
    """Forwards a replica of ``stage`` runs before its first backward in 1F1B.

    ⌈(workers in stages ≥ stage) / replicas of stage⌉: n − s for a straight pipeline
    (0-indexed s), NOAM = ⌈workers / input replicas⌉ for the input stage — enough
    minibatches in flight to keep every downstream worker busy.
    """
    downstream = sum(st.replicas for st in plan.stages[stage:])
    return math.ceil(downstream / plan.stages[stage].replicas)
