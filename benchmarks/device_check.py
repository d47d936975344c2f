"""The GPU check, ready before the GPU is: what the README says no GPU has verified, in one run.

On the device it is given (``--device cuda``, the default where CUDA exists; ``--device cpu`` runs
the same code paths on CPU, and CI runs that dry run so the script cannot rot):

* **parity**: every schedule kind with a version rule (all but ``naive``) on 1 and 2 workers,
  recomputation and bfloat16, each trained a few minibatches by the pipeline *on the device*
  and by ``verify``'s one-process reference of its rule on the same device; every parameter and
  buffer compared. Two workers share the one device: NCCL refuses two ranks on one GPU, so they
  talk over gloo, their messages staged through host memory (runtime/comm.py, "wire device");
* **profile**: the profiler's per-layer forward and backward times (CUDA events on a GPU)
  summed, against a whole forward-backward step timed alone;
* **memory**: a straight 2-stage flush plan's predicted peak per stage (the memory model)
  against the measured one (``torch.cuda.max_memory_allocated`` on a GPU);
* **throughput**: plain training in one process, the schedule ``--schedule auto`` chooses for
  2 workers sharing the device, and the simulator's prediction for that choice.

    scripts/device_check                       # on the GPU: results/device_check.json
    scripts/device_check --device cpu          # the dry run (about a minute on 2 cores)

Writes ``--out`` (default benchmarks/results/device_check.json on CUDA, device_check_cpu.json on
CPU) and prints a short table. Exit status 1 when a parity case fails.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from table_format import Table, table  # noqa: E402

#: the model and run sizes of each preset: (width, blocks, batch, minibatches timed)
SIZES = {"small": (64, 4, 32, 6), "gpu": (1024, 8, 256, 20)}
CLASSES = 10
PARITY_MINIBATCHES = 3
MICROBATCHES = 4
#: kinds whose plan puts one stage on each worker (the virtual-stage kinds have their own plans)
STRAIGHT_KINDS = ("pipedream", "2bw", "flush", "gpipe", "zb-h1", "zb-h2", "zb-2bw")
VIRTUAL_KINDS = ("interleaved", "zb-v")
#: verify's tolerances, bf16 too: both sides run the same bf16 arithmetic on the same microbatches
#: (tests/test_device_check.py: bf16 moves the weights by many times this from fp32's)
ATOL, RTOL = 1e-5, 1e-4


def make_model(width: int, blocks: int, seed: int = 0) -> Any:
    """A residual-free MLP of ``blocks`` (Linear, GELU, Linear, LayerNorm) blocks and a classifier:
    every layer a weight a GPU multiplies, nothing drawn at random (verify compares one process)."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width), nn.LayerNorm(width)]
    return nn.Sequential(*layers, nn.Linear(width, CLASSES))


def make_batches(width: int, batch: int, count: int, seed: int = 1) -> list:
    """``count`` (inputs, labels) minibatches on the CPU (each side moves them to its device)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, width, generator=g), torch.randint(0, CLASSES, (batch,), generator=g))
            for _ in range(count)]


def _loss() -> Any:
    from torch import nn

    return nn.CrossEntropyLoss()


def _optimizer() -> Any:
    import torch

    return functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)


# ----------------------------------------------------------------------------- parity
def _cuts(names: list[str], parts: int) -> list[list[str]]:
    """The model's layers (input first) in ``parts`` consecutive groups of nearly equal length."""
    step = len(names) / parts
    return [names[round(i * step): round((i + 1) * step)] for i in range(parts)]


def parity_plans(names: list[str], workers: int) -> list[tuple[str, Any]]:
    """(case, plan) of every kind with a version rule on ``workers`` workers, and recomputation."""
    from torchpipedream.plans.plan import Plan

    cases = []
    for kind in STRAIGHT_KINDS:
        m = {"microbatches": MICROBATCHES} if kind != "pipedream" else {}
        cases.append((kind, Plan.straight(_cuts(names, workers), schedule=kind, **m)))
    virtual = _cuts(names, 2 * workers)
    cases.append(("interleaved", Plan.looped(virtual, workers, microbatches=MICROBATCHES)))
    cases.append(("zb-v", Plan.v_shape(virtual, workers, microbatches=MICROBATCHES)))
    for kind in ("flush", "pipedream"):
        plan = dict(cases)[kind]
        cases.append((f"{kind} + recompute", plan.with_recompute(True)))
    return cases


