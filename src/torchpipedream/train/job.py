"""A whole training run, on this computer's cores (``launch``) or as one process of torchrun."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from .config import TrainConfig
from .outputs import write_outputs
from .preparation import Prepared, prepare
from .resume import resume_after_restart
from .worker import train_rank

__all__ = ["run"]

log = logging.getLogger(__name__)


def run(cfg: TrainConfig) -> dict[str, Any]:
    """Prepare, launch one worker per plan rank on this computer, train, and write the outputs;
    returns the report.

    Under torchrun (RANK and WORLD_SIZE set) each process is one worker: rank 0 prepares and
    broadcasts the plan, and writes the outputs (the other ranks return an empty dict).
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return _run_under_torchrun(cfg)
    from ..runtime import launch

    prep = prepare(cfg, measure_host=True)
    log.info("plan %s for %d workers: %s", prep.plan.summary, prep.plan.num_workers, prep.why)
    result = launch(train_rank, prep.plan.num_workers, prep, timeout_s=max(cfg.timeout_s * 4, 600.0))
    return write_outputs(prep, result, Path(cfg.out))


def _run_under_torchrun(cfg: TrainConfig) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        from ..runtime.launcher import init_from_env

        init_from_env("nccl" if torch.cuda.is_available() else "gloo", max(cfg.timeout_s, 60.0))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg.workers = world
    box: list[Any] = [None]
    if rank == 0:
        try:
            resume_after_restart(cfg)
            box[0] = prepare(cfg)
        except Exception as exc:  # tell the other ranks, then fail here
            box[0] = exc
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], Exception):
        raise box[0]
    prep: Prepared = box[0]
    if prep.resume_from is not None:
        log.warning("rank %d: resuming from %s", rank, prep.resume_from)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world))))
    result = train_rank(rank, prep)
    # Leave together (as launch() does): a rank whose process exits while a peer's gloo work
    # is still in flight can abort the peer ("terminate called without an active exception",
    # seen after a resumed run).
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return {}
    return write_outputs(prep, result, Path(cfg.out))
