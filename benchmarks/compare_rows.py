"""The rows that compare.py measures, and that held_out.py, auto_choice.py, recompute.py,
memory_model.py, split_backward.py and sync_breakdown.py run the same way: the three benchmark
workloads, torchpipedream's rows (each pass predicted from costs measured right before it runs),
the peers' rows, and ``compare_model``, which runs one model's rows in interleaved passes.

Importing this module sets this process's allocator up as the workers' (PyTorch's huge pages,
freed memory kept for reuse) before it imports torch. compare.py's docstring says what is
measured and how.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from torchpipedream.host.freed_memory import keep_freed_memory
from torchpipedream.host.huge_pages import huge_pages_on, prefer_huge_pages

prefer_huge_pages()  # before this process's first tensor; the workers inherit it
KEEPS_FREED_MEMORY = keep_freed_memory()  # the single-process rows allocate as the workers do

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from peers import (CUTS, Workload, layer_times, peak_rss_mb, run_ddp, run_single, run_torch_pipelining,  # noqa: E402
                   split_sequential, training_step)

from torchpipedream.plans.kinds import schedule_kind  # noqa: E402
from torchpipedream.runtime import Pipeline, launch  # noqa: E402

TORCH_SCHEDULES = ("GPipe", "1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "Interleaved1F1B")
#: torchpipedream's rows: name -> (schedule kind, straight plan): "flush straight" runs flush on a
#: one-worker-per-stage plan, the cut zb-h1 runs (the planner may prefer data parallelism for flush);
#: "2bw straight" likewise, the cut zb-2bw runs
TPD_ROWS = {"pipedream": ("pipedream", False), "2bw": ("2bw", False), "flush": ("flush", False),
            "flush straight": ("flush", True), "zb-h1": ("zb-h1", False), "zb-h2": ("zb-h2", False),
            "interleaved": ("interleaved", False), "zb-v": ("zb-v", False),
            "2bw straight": ("2bw", True), "zb-2bw": ("zb-2bw", False)}
#: The rows every table needs (the ratios are to them): kept by --rows whatever it names.
BASE_ROWS = ("single, 1 thread", "torch DDP")
#: Microbatch counts tried for each torch.distributed.pipelining row (with each of peers.CUTS).
TORCH_MICROBATCHES = (2, 4, 8)


# ----------------------------------------------------------------------------- workloads
def _fc_heavy() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                         nn.Linear(4096, 1000))


def _fc_batch(b: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, 4096, generator=g), torch.randint(0, 1000, (b,), generator=g)


def _small_cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(64 * 8 * 8, 10),
    )


def _cnn_batch(b: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(b, 3, 32, 32, generator=g), torch.randint(0, 10, (b,), generator=g)


class _Embed(nn.Module):
    """Token + position embedding as one module, so the LM is an nn.Sequential."""

    def __init__(self, tok: nn.Embedding, pos: nn.Parameter) -> None:
        super().__init__()
        self.tok, self.pos = tok, pos

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos


def _transformer_lm() -> nn.Sequential:
    from torchpipedream.models import transformer

    torch.manual_seed(0)
    lm = transformer()
    return nn.Sequential(_Embed(lm.tok, lm.pos), *lm.blocks, lm.ln, lm.head)


def _lm_batch(b: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    from torchpipedream.models import VOCAB_SIZE

    x = torch.randint(0, VOCAB_SIZE, (b, 64), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


WORKLOADS = {
    "fc_heavy": Workload("fc_heavy", _fc_heavy, _fc_batch, nn.functional.cross_entropy, 64),
    "small_cnn": Workload("small_cnn", _small_cnn, _cnn_batch, nn.functional.cross_entropy, 64),
    "transformer_lm": Workload("transformer_lm", _transformer_lm, _lm_batch, _lm_loss, 16),
}


# ----------------------------------------------------------------------------- torchpipedream rows
def split_built(build, parts: int) -> nn.Module:
    """``build()`` with its wide linear layers split into ``parts`` column parts (picklable with
    functools.partial, for the baselines run on the model as torchpipedream runs it)."""
    from torchpipedream.model.layer_split import split_wide_layers

    return split_wide_layers(build(), parts)


def tpd_model(work: Workload, split_parts: int) -> nn.Module:
    """The model as torchpipedream runs it: wide linear layers split into column parts so the
    planner may cut inside them (same function, same training; see layer_split.py)."""
    from torchpipedream.model.layer_split import split_wide_layers

    model = work.build()
    return split_wide_layers(model, split_parts) if split_parts > 1 else model


def _profile(work: Workload, m: int, split_parts: int, threads: int = 1):
    """The model profiled in this process (``threads`` torch threads) as the schedule runs it: in
    microbatches of batch/m samples, with the SGD update timed."""
    from torchpipedream.model.profiler import profile

    g = torch.Generator().manual_seed(0)
    x, y = work.make_batch(work.batch_size, g)
    return profile(tpd_model(work, split_parts), x, loss_fn=work.loss_fn, target=y, name=work.name,
                   optimizer=lambda p: torch.optim.SGD(p, lr=work.lr), microbatches=m, num_threads=threads)


def schedule_microbatches(schedule: str, microbatches: int) -> int:
    """Microbatches per minibatch as torchpipedream runs ``schedule`` (pipedream: whole minibatches)."""
    return microbatches if schedule_kind(schedule).microbatched else 1


def choose_plan(work: Workload, workers: int, schedule: str, microbatches: int, split_parts: int = 1,
                minibatches: int = 32, straight: bool = False):
    """The planner's plan for ``workers`` local workers from one profile (one worker per stage
    with ``straight``), and its schedule of ``minibatches`` minibatches (the length one timed
    window runs)."""
    from torchpipedream.search.planner import plan as make_plan
    from torchpipedream.schedule.build import build_schedule
    from torchpipedream.plans.topology import Topology

    m = schedule_microbatches(schedule, microbatches)
    plan = make_plan(_profile(work, m, split_parts), Topology.local(workers), schedule=schedule, microbatches=m,
                     straight=straight)
    return plan, build_schedule(plan, schedule, minibatches=minibatches, microbatches=m)


def host_costs(work: Workload, plan, m: int) -> dict:
    """This host's measured terms for ``plan`` at ``m`` microbatches, as ``host_costs`` of
    ``choose_schedule``/``choose_layout`` (as train's: a single worker sends and reduces nothing)."""
    from torchpipedream.runtime.measure import measure_local_costs

    if plan.num_workers < 2:
        return {}
    return measure_local_costs(plan, m, make_step=functools.partial(training_step, work, m))


def planned_microbatches(work: Workload, workers: int, schedule: str, split_parts: int = 1, minibatches: int = 32,
                         straight: bool = False) -> int:
    """The microbatch count the planner predicts fastest for ``schedule`` (``choose_schedule``
    with this kind alone over auto_schedule.DEFAULT_MICROBATCHES, this host's costs measured
    for each candidate as ``predict`` measures them)."""
    from torchpipedream.search.auto import choose_schedule
    from torchpipedream.plans.topology import Topology

    if not schedule_kind(schedule).microbatched:
        return 1
    plan = choose_schedule(
        lambda m: _profile(work, m, split_parts), Topology.local(workers), kinds=[schedule], minibatches=minibatches,
        batch_size=work.batch_size, straight=straight, host_costs=functools.partial(host_costs, work))
    return int(plan.meta["auto"]["chosen"]["microbatches"])


def predict(work: Workload, plan, sched, split_parts: int = 1):
    """The simulator's samples/s for ``sched`` from costs measured now: a fresh profile and this
    host's terms (runtime.measure.py: message overhead, copy and accumulate bandwidth, all-reduces,
    and the slowdown of the plan's workers training side by side). Returns (samples/s, Costs,
    the simulation).

    Called right before each run of the row it predicts: this machine's speed drifts by 20-30%
    within minutes, so a prediction made before all the rows (as up to run 8) compared one
    moment's costs with another moment's run.
    """
    from torchpipedream.runtime.measure import measure_local_costs
    from torchpipedream.sim.simulator import Costs, simulate

    m = sched.microbatches
    graph = _profile(work, m, split_parts)
    per_stage = {k: [sum(getattr(graph[n], k) for n in st.layers) / 1e3 for st in plan.stages]
                 for k in ("forward_ms", "backward_ms", "optimizer_ms")}
    costs = Costs.from_plan(
        plan, microbatches=m,
        forward_s=[f / m for f in per_stage["forward_ms"]],
        # a recomputing stage runs its forward again in every backward (Stage.recompute)
        backward_s=[(b + (f if st.recompute else 0.0)) / m
                    for f, b, st in zip(per_stage["forward_ms"], per_stage["backward_ms"], plan.stages)],
        step_s=per_stage["optimizer_ms"],
        **measure_local_costs(plan, m, make_step=functools.partial(training_step, work, m)))
    sim = simulate(sched, costs)
    return sched.minibatches * work.batch_size / sim.makespan_s, costs, sim


def _median_compute(trace, stages: int) -> dict[str, list[float]]:
    """Each stage's median F, B and U seconds in ``trace`` (measured or simulated)."""
    return {k: [trace.median_duration_s(s, k) for s in range(stages)] for k in ("F", "B", "W", "U")}


def _predict_and_run(work: Workload, plan, sched, microbatches: int, windows: int, per_window: int,
                     split_parts: int) -> dict:
    """One pass of a torchpipedream row: predict it from costs measured now, then run it, then
    simulate it again with the compute times the run measured (a diagnostic, not the prediction).

    The run's median F, B and U already contain any slowdown, gradient accumulation and stash
    copy; simulating with them separates the two ways a prediction misses: the CPU computing
    at another speed than profiled (``run_compute_vs_profile``: the stages' median F + B in the
    run against the same medians in the simulation), and the schedule's waiting and
    communication (what is left against ``predicted_with_run_compute``).
    """
    from torchpipedream.sim.simulator import simulate

    predicted, costs, sim = predict(work, plan, sched, split_parts)
    res = launch(_tpd_worker, plan.num_workers, work, plan, sched.kind, microbatches, 1, windows, per_window,
                 split_parts, timeout_s=900)
    run = _median_compute(res.pop("trace"), plan.num_stages)
    simulated = _median_compute(sim.trace, plan.num_stages)
    split = any(w for w in run["W"])  # a split backward: B and W each measured
    got = dataclasses.replace(costs, forward_s=run["F"], step_s=run["U"], compute_slowdown=1.0,
                              backward_s=[b + (w if split else 0.0) for b, w in zip(run["B"], run["W"])],
                              weight_grad_s=run["W"] if split else costs.weight_grad_s,
                              copy_Bps=float("inf"), accumulate_Bps=float("inf"))
    return {**res, "predicted_samples_per_s": predicted, "slowdown": costs.compute_slowdown,
            "predicted_with_run_compute": sched.minibatches * work.batch_size / simulate(sched, got).makespan_s,
            "run_compute_vs_profile": sum(run["F"] + run["B"] + run["W"])
            / sum(simulated["F"] + simulated["B"] + simulated["W"])}


def _tpd_worker(rank: int, work: Workload, plan, schedule: str, microbatches: int, warmup: int, windows: int,
                per_window: int, split_parts: int) -> dict:
    g = torch.Generator().manual_seed(0)
    data = [work.make_batch(work.batch_size, g) for _ in range(per_window)]
    # the sample lets torch.export trace what torch.fx cannot (the held-out Hugging Face models)
    pipe = Pipeline(tpd_model(work, split_parts), plan, optimizer=lambda p: torch.optim.SGD(p, lr=work.lr),
                    loss_fn=work.loss_fn, schedule=schedule, sample=data[0][0],
                    microbatches=microbatches if schedule_kind(schedule).microbatched else None, timeout_s=120)
    for _ in range(warmup):
        pipe.train_minibatches(data)
    times = []
    for _ in range(windows):
        dist.barrier()
        t0 = time.perf_counter()
        pipe.train_minibatches(data)  # one schedule of per_window minibatches: fill, steady state, drain
        times.append((time.perf_counter() - t0) / per_window)
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, (statistics.median(times), peak_rss_mb()))
    trace = pipe.trace()  # the last window's events, every rank's (on rank 0)
    return {"samples_per_s": work.batch_size / max(t for t, _ in out), "peak_rss_mb": [r for _, r in out],
            "trace": trace}


