"""Schedule generators: orders, placement and weight versions against the paper's formulas."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest

from torchpipedream.schedule.actions import Kind, Schedule
from torchpipedream.plans.plan import Plan, Stage
from torchpipedream.plans.kinds import SCHEDULE_KINDS
from torchpipedream.schedule import orders
from torchpipedream.schedule.build import ScheduleBuildError, build_schedule
from torchpipedream.schedule.orders import order_function
from torchpipedream.schedule.placement import warmup_depth


def straight(n: int, **kw) -> Plan:
    return Plan.straight([[f"l{i}"] for i in range(n)], **kw)


def replicated(reps: list[int]) -> Plan:
    stages, r = [], 0
    for i, k in enumerate(reps):
        stages.append(Stage(layers=[f"l{i}"], replicas=k, ranks=list(range(r, r + k))))
        r += k
    return Plan(stages=stages)


def compute(sched: Schedule, rank: int) -> list[str]:
    return [f"{a.kind.value}{a.id}" for a in sched.actions[rank] if a.kind.is_compute]


def versions(sched: Schedule, kind: Kind) -> dict[tuple[int, int], int]:
    """(stage, id) -> version of every F (or B)."""
    return {(a.stage, a.id): a.version for acts in sched.actions.values() for a in acts if a.kind is kind}


def test_registry_has_every_kind_with_a_picture() -> None:
    assert set(SCHEDULE_KINDS) == {"pipedream", "2bw", "flush", "gpipe", "zb-h1", "zb-h2", "interleaved", "zb-v",
                                   "zb-2bw", "naive"}
    for kind in SCHEDULE_KINDS.values():
        fn = order_function(kind)
        assert "F0" in (fn.__doc__ or ""), f"{fn.__name__} needs an ASCII picture"


def test_every_kind_names_a_generator_and_every_generator_belongs_to_a_kind() -> None:
    generators = {name for name, fn in vars(orders).items() if inspect.isfunction(fn) and fn.__module__ == orders.__name__
                  and not name.startswith("_") and name != "order_function"}
    assert {kind.order for kind in SCHEDULE_KINDS.values()} == generators
    for kind in SCHEDULE_KINDS.values():
        assert order_function(kind).__name__ == kind.order
    with pytest.raises(LookupError, match="not a generator"):
        order_function(dataclasses.replace(SCHEDULE_KINDS["flush"], order="replica_of"))


def test_pipedream_two_stage_golden() -> None:
    # The 1F1B order written out by hand from the paper's figure (2 stages, 3 minibatches).
    s = build_schedule(straight(2), "pipedream", minibatches=3)
    assert " ".join(map(str, s.actions[0])) == (
        "s0F0v0 s0SA0@1 s0F1v0 s0SA1@1 s0RG0@1 s0B0v0 s0U0v1 s0F2v1 s0SA2@1 "
        "s0RG1@1 s0B1v0 s0U1v2 s0RG2@1 s0B2v1 s0U2v3"
    )
    assert " ".join(map(str, s.actions[1])) == (
        "s1RA0@0 s1F0v0 s1B0v0 s1SG0@0 s1U0v1 s1RA1@0 s1F1v1 s1B1v1 s1SG1@0 s1U1v2 "
        "s1RA2@0 s1F2v2 s1B2v2 s1SG2@0 s1U2v3"
    )


@pytest.mark.parametrize("n", [1, 2, 4, 7])
def test_pipedream_warmup_and_stashed_versions(n: int) -> None:
    t_count = 3 * n + 2
    s = build_schedule(straight(n), "pipedream", minibatches=t_count)
    for st in range(n):
        order = compute(s, st)
        assert order.index("B0") == n - st  # n − s forwards first (0-indexed)
        # then strictly alternating B, F while forwards remain
        steady = order[n - st: 2 * t_count - (n - st)]
        assert all(x[0] == "BF"[k % 2] for k, x in enumerate(steady))
    fv, bv = versions(s, Kind.FORWARD), versions(s, Kind.BACKWARD)
    for (st, t), v in fv.items():
        assert v == max(0, t - (n - 1 - st))  # w_s^(t−n+s), 1-indexed s
        assert bv[(st, t)] == v  # weight stashing


def test_vertical_sync_uses_input_stage_version() -> None:
    n = 4
    s = build_schedule(straight(n), "pipedream", minibatches=12, vertical_sync=True)
    for (st, t), v in versions(s, Kind.FORWARD).items():
        assert v == max(0, t - n + 1)
    for (st, t), v in versions(s, Kind.BACKWARD).items():
        assert v == max(0, t - n + 1)
    assert s.options == {"vertical_sync": True}


def test_naive_backward_uses_newer_weights() -> None:
    s = build_schedule(straight(3), "naive", minibatches=6)
    fv, bv = versions(s, Kind.FORWARD), versions(s, Kind.BACKWARD)
    assert fv == versions(build_schedule(straight(3), "pipedream", minibatches=6), Kind.FORWARD)
    stale = [k for k in fv if bv[k] != fv[k]]
    assert stale and all(bv[k] > fv[k] for k in stale)
    for acts in s.actions.values():  # B uses the newest version at its own position
        ups = 0
        for a in acts:
            if a.kind is Kind.OPTIMIZER_STEP:
                ups += 1
            elif a.kind is Kind.BACKWARD:
                assert a.version == ups


@pytest.mark.parametrize("kind", ["flush", "gpipe", "2bw"])
def test_batched_versions(kind: str) -> None:
    m, batches = 4, 5
    s = build_schedule(straight(4), kind, minibatches=batches, microbatches=m)
    assert s.microbatches == m
    want = (lambda t: t) if kind != "2bw" else (lambda t: max(0, t - 1))
    for kd in (Kind.FORWARD, Kind.BACKWARD):
        vs = versions(s, kd)
        assert len(vs) == 4 * m * batches
        for (st, i), v in vs.items():
            assert v == want(i // m)


def test_flush_drains_before_next_batch_and_warmup() -> None:
    n, m = 4, 6
    s = build_schedule(straight(n), "flush", minibatches=3, microbatches=m)
    for r, acts in s.actions.items():
        kinds = [(a.kind, a.id) for a in acts if a.kind is not Kind.SEND_ACT and not a.kind.is_transfer]
        order = compute(s, r)
        assert order.index("B0") == min(n - r, m)
        for t in range(3):
            u = kinds.index((Kind.OPTIMIZER_STEP, t))
            before = {i for k, i in kinds[:u] if k is Kind.BACKWARD}
            after = {i for k, i in kinds[u:] if k.is_compute}
            assert set(range(t * m + m)) <= before and all(i >= (t + 1) * m for i in after)


def test_gpipe_all_forwards_then_reverse_backwards() -> None:
    s = build_schedule(straight(3), "gpipe", minibatches=2, microbatches=4)
    assert compute(s, 1) == ["F0", "F1", "F2", "F3", "B3", "B2", "B1", "B0", "F4", "F5", "F6", "F7", "B7", "B6", "B5", "B4"]


def test_2bw_no_flush_and_update_after_last_backward() -> None:
    n, m = 4, 4
    s = build_schedule(straight(n), "2bw", minibatches=4, microbatches=m)
    order = compute(s, 0)
    # no flush: a forward of batch 1 runs before the last backward of batch 0
    assert order.index("F4") < order.index("B3")
    acts = [str(a) for a in s.actions[0]]
    assert acts.index("s0U0v1") == acts.index("s0B3v0") + 1


def test_replicas_round_robin_and_allreduce() -> None:
    plan = replicated([2, 1, 3])
    s = build_schedule(plan, "pipedream", minibatches=12)
    for st, stage in enumerate(plan.stages):
        for q, rank in enumerate(stage.ranks):
            ids = [a.id for a in s.actions[rank] if a.kind is Kind.FORWARD]
            assert ids == [t for t in range(12) if t % stage.replicas == q]
            ups = [str(a) for a in s.actions[rank] if a.kind in (Kind.ALLREDUCE, Kind.OPTIMIZER_STEP)]
            rounds = math.ceil(12 / stage.replicas)
            if stage.replicas > 1:
                assert [u for u in ups if "AR" in u] == [f"s{st}{'r%d' % q if q else ''}AR{u}" for u in range(rounds)]
            assert len([u for u in ups if "U" in u]) == rounds
    # every backward on the rank that ran its forward; transfers name the right peers
    for rank, acts in s.actions.items():
        f = {a.id for a in acts if a.kind is Kind.FORWARD}
        assert f == {a.id for a in acts if a.kind is Kind.BACKWARD}
        for a in acts:
            if a.kind is Kind.SEND_ACT:
                assert a.peer == plan.stages[a.stage + 1].ranks[a.id % plan.stages[a.stage + 1].replicas]


def test_input_stage_admits_noam() -> None:
    plan = replicated([2, 1, 1, 1, 1])  # 6 workers, 2 input replicas: NOAM = 3
    assert warmup_depth(plan, 0) == 3
    s = build_schedule(plan, "pipedream", minibatches=20)
    assert compute(s, 0)[:4] == ["F0", "F2", "F4", "B0"]


def test_defaults_from_plan_and_round_trip(tmp_path) -> None:
    plan = straight(3, schedule="flush", microbatches=3)
    s = build_schedule(plan, minibatches=2)
    assert (s.kind, s.microbatches) == ("flush", 3)
    s.save(tmp_path / "s.json")
    back = Schedule.load(tmp_path / "s.json")
    assert back.actions == s.actions and back.kind == "flush" and back.microbatches == 3


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(kind="zigzag"), "unknown schedule"),
        (dict(kind="pipedream", minibatches=0), "minibatches must be a positive"),
        (dict(kind="flush", microbatches=0), "microbatches must be a positive"),
        (dict(kind="pipedream", microbatches=4), "does not split"),
        (dict(kind="gpipe", vertical_sync=True), "vertical_sync"),
    ],
)
def test_bad_arguments(kwargs: dict, needle: str) -> None:
    with pytest.raises(ScheduleBuildError, match=needle):
        build_schedule(straight(2), **kwargs)


def test_2bw_needs_microbatches_multiple_of_replicas() -> None:
    with pytest.raises(ScheduleBuildError, match="multiple of every stage's replica count.*microbatches = 4"):
        build_schedule(replicated([1, 2]), "2bw", minibatches=3, microbatches=3)
    build_schedule(replicated([1, 2]), "2bw", minibatches=3, microbatches=4)
