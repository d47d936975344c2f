"""Where a run's time went against where its prediction put it: the report's "time split".

The run's prediction is a simulated trace of the same schedule; the run leaves a measured trace
of its last epoch. Both are split the same way (``Trace.time_split``): per rank, seconds per
minibatch computing, in transfers and waits (transfers and all-reduces, a wait for the peer
included) and outside any action (the engine, idle), and per stage and compute kind
(``Trace.pass_time``). When the run is slower than predicted, the report names the term whose
measured time exceeds its prediction most, and the compute pass furthest above its own, so
that a user can tell a slow kernel (compute) from slow messages or a late peer
(transfers and waits) from the library's own overhead (outside actions).
"""

from __future__ import annotations

from typing import Any

from ..sim.trace import Trace

__all__ = ["TERMS", "split_of", "largest_miss", "split_lines"]

TERMS = ("compute", "transfers and waits", "outside actions")
#: below this share of the predicted throughput the report names what missed
NAMED_BELOW = 0.9
#: ranks listed one per line; more are summarised by the largest miss alone
LISTED_RANKS = 4


def split_of(trace: Trace, minibatches: int) -> dict[str, Any]:
    """``trace``'s time split per minibatch, as JSON: ``ranks`` (rank → term → seconds) and
    ``passes`` ("stage S K" → seconds)."""
    return {"ranks": {str(r): terms for r, terms in trace.time_split(minibatches).items()},
            "passes": {f"stage {s} {k}": t for (s, k), t in sorted(trace.pass_time(minibatches).items())}}


def largest_miss(measured: dict[str, Any], predicted: dict[str, Any]) -> dict[str, Any] | None:
    """The rank and term whose measured seconds per minibatch exceed the prediction most
    (``excess_s``), and the compute pass with the largest measured / predicted ratio; None when
    nothing exceeds its prediction or a side is missing."""
    rows = [(m[t] - predicted["ranks"][r][t], r, t) for r, m in measured.get("ranks", {}).items()
            if r in predicted.get("ranks", {}) for t in TERMS]
    if not rows or max(rows)[0] <= 0:
        return None
    excess, rank, term = max(rows)
    ratios = [(measured["passes"][p] / t, p) for p, t in predicted.get("passes", {}).items()
              if t > 0 and p in measured.get("passes", {})]
    worst = max(ratios) if ratios else None
    return {"rank": int(rank), "term": term, "excess_s": excess,
            "pass": worst[1] if worst else None, "pass_ratio": worst[0] if worst else None}


def split_lines(split: dict[str, Any] | None, throughput_ratio: float | None) -> list[tuple[str, str]]:
    """The report's rows: each rank's terms, measured (predicted), in ms per minibatch, and
    when the run reached under ``NAMED_BELOW`` of its predicted throughput, what missed most."""
    if not split or not split.get("predicted") or not split.get("measured"):
        return []
    measured, predicted = split["measured"], split["predicted"]
    rows = []
    ranks = [r for r in measured["ranks"] if r in predicted["ranks"]]
    if len(ranks) <= LISTED_RANKS:
        for r in ranks:
            rows.append(("time split", f"rank {r}: " + ", ".join(
                f"{t} {measured['ranks'][r][t] * 1e3:.2f} ms (predicted {predicted['ranks'][r][t] * 1e3:.2f})"
                for t in TERMS) + " per minibatch"))
    if throughput_ratio is not None and throughput_ratio < NAMED_BELOW:
        miss = largest_miss(measured, predicted)
        if miss is not None:
            text = f"{miss['term']} on rank {miss['rank']}, {miss['excess_s'] * 1e3:+.2f} ms per minibatch over its prediction"
            if miss["pass"] is not None:
                text += f"; the compute furthest above its prediction: {miss['pass']} ({miss['pass_ratio']:.2f}×)"
            rows.append(("missed most", text))
    return rows
