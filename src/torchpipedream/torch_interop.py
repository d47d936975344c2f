"""Schedules in torch.distributed.pipelining's action text, in and out.

torch writes a schedule as one list of actions per rank, each ``{stage}{type}{microbatch}``:
``F`` forward, ``B`` full backward, ``I`` the backward's input-gradient part, ``W`` its
weight-gradient part, ``SEND_F``/``RECV_F``/``SEND_B``/``RECV_B`` transfers, ``UNSHARD``,
``RESHARD`` (FSDP) and ``REDUCE_GRAD``; ``(0F3;3B1)OVERLAP_F_B`` runs its sub-actions together;
an empty cell is an idle step. One schedule is one ``step()``: one batch of ``n`` microbatches
(ids 0 … n − 1), with the optimizer outside it. Its CSV file has one row per rank.

Here a torch schedule becomes a :class:`~torchpipedream.actions.Schedule` (:func:`from_torch`,
:func:`read_torch_csv`) that ``validate_schedule`` proves, ``simulate`` times with profiled
durations and ``Pipeline.use_schedule`` runs; and one of ours becomes torch's text
(:func:`to_torch`, :func:`write_torch_csv`) for its ``_PipelineScheduleRuntime._load_csv``.

The mapping: torch's ``F``, ``B``, ``I``, ``W`` are our F, B, B-with-a-W (a split backward) and
W. Transfers are not read: our lowering puts them around the compute, in the compute's order
(``schedules.schedule_from_order``), and torch's loader does the same for a compute-only file.
``UNSHARD``/``RESHARD`` (no FSDP here) and ``REDUCE_GRAD`` (our updates follow the kind's rule)
are dropped. Only one stage per rank (stage index = rank) is supported: several stages per
rank (interleaved, V-shaped: ZBV, DualPipeV) are refused by name.

No torch import: the text format is all this module reads and writes.
"""

from __future__ import annotations

import csv
import re
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from .actions import Kind, Schedule, split_backwards
from .kinds import VersionRule, schedule_kind
from .plans import Plan
from .schedules import schedule_from_order
from .validate import bounds, schedule_stats

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


def _infer_kind(order: Mapping[int, Sequence[tuple[Kind, int]]], split: bool) -> str:
    if split:
        return "zb-h1"
    forwards_first = all(
        max((p for p, (k, _) in enumerate(acts) if k is Kind.FORWARD), default=-1)
        < min((p for p, (k, _) in enumerate(acts) if k is Kind.BACKWARD), default=len(acts))
        for acts in order.values())
    return "gpipe" if forwards_first else "flush"


def from_torch(actions: Mapping[int, Iterable[str | object | None]], plan: Plan | None = None,
               minibatches: int = 1, kind: str | None = None, microbatches: int | None = None) -> Schedule:
    """A schedule of ours from torch's per-rank actions (strings, or torch's ``_Action`` objects,
    whose ``str`` is the text), one torch step per minibatch, ``minibatches`` times.

    Args:
        actions: rank -> that rank's actions, as ``schedule.pipeline_order`` holds them.
        plan: the plan to run it on (one worker per stage, stage s on rank s); default a
            straight plan with one layer name per stage.
        minibatches: how many batches the schedule covers (torch's step repeated).
        kind: the semantics it is validated and run under (flush, gpipe or zb-h1); default
            zb-h1 when it splits a backward, gpipe when every forward comes before every
            backward on each rank, else flush.
        microbatches: microbatches per batch; default one more than the largest id.

    Raises:
        TorchScheduleError: unreadable text, several stages on one rank, an ``I`` without its
            ``W`` (or the reverse), or a plan that does not match.
    """
    ranks = sorted(actions)
    if ranks != list(range(len(ranks))) or not ranks:
        raise TorchScheduleError(f"torch schedules list ranks 0..n-1; got {ranks}")
    order: dict[int, list[tuple[Kind, int]]] = {}
    splits = False  # some backward is split (I and W)
    top = -1
    for r in ranks:
        items: list[tuple[Kind, int]] = []
        inputs_only: set[int] = set()
        weights: set[int] = set()
        for cell in actions[r]:
            for stage, kind_text, mb in parse_torch_action("" if cell is None else str(cell)):
                if kind_text in _DROPPED:
                    continue
                if stage != r:
                    stages = sorted({s for c in actions[r] for s, _, _ in parse_torch_action("" if c is None else str(c))})
                    raise TorchScheduleError(
                        f"rank {r} runs stages {stages}: several stages per rank (interleaved or V-shaped "
                        "schedules) are not supported yet; only one stage per rank, stage index = rank")
                if mb is None:
                    raise TorchScheduleError(f"rank {r}: {stage}{kind_text} names no microbatch")
                top = max(top, mb)
                items.append((_COMPUTE[kind_text], mb))
                if kind_text == "I":
                    inputs_only.add(mb)
                elif kind_text == "W":
                    weights.add(mb)
        if inputs_only != weights:
            odd = sorted(inputs_only ^ weights)[0]
            what = "an I (input-gradient backward) without its W" if odd in inputs_only else "a W without its I"
            raise TorchScheduleError(f"rank {r}: microbatch {odd} has {what}")
        order[r] = items
        splits = splits or bool(weights)
    m = microbatches if microbatches is not None else top + 1
    if m < 1:
        raise TorchScheduleError("the torch schedule runs no microbatch")
    n = len(ranks)
    if plan is None:
        plan = Plan.straight([[f"stage{s}"] for s in range(n)], microbatches=m)
    elif plan.num_stages != n or any(st.replicas != 1 or st.ranks != [s] for s, st in enumerate(plan.stages)):
        raise TorchScheduleError(f"the plan ({plan.config}) must have {n} stages of one worker each, stage s on rank s, "
                                 "as the torch schedule has")
    chosen = kind or _infer_kind(order, splits)
    repeated = {(r, 0): [(k, t * m + mb) for t in range(minibatches) for k, mb in items] for r, items in order.items()}
    sched = schedule_from_order(plan, chosen, minibatches, m, repeated)
    # torch's orders may hold more microbatches than our kind's bound (its Interleaved1F1B warms
    # up deeper than 1F1B): the schedule declares its own, and memory counts what it holds
    held, limit = schedule_stats(sched).max_inflight, bounds(plan, chosen, m)
    if any(held[r] > limit[plan.stage_of_rank(r)[0]][1] for r in held):
        sched.options = {**(sched.options or {}), "max_inflight": max(held.values())}
    return sched


def to_torch(schedule: Schedule, batch: int = 0) -> dict[int, list[str]]:
    """Batch ``batch`` of a synchronous schedule of ours (flush, gpipe, zb-h1: each batch one
    torch ``step()``) as torch's compute-only actions per rank, microbatch ids from 0.

    Raises:
        TorchScheduleError: an asynchronous kind (its batches overlap: no torch step runs one),
            a replicated stage, or a batch out of range.
    """
    kind = schedule_kind(schedule.kind)
    if kind.version_rule is not VersionRule.BATCH:
        raise TorchScheduleError(f"{kind.name} overlaps its batches (weights of another update in flight); torch "
                                 "runs one batch per step: export flush, gpipe or zb-h1")
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
            text = {Kind.FORWARD: "F", Kind.WEIGHT_GRAD: "W"}.get(a.kind) or ("I" if a.id in split else "B")
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
