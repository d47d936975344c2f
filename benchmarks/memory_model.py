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
from table_format import Data, Table, listing, table, yes  # noqa: E402

CHOSEN_ON = ("fc_heavy", "small_cnn", "transformer_lm")
HELD_OUT = ("gpt2", "bert", "resnet", "vit", "mobilenet", "t5")
#: (schedule, microbatches, recompute) of every row
SETTINGS = (("flush", 4, False), ("gpipe", 4, False), ("2bw", 4, False), ("pipedream", 1, False),
            ("flush", 4, True), ("pipedream", 1, True))
MINIBATCHES = 6
ZOO_BATCH = 32


def _zoo_loss(name: str):
    import zoo_models as zoo

    return zoo.LOSSES.get(name)


def _batches(name: str, n: int) -> list:
    """``n`` minibatches of model ``name`` as its Pipeline takes them."""
    import torch
    import zoo_models as zoo
    from compare_rows import WORKLOADS

    if name in WORKLOADS:
        work = WORKLOADS[name]
        g = torch.Generator().manual_seed(0)
        return [work.make_batch(work.batch_size, g) for _ in range(n)]
    return zoo.batches(name, n, ZOO_BATCH)


def _model(name: str) -> torch.nn.Module:
    import zoo_models as zoo
    from compare_rows import WORKLOADS, tpd_model

    return tpd_model(WORKLOADS[name], 1) if name in WORKLOADS else zoo.FACTORIES[name]()


def _loss(name: str):
    from compare_rows import WORKLOADS

    return WORKLOADS[name].loss_fn if name in WORKLOADS else _zoo_loss(name)


def _profile(name: str, microbatches: int):
    from torchpipedream.model.profiler import profile

    batch = _batches(name, 1)[0]
    loss = _loss(name)
    inputs, extra = (batch, {}) if loss is None else (batch[0], {"loss_fn": loss, "target": batch[1]})
    return profile(_model(name), inputs, microbatches=microbatches, warmup=0, iters=1, **extra)


#: --optimizer: (torch.optim class and its arguments, optimizer_state_factor, optimizer_scratch) of each
OPTIMIZERS = {
    "momentum": (("SGD", {"lr": 0.01, "momentum": 0.9}), 2.0, (0.0, 0.0)),
    "adam": (("Adam", {"lr": 1e-3, "foreach": False}), 3.0, (2.0, 0.0)),
    "adam-foreach": (("Adam", {"lr": 1e-3, "foreach": True}), 3.0, (0.0, 1.0)),
}


def _optimizer(name: str):
    """The optimizer factory of ``OPTIMIZERS[name]``."""
    import torch

    cls, kwargs = OPTIMIZERS[name][0]
    return functools.partial(getattr(torch.optim, cls), **kwargs)


def _worker(rank: int, name: str, plan, schedule: str, microbatches: int, optimizer: str = "momentum") -> list[int]:
    from torchpipedream.runtime import Pipeline

    batches = _batches(name, MINIBATCHES)
    loss = _loss(name)
    pipe = Pipeline(_model(name), plan, optimizer=_optimizer(optimizer),
                    loss_fn=loss, schedule=schedule, microbatches=microbatches if microbatches > 1 else None,
                    measure_memory=True, timeout_s=120, sample=batches[0] if loss is None else batches[0][0])

    pipe.train_minibatches(batches)
    return pipe.memory_peaks()


def run_model(name: str, settings, optimizer: str = "momentum") -> list[dict]:
    from torchpipedream.plans.topology import Topology
    from torchpipedream.runtime import launch
    from torchpipedream.schedule.build import build_schedule
    from torchpipedream.search.planner import plan as make_plan
    from torchpipedream.sim.simulator import Costs, simulate

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
    from torchpipedream.plans.plan import PlanError
    from torchpipedream.plans.topology import Topology
    from torchpipedream.runtime import launch
    from torchpipedream.search.auto import auto_summary, choose_schedule

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


