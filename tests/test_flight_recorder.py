"""Where every rank stood when a run failed (runtime/flight_recorder.py): the ring buffer and its
report without processes, then one rank stalled on purpose under every schedule kind (2 gloo
processes, one launch: the process group is formed again between kinds) and the report of the
rank that waited for it."""

from __future__ import annotations

import datetime
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from torchpipedream.plans.kinds import KIND_NAMES
from torchpipedream.plans.plan import Plan
from torchpipedream.runtime import Pipeline, launch
from torchpipedream.runtime.flight_recorder import FlightRecorder, describe_standing, read_reports, standings_text
from torchpipedream.schedule.actions import Action, Kind


def _describe(rank: int) -> str:
    return f"rank {rank} (stage {rank})"


# ------------------------------------------------------------------------------- the record
def test_the_ring_keeps_the_newest_actions_in_order() -> None:
    rec = FlightRecorder(0, _describe, capacity=4)
    for i in range(10):
        rec.start(Action(0, Kind.FORWARD, i))
        rec.finish()
    standing = rec.standing()
    assert [e["microbatch"] for e in standing["recent"]] == [6, 7, 8, 9]
    assert standing["actions_started"] == 10 and standing["current"] is None
    assert standing["last_finished"]["action"] == "s0F9"
    assert "between actions" in describe_standing(standing)


def test_an_action_in_progress_names_its_peer_microbatch_and_wait() -> None:
    # the schedule's peer is a worker; the process it talks to is its counterpart (tensor parallelism)
    rec = FlightRecorder(2, _describe, peer_rank=lambda worker: worker * 2 + 1)
    rec.start(Action(1, Kind.FORWARD, 3))
    rec.finish()
    rec.start(Action(1, Kind.RECV_GRAD, 3, peer=2))
    time.sleep(0.05)
    standing = rec.standing()
    current = standing["current"]
    assert current["action"] == "s1RG3@2" and current["kind"] == "RECV_GRAD" and current["microbatch"] == 3
    assert current["peer"] == 5 and current["peer_is"] == "rank 5 (stage 5)"
    assert current["waited_s"] >= 0.05
    line = describe_standing(standing)
    assert line.startswith("rank 2 (stage 2) was in s1RG3@2 (the gradients of microbatch 3 from rank 5 (stage 5))")
    assert "it last finished s1F3" in line


def test_phases_are_recorded_and_an_open_one_is_named_around_the_current_action() -> None:
    rec = FlightRecorder(0, _describe, capacity=3)
    with pytest.raises(RuntimeError):
        with rec.phase("saving a checkpoint"):
            raise RuntimeError("boom")  # a failure leaves the phase open
    assert describe_standing(rec.standing()).startswith("rank 0 (stage 0) was in saving a checkpoint for")
    outer = rec.start(None, "training")
    rec.start(Action(0, Kind.SEND_ACT, 1, peer=1))
    assert describe_standing(rec.standing()).split(" for ")[0] == (
        "rank 0 (stage 0) was in s0SA1@1 (sending the activations of microbatch 1 to rank 1 (stage 1))")
    assert ", during training" in describe_standing(rec.standing())
    for i in range(5):  # the phase's entry is overwritten: finishing it changes nothing
        rec.start(Action(0, Kind.FORWARD, i))
        rec.finish()
    rec.finish(outer)
    assert rec.standing()["recent"][-1]["what"] == "s0F4"
    with pytest.raises(ValueError, match="capacity"):
        FlightRecorder(0, _describe, capacity=0)


def test_reports_are_written_read_and_silent_ranks_named(tmp_path: Path) -> None:
    rec = FlightRecorder(1, _describe)
    rec.start(Action(1, Kind.RECV_ACT, 0, peer=0))
    path = rec.write(tmp_path / "flight_record" / "rank1.json", error="PipelineFailure: x")
    data = json.loads(path.read_text())
    assert data["error"] == "PipelineFailure: x" and data["current"]["peer"] == 0
    lines = read_reports(tmp_path / "flight_record", 3)
    assert lines[0].startswith("rank 0: no report") and lines[2].startswith("rank 2: no report")
    assert lines[1].startswith("rank 1 (stage 1) was in s1RA0@0 (the activations of microbatch 0 from rank 0")
    text = standings_text({1: "rank 1 waited"}, 40, _describe, limit=2)
    assert text == ("rank 1 waited; no report yet from rank 0 (stage 0), rank 2 (stage 2) and 37 more "
                    "(still computing, hung, or dead)")
    many = standings_text({r: f"rank {r} waited" for r in range(5)}, 5, _describe, limit=2)
    assert many == "rank 0 waited; rank 1 waited; and 3 more ranks' lines (each rank's Pipeline.flight_recorder)"


