"""``schedule="auto"``: the planner chooses the kind and microbatch count by simulation."""

from __future__ import annotations

import dataclasses

import json
from pathlib import Path

import pytest

import torchpipedream as tpd
from torchpipedream.search.auto import (auto_summary, candidate_kinds, choose_layout, choose_schedule, local_layouts,
                                          threads_per_worker)
from torchpipedream.plans.kinds import schedule_kind
from torchpipedream.search.planner import plan as make_plan
from torchpipedream.plans.plan import PlanError
from torchpipedream.model.profiles import load_profile
from torchpipedream.schedule.build import build_schedule
from torchpipedream.sim.simulator import Costs, simulate

TOPOLOGY = "4:10GB/s"


@pytest.fixture(scope="module")
def vgg16():
    return load_profile("vgg16")


def _grid_times(graph, kinds, counts=(1, 2, 4, 8), minibatches=32, **options) -> dict[tuple[str, int], float]:
    """Every (kind, microbatches) planned and simulated one by one, as a user would by hand."""
    out = {}
    for kind in kinds:
        for m in counts if schedule_kind(kind).microbatched else [1]:
            try:
                p = make_plan(graph, TOPOLOGY, schedule=kind, microbatches=m, **options)
            except PlanError:
                continue
            sim = simulate(build_schedule(p, kind, minibatches=minibatches, microbatches=m),
                           Costs.from_plan(p, microbatches=m))
            out[(kind, m)] = sim.makespan_s / minibatches
    return out


def test_auto_picks_the_fastest_synchronous_kind_of_the_grid(vgg16) -> None:
    chosen = choose_schedule(vgg16, TOPOLOGY)
    # the reference profile has no split backward timed: no zero-bubble kind is tried
    grid = _grid_times(vgg16, ["flush", "gpipe", "interleaved"])
    best = min(grid.values())
    assert chosen.schedule in ("flush", "gpipe", "interleaved")
    assert grid[(chosen.schedule, chosen.microbatches)] == pytest.approx(best, rel=1e-12)
    auto = chosen.meta["auto"]
    assert auto["chosen"]["time_per_minibatch_s"] == pytest.approx(best, rel=1e-12)
    assert len([c for c in auto["candidates"] if not c["error"]]) == len(grid)
    assert auto["runner_up"]["time_per_minibatch_s"] >= best
    lines = auto_summary(chosen)
    assert lines[0].startswith(f"chosen {chosen.schedule}") and lines[1].startswith("runner-up")


def test_stale_kinds_only_when_allowed(vgg16) -> None:
    assert candidate_kinds(False) == ["flush", "gpipe", "zb-h1", "zb-h2", "interleaved", "zb-v"]
    assert candidate_kinds(True) == ["pipedream", "2bw", "flush", "gpipe", "zb-h1", "zb-h2", "interleaved", "zb-v",
                                     "zb-2bw"]  # never naive
    assert candidate_kinds(True, split_profiled=False) == ["pipedream", "2bw", "flush", "gpipe", "interleaved"]
    stale = choose_schedule(vgg16, TOPOLOGY, allow_stale=True)
    grid = _grid_times(vgg16, candidate_kinds(True, split_profiled=False))
    assert grid[(stale.schedule, stale.microbatches)] == pytest.approx(min(grid.values()), rel=1e-12)
    # On vgg16 over 4 workers weight stashing wins by far; without leave it is never chosen.
    assert stale.schedule == "pipedream"
    assert tpd.plan(vgg16, TOPOLOGY, schedule="auto").schedule in ("flush", "gpipe", "interleaved")
    with pytest.raises(PlanError, match="torchpipedream.plan"):
        make_plan(vgg16, TOPOLOGY, schedule="auto")  # the planner plans one kind
    with pytest.raises(PlanError, match="naive"):
        choose_schedule(vgg16, TOPOLOGY, kinds=["flush", "naive"])
    with pytest.raises(PlanError, match="allow_stale lets schedule='auto'"):
        tpd.plan(vgg16, TOPOLOGY, schedule="flush", allow_stale=True)


