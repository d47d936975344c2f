"""`torchpipedream simulate`: build, prove and time schedules for a plan; one row per schedule."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ...plans.kinds import KIND_NAMES, schedule_kind
from ...plans.plan import Plan
from ...schedule.actions import Schedule
from ...util.output_files import check_output, writing
from . import CommandError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "simulate",
        help="prove and simulate a plan's schedules; print samples/s, bubble and peak memory",
        description="Build the schedule(s) for a plan, validate them (dependencies, versions, no "
        "deadlock, memory bounds) and simulate them with the plan's profiled costs and its "
        "topology's links. Prints one row per schedule: throughput over the whole run and in "
        "steady state, idle (bubble) fraction, and peak memory per stage.",
    )
    p.add_argument("plan", help="plan JSON (from `torchpipedream plan`), or a schedule JSON (from "
                   "--save-schedule, possibly edited by hand: it is validated, then simulated)")
    p.add_argument("--schedule", default=None, metavar="{" + ",".join(KIND_NAMES + ("all",)) + "}",
                   help="a schedule kind, a comma-separated list of them, or all (default: the plan's schedule)")
    p.add_argument("--minibatches", type=int, default=32,
                   help="minibatches (pipedream, naive) or batches (the other kinds) to simulate (default 32)")
    p.add_argument("--microbatches", type=int, default=None,
                   help="microbatches per batch for 2bw, flush, gpipe (default: the plan's)")
    p.add_argument("--vertical-sync", action="store_true", help="pipedream with vertical sync")
    p.add_argument("--trace", default=None,
                   help="write the simulated trace JSON here (with several schedules: NAME.<schedule>.json)")
    p.add_argument("--chrome", default=None, help="write Chrome/Perfetto trace JSON here (same naming)")
    p.add_argument("--timeline", default=None, help="draw the timeline(s) here (.png, .svg or .pdf), stacked")
    p.add_argument("--save-schedule", default=None,
                   help="write the generated schedule JSON here (same naming); edit it and pass it back as PLAN")
    p.set_defaults(handler=run)


def _kinds(text: str | None, plan_kind: str) -> list[str]:
    if text is None:
        return [plan_kind]
    if text.strip().lower() == "all":
        return list(KIND_NAMES)
    kinds = [k.strip().lower() for k in text.split(",") if k.strip()]
    bad = [k for k in kinds if k not in KIND_NAMES]
    if bad or not kinds:
        raise CommandError(f"--schedule {text!r}: expected {', '.join(KIND_NAMES)}, a comma-separated list, or all")
    return kinds


def _named(path: str, kind: str, several: bool) -> Path:
    p = Path(path)
    return p.with_name(f"{p.stem}.{kind}{p.suffix}") if several else p


def _load_schedule(path: str) -> Any:
    """The Schedule in ``path`` if it is a schedule file, else None (it is then read as a plan)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError):
        return None  # Plan.load reports missing files and bad JSON
    if isinstance(data, dict) and data.get("format") == "torchpipedream.Schedule":
        return Schedule.from_dict(data, source=path)
    return None


def _fmt_bytes(n: float) -> str:
    for unit, factor in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= factor:
            return f"{n / factor:.3g}{unit}"
    return f"{n:.0f}B"


def _fmt_rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def _check_options(args: argparse.Namespace, plan: Plan) -> None:
    """Refuse counts below one, a plan without costs, and output files that cannot be written."""
    if args.minibatches < 1:
        raise CommandError(f"--minibatches must be a positive integer, got {args.minibatches}")
    if args.microbatches is not None and args.microbatches < 1:
        raise CommandError(f"--microbatches must be a positive integer, got {args.microbatches}")
    if all(st.forward_ms == 0 and st.backward_ms == 0 for st in plan.stages):
        raise CommandError(
            f"{args.plan}: the plan has no compute costs (forward_ms and backward_ms are 0 in every stage); "
            "make it with `torchpipedream plan` from a profiled graph"
        )
    for flag in ("trace", "chrome", "timeline", "save_schedule"):
        value = getattr(args, flag)
        if value:
            check_output(value, f"--{flag.replace('_', '-')}")
    if args.timeline and Path(args.timeline).suffix.lower() not in (".png", ".svg", ".pdf"):
        raise CommandError(f"--timeline {args.timeline}: use a .png, .svg or .pdf file name")


