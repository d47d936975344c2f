"""What this host's runtime really pays, measured: the host terms of the simulator's Costs.

The planner's and simulator's link model (bytes / bandwidth) describes GPUs on real links. On
CPU workers that share a host, other costs dominate, and each is measured here the way the
runtime incurs it:

* ``measure_message_overhead``: CPU time per message on each side (LogP's o);
* ``measure_allreduce``: a gloo all-reduce of a stage's flat gradient buffer;
* ``measure_copy_bandwidth``: the copy on update of a stashed weight version;
* ``measure_accumulate_bandwidth``: a backward adding its gradient into an existing one;
* ``measure_concurrency_slowdown``: N workers stepping in lockstep against one alone;
* ``measure_loopback_bandwidth``: gloo send/recv between two local processes
  (``Topology.local(bandwidth_Bps=...)``).

``measure_local_costs(plan)`` measures what a plan needs and returns keyword overrides for
:meth:`~torchpipedream.sim.simulator.Costs.from_plan`. Every function spawns processes (except the
copy bandwidth), so call them from a script's ``if __name__ == "__main__":`` block.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing as mp
import queue as queues
import socket
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from ..host.tuning import tune_own_process
from ..model.profiler import disturb_caches
from .comm import pack, post_recv, post_send, unpack

if TYPE_CHECKING:
    from ..plans.plan import Plan

__all__ = [
    "measure_local_costs",
    "measure_local_costs_of",
    "measure_message_overhead",
    "measure_allreduce",
    "measure_copy_bandwidth",
    "measure_accumulate_bandwidth",
    "measure_concurrency_slowdown",
    "measure_loopback_bandwidth",
    "concurrent_rates",
    "bracketed_slowdown",
]


def measure_local_costs(plan: "Plan", microbatches: int = 1,
                        make_step: Callable[[], Callable[[], None]] | None = None) -> dict[str, Any]:
    """Measure the host terms a plan's run on this machine's local workers pays, as keyword
    overrides for ``Costs.from_plan``: the copy and gradient-accumulation bandwidths at the
    largest stage's weights, the
    per-message overhead at the largest cut's microbatch message (pipelines), each replicated
    stage's all-reduce at its weight size and replica count, and with ``make_step`` (picklable;
    returns a function that runs one training step of the model) the concurrency slowdown of
    the plan's workers (``measure_concurrency_slowdown``). About 2 s per spawned measurement
    on the 2-core development machine.
    """
    m = max(1, int(microbatches))
    out = _in_process_costs(plan)
    out.update(_group_costs(plan, [_run_group(*job) for job in _group_jobs(plan, m)]))
    if make_step is not None and plan.num_workers > 1:
        out["compute_slowdown"] = measure_concurrency_slowdown(plan.num_workers, seconds=1.0, make_step=make_step)
    return out


def measure_local_costs_of(requests: Sequence[tuple["Plan", int]]) -> list[dict[str, Any]]:
    """:func:`measure_local_costs` of each ``(plan, microbatches)`` of ``requests`` (no
    ``make_step``), in order: the same measurements per plan, but the spawned ones of all
    plans run one after another in one launch per group size (all of them in one launch on
    local workers of two processes) instead of a launch each. A launch costs each process its
    start-up (about 1.5 s on the 2-core development machine, most of a measurement's time):
    ``schedule="auto"`` asks for a dozen plan shapes or more."""
    jobs = [_group_jobs(plan, max(1, int(m))) for plan, m in requests]
    answers = _run_jobs([job for plan_jobs in jobs for job in plan_jobs])
    out = []
    for (plan, _), plan_jobs in zip(requests, jobs):
        costs = _in_process_costs(plan)
        costs.update(_group_costs(plan, [answers.pop(0) for _ in plan_jobs]))
        out.append(costs)
    return out


#: One spawned measurement: (target, workers, nbytes, repeats, timeout_s, what), as _run_group takes it
_Job = tuple[Any, int, int, int, float, str]


def _group_jobs(plan: "Plan", m: int) -> list[_Job]:
    """The spawned measurements a plan's host costs need, in the order :func:`_group_costs`
    reads them: the message overhead at the largest cut's microbatch message (pipelines), then
    each replicated stage's all-reduce of one flat buffer (the weights' gradients plus a
    sample-count slot, as the runtime reduces it) among its replicas."""
    jobs: list[_Job] = []
    if plan.num_stages > 1:
        cut = max(st.output_bytes for st in plan.stages[:-1]) // m
        jobs.append((_message_overhead, 2, int(cut), 50, 60.0, "message overhead"))
    for st in plan.stages:
        if st.replicas > 1:
            jobs.append((_allreduce, st.replicas, int(st.parameter_bytes) + 4, 20, 60.0, "all-reduce"))
    return jobs


def _group_costs(plan: "Plan", answers: list[float]) -> dict[str, Any]:
    """The ``Costs.from_plan`` overrides from the answers of :func:`_group_jobs` (in its order)."""
    left = iter(answers)
    out: dict[str, Any] = {}
    if plan.num_stages > 1:
        out["message_overhead_s"] = next(left)
    if any(st.replicas > 1 for st in plan.stages):
        out["allreduce_s"] = [next(left) if st.replicas > 1 else None for st in plan.stages]
    return out


def _in_process_costs(plan: "Plan") -> dict[str, Any]:
    """The copy and accumulation bandwidths at the largest stage's weights (measured here)."""
    largest = int(max(st.parameter_bytes for st in plan.stages))
    return {"copy_Bps": measure_copy_bandwidth(largest), "accumulate_Bps": measure_accumulate_bandwidth(largest)}