def test_a_memory_budget_moves_the_choice_and_nothing_fitting_names_every_reason(vgg16) -> None:
    free = choose_schedule(vgg16, TOPOLOGY)
    peak = free.meta["auto"]["chosen"]["peak_memory_bytes"]
    # A budget under the free choice's peak: whatever is chosen now fits the planner's memory model.
    budget = int(peak * 0.99)
    tight = choose_schedule(vgg16, TOPOLOGY, memory_bytes=budget)
    assert tight.predicted["peak_memory_bytes"] <= budget
    # the choice moved: another kind, microbatch count or layout, or the same with its replicas sharded
    def choice(p):
        return p.schedule, p.microbatches, p.config, p.meta["auto"]["chosen"]["sharding"]
    assert choice(tight) != choice(free)
    # sharded where needed, the fastest way that fits: no faster way fits the budget
    fastest_first = ["replicate", "zero1", "zero2", "zero3"]
    for s, st in enumerate(tight.stages):
        for faster in fastest_first[:fastest_first.index(st.sharding)] if st.replicas > 1 else []:
            other = dataclasses.replace(tight, stages=[dataclasses.replace(x, sharding=faster) if k == s else x
                                                       for k, x in enumerate(tight.stages)])
            assert other.stage_memory_bytes(s) > budget, (s, st.sharding, faster)
    assert choice(free)[3] == "replicate"
    with pytest.raises(PlanError) as err:
        choose_schedule(vgg16, TOPOLOGY, memory_bytes=10_000)
    text = str(err.value)
    assert "no schedule fits" in text and "flush, 4 microbatches:" in text and "gpipe:" in text


def test_microbatch_counts_above_the_batch_are_skipped(vgg16) -> None:
    p = choose_schedule(vgg16, TOPOLOGY, batch_size=2)
    assert {c["microbatches"] for c in p.meta["auto"]["candidates"]} == {1, 2}


