"""The schedule kinds and their properties: one registry that every part of the library asks.

A kind is named in plans, schedules, traces and on the command line by its text
(``"pipedream"``, ``"2bw"``, ...); in code it is a :class:`ScheduleKind` with the properties
that the planner, the generators, the validator, the runtime and the CLI need. Code asks a
property (``kind.microbatched``, ``kind.version_rule``), never compares names, so a new kind
is one entry here, its generator included.

The generator (the kind's compute order, pass 1 of ``build_schedule``) is named, not held:
``order="two_bw"`` names the function ``schedule.orders.two_bw``, which
``schedule.orders.order_function(kind)`` returns. The entry cannot hold the function itself:
plans/ sits below schedule/ (the generators import ``Plan`` and this registry), so that would
be an import circle. tests/test_schedules.py checks that every kind's order exists and that
every generator in schedule/orders.py belongs to a kind.

The semantics behind the properties (docs/architecture.md, "Schedule semantics"; w^(k) is a
stage's weights after k updates, minibatch t, n stages, s counted from 0):

=========== ====================================================== =========================
kind        weights minibatch t uses                                versions alive per stage
=========== ====================================================== =========================
pipedream   the newest at its forward, stashed for its backward     up to n − s
2bw         W^(t−1) for every microbatch of batch t                 2
flush       W^(t)                                                   1
gpipe       W^(t), all forwards of a batch before its backwards     1
zb-h1       W^(t); backward split into B (inputs) and W (weights)   1
zb-h2       as zb-h1, twice the warm-up: no bubble between batches  1
interleaved W^(t); v stages (chunks) per worker, looped placement       1
zb-v        W^(t); two stages per worker in a V, backward split       1
zb-2bw      W^(t−1), as 2bw; backward split into B and W             2
naive       the newest at each of its forward and its backward      1
=========== ====================================================== =========================

No torch, no numpy.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

__all__ = ["VersionRule", "ScheduleKind", "SCHEDULE_KINDS", "KIND_NAMES", "AUTO", "schedule_kind", "UnknownKindError"]

#: Not a kind: the name that asks the planner to choose the kind and microbatches (search/auto.py).
AUTO = "auto"


class UnknownKindError(ValueError):
    """A schedule kind name that the registry does not know; the message lists the known ones."""


class VersionRule(enum.Enum):
    """Which weight version the forward and the backward of a microbatch use."""

    #: every F and B of batch t use W^(t): plain training with gradient accumulation (flush, gpipe, zb-h1, zb-h2)
    BATCH = "batch"
    #: every F and B of batch t use W^(t−1): one update of staleness (2bw)
    PREVIOUS_BATCH = "previous batch"
    #: F uses the newest version on its stage, B the one F used (weight stashing: pipedream)
    STASHED = "stashed"
    #: F and B each use the newest version at their time: no true gradient (naive)
    NEWEST = "newest"


@dataclass(frozen=True)
class ScheduleKind:
    """One schedule family and what the rest of the library needs to know about it.

    Attributes:
        name: the text used in files and on the command line.
        summary: one line for help texts.
        version_rule: which weights a microbatch's forward and backward use.
        microbatched: a minibatch is split into microbatches and each update applies one whole
            minibatch (its replicas share the minibatch's microbatches); otherwise a microbatch
            is a minibatch and a replicated stage takes whole minibatches in turn (round robin).
        flushes: the pipeline drains before every update (a bubble per minibatch).
        forwards_first: every forward of a batch runs before its first backward (GPipe).
        split_backward: the backward is split into B (the gradient of the stage's inputs, sent
            upstream at once) and W (the weights' gradient, run later to fill the pipeline's
            bubbles); a microbatch's activations are held until its W (zero-bubble kinds).
        double_warmup: (split kinds) stage s runs 2(n − s) − 1 forwards before its first B and
            every stage holds up to 2n − 1 microbatches: ZB-H2, whose batches follow each other
            without a bubble once μ ≥ 2n − 1.
        virtual_stages: each worker holds several stages (chunks) of the plan (``Plan.looped``)
            and runs them interleaved: Megatron's interleaved 1F1B, whose bubble is 1/v of
            flush's for v chunks per worker. Only these kinds take plans with virtual stages.
        v_shape: (virtual kinds) two stages per worker placed in a V (``Plan.v_shape``: worker r
            holds stages r and 2p − 1 − r, so the first worker also holds the last stage): ZB-V.
        order: the name of the kind's generator, a function of ``schedule/orders.py`` that
            writes every stage replica's compute order (the module docstring says why a name;
            every registered kind has one).
    """

    name: str
    summary: str
    version_rule: VersionRule
    microbatched: bool
    flushes: bool = False
    forwards_first: bool = False
    split_backward: bool = False
    double_warmup: bool = False
    virtual_stages: bool = False
    v_shape: bool = False
    order: str = ""

    @property
    def round_robin(self) -> bool:
        """Replicas of a stage take whole minibatches in turn (minibatch t → replica t mod r)."""
        return not self.microbatched

    @property
    def asynchronous(self) -> bool:
        """Updates are computed on weights older than the ones they update (stale gradients)."""
        return self.version_rule is not VersionRule.BATCH

    @property
    def can_shard(self) -> bool:
        """Replicated stages may shard their weights over their replicas (``Stage.sharding``,
        FSDP2): one weight version and replicated stages (flush, gpipe, zb-h1, zb-h2; under the
        last two a sharded stage's B runs its whole backward, as FSDP2 reduces the weights'
        gradients when a whole backward ends, and its W is empty)."""
        return self.version_rule is VersionRule.BATCH and not self.virtual_stages

    @property
    def replicates_split_stages(self) -> bool:
        """(split kinds) a stage may have replicas, each running the stage's order without the
        other replicas' microbatches and all-reducing after its last W: the split kinds that
        flush with one stage per worker (zb-h1, zb-h2; zb-2bw and the virtual zb-v run one worker per stage)."""
        return self.split_backward and self.flushes and not self.virtual_stages

    def replica_inflight(self, depth: int, replicas: int) -> int:
        """(kinds that replicate split stages) microbatches a replica of a stage of ``replicas``
        holds from F to W in a pipeline ``depth`` stages deep, before the cap of the ⌈μ/r⌉ it
        runs: each replica's order is the straight stage's with the other replicas' microbatches
        left out, so it holds its share of the straight stage's in flight: ⌈n/r⌉ of ZB-H1's n,
        ⌈(2n − 1)/r⌉ of ZB-H2's 2n − 1."""
        held = 2 * depth - 1 if self.double_warmup else depth
        return -(-held // max(1, replicas))

    @property
    def stashes_weights(self) -> bool:
        """A microbatch's backward uses the weights its forward used, kept until then."""
        return self.version_rule is VersionRule.STASHED

    @property
    def true_gradients(self) -> bool:
        """Each gradient is the exact gradient of the weights that produced it (all but naive)."""
        return self.version_rule is not VersionRule.NEWEST

    def max_versions(self, warmup: int, vertical_sync: bool = False) -> int:
        """Weight versions a replica keeps alive at most, for a stage with ``warmup`` forwards
        before its first backward (one stash per in-flight minibatch for pipedream)."""
        if self.version_rule is VersionRule.STASHED:
            return warmup + (1 if vertical_sync else 0)
        return 2 if self.version_rule is VersionRule.PREVIOUS_BATCH else 1

    def max_inflight(self, warmup: int, local_microbatches: int, first_warmup: int | None, stages: int,
                     replicas: int = 1) -> int:
        """Microbatches whose activations a replica of ``replicas`` holds at most, in a pipeline
        of ``stages`` stages: the warm-up depth, or for ``forwards_first`` kinds every
        microbatch of a batch that the replica runs, or for ``split_backward`` kinds
        :meth:`stage_inflight` (at most one batch where the kind flushes, two for zb-2bw)."""
        if self.forwards_first:
            return local_microbatches
        if self.split_backward:
            batches = 1 if self.flushes else 2
            return min(self.stage_inflight(warmup, first_warmup, stages, replicas, local_microbatches),
                       batches * max(1, local_microbatches))
        return warmup

    def stage_inflight(self, warmup: int, first_warmup: int | None, stages: int, replicas: int,
                       microbatches: int | None = None) -> int:
        """The in-flight count the memory model charges a replica of ``replicas`` whose warm-up
        depth is ``warmup``, in a pipeline of ``stages`` stages whose input stage's warm-up is
        ``first_warmup`` (``memory_terms`` caps it at the ⌈μ/r⌉ the replica runs): the kinds that
        replicate split stages count what their orders hold (:meth:`replica_inflight`), the
        others :meth:`inflight_depth`."""
        if self.replicates_split_stages:
            return self.replica_inflight(stages, replicas)
        return self.inflight_depth(warmup, first_warmup, microbatches)

    def inflight_depth(self, depth: int, first_depth: int | None, microbatches: int | None = None) -> int:
        """The in-flight count the memory model charges a stage whose warm-up depth is
        ``depth`` in a pipeline whose input stage's is ``first_depth``, with ``microbatches``
        per batch: ZB-H1 delays every stage's W passes until it holds as many microbatches as
        the input stage does, ZB-H2 until it holds 2 × that − 1. zb-2bw holds 2bw's warm-up
        depth where 2bw runs without a bubble (μ ≥ n − 1), and else up to two batches (2μ) on
        every stage: as many as its version rule lets in flight (schedule.orders.zb_2bw)."""
        if not self.split_backward:
            return depth
        first = max(depth, first_depth or depth)
        if self.version_rule is VersionRule.PREVIOUS_BATCH:
            mu = first if microbatches is None else max(1, microbatches)
            return depth if mu + 1 >= first else 2 * mu
        return 2 * first - 1 if self.double_warmup else first

    def fill_drain_factor(self, microbatches: int, depth: int, chunks: int = 1) -> float:
        """Time per minibatch over the bottleneck stage's, for a pipeline ``depth`` stages deep:
        a flushing kind runs μ microbatches in μ + n − 1 slots of 1/μ minibatch (GPipe's bubble),
        a split-backward one in μ + (n − 1)/3 (ZB-H1's (n − 1)(T_F + T_B − T_W) with
        T_F = T_B = T_W), ZB-H2 in μ + max(0, 2n − 1 − μ)/3 (batch after batch: none once
        μ ≥ 2n − 1); interleaved 1F1B over ``depth`` workers of ``chunks`` stages each in
        μ + (n − 1)/v (Narayanan et al., SC'21); ZB-V in μ + (n − 1)/6 (μ ≥ 2n). The others
        keep the pipeline full across minibatches, zb-2bw once μ ≥ n/2: below, a batch takes
        max(3μ, n + μ) slots for 3μ (equal F, B and W; schedule.orders.zb_2bw). (2bw's order, 1F1B
        with its warm-up capped at μ + 1, takes n − μ times the ideal for μ ≤ n − 2, which this
        model does not charge: the paper asks μ ≥ n.)"""
        if not self.flushes:
            if self.split_backward:  # zb-2bw
                return max(1.0, (depth + microbatches) / (3 * microbatches))
            return 1.0
        if self.v_shape:  # ZB-V: the forward wave's start, (p − 1) of 6 chunk passes per microbatch
            return (microbatches + (depth - 1) / 6) / microbatches
        if self.virtual_stages:
            return (microbatches + (depth - 1) / max(1, chunks)) / microbatches
        if self.double_warmup:
            fill = max(0, 2 * depth - 1 - microbatches) / 3
        else:
            fill = (depth - 1) / 3 if self.split_backward else depth - 1
        return (microbatches + fill) / microbatches

    def memory_terms(self, weights: Any, held: Any, microbatches: int, optimizer_factor: float,
                     replicas: int = 1) -> tuple[Any, Any, float]:
        """The versions and in-flight part of the memory model of one replica:
        ``base + per · min(d, cap)`` bytes for a stage holding ``d`` minibatches in flight, with
        ``weights`` the stage's parameter bytes and ``held`` the bytes one in-flight minibatch
        holds (scalars or numpy arrays alike). Optimizer state is ``optimizer_factor`` × the
        weights. ``replicas`` replicas of a flushing kind share each minibatch's microbatches
        (microbatch t on replica t mod m), so one holds at most ⌈μ/m⌉ of them."""
        w, a, mu, f = weights, held, microbatches, optimizer_factor
        local = -(-mu // max(1, int(replicas)))
        rule = self.version_rule
        if rule is VersionRule.STASHED:  # a weight stash and an input stash per in-flight minibatch
            return f * w, w + a, float("inf")
        if rule is VersionRule.NEWEST:
            return (1 + f) * w, a, float("inf")
        if rule is VersionRule.PREVIOUS_BATCH:
            return (2 + f) * w, a / mu, float("inf")
        if self.forwards_first:  # all of a batch's microbatches this replica runs in flight
            return (1 + f) * w + a * local / mu, 0.0 * a, float("inf")
        return (1 + f) * w, a / mu, float(local)


SCHEDULE_KINDS: dict[str, ScheduleKind] = {k.name: k for k in (
    ScheduleKind("pipedream", "1F1B with weight stashing (PipeDream): no flush, stale but true gradients",
                 VersionRule.STASHED, microbatched=False, order="pipedream"),
    ScheduleKind("2bw", "PipeDream-2BW: 1F1B over microbatches, double-buffered weights, one update stale",
                 VersionRule.PREVIOUS_BATCH, microbatched=True, order="two_bw"),
    ScheduleKind("flush", "PipeDream-Flush (synchronous 1F1B): plain training with gradient accumulation",
                 VersionRule.BATCH, microbatched=True, order="flush", flushes=True),
    ScheduleKind("gpipe", "GPipe: all forwards of a batch, then all backwards; plain training",
                 VersionRule.BATCH, microbatched=True, order="gpipe", flushes=True, forwards_first=True),
    ScheduleKind("zb-h1", "Zero Bubble H1 (Qi et al.): synchronous 1F1B with the backward split into B and W, "
                 "W delayed to fill the bubble; a third of flush's bubble",
                 VersionRule.BATCH, microbatched=True, order="zb_h1", flushes=True, split_backward=True),
    ScheduleKind("zb-h2", "Zero Bubble H2: zb-h1 with twice the warm-up and W kept for the batch's end, "
                 "so batches follow each other without a bubble; up to 2n - 1 microbatches held",
                 VersionRule.BATCH, microbatched=True, order="zb_h2", flushes=True, split_backward=True,
                 double_warmup=True),
    ScheduleKind("interleaved", "interleaved 1F1B (Megatron): v stages per worker, looped; synchronous, "
                 "1/v of flush's bubble, more transfers",
                 VersionRule.BATCH, microbatched=True, order="interleaved", flushes=True, virtual_stages=True),
    ScheduleKind("zb-v", "ZB-V (Qi et al.): two stages per worker in a V, backward split into B and W; "
                 "synchronous, only the forward wave's start idles once m >= 2p",
                 VersionRule.BATCH, microbatched=True, order="zb_v", flushes=True, split_backward=True,
                 virtual_stages=True, v_shape=True),
    ScheduleKind("zb-2bw", "2bw with the backward split into B and W (asynchronous, one update stale): "
                 "W fills the slots where 2bw waits, so fewer, larger microbatches (m >= n/2) keep the pipeline full",
                 VersionRule.PREVIOUS_BATCH, microbatched=True, order="zb_2bw", split_backward=True),
    ScheduleKind("naive", "pipelining without weight stashing (for experiments: wrong gradients)",
                 VersionRule.NEWEST, microbatched=False, order="naive"),
)}

#: The kind names in registry order (for ``choices=`` and messages).
KIND_NAMES: tuple[str, ...] = tuple(SCHEDULE_KINDS)


def _listing(names: list[str]) -> str:
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else "".join(names)


#: The kinds whose replicated stages may be sharded with FSDP2, for messages ("flush, gpipe, zb-h1 and zb-h2").
SHARDING_KINDS_TEXT: str = _listing([k.name for k in SCHEDULE_KINDS.values() if k.can_shard])


def schedule_kind(kind: str | ScheduleKind) -> ScheduleKind:
    """The registered kind for a name (a :class:`ScheduleKind` passes through)."""
    if isinstance(kind, ScheduleKind):
        return kind
    found = SCHEDULE_KINDS.get(kind) if isinstance(kind, str) else None
    if found is None:
        raise UnknownKindError(f"unknown schedule {kind!r}; expected one of {', '.join(KIND_NAMES)}")
    return found
