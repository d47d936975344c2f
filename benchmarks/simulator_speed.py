"""How fast are schedule generation, validation and simulation? Target: 1,000,000 actions < 10 s.

Run:  .venv/bin/python benchmarks/simulator_speed.py [--actions 1000000]
Prints a table and writes benchmarks/results/simulator_speed.json. Times are wall clock; the
simulation's CPU time is shown too, since on a shared machine wall time includes waiting.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

from table_format import Data, Table, table, yes

from torchpipedream.plans.plan import Plan, Stage
from torchpipedream.schedule.build import build_schedule
from torchpipedream.sim.simulator import Costs, simulate
from torchpipedream.schedule.validate import validate_schedule


def plan_for(config: list[int]) -> Plan:
    stages, r = [], 0
    for i, k in enumerate(config):
        stages.append(Stage(layers=[f"l{i}"], replicas=k, ranks=list(range(r, r + k)), forward_ms=1.0,
                            backward_ms=2.0, parameter_bytes=10**6, output_bytes=10**5))
        r += k
    return Plan(stages=stages, batch_size=32)


CASES = [
    ("pipedream", [1] * 8, None),
    ("pipedream", [2, 1, 1, 4], None),
    ("2bw", [1] * 8, 8),
    ("flush", [1] * 8, 8),
    ("gpipe", [1] * 8, 8),
]


# ----------------------------------------------------------------------------- what the docs show
def simulator_speed(data: Data) -> str:
    """simulator_speed.json (benchmarks/simulator_speed.py) → build, validate and simulate times."""
    head = ["schedule", "plan", "microbatches", "actions", "build s", "validate s", "simulate s (wall)",
            "simulate s (CPU)", "actions simulated per s"]
    body = [[r["schedule"], r["config"], r["microbatches"], f"{r['actions']:,}", f"{r['build_s']:.2f}",
             f"{r['validate_s']:.2f}", f"{r['simulate_s']:.2f}", f"{r['simulate_cpu_s']:.2f}",
             f"{r['simulate_actions_per_s']:,.0f}"] for r in data["rows"]]
    return (table(head, body) + "\n\nTarget: 1,000,000 actions simulated in < 10 s wall: "
            + yes(data["target_met"]) + ".")


TABLES = {"simulator_speed": Table(("simulator_speed.json",), simulator_speed)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--actions", type=int, default=1_000_000, help="approximate actions per schedule")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "simulator_speed.json"))
    args = ap.parse_args()
    rows = []
    for kind, config, m in CASES:
        plan = plan_for(config)
        probe = build_schedule(plan, kind, minibatches=4, microbatches=m)
        per_mb = probe.total_actions() / 4
        minibatches = max(1, round(args.actions / per_mb))
        t0 = time.perf_counter()
        sched = build_schedule(plan, kind, minibatches=minibatches, microbatches=m)
        t1 = time.perf_counter()
        validate_schedule(sched)
        t2 = time.perf_counter()
        c2 = time.process_time()
        res = simulate(sched, Costs.from_plan(plan, sched.microbatches), validate=False)
        t3 = time.perf_counter()
        c3 = time.process_time()
        rows.append({
            "schedule": kind, "config": plan.config, "microbatches": sched.microbatches,
            "minibatches": minibatches, "actions": sched.total_actions(),
            "build_s": t1 - t0, "validate_s": t2 - t1, "simulate_s": t3 - t2, "simulate_cpu_s": c3 - c2,
            "simulate_actions_per_s": sched.total_actions() / (t3 - t2),
            "simulated_samples_per_s": res.samples_per_s,
        })
        r = rows[-1]
        print(f"{kind:10s} {plan.config:14s} actions {r['actions']:>9,d}  build {r['build_s']:6.2f}s  "
              f"validate {r['validate_s']:6.2f}s  simulate {r['simulate_s']:6.2f}s (cpu {r['simulate_cpu_s']:5.2f}s)  "
              f"({r['simulate_actions_per_s'] / 1e6:.2f} M actions/s)", flush=True)
    ok = all(r["simulate_s"] < 10 * r["actions"] / 1e6 for r in rows)
    print(f"\ntarget: 1,000,000 actions simulated in < 10 s -> {'met' if ok else 'NOT met'}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"python": platform.python_version(), "machine": platform.machine(),
                                          "rows": rows, "target_met": ok}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
