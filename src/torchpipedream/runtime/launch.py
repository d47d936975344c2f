"""Local launcher: run ``fn(rank, *args)`` on ``nprocs`` processes of this computer.

Each worker gets MASTER_ADDR=127.0.0.1, a free MASTER_PORT, RANK/WORLD_SIZE/LOCAL_RANK, one
intra-op thread, and an initialised default process group (gloo on CPU, NCCL when there is a
GPU per worker). The same user function runs unchanged under ``torchrun``, where
:class:`~torchpipedream.runtime.pipeline.Pipeline` picks up the environment's process group.

Results come back through files (``torch.save``), so tensors and plain objects both work. A
worker's exception is re-raised in the parent as :class:`LaunchError` naming its rank, with
its traceback; the other workers are killed. So are all of them when ``timeout_s`` passes.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["launch", "LaunchError", "free_port"]


class LaunchError(RuntimeError):
    """A worker failed or the run timed out; the message names the rank."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, fn: Callable[..., Any], args: tuple[Any, ...], nprocs: int, port: int,
            backend: str, timeout_s: float, outdir: str, threads: int) -> None:
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
            raise RuntimeError(f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}") from None
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


def launch(
    fn: Callable[..., Any],
    nprocs: int,
    *args: Any,
    backend: str | None = None,
    timeout_s: float = 600.0,
    comm_timeout_s: float | None = None,
    return_all: bool = False,
    threads: int = 1,
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

    Raises:
        LaunchError: a worker raised (the message names its rank and has its traceback) or
            the run exceeded ``timeout_s``.
    """
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive integer, got {nprocs!r}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs else "gloo"
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="tpd_launch_") as outdir:
        ctx = mp.start_processes(
            _worker,
            args=(fn, args, nprocs, port, backend, comm_timeout_s or timeout_s, outdir, threads),
            nprocs=nprocs, join=False, start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=min(1.0, max(0.01, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise LaunchError(f"the run did not finish within {timeout_s:g} s; all {nprocs} workers were killed")
        except mp.ProcessRaisedException as exc:
            raise LaunchError(f"worker rank {exc.error_index} failed:\n{exc}") from None
        except mp.ProcessExitedException as exc:
            raise LaunchError(f"worker rank {exc.error_index} exited with code {exc.exit_code}") from None
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
