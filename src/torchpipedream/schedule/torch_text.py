"""Schedules in torch.distributed.pipelining's action text, in and out.

torch writes a schedule as one list of actions per rank, each ``{stage}{type}{microbatch}``:
``F`` forward, ``B`` full backward, ``I`` the backward's input-gradient part, ``W`` its
weight-gradient part, ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B`` transfers, ``UNSHARD``,
``RESHARD`` (FSDP) and ``REDUCE_GRAD``; ``(0F3;3B1)OVERLAP_F_B`` runs its sub-actions together;
an empty cell is an idle step. One schedule is one ``step()``: one batch of ``n`` microbatches
(ids 0 … n − 1), with the optimizer outside it. Its CSV file has one row per rank.

Here a torch schedule becomes a :class:`~torchpipedream.schedule.actions.Schedule` (:func:`from_torch`,
:func:`read_torch_csv`) that ``validate_schedule`` proves, ``simulate`` times with profiled
durations and ``Pipeline.use_schedule`` runs; and one of ours becomes torch's text
(:func:`to_torch`, :func:`write_torch_csv`) for its ``_PipelineScheduleRuntime._load_csv``.

The mapping: torch's ``F``, ``B``, ``I``, ``W`` are our F, B, B-with-a-W (a split backward) and
W. Transfers are not read: our lowering puts them around the compute, in the compute's order
(``build.schedule_from_order``), and torch's loader does the same for a compute-only file.
``UNSHARD``/``RESHARD`` and ``REDUCE_GRAD`` are dropped: torch's schedule runs one worker per
stage, which shards nothing (ours gives a stage sharded "zero1" its own ``UN``/``RS``/``RD``:
build.py), and our updates follow the kind's rule. torch's stage index is our stage index and its ranks are ours: a rank may run
several stages (virtual stages: ``Interleaved1F1B``, ``LoopedBFS`` with several stages per rank),
read as kind ``interleaved`` with the rank's order of its stages kept (``rank_order``); with a
split backward as well (``InterleavedZeroBubble`` with several stages per rank, ``ZBVZeroBubble``,
``DualPipeV``) they are refused, as our split-backward kinds run one stage per rank.

No torch import: the text format is all this module reads and writes.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from .actions import Kind, Schedule, split_backwards
from ..plans.kinds import SCHEDULE_KINDS, VersionRule, schedule_kind
from ..plans.plan import Plan, Stage, looped_rank, v_shape_rank
from .build import schedule_from_order
from .validate import bounds, rank_inflight_bound, schedule_stats

__all__ = ["TorchScheduleError", "from_torch", "to_torch", "read_torch_csv", "write_torch_csv", "parse_torch_action"]

_ACTION = re.compile(r"^(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)$")
_OVERLAP = re.compile(r"^\((?P<subs>[^()]*)\)(?P<type>[A-Z_]+)$")
_COMPUTE = {"F": Kind.FORWARD, "B": Kind.BACKWARD, "I": Kind.BACKWARD, "W": Kind.WEIGHT_GRAD}
_DROPPED = frozenset({"SEND_F", "RECV_F", "SEND_B", "RECV_B", "UNSHARD", "RESHARD", "REDUCE_GRAD"})


class TorchScheduleError(ValueError):
    """A torch schedule that cannot be read, or a schedule of ours that torch cannot run."""


def parse_torch_action(text: str) -> list[tuple[int, str, int | None]]:
    """One cell of torch's text as ``(stage, type, microbatch)`` tuples: none for an empty cell,
    the sub-actions of an ``OVERLAP_F_B``, else one."""
    text = text.strip()
    if not text or text == "None":
        return []
    overlap = _OVERLAP.match(text)
    if overlap:
        return [a for sub in overlap["subs"].split(";") for a in parse_torch_action(sub)]
    m = _ACTION.match(text)
    if not m:
        raise TorchScheduleError(f"cannot read torch action {text!r}: expected [stage][type][microbatch] such as "
                                 "'1F0', '0I3', '2W1' or '1SEND_F0'")
    return [(int(m[1]), m[2], int(m[3]) if m[3] else None)]


def _infer_kind(order: Mapping[int, Sequence[tuple[Kind, int]]], split: bool, virtual: bool) -> str:
    """The kind a torch order is read as: where a rank runs several stages zb-v if it splits a
    backward (a V: the only placement accepted with a split), else interleaved; zb-h1 where
    it splits a backward, gpipe where each stage runs every forward before its first backward,
    else flush."""
    if virtual:
        return "zb-v" if split else "interleaved"
    if split:
        return "zb-h1"
    forwards_first = all(
        max((p for p, (k, _) in enumerate(acts) if k is Kind.FORWARD), default=-1)
        < min((p for p, (k, _) in enumerate(acts) if k is Kind.BACKWARD), default=len(acts))
        for acts in order.values())
    return "gpipe" if forwards_first else "flush"


def _default_plan(placement: Mapping[int, int], workers: int, microbatches: int, kind: str) -> Plan:
    """A plan with one layer name per stage and torch's placement (``placement``: stage -> rank):
    straight where stage s is on rank s, looped where stage k is on rank k mod workers, else
    stage by stage (e.g. V-shaped)."""
    groups = [[f"stage{s}"] for s in range(len(placement))]
    if all(r == s for s, r in placement.items()):
        return Plan.straight(groups, microbatches=microbatches)
    if all(r == looped_rank(s, workers) for s, r in placement.items()):
        return Plan.looped(groups, workers, schedule=kind, microbatches=microbatches)
    return Plan(stages=[Stage(g, 1, [placement[s]]) for s, g in enumerate(groups)], schedule=kind,
                microbatches=microbatches)


@dataclass
class _TorchOrder:
    """What torch's per-rank action lists say, read into our terms."""

    ranks: list[int]
    order: dict[int, list[tuple[Kind, int]]] = field(default_factory=dict)  # stage -> its compute items, in order
    rank_order: dict[int, list[int]] = field(default_factory=dict)  # rank -> the stage of each of its compute items
    placement: dict[int, int] = field(default_factory=dict)  # stage -> the rank that runs it
    splits: bool = False  # some backward is split (I and W)
    top: int = -1  # the largest microbatch id

    def read_rank(self, r: int, cells: Iterable[str | object | None]) -> None:
        """Read rank ``r``'s cells; refuse a stage on two ranks, an action without a microbatch,
        and an ``I`` without its ``W`` (or the reverse)."""
        inputs_only: set[tuple[int, int]] = set()  # (stage, microbatch)
        weights: set[tuple[int, int]] = set()
        self.rank_order[r] = []
        for cell in cells:
            for stage, kind_text, mb in parse_torch_action("" if cell is None else str(cell)):
                if kind_text in _DROPPED:
                    continue
                if self.placement.setdefault(stage, r) != r:
                    raise TorchScheduleError(f"stage {stage} runs on rank {self.placement[stage]} and on rank {r}: a "
                                             "stage runs on one rank (one worker per stage)")
                if mb is None:
                    raise TorchScheduleError(f"rank {r}: {stage}{kind_text} names no microbatch")
                self.top = max(self.top, mb)
                self.order.setdefault(stage, []).append((_COMPUTE[kind_text], mb))
                self.rank_order[r].append(stage)
                if kind_text == "I":
                    inputs_only.add((stage, mb))
                elif kind_text == "W":
                    weights.add((stage, mb))
        self._check_split(r, inputs_only, weights)
        self.splits = self.splits or bool(weights)

    def _check_split(self, r: int, inputs_only: set[tuple[int, int]], weights: set[tuple[int, int]]) -> None:
        """A split backward only with one stage on the rank, or two in a V; every I with its W."""
        held = sorted(set(self.rank_order[r]))
        in_a_v = len(held) == 2 and all(v_shape_rank(s, len(self.ranks)) == r for s in held)
        if len(held) > 1 and (weights or inputs_only) and not in_a_v:
            raise TorchScheduleError(
                f"rank {r} runs stages {held} and splits the backward (I and W): several stages per rank with a "
                "split backward are supported in a V only (rank r holding stages r and 2p - 1 - r: ZBVZeroBubble, "
                "DualPipeV without its overlapped passes), read as zb-v; not looped (InterleavedZeroBubble with "
                "several stages per rank)")
        if inputs_only != weights:
            stage, odd = sorted(inputs_only ^ weights)[0]
            what = "an I (input-gradient backward) without its W" if (stage, odd) in inputs_only else "a W without its I"
            raise TorchScheduleError(f"rank {r}, stage {stage}: microbatch {odd} has {what}")

    def check_coverage(self) -> None:
        """Every rank runs a stage, and the stages are 0..n-1."""
        idle = [r for r in self.ranks if not self.rank_order[r]]
        if idle:
            raise TorchScheduleError(f"rank {idle[0]} runs no compute action: every rank runs at least one stage")
        missing = sorted(set(range(max(self.placement) + 1)) - set(self.placement))
        if missing:
            raise TorchScheduleError(f"the torch schedule runs stages {sorted(self.placement)}; stage {missing[0]} is "
                                     "missing (stages are numbered 0..n-1)")

    def kind(self, given: str | None) -> str:
        """``given``, else the kind inferred from the order; refused where a rank runs several
        stages under a kind that runs one stage per rank."""
        virtual = len(self.placement) > len(self.ranks)
        chosen = given or _infer_kind(self.order, self.splits, virtual)
        info = SCHEDULE_KINDS.get(chosen)
        if virtual and info is not None and not info.virtual_stages:
            r = next(r for r in self.ranks if len(set(self.rank_order[r])) > 1)
            raise TorchScheduleError(f"rank {r} runs stages {sorted(set(self.rank_order[r]))}: kind {chosen} runs one "
                                     "stage per rank; several stages per rank are read as interleaved")
        return chosen

    def check_plan(self, plan: Plan) -> None:
        """``plan`` has one worker per stage, placed as torch's order runs them."""
        theirs = {r: sorted(s for s, rr in self.placement.items() if rr == r) for r in self.ranks}
        ours = {r: [s for s, st in enumerate(plan.stages) if r in st.ranks] for r in range(plan.num_workers)}
        if (plan.num_stages != len(self.placement) or any(st.replicas != 1 for st in plan.stages) or ours != theirs):
            raise TorchScheduleError(
                f"the plan ({plan.summary}, stages per rank {ours}) must have {len(self.placement)} stages of one "
                f"worker each, placed as the torch schedule runs them: stages per rank {theirs}")


