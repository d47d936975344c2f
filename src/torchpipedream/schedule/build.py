"""Schedule generators: a Plan in, a Schedule (one ordered action list per rank) out.

Every schedule is built in three passes over plain data, each small enough to read:

1. **compute order** — for every rank, the order of its forwards and backwards
   (``_one_f_one_b``, ``_flush_batches``, ``_gpipe_batches``), from the microbatches
   that the placement rule sends to it;
2. **updates** — ``AR u`` (replicated stages) and ``U u`` after the rank's last backward
   contributing to update u, then weight versions per the kind's semantics;
3. **lowering** — ``SA``/``RA`` around every forward and ``SG``/``RG`` around every
   backward, with the peer rank that ran (or will run) the same microbatch.

The kinds and their meaning are in docs/architecture.md ("Schedule semantics"); a
generator is one function in ``GENERATORS`` (name → function). The simulator and the
runtime interpret the result and contain no schedule logic of their own;
:func:`~torchpipedream.schedule.validate.validate_schedule` proves a schedule before it runs.

Example::

    plan = Plan.straight([["a"], ["b"], ["c"], ["d"]])
    sched = build_schedule(plan, "pipedream", minibatches=8)
    print(" ".join(map(str, sched.actions[0])))
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from .actions import Action, Kind, Schedule
from ..plans.kinds import KIND_NAMES, ScheduleKind, UnknownKindError, VersionRule, schedule_kind
from .placement import (interleaved_warmup, num_updates, replica_of, tied_support_problem, update_of,
                        virtual_support_problem, warmup_depth)
from ..plans.plan import Plan, PlanError, looped_rank, v_shape_rank

__all__ = ["build_schedule", "schedule_from_order", "GENERATORS", "ScheduleBuildError"]

class ScheduleBuildError(ValueError):
    """A schedule cannot be generated for these arguments; the message says what to change."""


# --------------------------------------------------------------------- compute orders
@dataclass(frozen=True)
class _C:
    """A compute item before lowering: F, B or W of microbatch ``microbatch``."""

    kind: Kind
    microbatch: int


def _one_f_one_b(microbatch_ids: list[int], warmup: int) -> list[_C]:
    """``warmup`` forwards, then one backward and one forward in turn, then the rest of the backwards.

    ::

        F0 F1 F2 B0 F3 B1 F4 B2 B3 B4      (warmup 3, five microbatches)
    """
    out: list[_C] = []
    w = min(warmup, len(microbatch_ids))
    out += [_C(Kind.FORWARD, i) for i in microbatch_ids[:w]]
    nb = 0
    for i in microbatch_ids[w:]:
        out.append(_C(Kind.BACKWARD, microbatch_ids[nb]))
        nb += 1
        out.append(_C(Kind.FORWARD, i))
    out += [_C(Kind.BACKWARD, i) for i in microbatch_ids[nb:]]
    return out


def _flush_batches(batches: list[list[int]], warmup: int) -> list[_C]:
    """1F1B inside each batch, all backwards of a batch before the next batch's first forward."""
    out: list[_C] = []
    for microbatch_ids in batches:
        out += _one_f_one_b(microbatch_ids, warmup)
    return out


def _gpipe_batches(batches: list[list[int]]) -> list[_C]:
    """Per batch: every forward, then every backward in reverse order."""
    out: list[_C] = []
    for microbatch_ids in batches:
        out += [_C(Kind.FORWARD, i) for i in microbatch_ids]
        out += [_C(Kind.BACKWARD, i) for i in reversed(microbatch_ids)]
    return out


# --------------------------------------------------------------------- the generators
@dataclass
class _Ctx:
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


ComputeOrder = dict[tuple[int, int], list[_C]]  # (stage, replica) -> compute items


def pipedream(ctx: _Ctx) -> ComputeOrder:
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
    return {(s, q): _one_f_one_b(ctx.microbatch_ids_of(s, q), warmup_depth(ctx.plan, s))
            for s, st in enumerate(ctx.plan.stages) for q in range(st.replicas)}


