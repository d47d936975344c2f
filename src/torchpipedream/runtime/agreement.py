"""Small values exchanged by every rank, each exchange with a deadline that names who is late.

The collectives around a schedule (the barrier before it, a checkpoint's "did every rank
write its file?", the plan rank 0 made, a failure to report) carry a few bytes of JSON. They go
through the process group's key-value store, not through gloo, for three reasons:

* **A deadline per call.** Each rank writes ``<prefix><n>/<rank>`` and waits for every rank's
  key of round ``n`` for at most ``timeout_s``; when the wait expires, the keys that are missing
  name the ranks that did not answer (:class:`CollectiveTimeout`, a :class:`CommTimeout`, so the
  failure path reports it like any other wait on a peer).
* **A store nobody's death can stop.** The local launcher hosts the store in its own process
  (bound to the loopback interface); torchrun's agent hosts it under torchrun. A stopped or
  killed worker does not take the rendezvous with it.
* **No pickle.** Values are JSON: nothing received from another process runs code.

Every rank must call the same exchanges in the same order (SPMD), as with any collective.
A rank deletes its own key of round ``n − 2`` once round ``n − 1`` completed (every rank has
read it by then), so a long run leaves a bounded number of keys behind.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any, Callable

from . import liveness
from .comm import CommTimeout

__all__ = ["Agreement", "CollectiveTimeout"]


class CollectiveTimeout(CommTimeout):
    """One or more ranks did not reach a collective step within the deadline."""


class Agreement:
    """Round-numbered JSON exchanges among ``world`` ranks through ``store``.

    Args:
        store: a c10d store (``TCPStore``, ``FileStore``, or a ``PrefixStore`` over one).
        rank, world: this rank and the number of ranks.
        timeout_s: the deadline of each exchange.
        prefix: a key prefix unique to this group of exchanges (e.g. per Pipeline).
        describe: ``rank -> text`` for messages (e.g. "rank 1 (stage 1)").
    """

    def __init__(self, store: Any, rank: int, world: int, timeout_s: float, prefix: str,
                 describe: Callable[[int], str] | None = None) -> None:
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.store, self.rank, self.world = store, rank, world
        self.timeout_s = float(timeout_s)
        self.prefix = prefix
        self.describe = describe or (lambda r: f"rank {r}")
        self._round = 0

    def _key(self, round_: int, rank: int) -> str:
        return f"{self.prefix}{round_}/{rank}"

    def exchange(self, what: str, value: Any) -> list[Any]:
        """Every rank's ``value`` (JSON-serialisable), in rank order; ``what`` names the step in
        the error when a rank does not answer within the deadline."""
        n = self._round
        self._round += 1
        liveness.mark()
        keys = [self._key(n, r) for r in range(self.world)]
        text = json.dumps(value)  # TypeError for what JSON cannot hold: a caller's mistake
        try:
            self.store.set(keys[self.rank], text)
            arrived = self._wait(keys)
        except Exception as exc:  # the store itself failed (its host is gone)
            raise CollectiveTimeout(f"{self.describe(self.rank)}: {what}: the rendezvous store failed: "
                                    f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from None
        if not arrived:
            missing = self._missing(keys)
            who = ", ".join(self.describe(r) for r in missing) or "a rank"
            raise CollectiveTimeout(
                f"{who} did not reach {what} within {self.timeout_s:g} s (seen by {self.describe(self.rank)})",
                peer=missing[0] if missing else None)
        values = [json.loads(bytes(self.store.get(k)).decode()) for k in keys]
        if n >= 2:
            self._delete(self._key(n - 2, self.rank))
        liveness.mark()
        return values

    def barrier(self, what: str) -> None:
        """Wait until every rank reached ``what`` (or raise naming the ranks that did not)."""
        self.exchange(what, None)

    def broadcast(self, what: str, value: Any = None, src: int = 0) -> Any:
        """Rank ``src``'s ``value`` on every rank."""
        return self.exchange(what, value if self.rank == src else None)[src]

    def first_error(self, what: str, error: str | None) -> tuple[int, str] | None:
        """(rank, message) of the lowest rank that reports an error, or None: every rank gets
        the same answer, so all of them raise (or go on) together."""
        for r, e in enumerate(self.exchange(what, error)):
            if e is not None:
                return r, str(e)
        return None

    def _wait(self, keys: list[str]) -> bool:
        """Whether every key appeared within the deadline. Polls ``check`` (from 50 µs, doubling
        to 5 ms) rather than the store's blocking ``wait``, whose timeout prints C++ warnings."""
        deadline = time.monotonic() + self.timeout_s
        pause = 5e-5
        while not self.store.check(keys):
            if time.monotonic() > deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 5e-3)
        return True

    def _missing(self, keys: list[str]) -> list[int]:
        try:
            return [r for r, k in enumerate(keys) if not self.store.check([k])]
        except Exception:  # the store is gone: nobody can be named
            return []

    def _delete(self, key: str) -> None:
        try:
            self.store.delete_key(key)
        except Exception:  # a store without delete (FileStore) keeps the key; harmless
            pass