def _read_torch_order(actions: Mapping[int, Iterable[str | object | None]]) -> _TorchOrder:
    """torch's per-rank actions read rank by rank (ranks 0..n-1), every rank and stage checked."""
    ranks = sorted(actions)
    if ranks != list(range(len(ranks))) or not ranks:
        raise TorchScheduleError(f"torch schedules list ranks 0..n-1; got {ranks}")
    read = _TorchOrder(ranks)
    for r in ranks:
        read.read_rank(r, actions[r])
    read.check_coverage()
    return read


def _declare_inflight(sched: Schedule, plan: Plan, kind: str, m: int) -> None:
    """torch's orders may hold more microbatches than our kind's bound (its Interleaved1F1B with one
    stage per rank warms up deeper than 1F1B; LoopedBFS runs every forward of a stage first):
    the schedule declares its own, and memory counts what it holds."""
    stats, limit = schedule_stats(sched), bounds(plan, kind, m)
    over = [inflight for (_, s), (_, inflight) in stats.by_stage.items() if inflight > limit[s][1]]
    if over:
        sched.options = {**(sched.options or {}), "max_inflight": max(over)}
    if plan.virtual:  # and over a rank's stages together (LoopedBFS; a V-shaped order read as interleaved)
        rank_over = [held for r, held in stats.max_inflight.items()
                     if held > rank_inflight_bound(plan, kind, m, r)]
        if rank_over:
            sched.options = {**(sched.options or {}), "max_rank_inflight": max(rank_over)}


