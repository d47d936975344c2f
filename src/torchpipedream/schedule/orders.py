"""Compute orders: pass 1 of building a schedule, one generator per schedule kind.

A generator takes a :class:`BuildContext` (the plan, the kind, the counts) and returns, for
every (stage, replica), the order of its forwards and backwards (and, where the backward is
split, W passes) as :class:`ComputeItem` s, from the microbatches the placement rule sends to
it. ``schedule.build`` then adds the updates and weight versions (pass 2) and the transfers
(pass 3).

Each kind names its generator in its registry entry (``ScheduleKind.order``, plans/kinds.py):
the public functions of this module are exactly the generators, and :func:`order_function`
finds a kind's by that name (tests/test_schedules.py checks that every kind's exists and that
every generator belongs to a kind). Each generator's docstring draws its order.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable

from ..plans.kinds import SCHEDULE_KINDS, ScheduleKind
from ..plans.plan import Plan, looped_rank, v_shape_rank
from .actions import Kind
from .placement import interleaved_warmup, replica_of, warmup_depth

__all__ = ["ScheduleBuildError", "ComputeItem", "BuildContext", "ComputeOrder", "order_function", "pipedream", "naive",
           "two_bw", "flush", "gpipe", "zb_h1", "zb_h2", "interleaved", "zb_v", "zb_2bw"]


class ScheduleBuildError(ValueError):
    """A schedule cannot be generated for these arguments; the message says what to change."""


# --------------------------------------------------------------------- compute orders
@dataclass(frozen=True)
class ComputeItem:
    """A compute item before lowering: F, B or W of microbatch ``microbatch``."""

    kind: Kind
    microbatch: int


def _one_f_one_b(microbatch_ids: list[int], warmup: int) -> list[ComputeItem]:
    """``warmup`` forwards, then one backward and one forward in turn, then the rest of the backwards.

    ::

        F0 F1 F2 B0 F3 B1 F4 B2 B3 B4      (warmup 3, five microbatches)
    """
    out: list[ComputeItem] = []
    warm = min(warmup, len(microbatch_ids))
    out += [ComputeItem(Kind.FORWARD, i) for i in microbatch_ids[:warm]]
    backwards = 0
    for i in microbatch_ids[warm:]:
        out.append(ComputeItem(Kind.BACKWARD, microbatch_ids[backwards]))
        backwards += 1
        out.append(ComputeItem(Kind.FORWARD, i))
    out += [ComputeItem(Kind.BACKWARD, i) for i in microbatch_ids[backwards:]]
    return out


def _flush_batches(batches: list[list[int]], warmup: int) -> list[ComputeItem]:
    """1F1B inside each batch, all backwards of a batch before the next batch's first forward."""
    out: list[ComputeItem] = []
    for microbatch_ids in batches:
        out += _one_f_one_b(microbatch_ids, warmup)
    return out


def _gpipe_batches(batches: list[list[int]]) -> list[ComputeItem]:
    """Per batch: every forward, then every backward in reverse order."""
    out: list[ComputeItem] = []
    for microbatch_ids in batches:
        out += [ComputeItem(Kind.FORWARD, i) for i in microbatch_ids]
        out += [ComputeItem(Kind.BACKWARD, i) for i in reversed(microbatch_ids)]
    return out


# --------------------------------------------------------------------- the generators
@dataclass
class BuildContext:
    """What every pass of building one schedule reads: the plan, the kind and the counts."""

    plan: Plan
    kind: ScheduleKind
    minibatches: int
    microbatches: int
    vertical_sync: bool
    #: Plans with virtual stages: rank -> the stage of each of its compute items, in the order
    #: the rank runs them (how its stages' lists interleave); None: one stage per rank.
    rank_order: dict[int, list[int]] | None = None

    @property
    def total_mbs(self) -> int:
        return self.minibatches * self.microbatches

    def microbatch_ids_of(self, stage: int, replica: int) -> list[int]:
        return [i for i in range(self.total_mbs) if replica_of(self.plan, stage, i) == replica]

    def batches_of(self, stage: int, replica: int) -> list[list[int]]:
        m = self.microbatches
        mine = set(self.microbatch_ids_of(stage, replica))
        return [[i for i in range(t * m, t * m + m) if i in mine] for t in range(self.minibatches)]


ComputeOrder = dict[tuple[int, int], list[ComputeItem]]  # (stage, replica) -> compute items


