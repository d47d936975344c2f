"""Run one test file many times in a row and count: does it ever flake?

Each run is a fresh ``pytest`` process with its own ``--basetemp`` under ``--keep``, so a failing
run's folders (agents' logs, checkpoints) are kept for reading; a passing run's are deleted. The
results file is rewritten after every run, so a stopped repeat still says how far it got.

Prints a table and writes benchmarks/results/test_repeats_<file stem>.json.

    .venv/bin/python benchmarks/test_repeats.py tests/test_elastic.py [--runs 50] [--keep /tmp/repeats]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from table_format import Data, Table, print_and_write, table, write_json  # noqa: E402


def render(data: Data) -> str:
    """test_repeats_*.json → one row: runs, passes, the longest streak of passes, failures."""
    runs = data["runs"]
    streak = best = 0
    for r in runs:
        streak = streak + 1 if r["passed"] else 0
        best = max(best, streak)
    seconds = sorted(r["seconds"] for r in runs) or [0.0]
    head = ["test file", "runs", "passed", "longest run of passes", "median seconds", "failed runs"]
    failed = ", ".join(str(i + 1) for i, r in enumerate(runs) if not r["passed"]) or "none"
    return table(head, [[data["file"], len(runs), sum(r["passed"] for r in runs), best,
                         f"{seconds[len(seconds) // 2]:.0f}", failed]])


TABLES = {"test_repeats_elastic": Table(("test_repeats_test_elastic.json",), render)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", help="the test file, e.g. tests/test_elastic.py")
    ap.add_argument("--runs", type=int, default=50, help="runs in a row (default: %(default)s)")
    ap.add_argument("--keep", default="/tmp/tpd_test_repeats", help="where failing runs' folders stay")
    ap.add_argument("--out", default=None, help="results file (default: benchmarks/results/test_repeats_<stem>.json)")
    args = ap.parse_args()
    stem = Path(args.file).stem
    out = args.out or str(REPO / "benchmarks" / "results" / f"test_repeats_{stem}.json")
    keep = Path(args.keep) / stem
    keep.mkdir(parents=True, exist_ok=True)  # pytest makes --basetemp, not its parents
    data: Data = {"file": args.file, "machine": platform.platform(), "python": platform.python_version(),
                  "asked_runs": args.runs, "runs": []}
    for i in range(args.runs):
        folder = keep / f"run_{i + 1}"
        shutil.rmtree(folder, ignore_errors=True)
        start = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pytest", args.file, "-p", "no:cacheprovider", "--basetemp",
                               str(folder), "-q"], cwd=REPO, capture_output=True, text=True,
                              env=dict(os.environ, OMP_NUM_THREADS="1"))
        passed = proc.returncode == 0
        run = {"passed": passed, "seconds": round(time.monotonic() - start, 1)}
        if passed:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            (folder / "pytest_output.txt").parent.mkdir(parents=True, exist_ok=True)
            (folder / "pytest_output.txt").write_text(proc.stdout + proc.stderr)
            run.update(kept=str(folder), tail=(proc.stdout + proc.stderr)[-2000:])
        data["runs"].append(run)
        print(f"run {i + 1}: {'passed' if passed else 'FAILED (kept ' + str(folder) + ')'} in {run['seconds']} s",
              flush=True)
        write_json(data, out)  # after every run: a stopped repeat still leaves its count
    print_and_write(render(data), data, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
