"""Replicated stages under zb-h1 and zb-h2: the planner's choice and prediction against the simulator.

For each reference profile (per-layer times measured on GPUs, reference_profiles/README.md),
topology, kind (zb-h1, zb-h2) and microbatch count, the planner plans twice: as asked, where it
may replicate stages and keeps a replicated plan only where it predicts it faster than the
straight one (search/replica_round_trip.py charges a replica's round trips), and straight. The
simulator runs both built schedules (gradients accumulated and stashes copied at a GPU's
memory speed). Reported: how often the chosen plan simulates faster or slower than the straight
one, by how much, and how close the planner's prediction of the chosen plan is to the
simulator's steady time. The round-trip formula was written looking at the first six
profiles ("formed on"); the others were not looked at before it was frozen ("held out").

These are predictions of GPU runs: this machine has 2 CPU cores and no GPU.

Run:  .venv/bin/python benchmarks/zero_bubble_replicas.py
Prints a table; writes benchmarks/results/zero_bubble_replicas.json.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from table_format import Data, Table, print_and_write, table  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FORMED_ON = ("alexnet", "gnmt", "gnmt_large", "inception_v3", "vgg16", "resnet101")
HELD_OUT = ("densenet121", "resnet18", "resnet50", "squeezenet1_0")
TOPOLOGIES = ("4x2:25GB/s,1.25GB/s", "8:10GB/s", "A", "2x2:10GB/s,1.25GB/s")
KINDS = ("zb-h1", "zb-h2")
MICROBATCHES = (4, 8)


def simulated_ms(plan, memory_Bps: float, batches: int) -> float:
    """The simulator's steady time per minibatch of ``plan``."""
    from torchpipedream.schedule.build import build_schedule
    from torchpipedream.sim.simulator import Costs, simulate

    costs = Costs.from_plan(plan, plan.microbatches, accumulate_Bps=memory_Bps, copy_Bps=memory_Bps)
    return 1e3 / simulate(build_schedule(plan, plan.schedule, minibatches=batches), costs).steady_minibatches_per_s


def case(model: str, topology: str, kind: str, mu: int, memory_Bps: float, batches: int) -> dict:
    """One request planned as asked and straight, both simulated."""
    from torchpipedream.model.profiles import load_profile
    from torchpipedream.search.planner import plan as make_plan

    graph = load_profile(model)
    t0 = time.perf_counter()
    chosen = make_plan(graph, topology, schedule=kind, microbatches=mu)
    planning_s = time.perf_counter() - t0
    line = make_plan(graph, topology, schedule=kind, microbatches=mu, straight=True)
    sim, sim_line = simulated_ms(chosen, memory_Bps, batches), simulated_ms(line, memory_Bps, batches)
    return {"model": model, "held_out": model in HELD_OUT, "topology": topology, "kind": kind, "microbatches": mu,
            "plan": chosen.summary, "replicated": any(st.replicas > 1 for st in chosen.stages),
            "planning_s": planning_s, "predicted_ms": chosen.predicted["time_per_minibatch_s"] * 1e3,
            "bottleneck": chosen.predicted["bottleneck"], "simulated_ms": sim, "straight_simulated_ms": sim_line}


# ----------------------------------------------------------------------------- what the docs show
def _summary_row(label: str, rows: list[dict]) -> list[str]:
    picked = [r for r in rows if r["replicated"]]
    ratio = [r["simulated_ms"] / r["straight_simulated_ms"] for r in rows]
    err = [r["simulated_ms"] / r["predicted_ms"] for r in picked]
    faster = sum(x < 0.999 for x in ratio)
    slower = [x for x in ratio if x > 1.001]
    return [label, str(len(rows)), str(len(picked)), str(faster), str(len(slower)),
            f"{min(ratio):.2f}" if ratio else "-", f"{max(slower):.2f}" if slower else "-",
            f"{sum(abs(x - 1) <= 0.15 for x in err)} of {len(err)}", f"{sum(abs(x - 1) > 0.30 for x in err)}",
            f"{sum(x > 1 for x in err)} / {sum(x < 1 for x in err)}"]


def zero_bubble_replicas(data: Data) -> str:
    """zero_bubble_replicas.json (benchmarks/zero_bubble_replicas.py) → per profile set: the
    planner's replicated zb-h1/zb-h2 choices against the straight plans, simulated."""
    head = ["profiles", "requests", "replicated plans chosen", "simulated faster than straight",
            "simulated slower than straight", "best chosen / straight", "worst chosen / straight",
            "replicated: prediction within ±15% of the simulator", "outside ±30%", "prediction too fast / too slow"]
    rows = data["rows"]
    body = [_summary_row("formed on (" + ", ".join(FORMED_ON) + ")", [r for r in rows if not r["held_out"]]),
            _summary_row("held out (" + ", ".join(HELD_OUT) + ")", [r for r in rows if r["held_out"]])]
    meta = data["meta"]
    return (table(head, body) + f"\n\nSimulated, not measured: reference GPU profiles, topologies "
            f"{', '.join(meta['topologies'])}, {', '.join(str(m) for m in meta['microbatches'])} microbatches, "
            f"zb-h1 and zb-h2, gradients accumulated and stashes copied at {meta['memory_Bps'] / 1e9:.0f} GB/s, "
            f"{meta['batches']} batches, the steady window.")


TABLES = {"zero_bubble_replicas": Table(("zero_bubble_replicas.json",), zero_bubble_replicas)}


def simulation_arguments(description: str | None, results_file: str) -> argparse.ArgumentParser:
    """The options of a script that plans and simulates the reference profiles (this one's,
    flush_predictions.py's): the profiles, batches simulated, memory speed, results file."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(FORMED_ON + HELD_OUT))
    ap.add_argument("--batches", type=int, default=8, help="batches simulated per plan (default: %(default)s)")
    ap.add_argument("--memory-bandwidth", type=float, default=300e9, metavar="BYTES_PER_S",
                    help="gradient accumulation and stash copies (default: %(default).0f, a GPU's order)")
    ap.add_argument("--out", default=str(RESULTS / results_file))
    return ap


def simulation_meta(script: str, args: argparse.Namespace) -> dict:
    """The results file's ``meta`` of a script of :func:`simulation_arguments`."""
    return {"script": script, "kind": "simulated (reference GPU profiles)", "host": platform.node(),
            "topologies": list(TOPOLOGIES), "microbatches": list(MICROBATCHES), "memory_Bps": args.memory_bandwidth,
            "batches": args.batches}


def main(argv: list[str] | None = None) -> int:
    args = simulation_arguments(__doc__, "zero_bubble_replicas.json").parse_args(argv)
    rows = []
    for model in args.models.split(","):
        for topology in TOPOLOGIES:
            for kind in KINDS:
                for mu in MICROBATCHES:
                    r = case(model, topology, kind, mu, args.memory_bandwidth, args.batches)
                    rows.append(r)
                    print(f"{model:<13} {topology:<20} {kind} m={mu:<2} {r['plan']:>16} predicted "
                          f"{r['predicted_ms']:8.2f} simulated {r['simulated_ms']:8.2f} straight "
                          f"{r['straight_simulated_ms']:8.2f} ms", flush=True)
    data = {"meta": simulation_meta("benchmarks/zero_bubble_replicas.py", args), "rows": rows}
    print_and_write(zero_bubble_replicas(data), data, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
