"""The validator: generated schedules pass; broken ones are rejected with the marked grid."""

from __future__ import annotations

import json
import math
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from torchpipedream.schedule.actions import Action, Kind, Schedule
from torchpipedream.plans.plan import Plan, Stage
from torchpipedream.schedule.build import build_schedule
from torchpipedream.schedule.validate import ScheduleError, schedule_stats, validate_schedule

KINDS = ["pipedream", "2bw", "flush", "gpipe", "naive"]


def replicated(reps: list[int]) -> Plan:
    stages, r = [], 0
    for i, k in enumerate(reps):
        stages.append(Stage(layers=[f"l{i}"], replicas=k, ranks=list(range(r, r + k))))
        r += k
    return Plan(stages=stages)


@st.composite
def schedules(draw) -> Schedule:
    n = draw(st.integers(1, 8))
    reps = draw(st.lists(st.sampled_from([1, 1, 1, 2, 3]), min_size=n, max_size=n))
    kind = draw(st.sampled_from(KINDS))
    minibatches = draw(st.integers(1, 64))
    if kind == "2bw":
        m = math.lcm(*reps) * draw(st.integers(1, 2))
    elif kind in ("flush", "gpipe"):
        m = draw(st.integers(1, 6))
    else:
        m = None
    vs = kind == "pipedream" and draw(st.booleans())
    return build_schedule(replicated(reps), kind, minibatches=minibatches, microbatches=m, vertical_sync=vs)


SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(schedules())
def test_generated_schedules_validate(sched: Schedule) -> None:
    validate_schedule(sched)
    stats = schedule_stats(sched)
    plan = sched.plan
    n = plan.num_stages
    if all(s.replicas == 1 for s in plan.stages) and sched.minibatches * sched.microbatches >= 2 * n:
        for s in range(n):
            if sched.kind == "pipedream" and not sched.options:
                assert stats.max_versions[s] == n - s  # n − s + 1 with 1-indexed s
            if sched.kind in ("flush", "gpipe", "naive"):
                assert stats.max_versions[s] == 1


def _replace(sched: Schedule, rank: int, idx: int, new: Action | None) -> Schedule:
    acts = {r: list(a) for r, a in sched.actions.items()}
    if new is None:
        del acts[rank][idx]
    else:
        acts[rank][idx] = new
    return Schedule(sched.plan, sched.kind, sched.minibatches, sched.microbatches, acts, sched.options)


def _compute_ranks(sched: Schedule) -> list[int]:
    return [r for r, a in sched.actions.items() if any(x.kind is Kind.FORWARD for x in a)]


@SETTINGS
@given(schedules(), st.data())
def test_changed_version_is_rejected(sched: Schedule, data) -> None:
    rank = data.draw(st.sampled_from(_compute_ranks(sched)))
    idxs = [i for i, a in enumerate(sched.actions[rank]) if a.kind.is_compute]
    i = data.draw(st.sampled_from(idxs))
    a = sched.actions[rank][i]
    delta = data.draw(st.sampled_from([-1, 1])) if a.version else 1
    bad = Action(a.stage, a.kind, a.id, a.replica, a.version + delta, a.peer)
    with pytest.raises(ScheduleError) as exc:
        validate_schedule(_replace(sched, rank, i, bad))
    assert f">>{bad}<<" in str(exc.value)


@SETTINGS
@given(schedules(), st.data())
def test_backward_swapped_before_forward_is_rejected(sched: Schedule, data) -> None:
    rank = data.draw(st.sampled_from(_compute_ranks(sched)))
    acts = list(sched.actions[rank])
    f = data.draw(st.sampled_from([i for i, a in enumerate(acts) if a.kind is Kind.FORWARD]))
    b = next(i for i, a in enumerate(acts) if a.kind is Kind.BACKWARD and a.id == acts[f].id)
    acts[f], acts[b] = acts[b], acts[f]
    broken = Schedule(sched.plan, sched.kind, sched.minibatches, sched.microbatches, {**sched.actions, rank: acts}, sched.options)
    with pytest.raises(ScheduleError, match=">>"):
        validate_schedule(broken)


@SETTINGS
@given(schedules(), st.data())
def test_dropped_send_is_rejected(sched: Schedule, data) -> None:
    sends = [(r, i) for r, acts in sched.actions.items() for i, a in enumerate(acts) if a.kind.is_send]
    if not sends:
        return
    r, i = data.draw(st.sampled_from(sends))
    with pytest.raises(ScheduleError, match="never sen|never receive|waits for"):
        validate_schedule(_replace(sched, r, i, None))


def test_swapped_sends_break_fifo_matching() -> None:
    s = build_schedule(replicated([1, 1, 1]), "gpipe", minibatches=1, microbatches=3)
    acts = list(s.actions[0])
    a, b = [i for i, x in enumerate(acts) if x.kind is Kind.SEND_ACT][:2]
    acts[a], acts[b] = acts[b], acts[a]  # SA1 now goes out before SA0 (both after their F)
    # move F1 before the first send so "send after compute" still holds
    f1 = next(i for i, x in enumerate(acts) if x.kind is Kind.FORWARD and x.id == 1)
    acts.insert(a, acts.pop(f1))
    bad = Schedule(s.plan, s.kind, 1, 3, {**s.actions, 0: acts})
    with pytest.raises(ScheduleError, match="matched in order: send #0 carries microbatch 1 but receive #0 expects 0"):
        validate_schedule(bad)