def naive(ctx: _Ctx) -> ComputeOrder:
    """Pipelining without weight stashing: the 1F1B order of ``pipedream``, but B uses the newest
    weights at the time of B (not the ones F used), so its gradient is not a true gradient. For
    experiments that show why stashing matters.

    ::

        s0: F0v0 F1v0 B0v0 U0 F2v1 B1v1 U1 ...     (B1 ran F with v0 but uses v1)
    """
    return pipedream(ctx)


def two_bw(ctx: _Ctx) -> ComputeOrder:
    """PipeDream-2BW: 1F1B over microbatches across batches, no flush; double-buffered weights.

    Batch t (m microbatches) uses version t − 1 for all its F and B; ``U t`` after the
    stage's last backward of batch t. At most two versions alive. Warm-up is capped at
    (fewest microbatches of one batch on this replica) + 1 so that version t − 1 exists when batch t starts (the paper asks m ≥ n)::

        s0: F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 U0 F7 ...     (m = 4, n = 4)
        s3:          F0 B0 F1 B1 F2 B2 F3 B3 U0 F4 ...
    """
    out: ComputeOrder = {}
    for s, st in enumerate(ctx.plan.stages):
        for q in range(st.replicas):
            local_m = min(len(b) for b in ctx.batches_of(s, q))
            out[(s, q)] = _one_f_one_b(ctx.microbatch_ids_of(s, q), min(warmup_depth(ctx.plan, s), local_m + 1))
    return out


def flush(ctx: _Ctx) -> ComputeOrder:
    """PipeDream-Flush (synchronous 1F1B): 1F1B within a batch, then flush and step.

    Every F and B of batch t uses version t; ``U t`` after the batch's last backward::

        s0: F0 F1 F2 F3 B0 F4 B1 F5 B2 B3 B4 B5 U0 | F6 ...     (m = 6, n = 4)
        s3:          F0 B0 F1 B1 F2 B2 ...       B5 U0 |
    """
    return {(s, q): _flush_batches(ctx.batches_of(s, q), warmup_depth(ctx.plan, s))
            for s, st in enumerate(ctx.plan.stages) for q in range(st.replicas)}


def gpipe(ctx: _Ctx) -> ComputeOrder:
    """GPipe: all forwards of a batch, then all backwards in reverse order, then step.

    ::

        s0: F0 F1 F2 F3                B3 B2 B1 B0 U0
        s3:          F0 F1 F2 F3 B3 B2 B1 B0 U0
    """
    return {(s, q): _gpipe_batches(ctx.batches_of(s, q))
            for s, st in enumerate(ctx.plan.stages) for q in range(st.replicas)}


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


def zb_h1(ctx: _Ctx) -> ComputeOrder:
    """Zero Bubble H1: synchronous like flush (every pass of batch t uses W^(t), ``U t`` after
    the batch's last W), with each backward split into B (input gradient, sent upstream at
    once) and W (weight gradient), W delayed so that every stage holds as many microbatches as
    the input stage. On stages of equal F, B and W times the bubble is (n − 1)(T_F + T_B − T_W)
    per batch, a third of flush's::

        s0: F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7   (m = 8, n = 4)
        s3: F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7

    The order of each stage is the building block repeated every three steps and sorted by
    time; the runtime and the simulator then run it as early as dependencies allow.
    """
    n = ctx.plan.num_stages
    out: ComputeOrder = {}
    for s in range(n):
        offsets = _zb_h1_offsets(n, s)
        items: list[_C] = []
        for batch in ctx.batches_of(s, 0):
            timed = [(off + 3 * k, rank, _C(kind, i)) for k, i in enumerate(batch)
                     for rank, (kind, off) in enumerate(zip((Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT_GRAD), offsets))]
            items += [c for _, _, c in sorted(timed, key=lambda x: (x[0], x[1]))]
        out[(s, 0)] = items
    return out


