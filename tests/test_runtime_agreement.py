"""The deadline-bounded JSON exchanges of runtime/agreement.py, on an in-process store."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from torchpipedream.runtime.agreement import Agreement, CollectiveTimeout


def _pair(store, timeout_s: float = 5.0) -> list[Agreement]:
    return [Agreement(store, r, 2, timeout_s, "t/", lambda r: f"rank {r} (stage {r})") for r in range(2)]


def _both(fn0, fn1):
    out: dict[int, object] = {}

    def run(r, fn):
        try:
            out[r] = fn()
        except Exception as exc:  # reported to the test
            out[r] = exc

    threads = [threading.Thread(target=run, args=(r, fn)) for r, fn in enumerate((fn0, fn1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out[0], out[1]


def test_every_rank_gets_every_value_in_rank_order() -> None:
    a, b = _pair(dist.HashStore())
    assert _both(lambda: a.exchange("x", {"n": 1}), lambda: b.exchange("x", [2])) == ([{"n": 1}, [2]], [{"n": 1}, [2]])
    assert _both(lambda: a.broadcast("plan", "from 0"), lambda: b.broadcast("plan")) == ("from 0", "from 0")
    assert _both(lambda: a.first_error("save", None), lambda: b.first_error("save", "disk full")) == \
        ((1, "disk full"), (1, "disk full"))


def test_a_rank_that_does_not_come_is_named_within_the_deadline() -> None:
    a, _ = _pair(dist.HashStore(), timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(CollectiveTimeout, match=r"rank 1 \(stage 1\) did not reach the checkpoint within 0.5 s") as info:
        a.barrier("the checkpoint")
    assert info.value.peer == 1 and time.monotonic() - t0 < 3


def test_old_rounds_are_deleted() -> None:
    store = dist.HashStore()
    a, b = _pair(store)
    for i in range(5):
        _both(lambda: a.exchange("r", i), lambda: b.exchange("r", i))
    assert store.num_keys() <= 2 * 2  # the last two rounds of each rank, not all five


def test_values_are_json_not_pickles() -> None:
    a, _ = _pair(dist.HashStore())
    with pytest.raises(TypeError, match="not JSON serializable"):
        a.exchange("x", object())
