"""The planner: split a layer graph into pipeline stages and replicate them over a topology.

``plan(graph, topology)`` returns the :class:`~torchpipedream.plans.plan.Plan` with the smallest
predicted time per minibatch under the cost model below (docs/planner.md has the long form).

Cost model (times in ms per minibatch, the profile's batch; sizes in bytes)
--------------------------------------------------------------------------
The graph is planned over ``graph.linearize()``: a chain of blocks i = 0..N-1 with compute
C_i (forward + backward), parameters w_i and a_i, the bytes crossing the cut after block i.
A stage holds blocks i..j on ``m`` consecutive ranks r..r+m-1 (ranks are given out stage by
stage, in order). With B(X) the slowest link inside a rank set X (``Topology.span_bandwidth``):

* stage time  = (C_ij + allreduce) / m,   allreduce = 2(m-1)/m · w_ij / B(stage ranks)
  (pipedream, naive: ring all-reduce once per round of m minibatches, one per replica;
  **summed** with compute, not overlapped as in the paper's max(): our schedules run
  ALLREDUCE as its own action);
  2bw, flush, gpipe: C_ij · ceil(μ/m)/μ + allreduce (the replicas share each minibatch's μ
  microbatches and all-reduce once per minibatch), with m = 1 or a divisor of μ;
* cut time    = 2 · a_j / B(ranks of both stages)   (activation forward + gradient back;
  overlapped with compute as in the paper, so a cut is its own term in the max);
* bottleneck  = max over stages and cuts (the slowest pipeline element);
* time per minibatch = bottleneck · (μ + n − 1) / μ for schedules that flush every minibatch
  (flush, gpipe: n stages, μ microbatches, the fill and drain of each minibatch), the
  bottleneck itself for the others (pipedream, 2bw, naive keep the pipeline full).

Memory per worker of a stage, with d = ceil(workers from this stage to the end / m) minibatches
in flight and ``f`` = ``optimizer_state_factor`` extra weight copies (gradient, momentum):
``w·(versions + f)`` + the activations each in-flight microbatch holds (what autograd saved in
the stage, its inputs and outputs, message buffers) + the backward's working memory
(plans/memory.py), with versions and in-flight microbatches per schedule (pipedream: d
versions, d minibatches; 2bw: 2 versions, d microbatches; flush: 1 version, min(d, μ)
microbatches; gpipe: 1 version, all μ microbatches; naive: 1 version, d minibatches). A stage
that does not fit is never chosen.

Algorithms
----------
``method="fast"`` (default) is exact: a bisection on the bottleneck time T where each test is
a reachability DP over (block boundary, rank) pairs. For a fixed T, a stage of blocks i..j
needs at least mmin(i, j) replicas (closed form from the quadratic T·m² - (C+q)·m + q >= 0);
that bound shrinks as i grows, so for every start rank only the latest reachable block boundary
matters, and the feasible end ranks of a level-k span form a prefix-minimum within each level-k
component. One test costs O(N · levels · W) vectorised steps (O(N² · W) with a memory budget).
``method="hierarchical"`` is the paper's recurrence (A^k, T^k per level, bottom-up), exact for
its own, smaller space of plans (stages confined to components, sub-pipelines replicated over
whole components); it is O(levels · N³ · c²) and kept as a reference.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from ..model.graph import Block, LayerGraph, SharedParameter, measured_sum
from ..plans.kinds import AUTO, SHARDING_KINDS_TEXT, ScheduleKind, UnknownKindError, VersionRule, schedule_kind
from ..plans.memory import (DEFAULT_OPTIMIZER_STATE_FACTOR, NO_SCRATCH, StageActivations, memory_terms,
                            scratch_of_options, stage_activations, stage_memory_bytes, working_key)
from ..plans.plan import SHARDINGS, Plan, PlanError, Stage, TiedParameter, looped_rank, v_shape_rank
from ..plans.topology import Level, Topology, format_bytes
from ..schedule.build import build_schedule
from ..sim.costs import MS_PER_S, paper_allreduce, paper_transfer, ring_allreduce_share, sharded_collectives
from ..sim.simulator import Costs, simulate
from .replica_round_trip import replica_round_trip_ms
from .tensor_parallel import tensor_parallel_graph, worker_topology

__all__ = [
    "plan",
    "evaluate",
    "best_split_for_replicas",
    "allreduce_ms",
    "transfer_ms",
    "stage_time_ms",
    "replicas_share_microbatches",
    "replica_count_allowed",
    "in_flight",
    "fill_drain_factor",
    "Evaluation",
    "DEFAULT_OPTIMIZER_STATE_FACTOR",
]

log = logging.getLogger(__name__)

_INF_M = 1 << 40  # "no replica count works"


# ------------------------------------------------------------------ the cost model
# The planner prices communication with the paper's bandwidth-only forms (sim.costs), in ms.
def transfer_ms(nbytes: float, bandwidth_Bps: float) -> float:
    """Milliseconds to move ``nbytes`` over a link of ``bandwidth_Bps`` (0 on the same worker):
    ``sim.costs.paper_transfer``."""
    return paper_transfer(nbytes, bandwidth_Bps, per_s=MS_PER_S)


def allreduce_ms(parameter_bytes: float, replicas: int, bandwidth_Bps: float) -> float:
    """Ring all-reduce of a stage's gradients among its replicas, 2(m-1)/m · |w| / B, in
    milliseconds: ``sim.costs.paper_allreduce``."""
    return paper_allreduce(parameter_bytes, replicas, bandwidth_Bps, per_s=MS_PER_S)


def replicas_share_microbatches(schedule: str | ScheduleKind) -> bool:
    """Whether a replicated stage splits each minibatch's microbatches among its replicas and
    all-reduces once per minibatch (2bw, flush, gpipe: one update per minibatch), rather than
    taking whole minibatches in turn and all-reducing once per round of them (pipedream, naive)."""
    return schedule_kind(schedule).microbatched


def replica_count_allowed(schedule: str | ScheduleKind, replicas: int, microbatches: int) -> bool:
    """Replica counts the search considers: any for pipedream and naive; for the kinds whose
    replicas share a minibatch's microbatches, 1 or a divisor of them (2bw requires it; under
    flush and gpipe any other count leaves replicas idle for part of every minibatch, and more
    replicas than microbatches leaves some idle throughout, so that each minibatch runs on
    one replica after another)."""
    return replicas == 1 or not replicas_share_microbatches(schedule) or microbatches % replicas == 0


def stage_time_ms(compute_ms: float, parameter_bytes: float, replicas: int, bandwidth_Bps: float,
                  schedule: str | ScheduleKind = "pipedream", microbatches: int = 1, sharding: str = "replicate") -> float:
    """Time per minibatch of a stage with ``replicas`` workers.

    pipedream, naive: (compute + all-reduce) / m: each replica takes every m-th minibatch and
    the all-reduce runs once per round of m minibatches. 2bw, flush, gpipe: compute · ⌈μ/m⌉/μ
    + all-reduce: the busiest replica runs ⌈μ/m⌉ of the minibatch's μ microbatches, and every
    minibatch ends in its own all-reduce; a sharded stage instead gathers and reduce-scatters
    in each of those microbatches (:func:`sharded_sync_ms`).
    """
    if replicas_share_microbatches(schedule):
        local = math.ceil(microbatches / replicas)
        return compute_ms * local / microbatches + shared_sync_ms(parameter_bytes, replicas, bandwidth_Bps, sharding,
                                                                  microbatches)
    return (compute_ms + allreduce_ms(parameter_bytes, replicas, bandwidth_Bps)) / replicas


def shared_sync_ms(parameter_bytes: float, replicas: int, bandwidth_Bps: float, sharding: str,
                   microbatches: int) -> float:
    """The replicas' synchronisation per minibatch of a stage whose replicas share its
    microbatches: one all-reduce, or sharded, the collectives of :func:`sharded_sync_ms`."""
    if sharding == "replicate":
        return allreduce_ms(parameter_bytes, replicas, bandwidth_Bps)
    return sharded_sync_ms(parameter_bytes, replicas, bandwidth_Bps, sharding, math.ceil(microbatches / replicas))


def sharded_sync_ms(parameter_bytes: Any, replicas: Any, bandwidth_Bps: float, sharding: str, local: Any) -> Any:
    """A sharded stage's collectives per minibatch on one replica, in milliseconds: for ``local``
    microbatches, ``sim.costs.sharded_collectives`` all-gathers and reduce-scatters of
    (m − 1)/m of the weights (half a ring all-reduce each; arrays broadcast)."""
    count = sharded_collectives(sharding, local)
    return count * (ring_allreduce_share(replicas) / 2) * (parameter_bytes / bandwidth_Bps * MS_PER_S)


def fill_drain_factor(schedule: str | ScheduleKind, microbatches: int, depth: int) -> float:
    """Time per minibatch over the bottleneck for a pipeline ``depth`` stages deep.

    flush and gpipe drain the pipeline at every minibatch: its μ microbatches take μ + n − 1
    bottleneck slots of 1/μ of a minibatch each, i.e. (μ + n − 1)/μ (the bubble of GPipe's
    paper). pipedream, 2bw and naive keep it full across minibatches: 1.
    """
    return schedule_kind(schedule).fill_drain_factor(microbatches, depth)


def in_flight(workers_to_end: int, replicas: int) -> int:
    """Minibatches in flight on one replica of a stage: ceil(workers from it to the end / m)."""
    return -(-workers_to_end // replicas)


# ------------------------------------------------------------------ evaluation
@dataclass
class Evaluation:
    """The cost model applied to one placement: per-stage and per-cut times, memory, bottleneck.

    ``time_ms`` is the bottleneck (what the bisection searches on); ``minibatch_ms`` the time
    per minibatch, the bottleneck times the schedule's :func:`fill_drain_factor`."""

    stage_ms: list[float]
    allreduce_ms: list[float]
    cut_ms: list[float]
    memory_bytes: list[float]
    time_ms: float
    bottleneck: str
    bottleneck_stage: int
    ranks: list[list[int]] = field(default_factory=list)
    minibatch_ms: float = 0.0


def tied_holders(blocks: Sequence[Block], stages: Sequence[tuple[int, int, int]],
                 tied: Sequence[SharedParameter]) -> list[tuple[SharedParameter, list[int]]]:
    """Each shared parameter whose layers the stages split, with the stages holding a copy."""
    stage_of = {name: s for s, (i, j, _) in enumerate(stages) for b in blocks[i:j + 1] for name in b.layers}
    out = []
    for t in tied:
        holders = sorted({stage_of[name] for name in t.layers if name in stage_of})
        if len(holders) > 1:
            out.append((t, holders))
    return out