def from_torch(actions: Mapping[int, Iterable[str | object | None]], plan: Plan | None = None,
               minibatches: int = 1, kind: str | None = None, microbatches: int | None = None) -> Schedule:
    """A schedule of ours from torch's per-rank actions (strings, or torch's ``_Action`` objects,
    whose ``str`` is the text), one torch step per minibatch, ``minibatches`` times.

    Args:
        actions: rank -> that rank's actions, as ``schedule.pipeline_order`` holds them.
        plan: the plan to run it on: one worker per stage, each stage on the rank that runs it
            in torch's order (torch's stage index = ours); default one layer name per stage,
            straight (stage s on rank s) or looped (``Plan.looped``) as torch's placement is.
        minibatches: how many batches the schedule covers (torch's step repeated).
        kind: the semantics it is validated and run under (flush, gpipe, zb-h1 or interleaved);
            default interleaved when a rank runs several stages, zb-h1 when it splits a
            backward, gpipe when every forward comes before every backward on each stage, else
            flush.
        microbatches: microbatches per batch; default one more than the largest id.

    Raises:
        TorchScheduleError: unreadable text, a stage on two ranks, several stages on a rank
            together with a split backward (not supported yet) or with a kind that runs one
            stage per rank, an ``I`` without its ``W`` (or the reverse), or a plan that does
            not match.
    """
    read = _read_torch_order(actions)
    m = microbatches if microbatches is not None else read.top + 1
    if m < 1:
        raise TorchScheduleError("the torch schedule runs no microbatch")
    chosen = read.kind(kind)
    if plan is None:
        plan = _default_plan(read.placement, len(read.ranks), m, chosen)
    else:
        read.check_plan(plan)
    repeated = {(s, 0): [(k, t * m + mb) for t in range(minibatches) for k, mb in items]
                for s, items in read.order.items()}
    sched = schedule_from_order(plan, chosen, minibatches, m, repeated,
                                {r: stages * minibatches for r, stages in read.rank_order.items()})
    _declare_inflight(sched, plan, chosen, m)
    return sched


