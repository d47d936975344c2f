"""The peers torchpipedream is compared against, measured the same way.

Each runner trains the same model (an ``nn.Sequential``) on the same synthetic batches with the
same optimizer and reports samples/s as the median of several timed windows after warm-up,
and the peak resident memory of its process. Used by ``benchmarks/compare_rows.py``.

Runners: a single process (1 thread, or all threads), torch DistributedDataParallel, and
torch.distributed.pipelining with ScheduleGPipe, Schedule1F1B and ScheduleZBVZeroBubble (and the
interleaved ones), cut by parameter count or by measured layer time (``CUTS``, ``layer_times``).
"""

from __future__ import annotations

import resource
import statistics
import subprocess
import time
from dataclasses import dataclass
import json
from pathlib import Path
from typing import Callable, Sequence, TypeVar

import torch
import torch.distributed as dist
import torch.nn as nn

from torchpipedream.runtime.measure import concurrent_rates

T = TypeVar("T")


@dataclass
class Workload:
    """A model, how to make its batches, and where to split it into pipeline stages."""

    name: str
    build: Callable[[], nn.Module]  # an nn.Sequential for the peers that cut it (DDP takes any module)
    make_batch: Callable[[int, torch.Generator], tuple[torch.Tensor | dict, torch.Tensor]]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batch_size: int
    lr: float = 0.01


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MiB.

    Read from /proc/self/status (VmHWM), which starts afresh in a spawned worker; getrusage's
    ru_maxrss survives exec on Linux, so a spawned worker would report its parent's peak.
    """
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _timed_windows(step: Callable[[], None], warmup: int, windows: int, steps_per_window: int) -> list[float]:
    """Seconds per step for each timed window, after ``warmup`` untimed steps."""
    for _ in range(warmup):
        step()
    out = []
    for _ in range(windows):
        t0 = time.perf_counter()
        for _ in range(steps_per_window):
            step()
        out.append((time.perf_counter() - t0) / steps_per_window)
    return out


def _batches(work: Workload, seed: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [work.make_batch(work.batch_size, g) for _ in range(count)]


def chunk_inputs(x: torch.Tensor | dict, parts: int) -> list:
    """A model's inputs (a tensor, or a dict of keyword arguments) in ``parts`` pieces along
    dimension 0; a dict's non-tensor values go to every piece."""
    if not isinstance(x, dict):
        return list(x.chunk(parts))
    pieces = {k: v.chunk(parts) if isinstance(v, torch.Tensor) else [v] * parts for k, v in x.items()}
    return [{k: pieces[k][i] for k in x} for i in range(parts)]


def _plain_step(work: Workload, threads: int, batches: int, microbatches: int = 1) -> Callable[[], None]:
    """One training step of ``work`` in this process per call (``threads`` intra-op threads),
    cycling over ``batches`` fixed minibatches, each in ``microbatches`` accumulated parts."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = work.build()
    opt = torch.optim.SGD(model.parameters(), lr=work.lr)
    data = _batches(work, 0, batches)
    i = [0]

    def step() -> None:
        x, y = data[i[0] % len(data)]
        i[0] += 1
        opt.zero_grad(set_to_none=True)
        for xs, ys in zip(chunk_inputs(x, microbatches), y.chunk(microbatches)):
            work.loss_fn(model(**xs) if isinstance(xs, dict) else model(xs), ys).backward()
        opt.step()

    return step


def run_single(work: Workload, threads: int, warmup: int = 2, windows: int = 5, steps: int = 3) -> dict:
    """One process, ``threads`` intra-op threads, plain training."""
    step = _plain_step(work, threads, 4)
    times = _timed_windows(step, warmup, windows, steps)
    return {"samples_per_s": work.batch_size / statistics.median(times), "peak_rss_mb": [peak_rss_mb()]}


def training_step(work: Workload, microbatches: int = 1) -> Callable[[], None]:
    """One-thread training of ``work`` as ``measure_concurrency_slowdown``'s step (how much
    slower copies that wait for each other run side by side), each step in ``microbatches``
    parts as a microbatched schedule runs it: small microbatches of a weight-heavy model stream
    the weights once per part and slow each other down far more."""
    return _plain_step(work, 1, 1, microbatches)


def _gather(value: float) -> list[float]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def run_ddp(work: Workload, warmup: int = 2, windows: int = 5, steps: int = 3) -> dict:
    """torch DistributedDataParallel; each rank takes batch_size / world samples of the global batch."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = DDP(work.build())
    opt = torch.optim.SGD(model.parameters(), lr=work.lr)
    data = _batches(work, 0, 4)
    per_rank = work.batch_size // world
    i = [0]

    def step() -> None:
        x, y = data[i[0] % len(data)]
        i[0] += 1
        sl = slice(rank * per_rank, (rank + 1) * per_rank)
        opt.zero_grad(set_to_none=True)
        work.loss_fn(model(x[sl]), y[sl]).backward()
        opt.step()

    times = _timed_windows(step, warmup, windows, steps)
    slowest = max(_gather(statistics.median(times)))
    return {"samples_per_s": work.batch_size / slowest, "peak_rss_mb": _gather(peak_rss_mb())}


