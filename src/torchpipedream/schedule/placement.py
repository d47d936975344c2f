"""Placement rules shared by the schedule generators and the validator: which replica of a
stage runs a microbatch, which update its gradient joins, how deep each stage's warm-up is.

Plain functions of the plan and the kind's properties (see ``kinds.py``), so that the
generators (``build.py``) and the independent checks (``validate.py``) ask the same
questions without importing each other.
"""

from __future__ import annotations

import math

from ..plans.kinds import SCHEDULE_KINDS, SHARDING_KINDS_TEXT, ScheduleKind, VersionRule, schedule_kind
from ..plans.plan import Plan

__all__ = ["replica_of", "update_of", "num_updates", "warmup_depth", "interleaved_warmup", "v_shape_inflight",
           "tied_support_problem", "virtual_support_problem", "sharding_support_problem",
           "tensor_parallel_support_problem"]


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


def interleaved_warmup(plan: Plan, rank: int, microbatches: int) -> int:
    """Forwards a rank of an interleaved pipeline (p workers of v stages each) runs before its
    first backward in a batch of ``microbatches``: 2(p − r − 1) + (v − 1)p + 1, at most all
    of them (Narayanan et al., SC'21: the v − 1 earlier chunks of a round of p microbatches,
    then 1F1B's warm-up; twice it, because a rank's chunks alternate with its neighbours')."""
    p, v = plan.num_workers, plan.chunks
    return min(microbatches * v, 2 * (p - rank - 1) + (v - 1) * p + 1)


def v_shape_inflight(plan: Plan, microbatches: int) -> int:
    """Microbatch chunks a ZB-V worker (two stages in a V) holds at most, over both its stages:
    2p + 2 (p + 1 microbatches of its whole layers), at most the batch's two stages' worth."""
    return min(2 * microbatches, 2 * plan.num_workers + 2)


def virtual_support_problem(plan: Plan, kind: str | ScheduleKind) -> str | None:
    """Why this kind cannot run this plan's placement, or None: a plan putting several stages on
    one worker needs a kind with virtual stages, and those run one worker per stage."""
    info = schedule_kind(kind)
    if plan.virtual and not info.virtual_stages:
        virtual = ", ".join(k.name for k in SCHEDULE_KINDS.values() if k.virtual_stages)
        return (f"the plan puts several stages on one worker ({plan.summary}); {info.name} runs one stage per "
                f"worker: use {virtual}")
    replicated = next((s for s, st in enumerate(plan.stages) if st.replicas > 1), None)
    if info.virtual_stages and replicated is not None:
        return (f"{info.name} runs stages of one worker each; stage {replicated} has "
                f"{plan.stages[replicated].replicas} replicas: plan with straight=True, or use flush")
    return None


def tied_support_problem(plan: Plan, kind: str | ScheduleKind, vertical_sync: bool = False) -> str | None:
    """Why this kind cannot keep the copies of a shared parameter (``plan.tied``) equal, naming
    the parameter, or None: under round-robin kinds (pipedream, naive) every stage holding one
    must have a single replica (their updates cover other minibatches than the other stages'
    otherwise); naive and vertical sync define no version rule for them; with virtual stages
    a worker may hold one copy of it, not two (not yet)."""
    info = schedule_kind(kind)
    for t in plan.tied:
        twice = plan.worker_holding_twice(t)
        if plan.virtual and twice is not None:
            both = [s for s in t.stages if plan.stages[s].ranks[0] == twice]
            return (f"parameter {t.name!r} is shared by stages {t.stages}, and worker {twice} holds two of them "
                    f"({both}): a worker holding two copies of a shared parameter is not supported yet ({info.name}"
                    f"{' puts the first and last stage on one worker' if info.v_shape else ''}); use interleaved on "
                    "two or more workers, flush or zb-h1")
        if info.version_rule is VersionRule.NEWEST:
            return (f"parameter {t.name!r} is shared by stages {t.stages}: {info.name} keeps no version rule for "
                    "it; use pipedream, 2bw, flush or gpipe")
        if vertical_sync:
            return f"parameter {t.name!r} is shared by stages {t.stages}: vertical sync is not supported with it"
        replicated = [s for s in t.stages if plan.stages[s].replicas > 1]
        if info.round_robin and replicated:
            return (f"parameter {t.name!r} is shared by stages {t.stages}, and stage {replicated[0]} is replicated: "
                    f"under {info.name} its replicas update on other minibatches than the other stages; plan those "
                    "stages without replicas, or use 2bw, flush or gpipe")
    return None


def tensor_parallel_support_problem(plan: Plan, kind: str | ScheduleKind) -> str | None:
    """Why this kind cannot run the plan's tensor parallelism (``Plan.tensor_parallel``), or
    None. A tensor-parallel stage runs torch's DTensor layers with one weight version (the kinds
    that stash several are refused, as for sharding); a parameter shared across stages stays
    whole on each tensor rank, each rank's copy kept equal with its counterparts' by the TR
    actions (the runtime refuses a layout that splits it). Its replicas may replicate or shard
    (FSDP2 over the (data, tensor) mesh: ``sharding_support_problem``); a worker
    may hold several stages (interleaved, zb-v); the zero-bubble kinds' weight pass
    differentiates the DTensor parameters themselves (``TensorParallelWeights.tensors``)."""
    info = schedule_kind(kind)
    t = plan.tensor_parallel
    if t == 1:
        return None
    if info.asynchronous:
        return (f"tensor_parallel {t}: {info.name} is not supported with tensor parallelism yet (it keeps several "
                "weight versions); use flush, gpipe, interleaved or a zero-bubble kind")
    return None


def sharding_support_problem(plan: Plan, kind: str | ScheduleKind) -> str | None:
    """Why this kind cannot run the plan's sharded stages (``Stage.sharding``: FSDP2 over a
    stage's replicas), naming the stage, or None. Sharding needs one weight version per stage
    (FSDP2 shards the module's parameters, not stashes of older ones: pipedream, 2bw, zb-2bw
    and naive keep several). Under zb-h1 and zb-h2 a sharded stage's B runs its whole backward
    (FSDP2 reduces the weights' gradients when a backward ends) and its W is empty;
    a parameter shared by stages stays whole on each replica, outside FSDP2 (its copies are
    stepped by the TR actions, as on a replicated stage).
    Asks :func:`tensor_parallel_support_problem` first (the plan's third dimension)."""
    info = schedule_kind(kind)
    problem = tensor_parallel_support_problem(plan, info)
    sharded = [s for s, st in enumerate(plan.stages) if st.sharded]
    if problem or not sharded:
        return problem
    first = plan.stages[sharded[0]]
    if info.asynchronous:
        return (f"stage {sharded[0]} is sharded ({first.sharding}): {info.name} keeps several weight versions of a "
                f"stage, which torch's FSDP2 does not shard; use one of {SHARDING_KINDS_TEXT}, or sharding 'replicate'")
    return None
