"""The simulator against closed forms: bubbles, steady-state throughput, transfers, all-reduce, memory."""

from __future__ import annotations

import pytest

from torchpipedream.schedule.actions import Kind, Schedule
from torchpipedream.plans.plan import Plan, Stage
from torchpipedream.schedule.build import build_schedule
from torchpipedream.sim.simulator import Costs, SimulationError, simulate
from torchpipedream.schedule.validate import ScheduleError

F, B = 1.0, 2.0


def straight(n: int, **kw) -> Plan:
    return Plan.straight([[f"l{i}"] for i in range(n)], **kw)


def equal(n: int, **kw) -> Costs:
    return Costs(forward_s=[F] * n, backward_s=[B] * n, **kw)


@pytest.mark.parametrize("kind", ["gpipe", "flush"])
@pytest.mark.parametrize("p, m, batches", [(2, 1, 1), (4, 4, 1), (4, 8, 3), (3, 5, 2), (6, 2, 1)])
def test_bubble_closed_form(kind: str, p: int, m: int, batches: int) -> None:
    res = simulate(build_schedule(straight(p), kind, minibatches=batches, microbatches=m), equal(p))
    assert res.makespan_s == pytest.approx(batches * (m + p - 1) * (F + B))
    assert res.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert res.max_versions == [1] * p


@pytest.mark.parametrize("p", [2, 4, 5])
def test_pipedream_no_steady_bubble_and_versions(p: int) -> None:
    n_mb = 12 * p
    res = simulate(build_schedule(straight(p, batch_size=8), "pipedream", minibatches=n_mb), equal(p))
    assert res.steady_bubble_fraction == pytest.approx(0.0, abs=1e-9)
    assert res.steady_minibatches_per_s == pytest.approx(1 / (F + B))
    assert res.steady_samples_per_s == pytest.approx(8 / (F + B))
    # fill + drain: every minibatch costs F+B on the slowest (every) stage, plus (p−1)(F+B)
    assert res.makespan_s == pytest.approx((n_mb + p - 1) * (F + B))
    assert res.max_versions == [p - s for s in range(p)]  # n − s + 1, 1-indexed
    assert res.max_inflight == [p - s for s in range(p)]


def test_2bw_no_steady_bubble_two_versions() -> None:
    p, m = 4, 4
    res = simulate(build_schedule(straight(p), "2bw", minibatches=16, microbatches=m), equal(p))
    assert res.steady_bubble_fraction == pytest.approx(0.0, abs=1e-9)
    assert res.steady_minibatches_per_s == pytest.approx(1 / (m * (F + B)))
    assert res.max_versions == [2] * p


def test_transfer_latency_and_bandwidth_on_the_critical_path() -> None:
    plan = straight(2)
    costs = Costs(forward_s=[1.0, 1.0], backward_s=[2.0, 2.0], output_bytes=[4e6, 0.0], bandwidth_Bps=1e6, latency_s=0.5)
    res = simulate(build_schedule(plan, "pipedream", minibatches=1), costs)
    hop = 0.5 + 4.0
    assert res.makespan_s == pytest.approx(1 + hop + 1 + 2 + hop + 2)
    sa = next(e for e in res.trace.events if e.kind == "SA")
    assert (sa.start_s, sa.end_s, sa.bytes) == (pytest.approx(1.0), pytest.approx(1 + hop), 4_000_000)


def test_busy_link_delays_next_message_but_not_the_sender() -> None:
    plan = straight(2)
    costs = Costs(forward_s=[0.1, 0.1], backward_s=[0.1, 0.1], output_bytes=[1e6, 0.0], bandwidth_Bps=1e6)
    res = simulate(build_schedule(plan, "gpipe", minibatches=1, microbatches=4), costs)
    ev = res.trace.events
    f0 = sorted((e.start_s for e in ev if e.rank == 0 and e.kind == "F"))
    assert f0 == pytest.approx([0.0, 0.1, 0.2, 0.3])  # sends do not block the sender's compute
    arrivals = sorted(e.end_s for e in ev if e.kind == "SA")
    assert arrivals == pytest.approx([1.1, 2.1, 3.1, 4.1])  # one message at a time on the link
    f1 = sorted(e.start_s for e in ev if e.rank == 1 and e.kind == "F")
    assert f1 == pytest.approx(arrivals)  # receiver waits for arrival


