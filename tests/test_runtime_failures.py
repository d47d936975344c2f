"""Failures stop every rank cleanly (gloo, 3 processes, started one by one, not by launch(),
so that survivors have to stop on their own): each survivor exits within the failure bound
with a PipelineFailure naming the rank and stage that failed first. Plus the failure board,
the fault specification and the error classification, without processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from torchpipedream.runtime.comm import CommTimeout
from fault_injection.faults import fault_environment, parse_fault
from torchpipedream.runtime.failures import FailureBoard, PipelineFailure, is_comm_failure
from torchpipedream.runtime.launcher import free_port

WORKER = Path(__file__).with_name("failure_worker.py")
BOUND_S = 5.0  # failure_timeout_s in the worker; survivors must be gone within it


def run_ranks(fault: str, *args: str, world: int = 3, lingering: int | None = None) -> dict[int, dict]:
    """Start ``world`` ranks with TORCHPIPEDREAM_FAULT=fault; return per rank its exit code,
    exit time and JSON report (None for a killed rank). A ``lingering`` rank is killed once
    the others have exited (its code stays None)."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = fault_environment(fault, dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                                            RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                                            OMP_NUM_THREADS="1"))
        env.pop("TORCHELASTIC_RESTART_COUNT", None)
        procs.append(subprocess.Popen([sys.executable, str(WORKER), *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    out: dict[int, dict] = {}
    outputs: dict[int, str] = {}
    readers = []
    for rank, p in enumerate(procs):  # drain the pipes while waiting, so no rank blocks on a full pipe
        t = threading.Thread(target=lambda r=rank, q=p: outputs.__setitem__(r, q.stdout.read()), daemon=True)
        t.start()
        readers.append(t)
    deadline = time.time() + 90
    others = world - (lingering is not None)
    while len([r for r in out if r != lingering]) < others and time.time() < deadline:
        for rank, p in enumerate(procs):
            if rank not in out and p.poll() is not None:
                out[rank] = {"code": p.returncode, "exit": time.time()}
        time.sleep(0.01)
    for p in procs:
        if p.poll() is None:
            p.kill()
    for t in readers:
        t.join(10)
    for rank in range(world):
        text = outputs.get(rank, "")
        lines = [l for l in text.splitlines() if l.startswith("REPORT ")]
        out.setdefault(rank, {"code": None, "exit": None})
        out[rank]["report"] = json.loads(lines[-1][7:]) if lines else None
        out[rank]["output"] = text[-3000:]
    return out


def check_survivors(runs: dict[int, dict], failed: int, t_fault: float, names: str) -> None:
    for rank, r in runs.items():
        if rank == failed:
            continue
        assert r["code"] is not None, f"rank {rank} did not exit:\n{r['output']}"
        assert r["report"] is not None, r["output"]
        assert r["report"]["type"] == "PipelineFailure", r["report"]
        assert names in r["report"]["message"], r["report"]["message"]
        assert r["report"]["message"].startswith(f"rank {rank} (stage {rank}) stopped")
        assert r["report"]["time"] - t_fault < BOUND_S, (rank, r["report"]["time"] - t_fault)
        assert r["exit"] - t_fault < BOUND_S, (rank, r["exit"] - t_fault)


@pytest.mark.timeout(120)
def test_an_exception_on_one_rank_stops_every_rank_naming_it():
    runs = run_ranks("rank=2,minibatch=20,mode=raise")
    failed = runs[2]["report"]
    assert failed["type"] == "RuntimeError" and "injected fault at minibatch 20" in failed["message"]
    check_survivors(runs, 2, failed["time"], "rank 2 (stage 2) failed during training: RuntimeError: injected fault")


@pytest.mark.timeout(120)
def test_a_killed_rank_stops_every_rank_naming_it():
    runs = run_ranks("rank=2,minibatch=20,mode=kill")
    assert runs[2]["code"] == -9 and runs[2]["report"] is None  # SIGKILL: no word from it
    check_survivors(runs, 2, runs[2]["exit"], "rank 2 (stage 2) died or closed its connection")


@pytest.mark.timeout(120)
def test_a_failed_rank_that_stays_alive_does_not_hold_its_peers():
    """The middle rank catches its own error and lingers for 30 s: its peers on both sides
    still stop within the bound, because it closed its connections."""
    runs = run_ranks("rank=1,minibatch=20,mode=raise", "linger", lingering=1)
    failed = runs[1]["report"]
    assert failed["type"] == "RuntimeError"
    assert runs[1]["code"] is None  # it was still alive when its peers had gone
    check_survivors(runs, 1, failed["time"], "rank 1 (stage 1) failed during training: RuntimeError: injected fault")


# ---------------------------------------------------------------------------- without processes
def test_board_reports_the_first_failure_and_nothing_when_empty():
    store = dist.HashStore()
    board = FailureBoard(store, "x/", timeout_s=2)
    assert board.first() is None
    board.post("rank 2 (stage 2) failed: A")
    board.post("rank 1 (stage 1) failed: B")
    assert board.first() == "rank 2 (stage 2) failed: A"
    assert FailureBoard(store, "y/", timeout_s=2).first() is None  # another pipeline or restart


class _HangingStore:
    def add(self, key: str, value: int) -> int:
        time.sleep(30)
        return 0


def test_board_operations_are_bounded_when_the_store_hangs():
    board = FailureBoard(_HangingStore(), "x/", timeout_s=0.3)
    t0 = time.monotonic()
    assert board.first() is None
    board.post("rank 0: gone")
    assert time.monotonic() - t0 < 2


def test_fault_spec():
    assert parse_fault("rank=1,minibatch=12") == {"rank": 1, "minibatch": 12, "mode": "kill"}
    assert parse_fault("rank=0, minibatch=3, mode=raise")["mode"] == "raise"
    assert parse_fault("rank=1,minibatch=0,mode=slow,seconds=0.2") == {"rank": 1, "minibatch": 0, "mode": "slow",
                                                                       "seconds": 0.2}
    for bad in ("rank=1", "rank=x,minibatch=2", "rank=1,minibatch=2,mode=explode", "nonsense",
                "rank=1,minibatch=0,mode=slow", "rank=1,minibatch=0,seconds=1", "rank=1,save=1,mode=slow,seconds=1"):
        with pytest.raises(ValueError, match="TORCHPIPEDREAM_FAULT"):
            parse_fault(bad)


def test_comm_failures_are_told_from_own_failures():
    assert is_comm_failure(CommTimeout("x", peer=1, closed=True))
    assert is_comm_failure(RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer"))
    assert not is_comm_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not is_comm_failure(RuntimeError("reading the data timed out"))  # the user's own failure
    assert not is_comm_failure(ValueError("bad"))
    assert not is_comm_failure(PipelineFailure("rank 2 (stage 2) failed"))