def pipedream(ctx: BuildContext) -> ComputeOrder:
    """PipeDream 1F1B-RR with weight stashing (optionally vertical sync).

    Straight 4-stage pipeline (n − s warm-up forwards at 0-indexed stage s, then one
    backward and one forward in turn; ``U t`` after ``B t``)::

        s0: F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 ...
        s1:    F0 F1 F2 B0 F3 B1 F4 B2 F5 ...
        s2:       F0 F1 B0 F2 B1 F3 B2 F4 ...
        s3:          F0 B0 F1 B1 F2 B2 F3 ...

    Minibatch t runs on replica t mod r of a replicated stage; F and B of t use the version
    that was newest when F ran (weight stashing).
    """
    return {(s, replica): _one_f_one_b(ctx.microbatch_ids_of(s, replica), warmup_depth(ctx.plan, s))
            for s, st in enumerate(ctx.plan.stages) for replica in range(st.replicas)}


def naive(ctx: BuildContext) -> ComputeOrder:
    """Pipelining without weight stashing: the 1F1B order of ``pipedream``, but B uses the newest
    weights at the time of B (not the ones F used), so its gradient is not a true gradient. For
    experiments that show why stashing matters.

    ::

        s0: F0v0 F1v0 B0v0 U0 F2v1 B1v1 U1 ...     (B1 ran F with v0 but uses v1)
    """
    return pipedream(ctx)


def two_bw(ctx: BuildContext) -> ComputeOrder:
    """PipeDream-2BW: 1F1B over microbatches across batches, no flush; double-buffered weights.

    Batch t (m microbatches) uses version t − 1 for all its F and B; ``U t`` after the
    stage's last backward of batch t. At most two versions alive. Warm-up is capped at
    (fewest microbatches of one batch on this replica) + 1 so that version t − 1 exists when batch t starts (the paper asks m ≥ n)::

        s0: F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 U0 F7 ...     (m = 4, n = 4)
        s3:          F0 B0 F1 B1 F2 B2 F3 B3 U0 F4 ...
    """
    out: ComputeOrder = {}
    for s, st in enumerate(ctx.plan.stages):
        for replica in range(st.replicas):
            local_m = min(len(b) for b in ctx.batches_of(s, replica))
            warmup = min(warmup_depth(ctx.plan, s), local_m + 1)
            out[(s, replica)] = _one_f_one_b(ctx.microbatch_ids_of(s, replica), warmup)
    return out


def flush(ctx: BuildContext) -> ComputeOrder:
    """PipeDream-Flush (synchronous 1F1B): 1F1B within a batch, then flush and step.

    Every F and B of batch t uses version t; ``U t`` after the batch's last backward::

        s0: F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5 U0 | F6 ...     (m = 6, n = 4)
        s3:          F0 B0 F1 B1 F2 B2 ...       B5 U0 |
    """
    return {(s, replica): _flush_batches(ctx.batches_of(s, replica), warmup_depth(ctx.plan, s))
            for s, st in enumerate(ctx.plan.stages) for replica in range(st.replicas)}


def gpipe(ctx: BuildContext) -> ComputeOrder:
    """GPipe: all forwards of a batch, then all backwards in reverse order, then step.

    ::

        s0: F0 F1 F2 F3                B3 B2 B1 B0 U0
        s3:          F0 F1 F2 F3 B3 B2 B1 B0 U0
    """
    return {(s, replica): _gpipe_batches(ctx.batches_of(s, replica))
            for s, st in enumerate(ctx.plan.stages) for replica in range(st.replicas)}


def _zb_h1_offsets(n: int, s: int) -> tuple[int, int, int]:
    """Times of stage ``s``'s F, B and W of the first microbatch in ZB-H1's building block
    (unit-time passes; microbatch k's are k · 3 later; Qi et al., ICLR 2024, section 2.1).

    F runs at ``s`` (the forward wave); B right after the last stage's F, then one stage per
    step back up, a step later where that slot is the stage's F; W at the stage's third slot
    of the period, but not before ``s + 3(n − 1)``: every stage holds as many microbatches
    in flight (F to W) as the input stage, which is what lets the B wave run ahead while the
    W passes fill the tail.
    """
    b = n
    for stage in range(n - 1, s - 1, -1):
        if stage < n - 1:
            b += 1
        while b % 3 == stage % 3:
            b += 1
    w = max(b + 1, s + 3 * (n - 1))
    while w % 3 in (s % 3, b % 3):
        w += 1
    return s, b, w