# ----------------------------------------------------------------------------- what the docs show
def memory_model(data: Data) -> str:
    """memory_model.json (benchmarks/memory_model.py) → the memory model's prediction beside the
    measured peak of every stage, the models it was chosen on first, then those held out."""
    rows = data["rows"]

    def summary(held_out: bool) -> str:
        ratios = [r["measured_vs_predicted"] for r in rows if r["held_out"] == held_out]
        if not ratios:
            return ""
        inside = sum(abs(x - 1) <= 0.15 for x in ratios)
        what = "held out (not looked at while choosing the model's constant)" if held_out else \
            f"chosen on (working factor {data['working_factor']:g} chosen on these)"
        return (f"Models {what}: {inside} of {len(ratios)} stages within ±15% of the prediction, "
                f"measured/predicted {min(ratios):.2f}–{max(ratios):.2f}.")

    head = ["model", "schedule", "μ", "recompute", "stage", "predicted MiB", "simulated MiB", "measured MiB",
            "measured/predicted"]
    body = [[r["model"] + (" (held out)" if r["held_out"] else ""), r["schedule"], r["microbatches"],
             "yes" if r["recompute"] else "no", r["stage"], f"{r['predicted_bytes'] / 2**20:.2f}",
             f"{r['simulated_bytes'] / 2**20:.2f}", f"{r['measured_bytes'] / 2**20:.2f}",
             f"{r['measured_vs_predicted']:.3f}"] for r in sorted(rows, key=lambda r: r["held_out"])]
    lines = [line for line in (summary(False), summary(True)) if line]
    return "\n".join(lines) + "\n\n" + table(head, body)


def memory_optimizer(data: Data) -> str:
    """memory_model_adam.json (benchmarks/memory_model.py --optimizers ...) → the prediction with
    the optimizer step's temporaries beside the measured peak, per optimizer and stage."""
    rows = data["rows"]
    lines = []
    for opt in dict.fromkeys(r["optimizer"] for r in rows):
        mine = [r for r in rows if r["optimizer"] == opt]
        ratios = [r["measured_vs_predicted"] for r in mine]
        first = [r["measured_vs_predicted"] for r in mine if r["model"] == "fc_heavy"]
        rest = [r["measured_vs_predicted"] for r in mine if r["model"] != "fc_heavy"]
        a, b = data["optimizer_scratch"][opt]
        lines.append(
            f"{opt} (step temporaries {a:g} × the largest layer's parameters + {b:g} × the stage's weights): "
            f"{sum(abs(x - 1) <= 0.15 for x in ratios)} of {len(ratios)} stages within ±15%, measured/predicted "
            f"{min(ratios):.2f}–{max(ratios):.2f}"
            + (f" (fc_heavy, where the term was first seen: {sum(abs(x - 1) <= 0.15 for x in first)} of {len(first)}; "
               f"the other models: {sum(abs(x - 1) <= 0.15 for x in rest)} of {len(rest)})." if first and rest else "."))
    head = ["model", "optimizer", "schedule", "μ", "recompute", "stage", "predicted MiB", "measured MiB",
            "measured/predicted"]
    body = [[r["model"], r["optimizer"], r["schedule"], r["microbatches"], "yes" if r["recompute"] else "no", r["stage"],
             f"{r['predicted_bytes'] / 2**20:.2f}", f"{r['measured_bytes'] / 2**20:.2f}",
             f"{r['measured_vs_predicted']:.3f}"] for r in rows]
    return "\n".join(lines) + "\n\n" + table(head, body)


def memory_budget(data: Data) -> str:
    """memory_model.json → ``--schedule auto`` without and with a memory budget: the plans chosen,
    predicted and measured peaks per stage, and what the budget gave up."""
    head = ["model", "run", "budget MiB", "chosen", "predicted ms/minibatch", "predicted MiB per stage",
            "measured MiB per stage", "measured under budget"]
    body = []
    for r in data.get("budget_rows", []):
        budget = r["budget_bytes"]
        body.append([r["model"], r["run"], "-" if budget is None else f"{budget / 2**20:.2f}",
                     f"{r['schedule']}, {r['microbatches']} microbatches{', recompute' if r['recompute'] else ''} "
                     f"[{r['plan']}]", f"{r['predicted_time_per_minibatch_s'] * 1e3:.2f}",
                     ", ".join(f"{x / 2**20:.2f}" for x in r["predicted_bytes"]),
                     ", ".join(f"{x / 2**20:.2f}" for x in r["measured_bytes"]),
                     "-" if budget is None else yes(max(r["measured_bytes"]) <= budget)])
    gave = [f"{r['model']}: {line}" for r in data.get("budget_rows", []) if r["budget_bytes"] is not None
            for line in r["summary"] if line.startswith("memory budget")]
    return table(head, body) + ("\n\n" + "\n".join(f"- {g}" for g in gave) if gave else "")


# ----------------------------------------------------------------------------- numbers the docs' prose quotes
def _ratio(r: dict) -> float:
    return r["measured_vs_predicted"]


def _stages_within(model: str, within: float) -> Table:
    """A value: "N of M", the stages of ``model`` whose measured peak is within ``within`` of the prediction."""
    def render(d: Data) -> str:
        rows = [r for r in d["rows"] if r["model"] == model]
        return f"{sum(abs(_ratio(r) - 1) <= within for r in rows)} of {len(rows)}"
    return Table(("memory_model.json",), render)


