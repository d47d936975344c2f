"""Command-line start-up: wall time of commands that need no torch, against the planner's own time.

Each command runs as a fresh process (``python -m torchpipedream ...``), ``--repeats`` times,
interleaved with the others so that a drift of the machine's speed hits every row alike; the
table shows the median and the range. ``plan vgg16 --topology A`` should take under 0.5 s on
the 2-core development machine, where the planner itself takes a few hundredths of that.

With ``--baseline REV`` the same commands also run from a git worktree of that revision (its
``src`` on PYTHONPATH; graph files by path, as older versions take no profile names), interleaved
with the current code, so that before and after are measured side by side in one run.

Prints a table and writes benchmarks/results/cli_startup.json.

    .venv/bin/python benchmarks/cli_startup.py [--repeats 7] [--baseline 4bc6850]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "cli_startup.json"
sys.path.insert(0, str(REPO / "src"))

from table_format import Data, Table, table  # noqa: E402

from torchpipedream.search.planner import plan  # noqa: E402
from torchpipedream.model.profiles import load_profile, reference_profile_path  # noqa: E402

VGG = str(reference_profile_path("vgg16"))
COMMANDS = {  # name -> arguments (profile names where the current code takes them)
    "plan vgg16 --topology A": (["plan", "vgg16", "--topology", "A"], ["plan", VGG, "--topology", "A"]),
    "show vgg16": (["show", "vgg16", "--limit", "5"], ["show", VGG, "--limit", "5"]),
    "--help": (["--help"], ["--help"]),
}


def timed(args: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "torchpipedream", *args], env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {proc.stderr[-2000:]}")
    return elapsed


def planner_only_s(repeats: int) -> float:
    graph = load_profile("vgg16")
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        plan(graph, "A")
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ----------------------------------------------------------------------------- what the docs show
def cli_startup(data: Data) -> str:
    """cli_startup.json (benchmarks/cli_startup.py) → wall time of each command as a fresh process."""
    head = ["command", "code", "median s", "min s", "max s"]
    body = [[f"`torchpipedream {r['command']}`", r["code"], f"{r['median_s']:.3f}", f"{r['min_s']:.3f}",
             f"{r['max_s']:.3f}"] for r in data["rows"]]
    return (table(head, body) + f"\n\n{data['repeats']} runs of each, interleaved, on {data['cpus']} CPUs; the "
            f"planner alone (in process, `plan(load_profile(\"vgg16\"), \"A\")`) {data['planner_only_s']:.3f} s. "
            f"Target: {data['target']}.")


TABLES = {"cli_startup": Table(("cli_startup.json",), cli_startup)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--baseline", default=None, help="a git revision to time side by side (e.g. 4bc6850)")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    variants = {"current": (dict(os.environ, PYTHONPATH=str(REPO / "src")), 0)}
    worktree = None
    if args.baseline:
        worktree = Path(tempfile.mkdtemp(prefix="tpd_baseline_")) / "tree"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(worktree), args.baseline],
                       check=True, capture_output=True)
        variants[f"baseline {args.baseline}"] = (dict(os.environ, PYTHONPATH=str(worktree / "src")), 1)
    samples: dict[tuple[str, str], list[float]] = {}
    try:
        for _ in range(args.repeats):
            for name, forms in COMMANDS.items():
                for variant, (env, form) in variants.items():
                    samples.setdefault((name, variant), []).append(timed(forms[form], env))
    finally:
        if worktree is not None:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(worktree)], capture_output=True)
    planner_s = planner_only_s(args.repeats)
    rows = []
    print(f"{'command':<28} {'code':<20} {'median s':>9} {'min s':>7} {'max s':>7}")
    for (name, variant), times in samples.items():
        row = {"command": name, "code": variant, "median_s": statistics.median(times), "min_s": min(times),
               "max_s": max(times), "samples_s": times}
        rows.append(row)
        print(f"{name:<28} {variant:<20} {row['median_s']:>9.3f} {row['min_s']:>7.3f} {row['max_s']:>7.3f}")
    print(f"{'planner alone (in process)':<28} {'current':<20} {planner_s:>9.3f}")
    out = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
           "repeats": args.repeats, "baseline": args.baseline, "rows": rows, "planner_only_s": planner_s,
           "target": "plan vgg16 --topology A under 0.5 s"}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