def zb_h1(ctx: BuildContext) -> ComputeOrder:
    """Zero Bubble H1: synchronous like flush (every pass of batch t uses W^(t), ``U t`` after
    the batch's last W), with each backward split into B (input gradient, sent upstream at
    once) and W (weight gradient), W delayed so that every stage holds as many microbatches as
    the input stage. On stages of equal F, B and W times the bubble is (n − 1)(T_F + T_B − T_W)
    per batch, a third of flush's::

        s0: F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7   (m = 8, n = 4)
        s3: F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7

    The order of each stage is the building block repeated every three steps and sorted by
    time; the runtime and the simulator then run it as early as dependencies allow. A replica of
    a replicated stage runs the stage's order without the other replicas' microbatches
    (:func:`_replicas_follow_the_stage`), so it holds its share of the n in flight, ⌈n/r⌉ (timed
    by its own count of microbatches, a replica ran the next microbatch's F before a B the stage
    above waited for).
    """
    n = ctx.plan.num_stages

    def batch_order(ids: list[int], s: int) -> list[ComputeItem]:  # the block's passes, by time
        offsets = _zb_h1_offsets(n, s)
        timed = [(off + 3 * k, ComputeItem(kind, i)) for k, i in enumerate(ids)
                 for kind, off in zip((Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT_GRAD), offsets)]
        return [c for _, c in sorted(timed, key=lambda x: x[0])]  # F, B and W never share a time

    return _replicas_follow_the_stage(ctx, batch_order)


def _replicas_follow_the_stage(ctx: BuildContext,
                               batch_order: Callable[[list[int], int], list[ComputeItem]]) -> ComputeOrder:
    """Each replica's order: ``batch_order(ids of batch t, stage)``, the straight stage's order of
    a batch, with the other replicas' microbatches left out. Every replica's order is then a part
    of the straight pipeline's, which cannot deadlock, and a replica of r holds its share of what
    the straight stage holds in flight (the zero-bubble kinds, whose orders the stage's own rule
    applied to a replica's microbatches deadlocked: zb-h1's 1-3-1 at 6 microbatches, zb-h2's at 12)."""
    m = ctx.microbatches
    out: ComputeOrder = {}
    for s, st in enumerate(ctx.plan.stages):
        for replica in range(st.replicas):
            items: list[ComputeItem] = []
            for t, batch in enumerate(ctx.batches_of(s, replica)):
                mine = set(batch)
                items += [c for c in batch_order(list(range(t * m, t * m + m)), s) if c.microbatch in mine]
            out[(s, replica)] = items
    return out


def _zb_h2_batch(microbatch_ids: list[int], n: int, s: int) -> list[ComputeItem]:
    """One batch of ZB-H2 on stage ``s`` of ``n``: 2(n − s) − 1 forwards, then each B followed by
    the next F (a W first when the stage already holds 2n − 1 microbatches) and then W passes
    until only 2s are left; those 2s run at the batch's end, while the B of the last
    microbatches climbs back to stage 0, and fill what would be the gap before the next batch."""
    ids = list(microbatch_ids)
    warm = min(2 * (n - s) - 1, len(ids))
    out = [ComputeItem(Kind.FORWARD, i) for i in ids[:warm]]
    nf, nw, pending = warm, 0, []
    for i in ids:
        out.append(ComputeItem(Kind.BACKWARD, i))
        pending.append(i)
        if nf < len(ids):
            if nf - nw >= 2 * n - 1:  # in flight (forwarded, W not done) at the bound
                out.append(ComputeItem(Kind.WEIGHT_GRAD, pending.pop(0)))
                nw += 1
            out.append(ComputeItem(Kind.FORWARD, ids[nf]))
            nf += 1
        while len(pending) > 2 * s:
            out.append(ComputeItem(Kind.WEIGHT_GRAD, pending.pop(0)))
            nw += 1
    return out + [ComputeItem(Kind.WEIGHT_GRAD, i) for i in pending]


