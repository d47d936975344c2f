"""Is ``--schedule auto``'s choice the fastest measured? Every candidate run side by side.

For each model, ``choose_layout`` plans every synchronous kind that ``--schedule auto`` tries
(flush, gpipe; on two or more workers also zb-h1 and zb-h2, priced from the profile's timed
split backward; not interleaved or zb-v, which ``train`` cannot run yet) at 1, 2, 4 and 8 microbatches for every way of using the ``--procs`` cores (``--procs`` one-thread workers, ...,
one worker with ``--procs`` threads: ``auto_schedule.local_layouts``), each from a profile at
its own microbatch size and thread count and priced with this host's measured costs (as
``train --schedule auto`` does on local workers); then every candidate's plan runs, on its
layout's workers and threads (the same ``_tpd_worker`` as compare.py, from compare_rows.py: warm-up, timed
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
from table_format import Data, Table, listing, span, table, yes  # noqa: E402


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
    import torch
    from compare_rows import WORKLOADS, _profile, _tpd_worker, host_costs

    from torchpipedream.plans.topology import Topology
    from torchpipedream.runtime import launch
    from torchpipedream.search.auto import choose_layout, local_layouts, threads_per_worker

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


# ----------------------------------------------------------------------------- what the docs show
def auto_choice(data: Data) -> str:
    """auto_choice.json (benchmarks/auto_choice.py) → every candidate of --schedule auto, measured
    beside predicted, per model; the choice against the best measured; rank correlation."""
    head = ["model", "schedule", "microbatches", "plan", "threads per worker", "predicted samples/s",
            "measured samples/s", "measured/predicted", "auto's choice"]
    body = []
    for m in data["models"]:
        for r in sorted(m["rows"], key=lambda r: -r["samples_per_s"]):
            body.append([f"{m['model']} (batch {m['batch_size']})", r["schedule"], str(r["microbatches"]), r["config"],
                         str(r.get("threads", 1)),
                         f"{r['predicted_samples_per_s']:.1f}", f"{r['samples_per_s']:.1f}",
                         f"{r['samples_per_s'] / r['predicted_samples_per_s']:.2f}", "**chosen**" if r["chosen"] else ""])
    summary = "; ".join(f"{m['model']}: chose {m['chosen']}, {m['chosen_vs_best_measured']:.2f} of the best measured "
                        f"({m['best_measured']}), Spearman {m['spearman']:.2f}" for m in data["models"])
    return summary + ".\n\n" + table(head, body)



# ----------------------------------------------------------------------------- numbers the docs' prose quotes
TARGET_CHOICE = 0.95  # the choice's measured throughput over the best measured


def _workers(r: dict) -> int:
    return sum(int(n) for n in r["config"].split("-"))


def _ratio(r: dict) -> float:
    return r["samples_per_s"] / r["predicted_samples_per_s"]


def _model(d: Data, name: str) -> dict:
    return next(m for m in d["models"] if m["model"] == name)


def _rows_value(keep, of=_ratio) -> Table:
    """A value: the range of ``of`` over the candidates (every model's) that ``keep`` keeps."""
    return Table(("auto_choice.json",), lambda d: span([of(r) for m in d["models"] for r in m["rows"] if keep(r)]))


def _choice_target(d: Data) -> str:
    ratios = {m["model"]: m["chosen_vs_best_measured"] for m in d["models"]}
    return ", ".join(f"{name} {x:.2f} ({yes(x >= TARGET_CHOICE)})" for name, x in ratios.items())


def _layouts(d: Data) -> str:
    """Per model, the workers × threads of the choice and of the best measured row."""
    def layout(r: dict) -> str:
        return f"{_workers(r)} × {r.get('threads', 1)}"
    parts = []
    for m in d["models"]:
        chosen = next(r for r in m["rows"] if r["chosen"])
        best = max(m["rows"], key=lambda r: r["samples_per_s"])
        parts.append(f"{m['model']}: chose {layout(chosen)}, best measured {layout(best)}")
    return "; ".join(parts)


def _zb(r: dict) -> bool:
    return r["schedule"].startswith("zb-")


def _zb_best(d: Data) -> str:
    return ", ".join(f"{m['model']} {max(r['samples_per_s'] for r in m['rows'] if _zb(r)):.1f} against "
                     f"{max(r['samples_per_s'] for r in m['rows'] if _workers(r) == 1):.1f}" for m in d["models"])


def _fc_heavy_one_worker(d: Data) -> str:
    rows = [r for r in _model(d, "fc_heavy")["rows"] if _workers(r) == 1 and r["microbatches"] == 1]
    predicted = listing(sorted({f"{r['predicted_samples_per_s']:.1f}" for r in rows}))
    return (f"predicted {predicted} samples/s and measured "
            f"{span([r['samples_per_s'] for r in rows], '.1f')} ({span([_ratio(r) for r in rows])})")


def _lm_row(d: Data, chosen: bool) -> str:
    m = _model(d, "transformer_lm")
    r = next(r for r in m["rows"] if r["chosen"]) if chosen else max(m["rows"], key=lambda r: r["samples_per_s"])
    return f"{r['schedule']}, {r['microbatches']} microbatch, {_workers(r)} worker: {r['samples_per_s']:.1f} samples/s"


def _per_model(count) -> Table:
    """A value: ``count(model)`` of every model, once where they agree."""
    return Table(("auto_choice.json",), lambda d: listing(sorted({str(count(m)) for m in d["models"]})))


VALUES = {
    "auto_probes": Table(("auto_choice.json",),
                         lambda d: f"{d['probes'][0]:.2f} at the start, {d['probes'][1]:.2f} at the end"),
    "auto_candidates": _per_model(lambda m: len(m["rows"])),
    "auto_choice_target": Table(("auto_choice.json",), _choice_target),
    "auto_layouts": Table(("auto_choice.json",), _layouts),
    "auto_lm_best": Table(("auto_choice.json",), lambda d: _lm_row(d, False)),
    "auto_lm_chosen": Table(("auto_choice.json",), lambda d: _lm_row(d, True)),
    "auto_lm_gap": Table(("auto_choice.json",),
                         lambda d: f"{1 - _model(d, 'transformer_lm')['chosen_vs_best_measured']:.0%}"),
    "auto_zb_predicted": _rows_value(_zb),
    "auto_zb_count": _per_model(lambda m: sum(_zb(r) for r in m["rows"])),
    "auto_zb_best": Table(("auto_choice.json",), _zb_best),
    "auto_two_worker_predicted": _rows_value(lambda r: _workers(r) == 2),
    "auto_one_worker_predicted": _rows_value(lambda r: _workers(r) == 1),
    "auto_fc_heavy_one_worker": Table(("auto_choice.json",), _fc_heavy_one_worker),
}

TABLES = {"auto_choice": Table(("auto_choice.json",), auto_choice)}
COMPANIONS = {"auto_choice.md": Table(("auto_choice.json",), auto_choice)}


def main(argv: list[str] | None = None) -> int:
    from compare_rows import WORKLOADS  # also tunes this process's allocator, before torch is imported
    from peers import probed, write_results

    import torch

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
    write_results(args.out, result, auto_choice(result))  # the docs render it the same way (TABLES)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
