"""Building a schedule: a Plan in, a Schedule (one ordered action list per rank) out.

Every schedule is built in three passes over plain data, each small enough to read:

1. **compute order** — for every rank, the order of its forwards and backwards, from the
   microbatches that the placement rule sends to it: the generator the kind names
   (``ScheduleKind.order``), in ``schedule/orders.py``;
2. **updates** — ``AR u`` (replicated stages) and ``U u`` after the rank's last backward
   contributing to update u (and, on a stage sharded "zero1", the gather ``UN u`` before its
   first forward of u, the reduce-scatter ``RD u`` after its last backward and the reshard
   ``RS u``), then weight versions per the kind's semantics;
3. **lowering** — ``SA``/``RA`` around every forward and ``SG``/``RG`` around every
   backward, with the peer rank that ran (or will run) the same microbatch.

The kinds and their meaning are in docs/architecture.md ("Schedule semantics"). The
simulator and the runtime interpret the result and contain no schedule logic of their own;
:func:`~torchpipedream.schedule.validate.validate_schedule` proves a schedule before it runs.

Example::

    plan = Plan.straight([["a"], ["b"], ["c"], ["d"]])
    sched = build_schedule(plan, "pipedream", minibatches=8)
    print(" ".join(map(str, sched.actions[0])))
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

from ..plans.kinds import UnknownKindError, VersionRule, schedule_kind
from ..plans.plan import Plan, PlanError
from .actions import Action, Kind, Schedule
from .orders import BuildContext, ComputeItem, ComputeOrder, ScheduleBuildError, order_function
from .placement import (num_updates, replica_of, sharding_support_problem, tied_support_problem, update_of,
                        virtual_support_problem)

__all__ = ["build_schedule", "schedule_from_order", "ScheduleBuildError"]


# --------------------------------------------------------------------- pass 2: updates, versions
def _add_updates(ctx: BuildContext, stage: int, items: list[ComputeItem]) -> list[ComputeItem | tuple[str, int]]:
    """Insert ("AR", u) / ("U", u) after the rank's last backward of each update u.

    A replica with no backward in update u (e.g. the last, partial round) still takes part in
    the all-reduce and the step (contributing a zero gradient), right after its previous step.
    """
    plan, kind, m = ctx.plan, ctx.kind, ctx.microbatches
    replicated = plan.stages[stage].replicas > 1
    updates = num_updates(plan, kind, stage, ctx.minibatches)
    last_backward: dict[int, int] = {}  # the last B, or W where the backward is split
    for pos, item in enumerate(items):
        if item.kind is Kind.BACKWARD or item.kind is Kind.WEIGHT_GRAD:
            last_backward[update_of(plan, kind, stage, item.microbatch, m)] = pos
    after: dict[int, list[int]] = {}
    prev = -1
    for u in range(updates):
        pos = last_backward.get(u, prev)
        pos = max(pos, prev)
        after.setdefault(pos, []).append(u)
        prev = pos
    out: list[ComputeItem | tuple[str, int]] = []
    for u in after.get(-1, []):
        out += ([("AR", u)] if replicated else []) + [("U", u)]
    for pos, item in enumerate(items):
        out.append(item)
        for u in after.get(pos, []):
            out += ([("AR", u)] if replicated else []) + [("U", u)]
    return out


def _add_gathers(ctx: BuildContext, stage: int, items: list) -> list:
    """A stage sharded "zero1" (``Stage.sharding``): for each update u, ("UN", u) gathers its
    weights right before its first forward of u; ("RD", u) reduce-scatters the gradient right
    after its last backward of u (FSDP2 reduces from that backward's hooks, so nothing may run
    between them); ("RS", u) frees the gathered weights after its last B or W of u, before
    the update's AR and U. Other stages gather inside every F and B (FSDP2's hooks) or not at all."""
    st = ctx.plan.stages[stage]
    if st.sharding != "zero1":
        return items
    plan, kind, m = ctx.plan, ctx.kind, ctx.microbatches
    first: dict[int, int] = {}
    last_b: dict[int, int] = {}
    last: dict[int, int] = {}
    for pos, item in enumerate(items):
        if isinstance(item, ComputeItem):
            u = update_of(plan, kind, stage, item.microbatch, m)
            first.setdefault(u, pos)
            last[u] = pos
            if item.kind is Kind.BACKWARD:
                last_b[u] = pos
    before: dict[int, list] = {}
    after: dict[int, list] = {}
    for u in first:
        before.setdefault(first[u], []).append(("UN", u))
        after.setdefault(last_b[u], []).append(("RD", u))
        after.setdefault(last[u], []).append(("RS", u))
    out: list = []
    for pos, item in enumerate(items):
        out += before.get(pos, [])
        out.append(item)
        out += after.get(pos, [])
    return out


def _add_tied(ctx: BuildContext, stage: int, items: list) -> list:
    """Insert the exchange of every shared parameter ``k`` this stage holds (``plan.tied``):
    ("TP", u, k) posts the stage's gradient of update u (a non-blocking all-reduce with every
    stage holding a copy) once the stage's backwards of update u are done; ("TR", u, k) waits for
    it and steps the parameter, before the first forward that uses the new version:

    * flush, gpipe (``BATCH``): both right before ``U u``: every use of batch t sees version t.
    * 2bw (``PREVIOUS_BATCH``): TP with ``U u``; TR right before the first forward of batch
      u + 2, the first that uses version u + 1.
    * pipedream (``STASHED``): TP right after ``U u``; TR after ``U u+d+1`` with d = stage −
      (first holding stage): the backward of minibatch u reaches the first holding stage about
      d steps after this one, and the extra step hides the all-reduce itself, so no stage waits.
      A use's version is the number of its stage's TR steps before the forward.
    """
    plan, kind, m = ctx.plan, ctx.kind, ctx.microbatches
    held = plan.tied_at(stage)
    if not held:
        return items
    updates = num_updates(plan, kind, stage, ctx.minibatches)
    update_at = {item[1]: pos for pos, item in enumerate(items) if isinstance(item, tuple) and item[0] == "U"}
    before: dict[int, list] = {}  # position -> items to insert before it
    end: list = []

    def put(pos: int | None, item: tuple) -> None:
        (before.setdefault(pos, []) if pos is not None else end).append(item)

    for k in held:
        for u in range(updates):
            if kind.version_rule is VersionRule.BATCH:
                put(update_at[u], ("TP", u, k))
                put(update_at[u], ("TR", u, k))
            elif kind.version_rule is VersionRule.PREVIOUS_BATCH:
                put(update_at[u], ("TP", u, k))
                first_f = next((pos for pos, item in enumerate(items) if isinstance(item, ComputeItem)
                                and item.kind is Kind.FORWARD and item.microbatch // m == u + 2), None)
                put(first_f, ("TR", u, k))
            else:  # STASHED
                lag = stage - plan.tied[k].stages[0] + 1
                put(update_at[u] + 1, ("TP", u, k))
                later = update_at.get(u + lag)
                put(later + 1 if later is not None else None, ("TR", u, k))
    rank_of = {"TP": 0, "TR": 1}
    order = lambda t: (t[1], rank_of[t[0]], t[2])  # noqa: E731 - update, post before wait, parameter
    out: list = []
    for pos, item in enumerate(items):
        out += sorted(before.get(pos, []), key=order)
        out.append(item)
    out += sorted(before.get(len(items), []) + end, key=order)
    return out


def _versions(ctx: BuildContext, order: dict[tuple[int, int], list[ComputeItem | tuple[str, int]]]) -> dict[tuple[int, int], dict[tuple[Kind, int], int]]:
    """Weight version of every F and B, per the kind's semantics (docs/architecture.md)."""
    kind, m = ctx.kind, ctx.microbatches
    out: dict[tuple[int, int], dict[tuple[Kind, int], int]] = {}
    for key, items in order.items():
        versions: dict[tuple[Kind, int], int] = {}
        steps = 0
        for item in items:
            if isinstance(item, tuple):
                steps += item[0] == "U"
                continue
            rule = kind.version_rule
            if rule is VersionRule.BATCH:
                versions[(item.kind, item.microbatch)] = item.microbatch // m
            elif rule is VersionRule.PREVIOUS_BATCH:
                versions[(item.kind, item.microbatch)] = max(0, item.microbatch // m - 1)
            elif rule is VersionRule.NEWEST or item.kind is Kind.FORWARD:
                versions[(item.kind, item.microbatch)] = steps
            else:  # STASHED: the backward (B and W) uses its forward's version
                versions[(item.kind, item.microbatch)] = versions[(Kind.FORWARD, item.microbatch)]
        out[key] = versions
    if ctx.vertical_sync:
        _apply_vertical_sync(ctx, order, out)
    return out


def _apply_vertical_sync(ctx: BuildContext, order: dict, versions: dict) -> None:
    """Every stage uses, for minibatch t, the weights that include exactly the updates the input
    stage's version for t includes: stage s takes ⌊v0(t)·r0 / r_s⌋ (v0(t) for straight pipelines,
    = max(0, t − n + 1))."""
    plan = ctx.plan
    r0 = plan.stages[0].replicas
    v0 = {}
    for replica in range(r0):
        for (k, microbatch), v in versions[(0, replica)].items():
            if k is Kind.FORWARD:
                v0[microbatch] = v
    for (s, replica), items in order.items():
        rs = plan.stages[s].replicas
        steps = 0
        for item in items:
            if isinstance(item, tuple):
                steps += item[0] == "U"
                continue
            v = (v0[item.microbatch] * r0) // rs
            if item.kind is Kind.FORWARD and v > steps:
                raise ScheduleBuildError(
                    f"vertical sync: stage {s} would need weight version {v} for minibatch {item.microbatch} "
                    f"but has only taken {steps} steps; use vertical_sync=False for this plan ({plan.config})"
                )
            versions[(s, replica)][(item.kind, item.microbatch)] = v


# --------------------------------------------------------------------- pass 3: lowering
def _lower(ctx: BuildContext, order: dict, versions: dict) -> dict[int, list[Action]]:
    """Turn compute items into actions with the transfers around them, then each rank's list:
    its stage's actions, or where a rank holds several stages their segments (one per compute
    item, with the updates that follow it) in the rank's order (``ctx.rank_order``). A
    transfer between two stages of one rank names that rank as its peer."""
    plan = ctx.plan
    n = plan.num_stages

    def rank(stage: int, microbatch: int) -> int:
        return plan.stages[stage].ranks[replica_of(plan, stage, microbatch)]

    segments: dict[tuple[int, int], list[list[Action]]] = {}
    for (s, replica), items in order.items():
        replica_segments: list[list[Action]] = [[]]  # [0]: what runs before the first compute item
        for item in items:
            out = replica_segments[-1]
            if isinstance(item, tuple):
                if item[0] == "TP":
                    out.append(Action(s, Kind.TIED_POST, item[1], replica=replica, tie=item[2]))
                    continue
                if item[0] == "TR":
                    out.append(Action(s, Kind.TIED_REDUCE, item[1], replica=replica, version=item[1] + 1, tie=item[2]))
                    continue
                if item[0] in ("UN", "RD", "RS"):
                    gather = Action(s, Kind(item[0]), item[1], replica=replica)
                    if item[0] == "RD":  # right after the B whose hooks reduce (before its SG)
                        out.insert(next(k for k, a in enumerate(out) if a.kind is Kind.BACKWARD) + 1, gather)
                    else:
                        out.append(gather)
                    continue
                k = Kind.ALLREDUCE if item[0] == "AR" else Kind.OPTIMIZER_STEP
                out.append(Action(s, k, item[1], replica=replica,
                                  version=item[1] + 1 if k is Kind.OPTIMIZER_STEP else None))
                continue
            out = []
            replica_segments.append(out)
            mb = item.microbatch
            v = versions[(s, replica)][(item.kind, mb)]
            if item.kind is Kind.WEIGHT_GRAD:
                out.append(Action(s, Kind.WEIGHT_GRAD, mb, replica=replica, version=v))
            elif item.kind is Kind.FORWARD:
                if s > 0:
                    out.append(Action(s, Kind.RECV_ACT, mb, replica=replica, peer=rank(s - 1, mb)))
                out.append(Action(s, Kind.FORWARD, mb, replica=replica, version=v))
                if s < n - 1:
                    out.append(Action(s, Kind.SEND_ACT, mb, replica=replica, peer=rank(s + 1, mb)))
            else:
                if s < n - 1:
                    out.append(Action(s, Kind.RECV_GRAD, mb, replica=replica, peer=rank(s + 1, mb)))
                out.append(Action(s, Kind.BACKWARD, mb, replica=replica, version=v))
                if s > 0:
                    out.append(Action(s, Kind.SEND_GRAD, mb, replica=replica, peer=rank(s - 1, mb)))
        segments[(s, replica)] = replica_segments
    actions: dict[int, list[Action]] = {}
    if ctx.rank_order is None:
        for (s, replica), replica_segments in segments.items():
            actions[plan.stages[s].ranks[replica]] = [a for seg in replica_segments for a in seg]
        return dict(sorted(actions.items()))
    for r, stage_order in ctx.rank_order.items():
        held = plan.stages_of_rank(r)
        out = [a for s in held for a in segments[(s, 0)][0]]
        nxt = {s: 1 for s in held}
        for s in stage_order:
            out += segments[(s, 0)][nxt[s]]
            nxt[s] += 1
        assert all(nxt[s] == len(segments[(s, 0)]) for s in held), "rank_order must list every compute item"
        actions[r] = _steps_after_the_ranks_backwards(ctx, out)
    return dict(sorted(actions.items()))


def _steps_after_the_ranks_backwards(ctx: BuildContext, actions: list[Action]) -> list[Action]:
    """A rank holding several stages: each of its steps of update u moved to right after its last
    B or W of u (over all its stages; after the B's send of its input gradient), in their order.
    Every kind with virtual stages flushes, so nothing of the next batch runs on the rank before
    that point and the move costs no time; it is what lets a reduction over every rank at each update (clipping by the global
    norm) run exactly: all of the update's gradients are there at the rank's first step."""
    plan, kind, m = ctx.plan, ctx.kind, ctx.microbatches
    last: dict[int, int] = {}  # update -> the position of the rank's last B or W of it, or of the send after it
    for k, a in enumerate(actions):
        if a.kind is Kind.BACKWARD or a.kind is Kind.WEIGHT_GRAD:
            last[update_of(plan, kind, a.stage, a.id, m)] = k
        elif a.kind is Kind.SEND_GRAD and k and actions[k - 1].kind is Kind.BACKWARD:
            last[update_of(plan, kind, a.stage, a.id, m)] = k

    def moved(a: Action) -> bool:  # a step of an update, with a shared parameter's post and step (TP, TR)
        return a.kind in (Kind.OPTIMIZER_STEP, Kind.TIED_POST, Kind.TIED_REDUCE) and a.id in last

    steps: dict[int, list[Action]] = {}
    for a in actions:
        if moved(a):
            steps.setdefault(last[a.id], []).append(a)
    order = {Kind.TIED_POST: 0, Kind.TIED_REDUCE: 1, Kind.OPTIMIZER_STEP: 2}  # posts, then their sums, then steps
    out: list[Action] = []
    for k, a in enumerate(actions):
        if not moved(a):
            out.append(a)
        out += sorted(steps.get(k, []), key=lambda b: order[b.kind])
    return out


def _check_sharded_shares(plan: Plan, m: int) -> None:
    """A sharded stage's replicas run the same forwards and backwards, each a collective of
    theirs (FSDP2's gathers and reductions), so each takes the same share of every batch."""
    for i, st in enumerate(plan.stages):
        if st.sharded and m % st.replicas:
            raise ScheduleBuildError(
                f"stage {i} is sharded ({st.sharding}) over {st.replicas} replicas, and microbatches is {m}: every "
                "replica of a sharded stage must run as many forwards and backwards (FSDP2 gathers and reduces "
                f"inside each, with the other replicas); choose microbatches = {m + (-m) % st.replicas} or another "
                f"multiple of {st.replicas}")


def _check_shares(plan: Plan, kind: str, m: int) -> None:
    """Restriction of a microbatched kind without flushes (2bw): every replica takes the same
    share of each batch (r divides m).

    Otherwise replicas reach their all-reduce of batch t at different points of the
    continuous 1F1B stream and the all-reduce interlocks with the pipeline (a deadlock the
    validator reports); flush and gpipe drain between batches and have no such restriction.
    """
    bad = [(i, st.replicas) for i, st in enumerate(plan.stages) if m % st.replicas]
    lcm = math.lcm(*(st.replicas for st in plan.stages))
    if bad:
        s_i, r = bad[0]
        raise ScheduleBuildError(
            f"{kind} needs microbatches to be a multiple of every stage's replica count (stage {s_i} has "
            f"{r} replicas, microbatches is {m}): every replica must take the same share of each batch, "
            "or the replicas' all-reduces interlock with the pipeline and deadlock. Choose microbatches "
            f"= {m + (-m) % lcm} or another multiple of {lcm}"
        )


# --------------------------------------------------------------------- entry point
def build_schedule(
    plan: Plan,
    kind: str | None = None,
    minibatches: int = 8,
    microbatches: int | None = None,
    vertical_sync: bool = False,
) -> Schedule:
    """Generate the action lists of every rank for ``plan``.

    Args:
        plan: a valid plan (stages, replicas, ranks).
        kind: pipedream, 2bw, flush, gpipe, zb-h1, zb-h2, interleaved, zb-v, zb-2bw or naive; defaults to
            ``plan.schedule``.
        minibatches: minibatches (pipedream, naive) or batches (the microbatched kinds) to cover.
        microbatches: microbatches per batch for the microbatched kinds (default ``plan.microbatches``);
            always 1 for pipedream and naive.
        vertical_sync: pipedream only — every stage uses the input stage's version.

    Raises:
        ScheduleBuildError: unknown kind, bad counts, or an option the kind does not support.
    """
    try:
        info = schedule_kind(plan.schedule if kind is None else kind)
    except UnknownKindError as exc:
        raise ScheduleBuildError(str(exc)) from None
    try:
        plan.validate()
    except PlanError as exc:
        raise ScheduleBuildError(f"cannot build a schedule for an invalid plan: {exc}") from None
    if not isinstance(minibatches, int) or minibatches < 1:
        raise ScheduleBuildError(f"minibatches must be a positive integer, got {minibatches!r}")
    if not info.microbatched:
        if microbatches not in (None, 1):
            raise ScheduleBuildError(f"{info.name} does not split minibatches; use microbatches=1 (got {microbatches})")
        m = 1
    else:
        m = plan.microbatches if microbatches is None else microbatches
        if not isinstance(m, int) or m < 1:
            raise ScheduleBuildError(f"microbatches must be a positive integer, got {m!r}")
    problem = sharding_support_problem(plan, info)
    if problem:
        raise ScheduleBuildError(problem)
    if info.microbatched and not info.flushes:
        _check_shares(plan, info.name, m)
    _check_sharded_shares(plan, m)
    if info.split_backward and not info.replicates_split_stages and any(st.replicas > 1 for st in plan.stages):
        bad = next(i for i, st in enumerate(plan.stages) if st.replicas > 1)
        raise ScheduleBuildError(
            f"{info.name} runs a straight pipeline (one worker per stage); stage {bad} has "
            f"{plan.stages[bad].replicas} replicas: plan with straight=True, or use flush")
    problem = virtual_support_problem(plan, info)
    if problem:
        raise ScheduleBuildError(problem)
    if vertical_sync and not info.stashes_weights:
        raise ScheduleBuildError(f"vertical_sync applies to schedules with weight stashing (pipedream) only, not {info.name!r}")
    problem = tied_support_problem(plan, info, vertical_sync)
    if problem:
        raise ScheduleBuildError(problem)
    ctx = BuildContext(plan, info, minibatches, m, vertical_sync)
    return _finish(ctx, order_function(info)(ctx))


def _finish(ctx: BuildContext, compute: ComputeOrder) -> Schedule:
    """Passes 2 and 3 over a compute order: updates, shared parameters, versions, transfers."""
    order = {key: _add_tied(ctx, key[0], _add_gathers(ctx, key[0], _add_updates(ctx, key[0], items)))
             for key, items in compute.items()}
    versions = _versions(ctx, order)
    actions = _lower(ctx, order, versions)
    options = {"vertical_sync": True} if ctx.vertical_sync else {}
    return Schedule(plan=ctx.plan, kind=ctx.kind.name, minibatches=ctx.minibatches, microbatches=ctx.microbatches,
                    actions=actions, options=options)


def schedule_from_order(plan: Plan, kind: str, minibatches: int, microbatches: int,
                        order: Mapping[tuple[int, int], Sequence[tuple[Kind, int]]],
                        rank_order: Mapping[int, Sequence[int]] | None = None) -> Schedule:
    """A schedule from a compute order written elsewhere (torch_text.py reads torch's):
    ``order[(stage, replica)]`` lists the F, B and W of global microbatch ids in the order that
    replica runs them (a B is split where the list also has a W of its microbatch). The same
    passes as every generator then add the updates and versions by ``kind``'s rule and the
    transfers; :func:`~torchpipedream.schedule.validate.validate_schedule` proves the result (an order
    that breaks a rule fails there, with the grid).

    A plan with virtual stages (several stages per rank) also needs ``rank_order``: rank -> the
    stage of each of its compute items, in the order the rank runs them, which says how its
    stages' lists interleave (the lowering merges them so). For one stage per rank it adds
    nothing and is only checked.

    Raises:
        ScheduleBuildError: unknown kind, an invalid plan, bad counts, an order that misses a
            replica of the plan or names a kind other than F, B and W, a virtual plan without
            ``rank_order`` or with a kind that runs one stage per worker, or a ``rank_order``
            that does not list each rank's compute items exactly.
    """
    try:
        info = schedule_kind(kind)
        plan.validate()
    except (UnknownKindError, PlanError) as exc:
        raise ScheduleBuildError(str(exc)) from None
    if not isinstance(minibatches, int) or minibatches < 1 or not isinstance(microbatches, int) or microbatches < 1:
        raise ScheduleBuildError(f"minibatches and microbatches must be positive integers, got {minibatches!r} and "
                                 f"{microbatches!r}")
    m = microbatches if info.microbatched else 1
    want = {(s, replica) for s, st in enumerate(plan.stages) for replica in range(st.replicas)}
    if set(order) != want:
        raise ScheduleBuildError(f"the order lists (stage, replica) {sorted(order)}; the plan has {sorted(want)}")
    problem = virtual_support_problem(plan, info)
    if problem:
        raise ScheduleBuildError(problem)
    if plan.virtual and rank_order is None:
        raise ScheduleBuildError(
            f"the plan puts several stages on one worker ({plan.summary}): rank_order is needed (rank -> the stage of "
            "each of its compute items, in the order the rank runs them) to interleave each rank's stages")
    compute: ComputeOrder = {}
    for key, items in order.items():
        bad = [k for k, _ in items if k not in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT_GRAD)]
        if bad:
            raise ScheduleBuildError(f"stage {key[0]} replica {key[1]}: a compute order holds F, B and W only, not {bad[0]}")
        compute[key] = [ComputeItem(k, int(i)) for k, i in items]
    ranks: dict[int, list[int]] | None = None
    if rank_order is not None:  # per rank: each stage it holds, once per compute item of that stage
        if set(rank_order) != set(range(plan.num_workers)):
            raise ScheduleBuildError(f"rank_order lists ranks {sorted(rank_order)}; the plan has ranks "
                                     f"{list(range(plan.num_workers))}")
        ranks = {}
        for r in sorted(rank_order):
            held = {s: plan.stages[s].ranks.index(r) for s in plan.stages_of_rank(r)}  # stage -> the replica r runs
            listed: dict[int, int] = {}
            for s in rank_order[r]:
                if s not in held:
                    raise ScheduleBuildError(f"rank_order[{r}] names stage {s!r}; rank {r} holds stages {sorted(held)}")
                listed[s] = listed.get(s, 0) + 1
            for s, replica in held.items():
                if listed.get(s, 0) != len(compute[(s, replica)]):
                    raise ScheduleBuildError(
                        f"rank_order[{r}] lists stage {s} {listed.get(s, 0)} times, but the order has "
                        f"{len(compute[(s, replica)])} compute items of stage {s}"
                        + (f" replica {replica}" if plan.stages[s].replicas > 1 else "")
                        + ": rank_order needs one entry per compute item of the rank's stages")
            ranks[r] = list(rank_order[r])
    # one stage per rank: the rank's order is its stage's, nothing to interleave
    return _finish(BuildContext(plan, info, minibatches, m, False, ranks if plan.virtual else None), compute)