def zb_h2(ctx: BuildContext) -> ComputeOrder:
    """Zero Bubble H2 (Qi et al., section 2.2), synchronous like flush: stage s runs 2(n − s) − 1
    forwards before its first B (twice 1F1B's warm-up), then B and F in turn with W passes
    between, keeping its last 2s W passes for the batch's end. Those fill the time in which the
    next batch's forwards travel down the pipeline, so consecutive batches run back to back:
    on stages of equal F, B and W times no stage idles between batches once m ≥ 2n − 1 (each
    stage's own step separates them; no stage waits for another's). Every stage holds up to
    2n − 1 microbatches::

        s0: F0 F1 F2 F3 F4 F5 F6 B0 W0 F7 B1 W1 B2 W2 B3 W3 B4 W4 B5 W5 B6 W6 B7 W7   (m = 8, n = 4)
        s3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 W0 F7 B7 W1 W2 W3 W4 W5 W6 W7

    A replica of a replicated stage runs the stage's order without the other replicas'
    microbatches (:func:`_replicas_follow_the_stage`), so it holds its share of the 2n − 1 in
    flight, ⌈(2n − 1)/r⌉.
    """
    n = ctx.plan.num_stages
    return _replicas_follow_the_stage(ctx, lambda ids, s: _zb_h2_batch(ids, n, s))


def interleaved(ctx: BuildContext) -> ComputeOrder:
    """Interleaved 1F1B (Narayanan et al., SC'21; Megatron-LM), synchronous like flush: each of
    p ranks holds v stages, stage k on rank k mod p (``Plan.looped``). A rank runs the forwards
    of a batch in rounds of p microbatches, chunk by chunk (round 0 on its first chunk, round 0
    on its second, ..., then round 1), and the backwards in the same rounds with the chunks in
    reverse; 1F1B between the two after ``interleaved_warmup`` forwards. On stages of equal
    times the bubble is (p − 1)/v of one stage's F + B per batch, 1/v of flush's::

        r0: F0 F1 F0' F1' F2 B0' F3 B1' F2' B0 F3' B1 B2' B3' B2 B3 U0' U0   (p = 2, v = 2, m = 4;
        r1: F0 F1 F0' B0' F1' B1' F2 B0 F3 B1 F2' B2' F3' B3' B2 B3 U0' U0   ' = the rank's 2nd stage)

    (A rank's steps follow its last backward of the batch: ``build._steps_after_the_ranks_backwards``.)
    """
    plan, m, p, v = ctx.plan, ctx.microbatches, ctx.plan.num_workers, ctx.plan.chunks
    if not plan.placed_by(looped_rank):
        raise ScheduleBuildError(f"{ctx.kind.name} needs stage k on rank k mod {p} (Plan.looped); the plan puts "
                                 f"them on {[st.ranks for st in plan.stages]}")
    if m % p:
        raise ScheduleBuildError(f"{ctx.kind.name} runs microbatches in rounds of one per worker: microbatches must be a "
                                 f"multiple of the {p} workers, got {m} (choose {m + (-m) % p})")
    out: ComputeOrder = {(k, 0): [] for k in range(plan.num_stages)}
    ctx.rank_order = {}
    for r in range(p):
        chunks = plan.stages_of_rank(r)
        items: list[tuple[int, ComputeItem]] = []
        for t in range(ctx.minibatches):
            ids = list(range(t * m, t * m + m))
            rounds = [ids[g:g + p] for g in range(0, m, p)]
            fwd = [(chunks[c], ComputeItem(Kind.FORWARD, i)) for rnd in rounds for c in range(v) for i in rnd]
            bwd = [(chunks[c], ComputeItem(Kind.BACKWARD, i)) for rnd in rounds for c in reversed(range(v)) for i in rnd]
            warm = interleaved_warmup(plan, r, m)
            items += fwd[:warm]
            for k, b in enumerate(bwd):
                items.append(b)
                if warm + k < len(fwd):
                    items.append(fwd[warm + k])
        for stage, item in items:
            out[(stage, 0)].append(item)
        ctx.rank_order[r] = [stage for stage, _ in items]
    return out


