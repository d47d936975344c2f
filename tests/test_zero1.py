"""A stage sharded "zero1" (issue 36, item 3): its gathers, reduce-scatters and reshards are
actions of the schedule (``UN``, ``RD``, ``RS``), which the builder places once per update, the
validator proves, the simulator prices and the runtime runs with torch's FSDP2.

The runtime's parity with one-process training is in test_sharding.py and
test_sharding_zero_bubble.py (the zero1 scenarios); here, the IR and its rules, the
simulator's charges against a hand calculation, and the collectives FSDP2 actually runs,
counted by torch's profiler.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from torchpipedream.plans.plan import Plan, Stage
from torchpipedream.runtime import Pipeline, launch
from torchpipedream.schedule.actions import Action, Kind, parse_action
from torchpipedream.schedule.build import build_schedule
from torchpipedream.schedule.validate import ScheduleError, update_barrier_problem, validate_schedule
from torchpipedream.sim.simulator import Costs, simulate

KINDS = ["flush", "gpipe", "zb-h1", "zb-h2"]
MB = 1e6


def _plan(kind: str, sharding: str = "zero1", m: int = 4, weights: float = 8 * MB) -> Plan:
    """Stage 0 on one worker, stage 1 on two replicas sharded ``sharding``."""
    return Plan(stages=[Stage(["a"], ranks=[0], forward_ms=1.0, backward_ms=2.0, parameter_bytes=int(weights),
                              output_bytes=1000),
                        Stage(["b"], replicas=2, ranks=[1, 2], sharding=sharding, forward_ms=1.0, backward_ms=2.0,
                              parameter_bytes=int(weights), output_bytes=1000)],
                schedule=kind, microbatches=m, batch_size=8)


def test_the_actions_read_and_write_their_text() -> None:
    for text, kind in (("s1UN3", Kind.UNSHARD), ("s1r1RD2", Kind.REDUCE_GRAD), ("s0RS0", Kind.RESHARD)):
        a = parse_action(text)
        assert a.kind is kind and str(a) == text and a.kind.is_gather
    assert not Kind.ALLREDUCE.is_gather


@pytest.mark.parametrize("kind", KINDS)
def test_each_update_gathers_once_reduces_after_its_last_backward_and_frees_before_its_step(kind: str) -> None:
    sched = build_schedule(_plan(kind), kind, minibatches=3)
    validate_schedule(sched)
    for rank in (1, 2):
        acts = sched.actions[rank]
        for u in range(3):
            at = {k: [i for i, a in enumerate(acts) if a.kind is k and a.id == u]
                  for k in (Kind.UNSHARD, Kind.REDUCE_GRAD, Kind.RESHARD, Kind.ALLREDUCE, Kind.OPTIMIZER_STEP)}
            assert all(len(v) == 1 for v in at.values()), (rank, u, at)
            (un,), (rd,), (rs,), (ar,), (step,) = at.values()
            computes = [i for i, a in enumerate(acts) if a.kind.is_compute and a.id // 4 == u]
            backwards = [i for i in computes if acts[i].kind is Kind.BACKWARD]
            assert un < min(computes) and max(computes) < rs < ar < step
            assert rd == max(backwards) + 1  # right after the update's last B, before its send
    # the other shardings gather inside F and B: no such actions
    for other in ("zero3", "zero2", "replicate"):
        plain = build_schedule(_plan(kind, other), kind, minibatches=3)
        assert not any(a.kind.is_gather for acts in plain.actions.values() for a in acts)


def _mutated(rank: int, change) -> object:
    sched = build_schedule(_plan("flush", m=4), "flush", minibatches=2)
    acts = list(sched.actions[rank])
    change(acts)
    return dataclasses.replace(sched, actions={**sched.actions, rank: acts})


def _index(acts: list[Action], text: str) -> int:
    return next(i for i, a in enumerate(acts) if str(a) == text)


def _move(text: str, after: str):
    def change(acts: list[Action]) -> None:
        a = acts.pop(_index(acts, text))
        acts.insert(_index(acts, after) + 1, a)
    return change


@pytest.mark.parametrize("change, message", [
    (lambda acts: acts.pop(_index(acts, "s1UN0")),
     r"microbatch 0 of update 0 runs on its gathered weights, between UN0 and RS0"),
    (lambda acts: acts.insert(_index(acts, "s1UN0") + 1, parse_action("s1UN1")),
     r"the weights are gathered already \(UN0 has no RS yet\)"),
    (_move("s1RD0", "s1SG2@0"), r"RD0 must directly follow a B of update 0"),
    (_move("s1RD0", "s1B0v0"), r"RD0 reduce-scatters update 0's gradient before the backward of microbatch 2"),
    (_move("s1RS0", "s1U0v1"), r"AR0 before RS0"),
    (lambda acts: acts.pop(_index(acts, "s1RD1")), r"RS1 before RD1"),
])
def test_the_validator_refuses_gathers_out_of_place(change, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        validate_schedule(_mutated(1, change))


def test_only_a_zero1_stage_gathers_by_actions() -> None:
    sched = build_schedule(_plan("flush", "zero3"), "flush", minibatches=1)
    acts = [parse_action("s1UN0"), *sched.actions[1]]
    with pytest.raises(ScheduleError, match="stage 1 is not sharded 'zero1'"):
        validate_schedule(dataclasses.replace(sched, actions={**sched.actions, 1: acts}))


def test_the_gathers_are_collectives_in_the_deadlock_proof() -> None:
    """Stage 0 sends microbatch 1 first and waits for its gradient; replica 1 of the zero1 stage
    sends that gradient only after its RD, which waits for replica 0, which waits for
    microbatch 0's activations: a cycle. The same order on replicating replicas runs."""
    def reordered(sharding: str):
        sched = build_schedule(_plan("flush", sharding, m=2), "flush", minibatches=1)
        order = ["s0F1v0", "s0SA1@2", "s0RG1@2", "s0B1v0", "s0F0v0", "s0SA0@1", "s0RG0@1", "s0B0v0", "s0U0v1"]
        assert sorted(order) == sorted(map(str, sched.actions[0]))
        return dataclasses.replace(sched, actions={**sched.actions, 0: [parse_action(t) for t in order]})

    validate_schedule(reordered("replicate"))
    with pytest.raises(ScheduleError, match=r"deadlock: cycle .*rank 2 waits at s1r1RD0 for rank 1"):
        validate_schedule(reordered("zero1"))
    # the proof for clipping by the global norm (one more collective at each update) meets them too
    assert update_barrier_problem(reordered("replicate")) is None
    assert "would wait forever" in (update_barrier_problem(reordered("zero1")) or "")


