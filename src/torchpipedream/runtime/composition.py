"""Which features compose with which schedule kinds: the matrix, asked of the library itself.

Each cell (a kind × a feature) is found by running the checks a :class:`Pipeline` runs, in its
order and with its own functions (its argument checks, its refusal helpers, ``build_schedule``
and ``validate_schedule`` on a small plan of the kind's shape): no model, no training, no
process. A refusal keeps the library's own message, so the table says what a user would read.
``tests/test_composition_matrix.py`` checks a sample of cells against real pipelines, and the
README's table against :func:`render_markdown`; regenerate that table with
``python -c "from torchpipedream.runtime.composition import write_readme; write_readme()"``.

``train --schedule`` is not a column: ``train`` sits above the runtime (it runs every kind whose
checkpoints resume, the "checkpoint resume" column; the test checks that the two agree).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch

from ..plans.kinds import KIND_NAMES, schedule_kind
from ..plans.plan import Plan, PlanError, Stage, TiedParameter
from ..schedule.build import build_schedule
from ..schedule.orders import ScheduleBuildError
from ..schedule.placement import sharding_support_problem, tied_support_problem
from ..schedule.validate import ScheduleError, validate_schedule
from .pipeline import Pipeline, PipelineError, _check_arguments, _check_recipe_arguments, _with_recompute

__all__ = ["KINDS", "FEATURES", "FEATURE_OPTIONS", "Options", "Cell", "cell", "ask", "kind_plan", "matrix",
           "render_markdown", "readme_path", "readme_table", "write_readme", "SHARED_PARAMETER", "README_BEGIN",
           "README_END"]

KINDS: tuple[str, ...] = KIND_NAMES

#: The name the matrix gives the parameter its "shared parameter" plans share (first and last stage).
SHARED_PARAMETER = "embedding.weight"

#: Where the README holds the rendered table.
README_BEGIN, README_END = "<!-- composition: begin -->", "<!-- composition: end -->"

#: What a refused cell's question raised: the library's errors for a combination it cannot run.
REFUSALS = (PipelineError, PlanError, ScheduleBuildError, ScheduleError)


@dataclass(frozen=True)
class Cell:
    """One kind × feature: ``status`` "runs" or "refused", with the library's message when refused."""

    status: str
    message: str | None = None


@dataclass(frozen=True)
class Options:
    """The ``Pipeline`` arguments a feature sets (the defaults: a plain fp32 pipeline)."""

    precision: str = "fp32"
    accumulate: int = 1
    lr_scheduler: Any = None
    clip_grad_norm: float | None = None
    loss_normalizer: Callable[[Any], Any] | None = None
    vertical_sync: bool = False
    shared: bool = False
    recompute: bool | None = None
    replicated: bool = False
    sharded: bool = False
    sharding: str = "zero3"  # how a sharded stage shards (``Stage.sharding``)
    checkpoint: bool = False
    tensor_parallel: int = 1

    def pipeline_kwargs(self) -> dict[str, Any]:
        """The ``Pipeline`` keyword arguments these options are (the plan's shape aside)."""
        return {"precision": self.precision, "accumulate": self.accumulate, "lr_scheduler": self.lr_scheduler,
                "clip_grad_norm": self.clip_grad_norm, "loss_normalizer": self.loss_normalizer,
                "loss_reduction": "sum" if self.loss_normalizer is not None else "mean",
                "vertical_sync": self.vertical_sync, "recompute": self.recompute}


