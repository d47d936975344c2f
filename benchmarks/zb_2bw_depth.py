"""zb-2bw against 2bw on deep pipelines: simulated from the reference GPU profiles.

zb-2bw runs 2bw's updates (batch t on W^(t−1), two weight versions) with every backward split
into B and W. On equal stages it keeps the pipeline full from m ≥ n/2 microbatches per batch,
where 2bw's order needs m ≥ n − 1 (tests/test_zb_2bw_schedule.py). This script asks what that
is worth on real models' shapes: for each reference profile (per-layer times measured on GPUs,
reference_profiles/README.md), depth n and microbatches m, it plans one straight cut of n stages
(the planner, 2bw) and simulates both kinds on it with the profile's durations (the W share of
each backward is the simulator's assumed ``WEIGHT_GRAD_SHARE``), and reports batches per second, the
steady bubble and the memory model's peak of the busiest stage.

These are predictions: this machine has 2 CPU cores and no GPU, so a deep pipeline cannot be
measured here; docs/benchmarks.md ("Asynchronous split backward") shows the 2-process
measurement beside them.

Run:  .venv/bin/python benchmarks/zb_2bw_depth.py
Prints a table; writes benchmarks/results/zb_2bw_depth.json and .md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from table_format import Data, Table, span, table  # noqa: E402

from torchpipedream.search.planner import plan as make_plan  # noqa: E402
from torchpipedream.model.profiles import load_profile  # noqa: E402
from torchpipedream.schedule.build import build_schedule  # noqa: E402
from torchpipedream.sim.simulator import WEIGHT_GRAD_SHARE, Costs, simulate  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODELS = ("vgg16", "resnet50", "gnmt")
DEPTHS = (4, 8)
KINDS = ("2bw", "zb-2bw")


def microbatch_counts(n: int) -> list[int]:
    """From a quarter of the depth to the depth: below n/2 neither kind is full, from n − 1 both."""
    return sorted({max(1, n // 4), n // 2, (3 * n) // 4, n - 1, n})


def case(model: str, n: int, m: int, bandwidth: str, batches: int, memory_Bps: float) -> dict:
    """One straight n-stage cut (planned for 2bw), both kinds simulated on it; gradients
    accumulate and stashes copy at ``memory_Bps`` (the simulator's defaults are a CPU's)."""
    graph = load_profile(model)
    cut = make_plan(graph, f"{n}:{bandwidth}", schedule="2bw", microbatches=m, num_stages=n, straight=True)
    out: dict = {"model": model, "stages": n, "microbatches": m, "plan": cut.summary}
    for kind in KINDS:
        plan = dataclasses.replace(cut, schedule=kind)
        sim = simulate(build_schedule(plan, kind, minibatches=batches, microbatches=m),
                       Costs.from_plan(plan, microbatches=m, accumulate_Bps=memory_Bps, copy_Bps=memory_Bps))
        out[kind] = {"batches_per_s": sim.steady_minibatches_per_s, "steady_bubble": sim.steady_bubble_fraction,
                     "max_inflight": sim.max_inflight,
                     "peak_memory_bytes": max(plan.stage_memory_bytes(s, kind, m) or 0.0 for s in range(n))}
    out["zb-2bw_vs_2bw"] = out["zb-2bw"]["batches_per_s"] / out["2bw"]["batches_per_s"]
    return out


# ----------------------------------------------------------------------------- what the docs show
def zb_2bw_depth(data: Data) -> str:
    """zb_2bw_depth.json (benchmarks/zb_2bw_depth.py) → per reference model, depth and
    microbatches: 2bw and zb-2bw simulated on one cut, batches/s, steady bubble, peak memory."""
    head = ["model", "stages n", "microbatches m", "2bw batches/s", "zb-2bw batches/s", "zb-2bw / 2bw",
            "steady bubble 2bw, zb-2bw", "peak memory 2bw, zb-2bw (GB, busiest stage)"]
    body = []
    for r in data["rows"]:
        a, z = r["2bw"], r["zb-2bw"]
        body.append([r["model"], r["stages"], r["microbatches"], f"{a['batches_per_s']:.2f}",
                     f"{z['batches_per_s']:.2f}", f"**{r['zb-2bw_vs_2bw']:.2f}**",
                     f"{a['steady_bubble']:.0%}, {z['steady_bubble']:.0%}",
                     f"{a['peak_memory_bytes'] / 1e9:.2f}, {z['peak_memory_bytes'] / 1e9:.2f}"])
    meta = data["meta"]
    return (table(head, body) + f"\n\nSimulated, not measured: reference GPU profiles, one straight cut per row "
            f"(planned for 2bw), links of {meta['bandwidth']}, gradients accumulated and stashes copied at "
            f"{meta['memory_Bps'] / 1e9:.0f} GB/s, {meta['batches']} batches, the steady window; W is "
            f"{meta['weight_grad_share']:.0%} of each backward (the simulator's assumption).")



def _full(r: dict) -> bool:
    """Both kinds keep the pipeline full on equal stages (m ≥ n − 1)."""
    return r["microbatches"] >= r["stages"] - 1


def _lead_below_full(stages: int) -> Table:
    """A value: zb-2bw's lead where 2bw's order is not full, at ``stages`` stages, and the m it covers."""
    def render(d: Data) -> str:
        rows = [r for r in d["rows"] if r["stages"] == stages and not _full(r)]
        ms = [r["microbatches"] for r in rows]
        return f"{span([r['zb-2bw_vs_2bw'] for r in rows])}× ({stages} stages, m = {span(ms, 'd')})"
    return Table(("zb_2bw_depth.json",), render)


def _memory_most(d: Data) -> str:
    r = max(d["rows"], key=lambda r: r["zb-2bw"]["peak_memory_bytes"] - r["2bw"]["peak_memory_bytes"])
    more = (r["zb-2bw"]["peak_memory_bytes"] - r["2bw"]["peak_memory_bytes"]) / 1e9
    return (f"{more:.2f} GB more than 2bw on the busiest stage ({r['model']}, {r['stages']} stages, "
            f"m = {r['microbatches']})")


def _memory_less(d: Data) -> str:
    """Where zb-2bw's busiest stage holds at least 5% less than 2bw's."""
    less = [r for r in d["rows"] if r["zb-2bw"]["peak_memory_bytes"] < 0.95 * r["2bw"]["peak_memory_bytes"]]
    return "; ".join(f"{r['model']} at m = {r['microbatches']} of {r['stages']} stages" for r in less)


VALUES = {
    "depth_full_lead": Table(("zb_2bw_depth.json",),
                             lambda d: span([r["zb-2bw_vs_2bw"] for r in d["rows"] if _full(r)])),
    "depth_full_2bw_bubble": Table(("zb_2bw_depth.json",),
                                   lambda d: span([r["2bw"]["steady_bubble"] for r in d["rows"] if _full(r)], ".0%")),
    "depth_lead_8": _lead_below_full(8),
    "depth_lead_4": _lead_below_full(4),
    "depth_memory_most": Table(("zb_2bw_depth.json",), _memory_most),
    "depth_memory_less": Table(("zb_2bw_depth.json",), _memory_less),
    "weight_grad_share": Table(("zb_2bw_depth.json",), lambda d: f"{d['meta']['weight_grad_share']:.0%}"),
}
TABLES = {"zb_2bw_depth": Table(("zb_2bw_depth.json",), zb_2bw_depth)}
COMPANIONS = {"zb_2bw_depth.md": Table(("zb_2bw_depth.json",), zb_2bw_depth)}


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--bandwidth", default="10GB/s", help="the link between workers (default: %(default)s)")
    ap.add_argument("--batches", type=int, default=32, help="batches simulated per case (default: %(default)s)")
    ap.add_argument("--memory-bandwidth", type=float, default=900e9, metavar="BYTES_PER_S",
                    help="gradient accumulation and stash copies (default: a V100's HBM2, %(default).0f; the "
                         "profiles were measured on V100s)")
    ap.add_argument("--out", default=str(RESULTS / "zb_2bw_depth.json"))
    args = ap.parse_args(argv)
    rows = []
    for model in args.models.split(","):
        for n in DEPTHS:
            for m in microbatch_counts(n):
                row = case(model, n, m, args.bandwidth, args.batches, args.memory_bandwidth)
                rows.append(row)
                print(f"{model:<9} n={n} m={m:<2} 2bw {row['2bw']['batches_per_s']:9.2f}  zb-2bw "
                      f"{row['zb-2bw']['batches_per_s']:9.2f} batches/s  × {row['zb-2bw_vs_2bw']:.2f}", flush=True)
    data = {"meta": {"script": "benchmarks/zb_2bw_depth.py", "kind": "simulated (reference GPU profiles)",
                     "bandwidth": args.bandwidth, "batches": args.batches, "memory_Bps": args.memory_bandwidth, "weight_grad_share": WEIGHT_GRAD_SHARE,
                     "torch": torch.__version__, "python": platform.python_version()},
            "rows": rows}
    out = Path(args.out)
    out.write_text(json.dumps(data, indent=1) + "\n")
    text = zb_2bw_depth(data)  # the docs render the .md the same way (TABLES)
    out.with_suffix(".md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