def _peer_worker(rank: int, work: Workload, which: str, microbatches: int, warmup: int, windows: int,
                 steps: int, cost: list[float] | None = None) -> dict:
    if which == "DDP":
        return run_ddp(work, warmup, windows, steps)
    return run_torch_pipelining(work, which, microbatches, warmup, windows, steps, cost)


def _pieces(schedule: str, procs: int) -> int:
    return 2 * procs if schedule in ("ZBVZeroBubble", "Interleaved1F1B") else procs


def tune_torch_pipelining(work: Workload, procs: int, schedule: str) -> tuple[int, list[float] | None, str]:
    """torch.distributed.pipelining's own best configuration of ``schedule`` for ``work``: every
    microbatch count of TORCH_MICROBATCHES that divides the batch, with each cut of peers.CUTS
    (identical cuts tried once), run for one short window; returns the fastest's (microbatches,
    per-layer cost for split_sequential, label)."""
    best: tuple[float, int, list[float] | None, str] | None = None
    for m in TORCH_MICROBATCHES:
        if work.batch_size % m:
            continue
        seen = set()
        for cut in CUTS:
            cost = layer_times(work, m) if cut == "time" else None
            sizes = tuple(len(piece) for piece in split_sequential(work.build(), _pieces(schedule, procs), cost))
            if sizes in seen:
                continue
            seen.add(sizes)
            label = f"{m} microbatches, cut by {cut} {'-'.join(map(str, sizes))}"
            try:
                got = launch(_peer_worker, procs, work, schedule, m, 1, 1, 3, cost, timeout_s=300)["samples_per_s"]
            except Exception as exc:  # a configuration torch refuses is skipped
                print(f"  {work.name:<15} torch.pipelining {schedule} [{label}]: failed: "
                      f"{str(exc).splitlines()[0][:150]}", flush=True)
                continue
            print(f"  {work.name:<15} torch.pipelining {schedule} [{label}]: {got:.1f} samples/s (tuning)", flush=True)
            if best is None or got > best[0]:
                best = (got, m, cost, label)
    if best is None:
        raise RuntimeError(f"torch.pipelining {schedule}: no configuration ran")
    return best[1], best[2], best[3]


