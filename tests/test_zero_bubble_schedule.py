"""ZB-H1 (split backward) as data: its order, the closed-form bubble, the validator's rules for W,
the memory it holds and the planner's handling. No processes here (tests/test_zero_bubble.py
runs it)."""

from __future__ import annotations

import dataclasses

import pytest

from torchpipedream.schedule.actions import Action, Kind, Schedule, parse_action
from torchpipedream.model.graph import Layer, LayerGraph
from torchpipedream.plans.kinds import schedule_kind
from torchpipedream.search.planner import plan as make_plan
from torchpipedream.plans.plan import Plan, PlanError, Stage
from torchpipedream.schedule.build import ScheduleBuildError, build_schedule
from torchpipedream.sim.simulator import Costs, simulate
from torchpipedream.schedule.validate import ScheduleError, schedule_stats, validate_schedule


def straight(n: int) -> Plan:
    return Plan.straight([[f"l{i}"] for i in range(n)])


def compute(sched: Schedule, rank: int) -> str:
    return " ".join(f"{a.kind.value}{a.id}" for a in sched.actions[rank] if a.kind.is_compute)


def test_the_four_stage_order_is_the_building_block_of_the_paper() -> None:
    # Written out from the building block (F at s, B one step per stage back from the last
    # stage's F, W at the third slot of each period once the stage holds 4 microbatches).
    s = build_schedule(straight(4), "zb-h1", minibatches=1, microbatches=8)
    assert compute(s, 0) == "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7"
    assert compute(s, 3) == "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7"
    # the gradient leaves right after B (not after W), the step after the batch's last W
    acts = [str(a) for a in s.actions[3]]
    assert acts[acts.index("s3B0v0") + 1] == "s3SG0@2"
    assert acts[-2:] == ["s3W7v0", "s3U0v1"]


def test_text_form_of_a_weight_gradient_pass_round_trips() -> None:
    a = parse_action("s2W7v3")
    assert a == Action(2, Kind.WEIGHT_GRAD, 7, version=3) and str(a) == "s2W7v3"
    s = build_schedule(straight(3), "zb-h1", minibatches=2, microbatches=4)
    assert Schedule.from_dict(s.to_dict()).actions == s.actions


@pytest.mark.parametrize("tf, tb, tw", [(1.0, 1.0, 1.0), (1.0, 1.5, 0.5), (2.0, 1.0, 1.0), (1.0, 1.0, 0.25)])
@pytest.mark.parametrize("n, m", [(2, 4), (3, 6), (4, 8), (4, 16), (5, 10), (8, 16)])
def test_bubble_matches_the_closed_form(n: int, m: int, tf: float, tb: float, tw: float) -> None:
    """Qi et al.: ZB-H1's bubble is (p − 1)(T_F + T_B − T_W) per batch (T_W ≤ T_F, T_B), 1F1B's
    (p − 1)(T_F + T_B + T_W); the simulator, with these durations and free links, gives both."""
    costs = Costs(forward_s=[tf] * n, backward_s=[tb + tw] * n, weight_grad_s=[tw] * n)
    ideal = m * (tf + tb + tw)
    zb = simulate(build_schedule(straight(n), "zb-h1", minibatches=1, microbatches=m), costs)
    flush = simulate(build_schedule(straight(n), "flush", minibatches=1, microbatches=m), costs)
    assert zb.makespan_s - ideal == pytest.approx((n - 1) * (tf + tb - tw), abs=1e-9)
    assert flush.makespan_s - ideal == pytest.approx((n - 1) * (tf + tb + tw), abs=1e-9)
    if tf == tb == tw:  # a third of 1F1B's, as a fraction of the ideal time: (p − 1)/(3m)
        assert (zb.makespan_s - ideal) / ideal == pytest.approx((n - 1) / (3 * m), abs=0.02)
    # every stage holds as many microbatches (F to W) as the input stage: n
    assert zb.max_inflight == [n] * n
    assert flush.max_inflight == [n - s for s in range(n)]


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [1, 2, 3, 7])
def test_every_shape_validates_including_fewer_microbatches_than_stages(n: int, m: int) -> None:
    s = build_schedule(straight(n), "zb-h1", minibatches=3, microbatches=m)
    validate_schedule(s)
    assert all(v == min(n, m) for v in schedule_stats(s).max_inflight.values())
    simulate(s, Costs(forward_s=[1.0] * n, backward_s=[2.0] * n))


