"""Soak: 10,000 minibatches on 2 processes, memory flat after warm-up, weight versions in bounds.

For each schedule kind (pipedream, and 2bw with 2 microbatches) a fresh pair of processes
trains a small MLP (2 stages, SGD with momentum) for ``--minibatches`` minibatches, one schedule
per ``--every`` minibatches (the pipeline is full for all of them, as ``fit`` keeps it for an
epoch of that length). After each schedule every rank samples

* its resident memory, VmRSS from /proc/self/status;
* its stage's peak number of live weight versions so far
  (``WeightVersions.max_versions_alive``, the newest version plus the stashes alive at any
  optimizer step).

The version bound is the schedule's semantics as the schedule validator states them
(``validate.bounds``: pipedream keeps at most n − s versions at stage s, 0-indexed; 2bw two);
it is not computed from the runtime under test. The same batches are reused by every
schedule, so the data allocates nothing after the start: any growth is the runtime's.

Fails (exit code 1) when a rank's RSS grows by more than ``--tolerance-mib`` between the end
of warm-up (``--warmup`` minibatches) and any later sample, or when a stage ever held more
versions than its bound. Prints a table and writes benchmarks/results/soak.json.

With ``--train-minutes M`` it soaks the main job instead: ``torchpipedream train`` with its
defaults, for as many epochs as take at least M minutes (calibrated first),
sampling every 10 s the workers' resident memory, the checkpoint directories in ``--out`` and
their size. The calibration runs 2 and 12 epochs and takes the difference of their wall times
(start-up and outputs cancel). It fails unless the run ends normally (exit 0, a valid report.json) after at least
M minutes, the checkpoints stay within ``--keep-checkpoints`` + 1 and no worker's memory grows
by more than ``--tolerance-mib`` plus the run's per-epoch history after the first fifth of the
run. The history is the report's row per epoch, which the run keeps by design (and writes into
every checkpoint): 430 bytes per row (tracemalloc, 5,000 rows), allowed at ``HISTORY_ROW_BYTES``
= 1 KiB for the copy a checkpoint's ``extra`` is built from. The main job's epochs are short
(the bundled digits), so a quarter-hour soak runs thousands of them. Writes
benchmarks/results/soak_train.json.

    .venv/bin/python benchmarks/soak.py                      # ~1-2 minutes on 2 cores
    .venv/bin/python benchmarks/soak.py --train-minutes 16   # the main job for 16+ minutes
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from table_format import Data, Table, num, span, table

from torchpipedream.plans.plan import Plan
from torchpipedream.schedule.validate import bounds

RESULTS = Path(__file__).resolve().parent / "results" / "soak.json"
BATCH, FEATURES, HIDDEN, CLASSES = 32, 64, 256, 10


def vm_rss_mib() -> float:
    """Current resident set size of this process in MiB (VmRSS)."""
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def stages() -> list[torch.nn.Module]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN)),
            nn.Sequential(nn.ReLU(), nn.Linear(HIDDEN, CLASSES))]


def plan_for(kind: str, m: int) -> Plan:
    return Plan.straight([["first"], ["second"]], schedule=kind, microbatches=m)


def soak_worker(rank: int, kind: str, m: int, total: int, every: int) -> dict:
    import torch

    from torchpipedream.runtime import Pipeline

    torch.set_num_threads(1)
    plan = plan_for(kind, m)
    pipe = Pipeline(stages(), plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9),
                    loss_fn=torch.nn.CrossEntropyLoss(), microbatches=m if kind != "pipedream" else None, timeout_s=120)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(BATCH, FEATURES, generator=g), torch.randint(0, CLASSES, (BATCH,), generator=g))
               for _ in range(every)]
    start_rss = vm_rss_mib()
    samples = []
    t0 = time.perf_counter()
    for i in range(total // every):
        losses = pipe.train_minibatches(batches)
        samples.append({"minibatches": (i + 1) * every, "rss_mib": round(vm_rss_mib(), 2),
                        "max_versions_alive": pipe.weights.max_versions_alive,
                        "seconds": round(time.perf_counter() - t0, 2), "loss": sum(losses) / len(losses)})
    return {"rank": rank, "stage": pipe.stage, "start_rss_mib": round(start_rss, 2), "samples": samples}


def check(kind: str, m: int, ranks: list[dict], warmup: int, tolerance: float) -> list[str]:
    """Problems found in one kind's run (empty when it passed)."""
    problems = []
    bound = bounds(plan_for(kind, m), kind, m)
    for r in ranks:
        allowed = bound[r["stage"]][0]
        peak = max(s["max_versions_alive"] for s in r["samples"])
        r["version_bound"], r["versions_peak"] = allowed, peak
        if peak > allowed:
            problems.append(f"{kind} rank {r['rank']} (stage {r['stage']}): {peak} weight versions alive, "
                            f"the schedule allows {allowed}")
        after = [s for s in r["samples"] if s["minibatches"] >= warmup]
        base = after[0]["rss_mib"]
        growth = max(s["rss_mib"] for s in after) - base
        r["rss_after_warmup_mib"], r["rss_growth_mib"] = base, round(growth, 2)
        if growth > tolerance:
            problems.append(f"{kind} rank {r['rank']}: RSS grew {growth:.1f} MiB after warm-up "
                            f"({base:.1f} -> {max(s['rss_mib'] for s in after):.1f}), tolerance {tolerance:g} MiB")
    return problems


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        return None
    return None


