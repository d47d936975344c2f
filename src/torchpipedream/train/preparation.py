"""Before any worker starts: options checked, the model profiled, a plan made (or loaded and
checked) and its time predicted."""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from time import monotonic
from typing import Any, Callable, Iterator

import torch
from torch import nn

from ..model import profiler
from ..model.graph import LayerGraph
from ..plans.kinds import AUTO, schedule_kind
from ..plans.plan import Plan, PlanError
from ..plans.topology import Topology, parse_bytes
from ..runtime.checkpoint import CheckpointError, saved_shapes, shape_mismatch
from ..runtime.measure import measure_local_costs, measure_local_costs_of
from ..runtime.pipeline import PRECISIONS
from ..schedule.build import build_schedule
from ..schedule.placement import virtual_support_problem
from ..search.auto import choose_layout, choose_schedule, local_layouts, threads_per_worker
from ..search.planner import nothing_sharded, plan as make_plan
from ..sim.simulator import Costs, simulate
from ..util.units import human_bytes
from .config import (OPTIMIZER_STATE, TrainConfig, TrainError, check_options, check_workers_fit, microbatches_of,
                     optimizer_scratch_of, schedule_of, tensor_degree)
from .inputs import (build_model, load_data, loss_for, minibatches, optimizer_factory, pipeline_units,
                     units_named_by_model)
from .resume import ResumePoint, plan_side_text, resume_point
from .time_split import split_of

__all__ = ["Prepared", "prepare", "explain_plan"]

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """What the parent process computed before launching workers (picklable)."""

    config: TrainConfig
    plan: Plan
    graph: LayerGraph
    predicted: dict[str, Any] = field(default_factory=dict)
    why: str = ""
    resume_from: str | None = None  # checkpoint directory to load before training
    complete: bool = False  # the checkpoint ends the run: only the outputs are written again
    plan_changes: list[dict[str, Any]] = field(default_factory=list)  # resumptions onto another plan

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON (rank 0 sends it to the other ranks under torchrun: nothing is pickled)."""
        return {"config": asdict(self.config), "plan": self.plan.to_dict(), "graph": self.graph.to_dict(),
                "predicted": self.predicted, "why": self.why, "resume_from": self.resume_from,
                "complete": self.complete, "plan_changes": self.plan_changes}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Prepared":
        return cls(TrainConfig(**data["config"]), Plan.from_dict(data["plan"]), LayerGraph.from_dict(data["graph"]),
                   dict(data["predicted"]), str(data["why"]), data["resume_from"], bool(data["complete"]),
                   list(data.get("plan_changes", [])))


def explain_plan(plan: Plan, graph: LayerGraph) -> str:
    """One line on why the planner chose this plan (the trade it made)."""
    total_w = sum(s.parameter_bytes for s in plan.stages)
    t = plan.predicted.get("time_per_minibatch_s")
    speedup = plan.predicted.get("speedup_over_data_parallel")
    if plan.num_stages == 1:
        if plan.stages[0].replicas == 1:
            return "one worker: nothing to split."
        return (
            f"data parallelism: the {human_bytes(total_w)} of weights are cheap to all-reduce next to "
            f"the compute, and every cut would send more than it saves."
        )
    heavy = max(range(plan.num_stages), key=lambda s: plan.stages[s].parameter_bytes)
    share = plan.stages[heavy].parameter_bytes / max(total_w, 1)
    cut_bytes = sum(s.output_bytes for s in plan.stages[:-1])
    line = (
        f"{plan.summary}: stage {heavy} holds {share:.0%} of the {human_bytes(total_w)} of weights; "
        f"pipelining sends {human_bytes(cut_bytes)} of activations per minibatch across its cuts "
        f"instead of all-reducing weights"
    )
    if speedup:
        line += f", predicted {speedup:.2f}x the throughput of data parallelism"
    if t:
        line += f" ({t * 1e3:.2f} ms per minibatch)"
    return line + "."


def _choose_plan(cfg: TrainConfig, graph: LayerGraph, workers: int, saved_plan: Plan | None) -> Plan:
    """The checkpoint's plan on a resumption with the same plan options, ``--plan`` when given
    (checked against the model and the workers), else a new plan for ``--topology`` or this
    computer's workers."""
    t = tensor_degree(cfg)
    if saved_plan is not None:  # resume on the checkpoint's plan (re-planning could pick another)
        try:
            saved_plan.validate(layer_names=graph.names, world_size=workers * t, edges=graph.edges)
        except PlanError as exc:
            raise TrainError(f"--resume: the checkpoint's plan {exc}") from None
        return saved_plan
    if cfg.plan_file:
        plan = Plan.load(cfg.plan_file).with_tensor_parallel(t)  # check_options has read it
        try:
            plan.validate(layer_names=graph.names, world_size=workers * t, edges=graph.edges)
        except PlanError as exc:
            raise TrainError(f"--plan {cfg.plan_file}: {exc}") from None
        if cfg.schedule != AUTO:  # auto: the file's schedule and microbatches
            plan.schedule = cfg.schedule
        problem = virtual_support_problem(plan, plan.schedule)
        if problem:
            raise TrainError(f"--plan {cfg.plan_file} with --schedule {plan.schedule}: {problem}")
        if _recipe_counts_updates(cfg) and not schedule_kind(plan.schedule).microbatched \
                and any(st.replicas > 1 for st in plan.stages):
            raise TrainError(f"--plan {cfg.plan_file}: {plan.summary} replicates a stage, which under {plan.schedule} "
                             "updates once per minibatch of each replica together, so --lr-schedule, --warmup and "
                             "--clip-grad-norm would count updates differently on its stages; use a straight plan "
                             "or a synchronous schedule")
        plan = plan.with_recompute(True) if cfg.recompute else plan
        plan = _sharded(cfg, plan)
        _check_fits_memory(cfg, plan, f"--plan {cfg.plan_file}")
        return plan
    try:
        return make_plan(graph, _topology(cfg, workers * t), schedule=cfg.schedule, microbatches=microbatches_of(cfg),
                         num_stages=cfg.stages, straight=_straight(cfg), recompute=cfg.recompute,
                         optimizer_state_factor=OPTIMIZER_STATE[cfg.optimizer],
                         optimizer_scratch=_scratch(cfg), sharding=cfg.shard, tensor_parallel=t)
    except PlanError as exc:
        if cfg.memory is None:
            raise
        raise TrainError(f"--memory {cfg.memory}: {exc}") from None


