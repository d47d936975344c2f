"""What torchpipedream costs when it runs a model on one worker: the plain PyTorch loop beside
the same training through ``Pipeline`` on a one-stage plan (flush, one microbatch), side by side.

When ``--schedule auto`` finds that no pipeline pays on a host (two cores and a small model),
it runs one worker with every thread; that row must run at the plain loop's speed. This script
times, in ONE launched process with ``--threads`` torch threads, for each of compare.py's three
workloads:

- "plain loop": ``zero_grad``, forward, loss, backward, ``SGD.step`` over fixed minibatches
  (compare.py's "single, 2 threads" row, but in a launched process like the workers);
- "torchpipedream, one worker": ``Pipeline(model, one-stage plan, schedule="flush")`` and
  ``train_minibatches`` over ``--per-window`` minibatches (one schedule per window), the model
  as given;
- with ``--split-wide`` > 1, both again on the model with its wide linear layers split into
  column parts (``split_wide_layers``, which compare.py's torchpipedream rows run so that the
  planner can cut inside them): where a layer is split (fc_heavy), this prices the split alone.

The contenders' timed windows alternate in the one process (a, b, c, d, d, c, b, a, ...), so
every pair of windows runs seconds apart: the 2-core machine's speed drifts by tens of percent
within minutes. Each timed window follows two untimed steps of its own contender: the first
steps after another contender ran are up to a third slower, for the plain loop and the Pipeline
alike (seen on fc_heavy: 460-490 samples/s after a switch, 730-740 in the next window; without
this, which contender happened to follow which decided the ratio). A row's samples/s is the median over passes of the median window; its ratio to
the plain loop is the median over a pass's pairs of windows (side by side), then over passes.
A CPU probe runs at the start and the end; a run whose probes disagree by more than 15% is
flagged (repeat it).

    .venv/bin/python benchmarks/one_worker.py                  # ~6 min
    .venv/bin/python benchmarks/one_worker.py --models fc_heavy --passes 1

Writes benchmarks/results/one_worker.json and one_worker.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from table_format import Data, Table, listing, span, table  # noqa: E402

MODELS = ("fc_heavy", "small_cnn", "transformer_lm")
PLAIN, TPD = "plain loop", "torchpipedream, one worker"


def _one_stage_plan(model, sample):
    """The one-stage plan of ``model``: every layer of its graph on worker 0 (flush, one
    microbatch), as ``--schedule auto`` plans a host where no pipeline pays."""
    from compare_rows import layer_names
    from torchpipedream.plans.plan import Plan

    return Plan.straight([layer_names(model, sample)], schedule="flush", microbatches=1)


def _contenders(work, split_parts: int) -> dict:
    """name -> a function that trains on a list of minibatches (one schedule for a Pipeline)."""
    import torch

    from compare_rows import split_built
    from torchpipedream.runtime import Pipeline

    def plain(build):
        torch.manual_seed(0)
        model = build()
        opt = torch.optim.SGD(model.parameters(), lr=work.lr)

        def window(data: list) -> None:
            for x, y in data:
                opt.zero_grad(set_to_none=True)
                work.loss_fn(model(x), y).backward()
                opt.step()
        return window

    def pipelined(build):
        torch.manual_seed(0)
        model = build()
        sample = work.make_batch(work.batch_size, torch.Generator().manual_seed(1))[0]
        pipe = Pipeline(model, _one_stage_plan(model, sample), optimizer=lambda p: torch.optim.SGD(p, lr=work.lr),
                        loss_fn=work.loss_fn, schedule="flush", sample=sample, timeout_s=120)
        return pipe.train_minibatches

    out = {PLAIN: plain(work.build), TPD: pipelined(work.build)}
    split = lambda: split_built(work.build, split_parts)  # noqa: E731
    if split_parts > 1 and len(list(split().modules())) != len(list(work.build().modules())):
        out |= {f"{PLAIN}, split model": plain(split), f"{TPD}, split model": pipelined(split)}
    return out


def _worker(rank: int, name: str, split_parts: int, warmup: int, windows: int, per_window: int) -> dict:
    """One pass of one model: every contender in this process, their windows alternating."""
    import torch

    from compare_rows import WORKLOADS

    work = WORKLOADS[name]
    g = torch.Generator().manual_seed(0)
    data = [work.make_batch(work.batch_size, g) for _ in range(per_window)]
    runs = _contenders(work, split_parts)
    for window in runs.values():
        for _ in range(warmup):
            window(data)
    times: dict[str, list[float]] = {k: [] for k in runs}
    order = list(runs)
    for w in range(windows):
        for k in (order if w % 2 == 0 else order[::-1]):
            runs[k](data[:2])  # untimed: the first steps after another contender ran are slow (both kinds alike)
            t0 = time.perf_counter()
            runs[k](data)
            times[k].append((time.perf_counter() - t0) / per_window)
    return {"batch_size": work.batch_size, "seconds_per_minibatch": times}


def _pass_ratio(times: dict, row: str, base: str) -> float:
    """The median over a pass's windows of base time / row time (a window and its partner ran
    seconds apart)."""
    return statistics.median(b / r for r, b in zip(times[row], times[base]))


def run(models: list[str], args: argparse.Namespace) -> list[dict]:
    """Every model's contenders, in ``args.passes`` interleaved passes (one launch each)."""
    from torchpipedream.runtime import launch

    got: dict[str, list[dict]] = {m: [] for m in models}
    for pass_ in range(args.passes):
        for name in models:
            res = launch(_worker, 1, name, args.split_wide, args.warmup, args.windows, args.per_window,
                         threads=args.threads, timeout_s=900)
            got[name].append(res)
            speeds = {k: res["batch_size"] / statistics.median(t) for k, t in res["seconds_per_minibatch"].items()}
            print(f"  {name:<15} pass {pass_ + 1}: " + ", ".join(f"{k} {v:.1f}" for k, v in speeds.items())
                  + f" samples/s; {TPD} / {PLAIN} {_pass_ratio(res['seconds_per_minibatch'], TPD, PLAIN):.3f}",
                  flush=True)
    rows = []
    for name, passes in got.items():
        for row in passes[0]["seconds_per_minibatch"]:
            base = f"{PLAIN}, split model" if row == f"{TPD}, split model" else PLAIN
            ratios = [_pass_ratio(p["seconds_per_minibatch"], row, base) for p in passes]
            speeds = [p["batch_size"] / statistics.median(p["seconds_per_minibatch"][row]) for p in passes]
            rows.append({"model": name, "row": row, "threads": args.threads, "samples_per_s": statistics.median(speeds),
                         "passes_samples_per_s": speeds, "versus": base, "vs_base": statistics.median(ratios),
                         "passes_vs_base": ratios})
    return rows


