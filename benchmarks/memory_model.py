"""The memory model against measured peaks, per stage: the benchmark models it was chosen on and
models it was not.

For each model, schedule and recomputation setting, a straight 2-stage plan runs 6 minibatches
on 2 processes with ``Pipeline(measure_memory=True)`` (every allocation and free of the run
recorded by PyTorch's profiler; the peak of the tensors a rank held at once), beside the plan's
prediction (``Stage.memory_bytes``: memory_model.py) and the simulator's (the same terms with
the schedule's exact in-flight counts). The memory model's one constant (``WORKING_FACTOR``)
was chosen on the benchmark models (fc_heavy, small_cnn, transformer_lm); the zoo models
(GPT-2 with its tied embedding, BERT with attention masks, ResNet with BatchNorm, ViT,
MobileNetV2, T5) were not looked at while choosing it. (ResNet's first stages showed that the
model's own input, the caller's batch, had been charged to the stage's stash; that structural
fix came after the first held-out pass, and MobileNetV2 and T5 were added after it, unseen.) Memory counts do not depend on the CPU's speed, so one pass is
the measurement (repeating a row gives the same bytes).

    .venv/bin/python benchmarks/memory_model.py                     # about 8 minutes on 2 cores
    .venv/bin/python benchmarks/memory_model.py --models small_cnn --schedules flush

Then ``--schedule auto`` with a memory budget (``--budget-fraction`` of the unbounded choice's
predicted peak) on the budget models: both choices run with their peaks measured, and the
bounded one's must stay under the budget; the table says what the budget gave up.

With ``--optimizers adam,adam-foreach`` the runs train with torch's Adam (its per-parameter
loop, CPU's default, and its ``foreach`` form, CUDA's default) and are planned with the memory
model's optimizer step temporaries (``optimizer_scratch``); the scratch terms come from the
two forms' arithmetic (the loop's ``exp_avg_sq.sqrt() / c`` holds two tensors of one
parameter's size; foreach's ``_foreach_sqrt`` one of every parameter's) and were first seen
on fc_heavy (no committed data); the other models were not looked at before this run:

    .venv/bin/python benchmarks/memory_model.py --optimizers adam,adam-foreach --schedules flush,pipedream \
        --models fc_heavy,transformer_lm,small_cnn,bert,vit --budget-models '' --out benchmarks/results/memory_model_adam

Writes benchmarks/results/memory_model.json and memory_model.md (or ``--out``).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))  # the zoo is the tests' own
from compare import WORKLOADS, tpd_model  # noqa: E402  (tunes the allocator)
from doc_tables import memory_budget as budget_table  # noqa: E402  (the docs render them the same way)
from doc_tables import memory_model as memory_table  # noqa: E402
from doc_tables import memory_optimizer as optimizer_table  # noqa: E402
from peers import write_results  # noqa: E402

import torch  # noqa: E402

import zoo_models as zoo  # noqa: E402
from torchpipedream.plans.memory import WORKING_FACTOR  # noqa: E402
from torchpipedream.search.planner import plan as make_plan  # noqa: E402
from torchpipedream.model.profiler import profile  # noqa: E402
from torchpipedream.runtime import Pipeline, launch  # noqa: E402
from torchpipedream.schedule.build import build_schedule  # noqa: E402
from torchpipedream.sim.simulator import Costs, simulate  # noqa: E402
from torchpipedream.plans.topology import Topology  # noqa: E402

CHOSEN_ON = ("fc_heavy", "small_cnn", "transformer_lm")
HELD_OUT = ("gpt2", "bert", "resnet", "vit", "mobilenet", "t5")
#: (schedule, microbatches, recompute) of every row
SETTINGS = (("flush", 4, False), ("gpipe", 4, False), ("2bw", 4, False), ("pipedream", 1, False),
            ("flush", 4, True), ("pipedream", 1, True))
MINIBATCHES = 6
ZOO_BATCH = 32


def _zoo_loss(name: str):
    return zoo.LOSSES.get(name)


def _batches(name: str, n: int) -> list:
    """``n`` minibatches of model ``name`` as its Pipeline takes them."""
    if name in WORKLOADS:
        work = WORKLOADS[name]
        g = torch.Generator().manual_seed(0)
        return [work.make_batch(work.batch_size, g) for _ in range(n)]
    return zoo.batches(name, n, ZOO_BATCH)


def _model(name: str) -> torch.nn.Module:
    return tpd_model(WORKLOADS[name], 1) if name in WORKLOADS else zoo.FACTORIES[name]()


def _loss(name: str):
    return WORKLOADS[name].loss_fn if name in WORKLOADS else _zoo_loss(name)


def _profile(name: str, microbatches: int):
    batch = _batches(name, 1)[0]
    loss = _loss(name)
    inputs, extra = (batch, {}) if loss is None else (batch[0], {"loss_fn": loss, "target": batch[1]})
    return profile(_model(name), inputs, microbatches=microbatches, warmup=0, iters=1, **extra)


#: --optimizer: (factory, optimizer_state_factor, optimizer_scratch) of each (memory_model.py)
OPTIMIZERS = {
    "momentum": (functools.partial(torch.optim.SGD, lr=0.01, momentum=0.9), 2.0, (0.0, 0.0)),
    "adam": (functools.partial(torch.optim.Adam, lr=1e-3, foreach=False), 3.0, (2.0, 0.0)),
    "adam-foreach": (functools.partial(torch.optim.Adam, lr=1e-3, foreach=True), 3.0, (0.0, 1.0)),
}


def _worker(rank: int, name: str, plan, schedule: str, microbatches: int, optimizer: str = "momentum") -> list[int]:
    batches = _batches(name, MINIBATCHES)
    loss = _loss(name)
    pipe = Pipeline(_model(name), plan, optimizer=OPTIMIZERS[optimizer][0],
                    loss_fn=loss, schedule=schedule, microbatches=microbatches if microbatches > 1 else None,
                    measure_memory=True, timeout_s=120, sample=batches[0] if loss is None else batches[0][0])

    pipe.train_minibatches(batches)
    return pipe.memory_peaks()


def run_model(name: str, settings, optimizer: str = "momentum") -> list[dict]:
    rows = []
    _, state, scratch = OPTIMIZERS[optimizer]
    for schedule, m, recompute in settings:
        graph = _profile(name, m)
        plan = make_plan(graph, Topology.local(2), schedule=schedule, microbatches=m, straight=True, num_stages=2,
                         recompute=recompute, optimizer_state_factor=state, optimizer_scratch=scratch)
        sim = simulate(build_schedule(plan, schedule, minibatches=MINIBATCHES, microbatches=m), Costs.from_plan(plan, m))
        measured = launch(_worker, 2, name, plan, schedule, m, optimizer, timeout_s=600)
        for s, st in enumerate(plan.stages):
            row = {"model": name, "held_out": name not in CHOSEN_ON, "optimizer": optimizer,
                   "schedule": schedule, "microbatches": m,
                   "recompute": recompute, "plan": plan.summary, "stage": s, "parameter_bytes": st.parameter_bytes,
                   "predicted_bytes": st.memory_bytes, "simulated_bytes": int(sim.peak_memory_bytes[s]),
                   "measured_bytes": measured[s], "measured_vs_predicted": measured[s] / st.memory_bytes}
            rows.append(row)
            print(f"  {name:<15} {optimizer:<12} {schedule:<9} m={m} recompute={'yes' if recompute else 'no ':<3} stage {s}: "
                  f"measured {measured[s] / 2**20:8.2f} MiB, predicted {st.memory_bytes / 2**20:8.2f} "
                  f"({row['measured_vs_predicted']:.3f})", flush=True)
    return rows


def budget_rows(name: str, fractions: list[float]) -> list[dict]:
    """``--schedule auto`` without a memory budget, and with the first budget of ``fractions`` ×
    the unbounded choice's predicted peak that some plan fits: both plans run with their peaks
    measured (the bounded one must stay under the budget), and what the budget gave up."""
    from torchpipedream.search.auto import auto_summary, choose_schedule
    from torchpipedream.plans.plan import PlanError

    graphs: dict[int, object] = {}

    def graph_for(m: int):
        if m not in graphs:
            graphs[m] = _profile(name, m)
        return graphs[m]

    free = choose_schedule(graph_for, Topology.local(2))
    bounded, refused = None, []
    for fraction in fractions:
        budget = int(free.predicted["peak_memory_bytes"] * fraction)
        try:
            bounded = choose_schedule(graph_for, Topology.local(2), memory_bytes=budget)
            break
        except PlanError:
            refused.append(budget)
            print(f"  {name}: no plan fits in {budget / 2**20:.2f} MiB per worker", flush=True)
    if bounded is None:
        return []
    rows = []
    for label, p in (("without budget", free), ("with budget", bounded)):
        chosen = p.meta["auto"]["chosen"]
        measured = launch(_worker, 2, name, p, p.schedule, p.microbatches, timeout_s=600)
        rows.append({"model": name, "run": label, "budget_bytes": budget if p is bounded else None,
                     "schedule": p.schedule, "microbatches": p.microbatches, "recompute": chosen["recompute"],
                     "plan": p.summary, "predicted_time_per_minibatch_s": chosen["time_per_minibatch_s"],
                     "predicted_bytes": [st.memory_bytes for st in p.stages], "measured_bytes": measured,
                     "summary": auto_summary(p), "budgets_nothing_fits": refused if p is bounded else []})
        print(f"  {name:<15} {label:<15} {p.schedule} m={p.microbatches} recompute={chosen['recompute']}: "
              f"predicted {[round(st.memory_bytes / 2**20, 2) for st in p.stages]} MiB, measured "
              f"{[round(x / 2**20, 2) for x in measured]} MiB"
              + (f", budget {budget / 2**20:.2f} MiB" if p is bounded else ""), flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(CHOSEN_ON + HELD_OUT))
    ap.add_argument("--schedules", default=None, help="only these schedules (comma-separated)")
    ap.add_argument("--budget-models", default="transformer_lm,small_cnn",
                    help="models for the memory-budget rows ('' for none)")
    ap.add_argument("--budget-fractions", default="0.5,0.7,0.85",
                    help="budgets to try, as fractions of the unbounded choice's predicted peak; the first "
                         "that some plan fits is used")
    ap.add_argument("--optimizers", default="momentum",
                    help=f"comma-separated, of {', '.join(OPTIMIZERS)} (each run's plan is made for its optimizer)")
    ap.add_argument("--out", default="benchmarks/results/memory_model")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    names = args.models.split(",")
    unknown = [n for n in names if n not in WORKLOADS and n not in zoo.FACTORIES]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; choose from {', '.join(list(WORKLOADS) + list(zoo.FACTORIES))}")
    wanted = set(args.schedules.split(",")) if args.schedules else None
    settings = [s for s in SETTINGS if wanted is None or s[0] in wanted]
    optimizers = args.optimizers.split(",")
    if set(optimizers) - set(OPTIMIZERS):
        ap.error(f"unknown optimizer(s) {sorted(set(optimizers) - set(OPTIMIZERS))}; choose from {', '.join(OPTIMIZERS)}")
    rows = [row for optimizer in optimizers for name in names for row in run_model(name, settings, optimizer)]
    budget = [row for name in filter(None, args.budget_models.split(",")) for row in
              budget_rows(name, [float(f) for f in args.budget_fractions.split(",")])]
    result = {"args": vars(args), "working_factor": WORKING_FACTOR,
              "optimizer_scratch": {k: list(v[2]) for k, v in OPTIMIZERS.items()}, "minibatches": MINIBATCHES,
              "zoo_batch_size": ZOO_BATCH, "chosen_on": list(CHOSEN_ON), "rows": rows, "budget_rows": budget}
    tables = memory_table(result) + "\n\n" + budget_table(result) if optimizers == ["momentum"] \
        else optimizer_table(result)
    write_results(args.out, result, tables)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