def _zb_h2_batch(microbatch_ids: list[int], n: int, s: int) -> list[_C]:
    """One batch of ZB-H2 on stage ``s`` of ``n``: 2(n − s) − 1 forwards, then each B followed by
    the next F (a W first when the stage already holds 2n − 1 microbatches) and then W passes
    until only 2s are left; those 2s run at the batch's end, while the B of the last
    microbatches climbs back to stage 0, and fill what would be the gap before the next batch."""
    ids = list(microbatch_ids)
    warm = min(2 * (n - s) - 1, len(ids))
    out = [_C(Kind.FORWARD, i) for i in ids[:warm]]
    nf, nw, pending = warm, 0, []
    for i in ids:
        out.append(_C(Kind.BACKWARD, i))
        pending.append(i)
        if nf < len(ids):
            if nf - nw >= 2 * n - 1:  # in flight (forwarded, W not done) at the bound
                out.append(_C(Kind.WEIGHT_GRAD, pending.pop(0)))
                nw += 1
            out.append(_C(Kind.FORWARD, ids[nf]))
            nf += 1
        while len(pending) > 2 * s:
            out.append(_C(Kind.WEIGHT_GRAD, pending.pop(0)))
            nw += 1
    return out + [_C(Kind.WEIGHT_GRAD, i) for i in pending]


def zb_h2(ctx: _Ctx) -> ComputeOrder:
    """Zero Bubble H2 (Qi et al., section 2.2), synchronous like flush: stage s runs 2(n − s) − 1
    forwards before its first B (twice 1F1B's warm-up), then B and F in turn with W passes
    between, keeping its last 2s W passes for the batch's end. Those fill the time in which the
    next batch's forwards travel down the pipeline, so consecutive batches run back to back:
    on stages of equal F, B and W times no stage idles between batches once m ≥ 2n − 1 (each
    stage's own step separates them; no stage waits for another's). Every stage holds up to
    2n − 1 microbatches::

        s0: F0 F1 F2 F3 F4 F5 F6 B0 W0 F7 B1 W1 B2 W2 B3 W3 B4 W4 B5 W5 B6 W6 B7 W7   (m = 8, n = 4)
        s3: F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 W0 F7 B7 W1 W2 W3 W4 W5 W6 W7
    """
    n = ctx.plan.num_stages
    return {(s, 0): [c for batch in ctx.batches_of(s, 0) for c in _zb_h2_batch(batch, n, s)] for s in range(n)}


