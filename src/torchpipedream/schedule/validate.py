"""Prove a schedule before a tensor moves: dependencies, matching, versions, deadlock, memory.

:func:`validate_schedule` raises :class:`ScheduleError` with the rank × step grid around the
failing action (marked ``>>s1B3v2<<``) and one line saying what is wrong. It checks, in order:

1. structure — every rank of the plan has a list; every action names that rank's stage and
   replica, a microbatch/update id in range, a peer on the neighbouring stage that runs the
   same microbatch;
2. per rank, in list order — a forward runs once, after its activations arrived (RA); a
   backward runs after its forward on the same rank and after its gradient arrived (RG); a
   weight-gradient pass (W, split backward) after its B, with the same version (the
   microbatch's activations count as held until then); a send follows the compute that
   produced what it sends; the weight versions follow the schedule kind's semantics
   (docs/architecture.md, "Schedule semantics"); AR/U in update order, after every backward of the update; live weight versions and in-flight
   activations stay within the kind's bounds; nothing is left undone;
3. matching — the k-th send from rank a to rank b carries the same microbatch as the k-th
   receive on b from a (the runtime matches point-to-point messages in FIFO order);
4. deadlock — execution with non-blocking sends, blocking receives and collective
   all-reduces among a stage's replicas (and a sharded stage's gathers and reduce-scatters:
   inside its F and B, or its own UN and RD actions for "zero1") runs every action; if it
   gets stuck, the waiting cycle is reported.

A stage sharded "zero1" has rules of its own for its UN, RD and RS (gather_rules.py).

:func:`schedule_stats` gives the same memory counts (peak live versions, peak in-flight
activations per rank) to the simulator.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from .actions import Action, Kind, Schedule, message_key, split_backwards
from .gather_rules import GatherWalk
from ..plans.kinds import ScheduleKind, UnknownKindError, VersionRule, schedule_kind
from .placement import (interleaved_warmup, num_updates, replica_of, sharding_support_problem, tied_support_problem,
                        update_of, v_shape_inflight, virtual_support_problem, warmup_depth)
from ..plans.plan import Plan

__all__ = ["ScheduleError", "validate_schedule", "update_barrier_problem", "uneven_updates", "schedule_stats", "ScheduleStats", "format_grid", "bounds",
           "rank_inflight_bound"]

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
def bounds(plan: Plan, kind: str | ScheduleKind, microbatches: int, vertical_sync: bool = False) -> dict[int, tuple[int, int]]:
    """Per stage, (max live weight versions, max in-flight activations) a replica may hold.

    pipedream: one version and one activation stash per in-flight minibatch, at most the warm-up
    depth ⌈(workers in stages ≥ s)/r_s⌉ (n − s, 0-indexed, in a straight pipeline; +1 version with
    vertical sync); naive: 1 version; 2bw: 2 versions; flush: 1 version, warm-up depth
    activations; gpipe: 1 version, every local microbatch of a batch; zb-h1: 1 version, the
    pipeline's depth n of activations (held until W); zb-h2: 2n − 1; a replica of r its share
    of either (``ScheduleKind.replica_inflight``), at most the ⌈μ/r⌉ it runs; interleaved: 1
    version, its rank's warm-up depth (``interleaved_warmup``), at most the batch; zb-v: 1
    version, the chunks a worker holds at most (``v_shape_inflight``), at most the batch;
    zb-2bw: 2 versions, 2bw's depth where m ≥ n − 1, else two batches (2m) on every stage.
    """
    try:
        info = schedule_kind(kind)
    except UnknownKindError as exc:
        raise ScheduleError(str(exc)) from None
    if info.v_shape:
        return {s: (1, min(microbatches, v_shape_inflight(plan, microbatches))) for s in range(plan.num_stages)}
    if info.virtual_stages:
        return {s: (1, min(microbatches, interleaved_warmup(plan, st.ranks[0], microbatches)))
                for s, st in enumerate(plan.stages)}
    out = {}
    first = warmup_depth(plan, 0)
    for s, st in enumerate(plan.stages):
        w = warmup_depth(plan, s)
        out[s] = (info.max_versions(w, vertical_sync),
                  info.max_inflight(w, math.ceil(microbatches / st.replicas), first, plan.num_stages, st.replicas))
    return out


@dataclass
class ScheduleStats:
    """Per rank: peak live weight versions and peak in-flight (stashed) activations, over all
    its stages; ``by_stage``: the same per (rank, stage), for ranks holding several."""

    max_versions: dict[int, int]
    max_inflight: dict[int, int]
    by_stage: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)


# --------------------------------------------------------------------- per-rank walk
class _RankWalk:
    """Checks one rank's list in order, keeping what has happened on the rank so far.

    One method per kind of action (:meth:`forward`, :meth:`backward`, :meth:`transfer`,
    :meth:`allreduce`, :meth:`step`); :meth:`run` checks each action's own fields, dispatches,
    then the memory bounds; :meth:`finish` checks that nothing was left undone.
    """

    def __init__(self, schedule: Schedule, rank: int, v0: dict[int, int] | None, stage: int | None = None) -> None:
        self.schedule, self.rank, self.v0 = schedule, rank, v0
        plan = self.plan = schedule.plan
        self.kind, self.m = schedule_kind(schedule.kind), schedule.microbatches
        self.n = plan.num_stages
        # One stage of a rank that holds several (virtual stages): the walk checks that
        # stage's actions, at their places in the rank's list.
        self.s, self.q = plan.stage_of_rank(rank) if stage is None else (stage, 0)
        self.replicas = plan.stages[self.s].replicas
        self.total = schedule.minibatches * self.m
        self.n_updates = num_updates(plan, self.kind, self.s, schedule.minibatches)
        vsync = bool((schedule.options or {}).get("vertical_sync"))
        self.version_bound, self.activation_bound = bounds(plan, self.kind, self.m, vsync)[self.s]
        declared = (schedule.options or {}).get("max_inflight")  # a schedule from elsewhere (torch_text.py)
        if isinstance(declared, int) and declared > self.activation_bound:
            self.activation_bound = declared
        self.acts = schedule.actions[rank]
        self.steps_of_stage = [k for k, a in enumerate(self.acts) if stage is None or a.stage == stage]
        self.mine = {i for i in range(self.total) if replica_of(plan, self.s, i) == self.q}
        self.by_update: dict[int, list[int]] = {}
        self.per_batch: dict[int, int] = {}
        for j in sorted(self.mine):
            self.by_update.setdefault(update_of(plan, self.kind, self.s, j, self.m), []).append(j)
            self.per_batch[j // self.m] = self.per_batch.get(j // self.m, 0) + 1
        self.fwd_ver: dict[int, int] = {}
        self.done_b: set[int] = set()
        # microbatches whose B computes the inputs' gradient only (a W follows)
        self.split = {i for s, i in split_backwards(self.acts) if s == self.s}
        self.done_w: set[int] = set()
        self.got_act: set[int] = set()
        self.got_grad: set[int] = set()
        self.sent_act: set[int] = set()
        self.sent_grad: set[int] = set()
        self.inflight: dict[int, int] = {}  # microbatch -> version its stash holds
        self.held: dict[int, int] = {}  # version -> number of in-flight microbatches stashing it
        self.batch_fwds: dict[int, int] = {}
        self.steps = 0
        self.reduced = -1
        self.tied = plan.tied_at(self.s)
        self.tied_steps = {k: 0 for k in self.tied}  # TR steps done, per shared parameter
        self.tied_posts = {k: 0 for k in self.tied}  # TP steps done
        st = plan.stages[self.s]
        self.gathers = GatherWalk(self.s, st.sharding if st.replicas > 1 else "replicate", self.n_updates,
                                  self.by_update)

    def err(self, step: int, what: str) -> ScheduleError:
        return _fail(self.schedule, f"rank {self.rank} step {step} ({self.acts[step]}): {what}", [(self.rank, step)])

    def peer_rank(self, stage: int, microbatch: int) -> int:
        return self.plan.stages[stage].ranks[replica_of(self.plan, stage, microbatch)]

    def run(self) -> None:
        handlers = {Kind.FORWARD: self.forward, Kind.BACKWARD: self.backward, Kind.WEIGHT_GRAD: self.weight_grad,
                    Kind.ALLREDUCE: self.allreduce,
                    Kind.OPTIMIZER_STEP: self.step, Kind.TIED_POST: self.tied_post,
                    Kind.TIED_REDUCE: self.tied_reduce, Kind.UNSHARD: self.gather, Kind.REDUCE_GRAD: self.gather,
                    Kind.RESHARD: self.gather}
        for k in self.steps_of_stage:
            a = self.acts[k]
            self.fields(k, a)
            handlers.get(a.kind, self.transfer)(k, a)
            live = 1 if self.kind.version_rule is VersionRule.NEWEST else len(self.held) + (self.steps not in self.held)
            if live > self.version_bound:
                raise self.err(k, f"{live} weight versions alive on stage {self.s}; a {self.kind.name} schedule "
                                  f"keeps at most {self.version_bound}")
            if len(self.inflight) > self.activation_bound:
                raise self.err(k, f"{len(self.inflight)} activations stashed on stage {self.s}; a {self.kind.name} "
                                  f"schedule keeps at most {self.activation_bound}")
        self.finish()

    def fields(self, k: int, a: Action) -> None:
        """The action names this rank's stage and replica, a peer if it moves data, a version if
        it computes, and an id in range."""
        if a.stage != self.s or a.replica != self.q:
            raise self.err(k, f"rank {self.rank} runs stage {self.s} replica {self.q}, but the action is for stage "
                              f"{a.stage} replica {a.replica}")
        if a.kind.is_transfer and a.peer is None:
            raise self.err(k, "a transfer needs a peer (@rank)")
        if a.kind.is_compute and a.version is None:
            raise self.err(k, "a forward/backward/weight-gradient pass needs a weight version (v<n>)")
        if (a.kind in (Kind.TIED_POST, Kind.TIED_REDUCE)) != (a.tie is not None):
            raise self.err(k, "a TP or TR names its shared parameter (t<k>), and only those do")
        if a.kind.is_transfer or a.kind.is_compute:
            if not 0 <= a.id < self.total:
                raise self.err(k, f"microbatch {a.id} is out of range 0..{self.total - 1}")
        elif not 0 <= a.id < self.n_updates:
            raise self.err(k, f"update {a.id} is out of range 0..{self.n_updates - 1}")

    def gather(self, k: int, a: Action) -> None:
        """UN, RD, RS of a stage sharded "zero1" (gather_rules.py)."""
        self.gathers.action(k, a, self.acts[k - 1] if k else None, self.done_b, self.split - self.done_w, self.err)

    def _on_gathered(self, k: int, a: Action) -> None:
        self.gathers.compute(k, a, update_of(self.plan, self.kind, self.s, a.id, self.m), self.err)

    def forward(self, k: int, a: Action) -> None:
        i = a.id
        self._on_gathered(k, a)
        if i not in self.mine:
            raise self.err(k, f"microbatch {i} belongs to replica {replica_of(self.plan, self.s, i)} of stage "
                              f"{self.s}, not replica {self.q}")
        if i in self.fwd_ver:
            raise self.err(k, f"microbatch {i} is forwarded twice")
        if self.s > 0 and i not in self.got_act:
            raise self.err(k, f"forward before its activations arrived (no RA{i} earlier on this rank)")
        _check_version(self.schedule, a, self.steps, self.v0, self.replicas, self.err, k, forward=True,
                       fwd_version=None)
        self._check_tied_versions(k, i)
        self.fwd_ver[i] = a.version  # type: ignore[assignment]
        self.inflight[i] = a.version  # type: ignore[assignment]
        self.held[a.version] = self.held.get(a.version, 0) + 1  # type: ignore[index]
        self.batch_fwds[i // self.m] = self.batch_fwds.get(i // self.m, 0) + 1

    def backward(self, k: int, a: Action) -> None:
        i = a.id
        self._on_gathered(k, a)
        if i not in self.fwd_ver:
            raise self.err(k, f"backward of microbatch {i} before its forward on this rank")
        if i in self.done_b:
            raise self.err(k, f"microbatch {i} is backpropagated twice")
        if self.s < self.n - 1 and i not in self.got_grad:
            raise self.err(k, f"backward before its gradient arrived (no RG{i} earlier on this rank)")
        if self.kind.forwards_first and self.batch_fwds.get(i // self.m, 0) < self.per_batch[i // self.m]:
            raise self.err(k, f"{self.kind.name} runs every forward of batch {i // self.m} before its first backward")
        _check_version(self.schedule, a, self.steps, self.v0, self.replicas, self.err, k, forward=False,
                       fwd_version=self.fwd_ver[i])
        self.done_b.add(i)
        if i not in self.split:
            self._release(i)

    def weight_grad(self, k: int, a: Action) -> None:
        i = a.id
        if i not in self.done_b:
            raise self.err(k, f"the weight-gradient pass of microbatch {i} before its B on this rank")
        if i in self.done_w:
            raise self.err(k, f"microbatch {i}'s weight gradient is computed twice")
        self._on_gathered(k, a)
        _check_version(self.schedule, a, self.steps, self.v0, self.replicas, self.err, k, forward=False,
                       fwd_version=self.fwd_ver[i])
        self.done_w.add(i)
        self._release(i)

    def _release(self, i: int) -> None:
        """Microbatch ``i``'s activations and weight stash are no longer needed."""
        version = self.inflight.pop(i)
        if self.held[version] == 1:
            del self.held[version]
        else:
            self.held[version] -= 1

    def transfer(self, k: int, a: Action) -> None:
        _check_transfer(a, k, self.s, self.n, a.id, self.peer_rank, self.fwd_ver, self.done_b, self.sent_act,
                        self.sent_grad, self.got_act, self.got_grad, self.err)
        {Kind.SEND_ACT: self.sent_act, Kind.SEND_GRAD: self.sent_grad, Kind.RECV_ACT: self.got_act,
         Kind.RECV_GRAD: self.got_grad}[a.kind].add(a.id)

    def _check_tied_versions(self, k: int, microbatch: int) -> None:
        """A shared parameter's version at a forward is the number of its TR steps so far on this
        rank; for the kinds that fix versions per batch it must be the batch's (t, or t − 1)."""
        rule, t = self.kind.version_rule, microbatch // self.m
        want = t if rule is VersionRule.BATCH else max(0, t - 1) if rule is VersionRule.PREVIOUS_BATCH else None
        for tie in self.tied:
            if want is not None and self.tied_steps[tie] != want:
                name = self.plan.tied[tie].name
                raise self.err(k, f"{self.kind.name}: shared parameter {name!r} is at version {self.tied_steps[tie]} "
                                  f"here, but every use in batch {t} must see version {want}: its TR{want - 1} is "
                                  "missing before this forward" if self.tied_steps[tie] < want else
                                  f"{self.kind.name}: shared parameter {name!r} is already at version "
                                  f"{self.tied_steps[tie]}, batch {t} must see {want}")

    def _tie_index(self, k: int, a: Action) -> int:
        if a.tie not in self.tied:
            raise self.err(k, f"stage {self.s} holds no copy of shared parameter {a.tie} "
                              f"(plan.tied: {[(t.name, t.stages) for t in self.plan.tied]})")
        return a.tie  # type: ignore[return-value]

    def tied_post(self, k: int, a: Action) -> None:
        tie = self._tie_index(k, a)
        if a.id != self.tied_posts[tie]:
            raise self.err(k, f"the posts of shared parameter {self.plan.tied[tie].name!r} come in order: "
                              f"expected TP{self.tied_posts[tie]}")
        missing = self._missing_backward(a.id)
        if missing is not None:
            raise self.err(k, f"TP{a.id} posts the gradient before the backward of microbatch {missing} adds to it")
        self.tied_posts[tie] += 1

    def tied_reduce(self, k: int, a: Action) -> None:
        tie = self._tie_index(k, a)
        done = self.tied_steps[tie]
        if a.id != done:
            raise self.err(k, f"the steps of shared parameter {self.plan.tied[tie].name!r} come in order: "
                              f"expected TR{done}")
        if a.version != a.id + 1:
            raise self.err(k, f"TR{a.id} produces version {a.id + 1}, not {a.version}")
        if self.tied_posts[tie] <= a.id:
            raise self.err(k, f"TR{a.id} waits for an all-reduce this rank has not posted (no TP{a.id} before it)")
        self.tied_steps[tie] = done + 1

    def _missing_backward(self, update: int) -> int | None:
        """A microbatch of ``update`` whose weight gradient is not computed yet (its B, or its
        W where the backward is split)."""
        return next((j for j in self.by_update.get(update, ())
                     if j not in self.done_b or (j in self.split and j not in self.done_w)), None)

    def allreduce(self, k: int, a: Action) -> None:
        if self.replicas == 1:
            raise self.err(k, f"stage {self.s} has one replica; there is nothing to all-reduce")
        if a.id != self.steps or self.reduced == a.id:
            raise self.err(k, f"expected the all-reduce of update {self.steps} here")
        self.gathers.step(k, a, self.err)
        missing = self._missing_backward(a.id)
        if missing is not None:
            raise self.err(k, f"the all-reduce of update {a.id} runs before the backward of microbatch {missing} "
                              "it must include")
        self.reduced = a.id

    def step(self, k: int, a: Action) -> None:
        if a.id != self.steps:
            raise self.err(k, f"optimizer steps must come in order: expected U{self.steps}")
        if a.version != a.id + 1:
            raise self.err(k, f"U{a.id} produces version {a.id + 1}, not {a.version}")
        self.gathers.step(k, a, self.err)
        if self.replicas > 1 and self.reduced != a.id:
            raise self.err(k, f"stage {self.s} is replicated: AR{a.id} must come before U{a.id}")
        missing = self._missing_backward(a.id)
        if missing is not None:
            raise self.err(k, f"update {a.id} runs before the backward of microbatch {missing} that it must include")
        self.steps += 1

    def finish(self) -> None:
        marks = [(self.rank, len(self.acts) - 1)] if self.acts else []

        def end_err(what: str) -> ScheduleError:
            return _fail(self.schedule, f"rank {self.rank}: {what}", marks)

        for name, todo in (("forward", self.mine - set(self.fwd_ver)), ("backward", self.mine - self.done_b),
                           ("weight-gradient pass", self.split - self.done_w)):
            if todo:
                raise end_err(f"the {name} of microbatch(es) {sorted(todo)[:6]} never runs on this rank")
        if self.s < self.n - 1 and (self.mine - self.sent_act):
            raise end_err(f"activations of microbatch {min(self.mine - self.sent_act)} are never sent to stage "
                          f"{self.s + 1}")
        if self.s > 0 and (self.mine - self.sent_grad):
            raise end_err(f"the gradient of microbatch {min(self.mine - self.sent_grad)} is never sent to stage "
                          f"{self.s - 1}")
        if self.steps != self.n_updates:
            raise end_err(f"stage {self.s} takes {self.steps} optimizer steps; the schedule needs {self.n_updates}")
        self.gathers.finish(end_err)
        for tie, done in self.tied_steps.items():
            if done != self.n_updates:
                raise end_err(f"shared parameter {self.plan.tied[tie].name!r} takes {done} TR steps on stage {self.s}; "
                              f"the schedule needs {self.n_updates}")


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
    kind, m, v = schedule_kind(schedule.kind), schedule.microbatches, a.version
    plan = schedule.plan
    rule = kind.version_rule
    if rule is VersionRule.BATCH:
        want = a.id // m
        if v != want:
            raise err(k, f"{kind.name}: every F/B of batch {want} uses version {want}, not {v}")
        if steps != want:
            raise err(k, f"{kind.name}: batch {want} must run after exactly {want} optimizer steps (found {steps}): no flush")
        return
    if rule is VersionRule.PREVIOUS_BATCH:
        want = max(0, a.id // m - 1)
        if v != want:
            raise err(k, f"{kind.name}: every F/B of batch {a.id // m} uses version {want} (W^(t-1)), not {v}")
        if not steps - 1 <= want <= steps:
            raise err(k, f"{kind.name}: version {want} is not one of the two alive ({max(0, steps - 1)}, {steps})")
        return
    if rule is VersionRule.NEWEST:
        if v != steps:
            raise err(k, f"{kind.name}: {'F' if forward else 'B'} uses the newest weights, version {steps}, not {v}")
        return
    # STASHED (pipedream)
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
        raise err(k, f"{kind.name}: F{a.id} uses the newest weights on this rank, version {steps}, not {v}")


# --------------------------------------------------------------------- matching and deadlock
def rank_inflight_bound(plan: Plan, kind: str | ScheduleKind, microbatches: int, rank: int) -> int:
    """Microbatch chunks a rank holding several stages keeps in flight at most, over all of them:
    interleaved its warm-up depth (``interleaved_warmup``), zb-v 2p + 2 (``v_shape_inflight``)."""
    info = schedule_kind(kind)
    return v_shape_inflight(plan, microbatches) if info.v_shape else interleaved_warmup(plan, rank, microbatches)


def _check_rank_inflight(schedule: Schedule, kind: ScheduleKind, rank: int) -> None:
    """A rank holding several stages keeps at most ``rank_inflight_bound`` microbatch chunks in
    flight over all of them, or what a schedule from elsewhere declares
    (``options["max_rank_inflight"]``, torch_text.py)."""
    plan, m = schedule.plan, schedule.microbatches
    bound = rank_inflight_bound(plan, kind, m, rank)
    declared = (schedule.options or {}).get("max_rank_inflight")
    if isinstance(declared, int):
        bound = max(bound, declared)
    acts = schedule.actions[rank]
    split = split_backwards(acts)
    held: set[tuple[int, int]] = set()
    for k, a in enumerate(acts):
        key = (a.stage, a.id)
        if a.kind is Kind.FORWARD:
            held.add(key)
            if len(held) > bound:
                raise _fail(schedule, f"rank {rank} step {k} ({a}): {len(held)} microbatch chunks in flight over its "
                                      f"stages {plan.stages_of_rank(rank)}; a {kind.name} worker holds at most {bound}",
                            [(rank, k)])
        elif a.kind is Kind.WEIGHT_GRAD or (a.kind is Kind.BACKWARD and key not in split):
            held.discard(key)


def _check_matching(schedule: Schedule) -> None:
    sends: dict[tuple[int, int, str], list[tuple[int, tuple[int, int]]]] = {}
    recvs: dict[tuple[int, int, str], list[tuple[int, tuple[int, int]]]] = {}
    for r, acts in schedule.actions.items():
        for k, a in enumerate(acts):
            if a.kind is Kind.SEND_ACT or a.kind is Kind.SEND_GRAD:
                sends.setdefault((r, a.peer, "A" if a.kind is Kind.SEND_ACT else "G"), []).append((k, message_key(a)))  # type: ignore[arg-type]
            elif a.kind is Kind.RECV_ACT or a.kind is Kind.RECV_GRAD:
                recvs.setdefault((a.peer, r, "A" if a.kind is Kind.RECV_ACT else "G"), []).append((k, message_key(a)))  # type: ignore[arg-type]
    for key in sorted(set(sends) | set(recvs)):
        src, dst, d = key
        what = "activations" if d == "A" else "gradients"
        ss, rr = sends.get(key, []), recvs.get(key, [])
        for j, (sd, rc) in enumerate(zip(ss, rr)):
            if sd[1] != rc[1]:
                raise _fail(
                    schedule,
                    f"{what} from rank {src} to rank {dst} are matched in order: send #{j} carries microbatch "
                    f"{sd[1][1]} but receive #{j} expects {rc[1][1]}"
                    + (f" (of stage {sd[1][0]}'s forward, not stage {rc[1][0]}'s)" if sd[1][0] != rc[1][0] else ""),
                    [(src, sd[0]), (dst, rc[0])],
                )
        if len(ss) != len(rr):
            if len(ss) > len(rr):
                k, _ = ss[len(rr)]
                raise _fail(schedule, f"rank {src} sends {what} that rank {dst} never receives", [(src, k)])
            k, _ = rr[len(ss)]
            raise _fail(schedule, f"rank {dst} waits for {what} that rank {src} never sends", [(dst, k)])


class _BlockingRun:
    """A schedule's lists run with non-blocking sends, blocking receives and stage-wide
    all-reduces, one rank at a time, until no rank can move."""

    def __init__(self, schedule: Schedule) -> None:
        self.plan = schedule.plan
        self.acts = schedule.actions
        self.position = {r: 0 for r in self.acts}  # each rank's next action
        self.sent: dict[tuple[int, int, str], int] = {}
        self.got: dict[tuple[int, int, str], int] = {}
        self.waiting: dict[tuple[int, int, str], int] = {}  # channel -> rank blocked on it
        self.arrived: dict[tuple[int, int], set[int]] = {}  # collective -> the ranks that reached it
        self.ready = deque(sorted(self.acts))
        self.queued = set(self.ready)

    def run(self) -> dict[int, int]:
        """Run until no rank can move; the ranks that stopped before their list's end, with
        the position of the action each waits at."""
        while self.ready:
            r = self.ready.popleft()
            self.queued.discard(r)
            actions = self.acts[r]
            p = self.position[r]
            while p < len(actions) and self._proceeds(r, actions[p]):
                p += 1
            self.position[r] = p
        return {r: self.position[r] for r in self.acts if self.position[r] < len(self.acts[r])}

    def _wake(self, rank: int) -> None:
        if rank not in self.queued:
            self.ready.append(rank)
            self.queued.add(rank)

    def _proceeds(self, r: int, a: Action) -> bool:
        """Run rank ``r``'s action ``a``; False where the rank must wait at it."""
        kd = a.kind
        if kd is Kind.SEND_ACT or kd is Kind.SEND_GRAD:
            channel = (r, a.peer, "A" if kd is Kind.SEND_ACT else "G")
            self.sent[channel] = self.sent.get(channel, 0) + 1
            receiver = self.waiting.pop(channel, None)
            if receiver is not None:
                self._wake(receiver)
        elif kd is Kind.RECV_ACT or kd is Kind.RECV_GRAD:
            channel = (a.peer, r, "A" if kd is Kind.RECV_ACT else "G")
            if self.got.get(channel, 0) >= self.sent.get(channel, 0):
                self.waiting[channel] = r
                return False
            self.got[channel] = self.got.get(channel, 0) + 1
        elif kd is Kind.TIED_POST:
            key, members = _collective(self.plan, a)
            posted = self.arrived.setdefault(key, set())
            posted.add(r)
            if len(posted) == len(members):  # the all-reduce can complete: wake its waiters
                for o in members:
                    if o != r:
                        self._wake(o)
        elif kd is Kind.TIED_REDUCE:
            key, members = _collective(self.plan, a)
            return len(self.arrived.get(key, ())) >= len(members)
        elif kd is Kind.ALLREDUCE:
            return self._allreduce(r, a)
        return True

    def _allreduce(self, r: int, a: Action) -> bool:
        """Rank ``r`` reaches an all-reduce: it waits there until every member has; the last to
        arrive releases the others (parked at this collective)."""
        return self._meet(r, *_collective(self.plan, a))

    def _meet(self, r: int, key: tuple, members: list[int]) -> bool:
        """Rank ``r`` reaches the collective ``key`` of ``members``: :meth:`_allreduce`'s rule."""
        group = self.arrived.setdefault(key, set())
        group.add(r)
        if len(group) < len(members):
            return False
        for o in members:
            if o != r:
                self.position[o] += 1
                self._wake(o)
        return True


class _ShardedRun(_BlockingRun):
    """The blocking run where every F and B of a sharded stage (``Stage.sharding``) is also a
    collective of the stage's replicas: torch's FSDP2 gathers the weights (and, in B, reduces
    the gradients) inside them, so the replicas' k-th F/B must meet, and be of one kind (each
    replica's list is then a run of the same collectives: no deadlock, none left unmatched).
    A stage sharded "zero1" gathers and reduces in its UN and RD actions instead: those meet,
    its F and B run alone."""

    def __init__(self, schedule: Schedule) -> None:
        super().__init__(schedule)
        # (rank, kind, microbatch) of a sharded stage's F/B -> the key of its collective:
        # (stage, how many F/B of the rank's stage came before it, kind)
        self.keys: dict[tuple[int, str, int], tuple] = {}
        for r, actions in self.acts.items():
            seen: dict[int, int] = {}
            for a in actions:
                if a.kind in (Kind.FORWARD, Kind.BACKWARD) and _gathers_in_passes(self.plan, a.stage):
                    k = seen.get(a.stage, 0)
                    seen[a.stage] = k + 1
                    self.keys[(r, a.kind.value, a.id)] = ("FSDP", a.stage, k, a.kind.value)

    def _proceeds(self, r: int, a: Action) -> bool:
        key = self.keys.get((r, a.kind.value, a.id))
        if key is not None:
            return self._meet(r, key, list(self.plan.stages[a.stage].ranks))
        if a.kind is Kind.UNSHARD or a.kind is Kind.REDUCE_GRAD:
            return self._meet(r, *_collective(self.plan, a))
        return super()._proceeds(r, a)


def _gathers_in_passes(plan: Plan, stage: int) -> bool:
    """Whether FSDP2 gathers (and reduces) inside each F and B of ``stage``: sharded, not "zero1"."""
    return plan.stages[stage].sharded and plan.stages[stage].sharding != "zero1"


class _UpdateBarrierRun(_ShardedRun):
    """The blocking run (with a sharded stage's collectives, :class:`_ShardedRun`) with one more
    collective: every rank's first U or TR of each update waits there for every rank's (a global
    reduction taken there: clipping by the global norm)."""

    def __init__(self, schedule: Schedule, firsts: set[tuple[int, Action]]) -> None:
        super().__init__(schedule)
        self.firsts = firsts  # (rank, action) of each rank's first U/TR of an update
        self.members = sorted(schedule.actions)

    def _proceeds(self, r: int, a: Action) -> bool:
        if (r, a) in self.firsts:
            group = self.arrived.setdefault(("UPDATE", a.id), set())
            if r not in group:
                group.add(r)
                if len(group) == len(self.members):
                    for o in self.members:
                        self._wake(o)
            if len(group) < len(self.members):
                return False
        return super()._proceeds(r, a)


def uneven_updates(schedule: Schedule) -> str | None:
    """Why update ``t`` is not the same minibatches' update on every stage, or None: under pipedream
    and naive a replicated stage's update merges one minibatch of each replica, so
    it makes fewer updates than a stage without replicas (a learning rate by update count, or a
    norm per update, would then differ between stages). The kinds that split minibatches
    (flush, gpipe, 2bw, ...) update every stage once per minibatch or batch."""
    counts: dict[int, int] = {}
    for actions in schedule.actions.values():
        for a in actions:
            if a.kind is Kind.OPTIMIZER_STEP and a.replica == 0:
                counts[a.stage] = counts.get(a.stage, 0) + 1
    if len(set(counts.values())) > 1:
        few, many = min(counts, key=counts.get), max(counts, key=counts.get)  # type: ignore[arg-type]
        return (f"stage {few} makes {counts[few]} updates and stage {many} {counts[many]} in "
                f"{schedule.minibatches} minibatches (a {schedule.kind} stage with replicas updates once per "
                "minibatch of each replica together)")
    return None


def _late_gradient(rank: int, actions: list[Action]) -> tuple[str | None, dict[int, int]]:
    """Whether a rank's first step (U or TR) of each update comes after everything that makes
    the update's gradient on that rank: each stage's B and W since its previous U (what its U
    applies), the update's AR and TP (a replicated stage's sum, a shared parameter's posted
    sum). Returns (the problem or None, update -> the
    position of its first step)."""
    count: dict[int, int] = {}  # stage -> its U so far: the update its next B and W feed
    last_part: dict[int, int] = {}  # update -> position of the last action making its gradient
    first: dict[int, int] = {}
    for k, a in enumerate(actions):
        if a.kind in (Kind.BACKWARD, Kind.WEIGHT_GRAD):
            last_part[count.get(a.stage, 0)] = k
        elif a.kind in (Kind.ALLREDUCE, Kind.TIED_POST):
            last_part[a.id] = k
        elif a.kind in (Kind.OPTIMIZER_STEP, Kind.TIED_REDUCE):
            first.setdefault(a.id, k)
            if a.kind is Kind.OPTIMIZER_STEP:
                count[a.stage] = count.get(a.stage, 0) + 1
    for update, k in sorted(first.items()):
        late = last_part.get(update, -1)
        if late > k:
            shared = " (a parameter shared by stages posts its gradient after the stage's step)" \
                if actions[late].kind is Kind.TIED_POST else ""
            return (f"rank {rank} steps update {update} at {actions[k]} before its {actions[late]}: the update's "
                    f"gradients are not all there when its first step runs{shared}", first)
    return None, first


def update_barrier_problem(schedule: Schedule) -> str | None:
    """Why a reduction over every rank at each update (taken at each rank's first U or TR of
    the update) cannot run exactly in ``schedule``; None when it can. It needs (1) every rank
    to hold all of the update's gradients at that point (:func:`_late_gradient`); (2) no
    deadlock with that extra collective."""
    uneven = uneven_updates(schedule)
    if uneven:
        return uneven
    firsts: set[tuple[int, Action]] = set()
    for r, actions in schedule.actions.items():
        problem, first_steps = _late_gradient(r, actions)
        if problem:
            return problem
        firsts.update((r, actions[k]) for k in first_steps.values())
    run = _UpdateBarrierRun(schedule, firsts)
    stuck = run.run()
    if stuck:
        r, k = min(stuck.items())
        return f"rank {r} would wait forever at {schedule.actions[r][k]} with a collective at every update"
    return None


def _check_deadlock(schedule: Schedule) -> None:
    """Run every list with non-blocking sends, blocking receives and stage-wide all-reduces
    (and, on sharded stages, every F and B a collective of the stage's replicas)."""
    run = _ShardedRun(schedule) if any(st.sharded for st in schedule.plan.stages) else _BlockingRun(schedule)
    stuck = run.run()
    if stuck:
        _report_deadlock(schedule, stuck, run.arrived)


def _report_deadlock(schedule: Schedule, stuck: dict[int, int], arrived: dict[tuple[int, int], set[int]]) -> None:
    """Raise the deadlock's error: who waits for whom, a cycle of waits where there is one."""
    acts = schedule.actions
    waits_for: dict[int, list[int]] = {}
    for r, p in stuck.items():
        a = acts[r][p]
        if a.kind.is_recv:
            waits_for[r] = [a.peer]  # type: ignore[list-item]
        elif a.kind in (Kind.ALLREDUCE, Kind.TIED_REDUCE, Kind.UNSHARD, Kind.REDUCE_GRAD):
            key, members = _collective(schedule.plan, a)
            waits_for[r] = [o for o in members if o not in arrived.get(key, set())]
        elif a.kind in (Kind.FORWARD, Kind.BACKWARD) and _gathers_in_passes(schedule.plan, a.stage):
            waits_for[r] = [o for o in schedule.plan.stages[a.stage].ranks if o != r and o in stuck]
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


def _collective(plan: Plan, a: Action) -> tuple[tuple, list[int]]:
    """The key and the member ranks of a collective action: an AR (or a zero1 stage's UN or RD)
    among its stage's replicas, a TP/TR among every rank of every stage holding the shared
    parameter."""
    if a.kind in (Kind.TIED_POST, Kind.TIED_REDUCE):
        members = [r for s in plan.tied[a.tie].stages for r in plan.stages[s].ranks]  # type: ignore[index]
        return ("TR", a.tie, a.id), members
    return (a.kind.value, a.stage, a.id), list(plan.stages[a.stage].ranks)


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
    try:
        kind = schedule_kind(schedule.kind)
    except UnknownKindError as exc:
        raise ScheduleError(str(exc)) from None
    if kind.round_robin and schedule.microbatches != 1:
        raise ScheduleError(f"{kind.name} schedules have 1 microbatch per minibatch, not {schedule.microbatches}")
    if schedule.minibatches < 1 or schedule.microbatches < 1:
        raise ScheduleError("minibatches and microbatches must be positive")
    want = set(range(plan.num_workers))
    if set(schedule.actions) != want:
        raise ScheduleError(
            f"the plan has ranks {sorted(want)} but the schedule has lists for {sorted(schedule.actions)}"
        )
    v0 = None
    vsync = bool((schedule.options or {}).get("vertical_sync"))
    if vsync and not kind.stashes_weights:
        raise ScheduleError("vertical_sync applies to schedules with weight stashing (pipedream) only")
    problem = tied_support_problem(plan, kind, vsync) or sharding_support_problem(plan, kind)
    if problem:
        raise ScheduleError(problem)
    problem = virtual_support_problem(plan, kind)
    if problem:
        raise ScheduleError(problem)
    if plan.virtual:
        for r, acts in schedule.actions.items():
            held = plan.stages_of_rank(r)
            stray = next((k for k, a in enumerate(acts) if a.stage not in held), None)
            if stray is not None:
                raise _fail(schedule, f"rank {r} holds stages {held}, not stage {acts[stray].stage}", [(r, stray)])
            for s in held:
                _RankWalk(schedule, r, None, stage=s).run()
            _check_rank_inflight(schedule, kind, r)
    else:
        for r in sorted(schedule.actions, key=lambda r: plan.stage_of_rank(r)):
            _RankWalk(schedule, r, v0).run()
            if vsync and v0 is None and plan.stage_of_rank(r)[0] == 0 and r == plan.stages[0].ranks[-1]:
                v0 = {a.id: a.version for rr in plan.stages[0].ranks for a in schedule.actions[rr]  # type: ignore[misc]
                      if a.kind is Kind.FORWARD}
    _check_matching(schedule)
    _check_deadlock(schedule)


def schedule_stats(schedule: Schedule) -> ScheduleStats:
    """Peak live weight versions and peak stashed activations per rank (no checking).

    Live versions = the newest version plus every version an in-flight microbatch stashed
    (1 for naive, which stashes none); in flight = forwarded, not yet backpropagated (until its
    W where the backward is split). A rank holding several stages counts each stage's own
    versions and microbatches (``by_stage``) and, for the rank, their sums at each point.
    """
    mv, ma, by_stage = {}, {}, {}
    naive = schedule_kind(schedule.kind).version_rule is VersionRule.NEWEST
    F, B, W, U = Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT_GRAD, Kind.OPTIMIZER_STEP
    for r, acts in schedule.actions.items():
        split = split_backwards(acts)
        inflight: dict[tuple[int, int], int] = {}  # (stage, microbatch) -> version
        held: dict[int, dict[int, int]] = {}  # stage -> version -> microbatches stashing it
        steps: dict[int, int] = {}
        count: dict[int, int] = {}  # stage -> microbatches in flight
        peak_v = peak_a = 0
        stage_peaks: dict[int, list[int]] = {}
        for a in acts:
            k, key, s = a.kind, (a.stage, a.id), a.stage
            mine = held.setdefault(s, {})
            if k is F:
                if key in inflight:
                    continue
                inflight[key] = a.version  # type: ignore[assignment]
                count[s] = count.get(s, 0) + 1
                mine[a.version] = mine.get(a.version, 0) + 1  # type: ignore[index]
            elif (k is B and key not in split) or k is W:
                v = inflight.pop(key, None)
                if v is not None:
                    count[s] -= 1
                    if mine[v] == 1:
                        del mine[v]
                    else:
                        mine[v] -= 1
                continue
            elif k is U:
                steps[s] = steps.get(s, 0) + 1
            else:
                continue
            live = {t: (1 if naive else len(h) + (steps.get(t, 0) not in h)) for t, h in held.items()}
            per_stage = stage_peaks.setdefault(s, [0, 0])
            per_stage[0] = max(per_stage[0], live[s])
            per_stage[1] = max(per_stage[1], count.get(s, 0))
            peak_v = max(peak_v, sum(live.values()))
            peak_a = max(peak_a, len(inflight))
        mv[r], ma[r] = max(peak_v, 1 if acts else 0), peak_a
        for s in {a.stage for a in acts}:
            v_peak, a_peak = stage_peaks.get(s, [0, 0])
            by_stage[(r, s)] = (max(v_peak, 1), a_peak)
    return ScheduleStats(max_versions=mv, max_inflight=ma, by_stage=by_stage)
