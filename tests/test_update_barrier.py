"""Which schedules can take a reduction over every rank at each update (clipping by the global
gradient norm): ``schedule.validate.update_barrier_problem``, checked on every kind and on
schedules broken on purpose, and a pipeline with virtual stages clipping as torch does."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from torchpipedream.plans.kinds import schedule_kind
from torchpipedream.plans.plan import Plan
from torchpipedream.runtime import Pipeline
from torchpipedream.schedule.actions import Kind
from torchpipedream.schedule.build import build_schedule
from torchpipedream.schedule.validate import update_barrier_problem, validate_schedule

ONE_STAGE_PER_RANK = ["pipedream", "2bw", "flush", "gpipe", "zb-h1", "zb-h2", "zb-2bw", "naive"]


def _straight(kind: str, stages: int, m: int) -> Plan:
    return Plan.straight([[f"l{i}"] for i in range(stages)], schedule=kind, microbatches=m)


@pytest.mark.parametrize("kind", ONE_STAGE_PER_RANK)
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_every_kind_with_one_stage_per_rank_can_wait_for_the_global_norm(kind, stages):
    m = 4 if schedule_kind(kind).microbatched else 1
    for vertical_sync in ([False, True] if kind == "pipedream" else [False]):
        schedule = build_schedule(_straight(kind, stages, m), kind, 6, microbatches=m, vertical_sync=vertical_sync)
        assert update_barrier_problem(schedule) is None


def test_a_replicated_stage_can_too_under_a_synchronous_kind_only():
    from torchpipedream.plans.plan import Stage

    def two_one(kind: str) -> Plan:
        return Plan(stages=[Stage(layers=["a"], replicas=2, ranks=[0, 1]), Stage(layers=["b"], ranks=[2])],
                    schedule=kind, microbatches=2 if kind == "flush" else 1)

    assert update_barrier_problem(build_schedule(two_one("flush"), "flush", 5, microbatches=2)) is None
    # pipedream: the replicated stage updates once per two minibatches, the other once per minibatch
    problem = update_barrier_problem(build_schedule(two_one("pipedream"), "pipedream", 5, microbatches=1))
    assert problem is not None and "stage 0 makes 3 updates and stage 1 5" in problem


@pytest.mark.parametrize("kind", ["interleaved", "zb-v"])
def test_ranks_holding_several_stages_step_after_their_last_backward(kind):
    layers = [[f"l{i}"] for i in range(4)]
    plan = Plan.looped(layers, 2, schedule=kind, microbatches=4) if kind == "interleaved" \
        else Plan.v_shape(layers, 2, schedule=kind, microbatches=4)
    assert update_barrier_problem(build_schedule(plan, kind, 3, microbatches=4)) is None


def test_a_send_moved_after_the_step_deadlocks_with_the_barrier():
    """Rank 0 sends microbatch 1's activations only after its first update, and rank 1 takes its
    first update only after receiving them: fine without the barrier (rank 0 does not wait at
    its update), a deadlock with it."""
    schedule = build_schedule(_straight("pipedream", 2, 1), "pipedream", 6)
    zero, one = list(schedule.actions[0]), list(schedule.actions[1])
    send = next(i for i, a in enumerate(zero) if a.kind is Kind.SEND_ACT and a.id == 1)
    sent = zero.pop(send)
    zero.insert(next(i for i, a in enumerate(zero) if a.kind is Kind.OPTIMIZER_STEP) + 1, sent)
    step = one.pop(next(i for i, a in enumerate(one) if a.kind is Kind.OPTIMIZER_STEP))
    one.insert(next(i for i, a in enumerate(one) if a.kind is Kind.RECV_ACT and a.id == 1) + 1, step)
    broken = dataclasses.replace(schedule, actions={0: zero, 1: one})
    validate_schedule(broken)  # a valid schedule without the barrier
    problem = update_barrier_problem(broken)
    assert problem is not None and "wait forever" in problem


def test_a_backward_between_two_steps_of_one_update_is_named():
    schedule = build_schedule(_straight("flush", 1, 2), "flush", 1, microbatches=2)
    actions = list(schedule.actions[0])
    step = next(i for i, a in enumerate(actions) if a.kind is Kind.OPTIMIZER_STEP)
    # a second stage's step of the same update before a backward (as virtual stages do)
    early = dataclasses.replace(actions[step], stage=1)
    first_backward = next(i for i, a in enumerate(actions) if a.kind is Kind.BACKWARD)
    actions.insert(first_backward, early)
    broken = dataclasses.replace(schedule, actions={0: actions})
    problem = update_barrier_problem(broken)
    assert problem is not None and "before its s0B" in problem


def test_a_pipeline_with_virtual_stages_clips_as_clip_grad_norm_does():
    """One process holding four stages (interleaved): one clipped step equals torch's."""
    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh())

    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 4, generator=g) * 10
    plan = Plan.looped([["input_1", "_0"], ["_1"], ["_2"], ["_3"]], 1, schedule="interleaved", microbatches=2)
    pipe = Pipeline(model(), plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.MSELoss(),
                    clip_grad_norm=0.1)
    pipe.train_step((x, y))
    ref = model()
    nn.MSELoss()(ref(x), y).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    assert norm > 0.1 and pipe.grad_norms == pytest.approx([float(norm)], rel=1e-5)
    with torch.no_grad():
        for p in ref.parameters():
            p -= 0.1 * p.grad
    for name, value in ref.state_dict().items():
        torch.testing.assert_close(pipe.state_dict()[name], value, atol=1e-6, rtol=1e-5)
