"""The docs' tables and quoted numbers are what the benchmark scripts render from the committed
results (benchmarks/doc_tables.py finds them in each script's TABLES and VALUES).

Reads files only: no benchmark runs, no torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
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
    sys.modules.setdefault("doc_tables", module)
    spec.loader.exec_module(module)  # puts benchmarks/ on sys.path and imports the scripts with tables
    return module


doc_tables = _load()
compare = importlib.import_module("compare")
held_out = importlib.import_module("held_out")
DOCS = sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"]


def test_every_marked_table_and_value_in_the_docs_matches_its_results_file() -> None:
    problems = doc_tables.check()
    assert not problems, "stale tables or values; run `python benchmarks/doc_tables.py`:\n" + "\n".join(problems)


def test_every_table_and_value_is_shown_in_some_doc() -> None:
    text = "".join(p.read_text() for p in DOCS)
    unused = [name for name in doc_tables.TABLES if f"<!-- table: {name} " not in text]
    unused += [name for name in doc_tables.VALUES if not re.search(rf"<!-- value: \S+ {re.escape(name)} -->", text)]
    assert not unused, f"tables or values no doc shows: {unused}"


def test_each_benchmark_script_owns_its_tables() -> None:
    owners = {name: sys.modules[entry.render.__module__].__file__ for name, entry in doc_tables.TABLES.items()}
    assert all(Path(f).parent == SCRIPT.parent and Path(f) != SCRIPT for f in owners.values()), owners
    assert "| --- |" not in SCRIPT.read_text()  # doc_tables.py renders no table itself


def test_a_changed_number_in_a_doc_block_is_named(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    shutil.copy(REPO / "docs" / "benchmarks.md", doc)
    text = doc.read_text()
    fresh = doc_tables.block("compare_results")
    assert fresh in text
    number = re.search(r"\| (\d+\.\d) \|", fresh).group(1)  # the first samples/s cell
    planted = fresh.replace(f"| {number} |", f"| {float(number) + 1:.1f} |", 1)
    assert planted != fresh
    doc.write_text(text.replace(fresh, planted))

    problems = doc_tables.check([doc], companions=False)
    assert len(problems) == 1 and "table 'compare_results'" in problems[0], problems

    assert doc_tables.write([doc], companions=False) == [f"{doc}: table 'compare_results' differs from compare.json"]
    assert doc.read_text() == text
    assert doc_tables.check([doc], companions=False) == []


def test_a_wrong_number_in_prose_is_caught_by_check(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    shutil.copy(REPO / "docs" / "benchmarks.md", doc)
    text = doc.read_text()
    marked = "<!-- value: memory_model.json mm_fc_heavy_within_1pct -->11 of 12<!-- /value -->"
    assert marked in text
    doc.write_text(text.replace(marked, marked.replace("11 of 12", "12 of 12")))

    problems = doc_tables.check([doc], companions=False)
    assert problems == [f"{doc}: value 'mm_fc_heavy_within_1pct' reads '12 of 12'; memory_model.json gives '11 of 12'"]
    assert doc_tables.main(["--check", str(doc)]) == 1
    doc_tables.write([doc], companions=False)
    assert doc.read_text() == text


def test_an_unmarked_number_in_prose_is_caught_by_check(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text("fc_heavy, 12 of 12 stages within 1%, measured/predicted 0.99.\n\n"
                   "`0.5` in code, a version 2.13.0, and <!-- value: memory_model.json mm_cnn_gpipe_last -->0.93"
                   "<!-- /value --> are not prose numbers.\n")
    problems = doc_tables.check([doc], companions=False)
    assert [p.split(": ", 1)[1].split(":")[0] for p in problems] == ["line 1", "line 1"], problems
    assert "'12 of 12'" in problems[0] and "'0.99'" in problems[1]
    other = tmp_path / "other.md"  # only benchmarks.md and README.md report results
    other.write_text(doc.read_text())
    assert doc_tables.check([other], companions=False) == []


def test_a_broken_block_or_value_is_reported(tmp_path: Path) -> None:
    doc = tmp_path / "x.md"
    doc.write_text("<!-- table: compare_results (generated) -->\nno end here\n")
    assert "has no" in doc_tables.check([doc], companions=False)[0]
    doc.write_text("<!-- table: no_such_table (generated) -->\n<!-- end table -->\n")
    assert "unknown table 'no_such_table'" in doc_tables.check([doc], companions=False)[0]
    doc.write_text("<!-- value: compare.json no_such_value -->1<!-- /value -->\n")
    assert "unknown value 'no_such_value'" in doc_tables.check([doc], companions=False)[0]
    doc.write_text("<!-- value: held_out.json mm_cnn_gpipe_last -->0.93<!-- /value -->\n")
    assert "cites held_out.json; it reads memory_model.json" in doc_tables.check([doc], companions=False)[0]


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


@pytest.mark.parametrize("name", sorted(doc_tables.VALUES))
def test_each_value_renders_one_line_from_its_results(name: str) -> None:
    text = doc_tables.render(name, registry=doc_tables.VALUES)
    assert text and "\n" not in text and "<" not in text


def _held_out_row(model: str, kind: str, measured: list[float], predicted: list[float]) -> dict:
    return {"model": model, "kind": kind, "plan": "straight ×2", "passes": [
        {"samples_per_s": m, "predicted_samples_per_s": p, "predicted_with_run_compute": m, "run_compute_vs_profile": 1.0,
         "slowdown": 1.0, "ratio": m / p} for m, p in zip(measured, predicted)]}


def test_held_out_targets_count_every_pass_not_medians() -> None:
    # ratios 1.0, 0.9, 1.2 | 0.6, 1.0, 1.0 | refused: 4 of 6 within ±15%, one outside ±30% (0.6)
    data = {"probes": [2.0, 2.0], "commit": "abc1234", "torch": "2.13.0",
            "args": {"procs": 2, "microbatches": 4, "passes": 3, "windows": 3, "per_window": 16},
            "rows": [_held_out_row("a", "flush", [100, 90, 120], [100, 100, 100]),
                     _held_out_row("b", "zb-h1", [60, 100, 100], [100, 100, 100]),
                     {"model": "b", "kind": "zb-v", "refused": "zb-v: shares parameters"}]}
    text = held_out.held_out_results(data)
    assert "4 of 6 (67%; target ≥ 80%: **missed**)" in text
    assert "outside ±30%: 1 (target none: **missed**)" in text
    assert "**1.20**" in text and "**0.60**" in text and "0.90," in text  # outside ±15% in bold, inside not
    assert "refused: zb-v: shares parameters" in text


def test_compare_prediction_target_counts_each_pass() -> None:
    def row(name: str, measured: list[float], predicted: list[float]) -> dict:
        return {"model": "fc_heavy", "row": name, "plan": "straight ×2", "samples_per_s": sorted(measured)[1], "vs_ddp": 1.0,
                "vs_perfect_scaling": 0.5, "vs_side_by_side_ceiling": 0.6, "passes_samples_per_s": measured,
                "passes_predicted_samples_per_s": predicted, "measured_vs_predicted": 1.0,
                "measured_vs_run_compute": 1.0}
    # the median pass is within 15% in both rows, but two passes of six are not
    ddp = {**row("torch DDP", [50, 50, 50], []), "measured_vs_predicted": None, "measured_vs_run_compute": None}
    data = {"rows": [ddp, row("torchpipedream flush", [100, 100, 70], [100, 100, 100]),
                     row("torchpipedream zb-h1", [100, 130, 100], [100, 100, 100])]}
    text = compare.compare_targets(data)
    assert "4 of 6 passes (0.70–1.30); by each row's median over passes 2 of 2" in text

    # 2bw is faster and above both targets, but it is one update stale: the synchronous target
    # takes the best plain-training row (flush and zb-h1 tie at 100 samples/s) and misses
    fast = {**row("torchpipedream 2bw", [300, 300, 300], [300, 300, 300]), "vs_ddp": 6.0, "vs_perfect_scaling": 0.9}
    data["rows"].append(fast)
    lines = compare.compare_targets(data).splitlines()
    sync = next(x for x in lines if "best synchronous" in x)
    stale = next(x for x in lines if "best one update stale" in x)
    assert "| flush (straight ×2): 1.00× DDP, 0.50 of perfect scaling | **missed**, **missed**" in sync
    assert "2bw (straight ×2): 6.00× DDP, 0.90 of perfect scaling | met, met" in stale
