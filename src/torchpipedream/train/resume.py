"""Where checkpoints go, and continuing a run from one (``--resume``, torchrun restarts)."""

from __future__ import annotations

import logging
import os
from dataclasses import asdict
from pathlib import Path

import torch

from ..plans import Plan
from .config import TrainConfig, TrainError

__all__ = ["checkpoint_dir", "resume_point", "resume_after_restart", "RESUMABLE_CHANGES"]

log = logging.getLogger(__name__)

#: Options that may change between a run and its resumption (everything else must match).
RESUMABLE_CHANGES = frozenset({"epochs", "progress", "timeout_s", "resume", "out", "failure_timeout_s"})


def checkpoint_dir(out: str | Path, epoch: int, minibatch: int = 0) -> Path:
    """Where the workers write the checkpoint taken after ``epoch`` epochs and ``minibatch``
    minibatches of the next one (``--checkpoint-every``)."""
    name = f"epoch_{epoch}" if minibatch == 0 else f"epoch_{epoch}_plus_{minibatch}_minibatches"
    return Path(out) / "checkpoints" / name


def resume_point(cfg: TrainConfig) -> tuple[str, Plan]:
    """The newest verified checkpoint in OUT/checkpoints and its plan, after checking that it
    was written by a run with the same options and has epochs left to train."""
    from ..runtime.checkpoint import CheckpointError, latest_checkpoint, read_manifest

    root = Path(cfg.out) / "checkpoints"
    found = latest_checkpoint(root)
    if found is None:
        raise TrainError(
            f"--resume: no complete checkpoint in {root} (incomplete or corrupted ones are skipped); "
            "run without --resume to start from scratch"
        )
    try:
        manifest = read_manifest(found)
        extra = torch.load(found / "extra.pt", map_location="cpu", weights_only=False)
    except (CheckpointError, OSError) as exc:
        raise TrainError(f"--resume: {exc}") from None
    saved = extra.get("config", {}) if isinstance(extra, dict) else {}
    mine = asdict(cfg)
    differ = sorted(k for k in mine if k not in RESUMABLE_CHANGES and saved.get(k) != mine[k])
    if differ:
        shown = ", ".join(f"--{k.replace('_', '-')} {saved.get(k)!r} (now {mine[k]!r})" for k in differ)
        raise TrainError(f"--resume: the checkpoint {found} was written with other options: {shown}; "
                         "resume with the same options (only --epochs, --timeout and progress may change)")
    done = int(extra.get("epoch", 0))
    if done >= cfg.epochs and not extra.get("minibatch", 0):
        raise TrainError(f"--resume: the checkpoint {found} is already at epoch {done} of --epochs {cfg.epochs}; "
                         "raise --epochs to train further")
    return str(found), Plan.from_dict(manifest["plan"], source=str(found / "manifest.json"))


def resume_after_restart(cfg: TrainConfig) -> None:
    """Under ``torchrun --max-restarts``: a restarted attempt (TORCHELASTIC_RESTART_COUNT > 0)
    continues from the newest verified checkpoint in OUT/checkpoints, as ``--resume`` would,
    when there is one (a job that failed before its first checkpoint starts over)."""
    from ..runtime.checkpoint import latest_checkpoint

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart > 0 and not cfg.resume and latest_checkpoint(Path(cfg.out) / "checkpoints") is not None:
        log.warning("restart %d: resuming from the newest checkpoint in %s", restart, Path(cfg.out) / "checkpoints")
        cfg.resume = True
