"""``schedule="auto"``: choose the schedule kind and microbatch count with the planner and the simulator.

For every candidate (kind × microbatches per minibatch) the planner finds its best stages,
replication and ranks under the memory budget; the simulator then runs the candidate's
schedule over ``minibatches`` minibatches with the plan's costs, and the fastest predicted
time per minibatch wins (ties: less predicted memory, fewer microbatches, then the order of
``kinds``). Synchronous
kinds (plain training: flush, gpipe) by default; ``allow_stale`` adds the asynchronous ones
(pipedream, 2bw), whose updates use stale weights. A candidate that fits nowhere is kept with
the planner's reason. The chosen plan records every candidate in ``plan.meta["auto"]`` and the
report prints the choice and the runner-up.

The profile a candidate is planned from may depend on its microbatch count (a schedule of m
microbatches runs the layers on batch/m samples, often less efficiently): ``graph_for(m)``
gives it; a single graph is scaled by 1/m as ``Costs.from_plan`` does.

Activation recomputation is searched where memory is bounded: with a memory budget (the
``memory_bytes`` option or the topology's) every candidate is also planned with
``recompute=True``, which the memory model (plans/memory.py) prices as keeping each stage's
inputs and outputs only, at the cost of a second forward in every backward; then only the
stages that do not fit without it keep it (:func:`recompute_where_needed`). Without a budget
recomputation only costs time and is not tried (``recompute=True`` asks for it on every
candidate). With a budget, the fastest plan without it is recorded too
(``meta["auto"]["without_budget"]``): what the budget gave up.
"""

from __future__ import annotations

import copy
import itertools
import math
import logging
from dataclasses import asdict, dataclass
from typing import Any, Callable, Sequence

from ..model.graph import LayerGraph
from ..plans.kinds import AUTO, SCHEDULE_KINDS, ScheduleKind, schedule_kind
from ..plans.plan import Plan, PlanError
from ..plans.topology import Topology
from ..schedule.build import build_schedule
from ..sim.simulator import Costs, simulate
from ..util.units import human_bytes
from .planner import plan as plan_one_kind

__all__ = ["AUTO", "Candidate", "plan", "plan_tensor_degrees", "tensor_degrees", "choose_schedule", "choose_layout", "local_layouts", "threads_per_worker", "candidate_kinds", "split_profiled", "recompute_where_needed", "shard_where_needed", "auto_summary", "auto_summary_lines", "auto_candidates_table"]

log = logging.getLogger(__name__)

#: Microbatch counts tried for the microbatched kinds (those above the batch size are skipped).
DEFAULT_MICROBATCHES = (1, 2, 4, 8)


@dataclass
class Candidate:
    """One configuration tried: its prediction, or why it could not be planned."""

    schedule: str
    microbatches: int
    recompute: bool = False
    config: str = ""
    time_per_minibatch_s: float | None = None
    peak_memory_bytes: int | None = None
    error: str = ""
    threads: int = 1  # torch threads per worker (choose_layout)
    recompute_stages: list[int] | None = None  # the stages that recompute, where only some do
    sharding: str = "replicate"  # what its replicated stages do with their weights (Stage.sharding; "+" between several)
    tensor_parallel: int = 1  # processes per worker splitting its layers (Plan.tensor_parallel)

    @property
    def recomputed(self) -> str:
        """"yes" (every stage recomputes), "no", or the stages that do."""
        if self.recompute_stages is not None:
            return "stages " + ", ".join(map(str, self.recompute_stages))
        return "yes" if self.recompute else "no"

    @property
    def label(self) -> str:
        text = self.schedule if self.microbatches == 1 else f"{self.schedule}, {self.microbatches} microbatches"
        again = {"yes": ", recompute", "no": ""}.get(self.recomputed, f", recompute {self.recomputed}")
        shard = f", sharded {self.sharding}" if self.sharding != "replicate" else ""
        tensor = f", tensor parallel ×{self.tensor_parallel}" if self.tensor_parallel != 1 else ""
        return text + again + shard + tensor + (f", {self.threads} threads per worker" if self.threads != 1 else "")


