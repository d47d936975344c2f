"""The report's time split (sim/trace.py ``time_split``/``pass_time``, train/time_split.py):
where a trace's time goes per rank, and the term that missed its prediction most."""

from __future__ import annotations

import pytest

from torchpipedream.plans.plan import Plan, Stage
from torchpipedream.schedule.build import build_schedule
from torchpipedream.sim.simulator import Costs, simulate
from torchpipedream.sim.trace import Event, Trace
from torchpipedream.train.time_split import TERMS, largest_miss, split_lines, split_of


def _ev(rank: int, kind: str, start: float, end: float, stage: int | None = None) -> Event:
    return Event(rank=rank, stage=rank if stage is None else stage, kind=kind, id=0, start_s=start, end_s=end)


def _trace() -> Trace:
    """Rank 0: F 0-1, a send 0.5-1.5 that overlaps it, nothing 1.5-2, B 2-3. Rank 1: a receive
    0-1.2, F 1.5-2.5, nothing after. Makespan 3."""
    return Trace([_ev(0, "F", 0, 1), _ev(0, "SA", 0.5, 1.5), _ev(0, "B", 2, 3),
                  _ev(1, "RA", 0, 1.2), _ev(1, "F", 1.5, 2.5)])


def test_a_ranks_terms_count_overlaps_as_compute_and_sum_to_the_makespan() -> None:
    split = _trace().time_split(minibatches=2)
    assert split[0] == pytest.approx({"compute": 1.0, "transfers and waits": 0.25, "outside actions": 0.25})
    assert split[1] == pytest.approx({"compute": 0.5, "transfers and waits": 0.6, "outside actions": 0.4})


def test_pass_time_sums_a_stages_kind_over_its_replicas() -> None:
    trace = Trace([_ev(0, "F", 0, 1, stage=0), _ev(1, "F", 0, 2, stage=0), _ev(1, "B", 2, 5, stage=0),
                   _ev(2, "SG", 0, 4, stage=1)])
    assert trace.pass_time(minibatches=2) == pytest.approx({(0, "F"): 1.5, (0, "B"): 1.5})


def test_a_simulated_schedules_split_sums_to_its_makespan_on_every_rank() -> None:
    plan = Plan(stages=[Stage(layers=["a"], ranks=[0], forward_ms=2.0, backward_ms=4.0, output_bytes=10 ** 6),
                        Stage(layers=["b"], ranks=[1], forward_ms=3.0, backward_ms=5.0)],
                schedule="flush", microbatches=4)
    sim = simulate(build_schedule(plan, "flush", minibatches=3, microbatches=4), Costs.from_plan(plan, microbatches=4))
    split = sim.trace.time_split(3)
    assert set(split) == {0, 1}
    for terms in split.values():
        assert sum(terms.values()) == pytest.approx(sim.makespan_s / 3)
        assert terms["compute"] > 0
    # stage 1's forward: 3 ms a minibatch in 4 microbatches of 0.75 ms, 3 minibatches
    assert sim.trace.pass_time(3)[(1, "F")] == pytest.approx(3e-3)


def _split(ranks: dict[str, tuple[float, float, float]], passes: dict[str, float]) -> dict:
    return {"ranks": {r: dict(zip(TERMS, v)) for r, v in ranks.items()}, "passes": passes}


def test_the_miss_is_named_on_the_busiest_rank_whose_waits_are_the_rest_of_the_gap() -> None:
    """Rank 1 computes most (the bottleneck): rank 0's extra waits follow from it. The run took
    3 ms more per minibatch than predicted; rank 1's compute took 2.5 of them, its time between
    actions 0.1, and the remaining 0.4 are transfers and waits."""
    predicted = _split({"0": (2e-3, 2e-3, 0.0), "1": (3.5e-3, 0.5e-3, 0.0)}, {"stage 0 F": 1e-3, "stage 1 B": 2e-3})
    measured = _split({"0": (2.2e-3, 4.8e-3, 0.0), "1": (6e-3, 0.9e-3, 0.1e-3)}, {"stage 0 F": 1.1e-3,
                                                                                  "stage 1 B": 4e-3})
    miss = largest_miss(measured, predicted)
    assert miss["rank"] == 1 and miss["term"] == "compute"
    assert miss["excess_s"] == pytest.approx(2.5e-3) and miss["gap_s"] == pytest.approx(3e-3)
    assert miss["pass"] == "stage 1 B" and miss["pass_ratio"] == pytest.approx(2.0)
    # the pass is the busiest rank's own: rank 0's forward 5x off is not named for rank 1
    measured["passes"]["stage 0 F"] = 5e-3
    assert largest_miss(dict(measured, stages={"0": [0], "1": [1]}), predicted)["pass"] == "stage 1 B"
    # the same gap with rank 1's compute as predicted: transfers and waits took it
    slow_messages = _split({"0": (2e-3, 5e-3, 0.0), "1": (3.5e-3, 3.5e-3, 0.0)}, {})
    miss = largest_miss(slow_messages, predicted)
    assert miss["rank"] == 1 and miss["term"] == "transfers and waits" and miss["excess_s"] == pytest.approx(3e-3)
    assert largest_miss(predicted, measured) is None  # faster than predicted: nothing missed


def test_the_report_lists_ranks_and_names_the_miss_only_when_the_run_fell_short() -> None:
    predicted = _split({"0": (2e-3, 1e-3, 0.0)}, {"stage 0 F": 1e-3})
    measured = _split({"0": (6e-3, 1e-3, 0.0)}, {"stage 0 F": 3e-3})
    rows = split_lines({"measured": measured, "predicted": predicted}, throughput_ratio=0.5)
    assert rows[0] == ("time split", "rank 0: compute 6.00 ms (predicted 2.00), transfers and waits 1.00 ms "
                                     "(predicted 1.00), outside actions 0.00 ms (predicted 0.00) per minibatch")
    assert rows[1][0] == "missed most" and rows[1][1].startswith(
        "compute on rank 0 (the busiest), +4.00 of the +4.00 ms per minibatch the run took over its prediction")
    assert "stage 0 F (3.00×)" in rows[1][1]
    assert [r[0] for r in split_lines({"measured": measured, "predicted": predicted}, 0.95)] == ["time split"]
    # a run prepared before the split existed (resumed from an older checkpoint) prints none
    assert split_lines({"measured": measured, "predicted": None}, 0.5) == []


def test_split_of_writes_json_keys() -> None:
    out = split_of(_trace(), 2)
    assert set(out["ranks"]) == {"0", "1"} and set(out["passes"]) == {"stage 0 F", "stage 0 B", "stage 1 F"}
    assert out["stages"] == {"0": [0], "1": [1]}
