"""Sharded stages (FSDP2, ``Stage.sharding``) against replicated ones: memory per worker measured
beside the memory model's prediction, and the time per minibatch, on 4 CPU processes.

For each model, the planner plans 4 workers for flush (4 microbatches) with every sharding
("replicate", "zero3", "zero2", "zero1"), once with 2 stages and once as data parallelism (1 stage);
each plan trains a warm-up minibatch and then two runs of ``MINIBATCHES / 2`` with
``Pipeline(measure_memory=True)`` (the peak of the tensors a rank held at once, from PyTorch's
profiler), its stages' predicted peaks beside the larger of the two runs' measured ones (both
are recorded: a sharded stage's peak can differ between runs, as its collectives' buffers are
allocated and freed on gloo's threads too). The plans of one layout run one after another in one process pool
(the machine is shared: the times are for this run's comparison, not absolute).

    .venv/bin/python benchmarks/sharding.py                  # about 3 minutes on 2 cores
    .venv/bin/python benchmarks/sharding.py --models fc_heavy

Writes benchmarks/results/sharding.json and sharding.md (or ``--out``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from table_format import Data, Table, table  # noqa: E402

MINIBATCHES = 6
WORKERS = 4
SHARDINGS = ("replicate", "zero3", "zero2", "zero1")
LAYOUTS = {"2 stages": 2, "data parallel": 1}


def _batches(name: str, n: int) -> list:
    import torch
    from compare_rows import WORKLOADS

    work = WORKLOADS[name]
    g = torch.Generator().manual_seed(0)
    return [work.make_batch(work.batch_size, g) for _ in range(n)]


def _worker(rank: int, name: str, plans: list) -> list[dict]:
    """Each plan's measured peak per rank (rank 0's list) and time per minibatch."""
    import torch
    from compare_rows import WORKLOADS, tpd_model

    from torchpipedream.runtime import Pipeline

    torch.set_num_threads(1)
    work, batches = WORKLOADS[name], _batches(name, MINIBATCHES + 1)
    out = []
    for plan in plans:
        pipe = Pipeline(tpd_model(work, 1), plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
                        loss_fn=work.loss_fn, measure_memory=True, timeout_s=300, sample=batches[0][0])
        pipe.train_minibatches(batches[:1])  # warm-up (first-call allocations: the optimizer's state)
        runs, seconds = [], 0.0
        for part in (batches[1:1 + MINIBATCHES // 2], batches[1 + MINIBATCHES // 2:]):  # two runs, each measured
            pipe.memory_peak_bytes = None
            t0 = time.perf_counter()
            pipe.train_minibatches(part)
            seconds += time.perf_counter() - t0
            runs.append(pipe.memory_peaks())
        out.append({"peaks": runs, "s_per_minibatch": seconds / MINIBATCHES})
    return out


def run_model(name: str) -> list[dict]:
    from compare_rows import WORKLOADS, tpd_model

    from torchpipedream.model.profiler import profile
    from torchpipedream.plans.topology import Topology
    from torchpipedream.runtime import launch
    from torchpipedream.search.planner import plan as make_plan

    work = WORKLOADS[name]
    batch = _batches(name, 1)[0]
    graph = profile(tpd_model(work, 1), batch[0], loss_fn=work.loss_fn, target=batch[1], microbatches=4, warmup=1, iters=2)
    rows = []
    for layout, stages in LAYOUTS.items():
        plans = [make_plan(graph, Topology.local(WORKERS), schedule="flush", microbatches=4, num_stages=stages,
                           sharding=sharding) for sharding in SHARDINGS]
        measured = launch(_worker, WORKERS, name, plans, timeout_s=1200)
        for sharding, plan, got in zip(SHARDINGS, plans, measured):
            for s, st in enumerate(plan.stages):
                # per run, per rank: the stage's peak is its ranks' largest; the two runs' may differ
                low, peak = sorted(max(run[r] for r in st.ranks) for run in got["peaks"])
                rows.append({"model": name, "layout": layout, "sharding": sharding, "plan": plan.summary,
                             "stage": s, "replicas": st.replicas, "parameter_bytes": st.parameter_bytes,
                             "predicted_bytes": st.memory_bytes, "measured_bytes": peak, "measured_bytes_other_run": low,
                             "measured_vs_predicted": peak / st.memory_bytes,
                             "s_per_minibatch": got["s_per_minibatch"]})
                print(f"  {name:<14} {layout:<13} {sharding:<9} {plan.config:<5} stage {s}: measured "
                      f"{peak / 2**20:7.2f} MiB ({low / 2**20:7.2f} in the other run), predicted {st.memory_bytes / 2**20:7.2f} MiB, "
                      f"{got['s_per_minibatch'] * 1e3:7.1f} ms per minibatch", flush=True)
    return rows


def sharding_memory(data: Data) -> str:
    """sharding.json (benchmarks/sharding.py) → per stage: measured and predicted peak of each
    sharding, and the share of the replicated peak it keeps."""
    rows = data["rows"]
    base = {(r["model"], r["layout"], r["stage"]): r for r in rows if r["sharding"] == "replicate"}
    head = ["model", "layout", "sharding", "plan", "stage", "predicted MiB", "measured MiB (other run)",
            "measured/predicted", "measured / replicated", "ms per minibatch"]
    body = []
    for r in rows:
        ref = base.get((r["model"], r["layout"], r["stage"]))
        share = f"{r['measured_bytes'] / ref['measured_bytes']:.2f}" if ref and ref["plan"].split(",")[0] == \
            r["plan"].split(",")[0] else "-"
        body.append([r["model"], r["layout"], r["sharding"], r["plan"], r["stage"], f"{r['predicted_bytes'] / 2**20:.2f}",
                     f"{r['measured_bytes'] / 2**20:.2f} ({r['measured_bytes_other_run'] / 2**20:.2f})",
                     f"{r['measured_vs_predicted']:.2f}", share,
                     f"{r['s_per_minibatch'] * 1e3:.1f}"])
    return table(head, body)


def _within(data: Data) -> str:
    """How many stages' measured peaks lie within ±15% of the prediction, of how many."""
    ratios = [r["measured_vs_predicted"] for r in data["rows"]]
    return f"{sum(abs(x - 1) <= 0.15 for x in ratios)} of {len(ratios)}"


