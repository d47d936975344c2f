"""The model zoo's parity table: every zoo model (tests/zoo_models.py) on 2 workers, each plan
and schedule checked by ``torchpipedream.verify_plans`` against its one-process reference.

For each model: profile it, plan it for 2 workers (the planner's choice under flush, and a
forced straight 2-stage pipeline), then verify flush on both plans and pipedream on the
straight one (and 2bw, for the GPT-2 with its tied embedding), 4 minibatches of 8 samples, SGD
with momentum. Prints a table and writes benchmarks/results/model_zoo.json: per model and plan
the largest |pipeline − reference| over every parameter and buffer, the shared parameters the
plan split, and the wall time of the check (both launches of 2 processes included).

    .venv/bin/python benchmarks/model_zoo.py          # about 3 minutes on 2 cores
"""

from __future__ import annotations

import dataclasses
import functools
import json
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # the zoo is the tests' own
from table_format import Data, Table, listing, table  # noqa: E402

RESULTS = HERE / "results" / "model_zoo.json"


def check(name: str) -> list[dict]:
    import torch
    import zoo_models as zoo

    from torchpipedream.model.profiler import profile
    from torchpipedream.plans.topology import Topology
    from torchpipedream.runtime.verification import verify_plans
    from torchpipedream.search.planner import plan as make_plan

    optimizer = functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9)
    batches = zoo.batches(name, 4)
    loss = zoo.LOSSES.get(name)
    model = zoo.FACTORIES[name]()
    inputs, extra = (batches[0], {}) if loss is None else (batches[0][0], {"loss_fn": loss, "target": batches[0][1]})
    graph = profile(model, inputs, warmup=0, iters=1, **extra)
    chosen = make_plan(graph, Topology.local(2), schedule="flush", microbatches=2)
    straight = make_plan(graph, Topology.local(2), schedule="flush", microbatches=2, straight=True)
    plans = [chosen, straight, dataclasses.replace(straight, schedule="pipedream")]
    if name == "gpt2":
        plans.append(dataclasses.replace(straight, schedule="2bw"))
    t0 = time.perf_counter()
    reports = verify_plans(zoo.FACTORIES[name], batches, plans, optimizer, loss_fn=loss)
    seconds = time.perf_counter() - t0
    parameters = sum(p.numel() for p in model.parameters())
    return [{"model": name, "class": type(model).__name__, "parameters": parameters, "layers": len(graph.names),
             "plan": p.summary, "config": p.config, "schedule": r.schedule, "microbatches": r.microbatches,
             "shared": [{"name": t.name, "stages": t.stages} for t in p.tied], "ok": r.ok,
             "max_abs_diff": r.max_abs_diff, "not_compared": len(r.not_compared),
             "mismatch": None if r.mismatch is None else str(r.mismatch), "check_s": round(seconds, 1)}
            for p, r in zip(plans, reports)]


# ----------------------------------------------------------------------------- what the docs show
def model_zoo(data: Data) -> str:
    """model_zoo.json (benchmarks/model_zoo.py) → each zoo model's parity with its reference."""
    head = ["model", "parameters", "plan", "schedule", "shared parameters split", "max abs diff", "result",
            "check (s)"]
    body = []
    for r in data["rows"]:
        shared = ", ".join(f"{t['name']} ({'+'.join(map(str, t['stages']))})" for t in r["shared"]) or "-"
        schedule = r["schedule"] if r["microbatches"] == 1 else f"{r['schedule']} (m = {r['microbatches']})"
        body.append([f"{r['model']} ({r['class']})", f"{r['parameters']:,}", r["plan"], schedule, shared,
                     f"{r['max_abs_diff']:.2g}", "equal" if r["ok"] else "MISMATCH: " + str(r["mismatch"]),
                     f"{r['check_s']:.1f}"])
    caption = (f"{data['minibatches']} minibatches of {data['batch_size']}, {data['optimizer']}; torch "
               f"{data['torch']}, transformers {data['transformers']}; the check time is per model (all its "
               f"plans in one launch of 2 processes): {'all equal' if data['passed'] else 'FAILED'}.")
    return caption + "\n\n" + table(head, body)


def _schedules(d: Data) -> str:
    """The schedules every model was checked under, and those only some were."""
    by_model: dict[str, set[str]] = {}
    for r in d["rows"]:
        by_model.setdefault(r["model"], set()).add(r["schedule"])
    common = set.intersection(*by_model.values())
    extra = [f"{s} on {m}" for m, ss in by_model.items() for s in sorted(ss - common)]
    return listing(sorted(common)) + " on every model" + ("; " + listing(extra) if extra else "")


VALUES = {
    "zoo_transformers": Table(("model_zoo.json",), lambda d: d["transformers"]),
    "zoo_result": Table(("model_zoo.json",), lambda d: "all equal" if d["passed"] else "not all equal"),
    "zoo_schedules": Table(("model_zoo.json",), _schedules),
}

TABLES = {"model_zoo": Table(("model_zoo.json",), model_zoo)}


def main() -> int:
    import torch
    import transformers
    import zoo_models as zoo

    rows = []
    for name in sorted(zoo.FACTORIES):
        rows += check(name)
        print(f"{name}: {'OK' if all(r['ok'] for r in rows if r['model'] == name) else 'MISMATCH'}", flush=True)
    data = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
            "minibatches": 4, "batch_size": 8, "optimizer": "SGD lr 0.01 momentum 0.9", "rows": rows,
            "passed": all(r["ok"] for r in rows)}
    RESULTS.write_text(json.dumps(data, indent=1) + "\n")
    print(model_zoo(data))  # as architecture.md shows it (TABLES)
    print(f"wrote {RESULTS}")
    return 0 if data["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
