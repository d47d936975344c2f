"""Local launcher: run ``fn(rank, *args)`` on ``nprocs`` processes of this computer.

Each worker gets RANK/WORLD_SIZE/LOCAL_RANK, one intra-op thread, and an initialised default
process group (gloo on CPU, NCCL when there is a GPU per worker). The same user function runs
unchanged under ``torchrun``, where :class:`~torchpipedream.runtime.pipeline.Pipeline` picks up
the environment's process group.

**Rendezvous on this computer only.** The launcher hosts the process group's key-value store
in its own process, listening on 127.0.0.1 alone, and the workers' gloo sockets bind to the
loopback interface (``GLOO_SOCKET_IFNAME``, unless the caller set it): nothing of a local run is
reachable from another machine. Because the launcher hosts the store, a worker that is stopped
or killed does not take the rendezvous with it: the others' deadlines still work and name it.

**No wall-clock limit on a healthy run.** The runtime marks progress (``liveness.py``) after
every action and collective step; with ``stall_timeout_s`` the launcher stops the run when no
worker has made progress for that long, and never otherwise (``timeout_s``, a limit on the
whole run, is off unless given).

**Start-up has its own deadline.** A worker has started when its process is up and has
loaded ``fn`` and ``args`` (importing torch and the user's modules: tens of seconds on a loaded
machine). ``startup_timeout_s`` (default 300 s) bounds that, and nothing else does: the workers
meet in the launcher's store before they form the process group, so a peer that is still
importing is not mistaken for an unresponsive one by ``comm_timeout_s`` or ``stall_timeout_s``.

Results come back pickled through files in a private temporary directory that only this
launch's own workers write, so tensors and plain objects both work. A worker's exception is re-raised in the parent as
:class:`LaunchError` naming its rank, with its traceback. When a worker fails, the others get
``failure_grace_s`` to stop on their own (a Pipeline's ranks do, in milliseconds: see
``runtime/failures.py``), then the rest are killed; the error reported is the root cause, a
rank whose own code failed, rather than a rank that stopped because a peer failed
(:class:`PipelineFailure`).

The workers are processes of torchpipedream's own, so they are tuned (``host/tuning.py``) before
their first tensor: PyTorch's huge-page allocation on (``THP_MEM_ALLOC_ENABLE=1``) unless the
caller's environment says otherwise, and malloc keeping the memory of freed tensors for reuse
instead of faulting fresh pages in every step. The caller's own process and environment are
left as they are: ``fn`` and ``args`` travel pickled and are unpickled in the worker after
the tuning, so that even tensors among the arguments are allocated the tuned way.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import pickle
import re
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  before any process group is formed: see process_exit.py
import torch.multiprocessing as mp

from ..host.tuning import tune_own_process
from . import liveness
from .devices import default_backend

__all__ = ["launch", "LaunchError", "free_port", "init_from_env", "loopback_interface", "without_cpp_frames"]


class LaunchError(RuntimeError):
    """A worker failed or the run timed out; the message names the rank."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def loopback_interface() -> str | None:
    """The name of this computer's loopback network interface ("lo" on Linux), if any."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:  # pragma: no cover - platforms without if_nameindex
        return None
    return next((n for n in names if n == "lo"), next((n for n in names if n.startswith("lo")), None))


def without_cpp_frames(text: str) -> str:
    """``text`` without the C++ stack traces that torch appends to some errors ("Exception
    raised from ...", "frame #3: ..."): they bury the message and say nothing to a user."""
    lines = [line for line in text.splitlines()
             if not re.match(r"\s*(frame #\d+:|Exception raised from |<omitting python frames>)", line)]
    return "\n".join(lines)


def _loopback_store(world: int, timeout_s: float) -> Any:
    """A key-value store hosted in this process and listening on 127.0.0.1 only (TCPStore binds
    every interface unless it is handed a socket that is already bound)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(max(128, 2 * world))
    port = sock.getsockname()[1]
    store = dist.TCPStore("127.0.0.1", port, world, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False, master_listen_fd=sock.fileno())
    sock.detach()  # the store owns the listening socket now, and closes it
    return store, port


def init_from_env(backend: str, timeout_s: float, startup_timeout_s: float = 300.0) -> None:
    """``dist.init_process_group`` from the environment (torchrun's or :func:`launch`'s).

    Under torchrun the workers share the agent's key-value store (TORCHELASTIC_USE_AGENT_STORE),
    which outlives a restart: measured with torch 2.13 and ``--max-restarts``, restarted
    workers sometimes read the previous attempt's gloo addresses from it and fail with
    "connectFullMesh failed ... Connection refused". So each attempt gets its own key prefix
    (TORCHELASTIC_RESTART_COUNT), and the workers first meet there with ``startup_timeout_s``
    (a peer still importing torch on a loaded machine is not a hung one), then form the group
    with ``timeout_s``. Otherwise this is the plain ``env://`` initialisation.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                              timeout=datetime.timedelta(seconds=startup_timeout_s))
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        prefixed = dist.PrefixStore(f"torchpipedream/attempt_{attempt}/", store)
        _meet(prefixed, rank, world)
        prefixed.set_timeout(timeout)
        dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)