def plan(graph: LayerGraph, topology: Topology | str, *, schedule: str = "pipedream", allow_stale: bool = False,
         **options: Any) -> Plan:
    """:func:`torchpipedream.search.planner.plan`, where ``schedule="auto"`` also chooses the kind and
    the microbatch count (:func:`choose_schedule`; ``options["microbatches"]`` is then not used).
    This is ``torchpipedream.plan``."""
    if schedule == AUTO:
        options.pop("microbatches", None)
        return choose_schedule(graph, topology, allow_stale=allow_stale, **options)
    if allow_stale:
        raise PlanError(f"allow_stale lets schedule='auto' choose an asynchronous kind; schedule={schedule!r} "
                        "is already chosen")
    if options.get("tensor_parallel") == AUTO:
        return plan_tensor_degrees(graph, topology, schedule=schedule, **options)
    return plan_one_kind(graph, topology, schedule=schedule, **options)


def tensor_degrees(topology: Topology, kind: ScheduleKind) -> list[int]:
    """The tensor-parallel degrees ``tensor_parallel="auto"`` tries for ``kind`` on
    ``topology``: 1, and where the kind runs tensor parallelism (the synchronous kinds) every
    power of two that makes whole workers of the innermost level's processes (a worker never
    spans the innermost link: Megatron keeps tensor parallelism inside a server)."""
    if kind.asynchronous:
        return [1]
    inner = topology.levels[0].count
    return [t for t in (2 ** i for i in range(inner.bit_length())) if inner % t == 0]


def plan_tensor_degrees(graph: LayerGraph, topology: Topology | str, *, schedule: str, **options: Any) -> Plan:
    """:func:`~torchpipedream.search.planner.plan` of ``schedule`` at every degree of
    :func:`tensor_degrees`; the plan the planner predicts fastest (ties: the smaller degree).
    ``plan.meta["tensor_parallel_search"]`` lists each degree's prediction or why it could not
    be planned."""
    topo = Topology.from_any(topology)
    options.pop("tensor_parallel", None)
    tried: list[dict[str, Any]] = []
    best: Plan | None = None
    for t in tensor_degrees(topo, schedule_kind(schedule)):
        try:
            made = plan_one_kind(graph, topo, schedule=schedule, tensor_parallel=t, **options)
        except PlanError as exc:
            tried.append({"tensor_parallel": t, "error": str(exc)})
            continue
        took = made.predicted["time_per_minibatch_s"]
        tried.append({"tensor_parallel": t, "time_per_minibatch_s": took, "config": made.config})
        if best is None or took < best.predicted["time_per_minibatch_s"]:
            best = made
    if best is None:
        raise PlanError("tensor_parallel auto: no degree can be planned: "
                        + "; ".join(f"{x['tensor_parallel']}: {x['error']}" for x in tried))
    best.meta["tensor_parallel_search"] = tried
    log.info("tensor_parallel auto: degree %d of %s", best.tensor_parallel, [x["tensor_parallel"] for x in tried])
    return best


def candidate_kinds(allow_stale: bool, split_profiled: bool = True, virtual_stages: bool = True) -> list[str]:
    """Kinds with true gradients: the synchronous ones, and with ``allow_stale`` the asynchronous;
    the virtual-stage kinds (interleaved, zb-v) unless ``virtual_stages`` is False.

    The split-backward kinds (zb-h1, zb-h2, zb-v, zb-2bw) only where the profile timed each
    layer's split backward (``split_profiled``; ``profile(split_backward=True)``, the default):
    otherwise their prediction would rest on an assumed share of the backward for the
    weight-gradient pass (``simulator.WEIGHT_GRAD_SHARE``), and splitting costs more than one
    backward on small layers. ``choose_schedule(kinds=[...])`` takes them when asked."""
    return [k.name for k in SCHEDULE_KINDS.values()
            if k.true_gradients and (allow_stale or not k.asynchronous) and (split_profiled or not k.split_backward)
            and (virtual_stages or not k.virtual_stages)]