def test_allreduce_ring_cost() -> None:
    r, w, bw = 4, 8e6, 1e6
    plan = Plan(stages=[Stage(layers=["a"], replicas=r, ranks=list(range(r)))])
    costs = Costs(forward_s=[1.0], backward_s=[2.0], parameter_bytes=[w], bandwidth_Bps=bw, latency_s=0.01,
                  accumulate_Bps=float("inf"))
    res = simulate(build_schedule(plan, "pipedream", minibatches=r), costs)
    ring = 2 * (r - 1) / r * w / bw + 2 * (r - 1) * 0.01
    assert res.makespan_s == pytest.approx(3.0 + ring)
    ars = [e for e in res.trace.events if e.kind == "AR"]
    assert len(ars) == r and all(e.end_s == pytest.approx(3.0 + ring) for e in ars)


def test_allreduce_efficiency_comes_from_the_plans_topology() -> None:
    # e = 0.25: the ring formula at a quarter of the link's speed, as the planner charges it.
    r, w = 2, 8e6
    plan = Plan(stages=[Stage(layers=["a"], replicas=r, ranks=list(range(r)))], topology="2:1MB/s~0us%25")
    res = simulate(build_schedule(plan, "pipedream", minibatches=r),
                   Costs.from_plan(plan, forward_s=[1.0], backward_s=[2.0], parameter_bytes=[w],
                                   accumulate_Bps=float("inf")))
    assert res.makespan_s == pytest.approx(3.0 + 2 * (r - 1) / r * w / (0.25 * 1e6))


@pytest.mark.parametrize("m", [1, 3])
def test_backwards_that_accumulate_pay_a_pass_over_the_gradients(m: int) -> None:
    # flush on one unreplicated stage, 2 batches of m microbatches: the first B of each update
    # hands its gradient over, the other m − 1 add theirs (|w| / accumulate_Bps each).
    w, acc = 6.0, 2.0
    plan = Plan.straight([["a"]])
    sched = build_schedule(plan, "flush", minibatches=2, microbatches=m)
    res = simulate(sched, Costs(forward_s=[F], backward_s=[B], parameter_bytes=[w], accumulate_Bps=acc))
    assert res.makespan_s == pytest.approx(2 * m * (F + B) + 2 * (m - 1) * w / acc)
    # on a replicated stage every B adds into the persistent all-reduce buffers
    dp = Plan(stages=[Stage(layers=["a"], replicas=2, ranks=[0, 1])])
    both = simulate(build_schedule(dp, "flush", minibatches=1, microbatches=2 * m), Costs(
        forward_s=[F], backward_s=[B], parameter_bytes=[w], accumulate_Bps=acc, bandwidth_Bps=float("inf")))
    assert both.makespan_s == pytest.approx(m * (F + B + w / acc))
    with pytest.raises(SimulationError, match="accumulate_Bps"):
        simulate(sched, Costs(forward_s=[F], backward_s=[B], accumulate_Bps=0.0))


def test_measured_allreduce_replaces_the_ring_formula() -> None:
    # A stage whose all-reduce was measured (Costs.allreduce_s) is charged that time, not the
    # formula's; an unreplicated stage (None) is charged nothing; bad entries are refused.
    plan = Plan(stages=[Stage(layers=["a"], replicas=2, ranks=[0, 1]), Stage(layers=["b"], ranks=[2])])
    costs = Costs(forward_s=[1.0, 1.0], backward_s=[2.0, 2.0], parameter_bytes=[8e6, 1.0], bandwidth_Bps=1e6,
                  allreduce_s=[0.75, None])
    res = simulate(build_schedule(plan, "pipedream", minibatches=2), costs)
    ars = [e for e in res.trace.events if e.kind == "AR"]
    assert {e.rank for e in ars} == {0, 1} and len(ars) == 2  # one update per replica (one minibatch each)
    assert max(e.end_s for e in ars) - max(e.start_s for e in ars) == pytest.approx(0.75)  # from the last arrival
    formula = simulate(build_schedule(plan, "pipedream", minibatches=2), Costs(
        forward_s=[1.0, 1.0], backward_s=[2.0, 2.0], parameter_bytes=[8e6, 1.0], bandwidth_Bps=1e6))
    assert formula.makespan_s > res.makespan_s + 7  # the ring moves 8 MB at 1 MB/s: 8 s, not 0.75 s
    for bad, match in (([0.5], "2 stages"), ([-1.0, None], ">= 0")):
        with pytest.raises(SimulationError, match=match):
            simulate(build_schedule(plan, "pipedream", minibatches=2), Costs(
                forward_s=[1.0, 1.0], backward_s=[2.0, 2.0], allreduce_s=bad))


