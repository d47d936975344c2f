"""Where each rank stood when a run failed: its last actions, kept in a ring buffer.

A pipeline that stops with a timeout says which rank did not answer; to tell a bug (two ranks
waiting on each other, a schedule that differs between ranks) from a slow peer, a user needs
where *every* rank stood: the action it was in, the microbatch, the peer it waited for and
for how long, and what it finished last. torch's NCCL flight recorder keeps the same kind of
record of collectives; this one keeps the pipeline's own actions.

Cost on the hot path: one tuple written into a preallocated list per action started, and one
float per action finished (``run_actions`` already reads the clock around each action). The
record is read only when an exception is already on its way up: :meth:`FlightRecorder.standing`
gives a JSON-able dict, :meth:`FlightRecorder.summary` one line for error messages.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from ..schedule.actions import Action, Kind

__all__ = ["FlightRecorder", "DEFAULT_CAPACITY", "describe_standing", "read_reports", "standings_text"]

#: Actions kept per rank (the newest; older ones are overwritten).
DEFAULT_CAPACITY = 64

_WAITS = {
    Kind.RECV_ACT: "the activations of microbatch {id} from {peer}",
    Kind.RECV_GRAD: "the gradients of microbatch {id} from {peer}",
    Kind.SEND_ACT: "sending the activations of microbatch {id} to {peer}",
    Kind.SEND_GRAD: "sending the gradients of microbatch {id} to {peer}",
    Kind.ALLREDUCE: "the gradient all-reduce among its stage's replicas",
    Kind.TIED_REDUCE: "the all-reduce of a parameter shared between stages",
    Kind.UNSHARD: "the gather of its stage's weights among the stage's replicas (FSDP2)",
    Kind.REDUCE_GRAD: "the reduce-scatter of its stage's gradient among the stage's replicas (FSDP2)",
}


class FlightRecorder:
    """The last ``capacity`` actions (or phases such as a barrier) of one rank, with times.

    ``describe`` turns a global rank into words ("rank 1 (stage 1)"); ``peer_rank`` maps an
    action's peer (the schedule's worker) to the global rank this process talks to.
    """

    def __init__(self, rank: int, describe: Callable[[int], str],
                 peer_rank: Callable[[int], int] | None = None, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.rank = rank
        self.describe = describe
        self.peer_rank = peer_rank or (lambda peer: peer)
        self.capacity = capacity
        self._entries: list[list[Any] | None] = [None] * capacity  # [what, action, start, end]
        self._count = 0  # entries ever started

    def start(self, action: Action | None, what: str | None = None) -> int:
        """An action (or a named phase, ``what``) begins now; returns its number (for :meth:`finish`)."""
        self._entries[self._count % self.capacity] = [what, action, time.monotonic(), None]
        self._count += 1
        return self._count - 1

    def finish(self, number: int | None = None) -> None:
        """Entry ``number`` (default: the newest) ended now; one already overwritten is left."""
        number = self._count - 1 if number is None else number
        if 0 <= number and self._count - number <= self.capacity:
            self._entries[number % self.capacity][3] = time.monotonic()  # type: ignore[index]

    @contextlib.contextmanager
    def phase(self, what: str) -> Iterator[None]:
        """A step outside the schedule's actions (a barrier, waiting for sends, a checkpoint),
        recorded like an action; it ends only if it succeeds (a failure leaves it open)."""
        number = self.start(None, what)
        yield
        self.finish(number)

    def _ordered(self) -> list[list[Any]]:
        n = min(self._count, self.capacity)
        first = self._count - n
        return [self._entries[i % self.capacity] for i in range(first, self._count)]  # type: ignore[misc]

    def _entry(self, entry: list[Any], now: float) -> dict[str, Any]:
        what, action, start, end = entry
        out: dict[str, Any] = {"what": what or str(action)}
        if action is not None:
            out.update(action=str(action), kind=action.kind.name, stage=action.stage, microbatch=action.id)
            if action.peer is not None:
                peer = self.peer_rank(action.peer)
                out.update(peer=peer, peer_is=self.describe(peer))
            if action.kind in _WAITS:
                out["waits_for"] = _WAITS[action.kind].format(id=action.id, peer=out.get("peer_is", "?"))
        if end is None:  # in progress: for how long
            out["waited_s"] = round(now - start, 3)
        else:  # finished: how long it took, and how long ago it ended
            out.update(took_s=round(end - start, 6), ago_s=round(now - end, 3))
        return out

    def standing(self) -> dict[str, Any]:
        """Where this rank stands now: the entry in progress (if any, with the seconds it has
        waited), the last one finished, and the newest entries (oldest first), as JSON-able data."""
        now = time.monotonic()
        entries = [self._entry(e, now) for e in self._ordered()]
        current = entries[-1] if entries and "waited_s" in entries[-1] else None
        done = [e for e in entries if "took_s" in e]
        within = [e["what"] for e in entries[:-1] if "waited_s" in e]  # open phases around it ("training")
        return {"rank": self.rank, "is": self.describe(self.rank), "actions_started": self._count,
                "current": current, "within": within, "last_finished": done[-1] if done else None,
                "recent": entries}

    def summary(self) -> str:
        """One line: where this rank stands (for error messages)."""
        return describe_standing(self.standing())

    def write(self, path: str | Path, error: str | None = None) -> Path:
        """Write :meth:`standing` (and the error this rank saw) as JSON to ``path``."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = dict(self.standing(), error=error)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
        return path


def describe_standing(standing: dict[str, Any]) -> str:
    """A rank's :meth:`FlightRecorder.standing` in one line."""
    who = standing.get("is") or f"rank {standing.get('rank')}"
    current, last = standing.get("current"), standing.get("last_finished")
    if current is not None:
        waits = f" ({current['waits_for']})" if current.get("waits_for") else ""
        text = f"{who} was in {current['what']}{waits} for {current['waited_s']:.2f} s"
    elif standing.get("actions_started"):
        text = f"{who} was between actions"
    else:
        text = f"{who} had started no action"
    if standing.get("within"):
        text += f", during {standing['within'][-1]}"
    if last is not None:
        text += f"; it last finished {last['what']}, {last['ago_s']:.2f} s earlier"
    return text


def standings_text(stood: dict[int, str], world_size: int, describe: Callable[[int], str],
                   limit: int = 16) -> str:
    """The lines of the ranks that reported (``stood``: rank -> :func:`describe_standing`), and
    the ranks that have not (yet): hung, dead, or still running; at most ``limit`` of each."""
    silent = [r for r in range(world_size) if r not in stood]
    parts = [stood[r] for r in sorted(stood)[:limit]]
    if len(stood) > limit:
        parts.append(f"and {len(stood) - limit} more ranks' lines (each rank's Pipeline.flight_recorder)")
    if silent:
        named = ", ".join(describe(r) for r in silent[:limit]) + (f" and {len(silent) - limit} more"
                                                                  if len(silent) > limit else "")
        parts.append(f"no report yet from {named} (still computing, hung, or dead)")
    return "; ".join(parts)


def read_reports(directory: str | Path, ranks: int) -> list[str]:
    """One line per rank from the reports ranks wrote into ``directory`` (``rank<r>.json``); a
    rank that wrote none is named as such (it hung, was killed, or failed before it could)."""
    lines = []
    for r in range(ranks):
        path = Path(directory) / f"rank{r}.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            lines.append(f"rank {r}: no report (it did not reach its failure path: hung, killed, or not started)")
            continue
        lines.append(describe_standing(data))
    return lines