def split_profiled(graph: LayerGraph) -> bool:
    """Whether every layer of ``graph`` with a backward has its split backward timed."""
    return all(l.input_grad_ms is not None and l.weight_grad_ms is not None
               for l in graph.layers if not l.is_input)


def choose_schedule(
    graph_for: Callable[[int], LayerGraph] | LayerGraph,
    topology: Topology | str,
    *,
    allow_stale: bool = False,
    kinds: Sequence[str] | None = None,
    microbatches: Sequence[int] = DEFAULT_MICROBATCHES,
    batch_size: int | None = None,
    minibatches: int = 32,
    progress: Callable[[Candidate, Plan | None], None] | None = None,
    host_costs: Callable[[Plan, int], dict[str, Any]] | None = None,
    threads: int = 1,
    virtual_stages: bool = True,
    **plan_options: Any,
) -> Plan:
    """The fastest predicted plan over schedule kinds and microbatch counts.

    Args:
        graph_for: the profile to plan a candidate of ``m`` microbatches from (``graph_for(m)``),
            or one graph for all.
        topology: as for :func:`~torchpipedream.search.planner.plan`.
        allow_stale: also try pipedream and 2bw (asynchronous: stale but true gradients).
        kinds: the kinds to try (default: :func:`candidate_kinds`); naive is never chosen.
        microbatches: counts tried for microbatched kinds; counts above ``batch_size`` are skipped.
        batch_size: samples per minibatch (default: the graph's).
        minibatches: the schedule length the simulator compares (fill and drain amortised over it).
        progress: called with each candidate as it is decided, and its plan (None if none fits).
        host_costs: ``host_costs(plan, microbatches)`` -> overrides for ``Costs.from_plan``
            (``runtime.measure.measure_local_costs`` on local CPU workers, whose messages and
            all-reduces the link model prices too cheaply); default: the plan's link model.
        threads: the torch threads per worker the profiles were taken with (recorded on every
            candidate; :func:`choose_layout` compares several).
        virtual_stages: with the default kinds, also try interleaved and zb-v (several stages
            per worker).
        plan_options: passed to the planner (straight, num_stages, memory_bytes, ...).

    Raises:
        PlanError: no candidate can be planned (the message lists each one's reason).
    """
    graph = _graph_per_count(graph_for)
    names = list(kinds) if kinds is not None else candidate_kinds(allow_stale, split_profiled(graph(1)),
                                                                  virtual_stages)
    counts = _checked_request(names, plan_options, minibatches, microbatches)
    topo = Topology.from_any(topology)
    budget = plan_options.get("memory_bytes")
    budget = budget if budget is not None else topo.memory_bytes
    asked = bool(plan_options.pop("recompute", False))
    search = _Search(graph, names, kinds is not None, counts, batch_size or graph(1).batch_size, minibatches,
                     budget, asked, threads, host_costs, progress, plan_options.pop("sharding", "replicate"),
                     plan_options.pop("tensor_parallel", 1))
    recomputes = [True] if asked else ([False, True] if budget is not None else [False])
    tried = search.candidates(topo, plan_options, recomputes, report=True)
    ok = search.ranked(tried)
    if not ok:
        reasons = "; ".join(f"{c.label}: {c.error}" for c, _ in tried) or "no candidate (batch smaller than 1?)"
        raise PlanError(f"schedule auto: no schedule fits: {reasons}")
    best_cand, best = ok[0]
    without_budget = search.fastest_without_budget(topo, plan_options) if budget is not None else None
    best.meta["auto"] = {
        "allow_stale": allow_stale, "minibatches": minibatches,
        "memory_budget_bytes": budget,
        "chosen": asdict(best_cand),
        "runner_up": asdict(ok[1][0]) if len(ok) > 1 else None,
        "without_budget": without_budget,
        "candidates": [asdict(c) for c, _ in tried],
    }
    log.info("schedule auto: %s (%s) predicted %.3f ms per minibatch", best_cand.label, best.config,
             best_cand.time_per_minibatch_s * 1e3)
    return best