# ----------------------------------------------------------------------------- the run
def auto_job(work: Workload, procs: int, windows: int, per_window: int, split_parts: int) -> tuple[str, Any, str]:
    """The row of ``train --schedule auto`` on this host: ``choose_layout`` over every way of
    using ``procs`` cores (workers × threads) and the synchronous kinds at 1, 2, 4 and 8
    microbatches, priced with this host's measured costs as auto_choice.py does; run on the
    chosen layout (not predicted per pass: its threads need a profile of their own), on the model
    as given where that layout has one stage (no cut falls inside a split layer)."""
    from torchpipedream.search.auto import choose_layout, local_layouts, threads_per_worker
    from torchpipedream.plans.topology import Topology

    plan = choose_layout(lambda m, threads: _profile(work, m, split_parts, threads), local_layouts(procs, procs),
                         Topology.local, batch_size=work.batch_size, host_costs=functools.partial(host_costs, work),
                         minibatches=per_window, virtual_stages=False)  # as train's
    threads, m = threads_per_worker(plan), plan.microbatches
    label = f"{plan.summary}, {plan.num_workers} × {threads} threads, {plan.schedule}, {m} microbatches"
    if len(plan.stages) == 1 and split_parts > 1:  # no cut inside a split layer: run the model as given
        plan, split_parts = as_given(work, plan), 1

    def run() -> dict:
        res = launch(_tpd_worker, plan.num_workers, work, plan, plan.schedule, m, 1, windows, per_window, split_parts,
                     timeout_s=900, threads=threads)
        res.pop("trace", None)
        return res

    return "torchpipedream auto", run, label