def _held_out_counts(d: Data) -> str:
    models = dict.fromkeys(r["model"] for r in d["rows"] if r["held_out"])
    return ", ".join(f"{m} {_stages_within(m, 0.15).render(d)}" for m in models)


def _misses(source: str) -> Table:
    """A value: every stage outside ±15% of its prediction (model, optimizer, schedule, stage, ratio)."""
    def render(d: Data) -> str:
        misses = [r for r in d["rows"] if abs(_ratio(r) - 1) > 0.15]
        return "; ".join(f"{r['model']} {r['optimizer']} {r['schedule']}{' with recomputation' * r['recompute']}, "
                         f"stage {r['stage']} ({_ratio(r):.2f})" for r in misses)
    return Table((source,), render)


def _stage_ratio(model: str, schedule: str, stage: int, recompute: bool = False, spec: str = ".2f") -> Table:
    """A value: one stage's measured/predicted."""
    def render(d: Data) -> str:
        key = (model, schedule, stage, recompute)
        (r,) = [r for r in d["rows"] if (r["model"], r["schedule"], r["stage"], r["recompute"]) == key]
        return format(_ratio(r), spec)
    return Table(("memory_model.json",), render)


def _budgeted(d: Data) -> list[dict]:
    return [r for r in d.get("budget_rows", []) if r["budget_bytes"] is not None]


def _budgets_met(d: Data) -> str:
    return ", ".join(f"{max(r['measured_bytes']) / 2**20:.2f} of {r['budget_bytes'] / 2**20:.2f} MiB on {r['model']}"
                     for r in _budgeted(d))


def _budget_choice(model: str) -> Table:
    """A value: what ``--schedule auto`` chose under the budget, as its report says it."""
    def render(d: Data) -> str:
        (r,) = [r for r in _budgeted(d) if r["model"] == model]
        chosen = next(line for line in r["summary"] if line.startswith("chosen "))
        return f"{chosen.removeprefix('chosen ').split(' (')[0]} [{r['plan']}]"
    return Table(("memory_model.json",), render)


def _budget_cost(d: Data) -> str:
    costs = [line.rsplit("(", 1)[1].split(" ")[0] for r in _budgeted(d) for line in r["summary"]
             if line.startswith("memory budget")]
    return " and ".join(costs)


VALUES = {
    "mm_fc_heavy_within_1pct": _stages_within("fc_heavy", 0.01),
    "mm_fc_heavy_pipedream_recompute_first": _stage_ratio("fc_heavy", "pipedream", 0, True, ".3f"),
    "mm_lm_within": _stages_within("transformer_lm", 0.15),
    "mm_cnn_within": _stages_within("small_cnn", 0.15),
    "mm_cnn_gpipe_last": _stage_ratio("small_cnn", "gpipe", 1),
    "mm_held_out": Table(("memory_model.json",), _held_out_counts),
    "mm_misses": _misses("memory_model.json"),
    "mm_bert_2bw_first": _stage_ratio("bert", "2bw", 0),
    "mm_budgets_met": Table(("memory_model.json",), _budgets_met),
    "mm_budget_lm": _budget_choice("transformer_lm"),
    "mm_budget_cnn": _budget_choice("small_cnn"),
    "mm_budget_cost": Table(("memory_model.json",), _budget_cost),
    "mm_budget_fractions": Table(("memory_model.json",), lambda d: listing(d["args"]["budget_fractions"].split(","))),
    "mm_adam_misses": _misses("memory_model_adam.json"),
}

def _markdown(result: Data) -> str:
    """memory_model.md: the docs' tables of the run (memory_model_adam.md: an --optimizers run's)."""
    if result["args"]["optimizers"] == "momentum":
        return memory_model(result) + "\n\n" + memory_budget(result)
    return memory_optimizer(result)


TABLES = {"memory_model": Table(("memory_model.json",), memory_model),
          "memory_budget": Table(("memory_model.json",), memory_budget),
          "memory_optimizer": Table(("memory_model_adam.json",), memory_optimizer)}
COMPANIONS = {"memory_model.md": Table(("memory_model.json",), _markdown),
              "memory_model_adam.md": Table(("memory_model_adam.json",), _markdown)}


def main(argv: list[str] | None = None) -> int:
    from compare_rows import WORKLOADS  # tunes the allocator, before torch is imported
    from peers import write_results

    import torch
    import zoo_models as zoo

    from torchpipedream.plans.memory import WORKING_FACTOR

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
    write_results(args.out, result, _markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