def _zb_v_batch(m: int, p: int) -> dict[int, list[tuple[int, Kind, int]]]:
    """One batch of ZB-V on p workers, as rank -> [(stage, F/B/W, index in the batch)]: unit-time
    passes placed greedily, each worker, whenever it is free, running the first that is ready
    of: the B of its lower stage r (it finishes a microbatch's backward on the worker), the F of
    its upper stage 2p − 1 − r, the F of stage r while it holds fewer than 2p + 2 microbatch
    chunks, the B of stage 2p − 1 − r, else its oldest pending W. Equal F, B and W then leave
    only the forward wave's start idle: a batch takes 6m + p − 1 units for every m ≥ 2p
    (tests/test_zero_bubble_schedule.py)."""
    n, cap = 2 * p, 2 * p + 2
    finish: dict[tuple[Kind, int, int], int] = {}  # (kind, stage, index) -> end of that unit step
    free, held = [0] * p, [0] * p
    next_f, next_b = [0] * n, [0] * n
    pending_w: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    out: dict[int, list[tuple[int, Kind, int]]] = {r: [] for r in range(p)}
    left, idle = 3 * n * m, 0
    while left:
        r = min(range(p), key=lambda q: (free[q], q))
        t, low, high = free[r], r, n - 1 - r

        def ready(kind: Kind, k: int) -> bool:
            if kind is Kind.FORWARD:
                i = next_f[k]
                return i < m and (k == 0 or finish.get((Kind.FORWARD, k - 1, i), t + 1) <= t)
            i = next_b[k]
            after = (Kind.FORWARD, k, i) if k == n - 1 else (Kind.BACKWARD, k + 1, i)
            return i < m and (Kind.FORWARD, k, i) in finish and finish.get(after, t + 1) <= t

        choice: tuple[Kind, int] | None = None
        for kind, k in ((Kind.BACKWARD, low), (Kind.FORWARD, high), (Kind.FORWARD, low), (Kind.BACKWARD, high)):
            if ready(kind, k) and (kind is Kind.BACKWARD or held[r] < cap):
                choice = (kind, k)
                break
        if choice is None and pending_w[r]:
            choice = (Kind.WEIGHT_GRAD, pending_w[r][0][0])
        if choice is None:
            free[r] = t + 1
            idle += 1
            if idle > 3 * n * m * p:  # pragma: no cover - the rule above always progresses
                raise ScheduleBuildError(f"zb-v: no order found for {m} microbatches on {p} workers")
            continue
        kind, k = choice
        if kind is Kind.FORWARD:
            i = next_f[k]
            next_f[k] += 1
            held[r] += 1
        elif kind is Kind.BACKWARD:
            i = next_b[k]
            next_b[k] += 1
            pending_w[r].append((k, i))
        else:
            k, i = pending_w[r].pop(0)
            held[r] -= 1
        finish[(kind, k, i)] = t + 1
        out[r].append((k, kind, i))
        free[r] = t + 1
        left -= 1
    return out


def zb_v(ctx: BuildContext) -> ComputeOrder:
    """ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024), synchronous like
    flush: p workers hold two stages each in a V (``Plan.v_shape``: worker r holds stages r and
    2p − 1 − r, so the first worker runs the first and the last stage), every backward split into
    B and W. Each batch's order comes from ``_zb_v_batch``; on stages of equal F, B and W a batch
    of m ≥ 2p microbatches idles only for the forward wave's start, p − 1 passes, and every
    worker holds at most 2p + 2 microbatch chunks (p + 1 microbatches of its whole layers)::

        r0: F0 F1 F2 F0' F3 F1' B0' B1' W0' B0 F2' B1 B2' W1' W0 B2 W1 F3' B3' W2' W2 B3 W3' W3
        r1: F0 F0' F1 F1' F2 F2' B0' B0 B1' B1 W0' F3 B2' B2 W0 F3' W1' W1 B3' B3 W2' W2 W3' W3
                                                              (p = 2, m = 4; ' = stage 2p − 1 − r)
    """
    plan, m, p = ctx.plan, ctx.microbatches, ctx.plan.num_workers
    if plan.chunks != 2 or not plan.placed_by(v_shape_rank):
        raise ScheduleBuildError(f"{ctx.kind.name} needs two stages per worker in a V, worker r holding stages r and "
                                 f"{2 * p - 1} - r (Plan.v_shape); the plan puts them on "
                                 f"{[st.ranks for st in plan.stages]}")
    out: ComputeOrder = {(k, 0): [] for k in range(plan.num_stages)}
    ctx.rank_order = {r: [] for r in range(p)}
    for t in range(ctx.minibatches):
        for r, items in _zb_v_batch(m, p).items():
            for stage, kind, i in items:
                out[(stage, 0)].append(ComputeItem(kind, t * m + i))
                ctx.rank_order[r].append(stage)
    return out