def _is_worker(pid: int) -> bool:
    """A process that launch() spawned (not multiprocessing's resource tracker)."""
    try:
        return b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _du_mb(path: Path) -> float:
    """Megabytes of the files under ``path`` (files deleted while counting are skipped)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total / 1e6


def _count_dirs(path: Path) -> int:
    try:
        return sum(1 for d in os.scandir(path) if d.is_dir())
    except OSError:
        return 0


def _sample(proc: Any, run_out: Path, t0: float) -> list[dict]:
    """Every 10 s until ``proc`` ends: the workers' memory, checkpoint directories, --out's size."""
    samples = []
    while proc.poll() is None:
        time.sleep(10)
        workers = [p for p in _descendants(proc.pid) if _is_worker(p)]
        samples.append({"seconds": round(time.monotonic() - t0, 1),
                        "worker_rss_mib": {str(p): round(_rss_mib(p) or 0.0, 1) for p in workers},
                        "checkpoint_dirs": _count_dirs(run_out / "checkpoints"),
                        "out_mb": round(_du_mb(run_out), 2)})
    return samples


#: Allowed memory per epoch of a --train-minutes run: its row of the report's history (see above).
HISTORY_ROW_BYTES = 1024


def soak_train(minutes: float, out: Path, tolerance: float, keep: int) -> dict:
    """The main job for at least ``minutes``: see the module docstring."""
    import shutil
    import subprocess

    cli = [sys.executable, "-m", "torchpipedream", "train", "--no-progress"]
    shutil.rmtree(out, ignore_errors=True)
    walls = {}
    for epochs in (2, 12):  # the wall time per epoch, start-up and outputs excluded
        t0 = time.monotonic()
        calib = subprocess.run([*cli, "--epochs", str(epochs), "--out", str(out / f"calibration{epochs}")],
                               capture_output=True, text=True)
        if calib.returncode != 0:
            raise SystemExit(f"calibration run failed: {calib.stderr[-2000:]}")
        walls[epochs] = time.monotonic() - t0
    per_epoch = max((walls[12] - walls[2]) / 10, 1e-3)
    epochs = int(minutes * 60 / per_epoch * 1.6) + 2  # the machine's speed drifts: rather too long than short
    run_out = out / "run"
    t0 = time.monotonic()
    samples = []
    with open(out / "stdout.txt", "w") as so, open(out / "stderr.txt", "w") as se:
        proc = subprocess.Popen([*cli, "--epochs", str(epochs), "--keep-checkpoints", str(keep), "--out",
                                 str(run_out)], stdout=so, stderr=se, text=True)
        try:
            samples = _sample(proc, run_out, t0)
        finally:
            if proc.poll() is None:  # this script failed: do not leave the run behind
                proc.kill()
            proc.wait()
    stdout, stderr = (out / "stdout.txt").read_text(), (out / "stderr.txt").read_text()
    wall = time.monotonic() - t0
    problems = []
    if proc.returncode != 0:
        problems.append(f"the run ended with exit code {proc.returncode}: {stderr[-1500:]}")
    if wall < minutes * 60:
        problems.append(f"the run took {wall / 60:.1f} minutes, less than the {minutes:g} asked for")
    try:
        report = json.loads((run_out / "report.json").read_text(), parse_constant=float)
    except (OSError, ValueError) as exc:
        report = None
        problems.append(f"report.json: {exc}")
    most = max((s["checkpoint_dirs"] for s in samples), default=0)
    if most > keep + 1:
        problems.append(f"{most} checkpoint directories at once; --keep-checkpoints {keep} allows {keep + 1}")
    steady = [s for s in samples if s["seconds"] >= wall / 5 and len(s["worker_rss_mib"]) >= 2]
    growth = 0.0
    allowed = tolerance + epochs * HISTORY_ROW_BYTES / 2**20
    if steady:
        first = steady[0]["worker_rss_mib"]
        growth = max(max(rss - first[pid] for pid, rss in s["worker_rss_mib"].items() if pid in first)
                     for s in steady)
        if growth > allowed:
            problems.append(f"a worker's memory grew {growth:.1f} MiB after the first fifth; allowed {allowed:.1f} "
                            f"({tolerance:g} + {epochs} epochs of history at {HISTORY_ROW_BYTES} bytes)")
    return {"minutes": minutes, "epochs": epochs, "wall_s": round(wall, 1), "exit_code": proc.returncode,
            "final_test_accuracy": report and report.get("final_test_accuracy"), "max_checkpoint_dirs": most,
            "keep_checkpoints": keep, "final_out_mb": samples[-1]["out_mb"] if samples else None,
            "worker_rss_growth_mib": round(growth, 2),
            "allowed_growth_mib": round(allowed, 2), "samples": samples, "stdout_tail": stdout[-1500:],
            "passed": not problems, "problems": problems}


# ----------------------------------------------------------------------------- what the docs show
def soak_table(data: Data) -> str:
    """soak.json (benchmarks/soak.py) → memory and weight versions per rank over the soak."""
    cfg = data["config"]
    head = ["kind", "rank (stage)", "RSS at start (MiB)", "after warm-up", "lowest–highest after warm-up",
            "at the end", "largest growth after warm-up", "peak versions", "bound", "wall (s)"]
    body = []
    for kind, run in data["runs"].items():
        label = kind if run["microbatches"] == 1 else f"{kind} (m = {run['microbatches']})"
        for r in run["ranks"]:
            after = [s["rss_mib"] for s in r["samples"] if s["minibatches"] >= cfg["warmup"]]
            body.append([label, f"{r['rank']} ({r['stage']})", f"{r['start_rss_mib']:.1f}",
                         f"{r['rss_after_warmup_mib']:.1f}", span(after, ".1f"),
                         f"{r['samples'][-1]['rss_mib']:.1f}", f"{r['rss_growth_mib']:.2f}", r["versions_peak"],
                         r["version_bound"], f"{run['wall_s']:.1f}"])
    verdict = "passed" if data["passed"] else "FAILED: " + "; ".join(data["problems"])
    caption = (f"{cfg['minibatches']:,} minibatches per kind, one sample every {cfg['every']}; baseline after "
               f"{cfg['warmup']:,}; tolerance {cfg['tolerance_mib']:g} MiB; torch {data['torch']}: {verdict}.")
    return caption + "\n\n" + table(head, body)


def soak_train_table(data: Data) -> str:
    """soak_train.json (benchmarks/soak.py --train-minutes) → the main job's long run."""
    verdict = "passed" if data["passed"] else "FAILED: " + "; ".join(data["problems"])
    head = ["asked for (min)", "ran (min)", "epochs", "exit code", "most checkpoint directories at once",
            "--keep-checkpoints", "--out at the end (MB)", "worker memory growth after the first fifth (MiB)",
            "allowed (MiB)", "final test accuracy"]
    acc = data.get("final_test_accuracy")
    body = [[f"{data['minutes']:g}", f"{data['wall_s'] / 60:.1f}", data["epochs"], data["exit_code"],
             data["max_checkpoint_dirs"], data["keep_checkpoints"], num(data.get("final_out_mb"), ".1f"),
             f"{data['worker_rss_growth_mib']:.2f}", num(data.get("allowed_growth_mib"), ".1f"),
             "-" if acc is None else f"{acc:.2%}"]]
    text = f"`torchpipedream train` with its defaults, torch {data['torch']}: {verdict}.\n\n" + table(head, body)
    # Per worker: its memory at the end of the first fifth, at the end, and the largest growth.
    wall = data["wall_s"]
    steady = [s for s in data["samples"] if s["seconds"] >= wall / 5 and len(s["worker_rss_mib"]) >= 2]
    if steady:
        first = steady[0]["worker_rss_mib"]
        rows = []
        for n, pid in enumerate(first):
            series = [(s["seconds"], s["worker_rss_mib"][pid]) for s in steady if pid in s["worker_rss_mib"]]
            jump = max(((b[1] - a[1]), b[0]) for a, b in zip(series, series[1:]))
            rows.append([f"worker {n}", f"{first[pid]:.1f}", f"{series[-1][1]:.1f}",
                         f"{max(v for _, v in series) - first[pid]:.1f}", f"{jump[0]:.1f} at {jump[1] / 60:.0f} min"])
        text += "\n\n" + table(["worker", "RSS after the first fifth (MiB)", "at the end", "largest growth",
                                  "largest rise between two samples (10 s)"], rows)
    return text



