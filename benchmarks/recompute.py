"""Activation recomputation side by side: time and memory with and without it, on one plan.

For each model and schedule, the planner's straight pipeline of ``--procs`` stages runs twice
per pass, as planned and with ``Stage.recompute`` on every stage (the same cut, so the difference
is recomputation alone); rows run in interleaved passes (the machine's speed drifts). For each
row: samples/s (median over passes of the median timed window), the simulator's prediction
made just before the run (recomputation charged as one more forward per backward), and the
peak resident memory of each rank (VmHWM of a freshly spawned worker). A CPU probe runs at the
start and the end; a run whose probes disagree by more than 15% is flagged.

    .venv/bin/python benchmarks/recompute.py
    .venv/bin/python benchmarks/recompute.py --models transformer_lm --passes 1

Writes benchmarks/results/recompute.json and recompute.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from table_format import Data, Table, listing, span, table  # noqa: E402

SCHEDULES = ("gpipe", "flush", "pipedream")


def straight_plan(work, procs: int, kind: str, microbatches: int, minibatches: int):
    """The planner's straight pipeline of ``procs`` stages (activations are what a pipeline
    stage holds; a data-parallel plan would keep whole-model activations on every worker) and
    its schedule of ``minibatches`` minibatches."""
    from compare_rows import _profile, schedule_microbatches

    from torchpipedream.plans.topology import Topology
    from torchpipedream.schedule.build import build_schedule
    from torchpipedream.search.planner import plan as make_plan

    m = schedule_microbatches(kind, microbatches)
    plan = make_plan(_profile(work, m, 1), Topology.local(procs), schedule=kind, microbatches=m, straight=True,
                     num_stages=procs)
    return plan, build_schedule(plan, kind, minibatches=minibatches, microbatches=m)


def run_model(name: str, batch: int, procs: int, microbatches: int, windows: int, per_window: int,
              passes: int) -> list[dict]:
    import torch
    from compare_rows import WORKLOADS, _predict_and_run

    work = dataclasses.replace(WORKLOADS[name], batch_size=batch)
    jobs = []
    for kind in SCHEDULES:
        plan, sched = straight_plan(work, procs, kind, microbatches, per_window)
        for recompute in (False, True):
            p = plan.with_recompute(recompute)
            jobs.append(((kind, recompute, plan.summary),
                         functools.partial(_predict_and_run, work, p, sched, microbatches, windows, per_window, 1)))
    got: dict[tuple, list[dict]] = {key: [] for key, _ in jobs}
    for pass_ in range(passes):
        for key, run in jobs:
            res = run()
            torch.set_num_threads(1)
            got[key].append(res)
            print(f"  {name:<15} {key[0]:<10} recompute {'yes' if key[1] else 'no ':<4} pass {pass_ + 1}: "
                  f"{res['samples_per_s']:8.1f} samples/s, predicted {res['predicted_samples_per_s']:8.1f}, "
                  f"peak RSS {', '.join(f'{x:.0f}' for x in res['peak_rss_mb'])} MiB", flush=True)
    rows = []
    for (kind, recompute, summary), res in got.items():
        rows.append({
            "model": name, "batch_size": batch, "schedule": kind, "recompute": recompute, "plan": summary,
            "samples_per_s": statistics.median(r["samples_per_s"] for r in res),
            "passes_samples_per_s": [r["samples_per_s"] for r in res],
            "predicted_samples_per_s": statistics.median(r["predicted_samples_per_s"] for r in res),
            "passes_predicted_samples_per_s": [r["predicted_samples_per_s"] for r in res],
            "measured_vs_predicted": statistics.median(r["samples_per_s"] / r["predicted_samples_per_s"] for r in res),
            "peak_rss_mb": [max(r["peak_rss_mb"][i] for r in res) for i in range(procs)],
        })
    for r in rows:
        base = next(b for b in rows if b["schedule"] == r["schedule"] and not b["recompute"])
        r["vs_without"] = r["samples_per_s"] / base["samples_per_s"]
        r["predicted_vs_without"] = r["predicted_samples_per_s"] / base["predicted_samples_per_s"]
        r["rss_vs_without_mb"] = [a - b for a, b in zip(r["peak_rss_mb"], base["peak_rss_mb"])]
    return rows


# ----------------------------------------------------------------------------- what the docs show
def recompute(data: Data) -> str:
    """recompute.json (benchmarks/recompute.py) → time and peak memory with and without
    activation recomputation, per schedule."""
    head = ["model", "schedule [plan]", "recompute", "samples/s", "vs without", "predicted", "measured/predicted",
            "peak RSS per rank (MiB)", "RSS vs without (MiB)"]
    body = [[f"{r['model']} (batch {r['batch_size']})", f"{r['schedule']} [{r['plan']}]",
             "yes" if r["recompute"] else "no", f"{r['samples_per_s']:.1f}", f"{r['vs_without']:.2f}",
             f"{r['predicted_samples_per_s']:.1f}", f"{r['measured_vs_predicted']:.2f}",
             ", ".join(f"{x:.0f}" for x in r["peak_rss_mb"]), ", ".join(f"{x:+.0f}" for x in r["rss_vs_without_mb"])]
            for r in data["rows"]]
    return table(head, body)



def _with(d: Data, schedule: str) -> dict:
    return next(r for r in d["rows"] if r["schedule"] == schedule and r["recompute"])


def _rss_saved(schedule: str, stages: tuple[int, ...]) -> Table:
    """A value: MiB of peak RSS that recomputation saved on each of ``stages`` under ``schedule``."""
    return Table(("recompute.json",),
                 lambda d: listing([f"{-_with(d, schedule)['rss_vs_without_mb'][s]:.0f}" for s in stages]))


def _costs(d: Data) -> str:
    """Predicted against measured throughput with/without recomputation, per schedule."""
    rows = [r for r in d["rows"] if r["recompute"]]
    return (", ".join(f"{r['predicted_vs_without']:.2f} ({r['schedule']})" for r in rows) + " against "
            + ", ".join(f"{r['vs_without']:.2f}" for r in rows) + " measured")


VALUES = {
    "recompute_probes": Table(("recompute.json",),
                              lambda d: f"{d['probes'][0]:.2f} at the start, {d['probes'][1]:.2f} at the end"),
    "recompute_gpipe_saved": _rss_saved("gpipe", (0, 1)),
    "recompute_flush_first_saved": _rss_saved("flush", (0,)),
    "recompute_pipedream_first_saved": _rss_saved("pipedream", (0,)),
    "recompute_last_saved": Table(("recompute.json",), lambda d: listing(sorted(
        {f"{-r['rss_vs_without_mb'][-1]:.0f}" for r in d["rows"] if r["recompute"] and r["schedule"] != "gpipe"}))),
    "recompute_cost": Table(("recompute.json",),
                            lambda d: span([1 - r["vs_without"] for r in d["rows"] if r["recompute"]], ".0%")),
    "recompute_predicted": Table(("recompute.json",),
                                 lambda d: span([r["measured_vs_predicted"] for r in d["rows"]])),
    "recompute_predicted_cost": Table(("recompute.json",), _costs),
}
TABLES = {"recompute": Table(("recompute.json",), recompute)}
COMPANIONS = {"recompute.md": Table(("recompute.json",), recompute)}


def main(argv: list[str] | None = None) -> int:
    from compare_rows import WORKLOADS  # tunes the allocator, before torch is imported
    from peers import probed, write_results

    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="transformer_lm:256",
                    help="MODEL:BATCH,... from compare.py's workloads (default: %(default)s)")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--per-window", type=int, default=8)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/recompute")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    specs = [(name, int(batch or WORKLOADS[name].batch_size) if name in WORKLOADS else 0)
             for name, _, batch in (spec.partition(":") for spec in args.models.split(","))]
    for name, _ in specs:
        if name not in WORKLOADS:
            ap.error(f"unknown model {name!r}; choose from {', '.join(WORKLOADS)}")
    rows, probes, agree = probed(lambda: [row for name, batch in specs for row in run_model(
        name, batch, args.procs, args.microbatches, args.windows, args.per_window, args.passes)])
    result = {"probes": probes, "probes_agree": agree, "args": vars(args), "rows": rows}
    write_results(args.out, result, recompute(result))  # the docs render it the same way (TABLES)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
