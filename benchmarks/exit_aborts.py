"""How often a finished run aborts at exit ("terminate called without an active exception").

The abort's cause is in src/torchpipedream/runtime/process_exit.py: a process group pinned by
torch.distributed.nn's default arguments outlives ``destroy_process_group``, and one of its gloo
threads asks for the GIL during interpreter shutdown. Three arms, run interleaved (one launch of
each in turn), each launch's exit code and stderr read:

* **torchrun example**: ``torchrun --nproc-per-node 2 examples/user_pipeline.py``, the README's
  script as it is (torchpipedream imported before ``init_process_group``);
* **launch()**: ``torchpipedream.launch`` of a 2-stage pipeline that trains, gathers its trace and
  returns (the local launcher's workers);
* **torchrun, imported late**: the same example with ``import torchpipedream`` moved below
  ``init_process_group`` (a copy in a temporary folder): the order that pins the group; the
  Pipeline warns about it, and aborts are expected here.

An abort is an exit code of -6 (SIGABRT) on any process, or a line of stderr that starts
"terminate called".
Prints a table and writes benchmarks/results/exit_aborts.json.

    .venv/bin/python benchmarks/exit_aborts.py [--runs 200] [--late-runs 100]
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from table_format import Data, Table, print_and_write, table  # noqa: E402

EXAMPLE = REPO / "examples" / "user_pipeline.py"
ARMS = ("torchrun example", "launch()", "torchrun, imported late")

_LAUNCH_SCRIPT = """
import torch
from torch import nn
import torchpipedream as tpd

def work(rank):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    plan = tpd.Plan.straight([["_0", "_1"], ["_2"]], schedule="pipedream")
    pipe = tpd.Pipeline(model, plan, optimizer=lambda p: torch.optim.Adam(p, lr=1e-3), loss_fn=nn.CrossEntropyLoss())
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(20)]
    pipe.fit(data)
    trace = pipe.trace(dst=0)
    return None if trace is None else len(trace.events)

if __name__ == "__main__":
    tpd.launch(work, 2, timeout_s=240)
"""


def _late_example(folder: Path) -> Path:
    """The example with ``import torchpipedream as tpd`` after ``init_process_group``."""
    text = EXAMPLE.read_text()
    text = text.replace("import torchpipedream as tpd\n", "", 1)
    marker = '    dist.init_process_group("gloo")'
    assert marker in text, "examples/user_pipeline.py changed: update benchmarks/exit_aborts.py"
    text = text.replace(marker, marker + "\n    global tpd\n    import torchpipedream as tpd", 1)
    path = folder / "user_pipeline_late.py"
    path.write_text(text)
    return path


def _run(cmd: list[str], cwd: Path) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO / "src"))
    start = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    aborted = (proc.returncode == -6 or "(SIGABRT)" in proc.stderr
               or any(line.startswith("terminate called") for line in proc.stderr.splitlines()))
    return {"code": proc.returncode, "aborted": aborted, "seconds": time.monotonic() - start,
            "tail": proc.stderr[-600:] if proc.returncode != 0 or aborted else ""}


def _torchrun(script: Path, cwd: Path) -> list[str]:
    from torchpipedream.runtime.launcher import free_port

    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), str(script)]


def render(data: Data) -> str:
    """exit_aborts.json → one row per arm: launches, aborts, other failures."""
    head = ["arm", "launches", "aborts at exit", "other failures", "median seconds"]
    body = []
    for arm, row in data["arms"].items():
        body.append([arm, row["launches"], row["aborts"], row["other_failures"], f"{row['median_s']:.1f}"])
    return table(head, body)


TABLES = {"exit_aborts": Table(("exit_aborts.json",), render)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200, help="launches of each fixed arm (default: %(default)s)")
    ap.add_argument("--late-runs", type=int, default=100, help="launches of the late-import arm (default: %(default)s)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "exit_aborts.json"))
    args = ap.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory(prefix="tpd_exit_") as tmp:
        folder = Path(tmp)
        late, launcher = _late_example(folder), folder / "launch_pipeline.py"
        launcher.write_text(_LAUNCH_SCRIPT)
        for i in range(max(args.runs, args.late_runs)):
            plan = [("torchrun example", _torchrun(EXAMPLE, folder), args.runs),
                    ("launch()", [sys.executable, str(launcher)], args.runs),
                    ("torchrun, imported late", _torchrun(late, folder), args.late_runs)]
            for arm, cmd, n in plan:
                if i < n:
                    runs[arm].append(_run(cmd, folder))
            if (i + 1) % 10 == 0:
                print(f"{i + 1} rounds: " + ", ".join(f"{a} {sum(r['aborted'] for r in rs)}/{len(rs)}"
                                                     for a, rs in runs.items()), flush=True)
    arms = {}
    for arm, rs in runs.items():
        seconds = sorted(r["seconds"] for r in rs)
        arms[arm] = {"launches": len(rs), "aborts": sum(r["aborted"] for r in rs),
                     "other_failures": sum(r["code"] != 0 and not r["aborted"] for r in rs),
                     "median_s": seconds[len(seconds) // 2] if seconds else 0.0,
                     "failures": [r["tail"] for r in rs if r["tail"]][:5]}
    data = {"machine": platform.platform(), "python": platform.python_version(), "arms": arms}
    print_and_write(render(data), data, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