def _swap(s: Schedule, rank: int, first: str, second: str) -> Schedule:
    acts = list(s.actions[rank])
    i, j = [str(a) for a in acts].index(first), [str(a) for a in acts].index(second)
    acts[i], acts[j] = acts[j], acts[i]
    return dataclasses.replace(s, actions={**s.actions, rank: acts})


def test_validator_rules_for_the_weight_gradient_pass() -> None:
    s = build_schedule(straight(2), "zb-h1", minibatches=2, microbatches=2)
    validate_schedule(s)
    with pytest.raises(ScheduleError, match="weight-gradient pass of microbatch 0 before its B"):
        validate_schedule(_swap(s, 1, "s1B0v0", "s1W0v0"))
    with pytest.raises(ScheduleError, match="before the backward of microbatch 1"):
        validate_schedule(_swap(s, 1, "s1W1v0", "s1U0v1"))
    wrong = [a if str(a) != "s1W1v0" else dataclasses.replace(a, version=1) for a in s.actions[1]]
    with pytest.raises(ScheduleError, match="uses version 0, not 1"):
        validate_schedule(dataclasses.replace(s, actions={**s.actions, 1: wrong}))
    twice = list(s.actions[1])
    twice.insert([str(a) for a in twice].index("s1U0v1"), parse_action("s1W0v0"))
    with pytest.raises(ScheduleError, match="computed twice"):
        validate_schedule(dataclasses.replace(s, actions={**s.actions, 1: twice}))


def test_activations_count_as_held_until_w() -> None:
    """A schedule that defers every W to the end holds the whole batch: over the bound."""
    s = build_schedule(straight(2), "zb-h1", minibatches=1, microbatches=6)
    acts = list(s.actions[1])
    ws = [a for a in acts if a.kind is Kind.WEIGHT_GRAD]
    rest = [a for a in acts if a.kind is not Kind.WEIGHT_GRAD]
    deferred = rest[:-1] + ws + rest[-1:]
    assert schedule_stats(dataclasses.replace(s, actions={**s.actions, 1: deferred})).max_inflight[1] == 6
    with pytest.raises(ScheduleError, match="activations stashed on stage 1"):
        validate_schedule(dataclasses.replace(s, actions={**s.actions, 1: deferred}))


def test_a_replicated_plan_is_refused_by_name_under_zb_2bw_only() -> None:
    stages = [Stage(layers=["a"], replicas=2, ranks=[0, 1]), Stage(layers=["b"], replicas=1, ranks=[2])]
    with pytest.raises(ScheduleBuildError, match="stage 0 has 2 replicas"):
        build_schedule(Plan(stages=stages, schedule="zb-2bw", microbatches=4), "zb-2bw", minibatches=1)
    for kind in ("zb-h1", "zb-h2"):  # tests/test_zero_bubble_replicas.py runs them
        validate_schedule(build_schedule(Plan(stages=stages, schedule=kind, microbatches=4), kind, minibatches=1))


def _chain(n: int) -> LayerGraph:
    layers = [Layer(name=f"l{i}", forward_ms=1.0, backward_ms=2.0, activation_bytes=1000,
                    parameter_bytes=4000) for i in range(n)]
    return LayerGraph(layers=layers, edges=[(f"l{i}", f"l{i + 1}") for i in range(n - 1)], batch_size=8)


def test_a_straight_zb_h1_plan_charges_the_input_stages_depth_everywhere() -> None:
    graph = _chain(8)
    zb = make_plan(graph, "local:4", schedule="zb-h1", microbatches=8, straight=True)
    flush = make_plan(graph, "local:4", schedule="flush", microbatches=8, straight=True)
    assert [st.replicas for st in zb.stages] == [1, 1, 1, 1]
    assert zb.predicted["time_per_minibatch_s"] < flush.predicted["time_per_minibatch_s"]  # a third of the bubble
    kind = schedule_kind("zb-h1")
    assert kind.fill_drain_factor(8, 4) == pytest.approx((8 + 1) / 8)
    # the memory model charges 4 in-flight microbatches on every stage (the input stage's depth)
    # (flush: 4 - s), so the input stage costs the same and every later stage more
    assert zb.stage_memory_bytes(0) == flush.stage_memory_bytes(0)
    for s in range(1, 4):
        assert zb.stage_memory_bytes(s) > flush.stage_memory_bytes(s)
    extra = [zb.stage_memory_bytes(s) - flush.stage_memory_bytes(s) for s in range(4)]
    assert extra[1] * 2 == pytest.approx(extra[2]) and extra[1] * 3 == pytest.approx(extra[3])  # s more each