def test_allreduce_waits_for_slowest_replica() -> None:
    plan = Plan(stages=[Stage(layers=["a"], replicas=2, ranks=[0, 1]), Stage(layers=["b"], ranks=[2])])
    costs = Costs(forward_s=[1.0, 1.0], backward_s=[1.0, 1.0], bandwidth_Bps=float("inf"))
    res = simulate(build_schedule(plan, "pipedream", minibatches=2), costs)
    ar = {e.rank: e for e in res.trace.events if e.kind == "AR"}
    assert ar[0].end_s == ar[1].end_s == max(e.end_s for e in res.trace.events if e.kind == "B" and e.stage == 0)


def test_peak_memory_formula() -> None:
    p = 3
    costs = equal(p, parameter_bytes=[100.0] * p, activation_bytes=[0.0, 10.0, 10.0], optimizer_state_factor=2.0)
    res = simulate(build_schedule(straight(p), "pipedream", minibatches=10), costs)
    # weights × versions (3, 2, 1) + 2 × weights + stashed activations × in flight (3, 2, 1)
    assert res.peak_memory_bytes == pytest.approx([100 * 5 + 0, 100 * 4 + 20, 100 * 3 + 10])
    res = simulate(build_schedule(straight(p), "gpipe", minibatches=2, microbatches=4), costs)
    assert res.peak_memory_bytes == pytest.approx([300, 300 + 40, 300 + 40])


def test_costs_from_plan_and_topology() -> None:
    plan = straight(2, batch_size=4)
    plan.topology = "2:1MB/s~1ms"
    plan.stages[0].forward_ms, plan.stages[0].backward_ms, plan.stages[0].output_bytes = 40.0, 80.0, 2000
    plan.stages[1].forward_ms, plan.stages[1].backward_ms = 40.0, 80.0
    c = Costs.from_plan(plan, microbatches=2)
    assert c.forward_s == pytest.approx([0.02, 0.02]) and c.backward_s == pytest.approx([0.04, 0.04])
    assert c.output_bytes[0] == 1000 and c.activation_bytes == [0.0, 1000]
    assert c.bandwidth(0, 1) == pytest.approx(1e6) and c.latency_s == pytest.approx(1e-3)
    res = simulate(build_schedule(plan, "pipedream", minibatches=1))
    hop = 1e-3 + 2000 / 1e6
    assert res.makespan_s == pytest.approx(0.04 + hop + 0.04 + 0.08 + hop + 0.08)
    assert res.samples_per_s == pytest.approx(4 / res.makespan_s)


def test_bad_costs_and_invalid_schedule() -> None:
    sched = build_schedule(straight(2), "pipedream", minibatches=2)
    with pytest.raises(SimulationError, match="forward_s has 1 entries but the plan has 2 stages"):
        simulate(sched, Costs(forward_s=[1.0], backward_s=[1.0, 1.0]))
    with pytest.raises(SimulationError, match="must be numbers >= 0"):
        simulate(sched, Costs(forward_s=[1.0, -1.0], backward_s=[1.0, 1.0]))
    acts = {r: [a for a in lst if a.kind is not Kind.SEND_ACT] for r, lst in sched.actions.items()}
    broken = Schedule(sched.plan, sched.kind, 2, 1, acts)
    with pytest.raises(ScheduleError):
        simulate(broken, equal(2))
    with pytest.raises(SimulationError, match="stuck"):
        simulate(broken, equal(2), validate=False)


def test_trace_summary_agrees_with_result() -> None:
    res = simulate(build_schedule(straight(3), "flush", minibatches=2, microbatches=3), equal(3))
    s = res.trace.summary()
    assert s["makespan_s"] == pytest.approx(res.makespan_s)
    assert s["events"]["F"] == s["events"]["B"] == 3 * 6
    assert res.trace.meta["schedule"] == "flush"


