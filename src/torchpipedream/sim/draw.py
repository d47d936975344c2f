"""Timeline pictures of traces: the workers × time figure of the PipeDream paper.

:func:`draw_timeline` draws one trace as a Gantt chart: a row per rank, forwards and backwards
in two colours with their microbatch number in the box, transfers as thin bars under the row
(activations and gradients in two shades), all-reduces hatched and optimizer steps as ticks.
:func:`draw_timelines` stacks several traces on one time scale (e.g. the four schedules on the
same plan). matplotlib runs with the Agg backend; the file type follows the suffix (png, svg,
pdf).

The README's picture of the schedules is made by ``python -m torchpipedream.sim.draw OUT.png``
(:func:`schedules_figure`).
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, Sequence

from ..plans.plan import Plan
from ..schedule.build import build_schedule
from .simulator import Costs, simulate
from .trace import Trace

__all__ = ["draw_timeline", "draw_timelines", "schedules_figure", "VizError", "COLOURS"]

log = logging.getLogger(__name__)

COLOURS = {
    "F": "#4C8BD6",  # forward: blue
    "B": "#5DB364",  # backward: green
    "W": "#A8D89A",  # weight-gradient pass of a split backward: light green
    "SA": "#9A9A9A",  # activation transfer
    "SG": "#C9A25E",  # gradient transfer
    "AR": "#D1495B",  # all-reduce
    "TR": "#7B4FB5",  # shared parameter's gradients summed across stages
    "UN": "#E08E2B",  # a zero1 stage gathers its weights
    "RD": "#B5651D",  # a zero1 stage reduce-scatters its gradient
    "U": "#222222",  # optimizer step
}
_SUFFIXES = (".png", ".svg", ".pdf")
_MAX_LABELS = 400  # boxes per panel above which numbers are not drawn


class VizError(ValueError):
    """A picture cannot be drawn (bad output path, empty trace); the message says why."""


def _check_out(out: str | Path) -> Path:
    path = Path(out)
    if path.suffix.lower() not in _SUFFIXES:
        raise VizError(f"{path}: the picture's file type comes from its suffix; use one of {', '.join(_SUFFIXES)}")
    if not path.parent.exists():
        raise VizError(f"{path}: directory {path.parent} does not exist")
    return path


def _plot(ax, trace: Trace, title: str | None, t_scale: float, unit: str) -> None:
    """Draw one trace into ``ax``."""
    ranks = trace.ranks
    row = {r: i for i, r in enumerate(ranks)}
    t0 = trace.start_s
    held = _stages_of_ranks(trace)
    bars: dict[tuple[int, str, int], list[tuple[float, float]]] = {}
    labels: list[tuple[float, float, str]] = []
    for e in trace.events:
        k = "SA" if e.kind in ("SA", "RA") else "SG" if e.kind in ("SG", "RG") else e.kind
        if e.kind in ("RA", "RG", "TP"):
            continue  # a receive is the other end of a send (its wait shows as the gap); TP only posts
        chunk = held[e.rank].index(e.stage) if e.kind in ("F", "B", "W") else 0  # which of the rank's stages
        bars.setdefault((e.rank, k, chunk), []).append(((e.start_s - t0) * t_scale,
                                                        max(e.duration_s * t_scale, 0.0)))
        if e.kind in ("F", "B", "W"):
            labels.append(((e.start_s - t0 + e.duration_s / 2) * t_scale, row[e.rank], str(e.id) + "′" * chunk))
    span = trace.makespan * t_scale or 1.0
    for (rank, k, chunk), spans in bars.items():
        y = row[rank]
        if k in ("F", "B", "W"):
            # a rank's later stages (virtual stages) in a darker shade of the same colour
            ax.broken_barh(spans, (y - 0.38, 0.62), facecolors=_shade(COLOURS[k], chunk), edgecolors="white",
                           linewidth=0.4)
        elif k in ("AR", "TR", "UN", "RD"):
            ax.broken_barh(spans, (y - 0.38, 0.62), facecolors="none", edgecolors=COLOURS[k],
                           hatch="\\\\\\\\" if k == "TR" else "////", linewidth=0.6)
        elif k == "RS":  # frees memory, moves nothing
            continue
        elif k == "U":
            w = span / 400
            ax.broken_barh([(s + d - w, w) for s, d in spans], (y - 0.42, 0.7), facecolors=COLOURS[k])
        else:
            off = 0.28 if k == "SA" else 0.38
            ax.broken_barh(spans, (y + off - 0.02, 0.08), facecolors=COLOURS[k])
    if len(labels) <= _MAX_LABELS:
        small = len(labels) > 120
        for x, y, text in labels:
            ax.text(x, y - 0.07, text, ha="center", va="center", fontsize=5.5 if small else 7, color="white")
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {r}" + _stage_tag(trace, r) for r in ranks], fontsize=8)
    ax.set_ylim(len(ranks) - 0.4, -0.6)
    ax.set_xlim(0, span * 1.01)
    ax.grid(axis="x", color="#eeeeee", linewidth=0.6)
    ax.set_axisbelow(True)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    if title:
        ax.set_title(title, loc="left", fontsize=10)


def _stages_of_ranks(trace: Trace) -> dict[int, list[int]]:
    """rank -> the stages it ran (several where it holds virtual stages), ascending."""
    out: dict[int, set[int]] = {}
    for e in trace.events:
        out.setdefault(e.rank, set()).add(e.stage)
    return {r: sorted(s) for r, s in out.items()}


def _shade(colour: str, chunk: int) -> Any:
    """``colour`` for a rank's first stage, darker for each later one."""
    from matplotlib.colors import to_rgb  # lazy: matplotlib only when a picture is drawn (sim/ loads without it)

    f = 0.62 ** chunk
    return tuple(c * f for c in to_rgb(colour))