def _warn_if_nothing_sharded(cfg: TrainConfig, plan: Plan) -> None:
    """``--shard`` on a plan without a replicated stage shards nothing: say so (the planner found
    no replicated stage worth its workers)."""
    why = nothing_sharded(plan, cfg.shard)
    if why is not None:
        log.warning("--shard %s: %s", cfg.shard, why)


def _sharded(cfg: TrainConfig, plan: Plan) -> Plan:
    """``--plan`` with ``--shard``: the file's replicated stages sharded (TrainError when it has none)."""
    if cfg.shard == "replicate":
        return plan
    if all(st.replicas == 1 for st in plan.stages):
        raise TrainError(f"--plan {cfg.plan_file} with --shard {cfg.shard}: the plan ({plan.summary}) has no replicated "
                         "stage to shard")
    return plan.with_sharding(cfg.shard)


def _recipe_counts_updates(cfg: TrainConfig) -> bool:
    """Whether the run's learning rate or clipping follows the update count (every stage must
    then count its updates alike: runtime/lr_schedule.py, runtime/clipping.py)."""
    return cfg.lr_schedule != "constant" or bool(cfg.warmup) or cfg.clip_grad_norm is not None


def _straight(cfg: TrainConfig) -> bool:
    """Plan without replicated stages: ``--straight``, or a recipe that counts updates under a
    kind whose replicated stage merges one minibatch of each replica into an update (pipedream,
    naive; with ``--schedule auto``, when ``--allow-stale`` lets it choose pipedream)."""
    per_minibatch = cfg.allow_stale if cfg.schedule == AUTO else not schedule_kind(cfg.schedule).microbatched
    return cfg.straight or (_recipe_counts_updates(cfg) and per_minibatch)


