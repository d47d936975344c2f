"""The output directory of a run (``--out``): checked before anything starts, never silently
shared by two runs, and kept to a bounded number of checkpoints.

* A path that is a file, or a directory that cannot be written, is refused at once.
* A directory that holds another run's checkpoints or outputs is refused unless the run
  continues it (``--resume``) or replaces it (``--overwrite``: its checkpoints and the files a
  run writes are deleted; other files stay).
* Temporary files that a killed writer left behind are removed at the start.
* After each checkpoint, rank 0 keeps the newest ``--keep-checkpoints`` of them and always the
  newest one taken at the end of an epoch (0 keeps every checkpoint).
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

from ..runtime.checkpoint import checkpoints_newest_first, remove_temporary_files
from .config import TrainConfig, TrainError
from .resume import is_epoch_end

__all__ = ["OUTPUT_FILES", "prepare_out_dir", "prune_checkpoints", "checkpoints_root"]

log = logging.getLogger(__name__)

#: The files a finished run writes into --out (checkpoints go to OUT/checkpoints).
OUTPUT_FILES = ("plan.json", "graph.json", "trace.json", "trace.chrome.json", "timeline.png", "checkpoint.pt",
                "report.json")


def checkpoints_root(out: str | Path) -> Path:
    return Path(out) / "checkpoints"


def _holds_a_run(out: Path) -> list[str]:
    """What in ``out`` belongs to an earlier run (empty when nothing does)."""
    found = []
    root = checkpoints_root(out)
    if root.is_dir() and any(p.is_dir() for p in root.iterdir()):
        found.append(f"checkpoints in {root}")
    found += [name for name in OUTPUT_FILES if (out / name).exists()]
    return found


def _check_writable(out: Path) -> None:
    """TrainError unless ``out`` is (or can be created as) a directory this process may write;
    nothing is created here (a run refused later leaves no trace)."""
    if out.is_dir():
        probe = out / f".write-probe-{uuid.uuid4().hex}"
        try:
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise TrainError(f"--out {out}: cannot write there: {exc.strerror or exc}") from None
        return
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise TrainError(f"--out {out}: {parent} is a file, so the directory cannot be created")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise TrainError(f"--out {out}: cannot create the directory: {parent} is not writable")


def prepare_out_dir(cfg: TrainConfig) -> None:
    """Check ``--out`` before anything starts, and clear it of leftovers (see the module docstring)."""
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise TrainError(f"--out {out}: a file of that name exists; give a directory")
    _check_writable(out)
    earlier = _holds_a_run(out)
    if earlier and not (cfg.resume or cfg.overwrite):
        raise TrainError(
            f"--out {out} holds another run ({', '.join(earlier[:3])}{' ...' if len(earlier) > 3 else ''}): "
            "continue it with --resume, replace it with --overwrite, or choose another --out")
    if cfg.overwrite and earlier:
        log.warning("--overwrite: deleting the earlier run's checkpoints and outputs in %s", out)
        shutil.rmtree(checkpoints_root(out), ignore_errors=True)
        for name in OUTPUT_FILES:
            (out / name).unlink(missing_ok=True)
    removed = remove_temporary_files(out)
    if removed:
        log.info("removed %d temporary file(s) that an interrupted run left in %s", removed, out)


def prune_checkpoints(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` checkpoints in ``root`` and the newest taken at an
    epoch's end (``keep`` 0 deletes nothing); directories without a complete manifest are left
    alone (a save in progress). Returns the deleted directories."""
    if keep <= 0:
        return []
    found = checkpoints_newest_first(root)
    kept = {m.path.parent for m in found[:keep]}
    epoch_end = next((m for m in found if is_epoch_end(m.path.parent)), None)
    if epoch_end is not None:
        kept.add(epoch_end.path.parent)
    deleted = []
    for m in found:
        d = m.path.parent
        if d not in kept and d != root:
            try:
                os.replace(d / "manifest.json", d / ".manifest.deleted")  # not a checkpoint from here on
            except OSError:
                continue
            shutil.rmtree(d, ignore_errors=True)
            deleted.append(d)
    return deleted
