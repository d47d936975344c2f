"""The docs' tables of numbers are what benchmarks/doc_tables.py renders from the committed results.

Reads files only: no benchmark runs, no torch.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "doc_tables.py"


def _load():
    spec = importlib.util.spec_from_file_location("doc_tables", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("doc_tables", module)  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


doc_tables = _load()


def test_every_marked_table_in_the_docs_matches_its_results_file() -> None:
    problems = doc_tables.check()
    assert not problems, "stale tables; run `python benchmarks/doc_tables.py`:\n" + "\n".join(problems)


def test_every_table_is_shown_in_some_doc() -> None:
    text = "".join(p.read_text() for p in (REPO / "docs").glob("*.md"))
    unused = [name for name in doc_tables.TABLES if f"<!-- table: {name} " not in text]
    assert not unused, f"tables no doc shows: {unused}"


def test_a_changed_number_in_a_doc_block_is_named(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    shutil.copy(REPO / "docs" / "benchmarks.md", doc)
    text = doc.read_text()
    fresh = doc_tables.block("compare_results")
    assert fresh in text
    planted = fresh.replace("| 447.3 |", "| 474.3 |", 1)
    assert planted != fresh
    doc.write_text(text.replace(fresh, planted))

    problems = doc_tables.check([doc], companions=False)
    assert len(problems) == 1 and "'compare_results'" in problems[0], problems

    assert doc_tables.write([doc], companions=False) == [f"{doc}: compare_results"]
    assert doc.read_text() == text
    assert doc_tables.check([doc], companions=False) == []


def test_a_block_without_its_end_or_of_an_unknown_table_is_reported(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("<!-- table: compare_results (generated) -->\nno end here\n")
    assert "has no" in doc_tables.check([doc], companions=False)[0]
    doc.write_text("<!-- table: no_such_table (generated) -->\n<!-- end table -->\n")
    assert "unknown table 'no_such_table'" in doc_tables.check([doc], companions=False)[0]


def test_the_command_line_check_imports_no_torch() -> None:
    code = ("import runpy, sys\n"
            f"sys.argv = [{str(SCRIPT)!r}, '--check']\n"
            "try:\n"
            f"    runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n"
            "except SystemExit as exc:\n"
            "    print('exit', exc.code)\n"
            "print('TORCH' if 'torch' in sys.modules else 'NO TORCH')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert "exit 0" in result.stdout and result.stdout.strip().endswith("NO TORCH"), result.stdout


@pytest.mark.parametrize("name", sorted(doc_tables.TABLES))
def test_each_table_renders_from_its_results(name: str) -> None:
    text = doc_tables.render(name)
    assert "| --- |" in text