def _graph_per_count(graph_for: Callable[[int], LayerGraph] | LayerGraph) -> Callable[[int], LayerGraph]:
    """``graph_for`` as a function of the microbatch count, each count's profile asked for once
    (one graph: the same for every count)."""
    cache: dict[int, LayerGraph] = {}

    def graph(m: int) -> LayerGraph:
        if isinstance(graph_for, LayerGraph):
            return graph_for
        if m not in cache:
            cache[m] = graph_for(m)
        return cache[m]

    return graph


def _checked_request(names: list[str], plan_options: dict[str, Any], minibatches: int,
                     microbatches: Sequence[int]) -> list[int]:
    """Refuse what ``choose_schedule`` cannot try; the microbatch counts to try, sorted."""
    for name in names:
        if not schedule_kind(name).true_gradients:
            raise PlanError(f"schedule auto: {name!r} computes no true gradient and is never chosen")
    if "schedule" in plan_options or "microbatches" in plan_options:
        raise PlanError("schedule auto chooses the schedule and the microbatches itself; do not pass them")
    if not isinstance(minibatches, int) or minibatches < 1:
        raise PlanError(f"minibatches must be a positive integer, got {minibatches!r}")
    counts = sorted({int(m) for m in microbatches if int(m) >= 1})
    if not counts:
        raise PlanError(f"schedule auto: no microbatch count to try in {list(microbatches)!r}")
    return counts