def _dp_share(model: str, sharding: str):
    """The data-parallel stage's measured peak with ``sharding`` as a share of the replicated one."""
    def render(data: Data) -> str:
        rows = {r["sharding"]: r for r in data["rows"] if r["model"] == model and r["layout"] == "data parallel"}
        return f"{rows[sharding]['measured_bytes'] / rows['replicate']['measured_bytes']:.2f}"
    return render


def _zero1_time_share(data: Data) -> str:
    """Per model and layout: zero1's time per minibatch as a share of zero3's, and of replicate's."""
    rows = {(r["model"], r["layout"], r["sharding"]): r["s_per_minibatch"] for r in data["rows"]}
    parts = [f"{model} {layout} {rows[(model, layout, 'zero1')] / rows[(model, layout, 'zero3')]:.2f} "
             f"({rows[(model, layout, 'zero1')] / rows[(model, layout, 'replicate')]:.2f})"
             for model, layout, sharding in rows if sharding == "zero1"]
    return ", ".join(parts)


TABLES = {"sharding": Table(("sharding.json",), sharding_memory)}
VALUES = {"sharding_within": Table(("sharding.json",), _within),
          "sharding_lm_zero3_share": Table(("sharding.json",), _dp_share("transformer_lm", "zero3")),
          "sharding_fc_zero3_share": Table(("sharding.json",), _dp_share("fc_heavy", "zero3")),
          "sharding_zero1_time": Table(("sharding.json",), _zero1_time_share)}
COMPANIONS = {"sharding.md": Table(("sharding.json",), sharding_memory)}


def main(argv: list[str] | None = None) -> int:
    from compare_rows import WORKLOADS  # tunes the allocator, before torch is imported
    from peers import write_results

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="fc_heavy,transformer_lm")
    ap.add_argument("--out", default="benchmarks/results/sharding")
    args = ap.parse_args(argv)
    names = args.models.split(",")
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    rows = [row for name in names for row in run_model(name)]
    result = {"args": vars(args), "workers": WORKERS, "minibatches": MINIBATCHES, "rows": rows}
    write_results(args.out, result, sharding_memory(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
