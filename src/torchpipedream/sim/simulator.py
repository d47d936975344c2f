"""Discrete-event simulation of a schedule: the same action lists the runtime runs, timed.

``simulate(schedule, costs)`` interprets every rank's list in order, like the runtime:

* F, B and U take their compute time and keep the rank busy; where a rank's list has a W for a
  microbatch (a split backward), its B takes ``backward_s − weight_grad_s`` and the W
  ``weight_grad_s`` (and the gradient accumulation below);
* a send (SA, SG) does not block its rank beyond the host's per-message overhead ``o``
  (LogP's o: handing the message to the transport, default 0): the message occupies the
  directed link (sender, receiver) from max(now + o, link free) for
  ``latency + bytes / bandwidth`` (``sim.costs.transfer_s``); a busy link delays the next
  message on it;
* a receive (RA, RG) blocks until the matching message (FIFO per pair) has arrived, then
  takes ``o``;
* AR (and a "zero1" stage's UN and RD, each half of one: an all-gather of its weights, a
  reduce-scatter of its gradient; its RS frees memory and costs nothing) starts when every
  replica of the stage has reached it and costs a ring all-reduce,
  2(r−1)/r · |w| / (e · B) (+ 2(r−1) latencies; e = ``Costs.allreduce_efficiency``;
  ``sim.costs.ring_allreduce_s``), or
  the stage's measured all-reduce time when ``Costs.allreduce_s`` gives one, after which
  all replicas continue;
* a B (or W) that adds its weight gradient into an existing one (every B of a replicated stage,
  whose gradients live in persistent buffers; elsewhere every B of an update but its first:
  ``schedule.versions.accumulating_backwards``, the rule the runtime follows)
  also takes |w| / ``Costs.accumulate_Bps``: the profile times a backward that hands over
  fresh gradient tensors, and on a CPU the add is a pass over the stage's gradients;
* U takes the stage's optimizer step, plus a copy of its weights (|w| / copy bandwidth) when
  the version it replaces is still used by a later F or B of the rank (copy on update:
  weight stashing keeps the old version, as the runtime does; ``schedule.versions.stash_copies``).

It knows nothing about schedule kinds; the schedule is data. Costs default to the plan's
profile (:meth:`Costs.from_plan`); the link bandwidth comes from the plan's topology spec when
there is one. The result is a :class:`SimResult`: the :class:`~torchpipedream.sim.trace.Trace` plus
throughput (whole run and steady state), bubble fraction, utilisation and peak memory per stage.

Example::

    sched = build_schedule(plan, "pipedream", minibatches=64)
    result = simulate(sched)
    print(result.samples_per_s, result.bubble_fraction, result.peak_memory_bytes)
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..plans.kinds import SCHEDULE_KINDS
from ..plans.memory import DEFAULT_OPTIMIZER_STATE_FACTOR, once_bytes, scratch_of_options, sharded_weight_bytes
from ..plans.plan import Plan
from ..plans.topology import Topology
from ..schedule.actions import Action, Kind, Schedule, split_backwards
from ..schedule.validate import schedule_stats, validate_schedule
from ..schedule.versions import accumulating_backwards, by_stage, stash_copies
from .costs import ring_allreduce_s, ring_allreduce_share, sharded_passes, transfer_s
from .trace import COMPUTE_KINDS, Event, Trace, _union_length

# stash_copies, accumulating_backwards (schedule.versions) and DEFAULT_OPTIMIZER_STATE_FACTOR
# (plans.memory) are re-exported: they were defined here before.
__all__ = ["Costs", "SimResult", "simulate", "stash_copies", "accumulating_backwards", "DEFAULT_BANDWIDTH_BPS",
           "WEIGHT_GRAD_SHARE", "split_backward_ms", "DEFAULT_COPY_BPS", "DEFAULT_ACCUMULATE_BPS", "DEFAULT_OPTIMIZER_STATE_FACTOR"]

log = logging.getLogger(__name__)

#: Link bandwidth when the plan names no topology (bytes/s): about one PCIe 3 x16 link.
DEFAULT_BANDWIDTH_BPS = 10e9
#: Memory copy bandwidth for the copy on update of a stashed version (bytes/s): a large
#: one-thread ``Tensor.copy_`` on the project's 2-core development machine moves 12-13 GB/s
#: (40+ GB/s while it fits in cache); pass a measured ``copy_Bps`` for other hardware.
DEFAULT_COPY_BPS = 12e9
#: Gradient bytes added per second when a backward accumulates into an existing gradient
#: (``grad += new``, three passes over the bytes): 5.2-6.2 GB/s for 2-76 MB on one thread of
#: the development machine (``runtime.measure.measure_accumulate_bandwidth``); pass a measured
#: ``accumulate_Bps`` for other hardware.
DEFAULT_ACCUMULATE_BPS = 5e9
#: Share of a stage's backward that its weight-gradient pass (W) takes when the backward is
#: split, for every stage but the first (whose B has no input gradient to compute and costs
#: nothing; its W is the whole backward): the weight GEMM of a linear layer costs what its input
#: GEMM does. An assumption, used only where the profile did not time the split
#: (``Layer.weight_grad_ms``; the profiler times it by default).
WEIGHT_GRAD_SHARE = 0.5


class SimulationError(ValueError):
    """The schedule cannot be simulated (invalid or given bad costs); the message says why."""


@dataclass
class Costs:
    """What the simulator charges, per microbatch of the schedule being simulated.

    Attributes:
        forward_s / backward_s: compute seconds of one microbatch, per stage.
        output_bytes: bytes stage s sends to s+1 per microbatch (the gradient back is the same size).
        parameter_bytes: weights of one replica of each stage (all-reduce size, memory).
        activation_bytes: bytes stashed per in-flight microbatch on each stage (for memory).
        working_bytes: bytes a worker of each stage needs once besides its weights and
            in-flight microbatches (``plans.memory.once_bytes``; for memory).
        step_s: seconds of one optimizer step (U): one number for every stage, or one per stage
            (``from_plan`` takes each stage's measured ``optimizer_ms``).
        bandwidth_Bps: link bandwidth when ``bandwidth_fn`` is None (bytes/s).
        latency_s: per-message latency.
        bandwidth_fn: ``(rank_a, rank_b) -> bytes/s``; e.g. ``Topology.bandwidth``.
        optimizer_state_factor: optimizer state + gradient buffers as multiples of the weights.
        copy_Bps: memory copy bandwidth for the copy on update of a stashed version (bytes/s).
        message_overhead_s: CPU time a send or a receive takes from its rank (LogP's o), on
            top of the link's latency and bandwidth; e.g. ``measure_message_overhead``.
        compute_slowdown: factor on every F, B and U: workers that share a host compute slower
            together than the one process that was profiled (``measure_concurrency_slowdown``;
            1.0 for a device per worker).
        accumulate_Bps: gradient bytes per second a backward adds into an existing gradient
            (``measure_accumulate_bandwidth``), charged at the B actions that accumulate.
        allreduce_efficiency: share of the ring formula's speed an all-reduce reaches
            (``Topology.allreduce_efficiency``; ``from_plan`` takes the plan topology's).
        weight_grad_s: seconds of one microbatch's weight-gradient pass (W) per stage, part of
            ``backward_s`` (a split B takes the rest); ``from_plan``: the first stage's whole
            backward, elsewhere the profiled W (``Stage.weight_grad_ms``, with ``backward_s``
            the profiled B + W), or ``WEIGHT_GRAD_SHARE`` of the backward where not profiled.
        allreduce_s: measured seconds of each stage's all-reduce (``measure_allreduce`` at the
            stage's weight size and replica count), replacing the ring formula; None (or a
            None entry) keeps the formula. Collectives on a CPU cost far more than their bytes
            over the link: gloo on loopback moves 2 MB in ~3 ms, against 1 ms by the formula.
    """

    forward_s: list[float]
    backward_s: list[float]
    output_bytes: list[float] = field(default_factory=list)
    parameter_bytes: list[float] = field(default_factory=list)
    activation_bytes: list[float] = field(default_factory=list)
    working_bytes: list[float] = field(default_factory=list)
    step_s: float | list[float] = 0.0
    bandwidth_Bps: float = DEFAULT_BANDWIDTH_BPS
    latency_s: float = 0.0
    bandwidth_fn: Callable[[int, int], float] | None = None
    optimizer_state_factor: float = DEFAULT_OPTIMIZER_STATE_FACTOR
    copy_Bps: float = DEFAULT_COPY_BPS
    message_overhead_s: float = 0.0
    compute_slowdown: float = 1.0
    accumulate_Bps: float = DEFAULT_ACCUMULATE_BPS
    allreduce_efficiency: float = 1.0
    allreduce_s: list[float | None] | None = None
    weight_grad_s: list[float] | None = None

    @classmethod
    def from_plan(cls, plan: Plan, microbatches: int = 1, **overrides: Any) -> "Costs":
        """Costs from the plan's per-minibatch profile, divided by ``microbatches``.

        Bandwidth and latency come from ``Topology.parse(plan.topology)`` when the plan has a
        topology; keyword ``overrides`` replace any field.
        """
        m = max(1, int(microbatches))
        n = plan.num_stages
        # a recomputing stage runs its forward again at the start of every backward; where the
        # backward is split, at its B and again at its W (the first stage's B computes nothing)
        split = _splits_backward(plan.schedule)
        again = [(2 if split and s > 0 else 1) * st.forward_ms if st.recompute else 0.0 for s, st in enumerate(plan.stages)]
        backward, weight_grad = _split_backward_ms(plan, split)
        kw: dict[str, Any] = dict(
            forward_s=[st.forward_ms / 1e3 / m for st in plan.stages],
            backward_s=[(backward[s] + again[s]) / 1e3 / m for s in range(n)],
            output_bytes=[st.output_bytes / m for st in plan.stages],
            parameter_bytes=[float(st.parameter_bytes) for st in plan.stages],
            activation_bytes=[0.0] + [plan.stages[s - 1].output_bytes / m for s in range(1, n)],
            step_s=[st.optimizer_ms / 1e3 for st in plan.stages],  # once per update, not per microbatch
            weight_grad_s=[(weight_grad[s] + (again[s] / 2 if s > 0 else again[s])) / 1e3 / m for s in range(n)],
        )
        options = plan.meta.get("planner") if isinstance(plan.meta, dict) else None
        if plan.stages and all(st.activations is not None for st in plan.stages):  # the memory model's terms
            kw["activation_bytes"] = [st.activations.held(st.recompute) / m for st in plan.stages]
            scratch = scratch_of_options(options)
            kw["working_bytes"] = [once_bytes(st.activations, m, st.recompute, st.replicas, scratch,
                                              plan.held_parameter_bytes(s)) for s, st in enumerate(plan.stages)]
        if isinstance(options, dict) and isinstance(options.get("optimizer_state_factor"), (int, float)):
            kw["optimizer_state_factor"] = float(options["optimizer_state_factor"])
        if plan.topology:
            topo = Topology.parse(plan.topology)
            if topo.num_workers >= plan.num_workers:
                kw["bandwidth_fn"] = topo.bandwidth
                kw["latency_s"] = topo.latency_s
                kw["allreduce_efficiency"] = topo.allreduce_efficiency
            else:
                log.warning("topology %r has fewer workers than the plan; using %g B/s links",
                            plan.topology, DEFAULT_BANDWIDTH_BPS)
        kw.update(overrides)
        return cls(**kw)

    def bandwidth(self, a: int, b: int) -> float:
        return self.bandwidth_fn(a, b) if self.bandwidth_fn is not None else self.bandwidth_Bps

    def check(self, plan: Plan) -> None:
        n = plan.num_stages
        for name in ("forward_s", "backward_s", "output_bytes", "parameter_bytes", "activation_bytes",
                     "working_bytes"):
            v = getattr(self, name)
            if name in ("forward_s", "backward_s") or v:
                if len(v) != n:
                    raise SimulationError(f"costs.{name} has {len(v)} entries but the plan has {n} stages")
                if any(not isinstance(x, (int, float)) or x != x or x < 0 for x in v):
                    raise SimulationError(f"costs.{name} must be numbers >= 0, got {v}")
        if self.bandwidth_fn is None and not self.bandwidth_Bps > 0:
            raise SimulationError(f"costs.bandwidth_Bps must be > 0, got {self.bandwidth_Bps!r}")
        steps = self.step_s if isinstance(self.step_s, list) else [self.step_s]
        if isinstance(self.step_s, list) and len(steps) != n:
            raise SimulationError(f"costs.step_s has {len(steps)} entries but the plan has {n} stages")
        if self.latency_s < 0 or any(not x >= 0 for x in steps):
            raise SimulationError("costs.latency_s and costs.step_s must be >= 0")
        if not 1.0 <= self.compute_slowdown < math.inf:
            raise SimulationError(f"costs.compute_slowdown must be a finite number >= 1, got {self.compute_slowdown!r}")
        if not self.message_overhead_s >= 0:
            raise SimulationError(f"costs.message_overhead_s must be >= 0, got {self.message_overhead_s!r}")
        if not self.copy_Bps > 0:
            raise SimulationError(f"costs.copy_Bps must be > 0, got {self.copy_Bps!r}")
        if not self.accumulate_Bps > 0:
            raise SimulationError(f"costs.accumulate_Bps must be > 0, got {self.accumulate_Bps!r}")
        if not 0 < self.allreduce_efficiency <= 1:
            raise SimulationError(f"costs.allreduce_efficiency must be in (0, 1], got {self.allreduce_efficiency!r}")
        if self.allreduce_s is not None:
            if len(self.allreduce_s) != n:
                raise SimulationError(f"costs.allreduce_s has {len(self.allreduce_s)} entries but the plan has {n} stages")
            if any(x is not None and not 0 <= x < math.inf for x in self.allreduce_s):
                raise SimulationError(f"costs.allreduce_s must be seconds >= 0 (or None), got {self.allreduce_s}")


@dataclass
class SimResult:
    """A simulated run.

    Attributes:
        trace: every executed action with its simulated start and end.
        makespan_s: first start to last end.
        minibatches_per_s / samples_per_s: over the whole run (samples need plan.batch_size).
        steady_minibatches_per_s / steady_samples_per_s: over the middle half of the minibatch
            completions (warm-up and drain excluded).
        bubble_fraction: idle share of all ranks over the whole run; steady_bubble_fraction over
            the steady window.
        utilisation: per rank, busy share of the makespan.
        max_versions / max_inflight: per stage, peak live weight versions and stashed activations.
        peak_memory_bytes: per stage, weights × versions + optimizer state + stashed activations.
    """

    trace: Trace
    makespan_s: float
    minibatches_per_s: float
    samples_per_s: float | None
    steady_minibatches_per_s: float
    steady_samples_per_s: float | None
    bubble_fraction: float
    steady_bubble_fraction: float
    utilisation: dict[int, float]
    max_versions: list[int]
    max_inflight: list[int]
    peak_memory_bytes: list[float]

    def summary(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "trace"}


_KV = {k: k.value for k in Kind}


def _splits_backward(kind: str) -> bool:
    """Whether the plan's own kind splits the backward (the default costs of a recomputing stage
    count its forward once more then); False for a kind this version does not know."""
    found = SCHEDULE_KINDS.get(kind)
    return bool(found and found.split_backward)


def _text(a: Any) -> str:
    """``str(action)`` without the enum lookups (the simulator formats every action)."""
    t = f"s{a.stage}r{a.replica}{_KV[a.kind]}{a.id}" if a.replica else f"s{a.stage}{_KV[a.kind]}{a.id}"
    if a.version is not None:
        t += f"v{a.version}"
    if a.tie is not None:
        t += f"t{a.tie}"
    if a.peer is not None:
        t += f"@{a.peer}"
    return t


def simulate(schedule: Schedule, costs: Costs | None = None, validate: bool = True) -> SimResult:
    """Run ``schedule`` against ``costs`` (default: :meth:`Costs.from_plan`) and report.

    Args:
        schedule: the schedule (validated first unless ``validate`` is False).
        costs: per-microbatch costs; default from the plan and its topology.
        validate: prove the schedule first (a deadlocking schedule would otherwise be reported
            as stuck ranks).

    Raises:
        ScheduleError: the schedule is invalid (with the marked grid).
        SimulationError: bad costs, or the schedule gets stuck (only when not validated).
    """
    plan = schedule.plan
    if validate:
        validate_schedule(schedule)
    costs = costs or Costs.from_plan(plan, schedule.microbatches)
    costs.check(plan)
    events = _EventLoop(schedule, costs).run()
    trace = Trace(events, meta={
        "source": "simulate",
        "schedule": schedule.kind,
        "plan": plan.summary,
        "config": plan.config,
        "minibatches": schedule.minibatches,
        "microbatches": schedule.microbatches,
        "samples_per_minibatch": plan.batch_size,
        "options": dict(schedule.options or {}),
    })
    return _report(schedule, costs, trace)


@dataclass
class _Charges:
    """Seconds each action costs on each stage, precomputed from :class:`Costs` once per run."""

    forward: list[float]
    backward: list[float]
    weight_grad: list[float]  # the W of a split backward (its B takes backward − weight_grad)
    step: list[float]
    copy: list[float]  # extra on a U that keeps the old version (``stash_copies``)
    add: list[float]  # extra on a B that accumulates into an existing gradient
    output_bytes: list[float]
    allreduce: dict[int, float]  # stage -> seconds of one all-reduce among its replicas
    allreduce_bytes: dict[int, int]  # stage -> bytes each replica moves in it
    tied: dict[int, float] = field(default_factory=dict)  # shared parameter -> seconds of one TR
    tied_bytes: dict[int, int] = field(default_factory=dict)  # shared parameter -> bytes each rank moves
    gather: dict[int, float] = field(default_factory=dict)  # zero1 stage -> seconds of one UN (or RD)
    gather_bytes: dict[int, int] = field(default_factory=dict)  # zero1 stage -> bytes each replica moves in it

    @classmethod
    def of(cls, plan: Plan, costs: Costs) -> "_Charges":
        slow = costs.compute_slowdown
        n = plan.num_stages
        params = costs.parameter_bytes or [0.0] * n
        steps = costs.step_s if isinstance(costs.step_s, list) else [costs.step_s] * n
        allreduce: dict[int, float] = {}
        moved: dict[int, int] = {}
        gather: dict[int, float] = {}
        gathered: dict[int, int] = {}
        forward = [f * slow for f in costs.forward_s]
        backward = [b * slow for b in costs.backward_s]
        for s, st in enumerate(plan.stages):
            r = st.replicas
            if r < 2:
                continue
            measured = costs.allreduce_s[s] if costs.allreduce_s is not None else None
            if st.sharded:  # FSDP2's collectives run inside F and B; AR sums the sample count
                # a gather or a reduce-scatter: half an all-reduce of the stage's weights (measured on the host where given)
                one = (measured if measured is not None else _allreduce_among_s(costs, list(st.ranks), params[s])) / 2
                in_forward, in_backward = sharded_passes(st.sharding)
                forward[s] += in_forward * one
                backward[s] += in_backward * one
                gather[s], gathered[s] = one, int(ring_allreduce_share(r) / 2 * params[s])  # zero1's UN and RD
                allreduce[s], moved[s] = _allreduce_among_s(costs, list(st.ranks), 8.0), 8
                continue
            moved[s] = int(ring_allreduce_share(r) * params[s])
            if measured is not None:
                allreduce[s] = float(measured)
                continue
            allreduce[s] = _allreduce_among_s(costs, list(st.ranks), params[s])
        tied: dict[int, float] = {}
        tied_moved: dict[int, int] = {}
        for k, t in enumerate(plan.tied):
            members = [r for s in t.stages for r in plan.stages[s].ranks]
            tied[k] = _allreduce_among_s(costs, members, t.bytes)
            tied_moved[k] = int(ring_allreduce_share(len(members)) * t.bytes)
        wg = costs.weight_grad_s if costs.weight_grad_s is not None else [WEIGHT_GRAD_SHARE * b for b in costs.backward_s]
        wg = [0.0 if _fsdp_sharded(st) else w for st, w in zip(plan.stages, wg)]  # B runs the whole backward
        return cls(forward=forward, backward=backward,
                   weight_grad=[min(w, b) * slow for w, b in zip(wg, costs.backward_s)],
                   step=[u * slow for u in steps], copy=[b / costs.copy_Bps for b in params],
                   add=[b / costs.accumulate_Bps for b in params], output_bytes=costs.output_bytes or [0.0] * n,
                   allreduce=allreduce, allreduce_bytes=moved, tied=tied, tied_bytes=tied_moved, gather=gather,
                   gather_bytes=gathered)


def _weight_bytes(stage: Any, params: float, versions: int, optimizer_state_factor: float, whole: float) -> float:
    """What one replica of ``stage`` holds of its weights: ``versions`` of them with the optimizer's
    state, or a sharded stage's shard with what it gathers (``plans.memory.sharded_weight_bytes``;
    ``whole``: its shared parameters' bytes, which stay whole)."""
    if stage.sharded and stage.replicas > 1:
        largest = stage.activations.largest_parameter if stage.activations is not None else params
        return sharded_weight_bytes(params, stage.replicas, optimizer_state_factor, stage.sharding, largest, whole)
    return params * (versions + optimizer_state_factor)


def _split_backward_ms(plan: Plan, split: bool) -> tuple[list[float], list[float]]:
    """Each stage's backward and its W part (ms per minibatch): :func:`split_backward_ms` of the
    plan's stages."""
    times = [(st.backward_ms, st.input_grad_ms, st.weight_grad_ms) for st in plan.stages]
    return split_backward_ms(times, [_fsdp_sharded(st) for st in plan.stages], split)


def split_backward_ms(times: Sequence[tuple[float, float | None, float | None]], sharded: Sequence[bool],
                      split: bool = True) -> tuple[list[float], list[float]]:
    """Each stage's backward and its W part (ms), from its (backward, timed B, timed W) in
    pipeline order: the simulator's rule, which the planner's round-trip term shares. Under a
    split backward whose halves the profile timed for every stage after the first, B + W and W
    as timed; otherwise the unsplit backward with ``WEIGHT_GRAD_SHARE`` of it as W. The first
    stage's B has no input to differentiate: its W is one backward over its weights, whose cost
    is the unsplit one. An FSDP2-sharded stage (``sharded[s]``) runs its whole backward in B and
    nothing in W (runtime/sharding.py: FSDP2 reduces the gradients when a whole backward ends)."""
    (first, _, _), rest = times[0], times[1:]
    if split and all(b is not None and w is not None for _, b, w in rest):
        backward = [first] + [b + w for _, b, w in rest]  # type: ignore[operator]
        weight = [first] + [float(w) for _, _, w in rest]  # type: ignore[arg-type]
    else:
        backward = [t for t, _, _ in times]
        weight = [first] + [WEIGHT_GRAD_SHARE * t for t, _, _ in rest]
    for s, (t, _, _) in enumerate(times):
        if sharded[s]:
            backward[s], weight[s] = t, 0.0
    return backward, weight


def _fsdp_sharded(stage: Any) -> bool:
    """Whether FSDP2 shards ``stage`` over its replicas (its whole backward runs in B)."""
    return stage.sharded and stage.replicas > 1


def _allreduce_among_s(costs: Costs, ranks: list[int], nbytes: float) -> float:
    """A ring all-reduce of ``nbytes`` among ``ranks`` at the slowest link between them
    (``costs.ring_allreduce_s`` with the costs' latency and all-reduce efficiency)."""
    slowest = min(costs.bandwidth(a, b) for a in ranks for b in ranks if a != b)
    return ring_allreduce_s(nbytes, len(ranks), slowest, costs.latency_s, costs.allreduce_efficiency)


#: What a handler of :class:`_EventLoop` returns when its rank must wait (a message not yet
#: in, an all-reduce whose replicas have not all arrived): the rank stops at that action.
_BLOCKED = None


class _EventLoop:
    """The state of one simulation and a handler per action kind.

    A handler takes (rank, the action's index in the rank's list, action, the rank's clock),
    emits the action's event and returns the rank's clock after it, or ``_BLOCKED``: sends
    never block (a link carries one message at a time, in order); a receive waits for its
    message's arrival; an all-reduce waits for every replica of its stage, then ends for all
    of them at once; a shared parameter's reduce (TR) waits for every holder's post (TP).
    """

    def __init__(self, schedule: Schedule, costs: Costs) -> None:
        plan = schedule.plan
        self.plan, self.costs = plan, costs
        self.charge = _Charges.of(plan, costs)
        self.actions = schedule.actions
        self.split_at = {r: split_backwards(lst) for r, lst in self.actions.items()}
        self.copy_at = {r: by_stage(lst, lambda sub, s: stash_copies(sub)) for r, lst in self.actions.items()}
        self.adds_at = {r: by_stage(lst, lambda sub, s: accumulating_backwards(sub, plan.stages[s].replicas > 1))
                        for r, lst in self.actions.items()}
        self.clock = {r: 0.0 for r in self.actions}
        self.position = {r: 0 for r in self.actions}
        self.link_free: dict[tuple[int, int], float] = {}  # (sender, receiver) -> when the link is free
        self.arrivals: dict[tuple[int, int], deque[float]] = {}  # (sender, receiver) -> arrival times, FIFO
        self.link_cost: dict[tuple[int, int, int], float] = {}  # (sender, receiver, stage) -> seconds
        self.receiver_waiting: dict[tuple[int, int], int] = {}  # (sender, receiver) -> the blocked receiver
        # (kind, stage, update) of an AR, UN or RD -> the replicas there so far
        self.allreduce_arrivals: dict[tuple[Kind, int, int], list[tuple[int, float, Action]]] = {}
        self.tied_size = {k: sum(plan.stages[s].replicas for s in tie.stages) for k, tie in enumerate(plan.tied)}
        self.tied_posts: dict[tuple[int, int], dict[int, float]] = {}  # (parameter, update) -> rank -> post time
        self.tied_waiting: dict[tuple[int, int], set[int]] = {}  # ranks blocked at a TR until every post is in
        self.events: list[Event] = []
        self.ready = deque(sorted(self.actions))
        self.queued = set(self.ready)
        self.handlers: dict[Kind, Callable[[int, int, Action, float], float | None]] = {
            Kind.FORWARD: self.compute, Kind.BACKWARD: self.compute, Kind.WEIGHT_GRAD: self.compute,
            Kind.SEND_ACT: self.send, Kind.SEND_GRAD: self.send, Kind.RECV_ACT: self.receive,
            Kind.RECV_GRAD: self.receive, Kind.ALLREDUCE: self.allreduce, Kind.TIED_POST: self.tied_post,
            Kind.TIED_REDUCE: self.tied_reduce, Kind.OPTIMIZER_STEP: self.optimizer_step,
            Kind.UNSHARD: self.allreduce, Kind.REDUCE_GRAD: self.allreduce, Kind.RESHARD: self.reshard,
        }
        assert set(self.handlers) == set(Kind), "every action kind needs a handler"

    def run(self) -> list[Event]:
        """Advance any rank that can run until every list is done (or raise: a deadlock)."""
        handlers, ready = self.handlers, self.ready
        while ready:
            rank = ready.popleft()
            self.queued.discard(rank)
            actions = self.actions[rank]
            now, index = self.clock[rank], self.position[rank]
            while index < len(actions):
                a = actions[index]
                after = handlers[a.kind](rank, index, a, now)
                if after is _BLOCKED:
                    break
                now = after
                index += 1
            self.position[rank] = index
            self.clock[rank] = now
        self._check_finished()
        return self.events

    def wake(self, rank: int) -> None:
        if rank not in self.queued:
            self.ready.append(rank)
            self.queued.add(rank)

    def emit(self, rank: int, a: Action, start: float, end: float, nbytes: int = 0,
             version: int | None = None) -> None:
        self.events.append(Event(rank, a.stage, _KV[a.kind], a.id, start, end, nbytes, _text(a), a.replica, version))

    def compute(self, rank: int, index: int, a: Action, now: float) -> float:
        """F, B or W: the stage's compute time (a split B: the backward less its W), plus the
        gradient's accumulation where this B or W adds into an existing gradient."""
        charge, s = self.charge, a.stage
        if a.kind is Kind.FORWARD:
            d = charge.forward[s]
        elif a.kind is Kind.WEIGHT_GRAD:
            d = charge.weight_grad[s] + (charge.add[s] if index in self.adds_at[rank] else 0.0)
        elif (s, a.id) in self.split_at[rank]:
            d = charge.backward[s] - charge.weight_grad[s]
        else:
            d = charge.backward[s] + (charge.add[s] if index in self.adds_at[rank] else 0.0)
        self.emit(rank, a, now, now + d, version=a.version)
        return now + d

    def send(self, rank: int, index: int, a: Action, now: float) -> float:
        """SA or SG: the message occupies the link from max(now + overhead, link free)."""
        s, receiver, overhead = a.stage, a.peer, self.costs.message_overhead_s
        channel = (rank, receiver)
        nbytes = self.charge.output_bytes[s] if a.kind is Kind.SEND_ACT else self.charge.output_bytes[s - 1]
        cost = self.link_cost.get((rank, receiver, s))
        if cost is None:
            if receiver == rank:  # a transfer between two stages of one rank is a hand-over in memory
                cost = 0.0
            else:
                cost = transfer_s(nbytes, self.costs.bandwidth(rank, receiver), self.costs.latency_s)  # type: ignore[arg-type]
            self.link_cost[(rank, receiver, s)] = cost
        if receiver != rank:
            now += overhead
        start = self.link_free.get(channel, 0.0)
        if start < now:
            start = now
        end = start + cost
        self.link_free[channel] = end
        self.arrivals.setdefault(channel, deque()).append(end)  # type: ignore[arg-type]
        self.emit(rank, a, start - overhead, end, int(nbytes))
        blocked = self.receiver_waiting.pop(channel, None)  # type: ignore[arg-type]
        if blocked is not None:
            self.wake(blocked)
        return now

    def receive(self, rank: int, index: int, a: Action, now: float) -> float | None:
        """RA or RG: wait for the message's arrival, then the host's overhead."""
        channel = (a.peer, rank)
        arrived = self.arrivals.get(channel)  # type: ignore[arg-type]
        if not arrived:
            self.receiver_waiting[channel] = rank  # type: ignore[index]
            return _BLOCKED
        arrival = arrived.popleft()
        start = now
        if arrival > now:
            now = arrival
        if a.peer != rank:
            now += self.costs.message_overhead_s
        self.emit(rank, a, start, now)
        return now

    def allreduce(self, rank: int, index: int, a: Action, now: float) -> float | None:
        """AR (or a zero1 stage's UN or RD: an all-gather, a reduce-scatter): once every replica
        of the stage has arrived, the collective runs from the latest arrival and ends for all
        of them at once."""
        s = a.stage
        arrived = self.allreduce_arrivals.setdefault((a.kind, s, a.id), [])
        if all(other != rank for other, _, _ in arrived):
            arrived.append((rank, now, a))
        if len(arrived) < self.plan.stages[s].replicas:
            return _BLOCKED
        if a.kind is Kind.ALLREDUCE:
            seconds, nbytes = self.charge.allreduce.get(s, 0.0), self.charge.allreduce_bytes.get(s, 0)
        else:
            seconds, nbytes = self.charge.gather.get(s, 0.0), self.charge.gather_bytes.get(s, 0)
        end = max(0.0, *(at for _, at, _ in arrived)) + seconds
        for other, arrived_at, act in arrived:
            self.emit(other, act, arrived_at, end, nbytes)
            if other != rank:  # the others were parked at this AR: it is done for them too
                self.clock[other] = end
                self.position[other] += 1
                self.wake(other)
        return end

    def tied_post(self, rank: int, index: int, a: Action, now: float) -> float:
        """TP: a non-blocking all-reduce of a shared parameter's gradient, posted."""
        key = (a.tie, a.id)
        posts = self.tied_posts.setdefault(key, {})  # type: ignore[arg-type]
        posts[rank] = now
        self.emit(rank, a, now, now)
        if len(posts) == self.tied_size[a.tie]:  # type: ignore[index]
            for other in self.tied_waiting.pop(key, ()):  # type: ignore[arg-type]
                self.wake(other)
        return now

    def tied_reduce(self, rank: int, index: int, a: Action, now: float) -> float | None:
        """TR: wait for every holder's post, then the all-reduce's time, then step."""
        key = (a.tie, a.id)
        posts = self.tied_posts.get(key, {})  # type: ignore[arg-type]
        if len(posts) < self.tied_size[a.tie]:  # type: ignore[index]
            self.tied_waiting.setdefault(key, set()).add(rank)  # type: ignore[arg-type]
            return _BLOCKED
        end = max(now, max(posts.values()) + self.charge.tied[a.tie])  # type: ignore[index]
        self.emit(rank, a, now, end, self.charge.tied_bytes[a.tie], a.version)  # type: ignore[index]
        return end

    def reshard(self, rank: int, index: int, a: Action, now: float) -> float:
        """RS: a zero1 stage frees its gathered weights (no communication, no time)."""
        self.emit(rank, a, now, now)
        return now

    def optimizer_step(self, rank: int, index: int, a: Action, now: float) -> float:
        """U: the stage's step, plus a copy of its weights where the replaced version is still used."""
        s = a.stage
        d = self.charge.step[s] + (self.charge.copy[s] if index in self.copy_at[rank] else 0.0)
        self.emit(rank, a, now, now + d, version=a.version)
        return now + d

    def _check_finished(self) -> None:
        stuck = [r for r in self.actions if self.position[r] < len(self.actions[r])]
        if stuck:
            raise SimulationError(
                "the schedule got stuck (deadlock): "
                + "; ".join(f"rank {r} at {self.actions[r][self.position[r]]}" for r in stuck[:8])
                + " — run validate_schedule for the grid"
            )


def _report(schedule: Schedule, costs: Costs, trace: Trace) -> SimResult:
    plan = schedule.plan
    m = schedule.microbatches
    t_lo = min((e.start_s for e in trace.events), default=0.0)
    t_hi = max((e.end_s for e in trace.events), default=0.0)
    span = t_hi - t_lo
    nmb = schedule.minibatches
    bs = plan.batch_size
    # completion of minibatch t: the end of the last backward (or W) of its microbatches on stage 0
    done: dict[int, float] = {}
    for e in trace.events:
        if (e.kind == "B" or e.kind == "W") and e.stage == 0:
            t = e.id // m
            if e.end_s > done.get(t, -1.0):
                done[t] = e.end_s
    comp = sorted(done.values())
    mb_per_s = nmb / span if span > 0 else 0.0
    steady = mb_per_s
    window = (t_lo, t_hi)
    if len(comp) >= 4:
        # Measure between equivalent points of the periodic steady state: whole periods of
        # lcm(replica counts) minibatches (replicas complete their rounds in bursts).
        period = math.lcm(*(st.replicas for st in plan.stages))
        k1 = len(comp) // 4
        k2 = k1 + period * ((len(comp) - 1 - len(comp) // 4 - k1) // period)
        if k2 > k1 and comp[k2] > comp[k1]:
            steady = (k2 - k1) / (comp[k2] - comp[k1])
            window = (comp[k1], comp[k2])
    stats = schedule_stats(schedule)
    busy = trace.busy_time()
    n = plan.num_stages
    max_v = [max(stats.by_stage.get((r, s), (0, 0))[0] for r in st.ranks) for s, st in enumerate(plan.stages)]
    max_a = [max(stats.by_stage.get((r, s), (0, 0))[1] for r in st.ranks) for s, st in enumerate(plan.stages)]
    params = costs.parameter_bytes or [0.0] * n
    acts = costs.activation_bytes or [0.0] * n
    once = costs.working_bytes or [0.0] * n
    mem = [_weight_bytes(plan.stages[s], params[s], max_v[s], costs.optimizer_state_factor, plan.whole_shared_bytes(s))
           + acts[s] * max_a[s]
           + once[s] for s in range(n)]
    return SimResult(
        trace=trace,
        makespan_s=span,
        minibatches_per_s=mb_per_s,
        samples_per_s=mb_per_s * bs if bs else None,
        steady_minibatches_per_s=steady,
        steady_samples_per_s=steady * bs if bs else None,
        bubble_fraction=1.0 - sum(busy.values()) / (len(busy) * span) if span > 0 and busy else 0.0,
        steady_bubble_fraction=_window_bubble(trace, *window),
        utilisation={r: (b / span if span > 0 else 0.0) for r, b in busy.items()},
        max_versions=max_v,
        max_inflight=max_a,
        peak_memory_bytes=mem,
    )


def _window_bubble(trace: Trace, lo: float, hi: float) -> float:
    """Idle share of all ranks inside [lo, hi]."""
    if hi <= lo:
        return 0.0
    per_rank: dict[int, list[tuple[float, float]]] = {}
    for e in trace.events:
        if e.rank not in per_rank:
            per_rank[e.rank] = []
        if e.end_s > lo and e.start_s < hi and e.kind in COMPUTE_KINDS:
            per_rank[e.rank].append((e.start_s if e.start_s > lo else lo, e.end_s if e.end_s < hi else hi))
    busy = sum(_union_length(iv) for iv in per_rank.values())
    return 1.0 - busy / (len(per_rank) * (hi - lo))
