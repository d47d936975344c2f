"""Statistical efficiency: test accuracy against epochs and wall-clock time, per training method.

Same model (the default CNN), data (digits, fixed split), seeds, batch size, optimizer and
learning rate for: a single process, torch DistributedDataParallel (2 processes), and
torchpipedream's pipedream (weight stashing), pipedream with vertical sync, naive pipelining
(no stashing), 2bw and flush, on a straight pipeline of --stages stages. Prints a table of
epochs to the target accuracy (mean over seeds) and writes results JSON, a markdown table and a
plot.

    .venv/bin/python benchmarks/statistical_efficiency.py                # the docs' numbers
    .venv/bin/python benchmarks/statistical_efficiency.py --quick        # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from table_format import Data, Table, table  # noqa: E402

from torchpipedream.train import TrainConfig  # noqa: E402

PIPELINE_METHODS = {
    "pipedream": dict(schedule="pipedream"),
    "pipedream+vsync": dict(schedule="pipedream", vertical_sync=True),
    "naive": dict(schedule="naive"),
    "2bw": dict(schedule="2bw"),
    "flush": dict(schedule="flush"),
}


def _evaluate(model: torch.nn.Module, xt: torch.Tensor, yt: torch.Tensor) -> float:
    import torch

    with torch.no_grad():
        return (model(xt).argmax(-1) == yt).float().mean().item()


def _train_epochs(cfg: TrainConfig, model: torch.nn.Module, eval_model: torch.nn.Module,
                  part: Callable[[int], slice | torch.Tensor], loss_weight: Callable[[int], float]) -> list[dict]:
    """The reference training loop shared by the single process and each DDP rank.

    ``part(n)`` selects this process's samples of a minibatch of n; ``loss_weight(n)`` scales
    its mean loss so that the applied gradient is the mean over the whole minibatch.
    """
    from torchpipedream.train.inputs import load_data, loss_for, minibatches, optimizer_factory

    opt = optimizer_factory(cfg)(model.parameters())
    loss_fn = loss_for(cfg)
    x, y, xt, yt = load_data(cfg)
    history, clock = [], 0.0
    for epoch in range(cfg.epochs):
        t0 = time.perf_counter()
        for xb, yb in minibatches(x, y, cfg.batch_size, cfg.max_minibatches, cfg.seed * 1000 + epoch):
            mine = part(len(xb))
            opt.zero_grad(set_to_none=True)
            (loss_fn(model(xb[mine]), yb[mine]) * loss_weight(len(xb))).backward()
            opt.step()
        clock += time.perf_counter() - t0
        history.append({"epoch": epoch + 1, "seconds": clock, "test_accuracy": _evaluate(eval_model, xt, yt)})
    return history


def single_process(cfg: TrainConfig) -> list[dict]:
    """Plain training in one process: the reference every method is held against."""
    import torch

    from torchpipedream.train.inputs import build_model

    torch.set_num_threads(1)
    model = build_model(cfg)
    return _train_epochs(cfg, model, model, lambda n: slice(0, n), lambda n: 1.0)


def _ddp_worker(rank: int, cfg: TrainConfig) -> list[dict] | None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torchpipedream.train.inputs import build_model

    world = dist.get_world_size()
    model = DDP(build_model(cfg))
    # DDP averages gradients over ranks: weight each rank's mean loss by its share of the batch
    history = _train_epochs(cfg, model, model.module,
                            lambda n: torch.tensor_split(torch.arange(n), world)[rank],
                            lambda n: len(torch.tensor_split(torch.arange(n), world)[rank]) * world / n)
    return history if rank == 0 else None


def ddp(cfg: TrainConfig, workers: int = 2) -> list[dict]:
    from torchpipedream.runtime import launch

    return launch(_ddp_worker, workers, cfg, timeout_s=900)


def fixed_plan(cfg: TrainConfig, stages: int, path: Path) -> str:
    """Plan once and reuse the file: every pipeline method and seed then cuts the model at the
    same places (a fresh profile per run can move a cut, and an asynchronous schedule's result
    depends on where the cuts are)."""
    from torchpipedream.train.preparation import prepare

    prep = prepare(replace(cfg, workers=stages, stages=stages, straight=True))
    path.parent.mkdir(parents=True, exist_ok=True)
    prep.plan.save(path)
    return str(path)


def pipeline(cfg: TrainConfig, stages: int, plan_file: str, **method) -> list[dict]:
    from torchpipedream.train.job import run

    run_cfg = replace(cfg, workers=stages, plan_file=plan_file, progress=False,
                      out=f"/tmp/tpd_stateff/{os.getpid()}", **method)
    report = run(run_cfg)
    clock, out = 0.0, []
    for row in report["history"]:
        clock += row["seconds"]
        out.append({"epoch": row["epoch"], "seconds": clock, "test_accuracy": row["test_accuracy"]})
    return out


def epochs_to(history: list[dict], target: float) -> int | None:
    return next((h["epoch"] for h in history if h["test_accuracy"] >= target), None)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--lr", type=float, default=TrainConfig.lr)
    ap.add_argument("--optimizer", default=TrainConfig.optimizer)
    ap.add_argument("--target", type=float, default=0.98, help="the accuracy the table's headline counts epochs to")
    ap.add_argument("--from-json", default=None, help="re-render the table and plot from an earlier run's JSON")
    ap.add_argument("--methods", default="single,ddp," + ",".join(PIPELINE_METHODS))
    ap.add_argument("--quick", action="store_true", help="1 seed, 3 epochs, 10 minibatches per epoch")
    ap.add_argument("--out", default="benchmarks/results/statistical_efficiency")
    args = ap.parse_args(argv)
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        meta = dict(data["meta"], target=args.target)
        write_outputs(data["histories"], meta, Path(args.out))
        return 0
    if args.quick:
        args.seeds, args.epochs = 1, 3
    methods = args.methods.split(",")
    results: dict[str, list[list[dict]]] = {m: [] for m in methods}
    plan_file = fixed_plan(TrainConfig(optimizer=args.optimizer, lr=args.lr), args.stages,
                           Path(f"{args.out}.plan.json"))
    for seed in range(args.seeds):
        cfg = TrainConfig(epochs=args.epochs, seed=seed, lr=args.lr, optimizer=args.optimizer,
                          max_minibatches=10 if args.quick else None, progress=False, timeout_s=120)
        for m in methods:  # interleaved: every method once per seed
            t0 = time.perf_counter()
            if m == "single":
                hist = single_process(cfg)
            elif m == "ddp":
                hist = ddp(cfg)
            else:
                hist = pipeline(cfg, args.stages, plan_file, **PIPELINE_METHODS[m])
            results[m].append(hist)
            print(f"seed {seed} {m:<16} final acc {hist[-1]['test_accuracy']:.4f}  "
                  f"epochs to {args.target:.0%}: {epochs_to(hist, args.target)}  ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    write_outputs(results, meta_of(args), Path(args.out))
    return 0


def meta_of(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in ("epochs", "seeds", "stages", "lr", "optimizer", "target")}


def summarise(results: dict[str, list[list[dict]]], targets: list[float]) -> list[dict]:
    """Per method: mean epochs to each target (over the seeds that reach it), final accuracy, s/epoch."""
    rows = []
    for m, runs in results.items():
        row = {"method": m, "final_accuracy_mean": statistics.mean(h[-1]["test_accuracy"] for h in runs),
               "seconds_per_epoch": statistics.mean(h[-1]["seconds"] / len(h) for h in runs)}
        for t in targets:
            reach = [epochs_to(h, t) for h in runs]
            ok = [r for r in reach if r is not None]
            row[f"epochs_to_{t:g}"] = statistics.mean(ok) if ok else None
            row[f"reached_{t:g}"] = f"{len(ok)}/{len(reach)}"
        rows.append(row)
    return rows


def write_outputs(results: dict[str, list[list[dict]]], meta: dict, out: Path) -> None:
    """Print and write the table (epochs to 95%, 97% and the headline target), JSON and plot."""
    data = {"meta": meta, "rows": summarise(results, _targets(meta)), "histories": results}
    text = statistical_efficiency(data)  # the same function renders docs/statistical_efficiency.md's tables
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(data, indent=1))
    Path(f"{out}.md").write_text(text + "\n")
    _plot(results, meta["target"], Path(f"{out}.png"))
    print(f"wrote {out}.json, {out}.md, {out}.png")


def _plot(results: dict[str, list[list[dict]]], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for m, runs in results.items():
        epochs = [h["epoch"] for h in runs[0]]
        acc = [statistics.mean(r[i]["test_accuracy"] for r in runs) for i in range(len(epochs))]
        secs = [statistics.mean(r[i]["seconds"] for r in runs) for i in range(len(epochs))]
        a1.plot(epochs, acc, marker="o", ms=3, label=m)
        a2.plot(secs, acc, marker="o", ms=3, label=m)
    for ax, xl in ((a1, "epoch"), (a2, "training wall-clock (s)")):
        ax.axhline(target, color="grey", ls=":", lw=1)
        ax.set_xlabel(xl)
        ax.set_ylabel("test accuracy (mean over seeds)")
        ax.set_ylim(max(0.0, min(ax.get_ylim()[0], 0.8)), 1.0)
        ax.grid(alpha=0.3)
    a1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ----------------------------------------------------------------------------- what the docs show
def _targets(meta: Data) -> list[float]:
    return sorted({0.95, 0.97, meta["target"]})


def statistical_efficiency(data: Data) -> str:
    """statistical_efficiency*.json (benchmarks/statistical_efficiency.py) → epochs to each target
    accuracy (mean over the seeds that reach it), final accuracy and seconds per epoch per method."""
    targets = _targets(data["meta"])
    head = ["method"] + [f"epochs to {t:.0%} (seeds)" for t in targets] + ["final accuracy", "s/epoch"]
    body = []
    for r in data["rows"]:
        cells = []
        for t in targets:
            e = r[f"epochs_to_{t:g}"]
            cells.append(("-" if e is None else f"{e:.2f}") + f" ({r[f'reached_{t:g}']})")
        body.append([r["method"], *cells, f"{r['final_accuracy_mean']:.4f}", f"{r['seconds_per_epoch']:.2f}"])
    return table(head, body)


#: Accuracies closer than this are equal: the single process stores float32 values, the others float64.
SAME_ACCURACY = 1e-4


def statistical_efficiency_agreement(data: Data) -> str:
    """statistical_efficiency*.json → for each method, the epochs whose test accuracy differs from
    the single process's in the same seed, and by how much."""
    hist = data["histories"]
    reference = hist["single"]
    head = ["method", "epochs that differ from the single process", "largest difference", "seeds with a difference"]
    body = []
    for method, runs in hist.items():
        if method == "single":
            continue
        diffs = [[b["test_accuracy"] - a["test_accuracy"] for a, b in zip(ref, run)]
                 for ref, run in zip(reference, runs)]
        differ = [d for seed in diffs for d in seed if abs(d) > SAME_ACCURACY]
        seeds = sum(any(abs(d) > SAME_ACCURACY for d in seed) for seed in diffs)
        total = sum(len(seed) for seed in diffs)
        largest = max(differ, key=abs) if differ else 0.0
        body.append([method, f"{len(differ)} of {total}", f"{largest:+.4f}" if differ else "0",
                     f"{seeds} of {len(diffs)}"])
    return table(head, body)


