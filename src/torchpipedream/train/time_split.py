"""Where a run's time went against where its prediction put it: the report's "time split".

The run's prediction is a simulated trace of the same schedule; the run leaves a measured trace
of its last epoch. Both are split the same way (``Trace.time_split``): per rank, seconds per
minibatch computing, in transfers and waits (transfers and all-reduces, a wait for the peer
included) and outside any action (the engine, idle), and per stage and compute kind
(``Trace.pass_time``). When the run is slower than predicted, the report names, on the busiest
rank (the bottleneck: the others' extra waits follow from it), the term whose measured time
exceeds its prediction most, and the compute pass furthest above its own, so that a user can
tell a slow kernel (compute) from slow messages or a late peer
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
    """``trace``'s time split per minibatch, as JSON: ``ranks`` (rank → term → seconds),
    ``passes`` ("stage S K" → seconds) and ``stages`` (rank → the stages it ran)."""
    stages: dict[str, set[int]] = {}
    for e in trace.events:
        stages.setdefault(str(e.rank), set()).add(e.stage)
    return {"ranks": {str(r): terms for r, terms in trace.time_split(minibatches).items()},
            "passes": {f"stage {s} {k}": t for (s, k), t in sorted(trace.pass_time(minibatches).items())},
            "stages": {r: sorted(held) for r, held in sorted(stages.items())}}


def largest_miss(measured: dict[str, Any], predicted: dict[str, Any]) -> dict[str, Any] | None:
    """What made the run slower than predicted, on its busiest rank (the most seconds per
    minibatch computing and between actions: the pipeline's bottleneck; the others' extra
    waits follow from it): that rank's term whose excess over its prediction is largest
    (``excess_s``), where its compute and outside-actions excesses are its own and the rest of
    the run's excess per minibatch is counted as transfers and waits; and, of its stages, the
    compute pass with the largest measured / predicted ratio. None when the run was not slower
    or a side is missing."""
    ranks = [r for r in measured.get("ranks", {}) if r in predicted.get("ranks", {})]
    if not ranks:
        return None
    m, p = measured["ranks"], predicted["ranks"]
    busiest = max(ranks, key=lambda r: m[r]["compute"] + m[r]["outside actions"])
    gap = sum(m[busiest].values()) - sum(p[busiest].values())
    if gap <= 0:
        return None
    own = {t: m[busiest][t] - p[busiest][t] for t in ("compute", "outside actions")}
    excess = dict(own, **{"transfers and waits": gap - sum(own.values())})
    term = max(TERMS, key=lambda t: excess[t])
    held = measured.get("stages", {}).get(busiest)  # its own passes (all where a split predates the record)
    ratios = [(measured["passes"][name] / t, name) for name, t in predicted.get("passes", {}).items()
              if t > 0 and name in measured.get("passes", {}) and (held is None or int(name.split()[1]) in held)]
    worst = max(ratios) if ratios else None
    return {"rank": int(busiest), "term": term, "excess_s": excess[term], "gap_s": gap,
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
            text = (f"{miss['term']} on rank {miss['rank']} (the busiest), {miss['excess_s'] * 1e3:+.2f} of the "
                    f"{miss['gap_s'] * 1e3:+.2f} ms per minibatch the run took over its prediction")
            if miss["pass"] is not None:
                text += f"; the compute furthest above its prediction: {miss['pass']} ({miss['pass_ratio']:.2f}×)"
            rows.append(("missed most", text))
    return rows