def _check_fits_memory(cfg: TrainConfig, plan: Plan, source: str) -> None:
    """TrainError when ``--memory`` is given and a stage of a plan the planner did not make for it
    (``source``) is predicted to need more, or has no prediction to check."""
    if cfg.memory is None:
        return
    budget = parse_bytes(cfg.memory)
    kind, microbatches = schedule_of(cfg, plan)
    for s in range(len(plan.stages)):
        need = plan.stage_memory_bytes(s, kind, microbatches)
        if need is None:
            raise TrainError(f"--memory {cfg.memory}: {source} has no memory prediction for stage {s} (a plan "
                             "without the memory model's activation terms): re-plan it, or leave out --memory")
        if need > budget:
            raise TrainError(f"--memory {cfg.memory}: {source}: stage {s} is predicted to need "
                             f"{human_bytes(need)} per worker, more than the budget")


def _scratch(cfg: TrainConfig) -> tuple[float, float]:
    """The optimizer step's temporaries for the memory model, on the device the workers train on."""
    return optimizer_scratch_of(cfg.optimizer, torch.cuda.is_available())


def _topology(cfg: TrainConfig, workers: int, check: bool = True) -> Any:
    """``--topology``, else this computer's ``workers``; checked against ``--workers`` (unless
    ``check``: a local layout of fewer workers than ``--workers``)."""
    topo = Topology.from_any(cfg.topology) if cfg.topology else Topology.local(workers)
    if check and topo.num_workers != workers:
        raise TrainError(f"--topology has {topo.num_workers} workers but --workers is {workers}")
    if cfg.memory is not None:
        topo.memory_bytes = parse_bytes(cfg.memory)
    return topo


#: How long one process reuses a host-cost measurement of the same plan shape (seconds)
HOST_COSTS_REUSE_S = 600.0
_host_costs_measured: dict[Any, tuple[float, dict[str, Any]]] = {}  # key -> (when measured, costs)


def measured_host_costs(plan: Plan, m: int) -> dict[str, Any]:
    """This host's measured costs of a plan's local run (``runtime.measure.measure_local_costs``,
    a few seconds of spawned processes), measured once per plan shape and microbatch count:
    candidates of one shape (flush and gpipe, often) and the chosen plan share a measurement,
    and so do the runs one process starts within ``HOST_COSTS_REUSE_S`` (a notebook or a
    script that trains several times; the host's per-message cost moves with its load, slowly
    beside that)."""
    if plan.num_workers < 2:
        return {}
    key = _shape_key(plan, m)
    cached = _host_costs_measured.get(key)
    if cached is None or monotonic() - cached[0] > HOST_COSTS_REUSE_S:
        cached = _host_costs_measured[key] = (monotonic(), measure_local_costs(plan, m))
    return dict(cached[1])


def _shape_key(plan: Plan, m: int) -> Any:
    """What a host-cost measurement depends on: the microbatch count and each stage's replicas,
    weight bytes and output bytes."""
    return (m, tuple((st.replicas, st.parameter_bytes, st.output_bytes) for st in plan.stages))


def _measure_ahead(search: Callable[[Callable[[Plan, int], dict[str, Any]]], Plan]) -> None:
    """Measure at once the host costs of every plan shape ``search(host_costs)`` will ask
    ``measured_host_costs`` for (and has no fresh measurement of), and keep them as it would:
    the same measurements per shape (``runtime.measure.measure_local_costs_of``), their
    spawned processes started once for all shapes instead of once per shape. The shapes are
    found by running the search once with no host costs, its log quiet (its predictions are
    not the run's): the plans it compares do not depend on the costs, only their ranking."""
    asked: dict[Any, tuple[Plan, int]] = {}

    def record(plan: Plan, m: int) -> dict[str, Any]:
        key = _shape_key(plan, m)
        cached = _host_costs_measured.get(key)
        if plan.num_workers >= 2 and (cached is None or monotonic() - cached[0] > HOST_COSTS_REUSE_S):
            asked.setdefault(key, (plan, m))
        return {}

    with _quiet(choose_layout.__module__, make_plan.__module__, simulate.__module__):
        search(record)
    if asked:
        when = monotonic()
        for key, costs in zip(asked, measure_local_costs_of(list(asked.values()))):
            _host_costs_measured[key] = (when, costs)