# ----------------------------------------------------------------------------- numbers the docs' prose quotes
def _at_bound(d: Data) -> str:
    ranks = [r for run in d["runs"].values() for r in run["ranks"]]
    return f"{sum(r['versions_peak'] == r['version_bound'] for r in ranks)} of {len(ranks)}"


def _grown_worker(d: Data) -> list[tuple[float, float]]:
    """(seconds, MiB) of the worker whose memory grew most, after the first fifth of the run."""
    steady = [s for s in d["samples"] if s["seconds"] >= d["wall_s"] / 5 and len(s["worker_rss_mib"]) >= 2]
    series = {pid: [(s["seconds"], s["worker_rss_mib"][pid]) for s in steady if pid in s["worker_rss_mib"]]
              for pid in steady[0]["worker_rss_mib"]}
    return max(series.values(), key=lambda xs: max(v for _, v in xs) - xs[0][1])


def _lasting_step(d: Data) -> str:
    """The largest rise between two samples of that worker that its memory never fell back from."""
    xs = _grown_worker(d)
    steps = [(b[1] - a[1], b[0]) for i, (a, b) in enumerate(zip(xs, xs[1:]))
             if min(v for _, v in xs[i + 1:]) > a[1] + (b[1] - a[1]) / 2]
    rise, at = max(steps)
    return f"{rise:.1f} MiB at {at / 60:.1f} minutes"


