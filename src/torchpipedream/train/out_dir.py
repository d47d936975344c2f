"""The output directory of a run (``--out``): checked before anything starts, never silently
shared by two runs, and kept to a bounded number of checkpoints.

* A path that is a file, or a directory that cannot be written, is refused at once.
* A directory that holds another run's checkpoints or outputs is refused unless the run
  continues it (``--resume``) or replaces it (``--overwrite``: its checkpoints and the files a
  run writes are deleted; other files stay). This run's own inputs are never deleted: a
  ``--plan`` or ``--init`` among the earlier run's outputs (``--plan OUT/plan.json``, the way
  to reproduce a run) is kept until the new run writes its own, and one inside
  OUT/checkpoints, which is deleted as a whole, is refused before anything is deleted.
* One run at a time: a run locks ``--out`` for its lifetime (``lock_out_dir``: an exclusive
  ``flock`` on OUT/.torchpipedream.lock, released by the kernel when the process ends), and a
  second run on the same ``--out`` is refused, naming the first one's process.
* Temporary files that a killed writer left behind are removed at the start.
* After each checkpoint, rank 0 keeps the newest ``--keep-checkpoints`` of them and always the
  newest one taken at the end of an epoch (0 keeps every checkpoint).
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import uuid
from pathlib import Path

from ..runtime.checkpoint import checkpoints_newest_first, remove_temporary_files
from .config import TrainConfig, TrainError, flag
from .resume import is_epoch_end

__all__ = ["OUTPUT_FILES", "LOCK_FILE", "OutDirLock", "check_out_dir", "clear_out_dir", "flight_record_dir",
           "lock_out_dir", "prepare_out_dir", "prune_checkpoints", "checkpoints_root"]

log = logging.getLogger(__name__)

#: The files a finished run writes into --out (checkpoints go to OUT/checkpoints).
OUTPUT_FILES = ("plan.json", "graph.json", "trace.json", "trace.chrome.json", "timeline.png", "checkpoint.pt",
                "report.json")
#: The lock file in --out that holds the running run's pid (``lock_out_dir``).
LOCK_FILE = ".torchpipedream.lock"


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
        _probe(out, f"--out {out}: cannot write there")
        root = checkpoints_root(out)  # found now, not when the first epoch's checkpoint is written
        if root.exists() and not root.is_dir():
            raise TrainError(f"--out {out}: {root} is a file, and the run writes its checkpoints into that directory")
        if root.is_dir():
            _probe(root, f"--out {out}: cannot write checkpoints into {root}")
        return
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise TrainError(f"--out {out}: {parent} is a file, so the directory cannot be created")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise TrainError(f"--out {out}: cannot create the directory: {parent} is not writable")


def _probe(folder: Path, error: str) -> None:
    """TrainError (``error``: the reason) unless a file can be created and removed in ``folder``."""
    probe = folder / f".write-probe-{uuid.uuid4().hex}"
    try:
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise TrainError(f"{error}: {exc.strerror or exc}") from None


def _inputs_to_keep(cfg: TrainConfig, out: Path) -> set[str]:
    """The names among OUTPUT_FILES that are this run's ``--plan`` or ``--init`` (``--overwrite``
    keeps them: the run reads them); TrainError for an input inside OUT/checkpoints, which
    ``--overwrite`` deletes as a whole."""
    kept = set()
    root = checkpoints_root(out).resolve()
    for name, value in (("plan_file", cfg.plan_file), ("init", cfg.init)):
        if not value:
            continue
        path = Path(value).resolve()
        if path.is_relative_to(root):
            raise TrainError(f"{flag(name)} {value} is inside {checkpoints_root(out)}, which --overwrite deletes: "
                             "copy it out of --out first, or choose another --out")
        if path.parent == out.resolve() and path.name in OUTPUT_FILES:
            log.info("--overwrite keeps %s %s (this run reads it) until the run writes its own", flag(name), value)
            kept.add(path.name)
    return kept


def _check_path(out: Path) -> None:
    """TrainError when ``out`` is a file or cannot be written (nothing is created)."""
    if out.exists() and not out.is_dir():
        raise TrainError(f"--out {out}: a file of that name exists; give a directory")
    _check_writable(out)


def check_out_dir(cfg: TrainConfig) -> None:
    """TrainError when ``--out`` cannot take this run (see the module docstring); deletes nothing."""
    out = Path(cfg.out)
    _check_path(out)
    earlier = _holds_a_run(out)
    if earlier and not (cfg.resume or cfg.overwrite):
        raise TrainError(
            f"--out {out} holds another run ({', '.join(earlier[:3])}{' ...' if len(earlier) > 3 else ''}): "
            "continue it with --resume, replace it with --overwrite, or choose another --out")
    if cfg.overwrite and earlier:
        _inputs_to_keep(cfg, out)


def flight_record_dir(out: str | Path) -> Path:
    """Where the ranks of a failed run write where they stood (runtime/flight_recorder.py)."""
    return Path(out) / "flight_record"


def clear_out_dir(cfg: TrainConfig) -> None:
    """With ``--overwrite``, delete the earlier run in ``--out`` (but this run's inputs); remove
    temporary files an interrupted run left. Called once the run has read its inputs."""
    out = Path(cfg.out)
    if cfg.overwrite and _holds_a_run(out):
        kept = _inputs_to_keep(cfg, out)
        log.warning("--overwrite: deleting the earlier run's checkpoints and outputs in %s", out)
        shutil.rmtree(checkpoints_root(out), ignore_errors=True)
        for name in OUTPUT_FILES:
            if name not in kept:
                (out / name).unlink(missing_ok=True)
    if flight_record_dir(out).exists():  # an earlier attempt's failure report: this run writes its own
        shutil.rmtree(flight_record_dir(out), ignore_errors=True)
    removed = remove_temporary_files(out)
    if removed:
        log.info("removed %d temporary file(s) that an interrupted run left in %s", removed, out)


def prepare_out_dir(cfg: TrainConfig) -> None:
    """:func:`check_out_dir`, then :func:`clear_out_dir`."""
    check_out_dir(cfg)
    clear_out_dir(cfg)


class OutDirLock:
    """``--out`` held by this process for one run (an exclusive ``flock`` on OUT/.torchpipedream.lock,
    which holds the pid); the kernel releases it when the process ends, however it ends."""

    def __init__(self, out: Path, fd: int, created: bool) -> None:
        self.out, self._fd, self._created = out, fd, created

    def release(self) -> None:
        """Release the lock; a directory that only the lock made is removed again."""
        if self._fd is None:
            return
        try:
            if self._created and [p.name for p in self.out.iterdir()] == [LOCK_FILE]:
                (self.out / LOCK_FILE).unlink()
                self.out.rmdir()
        except OSError:
            pass
        os.close(self._fd)  # releases the flock
        self._fd = None

    def __enter__(self) -> "OutDirLock":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _holder(fd: int) -> str:
    """The pid that the holder of a lock file wrote into it ("unknown" if none yet)."""
    try:
        text = os.pread(fd, 64, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    return text if text.isdigit() else "unknown"


def lock_out_dir(out_arg: str | Path) -> OutDirLock:
    """Lock ``--out`` for this run's lifetime (creating the directory); TrainError naming the
    other run's process when one holds it."""
    out = Path(out_arg)
    _check_path(out)
    created = not out.exists()
    path = out / LOCK_FILE
    while True:
        try:
            out.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise TrainError(f"--out {out}: cannot create the lock file {path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise TrainError(f"--out {out} is in use by another run (process {holder}): wait for it to end, "
                             "or choose another --out") from None
        if path.exists() and os.stat(path).st_ino == os.fstat(fd).st_ino:
            break
        os.close(fd)  # the holder removed the file as it released it: lock the new one
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return OutDirLock(out, fd, created)


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
