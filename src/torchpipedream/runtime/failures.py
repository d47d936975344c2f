"""Failures that stop every rank cleanly, naming the rank and stage that failed first.

What happens when one rank of a pipeline fails (measured with gloo, 3 ranks on one computer,
see docs/architecture.md "Failures"):

* A rank whose process dies closes its TCP connections; gloo then fails every pending wait
  on that peer at once ("Connection closed by peer"). Its neighbours notice in
  milliseconds, not at the deadline, and the failure travels down the pipeline hop by hop.
* But only the neighbours learn *that* a connection closed, not why. So every rank that
  fails posts one line on a **failure board** kept in the process group's key-value store
  (the c10d store that torchrun and :func:`~torchpipedream.launch` set up): the rank whose
  own code raised posts its error ("rank 2 (stage 2): ValueError: ..."); a rank whose wait
  on a peer failed and finds the board empty posts that the peer stopped (its connection
  closed, or it did not answer within ``timeout_s``: a SIGKILL posts nothing). Every rank
  whose wait failed reads the board and raises :class:`PipelineFailure` naming the first
  report, so the message on every rank names the original failure.
* A failing rank then **closes its connections** itself instead of relying on its process
  exiting (a caller may catch the exception and linger): with gloo a receive whose wait times
  out closes the connection ("Application timeout caused pair closure", measured), so it
  posts a one-byte receive from every other rank and waits a millisecond on each. The
  peers' pending waits fail at once; a peer that is computing fails at its next wait.

So each hop costs milliseconds plus the time to post and read the board. Every store
operation runs with a deadline, ``failure_timeout_s`` (a store whose host died must not turn
a clean failure into a hang); a hung-but-alive peer is caught by ``timeout_s``, the deadline
of every wait. None of this adds work to the hot path: the board is touched only when an
exception is already on its way up.

The tests inject faults from outside the library (``tests/fault_injection``): nothing here can
kill its own process.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from .comm import CommTimeout

__all__ = ["PipelineFailure", "FailureBoard", "is_comm_failure", "close_connections"]

log = logging.getLogger(__name__)

_CLOSE_TAG = 97
T = TypeVar("T")

# Phrases of torch.distributed's own errors (gloo, NCCL, c10d, the gradient all-reduce's
# deadline) that mean "the other side is gone or did not answer"; kept specific so that a
# user's error mentioning a timeout is still reported as this rank's own failure.
_COMM_PHRASES = ("gloo", "nccl", "processgroup", "connection closed", "connection reset", "pair closure",
                 "gradient all-reduce did not complete")


class PipelineFailure(RuntimeError):
    """Another rank of the pipeline failed; the message names the first failed rank and stage."""


def is_comm_failure(exc: BaseException) -> bool:
    """Whether ``exc`` says a wait on other ranks failed (a consequence) rather than this
    rank's own code failing (a cause)."""
    if isinstance(exc, CommTimeout):
        return True
    if isinstance(exc, RuntimeError) and not isinstance(exc, PipelineFailure):
        text = str(exc).lower()
        return any(p in text for p in _COMM_PHRASES)
    return False


def _bounded(fn: Callable[[], T], timeout_s: float) -> T | None:
    """``fn()`` run in a daemon thread for at most ``timeout_s``; None if it failed or ran over."""
    box: list[Any] = []

    def target() -> None:
        try:
            box.append(fn())
        except Exception as exc:  # a dead store host: report nothing rather than fail twice
            log.debug("failure board operation failed: %s", exc)

    thread = threading.Thread(target=target, name="torchpipedream-failure-board", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return box[0] if box else None


_instances = 0  # users of the store in this process: Pipelines, train's start (the same order on every rank)


def new_store_prefix() -> tuple[Any, str]:
    """The default process group's key-value store and a key prefix unique to its caller (a
    Pipeline being built, the start of a training run): ``torchpipedream/<restart>/<n>/``, so
    a restarted job (a new ``TORCHELASTIC_RESTART_COUNT``) and a second Pipeline in the same
    processes start afresh. Every rank must call it the same number of times (SPMD)."""
    global _instances
    _instances += 1
    store = dist.distributed_c10d._get_default_store()
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return store, f"torchpipedream/{restart}/{_instances}/"


class FailureBoard:
    """First-come reports of failed ranks, in the process group's key-value store (under the
    Pipeline's own prefix: :func:`new_store_prefix`). Every operation returns within
    ``timeout_s``.
    """

    def __init__(self, store: Any, prefix: str, timeout_s: float) -> None:
        self.store = store
        self.prefix = prefix
        self.timeout_s = float(timeout_s)

    def post(self, text: str) -> None:
        """Add one report (a line naming the rank and stage, and what happened)."""
        def go() -> None:
            n = self.store.add(self.prefix + "count", 1)
            self.store.set(self.prefix + str(n), text)

        _bounded(go, self.timeout_s)

    def first(self) -> str | None:
        """The earliest report, or None when nobody reported (or the store is gone)."""
        def go() -> str | None:
            count = int(self.store.add(self.prefix + "count", 0))
            for i in range(1, count + 1):
                key = self.prefix + str(i)
                if self.store.check([key]):
                    return bytes(self.store.get(key)).decode(errors="replace")
            return None

        return _bounded(go, self.timeout_s)

    def post_standing(self, rank: int, standing: str) -> None:
        """Note where ``rank`` stood when it failed (a line of its flight recorder)."""
        _bounded(lambda: self.store.set(f"{self.prefix}standing/{rank}", standing), self.timeout_s)

    def standings(self, world_size: int) -> dict[int, str]:
        """The lines ranks have noted so far (:meth:`post_standing`), by rank; waits for none."""
        def go() -> dict[int, str]:
            keys = {r: f"{self.prefix}standing/{r}" for r in range(world_size)}
            return {r: bytes(self.store.get(k)).decode(errors="replace")
                    for r, k in keys.items() if self.store.check([k])}

        return _bounded(go, self.timeout_s) or {}


def close_connections(world_size: int, rank: int, timeout_s: float) -> None:
    """Close this rank's gloo connections to every other rank, so no peer waits on it.

    Gloo closes a connection when a receive on it times out; a one-byte receive with a
    one-millisecond wait does that without any message. Other backends are left alone.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() != "gloo":
        return

    def go() -> None:
        for peer in range(world_size):
            if peer == rank:
                continue
            try:
                work = dist.irecv(torch.empty(1, dtype=torch.uint8), src=peer, tag=_CLOSE_TAG)
                work.wait(timeout=datetime.timedelta(milliseconds=1))
            except Exception:  # expected: the wait times out (or the connection is already closed)
                pass

    _bounded(go, timeout_s)