# ----------------------------------------------------------------- against an independent reference
def _reference_makespan(sched: Schedule, costs: Costs) -> dict[tuple[int, int], float]:
    """Finish time of every action as a longest path over its dependencies, by memoised recursion.

    ready(r, k): when rank r is free after its k-th action. Sends do not occupy the rank; a
    message leaves at max(issue, previous message on the same directed link) and arrives after
    latency + bytes / bandwidth; a receive finishes at max(ready, arrival); an all-reduce ends at
    the latest replica's arrival plus the ring cost.
    """
    plan = sched.plan
    acts = sched.actions
    sends: dict[tuple[int, int], list[int]] = {}
    recvs: dict[tuple[int, int, int], int] = {}  # (src, dst, k on dst) -> index in that link's sequence
    ars: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for r, lst in acts.items():
        for k, a in enumerate(lst):
            if a.kind.is_send:
                sends.setdefault((r, a.peer), []).append(k)
            elif a.kind.is_recv:
                recvs[(a.peer, r, k)] = sum(1 for j in range(k) if lst[j].kind.is_recv and lst[j].peer == a.peer)
            elif a.kind is Kind.ALLREDUCE:
                ars.setdefault((a.stage, a.id), []).append((r, k))
    memo: dict[tuple[int, int], float] = {}
    arrive_memo: dict[tuple[int, int, int], float] = {}

    def ready(r: int, k: int) -> float:
        if k < 0:
            return 0.0
        if (r, k) in memo:
            return memo[(r, k)]
        a = acts[r][k]
        s = a.stage
        before = ready(r, k - 1)
        if a.kind is Kind.FORWARD:
            out = before + costs.forward_s[s]
        elif a.kind is Kind.BACKWARD:
            out = before + costs.backward_s[s]
        elif a.kind is Kind.OPTIMIZER_STEP:
            out = before + costs.step_s
        elif a.kind.is_send:
            out = before + costs.message_overhead_s
        elif a.kind.is_recv:
            out = max(before, arrival(a.peer, r, recvs[(a.peer, r, k)])) + costs.message_overhead_s
        else:
            group = ars[(s, a.id)]
            rr = plan.stages[s].replicas
            ring = 2 * (rr - 1) * costs.latency_s + 2 * (rr - 1) / rr * costs.parameter_bytes[s] / costs.bandwidth_Bps
            out = max(ready(o, j - 1) for o, j in group) + ring
        memo[(r, k)] = out
        return out

    def arrival(src: int, dst: int, j: int) -> float:
        if (src, dst, j) in arrive_memo:
            return arrive_memo[(src, dst, j)]
        k = sends[(src, dst)][j]
        a = acts[src][k]
        nbytes = costs.output_bytes[a.stage] if a.kind is Kind.SEND_ACT else costs.output_bytes[a.stage - 1]
        start = ready(src, k - 1) + costs.message_overhead_s
        if j > 0:
            start = max(start, arrival(src, dst, j - 1))
        out = start + costs.latency_s + nbytes / costs.bandwidth_Bps
        arrive_memo[(src, dst, j)] = out
        return out

    import sys

    old = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old, 50000))
    try:
        ends = [ready(r, len(lst) - 1) for r, lst in acts.items() if lst]
        last_msgs = [arrival(s, d, len(ks) - 1) for (s, d), ks in sends.items()]
    finally:
        sys.setrecursionlimit(old)
    return {"makespan": max(ends + last_msgs)}


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as hst  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(
    reps=hst.lists(hst.sampled_from([1, 1, 2, 3]), min_size=1, max_size=4),
    kind=hst.sampled_from(["pipedream", "flush", "gpipe", "naive", "2bw"]),
    minibatches=hst.integers(1, 10),
    m=hst.integers(1, 4),
    fw=hst.lists(hst.integers(1, 9), min_size=4, max_size=4),
    bw=hst.lists(hst.integers(1, 9), min_size=4, max_size=4),
    out=hst.lists(hst.integers(0, 5), min_size=4, max_size=4),
    lat=hst.sampled_from([0.0, 0.5]),
    ovh=hst.sampled_from([0.0, 0.125]),
)
def test_simulator_matches_longest_path_reference(reps, kind, minibatches, m, fw, bw, out, lat, ovh) -> None:
    import math

    stages, r = [], 0
    for i, k in enumerate(reps):
        stages.append(Stage(layers=[f"l{i}"], replicas=k, ranks=list(range(r, r + k))))
        r += k
    plan = Plan(stages=stages)
    n = len(reps)
    if kind == "2bw":
        m = math.lcm(*reps)
    sched = build_schedule(plan, kind, minibatches=minibatches, microbatches=None if kind in ("pipedream", "naive") else m)
    costs = Costs(forward_s=[float(x) for x in fw[:n]], backward_s=[float(x) for x in bw[:n]],
                  output_bytes=[float(x) for x in out[:n]], parameter_bytes=[3.0] * n, bandwidth_Bps=2.0,
                  latency_s=lat, step_s=0.25, message_overhead_s=ovh)
    res = simulate(sched, costs)
    assert res.makespan_s == pytest.approx(_reference_makespan(sched, costs)["makespan"])


