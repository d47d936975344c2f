"""Discrete-event simulation of a schedule: the same action lists the runtime runs, timed.

``simulate(schedule, costs)`` interprets every rank's list in order, like the runtime:

* F, B and U take their compute time and keep the rank busy; where a rank's list has a W for a
  microbatch (a split backward), its B takes ``backward_s − weight_grad_s`` and the W
  ``weight_grad_s`` (and the gradient accumulation below);
* a send (SA, SG) does not block its rank beyond the host's per-message overhead ``o``
  (LogP's o: handing the message to the transport, default 0): the message occupies the
  directed link (sender, receiver) from max(now + o, link free) for
  ``latency + bytes / bandwidth``; a busy link delays the next message on it;
* a receive (RA, RG) blocks until the matching message (FIFO per pair) has arrived, then
  takes ``o``;
* AR starts when every replica of the stage has reached it and costs a ring all-reduce,
  2(r−1)/r · |w| / (e · B) (+ 2(r−1) latencies; e = ``Costs.allreduce_efficiency``), or
  the stage's measured all-reduce time when ``Costs.allreduce_s`` gives one, after which
  all replicas continue;
* a B (or W) that adds its weight gradient into an existing one (every B of a replicated stage,
  whose gradients live in persistent buffers; elsewhere every B of an update but its first)
  also takes |w| / ``Costs.accumulate_Bps``: the profile times a backward that hands over
  fresh gradient tensors, and on a CPU the add is a pass over the stage's gradients;
* U takes the stage's optimizer step, plus a copy of its weights (|w| / copy bandwidth) when
  the version it replaces is still used by a later F or B of the rank (copy on update:
  weight stashing keeps the old version, as the runtime does).

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
from typing import Any, Callable

from ..schedule.actions import Action, Kind, Schedule, split_backwards
from ..plans.kinds import SCHEDULE_KINDS
from ..plans.memory import once_bytes, scratch_of_options
from ..plans.plan import Plan
from .trace import COMPUTE_KINDS, Event, Trace, _union_length
from ..schedule.validate import schedule_stats, validate_schedule

__all__ = ["Costs", "SimResult", "simulate", "stash_copies", "accumulating_backwards", "DEFAULT_BANDWIDTH_BPS",
           "WEIGHT_GRAD_SHARE",
           "DEFAULT_COPY_BPS", "DEFAULT_ACCUMULATE_BPS",
           "DEFAULT_OPTIMIZER_STATE_FACTOR"]

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
#: Optimizer state (+ gradient buffer) per worker in multiples of the stage's weights; the
#: planner's default (momentum buffer + gradient), so simulated and planned memory agree.
DEFAULT_OPTIMIZER_STATE_FACTOR = 2.0


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
            in-flight microbatches (``memory_model.once_bytes``; for memory).
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
            try:
                from ..plans.topology import Topology

                topo = Topology.parse(plan.topology)
                if topo.num_workers >= plan.num_workers:
                    kw["bandwidth_fn"] = topo.bandwidth
                    kw["latency_s"] = topo.latency_s
                    kw["allreduce_efficiency"] = topo.allreduce_efficiency
                else:
                    log.warning("topology %r has fewer workers than the plan; using %g B/s links",
                                plan.topology, DEFAULT_BANDWIDTH_BPS)
            except ImportError:  # pragma: no cover - topology.py ships with the package
                pass
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


def _transfer_s(nbytes: float, bw: float, latency: float) -> float:
    return latency + (nbytes / bw if bw != float("inf") else 0.0)


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
    events = _run(schedule, costs)
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


def stash_copies(actions: list[Action]) -> set[int]:
    """Positions of the U actions in one rank's list that copy the weights.

    The weights before the k-th U of a schedule are version k (versions count updates from
    the schedule's start); the U must keep that version for later if an F or B after it
    names it, so the runtime copies the weights before updating them in place.
    """
    copies: set[int] = set()
    used_later: set[int] = set()
    k = sum(1 for a in actions if a.kind is Kind.OPTIMIZER_STEP)
    for p in range(len(actions) - 1, -1, -1):
        a = actions[p]
        if a.kind is Kind.OPTIMIZER_STEP:
            k -= 1
            if k in used_later:
                copies.add(p)
        elif a.version is not None and a.kind.is_compute:
            used_later.add(a.version)
    return copies


def accumulating_backwards(actions: list[Action], replicated: bool) -> set[int]:
    """Positions of the B actions (the W actions, where a backward is split) in one rank's list
    that add their weight gradient into an existing one, as the runtime's WeightVersions makes
    them: on a replicated stage every one (its gradients live in persistent all-reduce
    buffers), elsewhere every one after the first since the last U (the first hands over fresh
    gradient tensors, as the profile times it)."""
    out: set[int] = set()
    first = True
    split = split_backwards(actions)
    for p, a in enumerate(actions):
        if a.kind is Kind.WEIGHT_GRAD or (a.kind is Kind.BACKWARD and (a.stage, a.id) not in split):
            if replicated or not first:
                out.add(p)
            first = False
        elif a.kind is Kind.OPTIMIZER_STEP:
            first = True
    return out


def _by_stage(actions: list[Action], positions: Any) -> set[int]:
    """``positions(sub, stage)`` (positions in ``sub``) for each stage's own actions of one
    rank's list, as positions in the whole list (a rank holding several stages keeps
    versions and gradients per stage)."""
    stages = {a.stage for a in actions}
    if len(stages) <= 1:
        return positions(actions, next(iter(stages), 0))
    out: set[int] = set()
    for s in stages:
        at = [p for p, a in enumerate(actions) if a.stage == s]
        out |= {at[i] for i in positions([actions[p] for p in at], s)}
    return out


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

    @classmethod
    def of(cls, plan: Plan, costs: Costs) -> "_Charges":
        slow = costs.compute_slowdown
        n = plan.num_stages
        params = costs.parameter_bytes or [0.0] * n
        steps = costs.step_s if isinstance(costs.step_s, list) else [costs.step_s] * n
        allreduce: dict[int, float] = {}
        moved: dict[int, int] = {}
        for s, st in enumerate(plan.stages):
            r = st.replicas
            if r < 2:
                continue
            moved[s] = int(2 * (r - 1) / r * params[s])
            measured = costs.allreduce_s[s] if costs.allreduce_s is not None else None
            if measured is not None:
                allreduce[s] = float(measured)
                continue
            allreduce[s] = _ring_allreduce_s(costs, list(st.ranks), params[s])
        tied: dict[int, float] = {}
        tied_moved: dict[int, int] = {}
        for k, t in enumerate(plan.tied):
            members = [r for s in t.stages for r in plan.stages[s].ranks]
            tied[k] = _ring_allreduce_s(costs, members, t.bytes)
            tied_moved[k] = int(2 * (len(members) - 1) / len(members) * t.bytes)
        wg = costs.weight_grad_s if costs.weight_grad_s is not None else [WEIGHT_GRAD_SHARE * b for b in costs.backward_s]
        return cls(forward=[f * slow for f in costs.forward_s], backward=[b * slow for b in costs.backward_s],
                   weight_grad=[min(w, b) * slow for w, b in zip(wg, costs.backward_s)],
                   step=[u * slow for u in steps], copy=[b / costs.copy_Bps for b in params],
                   add=[b / costs.accumulate_Bps for b in params], output_bytes=costs.output_bytes or [0.0] * n,
                   allreduce=allreduce, allreduce_bytes=moved, tied=tied, tied_bytes=tied_moved)


def _split_backward_ms(plan: Plan, split: bool) -> tuple[list[float], list[float]]:
    """Each stage's backward and its W part (ms per minibatch). Under a split backward whose
    halves the profile timed (``Stage.input_grad_ms`` / ``weight_grad_ms``), B + W and W as
    timed; otherwise the unsplit backward with ``WEIGHT_GRAD_SHARE`` of it as W. The first
    stage's B has no input to differentiate: its W is one backward over its weights, whose
    cost is the unsplit one."""
    first, rest = plan.stages[0], plan.stages[1:]
    timed = [(st.input_grad_ms, st.weight_grad_ms) for st in rest]
    if split and all(b is not None and w is not None for b, w in timed):
        return ([first.backward_ms] + [b + w for b, w in timed],  # type: ignore[operator]
                [first.backward_ms] + [float(w) for _, w in timed])  # type: ignore[arg-type]
    return ([st.backward_ms for st in plan.stages],
            [first.backward_ms] + [WEIGHT_GRAD_SHARE * st.backward_ms for st in rest])


def _ring_allreduce_s(costs: Costs, ranks: list[int], nbytes: float) -> float:
    """A ring all-reduce of ``nbytes`` among ``ranks`` at the slowest link between them, at the
    topology's all-reduce efficiency: 2(m−1) latencies + 2(m−1)/m · bytes / bandwidth."""
    m = len(ranks)
    bw = min(costs.bandwidth(a, b) for a in ranks for b in ranks if a != b) * costs.allreduce_efficiency
    return 2 * (m - 1) * costs.latency_s + (2 * (m - 1) / m * nbytes / bw if bw != float("inf") else 0.0)