@contextmanager
def _quiet(*names: str) -> Iterator[None]:
    """Drop the records the loggers ``names`` make inside the block (their configuration kept)."""
    def drop(record: logging.LogRecord) -> bool:
        return False

    loggers = [logging.getLogger(name) for name in names]
    for logger in loggers:
        logger.addFilter(drop)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(drop)


def _auto_plan(cfg: TrainConfig, profiled: Any, workers: int,
               host_costs: Callable[[Plan, int], dict[str, Any]] | None) -> Plan:
    """``--schedule auto``: the fastest predicted kind and microbatch count (search/auto.py),
    each candidate planned from a profile at its own microbatch size, and on this machine's
    workers priced with its measured host costs (as the run's own prediction is). A local run
    (this machine's cores, no --topology) also tries fewer workers with more torch threads each
    (``auto.local_layouts``), each from a profile at that thread count; with --tensor-parallel,
    workers of that many processes, one thread each (the kinds that split layers)."""
    t = tensor_degree(cfg)
    options = dict(allow_stale=cfg.allow_stale, batch_size=cfg.batch_size, num_stages=cfg.stages,
                   straight=_straight(cfg), recompute=cfg.recompute,
                   optimizer_state_factor=OPTIMIZER_STATE[cfg.optimizer], optimizer_scratch=_scratch(cfg),
                   host_costs=host_costs,
                   sharding=cfg.shard)
    try:
        if t > 1:
            log.info("--schedule auto: planning the kinds that split layers over %d processes per worker", t)

            def split(costs: Callable[[Plan, int], dict[str, Any]] | None) -> Plan:
                return choose_schedule(lambda m: profiled(m, 1), _topology(cfg, workers * t),
                                       **dict(options, host_costs=costs, tensor_parallel=t))

            if host_costs is not None:
                _measure_ahead(split)  # every candidate's shape in one launch, not one launch each
            return split(host_costs)
        if host_costs is not None:
            layouts = local_layouts(workers, os.cpu_count() or 1)
            log.info("--schedule auto: planning every schedule kind and microbatch count for %s",
                     ", ".join(f"{w} workers × {t} threads" for w, t in layouts))

            def search(costs: Callable[[Plan, int], dict[str, Any]]) -> Plan:
                return choose_layout(profiled, layouts, lambda w: _topology(cfg, w, check=False),
                                     **dict(options, host_costs=costs))

            _measure_ahead(search)  # every candidate's shape in one launch, not one launch each
            return search(host_costs)
        log.info("--schedule auto: planning every schedule kind and microbatch count")
        return choose_schedule(lambda m: profiled(m, 1), _topology(cfg, workers), **options)
    except PlanError as exc:
        raise TrainError(str(exc)) from None


def _check_resumed_model(directory: Any, model: nn.Module) -> None:
    """TrainError when the checkpoint ``--resume`` found holds another model's tensors (the
    model's code changed since it was written)."""
    try:
        problem = shape_mismatch(saved_shapes(directory), model)
    except CheckpointError as exc:
        raise TrainError(f"--resume: {exc}") from None
    if problem:
        raise TrainError(f"--resume: the checkpoint {directory} was written for another model: {problem}. "
                         "Resume with the model it was written for, or start afresh with --overwrite")


