"""Where a pipelined schedule's time goes on fc_heavy: each rank's measured window split into
compute, transfers and waits, and time outside any action, beside the one-thread single process.

For each kind (``--kinds``) at the microbatch count its planner chooses (compare.py's
``planned_microbatches``), the plan runs one warm-up and ``--windows`` timed windows of
``--per-window`` minibatches on 2 workers (compare.py's ``_tpd_worker``). The last window's trace
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
import compare  # noqa: E402  (sets up the allocator as for compare.py's rows)
from doc_tables import sync_breakdown as sync_breakdown_table  # noqa: E402
from peers import git_commit, probed, run_single, write_results  # noqa: E402

import torch  # noqa: E402

from torchpipedream.runtime import launch  # noqa: E402
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


def main(argv: list[str] | None = None) -> int:
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
    write_results(args.out, result, sync_breakdown_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