def to_torch(schedule: Schedule, batch: int = 0) -> dict[int, list[str]]:
    """Batch ``batch`` of a synchronous schedule of ours (flush, gpipe, zb-h1, zb-h2,
    interleaved: each batch one torch ``step()``) as torch's compute-only actions per rank,
    microbatch ids from 0; a rank holding several stages (interleaved) lists them all, each
    action naming its stage, as torch's multi-stage schedules do.

    Raises:
        TorchScheduleError: an asynchronous kind (its batches overlap: no torch step runs one),
            a replicated stage, or a batch out of range.
    """
    kind = schedule_kind(schedule.kind)
    if kind.version_rule is not VersionRule.BATCH:
        raise TorchScheduleError(f"{kind.name} overlaps its batches (weights of another update in flight); torch "
                                 "runs one batch per step: export flush, gpipe, zb-h1 or interleaved")
    if any(st.replicas > 1 for st in schedule.plan.stages):
        raise TorchScheduleError(f"plan {schedule.plan.config} replicates a stage; torch's pipeline schedules run one "
                                 "worker per stage (combine them with data parallelism outside)")
    if not 0 <= batch < schedule.minibatches:
        raise TorchScheduleError(f"batch {batch} is out of range 0..{schedule.minibatches - 1}")
    m = schedule.microbatches
    lo, hi = batch * m, batch * m + m
    out: dict[int, list[str]] = {}
    for r, acts in sorted(schedule.actions.items()):
        split = split_backwards(acts)
        cells = []
        for a in acts:
            if a.kind not in _COMPUTE.values() or not lo <= a.id < hi:
                continue
            text = {Kind.FORWARD: "F", Kind.WEIGHT_GRAD: "W"}.get(a.kind) or ("I" if (a.stage, a.id) in split else "B")
            cells.append(f"{a.stage}{text}{a.id - lo}")
        out[r] = cells
    return out


def write_torch_csv(schedule: Schedule, path: str | Path, batch: int = 0) -> Path:
    """:func:`to_torch` as torch's compute-only CSV (one row per rank), for
    ``_PipelineScheduleRuntime._load_csv(path)``."""
    path = Path(path)
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        for _, cells in sorted(to_torch(schedule, batch).items()):
            writer.writerow(cells)
    return path


def read_torch_csv(path: str | Path, plan: Plan | None = None, minibatches: int = 1, kind: str | None = None,
                   microbatches: int | None = None) -> Schedule:
    """A torch schedule CSV (one row per rank, compute-only or with transfers) as a schedule of
    ours; arguments as :func:`from_torch`."""
    path = Path(path)
    try:
        with path.open(newline="") as f:
            rows = {r: row for r, row in enumerate(csv.reader(f))}
    except OSError as exc:
        raise TorchScheduleError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return from_torch(rows, plan, minibatches, kind, microbatches)
    except TorchScheduleError as exc:
        raise TorchScheduleError(f"{path}: {exc}") from None
