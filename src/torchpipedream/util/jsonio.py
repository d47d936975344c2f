"""Reading and writing the project's JSON files with errors that name the file and line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["read_json", "write_json", "excerpt"]

#: Characters of a file's text that an error message quotes at most.
EXCERPT_CHARS = 60


def excerpt(text: str, limit: int = EXCERPT_CHARS) -> str:
    """``text`` quoted for an error message, cut to its first ``limit`` characters (a line of a
    malformed file can be megabytes long): ``'[[[['… (200000 characters)``."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}… ({len(text)} characters)"


def read_json(path: str | Path, error: type[Exception]) -> Any:
    """Parse a JSON file; a missing file or invalid JSON raises ``error`` naming the file (and line)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except IsADirectoryError:
        raise error(f"{path}: is a directory, not a file") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{path}: line {exc.lineno}, column {exc.colno}: invalid JSON: {exc.msg}") from None
    except RecursionError:
        raise error(f"{path}: invalid JSON: arrays or objects nested too deeply to read") from None


def write_json(path: str | Path, data: Any) -> None:
    """Write ``data`` as indented JSON with a final newline."""
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
