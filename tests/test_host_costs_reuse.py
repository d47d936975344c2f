"""train's measured host costs: one measurement per plan shape, reused by a process's later
runs for HOST_COSTS_REUSE_S, then measured again."""

from __future__ import annotations

import pytest

from torchpipedream.plans.plan import Plan
from torchpipedream.train import preparation


def test_a_shape_is_measured_once_per_reuse_window_and_a_new_shape_at_once(monkeypatch) -> None:
    calls: list[tuple[int, int]] = []
    clock = [1000.0]

    def measure(plan: Plan, m: int) -> dict:
        calls.append((plan.num_workers, m))
        return {"message_overhead_s": 1e-4 * len(calls)}

    monkeypatch.setattr(preparation, "measure_local_costs", measure)
    monkeypatch.setattr(preparation, "monotonic", lambda: clock[0])
    monkeypatch.setattr(preparation, "_host_costs_measured", {})
    two = Plan.straight([["a"], ["b"]], schedule="flush", batch_size=8, microbatches=2)
    one = Plan.straight([["a", "b"]], schedule="flush", batch_size=8, microbatches=2)

    first = preparation.measured_host_costs(two, 2)
    clock[0] += preparation.HOST_COSTS_REUSE_S - 1  # a later run of the same process, in the window
    assert preparation.measured_host_costs(two, 2) == first == {"message_overhead_s": pytest.approx(1e-4)}
    assert calls == [(2, 2)]
    preparation.measured_host_costs(two, 4)  # another microbatch count: another message size
    assert calls == [(2, 2), (2, 4)]
    assert preparation.measured_host_costs(one, 2) == {} and len(calls) == 2  # one worker sends nothing
    clock[0] += 2  # the first measurement is now older than the window
    assert preparation.measured_host_costs(two, 2) == {"message_overhead_s": pytest.approx(3e-4)}
    assert calls == [(2, 2), (2, 4), (2, 2)]