def evaluate(blocks: Sequence[Block], topology: Topology, stages: Sequence[tuple[int, int, int]],
             schedule: str = "pipedream", microbatches: int = 1,
             optimizer_state_factor: float = DEFAULT_OPTIMIZER_STATE_FACTOR,
             tied: Sequence[SharedParameter] = (), recompute: bool = False,
             optimizer_scratch: tuple[float, float] = NO_SCRATCH, sharding: str = "replicate") -> Evaluation:
    """Apply the cost model to stages given as (first block, last block, replicas), ranks in order.

    Memory per worker is ``plans.memory.stage_memory_bytes`` (with ``recompute``, what a
    recomputing stage holds).

    A shared parameter (``tied``) that the stages split costs every holding stage a copy (its
    weights, versions and optimizer state: the profile counts it once, in its first layer) and
    the exchange of its gradient: a ring all-reduce among the holders' ranks once per update,
    charged to each holder as its replicas' all-reduce is (``schedule.build._add_tied`` overlaps it
    with compute where the kind allows; the charge is the upper bound).

    ``sharding`` is what every replicated stage does with its weights (``Stage.sharding``):
    sharded, it pays its gathers and reduce-scatters instead of the all-reduce, and holds its
    shard (``plans.memory.sharded_weight_bytes``)."""
    workers = sum(m for _, _, m in stages)
    if workers > topology.num_workers:
        raise PlanError(f"the stages use {workers} workers but the topology has {topology.num_workers}")
    ranks, stage_ms, ar_ms, cut_ms, mem = [], [], [], [], []
    r = 0
    for i, j, m in stages:
        ranks.append(list(range(r, r + m)))
        r += m
    copies = [0.0] * len(stages)  # bytes of shared parameters a stage holds beyond the profile's count
    whole = [0.0] * len(stages)  # bytes of shared parameters a stage holds (whole, on a sharded stage too)
    exchange = [0.0] * len(stages)  # ms of shared-parameter all-reduce per update
    for t, holders in tied_holders(blocks, stages, tied):
        group = [r for s in holders for r in ranks[s]]
        cost = allreduce_ms(t.bytes, len(group), topology.allreduce_bandwidth(group))
        for s in holders:
            exchange[s] += cost
            whole[s] += t.bytes
        for s in holders[1:]:
            copies[s] += t.bytes
    kind = schedule_kind(schedule)
    first_depth = in_flight(workers - ranks[0][0], stages[0][2]) if stages else 0
    for s, (i, j, m) in enumerate(stages):
        compute = sum(b.compute_ms for b in blocks[i:j + 1])
        own = sum(b.parameter_bytes for b in blocks[i:j + 1])  # without copies of shared parameters
        params = own + copies[s]
        bw = topology.allreduce_bandwidth(ranks[s])
        stage_ms.append(stage_time_ms(compute, own, m, bw, schedule, microbatches, sharding) + exchange[s])
        ar_ms.append(shared_sync_ms(own, m, bw, sharding, microbatches) + exchange[s])
        depth = kind.stage_inflight(in_flight(workers - ranks[s][0], m), first_depth, len(stages), m, microbatches)
        mem.append(stage_memory_bytes(schedule, params, stage_activations(blocks, i, j), depth, microbatches,
                                      optimizer_state_factor, recompute, replicas=m, scratch=optimizer_scratch,
                                      sharding=sharding, whole=whole[s]))
        if s + 1 < len(stages):
            cut_ms.append(2 * transfer_ms(blocks[j].cut_bytes, topology.span_bandwidth(ranks[s] + ranks[s + 1])))
    worst_stage = max(range(len(stages)), key=lambda s: stage_ms[s])
    t, what, where = stage_ms[worst_stage], f"stage {worst_stage} compute+sync", worst_stage
    for s, c in enumerate(cut_ms):
        if c > t:
            t, what, where = c, f"transfer between stages {s} and {s + 1}", s
    minibatch = t * fill_drain_factor(schedule, microbatches, len(stages))
    links = [topology.span_bandwidth(ranks[s] + ranks[s + 1]) for s in range(len(stages) - 1)]
    waits, waiting = replica_round_trip_ms(blocks, stages, links, kind, microbatches, ar_ms, sharding != "replicate")
    if waits > minibatch:  # zb-h1, zb-h2: a replica holds too few microbatches to stay busy
        minibatch, what, where = waits, f"stage {waiting}'s round trip (its replicas wait for input gradients)", waiting
    return Evaluation(stage_ms, ar_ms, cut_ms, mem, t, what, where, ranks, minibatch)