def as_given(work: Workload, plan):
    """A one-stage ``plan`` of the split model as the same plan of the model as given: with no
    cut, splitting wide layers only slows them down (fc_heavy's split model runs at about 0.94
    of the given one's speed: benchmarks/one_worker.py)."""
    x, _ = work.make_batch(work.batch_size, torch.Generator().manual_seed(0))
    return dataclasses.replace(plan, stages=[dataclasses.replace(plan.stages[0], layers=layer_names(work.build(), x))])


def layer_names(model: nn.Module, sample: Any) -> list[str]:
    """The names of ``model``'s layers as the profiler and the planner name them (one quick
    profile: the names, not the times, are wanted)."""
    from torchpipedream.model.profiler import profile

    return [layer.name for layer in profile(model, sample, warmup=0, iters=1, num_threads=None,
                                            split_backward=False).layers]


def _baseline_jobs(work: Workload, procs: int, windows: int, microbatches: int, suffix: str) -> list:
    return [
        (f"single, 1 thread{suffix}", lambda: run_single(work, 1, warmup=2, windows=windows, steps=3), ""),
        (f"single, {procs} threads{suffix}", lambda: run_single(work, procs, warmup=2, windows=windows, steps=3), ""),
        (f"torch DDP{suffix}",
         lambda: launch(_peer_worker, procs, work, "DDP", microbatches, 2, windows, 3, timeout_s=900), ""),
    ]