# ----------------------------------------------------------------------------- what the docs show
def one_worker(data: Data) -> str:
    """one_worker.json (benchmarks/one_worker.py) → per model and row: samples/s and the ratio to
    the plain loop on the same model, side by side."""
    head = ["model", "row", "threads", "samples/s", "versus", "ratio (side by side)", "ratio per pass"]
    body = [[r["model"], r["row"], r["threads"], f"{r['samples_per_s']:.1f}", r["versus"] if r["row"] != r["versus"]
             else "-", f"{r['vs_base']:.3f}" if r["row"] != r["versus"] else "1", span(r["passes_vs_base"], ".3f")
             if r["row"] != r["versus"] else "-"] for r in data["rows"]]
    return table(head, body)


def _ratios(d: Data, row: str) -> str:
    return listing([f"{r['model']} {r['vs_base']:.3f}" for r in d["rows"] if r["row"] == row])


VALUES = {
    "one_worker_probes": Table(("one_worker.json",),
                               lambda d: f"{d['probes'][0]:.2f} at the start, {d['probes'][1]:.2f} at the end"),
    "one_worker_commit": Table(("one_worker.json",), lambda d: d["commit"]),
    "one_worker_ratios": Table(("one_worker.json",), lambda d: _ratios(d, TPD)),
    "one_worker_split_cost": Table(("one_worker.json",), lambda d: _ratios(d, f"{PLAIN}, split model")),
    "one_worker_split_ratios": Table(("one_worker.json",), lambda d: _ratios(d, f"{TPD}, split model")),
    "one_worker_spread": Table(("one_worker.json",), lambda d: span(
        [v for r in d["rows"] if r["row"] == TPD for v in r["passes_vs_base"]], ".3f")),
}
TABLES = {"one_worker": Table(("one_worker.json",), one_worker)}
COMPANIONS = {"one_worker.md": Table(("one_worker.json",), one_worker)}


def main(argv: list[str] | None = None) -> int:
    import compare_rows  # noqa: F401  (tunes the allocator as the other benchmarks', before torch is imported)
    from peers import git_commit, probed, write_results

    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS), help="of compare.py's workloads (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of the one process")
    ap.add_argument("--split-wide", type=int, default=4, metavar="PARTS",
                    help="also run the model with linear layers of >= 1024 outputs split into PARTS column parts, "
                         "as compare.py's torchpipedream rows do (1 = off)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed windows of each contender")
    ap.add_argument("--windows", type=int, default=10, help="timed windows of each contender per pass")
    ap.add_argument("--per-window", type=int, default=8, help="minibatches per window (one schedule)")
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/one_worker")
    args = ap.parse_args(argv)
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"--models: unknown {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    if min(args.threads, args.windows, args.per_window, args.passes) < 1 or args.warmup < 0 or args.split_wide < 1:
        ap.error("--threads, --windows, --per-window, --passes and --split-wide must be at least 1, --warmup 0")
    torch.set_num_threads(1)
    rows, probes, agree = probed(lambda: run(models, args))
    result = {"commit": git_commit(), "probes": probes, "probes_agree": agree, "args": vars(args), "rows": rows}
    write_results(args.out, result, one_worker(result))  # the docs render it the same way (TABLES)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