def _stage_tag(trace: Trace, rank: int) -> str:
    for e in trace.events:
        if e.rank == rank:
            stages = _stages_of_ranks(trace)[rank]
            if len(stages) > 1:
                return " · " + "+".join(f"s{s}" for s in stages)
            return f" · s{e.stage}" + (f"r{e.replica}" if e.replica else "")
    return ""


def _time_unit(span_s: float) -> tuple[float, str]:
    if span_s >= 10:
        return 1.0, "s"
    if span_s >= 0.01:
        return 1e3, "ms"
    return 1e6, "µs"


def draw_timelines(traces: Sequence[tuple[str, Trace]], out: str | Path, width: float = 13.0,
                   time_unit: str | None = None) -> Path:
    """Stack several (title, trace) panels on one time axis and save to ``out`` (png/svg/pdf).

    Args:
        traces: panels, top to bottom.
        out: output file; the suffix picks the format.
        width: figure width in inches.
        time_unit: axis label for unit-cost pictures (e.g. "time (forward = 1)"); seconds by default.
    """
    import matplotlib  # lazy: matplotlib only when a picture is drawn (sim/ loads without it)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: after the Agg backend is chosen
    from matplotlib.patches import Patch  # lazy: as matplotlib above

    path = _check_out(out)
    traces = [(t, tr) for t, tr in traces]
    if not traces or any(not tr.events for _, tr in traces):
        raise VizError("nothing to draw: a trace has no events")
    longest = max(tr.makespan for _, tr in traces)
    scale, unit = (1.0, "") if time_unit else _time_unit(longest)
    heights = [max(1.2, 0.42 * len(tr.ranks) + 0.5) for _, tr in traces]
    fig, axes = plt.subplots(len(traces), 1, figsize=(width, sum(heights) + 0.9), sharex=True,
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (title, tr) in zip(axes[:, 0], traces):
        _plot(ax, tr, title, scale, unit)
        ax.set_xlim(0, longest * scale * 1.01)
    axes[-1, 0].set_xlabel(time_unit or f"time ({unit})")
    kinds = {e.kind for _, tr in traces for e in tr.events if e.duration_s > 0 or e.kind == "U"}
    legend = [Patch(color=COLOURS["F"], label="forward"), Patch(color=COLOURS["B"], label="backward")]
    if "W" in kinds:
        legend.append(Patch(color=COLOURS["W"], label="weight gradient (split backward)"))
    if any(len(v) > 1 for _, tr in traces for v in _stages_of_ranks(tr).values()):
        legend.append(Patch(color=_shade(COLOURS["F"], 1), label="a rank's second stage (′)"))
    if "SA" in kinds:
        legend.append(Patch(color=COLOURS["SA"], label="send activations"))
    if "SG" in kinds:
        legend.append(Patch(color=COLOURS["SG"], label="send gradients"))
    if "AR" in kinds:
        legend.append(Patch(facecolor="none", edgecolor=COLOURS["AR"], hatch="////", label="all-reduce"))
    if "TR" in kinds:
        legend.append(Patch(facecolor="none", edgecolor=COLOURS["TR"], hatch="\\\\\\\\",
                            label="shared parameter: gradients summed"))
    if "UN" in kinds:
        legend.append(Patch(facecolor="none", edgecolor=COLOURS["UN"], hatch="////", label="gather weights (zero1)"))
    if "RD" in kinds:
        legend.append(Patch(facecolor="none", edgecolor=COLOURS["RD"], hatch="////",
                            label="reduce-scatter gradient (zero1)"))
    if "U" in kinds:
        legend.append(Patch(color=COLOURS["U"], label="optimizer step"))
    fig.legend(handles=legend, loc="upper right", ncol=len(legend), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (sum(heights) + 0.9)))
    fig.savefig(path, dpi=150)
    plt.close(fig)
    log.debug("wrote %s", path)
    return path