@dataclass
class _Search:
    """The candidates of one :func:`choose_schedule` call: each kind × microbatch count (×
    recomputation) planned, and its schedule simulated."""

    graph: Callable[[int], LayerGraph]
    names: list[str]
    kinds_given: bool  # the caller named the kinds: none is skipped
    counts: list[int]
    batch: int | None
    minibatches: int
    budget: float | None
    asked: bool  # recomputation asked for on every stage
    threads: int
    host_costs: Callable[[Plan, int], dict[str, Any]] | None
    progress: Callable[[Candidate, Plan | None], None] | None
    sharding: str = "replicate"  # asked for; "replicate": sharding tried too under a budget
    tensor_parallel: int | str = 1  # asked for; "auto": every degree of tensor_degrees

    def degrees(self, kind: ScheduleKind, topo: Topology) -> list[int]:
        """The tensor-parallel degrees tried for ``kind``."""
        return tensor_degrees(topo, kind) if self.tensor_parallel == AUTO else [int(self.tensor_parallel)]

    def shardings(self, kind: ScheduleKind) -> list[str]:
        """The sharding options tried for ``kind``: the one asked for (none where the kind cannot
        shard), or under a memory budget "replicate" and "zero3" where it can."""
        if self.sharding != "replicate":
            return [self.sharding] if kind.can_shard else []
        return ["replicate", "zero3"] if kind.can_shard and self.budget is not None else ["replicate"]

    def candidates(self, topo: Topology, options: dict[str, Any], recomputes: list[bool],
                   report: bool) -> list[tuple[Candidate, Plan | None]]:
        """Every candidate on ``topo`` with its plan (None where it cannot be planned), in order;
        ``report``: each is passed to ``progress`` as it is decided."""
        tried: list[tuple[Candidate, Plan | None]] = []
        for name in self.names:
            kind = schedule_kind(name)
            if (kind.virtual_stages or kind.split_backward) and topo.num_workers < 2 and not self.kinds_given:
                continue  # one worker has no bubble to fill: they would only add hand-overs or a split
            for m in self.counts if kind.microbatched else [1]:
                if self.batch and m > self.batch:
                    continue
                for recompute, sharding, t in itertools.product(recomputes, self.shardings(kind),
                                                                self.degrees(kind, topo)):
                    cand, plan = self._candidate(name, m, recompute, topo,
                                                 dict(options, sharding=sharding, tensor_parallel=t))
                    tried.append((cand, plan))
                    if self.progress is not None and report:
                        self.progress(cand, plan)
        return tried

    def _candidate(self, name: str, m: int, recompute: bool, topo: Topology,
                   options: dict[str, Any]) -> tuple[Candidate, Plan | None]:
        """One candidate planned and simulated, or the planner's reason it cannot be."""
        cand = Candidate(name, m, recompute, threads=self.threads, sharding=options["sharding"],
                         tensor_parallel=options["tensor_parallel"])
        try:
            plan = plan_one_kind(self.graph(m), topo, schedule=name, microbatches=m, recompute=recompute, **options)
            if recompute and not self.asked and self.budget is not None:
                plan = recompute_where_needed(plan, self.budget)
                again = [s for s, st in enumerate(plan.stages) if st.recompute]
                cand.recompute = bool(again)
                if again and len(again) < plan.num_stages:
                    cand.recompute_stages = again
            if cand.sharding != "replicate" and self.sharding == "replicate" and self.budget is not None:
                plan = shard_where_needed(plan, self.budget)  # tried by auto, not asked for: only where needed
                # the label says what runs: "replicate" where every stage fits replicated, else its shardings
                cand.sharding = "+".join(sorted({st.sharding for st in plan.stages if st.sharded})) or "replicate"
            extra = self.host_costs(plan, m) if self.host_costs is not None else {}
            sim = simulate(build_schedule(plan, name, minibatches=self.minibatches, microbatches=m),
                           Costs.from_plan(plan, microbatches=m, **extra))
            cand.config = plan.config
            cand.time_per_minibatch_s = sim.makespan_s / self.minibatches
            cand.peak_memory_bytes = int(max(sim.peak_memory_bytes)) if sim.peak_memory_bytes else None
        except PlanError as exc:
            cand.error = str(exc)
            return cand, None
        return cand, plan

    def ranked(self, tried: list[tuple[Candidate, Plan | None]]) -> list[tuple[Candidate, Plan]]:
        """The candidates that were planned, fastest first (ties: less memory, no recomputation,
        fewer microbatches, then the order of the kinds)."""
        order = {n: i for i, n in enumerate(self.names)}
        ok = [(c, p) for c, p in tried if p is not None and c.time_per_minibatch_s is not None]
        ok.sort(key=lambda cp: (cp[0].time_per_minibatch_s, cp[0].peak_memory_bytes or 0, cp[0].recompute,
                                cp[0].sharding != "replicate", cp[0].tensor_parallel, cp[0].microbatches,
                                order[cp[0].schedule]))
        return ok

    def fastest_without_budget(self, topo: Topology, plan_options: dict[str, Any]) -> dict[str, Any] | None:
        """What the memory budget gave up: the fastest candidate if memory were unbounded."""
        unbounded = copy.copy(topo)
        unbounded.memory_bytes = None
        options = {k: v for k, v in plan_options.items() if k != "memory_bytes"}
        free = self.ranked(self.candidates(unbounded, options, [self.asked], False))
        return asdict(free[0][0]) if free else None


def recompute_where_needed(plan: Plan, budget: float) -> Plan:
    """``plan`` (planned with recomputation on every stage) recomputing only the stages whose
    predicted memory without it exceeds ``budget``: a stage's memory depends on its own
    recomputation only, and recomputing costs a forward per backward. Plans without the memory
    model's terms, and virtual-stage plans (whose workers share the budget between stages),
    are returned as they are."""
    if plan.virtual or any(st.activations is None for st in plan.stages):
        return plan
    plain = plan.with_recompute(False)
    need = [s for s, st in enumerate(plain.stages) if st.memory_bytes > budget]
    return plan if len(need) == plan.num_stages else plan.with_recompute(need)


