"""What clipping by the global gradient norm (``Pipeline(clip_grad_norm=)``) costs, per schedule kind.

With clipping, every rank's first step of update t takes one all-reduce of the squared
gradient norms over all ranks (src/torchpipedream/runtime/clipping.py), so no rank can apply
update t before the first stage has finished its backward of t. The synchronous kinds (flush)
reach their update at the flush anyway, so it should cost little more than the all-reduce; the
asynchronous ones (pipedream, 2bw, zb-2bw) may stall, the more the sooner a stage needs its
update's new weights (pipedream: at its very next forward; 2bw, zb-2bw: a batch later).

An MLP of ``--depth`` Linear(``--width``, ``--width``) layers with ReLUs between them, cut in
the middle into a straight pipeline of 2 stages on 2 one-thread workers (about 30 ms of
forward + backward per stage and minibatch at the defaults), SGD, batch ``--batch``. Each kind
runs in one launch of the 2 workers holding two pipelines of the same model, without and with
clipping (``--max-norm``, below these updates' norms, so that clipping really clips), whose
timed windows alternate (off, on, on, off, ...): each pair of windows runs side by side, a
second apart, which a 2-core machine shared with other work needs (its speed drifts by 20-30%
within minutes). The kinds run in interleaved passes. For each row: samples/s (median over
passes of the median timed window, the slowest rank's), the ratio with over without clipping
(the median over a pass's pairs of windows, then over passes), and the median number of
updates' norms recorded per timed window (``len(pipe.grad_norms)`` grows by one per update: it
must equal the window's minibatches). A CPU probe runs at the start and the end; a run whose
probes disagree by more than 15% is flagged.

    .venv/bin/python benchmarks/clipping.py                 # ~5 min
    .venv/bin/python benchmarks/clipping.py --kinds flush,pipedream --passes 1

Writes benchmarks/results/clipping.json and clipping.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from table_format import Data, Table, listing, span, table  # noqa: E402

KINDS = ("flush", "pipedream", "2bw", "zb-2bw")
#: the asynchronous kinds: a stage's update t may wait for the first stage's backward of t (the global norm)
ASYNC_KINDS = ("pipedream", "2bw", "zb-2bw")
LR = 0.01


def mlp(width: int, depth: int):
    """``depth`` Linear(width, width) layers with a ReLU between each two (the last one's output
    is the logits of ``width`` classes)."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(depth):
        layers += [nn.Linear(width, width)] + ([nn.ReLU()] if i < depth - 1 else [])
    return nn.Sequential(*layers)


def plan_for(kind: str, depth: int, microbatches: int):
    """The straight 2-stage plan of ``mlp``, cut after the middle layer's ReLU (torch.fx names
    an nn.Sequential's input ``input_1`` and its children ``_0``, ``_1``, ...)."""
    from torchpipedream.plans.plan import Plan

    names = [f"_{i}" for i in range(2 * depth - 1)]
    cut = 2 * (depth // 2)  # after the ReLU that follows Linear depth // 2 - 1
    return Plan.straight([["input_1"] + names[:cut], names[cut:]], schedule=kind, microbatches=microbatches)


def _pipeline(kind: str, microbatches: int, max_norm: float | None, width: int, depth: int):
    import torch

    from torchpipedream.runtime import Pipeline

    return Pipeline(mlp(width, depth), plan_for(kind, depth, microbatches),
                    optimizer=lambda p: torch.optim.SGD(p, lr=LR), loss_fn=torch.nn.functional.cross_entropy,
                    schedule=kind, microbatches=microbatches if microbatches > 1 else None,
                    clip_grad_norm=max_norm, timeout_s=120)


def _worker(rank: int, kind: str, microbatches: int, max_norm: float, width: int, depth: int, batch: int,
            warmup: int, windows: int, per_window: int) -> dict:
    """One pass of one kind: two pipelines of the same model in the same processes, without and
    with clipping, each run for ``warmup`` untimed and ``windows`` timed schedules of
    ``per_window`` minibatches, their windows alternating (off, on, on, off, off, on, ...) so
    that each pair of windows runs side by side, a second apart."""
    import torch
    import torch.distributed as dist

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(batch, width, generator=g), torch.randint(0, width, (batch,), generator=g))
            for _ in range(per_window)]
    pipes = {clip: _pipeline(kind, microbatches, max_norm if clip else None, width, depth) for clip in (False, True)}
    for pipe in pipes.values():
        for _ in range(warmup):
            pipe.train_minibatches(data)
    times: dict[bool, list[float]] = {False: [], True: []}
    recorded = []
    for w in range(windows):
        for clip in ((False, True) if w % 2 == 0 else (True, False)):
            before = len(pipes[clip].grad_norms)
            dist.barrier()
            t0 = time.perf_counter()
            pipes[clip].train_minibatches(data)
            times[clip].append((time.perf_counter() - t0) / per_window)
            if clip:
                recorded.append(len(pipes[clip].grad_norms) - before)
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, (times, pipes[True].grad_norms, pipes[False].grad_norms))
    norms = out[0][1]
    slowest = {clip: [max(t[clip][w] for t, *_ in out) for w in range(windows)] for clip in (False, True)}
    return {"samples_per_s": {clip: batch / statistics.median(slowest[clip]) for clip in (False, True)},
            "vs_without": statistics.median(off / on for off, on in zip(slowest[False], slowest[True])),
            "norms_per_window": statistics.median(recorded), "norms_without": max(len(n) for *_, n in out),
            "norms_same_on_ranks": all(n == norms for _, n, _ in out),
            "clipped_share": sum(n > max_norm for n in norms) / len(norms), "median_norm": statistics.median(norms)}