def compare_model(work: Workload, procs: int, microbatches: int, windows: int, per_window: int,
                  split_parts: int = 1, passes: int = 3, rows: tuple[str, ...] = (),
                  tune_torch: bool = True) -> list[dict]:
    """Every row of one model, measured in ``passes`` interleaved passes (row 1, row 2, ...,
    row 1, row 2, ...): the machine's speed drifts by 20-30% within minutes, and interleaving
    spreads a slow spell over every row instead of the rows that happened to run in it. A
    row's samples/s is the median over its passes of each pass's median window. ``rows``, when
    given, keeps the rows whose name contains one of them (and ``BASE_ROWS``).

    The single-process and DDP rows run both the model as given and, with ``split_parts`` > 1,
    the model as torchpipedream's rows run it (", split model"). Each torch.distributed.pipelining
    row runs its own best microbatch count and cut (``tune_torch_pipelining``), or with
    ``tune_torch=False`` ``microbatches`` and the parameter-balanced cut."""
    torch.set_num_threads(1)
    def wanted(name: str) -> bool:  # "=NAME" keeps that row only, any other token every row containing it
        return not rows or name in BASE_ROWS or any(name == r[1:] if r.startswith("=") else r in name for r in rows)

    jobs: list[tuple[str, Any, str]] = _baseline_jobs(work, procs, windows, microbatches, "")  # (row, run, plan)
    split = dataclasses.replace(work, build=functools.partial(split_built, work.build, split_parts))
    if split_parts > 1 and len(list(split.build().modules())) != len(list(work.build().modules())):
        jobs += _baseline_jobs(split, procs, windows, microbatches, ", split model")  # only where a layer was split
    for s in TORCH_SCHEDULES:
        name = f"torch.pipelining {s}"
        if not wanted(name):
            continue
        m, cost, label = tune_torch_pipelining(work, procs, s) if tune_torch else (microbatches or 4, None, "")
        jobs.append((name, lambda s=s, m=m, cost=cost: launch(_peer_worker, procs, work, s, m, 2, windows, 3, cost,
                                                              timeout_s=900), label))
    for row, (s, straight) in TPD_ROWS.items():
        if not wanted(f"torchpipedream {row}"):
            continue
        m = microbatches or planned_microbatches(work, procs, s, split_parts, per_window, straight)
        plan, sched = choose_plan(work, procs, s, m, split_parts, minibatches=per_window, straight=straight)
        label = plan.summary + (f", {m} microbatches" if not microbatches and schedule_kind(s).microbatched else "")
        jobs.append((f"torchpipedream {row}", functools.partial(_predict_and_run, work, plan, sched, m,
                                                              windows, per_window, split_parts), label))
    if wanted("torchpipedream auto"):
        jobs.append(auto_job(work, procs, windows, per_window, split_parts))
    jobs = [j for j in jobs if wanted(j[0])]
    results: dict[str, list[dict]] = {name: [] for name, *_ in jobs}
    failed: dict[str, str] = {}
    for pass_ in range(passes):
        for name, run, plan in jobs:
            if name in failed:
                continue
            res = None
            for attempt in (1, 2):  # a crash is retried once (seen: torch.pipelining aborting in gloo)
                try:
                    res = run()
                    break
                except Exception as exc:  # a row that cannot run is reported as failed, not hidden
                    print(f"  {work.name:<15} {name}: FAILED (attempt {attempt}): {str(exc).splitlines()[0][:200]}",
                          flush=True)
                    if attempt == 2:
                        failed[name] = str(exc)[:500]
            if res is None:
                continue
            torch.set_num_threads(1)
            results[name].append(res)
            pred = res.get("predicted_samples_per_s")
            print(f"  {work.name:<15} {name:<32} pass {pass_ + 1}: {res['samples_per_s']:9.1f} samples/s"
                  + (f"   predicted {pred:9.1f} (slowdown {res['slowdown']:.2f}; from the run's compute "
                     f"{res['predicted_with_run_compute']:.1f}, compute × {res['run_compute_vs_profile']:.2f})"
                     if pred else "")
                  + (f"   [{plan}]" if plan else ""), flush=True)
    rows: list[dict] = []
    for name, _, plan in jobs:
        got = results[name]
        if name in failed and not got:
            if name.startswith("torchpipedream"):  # our own failures stay in the table
                rows.append({"model": work.name, "row": name, "samples_per_s": 0.0, "failed": failed[name],
                             "predicted_samples_per_s": None, "plan": plan, "peak_rss_mb": []})
            continue
        rss = [max(r["peak_rss_mb"][i] for r in got) for i in range(len(got[0]["peak_rss_mb"]))]
        row = {"model": work.name, "row": name,
               "samples_per_s": statistics.median(r["samples_per_s"] for r in got),
               "passes_samples_per_s": [r["samples_per_s"] for r in got],
               "predicted_samples_per_s": None, "plan": plan, "peak_rss_mb": rss}
        if "predicted_samples_per_s" in got[0]:
            # each pass's run against the prediction made just before it
            row.update(predicted_samples_per_s=statistics.median(r["predicted_samples_per_s"] for r in got),
                       passes_predicted_samples_per_s=[r["predicted_samples_per_s"] for r in got],
                       passes_slowdown=[r["slowdown"] for r in got],
                       measured_vs_predicted=statistics.median(r["samples_per_s"] / r["predicted_samples_per_s"]
                                                               for r in got),
                       passes_predicted_with_run_compute=[r["predicted_with_run_compute"] for r in got],
                       passes_run_compute_vs_profile=[r["run_compute_vs_profile"] for r in got],
                       measured_vs_run_compute=statistics.median(r["samples_per_s"] / r["predicted_with_run_compute"]
                                                                 for r in got),
                       run_compute_vs_profile=statistics.median(r["run_compute_vs_profile"] for r in got))
        rows.append(row)
    ddp = next(r["samples_per_s"] for r in rows if r["row"] == "torch DDP")
    single1 = rows[0]["samples_per_s"]
    # What `procs` copies of this model's own training step (whole minibatches, as the
    # single-process rows train) reach side by side on this host, as a share of perfect
    # scaling (runtime.measure.measure_concurrency_slowdown, measured in each pass with
    # pipedream's prediction): a ceiling for any scheme of `procs` one-thread processes.
    # A microbatched schedule's own prediction uses the slowdown of microbatched steps.
    whole = next((r["passes_slowdown"] for r in rows if r["row"] == "torchpipedream pipedream"
                  and r.get("passes_slowdown")), None) \
        or [v for r in rows for v in r.get("passes_slowdown", [])]
    slowdown = statistics.median(whole) if whole else 1.0
    for r in rows:
        r["vs_ddp"] = r["samples_per_s"] / ddp
        r["vs_perfect_scaling"] = r["samples_per_s"] / (procs * single1)
        r["side_by_side_slowdown"] = slowdown
        r["vs_side_by_side_ceiling"] = r["samples_per_s"] / (procs * single1 / slowdown)
        for k in ("measured_vs_predicted", "measured_vs_run_compute", "run_compute_vs_profile"):
            r.setdefault(k, None)
    return rows