def test_the_simulator_charges_one_gather_and_one_reduce_scatter_per_update() -> None:
    """8 MB over 2 replicas at 1 GB/s: a gather receives half of it, 4 ms; so does the
    reduce-scatter; RS is free. zero3 instead adds a gather to every forward and a gather and
    a reduce-scatter to every backward of the stage (hand-computed, 4 ms each)."""
    costs = lambda plan: Costs.from_plan(plan, 4, bandwidth_Bps=1e9, accumulate_Bps=float("inf"))  # noqa: E731
    plan = _plan("flush")
    trace = simulate(build_schedule(plan, "flush", minibatches=2), costs(plan)).trace
    mine = [e for e in trace.events if e.stage == 1 and e.kind in ("UN", "RD", "RS")]
    assert sorted({(e.rank, e.kind) for e in mine}) == [(r, k) for r in (1, 2) for k in ("RD", "RS", "UN")]
    for e in mine:
        want = 0.0 if e.kind == "RS" else 4e-3
        assert e.end_s - e.start_s >= want - 1e-12 and e.bytes == (0 if e.kind == "RS" else 4 * MB)
    # the collective itself takes 4 ms from the last replica's arrival
    un0 = [e for e in mine if e.kind == "UN" and e.id == 0]
    assert abs(min(e.end_s for e in un0) - max(e.start_s for e in un0) - 4e-3) < 1e-12
    forward = {round(e.end_s - e.start_s, 9) for e in trace.events if e.stage == 1 and e.kind == "F"}
    assert forward == {round(0.25e-3, 9)}  # 1 ms per minibatch over 4 microbatches, nothing gathered
    plan3 = _plan("flush", "zero3")
    trace3 = simulate(build_schedule(plan3, "flush", minibatches=2), costs(plan3)).trace
    forward3 = {round(e.end_s - e.start_s, 9) for e in trace3.events if e.stage == 1 and e.kind == "F"}
    backward3 = {round(e.end_s - e.start_s, 9) for e in trace3.events if e.stage == 1 and e.kind == "B"}
    assert forward3 == {round(0.25e-3 + 4e-3, 9)} and min(backward3) == round(0.5e-3 + 8e-3, 9)


