"""Files the commands write: checked before the work that makes them, and a failed write (a
read-only folder, a full disk, a path under a regular file) reported as one line naming the path
and the reason, never as a traceback."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

__all__ = ["OutputFileError", "check_output", "writing"]

#: Characters of a writer's own message kept in the error (torch's can run to many lines).
_REASON_CHARS = 200


class OutputFileError(ValueError):
    """An output file cannot be written; the message names the path (and its option) and why."""


def _label(path: Path, flag: str) -> str:
    return f"{flag} {path}" if flag else str(path)


def _reason(exc: BaseException) -> str:
    """The first line of why a write failed, short: "Permission denied", "No space left on device"."""
    text = getattr(exc, "strerror", None) or str(exc).strip() or type(exc).__name__
    first = text.splitlines()[0]
    return first if len(first) <= _REASON_CHARS else first[: _REASON_CHARS - 1] + "…"


def _file_in_the_way(folder: Path) -> Path | None:
    """The nearest existing ancestor of ``folder`` (itself included) when it is not a directory."""
    for candidate in (folder, *folder.parents):
        if candidate.exists():
            return None if candidate.is_dir() else candidate
    return None


def _make_folder(path: Path, label: str) -> None:
    folder = path.parent
    blocker = _file_in_the_way(folder)
    if blocker is not None:
        raise OutputFileError(f"{label}: cannot create directory {folder}: {blocker} is a file, not a directory")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputFileError(f"{label}: cannot create directory {folder} ({_reason(exc)})") from None


def check_output(path: str | Path, flag: str = "") -> Path:
    """Make sure ``path`` can be written before the work that produces it: its folder is created
    (like ``mkdir -p``) and writable, and ``path`` is not a folder or a read-only file. ``flag``
    (e.g. ``"--out"``) names the option in the error."""
    path = Path(path)
    label = _label(path, flag)
    if path.is_dir():
        raise OutputFileError(f"{label}: is a directory; give a file name")
    _make_folder(path, label)
    if not os.access(path.parent, os.W_OK | os.X_OK):
        raise OutputFileError(f"{label}: cannot write in directory {path.parent} (Permission denied)")
    if path.exists() and not os.access(path, os.W_OK):
        raise OutputFileError(f"{label}: cannot write the file (Permission denied)")
    return path


@contextmanager
def writing(path: str | Path, flag: str = "", errors: tuple[type[BaseException], ...] = ()) -> Iterator[Path]:
    """Run the writer of ``path`` inside this block; an OSError or RuntimeError from it (or one of
    ``errors``, a writer's own exception type) becomes an :class:`OutputFileError` naming the path."""
    path = Path(path)
    try:
        yield path
    except OutputFileError:
        raise
    except (OSError, RuntimeError, *errors) as exc:
        raise OutputFileError(f"{_label(path, flag)}: cannot write the file ({_reason(exc)})") from None
