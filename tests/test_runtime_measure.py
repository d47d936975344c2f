"""Host measurements: the concurrency slowdown's lockstep, drift-cancelling estimate."""

from __future__ import annotations

import math

import pytest

from torchpipedream.runtime.measure import bracketed_slowdown, measure_concurrency_slowdown


def test_bracketing_cancels_a_linear_drift() -> None:
    # The host slows down steadily (alone: 10, 9, 8, 7 work/s at the alone-measurements); two
    # processes together run 1.25x slower than one alone would at that moment.
    alone = [10.0, 9.0, 8.0, 7.0]
    together = [[(a + b) / 2 / 1.25] * 2 for a, b in zip(alone, alone[1:])]
    assert bracketed_slowdown(alone, together) == pytest.approx(1.25)
    # The one-pair estimate this replaces reads the drift as extra slowdown.
    assert alone[0] / together[0][0] > 1.3


def test_bracketing_takes_the_slowest_worker_and_the_median_and_never_goes_below_one() -> None:
    alone = [10.0, 10.0, 10.0, 10.0]
    # workers that wait for each other move at the slowest one's pace
    assert bracketed_slowdown(alone[:2], [[10.0, 8.0]]) == pytest.approx(1.25)
    # one outlier repeat (the host stalled during it) does not move the median
    assert bracketed_slowdown(alone, [[8.0, 8.0], [2.0, 2.0], [8.0, 8.0]]) == pytest.approx(1.25)
    assert bracketed_slowdown(alone[:2], [[12.0, 11.0]]) == 1.0  # faster together: noise, not a speed-up
    assert bracketed_slowdown(alone[:2], [[0.0, 0.0]]) == math.inf


def test_bracketing_needs_one_more_alone_measurement() -> None:
    with pytest.raises(ValueError, match="one more alone"):
        bracketed_slowdown([1.0, 1.0], [[1.0], [1.0]])
    with pytest.raises(ValueError, match="one more alone"):
        bracketed_slowdown([1.0], [])


def test_lockstep_measurement_charges_the_wait_for_the_slower_worker() -> None:
    # Steps that sleep 5 or 15 ms (no CPU), each process in its own random order but balanced:
    # every two consecutive steps take 20 ms, so a run alone averages 10 ms a step (to within
    # one step at the run's ends). Independent copies would not slow each other down at all;
    # with a barrier after every step the group waits for the longer of the two processes'
    # steps: 12.5 ms on average (20 ms per pair when their orders agree, 30 when they differ),
    # 1.25x one alone. Over ~50 steps the pairs' spread is ~4% per repeat, so the bounds hold
    # with a wide margin on a loaded host too (oversleeping adds the same to both sides).
    slowdown = measure_concurrency_slowdown(2, seconds=0.5, make_step=_balanced_jittery_step, repeats=3)
    assert 1.1 < slowdown < 1.6
    assert 1.0 <= measure_concurrency_slowdown(2, seconds=0.05, repeats=1) < math.inf  # default step


def _balanced_jittery_step():  # a picklable step factory: spawned processes import this module
    import os
    import random
    import time

    rng = random.Random(os.getpid())
    pending: list[float] = []

    def step() -> None:
        if not pending:
            pending.extend(rng.sample((0.005, 0.015), 2))
        time.sleep(pending.pop())

    return step
