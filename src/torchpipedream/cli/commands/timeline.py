"""`torchpipedream timeline`: draw a trace (simulated or measured) as a Gantt chart."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ...sim.trace import Trace
from ...util.output_files import check_output, writing
from . import CommandError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "timeline",
        help="draw a trace as a workers × time picture, or export it for Perfetto",
        description="Draw a trace JSON (from `torchpipedream simulate --trace` or a training run) "
        "as a Gantt chart: a row per rank, forward and backward boxes numbered by microbatch, "
        "transfers, all-reduces and optimizer steps. --chrome writes the Chrome trace format that "
        "https://ui.perfetto.dev opens.",
    )
    p.add_argument("trace", nargs="+", help="trace JSON; several are stacked on one time axis "
                   "(e.g. a simulated and a measured run of the same schedule)")
    p.add_argument("--out", default=None, help="picture file (.png, .svg or .pdf)")
    p.add_argument("--chrome", default=None, help="write Chrome/Perfetto trace JSON here (first trace)")
    p.add_argument("--title", default=None, help="title above the chart (default: schedule and plan)")
    p.set_defaults(handler=run)


def _panel(path: str, trace: Trace) -> tuple[str, Trace]:
    """A stacked panel's title (the file's name, its schedule and source) and its trace."""
    what = " · ".join(str(x) for x in (trace.meta.get("schedule"), trace.meta.get("source")) if x)
    return f"{Path(path).name}" + (f" ({what})" if what else ""), trace


def run(args: argparse.Namespace) -> int:
    # lazy: every command module loads at start-up; drawing (with the simulator it imports) loads when `timeline` runs
    from ...sim.draw import draw_timeline, draw_timelines

    if not args.out and not args.chrome:
        raise CommandError("nothing to do: give --out PICTURE.png|svg and/or --chrome OUT.json")
    for flag in ("out", "chrome"):
        value = getattr(args, flag)
        if value:
            check_output(value, f"--{flag}")
    traces = []
    for path in args.trace:
        trace = Trace.load(path)
        if not trace.events:
            raise CommandError(f"{path}: the trace has no events")
        s = trace.summary()
        print(f"{path}: {len(trace.events)} events on {len(trace.ranks)} ranks, makespan "
              f"{s['makespan_s'] * 1e3:.3f} ms, bubble {s['bubble_fraction']:.1%}")
        traces.append((path, trace))
    if args.out:
        with writing(args.out, "--out"):
            if len(traces) == 1:
                draw_timeline(traces[0][1], args.out, title=args.title)
            else:
                draw_timelines([_panel(path, tr) for path, tr in traces], args.out)
        print(f"timeline: {args.out}")
    if args.chrome:
        with writing(args.chrome, "--chrome"):
            traces[0][1].to_chrome(args.chrome)
        print(f"chrome trace: {args.chrome} (open in https://ui.perfetto.dev)")
    return 0
