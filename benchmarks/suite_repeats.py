"""Run CI (``bash .ci/run``) from fresh clones of one commit, several times in a row: is the
whole suite green every time, and how long does CI take?

Each run clones the repository at ``--commit`` (default: HEAD) into a new folder, so it sets
up its own ``.venv`` as CI's clean clone does, and runs ``.ci/run`` unchanged; pytest's junit
report (asked for through ``PYTEST_ADDOPTS``, which changes no test) gives each test file's
seconds and the failed tests' names. A failing run's clone and output are kept under
``--keep``; a passing run's clone is deleted. The results file is rewritten after every run.

Prints a table and writes benchmarks/results/suite_repeats.json.

    .venv/bin/python benchmarks/suite_repeats.py [--runs 5] [--commit HEAD] [--keep /tmp/tpd_suite_repeats]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

from table_format import Data, Table, print_and_write, table, write_json

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "suite_repeats.json"


def junit_summary(path: Path) -> dict:
    """Counts, failed test ids and seconds per test file from pytest's junit XML report."""
    root = ET.parse(path).getroot()
    per_file: dict[str, float] = defaultdict(float)
    failed: list[str] = []
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for case in root.iter("testcase"):
        counts["tests"] += 1
        module = case.get("classname", "").split(".")[-1] or "?"
        per_file[f"tests/{module}.py"] += float(case.get("time", 0.0))
        for outcome, key in (("failure", "failures"), ("error", "errors"), ("skipped", "skipped")):
            if case.find(outcome) is not None:
                counts[key] += 1
                if outcome != "skipped":
                    failed.append(f"{case.get('classname')}::{case.get('name')}")
    return {**counts, "failed": failed,
            "seconds_per_file": {f: round(s, 1) for f, s in sorted(per_file.items(), key=lambda kv: -kv[1])}}


def one_run(commit: str, folder: Path) -> dict:
    """Clone ``commit`` into ``folder`` and run its .ci/run; the run's record."""
    shutil.rmtree(folder, ignore_errors=True)
    subprocess.run(["git", "clone", "-q", str(REPO), str(folder)], check=True)
    subprocess.run(["git", "-C", str(folder), "checkout", "-q", commit], check=True)
    report = folder / "junit.xml"
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PYTEST_ADDOPTS"] = f"--junitxml={report} -p no:cacheprovider"
    start = time.monotonic()
    proc = subprocess.run(["bash", ".ci/run"], cwd=folder, capture_output=True, text=True, env=env)
    run: dict = {"commit": commit, "exit_code": proc.returncode, "passed": proc.returncode == 0,
                 "ci_seconds": round(time.monotonic() - start, 1)}
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    run["pytest_summary"] = lines[-1].strip("= ") if lines else ""
    if "warnings summary" in proc.stdout:  # what the suite warned about, for the next reader
        run["warnings"] = proc.stdout.split("warnings summary", 1)[1][:4000]
    if report.is_file():
        run.update(junit_summary(report))
    return run


def render(data: Data) -> str:
    """suite_repeats.json → one row per run."""
    head = ["run", "commit", "result", "tests", "failed", "CI minutes (set-up and tests)"]
    rows = [[i + 1, r["commit"][:10], "green" if r["passed"] else "FAILED", r.get("tests", "-"),
             ", ".join(r.get("failed", [])) or ("-" if r["passed"] else f"exit {r['exit_code']}"),
             f"{r['ci_seconds'] / 60:.1f}"] for i, r in enumerate(data["runs"])]
    return table(head, rows)


def render_slowest(data: Data, count: int = 12) -> str:
    """suite_repeats.json → the slowest test files, by their median seconds over the runs."""
    seconds: dict[str, list[float]] = defaultdict(list)
    for r in data["runs"]:
        for name, s in r.get("seconds_per_file", {}).items():
            seconds[name].append(s)
    medians = sorted(((statistics.median(v), k) for k, v in seconds.items()), reverse=True)
    total = sum(m for m, _ in medians) or 1.0
    rows = [[name, f"{m:.0f}", f"{100 * m / total:.0f}%"] for m, name in medians[:count]]
    rows.append([f"the other {max(0, len(medians) - count)} files", f"{sum(m for m, _ in medians[count:]):.0f}",
                 f"{100 * sum(m for m, _ in medians[count:]) / total:.0f}%"])
    return table(["test file", "median seconds", "share of the tests' time"], rows)


TABLES = {"suite_repeats": Table(("suite_repeats.json",), render),
          "suite_slowest_files": Table(("suite_repeats.json",), render_slowest)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5, help="fresh-clone CI runs in a row (default: %(default)s)")
    ap.add_argument("--commit", default="HEAD", help="the commit every run clones (default: HEAD)")
    ap.add_argument("--keep", default="/tmp/tpd_suite_repeats", help="where failing runs' clones stay")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", args.commit], check=True, capture_output=True,
                            text=True).stdout.strip()
    data: Data = {"commit": commit, "machine": platform.platform(), "cpus": os.cpu_count(),
                  "python": platform.python_version(), "asked_runs": args.runs, "runs": []}
    for i in range(args.runs):
        folder = Path(args.keep) / f"run_{i + 1}"
        run = one_run(commit, folder)
        data["runs"].append(run)
        if run["passed"]:
            shutil.rmtree(folder, ignore_errors=True)
        else:
            run["kept"] = str(folder)
        print(f"run {i + 1}: {'green' if run['passed'] else 'FAILED ' + str(run.get('failed'))} in "
              f"{run['ci_seconds'] / 60:.1f} min ({run['pytest_summary']})", flush=True)
        write_json(data, args.out)  # after every run: a stopped repeat still leaves its count
    print_and_write(render(data), data, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