@pytest.mark.parametrize("r0, c0, c1, expect_period", [(2, 4.0, 2.0, 2.5), (3, 6.0, 1.0, (6.0 + 4 / 3) / 3), (2, 2.0, 3.0, 3.0)])
def test_replicated_steady_throughput_is_the_slowest_stage(r0: int, c0: float, c1: float, expect_period: float) -> None:
    # PipeDream's cost model: a stage with r replicas delivers a minibatch every (C + allreduce) / r
    plan = Plan(stages=[Stage(layers=["a"], replicas=r0, ranks=list(range(r0))), Stage(layers=["b"], ranks=[r0])])
    costs = Costs(forward_s=[c0 / 4, c1 / 4], backward_s=[3 * c0 / 4, 3 * c1 / 4], parameter_bytes=[1.0, 0.0],
                  bandwidth_Bps=1.0)  # allreduce = 2(r−1)/r · 1 / 1
    res = simulate(build_schedule(plan, "pipedream", minibatches=30 * r0), costs)
    ar = 2 * (r0 - 1) / r0
    assert expect_period == pytest.approx(max((c0 + ar) / r0, c1))
    assert res.steady_minibatches_per_s == pytest.approx(1 / expect_period)


def test_optimizer_step_is_charged_per_stage_once_per_update() -> None:
    plan = straight(2, batch_size=4)
    plan.stages[0].forward_ms, plan.stages[0].backward_ms, plan.stages[0].optimizer_ms = 10.0, 20.0, 5.0
    plan.stages[1].forward_ms, plan.stages[1].backward_ms, plan.stages[1].optimizer_ms = 10.0, 20.0, 30.0
    for kind, m in (("pipedream", 1), ("flush", 2)):
        res = simulate(build_schedule(plan, kind, minibatches=3, microbatches=m), Costs.from_plan(plan, microbatches=m))
        steps = [e for e in res.trace.events if e.kind == "U"]
        assert len(steps) == 6  # 3 updates on each of the 2 stages, whatever m is
        for e in steps:
            assert e.end_s - e.start_s == pytest.approx([0.005, 0.030][e.stage])
    with pytest.raises(SimulationError, match="step_s has 1 entries"):
        simulate(build_schedule(plan, "pipedream", minibatches=2), equal(2, step_s=[0.1]))


# --------------------------------------------------------------------------- copy on update
def _runtime_copies(sched: Schedule, rank: int) -> int:
    """Replay one rank's F/B/U version bookkeeping on the runtime's WeightVersions (no compute)
    and count the copies on update it makes: an independent reference for stash_copies."""
    import torch

    from torchpipedream.runtime.weights import WeightVersions

    w = WeightVersions(torch.nn.Linear(2, 2), lambda ps: torch.optim.SGD(ps, lr=0.1))
    acts = sched.actions[rank]
    uses: dict[int, int] = {}
    for a in acts:
        if a.kind in (Kind.FORWARD, Kind.BACKWARD) and a.version is not None:
            uses[a.version] = uses.get(a.version, 0) + 1
    w.expect(uses)
    for a in acts:
        if a.kind in (Kind.FORWARD, Kind.BACKWARD) and a.version is not None:
            w.tensors(a.version)
            w.add_samples(1)
            w.release(a.version)
        elif a.kind is Kind.OPTIMIZER_STEP:
            w.step()
    return w.copies


@pytest.mark.parametrize("kind, m, vsync", [("pipedream", None, False), ("pipedream", None, True), ("2bw", 2, False),
                                            ("flush", 4, False), ("gpipe", 2, False), ("naive", None, False)])
def test_stash_copies_match_the_runtime(kind: str, m, vsync: bool) -> None:
    from torchpipedream.sim.simulator import stash_copies

    sched = build_schedule(straight(3), kind, minibatches=7, microbatches=m, vertical_sync=vsync)
    for rank in sched.actions:
        assert len(stash_copies(sched.actions[rank])) == _runtime_copies(sched, rank), (kind, rank)


