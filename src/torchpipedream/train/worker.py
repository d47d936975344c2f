"""One rank of a training run: build the pipeline, train epoch by epoch with checkpoints,
evaluate, and hand the results to rank 0."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterator

import torch
from tqdm import tqdm

from ..runtime import Pipeline
from ..runtime.lr_schedule import LRSchedule
from .config import TrainConfig, minibatches_per_epoch, schedule_of
from .inputs import build_model, load_data, loss_for, minibatches, optimizer_factory, pipeline_units, stage_modules
from .out_dir import checkpoints_root, flight_record_dir, prune_checkpoints
from .preparation import Prepared
from .resume import checkpoint_dir

log = logging.getLogger(__name__)

__all__ = ["train_rank"]


def _progress_bar(rank: int, prep: Prepared, per_epoch: int) -> Any:
    cfg = prep.config
    if rank != 0 or not cfg.progress:
        return None
    return tqdm(total=cfg.epochs * per_epoch, unit="minibatch", dynamic_ncols=True,
                desc=f"train {cfg.model} [{prep.plan.summary}, {prep.plan.schedule}]")


def lr_schedule_of(cfg: TrainConfig, per_epoch: int) -> LRSchedule | None:
    """``--lr-schedule`` and ``--warmup`` over the run's updates (one per minibatch under every
    schedule kind), decaying to 0 at the last; None for a constant rate without warm-up."""
    if cfg.lr_schedule == "constant" and cfg.warmup == 0:
        return None
    return LRSchedule(cfg.lr_schedule, cfg.warmup, total=cfg.epochs * per_epoch, final=0.0)


def train_rank(rank: int, prep: Prepared) -> dict[str, Any] | None:
    """Train as rank ``rank`` of the plan; rank 0 returns history, trace and full state."""
    cfg = prep.config
    model = build_model(cfg)
    units = pipeline_units(cfg, model)  # GPT-2 with --tensor-parallel: cut by its own modules
    x, y, xt, yt = load_data(cfg)
    kind, microbatches = schedule_of(cfg, prep.plan)
    per_epoch = minibatches_per_epoch(len(x), cfg.batch_size, cfg.max_minibatches)
    pipe = Pipeline(stage_modules(units, prep.plan) if units is not None else model, prep.plan,
                    model=model if units is not None else None, optimizer=optimizer_factory(cfg), loss_fn=loss_for(cfg),
                    schedule=kind, microbatches=microbatches,
                    vertical_sync=cfg.vertical_sync,
                    timeout_s=cfg.timeout_s, seed=cfg.seed, failure_timeout_s=cfg.failure_timeout_s,
                    precision=cfg.precision, measure_memory=cfg.measure_memory,
                    lr_scheduler=lr_schedule_of(cfg, per_epoch), clip_grad_norm=cfg.clip_grad_norm,
                    sample=x[: cfg.batch_size])  # for models that torch.export traces (--model gpt2)
    with _flight_record_on_failure(pipe, cfg.out, rank):
        return _train(rank, prep, pipe, (x, y, xt, yt), per_epoch)


@contextlib.contextmanager
def _flight_record_on_failure(pipe: Pipeline, out: str, rank: int) -> Iterator[None]:
    """On any failure, write where this rank stood (its flight recorder) to
    OUT/flight_record/rank<r>.json before the error goes up (the job names them all)."""
    try:
        yield
    except BaseException as exc:
        path = flight_record_dir(out) / f"rank{rank}.json"
        try:
            pipe.flight_recorder.write(path, error=f"{type(exc).__name__}: {str(exc)[:2000]}")
        except OSError as err:
            log.warning("rank %d: could not write its flight record to %s: %s", rank, path, err)
        raise


def _train(rank: int, prep: Prepared, pipe: Pipeline, data: tuple[Any, ...], per_epoch: int) -> dict[str, Any] | None:
    """Train, evaluate and checkpoint epoch by epoch (resuming where a checkpoint says)."""
    cfg = prep.config
    x, y, xt, yt = data
    test = minibatches(xt, yt, 256, None, None)
    bar = _progress_bar(rank, prep, per_epoch)
    history: list[dict[str, Any]] = []
    start_epoch, start_minibatch, partial = 0, 0, {"losses": [], "seconds": 0.0}
    if prep.resume_from is not None:
        extra = pipe.load_checkpoint(prep.resume_from)  # collective; verified on every rank
        start_epoch, history = int(extra["epoch"]), list(extra["history"])
        start_minibatch = int(extra.get("minibatch", 0))  # inside epoch `start_epoch` (--checkpoint-every)
        partial = dict(extra.get("partial") or partial)
        if bar is not None:
            bar.update(start_epoch * per_epoch + start_minibatch)
    trace = None
    for epoch in range(start_epoch, cfg.epochs):
        batches = minibatches(x, y, cfg.batch_size, cfg.max_minibatches, cfg.seed * 1000 + epoch)
        resumed = epoch == start_epoch
        norms_before = len(pipe.grad_norms)
        losses, seconds = _train_epoch(pipe, cfg, epoch, batches, start_minibatch if resumed else 0,
                                       list(partial["losses"]) if resumed else [],
                                       float(partial["seconds"]) if resumed else 0.0, history, bar,
                                       prep.plan_changes)
        pipe.epochs_done += 1
        if epoch == cfg.epochs - 1:
            trace = pipe.trace(dst=0)  # collective: the measured trace of the last schedule
        metrics = pipe.evaluate(test)
        samples = sum(len(b[1]) for b in batches)
        row = {"epoch": epoch + 1, "train_loss": sum(losses) / len(losses), "test_loss": metrics["loss"],
               "test_accuracy": metrics["accuracy"], "seconds": seconds, "minibatches": len(batches),
               "samples_per_s": samples / seconds}
        if cfg.clip_grad_norm is not None:  # the global gradient norms (before clipping) of this epoch's updates
            row["grad_norm"] = _norm_summary(pipe.grad_norms[norms_before:])
        history.append(row)
        if rank == 0 and not math.isfinite(row["train_loss"]) and all(math.isfinite(r["train_loss"])
                                                                       for r in history[:-1]):
            log.warning("the training loss is %s in epoch %d: the run diverged (a smaller --lr may help)",
                        row["train_loss"], epoch + 1)
        # Collective, after the schedule returned: nothing in flight; exact to resume from. The
        # last one also keeps the measured trace, so the outputs can be written again from it.
        last = epoch == cfg.epochs - 1
        _checkpoint(pipe, cfg, rank, checkpoint_dir(cfg.out, epoch + 1), epoch=epoch + 1, minibatch=0,
                    history=history, plan_changes=prep.plan_changes,
                    trace=trace.to_dict() if last and trace is not None else None)
        if bar is not None:
            acc = row["test_accuracy"]
            bar.set_postfix(loss=f"{row['train_loss']:.3f}", acc="-" if acc is None else f"{acc:.3f}",
                            samples_s=f"{row['samples_per_s']:.0f}")
    if bar is not None:
        bar.close()
    state = pipe.state_dict(dst=0)
    peaks = pipe.memory_peaks() if cfg.measure_memory else None  # collective
    if rank != 0:
        return None
    scaling = {"scale": pipe.loss_scale, "skipped_updates": pipe.skipped_updates} if cfg.precision == "fp16" else None
    return {"history": history, "trace": trace, "state": state, "memory_peak_bytes": peaks, "loss_scaling": scaling,
            "threads": torch.get_num_threads()}



def _norm_summary(norms: list[float]) -> dict[str, float | None]:
    """The largest and the mean of an epoch's gradient norms, but those of float16 updates
    skipped (NaN); None when there are none (an epoch resumed at its end)."""
    norms = [n for n in norms if not math.isnan(n)]
    if not norms:
        return {"max": None, "mean": None}
    return {"max": max(norms), "mean": sum(norms) / len(norms)}


def _train_epoch(pipe: Any, cfg: Any, epoch: int, batches: list, first: int, losses: list[float], seconds: float,
                 history: list[dict[str, Any]], bar: Any, changes: list[dict[str, Any]]) -> tuple[list[float], float]:
    """Train ``batches[first:]``: one schedule per chunk of ``--checkpoint-every`` minibatches
    (the whole epoch by default). The pipeline drains at each chunk's end, so a checkpoint
    there is exact. Returns the epoch's losses and training seconds so far."""
    every = cfg.checkpoint_every or len(batches)
    for lo in range(first, len(batches), every):
        chunk = batches[lo: lo + every]
        t0 = time.perf_counter()
        losses += pipe.train_minibatches(chunk)
        seconds += time.perf_counter() - t0
        if bar is not None:
            bar.update(len(chunk))
        done = lo + len(chunk)
        if done < len(batches):
            _checkpoint(pipe, cfg, pipe.rank, checkpoint_dir(cfg.out, epoch, done), epoch=epoch, minibatch=done,
                        partial={"losses": losses, "seconds": seconds}, history=history, plan_changes=changes)
    return losses, seconds


def _checkpoint(pipe: Any, cfg: TrainConfig, rank: int, directory: Path, **extra: Any) -> None:
    """Save (collective), then rank 0 keeps the newest ``--keep-checkpoints`` (out_dir.py).
    ``extra`` carries the data position, the history and the resumptions onto other plans."""
    pipe.save_checkpoint(directory, config=asdict(cfg), **extra)
    if rank == 0:
        for deleted in prune_checkpoints(checkpoints_root(cfg.out), cfg.keep_checkpoints):
            log.debug("deleted checkpoint %s (--keep-checkpoints %d)", deleted, cfg.keep_checkpoints)
