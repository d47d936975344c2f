"""flush and gpipe: the planner's time per minibatch against the simulator, and a per-stage fill.

For each reference profile (per-layer times measured on GPUs, reference_profiles/README.md),
topology, kind (flush, gpipe) and microbatch count, the planner plans as asked (it may
replicate stages) and straight; the simulator runs each plan's schedule (gradients accumulated
at a GPU's memory speed) and its steady time per minibatch is read. Beside the planner's own
prediction, the bottleneck stage's time times the fill (μ + n − 1)/μ, the table shows what a
per-stage fill would predict for the same plan: the slowest stage s busy for its time per
minibatch, and every other stage and cut passing a single microbatch before and after it,
max_s [busy_s + Σ_{s'≠s} compute_s' / μ] + Σ_cuts transfers / μ (``per_stage_fill_ms``: not
the planner's rule; the planner's search and its optimality tests are built on the
bottleneck). Counting a cut's transfers of the whole minibatch as busy time of its own, like a
stage's, predicted replicated plans too slow (docs/changelog.md, ninth session). "Formed on" are the
profiles the planner's cost model was developed on; the others were not looked at for it.

These are predictions of GPU runs: this machine has 2 CPU cores and no GPU.

Run:  .venv/bin/python benchmarks/flush_predictions.py
Prints a table; writes benchmarks/results/flush_predictions.json.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from table_format import Data, Table, print_and_write, table  # noqa: E402
# the same profiles, topologies and simulation as the zb-h1/zb-h2 replicas' table
from zero_bubble_replicas import (FORMED_ON, HELD_OUT, MICROBATCHES, TOPOLOGIES, simulated_ms,  # noqa: E402
                                  simulation_arguments, simulation_meta)

KINDS = ("flush", "gpipe")


def per_stage_fill_ms(busy_ms: list[float], compute_ms: list[float], cut_ms: list[float], microbatches: int) -> float:
    """max_s [busy_s + Σ_{s'≠s} compute_s' / μ] + Σ cut / μ (see the module docstring)."""
    passes = sum(compute_ms) / microbatches
    return max(busy + passes - own / microbatches for busy, own in zip(busy_ms, compute_ms)) + sum(cut_ms) / microbatches


def alternative_ms(plan, graph, topology: str) -> tuple[float, float]:
    """(the planner's evaluation of ``plan`` again, the per-stage fill's) in ms per minibatch."""
    from torchpipedream.search.planner import evaluate

    chain = graph.linearize()
    stages = [(i, j, st.replicas) for (i, j), st in zip(plan.meta["blocks"], plan.stages)]
    ev = evaluate(chain, topology, stages, plan.schedule, plan.microbatches)
    compute = [sum(b.compute_ms for b in chain[i:j + 1]) for i, j, _ in stages]
    return ev.minibatch_ms, per_stage_fill_ms(ev.stage_ms, compute, ev.cut_ms, plan.microbatches)


def case(graph, model: str, topology: str, kind: str, mu: int, straight: bool, memory_Bps: float,
         batches: int) -> dict | None:
    """One request planned and simulated; None where it cannot be planned."""
    from torchpipedream.plans.plan import PlanError
    from torchpipedream.plans.topology import Topology
    from torchpipedream.search.planner import plan as make_plan

    try:
        made = make_plan(graph, topology, schedule=kind, microbatches=mu, straight=straight)
    except PlanError:
        return None
    again, alternative = alternative_ms(made, graph, Topology.from_any(topology))
    predicted = made.predicted["time_per_minibatch_s"] * 1e3
    if abs(again - predicted) > 1e-6 * predicted:
        raise RuntimeError(f"{model} {topology} {kind}: evaluate gives {again} ms, the plan says {predicted} ms")
    return {"model": model, "held_out": model in HELD_OUT, "topology": topology, "kind": kind, "microbatches": mu,
            "straight": straight, "plan": made.summary, "predicted_ms": predicted, "per_stage_fill_ms": alternative,
            "simulated_ms": simulated_ms(made, memory_Bps, batches)}


# ----------------------------------------------------------------------------- what the docs show
def _accuracy(rows: list[dict], key: str) -> list[str]:
    err = [r["simulated_ms"] / r[key] for r in rows]
    if not err:
        return ["-"] * 4
    return [f"{sum(abs(x - 1) <= 0.15 for x in err)} of {len(err)}", str(sum(abs(x - 1) > 0.30 for x in err)),
            f"{sum(x > 1 for x in err)} / {sum(x < 1 for x in err)}", f"{statistics.median(err):.2f}"]


def flush_predictions(data: Data) -> str:
    """flush_predictions.json (benchmarks/flush_predictions.py) → per profile set and plan shape:
    the planner's flush/gpipe predictions and the per-stage fill's, against the simulator."""
    head = ["profiles", "plans", "prediction", "within ±15% of the simulator", "outside ±30%",
            "too fast / too slow", "median simulated / predicted"]
    body = []
    for label, held in (("formed on", False), ("held out", True)):
        for shape, straight in (("as asked", False), ("straight", True)):
            rows = [r for r in data["rows"] if r["held_out"] == held and r["straight"] == straight]
            for name, key in (("planner (bottleneck × fill)", "predicted_ms"), ("per-stage fill", "per_stage_fill_ms")):
                body.append([f"{label}, {shape}", str(len(rows)), name, *_accuracy(rows, key)])
    meta = data["meta"]
    return (table(head, body) + f"\n\nSimulated, not measured: reference GPU profiles (formed on: "
            f"{', '.join(FORMED_ON)}; held out: {', '.join(HELD_OUT)}), topologies {', '.join(meta['topologies'])}, "
            f"{', '.join(str(m) for m in meta['microbatches'])} microbatches, flush and gpipe, gradients accumulated "
            f"at {meta['memory_Bps'] / 1e9:.0f} GB/s, {meta['batches']} batches, the steady window.")


TABLES = {"flush_predictions": Table(("flush_predictions.json",), flush_predictions)}


def main(argv: list[str] | None = None) -> int:
    args = simulation_arguments(__doc__, "flush_predictions.json").parse_args(argv)
    from torchpipedream.model.profiles import load_profile

    rows = []
    for model in args.models.split(","):
        graph = load_profile(model)
        for topology in TOPOLOGIES:
            for kind in KINDS:
                for mu in MICROBATCHES:
                    for straight in (False, True):
                        r = case(graph, model, topology, kind, mu, straight, args.memory_bandwidth, args.batches)
                        if r is None:
                            continue
                        rows.append(r)
                        print(f"{model:<13} {topology:<20} {kind} m={mu:<2} {r['plan']:>18} predicted "
                              f"{r['predicted_ms']:8.2f} per-stage {r['per_stage_fill_ms']:8.2f} simulated "
                              f"{r['simulated_ms']:8.2f} ms", flush=True)
    data = {"meta": simulation_meta("benchmarks/flush_predictions.py", args), "rows": rows}
    print_and_write(flush_predictions(data), data, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