def test_the_planner_plans_it_straight_with_its_factor_and_depth() -> None:
    graph = _chain(8)
    full = make_plan(graph, "local:4", schedule="zb-2bw", microbatches=4)
    two_bw = make_plan(graph, "local:4", schedule="2bw", microbatches=4, straight=True)
    assert [st.replicas for st in full.stages] == [1, 1, 1, 1]
    # m = 4 ≥ n − 1: 2bw's time and memory (n − s microbatches held)
    assert full.predicted["time_per_minibatch_s"] == pytest.approx(two_bw.predicted["time_per_minibatch_s"])
    assert [full.stage_memory_bytes(s) for s in range(4)] == pytest.approx(
        [two_bw.stage_memory_bytes(s, "2bw") for s in range(4)])
    # m = 1 < n − 1: two batches (2m = 2 microbatches) on every stage, and (n + m)/3m of the ideal
    small = make_plan(graph, "local:4", schedule="zb-2bw", microbatches=1, num_stages=4)
    small_2bw = make_plan(graph, "local:4", schedule="2bw", microbatches=1, num_stages=4, straight=True)
    per = small_2bw.stage_memory_bytes(2) - small_2bw.stage_memory_bytes(3)  # one microbatch's bytes
    assert per > 0
    for s in range(1, 4):  # (stage 0 stashes no input of its own: the data is the loader's)
        held = 4 - s  # what the 2bw model charges
        assert small.stage_memory_bytes(s) - small_2bw.stage_memory_bytes(s) == pytest.approx((2 - held) * per)
    assert small.predicted["time_per_minibatch_s"] == pytest.approx(
        small_2bw.predicted["time_per_minibatch_s"] * (4 + 1) / 3)


# --------------------------------------------------------------------------- ZB-H2
@pytest.mark.parametrize("n, m", [(2, 3), (2, 4), (3, 5), (3, 6), (4, 7), (4, 8), (4, 16), (5, 10), (8, 16)])
def test_zb_h2_runs_batch_after_batch_without_a_bubble(n: int, m: int) -> None:
    """Stages of equal F, B and W: once m ≥ 2n − 1, a batch in the steady state takes exactly its
    compute, 3m (ZB-H2's zero bubble; each stage's own step separates the batches); the first
    batch pays only the forward wave's start, n − 1. ZB-H1 pays (n − 1) every batch."""
    costs = Costs(forward_s=[1.0] * n, backward_s=[2.0] * n, weight_grad_s=[1.0] * n)

    def makespan(kind: str, batches: int) -> float:
        return simulate(build_schedule(straight(n), kind, minibatches=batches, microbatches=m), costs).makespan_s

    assert makespan("zb-h2", 6) - makespan("zb-h2", 5) == pytest.approx(3 * m, abs=1e-9)
    assert makespan("zb-h2", 1) == pytest.approx(3 * m + n - 1, abs=1e-9)
    assert makespan("zb-h1", 6) - makespan("zb-h1", 5) == pytest.approx(3 * m + n - 1, abs=1e-9)
    kind = schedule_kind("zb-h2")
    assert kind.fill_drain_factor(m, n) == 1.0


@pytest.mark.parametrize("n, m", [(3, 4), (4, 5), (4, 3), (4, 2)])
def test_zb_h2_with_fewer_microbatches_pays_what_its_factor_says(n: int, m: int) -> None:
    costs = Costs(forward_s=[1.0] * n, backward_s=[2.0] * n, weight_grad_s=[1.0] * n)
    spans = [simulate(build_schedule(straight(n), "zb-h2", minibatches=b, microbatches=m), costs).makespan_s
             for b in (5, 6)]
    assert spans[1] - spans[0] == pytest.approx(3 * m * schedule_kind("zb-h2").fill_drain_factor(m, n), abs=1e-9)


@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("m", [1, 2, 3, 7, 12])
def test_zb_h2_shapes_validate_and_hold_at_most_2n_minus_1(n: int, m: int) -> None:
    s = build_schedule(straight(n), "zb-h2", minibatches=3, microbatches=m)
    validate_schedule(s)
    assert all(v == min(2 * n - 1, m) for v in schedule_stats(s).max_inflight.values())


