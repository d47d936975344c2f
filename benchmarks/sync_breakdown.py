"""Where a pipelined schedule's time goes on fc_heavy: each rank's measured window split into
compute, transfers and waits, and time outside any action, beside the one-thread single process.

For each kind (``--kinds``) at the microbatch count its planner chooses (compare_rows.py's
``planned_microbatches``), the plan runs one warm-up and ``--windows`` timed windows of
``--per-window`` minibatches on 2 workers (compare_rows.py's ``_tpd_worker``). The last window's trace
is split per rank into the union of its F, B, W and U actions (compute), the part of its
transfers, all-reduces and waits that no compute overlaps (communication and waiting), and the
rest (the runtime between actions). "compute inflation" is the ranks' summed compute per
minibatch over one single-process one-thread training step of the same minibatch, measured
right before: what microbatching and working side by side add to the work itself. The
"ceiling" is 2 workers' samples/s if the busiest rank only computed.

    .venv/bin/python benchmarks/sync_breakdown.py          # ~5 min

Writes benchmarks/results/sync_breakdown.json and .md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from table_format import Data, Table, span, table  # noqa: E402

from torchpipedream.sim.trace import COMPUTE_KINDS, Trace  # noqa: E402


def split_window(trace: Trace, minibatches: int) -> list[dict]:
    """Per rank, milliseconds per minibatch of: the window (the rank's first action to its last),
    compute, the transfers and waits that no compute overlaps, and the time outside any
    recorded action."""
    compute = trace.busy_time(COMPUTE_KINDS)
    anything = trace.busy_time({e.kind for e in trace.events})
    out = []
    for rank in trace.ranks:
        ev = [e for e in trace.events if e.rank == rank]
        span = max(e.end_s for e in ev) - min(e.start_s for e in ev)
        out.append({"rank": rank, "window_ms": span * 1e3 / minibatches,
                    "compute_ms": compute[rank] * 1e3 / minibatches,
                    "communication_and_waiting_ms": (anything[rank] - compute[rank]) * 1e3 / minibatches,
                    "outside_actions_ms": (span - anything[rank]) * 1e3 / minibatches})
    return out


def measure_kind(work, kind: str, split_parts: int, windows: int, per_window: int) -> dict:
    """One kind at its planned microbatch count: the run, its per-rank breakdown, and the
    one-thread single process measured just before."""
    import compare_rows as compare
    import torch
    from peers import run_single

    from torchpipedream.runtime import launch

    m = compare.planned_microbatches(work, 2, kind, split_parts, per_window)
    plan, _ = compare.choose_plan(work, 2, kind, m, split_parts, minibatches=per_window)
    torch.set_num_threads(1)
    single = run_single(work, 1, warmup=2, windows=3, steps=3)["samples_per_s"]
    res = launch(compare._tpd_worker, plan.num_workers, work, plan, kind, m, 1, windows, per_window, split_parts,
                 timeout_s=900)
    torch.set_num_threads(1)
    ranks = split_window(res["trace"], per_window)
    step_ms = work.batch_size / single * 1e3
    return {"kind": kind, "microbatches": m, "plan": plan.summary, "samples_per_s": res["samples_per_s"],
            "single_1_thread_samples_per_s": single, "vs_perfect_scaling": res["samples_per_s"] / (2 * single),
            "ranks": ranks, "compute_inflation": sum(r["compute_ms"] for r in ranks) / step_ms,
            "ceiling_samples_per_s": work.batch_size / max(r["compute_ms"] for r in ranks) * 1e3}


# ----------------------------------------------------------------------------- what the docs show
def sync_breakdown(data: Data) -> str:
    """sync_breakdown.json (benchmarks/sync_breakdown.py) → per kind, where each rank's time per
    minibatch goes, beside the one-thread single process."""
    probes = data["probes"]
    body = []
    for r in data["rows"]:
        ranks = r["ranks"]
        body.append([r["kind"], r["plan"], r["microbatches"], f"{r['samples_per_s']:.1f}",
                     f"{r['vs_perfect_scaling']:.2f}", f"{r['compute_inflation']:.2f}",
                     f"{r['ceiling_samples_per_s'] / (2 * r['single_1_thread_samples_per_s']):.2f}",
                     " / ".join(f"{x['window_ms']:.1f}" for x in ranks),
                     " / ".join(f"{x['compute_ms']:.1f}" for x in ranks),
                     " / ".join(f"{x['communication_and_waiting_ms']:.1f}" for x in ranks),
                     " / ".join(f"{x['outside_actions_ms']:.1f}" for x in ranks)])
    caption = (f"{data['model']}, commit {data['commit']}, 2 workers; CPU probe (2 concurrent processes / 1): start "
               f"{probes[0]:.2f}, end {probes[1]:.2f}. Milliseconds per minibatch, rank 0 / rank 1, in the last of "
               f"{data['args']['windows']} windows of {data['args']['per_window']} minibatches.")
    head = ["kind", "plan", "microbatches", "samples/s", "× perfect scaling",
            "compute per minibatch, both ranks, × one thread's step", "× perfect scaling if only computing",
            "window", "compute", "transfers and waits", "outside actions"]
    return caption + "\n\n" + table(head, body)



def _kind(data: Data, kind: str) -> dict:
    return next(r for r in data["rows"] if r["kind"] == kind)


def _per_rank(kind: str, key: str) -> Table:
    """A value: ``key`` of every rank of ``kind``'s row, as the table writes it (rank 0 / rank 1)."""
    return Table(("sync_breakdown.json",), lambda d: " / ".join(f"{x[key]:.1f}" for x in _kind(d, kind)["ranks"]))


def _field(kind: str, key: str, spec: str = ".2f") -> Table:
    return Table(("sync_breakdown.json",), lambda d: format(_kind(d, kind)[key], spec))


def _one_microbatch_inflation(d: Data) -> str:
    return span([r["compute_inflation"] for r in d["rows"] if r["microbatches"] == 1])


VALUES = {
    "sync_flush_waits": _per_rank("flush", "communication_and_waiting_ms"),
    "sync_flush_window": _per_rank("flush", "window_ms"),
    "sync_zb_h1_waits": _per_rank("zb-h1", "communication_and_waiting_ms"),
    "sync_zb_h1_window": _per_rank("zb-h1", "window_ms"),
    "sync_zb_h2_microbatches": _field("zb-h2", "microbatches", ""),
    "sync_zb_h2_waits": _per_rank("zb-h2", "communication_and_waiting_ms"),
    "sync_zb_h2_inflation": _field("zb-h2", "compute_inflation"),
    "sync_one_microbatch_inflation": Table(("sync_breakdown.json",), _one_microbatch_inflation),
    "sync_2bw_waits": _per_rank("2bw", "communication_and_waiting_ms"),
    "sync_2bw_perfect_scaling": _field("2bw", "vs_perfect_scaling"),
    "sync_zb_h1_microbatches": _field("zb-h1", "microbatches", ""),
}
TABLES = {"sync_breakdown": Table(("sync_breakdown.json",), sync_breakdown)}
COMPANIONS = {"sync_breakdown.md": Table(("sync_breakdown.json",), sync_breakdown)}


def main(argv: list[str] | None = None) -> int:
    import compare_rows as compare  # sets up the allocator as for compare.py's rows, before torch is imported
    from peers import git_commit, probed, write_results

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="fc_heavy", choices=sorted(compare.WORKLOADS))
    ap.add_argument("--kinds", default="flush,zb-h1,zb-h2,2bw,pipedream")
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--per-window", type=int, default=32)
    ap.add_argument("--split-wide", type=int, default=4)
    ap.add_argument("--out", default="benchmarks/results/sync_breakdown")
    args = ap.parse_args(argv)
    work = compare.WORKLOADS[args.model]

    def run() -> list[dict]:
        rows = []
        for kind in args.kinds.split(","):
            row = measure_kind(work, kind, args.split_wide, args.windows, args.per_window)
            rows.append(row)
            print(f"  {kind:<9} m={row['microbatches']}: {row['samples_per_s']:.1f} samples/s "
                  f"({row['vs_perfect_scaling']:.2f} of perfect scaling), compute × {row['compute_inflation']:.2f}",
                  flush=True)
        return rows

    rows, probes, _ = probed(run)
    result = {"probes": probes, "args": vars(args), "model": args.model, "commit": git_commit(), "rows": rows}
    write_results(args.out, result, sync_breakdown(result))  # as the docs render it (TABLES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
