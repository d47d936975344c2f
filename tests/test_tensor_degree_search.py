"""``tensor_parallel="auto"``: the planner tries every tensor-parallel degree that makes whole
workers of the innermost level and keeps the fastest predicted (search/auto.py), for one kind
(``plan``) and for every candidate of ``schedule="auto"`` (``choose_schedule``); checked
against the planner called at each degree by hand."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from torchpipedream.cli import main
from torchpipedream.model.profiler import profile
from torchpipedream.plans.kinds import schedule_kind
from torchpipedream.plans.plan import PlanError
from torchpipedream.plans.topology import Topology
from torchpipedream.search.auto import choose_schedule, plan, tensor_degrees
from torchpipedream.search.planner import plan as plan_one_kind

FAST = "4:100GB/s~0s"  # no latency: halving a Linear pair's compute costs less than its all-reduces
SLOW = "4:10MB/s~1ms"  # every all-reduce costs far more than the compute it saves


@pytest.fixture(scope="module")
def graph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64), nn.ReLU(),
                          nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10))
    return profile(model, torch.randn(32, 64), warmup=1, iters=2)


def test_degrees_are_the_powers_of_two_that_make_whole_workers_of_the_innermost_level() -> None:
    assert tensor_degrees(Topology.parse("8x2:100GB/s,1GB/s"), schedule_kind("flush")) == [1, 2, 4, 8]
    assert tensor_degrees(Topology.parse("6:1GB/s"), schedule_kind("zb-h1")) == [1, 2]
    assert tensor_degrees(Topology.parse("1x4:1GB/s,1GB/s"), schedule_kind("gpipe")) == [1]
    assert tensor_degrees(Topology.parse("8:1GB/s"), schedule_kind("pipedream")) == [1]  # no tensor parallelism


@pytest.mark.parametrize("topology, expect_split", [(FAST, True), (SLOW, False)])
def test_one_kind_keeps_the_fastest_degree_the_planner_predicts(graph, topology: str, expect_split: bool) -> None:
    by_hand = {}
    for t in (1, 2, 4):
        try:
            by_hand[t] = plan_one_kind(graph, topology, schedule="flush", microbatches=2, tensor_parallel=t)
        except PlanError:
            pass
    best = min(by_hand, key=lambda t: (by_hand[t].predicted["time_per_minibatch_s"], t))
    got = plan(graph, topology, schedule="flush", microbatches=2, tensor_parallel="auto")
    assert got.tensor_parallel == best and (best > 1) == expect_split
    assert got.predicted["time_per_minibatch_s"] == pytest.approx(by_hand[best].predicted["time_per_minibatch_s"])
    tried = {x["tensor_parallel"]: x for x in got.meta["tensor_parallel_search"]}
    assert set(tried) == {1, 2, 4}
    for t, made in by_hand.items():
        assert tried[t]["time_per_minibatch_s"] == pytest.approx(made.predicted["time_per_minibatch_s"])


def test_auto_tries_every_degree_for_the_synchronous_kinds_only(graph) -> None:
    got = choose_schedule(graph, FAST, allow_stale=True, microbatches=(1, 2), tensor_parallel="auto",
                          virtual_stages=False)
    cands = got.meta["auto"]["candidates"]
    degrees = {(c["schedule"], c["tensor_parallel"]) for c in cands}
    assert {("flush", 1), ("flush", 2), ("flush", 4), ("gpipe", 4)} <= degrees
    assert {t for k, t in degrees if schedule_kind(k).asynchronous} == {1}
    fastest = min(c["time_per_minibatch_s"] for c in cands if c["time_per_minibatch_s"] is not None)
    assert got.meta["auto"]["chosen"]["time_per_minibatch_s"] == fastest
    assert got.tensor_parallel == got.meta["auto"]["chosen"]["tensor_parallel"]


def test_the_plan_command_takes_auto_and_a_fixed_degree_for_auto_not_for_all(graph, tmp_path: Path,
                                                                                  capsys) -> None:
    path = tmp_path / "graph.json"
    graph.save(path)
    assert main(["plan", str(path), "-t", FAST, "--schedule", "flush", "--microbatches", "2",
                 "--tensor-parallel", "auto"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallel ×1: " in out and "tensor parallel ×4: " in out and "predicted" in out
    assert main(["plan", str(path), "-t", FAST, "--schedule", "auto", "--tensor-parallel", "2"]) == 0
    assert "tensor parallel ×2" in capsys.readouterr().out  # the synchronous kinds at that degree
    assert main(["plan", str(path), "-t", FAST, "--schedule", "all", "--tensor-parallel", "2"]) == 2
    assert "or --tensor-parallel auto" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["plan", str(path), "-t", FAST, "--tensor-parallel", "0"])
    assert "expected a positive whole number or 'auto'" in capsys.readouterr().err
