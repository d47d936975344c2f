"""Is ``--schedule auto``'s choice the fastest measured? Every candidate run side by side.

For each model, ``choose_layout`` plans every synchronous kind that ``--schedule auto`` tries
(flush, gpipe; on two or more workers also zb-h1 and zb-h2, priced from the profile's timed
split backward; not interleaved or zb-v, which ``train`` cannot run yet) at 1, 2, 4 and 8 microbatches for every way of using the ``--procs`` cores (``--procs`` one-thread workers, ...,
one worker with ``--procs`` threads: ``auto_schedule.local_layouts``), each from a profile at
its own microbatch size and thread count and priced with this host's measured costs (as
``train --schedule auto`` does on local workers); then every candidate's plan runs, on its
layout's workers and threads (the same ``_tpd_worker`` as compare.py: warm-up, timed
windows of ``--per-window`` minibatches), in ``--passes`` interleaved passes. For each model:
the measured samples/s of every candidate beside its prediction, the auto choice's measured
throughput over the best measured one (target ≥ 0.95), and the rank correlation (Spearman)
between predicted and measured throughput. A CPU probe runs at the start and the end.

    .venv/bin/python benchmarks/auto_choice.py
    .venv/bin/python benchmarks/auto_choice.py --models fc_heavy --passes 1

Writes benchmarks/results/auto_choice.json and auto_choice.md.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare import WORKLOADS, _profile, _tpd_worker, host_costs  # noqa: E402  (also tunes this process's allocator)
from doc_tables import auto_choice as auto_choice_table  # noqa: E402  (the docs render it the same way)
from peers import probed, write_results  # noqa: E402

import torch  # noqa: E402

from torchpipedream.runtime import launch  # noqa: E402


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else float("nan")


def run_model(name: str, procs: int, windows: int, per_window: int, passes: int, split_parts: int) -> dict:
    from torchpipedream.search.auto import choose_layout, local_layouts, threads_per_worker
    from torchpipedream.plans.topology import Topology

    work = WORKLOADS[name]
    graphs: dict[tuple[int, int], object] = {}

    def graph_for(m: int, threads: int):
        if (m, threads) not in graphs:
            graphs[(m, threads)] = _profile(work, m, split_parts, threads)
        return graphs[(m, threads)]

    plans = {}  # every candidate's plan, as choose_layout planned it

    def keep(cand, plan) -> None:
        if plan is not None:
            plans[(cand.schedule, cand.microbatches, cand.threads)] = plan

    chosen = choose_layout(graph_for, local_layouts(procs, procs), Topology.local, batch_size=work.batch_size,
                           host_costs=functools.partial(host_costs, work), minibatches=per_window, progress=keep,
                           virtual_stages=False)
    cands = [c for c in chosen.meta["auto"]["candidates"] if not c["error"]]
    measured: dict[tuple[str, int, int], list[float]] = {k: [] for k in plans}
    for pass_ in range(passes):
        for (kind, m, threads), plan in plans.items():
            for attempt in (1, 2):  # a worker abort is retried once (seen rarely: "terminate called without
                try:                 # an active exception" in a gloo worker at exit; not yet explained)
                    res = launch(_tpd_worker, plan.num_workers, work, plan, kind, m, 1, windows, per_window,
                                 split_parts, timeout_s=900, threads=threads)
                    break
                except Exception as exc:
                    print(f"  {name:<15} {kind:<6} m={m}: FAILED (attempt {attempt}): {str(exc).splitlines()[0][:160]}",
                          flush=True)
                    if attempt == 2:
                        raise
            torch.set_num_threads(1)
            measured[(kind, m, threads)].append(res["samples_per_s"])
            print(f"  {name:<15} {kind:<6} m={m} threads={threads}  pass {pass_ + 1}: {res['samples_per_s']:8.1f} "
                  f"samples/s [{plan.config}]", flush=True)
    rows = []
    for c in cands:
        key = (c["schedule"], c["microbatches"], c["threads"])
        rows.append({"schedule": c["schedule"], "microbatches": c["microbatches"], "config": c["config"],
                     "threads": c["threads"],
                     "predicted_samples_per_s": work.batch_size / c["time_per_minibatch_s"],
                     "samples_per_s": statistics.median(measured[key]), "passes_samples_per_s": measured[key],
                     "chosen": key == (chosen.schedule, chosen.microbatches, threads_per_worker(chosen))})
    best = max(r["samples_per_s"] for r in rows)
    pick = next(r for r in rows if r["chosen"])
    def label(r: dict) -> str:
        return f"{r['schedule']}, {r['microbatches']} microbatches [{r['config']}, {r['threads']} thread(s) per worker]"

    return {"model": name, "batch_size": work.batch_size, "rows": rows,
            "chosen": label(pick),
            "chosen_vs_best_measured": pick["samples_per_s"] / best,
            "best_measured": next(label(r) for r in rows if r["samples_per_s"] == best),
            "spearman": spearman([r["predicted_samples_per_s"] for r in rows], [r["samples_per_s"] for r in rows])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="fc_heavy,small_cnn,transformer_lm")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--per-window", type=int, default=16)
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--split-wide", type=int, default=4, metavar="PARTS",
                    help="split linear layers with >= 1024 outputs into PARTS column parts, as compare.py does")
    ap.add_argument("--out", default="benchmarks/results/auto_choice")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    for name in args.models.split(","):
        if name not in WORKLOADS:
            ap.error(f"unknown model {name!r}; choose from {', '.join(WORKLOADS)}")
    models, probes, agree = probed(lambda: [
        run_model(name, args.procs, args.windows, args.per_window, args.passes, args.split_wide)
        for name in args.models.split(",")])
    result = {"probes": probes, "probes_agree": agree, "args": vars(args), "models": models}
    write_results(args.out, result, auto_choice_table(result))
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