def draw_timeline(trace: Trace, out: str | Path, title: str | None = None, width: float = 13.0) -> Path:
    """Draw one trace's Gantt chart to ``out`` (png/svg/pdf)."""
    if title is None:
        meta = trace.meta
        title = " · ".join(str(x) for x in (meta.get("schedule"), meta.get("plan"), meta.get("source")) if x)
    return draw_timelines([(title, trace)], out, width=width)


def schedules_figure(out: str | Path, stages: int = 4) -> Path:
    """The README picture: pipedream, 2bw, flush, gpipe, zb-h1, zb-h2 and zb-2bw on one straight ``stages``-stage plan,
    and interleaved and zb-v on the same model cut into twice the stages, two per worker.

    Equal stages, backward = 2 × forward (zb-h1, zb-h2: B and W one each), zero communication cost; every box is one unit of
    work (a pipedream minibatch or a microbatch of the others), 8 units in all: pipedream runs
    8 minibatches, the batched schedules 2 batches of 4 microbatches; zb-h2 2 batches of 8 (16
    units), the count from which its batches follow each other without a bubble; 2bw and zb-2bw
    also with 4 batches of 2 microbatches (fewer than 2bw needs to stay full, enough for
    zb-2bw); interleaved's
    and zb-v's boxes are half a unit (half a worker's layers each; zb-v: 2 batches of 8).
    """
    plan = Plan.straight([[f"layer{i}"] for i in range(stages)])
    # a split backward (zb-h1) runs B and W of one unit each
    costs = Costs(forward_s=[1.0] * stages, backward_s=[2.0] * stages, weight_grad_s=[1.0] * stages)
    panels = []
    for kind, minibatches, m in (("pipedream", 8, None), ("2bw", 2, 4), ("flush", 2, 4), ("gpipe", 2, 4),
                                 ("zb-h1", 2, 4), ("zb-h2", 2, 8), ("2bw", 4, 2), ("zb-2bw", 4, 2)):
        res = simulate(build_schedule(plan, kind, minibatches=minibatches, microbatches=m), costs)
        what = "8 minibatches" if m is None else f"{minibatches} batches × {m} microbatches"
        versions = "/".join(str(v) for v in res.max_versions)
        panels.append((f"{kind} — {what}; weight versions per stage {versions}; "
                       f"bubble {res.bubble_fraction:.0%}", res.trace))
    looped = Plan.looped([[f"layer{i}"] for i in range(2 * stages)], stages)
    res = simulate(build_schedule(looped, "interleaved", minibatches=2, microbatches=4),
                   Costs(forward_s=[0.5] * 2 * stages, backward_s=[1.0] * 2 * stages))
    panels.append((f"interleaved — 2 batches × 4 microbatches, two stages per worker (′: the second); "
                   f"weight versions per stage 1; bubble {res.bubble_fraction:.0%}", res.trace))
    v_shape = Plan.v_shape([[f"layer{i}"] for i in range(2 * stages)], stages)
    res = simulate(build_schedule(v_shape, "zb-v", minibatches=2, microbatches=8),
                   Costs(forward_s=[0.5] * 2 * stages, backward_s=[1.0] * 2 * stages, weight_grad_s=[0.5] * 2 * stages))
    panels.append((f"zb-v — 2 batches × 8 microbatches, two stages per worker in a V (′: the second); "
                   f"weight versions per stage 1; bubble {res.bubble_fraction:.0%}", res.trace))
    return draw_timelines(panels, out, time_unit="time (one forward = 1, backward = 2)")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m torchpipedream.sim.draw OUT.png``: draw :func:`schedules_figure`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m torchpipedream.sim.draw OUT.png|svg|pdf", file=sys.stderr)
        return 2
    try:
        print(schedules_figure(args[0]))
    except VizError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