def parity(device: str, width: int, blocks: int, batch: int, names: list[str]) -> list[dict]:
    """Every parity case on 1 and 2 workers in fp32, and pipedream, flush and zb-v in bf16: one
    launch of workers per worker count and precision."""
    from torchpipedream.runtime.verification import verify_plans

    model = functools.partial(make_model, width, blocks)
    batches = make_batches(width, batch, PARITY_MINIBATCHES)
    rows = []
    for workers in (1, 2):
        for precision in ("fp32", "bf16"):
            cases = parity_plans(names, workers)
            if precision == "bf16":
                cases = [(k, p) for k, p in cases if k in ("flush", "pipedream", "zb-v")]
            reports = verify_plans(model, batches, [p for _, p in cases], _optimizer(), loss_fn=_loss(),
                                   atol=ATOL, rtol=RTOL, device=device, precision=precision)
            for (case, plan), report in zip(cases, reports):
                rows.append({"case": case, "workers": workers, "precision": precision, "plan": plan.summary,
                             "ok": report.ok, "max_abs_diff": report.max_abs_diff,
                             "mismatch": None if report.ok else str(report.mismatch)})
                logging.info("parity %-22s %d worker(s) %s: %s", case, workers, precision, "OK" if report.ok else report)
    return rows


# ----------------------------------------------------------------------------- profile
def _synchronize(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(device: str, width: int, blocks: int, batch: int, count: int, update: bool) -> float:
    """Median seconds of one plain step (forward, loss, backward; and the optimizer's step when
    ``update``) in this process on ``device``, after two untimed ones."""
    import torch

    dev = torch.device(device)
    model = make_model(width, blocks).to(dev)
    opt = _optimizer()(model.parameters())
    loss_fn = _loss()
    seconds = []
    for i, (x, y) in enumerate(make_batches(width, batch, count + 2)):
        x, y = x.to(dev), y.to(dev)
        _synchronize(dev)
        t0 = time.perf_counter()
        loss_fn(model(x), y).backward()
        if update:
            opt.step()
        opt.zero_grad(set_to_none=True)
        _synchronize(dev)
        if i >= 2:
            seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def profile_check(device: str, width: int, blocks: int, batch: int) -> tuple[dict, Any]:
    """The profile's summed forward and backward of one microbatch against a plain step of one
    microbatch timed alone; returns the row and the graph (the later sections plan with it)."""
    from torchpipedream.model.profiler import profile

    x, y = make_batches(width, batch, 1)[0]
    graph = profile(make_model(width, blocks), x, loss_fn=_loss(), target=y, device=device, warmup=2, iters=5,
                    microbatches=MICROBATCHES)
    totals = graph.totals()
    step_s = timed_steps(device, width, blocks, batch // MICROBATCHES, 7, update=False)
    # the graph describes the minibatch: one microbatch's times × MICROBATCHES (profile's microbatches)
    profiled_s = (totals["forward_ms"] + totals["backward_ms"]) / 1000 / MICROBATCHES
    return {"timer": graph.meta.get("timer") if isinstance(graph.meta, dict) else None,
            "profiled_forward_backward_ms": profiled_s * 1000, "timed_step_ms": step_s * 1000,
            "profiled_vs_timed": profiled_s / step_s}, graph


# ----------------------------------------------------------------------------- memory and throughput
def _worker(rank: int, device: str, width: int, blocks: int, batch: int, count: int,
            memory_plan: Any, fast_plan: Any) -> dict:
    """On each rank: the memory plan's measured peak per stage, then the chosen plan's seconds per
    minibatch over ``count`` minibatches after one untimed."""
    import torch
    import torch.distributed as dist
    from torchpipedream.runtime import Pipeline

    dev = torch.device(device)
    batches = make_batches(width, batch, count + 1)
    pipe = Pipeline(make_model(width, blocks), memory_plan, _optimizer(), loss_fn=_loss(), device=dev,
                    measure_memory=True, timeout_s=120)
    pipe.train_minibatches(batches[:3])
    peaks = pipe.memory_peaks()
    pipe = Pipeline(make_model(width, blocks), fast_plan, _optimizer(), loss_fn=_loss(), device=dev, timeout_s=120)
    pipe.train_minibatches(batches[:1])
    _synchronize(dev)
    dist.barrier()
    t0 = time.perf_counter()
    pipe.train_minibatches(batches[1:])
    _synchronize(dev)
    dist.barrier()
    return {"peaks": peaks, "seconds_per_minibatch": (time.perf_counter() - t0) / count}


def memory_and_throughput(device: str, width: int, blocks: int, batch: int, count: int, graph: Any) -> dict:
    """Predicted against measured peaks per stage (straight flush on 2 workers); plain training,
    the auto-chosen schedule on 2 workers sharing the device, and the simulator's prediction."""
    from torchpipedream.plans.topology import Topology
    from torchpipedream.runtime import launch
    from torchpipedream.search.auto import choose_schedule
    from torchpipedream.search.planner import plan as make_plan
    from torchpipedream.train.preparation import measured_host_costs

    memory_plan = make_plan(graph, Topology.local(2), schedule="flush", microbatches=MICROBATCHES, straight=True,
                            num_stages=2)
    # priced with this host's measured message costs, as `train --schedule auto` prices a local run
    fast_plan = choose_schedule(graph, Topology.local(2), microbatches=(MICROBATCHES,), host_costs=measured_host_costs)
    chosen = fast_plan.meta["auto"]["chosen"]
    out = launch(_worker, 2, device, width, blocks, batch, count, memory_plan, fast_plan, timeout_s=300,
                 return_all=True)
    memory = [{"stage": s, "predicted_bytes": st.memory_bytes, "measured_bytes": out[0]["peaks"][s],
               "measured_vs_predicted": out[0]["peaks"][s] / st.memory_bytes}
              for s, st in enumerate(memory_plan.stages)]
    plain_s = timed_steps(device, width, blocks, batch, count, update=True)
    pipeline_s = out[0]["seconds_per_minibatch"]
    throughput = {"plan": fast_plan.summary, "schedule": fast_plan.schedule, "microbatches": fast_plan.microbatches,
                  "plain_samples_per_s": batch / plain_s, "pipeline_samples_per_s": batch / pipeline_s,
                  "predicted_samples_per_s": batch / chosen["time_per_minibatch_s"],
                  "pipeline_vs_plain": plain_s / pipeline_s}
    return {"memory": memory, "throughput": throughput}


# ----------------------------------------------------------------------------- the run
def describe_device(device: str) -> dict:
    import torch

    info = {"device": device, "torch": torch.__version__, "host": platform.node(), "cpu_threads": torch.get_num_threads()}
    if device.startswith("cuda"):
        info.update(gpu=torch.cuda.get_device_name(device), cuda=torch.version.cuda, gpus=torch.cuda.device_count())
    return info


def report(results: dict) -> str:
    """The short table: each parity case per worker count, then the measured checks."""
    cases: dict[tuple[str, str], dict[int, bool]] = {}
    for row in results["parity"]:
        cases.setdefault((row["case"], row["precision"]), {})[row["workers"]] = row["ok"]
    parity_rows = [(case, precision, *("OK" if by.get(w) else ("-" if w not in by else "MISMATCH") for w in (1, 2)))
                   for (case, precision), by in cases.items()]
    prof, thr = results["profile"], results["throughput"]
    measured = [("profile: forward+backward summed / timed step", f"{prof['profiled_vs_timed']:.2f}")]
    measured += [(f"memory, stage {m['stage']}: measured / predicted", f"{m['measured_vs_predicted']:.2f}")
                 for m in results["memory"]]
    measured += [("plain, samples/s", f"{thr['plain_samples_per_s']:.0f}"),
                 (f"{thr['schedule']} on 2 workers sharing the device, samples/s", f"{thr['pipeline_samples_per_s']:.0f}"),
                 ("simulator's prediction for it, samples/s", f"{thr['predicted_samples_per_s']:.0f}")]
    return (table(["case", "precision", "1 worker", "2 workers"], parity_rows) + "\n\n"
            + table(["check", "value"], measured))


#: the dry run's table in docs/benchmarks.md (the GPU run's joins it once a GPU has written its file)
TABLES = {"device_check_cpu": Table(("device_check_cpu.json",), report)}


def run(device: str, size: str) -> dict:
    """Every section on ``device`` at preset ``size``; the results as written."""
    import torch

    width, blocks, batch, count = SIZES[size]
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)  # as the profiler times and each worker runs: one core each
    t0 = time.perf_counter()
    results: dict[str, Any] = {"info": describe_device(device), "size": size,
                               "model": {"width": width, "blocks": blocks, "batch": batch}}
    try:
        prof, graph = profile_check(device, width, blocks, batch)
        results["profile"] = prof
        results["parity"] = parity(device, width, blocks, batch, graph.names)
        results.update(memory_and_throughput(device, width, blocks, batch, count, graph))
    finally:
        torch.set_num_threads(threads)  # main() may run inside another program (the dry run's test)
    results["all_parity_ok"] = all(r["ok"] for r in results["parity"])
    results["seconds"] = time.perf_counter() - t0
    return results


def main(argv: list[str] | None = None) -> int:
    import torch

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu",
                   help="cpu (the dry run) or cuda[:i] (default: cuda:0 where CUDA exists)")
    p.add_argument("--size", choices=sorted(SIZES), default=None,
                   help="model and run size (default: gpu on CUDA, small on CPU)")
    p.add_argument("--out", type=Path, default=None, help="results file (default: benchmarks/results/device_check"
                   "[_cpu].json)")
    args = p.parse_args(argv)
    device = "cuda:0" if args.device == "cuda" else args.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        p.error(f"--device {args.device}: CUDA is not available here (use --device cpu for the dry run)")
    size = args.size or ("gpu" if device.startswith("cuda") else "small")
    out = args.out or HERE / "results" / ("device_check.json" if device.startswith("cuda") else "device_check_cpu.json")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results = run(device, size)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1) + "\n")
    print(report(results))
    print(f"\n{'every parity case passed' if results['all_parity_ok'] else 'PARITY FAILED'}; "
          f"{results['seconds']:.0f} s; wrote {out}")
    return 0 if results["all_parity_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