def test_the_planner_charges_a_straight_zb_h2_stage_twice_the_depth_less_one() -> None:
    graph = _chain(8)
    h2 = make_plan(graph, "local:4", schedule="zb-h2", microbatches=8, straight=True)
    h1 = make_plan(graph, "local:4", schedule="zb-h1", microbatches=8, straight=True)
    flush = make_plan(graph, "local:4", schedule="flush", microbatches=8, straight=True)
    assert [st.replicas for st in h2.stages] == [1, 1, 1, 1]
    assert h2.predicted["time_per_minibatch_s"] < h1.predicted["time_per_minibatch_s"]
    for s in (1, 2):  # one microbatch's bytes: zb-h1 holds 4, flush 4 - s; zb-h2 holds 7
        per = (h1.stage_memory_bytes(s) - flush.stage_memory_bytes(s)) / s
        assert per > 0
        assert h2.stage_memory_bytes(s) - h1.stage_memory_bytes(s) == pytest.approx(3 * per)


# --------------------------------------------------------------------------- ZB-V
def v_plan(p: int) -> Plan:
    return Plan.v_shape([[f"l{k}"] for k in range(2 * p)], p)


def test_zb_v_puts_two_stages_per_worker_in_a_v() -> None:
    plan = v_plan(3)
    assert [st.ranks for st in plan.stages] == [[0], [1], [2], [2], [1], [0]]
    assert plan.virtual and plan.chunks == 2 and plan.stages_of_rank(0) == [0, 5]
    s = build_schedule(plan, "zb-v", minibatches=1, microbatches=6)
    validate_schedule(s)
    # the turn of the V (stage 2 to stage 3) stays on worker 2: a hand-over, not a message
    assert [a.peer for a in s.actions[2] if a.kind is Kind.SEND_ACT and a.stage == 2] == [2] * 6
    assert all(a.kind is not Kind.BACKWARD or a.id in {w.id for w in s.actions[2] if w.kind is Kind.WEIGHT_GRAD
                                                        and w.stage == a.stage} for a in s.actions[2])
    with pytest.raises(ScheduleBuildError, match="two stages per worker in a V"):
        build_schedule(Plan.looped([[f"l{k}"] for k in range(6)], 3), "zb-v", microbatches=6)
    with pytest.raises(ScheduleBuildError, match="stage k on rank k mod 3"):
        build_schedule(plan, "interleaved", microbatches=6)
    with pytest.raises(PlanError, match="two stages per worker: 6 layer groups for 3 workers, got 4"):
        Plan.v_shape([["a"], ["b"], ["c"], ["d"]], 3)


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("rounds", [1, 2, 3])
def test_zb_v_idles_only_for_the_forward_waves_start(p: int, rounds: int) -> None:
    """Equal F, B and W passes of one unit per stage (a worker's 6 per microbatch): a batch of
    m ≥ p microbatches takes exactly 6m + p − 1 units, the p − 1 being the time the first
    forward takes to reach the last worker (no schedule of these passes can take less); every
    worker holds at most 2p + 2 microbatch chunks; batches that follow each other overlap."""
    m, n = rounds * p, 2 * p
    costs = Costs(forward_s=[1.0] * n, backward_s=[2.0] * n, weight_grad_s=[1.0] * n)
    one = build_schedule(v_plan(p), "zb-v", minibatches=1, microbatches=m)
    assert simulate(one, costs).makespan_s == 6 * m + p - 1
    assert max(schedule_stats(one).max_inflight.values()) <= 2 * p + 2
    four = simulate(build_schedule(v_plan(p), "zb-v", minibatches=4, microbatches=m), costs).makespan_s
    assert 4 * 6 * m + p - 1 <= four <= 4 * (6 * m + p - 1)


def test_zb_v_holds_activations_until_w_and_the_validator_bounds_them() -> None:
    s = build_schedule(v_plan(2), "zb-v", minibatches=1, microbatches=8)
    assert max(schedule_stats(s).max_inflight.values()) <= 6
    # a W moved to the end of its rank's list: that stage holds more than a worker may
    acts = s.actions[0]
    w = next(k for k, a in enumerate(acts) if a.kind is Kind.WEIGHT_GRAD and a.stage == 0)
    late = acts[:w] + acts[w + 1:-1] + [acts[w], acts[-1]]
    with pytest.raises(ScheduleError, match="7 microbatch chunks in flight over its stages \\[0, 3\\]; a zb-v worker "
                                            "holds at most 6"):
        validate_schedule(dataclasses.replace(s, actions={**s.actions, 0: late}))