def test_the_planner_prices_zero1_between_replication_and_zero3() -> None:
    """Per minibatch of μ = 4 microbatches on 2 replicas: replicate one all-reduce (2 halves),
    zero1 one gather and one reduce-scatter (2 halves), zero3 3 halves per local microbatch
    (2 local: 6 halves)."""
    from torchpipedream.search.planner import shared_sync_ms
    half = 0.5 * 8 * MB / 1e9 * 1e3  # ms: (r − 1)/r of 8 MB at 1 GB/s
    assert shared_sync_ms(8 * MB, 2, 1e9, "replicate", 4) == pytest.approx(2 * half)
    assert shared_sync_ms(8 * MB, 2, 1e9, "zero1", 4) == pytest.approx(2 * half)
    assert shared_sync_ms(8 * MB, 2, 1e9, "zero2", 4) == pytest.approx(4 * half)
    assert shared_sync_ms(8 * MB, 2, 1e9, "zero3", 4) == pytest.approx(6 * half)


# ----------------------------------------------------------------------- the runtime's collectives
def _collectives(rank: int) -> dict[str, dict[str, int]]:
    """Per sharding: FSDP2's all-gathers and gradient reductions in two minibatches of a stage
    of three Linear layers on two replicas (4 microbatches: 2 per replica), as torch's profiler
    records them."""
    from torch.profiler import ProfilerActivity, profile
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]
    out = {}
    for sharding in ("zero3", "zero2", "zero1"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))
        plan = Plan(stages=[Stage([str(i) for i in range(5)], replicas=2, ranks=[0, 1], sharding=sharding)],
                    schedule="flush", microbatches=4)
        pipe = Pipeline(model, plan, loss_fn=nn.functional.cross_entropy,
                        optimizer=lambda p: torch.optim.SGD(p, lr=0.1), sample=batches[0][0], microbatches=4,
                        timeout_s=60)
        pipe.train_minibatches(batches[:1])  # FSDP2's lazy set-up outside the count
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            pipe.train_minibatches(batches[1:])
        names = [e.name for e in prof.events()]
        # FSDP2 names a unit's all-gather "FSDP::all_gather (<its name>)", the root unit's without one
        out[sharding] = {"gathers": sum(n == "FSDP::all_gather" or n.startswith("FSDP::all_gather (") for n in names),
                         "reduces": sum(n.startswith("FSDP::post_backward_reduce") for n in names),
                         "sharded after": all(getattr(p, "device_mesh", None) is not None
                                              for p in pipe.module.parameters())}
    return out


def test_fsdp2_gathers_once_per_minibatch_under_zero1() -> None:
    """Three units (Linear layers), two minibatches, two microbatches per replica each: zero3
    gathers for every forward and backward (3 × 2 × 2 × 2 = 24) and reduces after every backward
    (12); zero2 gathers for the forwards only (12); zero1 shards the stage as one unit and
    gathers and reduces it once per minibatch (2 each), and its weights are sharded again after
    the step."""
    counts = launch(_collectives, 2, timeout_s=240, stall_timeout_s=60, return_all=True)
    for got in counts:
        assert (got["zero3"]["gathers"], got["zero3"]["reduces"]) == (24, 12), got
        assert (got["zero2"]["gathers"], got["zero2"]["reduces"]) == (12, 12), got
        assert (got["zero1"]["gathers"], got["zero1"]["reduces"]) == (2, 2), got
        assert all(got[s]["sharded after"] for s in got)