def test_deadlock_reports_cycle_and_marks_both_ranks() -> None:
    s = build_schedule(replicated([1, 1]), "pipedream", minibatches=3)
    acts = list(s.actions[0])
    rg = next(i for i, a in enumerate(acts) if a.kind is Kind.RECV_GRAD)
    acts.insert(0, acts.pop(rg))  # wait for gradient 0 before sending activation 0
    with pytest.raises(ScheduleError) as exc:
        validate_schedule(Schedule(s.plan, s.kind, 3, 1, {**s.actions, 0: acts}))
    msg = str(exc.value)
    assert "deadlock: cycle 0 -> 1 -> 0" in msg
    assert ">>s0RG0@1<<" in msg and ">>s1RA0@0<<" in msg
    assert re.search(r"^rank 0 ", msg, re.M) and re.search(r"^rank 1 ", msg, re.M)


def test_allreduce_before_its_backward_rejected() -> None:
    s = build_schedule(replicated([2, 1]), "pipedream", minibatches=2)
    acts = list(s.actions[1])
    acts.insert(0, acts.pop(next(i for i, a in enumerate(acts) if a.kind is Kind.ALLREDUCE)))
    with pytest.raises(ScheduleError, match="all-reduce of update 0 runs before the backward of microbatch 1"):
        validate_schedule(Schedule(s.plan, s.kind, 2, 1, {**s.actions, 1: acts}))


def test_allreduce_interlock_deadlock_detected(monkeypatch) -> None:
    # The failure the 2bw restriction prevents: with 1 microbatch per batch and 2 input replicas,
    # replica 1 all-reduces batch 0 (no share of it) while stage 1 still needs its forward of batch 1.
    import torchpipedream.schedule.build as schedules

    monkeypatch.setattr(schedules, "_check_shares", lambda plan, kind, m: None)
    s = schedules.build_schedule(replicated([2, 1, 1]), "2bw", minibatches=6, microbatches=1)
    with pytest.raises(ScheduleError, match=r"deadlock: cycle .*waits at s0r1AR0 for rank 0"):
        validate_schedule(s)


def test_inflight_bound_enforced() -> None:
    # a gpipe-shaped order labelled pipedream stashes more activations than 1F1B's warm-up allows
    s = build_schedule(replicated([1, 1]), "gpipe", minibatches=1, microbatches=4)
    acts = {r: [Action(a.stage, a.kind, a.id, a.replica, 0) if a.kind.is_compute else a
                for a in lst if a.kind is not Kind.OPTIMIZER_STEP] for r, lst in s.actions.items()}
    with pytest.raises(ScheduleError, match=r"3 activations stashed on stage 0; a pipedream schedule keeps at most 2(.|\n)*>>s0F2v0<<"):
        validate_schedule(Schedule(s.plan, "pipedream", 4, 1, acts))


def _edit_file(tmp_path, sched: Schedule, rank: int, old: str, new: str):
    path = tmp_path / "edited.json"
    sched.save(path)
    data = json.loads(path.read_text())
    text = data["actions"][str(rank)]
    assert f" {old} " in f" {text} "
    data["actions"][str(rank)] = f" {text} ".replace(f" {old} ", f" {new} ", 1).strip()
    path.write_text(json.dumps(data))
    return Schedule.load(path)


def test_hand_edited_file_with_wrong_version_rejected(tmp_path) -> None:
    s = build_schedule(replicated([1, 1, 1, 1]), "pipedream", minibatches=8)
    edited = _edit_file(tmp_path, s, 1, "s1F5v3", "s1F5v2")
    with pytest.raises(ScheduleError) as exc:
        validate_schedule(edited)
    msg = str(exc.value)
    assert "rank 1" in msg and "version 3, not 2" in msg and ">>s1F5v2<<" in msg


def test_hand_edited_file_that_deadlocks_rejected(tmp_path) -> None:
    s = build_schedule(replicated([1, 1, 1]), "flush", minibatches=2, microbatches=3)
    # stage 1 waits for the gradient of microbatch 0 before receiving microbatch 0's activations
    edited = _edit_file(tmp_path, s, 1, "s1RA0@0", "s1RG0@2 s1RA0@0")
    edited.actions[1] = [a for k, a in enumerate(edited.actions[1])
                         if not (a.kind is Kind.RECV_GRAD and a.id == 0 and k > 1)]
    with pytest.raises(ScheduleError, match=r"deadlock(.|\n)*>>s1RG0@2<<"):
        validate_schedule(edited)


def test_structural_errors() -> None:
    s = build_schedule(replicated([1, 1]), "pipedream", minibatches=2)
    wrong_stage = _replace(s, 0, 0, Action(1, Kind.FORWARD, 0, 0, 0))
    with pytest.raises(ScheduleError, match="runs stage 0 replica 0, but the action is for stage 1"):
        validate_schedule(wrong_stage)
    wrong_peer = _replace(s, 0, 1, Action(0, Kind.SEND_ACT, 0, 0, None, 0))
    with pytest.raises(ScheduleError, match="is on rank 1 of the neighbouring stage, not rank 0"):
        validate_schedule(wrong_peer)
    missing_rank = Schedule(s.plan, s.kind, 2, 1, {0: s.actions[0]})
    with pytest.raises(ScheduleError, match="lists for"):
        validate_schedule(missing_rank)


def test_grid_shows_window_for_long_schedules() -> None:
    s = build_schedule(replicated([1, 1]), "pipedream", minibatches=40)
    k = next(i for i, a in enumerate(s.actions[0]) if i >= 100 and a.kind is Kind.FORWARD)
    a = s.actions[0][k]
    bad = _replace(s, 0, k, Action(a.stage, a.kind, a.id, a.replica, (a.version or 0) + 5))
    with pytest.raises(ScheduleError) as exc:
        validate_schedule(bad)
    msg = str(exc.value)
    assert re.search(rf"steps {k - 8}\.\.{k + 8} of {len(s.actions[0])}", msg)
    assert f">>{bad.actions[0][k]}<<" in msg and len(msg.splitlines()) == 5
