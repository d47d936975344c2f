"""Local launcher: run ``fn(rank, *args)`` on ``nprocs`` processes of this computer.

Each worker gets MASTER_ADDR=127.0.0.1, a free MASTER_PORT, RANK/WORLD_SIZE/LOCAL_RANK, one
intra-op thread, and an initialised default process group (gloo on CPU, NCCL when there is a
GPU per worker). The same user function runs unchanged under ``torchrun``, where
:class:`~torchpipedream.runtime.pipeline.Pipeline` picks up the environment's process group.

Results come back through files (``torch.save``), so tensors and plain objects both work. A
worker's exception is re-raised in the parent as :class:`LaunchError` naming its rank, with
its traceback. When a worker fails, the others get ``failure_grace_s`` to stop on their own
(a Pipeline's ranks do, in milliseconds: see ``runtime/failures.py``), then the rest are
killed; the error reported is the root cause, a rank whose own code failed, rather than a
rank that stopped because a peer failed (:class:`PipelineFailure`). All workers are killed
when ``timeout_s`` passes.

The workers are processes of torchpipedream's own, so they are tuned (``tuning.py``) before
their first tensor: PyTorch's huge-page allocation on (``THP_MEM_ALLOC_ENABLE=1``) unless the
caller's environment says otherwise, and malloc keeping the memory of freed tensors for reuse
instead of faulting fresh pages in every step. The caller's own process and environment are
left as they are: ``fn`` and ``args`` travel pickled and are unpickled in the worker after
the tuning, so that even tensors among the arguments are allocated the tuned way.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..tuning import tune_own_process

__all__ = ["launch", "LaunchError", "free_port", "init_from_env"]


class LaunchError(RuntimeError):
    """A worker failed or the run timed out; the message names the rank."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_from_env(backend: str, timeout_s: float) -> None:
    """``dist.init_process_group`` from the environment (torchrun's or :func:`launch`'s).

    Under torchrun the workers share the agent's key-value store (TORCHELASTIC_USE_AGENT_STORE),
    which outlives a restart: measured with torch 2.13 and ``--max-restarts``, restarted
    workers sometimes read the previous attempt's gloo addresses from it and fail with
    "connectFullMesh failed ... Connection refused". So each attempt gets its own key prefix
    (TORCHELASTIC_RESTART_COUNT). Otherwise this is the plain ``env://`` initialisation.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                              timeout=timeout)
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        prefixed = dist.PrefixStore(f"torchpipedream/attempt_{attempt}/", store)
        dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=timeout)
    else:
        dist.init_process_group(backend, timeout=timeout)


def _worker(rank: int, payload: bytes, nprocs: int, port: int, backend: str, timeout_s: float, outdir: str,
            threads: int, huge_pages: bool, keep_freed: bool) -> None:
    tune_own_process(huge_pages=huge_pages, keep_freed=keep_freed)  # before the first tensor
    fn, args = pickle.loads(payload)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nprocs))
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=nprocs,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        try:
            result = fn(rank, *args)
        except BaseException as exc:
            text = f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
            kind = "consequence" if type(exc).__name__ == "PipelineFailure" else "cause"
            (Path(outdir) / f"error_{rank}.{kind}.txt").write_text(text)
            raise RuntimeError(text) from None
        torch.save(result, Path(outdir) / f"result_{rank}.pt")
        # Tear down together: a rank that destroys its process group while a peer still has
        # gloo work in flight can abort the peer ("terminate called without an active
        # exception", seen intermittently at the end of benchmark runs). A rank that failed
        # skips this; the launcher kills the others.
        dist.barrier()
    finally:
        try:
            dist.destroy_process_group()
        except Exception:  # pragma: no cover - best effort on the way out
            pass


def _wait_for_workers(processes: list[Any], deadline: float, grace_s: float) -> dict[int, int] | None:
    """Wait until every worker exited, or until ``grace_s`` after the first failure.

    Returns {rank: exit code} of the failed workers ({} when all succeeded), None on timeout.
    """
    first_failure = None
    while True:
        codes = [p.exitcode for p in processes]
        failed = {r: c for r, c in enumerate(codes) if c not in (None, 0)}
        if failed and first_failure is None:
            first_failure = time.monotonic()
        if all(c is not None for c in codes):
            return failed
        if first_failure is not None and time.monotonic() - first_failure > grace_s:
            return failed
        if time.monotonic() > deadline:
            return None
        time.sleep(0.02)


def _root_cause(failed: dict[int, int], outdir: Path) -> str:
    """The error to report: a rank whose own code failed, else one that died without a word
    (killed), else the first rank that stopped because a peer failed."""
    def text(rank: int, kind: str) -> str | None:
        path = outdir / f"error_{rank}.{kind}.txt"
        return path.read_text() if path.exists() else None

    for rank in sorted(failed):
        cause = text(rank, "cause")
        if cause is not None:
            return f"worker rank {rank} failed:\n{cause}"
    for rank in sorted(failed):
        if text(rank, "consequence") is None:
            return f"worker rank {rank} exited with code {failed[rank]}"
    rank = min(failed)
    return f"worker rank {rank} failed:\n{text(rank, 'consequence')}"


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str | None = None,
    timeout_s: float = 600.0,
    comm_timeout_s: float | None = None,
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
        backend: "gloo" or "nccl" (default: nccl if there is a GPU per worker, else gloo).
        timeout_s: wall-clock limit of the whole run; the workers are killed after it.
        comm_timeout_s: the process group's timeout (default ``timeout_s``).
        return_all: return every rank's result as a list.
        threads: intra-op threads per worker.
        failure_grace_s: after a worker fails, how long the others may take to stop on their
            own before they are killed.
        huge_pages: start the workers with PyTorch's huge-page allocation on
            (``THP_MEM_ALLOC_ENABLE=1``; see ``huge_pages.py``) unless the environment
            already sets it.
        keep_freed_memory: the workers' malloc keeps freed memory for reuse
            (``freed_memory.py``; a training step re-allocates the same buffers each time).

    Raises:
        LaunchError: a worker raised (the message names its rank and has its traceback) or
            the run exceeded ``timeout_s``.
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive integer, got {nprocs!r}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs else "gloo"
    try:
        payload = pickle.dumps((fn, args))
    except Exception as exc:
        raise LaunchError(f"launch() sends fn and args to the workers by pickling them: {type(exc).__name__}: {exc} "
                          "(use a module-level function and picklable arguments)") from None
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tpd_launch_") as outdir:
        ctx = mp.start_processes(
            _worker,
            args=(payload, nprocs, port, backend, comm_timeout_s or timeout_s, outdir, threads, huge_pages,
                  keep_freed_memory),
            nprocs=nprocs, join=False, start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            failed = _wait_for_workers(ctx.processes, deadline, failure_grace_s)
            if failed is None:
                raise LaunchError(f"the run did not finish within {timeout_s:g} s; all {nprocs} workers were killed")
            if failed:
                raise LaunchError(_root_cause(failed, Path(outdir)))
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            for p in ctx.processes:
                p.join(timeout=5)
        results = []
        for rank in range(nprocs):
            path = Path(outdir) / f"result_{rank}.pt"
            results.append(torch.load(path, weights_only=False) if path.exists() else None)
    return results if return_all else results[0]