def statistical_efficiency_by_epoch(data: Data) -> str:
    """statistical_efficiency*.json → mean test accuracy over the seeds after every epoch."""
    hist = data["histories"]
    epochs = len(next(iter(hist.values()))[0])
    head = ["method"] + [f"epoch {e + 1}" for e in range(epochs)]
    body = [[m] + [f"{statistics.mean(run[e]['test_accuracy'] for run in runs):.4f}" for e in range(epochs)]
            for m, runs in hist.items()]
    return table(head, body)


TABLES = {
    "statistical_efficiency": Table(("statistical_efficiency.json",), statistical_efficiency),
    "statistical_efficiency_agreement": Table(("statistical_efficiency.json",), statistical_efficiency_agreement),
    "statistical_efficiency_by_epoch": Table(("statistical_efficiency.json",), statistical_efficiency_by_epoch),
    "statistical_efficiency_momentum": Table(("statistical_efficiency_momentum.json",), statistical_efficiency),
    "statistical_efficiency_momentum_agreement": Table(("statistical_efficiency_momentum.json",),
                                                       statistical_efficiency_agreement),
    "statistical_efficiency_momentum_by_epoch": Table(("statistical_efficiency_momentum.json",),
                                                      statistical_efficiency_by_epoch),
}
COMPANIONS = {"statistical_efficiency.md": Table(("statistical_efficiency.json",), statistical_efficiency),
              "statistical_efficiency_momentum.md": Table(("statistical_efficiency_momentum.json",),
                                                          statistical_efficiency)}


if __name__ == "__main__":
    sys.exit(main())
