"""Planner speed: every reference profile on 16 workers, and a 1,000-layer chain on 1,024.

Prints a table and writes benchmarks/results/planner_speed.json. Targets (issue 3): each
reference profile on 16 workers in < 1 s; the synthetic chain on 8 per server × 16 servers ×
8 racks in < 10 s and < 4 GiB. Peak memory is the process's maximum resident set size.

    .venv/bin/python benchmarks/planner_speed.py [--skip-hierarchical] [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import resource
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from table_format import Data, Table, num, table, yes  # noqa: E402

from torchpipedream.model.graph import Layer, LayerGraph  # noqa: E402
from torchpipedream.search.planner import plan  # noqa: E402
from torchpipedream.model.profiles import load_profile  # noqa: E402
MODELS = ["vgg16", "alexnet", "resnet50", "gnmt", "gnmt_large", "resnet18", "resnet101", "inception_v3",
          "densenet121", "squeezenet1_0"]


def synthetic_chain(n: int, seed: int = 0) -> LayerGraph:
    """A chain of n layers with random compute (1-10 ms), weights (0-40 MB), activations (0.1-50 MB)."""
    rng = random.Random(seed)
    layers = [Layer(f"l{i}", forward_ms=rng.uniform(0.3, 3.3), backward_ms=rng.uniform(0.7, 6.7),
                    parameter_bytes=rng.choice([0, rng.randrange(4 * 10**7)]),
                    activation_bytes=rng.randrange(10**5, 5 * 10**7)) for i in range(n)]
    return LayerGraph(layers, [(f"l{i}", f"l{i + 1}") for i in range(n - 1)], batch_size=64)


BATCH_SIZES = {"vgg16": 128, "resnet50": 128, "alexnet": 256}  # inferred, see the profiles' README
CLUSTERS = [("A (4x4)", "A"), ("B (2x8)", "B"), ("16 flat", "16:10GB/s@16GB")]


def reference_table() -> list[dict]:
    """docs/planner.md's table: chosen config, speedup over data parallel, planning time, and the
    paper's "15-1" (best split) under the same cost model for VGG-16 and AlexNet."""
    from torchpipedream.search.planner import best_split_for_replicas
    from torchpipedream.plans.topology import Topology

    rows = []
    print("| model | cluster | our plan | ms/minibatch | samples/s | speedup vs DP | planning s | "
          "paper DP (hierarchical) plan, ms | 15-1 ms (ours ≤) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for model in ["vgg16", "alexnet", "resnet50", "gnmt", "gnmt_large"]:
        g = load_profile(model)
        g.batch_size = BATCH_SIZES.get(model)
        for label, spec in CLUSTERS:
            topo = Topology.parse(spec)
            t0 = time.perf_counter()
            p = plan(g, topo)
            dt = time.perf_counter() - t0
            paper = plan(g, topo, method="hierarchical")
            ms = p.predicted["time_per_minibatch_s"] * 1e3
            row = {"model": model, "cluster": label, "topology": topo.to_spec(), "config": p.config,
                   "ms": ms, "samples_per_s": p.predicted["samples_per_s"],
                   "speedup": p.predicted["speedup_over_data_parallel"], "planning_s": dt,
                   "paper_config": paper.config, "paper_ms": paper.predicted["time_per_minibatch_s"] * 1e3}
            if model in ("vgg16", "alexnet"):
                row["ms_15_1"], _ = best_split_for_replicas(g.linearize(), topo, [15, 1])
                assert ms <= row["ms_15_1"] * (1 + 1e-9)
            rows.append(row)
            sps = "—" if row["samples_per_s"] is None else f"{row['samples_per_s']:.0f}"
            t151 = f"{row['ms_15_1']:.2f}" if "ms_15_1" in row else ""
            print(f"| {model} | {label} | {p.config} | {ms:.2f} | {sps} | {row['speedup']:.2f} | {dt:.3f} | "
                  f"{paper.config} ({row['paper_ms']:.2f}) | "
                  f"{t151} |")
    return rows


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # kB on Linux


# ----------------------------------------------------------------------------- what the docs show
def planner_reference(data: Data) -> str:
    """planner_speed.json (benchmarks/planner_speed.py) → the plans for the paper's models and clusters."""
    head = ["model", "cluster", "our plan", "ms/minibatch", "samples/s", "speedup vs DP", "planning s",
            "paper DP (hierarchical) plan, ms", "15-1 ms (ours ≤)"]
    body = [[r["model"], r["cluster"], r["config"], f"{r['ms']:.2f}", num(r["samples_per_s"], ".0f"),
             f"{r['speedup']:.2f}", f"{r['planning_s']:.3f}", f"{r['paper_config']} ({r['paper_ms']:.2f})",
             num(r.get("ms_15_1"))] for r in data["reference_table"]]
    return table(head, body)


def planner_speed(data: Data) -> str:
    """planner_speed.json → blocks per profile and planning time, fast method against the paper's DP,
    and the targets of issue 3."""
    head = ["profile", "blocks", "topology", "plan", "fast s", "paper DP s", "feasibility tests"]
    body, refs, chain = [], [], None
    for r in data["rows"]:
        if "stages" in r:  # the synthetic chain: its plan has hundreds of stages
            chain = r
            plan = f"{r['stages']} stages on {r['workers']:,} workers"
        else:
            refs.append(r)
            plan = r["config"]
        body.append([r["case"], f"{r['blocks']:,}", f"`{r['topology']}`", plan, f"{r['fast_s']:.3f}",
                     num(r["hierarchical_s"], ".3f"), r["checks"]])
    text = table(head, body)
    notes = []
    if refs:
        slowest = max(refs, key=lambda r: r["fast_s"])
        notes.append(f"Slowest reference profile: {slowest['case']}, {slowest['fast_s']:.3f} s "
                     f"(target < 1 s: {yes(slowest['fast_s'] < 1.0)}).")
    if chain is not None:
        notes.append(f"{chain['case']}: {chain['fast_s']:.2f} s (target < 10 s: {yes(chain['fast_s'] < 10)}); "
                     f"peak resident memory of the benchmark process {chain['peak_rss_gib']:.2f} GiB "
                     f"(target < 4 GiB: {yes(chain['peak_rss_gib'] < 4)}).")
    return text + ("\n\n" + " ".join(notes) if notes else "")


TABLES = {"planner_reference": Table(("planner_speed.json",), planner_reference),
          "planner_speed": Table(("planner_speed.json",), planner_speed)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--skip-hierarchical", action="store_true", help="do not time the paper's DP")
    ap.add_argument("--quick", action="store_true", help="only the five models of docs/planner.md")
    ap.add_argument("--skip-table", action="store_true", help="skip the reference-profile table of docs/planner.md")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "planner_speed.json"))
    args = ap.parse_args()
    reference = [] if args.skip_table else reference_table()
    rows = []
    print(f"{'case':<28} {'topology':<26} {'config':<24} {'fast s':>8} {'paper DP s':>10} {'checks':>6}")
    models = MODELS[:5] if args.quick else MODELS
    for model in models:
        g = load_profile(model)
        spec = "16:10GB/s"
        t0 = time.perf_counter()
        p = plan(g, spec, memory_bytes=None)
        fast_s = time.perf_counter() - t0
        paper_s = None
        if not args.skip_hierarchical:
            t0 = time.perf_counter()
            plan(g, spec, memory_bytes=None, method="hierarchical")
            paper_s = time.perf_counter() - t0
        rows.append({"case": model, "blocks": len(g.linearize()), "topology": spec, "config": p.config,
                     "fast_s": fast_s, "hierarchical_s": paper_s, "checks": p.meta["feasibility_checks"]})
        print(f"{model:<28} {spec:<26} {p.config[:24]:<24} {fast_s:8.3f} "
              f"{'' if paper_s is None else f'{paper_s:10.3f}':>10} {p.meta['feasibility_checks']:6d}")
    g = synthetic_chain(1000)
    spec = "8x16x8:25GB/s,12.5GB/s,3.125GB/s"
    t0 = time.perf_counter()
    p = plan(g, spec, memory_bytes=None)
    big_s = time.perf_counter() - t0
    rss = peak_rss_gib()
    rows.append({"case": "chain-1000", "blocks": 1000, "topology": spec, "config": p.summary,
                 "stages": p.num_stages, "workers": p.num_workers, "fast_s": big_s, "hierarchical_s": None,
                 "checks": p.meta["feasibility_checks"], "peak_rss_gib": rss,
                 "time_per_minibatch_ms": p.predicted["time_per_minibatch_s"] * 1e3})
    print(f"{'chain-1000 (1,024 workers)':<28} {spec:<26} {f'{p.num_stages} stages':<24} {big_s:8.3f} "
          f"{'':>10} {p.meta['feasibility_checks']:6d}")
    print(f"peak resident memory of this process: {rss:.2f} GiB")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": platform.platform(), "python": platform.python_version(),
                               "rows": rows, "reference_table": reference}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
