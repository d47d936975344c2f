"""train's measured host costs: one measurement per plan shape, reused by a process's later
runs for HOST_COSTS_REUSE_S, then measured again."""

from __future__ import annotations

import logging

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


def test_every_shape_a_search_asks_for_is_measured_in_one_call_before_it(monkeypatch, caplog) -> None:
    """``--schedule auto`` measures the shapes its search will price all at once (one launch,
    runtime.measure.measure_local_costs_of), found by a quiet run of the search, then searches
    with them; none is measured one by one, and a later search in the window measures none."""
    batches: list[list[tuple[int, int]]] = []

    def measure_all(requests: list) -> list[dict]:
        batches.append([(plan.num_workers, m) for plan, m in requests])
        return [{"message_overhead_s": float(m)} for _, m in requests]

    monkeypatch.setattr(preparation, "measure_local_costs_of", measure_all)
    monkeypatch.setattr(preparation, "measure_local_costs", lambda plan, m: pytest.fail("measured one shape alone"))
    monkeypatch.setattr(preparation, "_host_costs_measured", {})
    two = Plan.straight([["a"], ["b"]], schedule="flush", batch_size=8, microbatches=2)
    one = Plan.straight([["a", "b"]], schedule="flush", batch_size=8, microbatches=2)
    said = logging.getLogger(preparation.choose_layout.__module__)

    def search(costs) -> list[dict]:
        said.info("priced %d shapes", 4)
        return [costs(two, 2), costs(two, 4), costs(two, 2), costs(one, 2)]

    caplog.set_level(logging.INFO, logger=said.name)  # on the logger itself: another test may have set its level
    preparation._measure_ahead(search)
    assert batches == [[(2, 2), (2, 4)]]  # each shape once, one worker's none
    assert "priced" not in caplog.text  # the search that finds the shapes says nothing
    assert search(preparation.measured_host_costs) == [{"message_overhead_s": 2.0}, {"message_overhead_s": 4.0},
                                                         {"message_overhead_s": 2.0}, {}]
    assert caplog.text.count("priced 4 shapes") == 1
    preparation._measure_ahead(search)
    assert len(batches) == 1  # measured within HOST_COSTS_REUSE_S: nothing again