def _constant_rate(optimizer: torch.optim.Optimizer) -> Any:
    """An ``lr_scheduler`` factory: the optimizer's own rate at every update."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


def _count_samples(batch: Any) -> int:
    """A ``loss_normalizer``: the samples of an ``(inputs, targets)`` microbatch."""
    return int(batch[1].shape[0])


#: Feature name -> the Pipeline arguments (and plan) it stands for.
FEATURE_OPTIONS: dict[str, Options] = {
    "replicated stage": Options(replicated=True),
    "shared parameter": Options(shared=True),
    "shared parameter on a replicated stage": Options(shared=True, replicated=True),
    "shared parameter with vertical sync": Options(shared=True, vertical_sync=True),
    "recomputation": Options(recompute=True),
    "bf16": Options(precision="bf16"),
    "fp16": Options(precision="fp16"),
    "checkpoint resume onto another plan": Options(checkpoint=True),
    "lr_scheduler": Options(lr_scheduler=_constant_rate),
    "lr_scheduler with a replicated stage": Options(lr_scheduler=_constant_rate, replicated=True),
    "clip_grad_norm": Options(clip_grad_norm=1.0),
    "clip_grad_norm with a replicated stage": Options(clip_grad_norm=1.0, replicated=True),
    "loss_normalizer": Options(loss_normalizer=_count_samples),
    "accumulate": Options(accumulate=2),
    "vertical sync": Options(vertical_sync=True),
    "sharded stage (FSDP2)": Options(sharded=True),
    "sharded stage with clip_grad_norm": Options(sharded=True, clip_grad_norm=1.0),
    "sharded stage with bf16": Options(sharded=True, precision="bf16"),
    "sharded stage with recomputation": Options(sharded=True, recompute=True),
    "sharded stage with fp16": Options(sharded=True, precision="fp16"),
    "sharded stage, checkpoint resume onto another plan": Options(sharded=True, checkpoint=True),
    "sharded stage with a shared parameter": Options(sharded=True, shared=True),
    "sharded stage gathered once per minibatch (zero1)": Options(sharded=True, sharding="zero1"),
    "zero1 stage with clip_grad_norm": Options(sharded=True, sharding="zero1", clip_grad_norm=1.0),
    "zero1 stage with fp16": Options(sharded=True, sharding="zero1", precision="fp16"),
    "tensor parallel (×2)": Options(tensor_parallel=2),
    "tensor parallel with a replicated stage": Options(tensor_parallel=2, replicated=True),
    "tensor parallel with clip_grad_norm": Options(tensor_parallel=2, clip_grad_norm=1.0),
    "tensor parallel with bf16": Options(tensor_parallel=2, precision="bf16"),
    "tensor parallel with recomputation": Options(tensor_parallel=2, recompute=True),
    "tensor parallel with fp16": Options(tensor_parallel=2, precision="fp16"),
    "tensor parallel, checkpoint resume onto another plan": Options(tensor_parallel=2, checkpoint=True),
    "tensor parallel with a sharded stage": Options(tensor_parallel=2, sharded=True),
    "tensor parallel with a zero1 stage": Options(tensor_parallel=2, sharded=True, sharding="zero1"),
    "tensor parallel with a shared parameter": Options(tensor_parallel=2, shared=True),
}

FEATURES: tuple[str, ...] = tuple(FEATURE_OPTIONS)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def kind_plan(kind: str, workers: int = 2, layers: list[str] | None = None, replicated: bool = False,
              sharded: bool = False, tensor_parallel: int = 1, sharding: str = "zero3") -> Plan:
    """A small plan of ``kind``'s shape: a straight pipeline of ``workers`` stages, interleaved's
    looped placement or zb-v's V (two stages per worker); with ``replicated``, stage 0 on two
    replicas and stage 1 on a third worker (``workers`` aside), with ``sharded`` too, stage 0
    sharded over its replicas (FSDP2, ``sharding``); every worker ``tensor_parallel`` ranks. ``layers``
    (default ``layer0`` ...) are split evenly over the stages."""
    return dataclasses.replace(_kind_plan(kind, workers, layers, replicated, sharding if sharded else "replicate"),
                               tensor_parallel=tensor_parallel)


def _kind_plan(kind: str, workers: int, layers: list[str] | None, replicated: bool, sharding: str) -> Plan:
    """:func:`kind_plan` with one rank a worker."""
    replicated = replicated or sharding != "replicate"
    info = schedule_kind(kind)
    stages = 2 if replicated else (2 * workers if info.virtual_stages else workers)
    names = layers or [f"layer{i}" for i in range(2 * stages)]
    if len(names) < stages:
        raise PlanError(f"{len(names)} layers cannot fill the {stages} stages of a {kind} plan")
    step = -(-len(names) // stages)
    groups = [names[i:i + step] for i in range(0, len(names), step)]
    microbatches = 4 if info.microbatched else 1
    if replicated:
        return Plan(stages=[Stage(groups[0], replicas=2, ranks=[0, 1], sharding=sharding),
                            Stage(groups[1], ranks=[2])],
                    schedule=kind, microbatches=microbatches)
    if info.v_shape:
        return Plan.v_shape(groups, workers, schedule=kind, microbatches=microbatches)
    if info.virtual_stages:
        return Plan.looped(groups, workers, schedule=kind, microbatches=microbatches)
    return Plan.straight(groups, schedule=kind, microbatches=microbatches)


def _one_worker(plan: Plan) -> Plan:
    """``plan`` on one worker, virtual stages or not: what ``Pipeline._join_processes`` is asked
    about here (it refuses by whether the plan has virtual stages, and in one process it needs
    a plan of one worker, one rank: without tensor parallelism)."""
    if plan.num_workers == 1:
        return dataclasses.replace(plan, tensor_parallel=1)
    if plan.virtual:
        stages = [Stage(list(st.layers), ranks=[0]) for st in plan.stages]
    else:
        stages = [Stage([name for st in plan.stages for name in st.layers], ranks=[0])]
    return Plan(stages=stages, schedule=plan.schedule, microbatches=plan.microbatches)


def _construct(plan: Plan, kind: str, o: Options) -> tuple[Plan, Any]:
    """What ``Pipeline.__init__`` checks before it splits the model, in its order; returns the
    plan (with recomputation and the shared parameter) and the scheduler factory."""
    reduction = o.pipeline_kwargs()["loss_reduction"]
    _check_arguments(_sgd, reduction, o.precision)
    factory = _check_recipe_arguments(o.lr_scheduler, o.clip_grad_norm, o.loss_normalizer, reduction)
    Pipeline._check_accumulate(o.accumulate, kind)
    Pipeline._check_loss_scaling(o.precision, None, kind)
    plan = _with_recompute(plan, o.recompute)
    plan.validate(world_size=plan.num_ranks)
    Pipeline._join_processes(SimpleNamespace(plan=_one_worker(plan),  # type: ignore[arg-type]
                                             _ensure_process_group=lambda n: False), o.precision)
    if o.shared:  # as Pipeline._with_shared_parameters, once the split has found the parameter
        plan = dataclasses.replace(plan, tied=[TiedParameter(SHARED_PARAMETER, [0, plan.num_stages - 1], 64)])
        problem = tied_support_problem(plan, kind, o.vertical_sync)
        if problem:
            raise PipelineError(problem)
    problem = sharding_support_problem(plan, kind)  # as Pipeline._with_shared_parameters
    if problem:
        raise PipelineError(problem)
    return plan, factory


def _schedule(plan: Plan, kind: str, o: Options, factory: Any) -> None:
    """What ``Pipeline.schedule_for`` (or, accumulating, ``_accumulating_schedule``) builds and checks."""
    microbatches = plan.microbatches * o.accumulate if schedule_kind(kind).microbatched else None
    sched = build_schedule(plan, kind, minibatches=2 * plan.num_workers, microbatches=microbatches,
                           vertical_sync=o.vertical_sync)
    validate_schedule(sched)
    Pipeline._check_recipe(SimpleNamespace(_scheduler_factory=factory, precision=o.precision,  # type: ignore[arg-type]
                                           clipper=object() if o.clip_grad_norm is not None else None), sched)


def ask(kind: str, options: Options, plan: Plan | None = None) -> None:
    """Run the checks a ``Pipeline`` of ``kind`` with ``options`` runs on ``plan`` (default
    :func:`kind_plan`); raises the library's error where it refuses."""
    if plan is None:
        plan = kind_plan(kind, replicated=options.replicated, sharded=options.sharded,
                         tensor_parallel=options.tensor_parallel, sharding=options.sharding)
    plan, factory = _construct(plan, kind, options)  # Pipeline.save_checkpoint and load_checkpoint check nothing more
    _schedule(plan, kind, options, factory)


