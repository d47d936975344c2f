"""zb-2bw (2bw with the backward split into B and W) as data: its version rule, the pipeline it
keeps full, what it holds, the validator's rules and the planner's handling. No processes here:
tests/test_runtime_parity.py, test_runtime_four_stages.py and test_shared_parameters.py run it
against the independent reference of 2bw's rule; the planner's handling and the refusal of a
replicated plan are in tests/test_zero_bubble_schedule.py, beside zb-h1's."""

from __future__ import annotations

import dataclasses

import pytest

from torchpipedream.schedule.actions import Kind, Schedule
from torchpipedream.plans.kinds import schedule_kind
from torchpipedream.plans.plan import Plan
from torchpipedream.schedule.build import build_schedule
from torchpipedream.sim.simulator import Costs, simulate
from torchpipedream.schedule.validate import ScheduleError, schedule_stats, validate_schedule


def straight(n: int) -> Plan:
    return Plan.straight([[f"l{i}"] for i in range(n)])


def unit_costs(n: int) -> Costs:
    """F, B and W one unit each (a whole backward two), free links."""
    return Costs(forward_s=[1.0] * n, backward_s=[2.0] * n, weight_grad_s=[1.0] * n)


def per_batch(kind: str, n: int, m: int, costs: Costs) -> float:
    """Steady-state time of one batch: the makespan's growth from 8 to 12 batches, over 4."""
    spans = [simulate(build_schedule(straight(n), kind, minibatches=b, microbatches=m), costs).makespan_s
             for b in (8, 12)]
    return (spans[1] - spans[0]) / 4


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 8, 10])
def test_a_batch_takes_max_of_its_compute_and_n_plus_m(n: int) -> None:
    """Equal F, B and W: a batch of m microbatches takes max(3m, n + m) units once the pipeline
    runs, so it is full (3m, no bubble) from m ≥ n/2 on. Below, batch t + 2 waits for the
    update of batch t: its last microbatch's forward down and B back up, n slots, plus the
    batch's own m."""
    for m in range(1, n + 3):
        assert per_batch("zb-2bw", n, m, unit_costs(n)) == pytest.approx(max(3 * m, n + m), abs=1e-9), m
        assert schedule_kind("zb-2bw").fill_drain_factor(m, n) == pytest.approx(max(3 * m, n + m) / (3 * m))


@pytest.mark.parametrize("n", [4, 6, 8])
def test_fewer_microbatches_than_2bw_needs_keep_the_pipeline_full(n: int) -> None:
    """2bw's order (1F1B, warm-up capped at m + 1 so that W^(t−1) exists) needs m ≥ n − 1 to stay
    full; zb-2bw needs m ≥ n/2. From m ≥ n − 1 on both are full."""
    costs = unit_costs(n)
    for m in range(n // 2, n - 1):
        assert per_batch("zb-2bw", n, m, costs) == pytest.approx(3 * m, abs=1e-9)
        assert per_batch("2bw", n, m, costs) > 3 * m * 1.5
    for m in (n - 1, n, 2 * n):
        assert per_batch("2bw", n, m, costs) == pytest.approx(3 * m, abs=1e-9)
        assert per_batch("zb-2bw", n, m, costs) == pytest.approx(3 * m, abs=1e-9)


@pytest.mark.parametrize("n", [2, 3, 4, 6])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
def test_every_shape_validates_with_two_versions_and_the_stated_depth(n: int, m: int) -> None:
    """Two weight versions, as 2bw. Activations (F to W): 2bw's n − s where 2bw is full
    (m ≥ n − 1), else up to two batches, 2m, on every stage."""
    s = build_schedule(straight(n), "zb-2bw", minibatches=5, microbatches=m)
    validate_schedule(s)
    stats = schedule_stats(s)
    want = [n - st if m + 1 >= n else 2 * m for st in range(n)]
    assert [stats.max_inflight[r] for r in range(n)] == want
    assert all(v == 2 for v in stats.max_versions.values()) or n == 1
    res = simulate(s, unit_costs(n))
    assert res.max_inflight == want and res.max_versions == [2] * n


def _compute(s: Schedule, rank: int) -> list[str]:
    return [f"{a.kind.value}{a.id}" for a in s.actions[rank] if a.kind.is_compute or a.kind is Kind.OPTIMIZER_STEP]


def test_the_version_rule_orders_each_stage() -> None:
    """Every F, B and W of batch t names version t − 1 (0 for the first batch); U t follows the
    stage's last W of batch t; batch t + 2's first F follows U t (W^(t+1) must exist); the
    gradient leaves right after B."""
    n, m, batches = 4, 2, 5
    s = build_schedule(straight(n), "zb-2bw", minibatches=batches, microbatches=m)
    for r in range(n):
        acts = s.actions[r]
        for a in acts:
            if a.kind in (Kind.FORWARD, Kind.BACKWARD, Kind.WEIGHT_GRAD):
                assert a.version == max(0, a.id // m - 1), a
        order = _compute(s, r)
        for t in range(batches):
            last_w = max(order.index(f"W{i}") for i in range(t * m, t * m + m))
            step = order.index(f"U{t}")
            assert step == last_w + 1
            if t + 2 < batches:
                assert order.index(f"F{(t + 2) * m}") > step
        if r > 0:
            text = [str(a) for a in acts]
            for i in range(batches * m):
                b = next(k for k, x in enumerate(text) if x.startswith(f"s{r}B{i}v"))
                assert text[b + 1].startswith(f"s{r}SG{i}@")


def test_the_validator_refuses_a_forward_before_its_version_exists() -> None:
    s = build_schedule(straight(2), "zb-2bw", minibatches=4, microbatches=1)
    validate_schedule(s)
    acts = list(s.actions[0])
    text = [str(a) for a in acts]
    # move stage 0's step U0 after the forward of batch 2 (which uses W^(1), made by U0)
    u0 = acts.pop(text.index("s0U0v1"))
    text.pop(text.index("s0U0v1"))
    acts.insert(text.index("s0F2v1") + 2, u0)
    with pytest.raises(ScheduleError, match="version 1 is not one of the two alive"):
        validate_schedule(dataclasses.replace(s, actions={**s.actions, 0: acts}))