def interleaved(ctx: _Ctx) -> ComputeOrder:
    """Interleaved 1F1B (Narayanan et al., SC'21; Megatron-LM), synchronous like flush: each of
    p ranks holds v stages, stage k on rank k mod p (``Plan.looped``). A rank runs the forwards
    of a batch in rounds of p microbatches, chunk by chunk (round 0 on its first chunk, round 0
    on its second, ..., then round 1), and the backwards in the same rounds with the chunks in
    reverse; 1F1B between the two after ``interleaved_warmup`` forwards. On stages of equal
    times the bubble is (p − 1)/v of one stage's F + B per batch, 1/v of flush's::

        r0: F0 F1 F0' F1' F2 B0' F3 B1' F2' B0 F3' B1 B2' B3' U0' B2 B3 U0   (p = 2, v = 2, m = 4;
        r1: F0 F1 F0' B0' F1' B1' F2 B0 F3 B1 F2' B2' F3' B3' U0' B2 B3 U0   ' = the rank's 2nd stage)
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
        items: list[tuple[int, _C]] = []
        for t in range(ctx.minibatches):
            ids = list(range(t * m, t * m + m))
            rounds = [ids[g:g + p] for g in range(0, m, p)]
            fwd = [(chunks[c], _C(Kind.FORWARD, i)) for rnd in rounds for c in range(v) for i in rnd]
            bwd = [(chunks[c], _C(Kind.BACKWARD, i)) for rnd in rounds for c in reversed(range(v)) for i in rnd]
            warm = interleaved_warmup(plan, r, m)
            items += fwd[:warm]
            for k, b in enumerate(bwd):
                items.append(b)
                if warm + k < len(fwd):
                    items.append(fwd[warm + k])
        for stage, it in items:
            out[(stage, 0)].append(it)
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


def zb_v(ctx: _Ctx) -> ComputeOrder:
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
                out[(stage, 0)].append(_C(kind, t * m + i))
                ctx.rank_order[r].append(stage)
    return out


def _zb_2bw_order(kind: ScheduleKind, n: int, m: int, total: int) -> list[list[_C]]:
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
    out: list[list[_C]] = [[] for _ in range(n)]
    t = 0
    while min(nw) < total:
        for s in range(n):
            i = nb[s]
            if i < nf[s] and f_end[s][i] <= t and (s == n - 1 or (nb[s + 1] > i and b_end[s + 1][i] <= t)):
                out[s].append(_C(Kind.BACKWARD, i))
                b_end[s][i] = t + 1
                nb[s] += 1
                continue
            i = nf[s]
            if (i < total and i - nw[s] < cap[s] and i // m - 1 <= nw[s] // m
                    and (s == 0 or (nf[s - 1] > i and f_end[s - 1][i] <= t))):
                out[s].append(_C(Kind.FORWARD, i))
                f_end[s][i] = t + 1
                nf[s] += 1
                continue
            i = nw[s]
            if i < nb[s] and b_end[s][i] <= t:
                out[s].append(_C(Kind.WEIGHT_GRAD, i))
                nw[s] += 1
        t += 1
        assert t <= 4 * (total + n) * n, "zb-2bw's list schedule made no progress"
    return out


def zb_2bw(ctx: _Ctx) -> ComputeOrder:
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


GENERATORS: dict[str, Callable[[_Ctx], ComputeOrder]] = {
    "pipedream": pipedream,
    "2bw": two_bw,
    "flush": flush,
    "gpipe": gpipe,
    "zb-h1": zb_h1,
    "zb-h2": zb_h2,
    "interleaved": interleaved,
    "zb-v": zb_v,
    "zb-2bw": zb_2bw,
    "naive": naive,
}
assert set(GENERATORS) == set(KIND_NAMES), "every schedule kind needs a generator"


# --------------------------------------------------------------------- pass 2: updates, versions
def _add_updates(ctx: _Ctx, stage: int, items: list[_C]) -> list[_C | tuple[str, int]]:
    """Insert ("AR", u) / ("U", u) after the rank's last backward of each update u.

    A replica with no backward in update u (e.g. the last, partial round) still takes part in
    the all-reduce and the step (contributing a zero gradient), right after its previous step.
    """
    plan, kind, m = ctx.plan, ctx.kind, ctx.microbatches
    replicated = plan.stages[stage].replicas > 1
    n_upd = num_updates(plan, kind, stage, ctx.minibatches)
    last_b: dict[int, int] = {}  # the last B, or W where the backward is split
    for pos, it in enumerate(items):
        if it.kind is Kind.BACKWARD or it.kind is Kind.WEIGHT_GRAD:
            last_b[update_of(plan, kind, stage, it.microbatch, m)] = pos
    after: dict[int, list[int]] = {}
    prev = -1
    for u in range(n_upd):
        pos = last_b.get(u, prev)
        pos = max(pos, prev)
        after.setdefault(pos, []).append(u)
        prev = pos
    out: list[_C | tuple[str, int]] = []
    for u in after.get(-1, []):
        out += ([("AR", u)] if replicated else []) + [("U", u)]
    for pos, it in enumerate(items):
        out.append(it)
        for u in after.get(pos, []):
            out += ([("AR", u)] if replicated else []) + [("U", u)]
    return out


def _add_tied(ctx: _Ctx, stage: int, items: list) -> list:
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
    n_upd = num_updates(plan, kind, stage, ctx.minibatches)
    update_at = {it[1]: pos for pos, it in enumerate(items) if isinstance(it, tuple) and it[0] == "U"}
    before: dict[int, list] = {}  # position -> items to insert before it
    end: list = []

    def put(pos: int | None, item: tuple) -> None:
        (before.setdefault(pos, []) if pos is not None else end).append(item)

    for k in held:
        for u in range(n_upd):
            if kind.version_rule is VersionRule.BATCH:
                put(update_at[u], ("TP", u, k))
                put(update_at[u], ("TR", u, k))
            elif kind.version_rule is VersionRule.PREVIOUS_BATCH:
                put(update_at[u], ("TP", u, k))
                first_f = next((pos for pos, it in enumerate(items) if isinstance(it, _C)
                                and it.kind is Kind.FORWARD and it.microbatch // m == u + 2), None)
                put(first_f, ("TR", u, k))
            else:  # STASHED
                lag = stage - plan.tied[k].stages[0] + 1
                put(update_at[u] + 1, ("TP", u, k))
                later = update_at.get(u + lag)
                put(later + 1 if later is not None else None, ("TR", u, k))
    rank_of = {"TP": 0, "TR": 1}
    order = lambda t: (t[1], rank_of[t[0]], t[2])  # noqa: E731 - update, post before wait, parameter
    out: list = []
    for pos, it in enumerate(items):
        out += sorted(before.get(pos, []), key=order)
        out.append(it)
    out += sorted(before.get(len(items), []) + end, key=order)
    return out


def _versions(ctx: _Ctx, order: dict[tuple[int, int], list[_C | tuple[str, int]]]) -> dict[tuple[int, int], dict[tuple[Kind, int], int]]:
    """Weight version of every F and B, per the kind's semantics (docs/architecture.md)."""
    kind, m = ctx.kind, ctx.microbatches
    out: dict[tuple[int, int], dict[tuple[Kind, int], int]] = {}
    for key, items in order.items():
        vers: dict[tuple[Kind, int], int] = {}
        steps = 0
        for it in items:
            if isinstance(it, tuple):
                steps += it[0] == "U"
                continue
            rule = kind.version_rule
            if rule is VersionRule.BATCH:
                vers[(it.kind, it.microbatch)] = it.microbatch // m
            elif rule is VersionRule.PREVIOUS_BATCH:
                vers[(it.kind, it.microbatch)] = max(0, it.microbatch // m - 1)
            elif rule is VersionRule.NEWEST or it.kind is Kind.FORWARD:
                vers[(it.kind, it.microbatch)] = steps
            else:  # STASHED: the backward (B and W) uses its forward's version
                vers[(it.kind, it.microbatch)] = vers[(Kind.FORWARD, it.microbatch)]
        out[key] = vers
    if ctx.vertical_sync:
        _apply_vertical_sync(ctx, order, out)
    return out


def _apply_vertical_sync(ctx: _Ctx, order: dict, vers: dict) -> None:
    """Every stage uses, for minibatch t, the weights that include exactly the updates the input
    stage's version for t includes: stage s takes ⌊v0(t)·r0 / r_s⌋ (v0(t) for straight pipelines,
    = max(0, t − n + 1))."""
    plan = ctx.plan
    r0 = plan.stages[0].replicas
    v0 = {}
    for q in range(r0):
        for (k, microbatch), v in vers[(0, q)].items():
            if k is Kind.FORWARD:
                v0[microbatch] = v
    for (s, q), items in order.items():
        rs = plan.stages[s].replicas
        steps = 0
        for it in items:
            if isinstance(it, tuple):
                steps += it[0] == "U"
                continue
            v = (v0[it.microbatch] * r0) // rs
            if it.kind is Kind.FORWARD and v > steps:
                raise ScheduleBuildError(
                    f"vertical sync: stage {s} would need weight version {v} for minibatch {it.microbatch} "
                    f"but has only taken {steps} steps; use vertical_sync=False for this plan ({plan.config})"
                )
            vers[(s, q)][(it.kind, it.microbatch)] = v


# --------------------------------------------------------------------- pass 3: lowering
def _lower(ctx: _Ctx, order: dict, vers: dict) -> dict[int, list[Action]]:
    """Turn compute items into actions with the transfers around them, then each rank's list:
    its stage's actions, or where a rank holds several stages their segments (one per compute
    item, with the updates that follow it) in the rank's order (``ctx.rank_order``). A
    transfer between two stages of one rank names that rank as its peer."""
    plan = ctx.plan
    n = plan.num_stages

    def rank(stage: int, microbatch: int) -> int:
        return plan.stages[stage].ranks[replica_of(plan, stage, microbatch)]

    segments: dict[tuple[int, int], list[list[Action]]] = {}
    for (s, q), items in order.items():
        segs: list[list[Action]] = [[]]  # segs[0]: what runs before the first compute item
        for it in items:
            out = segs[-1]
            if isinstance(it, tuple):
                if it[0] == "TP":
                    out.append(Action(s, Kind.TIED_POST, it[1], replica=q, tie=it[2]))
                    continue
                if it[0] == "TR":
                    out.append(Action(s, Kind.TIED_REDUCE, it[1], replica=q, version=it[1] + 1, tie=it[2]))
                    continue
                k = Kind.ALLREDUCE if it[0] == "AR" else Kind.OPTIMIZER_STEP
                out.append(Action(s, k, it[1], replica=q, version=it[1] + 1 if k is Kind.OPTIMIZER_STEP else None))
                continue
            out = []
            segs.append(out)
            v = vers[(s, q)][(it.kind, it.microbatch)]
            if it.kind is Kind.WEIGHT_GRAD:
                out.append(Action(s, Kind.WEIGHT_GRAD, it.microbatch, replica=q, version=v))
            elif it.kind is Kind.FORWARD:
                if s > 0:
                    out.append(Action(s, Kind.RECV_ACT, it.microbatch, replica=q, peer=rank(s - 1, it.microbatch)))
                out.append(Action(s, Kind.FORWARD, it.microbatch, replica=q, version=v))
                if s < n - 1:
                    out.append(Action(s, Kind.SEND_ACT, it.microbatch, replica=q, peer=rank(s + 1, it.microbatch)))
            else:
                if s < n - 1:
                    out.append(Action(s, Kind.RECV_GRAD, it.microbatch, replica=q, peer=rank(s + 1, it.microbatch)))
                out.append(Action(s, Kind.BACKWARD, it.microbatch, replica=q, version=v))
                if s > 0:
                    out.append(Action(s, Kind.SEND_GRAD, it.microbatch, replica=q, peer=rank(s - 1, it.microbatch)))
        segments[(s, q)] = segs
    actions: dict[int, list[Action]] = {}
    if ctx.rank_order is None:
        for (s, q), segs in segments.items():
            actions[plan.stages[s].ranks[q]] = [a for seg in segs for a in seg]
        return dict(sorted(actions.items()))
    for r, stage_order in ctx.rank_order.items():
        held = plan.stages_of_rank(r)
        out = [a for s in held for a in segments[(s, 0)][0]]
        nxt = {s: 1 for s in held}
        for s in stage_order:
            out += segments[(s, 0)][nxt[s]]
            nxt[s] += 1
        assert all(nxt[s] == len(segments[(s, 0)]) for s in held), "rank_order must list every compute item"
        actions[r] = out
    return dict(sorted(actions.items()))


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
    if info.microbatched and not info.flushes:
        _check_shares(plan, info.name, m)
    if info.split_backward and any(st.replicas > 1 for st in plan.stages):
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
    ctx = _Ctx(plan, info, minibatches, m, vertical_sync)
    return _finish(ctx, GENERATORS[info.name](ctx))


def _finish(ctx: _Ctx, compute: ComputeOrder) -> Schedule:
    """Passes 2 and 3 over a compute order: updates, shared parameters, versions, transfers."""
    order = {key: _add_tied(ctx, key[0], _add_updates(ctx, key[0], items)) for key, items in compute.items()}
    vers = _versions(ctx, order)
    actions = _lower(ctx, order, vers)
    options = {"vertical_sync": True} if ctx.vertical_sync else {}
    return Schedule(plan=ctx.plan, kind=ctx.kind.name, minibatches=ctx.minibatches, microbatches=ctx.microbatches,
                    actions=actions, options=options)


def schedule_from_order(plan: Plan, kind: str, minibatches: int, microbatches: int,
                        order: Mapping[tuple[int, int], Sequence[tuple[Kind, int]]],
                        rank_order: Mapping[int, Sequence[int]] | None = None) -> Schedule:
    """A schedule from a compute order written elsewhere (torch_interop.py reads torch's):
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
    want = {(s, q) for s, st in enumerate(plan.stages) for q in range(st.replicas)}
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
        compute[key] = [_C(k, int(i)) for k, i in items]
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
            for s, q in held.items():
                if listed.get(s, 0) != len(compute[(s, q)]):
                    raise ScheduleBuildError(
                        f"rank_order[{r}] lists stage {s} {listed.get(s, 0)} times, but the order has "
                        f"{len(compute[(s, q)])} compute items of stage {s}"
                        + (f" replica {q}" if plan.stages[s].replicas > 1 else "")
                        + ": rank_order needs one entry per compute item of the rank's stages")
            ranks[r] = list(rank_order[r])
    # one stage per rank: the rank's order is its stage's, nothing to interleave
    return _finish(_Ctx(plan, info, minibatches, m, False, ranks if plan.virtual else None), compute)
