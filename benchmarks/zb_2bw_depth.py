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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from doc_tables import zb_2bw_depth  # noqa: E402  (the docs render the .md the same way)

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


def main(argv: list[str] | None = None) -> int:
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
    table = zb_2bw_depth(data)
    out.with_suffix(".md").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
