"""The schedule IR: actions, their compact text form, and a schedule (one action list per rank).

This is the contract between the schedule generators (schedule/build.py), the simulator
(sim/simulator.py) and the runtime (runtime/engine.py): each interprets the same lists.

Text form of an action (rank is implied by the list it is in)::

    s<stage>[r<replica>]<KIND><id>[v<version>][@<peer>]

    s1F7v5     stage 1 forward of microbatch 7 with weight version 5
    s1B7v5     its backward, with the same version (weight stashing)
    s1W7v5     its weight-gradient pass, when the backward is split (zero-bubble kinds): the
               B of a microbatch with a W on the same rank computes only the gradient of the
               stage's inputs (sent at once); W computes the weights' gradient later, with the
               same version; the microbatch's activations are held until W
    s0SA7@1    stage 0 sends microbatch 7's activations to rank 1
    s1RA7@0    stage 1 receives them from rank 0
    s1SG7@0    stage 1 sends the gradient of microbatch 7 back to rank 0
    s0RG7@1    stage 0 receives it
    s0r1AR3    replica 1 of stage 0 all-reduces gradients of update 3 with its replicas
    s0U3v4     stage 0's optimizer step number 3, producing weight version 4
    s3TP3t0    stage 3 posts its gradient of update 3 of the shared parameter plan.tied[0] (a
               non-blocking all-reduce with every stage holding a copy)
    s3TR3v4t0  stage 3 waits for that all-reduce (every holder's TP3) and steps the parameter,
               producing its version 4
    s1UN3      a stage sharded "zero1" (``Stage.sharding``) gathers its weights whole for
               update 3 (an all-gather among its replicas; FSDP2's ``unshard``)
    s1RD3      it reduce-scatters update 3's gradient, accumulated whole over the update's
               backwards, into its shards (FSDP2's reduce-scatter, run by the B this action
               directly follows: FSDP2 reduces from a backward's hooks)
    s1RS3      it frees the gathered weights (FSDP2's ``reshard``; no communication)

``id`` is a global microbatch index for F, B, W and the transfers (minibatch t with m
microbatches per minibatch has ids t*m .. t*m+m-1; m = 1 for pipedream), and an update index
for AR, U, TP, TR, UN, RD and RS. ``version`` for F/B/W is the number of optimizer steps the weights used have
seen (w^(v)); for U and TR it is the version the step produces. ``tie`` (TP and TR only) indexes
``plan.tied``; a shared parameter's version at an F is the number of its TR steps before the F
on that rank, and its B uses the F's (docs/architecture.md, "Shared parameters").
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from ..util.jsonio import read_json, write_json
from ..plans.plan import Plan

__all__ = ["Kind", "Action", "Schedule", "ScheduleFormatError", "parse_action", "split_backwards", "message_key"]


class ScheduleFormatError(ValueError):
    """A schedule file or action string could not be read."""


class Kind(str, enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    WEIGHT_GRAD = "W"
    SEND_ACT = "SA"
    RECV_ACT = "RA"
    SEND_GRAD = "SG"
    RECV_GRAD = "RG"
    ALLREDUCE = "AR"
    OPTIMIZER_STEP = "U"
    TIED_POST = "TP"
    TIED_REDUCE = "TR"
    UNSHARD = "UN"
    REDUCE_GRAD = "RD"
    RESHARD = "RS"

    @property
    def is_compute(self) -> bool:
        return self in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT_GRAD)

    @property
    def is_send(self) -> bool:
        return self in (Kind.SEND_ACT, Kind.SEND_GRAD)

    @property
    def is_recv(self) -> bool:
        return self in (Kind.RECV_ACT, Kind.RECV_GRAD)

    @property
    def is_transfer(self) -> bool:
        return self.is_send or self.is_recv

    @property
    def is_gather(self) -> bool:
        """A zero1 stage's gather, reduce-scatter or reshard of its weights (UN, RD, RS)."""
        return self in (Kind.UNSHARD, Kind.REDUCE_GRAD, Kind.RESHARD)


_ACTION_RE = re.compile(
    r"^s(?P<stage>\d+)(?:r(?P<replica>\d+))?(?P<kind>SA|RA|SG|RG|AR|TP|TR|UN|RD|RS|F|B|W|U)(?P<id>\d+)"
    r"(?:v(?P<version>\d+))?(?:t(?P<tie>\d+))?(?:@(?P<peer>\d+))?$"
)