def _run(schedule: Schedule, costs: Costs) -> list[Event]:
    """The event loop: advance any rank that can run until all lists are done.

    Sends never block (a link carries one message at a time, in order); a receive waits for
    its message's arrival; an all-reduce waits for every replica of its stage, then ends for
    all of them at once.
    """
    plan = schedule.plan
    charge = _Charges.of(plan, costs)
    fwd, bwd, step_s, copy_s, add_s, outb = (charge.forward, charge.backward, charge.step, charge.copy, charge.add,
                                             charge.output_bytes)
    lat, ovh = costs.latency_s, costs.message_overhead_s
    F, B, SA, RA, SG, RG, AR, TP, TR = (Kind.FORWARD, Kind.BACKWARD, Kind.SEND_ACT, Kind.RECV_ACT, Kind.SEND_GRAD,
                                        Kind.RECV_GRAD, Kind.ALLREDUCE, Kind.TIED_POST, Kind.TIED_REDUCE)
    W, wgrad = Kind.WEIGHT_GRAD, charge.weight_grad
    split_at = {r: split_backwards(lst) for r, lst in schedule.actions.items()}
    tied_size = {k: sum(plan.stages[s].replicas for s in t.stages) for k, t in enumerate(plan.tied)}
    tied_posts: dict[tuple[int, int], dict[int, float]] = {}  # (parameter, update) -> rank -> post time
    tied_waiting: dict[tuple[int, int], set[int]] = {}  # ranks blocked at a TR until every post is in
    acts = schedule.actions
    copy_at = {r: _by_stage(lst, lambda sub, s: stash_copies(sub)) for r, lst in acts.items()}
    adds_at = {r: _by_stage(lst, lambda sub, s: accumulating_backwards(sub, plan.stages[s].replicas > 1))
               for r, lst in acts.items()}
    clock = {r: 0.0 for r in acts}
    pc = {r: 0 for r in acts}
    link_free: dict[tuple[int, int], float] = {}
    arrivals: dict[tuple[int, int], deque[float]] = {}
    link_cost: dict[tuple[int, int, int], float] = {}
    waiting: dict[tuple[int, int], int] = {}
    ar_state: dict[tuple[int, int], list[Any]] = {}
    events: list[Event] = []
    emit = events.append
    Ev, text, KV = Event, _text, _KV  # local names: this loop runs once per action
    ready = deque(sorted(acts))
    queued = set(ready)

    def wake(rank: int) -> None:
        if rank not in queued:
            ready.append(rank)
            queued.add(rank)

    while ready:
        r = ready.popleft()
        queued.discard(r)
        lst = acts[r]
        t = clock[r]
        p = pc[r]
        n_acts = len(lst)
        while p < n_acts:
            a = lst[p]
            k, s, q = a.kind, a.stage, a.replica
            if k is F or k is B or k is W:
                if k is F:
                    d = fwd[s]
                elif k is W:
                    d = wgrad[s] + (add_s[s] if p in adds_at[r] else 0.0)
                elif (s, a.id) in split_at[r]:
                    d = bwd[s] - wgrad[s]
                else:
                    d = bwd[s] + (add_s[s] if p in adds_at[r] else 0.0)
                emit(Ev(r, s, KV[k], a.id, t, t + d, 0, text(a), q, a.version))
                t += d
            elif k is SA or k is SG:
                dst = a.peer
                ch = (r, dst)
                key = (r, dst, s)
                c = link_cost.get(key)
                nbytes = outb[s] if k is SA else outb[s - 1]
                if c is None:  # a transfer between two stages of one rank is a hand-over in memory
                    c = 0.0 if dst == r else _transfer_s(nbytes, costs.bandwidth(r, dst), lat)  # type: ignore[arg-type]
                    link_cost[key] = c
                if dst != r:
                    t += ovh
                start = link_free.get(ch, 0.0)
                if start < t:
                    start = t
                end = start + c
                link_free[ch] = end
                arrivals.setdefault(ch, deque()).append(end)
                emit(Ev(r, s, KV[k], a.id, start - ovh, end, int(nbytes), text(a), q, None))
                w = waiting.pop(ch, None)
                if w is not None:
                    wake(w)
            elif k is RA or k is RG:
                ch = (a.peer, r)  # type: ignore[assignment]
                qd = arrivals.get(ch)
                if not qd:
                    waiting[ch] = r
                    break
                arr = qd.popleft()
                start = t
                if arr > t:
                    t = arr
                if a.peer != r:
                    t += ovh
                emit(Ev(r, s, KV[k], a.id, start, t, 0, text(a), q, None))
            elif k is AR:
                group = ar_state.setdefault((s, a.id), [set(), 0.0, []])  # arrived, latest arrival, who
                if r not in group[0]:
                    group[0].add(r)
                    group[1] = max(group[1], t)
                    group[2].append((r, t, a))
                if len(group[0]) < plan.stages[s].replicas:
                    break
                end = group[1] + charge.allreduce.get(s, 0.0)
                for o, arrived_at, act in group[2]:
                    emit(Ev(o, s, "AR", act.id, arrived_at, end, charge.allreduce_bytes.get(s, 0), text(act),
                            act.replica, None))
                    if o != r:  # the others were parked at this AR: it is done for them too
                        clock[o] = end
                        pc[o] += 1
                        wake(o)
                t = end
            elif k is TP:  # a non-blocking all-reduce of a shared parameter's gradient: posted
                key = (a.tie, a.id)
                posts = tied_posts.setdefault(key, {})
                posts[r] = t
                emit(Ev(r, s, "TP", a.id, t, t, 0, text(a), q, None))
                if len(posts) == tied_size[a.tie]:
                    for o in tied_waiting.pop(key, ()):
                        wake(o)
            elif k is TR:  # wait for every holder's post, then the all-reduce's time, then step
                key = (a.tie, a.id)
                posts = tied_posts.get(key, {})
                if len(posts) < tied_size[a.tie]:
                    tied_waiting.setdefault(key, set()).add(r)
                    break
                start = t
                t = max(t, max(posts.values()) + charge.tied[a.tie])
                emit(Ev(r, s, "TR", a.id, start, t, charge.tied_bytes[a.tie], text(a), q, a.version))
            else:  # U
                d = step_s[s] + (copy_s[s] if p in copy_at[r] else 0.0)
                emit(Ev(r, s, "U", a.id, t, t + d, 0, text(a), q, a.version))
                t += d
            p += 1
        pc[r] = p
        clock[r] = t
    stuck = [r for r in acts if pc[r] < len(acts[r])]
    if stuck:
        raise SimulationError(
            "the schedule got stuck (deadlock): "
            + "; ".join(f"rank {r} at {acts[r][pc[r]]}" for r in stuck[:8])
            + " — run validate_schedule for the grid"
        )
    return events


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
    mem = [params[s] * (max_v[s] + costs.optimizer_state_factor) + acts[s] * max_a[s] + once[s] for s in range(n)]
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
