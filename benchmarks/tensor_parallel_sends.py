"""Who sends a stage's activations to a tensor-parallel stage: each tensor rank to its counterpart,
or one send and a broadcast inside the receiving worker?

A tensor-parallel worker's t processes all hold the stage's output whole (runtime/tensor_parallel.py),
and the next worker's t processes all need it. Two ways to deliver it:

* **counterparts** (what the runtime does): tensor rank i of the sender sends to tensor rank i of
  the receiver; t transfers of the same bytes at once, each between its own pair of processes;
* **send + broadcast**: tensor rank 0 sends to tensor rank 0 of the receiver, which broadcasts to
  its t − 1 peers (a collective of the receiving worker on every cut).

Four gloo processes on this machine (t = 2: ranks 0, 1 send; 2, 3 receive), one thread each; per
message size, the two ways alternate for ``--repeats`` rounds and each round's time is from a
barrier until the last receiver holds the bytes (the slowest rank's). Median per way, and their
ratio. Between CPU probes (peers.py: a run whose probes disagree is repeated). On GPUs the
answer depends on NCCL and the links; this is the CPU runtime's.

Prints a table and writes benchmarks/results/tensor_parallel_sends.json.

    .venv/bin/python benchmarks/tensor_parallel_sends.py [--sizes 16384,262144,4194304,33554432] [--repeats 15]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from table_format import Data, Table, print_and_write, table  # noqa: E402

WAYS = ("counterparts", "send + broadcast")


def _round(way: str, rank: int, buf: Any, group: Any) -> float:
    """One delivery of ``buf`` by ``way``; this rank's seconds from the barrier to its part done."""
    import time

    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    if way == "counterparts":
        if rank < 2:
            dist.send(buf, rank + 2)
        else:
            dist.recv(buf, rank - 2)
    else:
        if rank == 0:
            dist.send(buf, 2)
        elif rank == 2:
            dist.recv(buf, 0)
        if rank >= 2:
            dist.broadcast(buf, src=2, group=group)
    return time.perf_counter() - t0


def _worker(rank: int, sizes: list[int], repeats: int) -> dict[str, dict[str, float]] | None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    receivers = dist.new_group([2, 3])
    out: dict[str, dict[str, float]] = {}
    for size in sizes:
        buf = torch.zeros(size // 4, dtype=torch.float32)
        times: dict[str, list[float]] = {way: [] for way in WAYS}
        for r in range(repeats + 2):  # two warm-up rounds
            for way in (WAYS if r % 2 == 0 else WAYS[::-1]):  # interleaved, alternating first
                mine = torch.tensor([_round(way, rank, buf, receivers if rank >= 2 else None)], dtype=torch.float64)
                dist.all_reduce(mine, op=dist.ReduceOp.MAX)  # the slowest rank's: delivery is done when all are
                if r >= 2:
                    times[way].append(float(mine.item()))
        out[str(size)] = {way: statistics.median(ts) for way, ts in times.items()}
    return out if rank == 0 else None


def render(data: Data) -> str:
    """tensor_parallel_sends.json → one row per message size: median ms per way and the ratio."""
    head = ["message", "counterparts, ms", "send + broadcast, ms", "send + broadcast / counterparts"]
    body = []
    for size, row in data["rows"].items():
        a, b = row["counterparts"] * 1e3, row["send + broadcast"] * 1e3
        body.append([_size_text(int(size)), f"{a:.3f}", f"{b:.3f}", f"{b / a:.2f}"])
    return table(head, body)


def _size_text(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


TABLES = {"tensor_parallel_sends": Table(("tensor_parallel_sends.json",), render)}


def main() -> int:
    from peers import probed

    from torchpipedream.runtime import launch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="16384,262144,4194304,33554432", help="message bytes (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=15, help="timed rounds per way and size (default: %(default)s)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "tensor_parallel_sends.json"))
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    rows, probes, agree = probed(lambda: launch(_worker, 4, sizes, args.repeats, timeout_s=600))
    data = {"machine": platform.platform(), "python": platform.python_version(), "processes": 4, "tensor_parallel": 2,
            "repeats": args.repeats, "cpu_probes": probes, "probes_agree": agree, "rows": rows}
    print_and_write(render(data), data, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
