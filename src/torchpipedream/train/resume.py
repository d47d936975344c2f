"""Where checkpoints go, and continuing a run from one (``--resume``, torchrun restarts)."""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..plans.plan import Plan, PlanError
from ..runtime.checkpoint import (CheckpointError, checkpoints_newest_first, latest_checkpoint, read_extra,
                                  verify_checkpoint)
from .config import TrainConfig, TrainError, flag

__all__ = ["checkpoint_dir", "is_epoch_end", "ResumePoint", "resume_point", "resume_after_restart",
           "RESUMABLE_CHANGES", "PLAN_OPTIONS", "plan_side_text"]

log = logging.getLogger(__name__)

#: Options that shape the plan: a resumption with other values plans anew and loads the
#: checkpoint onto the new plan (checkpoints are keyed by the model's names, runtime/checkpoint.py).
PLAN_OPTIONS = frozenset({"workers", "schedule", "microbatches", "stages", "straight", "topology", "vertical_sync",
                          "plan_file", "recompute", "memory", "shard",
                          "tensor_parallel"})
#: Options that may change between a run and its resumption (everything else must match).
RESUMABLE_CHANGES = frozenset({"epochs", "progress", "timeout_s", "startup_timeout_s", "resume", "out",
                               "failure_timeout_s", "keep_checkpoints", "overwrite", "init", "measure_memory"}) | PLAN_OPTIONS  # a checkpoint wins over --init


def plan_side_text(change: dict[str, Any], side: str) -> str:
    """One side of a recorded plan change as text: its name, replica configuration and layers
    per stage (two plans of one name and configuration differ in where they cut)."""
    layers = "|".join(str(len(st)) for st in change.get(f"{side}_stages", []))
    return f"{change[side]} ({change[side + '_config']}{'; layers per stage ' + layers if layers else ''})"


def checkpoint_dir(out: str | Path, epoch: int, minibatch: int = 0) -> Path:
    """Where the workers write the checkpoint taken after ``epoch`` epochs and ``minibatch``
    minibatches of the next one (``--checkpoint-every``)."""
    name = f"epoch_{epoch}" if minibatch == 0 else f"epoch_{epoch}_plus_{minibatch}_minibatches"
    return Path(out) / "checkpoints" / name


def is_epoch_end(directory: Path) -> bool:
    """Whether ``directory`` (named by :func:`checkpoint_dir`) holds a checkpoint taken at the
    end of an epoch."""
    return directory.name.startswith("epoch_") and "_plus_" not in directory.name


@dataclass
class ResumePoint:
    """The checkpoint a run continues from: where, its plan, what the run saved with it, and
    whether the run it belongs to had already finished (then only the outputs are rewritten)."""

    directory: Path
    plan: Plan
    extra: dict[str, Any]
    complete: bool
    replan: list[str] = field(default_factory=list)  # the plan's options that changed, as text


def _differences(cfg: TrainConfig, saved: dict[str, Any], among: frozenset[str] | None = None) -> list[str]:
    """The options that differ from the saved run's, as text: those that may not change, or
    those ``among`` the given ones."""
    mine = asdict(cfg)
    # an option newer than the checkpoint was not recorded: that run had its default
    defaults = asdict(TrainConfig())
    fixed = RESUMABLE_CHANGES
    if among is None and mine.get("lr_schedule", "constant") != "constant":
        fixed = fixed - {"epochs"}  # a decaying learning rate ends at the run's last update: its length is fixed
    keys = [k for k in mine if (k in among if among is not None else k not in fixed)]
    return [f"{flag(k)} {saved.get(k, defaults[k])!r} (now {mine[k]!r})" for k in sorted(keys)
            if saved.get(k, defaults[k]) != mine[k]]


def resume_point(cfg: TrainConfig) -> ResumePoint:
    """The newest verified checkpoint in OUT/checkpoints written by a run with the same options
    (checkpoints of other options are skipped, with a warning saying which option differs)."""
    root = Path(cfg.out) / "checkpoints"
    rejected: list[str] = []
    given = Plan.load(cfg.plan_file) if cfg.plan_file else None
    for manifest in checkpoints_newest_first(root):
        found = manifest.path.parent
        try:
            verify_checkpoint(found, load=True)  # every file read as plain data: no code runs
            extra = read_extra(found, manifest)
            plan = Plan.from_dict(manifest.plan, source=str(manifest.path))
        except (CheckpointError, PlanError) as exc:
            log.warning("skipping checkpoint %s: %s", found, exc)
            rejected.append(f"{found.name}: {exc}")
            continue
        saved = extra.get("config") if isinstance(extra.get("config"), dict) else {}
        differ = _differences(cfg, saved)
        if differ:
            log.warning("skipping checkpoint %s: written with other options: %s", found, ", ".join(differ))
            rejected.append(f"{found.name} was written with other options: {', '.join(differ)}")
            continue
        replan = _differences(cfg, saved, PLAN_OPTIONS - {"plan_file"})
        if given is not None and not given.same_layout(plan):
            replan.append(f"--plan {cfg.plan_file} (another plan than the checkpoint's)")
        done = int(extra.get("epoch", 0)) >= cfg.epochs and not extra.get("minibatch", 0)
        return ResumePoint(found, plan, extra, complete=done, replan=replan)
    if rejected:
        raise TrainError(f"--resume: no checkpoint in {root} fits this run; "
                         + "; ".join(rejected[:3]) + ("; ..." if len(rejected) > 3 else "")
                         + ". Resume with the options of the run that wrote them (the plan's options, --epochs, "
                         "--timeout, --startup-timeout, --failure-timeout, --keep-checkpoints and --no-progress "
                         "may change)")
    raise TrainError(
        f"--resume: no complete checkpoint in {root} (incomplete or corrupted ones are skipped); "
        "run without --resume to start from scratch"
    )


def resume_after_restart(cfg: TrainConfig) -> None:
    """Under ``torchrun --max-restarts``: a restarted attempt (TORCHELASTIC_RESTART_COUNT > 0)
    continues from the newest verified checkpoint in OUT/checkpoints, as ``--resume`` would,
    when there is one (a job that failed before its first checkpoint starts over)."""
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart > 0 and not cfg.resume and latest_checkpoint(Path(cfg.out) / "checkpoints") is not None:
        log.warning("restart %d: resuming from the newest checkpoint in %s", restart, Path(cfg.out) / "checkpoints")
        cfg.resume = True