def measure_loopback_bandwidth(nbytes: int = 16 * 2**20, repeats: int = 5, timeout_s: float = 60.0) -> float:
    """Bytes/s of a gloo send/recv between two processes on 127.0.0.1 (best of ``repeats``)."""
    return _run_group(_loopback, 2, nbytes, repeats, timeout_s, "loopback")


def measure_message_overhead(nbytes: int = 64 * 2**10, repeats: int = 50, timeout_s: float = 60.0) -> float:
    """Seconds of CPU one activation message of ``nbytes`` costs each of two local processes
    (LogP's o), sent the way the runtime sends it.

    The sender packs the message (runtime.comm.pack) and calls ``isend``; the receiver posts
    the ``irecv`` ahead of time and unpacks after arrival. Each is timed after other compute
    (profiler.disturb_caches), as in a pipeline, and the medians of the two sides are
    averaged: what the simulator's ``Costs.message_overhead_s`` charges on each side of
    every message. Small messages on a CPU are dominated by this, not by bandwidth.
    """
    return _run_group(_message_overhead, 2, nbytes, repeats, timeout_s, "message overhead")


def measure_allreduce(nbytes: int, workers: int = 2, repeats: int = 20, timeout_s: float = 60.0) -> float:
    """Seconds one all-reduce of ``nbytes`` (a flat float32 tensor, as the runtime reduces a
    replicated stage's gradients) takes among ``workers`` local gloo processes, once all have
    arrived: median of ``repeats``, each after other compute (profiler.disturb_caches) and a
    barrier, slowest rank. The simulator's ``Costs.allreduce_s`` for a stage of that weight
    size and replica count. On the 2-core development machine gloo takes ~1.5 ms even for
    256 KB and ~3 ms for 2 MB: the ring formula at the link's bandwidth says 0.1 and 1 ms.
    """
    if workers < 2:
        raise ValueError(f"an all-reduce needs at least 2 workers, got {workers}")
    return _run_group(_allreduce, workers, nbytes, repeats, timeout_s, "all-reduce")