def _meet(store: Any, rank: int, world: int) -> None:
    """Note in ``store`` that this worker has started, and wait (the store's timeout) until
    every worker has."""
    store.set(f"started/{rank}", "1")
    store.wait([f"started/{r}" for r in range(world)])


def _worker(rank: int, nprocs: int, port: int, backend: str, timeouts: tuple[float, float],
            outdir: str, threads: int, huge_pages: bool, keep_freed: bool, marks: Any) -> None:
    """One launched process: tuned, started (``fn`` and ``args`` loaded from the launch's
    folder), met with its peers, in the process group; then ``fn(rank, *args)``. ``timeouts``:
    (comm_timeout_s, startup_timeout_s)."""
    tune_own_process(huge_pages=huge_pages, keep_freed=keep_freed)  # before the first tensor
    # Pipeline(measure_memory=True) runs PyTorch's profiler, whose Kineto library otherwise prints
    # two lines to stderr per run; this process is ours (a user's own setting is kept).
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nprocs))
    loopback = loopback_interface()
    if loopback is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)  # gloo listens on loopback only
    fn, args = pickle.loads((Path(outdir) / PAYLOAD_FILE).read_bytes())  # imports the user's modules: starting
    liveness.attach(marks, rank)  # started
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)  # default_backend chose nccl: a GPU for each worker
    _join_group(rank, nprocs, port, backend, *timeouts)
    try:
        try:
            result = fn(rank, *args)
        except BaseException as exc:
            text = without_cpp_frames(f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            kind = "consequence" if type(exc).__name__ == "PipelineFailure" else "cause"
            (Path(outdir) / f"error_{rank}.{kind}.txt").write_text(text)
            raise RuntimeError(text) from None
        with open(Path(outdir) / f"result_{rank}.pickle", "wb") as f:
            pickle.dump(result, f)
        _phase(outdir, rank, "had written its result")
        # Tear down together: a rank that destroys its process group while a peer still has
        # gloo work in flight can abort the peer ("terminate called without an active
        # exception", seen intermittently at the end of benchmark runs). A rank that failed
        # skips this; the launcher kills the others.
        dist.barrier()
        _phase(outdir, rank, "had passed the final barrier")
    finally:
        try:
            dist.destroy_process_group()
            _phase(outdir, rank, "had destroyed its process group")
        except Exception:  # pragma: no cover - best effort on the way out
            pass


def _join_group(rank: int, nprocs: int, port: int, backend: str, comm_timeout_s: float,
                startup_timeout_s: float) -> None:
    """Wait (up to the start-up deadline) until every worker has started, then form the process
    group with ``comm_timeout_s``: a peer still importing torch is not an unresponsive one. The
    launcher stops the run first when a worker does not start in time (and names it)."""
    store = dist.TCPStore("127.0.0.1", port, nprocs, is_master=False,
                          timeout=datetime.timedelta(seconds=startup_timeout_s + 10.0))
    _meet(store, rank, nprocs)
    timeout = datetime.timedelta(seconds=comm_timeout_s)
    store.set_timeout(timeout)
    dist.init_process_group(backend, store=store, rank=rank, world_size=nprocs, timeout=timeout)
    liveness.mark()


def _phase(outdir: str, rank: int, what: str) -> None:
    """Note how far a worker got on its way out, for the message if it dies there (an abort in
    gloo's teardown is seen rarely and not yet explained: this says where it happened)."""
    (Path(outdir) / f"phase_{rank}.txt").write_text(what)


def _wait_for_workers(processes: list[Any], deadline: float | None, grace_s: float, marks: Any,
                      stall_s: float | None, startup_s: float) -> tuple[dict[int, int], str | None]:
    """Wait until every worker exited, until ``grace_s`` after the first failure, or until the
    run is stuck: past ``deadline`` (a wall-clock limit), a worker not started (its first
    progress mark) within ``startup_s``, or, once all started, no worker marking progress for
    ``stall_s``. Returns ({rank: exit code} of the failed workers, why it stopped early)."""
    first_failure = None
    began = time.monotonic()
    while True:
        codes = [p.exitcode for p in processes]
        failed = {r: c for r, c in enumerate(codes) if c not in (None, 0)}
        if failed and first_failure is None:
            first_failure = time.monotonic()
        if all(c is not None for c in codes):
            return failed, None
        if first_failure is not None and time.monotonic() - first_failure > grace_s:
            return failed, None
        if deadline is not None and time.monotonic() > deadline:
            return failed, "deadline"
        running = [r for r, c in enumerate(codes) if c is None]
        if first_failure is None and any(marks[r] == 0.0 for r in running):
            if time.monotonic() - began > startup_s:
                return failed, "start"
        elif stall_s is not None and first_failure is None and running:
            if min(liveness.last_marks(marks)[r] for r in running) > stall_s:
                return failed, "stall"
        time.sleep(0.02)


def _stall_message(marks: Any, stall_s: float, nprocs: int) -> str:
    idle = liveness.last_marks(marks)
    oldest = max(range(nprocs), key=lambda r: idle[r])
    ages = ", ".join(f"rank {r} {idle[r]:.0f} s ago" for r in range(nprocs))
    return (f"no worker made progress for {stall_s:g} s (last progress: {ages}); rank {oldest} stopped first. "
            f"All {nprocs} workers were killed")


#: The file of a launch's private folder that holds ``(fn, args)`` pickled: the workers read it
#: rather than receive it through the spawn start method's pipe, which blocks the launching
#: process for good on a payload larger than the pipe's buffer when a worker dies before it
#: reads (a script without a ``__main__`` guard: each worker runs it again and fails).
PAYLOAD_FILE = "payload.pickle"

#: Why a worker that exited with an error before it started most likely did (its own error,
#: which Python printed to stderr, names it).
NOT_STARTED_HINT = (" before it started (while its interpreter imported the launching script and fn's modules; "
                    "Python's error is printed above). If the script that calls launch() has no "
                    "`if __name__ == \"__main__\":` guard, each worker runs the script again when it imports it "
                    "(the spawn start method) and fails: put the call under that guard")


def _root_cause(failed: dict[int, int], outdir: Path, running: list[int], unstarted: Sequence[int] = ()) -> str:
    """The error to report: a rank whose own code failed (with its traceback), else one that
    died without a word (killed; with a hint where it died before it started: ``unstarted``),
    else the first rank that stopped because a peer failed (its message alone: the traceback of
    a rank that only saw a peer fail says nothing more). Ranks still running when the others
    gave up (hung, stopped) are named: they are killed next."""
    def text(rank: int, kind: str) -> str | None:
        path = outdir / f"error_{rank}.{kind}.txt"
        return path.read_text() if path.exists() else None

    still = (f"\nrank(s) {', '.join(map(str, running))} had not stopped and were killed" if running else "")
    for rank in sorted(failed):
        cause = text(rank, "cause")
        if cause is not None:
            return f"worker rank {rank} failed:\n{cause}{still}"
    for rank in sorted(failed):
        if text(rank, "consequence") is None:
            phase = outdir / f"phase_{rank}.txt"
            where = f", after it {phase.read_text()}" if phase.exists() else ""
            if rank in unstarted and failed[rank] > 0:
                where = NOT_STARTED_HINT
            return f"worker rank {rank} exited with code {failed[rank]} (killed by a signal if negative){where}{still}"
    rank = min(failed)
    first_line = (text(rank, "consequence") or "").splitlines()[0]
    return f"worker rank {rank} failed: {first_line}{still}"


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str | None = None,
    timeout_s: float | None = None,
    stall_timeout_s: float | None = None,
    comm_timeout_s: float = 300.0,
    startup_timeout_s: float = 300.0,
    return_all: bool = False,
    threads: int = 1,
    failure_grace_s: float = 3.0,
    huge_pages: bool = True,
    keep_freed_memory: bool = True,
) -> Any:
    """Run ``fn(rank, *args)`` on ``nprocs`` local processes; return rank 0's result.

    Args:
        fn: a picklable (module-level) function.
        nprocs: number of worker processes.
        backend: "gloo" or "nccl" (default: ``devices.default_backend``: nccl when CUDA and NCCL are
            available and there is a GPU per worker, else gloo; with gloo and a GPU the workers
            still compute on it, their messages staged through host memory).
        timeout_s: a wall-clock limit on the whole run (default: none); the workers are killed
            after it.
        stall_timeout_s: stop the run when no worker has marked progress (``liveness.py``:
            the runtime marks every action and collective step) for this long (default:
            never). A run that keeps working is never cut short.
        comm_timeout_s: the process group's timeout: the deadline of gloo's own waits once
            every worker has started.
        startup_timeout_s: how long a worker may take to start (its process up, torch and
            ``fn``'s modules imported, ``fn`` and ``args`` loaded); the workers are killed
            after it, naming the ranks that had not started. Independent of the other
            deadlines: a slow start on a loaded machine is not a hang.
        return_all: return every rank's result as a list.
        threads: intra-op threads per worker.
        failure_grace_s: after a worker fails, how long the others may take to stop on their
            own before they are killed.
        huge_pages: start the workers with PyTorch's huge-page allocation on
            (``THP_MEM_ALLOC_ENABLE=1``; see ``host/huge_pages.py``) unless the environment
            already sets it.
        keep_freed_memory: the workers' malloc keeps freed memory for reuse
            (``host/freed_memory.py``; a training step re-allocates the same buffers each time).

    Raises:
        ValueError: before any worker starts: a number of processes, timeout or backend it cannot
            use (NCCL without a GPU for each worker).
        LaunchError: a worker raised (the message names its rank and has its traceback), the
            run exceeded ``timeout_s``, it stalled for ``stall_timeout_s``, or a worker did not
            start within ``startup_timeout_s``.
    """
    _check_launch_arguments(nprocs, timeout_s=timeout_s, stall_timeout_s=stall_timeout_s,
                            comm_timeout_s=comm_timeout_s, startup_timeout_s=startup_timeout_s)
    if backend is None:
        backend = default_backend(nprocs)
    _check_backend(backend, nprocs)
    payload = _pickled(fn, args)
    store, port = _loopback_store(nprocs, comm_timeout_s)
    marks = mp.get_context("spawn").Array("d", nprocs, lock=False)  # 0.0 until a worker starts
    try:
        with tempfile.TemporaryDirectory(prefix="tpd_launch_") as outdir:
            (Path(outdir) / PAYLOAD_FILE).write_bytes(payload)  # a private folder (mkdtemp: owner only)
            ctx = mp.start_processes(
                _worker,
                args=(nprocs, port, backend, (comm_timeout_s, startup_timeout_s), outdir, threads,
                      huge_pages, keep_freed_memory, marks),
                nprocs=nprocs, join=False, start_method="spawn",
            )
            _watch_workers(ctx.processes, marks, Path(outdir), timeout_s, stall_timeout_s, startup_timeout_s,
                           failure_grace_s)
            results = _read_results(Path(outdir), nprocs)
    finally:
        del store  # closes the listening socket
    return results if return_all else results[0]


