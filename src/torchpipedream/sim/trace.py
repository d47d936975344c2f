"""Traces: what happened when, on which rank, produced by the simulator or the runtime.

Both interpreters of a :class:`~torchpipedream.schedule.actions.Schedule` record one :class:`Event`
per executed action (a compute, a transfer, an all-reduce, an optimizer step), so a
prediction and a measurement can be compared, summarised and drawn the same way.

A trace is saved as JSON (``Trace.save``/``Trace.load``) and can be exported to the Chrome
trace format (``Trace.to_chrome``) that https://ui.perfetto.dev and chrome://tracing open:
one process per rank, one thread per kind of activity (compute, send, receive, sync).

Example::

    trace = Trace([Event(rank=0, stage=0, kind="F", id=0, start_s=0.0, end_s=0.01,
                         action="s0F0v0", version=0)], meta={"source": "runtime"})
    trace.save("trace.json"); trace.to_chrome("chrome.json")
    print(trace.makespan, trace.bubble_fraction())
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..util.jsonio import read_json

__all__ = ["Event", "Trace", "TraceFormatError", "CATEGORIES", "COMPUTE_KINDS", "category_of"]

TRACE_FORMAT_VERSION = 1

#: Kinds that count as a rank being busy (useful work); the rest is communication/waiting.
COMPUTE_KINDS = frozenset({"F", "B", "W", "U"})

#: Chrome-trace thread per category; tid = index in this tuple.
CATEGORIES = ("compute", "send", "recv", "sync")
_CATEGORY = {"F": "compute", "B": "compute", "W": "compute", "U": "compute", "SA": "send", "SG": "send",
             "RA": "recv", "RG": "recv", "AR": "sync", "TP": "sync", "TR": "sync",
             "UN": "sync", "RD": "sync", "RS": "sync"}

_KINDS = frozenset(_CATEGORY)


class TraceFormatError(ValueError):
    """A trace file could not be read; the message says which file and field."""


def category_of(kind: str) -> str:
    """The activity category (compute, send, recv, sync) of an action kind such as "F"."""
    return _CATEGORY.get(kind, "sync")


@dataclass(slots=True)
class Event:
    """One executed action.

    Attributes:
        rank: the global rank that ran it.
        stage / replica: the stage and replica index of that rank.
        kind: the action kind's text ("F", "B", "W", "SA", "RA", "SG", "RG", "AR", "U", "TP", "TR",
            "UN", "RD", "RS").
        id: microbatch id (F, B, transfers) or update index (AR, U), as in the schedule.
        start_s / end_s: wall-clock seconds from the start of the run.
        bytes: bytes moved (transfers, all-reduce), 0 otherwise.
        action: the action's text form, e.g. "s1F7v5".
        version: weight version used (F, B) or produced (U), when known.
    """

    rank: int
    stage: int
    kind: str
    id: int
    start_s: float
    end_s: float
    bytes: int = 0
    action: str = ""
    replica: int = 0
    version: int | None = None

    def __post_init__(self) -> None:
        # Accept a Kind enum (a str subclass) as well as its text.
        if type(self.kind) is not str:
            self.kind = str(getattr(self.kind, "value", self.kind))

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass
class Trace:
    """A list of events plus provenance (``meta``: source, schedule kind, plan summary, ...).

    ``meta`` keys used by the summaries when present: ``samples_per_minibatch`` (int),
    ``minibatches`` (int).
    """

    events: list[Event]
    meta: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ queries
    @property
    def ranks(self) -> list[int]:
        return sorted({e.rank for e in self.events})

    @property
    def start_s(self) -> float:
        return min((e.start_s for e in self.events), default=0.0)

    @property
    def end_s(self) -> float:
        return max((e.end_s for e in self.events), default=0.0)

    @property
    def makespan(self) -> float:
        """Seconds from the first event's start to the last event's end."""
        return self.end_s - self.start_s if self.events else 0.0

    def median_duration_s(self, stage: int, kind: str) -> float:
        """Median seconds of the ``kind`` events ("F", "B", "W", "U", ...) of ``stage``, over its
        replicas: the stage's typical compute time, robust to a few slow outliers; 0.0 when the
        stage ran none (W where the backward is not split)."""
        durations = [e.duration_s for e in self.events if e.stage == stage and e.kind == kind]
        return statistics.median(durations) if durations else 0.0

    def busy_time(self, kinds: Iterable[str] = COMPUTE_KINDS) -> dict[int, float]:
        """Per rank, seconds spent in events of ``kinds`` (overlaps on one rank counted once)."""
        kinds = frozenset(kinds)
        per_rank: dict[int, list[tuple[float, float]]] = {}
        for e in self.events:
            lst = per_rank.get(e.rank)
            if lst is None:
                lst = per_rank[e.rank] = []
            if e.kind in kinds:
                lst.append((e.start_s, e.end_s))
        return {r: _union_length(iv) for r, iv in per_rank.items()}

    def time_split(self, minibatches: int = 1) -> dict[int, dict[str, float]]:
        """Per rank, seconds per minibatch ``compute`` (in F, B, W, U), ``transfers and waits`` (in
        the other actions and not computing: transfers and all-reduces, a wait for the peer
        included) and ``outside actions`` (between actions: the engine, idle); the three sum to
        the makespan. A prediction and a measurement split the same way say which term missed."""
        compute, acting = self.busy_time(), self.busy_time(_KINDS | {e.kind for e in self.events})
        n, span = max(minibatches, 1), self.makespan
        return {r: {"compute": compute[r] / n, "transfers and waits": (acting[r] - compute[r]) / n,
                    "outside actions": (span - acting[r]) / n} for r in sorted(acting)}

    def pass_time(self, minibatches: int = 1) -> dict[tuple[int, str], float]:
        """Seconds per minibatch in each stage's compute kind (F, B, W, U), summed over the
        stage's ranks."""
        out: dict[tuple[int, str], float] = {}
        for e in self.events:
            if e.kind in COMPUTE_KINDS:
                out[(e.stage, e.kind)] = out.get((e.stage, e.kind), 0.0) + e.duration_s / max(minibatches, 1)
        return out

    def utilisation(self, kinds: Iterable[str] = COMPUTE_KINDS, busy: dict[int, float] | None = None) -> dict[int, float]:
        """Per rank, busy time / makespan (0..1); ``busy`` reuses a ``busy_time`` result."""
        span = self.makespan
        busy = self.busy_time(kinds) if busy is None else busy
        return {r: (b / span if span > 0 else 0.0) for r, b in busy.items()}

    def bubble_fraction(self, kinds: Iterable[str] = COMPUTE_KINDS, busy: dict[int, float] | None = None) -> float:
        """1 − (total busy time over all ranks) / (ranks × makespan): the idle share."""
        span = self.makespan
        busy = self.busy_time(kinds) if busy is None else busy
        if span <= 0 or not busy:
            return 0.0
        return 1.0 - sum(busy.values()) / (len(busy) * span)

    def summary(self) -> dict[str, Any]:
        """Makespan, bubble fraction, per-rank busy seconds and utilisation, event counts."""
        counts: dict[str, int] = {}
        for e in self.events:
            counts[e.kind] = counts.get(e.kind, 0) + 1
        busy = self.busy_time()
        out: dict[str, Any] = {
            "makespan_s": self.makespan,
            "bubble_fraction": self.bubble_fraction(busy=busy),
            "busy_s": busy,
            "utilisation": self.utilisation(busy=busy),
            "events": counts,
        }
        minibatches = self.meta.get("minibatches")
        if minibatches and self.makespan > 0:
            out["minibatches_per_s"] = minibatches / self.makespan
            spm = self.meta.get("samples_per_minibatch")
            if spm:
                out["samples_per_s"] = minibatches * spm / self.makespan
        return out

    # ------------------------------------------------------------------ JSON I/O
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": "torchpipedream.Trace",
            "format_version": TRACE_FORMAT_VERSION,
            "meta": self.meta,
            "events": [asdict(e) for e in self.events],
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "trace") -> "Trace":
        if not isinstance(data, dict) or data.get("format") != "torchpipedream.Trace":
            raise TraceFormatError(
                f"{source}: not a torchpipedream trace (expected \"format\": \"torchpipedream.Trace\"); "
                "make one with `torchpipedream simulate PLAN --trace out.json` or a training run"
            )
        if data.get("format_version") != TRACE_FORMAT_VERSION:
            raise TraceFormatError(
                f"{source}: format_version {data.get('format_version')!r} is not supported "
                f"(this version reads {TRACE_FORMAT_VERSION})"
            )
        raw = data.get("events")
        if not isinstance(raw, list):
            raise TraceFormatError(f"{source}: field 'events' must be a list")
        events = []
        known = set(Event.__dataclass_fields__)
        for i, ev in enumerate(raw):
            if not isinstance(ev, dict):
                raise TraceFormatError(f"{source}: events[{i}] must be an object")
            unknown = set(ev) - known
            if unknown:
                raise TraceFormatError(f"{source}: events[{i}]: unknown field(s) {sorted(unknown)}")
            try:
                e = Event(**ev)
            except TypeError as exc:
                raise TraceFormatError(f"{source}: events[{i}]: {exc}") from None
            bad = [f for f in ("rank", "stage", "id", "replica", "bytes")
                   if not isinstance(getattr(e, f), int) or isinstance(getattr(e, f), bool) or getattr(e, f) < 0]
            if bad:
                raise TraceFormatError(f"{source}: events[{i}]: {', '.join(bad)} must be integers >= 0")
            if e.kind not in _KINDS:
                raise TraceFormatError(
                    f"{source}: events[{i}]: unknown kind {e.kind!r}; expected one of {sorted(_KINDS)}"
                )
            if not (isinstance(e.start_s, (int, float)) and isinstance(e.end_s, (int, float))) or e.end_s < e.start_s:
                raise TraceFormatError(f"{source}: events[{i}]: need numbers with end_s >= start_s")
            events.append(e)
        meta = data.get("meta") or {}
        if not isinstance(meta, dict):
            raise TraceFormatError(f"{source}: field 'meta' must be an object")
        return cls(events=events, meta=dict(meta))

    def save(self, path: str | Path) -> None:
        """Write the trace as JSON (one event per line, so diffs stay readable)."""
        d = self.to_dict()
        events = d.pop("events")
        head = json.dumps(d)[:-1]
        lines = ",\n".join(json.dumps(e) for e in events)
        Path(path).write_text(f"{head}, \"events\": [\n{lines}\n]}}\n")

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        return cls.from_dict(read_json(path, TraceFormatError), source=str(path))

    # ------------------------------------------------------------------ Chrome
    def to_chrome_dict(self) -> dict[str, Any]:
        """The Chrome trace ("traceEvents", ph "X", µs) of this trace: pid = rank, tid = category."""
        t0 = self.start_s
        out: list[dict[str, Any]] = []
        for r in self.ranks:
            stage = next((e.stage for e in self.events if e.rank == r), 0)
            out.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0,
                        "args": {"name": f"rank {r} (stage {stage})"}})
            out.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
            for tid, cat in enumerate(CATEGORIES):
                out.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": cat}})
        for e in self.events:
            args: dict[str, Any] = {"stage": e.stage, "replica": e.replica, "id": e.id}
            if e.version is not None:
                args["version"] = e.version
            if e.bytes:
                args["bytes"] = e.bytes
            cat = category_of(e.kind)
            out.append({
                "name": e.action or f"{e.kind}{e.id}",
                "cat": cat,
                "ph": "X",
                "ts": (e.start_s - t0) * 1e6,
                "dur": max(e.duration_s, 0.0) * 1e6,
                "pid": e.rank,
                "tid": CATEGORIES.index(cat),
                "args": args,
            })
        return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {k: str(v) for k, v in self.meta.items()}}

    def to_chrome(self, path: str | Path) -> None:
        """Write the Chrome trace JSON (open it in https://ui.perfetto.dev)."""
        Path(path).write_text(json.dumps(self.to_chrome_dict()) + "\n")


def _union_length(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by a set of [start, end) intervals."""
    total = 0.0
    cur_s = cur_e = None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s  # type: ignore[operator]
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s  # type: ignore[operator]
    return total