@dataclass(frozen=True)
class Action:
    """One step of one rank's program. Immutable and hashable."""

    stage: int
    kind: Kind
    id: int
    replica: int = 0
    version: int | None = None
    peer: int | None = None
    tie: int | None = None

    def __str__(self) -> str:
        text = f"s{self.stage}"
        if self.replica:
            text += f"r{self.replica}"
        text += f"{self.kind.value}{self.id}"
        if self.version is not None:
            text += f"v{self.version}"
        if self.tie is not None:
            text += f"t{self.tie}"
        if self.peer is not None:
            text += f"@{self.peer}"
        return text

    def __repr__(self) -> str:
        return f"Action({self})"


def parse_action(text: str) -> Action:
    """Parse the compact text form back into an Action."""
    m = _ACTION_RE.match(text.strip())
    if not m:
        raise ScheduleFormatError(
            f"cannot parse action {text!r}: expected s<stage>[r<replica>]<F|B|W|SA|RA|SG|RG|AR|TP|TR|UN|RD|RS|U><id>[v<version>]"
            "[t<tie>][@<peer>]"
        )
    g = m.groupdict()
    return Action(
        stage=int(g["stage"]),
        kind=Kind(g["kind"]),
        id=int(g["id"]),
        replica=int(g["replica"] or 0),
        version=None if g["version"] is None else int(g["version"]),
        peer=None if g["peer"] is None else int(g["peer"]),
        tie=None if g["tie"] is None else int(g["tie"]),
    )


def split_backwards(actions: Iterable[Action]) -> set[tuple[int, int]]:
    """(stage, microbatch) of every backward one rank's list splits: those it has a W for (their
    B computes the inputs' gradient only); keyed by stage, as a rank may hold several."""
    return {(a.stage, a.id) for a in actions if a.kind is Kind.WEIGHT_GRAD}


def message_key(a: Action) -> tuple[int, int]:
    """What a transfer carries: (the stage whose forward produced the activations, microbatch).
    SA and RG name that stage, RA and SG the next one; a rank holding several stages (virtual
    stages) sends and receives messages of more than one on the same channel."""
    return (a.stage if a.kind in (Kind.SEND_ACT, Kind.RECV_GRAD) else a.stage - 1), a.id


@dataclass
class Schedule:
    """A plan plus, for every rank, the ordered list of actions it runs.

    Attributes:
        plan: the plan the schedule was generated for.
        kind: the generator's name (pipedream, 2bw, flush, gpipe, naive, ...).
        minibatches: number of minibatches (optimizer-visible batches) the schedule covers.
        microbatches: microbatches per minibatch (1 for pipedream / naive).
        actions: rank -> ordered actions.
        options: generator options (e.g. vertical_sync) kept for provenance; ``max_inflight``
            declares a schedule's own bound on in-flight microbatches per rank where it holds
            more than its kind's (an order imported from torch, torch_text.py).
    """

    plan: Plan
    kind: str
    minibatches: int
    microbatches: int
    actions: dict[int, list[Action]]
    options: dict[str, Any] | None = None

    def total_actions(self) -> int:
        return sum(len(a) for a in self.actions.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "torchpipedream.Schedule",
            "format_version": 1,
            "kind": self.kind,
            "minibatches": self.minibatches,
            "microbatches": self.microbatches,
            "options": self.options or {},
            "plan": self.plan.to_dict(),
            "actions": {str(r): " ".join(str(a) for a in acts) for r, acts in sorted(self.actions.items())},
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "schedule") -> "Schedule":
        if not isinstance(data, dict) or data.get("format_version") != 1:
            raise ScheduleFormatError(f"{source}: not a torchpipedream schedule (format_version 1)")
        try:
            actions = {
                int(r): [parse_action(tok) for tok in text.split()] for r, text in data["actions"].items()
            }
            return cls(
                plan=Plan.from_dict(data["plan"], source=f"{source}: plan"),
                kind=data["kind"],
                minibatches=int(data["minibatches"]),
                microbatches=int(data["microbatches"]),
                actions=actions,
                options=dict(data.get("options") or {}),
            )
        except KeyError as exc:
            raise ScheduleFormatError(f"{source}: missing field {exc}") from None
        except ScheduleFormatError as exc:
            raise ScheduleFormatError(f"{source}: {exc}") from None

    def save(self, path: str | Path) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> "Schedule":
        return cls.from_dict(read_json(path, ScheduleFormatError), source=str(path))