# ------------------------------------------------------------------------------- a stalled rank
_STALL: dict[str, Any] = {"at": 0, "store": None, "key": ""}


class _Stall(nn.Module):
    """Blocks its ``at``-th call until the test's store holds ``key`` (set by the rank that gave up
    waiting), at most 60 s: a rank stuck in its own computation, for exactly as long as needed."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == _STALL["at"]:
            end = time.monotonic() + 60
            while time.monotonic() < end and not _STALL["store"].check([_STALL["key"]]):
                time.sleep(0.01)
        return x


def _plan(kind: str) -> tuple[int, Plan]:
    n = 4 if kind in ("interleaved", "zb-v") else 2
    groups = [[f"g{i}"] for i in range(n)]
    if kind == "interleaved":
        return n, Plan.looped(groups, 2, microbatches=4)
    if kind == "zb-v":
        return n, Plan.v_shape(groups, 2, microbatches=4)
    return n, Plan.straight(groups, schedule=kind, microbatches=1 if kind in ("pipedream", "naive") else 4)


def _stall_every_kind(rank: int, kinds: list[str]) -> dict[str, Any]:
    """Per kind: rank 1 blocks in its third forward; rank 0 gives up after 1.5 s. Each rank's error
    and flight record; the process group is formed anew for the next kind (and for launch's end)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    out: dict[str, Any] = {}
    for i, kind in enumerate(kinds + ["end"]):
        if i:
            dist.destroy_process_group()
            dist.init_process_group("gloo", store=dist.PrefixStore(f"stall/{kind}/", store), rank=rank, world_size=2,
                                    timeout=timeout)
        if kind == "end":
            break
        torch.manual_seed(0)
        n, plan = _plan(kind)
        _STALL.update(at=3 if rank == 1 else 0, store=store, key=f"gave-up/{kind}")
        pipe = Pipeline([nn.Sequential(nn.Linear(8, 8), _Stall()) for _ in range(n)], plan,
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.01), loss_fn=nn.MSELoss(),
                        timeout_s=1.5, failure_timeout_s=5.0)
        data = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(6)]
        try:
            pipe.fit(data)
            out[kind] = {"type": None}
        except Exception as exc:
            out[kind] = {"type": type(exc).__name__, "message": str(exc), "standing": pipe.flight_recorder.standing()}
        if rank == 0:
            store.set(f"gave-up/{kind}", "1")
    return out


@pytest.fixture(scope="module")
def stalled_runs() -> list[dict[str, Any]]:
    return launch(_stall_every_kind, 2, list(KIND_NAMES), return_all=True, comm_timeout_s=60, timeout_s=400)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("kind", KIND_NAMES)
def test_the_report_names_the_waiting_rank_its_action_and_the_stalled_peer(stalled_runs, kind: str) -> None:
    waiting, stalled = stalled_runs[0][kind], stalled_runs[1][kind]
    assert waiting["type"] == "PipelineFailure", waiting
    current = waiting["standing"]["current"]
    assert current is not None and current["kind"] in ("RECV_ACT", "RECV_GRAD", "SEND_ACT", "SEND_GRAD"), current
    assert current["peer"] == 1 and current["waited_s"] >= 1.4
    message = waiting["message"]
    assert "rank 1 (stage" in message and "did not respond within 1.5 s" in message
    where = message.split("Where the ranks stood: ")[1]
    assert where.startswith(f"rank 0 (stage") and f"was in {current['action']} (" in where
    assert "from rank 1 (stage" in where or "to rank 1 (stage" in where
    assert "no report yet from rank 1" in where  # it was stuck in its forward: it could not say
    # the stalled rank failed at its next wait, and its own message holds both ranks' lines
    assert stalled["type"] == "PipelineFailure", stalled
    later = stalled["message"].split("Where the ranks stood: ")[1]
    assert later.startswith("rank 0 (stage") and "; rank 1 (stage" in later
    forwards = [e for e in stalled["standing"]["recent"] if e.get("kind") == "FORWARD" and "took_s" in e]
    assert max(e["took_s"] for e in forwards) >= 1.4  # its record shows the forward it was stuck in
