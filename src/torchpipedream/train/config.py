"""What a training run is asked to do: :class:`TrainConfig` and its checks. No torch import,
so the command line can build its options from it quickly."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ..kinds import KIND_NAMES, schedule_kind

__all__ = ["TrainConfig", "TrainError", "OPTIMIZERS", "check_options", "microbatches_of"]

OPTIMIZERS = ("sgd", "momentum", "adam")


class TrainError(ValueError):
    """An option or input of `torchpipedream train` cannot be used; the message says what to do."""


@dataclass
class TrainConfig:
    """Everything a training run needs; the CLI fills it from its options."""

    model: str = "cnn"
    schedule: str = "pipedream"
    workers: int = 0  # 0: one per core
    epochs: int = 8
    batch_size: int = 32
    lr: float = 0.001
    optimizer: str = "adam"
    microbatches: int = 4
    stages: int | None = None  # planner: exactly this many stages
    straight: bool = False  # planner: no replication
    plan_file: str | None = None
    topology: str | None = None
    out: str = "runs/train"
    seed: int = 0
    timeout_s: float = 120.0
    vertical_sync: bool = False
    progress: bool = True
    max_minibatches: int | None = None  # per epoch, for quick runs and tests
    resume: bool = False  # continue from the newest verified checkpoint in OUT/checkpoints
    checkpoint_every: int | None = None  # also checkpoint every N minibatches inside an epoch
    failure_timeout_s: float = 10.0  # deadline of each step of the failure path (runtime/failures.py)

    def resolved_workers(self) -> int:
        return self.workers if self.workers > 0 else (os.cpu_count() or 1)


def microbatches_of(cfg: TrainConfig) -> int:
    """Microbatches per minibatch the run uses: ``--microbatches`` for the kinds that split a
    minibatch, 1 for the others."""
    return cfg.microbatches if schedule_kind(cfg.schedule).microbatched else 1


def check_options(cfg: TrainConfig) -> None:
    """TrainError for the first option that cannot work, before anything is started."""
    if cfg.schedule not in KIND_NAMES:
        raise TrainError(f"unknown schedule {cfg.schedule!r}; choose one of {', '.join(KIND_NAMES)}")
    if cfg.optimizer not in OPTIMIZERS:
        raise TrainError(f"unknown optimizer {cfg.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}")
    for name in ("epochs", "batch_size", "microbatches"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 1:
            raise TrainError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
    if cfg.checkpoint_every is not None and (not isinstance(cfg.checkpoint_every, int) or cfg.checkpoint_every < 1):
        raise TrainError(f"--checkpoint-every must be a positive number of minibatches, got {cfg.checkpoint_every!r}")
    if not (cfg.failure_timeout_s > 0 and math.isfinite(cfg.failure_timeout_s)):
        raise TrainError(f"--failure-timeout must be a positive number of seconds, got {cfg.failure_timeout_s}")
    if cfg.stages is not None and cfg.stages < 1:
        raise TrainError(f"--stages must be a positive integer, got {cfg.stages}")
    if cfg.workers < 0:
        raise TrainError(f"--workers must be >= 1 (or 0 for one per core), got {cfg.workers}")
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise TrainError(f"--lr must be a positive number, got {cfg.lr}")
    from ..models import MODELS

    if cfg.model not in MODELS and ":" not in cfg.model:
        raise TrainError(
            f"unknown model {cfg.model!r}: use one of {', '.join(MODELS)} or 'module:function' for your own "
            "(it must take (N, 1, 8, 8) digit images and return 10 logits)"
        )
    if schedule_kind(cfg.schedule).microbatched and cfg.batch_size < cfg.microbatches:
        raise TrainError(
            f"--batch-size {cfg.batch_size} cannot be split into --microbatches {cfg.microbatches}"
        )