#: How the torch.distributed.pipelining rows may cut the model: balance the pieces' parameter
#: counts, or their forward + backward time measured layer by layer (``layer_times``).
CUTS = ("parameters", "time")


def layer_times(work: Workload, microbatches: int = 1, repeats: int = 5) -> list[float]:
    """Median forward + backward seconds of each child of ``work``'s Sequential on one
    microbatch, one thread: the weights of the "time" cut."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    layers = list(work.build().children())
    x, _ = _batches(work, 0, 1)[0]
    x = x.chunk(microbatches)[0]
    out = []
    for layer in layers:
        times = []
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            t0 = time.perf_counter()
            y = layer(inp)
            if y.requires_grad:
                y.backward(torch.ones_like(y))
            times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
        x = y.detach()
    return out


def split_sequential(model: nn.Sequential, parts: int, cost: Sequence[float] | None = None) -> list[nn.Sequential]:
    """Cut a Sequential into ``parts`` pieces, each with at least one parameterised layer where
    the model has enough of them, minimising the largest piece's cost: its parameter count, or
    ``cost`` per child (e.g. ``layer_times``).

    A piece without parameters (small_cnn's ReLU, MaxPool, Flatten) breaks
    ScheduleZBVZeroBubble, whose weight-gradient step needs weights on every stage.
    """
    layers = list(model.children())
    n = len(layers)
    if parts > n:
        raise ValueError(f"cannot split {n} layers into {parts} stages")
    params = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    need_params = sum(w > 0 for w in params) >= parts
    weights = list(cost) if cost is not None else params
    prefix, held = [0], [0]
    for w, q in zip(weights, params):
        prefix.append(prefix[-1] + w)
        held.append(held[-1] + q)

    def ok(a: int, b: int) -> bool:  # layers[a:b] may be a piece
        return not need_params or held[b] > held[a]

    inf = float("inf")
    # best[k][i]: smallest possible largest piece when layers[:i] form k pieces; cut[k][i]: where the last starts
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                if best[k - 1][j] < inf and ok(j, i):
                    v = max(best[k - 1][j], prefix[i] - prefix[j])
                    if v < best[k][i]:
                        best[k][i], cut[k][i] = v, j
    bounds, i = [n], n
    for k in range(parts, 0, -1):
        i = cut[k][i]
        bounds.append(i)
    bounds.reverse()
    return [nn.Sequential(*layers[a:b]) for a, b in zip(bounds, bounds[1:])]


def run_torch_pipelining(
    work: Workload, schedule: str, microbatches: int, warmup: int = 2, windows: int = 5, steps: int = 3,
    cost: Sequence[float] | None = None,
) -> dict:
    """torch.distributed.pipelining with manual stages (one per rank; two per rank, V-shaped, for ZBV;
    two per rank, looped (rank r holds stages r and r + w), for Interleaved1F1B;
    InterleavedZeroBubble, torch's ZB1P = ZB-H1, with one stage per rank), cut by parameter
    count or by ``cost`` per layer (``split_sequential``)."""
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
                                              ScheduleZBVZeroBubble)

    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    full = work.build()
    device = torch.device("cpu")
    if schedule == "ZBVZeroBubble":
        pieces = split_sequential(full, 2 * world, cost)
        stage_ids = [rank, 2 * world - 1 - rank]  # V shape: rank r holds stages r and 2w-1-r
        stages = [PipelineStage(pieces[s], s, 2 * world, device) for s in stage_ids]
        params = [p for s in stage_ids for p in pieces[s].parameters()]
        sched = ScheduleZBVZeroBubble(stages, n_microbatches=microbatches, loss_fn=work.loss_fn)
        has_input = has_loss = rank == 0  # rank 0 holds both the first and the last stage
    elif schedule == "Interleaved1F1B":
        pieces = split_sequential(full, 2 * world, cost)
        stage_ids = [rank, rank + world]  # looped: rank r holds stages r and r + w
        stages = [PipelineStage(pieces[s], s, 2 * world, device) for s in stage_ids]
        params = [p for s in stage_ids for p in pieces[s].parameters()]
        sched = ScheduleInterleaved1F1B(stages, n_microbatches=microbatches, loss_fn=work.loss_fn)
        has_input, has_loss = rank == 0, rank == world - 1
    else:
        pieces = split_sequential(full, world, cost)
        stage = PipelineStage(pieces[rank], rank, world, device)
        params = list(pieces[rank].parameters())
        if schedule == "InterleavedZeroBubble":  # its ZB1P (ZB-H1) with one stage per rank
            sched = ScheduleInterleavedZeroBubble([stage], n_microbatches=microbatches, loss_fn=work.loss_fn)
        else:
            cls = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}[schedule]
            sched = cls(stage, n_microbatches=microbatches, loss_fn=work.loss_fn)
        has_input, has_loss = rank == 0, rank == world - 1
    opt = torch.optim.SGD(params, lr=work.lr)
    data = _batches(work, 0, 4)
    i = [0]

    def step() -> None:
        x, y = data[i[0] % len(data)]
        i[0] += 1
        opt.zero_grad(set_to_none=True)
        args = (x,) if has_input else ()
        if has_loss:
            sched.step(*args, target=y)
        else:
            sched.step(*args)
        opt.step()

    times = _timed_windows(step, warmup, windows, steps)
    slowest = max(_gather(statistics.median(times)))
    return {"samples_per_s": work.batch_size / slowest, "peak_rss_mb": _gather(peak_rss_mb())}


def cpu_probe(seconds: float = 0.5) -> float:
    """Work rate of two concurrent processes relative to one (≈2.0 on two free cores)."""
    one, two = concurrent_rates(2, seconds, _spin)
    return sum(two) / one


def probed(run: Callable[[], T]) -> tuple[T, list[float], bool]:
    """``run()`` between two CPU probes (printed); returns its value, the probes and whether
    they agree within 15% (a run whose probes disagree saw the machine change: repeat it)."""
    start = cpu_probe()
    print(f"CPU probe at start: {start:.2f} (2.0 = two free cores)", flush=True)
    value = run()
    end = cpu_probe()
    print(f"CPU probe at end: {end:.2f}", flush=True)
    agree = abs(end - start) / max(start, end) <= 0.15
    if not agree:
        print("WARNING: the CPU probes disagree by more than 15%: the machine's capacity changed; repeat the run")
    return value, [start, end], agree


def git_commit() -> str:
    """The short hash of the checked-out commit the benchmark ran ("unknown" outside a git clone)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write_results(out: str, result: dict, table: str) -> None:
    """Print ``table`` and write OUT.json (``result``) and OUT.md (``table``)."""
    print(table)
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{path}.json").write_text(json.dumps(result, indent=1))
    Path(f"{path}.md").write_text(table + "\n")
    print(f"wrote {path}.json, {path}.md")


def _spin(seconds: float) -> float:
    """Matrix multiplies per second on one thread for ``seconds``."""
    torch.set_num_threads(1)
    a = torch.randn(128, 128)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a = torch.tanh(a @ a)
        n += 1
    return n / (time.perf_counter() - t0)
