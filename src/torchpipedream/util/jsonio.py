"""Reading and writing the project's JSON files with errors that name the file and line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["read_json", "write_json"]


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


def write_json(path: str | Path, data: Any) -> None:
    """Write ``data`` as indented JSON with a final newline."""
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