def run(args: argparse.Namespace) -> int:
    # lazy: every command module loads at start-up; the simulator loads when `simulate` runs (--help and show
    # start sooner)
    from ...schedule.build import ScheduleBuildError, build_schedule
    from ...schedule.validate import validate_schedule
    from ...sim.draw import draw_timelines
    from ...sim.simulator import simulate

    given = _load_schedule(args.plan)
    plan = given.plan if given is not None else Plan.load(args.plan)
    if given is not None:
        if args.schedule or args.vertical_sync or args.microbatches:
            raise CommandError(f"{args.plan} is a schedule file: --schedule, --microbatches and --vertical-sync "
                               "apply to plans only")
        validate_schedule(given)  # a hand-edited file fails here with the marked grid
    _check_options(args, plan)
    kinds = [given.kind] if given is not None else _kinds(args.schedule, plan.schedule)
    several = len(kinds) > 1
    unit = "samples/s" if plan.batch_size else "minibatches/s"
    print(f"plan {args.plan}: {plan.summary} (config {plan.config}), batch size {plan.batch_size or 'unknown'}, "
          f"topology {plan.topology or 'default links'}, "
          f"{given.minibatches if given is not None else args.minibatches} minibatches")
    pred = plan.predicted.get("samples_per_s") if plan.batch_size else plan.predicted.get("minibatches_per_s")
    if pred:
        print(f"planner's prediction for {plan.schedule}: {pred:,.1f} {unit} (slowest stage; no bubbles)")
    header = f"{'schedule':<10} {'m':>3} {unit:>14} {'steady ' + unit:>21} {'bubble':>7} {'steady':>7}  peak memory per stage"
    print(header)
    print("-" * len(header))
    panels = []
    for kind in kinds:
        info = schedule_kind(kind)
        m = args.microbatches if info.microbatched else None
        try:
            sched = given if given is not None else build_schedule(
                plan, kind, minibatches=args.minibatches, microbatches=m,
                vertical_sync=args.vertical_sync and info.stashes_weights)
        except ScheduleBuildError as exc:
            if not several:
                raise
            print(f"{kind:<10} skipped: {exc}")
            continue
        if args.save_schedule:
            with writing(_named(args.save_schedule, kind, several), "--save-schedule") as path:
                sched.save(path)
        res = simulate(sched)
        rate = res.samples_per_s if plan.batch_size else res.minibatches_per_s
        steady = res.steady_samples_per_s if plan.batch_size else res.steady_minibatches_per_s
        mem = " ".join(_fmt_bytes(b) for b in res.peak_memory_bytes)
        name = kind + (" (vsync)" if sched.options else "")
        print(f"{name:<10} {sched.microbatches:>3} {_fmt_rate(rate):>14} {_fmt_rate(steady):>21} "
              f"{res.bubble_fraction:>7.1%} {res.steady_bubble_fraction:>7.1%}  {mem}")
        if args.trace:
            with writing(_named(args.trace, kind, several), "--trace") as path:
                res.trace.save(path)
        if args.chrome:
            with writing(_named(args.chrome, kind, several), "--chrome") as path:
                res.trace.to_chrome(path)
        panels.append((f"{name}: {_fmt_rate(rate)} {unit}, bubble {res.bubble_fraction:.0%}", res.trace))
    if args.timeline and panels:
        with writing(args.timeline, "--timeline"):
            draw_timelines(panels, args.timeline)
        print(f"timeline: {args.timeline}")
    return 0
