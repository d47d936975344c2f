"""Prove a schedule before a tensor moves: dependencies, matching, versions, deadlock, memory.

:func:`validate_schedule` raises :class:`ScheduleError` with the rank × step grid around the
failing action (marked ``>>s1B3v2<<``) and one line saying what is wrong. It checks, in order:

1. structure — every rank of the plan has a list; every action names that rank's stage and
   replica, a microbatch/update id in range, a peer on the neighbouring stage that runs the
   same microbatch;
2. per rank, in list order — a forward runs once, after its activations arrived (RA); a
   backward runs after its forward on the same rank and after its gradient arrived (RG);
   a send follows the compute that produced what it sends; the weight versions follow the
   schedule kind's semantics (docs/architecture.md, "Schedule semantics"); AR/U in update
   order, after every backward of the update; live weight versions and in-flight
   activations stay within the kind's bounds; nothing is left undone;
3. matching — the k-th send from rank a to rank b carries the same microbatch as the k-th
   receive on b from a (the runtime matches point-to-point messages in FIFO order);
4. deadlock — execution with non-blocking sends, blocking receives and collective
   all-reduces among a stage's replicas runs every action; if it gets stuck, the waiting
   cycle is reported.

:func:`schedule_stats` gives the same memory counts (peak live versions, peak in-flight
activations per rank) to the simulator.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from .actions import Action, Kind, Schedule
from .plan import Plan
from .schedules import ROUND_ROBIN_KINDS, num_updates, replica_of, update_of, warmup_depth

__all__ = ["ScheduleError", "validate_schedule", "schedule_stats", "ScheduleStats", "format_grid", "bounds"]

_GRID_WINDOW = 8  # columns shown either side of the marked steps


class ScheduleError(ValueError):
    """A schedule breaks a rule; the message holds what is wrong and the rank × step grid."""


# --------------------------------------------------------------------- grid
def format_grid(schedule: Schedule, marks: list[tuple[int, int]] | None = None, window: int = _GRID_WINDOW) -> str:
    """The rank × step table of action texts, marked cells as ``>>text<<``.

    Only the columns around the marked steps are shown for long schedules (``window`` either side).
    """
    marks = marks or []
    acts = schedule.actions
    length = max((len(a) for a in acts.values()), default=0)
    if marks:
        lo = max(0, min(c for _, c in marks) - window)
        hi = min(length, max(c for _, c in marks) + window + 1)
    else:
        lo, hi = 0, min(length, 2 * window + 1)
    marked = set(marks)
    rows = []
    for r in sorted(acts):
        cells = []
        for c in range(lo, hi):
            text = str(acts[r][c]) if c < len(acts[r]) else "."
            cells.append(f">>{text}<<" if (r, c) in marked else text)
        rows.append((f"rank {r}", cells))
    header = ("step", [str(c) for c in range(lo, hi)])
    widths = [max(len(header[1][i]), *(len(cells[i]) for _, cells in rows)) for i in range(hi - lo)]
    lw = max(len(header[0]), *(len(name) for name, _ in rows)) if rows else 4
    lines = []
    for name, cells in [header, *rows]:
        lines.append(name.ljust(lw) + "  " + " ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
    note = f"(steps {lo}..{hi - 1} of {length})" if (lo > 0 or hi < length) else ""
    return "\n".join(lines) + ("\n" + note if note else "")


def _fail(schedule: Schedule, what: str, marks: list[tuple[int, int]]) -> ScheduleError:
    return ScheduleError(f"{schedule.kind} schedule is invalid: {what}\n{format_grid(schedule, marks)}")


# --------------------------------------------------------------------- bounds
def bounds(plan: Plan, kind: str, microbatches: int, vertical_sync: bool = False) -> dict[int, tuple[int, int]]:
    """Per stage, (max live weight versions, max in-flight activations) a replica may hold.

    pipedream: one version and one activation stash per in-flight minibatch, at most the warm-up
    depth ⌈(workers in stages ≥ s)/r_s⌉ (n − s, 0-indexed, in a straight pipeline; +1 version with
    vertical sync); naive: 1 version; 2bw: 2 versions; flush: 1 version, warm-up depth
    activations; gpipe: 1 version, every local microbatch of a batch.
    """
    out = {}
    for s, st in enumerate(plan.stages):
        w = warmup_depth(plan, s)
        if kind == "pipedream":
            out[s] = (w + (1 if vertical_sync else 0), w)
        elif kind == "naive":
            out[s] = (1, w)
        elif kind == "2bw":
            out[s] = (2, w)
        elif kind == "flush":
            out[s] = (1, w)
        elif kind == "gpipe":
            out[s] = (1, math.ceil(microbatches / st.replicas))
        else:
            raise ScheduleError(f"unknown schedule kind {kind!r}")
    return out


@dataclass
class ScheduleStats:
    """Per rank: peak live weight versions and peak in-flight (stashed) activations."""

    max_versions: dict[int, int]
    max_inflight: dict[int, int]


# --------------------------------------------------------------------- per-rank walk
def _walk_rank(schedule: Schedule, rank: int, v0: dict[int, int] | None, check: bool) -> tuple[int, int]:
    """Check one rank's list in order (when ``check``); return (peak versions, peak in-flight)."""
    plan, kind, m = schedule.plan, schedule.kind, schedule.microbatches
    n = plan.num_stages
    s, q = plan.stage_of_rank(rank)
    st = plan.stages[s]
    total = schedule.minibatches * m
    n_upd = num_updates(plan, kind, s, schedule.minibatches)
    vsync = bool((schedule.options or {}).get("vertical_sync"))
    ver_bound, act_bound = bounds(plan, kind, m, vsync)[s]
    acts = schedule.actions[rank]

    def err(step: int, what: str) -> ScheduleError:
        return _fail(schedule, f"rank {rank} step {step} ({acts[step]}): {what}", [(rank, step)])

    def peer_rank(stage: int, mb: int) -> int:
        return plan.stages[stage].ranks[replica_of(plan, kind, stage, mb, m)]

    mine = {i for i in range(total) if replica_of(plan, kind, s, i, m) == q}
    by_update: dict[int, list[int]] = {}
    per_batch: dict[int, int] = {}
    if check:
        for j in sorted(mine):
            by_update.setdefault(update_of(plan, kind, s, j, m), []).append(j)
            per_batch[j // m] = per_batch.get(j // m, 0) + 1
    fwd_ver: dict[int, int] = {}
    done_b: set[int] = set()
    got_act: set[int] = set()
    got_grad: set[int] = set()
    sent_act: set[int] = set()
    sent_grad: set[int] = set()
    inflight: dict[int, int] = {}  # mb -> version its stash holds
    held: dict[int, int] = {}  # version -> number of in-flight microbatches stashing it
    steps = 0
    reduced = -1
    peak_v = peak_a = 0
    batch_fwds: dict[int, int] = {}

    for k, a in enumerate(acts):
        if check:
            if a.stage != s or a.replica != q:
                raise err(k, f"rank {rank} runs stage {s} replica {q}, but the action is for stage {a.stage} replica {a.replica}")
            if a.kind.is_transfer and a.peer is None:
                raise err(k, "a transfer needs a peer (@rank)")
            if a.kind in (Kind.FORWARD, Kind.BACKWARD) and a.version is None:
                raise err(k, "a forward/backward needs a weight version (v<n>)")
            if a.kind.is_transfer or a.kind.is_compute:
                if not 0 <= a.id < total:
                    raise err(k, f"microbatch {a.id} is out of range 0..{total - 1}")
            elif not 0 <= a.id < n_upd:
                raise err(k, f"update {a.id} is out of range 0..{n_upd - 1}")
        i = a.id
        if a.kind is Kind.FORWARD:
            if check:
                if i not in mine:
                    raise err(k, f"microbatch {i} belongs to replica {replica_of(plan, kind, s, i, m)} of stage {s}, not replica {q}")
                if i in fwd_ver:
                    raise err(k, f"microbatch {i} is forwarded twice")
                if s > 0 and i not in got_act:
                    raise err(k, f"forward before its activations arrived (no RA{i} earlier on this rank)")
                _check_version(schedule, a, steps, v0, st.replicas, err, k, forward=True, fwd_version=None)
            fwd_ver[i] = a.version  # type: ignore[assignment]
            if i not in inflight:
                inflight[i] = a.version  # type: ignore[assignment]
                held[a.version] = held.get(a.version, 0) + 1  # type: ignore[index]
            b = i // m
            batch_fwds[b] = batch_fwds.get(b, 0) + 1
        elif a.kind is Kind.BACKWARD:
            if check:
                if i not in fwd_ver:
                    raise err(k, f"backward of microbatch {i} before its forward on this rank")
                if i in done_b:
                    raise err(k, f"microbatch {i} is backpropagated twice")
                if s < n - 1 and i not in got_grad:
                    raise err(k, f"backward before its gradient arrived (no RG{i} earlier on this rank)")
                if kind == "gpipe":
                    if batch_fwds.get(i // m, 0) < per_batch[i // m]:
                        raise err(k, f"gpipe runs every forward of batch {i // m} before its first backward")
                _check_version(schedule, a, steps, v0, st.replicas, err, k, forward=False, fwd_version=fwd_ver[i])
            done_b.add(i)
            hv = inflight.pop(i, None)
            if hv is not None:
                if held[hv] == 1:
                    del held[hv]
                else:
                    held[hv] -= 1
        elif a.kind is Kind.SEND_ACT or a.kind is Kind.RECV_ACT or a.kind is Kind.SEND_GRAD or a.kind is Kind.RECV_GRAD:
            if check:
                _check_transfer(a, k, s, n, i, peer_rank, fwd_ver, done_b, sent_act, sent_grad, got_act, got_grad, err)
            {Kind.SEND_ACT: sent_act, Kind.SEND_GRAD: sent_grad, Kind.RECV_ACT: got_act, Kind.RECV_GRAD: got_grad}[a.kind].add(i)
        elif a.kind is Kind.ALLREDUCE:
            if check:
                if st.replicas == 1:
                    raise err(k, f"stage {s} has one replica; there is nothing to all-reduce")
                if a.id != steps or reduced == a.id:
                    raise err(k, f"expected the all-reduce of update {steps} here")
                missing = [j for j in by_update.get(a.id, ()) if j not in done_b]
                if missing:
                    raise err(k, f"the all-reduce of update {a.id} runs before the backward of microbatch {missing[0]} it must include")
            reduced = a.id
        elif a.kind is Kind.OPTIMIZER_STEP:
            if check:
                if a.id != steps:
                    raise err(k, f"optimizer steps must come in order: expected U{steps}")
                if a.version != a.id + 1:
                    raise err(k, f"U{a.id} produces version {a.id + 1}, not {a.version}")
                if st.replicas > 1 and reduced != a.id:
                    raise err(k, f"stage {s} is replicated: AR{a.id} must come before U{a.id}")
                missing = [j for j in by_update.get(a.id, ()) if j not in done_b]
                if missing:
                    raise err(k, f"update {a.id} runs before the backward of microbatch {missing[0]} that it must include")
            steps += 1
        live_versions = (len(held) + (steps not in held)) if kind != "naive" else 1
        if live_versions > peak_v:
            peak_v = live_versions
        if len(inflight) > peak_a:
            peak_a = len(inflight)
        if check:
            if live_versions > ver_bound:
                raise err(k, f"{live_versions} weight versions alive on stage {s}; a {kind} schedule keeps at most {ver_bound}")
            if len(inflight) > act_bound:
                raise err(k, f"{len(inflight)} activations stashed on stage {s}; a {kind} schedule keeps at most {act_bound}")

    if check:
        last = len(acts) - 1 if acts else 0
        marks_end = [(rank, last)] if acts else []

        def end_err(what: str) -> ScheduleError:
            return _fail(schedule, f"rank {rank}: {what}", marks_end)

        for name, todo in (("forward", mine - set(fwd_ver)), ("backward", mine - done_b)):
            if todo:
                raise end_err(f"the {name} of microbatch(es) {sorted(todo)[:6]} never runs on this rank")
        if s < n - 1 and (mine - sent_act):
            raise end_err(f"activations of microbatch {min(mine - sent_act)} are never sent to stage {s + 1}")
        if s > 0 and (mine - sent_grad):
            raise end_err(f"the gradient of microbatch {min(mine - sent_grad)} is never sent to stage {s - 1}")
        if steps != n_upd:
            raise end_err(f"stage {s} takes {steps} optimizer steps; the schedule needs {n_upd}")
    return peak_v, peak_a


def _check_transfer(a: Action, k: int, s: int, n: int, i: int, peer_rank, fwd_ver, done_b, sent_act, sent_grad,
                    got_act, got_grad, err) -> None:
    kind = a.kind
    if kind is Kind.SEND_ACT:
        if s == n - 1:
            raise err(k, "the last stage sends no activations")
        want, produced, seen, what = peer_rank(s + 1, i), i in fwd_ver, sent_act, "its forward"
    elif kind is Kind.SEND_GRAD:
        if s == 0:
            raise err(k, "the first stage sends no gradients")
        want, produced, seen, what = peer_rank(s - 1, i), i in done_b, sent_grad, "its backward"
    elif kind is Kind.RECV_ACT:
        if s == 0:
            raise err(k, "the first stage receives no activations (its input comes from the data loader)")
        want, produced, seen, what = peer_rank(s - 1, i), True, got_act, ""
    else:
        if s == n - 1:
            raise err(k, "the last stage receives no gradients (it starts backward from the loss)")
        want, produced, seen, what = peer_rank(s + 1, i), True, got_grad, ""
    if a.peer != want:
        raise err(k, f"microbatch {i} is on rank {want} of the neighbouring stage, not rank {a.peer}")
    if not produced:
        raise err(k, f"sends microbatch {i} before {what} on this rank")
    if i in seen:
        raise err(k, f"microbatch {i} is transferred twice")


def _check_version(schedule: Schedule, a: Action, steps: int, v0: dict[int, int] | None, replicas: int, err, k: int,
                   forward: bool, fwd_version: int | None) -> None:
    """The version rules of docs/architecture.md "Schedule semantics"."""
    kind, m, v = schedule.kind, schedule.microbatches, a.version
    plan = schedule.plan
    if kind in ("flush", "gpipe"):
        want = a.id // m
        if v != want:
            raise err(k, f"{kind}: every F/B of batch {want} uses version {want}, not {v}")
        if steps != want:
            raise err(k, f"{kind}: batch {want} must run after exactly {want} optimizer steps (found {steps}): no flush")
        return
    if kind == "2bw":
        want = max(0, a.id // m - 1)
        if v != want:
            raise err(k, f"2bw: every F/B of batch {a.id // m} uses version {want} (W^(t-1)), not {v}")
        if not steps - 1 <= want <= steps:
            raise err(k, f"2bw: version {want} is not one of the two alive ({max(0, steps - 1)}, {steps})")
        return
    if kind == "naive":
        if v != steps:
            raise err(k, f"naive: {'F' if forward else 'B'} uses the newest weights, version {steps}, not {v}")
        return
    # pipedream
    if not forward:
        if v != fwd_version:
            raise err(k, f"weight stashing: B{a.id} must use the version its forward used ({fwd_version}), not {v}")
        return
    if v0 is not None and a.stage != 0:
        want = (v0[a.id] * plan.stages[0].replicas) // replicas
        if v != want:
            raise err(k, f"vertical sync: minibatch {a.id} uses the input stage's version, {want} here, not {v}")
        if want > steps:
            raise err(k, f"vertical sync: version {want} does not exist yet (only {steps} steps taken)")
        return
    if v != steps:
        raise err(k, f"pipedream: F{a.id} uses the newest weights on this rank, version {steps}, not {v}")


# --------------------------------------------------------------------- matching and deadlock
def _check_matching(schedule: Schedule) -> None:
    sends: dict[tuple[int, int, str], list[tuple[int, int]]] = {}
    recvs: dict[tuple[int, int, str], list[tuple[int, int]]] = {}
    for r, acts in schedule.actions.items():
        for k, a in enumerate(acts):
            if a.kind is Kind.SEND_ACT or a.kind is Kind.SEND_GRAD:
                sends.setdefault((r, a.peer, "A" if a.kind is Kind.SEND_ACT else "G"), []).append((k, a.id))  # type: ignore[arg-type]
            elif a.kind is Kind.RECV_ACT or a.kind is Kind.RECV_GRAD:
                recvs.setdefault((a.peer, r, "A" if a.kind is Kind.RECV_ACT else "G"), []).append((k, a.id))  # type: ignore[arg-type]
    for key in sorted(set(sends) | set(recvs)):
        src, dst, d = key
        what = "activations" if d == "A" else "gradients"
        ss, rr = sends.get(key, []), recvs.get(key, [])
        for j, (sd, rc) in enumerate(zip(ss, rr)):
            if sd[1] != rc[1]:
                raise _fail(
                    schedule,
                    f"{what} from rank {src} to rank {dst} are matched in order: send #{j} carries microbatch "
                    f"{sd[1]} but receive #{j} expects {rc[1]}",
                    [(src, sd[0]), (dst, rc[0])],
                )
        if len(ss) != len(rr):
            if len(ss) > len(rr):
                k, _ = ss[len(rr)]
                raise _fail(schedule, f"rank {src} sends {what} that rank {dst} never receives", [(src, k)])
            k, _ = rr[len(ss)]
            raise _fail(schedule, f"rank {dst} waits for {what} that rank {src} never sends", [(dst, k)])


def _check_deadlock(schedule: Schedule) -> None:
    """Run every list with non-blocking sends, blocking receives and stage-wide all-reduces."""
    plan = schedule.plan
    acts = schedule.actions
    pc = {r: 0 for r in acts}
    sent: dict[tuple[int, int, str], int] = {}
    got: dict[tuple[int, int, str], int] = {}
    waiting: dict[tuple[int, int, str], int] = {}  # channel -> rank blocked on it
    arrived: dict[tuple[int, int], set[int]] = {}
    ready = deque(sorted(acts))
    queued = set(ready)
    while ready:
        r = ready.popleft()
        queued.discard(r)
        lst = acts[r]
        p = pc[r]
        while p < len(lst):
            a = lst[p]
            kd = a.kind
            if kd is Kind.SEND_ACT or kd is Kind.SEND_GRAD:
                ch = (r, a.peer, "A" if kd is Kind.SEND_ACT else "G")
                sent[ch] = sent.get(ch, 0) + 1
                w = waiting.pop(ch, None)
                if w is not None and w not in queued:
                    ready.append(w)
                    queued.add(w)
            elif kd is Kind.RECV_ACT or kd is Kind.RECV_GRAD:
                ch = (a.peer, r, "A" if kd is Kind.RECV_ACT else "G")
                if got.get(ch, 0) >= sent.get(ch, 0):
                    waiting[ch] = r
                    break
                got[ch] = got.get(ch, 0) + 1
            elif kd is Kind.ALLREDUCE:
                key = (a.stage, a.id)
                group = arrived.setdefault(key, set())
                group.add(r)
                if len(group) < plan.stages[a.stage].replicas:
                    break
                # everyone is here: release the others (they are parked at this AR)
                for o in plan.stages[a.stage].ranks:
                    if o != r:
                        pc[o] += 1
                        if o not in queued:
                            ready.append(o)
                            queued.add(o)
            p += 1
        pc[r] = p
    stuck = {r: pc[r] for r in acts if pc[r] < len(acts[r])}
    if not stuck:
        return
    # explain: who waits for whom
    waits_for: dict[int, list[int]] = {}
    for r, p in stuck.items():
        a = acts[r][p]
        if a.kind.is_recv:
            waits_for[r] = [a.peer]  # type: ignore[list-item]
        elif a.kind is Kind.ALLREDUCE:
            waits_for[r] = [o for o in plan.stages[a.stage].ranks if o not in arrived.get((a.stage, a.id), set())]
        else:
            waits_for[r] = []
    cycle = _find_cycle(waits_for)
    shown = cycle or sorted(stuck)
    parts = []
    for r in shown:
        a = acts[r][stuck[r]]
        who = ", ".join(f"rank {o}" for o in waits_for.get(r, []))
        parts.append(f"rank {r} waits at {a} for {who or 'nothing'}")
    head = "deadlock: " + ("cycle " + " -> ".join(str(r) for r in cycle + cycle[:1]) + ": " if cycle else "")
    raise _fail(schedule, head + "; ".join(parts), [(r, stuck[r]) for r in shown])


def _find_cycle(graph: dict[int, list[int]]) -> list[int]:
    for start in sorted(graph):
        path: list[int] = []
        seen: dict[int, int] = {}
        node = start
        while node in graph and node not in seen:
            seen[node] = len(path)
            path.append(node)
            nxt = [o for o in graph[node] if o in graph]
            if not nxt:
                break
            node = nxt[0]
        else:
            if node in seen:
                return path[seen[node]:]
    return []


# --------------------------------------------------------------------- entry points
def validate_schedule(schedule: Schedule) -> None:
    """Raise :class:`ScheduleError` (with the marked grid) unless ``schedule`` is correct.

    See the module docstring for the rules. Runs in time linear in the number of actions.
    """
    plan = schedule.plan
    try:
        plan.validate()
    except ValueError as exc:
        raise ScheduleError(f"the schedule's plan is invalid: {exc}") from None
    if schedule.kind not in ("pipedream", "2bw", "flush", "gpipe", "naive"):
        raise ScheduleError(f"unknown schedule kind {schedule.kind!r}")
    if schedule.kind in ROUND_ROBIN_KINDS and schedule.microbatches != 1:
        raise ScheduleError(f"{schedule.kind} schedules have 1 microbatch per minibatch, not {schedule.microbatches}")
    if schedule.minibatches < 1 or schedule.microbatches < 1:
        raise ScheduleError("minibatches and microbatches must be positive")
    want = set(range(plan.num_workers))
    if set(schedule.actions) != want:
        raise ScheduleError(
            f"the plan has ranks {sorted(want)} but the schedule has lists for {sorted(schedule.actions)}"
        )
    v0 = None
    vsync = bool((schedule.options or {}).get("vertical_sync"))
    if vsync and schedule.kind != "pipedream":
        raise ScheduleError("vertical_sync applies to pipedream schedules only")
    order = sorted(schedule.actions, key=lambda r: plan.stage_of_rank(r))
    for r in order:
        _walk_rank(schedule, r, v0, check=True)
        if vsync and v0 is None and plan.stage_of_rank(r)[0] == 0 and r == plan.stages[0].ranks[-1]:
            v0 = {a.id: a.version for rr in plan.stages[0].ranks for a in schedule.actions[rr] if a.kind is Kind.FORWARD}  # type: ignore[misc]
    _check_matching(schedule)
    _check_deadlock(schedule)


def schedule_stats(schedule: Schedule) -> ScheduleStats:
    """Peak live weight versions and peak stashed activations per rank (no checking).

    Live versions = the newest version plus every version an in-flight microbatch stashed
    (1 for naive, which stashes none); in flight = forwarded, not yet backpropagated.
    """
    mv, ma = {}, {}
    naive = schedule.kind == "naive"
    F, B, U = Kind.FORWARD, Kind.BACKWARD, Kind.OPTIMIZER_STEP
    for r, acts in schedule.actions.items():
        inflight: dict[int, int] = {}
        held: dict[int, int] = {}
        steps = peak_v = peak_a = 0
        for a in acts:
            k = a.kind
            if k is F:
                if a.id not in inflight:
                    v = a.version
                    inflight[a.id] = v  # type: ignore[assignment]
                    held[v] = held.get(v, 0) + 1  # type: ignore[index]
                    if len(inflight) > peak_a:
                        peak_a = len(inflight)
            elif k is B:
                v = inflight.pop(a.id, None)  # type: ignore[assignment]
                if v is not None:
                    if held[v] == 1:
                        del held[v]
                    else:
                        held[v] -= 1
                continue
            elif k is U:
                steps += 1
            else:
                continue
            live = 1 if naive else len(held) + (steps not in held)
            if live > peak_v:
                peak_v = live
        mv[r], ma[r] = max(peak_v, 1 if acts else 0), peak_a
    return ScheduleStats(max_versions=mv, max_inflight=ma)