def test_copy_on_update_is_charged_where_versions_are_stashed() -> None:
    # pipedream: every stage but the last keeps the replaced version for an in-flight
    # minibatch, so its U costs step + |w| / copy bandwidth; flush never copies.
    n, step, wbytes, bw = 3, 0.5, 1e9, 4e9
    costs = equal(n, step_s=step, parameter_bytes=[wbytes] * n, copy_Bps=bw)
    res = simulate(build_schedule(straight(n), "pipedream", minibatches=10), costs)
    for s in range(n):
        durations = [e.duration_s for e in res.trace.events if e.stage == s and e.kind == "U"]
        copied = [d for d in durations if d == pytest.approx(step + wbytes / bw)]
        if s == n - 1:
            assert durations == pytest.approx([step] * 10)
        else:  # steady state copies; the drain's last updates do not (nobody needs the old version)
            assert len(copied) == 10 - (n - 1 - s)
    res = simulate(build_schedule(straight(n), "flush", minibatches=3, microbatches=4), costs)
    assert all(e.duration_s == pytest.approx(step) for e in res.trace.events if e.kind == "U")
    with pytest.raises(SimulationError, match="copy_Bps"):
        simulate(build_schedule(straight(n), "flush", minibatches=1, microbatches=2), equal(n, copy_Bps=0.0))


def test_message_overhead_is_charged_to_both_ranks() -> None:
    # 2 stages, one minibatch, pipedream: s0 F SA RG B U, s1 RA F B SG U. With per-message
    # host overhead o (and no link time), the critical path is F0 + o(SA) + o(RA) + F1 + B1 +
    # o(SG) + o(RG) + B0: four overheads.
    o = 0.25
    costs = equal(2, bandwidth_Bps=float("inf"), message_overhead_s=o)
    res = simulate(build_schedule(straight(2), "pipedream", minibatches=1), costs)
    assert res.makespan_s == pytest.approx(2 * (F + B) + 4 * o)
    base = simulate(build_schedule(straight(2), "pipedream", minibatches=1), equal(2, bandwidth_Bps=float("inf")))
    assert base.makespan_s == pytest.approx(2 * (F + B))


def test_compute_slowdown_scales_compute_and_updates_not_transfers() -> None:
    # flush on 2 stages, one batch of 2 microbatches: (m + p − 1)(F + B) of compute plus the
    # update; with workers k times slower every F, B and U takes k times longer.
    n, k, step = 2, 1.5, 0.5
    sched = build_schedule(straight(n), "flush", minibatches=1, microbatches=2)
    base = simulate(sched, equal(n, step_s=step, bandwidth_Bps=float("inf")))
    slow = simulate(sched, equal(n, step_s=step, bandwidth_Bps=float("inf"), compute_slowdown=k))
    assert base.makespan_s == pytest.approx(3 * (F + B) + step)
    assert slow.makespan_s == pytest.approx(k * base.makespan_s)
    with pytest.raises(SimulationError, match="compute_slowdown"):
        simulate(sched, equal(n, compute_slowdown=0.5))


@pytest.mark.parametrize("field, value", [("batch_size", -5), ("batch_size", 0), ("batch_size", 10**20),
                                          ("microbatches", 10**20), ("microbatches", 0)])
def test_simulate_refuses_a_plan_with_an_absurd_count(field: str, value, tmp_path, capsys) -> None:
    # issue 39: batch_size -5 printed -1,429 samples/s and 10**20 printed 2.7e22
    import json

    from torchpipedream.cli import main

    plan = straight(2, batch_size=8)
    for st in plan.stages:
        st.forward_ms, st.backward_ms = F, B
    data = plan.to_dict()
    data[field] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    assert main(["simulate", str(path)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert captured.out == "" and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "plan.json" in err and field in err and "from 1 to 2**31" in err, err


@pytest.mark.parametrize("value", [float("inf"), -1.0, float("nan")])
def test_a_plan_refuses_a_stage_cost_that_is_not_finite(value) -> None:
    from torchpipedream.plans.plan import PlanError

    plan = straight(2, batch_size=8)
    plan.stages[1].forward_ms = value
    with pytest.raises(PlanError, match="stage 1: forward_ms must be a finite number >= 0"):
        plan.validate()