#: Ways a stage's replicas may hold its weights, fastest first: one all-reduce per update; one
#: gather and one reduce-scatter per update (``UN``, ``RD``); gathers and reduce-scatters in every
#: microbatch, once (zero2) or twice (zero3) per microbatch's gather (benchmarks/sharding.py
#: measures this order).
FASTEST_FIRST = ("replicate", "zero1", "zero2", "zero3")


def shard_where_needed(plan: Plan, budget: float) -> Plan:
    """``plan`` (planned with its replicated stages sharded) with each sharded stage holding
    its weights the fastest way that fits ``budget`` (``FASTEST_FIRST``, up to the sharding
    it was planned with): a stage that fits replicated replicates, one that fits gathered
    once per minibatch is "zero1", and so on; a stage's memory depends on its own sharding
    only. Plans without the memory model's terms are returned as they are."""
    if any(st.activations is None for st in plan.stages):
        return plan
    out = copy.deepcopy(plan)
    for s, st in enumerate(out.stages):
        if not st.sharded:
            continue
        planned = plan.stages[s].sharding
        for sharding in FASTEST_FIRST[:FASTEST_FIRST.index(planned)]:
            st.sharding = sharding
            memory = out.stage_memory_bytes(s)
            if memory is not None and memory <= budget:
                st.memory_bytes = int(math.ceil(memory))
                break
        else:
            st.sharding = planned
    out.predicted["peak_memory_bytes"] = max(st.memory_bytes for st in out.stages)
    return out