def measure_copy_bandwidth(nbytes: int = 64 * 2**20, repeats: int = 20) -> float:
    """Bytes/s of one-thread memory copies of ``nbytes`` on this host (median of ``repeats``):
    the simulator's ``Costs.copy_Bps`` for the copy on update of a stashed weight version.
    Caches make small copies several times faster than large ones, so measure at the size of
    a stage's weights."""
    def once() -> float:
        t0 = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t0

    with _one_thread():
        src = torch.ones(max(1, nbytes // 4))
        dst = torch.empty_like(src)
        return src.numel() * 4 / _median_seconds(once, repeats)


def measure_accumulate_bandwidth(nbytes: int = 64 * 2**20, repeats: int = 10) -> float:
    """Gradient bytes per second one thread adds into an existing gradient (``acc += new``,
    as autograd accumulates a microbatch's weight gradient), each add after other compute
    (profiler.disturb_caches), median of ``repeats``: the simulator's ``Costs.accumulate_Bps``.
    Measure at the size of a stage's weights."""
    def once() -> float:
        new = torch.full_like(acc, 0.5)  # a fresh gradient, as each backward makes one
        disturb_caches()
        t0 = time.perf_counter()
        acc.add_(new)
        return time.perf_counter() - t0

    with _one_thread():
        acc = torch.ones(max(1, nbytes // 4))
        return acc.numel() * 4 / _median_seconds(once, repeats)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Run the block with one intra-op thread (a worker's setting), then restore."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _median_seconds(once: Callable[[], float], repeats: int, warmup: int = 2) -> float:
    """Median of ``repeats`` calls of ``once()`` (each returns the seconds it timed) after
    ``warmup`` untimed ones."""
    for _ in range(warmup):
        once()
    return statistics.median(once() for _ in range(repeats))


def measure_concurrency_slowdown(workers: int = 2, seconds: float = 0.5,
                                 make_step: Callable[[], Callable[[], None]] | None = None,
                                 repeats: int = 3, timeout_s: float = 120.0) -> float:
    """How much slower ``workers`` one-thread processes that wait for each other after every
    step get through their steps than one process alone (>= 1; 1.0 = independent cores, no
    jitter).

    A profile is taken by one process; a pipeline of N local workers computes N at a time on
    cores that share caches and memory bandwidth, and each waits for the others' messages, so
    the group moves at the pace of its slowest member at that moment. Hence the processes
    here run in lockstep (a barrier after every step) rather than independently: on the 2-core
    development machine, two independent copies of small_cnn's training step ran at 0.97-1.1×
    the time of one alone while its data-parallel run computed 15-30% slower than profiled;
    an all-reduce after every step made the same copies 10-15% slower than without.

    ``make_step()`` (picklable, called once in each spawned process) returns the work: a
    function that runs one step, e.g. one training step of the model. The default is stage-like
    64×512 by 512×512 matrix products; pass the model's own training when there is one. The
    number of steps is calibrated to about ``seconds`` alone; then runs alone and runs of the
    group alternate (``repeats`` group runs, each between two runs alone: see
    :func:`bracketed_slowdown`), because a shared host's speed drifts by 20-30% within seconds.
    """
    barrier = mp.get_context("spawn").Barrier(workers, timeout=timeout_s)
    alone: list[float] = []
    together: list[list[float]] = []
    with _spawned_pool(workers, timeout_s, initializer=_lockstep_init,
                       initargs=(barrier, make_step or _gemm_step)) as pool:
        calibration = pool.apply_async(_steps_for_seconds, (seconds,)).get(timeout_s)
        n = max(2, round(seconds * calibration))
        for _ in range(max(1, int(repeats))):
            alone.append(pool.apply_async(_run_steps, (n, False)).get(timeout_s))
            together.append(pool.starmap_async(_run_steps, [(n, True)] * workers, chunksize=1).get(timeout_s))
        alone.append(pool.apply_async(_run_steps, (n, False)).get(timeout_s))
    return bracketed_slowdown(alone, together)


@contextlib.contextmanager
def _spawned_pool(workers: int, limit_s: float, **pool_options: Any) -> Iterator[Any]:
    """A pool of ``workers`` spawned processes (with huge pages and freed memory kept, as
    launch()'s workers run); a result that takes longer than ``limit_s`` raises RuntimeError
    with the likely cause."""
    init = (pool_options.pop("initializer", None), pool_options.pop("initargs", ()))
    with mp.get_context("spawn").Pool(workers, initializer=_measuring_process_init, initargs=init,
                                      **pool_options) as pool:
        try:
            yield pool
        except mp.TimeoutError:
            raise RuntimeError(f"concurrency measurement got no answer in {limit_s:g} s (run it from a script's "
                               "`if __name__ == '__main__':` block: it spawns processes)") from None


def _measuring_process_init(init: Callable[..., None] | None, initargs: Sequence[Any]) -> None:
    """Pool initializer: allocate as launch()'s workers do, then the caller's initializer."""
    tune_own_process()
    if init is not None:
        init(*initargs)


def bracketed_slowdown(alone: Sequence[float], together: Sequence[Sequence[float]]) -> float:
    """The slowdown from alternating measurements ``alone[0], together[0], alone[1], ...,
    alone[n]`` (step rates, higher is faster; ``together[i]`` holds each worker's rate): the
    median over ``i`` of the mean of ``alone[i]`` and ``alone[i + 1]`` over the slowest rate in
    ``together[i]`` (workers that wait for each other move at the slowest one's pace), at
    least 1.0. Bracketing each group run cancels a drift that is linear over it."""
    if len(alone) != len(together) + 1 or not together:
        raise ValueError(f"need one more alone-measurement than together-measurements, got {len(alone)} "
                         f"and {len(together)}")
    ratios = []
    for i, group in enumerate(together):
        slowest = min(group)
        if slowest <= 0:
            return math.inf
        ratios.append((alone[i] + alone[i + 1]) / 2 / slowest)
    return max(1.0, statistics.median(ratios))


_step: Callable[[], None] | None = None  # this spawned measuring process's step
_barrier: Any = None


def _lockstep_init(barrier: Any, make_step: Callable[[], Callable[[], None]]) -> None:
    """Pool initializer: one thread, build the step once and warm it up."""
    global _step, _barrier
    torch.set_num_threads(1)
    _barrier = barrier
    _step = make_step()
    for _ in range(2):
        _step()


def _steps_for_seconds(seconds: float) -> float:
    """Steps per second of this process's step, run for about ``seconds``."""
    assert _step is not None
    n, t0 = 0, time.perf_counter()
    while n == 0 or time.perf_counter() - t0 < seconds:
        _step()
        n += 1
    return n / (time.perf_counter() - t0)


def _run_steps(n: int, lockstep: bool) -> float:
    """Steps per second over ``n`` steps; with ``lockstep``, waiting for the group after each."""
    assert _step is not None
    if lockstep:
        _barrier.wait()
    t0 = time.perf_counter()
    for _ in range(n):
        _step()
        if lockstep:
            _barrier.wait()
    return n / (time.perf_counter() - t0)


def concurrent_rates(workers: int, seconds: float, rate: Callable[[float], float]) -> tuple[float, list[float]]:
    """``rate(seconds)`` in ``workers`` spawned processes at once, independently, bracketed by
    one process alone before and after: (mean rate alone, rates together). A warm-up call
    first keeps start-up costs out of both."""
    limit = 60.0 + 4 * seconds  # a pool whose workers cannot start would wait for ever
    with _spawned_pool(workers, limit) as pool:
        pool.map_async(rate, [min(0.05, seconds)] * workers).get(limit)
        before = pool.apply_async(rate, (seconds,)).get(limit)
        together = pool.map_async(rate, [seconds] * workers).get(limit)
        after = pool.apply_async(rate, (seconds,)).get(limit)
    return (before + after) / 2, list(together)


def _gemm_step() -> Callable[[], None]:
    """A stage-like step: 20 products of 64×512 by 512×512 on one thread (a few ms)."""
    g = torch.Generator().manual_seed(0)
    x0, w = torch.randn(64, 512, generator=g), torch.randn(512, 512, generator=g) * 0.04

    def step() -> None:
        x = x0
        for _ in range(20):
            x = torch.relu(x @ w) + 0.01

    return step


def _run_group(target: Any, workers: int, nbytes: int, repeats: int, timeout_s: float, what: str) -> float:
    """Run the measurement ``target(rank, world, nbytes, repeats) -> float`` on ``workers``
    spawned one-thread processes joined by a gloo group; rank 0's answer."""
    return _launch(workers, [(target, nbytes, repeats, timeout_s, what)])[0]


def _run_jobs(jobs: Sequence[_Job]) -> list[float]:
    """The answers of spawned measurements ``jobs`` (as :func:`_run_group` takes each), in
    order: those of one group size run one after another in one launch of that many processes."""
    answers: list[float] = [0.0] * len(jobs)
    for workers in sorted({job[1] for job in jobs}):
        mine = [i for i, job in enumerate(jobs) if job[1] == workers]
        got = _launch(workers, [(jobs[i][0],) + tuple(jobs[i][2:]) for i in mine])
        for i, answer in zip(mine, got):
            answers[i] = answer
    return answers


def _launch(workers: int, jobs: Sequence[tuple[Any, int, int, float, str]]) -> list[float]:
    """Run the measurements ``jobs`` (each ``(target, nbytes, repeats, timeout_s, what)``: see
    :func:`_run_group`) one after another on ``workers`` spawned one-thread processes joined by
    one gloo group; rank 0's answer to each. Each answer has its job's ``timeout_s``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    work = [(target, nbytes, repeats) for target, nbytes, repeats, _, _ in jobs]
    procs = [ctx.Process(target=_group_worker, args=(r, workers, port, work, queue)) for r in range(workers)]
    for p in procs:
        p.start()
    answers = []
    try:
        for _, _, _, timeout_s, what in jobs:
            result = _answer(queue, procs, timeout_s, what)
            if isinstance(result, str):
                raise RuntimeError(f"{what} measurement failed: {result}")
            answers.append(float(result))
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
    return answers


def _answer(queue: Any, procs: Sequence[Any], timeout_s: float, what: str) -> Any:
    """The next answer on ``queue`` (a number, or an error as one line); RuntimeError when a
    measuring process dies or none comes within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:  # poll, so that a process that dies is reported at once, not at the deadline
        try:
            return queue.get(timeout=0.2)
        except queues.Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                why = f"a measuring process exited with code {dead[0]}" if dead else f"no answer in {timeout_s:g} s"
                raise RuntimeError(f"{what} measurement failed: {why} (run it from a script's "
                                   "`if __name__ == '__main__':` block: it spawns processes)") from None


def _group_worker(rank: int, world: int, port: int, work: Sequence[tuple[Any, int, int]], queue: Any) -> None:
    """One measuring process: join the group, run each measurement ``(target, nbytes,
    repeats)`` of ``work`` in turn, put rank 0's answer to each (or the first error, as one
    line, and stop) on ``queue``."""
    tune_own_process()  # allocate as launch()'s workers do
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        for target, nbytes, repeats in work:
            answer = target(rank, world, nbytes, repeats)
            if rank == 0:
                queue.put(answer)
        dist.destroy_process_group()
    except Exception as exc:  # reported to the parent as one line
        if rank == 0:
            queue.put(f"{type(exc).__name__}: {exc}")


def _message_overhead(rank: int, world: int, nbytes: int, repeats: int) -> float:
    cpu = torch.device("cpu")
    act = torch.randn(max(1, nbytes // 4))
    size = pack(1, [act], [], cpu).numel()
    calls = []
    for i in range(repeats + 5):
        buf = torch.empty(size, dtype=torch.uint8)
        disturb_caches()
        if rank == 1:  # the receiver posts early (the runtime prefetches), then unpacks
            t0 = time.perf_counter()
            work = post_recv(buf, 0, 0)
            took = time.perf_counter() - t0
        dist.barrier()
        if rank == 0:  # the sender packs and sends, as an SA does
            t0 = time.perf_counter()
            work = post_send(pack(1, [act], [], cpu), 1, 0)
            took = time.perf_counter() - t0
        work.wait()
        if rank == 1:
            disturb_caches()
            t0 = time.perf_counter()
            unpack(buf)
            took += time.perf_counter() - t0
        if i >= 5:
            calls.append(took)
    return sum(_everyone(statistics.median(calls), 2)) / 2


def _everyone(value: float, world: int) -> list[float]:
    """``value`` of every rank of the measuring group (a tensor gather: nothing unpickled)."""
    parts = [torch.zeros(1, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(parts, torch.tensor([value], dtype=torch.float64))
    return [float(p.item()) for p in parts]


def _loopback(rank: int, world: int, nbytes: int, repeats: int) -> float:
    buf = torch.zeros(nbytes // 4, dtype=torch.float32)
    best = math.inf
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def _allreduce(rank: int, world: int, nbytes: int, repeats: int) -> float:
    flat = torch.ones(max(1, nbytes // 4))
    times = []
    for i in range(repeats + 3):
        disturb_caches()
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(flat)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return max(_everyone(statistics.median(times), world))