# ------------------------------------------------------------------ the exact fast search
class _ChainTerms:
    """The memory model's terms of one chain's stages, over every start block, per end block:
    computed once and reused by every probe and depth of the packed test (they depend on neither
    T nor the depth, only on what the problems of one chain share: blocks, kind, microbatches,
    optimizer factor, recompute, scratch, sharding). The single-worker depths depend on the
    budget too, so they are kept for one budget at a time (``_nothing_fits`` bisects it)."""

    def __init__(self) -> None:
        self._acts: dict[int, StageActivations] = {}
        self._terms: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self._depths: dict[int, np.ndarray] = {}
        self._depths_budget: float | None = None

    def activations(self, prob: _Problem, j1: int) -> StageActivations:
        """``prob.activations`` of the stages i..j1-1 for every i < j1."""
        if j1 not in self._acts:
            self._acts[j1] = prob.activations(np.arange(j1), j1)
        return self._acts[j1]

    def shared_terms(self, prob: _Problem, j1: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``memory_terms`` of the stages i..j1-1 of m replicas, every i < j1 and m in
        ``prob.shared_sizes``: base and per as (sizes, j1), cap as (sizes,)."""
        if j1 not in self._terms:
            w = prob.weight_prefix[j1] - prob.weight_prefix[:j1]
            acts = self.activations(prob, j1)
            got = [memory_terms(prob.kind, w, acts, prob.mu, prob.f, prob.recompute, m, prob.scratch, prob.sharding)
                   for m in prob.shared_sizes]
            self._terms[j1] = (np.array([np.broadcast_to(g[0], w.shape) for g in got]).reshape(len(got), j1),
                               np.array([np.broadcast_to(g[1], w.shape) for g in got]).reshape(len(got), j1),
                               np.array([g[2] for g in got], dtype=np.float64))
        return self._terms[j1]

    def single_depths(self, prob: _Problem, j1: int) -> np.ndarray:
        """``prob.max_depth`` of the single-worker stages i..j1-1, every i < j1, at prob's budget."""
        if self._depths_budget != prob.memory:
            self._depths, self._depths_budget = {}, prob.memory
        if j1 not in self._depths:
            self._depths[j1] = prob.max_depth(np.arange(j1), j1, self.activations(prob, j1), 1)
        return self._depths[j1]


class _Problem:
    """Arrays of one planning problem, shared by every feasibility test."""

    def __init__(self, blocks: Sequence[Block], topology: Topology, schedule: str, microbatches: int,
                 memory: float | None, f: float, num_stages: int | None, straight: bool,
                 recompute: bool = False, scratch: tuple[float, float] = NO_SCRATCH, sharding: str = "replicate",
                 cache: _ChainTerms | None = None) -> None:
        self.blocks = list(blocks)
        self.sharding = sharding  # what replicated stages do with their weights (Stage.sharding)
        self.N = len(blocks)
        self.topology = topology
        self.W = topology.num_workers
        self.compute_prefix = np.concatenate([[0.0], np.cumsum([b.compute_ms for b in blocks])])
        self.weight_prefix = np.concatenate([[0.0], np.cumsum([float(b.parameter_bytes) for b in blocks])])
        self.a = np.array([float(b.cut_bytes) for b in blocks])
        self.a_in = np.concatenate([[0.0], self.a[:-1]])  # input bytes of a stage starting at i
        # the memory model's terms (plans/memory.py): prefix sums and per-block maxima
        self.saved_prefix = np.concatenate([[0.0], np.cumsum([float(b.saved_bytes) for b in blocks])])
        self.unsaved = np.array([float(b.unsaved_cut_bytes) for b in blocks])
        self.working = np.array([working_key(b.working_bytes, b.released_bytes) for b in blocks], dtype=float)
        self.largest = np.array([float(b.largest_parameter_bytes) for b in blocks])
        self.recompute = recompute
        self.scratch = scratch  # the optimizer step's temporaries (plans.memory.once_bytes)
        self.measured = all(b.saves_measured for b in blocks)  # else the older model (plans/memory.py)
        self.sizes = topology.sizes
        self.beff = topology.effective_bandwidths  # links: cuts
        self.bar = topology.allreduce_bandwidths  # all-reduces
        self.classes = [0] if straight else list(range(len(self.sizes)))
        self.schedule, self.mu, self.memory, self.f = schedule, microbatches, memory, f
        self.kind = schedule_kind(schedule)
        # 2bw, flush, gpipe: a replicated stage's size is a divisor of μ (replica_count_allowed)
        # and its time is not monotone in it (the all-reduce grows, the compute share has
        # steps), so those stages are enumerated size by size instead of by mmin.
        self.shared = replicas_share_microbatches(schedule) and not straight
        self.shared_sizes = [d for d in range(2, microbatches + 1) if replica_count_allowed(schedule, d, microbatches)]
        self.num_stages = num_stages
        self._class_col = np.array(self.classes, dtype=np.int64)[:, None, None]
        # the all-reduce's time scale 2|w|/B in ms per byte, per class (see mmin)
        self._allreduce_factor = np.array([2 * MS_PER_S / self.bar[max(k, 1)] for k in self.classes])[:, None, None]
        # level crossed between ranks s-1 and s, for s = 1..W-1
        self.lev_adj = np.zeros(self.W + 1, dtype=np.int64)
        for s in range(1, self.W):
            self.lev_adj[s] = next(k for k in range(len(self.sizes)) if (s - 1) // self.sizes[k] == s // self.sizes[k])
        self.checks = 0
        # the memory terms of the packed test, shared by the problems of one chain (every depth)
        self._cache = cache if cache is not None else _ChainTerms()

    # minimal replicas of class k (k = 0: a single worker) for stages (i.., j) at bottleneck T
    def mmin(self, k: int | np.ndarray, comp: np.ndarray, w: np.ndarray, T: float) -> np.ndarray:
        """Smallest m (>= 2 for k >= 1, == 1 for k == 0) with (comp + allreduce(w, m, B_k)) / m <= T.

        ``k`` may be an int or an integer array broadcastable against ``comp`` (one class per row).
        """
        k_array = np.asarray(k)
        single = k_array == 0
        if math.isinf(T):
            return np.broadcast_to(np.where(single, 1, 2), comp.shape).astype(np.int64)
        B = np.asarray(self.bar, dtype=np.float64)[np.maximum(k_array, 1)]
        q = w * (2 * MS_PER_S / B)  # all-reduce time scale 2|w|/B in ms (paper_allreduce = q·(m-1)/m)
        bq = comp + q
        disc = bq * bq - (4.0 * T) * q
        if T > 0:
            root = (bq + np.sqrt(np.maximum(disc, 0.0))) * (0.5 / T)
            root = np.where(disc > 0, root, 0.0)
        else:
            root = np.full(comp.shape, np.inf)
        # the smallest integer >= root (up to 1e-12 relative rounding of the closed form)
        m = np.ceil(np.minimum(root * (1 - 4e-15), float(_INF_M)))
        m = np.maximum(m, 2.0).astype(np.int64)
        return np.where(single, np.where(comp <= T, 1, _INF_M), m)

    def activations(self, i: np.ndarray, j1: int) -> StageActivations:
        """The memory model's activation terms of stages i..j1-1 (arrays over i)."""
        end = j1 == self.N
        if not self.measured:
            return StageActivations(inputs=self.a_in[i], measured=False)
        return StageActivations(
            saved=self.saved_prefix[j1] - self.saved_prefix[i], inputs=self.a_in[i],
            outputs=0.0 if end else self.a[j1 - 1], unsaved_outputs=0.0 if end else self.unsaved[j1 - 1],
            # max over k in i..j1-1 of (factor · working_k − saved after k): a suffix maximum
            working=np.maximum.accumulate((self.working[:j1] + self.saved_prefix[1:j1 + 1])[::-1])[::-1][i]
            - self.saved_prefix[j1],
            largest_parameter=np.maximum.accumulate(self.largest[:j1][::-1])[::-1][i])

    def max_depth(self, i: np.ndarray, j1: int, acts: StageActivations, replicas: int = 1) -> np.ndarray:
        """Largest in-flight count d whose memory fits, for stages i..j1-1 of ``replicas``
        replicas with activation terms ``acts`` (huge if any d fits)."""
        w = self.weight_prefix[j1] - self.weight_prefix[i]
        base, per, cap = memory_terms(self.kind, w, acts, self.mu, self.f, self.recompute, replicas, self.scratch)
        M = self.memory
        big = float(_INF_M)
        with np.errstate(invalid="ignore", divide="ignore"):
            d = np.where(per > 0, np.floor((M - base) / np.where(per > 0, per, 1.0)), big)
        d = np.where(base > M, -1.0, d)
        d = np.minimum(d, big)
        if not math.isinf(cap):
            d = np.where(base + per * cap <= M, big, np.minimum(d, cap - 1))
        d = d.astype(np.int64)
        # exact fix-up against the evaluator's formula
        def fits(dd: np.ndarray) -> np.ndarray:
            return base + per * np.minimum(dd, cap) <= M
        d = np.where((d >= 0) & (d < _INF_M) & ~fits(np.maximum(d, 1)), d - 1, d)
        d = np.where((d >= 0) & (d < _INF_M - 1) & fits(d + 1), d + 1, d)
        return np.maximum(d, 0)

    def feasible(self, T: float, workers: int, exact_end: bool, record: bool) -> tuple[bool, Any]:
        """Can blocks 0..N-1 be placed on ranks 0..workers-1 with every stage and cut ≤ T?

        A reachability DP over (block boundary, stage count, rank): ``reach[j1, c, s]`` says
        blocks 0..j1-1 fit on ranks 0..s-1 in c stages (c is tracked only with ``num_stages``).
        For each end block j, :meth:`_needs_no_budget` or :meth:`_needs_with_budget` gives the
        fewest replicas a stage ending at j needs from each start rank; a prefix minimum within
        each level-k component (:meth:`_component_prefix_min`) turns that into the ranks where
        such a stage can end. With ``record`` it returns the stages found, as (first block,
        last block, replicas).
        """
        self.checks += 1
        if self.memory is not None and self.shared:
            return self._feasible_packed(T, workers, exact_end, record)
        N = self.N
        num_classes = len(self.classes)
        counts = 1 if self.num_stages is None else self.num_stages + 1  # the stage-count axis c
        rank_bounds = workers + 1
        reach = np.zeros((N + 1, counts, rank_bounds), dtype=bool)
        reach[0, 0, 0] = True
        parent = np.full((N + 1, counts, rank_bounds, 3), -1, dtype=np.int64) if record else None  # (i, r, c_prev)
        ranks = np.arange(workers, dtype=np.int64)
        limit = ((ranks + 1) * rank_bounds + rank_bounds - 1)[None, :]  # key <= limit  <=>  e <= x + 1
        last = np.full((num_classes, counts, workers), -1, dtype=np.int64)  # latest reachable start (no budget)
        for ki in range(num_classes):
            last[ki, 0, 0] = 0
        # inok[ki, i]: a class-k stage may start at block i (the cut before it fits in T)
        inok = np.stack([self._in_ok(k, np.arange(N), T) for k in self.classes])
        out_thr = self._out_thresholds(T, workers)
        prefix_min = np.empty((num_classes, counts, workers), dtype=np.int64)
        for j in range(N):
            j1 = j + 1
            if self.memory is None:
                best, besti, shared_starts = self._needs_no_budget(j1, T, last, record)
            else:
                best, besti, shared_starts = self._needs_with_budget(j1, T, workers, reach, inok)
            e = ranks[None, None, :] + best  # earliest end (exclusive) of a stage starting at r
            keys = np.minimum(e, 2 * _INF_M) * rank_bounds + ranks[None, None, :]
            self._component_prefix_min(keys, workers, prefix_min)
            # (num_classes, counts, workers): a class-k stage can end just before rank s = x + 1
            cond = prefix_min <= limit
            shared = {ki: self._shared_ends(k, workers, counts, functools.partial(shared_starts, ki), record)
                      for ki, k in enumerate(self.classes) if k > 0 and self.shared}
            for ki, (ok_end, _, _) in shared.items():
                cond[ki] = ok_end
            if j < N - 1:
                cond &= (self.a[j] <= out_thr)[:, None, :]
            hit_c = cond.any(axis=0)  # (counts, workers), indexed by the previous stage count
            new_any = np.zeros((counts, rank_bounds), dtype=bool)
            if counts > 1:
                new_any[1:, 1:] = hit_c[:-1]
            else:
                new_any[:, 1:] = hit_c
            if parent is not None and hit_c.any():
                self._record(parent, j1, counts, rank_bounds, cond, hit_c, prefix_min, besti, shared)
            reach[j1] = new_any
            if j1 < N and self.memory is None and new_any.any():
                hit = new_any[:, :workers]
                for ki in range(num_classes):
                    if inok[ki, j1]:
                        last[ki][hit] = j1
        final_count = counts - 1 if self.num_stages is not None else 0
        ends = reach[N, final_count]
        s_end = _end_rank(ends, workers, exact_end)
        if s_end < 0:
            return False, None
        if parent is None:
            return True, None
        return True, _trace_back(parent, N, final_count, s_end)

    # ------------------------------------------------------------ packed test (budget, shared kinds)
    # With a memory budget under 2bw, flush or gpipe, ``feasible`` runs here: the same DP, with
    # the stage-count axis packed as bits of uint64 words (reach[j1, word, s]), each start block
    # weighed only where its stage fits in T and in memory, and the parents found by a walk back
    # over the stored reach (the choice ``_record`` would have made, recomputed at the path's
    # boundaries only) instead of a (blocks, counts, ranks, 3) table filled at every boundary.
    def _feasible_packed(self, T: float, workers: int, exact_end: bool, record: bool) -> tuple[bool, Any]:
        """:meth:`feasible` for a memory budget and classes whose replicas share microbatches."""
        N = self.N
        counts = 1 if self.num_stages is None else self.num_stages + 1
        reach, reached, inok, cut_ok = self._packed_reach(T, workers, counts)
        final = counts - 1 if self.num_stages is not None else 0
        s_end = _end_rank(_count_bit(reach[N], final), workers, exact_end)
        if s_end < 0:
            return False, None
        if not record:
            return True, None
        stages = []
        jj, c, s = N, final, s_end
        while jj > 0:
            cp = c - 1 if counts > 1 else 0
            i, r = self._packed_choice(self._packed_options(jj, T, workers, reached, inok), reach, cp, s - 1,
                                       cut_ok[jj - 1] if jj < N else None)
            stages.append((i, jj - 1, s - r))
            jj, c, s = i, cp, r
        stages.reverse()
        return True, stages

    def _packed_reach(self, T: float, workers: int, counts: int
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The packed DP at bottleneck T: reach[j1, word, s] (bit c: blocks 0..j1-1 fit on ranks
        0..s-1 in c stages), which boundaries any stage reaches, and the in/out cut tests."""
        N = self.N
        reach = np.zeros((N + 1, (counts + 63) // 64, workers + 1), dtype=np.uint64)
        reach[0, 0, 0] = 1
        reached = np.zeros(N + 1, dtype=bool)
        reached[0] = True
        inok = np.stack([self._in_ok(k, np.arange(N), T) for k in self.classes])
        cut_ok = self.a[:, None, None] <= self._out_thresholds(T, workers)[None]  # (j, ki, end rank)
        for j in range(N):
            options = self._packed_options(j + 1, T, workers, reached, inok)
            hit = np.zeros(reach.shape[1:2] + (workers,), dtype=np.uint64)
            for ki, k in enumerate(self.classes):
                ends = self._packed_ends(options[ki], reach, self.sizes[k], workers)
                if j < N - 1:
                    ends[:, ~cut_ok[j, ki]] = 0
                hit |= ends
            reach[j + 1, :, 1:] = _next_count(hit, counts)
            reached[j + 1] = reach[j + 1].any()
        return reach, reached, inok, cut_ok

    def feasible_depths(self, T: float, workers: int, exact_end: bool) -> np.ndarray | None:
        """Per stage count c = 0..num_stages, whether exactly c stages fit at bottleneck T: one
        packed test answers every depth at once (the count bits of a deeper problem evolve as a
        shallower one's do), so depths that cannot reach a cap are dismissed together. None
        where the packed test does not apply (no budget, or replicas that do not share)."""
        if self.memory is None or not self.shared or self.num_stages is None:
            return None
        self.checks += 1
        counts = self.num_stages + 1
        reach, _, _, _ = self._packed_reach(T, workers, counts)
        return np.array([_end_rank(_count_bit(reach[self.N], c), workers, exact_end) >= 0 for c in range(counts)])

    def _packed_options(self, j1: int, T: float, workers: int, reached: np.ndarray, inok: np.ndarray
                        ) -> list[list[tuple[int, np.ndarray, np.ndarray]]]:
        """Per class, the stages ending at block j1 - 1 that fit in T and in memory from some
        reachable start block: (replicas m, start blocks ascending, fits per start block and start
        rank). Class 0 is one worker; the others take each of ``shared_sizes``."""
        I = np.nonzero(reached[:j1])[0]
        comp = self.compute_prefix[j1] - self.compute_prefix[I]
        w = self.weight_prefix[j1] - self.weight_prefix[I]
        togo = self._held(workers)
        dmax = self._cache.single_depths(self, j1)[I]
        mmem1 = np.where(dmax[:, None] > 0, -(-togo // np.maximum(dmax[:, None], 1)), _INF_M)
        single = np.maximum(self.mmin(0, comp, w, T)[:, None], mmem1) <= 1  # (nI, workers)
        ms = np.array([m for m in self.shared_sizes if m <= workers], dtype=np.int64)
        out = []
        for ki, k in enumerate(self.classes):
            if k == 0:
                rows = np.nonzero(inok[ki, I] & single.any(axis=1))[0]
                out.append([(1, I[rows], single[rows])])
                continue
            fits = inok[ki, I][None] & (self._shared_stage_ms(k, comp[None], w[None], ms[:, None]) <= T)  # (M, nI)
            options = self._shared_options(j1, I, fits, ms, togo)
            out.append(options)
        return out

    def _shared_options(self, j1: int, I: np.ndarray, fits: np.ndarray, ms: np.ndarray, togo: np.ndarray
                        ) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """The replicated stages ending at block j1 - 1 that fit in memory, of the (size, start
        block) pairs that ``fits`` in time: (m, start blocks ascending, fits per start rank), by m."""
        M = len(ms)
        if not M:
            return []
        base, per, caps = self._cache.shared_terms(self, j1)
        depths = np.minimum(-(-togo // ms[:, None]), caps[:M, None])  # (M, workers): in flight per start rank
        t_idx, r_idx = np.nonzero(fits)  # by size, then start block ascending
        starts = I[r_idx]
        pair_base, pair_per = base[t_idx, starts], per[t_idx, starts]
        if np.isfinite(pair_per).all() and (pair_per >= 0).all():
            # depths fall as the start rank grows, so each pair fits from its first fitting rank on:
            # that rank by bisection, with the same arithmetic at the ranks it tests
            first = self._first_fit(pair_base, pair_per, depths, t_idx)
            keep = np.nonzero(first < togo.shape[1])[0]
            mem_ok = np.arange(togo.shape[1])[None, :] >= first[keep][:, None]
            bounds = np.searchsorted(t_idx[keep], np.arange(M + 1)).tolist()
            return [(m, starts[keep[a:b]], mem_ok[a:b])
                    for m, a, b in zip(ms.tolist(), bounds[:-1], bounds[1:]) if b > a]
        mem_ok = pair_base[:, None] + pair_per[:, None] * depths[t_idx] <= self.memory
        keep = np.nonzero(mem_ok.any(axis=1))[0]
        bounds = np.searchsorted(t_idx[keep], np.arange(M + 1)).tolist()
        return [(m, starts[keep[a:b]], mem_ok[keep[a:b]])
                for m, a, b in zip(ms.tolist(), bounds[:-1], bounds[1:]) if b > a]

    def _first_fit(self, b: np.ndarray, p: np.ndarray, depths: np.ndarray, t_idx: np.ndarray) -> np.ndarray:
        """Per (size, start block) pair, the first start rank where ``b + p * depth <= memory``
        (the number of ranks where none does); depths (sizes, ranks) must not rise along ranks."""
        last = depths.shape[1] - 1
        fits_last = b + p * depths[t_idx, last] <= self.memory  # most pairs fit nowhere: settled at once
        lo = np.where(fits_last, 0, last + 1)
        hi = np.full(len(b), last, dtype=np.int64)
        open_ = np.nonzero(fits_last)[0]
        while len(open_):
            mid = (lo[open_] + hi[open_]) // 2
            ok = b[open_] + p[open_] * depths[t_idx[open_], mid] <= self.memory
            hi[open_[ok]] = mid[ok]
            lo[open_[~ok]] = mid[~ok] + 1
            open_ = open_[lo[open_] < hi[open_]]
        return lo

    def _packed_ends(self, options: list[tuple[int, np.ndarray, np.ndarray]], reach: np.ndarray, S: int,
                     workers: int) -> np.ndarray:
        """(words, workers): the previous stage counts (bits) with which a stage of one class can
        end at rank x, over ``options`` (:meth:`_packed_options`), inside one component of S."""
        ends = np.zeros(reach.shape[1:2] + (workers,), dtype=np.uint64)
        zero = np.uint64(0)
        for m, rows, mem_ok in options:
            got = reach[rows, :, :workers]
            got *= mem_ok[:, None, :]  # by 0 or 1: the bits kept where the stage fits in memory
            got = np.bitwise_or.reduce(got, axis=0)
            n = workers - m + 1  # start ranks r with r + m - 1 < workers
            if m > 1:
                r = np.arange(n)
                got = np.where((r // S) == ((r + m - 1) // S), got[:, :n], zero)
            ends[:, m - 1:] |= got
        return ends

    def _packed_choice(self, options: list[list[tuple[int, np.ndarray, np.ndarray]]], reach: np.ndarray, c: int,
                       x: int, cut_ok: np.ndarray | None) -> tuple[int, int]:
        """(start block, start rank) of the stage that ``feasible``'s record keeps for an end at
        rank x after c stages: the first class, its first size, its first start block."""
        word, bit = c // 64, np.uint64(c % 64)
        for ki, k in enumerate(self.classes):
            if cut_ok is not None and not cut_ok[ki, x]:
                continue
            S = self.sizes[k]
            for m, rows, mem_ok in options[ki]:
                r = x - m + 1
                if r < 0 or (m > 1 and r // S != x // S):
                    continue
                ok = mem_ok[:, r] & ((reach[rows, word, r] >> bit) & np.uint64(1)).astype(bool)
                if ok.any():
                    return int(rows[np.argmax(ok)]), r
        raise AssertionError(f"no stage reaches rank {x} after {c} stages")  # reach said one does

    def _out_thresholds(self, T: float, workers: int) -> np.ndarray:
        """[ki, s-1]: the largest cut (bytes) a class-k stage ending before rank s may send in T."""
        beff = np.array(self.beff, dtype=np.float64)
        out = np.stack([beff[np.maximum(k, self.lev_adj[1:workers + 1])] * T / (2 * MS_PER_S) if not math.isinf(T)
                        else np.full(workers, np.inf) for k in self.classes])
        out[:, -1] = -1.0  # s == workers: no rank left for the next stage
        return out

    def _needs_no_budget(self, j1: int, T: float, last: np.ndarray, record: bool) -> tuple[np.ndarray, np.ndarray, Any]:
        """Without a memory budget the latest reachable start block is the best start (the
        replicas a stage needs shrink as it starts later): replicas needed per (class, stage
        count, start rank), the start blocks, and the shared-size test for ``_shared_ends``."""
        valid = last >= 0
        iv = np.where(valid, last, 0)
        comp = self.compute_prefix[j1] - self.compute_prefix[iv]
        w = self.weight_prefix[j1] - self.weight_prefix[iv]
        if math.isinf(T):
            mreq = np.broadcast_to(np.where(self._class_col == 0, 1, 2), comp.shape)
        else:  # inline of self.mmin (the hot loop), same arithmetic
            q = w * self._allreduce_factor
            bq = comp + q
            disc = bq * bq - (4.0 * T) * q
            np.maximum(disc, 0.0, out=disc)
            root = (bq + np.sqrt(disc)) * (0.5 * (1 - 4e-15) / T) if T > 0 else np.full(comp.shape, np.inf)
            mreq = np.maximum(np.ceil(np.minimum(root, float(_INF_M))), 2.0).astype(np.int64)
            if self.classes[0] == 0:
                mreq[0] = np.where(comp[0] <= T, 1, _INF_M)
        best = np.where(valid, mreq, _INF_M)
        besti = last.copy() if record else last

        def shared_starts(ki: int, ms: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
            f = self._shared_stage_ms(self.classes[ki], comp[ki][None], w[ki][None], ms[:, None, None])
            return valid[ki][None] & (f <= T), np.broadcast_to(last[ki], (len(ms),) + last[ki].shape)

        return best, besti, shared_starts

    def _held(self, workers: int) -> np.ndarray:
        """(1, workers): the in-flight count a stage starting at rank r holds on one worker (a
        replica of m holds ⌈that/m⌉): the workers from r to the end, or under the split kinds the
        input stage's count (ZB-H1), 2n − 1 (ZB-H2) or 2μ (zb-2bw) with n the stage count if set,
        else the workers (at least the stages)."""
        togo = (workers - np.arange(workers))[None, :]  # workers from r to the end
        if self.kind.split_backward:
            first = self.num_stages or workers
            togo = np.array([[self.kind.inflight_depth(int(d), first, self.mu) for d in togo[0]]], dtype=togo.dtype)
        return togo

    def _needs_with_budget(self, j1: int, T: float, workers: int, reach: np.ndarray, inok: np.ndarray
                           ) -> tuple[np.ndarray, np.ndarray, Any]:
        """With a memory budget a later start is no longer always better (memory grows with the
        stage's depth), so every reachable start block is weighed: as :meth:`_needs_no_budget`."""
        num_classes, counts = len(self.classes), reach.shape[1]
        best = np.full((num_classes, counts, workers), _INF_M, dtype=np.int64)
        besti = np.full((num_classes, counts, workers), -1, dtype=np.int64)
        I = np.nonzero(reach[:j1].any(axis=(1, 2)))[0]
        comp = self.compute_prefix[j1] - self.compute_prefix[I]
        w = self.weight_prefix[j1] - self.weight_prefix[I]
        togo = self._held(workers)
        acts = self.activations(I, j1)

        def replicas_for_memory(replicas: int) -> np.ndarray:
            """Fewest replicas whose depth fits the budget, per start block and start rank."""
            dmax = self.max_depth(I, j1, acts, replicas)  # (nI,)
            with np.errstate(divide="ignore"):
                return np.where(dmax[:, None] > 0, -(-togo // np.maximum(dmax[:, None], 1)), _INF_M)

        # A replicated stage accumulates into persistent gradients (one more parameter's worth).
        # Its replica count is not known here; 2 stands for any: only pipedream and naive
        # replicate in this path, and their memory depends on the count only through d.
        mmem1, mmem = replicas_for_memory(1), replicas_for_memory(2)
        reach_i = reach[I][:, :, :workers]
        for ki, k in enumerate(self.classes):
            if k > 0 and self.shared:
                continue  # enumerated by size in _shared_ends
            mreq = np.maximum(self.mmin(k, comp, w, T)[:, None], mmem1 if k == 0 else mmem)  # (nI, workers)
            cand = np.where(reach_i & inok[ki, I][:, None, None], mreq[:, None, :], _INF_M)
            arg = np.argmin(cand, axis=0)  # (counts, workers)
            best[ki] = np.take_along_axis(cand, arg[None], axis=0)[0]
            besti[ki] = np.where(best[ki] < _INF_M, I[arg], -1)

        fitting: dict[int, np.ndarray] = {}

        def memory_fits(m: int) -> np.ndarray:
            """(nI, workers): a stage of ``m`` replicas (sharing each minibatch's microbatches) fits."""
            if m not in fitting:
                base, per, cap = memory_terms(self.kind, w, acts, self.mu, self.f, self.recompute, m, self.scratch,
                                              self.sharding)
                d = np.minimum(-(-togo // m), cap)  # (1, workers)
                fitting[m] = (np.broadcast_to(base, w.shape)[:, None] + np.broadcast_to(per, w.shape)[:, None] * d
                              <= self.memory)
            return fitting[m]

        def shared_starts(ki: int, ms: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
            fits = inok[ki, I][None] & (self._shared_stage_ms(self.classes[ki], comp[None], w[None],
                                                              ms[:, None]) <= T)  # (M, nI)
            mem_ok = np.stack([memory_fits(int(m)) for m in ms])  # (M, nI, workers)
            ok = reach_i[None] & fits[:, :, None, None] & mem_ok[:, :, None, :]  # (M, nI, counts, workers)
            return ok.any(axis=1), I[np.argmax(ok, axis=1)]

        return best, besti, shared_starts

    def _component_prefix_min(self, keys: np.ndarray, workers: int, out: np.ndarray) -> None:
        """out[ki, c, x]: the smallest key over start ranks r ≤ x in x's level-k component (a
        stage of class k lies inside one component)."""
        counts = keys.shape[1]
        for ki, k in enumerate(self.classes):
            S = self.sizes[k]
            pad = (-workers) % S
            if k > 0 and self.shared:
                out[ki] = 0  # unused: _shared_ends decides these classes
            elif S == 1:
                out[ki] = keys[ki]
            elif pad:
                key = np.concatenate([keys[ki], np.full((counts, pad), np.iinfo(np.int64).max)], axis=1)
                out[ki] = np.minimum.accumulate(key.reshape(counts, -1, S), axis=2).reshape(counts, -1)[:, :workers]
            else:
                np.minimum.accumulate(keys[ki].reshape(counts, -1, S), axis=2, out=out[ki].reshape(counts, -1, S))

    def _record(self, parent: np.ndarray, j1: int, counts: int, rank_bounds: int, cond: np.ndarray, hit_c: np.ndarray,
                prefix_min: np.ndarray, besti: np.ndarray, shared: dict[int, Any]) -> None:
        """Remember, for every (stage count, end rank) newly reached at block boundary j1, the
        start block, start rank and previous stage count of the first class that reaches it."""
        kfirst = np.argmax(cond, axis=0)[None]
        r = np.take_along_axis(prefix_min, kfirst, axis=0)[0] % rank_bounds  # (counts, workers)
        i = besti[kfirst[0], np.arange(counts)[:, None], r]
        for ki, (_, r_k, i_k) in shared.items():
            r, i = np.where(kfirst[0] == ki, r_k, r), np.where(kfirst[0] == ki, i_k, i)
        if counts > 1:
            parent[j1, 1:, 1:, 0] = np.where(hit_c[:-1], i[:-1], -1)
            parent[j1, 1:, 1:, 1] = r[:-1]
            parent[j1, 1:, 1:, 2] = np.arange(counts - 1)[:, None]
        else:
            parent[j1, :, 1:, 0] = np.where(hit_c, i, -1)
            parent[j1, :, 1:, 1] = r
            parent[j1, :, 1:, 2] = 0

    def _shared_stage_ms(self, k: int, comp: np.ndarray, w: np.ndarray, m: np.ndarray) -> np.ndarray:
        """:func:`stage_time_ms` of class-k stages of ``m`` replicas under 2bw, flush or gpipe
        (``m`` broadcasts against ``comp`` and ``w``)."""
        # paper_allreduce over arrays (the same arithmetic: share × (bytes / B in ms))
        local = -(-self.mu // m)
        bandwidth = self.bar[max(k, 1)]
        if self.sharding != "replicate":
            return comp * local / self.mu + sharded_sync_ms(w, m, bandwidth, self.sharding, local)
        return comp * local / self.mu + ring_allreduce_share(m) * (w / bandwidth * MS_PER_S)

    def _shared_ends(self, k: int, workers: int, counts: int, starts: Any, record: bool
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where a class-k stage whose size is one of ``shared_sizes`` can end (2bw, flush, gpipe).

        ``starts(ms)`` gives, per size in ``ms`` and per (stage count, start rank), whether a
        stage of that many replicas ending at the current block fits from some reachable start
        block, and which one (only when recording). Returns (can end at rank x, its start rank,
        its start block), each (counts, workers).
        """
        S = self.sizes[k]
        ok_end = np.zeros((counts, workers), dtype=bool)
        r_sel = np.zeros((counts, workers), dtype=np.int64)
        i_sel = np.full((counts, workers), -1, dtype=np.int64)
        ms = np.array([m for m in self.shared_sizes if m <= workers], dtype=np.int64)
        if not len(ms):
            return ok_end, r_sel, i_sel
        oks, firsts = starts(ms)
        for t, m in enumerate(ms.tolist()):
            ok = oks[t]
            n = workers - m + 1  # start ranks r with r + m - 1 < workers
            r = np.arange(n)
            inside = (r // S) == ((r + m - 1) // S)  # the stage lies in one level-k component
            new = ok[:, :n] & inside[None, :] & ~ok_end[:, m - 1:]
            ok_end[:, m - 1:] |= new
            if record:
                r_sel[:, m - 1:] = np.where(new, r[None, :], r_sel[:, m - 1:])
                i_sel[:, m - 1:] = np.where(new, firsts[t][:, :n], i_sel[:, m - 1:])
        return ok_end, r_sel, i_sel

    def _in_ok(self, k: int, I: np.ndarray, T: float) -> np.ndarray:
        """Can a class-k stage start at block boundary i (the cut before it fits in T)?"""
        if k == 0 or math.isinf(T):
            return np.ones(len(I), dtype=bool)
        return (I == 0) | (2.0 * self.a_in[I] / self.beff[k] * MS_PER_S <= T)


def _end_rank(ends: np.ndarray, workers: int, exact_end: bool) -> int:
    """The rank bound where the last stage ends (``workers`` with ``exact_end``, else the
    fewest reached), or -1 where ``ends`` reaches none."""
    if exact_end:
        return workers if ends[workers] else -1
    hits = np.nonzero(ends)[0]
    return int(hits[0]) if len(hits) else -1


def _count_bit(words: np.ndarray, c: int) -> np.ndarray:
    """Bit c of packed stage-count words (words, ranks) as a bool array over ranks."""
    return ((words[c // 64] >> np.uint64(c % 64)) & np.uint64(1)).astype(bool)


def _next_count(hit: np.ndarray, counts: int) -> np.ndarray:
    """Stage-count bits one up (c → c + 1, dropping c = counts − 1), or as they are when the
    count is not tracked (counts == 1): the packed form of ``new_any[1:] = hit_c[:-1]``."""
    if counts == 1:
        return hit
    up = hit << np.uint64(1)
    up[1:] |= hit[:-1] >> np.uint64(63)
    top = counts % 64
    if top:
        up[-1] &= np.uint64((1 << top) - 1)
    return up


def _trace_back(parent: np.ndarray, N: int, c: int, s: int) -> list[tuple[int, int, int]]:
    """The stages (first block, last block, replicas) that reached rank ``s`` at the last block."""
    stages = []
    jj = N
    while jj > 0:
        i, r, cp = (int(v) for v in parent[jj, c, s])
        stages.append((i, jj - 1, s - r))
        jj, c, s = i, cp, r
    stages.reverse()
    return stages


def _search(prob: _Problem, workers: int, exact_end: bool, rtol: float,
            cap: float = math.inf) -> tuple[float, list[tuple[int, int, int]]] | None:
    """Bisection on the bottleneck; returns (time, stages) of the best plan or None if none fits
    (or, with ``cap``, none has a bottleneck of at most ``cap``: a deeper flush pipeline that
    cannot beat the best plan of a shallower one is dismissed with one test)."""
    ok, stages = prob.feasible(cap, workers, exact_end, record=True)
    if not ok:
        return None

    def cost(st: list[tuple[int, int, int]]) -> float:
        return evaluate(prob.blocks, prob.topology, st, prob.schedule, prob.mu, prob.f, sharding=prob.sharding).time_ms

    rtol = max(rtol, 1e-12)  # well above the closed form's rounding (4e-15, see mmin)
    best = cost(stages)
    hi = best
    lo = (prob.compute_prefix[-1] / workers) * (1 - 1e-9)
    # Plan costs are discrete: once the bracket is narrow, ask "is anything strictly better than
    # the best plan found?" — a no is a certificate of optimality and ends the search early.
    certify = True
    for _ in range(400):  # the bracket halves at least every other probe; 400 is never reached
        if not (hi > 0 and hi - lo > rtol * hi):
            break
        narrow = certify and hi - lo <= 1e-3 * hi
        certify = not narrow  # alternate certificate probes with bisection steps
        probe = best * (1 - rtol) if narrow else 0.5 * (lo + hi)
        ok, st = prob.feasible(probe, workers, exact_end, record=True)
        if ok:
            c = cost(st)
            if c < best:
                best, stages = c, st
            hi = min(probe, c)
        else:
            lo = probe
            if narrow:
                break
    return best, stages


# ------------------------------------------------------------------ the paper's recurrence
def _hierarchical(blocks: Sequence[Block], topology: Topology, allow_fewer: bool) -> list[tuple[int, int, int]]:
    """PipeDream's A^k/T^k dynamic programme (our cost terms), bottom-up over the levels."""
    N = len(blocks)
    compute_prefix = np.concatenate([[0.0], np.cumsum([b.compute_ms for b in blocks])])
    weight_prefix = np.concatenate([[0.0], np.cumsum([float(b.parameter_bytes) for b in blocks])])
    a = np.array([float(b.cut_bytes) for b in blocks])
    ii, jj = np.meshgrid(np.arange(N), np.arange(N), indexing="ij")
    valid = ii <= jj
    comp = np.where(valid, compute_prefix[np.minimum(jj + 1, N)] - compute_prefix[ii], np.inf)
    wts = np.where(valid, weight_prefix[np.minimum(jj + 1, N)] - weight_prefix[ii], 0.0)
    beff, bar = topology.effective_bandwidths, topology.allreduce_bandwidths
    below_full = None  # A^{k-1}(i→j, full component), (N, N)
    levels_choice = []
    for k, lv in enumerate(topology.levels, start=1):
        c, B = lv.count, beff[k]
        Tk = np.full((c + 1, N, N), np.inf)
        for m in range(1, c + 1):
            inner = comp if below_full is None else below_full
            ar = ring_allreduce_share(m) * wts / bar[k] * MS_PER_S
            Tk[m] = np.where(valid, (inner + ar) / m, np.inf)
        cut = 2.0 * a[:-1] / B * MS_PER_S  # cut after block s, s = 0..N-2
        Ak = np.full((c + 1, N, N), np.inf)
        choice = np.full((c + 1, N, N, 2), -1, dtype=np.int64)  # (split s, m') or -1: no split
        for m in range(1, c + 1):
            Ak[m] = Tk[m]
            for mp in range(1, m if N > 1 else 1):
                # X[i, s, j] = max(A(i→s, m-mp), cut_s, T(s+1→j, mp)), s = 0..N-2
                left = Ak[m - mp][:, :-1, None]
                right = Tk[mp][None, 1:, :]
                X = np.maximum(np.maximum(left, cut[None, :, None]), right)
                sbest = np.argmin(X, axis=1)
                xbest = np.take_along_axis(X, sbest[:, None, :], axis=1)[:, 0, :]
                better = xbest < Ak[m]
                Ak[m] = np.where(better, xbest, Ak[m])
                choice[m, :, :, 0] = np.where(better, sbest, choice[m, :, :, 0])
                choice[m, :, :, 1] = np.where(better, mp, choice[m, :, :, 1])
        levels_choice.append((Ak, Tk, choice))
        below_full = Ak[c]
    L = len(topology.levels)
    top_c = topology.levels[-1].count
    Atop = levels_choice[-1][0]
    m_top = top_c
    if allow_fewer:
        m_top = min(range(1, top_c + 1), key=lambda m: (Atop[m][0, N - 1], -m))

    def recon_A(k: int, m: int, i: int, j: int, mult: int) -> list[tuple[int, int, int]]:
        Ak, Tk, choice = levels_choice[k - 1]
        s, mp = (int(v) for v in choice[m, i, j])
        if s < 0:
            return recon_T(k, m, i, j, mult)
        return recon_A(k, m - mp, i, s, mult) + recon_T(k, mp, s + 1, j, mult)

    def recon_T(k: int, m: int, i: int, j: int, mult: int) -> list[tuple[int, int, int]]:
        if k == 1:
            return [(i, j, m * mult)]
        return recon_A(k - 1, topology.levels[k - 2].count, i, j, mult * m)

    return recon_A(L, m_top, 0, N - 1, 1)


# ------------------------------------------------------------------ fixed replica counts
def best_split_for_replicas(blocks: Sequence[Block], topology: Topology, replicas: Sequence[int],
                            schedule: str = "pipedream", microbatches: int = 1,
                            optimizer_state_factor: float = DEFAULT_OPTIMIZER_STATE_FACTOR
                            ) -> tuple[float, list[tuple[int, int, int]]]:
    """Best contiguous split for a fixed replica configuration (e.g. the paper's "15-1"):
    (time per minibatch in ms, stages). The depth is fixed, so the split that minimises the
    bottleneck also minimises the time per minibatch."""
    K, N = len(replicas), len(blocks)
    if K > N:
        raise PlanError(f"{K} stages but the graph has only {N} blocks to split")
    starts = np.concatenate([[0], np.cumsum(replicas)])
    if starts[-1] > topology.num_workers:
        raise PlanError(f"config {'-'.join(map(str, replicas))} needs {starts[-1]} workers; topology has "
                        f"{topology.num_workers}")
    compute_prefix = np.concatenate([[0.0], np.cumsum([b.compute_ms for b in blocks])])
    weight_prefix = np.concatenate([[0.0], np.cumsum([float(b.parameter_bytes) for b in blocks])])
    # best[s][j]: min bottleneck of stages 0..s covering blocks 0..j
    best = np.full((K, N), np.inf)
    arg = np.full((K, N), -1, dtype=np.int64)
    for s in range(K):
        m, r0 = int(replicas[s]), int(starts[s])
        bw = topology.allreduce_bandwidth(range(r0, r0 + m))
        for j in range(s, N - (K - 1 - s)):
            for i in range(s, j + 1):
                t = stage_time_ms(compute_prefix[j + 1] - compute_prefix[i], weight_prefix[j + 1] - weight_prefix[i],
                                  m, bw, schedule, microbatches)
                if s > 0:
                    prev = best[s - 1][i - 1]
                    cutbw = topology.span_bandwidth(range(int(starts[s - 1]), r0 + m))
                    t = max(t, prev, 2 * transfer_ms(blocks[i - 1].cut_bytes, cutbw))
                elif i > 0:
                    continue
                if t < best[s][j]:
                    best[s][j], arg[s][j] = t, i
    stages, j = [], N - 1
    for s in range(K - 1, -1, -1):
        i = int(arg[s][j])
        stages.append((i, j, int(replicas[s])))
        j = i - 1
    stages.reverse()
    ev = evaluate(blocks, topology, stages, schedule, microbatches, optimizer_state_factor)
    return ev.minibatch_ms, stages


# ------------------------------------------------------------------ the public entry point
def plan(
    graph: LayerGraph,
    topology: Topology | str,
    *,
    schedule: str = "pipedream",
    straight: bool = False,
    num_stages: int | None = None,
    allow_fewer_workers: bool = False,
    memory_bytes: int | None = None,
    microbatches: int = 1,
    optimizer_state_factor: float = DEFAULT_OPTIMIZER_STATE_FACTOR,
    optimizer_scratch: tuple[float, float] = NO_SCRATCH,
    method: str = "fast",
    rtol: float = 1e-10,
    recompute: bool = False,
    chunks: int = 2,
    sharding: str = "replicate",
    tensor_parallel: int = 1,
) -> Plan:
    """Choose stages, replica counts and ranks that minimise the predicted time per minibatch.

    Args:
        graph: the profiled layer graph (a DAG is planned over ``graph.linearize()``).
        topology: a :class:`Topology`, a spec (``"4x4:10GB/s,1.25GB/s"``), a preset or a JSON file.
        schedule: the schedule kind (a name in ``plans.kinds.SCHEDULE_KINDS``): decides the
            memory model, how replicas share a minibatch and whether fill and drain are paid
            (``torchpipedream.plan``, in search/auto.py, also takes "auto").
        straight: one worker per stage (no replication).
        num_stages: exactly this many stages.
        allow_fewer_workers: the plan may leave workers idle when that is not slower.
        memory_bytes: per-worker budget; None takes the topology's (None there = unlimited).
        microbatches: microbatches per minibatch (2bw, flush, gpipe memory model).
        optimizer_state_factor: extra weight-sized buffers per worker (gradient, momentum).
        optimizer_scratch: the optimizer step's temporaries, (a, b): a × the stage's largest
            layer's parameters + b × its weights (``plans.memory.once_bytes``): (0, 0) for SGD,
            (2, 0) for torch's Adam/AdamW on a CPU (a per-parameter loop), (0, 1) for their
            ``foreach`` form (CUDA's default).
        method: "fast" (exact bisection, default) or "hierarchical" (the paper's DP).
        rtol: the bisection stops when the bracket is within this relative width.
        recompute: activation recomputation on every stage (``Stage.recompute``): each backward is
            charged its stage's forward again; the memory model counts its stashed inputs.
        chunks: for kinds with virtual stages (interleaved): stages per worker, v. The model
            is cut into workers × v stages of balanced time (a straight plan of that depth),
            stage k on worker k mod workers (``Plan.looped``).
        sharding: what replicated stages do with their weights (``Stage.sharding``): "replicate",
            or "zero3"/"zero2"/"zero1" (FSDP2; flush, gpipe, zb-h1, zb-h2), priced with the shards' memory and collectives.
        tensor_parallel: processes per worker (``Plan.tensor_parallel``; flush, gpipe), grouped on
            the innermost level; each runs the model as search/tensor_parallel.py prices it.

    Raises:
        PlanError: impossible requests (more stages than blocks or workers, nothing fits in memory).
    """
    t0, (topo, kind) = time.perf_counter(), _topology_and_kind(graph, topology, schedule)
    arguments = {k: v for k, v in locals().items() if k in _PLAN_ARGUMENTS}  # every argument as given
    if tensor_parallel != 1:
        return _plan_tensor_parallel(graph, topo, kind, t0, **arguments)
    schedule, straight = kind.name, straight or (kind.split_backward and not kind.replicates_split_stages)
    if kind.virtual_stages:
        return _plan_virtual(graph, topo, schedule, _stages_per_worker(kind, chunks, num_stages, topo),
                             microbatches=microbatches, memory_bytes=memory_bytes, rtol=rtol, recompute=recompute,
                             optimizer_state_factor=optimizer_state_factor, optimizer_scratch=optimizer_scratch)
    optimizer_scratch = _checked_search_options(method, optimizer_state_factor, optimizer_scratch, recompute, (
        sharding, kind), hierarchical_ok=not straight and num_stages is None and not kind.split_backward)
    blocks = _planning_blocks(graph, recompute)
    _check_shape_request(len(graph), len(blocks), topo.num_workers, microbatches, num_stages, straight,
                         allow_fewer_workers)
    memory = _memory_budget(memory_bytes, topo)
    search = functools.partial(_search_chain, topo=topo, schedule=schedule, microbatches=microbatches, memory=memory,
                               f=optimizer_state_factor, scratch=optimizer_scratch, recompute=recompute,
                               method=method, num_stages=num_stages, allow_fewer=allow_fewer_workers, rtol=rtol,
                               sharding=sharding)
    blocks, stages, checks = _place(graph, blocks, search, straight, topo, schedule, microbatches,
                                    optimizer_state_factor, sharding)
    options = _options_record(method=method, straight=straight, num_stages=num_stages,
                              allow_fewer_workers=allow_fewer_workers, memory_bytes=memory, microbatches=microbatches,
                              optimizer_state_factor=optimizer_state_factor, recompute=recompute,
                              optimizer_scratch=optimizer_scratch, sharding=sharding)
    return _unless_straight_is_faster(graph, topo, _build_plan(
        graph, blocks, topo, stages, schedule, microbatches, optimizer_state_factor, memory, time.perf_counter() - t0,
        checks, options), arguments, t0)


def _unless_straight_is_faster(graph: LayerGraph, topo: Topology, replicated: Plan, arguments: dict[str, Any],
                               t0: float) -> Plan:
    """``replicated``, or under zb-h1 and zb-h2 where it has replicas the straight plan of the
    same request if that is not slower: the search balances the stages' busy time, but a
    replica of a split stage holds only its share of the straight stage's microbatches and waits
    on their round trips (search/replica_round_trip.py), which ``evaluate`` charges only once
    the plan is made."""
    if not schedule_kind(replicated.schedule).replicates_split_stages or all(
            st.replicas == 1 for st in replicated.stages):
        return replicated
    try:
        line = plan(graph, topo, **{**arguments, "straight": True})
    except PlanError:  # a straight pipeline does not fit (memory, fewer blocks than workers)
        return replicated
    if line.predicted["time_per_minibatch_s"] > replicated.predicted["time_per_minibatch_s"]:
        return replicated
    line.meta["planner"]["straight"] = False  # what was asked: a replicated plan was weighed
    line.meta["planning_time_s"] = time.perf_counter() - t0
    log.debug("straight %s plan %s is not slower than the replicated %s", line.schedule, line.summary,
              replicated.summary)
    return line


def nothing_sharded(plan: Plan, sharding: str) -> str | None:
    """Why ``plan`` shards nothing although ``sharding`` ("zero3", "zero2", "zero1") was asked for, or
    None: it has no replicated stage, because the planner found none worth its workers (under
    zb-h1 and zb-h2 a straight pipeline can be faster: replicas wait on round trips)."""
    if sharding == "replicate" or any(st.sharded for st in plan.stages):
        return None
    return (f"the plan ({plan.summary}) has no replicated stage, so nothing is sharded; to shard anyway, write a "
            "plan with replicated stages and give it to train --plan")


#: :func:`plan`'s keyword arguments.
_PLAN_ARGUMENTS = ("schedule", "straight", "num_stages", "allow_fewer_workers", "memory_bytes", "microbatches",
                   "optimizer_state_factor", "optimizer_scratch", "method", "rtol", "recompute", "chunks", "sharding",
                   "tensor_parallel")


def _plan_tensor_parallel(graph: LayerGraph, topo: Topology, kind: ScheduleKind, t0: float, **options: Any) -> Plan:
    """:func:`plan` of workers of ``tensor_parallel`` processes: the model as one process of a
    worker runs it, planned on the workers' topology (search/tensor_parallel.py)."""
    degree = options.pop("tensor_parallel")
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
        raise PlanError(f"tensor_parallel must be a positive whole number, got {degree!r}")
    if kind.asynchronous:
        raise PlanError(f"tensor_parallel {degree}: {kind.name} is not supported with tensor parallelism yet; "
                        "use a synchronous kind")
    inner = tensor_parallel_graph(graph, degree, topo, options["microbatches"])
    made = plan(inner, worker_topology(topo, degree), **options).with_tensor_parallel(degree)
    made.topology = topo.to_spec()
    made.meta["planner"] = {**made.meta.get("planner", {}), "tensor_parallel": degree}
    made.meta["planning_time_s"] = time.perf_counter() - t0
    return made


def _place(graph: LayerGraph, blocks: list[Block], search: Any, straight: bool, topo: Topology, schedule: str,
           microbatches: int, f: float, sharding: str = "replicate") -> tuple[list[Block], list[tuple[int, int, int]], int]:
    """The chain of blocks the plan cuts, its stages and the feasibility tests they took:
    ``search``'s, or where the model shares parameters, ``_place_shared``'s choice."""
    if graph.tied:
        return _place_shared(graph, blocks, search, straight, topo, schedule, microbatches, f, sharding)
    stages, checks = search(blocks, straight)
    return blocks, stages, checks


def _options_record(*, optimizer_scratch: tuple[float, float], sharding: str = "replicate",
                    **options: Any) -> dict[str, Any]:
    """The options a plan records (``meta["planner"]``), its optimizer scratch and sharding only
    where it has them (records as before them otherwise)."""
    if optimizer_scratch != NO_SCRATCH:
        options["optimizer_scratch"] = list(optimizer_scratch)
    if sharding != "replicate":
        options["sharding"] = sharding
    return options


def _check_sharding(sharding: str, kind: ScheduleKind, method: str) -> None:
    """``sharding`` is one of the plan's, for a kind that shards (``ScheduleKind.can_shard``) and the exact search."""
    if sharding not in SHARDINGS:
        raise PlanError(f"sharding must be one of {', '.join(SHARDINGS)}, got {sharding!r:.40}")
    if sharding == "replicate":
        return
    if not kind.can_shard:
        raise PlanError(f"sharding {sharding!r} runs under {SHARDING_KINDS_TEXT} (one weight version, replicated "
                        f"stages), not {kind.name}")
    if method != "fast":
        raise PlanError(f"sharding {sharding!r} is planned by method='fast' only")


def _topology_and_kind(graph: LayerGraph, topology: Topology | str, schedule: str) -> tuple[Topology, ScheduleKind]:
    """The topology and the registered kind ``plan`` plans for (PlanError for a non-graph,
    "auto" or an unknown kind)."""
    if not isinstance(graph, LayerGraph):
        raise PlanError(f"plan() needs a LayerGraph, got {type(graph).__name__}")
    if schedule == AUTO:
        raise PlanError("planner.plan plans one schedule kind; torchpipedream.plan(..., schedule='auto') "
                        "(search.auto.plan) chooses the kind and the microbatches")
    topo = Topology.from_any(topology)
    try:
        return topo, schedule_kind(schedule)
    except UnknownKindError as exc:
        raise PlanError(str(exc)) from None


def _stages_per_worker(kind: ScheduleKind, chunks: int, num_stages: int | None, topo: Topology) -> int:
    """Stages per worker of a kind with virtual stages (zb-v: 2, interleaved: ``chunks``), checked
    against a requested ``num_stages``."""
    per_worker = 2 if kind.v_shape else chunks
    if num_stages is not None and isinstance(per_worker, int) and num_stages != topo.num_workers * per_worker:
        raise PlanError(f"num_stages={num_stages}: {kind.name} plans {per_worker} stages on each of the "
                        f"{topo.num_workers} workers ({topo.num_workers * per_worker} stages); leave num_stages "
                        "unset or use a kind with one stage per worker")
    return per_worker


def _checked_search_options(method: str, optimizer_state_factor: float, optimizer_scratch: Any,
                            recompute: Any, sharding: tuple[str, ScheduleKind] | None = None,
                            hierarchical_ok: bool = True) -> tuple[float, float]:
    """PlanError for a bad method (the paper's DP plans neither straight nor a set number of
    stages: ``hierarchical_ok``), optimizer state factor, optimizer scratch, recompute flag or
    (sharding, kind) pair; the scratch as two floats."""
    if method == "hierarchical" and not hierarchical_ok:
        raise PlanError("method='hierarchical' (the paper's DP) supports neither straight, num_stages nor the "
                        "zero-bubble kinds; use method='fast'")
    if sharding is not None:
        _check_sharding(*sharding, method)
    if method not in ("fast", "hierarchical"):
        raise PlanError(f"unknown method {method!r}; use 'fast' or 'hierarchical'")
    if optimizer_state_factor < 0:
        raise PlanError(f"optimizer_state_factor must be >= 0, got {optimizer_state_factor!r}")
    if not (isinstance(optimizer_scratch, (tuple, list)) and len(optimizer_scratch) == 2
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 for v in optimizer_scratch)):
        raise PlanError("optimizer_scratch must be two numbers >= 0 (× the largest layer's parameters, × the "
                        f"stage's weights), got {optimizer_scratch!r}")
    if not isinstance(recompute, bool):
        raise PlanError(f"recompute must be True or False, got {recompute!r}")
    return float(optimizer_scratch[0]), float(optimizer_scratch[1])


def _memory_budget(memory_bytes: int | None, topo: Topology) -> float | None:
    """The per-worker budget: ``memory_bytes``, else the topology's (None: unlimited)."""
    memory = memory_bytes if memory_bytes is not None else topo.memory_bytes
    if memory is not None and (not isinstance(memory, (int, float)) or memory <= 0):
        raise PlanError(f"memory budget must be a positive number of bytes, got {memory!r}")
    return memory


def _search_chain(chain: list[Block], straight_only: bool, *, topo: Topology, schedule: str, microbatches: int,
                  memory: float | None, f: float, scratch: tuple[float, float], recompute: bool, method: str,
                  num_stages: int | None, allow_fewer: bool, rtol: float,
                  sharding: str = "replicate") -> tuple[list[tuple[int, int, int]], int]:
    """The best stages for one chain of blocks and the feasibility tests it took: the paper's DP
    (``method="hierarchical"``) or the exact search over the depths worth searching."""
    # the paper's DP replicates freely: a straight re-search (shared parameters) is the exact one's
    if method == "hierarchical" and not straight_only:
        return _hierarchical(chain, topo, allow_fewer), 0

    cache = _ChainTerms()  # one per chain: its problems differ only in depth (and, bisected, in budget)

    def problem(depth: int | None) -> _Problem:
        return _Problem(chain, topo, schedule, microbatches, memory, f, depth, straight_only, recompute, scratch,
                        sharding, cache)

    return _search_depths(problem, chain, topo.num_workers, num_stages, straight_only, allow_fewer,
                          memory is not None, rtol)


def _planning_blocks(graph: LayerGraph, recompute: bool) -> list[Block]:
    """The graph's chain of blocks as the planner prices them: with ``recompute`` each backward
    is charged its block's forward again."""
    blocks = graph.linearize()
    if recompute:
        blocks = [dataclasses.replace(b, backward_ms=b.backward_ms + b.forward_ms) for b in blocks]
    return blocks


def _plan_virtual(graph: LayerGraph, topo: Topology, schedule: str, chunks: int, **options: Any) -> Plan:
    """A plan of virtual stages for ``schedule``: the straight plan of workers × ``chunks``
    balanced stages on a topology with ``chunks`` times the workers (each worker's memory shared
    by its chunks), then stage k on worker k mod workers (interleaved, ``Plan.looped``), or in a
    V (zb-v, ``Plan.v_shape``: worker r holds stages r and 2p − 1 − r). A cut balanced stage by
    stage need not balance the workers, so the cuts ``_worker_cuts`` proposes (that one, the
    best few for the busiest worker's compute and transfers, and a local search's) are each
    simulated with the plan's profile and the fastest kept: the busiest worker's sum misses
    what the order costs (on fc_heavy and the LM its best cut simulated slower than the local
    search's). Its prediction: the busiest worker's compute and transfers per
    minibatch, times the kind's fill and drain (interleaved (μ + (p − 1)/v)/μ, zb-v
    (μ + (p − 1)/6)/μ). Its memory: the flush model of that deeper pipeline, summed per worker
    (an approximation: the interleaved order holds up to 2(p − r − 1) + (v − 1)p + 1
    microbatches over a worker's chunks, zb-v up to 2p + 2)."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise PlanError(f"chunks (stages per worker) must be a positive integer, got {chunks!r}")
    if graph.tied:
        raise PlanError(f"{schedule}: the model shares parameters between layers ({graph.tied[0].name}), which the "
                        "planner does not plan on virtual stages yet; give a plan by hand (Plan.looped) whose workers "
                        "each hold at most one copy, or use flush")
    workers = topo.num_workers
    kind = schedule_kind(schedule)
    if not kind.v_shape and options["microbatches"] % workers:
        raise PlanError(f"{schedule} runs microbatches in rounds of one per worker: microbatches must be a multiple "
                        f"of the {workers} workers, got {options['microbatches']}")
    memory = options.pop("memory_bytes")
    memory = memory if memory is not None else topo.memory_bytes
    top = topo.levels[-1]
    wide = Topology([*topo.levels[:-1], Level(top.count * chunks, top.bandwidth_Bps, top.name)],
                    memory_bytes=None, latency_s=topo.latency_s, name=topo.name,
                    allreduce_efficiency=topo.allreduce_efficiency)
    budget = memory / chunks if memory is not None else None
    deep = plan(graph, wide, schedule="flush", straight=True, num_stages=workers * chunks, memory_bytes=budget,
                **options)
    rank_of = v_shape_rank if kind.v_shape else looped_rank
    blocks = _planning_blocks(graph, bool(options.get("recompute")))
    cut = [(i, j, 1) for i, j in deep.meta["blocks"]]
    f = options["optimizer_state_factor"]

    stage_time = functools.lru_cache(maxsize=None)(
        functools.partial(_straight_stage_ms, blocks, wide, deep.microbatches, len(cut)))

    chosen: tuple[float, Plan] | None = None
    over: list[float] = []
    for trial in _worker_cuts(blocks, cut, rank_of, workers, stage_time):
        built = deep if trial == cut else _build_plan(  # the deep plan's options (its optimizer scratch) hold
            graph, blocks, wide, trial, "flush", deep.microbatches, f, budget, deep.meta["planning_time_s"],
            deep.meta["feasibility_checks"], dict(deep.meta["planner"], rebalanced_for_workers=True))
        if budget is not None and max(st.memory_bytes for st in built.stages) > budget:
            continue
        p = _placed(graph, topo, schedule, built, chunks, rank_of)
        if memory is not None and p.predicted["peak_memory_bytes"] > memory:
            over.append(p.predicted["peak_memory_bytes"])
            continue
        m = p.microbatches
        rate = simulate(build_schedule(p, schedule, minibatches=4, microbatches=m),
                        Costs.from_plan(p, microbatches=m)).minibatches_per_s
        if chosen is None or rate > chosen[0] * (1 + 1e-9):
            chosen = (rate, p)
    if chosen is None:
        raise PlanError(f"{schedule}: every cut needs more than the budget of {format_bytes(memory)} on some worker "
                        f"(the least: {format_bytes(min(over))})" if over else
                        f"{schedule}: no cut of the model into {workers * chunks} stages fits the budget")
    return chosen[1]


def _straight_stage_ms(blocks: Sequence[Block], topology: Topology, microbatches: int, num_stages: int,
                      k: int, i: int, j: int) -> float:
    """What :func:`evaluate` charges stage k (blocks i..j, on rank k) of a straight flush
    pipeline of ``num_stages`` stages per minibatch, its compute and its outgoing transfer, by
    the same arithmetic: ``_plan_virtual`` scores tens of thousands of cuts from these, cached
    per (k, i, j), instead of evaluating each cut."""
    compute = sum(b.compute_ms for b in blocks[i:j + 1])
    own = sum(b.parameter_bytes for b in blocks[i:j + 1])
    ms = stage_time_ms(compute, own, 1, topology.allreduce_bandwidth([k]), "flush", microbatches)  # no exchange
    if k == num_stages - 1:
        return ms
    return ms + 2 * transfer_ms(blocks[j].cut_bytes, topology.span_bandwidth([k, k + 1]))


def _placed(graph: LayerGraph, topo: Topology, schedule: str, deep: Plan, chunks: int, rank_of: Any) -> Plan:
    """The straight plan ``deep`` of workers × ``chunks`` stages placed on the workers by
    ``rank_of``, with the prediction and memory of its busiest worker (``_plan_virtual``)."""
    workers = topo.num_workers
    kind = schedule_kind(schedule)
    stages = [dataclasses.replace(st, ranks=[rank_of(k, workers)]) for k, st in enumerate(deep.stages)]
    m = deep.microbatches
    held = [[st for st in stages if st.ranks == [r]] for r in range(workers)]
    per_rank = [sum(st.compute_ms + st.comm_ms for st in mine) for mine in held]
    rank_memory = [sum(st.memory_bytes for st in mine) for mine in held]
    t_ms = max(per_rank) * kind.fill_drain_factor(m, workers, chunks)
    predicted = dict(deep.predicted)
    predicted.update(time_per_minibatch_s=t_ms / 1e3, minibatches_per_s=1e3 / t_ms if t_ms > 0 else None,
                     samples_per_s=(graph.batch_size * 1e3 / t_ms) if (graph.batch_size and t_ms > 0) else None,
                     bottleneck_stage=None, bottleneck=f"worker {per_rank.index(max(per_rank))}",
                     peak_memory_bytes=int(max(rank_memory)))
    dp = predicted.get("data_parallel_time_per_minibatch_s")
    predicted["speedup_over_data_parallel"] = dp * 1e3 / t_ms if dp and t_ms > 0 else None
    meta = dict(deep.meta, workers_available=workers, chunks=chunks, worker_time_ms=per_rank)
    meta["planner"] = dict(meta.get("planner", {}), chunks=chunks)
    p = Plan(stages=stages, schedule=schedule, batch_size=deep.batch_size, microbatches=m, topology=topo.to_spec(),
             predicted=predicted, meta=meta)
    p.validate(layer_names=graph.names, world_size=workers)
    return p


#: Cuts of a virtual plan searched exhaustively up to this many candidates (each one sum of
#: cached stage times: vgg16's 4 stages on 2 workers, 6545 cuts; resnet50's 632710 take the
#: local search).
EXHAUSTIVE_CUTS = 40000
#: How many of the exhaustive search's best cuts ``_plan_virtual`` simulates.
SIMULATED_CUTS = 4


def _worker_cuts(blocks: Sequence[Block], stages: list[tuple[int, int, int]], rank_of: Any, workers: int,
                 stage_time: Any) -> list[list[tuple[int, int, int]]]:
    """Cuts of the same stage count as ``stages`` (first block, last block, 1) worth simulating,
    lowest busiest-worker time first (worker of stage k: ``rank_of(k, workers)``; ``stage_time(k,
    i, j)`` gives stage k's time per minibatch over blocks i..j, its compute and its outgoing
    transfer): the
    ``SIMULATED_CUTS`` best of every cut where there are at most ``EXHAUSTIVE_CUTS``; the local
    optimum reached by moving each boundary in turn to its best place between its neighbours
    until none moves (moving one block at a time stopped short on small_cnn's V, measured 0.86×
    torch's ZBV); and ``stages`` itself, last."""
    n = len(blocks)
    starts = [i for i, _, _ in stages] + [n]

    def as_stages(bounds: list[int]) -> list[tuple[int, int, int]]:
        return [(bounds[k], bounds[k + 1] - 1, 1) for k in range(len(bounds) - 1)]

    owner = [rank_of(k, workers) for k in range(len(stages))]

    def busiest(bounds: list[int]) -> float:
        load = [0.0] * workers
        for k in range(len(bounds) - 1):
            load[owner[k]] += stage_time(k, bounds[k], bounds[k + 1] - 1)
        return max(load)

    found: list[tuple[float, list[int]]] = []
    if math.comb(n - 1, len(starts) - 2) <= EXHAUSTIVE_CUTS:
        every = ([0, *inner, n] for inner in itertools.combinations(range(1, n), len(starts) - 2))
        found = heapq.nsmallest(SIMULATED_CUTS, ((busiest(b), b) for b in every), key=lambda vb: vb[0])
    local, best = starts, busiest(starts)
    improved = True
    while improved:
        improved = False
        for k in range(1, len(local) - 1):
            for moved in range(local[k - 1] + 1, local[k + 1]):
                trial = local[:k] + [moved] + local[k + 1:]
                value = busiest(trial)
                if value < best * (1 - 1e-12):
                    local, best, improved = trial, value, True
    found.append((best, local))
    out: list[list[tuple[int, int, int]]] = []
    for _, bounds in sorted(found, key=lambda vb: vb[0]):
        if bounds != starts and as_stages(bounds) not in out:
            out.append(as_stages(bounds))
    return out + [as_stages(starts)]


def _check_shape_request(layers: int, N: int, W: int, microbatches: int, num_stages: int | None, straight: bool,
                         allow_fewer: bool) -> None:
    """PlanError for stage counts, microbatches and straightness that no plan of ``N`` blocks on
    ``W`` workers can meet, each message saying what to ask for instead."""
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise PlanError(f"microbatches must be a positive integer, got {microbatches!r}")
    if num_stages is not None:
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise PlanError(f"num_stages must be a positive integer, got {num_stages!r}")
        if num_stages > N:
            raise PlanError(
                f"{num_stages} stages requested but the graph has only {N} blocks to put in stages "
                f"({layers} layers; layers without compute or weights are merged into the block before "
                f"them); ask for at most {N} stages"
            )
        if num_stages > W:
            raise PlanError(f"{num_stages} stages need at least {num_stages} workers; the topology has {W}")
    if straight and not allow_fewer and W > N:
        raise PlanError(
            f"a straight pipeline on {W} workers needs {W} stages but the graph has only {N} blocks; "
            "use fewer workers or allow_fewer_workers (--allow-fewer-workers)"
        )
    if straight and num_stages is not None and not allow_fewer and num_stages != W:
        raise PlanError(f"a straight pipeline of {num_stages} stages uses {num_stages} workers, not {W}; "
                        "use allow_fewer_workers (--allow-fewer-workers) or --stages "
                        f"{W}")


def _search_depths(problem: Any, blocks: Sequence[Block], W: int, num_stages: int | None, straight: bool,
                   allow_fewer: bool, budgeted: bool, rtol: float) -> tuple[list[tuple[int, int, int]], int]:
    """The best stages over the depths worth searching, and the feasibility tests it took.

    Flushing kinds pay (μ + n − 1)/μ on the bottleneck (zb-2bw (n + μ)/3μ once n > 2μ), so
    depth is part of the objective: each
    depth n is searched exactly (``problem(n)``) from shallow to deep, and the search stops once
    even a perfectly balanced plan of that depth (total compute / W) cannot win. The other kinds
    search all depths at once (``problem(None)``).
    """
    first = problem(num_stages)
    depths: list[int | None] = [num_stages]
    deepest = min(len(blocks), W)
    if num_stages is None and first.kind.fill_drain_factor(first.mu, deepest) > 1 and not (straight and not allow_fewer):
        depths = list(range(1, min(len(blocks), W) + 1))
    result: tuple[float, list[tuple[int, int, int]]] | None = None
    checks = 0
    # one packed test screens the depths where there is one (a budget, replicas sharing microbatches)
    screen = _DepthScreen(problem(deepest), W) if len(depths) > 1 and budgeted and first.shared and not allow_fewer \
        else None
    for depth in depths:
        factor = first.kind.fill_drain_factor(first.mu, depth) if depth else 1.0
        if result is not None and blocks_total_ms(blocks) / W * factor >= result[0]:
            break
        cap = math.inf if result is None else result[0] * (1 - 1e-12) / factor
        if screen is not None and depth is not None and not screen.may_fit(depth, cap):
            continue
        prob = first if depth == num_stages else problem(depth)
        if allow_fewer and budgeted:
            found = [_search(prob, workers, True, rtol, cap) for workers in range(1, W + 1)]
        else:
            found = [_search(prob, W, not allow_fewer, rtol, cap)]
        checks += prob.checks
        if screen is not None and all(r is None for r in found):
            screen.missed()
        for r in found:
            if r is not None and (result is None or r[0] * factor < result[0] * (1 - 1e-12)):
                result = (r[0] * factor, r[1])
    if result is None:
        raise _nothing_fits(problem(num_stages), first.memory, W, allow_fewer, num_stages, straight)
    return result[1], checks + (screen.checks if screen is not None else 0)


class _DepthScreen:
    """Which depths can still reach a cap, from one packed test over every stage count
    (``_Problem.feasible_depths``) instead of one test per depth. Feasibility only grows with
    the bottleneck, and a depth's cap only falls, so a depth that fails the screen fails its own
    test. A screen is taken at the first depth, and again after a depth it let through found
    nothing under its cap (the screen was taken at a looser cap and may let more through)."""

    def __init__(self, deepest: Any, workers: int) -> None:
        self._prob, self._workers = deepest, workers
        self._fits: np.ndarray | None = None

    @property
    def checks(self) -> int:
        return self._prob.checks

    def may_fit(self, depth: int, cap: float) -> bool:
        """False only where ``depth`` stages certainly do not fit at bottleneck ``cap``."""
        if self._fits is None:
            self._fits = self._prob.feasible_depths(cap, self._workers, True)
        return self._fits is None or bool(self._fits[depth])

    def missed(self) -> None:
        """A depth the screen let through found nothing: screen again at the next cap."""
        self._fits = None


def blocks_total_ms(blocks: Sequence[Block]) -> float:
    """Compute of every block: a lower bound on W workers' time per minibatch is this / W."""
    return float(sum(b.compute_ms for b in blocks))


def _nothing_fits(prob: _Problem, memory: float | None, W: int, allow_fewer: bool, num_stages: int | None,
                  straight: bool) -> PlanError:
    """The error for an infeasible request; with a memory budget it names the smallest that fits."""
    if memory is None:
        hint = ""
        if prob.shared and not allow_fewer and min(prob.N, num_stages or prob.N) < W:
            hint = (f"; some stage needs replicas, and under {prob.schedule} a replicated "
                    f"stage's replica count must divide the {prob.mu} microbatches per minibatch, which it "
                    "shares among its replicas: raise microbatches (a multiple of the replica counts) or allow "
                    "fewer workers")
        return PlanError(f"no plan exists for {prob.N} blocks on {W} workers with these options "
                         f"(num_stages={num_stages}, straight={straight}){hint}")
    hi = 1.0
    prob.memory = hi
    while not _any_fit(prob, W, allow_fewer):
        hi *= 2
        prob.memory = hi
        if hi > 1e18:
            return PlanError("no plan exists even with unlimited memory; check num_stages/straight options")
    lo = hi / 2
    while hi - lo > max(1.0, hi * 1e-6):
        mid = (lo + hi) / 2
        prob.memory = mid
        if _any_fit(prob, W, allow_fewer):
            hi = mid
        else:
            lo = mid
    prob.memory = hi
    # the exact peak of a plan that fits in hi (every plan's peak is >= the infeasible lo)
    worker_counts = range(1, W + 1) if allow_fewer else [W]
    peaks = []
    for workers in worker_counts:
        ok, st = prob.feasible(math.inf, workers, True, True)
        if ok:
            ev = evaluate(prob.blocks, prob.topology, st, prob.schedule, prob.mu, prob.f, recompute=prob.recompute,
                          optimizer_scratch=prob.scratch, sharding=prob.sharding)
            peaks.append(max(ev.memory_bytes))
    hi = min(peaks)
    prob.memory = memory
    error = PlanError(
        f"no plan fits in {format_bytes(memory)} per worker ({int(memory)} bytes); the smallest budget any "
        f"plan of this model fits in is {format_bytes(math.ceil(hi))} ({math.ceil(hi)} bytes) "
        f"with schedule {prob.schedule!r}: raise --memory, add workers, or pick a schedule that keeps fewer "
        "weight versions (2bw, flush)" + (", or shard the replicated stages (sharding 'zero3', train --shard)"
                                          if prob.shared and prob.sharding == "replicate" else "")
    )
    error.smallest_budget = math.ceil(hi)  # type: ignore[attr-defined]  # _place_shared keeps the smaller of two
    return error


def _any_fit(prob: _Problem, W: int, allow_fewer: bool) -> bool:
    if allow_fewer:
        return any(prob.feasible(math.inf, workers, True, False)[0] for workers in range(1, W + 1))
    return prob.feasible(math.inf, W, True, False)[0]


def _merge_shared(blocks: Sequence[Block], tied: Sequence[SharedParameter]) -> list[Block]:
    """The chain with every run of blocks from a shared parameter's first use to its last
    merged into one block: the plans in which no stage splits a tie."""
    where = {name: k for k, b in enumerate(blocks) for name in b.layers}
    spans = sorted((min(where[n] for n in t.layers), max(where[n] for n in t.layers)) for t in tied)
    merged: list[Block] = []
    k = 0
    while k < len(blocks):
        end = k
        for a, b in spans:
            if a <= end and b > end and a >= k:
                end = b
        merged.append(Block.join(blocks[k:end + 1]))
        k = end + 1
    return merged


def _place_shared(graph: LayerGraph, blocks: list[Block], search: Any, straight: bool, topo: Topology,
                  schedule: str, microbatches: int, f: float,
                  sharding: str = "replicate") -> tuple[list[Block], list[tuple[int, int, int]], int]:
    """The best placement of a model with shared parameters (``graph.tied``): the search's own
    plan, priced with the exchange and copies of every tie it splits, against the best plan that
    keeps each tie's layers in one stage; the latter wins ties (no copy to keep equal). Where the
    kind cannot keep copies of a replicated holder equal (pipedream), or a replicated holder would
    be sharded (its copy is kept outside FSDP2), a straight plan stands in."""
    kind = schedule_kind(schedule)
    candidates: list[tuple[list[Block], list[tuple[int, int, int]]]] = []
    checks = 0
    merged = _merge_shared(blocks, graph.tied)
    errors = []
    for chain in (merged, blocks):
        try:  # the unmerged chain searched with each later holder's copy in its block's weights
            stages, n = search(chain if chain is merged else _with_copies(chain, graph.tied), straight)
        except PlanError as exc:
            errors.append(exc)
            continue
        checks += n
        split = tied_holders(chain, stages, graph.tied)
        if split and not _fits_with_copies(chain, stages, graph, topo, schedule, microbatches, f, search, sharding):
            errors.append(PlanError(f"no plan fits: the best one that splits the shared parameters "
                                    f"{[t.name for t in graph.tied]} does not fit once their copies are counted"))
            continue
        if split and kind.version_rule is VersionRule.NEWEST:
            continue  # naive keeps no version rule for a copy
        if split and (kind.round_robin or sharding != "replicate") \
                and any(stages[s][2] > 1 for _, holders in split for s in holders):
            if straight:
                continue
            try:
                stages, n = search(_with_copies(chain, graph.tied), True)
            except PlanError:
                continue
            checks += n
        candidates.append((chain, stages))
    if not candidates:
        if errors:  # the one naming the smaller budget that fits (the merged chain's or the split one's)
            raise min(errors, key=lambda e: getattr(e, "smallest_budget", math.inf))
        raise PlanError(f"under {schedule} the shared parameters {[t.name for t in graph.tied]} must stay in one "
                        "stage, and no plan keeps them there with these options; use pipedream, 2bw, flush or gpipe")

    def cost(candidate: tuple[list[Block], list[tuple[int, int, int]]]) -> float:
        chain, stages = candidate
        return evaluate(chain, topo, stages, schedule, microbatches, f, graph.tied, sharding=sharding).minibatch_ms

    best = candidates[0]
    for other in candidates[1:]:
        if cost(other) < cost(best) * (1 - 1e-9):
            best = other
    return best[0], best[1], checks


def _with_copies(blocks: list[Block], tied: Sequence[SharedParameter]) -> list[Block]:
    """The chain with each shared parameter's bytes added to every block that uses it after its
    first use (the profile counts it once, in its first layer): what a holder's copy weighs if
    the stages split the tie, so that the search sees it (a plan that keeps the tie in one stage
    is the merged chain's)."""
    where = {name: k for k, b in enumerate(blocks) for name in b.layers}
    extra = [0] * len(blocks)
    for t in tied:
        users = sorted({where[n] for n in t.layers if n in where})
        for k in users[1:]:
            extra[k] += t.bytes
    return [dataclasses.replace(b, parameter_bytes=b.parameter_bytes + e) if e else b for b, e in zip(blocks, extra)]


def _fits_with_copies(chain: list[Block], stages: list[tuple[int, int, int]], graph: LayerGraph, topo: Topology,
                      schedule: str, microbatches: int, f: float, search: Any, sharding: str) -> bool:
    """Whether every stage of a plan that splits shared parameters fits the search's memory budget
    with the copies it holds counted (the search of a chain does not see the ties: a holder's
    copy can push it over)."""
    options = getattr(search, "keywords", {})  # the search's budget, recomputation and scratch
    memory = options.get("memory")
    if memory is None:
        return True
    ev = evaluate(chain, topo, stages, schedule, microbatches, f, graph.tied, options.get("recompute", False),
                  options.get("scratch", NO_SCRATCH), sharding)
    return max(ev.memory_bytes) <= memory


def _build_plan(graph: LayerGraph, blocks: Sequence[Block], topo: Topology, stages: list[tuple[int, int, int]],
                schedule: str, microbatches: int, f: float, memory: float | None, elapsed: float, checks: int,
                options: dict[str, Any]) -> Plan:
    recompute = bool(options.get("recompute"))
    sharding = options.get("sharding", "replicate")
    ev = evaluate(blocks, topo, stages, schedule, microbatches, f, graph.tied, recompute,
                  scratch_of_options(options), sharding)
    out: list[Stage] = []
    for s, (i, j, m) in enumerate(stages):
        bl = blocks[i:j + 1]
        names = [n for b in bl for n in b.layers]
        out_bytes = blocks[j].cut_bytes if s + 1 < len(stages) else 0
        sync = ev.allreduce_ms[s] if replicas_share_microbatches(schedule) else ev.allreduce_ms[s] / m
        comm = sync + (ev.cut_ms[s] if s < len(ev.cut_ms) else 0.0)
        out.append(Stage(
            layers=names, replicas=m, ranks=ev.ranks[s],
            # Stage.backward_ms leaves out the recomputed forward (Costs.from_plan adds it)
            forward_ms=sum(b.forward_ms for b in bl),
            backward_ms=sum(b.backward_ms - (b.forward_ms if recompute else 0.0) for b in bl), recompute=recompute,
            optimizer_ms=sum(b.optimizer_ms for b in bl), parameter_bytes=sum(b.parameter_bytes for b in bl), output_bytes=int(out_bytes),
            comm_ms=comm, memory_bytes=int(math.ceil(ev.memory_bytes[s])),
            activations=stage_activations(blocks, i, j),
            input_grad_ms=measured_sum(b.input_grad_ms for b in bl),
            weight_grad_ms=measured_sum(b.weight_grad_ms for b in bl),
            sharding=sharding if m > 1 else "replicate",
        ))
    workers = sum(m for _, _, m in stages)
    dp = evaluate(blocks, topo, [(0, len(blocks) - 1, topo.num_workers)], schedule, microbatches, f)
    t_s = ev.minibatch_ms / 1e3
    predicted: dict[str, Any] = {
        "time_per_minibatch_s": t_s,
        "minibatches_per_s": (1.0 / t_s) if t_s > 0 else None,
        "samples_per_s": (graph.batch_size / t_s) if (graph.batch_size and t_s > 0) else None,
        "speedup_over_data_parallel": (dp.minibatch_ms / ev.minibatch_ms) if ev.minibatch_ms > 0 else None,
        "data_parallel_time_per_minibatch_s": dp.minibatch_ms / 1e3,
        "bottleneck_stage": ev.bottleneck_stage,
        "bottleneck": ev.bottleneck,
        "peak_memory_bytes": int(math.ceil(max(ev.memory_bytes))),
    }
    meta = {
        "planner": options,
        "planning_time_s": elapsed,
        "feasibility_checks": checks,
        "graph_source": graph.meta.get("source", ""),
        # the profile traced one microbatch of this many (the runtime traces the same size)
        "profile_microbatches": graph.meta.get("microbatches", 1),
        "model": graph.meta.get("model", graph.meta.get("name", "")),
        "blocks": [[i, j] for i, j, _ in stages],
        "stage_time_ms": ev.stage_ms,
        "cut_time_ms": ev.cut_ms,
        "workers_available": topo.num_workers,
    }
    tied = [TiedParameter(t.name, holders, int(t.bytes), list(t.layers))
            for t, holders in tied_holders(blocks, stages, graph.tied)]
    p = Plan(stages=out, schedule=schedule, batch_size=graph.batch_size, microbatches=microbatches,
             topology=topo.to_spec(), predicted=predicted, meta=meta, tied=tied)
    p.validate(layer_names=graph.names, world_size=workers)
    log.debug("planned %s in %.3f s: %s, %.3f ms per minibatch", graph.meta.get("source", "graph"), elapsed,
             p.summary, ev.minibatch_ms)
    return p