def cell(kind: str, feature: str, plan: Plan | None = None) -> Cell:
    """Whether ``feature`` runs under ``kind`` (on ``plan``, default :func:`kind_plan`), with
    the library's message where it is refused."""
    if feature not in FEATURE_OPTIONS:
        raise ValueError(f"unknown feature {feature!r}; expected one of {', '.join(FEATURES)}")
    try:
        ask(kind, FEATURE_OPTIONS[feature], plan)
    except REFUSALS as exc:
        return Cell("refused", str(exc))
    return Cell("runs")


def matrix() -> dict[tuple[str, str], Cell]:
    """Every (kind, feature) cell."""
    return {(kind, feature): cell(kind, feature) for feature in FEATURES for kind in KINDS}


def render_markdown(cells: dict[tuple[str, str], Cell] | None = None) -> str:
    """The matrix as a markdown table (features × kinds) with the refusals' messages numbered
    below it (one number per distinct message)."""
    cells = matrix() if cells is None else cells
    notes: dict[str, int] = {}
    lines = ["Schedule kinds × features, as the library answers (`runtime/composition.py` asks it; "
             "`tests/test_composition_matrix.py` keeps this table current): "
             "yes, or no with the message a `Pipeline` stops with.", "",
             "| feature | " + " | ".join(f"`{k}`" for k in KINDS) + " |",
             "| --- |" + " --- |" * len(KINDS)]
    for feature in FEATURES:
        row = []
        for kind in KINDS:
            c = cells[(kind, feature)]
            if c.status == "runs":
                row.append("yes")
            else:
                number = notes.setdefault(c.message or "", len(notes) + 1)
                row.append(f"no ({number})")
        lines.append(f"| {feature} | " + " | ".join(row) + " |")
    lines += ["", "<details><summary>The refusals' messages</summary>", ""]
    lines += [f"{n}. {_plain(message)}" for message, n in notes.items()]
    lines += ["", "</details>"]
    return "\n".join(lines) + "\n"


def _plain(message: str) -> str:
    """A message on one markdown line, its markup characters shown as text."""
    return re.sub(r"([\\`*<>|]|(?<!\w)_|_(?!\w))", r"\\\1", " ".join(message.split()))


def readme_path() -> Path:
    """The repository's README (this file is src/torchpipedream/runtime/composition.py)."""
    return Path(__file__).resolve().parents[3] / "README.md"


def readme_table(text: str) -> str:
    """The text between the README's composition markers (ValueError when they are missing)."""
    start, end = text.find(README_BEGIN), text.find(README_END)
    if start < 0 or end < start:
        raise ValueError(f"the README has no {README_BEGIN} ... {README_END} block")
    return text[start + len(README_BEGIN):end].strip("\n") + "\n"


def write_readme(path: str | Path | None = None) -> Path:
    """Replace the README's table between the markers with :func:`render_markdown`'s."""
    target = Path(path) if path is not None else readme_path()
    text = target.read_text()
    readme_table(text)  # the markers are there
    start, end = text.find(README_BEGIN) + len(README_BEGIN), text.find(README_END)
    target.write_text(text[:start] + "\n" + render_markdown() + text[end:])
    return target
