"""Learning-rate schedules of a pipeline: one scheduler per stage, stepped once per update.

``Pipeline(lr_scheduler=)`` takes a factory ``optimizer -> torch.optim.lr_scheduler.LRScheduler``
(called on every stage's optimizer, like the optimizer factory on its parameters) or an
:class:`LRSchedule`, the common warm-up-then-decay recipes as a function of the update count.
Each stage steps its scheduler right after each of its updates (skipped float16 updates
included), so update ``t`` of every stage runs with the learning rate of ``t`` scheduler steps,
under every schedule kind: the asynchronous kinds apply update ``t`` at different times on
different stages, but each with the same learning rate.

A checkpoint needs no scheduler state of its own: a stage's version counter is its number of
updates, and a resumed stage (under any plan) rebuilds its scheduler and steps it that many
times (``fast_forward``), which repeats the original run's arithmetic exactly. That rules out
schedulers that read a metric (``ReduceLROnPlateau``), refused at construction.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Callable, Union

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, ReduceLROnPlateau

__all__ = ["LRSchedule", "LR_SCHEDULE_KINDS", "LRScheduleError", "SchedulerFactory", "as_scheduler_factory",
           "build_scheduler", "fast_forward"]

#: What ``LRSchedule.kind`` (and ``train --lr-schedule``) accepts.
LR_SCHEDULE_KINDS = ("constant", "linear", "cosine", "polynomial")

SchedulerFactory = Callable[[torch.optim.Optimizer], LRScheduler]


class LRScheduleError(ValueError):
    """The learning-rate scheduler cannot be built or is not one a pipeline can step."""


@dataclass(frozen=True)
class LRSchedule:
    """The learning rate's multiplier as a function of the update count ``u`` (0 first).

    Warm-up: ``(u + 1) / warmup`` for the first ``warmup`` updates. Then, over the updates up
    to ``total``, with progress ``p`` from 0 to 1: ``constant`` stays 1; ``linear`` falls to
    ``final``; ``cosine`` follows half a cosine down to ``final``; ``polynomial`` falls as
    ``(1 - p) ** power`` to ``final`` (PipeDream's experiments: polynomial decay with warm-up).
    After ``total`` the multiplier stays at its last value.
    """

    kind: str = "constant"
    warmup: int = 0
    total: int | None = None
    final: float = 0.0
    power: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in LR_SCHEDULE_KINDS:
            raise ValueError(f"LRSchedule.kind must be one of {', '.join(LR_SCHEDULE_KINDS)}, got {self.kind!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"LRSchedule.warmup must be a number of updates >= 0, got {self.warmup!r}")
        if self.kind != "constant":
            if isinstance(self.total, bool) or not isinstance(self.total, int) or self.total <= self.warmup:
                raise ValueError(f"LRSchedule.total must be the run's number of updates, more than warmup "
                                 f"({self.warmup}), for a {self.kind} decay; got {self.total!r}")
        if not (isinstance(self.final, (int, float)) and 0 <= self.final <= 1):
            raise ValueError(f"LRSchedule.final must be a multiplier between 0 and 1, got {self.final!r}")
        if not (isinstance(self.power, (int, float)) and math.isfinite(self.power) and self.power > 0):
            raise ValueError(f"LRSchedule.power must be a positive number, got {self.power!r}")

    def __call__(self, update: int) -> float:
        """The multiplier of the learning rate at update ``update``."""
        if update < self.warmup:
            return (update + 1) / self.warmup
        if self.kind == "constant":
            return 1.0
        assert self.total is not None
        progress = min(1.0, (update - self.warmup) / (self.total - self.warmup))
        if self.kind == "linear":
            shape = 1.0 - progress
        elif self.kind == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            shape = (1.0 - progress) ** self.power
        return self.final + (1.0 - self.final) * shape

    def scheduler(self, optimizer: torch.optim.Optimizer) -> LRScheduler:
        """This schedule as a torch scheduler on ``optimizer`` (a ``LambdaLR``)."""
        return LambdaLR(optimizer, self)


def as_scheduler_factory(lr_scheduler: object) -> SchedulerFactory | None:
    """``Pipeline(lr_scheduler=)`` as a factory (None: a constant learning rate)."""
    if lr_scheduler is None:
        return None
    if isinstance(lr_scheduler, LRSchedule):
        return lr_scheduler.scheduler
    if isinstance(lr_scheduler, (LRScheduler, ReduceLROnPlateau)):
        raise ValueError(
            "lr_scheduler must be a factory such as `lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, "
            "T_max=1000)` (each stage builds one on its own optimizer) or a torchpipedream.LRSchedule, not a "
            f"{type(lr_scheduler).__name__} instance")
    if not callable(lr_scheduler):
        raise ValueError(f"lr_scheduler must be a factory `optimizer -> LRScheduler` or an LRSchedule, "
                         f"got {type(lr_scheduler).__name__}")
    return lr_scheduler  # type: ignore[return-value]


def build_scheduler(factory: SchedulerFactory, optimizer: torch.optim.Optimizer, where: str) -> LRScheduler:
    """The factory's scheduler on ``optimizer``, checked: a step-count scheduler (not one that
    reads a metric, which a pipeline has no place to give it)."""
    try:
        scheduler = factory(optimizer)
    except Exception as exc:
        raise LRScheduleError(f"{where}: the lr_scheduler factory raised {type(exc).__name__}: {exc}") from exc
    if isinstance(scheduler, ReduceLROnPlateau):
        raise LRScheduleError(f"{where}: lr_scheduler ReduceLROnPlateau steps on a metric, not once per update; "
                         "use a schedule of the update count (LambdaLR, CosineAnnealingLR, LRSchedule, ...)")
    if not isinstance(scheduler, LRScheduler):
        raise LRScheduleError(f"{where}: the lr_scheduler factory returned {type(scheduler).__name__}, "
                         "not a torch.optim.lr_scheduler.LRScheduler")
    return scheduler


def step_quietly(scheduler: LRScheduler) -> None:
    """``scheduler.step()`` without torch's warning about a step before the optimizer's (a
    skipped float16 update, or a resumed stage catching up, steps the schedule alone)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*lr_scheduler\.step\(\)", category=UserWarning)
        scheduler.step()


def fast_forward(scheduler: LRScheduler, updates: int) -> None:
    """Step a freshly built ``scheduler`` ``updates`` times: where a resumed run's schedule
    stands after that many updates (the same arithmetic as the run it continues)."""
    for _ in range(updates):
        step_quietly(scheduler)


SchedulerArgument = Union[SchedulerFactory, LRSchedule, None]
