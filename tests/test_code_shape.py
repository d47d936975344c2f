"""The package's code stays readable: no function longer than 80 lines, and an import inside a
function only where it keeps a heavy dependency out of a light module (and says so)."""

from __future__ import annotations

import ast
from pathlib import Path

import torchpipedream

PACKAGE = Path(torchpipedream.__file__).resolve().parent
MAX_LINES = 80


def _functions(tree: ast.AST):
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def long_functions(root: Path = PACKAGE, limit: int = MAX_LINES) -> list[str]:
    """``path:line name (N lines)`` for every function of more than ``limit`` lines."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for fn in _functions(ast.parse(path.read_text(), str(path))):
            lines = fn.end_lineno - fn.lineno + 1
            if lines > limit:
                out.append(f"{path.relative_to(root)}:{fn.lineno} {fn.name} ({lines} lines)")
    return out


def _explained(lines: list[str], index: int) -> bool:
    """A ``# lazy:`` comment on the import's line or above it, across the run of imports and
    comments that the import ends."""
    while index >= 0:
        text = lines[index].strip()
        if "# lazy:" in text:
            return True
        if not text.startswith(("import ", "from ", "#")):
            return False
        index -= 1
    return False


def unexplained_lazy_imports(root: Path = PACKAGE) -> list[str]:
    """Imports inside a function without a ``# lazy:`` comment on their line or the line above."""
    out = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().splitlines()
        for fn in _functions(ast.parse("\n".join(lines), str(path))):
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    if not _explained(lines, node.lineno - 1):
                        out.append(f"{path.relative_to(root)}:{node.lineno} {lines[node.lineno - 1].strip()}")
    return sorted(set(out))


def test_no_function_is_longer_than_80_lines() -> None:
    assert not long_functions(), "split these into named steps:\n" + "\n".join(long_functions())


def test_every_import_inside_a_function_says_why() -> None:
    bad = unexplained_lazy_imports()
    assert not bad, ("move these imports to the top of their module, or say with `# lazy: ...` which heavy "
                     "import they keep out of a light module:\n" + "\n".join(bad))


def test_the_checks_find_a_planted_long_function_and_a_silent_lazy_import(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "m.py").write_text(f"def long():\n{body}\n\n\ndef lazy():\n    import json\n    return json\n")
    assert long_functions(tmp_path) == [f"m.py:1 long ({MAX_LINES + 1} lines)"]
    assert unexplained_lazy_imports(tmp_path) == [f"m.py:{MAX_LINES + 5} import json"]