def _levels(d: Data) -> str:
    """That worker's memory after the first fifth, and its level (the median) over the last tenth."""
    xs = _grown_worker(d)
    last = sorted(v for t, v in xs if t >= 0.9 * d["wall_s"])
    return f"{xs[0][1]:.1f} to about {last[len(last) // 2]:.1f} MiB"


VALUES = {
    "soak_at_bound": Table(("soak.json",), _at_bound),
    "soak_train_minutes": Table(("soak_train.json",), lambda d: f"{d['wall_s'] / 60:.1f}"),
    "soak_train_extra_dirs": Table(("soak_train.json",),
                                   lambda d: str(d["max_checkpoint_dirs"] - d["keep_checkpoints"])),
    "soak_train_step": Table(("soak_train.json",), _lasting_step),
    "soak_train_levels": Table(("soak_train.json",), _levels),
}

TABLES = {"soak": Table(("soak.json",), soak_table), "soak_train": Table(("soak_train.json",), soak_train_table)}


def main(argv: list[str] | None = None) -> int:
    import torch

    from torchpipedream.runtime import launch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--train-minutes", type=float, default=None,
                    help="soak the main job (torchpipedream train) for at least this many minutes instead")
    ap.add_argument("--keep-checkpoints", type=int, default=3, help="with --train-minutes")
    ap.add_argument("--minibatches", type=int, default=10_000)
    ap.add_argument("--every", type=int, default=500, help="minibatches per schedule and per sample")
    ap.add_argument("--warmup", type=int, default=1_000, help="minibatches before the memory baseline")
    ap.add_argument("--tolerance-mib", type=float, default=8.0, help="allowed RSS growth after warm-up per rank")
    ap.add_argument("--kinds", default="pipedream,2bw")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    if args.train_minutes is not None:
        out = Path(args.out if args.out != str(RESULTS) else RESULTS.with_name("soak_train.json"))
        with tempfile.TemporaryDirectory(prefix="tpd_soak_") as tmp:
            result = soak_train(args.train_minutes, Path(tmp), args.tolerance_mib, args.keep_checkpoints)
        result.update(python=platform.python_version(), torch=torch.__version__)
        print(f"main job for {result['wall_s'] / 60:.1f} minutes ({result['epochs']} epochs): exit code "
              f"{result['exit_code']}, at most {result['max_checkpoint_dirs']} checkpoint directories "
              f"(--keep-checkpoints {result['keep_checkpoints']}), {result['final_out_mb']} MB in --out at the end, "
              f"worker memory growth {result['worker_rss_growth_mib']} MiB, test accuracy "
              f"{result['final_test_accuracy']}")
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {out}")
        for p in result["problems"]:
            print("FAIL:", p)
        return 0 if result["passed"] else 1
    if args.minibatches % args.every or args.warmup >= args.minibatches:
        ap.error("--minibatches must be a multiple of --every and larger than --warmup")

    runs, problems = {}, []
    for kind in args.kinds.split(","):
        m = 2 if kind in ("2bw", "flush", "gpipe") else 1
        t0 = time.perf_counter()
        ranks = launch(soak_worker, 2, kind, m, args.minibatches, args.every, return_all=True, timeout_s=3600)
        wall = time.perf_counter() - t0
        problems += check(kind, m, ranks, args.warmup, args.tolerance_mib)
        runs[kind] = {"microbatches": m, "wall_s": round(wall, 1), "ranks": ranks}

    print(f"soak: {args.minibatches} minibatches of {BATCH} on 2 processes, RSS sampled every {args.every}; "
          f"baseline after {args.warmup}; tolerance {args.tolerance_mib:g} MiB")
    head = f"{'kind':<10} {'rank':>4} {'stage':>5} {'RSS start':>10} {'after warm-up':>14} {'end':>8} " \
           f"{'max growth':>11} {'versions':>9} {'bound':>6} {'wall s':>7}"
    print(head)
    print("-" * len(head))
    for kind, run in runs.items():
        for r in run["ranks"]:
            print(f"{kind:<10} {r['rank']:>4} {r['stage']:>5} {r['start_rss_mib']:>10.1f} "
                  f"{r['rss_after_warmup_mib']:>14.1f} {r['samples'][-1]['rss_mib']:>8.1f} "
                  f"{r['rss_growth_mib']:>11.2f} {r['versions_peak']:>9} {r['version_bound']:>6} {run['wall_s']:>7.1f}")
    for kind, run in runs.items():
        series = ", ".join(f"{s['rss_mib']:.1f}" for s in run["ranks"][0]["samples"])
        print(f"{kind} rank 0 RSS every {args.every} (MiB): {series}")
    result = {"config": vars(args), "python": platform.python_version(), "torch": torch.__version__,
              "passed": not problems, "problems": problems, "runs": runs}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    for p in problems:
        print("FAIL:", p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