def _zb_2bw_order(kind: ScheduleKind, n: int, m: int, total: int) -> list[list[ComputeItem]]:
    """zb-2bw's compute order of each of ``n`` stages for ``total`` microbatches, ``m`` per
    batch: a greedy list schedule in unit time (F, B and W one step each, transfers free).
    Each stage, when free, runs the first ready of

    1. B of its oldest microbatch whose output gradient is in;
    2. F of its next microbatch, if its input is in, the stage holds fewer than
       the kind's ``inflight_depth`` (2bw's depth n − s where m ≥ n − 1, else 2m: the
       unit-time search of issue 19's note found any lower cap slows the pipeline there), and
       the version it needs exists (batch t's F uses W^(t−1), made by ``U t−2``: every W of
       batch t − 2 done);
    3. W of its oldest microbatch past B.

    B, F and W each run in microbatch order, so three counters per stage are the whole state.
    """
    cap = [kind.inflight_depth(n - s, n, m) for s in range(n)]
    f_end = [[0] * total for _ in range(n)]
    b_end = [[0] * total for _ in range(n)]
    nf, nb, nw = [0] * n, [0] * n, [0] * n
    out: list[list[ComputeItem]] = [[] for _ in range(n)]
    t = 0
    while min(nw) < total:
        for s in range(n):
            i = nb[s]
            if i < nf[s] and f_end[s][i] <= t and (s == n - 1 or (nb[s + 1] > i and b_end[s + 1][i] <= t)):
                out[s].append(ComputeItem(Kind.BACKWARD, i))
                b_end[s][i] = t + 1
                nb[s] += 1
                continue
            i = nf[s]
            if (i < total and i - nw[s] < cap[s] and i // m - 1 <= nw[s] // m
                    and (s == 0 or (nf[s - 1] > i and f_end[s - 1][i] <= t))):
                out[s].append(ComputeItem(Kind.FORWARD, i))
                f_end[s][i] = t + 1
                nf[s] += 1
                continue
            i = nw[s]
            if i < nb[s] and b_end[s][i] <= t:
                out[s].append(ComputeItem(Kind.WEIGHT_GRAD, i))
                nw[s] += 1
        t += 1
        assert t <= 4 * (total + n) * n, "zb-2bw's list schedule made no progress"
    return out


def zb_2bw(ctx: BuildContext) -> ComputeOrder:
    """2bw with the backward split (asynchronous, one update stale, two weight versions): every
    F, B and W of batch t uses W^(t−1) and ``U t`` follows the stage's last W of batch t, as
    2bw's rule (``two_bw``), so its weights equal 2bw's. W leaves the critical path: the input
    gradient climbs the pipeline a B per stage, not a whole backward, so the update that batch
    t + 2 waits for comes sooner. The order is ``_zb_2bw_order``'s. On stages of equal F, B and
    W the pipeline stays full once m ≥ n/2 microbatches per batch (2bw needs m ≥ n − 1), for
    up to two batches of activations held (2m microbatches, held until W) where m < n − 1;
    from m ≥ n − 1 on it holds 2bw's n − s::

        s0: F0 F1 F2 F3 B0 W0 B1 W1 B2 F4 B3 F5 W2 W3 F6 F7 B4 W4 B5 W5 B6 W6 B7 W7   (m = 2, n = 4)
        s3: F0 B0 F1 B1 F2 B2 F3 B3 W0 W1 W2 W3 F4 B4 F5 B5 W4 W5 F6 B6 F7 B7 W6 W7

    (F4, batch 2, waits for ``U 0``, after W1; stage 3 holds two batches, F0 to W3.)
    """
    n, m = ctx.plan.num_stages, ctx.microbatches
    return {(s, 0): items for s, items in enumerate(_zb_2bw_order(ctx.kind, n, m, ctx.total_mbs))}


def order_function(kind: ScheduleKind) -> Callable[[BuildContext], ComputeOrder]:
    """The generator ``kind`` names (``ScheduleKind.order``): the public function of that name here."""
    found = globals().get(kind.order)
    if (kind.order.startswith("_") or kind.order == "order_function" or not inspect.isfunction(found)
            or found.__module__ != __name__):
        raise LookupError(f"schedule kind {kind.name!r} names the compute order {kind.order!r}, which is not a "
                          "generator of schedule/orders.py")
    return found


assert all(order_function(kind) for kind in SCHEDULE_KINDS.values()), "every schedule kind needs a generator"