def _check_launch_arguments(nprocs: Any, **timeouts: float | None) -> None:
    """ValueError for a number of processes or a timeout that :func:`launch` cannot use."""
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive integer, got {nprocs!r}")
    for name, value in timeouts.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or not (value > 0 and math.isfinite(value))):
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def _check_backend(backend: Any, nprocs: int) -> None:
    """ValueError for a backend the workers cannot use here: an unknown name, or NCCL without a
    GPU for each worker (NCCL refuses two ranks on one GPU; gloo shares one, ``devices.py``)."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "nccl" and gpus < nprocs:
        raise ValueError(f"backend='nccl' needs a GPU for each of the {nprocs} workers, this machine has {gpus} "
                         "(NCCL refuses two ranks on one GPU): leave backend unset, and workers that share a GPU "
                         "use gloo, their messages staged through host memory")


def _pickled(fn: Callable[..., Any], args: tuple[Any, ...]) -> bytes:
    """``(fn, args)`` as the workers receive them, or LaunchError saying why they cannot travel."""
    try:
        return pickle.dumps((fn, args))
    except Exception as exc:
        raise LaunchError(f"launch() sends fn and args to the workers by pickling them: {type(exc).__name__}: {exc} "
                          "(use a module-level function and picklable arguments)") from None


def _watch_workers(processes: list[Any], marks: Any, outdir: Path, timeout_s: float | None,
                   stall_timeout_s: float | None, startup_timeout_s: float, failure_grace_s: float) -> None:
    """Wait for the workers to finish; LaunchError when one failed, one did not start, the run
    passed its deadline or stalled. Workers still alive afterwards are killed either way."""
    nprocs = len(processes)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        failed, early = _wait_for_workers(processes, deadline, failure_grace_s, marks, stall_timeout_s,
                                          startup_timeout_s)
        if early == "start":
            late = [r for r in range(nprocs) if marks[r] == 0.0]
            raise LaunchError(f"worker rank(s) {', '.join(map(str, late))} did not start within "
                              f"{startup_timeout_s:g} s (the start-up deadline: --startup-timeout of `train`, "
                              f"startup_timeout_s of launch()); all {nprocs} workers were killed")
        if early == "deadline":
            raise LaunchError(f"the run did not finish within {timeout_s:g} s; all {nprocs} workers were killed")
        if early == "stall":
            raise LaunchError(_stall_message(marks, stall_timeout_s, nprocs))  # type: ignore[arg-type]
        if failed:
            running = [r for r, p in enumerate(processes) if p.exitcode is None]
            raise LaunchError(_root_cause(failed, outdir, running, [r for r in failed if marks[r] == 0.0]))
    finally:
        for p in processes:
            if p.is_alive():
                p.kill()
        for p in processes:
            p.join(timeout=5)


def _read_results(outdir: Path, nprocs: int) -> list[Any]:
    """Every rank's result (None where a rank wrote none), from this launch's own private
    directory, written by its own workers."""
    results = []
    for rank in range(nprocs):
        path = outdir / f"result_{rank}.pickle"
        with open(path, "rb") if path.exists() else contextlib.nullcontext() as f:
            results.append(pickle.load(f) if f is not None else None)
    return results