def local_layouts(workers: int, cores: int) -> list[tuple[int, int]]:
    """(workers, torch threads per worker) that use a host's ``cores`` with at most ``workers``
    processes: every divisor w of ``workers``, each with ``cores // w`` threads (at least one),
    most workers first."""
    return [(w, max(1, cores // w)) for w in range(workers, 0, -1) if workers % w == 0]


def threads_per_worker(plan: Plan) -> int:
    """The torch threads each worker of ``plan`` runs with: what :func:`choose_layout` chose, else 1."""
    value = plan.meta.get("threads_per_worker") if isinstance(plan.meta, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1


def choose_layout(
    graph_for: Callable[[int, int], LayerGraph],
    layouts: Sequence[tuple[int, int]],
    topology_for: Callable[[int], Topology],
    *,
    host_costs: Callable[[Plan, int], dict[str, Any]] | None = None,
    progress: Callable[[Candidate, Plan | None], None] | None = None,
    **options: Any,
) -> Plan:
    """:func:`choose_schedule` over several ways of using one host's cores: for each
    ``(workers, threads)`` of ``layouts``, the candidates are planned for ``topology_for(workers)``
    from ``graph_for(m, threads)`` (the model profiled with that many torch threads: one process
    with two threads runs a layer faster than one with one), and the fastest predicted over all
    layouts wins. The chosen plan records the threads (``meta["threads_per_worker"]``, read by
    :func:`threads_per_worker`) and every layout's candidates in ``meta["auto"]``.

    Raises:
        PlanError: no layout has a candidate that can be planned (every layout's reason).
    """
    if not layouts:
        raise PlanError("schedule auto: no (workers, threads) layout to try")
    chosen: list[tuple[Plan, int]] = []
    reasons = []
    for workers, threads in layouts:
        try:
            best = choose_schedule(lambda m, t=threads: graph_for(m, t), topology_for(workers), host_costs=host_costs,
                                   progress=progress, threads=threads, **options)
        except PlanError as exc:
            reasons.append(f"{workers} workers × {threads} threads: {exc}")
            continue
        chosen.append((best, threads))
    if not chosen:
        raise PlanError("; ".join(reasons))
    chosen.sort(key=lambda pt: pt[0].meta["auto"]["chosen"]["time_per_minibatch_s"])
    best, threads = chosen[0]
    auto = best.meta["auto"]
    every = [c for p, _ in chosen for c in p.meta["auto"]["candidates"]]
    for p, _ in chosen[1:]:  # the runner-up may be another layout's choice
        theirs = p.meta["auto"]["chosen"]
        mine = auto["runner_up"]
        if mine is None or theirs["time_per_minibatch_s"] < mine["time_per_minibatch_s"]:
            auto["runner_up"] = theirs
    auto["candidates"] = every
    auto["layouts"] = [{"workers": w, "threads": t} for w, t in layouts]
    best.meta["threads_per_worker"] = threads
    log.info("schedule auto: %d workers × %d threads", best.num_workers, threads)
    return best


def auto_summary(plan: Plan) -> list[str]:
    """Lines saying what ``schedule="auto"`` chose and the runner-up, with predicted time and
    memory (empty for a plan that was not chosen that way)."""
    return auto_summary_lines(plan.meta.get("auto") if isinstance(plan.meta, dict) else None)


def auto_summary_lines(auto: Any) -> list[str]:
    """:func:`auto_summary` of a plan's ``meta["auto"]`` record (as the report stores it)."""
    if not isinstance(auto, dict) or not auto.get("chosen"):
        return []

    def text(c: dict[str, Any]) -> str:
        cand = Candidate(**c)
        mem = f", peak {human_bytes(cand.peak_memory_bytes)}" if cand.peak_memory_bytes else ""
        return f"{cand.label} ({cand.config}): {cand.time_per_minibatch_s * 1e3:.3f} ms per minibatch{mem}"

    tried = auto.get("candidates", [])
    failed = sum(1 for c in tried if c.get("error"))
    lines = [f"chosen {text(auto['chosen'])}"]
    if auto.get("runner_up"):
        lines.append(f"runner-up {text(auto['runner_up'])}")
    layouts = auto.get("layouts") or []
    lines.append(f"{len(tried)} candidates ({'with' if auto.get('allow_stale') else 'without'} stale kinds"
                 + (", over " + ", ".join(f"{x['workers']} workers × {x['threads']} threads" for x in layouts)
                    if len(layouts) > 1 else "")
                 + ")" + (f", {failed} did not fit" if failed else ""))
    free, budget = auto.get("without_budget"), auto.get("memory_budget_bytes")
    if budget is not None:
        if not free:
            lines.append(f"memory budget {human_bytes(budget)} per worker")
        elif all(free.get(k) == auto["chosen"].get(k)
                 for k in ("schedule", "microbatches", "recompute", "config", "sharding", "tensor_parallel")):
            lines.append(f"memory budget {human_bytes(budget)} per worker: gave up nothing (the fastest plan fits)")
        else:
            cost = auto["chosen"]["time_per_minibatch_s"] / free["time_per_minibatch_s"] - 1
            lines.append(f"memory budget {human_bytes(budget)} per worker gave up {text(free)} "
                         f"({cost:+.0%} time per minibatch)")
    return lines


def auto_candidates_table(plan: Plan) -> str:
    """Every candidate of a ``schedule="auto"`` plan, fastest first, with its prediction or why
    it could not be planned (what ``torchpipedream plan --schedule auto`` prints)."""
    auto = plan.meta.get("auto") or {}
    cands = [Candidate(**c) for c in auto.get("candidates", [])]
    cands.sort(key=lambda c: (c.time_per_minibatch_s is None, c.time_per_minibatch_s or 0.0))
    rows = [("schedule", "microbatches", "recompute", "config", "ms per minibatch", "peak memory")]
    for c in cands:
        again = c.recomputed
        config = c.config + (f" ×{c.threads} threads" if c.threads != 1 else "") + \
            (f" {c.sharding}" if c.sharding != "replicate" else "") + \
            (f" tensor ×{c.tensor_parallel}" if c.tensor_parallel != 1 else "")
        if c.error:
            rows.append((c.schedule, str(c.microbatches), again, "-", "does not fit", c.error[:60]))
        else:
            rows.append((c.schedule, str(c.microbatches), again, config, f"{c.time_per_minibatch_s * 1e3:.3f}",
                         human_bytes(c.peak_memory_bytes or 0)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) if i < 4 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    return "\n".join(["schedule auto: " + "; ".join(auto_summary(plan)), *lines])
