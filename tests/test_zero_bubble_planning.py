"""The planner replicates zb-h1 and zb-h2 stages where that is faster than a straight pipeline.

A replica of a split stage holds only its share of the straight stage's microbatches
(``ScheduleKind.replica_inflight``) and waits on their round trips, which the planner charges
with search/replica_round_trip.py and weighs against the straight plan of the same request.
The simulator, which runs the built schedule action by action, is the reference the planner's
predictions are held to.
"""

from __future__ import annotations

import pytest

import torchpipedream as tpd
from torchpipedream.model.graph import Block
from torchpipedream.plans.kinds import schedule_kind
from torchpipedream.search.planner import evaluate, plan
from torchpipedream.search.replica_round_trip import replica_round_trip_ms

WIDE = "4x2:25GB/s,1.25GB/s"


def _simulated_ms(p: tpd.Plan) -> float:
    """The simulator's steady time per minibatch of ``p`` (device-speed copies and accumulation,
    which the planner does not price)."""
    costs = tpd.Costs.from_plan(p, p.microbatches, accumulate_Bps=300e9, copy_Bps=300e9)
    result = tpd.simulate(tpd.build_schedule(p, p.schedule, minibatches=8), costs)
    return 1e3 / result.steady_minibatches_per_s


@pytest.mark.parametrize("kind, topology, microbatches", [("zb-h1", WIDE, 4), ("zb-h2", "A", 8)])
def test_a_replicated_zero_bubble_plan_is_chosen_where_the_simulator_finds_it_faster(
        kind: str, topology: str, microbatches: int) -> None:
    graph = tpd.load_profile("vgg16")
    chosen = plan(graph, topology, schedule=kind, microbatches=microbatches)
    line = plan(graph, topology, schedule=kind, microbatches=microbatches, straight=True)
    assert any(st.replicas > 1 for st in chosen.stages) and chosen.meta["planner"]["straight"] is False
    simulated, straight_simulated = _simulated_ms(chosen), _simulated_ms(line)
    assert simulated < 0.7 * straight_simulated
    # the prediction holds: the replicas' round trips are what bounds it
    predicted = chosen.predicted["time_per_minibatch_s"] * 1e3
    assert predicted == pytest.approx(simulated, rel=0.12)
    assert "round trip" in chosen.predicted["bottleneck"]


def test_the_straight_plan_is_kept_where_replicas_would_only_wait() -> None:
    """vgg16 on 2x2 under zb-h1 with 4 microbatches: the search's replicated plan waits on its
    round trips longer than the straight pipeline takes, so the straight one is returned, as
    asked for without ``straight`` (the record says a replicated plan was weighed)."""
    graph = tpd.load_profile("vgg16")
    chosen = plan(graph, "2x2:10GB/s,1.25GB/s", schedule="zb-h1", microbatches=4)
    assert chosen.summary == "straight ×4" and chosen.meta["planner"]["straight"] is False


def _block(forward: float, input_grad: float, weight_grad: float, cut: int) -> Block:
    return Block([f"l{forward}{cut}"], forward, input_grad + weight_grad, 0, cut, input_grad_ms=input_grad,
                 weight_grad_ms=weight_grad)


def test_the_round_trip_is_the_wave_formula_worked_by_hand() -> None:
    """Stage 0 of 2 replicas over stage 1, 4 microbatches, zb-h1 (n = 2: each replica holds
    ⌈2/2⌉ = 1 microbatch). Per microbatch stage 0 takes F = 1 and B + W = 2 (its B
    differentiates no input, so its W is the whole backward); stage 1 F = B = W = 0.5; the cut
    moves 1 MB per minibatch each way at 1 GB/s (0.25 ms per microbatch each way). A replica
    runs 2 waves of one microbatch: max(1, 1 + (0.5 + 0.5) + 0.5) + 2 = 4.5 ms each, 9 ms for
    the minibatch, where the busiest stage's 6 ms times zb-h1's fill, (4 + 1/3)/4, is 6.5."""
    blocks = [_block(4.0, 4.0, 4.0, 1_000_000), _block(2.0, 2.0, 2.0, 0)]
    ms, stage = replica_round_trip_ms(blocks, [(0, 0, 2), (1, 1, 1)], [1e9], schedule_kind("zb-h1"), 4, [0.0, 0.0])
    assert (ms, stage) == (pytest.approx(9.0), 0)
    # straight plans and the kinds whose replicas do not follow the stage's order pay nothing
    assert replica_round_trip_ms(blocks, [(0, 0, 1), (1, 1, 1)], [1e9], schedule_kind("zb-h1"), 4, [0.0, 0.0]) \
        == (0.0, -1)
    assert replica_round_trip_ms(blocks, [(0, 0, 2), (1, 1, 1)], [1e9], schedule_kind("flush"), 4, [0.0, 0.0]) \
        == (0.0, -1)
    # evaluate charges it where it exceeds the bottleneck times the fill
    topo = tpd.Topology.parse("3:1GB/s")
    ev = evaluate(blocks, topo, [(0, 0, 2), (1, 1, 1)], "zb-h1", 4)
    assert ev.time_ms == pytest.approx(6.0)
    assert ev.minibatch_ms == pytest.approx(9.0) and "stage 0's round trip" in ev.bottleneck


def test_a_budgeted_replicated_zb_h2_plan_fits_its_budget() -> None:
    """With a memory budget the search counts what a zb-h2 replica holds (⌈(2n − 1)/m⌉, capped
    at its ⌈μ/m⌉), not the workers after it: every stage of the plan fits."""
    graph = tpd.load_profile("vgg16")
    free = plan(graph, WIDE, schedule="zb-h2", microbatches=32)
    budget = int(0.9 * max(st.memory_bytes for st in free.stages))
    tight = plan(graph, WIDE, schedule="zb-h2", microbatches=32, memory_bytes=budget)
    assert max(st.memory_bytes for st in tight.stages) <= budget