def test_plan_command_prints_every_candidate(tmp_path: Path, capsys) -> None:
    from torchpipedream.cli import main

    out = tmp_path / "auto.json"
    assert main(["plan", "vgg16", "-t", TOPOLOGY, "--schedule", "auto", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "schedule auto: chosen" in text and "runner-up" in text and text.count("\nflush ") == 4
    saved = json.loads(out.read_text())
    assert saved["schedule"] in ("flush", "gpipe") and saved["meta"]["auto"]["chosen"]["schedule"] == saved["schedule"]
    assert main(["plan", "vgg16", "-t", TOPOLOGY, "--schedule", "flush", "--allow-stale"]) == 2


def test_train_schedule_auto_trains_with_the_chosen_kind(tmp_path: Path, capsys) -> None:
    from torchpipedream.cli import main

    out = tmp_path / "auto"
    assert main(["train", "--model", "mlp", "--workers", "2", "--no-progress", "--epochs", "1",
                 "--max-minibatches", "6", "--timeout", "60", "--schedule", "auto", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    chosen = report["auto"]["chosen"]
    assert report["config"]["schedule"] == "auto"
    # synchronous; the kinds with virtual stages among the candidates (train checkpoints them too)
    assert report["schedule"] == chosen["schedule"]
    assert report["schedule"] in ("flush", "gpipe", "zb-h1", "zb-h2", "interleaved", "zb-v")
    assert {"interleaved", "zb-v"} <= {c["schedule"] for c in report["auto"]["candidates"]}
    assert report["microbatches"] == chosen["microbatches"]
    console = capsys.readouterr().out
    assert f"schedule {report['schedule']}" in console and "auto           chosen" in console
    trace = json.loads((out / "trace.json").read_text())
    assert trace  # it trained with that schedule: the measured trace exists
    # on local cores it also tried one worker with two threads, and the workers ran as chosen
    assert {(x["workers"], x["threads"]) for x in report["auto"]["layouts"]} == {(2, 1), (1, 2)}
    assert report["threads_per_worker"] == chosen["threads"]
    assert len(report["memory"]) == len(json.loads((out / "plan.json").read_text())["stages"])
    # a resumption keeps the layout the checkpoint's plan was made for (maybe fewer workers than --workers)
    assert main(["train", "--model", "mlp", "--workers", "2", "--no-progress", "--epochs", "2", "--max-minibatches", "6",
                 "--timeout", "60", "--schedule", "auto", "--resume", "--out", str(out)]) == 0
    again = json.loads((out / "report.json").read_text())
    assert (again["plan_config"], again["threads_per_worker"]) == (report["plan_config"], report["threads_per_worker"])
    assert len(again["history"]) == 2
    assert main(["train", "--model", "mlp", "--workers", "2", "--no-progress", "--allow-stale",
                 "--out", str(tmp_path / "x")]) == 2
    assert "--allow-stale lets --schedule auto choose" in capsys.readouterr().err


def test_local_layouts_use_the_cores_with_fewer_workers() -> None:
    assert local_layouts(2, 2) == [(2, 1), (1, 2)]
    assert local_layouts(4, 2) == [(4, 1), (2, 1), (1, 2)]
    assert local_layouts(3, 4) == [(3, 1), (1, 4)]
    assert local_layouts(1, 8) == [(1, 8)]


def _threaded_chain(speedup: float):
    """graph_for(m, threads) of a balanced 4-layer chain whose layers run ``speedup``× faster
    on two threads (small activations and weights: two workers pipeline it almost perfectly)."""
    from torchpipedream.model.graph import Layer, LayerGraph

    def graph_for(m: int, threads: int) -> LayerGraph:
        scale = 1.0 / speedup if threads == 2 else 1.0
        names = [f"l{i}" for i in range(4)]
        layers = [Layer(n, forward_ms=1.0 * scale, backward_ms=2.0 * scale, activation_bytes=1 << 10,
                        parameter_bytes=1 << 10) for n in names]
        return LayerGraph(layers, list(zip(names, names[1:])), batch_size=8)

    return graph_for


@pytest.mark.parametrize("speedup, workers", [(1.3, 2), (3.0, 1)])
def test_auto_chooses_workers_and_threads_by_prediction(speedup: float, workers: int) -> None:
    """Two threads 1.3× faster: two one-thread workers win (they pipeline the chain); 3×
    faster: one worker with two threads wins. Every layout's candidates are kept, and the
    runner-up may be the other layout's choice."""
    from torchpipedream.plans.topology import Topology

    chosen = choose_layout(_threaded_chain(speedup), [(2, 1), (1, 2)], Topology.local, microbatches=(1, 4))
    auto = chosen.meta["auto"]
    assert chosen.num_workers == workers and threads_per_worker(chosen) == 3 - workers
    assert auto["chosen"]["threads"] == 3 - workers
    assert {c["threads"] for c in auto["candidates"]} == {1, 2}
    best_other = min(c["time_per_minibatch_s"] for c in auto["candidates"]
                     if c["threads"] != auto["chosen"]["threads"] and not c["error"])
    assert auto["runner_up"]["time_per_minibatch_s"] <= best_other
    assert auto["chosen"]["time_per_minibatch_s"] <= min(c["time_per_minibatch_s"] for c in auto["candidates"]
                                                         if not c["error"])
    assert "2 workers × 1 threads, 1 workers × 2 threads" in auto_summary(chosen)[2]


def test_layouts_that_cannot_be_planned_are_skipped_and_all_failing_names_each() -> None:
    from torchpipedream.plans.topology import Topology

    two_stages = choose_layout(_threaded_chain(3.0), [(2, 1), (1, 2)], Topology.local, num_stages=2)
    assert two_stages.num_workers == 2 and threads_per_worker(two_stages) == 1  # one worker cannot hold 2 stages
    with pytest.raises(PlanError, match="2 workers × 1 threads: .*; 1 workers × 2 threads: "):
        choose_layout(_threaded_chain(3.0), [(2, 1), (1, 2)], Topology.local, num_stages=3)
    assert threads_per_worker(make_plan(_threaded_chain(1.0)(1, 1), "2:10GB/s")) == 1


def _activation_heavy_chain():
    """Four layers whose forwards leave 48 MB each for their backward (intermediate activations)
    but pass on only 1 MB: a memory budget binds, and recomputation is what lifts it."""
    from torchpipedream.model.graph import Layer, LayerGraph

    names = [f"l{i}" for i in range(4)]
    layers = [Layer(n, forward_ms=1.0, backward_ms=2.0, activation_bytes=1 << 20, parameter_bytes=1 << 20,
                    saved_bytes=48 << 20, saved_output_bytes=0, released_bytes=0) for n in names]
    return LayerGraph(layers, list(zip(names, names[1:])), batch_size=8)


def test_with_a_memory_budget_auto_recomputes_and_says_what_the_budget_cost() -> None:
    graph = _activation_heavy_chain()
    free = choose_schedule(graph, "2:10GB/s")
    assert not any(c["recompute"] for c in free.meta["auto"]["candidates"])  # no budget: never tried
    peak = free.predicted["peak_memory_bytes"]
    budget = int(peak * 0.2)
    bounded = choose_schedule(graph, "2:10GB/s", memory_bytes=budget)
    auto = bounded.meta["auto"]
    assert max(st.memory_bytes for st in bounded.stages) <= budget
    assert auto["memory_budget_bytes"] == budget
    assert auto["without_budget"]["time_per_minibatch_s"] == pytest.approx(
        free.meta["auto"]["chosen"]["time_per_minibatch_s"], rel=1e-9)
    # nothing without recomputation fits; the chosen plan recomputes and is slower than the free one
    assert all(c["error"] for c in auto["candidates"] if not c["recompute"])
    assert auto["chosen"]["recompute"] and any(st.recompute for st in bounded.stages)
    # a stage that does not recompute fits without it (only the stages that need it recompute)
    plain = bounded.with_recompute(False)
    assert all(st.recompute == (p.memory_bytes > budget) for st, p in zip(bounded.stages, plain.stages))
    assert auto["chosen"]["time_per_minibatch_s"] > auto["without_budget"]["time_per_minibatch_s"]
    free_label = free.meta["auto"]["chosen"]["schedule"]
    assert any(line.startswith("memory budget") and f"gave up {free_label}" in line and "time per minibatch" in line
               for line in auto_summary(bounded))


def test_a_budget_the_fastest_plan_fits_gives_up_nothing() -> None:
    graph = _activation_heavy_chain()
    free = choose_schedule(graph, "2:10GB/s")
    roomy = choose_schedule(graph, "2:10GB/s", memory_bytes=free.predicted["peak_memory_bytes"] * 4)
    assert not roomy.meta["auto"]["chosen"]["recompute"]
    assert any("gave up nothing" in line for line in auto_summary(roomy))


def test_plan_schedule_all_ranks_every_kind_with_true_gradients(tmp_path: Path, capsys) -> None:
    """`plan --schedule all`: the asynchronous, zero-bubble and virtual-stage kinds are planned and
    ranked too (never naive), and the plan written is the fastest prediction of them all."""
    from torchpipedream.cli import main

    out = tmp_path / "all.json"
    assert main(["plan", "vgg16", "-t", TOPOLOGY, "--schedule", "all", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    saved = json.loads(out.read_text())
    candidates = saved["meta"]["auto"]["candidates"]
    assert {c["schedule"] for c in candidates} == {"pipedream", "2bw", "flush", "gpipe", "zb-h1", "zb-h2",
                                                   "interleaved", "zb-v", "zb-2bw"}
    best = min((c for c in candidates if c["time_per_minibatch_s"] is not None),
               key=lambda c: c["time_per_minibatch_s"])
    assert saved["schedule"] == best["schedule"] and saved["microbatches"] == best["microbatches"]
    assert "\nzb-h2 " in text and "\ninterleaved " in text and "\nnaive " not in text
    # interleaved needs microbatches in rounds of one per worker: 1 does not fit, and says why
    assert any(c["schedule"] == "interleaved" and c["time_per_minibatch_s"] is None for c in candidates)
    assert main(["plan", "vgg16", "-t", TOPOLOGY, "--schedule", "all", "--microbatches", "4"]) == 2
    assert "--schedule all tries 1, 2, 4 and 8 microbatches itself" in capsys.readouterr().err


def test_with_a_budget_only_the_stages_that_need_it_recompute() -> None:
    """Under 1F1B the first of two stages holds two microbatches in flight, the last one: with a
    budget between their peaks only the first recomputes, which is faster than both."""
    graph = _activation_heavy_chain()
    plain = make_plan(graph, "2:10GB/s", schedule="flush", microbatches=4, straight=True)
    first, last = (st.memory_bytes for st in plain.stages)
    assert first > 1.5 * last
    budget = (first + last) // 2
    chosen = choose_schedule(graph, "2:10GB/s", kinds=["flush"], microbatches=(4,), memory_bytes=budget,
                             straight=True)
    assert [st.recompute for st in chosen.stages] == [True, False]
    assert max(st.memory_bytes for st in chosen.stages) <= budget
    auto = chosen.meta["auto"]
    assert auto["chosen"]["recompute"] and auto["chosen"]["recompute_stages"] == [0]
    assert auto_summary(chosen)[0].startswith("chosen flush, 4 microbatches, recompute stages 0")

    def simulated(p) -> float:
        return simulate(build_schedule(p, "flush", minibatches=32, microbatches=4), Costs.from_plan(p, 4)).makespan_s / 32

    assert auto["chosen"]["time_per_minibatch_s"] == pytest.approx(simulated(chosen))
    assert simulated(chosen) < simulated(chosen.with_recompute(True))
