"""Interleaved 1F1B (virtual stages) as data: plans whose ranks hold several stages, the order
of Megatron's schedule, its closed-form bubble, the validator's rules for chunks. No processes
here (tests/test_interleaved.py runs it)."""

from __future__ import annotations

import dataclasses

import pytest

from torchpipedream.schedule.actions import Action, Kind, Schedule, parse_action
from torchpipedream.plans.plan import Plan, PlanError, Stage
from torchpipedream.schedule.build import ScheduleBuildError, build_schedule
from torchpipedream.sim.simulator import Costs, simulate
from torchpipedream.schedule.validate import ScheduleError, schedule_stats, validate_schedule


def looped(p: int, v: int, **kwargs) -> Plan:
    return Plan.looped([[f"l{i}"] for i in range(p * v)], p, **kwargs)


def compute(sched: Schedule, rank: int) -> str:
    """F3' for the forward of microbatch 3 on the rank's second stage (p = 2: stages r, r + 2)."""
    return " ".join(f"{a.kind.value}{a.id}" + "'" * (a.stage // sched.plan.num_workers)
                    for a in sched.actions[rank] if a.kind.is_compute)


def test_a_looped_plan_puts_stage_k_on_rank_k_mod_p() -> None:
    plan = looped(2, 3)
    assert [st.ranks for st in plan.stages] == [[0], [1], [0], [1], [0], [1]]
    assert plan.virtual and plan.chunks == 3 and plan.num_workers == 2
    assert plan.stages_of_rank(1) == [1, 3, 5]
    assert plan.summary == "6 stages on 2 workers (3 per worker)"
    with pytest.raises(PlanError, match="holds stages"):
        plan.stage_of_rank(0)
    assert Plan.from_dict(plan.to_dict()).stages == plan.stages
    straight = Plan.straight([["a"], ["b"]])
    assert not straight.virtual and straight.chunks == 1 and straight.stage_of_rank(1) == (1, 0)


def test_plans_with_virtual_stages_are_refused_where_they_cannot_run() -> None:
    with pytest.raises(PlanError, match="divide evenly"):
        Plan.looped([["a"], ["b"], ["c"]], 2)
    uneven = Plan(stages=[Stage(["a"], ranks=[0]), Stage(["b"], ranks=[1]), Stage(["c"], ranks=[0])])
    with pytest.raises(PlanError, match="same number of stages"):
        uneven.validate()
    replicated = Plan(stages=[Stage(["a"], replicas=2, ranks=[0, 1]), Stage(["b"], ranks=[0])])
    with pytest.raises(PlanError, match="stage 0 has 2 replicas"):
        replicated.validate()
    twice = Plan(stages=[Stage(["a"], replicas=2, ranks=[0, 0])])
    with pytest.raises(PlanError, match="name a rank twice"):
        twice.validate()
    with pytest.raises(ScheduleBuildError, match="flush runs one stage per worker: use interleaved"):
        build_schedule(looped(2, 2), "flush", microbatches=4)
    v_shape = Plan(stages=[Stage(["a"], ranks=[0]), Stage(["b"], ranks=[1]), Stage(["c"], ranks=[1]),
                           Stage(["d"], ranks=[0])], schedule="interleaved")
    with pytest.raises(ScheduleBuildError, match="stage k on rank k mod 2"):
        build_schedule(v_shape, microbatches=4)
    with pytest.raises(ScheduleBuildError, match="multiple of the 2 workers, got 3"):
        build_schedule(looped(2, 2), microbatches=3)


def test_the_two_rank_order_is_megatrons() -> None:
    # Written out from Narayanan et al. (SC'21), fig. 4, for p = 2, v = 2, m = 4: forwards in
    # rounds of p microbatches chunk by chunk, backwards in the same rounds with the chunks
    # reversed; rank r warms up with 2(p - r - 1) + (v - 1)p forwards before 1F1B.
    s = build_schedule(looped(2, 2), minibatches=1, microbatches=4)
    assert compute(s, 0) == "F0 F1 F0' F1' F2 B0' F3 B1' F2' B0 F3' B1 B2' B3' B2 B3"
    assert compute(s, 1) == "F0 F1 F0' B0' F1' B1' F2 B0 F3 B1 F2' B2' F3' B3' B2 B3"
    # every stage steps once per batch, after its own last backward; versions are the batch's
    acts = [str(a) for a in s.actions[0]]
    assert acts.index("s2U0v1") > acts.index("s2B3v0") and acts[-1] == "s0U0v1"
    assert Schedule.from_dict(s.to_dict()).actions == s.actions  # the text form carries the stage


@pytest.mark.parametrize("tf, tb", [(1.0, 2.0), (1.0, 1.0), (2.0, 1.0)])
@pytest.mark.parametrize("p, v", [(2, 1), (2, 2), (2, 4), (3, 2), (4, 2), (4, 3), (8, 2), (8, 4)])
@pytest.mark.parametrize("rounds", [1, 2, 4])
def test_bubble_matches_the_closed_form(p: int, v: int, rounds: int, tf: float, tb: float) -> None:
    """Narayanan et al.: with v stages of equal times per worker the bubble is (p − 1)(t_f + t_b)/v
    per batch, 1/v of 1F1B's, i.e. (p − 1)/(v·m) of the ideal time; simulated with free links."""
    m, n = rounds * p, p * v
    costs = Costs(forward_s=[tf / v] * n, backward_s=[tb / v] * n)
    ideal = m * (tf + tb)
    sim = simulate(build_schedule(looped(p, v), "interleaved", minibatches=1, microbatches=m), costs)
    flush = simulate(build_schedule(Plan.straight([[f"l{i}"] for i in range(p)]), "flush", minibatches=1,
                                    microbatches=m), Costs(forward_s=[tf] * p, backward_s=[tb] * p))
    assert sim.makespan_s - ideal == pytest.approx((p - 1) * (tf + tb) / v, abs=1e-9)
    assert flush.makespan_s - ideal == pytest.approx((p - 1) * (tf + tb), abs=1e-9)
    assert (sim.makespan_s - ideal) / ideal == pytest.approx((p - 1) / (v * m), abs=0.02)


def test_each_stage_holds_at_most_its_ranks_warm_up_and_the_stats_say_so() -> None:
    s = build_schedule(looped(4, 2), minibatches=2, microbatches=8)
    validate_schedule(s)
    stats = schedule_stats(s)
    # rank r warms up with 2(p − r − 1) + (v − 1)p + 1 forwards over its two stages
    assert [stats.max_inflight[r] for r in range(4)] == [min(16, 2 * (4 - r - 1) + 4 + 1) for r in range(4)]
    assert all(stats.by_stage[(r, st)][1] <= 8 for r in range(4) for st in s.plan.stages_of_rank(r))
    assert all(stats.by_stage[(r, st)][0] == 1 for r in range(4) for st in s.plan.stages_of_rank(r))
    sim = simulate(s, Costs(forward_s=[1.0] * 8, backward_s=[2.0] * 8, activation_bytes=[100.0] * 8,
                            parameter_bytes=[10.0] * 8))
    assert sim.max_inflight == [stats.by_stage[(s.plan.stages[k].ranks[0], k)][1] for k in range(8)]


def test_the_validator_checks_each_stage_of_a_rank() -> None:
    s = build_schedule(looped(2, 2), minibatches=1, microbatches=4)
    acts = s.actions[0]
    # an action of a stage this rank does not hold
    stray = dataclasses.replace(s, actions={**s.actions, 0: acts[:3] + [Action(1, Kind.FORWARD, 0, version=0)]
                                            + acts[3:]})
    with pytest.raises(ScheduleError, match="rank 0 holds stages \\[0, 2\\], not stage 1"):
        validate_schedule(stray)
    # stage 2's backward of microbatch 0 moved before its forward
    b = next(k for k, a in enumerate(acts) if str(a) == "s2B0v0")
    f = next(k for k, a in enumerate(acts) if str(a) == "s2F0v0")
    early = acts[:f] + [acts[b]] + acts[f:b] + acts[b + 1:]
    with pytest.raises(ScheduleError, match="backward of microbatch 0 before its forward"):
        validate_schedule(dataclasses.replace(s, actions={**s.actions, 0: early}))
    # rank 1 receives stage 2's microbatch 0 (for its stage 3) before stage 0's microbatch 1: the
    # k-th message on the channel from rank 0 is another stage's than the k-th receive expects
    theirs = [str(a) for a in s.actions[1]]
    early = theirs.pop(theirs.index("s3RA0@0"))
    theirs.insert(theirs.index("s1RA1@0"), early)
    with pytest.raises(ScheduleError, match="send #1 carries microbatch 1 but receive #1 expects 0 "
                                            "\\(of stage 0's forward, not stage 2's\\)"):
        validate_schedule(dataclasses.replace(s, actions={**s.actions, 1: [parse_action(t) for t in theirs]}))


def test_one_worker_of_several_stages_hands_over_to_itself() -> None:
    s = build_schedule(looped(1, 3), minibatches=1, microbatches=2)
    validate_schedule(s)
    transfers = [a for a in s.actions[0] if a.kind.is_transfer]
    assert transfers and all(a.peer == 0 for a in transfers)
    sim = simulate(s, Costs(forward_s=[1.0] * 3, backward_s=[2.0] * 3, output_bytes=[1e9] * 3, latency_s=1.0))
    assert sim.makespan_s == pytest.approx(2 * 9.0)  # no time on the wire: the rank is never idle


def test_the_planner_cuts_workers_times_chunks_stages_and_loops_them() -> None:
    from torchpipedream.search.planner import plan as make_plan
    from torchpipedream.model.profiles import load_profile

    graph = load_profile("vgg16")
    p = make_plan(graph, "2:10GB/s", schedule="interleaved", microbatches=4, chunks=3)
    assert p.virtual and p.chunks == 3 and p.num_stages == 6 and p.schedule == "interleaved"
    assert [st.ranks for st in p.stages] == [[k % 2] for k in range(6)]
    assert [n for st in p.stages for n in st.layers] == graph.names
    busiest = max(sum(st.compute_ms + st.comm_ms for st in p.stages[r::2]) for r in range(2))
    # (μ + (p − 1)/v)/μ of the busiest worker's time per minibatch
    assert p.predicted["time_per_minibatch_s"] * 1e3 == pytest.approx(busiest * (4 + 1 / 3) / 4)
    simulate(build_schedule(p, minibatches=2))  # validated and runnable
    with pytest.raises(PlanError, match="multiple of the 2 workers, got 3"):
        make_plan(graph, "2:10GB/s", schedule="interleaved", microbatches=3)


@pytest.mark.parametrize("kind, place", [("interleaved", lambda k: k % 2), ("zb-v", lambda k: k if k < 2 else 3 - k)])
def test_the_cut_balances_the_workers_not_only_the_stages(kind: str, place) -> None:
    """The straight plan of 4 balanced stages, placed looped or in a V, can leave one worker with
    much more than the other; the planner moves the cuts to balance the workers."""
    from torchpipedream.search.planner import plan as make_plan
    from torchpipedream.model.profiles import load_profile

    graph = load_profile("vgg16")
    p = make_plan(graph, "2:10GB/s", schedule=kind, microbatches=4)
    balanced = make_plan(graph, "4:10GB/s", schedule="flush", straight=True, num_stages=4, microbatches=4)

    def busiest(stages) -> float:
        return max(sum(st.compute_ms + st.comm_ms for k, st in enumerate(stages) if place(k) == r) for r in (0, 1))

    assert [st.ranks for st in p.stages] == [[place(k)] for k in range(4)]
    assert busiest(p.stages) < 0.95 * busiest(balanced.stages)
    assert p.meta["planner"].get("rebalanced_for_workers")


@pytest.mark.parametrize("many", [False, True])
def test_the_cuts_worth_simulating_include_the_best_where_one_block_moves_stop_short(many: bool, monkeypatch) -> None:
    """Blocks of times 8 8 9 4 6 4, cut into 4 stages in a V on 2 workers from the stage-balanced
    cut [8] [8] [9 4] [6 4] (workers 18 and 21): no boundary moved by one block lowers 21, but
    [8] [8 9] [4 6] [4] gives 12 and 20. Where every cut can be tried, the best (what every
    cut, enumerated here, gives at best) comes first; where there are too many, the local search
    ends where no single boundary move helps. The starting cut is always last."""
    import itertools

    from torchpipedream.search import planner
    from torchpipedream.plans.plan import v_shape_rank

    times = [8.0, 8.0, 9.0, 4.0, 6.0, 4.0]

    def stage_time(k, i, j):
        return sum(times[i:j + 1])

    def busiest(bounds) -> float:
        load = [0.0, 0.0]
        for k in range(4):
            load[v_shape_rank(k, 2)] += sum(times[bounds[k]:bounds[k + 1]])
        return max(load)

    best = min(busiest([0, *c, 6]) for c in itertools.combinations(range(1, 6), 3))
    assert best == 20.0
    if many:  # as if the model had too many blocks to try every cut
        monkeypatch.setattr(planner, "EXHAUSTIVE_CUTS", 1)
    start = [(0, 0, 1), (1, 1, 1), (2, 3, 1), (4, 5, 1)]
    cuts = planner._worker_cuts([None] * 6, start, v_shape_rank, 2, stage_time)
    assert cuts[-1] == start and len(cuts) == len({tuple(c) for c in cuts})
    values = [busiest([i for i, _, _ in c] + [6]) for c in cuts]
    if not many:
        assert values[0] == best and len(cuts) <= planner.SIMULATED_CUTS + 2
        return
    assert cuts == [start] and values == [21.0]  # the local search stays at the start:
    bounds = [0, 1, 2, 4, 6]
    for k in range(1, 4):
        for moved in range(bounds[k - 1] + 1, bounds[k + 1]):
            assert busiest(bounds[:k] + [moved] + bounds[k + 1:]) >= 21.0


def test_train_takes_virtual_stages_and_refuses_a_plan_of_another_placement(tmp_path) -> None:
    """`train` runs interleaved and zb-v (their checkpoints hold every stage of a worker); a plan
    file whose placement does not fit the --schedule is refused by name, before anything starts."""
    from torchpipedream.model.graph import Layer, LayerGraph
    from torchpipedream.train.config import TrainConfig, TrainError, check_options
    from torchpipedream.train.preparation import _choose_plan

    for kind in ("interleaved", "zb-v"):
        check_options(TrainConfig(schedule=kind))
    graph = LayerGraph(layers=[Layer(name=f"l{i}", forward_ms=1.0, backward_ms=2.0) for i in range(4)],
                       edges=[(f"l{i}", f"l{i + 1}") for i in range(3)], batch_size=8)
    path = tmp_path / "looped.json"
    looped(2, 2).save(path)
    chosen = _choose_plan(TrainConfig(plan_file=str(path), schedule="interleaved"), graph, 2, None)
    assert chosen.virtual and chosen.schedule == "interleaved"
    with pytest.raises(TrainError, match="--schedule flush: the plan puts several stages on one worker .* use "
                                         "interleaved, zb-v"):
        _choose_plan(TrainConfig(plan_file=str(path), schedule="flush"), graph, 2, None)


def test_the_cut_search_charges_each_stage_what_evaluate_charges_it() -> None:
    """``_straight_stage_ms`` (the virtual planner's per-stage score, cached) equals, bit for
    bit, each stage's time plus outgoing transfer in ``evaluate`` of whole straight cuts, on a
    profile with weights and transfers across a two-level topology."""
    import itertools

    from torchpipedream.model.profiles import load_profile
    from torchpipedream.plans.topology import Topology
    from torchpipedream.search.planner import _planning_blocks, evaluate, _straight_stage_ms

    blocks = _planning_blocks(load_profile("alexnet"), False)
    topo = Topology.from_any("2x2:10GB/s,1.25GB/s")
    n, stages = len(blocks), 4
    for inner in itertools.islice(itertools.combinations(range(1, n), stages - 1), 0, None, 37):
        bounds = [0, *inner, n]
        cut = [(bounds[k], bounds[k + 1] - 1, 1) for k in range(stages)]
        ev = evaluate(blocks, topo, cut, "flush", 4)
        expected = [ev.stage_ms[k] + (ev.cut_ms[k] if k < stages - 1 else 0.0) for k in range(stages)]
        assert [_straight_stage_ms(blocks, topo, 4, stages, k, i, j) for k, (i, j, _) in enumerate(cut)] == expected
