"""What moving bytes costs: a point-to-point transfer and a ring all-reduce.

Every cost of communication in the library comes from here, in two forms:

* **the simulator's** (:func:`transfer_s`, :func:`ring_allreduce_s`): seconds, with the link's
  per-message latency and, for an all-reduce, the share of the ring formula's speed it reaches
  (``Topology.allreduce_efficiency``). ``sim.simulator`` charges these.
* **the paper's** (:func:`paper_transfer`, :func:`paper_allreduce`): bandwidth only, as
  PipeDream's planner writes them (no latency, full efficiency). ``search.planner``'s dynamic
  programme keeps this form on purpose: it is the cost model the paper's optimality argument
  is about, and latency is small against a stage's compute at the profile's batch. The planner
  counts in milliseconds, so it asks for ``per_s=MS_PER_S``.

A ring all-reduce of ``|w|`` bytes among ``m`` members moves ``2(m − 1)/m · |w|`` bytes per
member (:func:`ring_allreduce_share`) over the slowest link of the ring, in ``2(m − 1)`` steps.
An all-gather or a reduce-scatter moves half of that, ``(m − 1)/m · |w|``: a stage sharded over
its replicas (``Stage.sharding``, FSDP2) runs :func:`sharded_passes` of them per microbatch
("zero3", "zero2": inside its F and B) or one gather and one reduce-scatter per minibatch
("zero1": the schedule's ``UN`` and ``RD``) instead of one all-reduce per update
(:func:`sharded_collectives` counts both).

Pure Python (the vectorised planner passes numpy arrays to :func:`ring_allreduce_share`).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["MS_PER_S", "ring_allreduce_share", "transfer_s", "ring_allreduce_s", "paper_transfer", "paper_allreduce",
           "sharded_passes", "sharded_collectives"]

#: Milliseconds per second: the planner's unit (its times are milliseconds per minibatch).
MS_PER_S = 1e3


def ring_allreduce_share(members: Any) -> Any:
    """Bytes each of ``members`` sends in a ring all-reduce, per byte of the buffer: 2(m − 1)/m
    (an int or a numpy array of them)."""
    return 2.0 * (members - 1) / members


def sharded_passes(sharding: str) -> tuple[int, int]:
    """(in the forward, in the backward): the all-gathers and reduce-scatters of a sharded
    stage's weights in one microbatch, each ``(m − 1)/m`` of the stage's bytes per replica.
    "zero3" gathers the weights for the forward and again for the backward, then
    reduce-scatters the gradient; "zero2" keeps the forward's weights for the backward;
    "zero1" runs none inside them (its gather and reduce-scatter are actions of their own,
    once per minibatch)."""
    if sharding == "zero3":
        return 1, 2
    if sharding == "zero2":
        return 1, 1
    return 0, 0


def sharded_collectives(sharding: str, local: Any) -> Any:
    """All-gathers plus reduce-scatters of a sharded stage's weights that one replica runs per
    minibatch of ``local`` microbatches (an int or a numpy array): :func:`sharded_passes` per
    microbatch, or for "zero1" one of each per minibatch (``UN`` and ``RD``)."""
    if sharding == "zero1":
        return 2 + 0 * local
    return local * sum(sharded_passes(sharding))


def transfer_s(nbytes: float, bandwidth_Bps: float, latency_s: float = 0.0) -> float:
    """Seconds to move ``nbytes`` over one link: its latency + bytes / bandwidth (an infinite
    bandwidth, e.g. two stages of one worker, costs the latency only)."""
    return latency_s + (nbytes / bandwidth_Bps if bandwidth_Bps != math.inf else 0.0)


def ring_allreduce_s(nbytes: float, members: int, bandwidth_Bps: float, latency_s: float = 0.0,
                     efficiency: float = 1.0) -> float:
    """Seconds of a ring all-reduce of ``nbytes`` among ``members`` at ``bandwidth_Bps`` (the
    slowest link between them) reached at ``efficiency``: 2(m − 1) latencies + 2(m − 1)/m ·
    bytes / (efficiency · bandwidth)."""
    bandwidth = bandwidth_Bps * efficiency
    moved = ring_allreduce_share(members) * nbytes / bandwidth if bandwidth != math.inf else 0.0
    return 2 * (members - 1) * latency_s + moved


def paper_transfer(nbytes: float, bandwidth_Bps: float, per_s: float = 1.0) -> float:
    """The paper's transfer time, bytes / bandwidth, in seconds (``per_s=MS_PER_S``:
    milliseconds); 0 for no bytes or an infinite link (the same worker)."""
    if nbytes == 0 or math.isinf(bandwidth_Bps):
        return 0.0
    return nbytes / bandwidth_Bps * per_s


def paper_allreduce(nbytes: float, members: int, bandwidth_Bps: float, per_s: float = 1.0) -> float:
    """The paper's ring all-reduce, 2(m − 1)/m · bytes / bandwidth, in seconds (``per_s`` as
    :func:`paper_transfer`); 0 for a single member."""
    if members <= 1:
        return 0.0
    return ring_allreduce_share(members) * paper_transfer(nbytes, bandwidth_Bps, per_s)