def prepare(cfg: TrainConfig, measure_host: bool = False) -> Prepared:
    """Check options, profile the model, plan (or load and check a plan) and predict its time.

    With ``measure_host`` (a local run on this machine's cores, no --topology) the prediction
    charges this host's measured message overhead, all-reduces and copy bandwidth
    (``runtime.measure.measure_local_costs``, a few seconds of spawned processes) instead of the
    link model's bytes / bandwidth, which on CPU workers predicts gloo's collectives 3-10× too fast.
    """
    check_options(cfg)
    point: ResumePoint | None = resume_point(cfg) if cfg.resume else None
    processes = cfg.resolved_workers()
    workers = processes // tensor_degree(cfg)  # the plan's; each of --tensor-parallel processes
    model = build_model(cfg)
    if point is not None:  # found here, not by every worker after launch
        _check_resumed_model(point.directory, model)
    x, y, _, _ = load_data(cfg)
    if measure_host:  # a local run: its workers must fit in this machine's memory
        check_workers_fit(processes, sum(p.numel() * p.element_size() for p in model.parameters()))
    profiles: dict[tuple[int, int], LayerGraph] = {}
    units = pipeline_units(cfg, model)  # GPT-2 with --tensor-parallel: profiled by its own modules

    def profiled(microbatches: int, threads: int = 1) -> LayerGraph:
        """The model profiled as a schedule of ``microbatches`` runs it, on a worker of
        ``threads`` torch threads, and under autocast for bf16 and fp16 (its compute, and
        activations of half the bytes); once per count."""
        if (microbatches, threads) not in profiles:
            half = PRECISIONS[cfg.precision]
            with torch.autocast("cpu", dtype=half or torch.bfloat16, enabled=half is not None):
                profiles[(microbatches, threads)] = profiler.profile(  # looked up when called (tests replace it)
                    units if units is not None else model, x[: cfg.batch_size], loss_fn=loss_for(cfg), target=y[: cfg.batch_size], name=cfg.model,
                    optimizer=optimizer_factory(cfg), microbatches=microbatches, num_threads=threads)
                if units is not None:
                    units_named_by_model(profiles[(microbatches, threads)], units, model)
        return profiles[(microbatches, threads)]

    host_costs = measured_host_costs if measure_host and not cfg.topology else None  # a local run on this host
    saved = point.plan if point is not None and not point.replan else None
    if cfg.schedule == AUTO and saved is None and not cfg.plan_file:
        plan = _auto_plan(cfg, profiled, workers, host_costs)
    else:
        # auto with a checkpoint's or a file's plan: that plan's microbatches
        given = (saved or Plan.load(cfg.plan_file)) if cfg.schedule == AUTO else None
        m = schedule_of(cfg, given)[1] if given is not None else microbatches_of(cfg)
        # a checkpoint's plan that auto laid out on fewer workers with more threads keeps them
        laid_out = saved is not None and isinstance(saved.meta, dict) and "threads_per_worker" in saved.meta
        plan = _choose_plan(cfg, profiled(m, threads_per_worker(saved) if laid_out else 1),
                            saved.num_workers if laid_out else workers, saved)
    _warn_if_nothing_sharded(cfg, plan)
    kind, m = schedule_of(cfg, plan)
    graph = profiled(m, threads_per_worker(plan))
    changes = list(point.extra.get("plan_changes", [])) if point is not None else []
    if point is not None and point.replan and not point.complete:
        change = {"epoch": int(point.extra.get("epoch", 0)), "minibatch": int(point.extra.get("minibatch", 0)),
                  "from": point.plan.summary, "from_config": point.plan.config, "to": plan.summary,
                  "to_config": plan.config, "because": point.replan,
                  "from_stages": [list(st.layers) for st in point.plan.stages],
                  "to_stages": [list(st.layers) for st in plan.stages]}
        log.warning("resuming onto another plan: %s -> %s, because %s", plan_side_text(change, "from"),
                    plan_side_text(change, "to"), "; ".join(point.replan))
        changes.append(change)
    n = len(minibatches(x, y, cfg.batch_size, cfg.max_minibatches, 0))
    sched = build_schedule(plan, kind, minibatches=n, microbatches=m,
                           **({"vertical_sync": True} if cfg.vertical_sync else {}))
    host: dict[str, Any] = {}
    if host_costs is not None and plan.num_workers > 1 and not (point is not None and point.complete):
        log.info("measuring this host's message, all-reduce and copy costs for the prediction")
        host = host_costs(plan, m)
    sim = simulate(sched, Costs.from_plan(plan, microbatches=m, **host))
    predicted = {
        "time_per_minibatch_s": sim.makespan_s / n,
        "samples_per_s": cfg.batch_size * n / sim.makespan_s if sim.makespan_s > 0 else float("inf"),
        "steady_samples_per_s": (sim.steady_minibatches_per_s or 0.0) * cfg.batch_size,
        "bubble_fraction": sim.bubble_fraction,
        # where the simulated time goes, to set beside the run's (train/time_split.py)
        "time_split": split_of(sim.trace, n),
    }
    return Prepared(cfg, plan, graph, predicted, explain_plan(plan, graph),
                    resume_from=str(point.directory) if point is not None else None,
                    complete=point is not None and point.complete, plan_changes=changes)