def run(kinds: list[str], args: argparse.Namespace) -> list[dict]:
    """Every kind without and with clipping (one launch), in ``args.passes`` interleaved passes."""
    import torch

    from torchpipedream.plans.kinds import schedule_kind
    from torchpipedream.runtime import launch

    got: dict[str, list[dict]] = {k: [] for k in kinds}
    for pass_ in range(args.passes):
        for kind in kinds:
            m = args.microbatches if schedule_kind(kind).microbatched else 1
            res = launch(_worker, 2, kind, m, args.max_norm, args.width, args.depth, args.batch, 1, args.windows,
                         args.per_window, timeout_s=600)
            torch.set_num_threads(1)
            got[kind].append({**res, "microbatches": m})
            sps = res["samples_per_s"]
            print(f"  {kind:<10} pass {pass_ + 1}: {sps[False]:8.1f} samples/s without clipping, {sps[True]:8.1f} "
                  f"with (side by side: {res['vs_without']:.2f}), {res['norms_per_window']} norms per window",
                  flush=True)
    rows = []
    for kind, res in got.items():
        for clip in (False, True):
            rows.append({
                "schedule": kind, "clip": clip, "max_norm": args.max_norm if clip else None,
                "microbatches": res[0]["microbatches"], "updates_per_window": args.per_window,
                "samples_per_s": statistics.median(r["samples_per_s"][clip] for r in res),
                "passes_samples_per_s": [r["samples_per_s"][clip] for r in res],
                # each pass's median over its pairs of windows, side by side
                "vs_without": statistics.median(r["vs_without"] for r in res) if clip else 1.0,
                "passes_vs_without": [r["vs_without"] if clip else 1.0 for r in res],
                "norms_per_window": statistics.median(r["norms_per_window"] for r in res) if clip else
                max(r["norms_without"] for r in res),
                "norms_same_on_ranks": all(r["norms_same_on_ranks"] for r in res),
                "clipped_share": statistics.median(r["clipped_share"] for r in res) if clip else None,
                "median_norm": statistics.median(r["median_norm"] for r in res) if clip else None,
            })
    return rows


# ----------------------------------------------------------------------------- what the docs show
def clipping(data: Data) -> str:
    """clipping.json (benchmarks/clipping.py) → samples/s with and without clipping by the
    global gradient norm, per schedule kind."""
    head = ["schedule", "clip_grad_norm", "samples/s", "with / without (side by side)", "norms per window",
            "updates per window", "updates clipped"]
    body = [[f"{r['schedule']} (m = {r['microbatches']})", f"{r['max_norm']:g}" if r["clip"] else "off",
             f"{r['samples_per_s']:.1f}", f"{r['vs_without']:.2f}" if r["clip"] else "1.00",
             f"{r['norms_per_window']:g}", r["updates_per_window"],
             f"{r['clipped_share']:.0%}" if r["clip"] else "-"] for r in data["rows"]]
    return table(head, body)


def _ratios(d: Data, asynchronous: bool) -> str:
    """Each kind's with/without ratio, of the asynchronous kinds or of the others (named where
    there are several)."""
    rows = [r for r in d["rows"] if r["clip"] and (r["schedule"] in ASYNC_KINDS) == asynchronous]
    if len(rows) == 1:
        return f"{rows[0]['vs_without']:.2f}"
    return listing([f"{r['vs_without']:.2f} ({r['schedule']})" for r in rows])


VALUES = {
    "clipping_probes": Table(("clipping.json",),
                             lambda d: f"{d['probes'][0]:.2f} at the start, {d['probes'][1]:.2f} at the end"),
    "clipping_commit": Table(("clipping.json",), lambda d: d["commit"]),
    "clipping_sync_ratio": Table(("clipping.json",), lambda d: _ratios(d, False)),
    "clipping_async_ratio": Table(("clipping.json",), lambda d: _ratios(d, True)),
    "clipping_pass_spread": Table(("clipping.json",), lambda d: span(
        [v for r in d["rows"] if r["clip"] for v in r["passes_vs_without"]])),
}
TABLES = {"clipping": Table(("clipping.json",), clipping)}
COMPANIONS = {"clipping.md": Table(("clipping.json",), clipping)}


def main(argv: list[str] | None = None) -> int:
    import compare_rows  # noqa: F401  (tunes the allocator as the other benchmarks', before torch is imported)
    from peers import git_commit, probed, write_results

    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kinds", default=",".join(KINDS), help="schedule kinds (default: %(default)s)")
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=6, help="Linear layers (at least 2)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=4, help="per minibatch, for the microbatched kinds")
    ap.add_argument("--max-norm", type=float, default=0.1, help="below these updates' norms (about 0.18)")
    ap.add_argument("--windows", type=int, default=6, help="timed windows of each contender")
    ap.add_argument("--per-window", type=int, default=8)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/clipping")
    args = ap.parse_args(argv)
    if args.depth < 2:
        ap.error(f"--depth must be at least 2 (one Linear layer per stage), got {args.depth}")
    torch.set_num_threads(1)
    kinds = args.kinds.split(",")
    rows, probes, agree = probed(lambda: run(kinds, args))
    result = {"commit": git_commit(), "probes": probes, "probes_agree": agree, "args": vars(args), "rows": rows}
    write_results(args.out, result, clipping(result))  # the docs render it the same way (TABLES)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
