"""The round trip that bounds a replicated stage under zb-h1 and zb-h2.

A replica of a split-backward stage runs the straight stage's order of each batch with the
other replicas' microbatches left out (``schedule.orders``), so it holds only its share of
the straight stage's in-flight microbatches: c = ⌈n/r⌉ under ZB-H1, ⌈(2n − 1)/r⌉ under ZB-H2
(``ScheduleKind.replica_inflight``). With few in flight, a replica waits: after the forwards
of a wave of c microbatches it cannot start another until the first one's input gradient has
come back through every later stage. A wave therefore takes

    max(c·F, F + RT) + c·(B + W)

where F, B and W are the replica's per-microbatch forward, input-gradient and weight-gradient
times (the backward split as the simulator splits it: ``sim.simulator.split_backward_ms``) and RT the round trip below it (the later stages' F + B and the transfers of both
directions), and the replica's ⌈μ/r⌉ microbatches take ⌈⌈μ/r⌉/c⌉ waves after the earlier
stages' first forwards reach it (and before their last input gradients leave). The bottleneck
and fill model of ``planner.evaluate`` does not see this wait: a 4-2-1-1 plan whose stages
are balanced per worker runs one microbatch at a time on each replica of its first stage.
Checked against the simulator (``sim.simulator``) on the reference profiles; see
docs/planner.md.
"""

from __future__ import annotations

import math
from typing import Sequence

from ..model.graph import Block, measured_sum
from ..plans.kinds import ScheduleKind
from ..sim.costs import MS_PER_S, paper_transfer
from ..sim.simulator import split_backward_ms

__all__ = ["replica_round_trip_ms"]


def replica_round_trip_ms(blocks: Sequence[Block], stages: Sequence[tuple[int, int, int]],
                          cut_bandwidths: Sequence[float], kind: ScheduleKind, microbatches: int,
                          sync_ms: Sequence[float], sharded: bool = False) -> tuple[float, int]:
    """The longest time per minibatch that a replicated stage's round trips impose, and that
    stage (0.0, -1 where no stage has replicas or ``kind`` does not replicate split stages).

    ``stages`` are (first block, last block, replicas); ``cut_bandwidths[s]`` the link between
    stage s and s + 1; ``sync_ms[s]`` what stage s's replicas spend synchronising per minibatch
    (after their last W); ``sharded``: replicated stages shard their weights (FSDP2).
    """
    if not kind.replicates_split_stages or all(m == 1 for _, _, m in stages):
        return 0.0, -1
    mu, n = max(1, microbatches), len(stages)
    runs = [blocks[i:j + 1] for i, j, _ in stages]
    backward, weight = split_backward_ms(
        [(sum(b.backward_ms for b in run), measured_sum(b.input_grad_ms for b in run),
          measured_sum(b.weight_grad_ms for b in run)) for run in runs],
        [sharded and m > 1 for _, _, m in stages])
    F = [sum(b.forward_ms for b in run) / mu for run in runs]
    B = [(t - w) / mu for t, w in zip(backward, weight)]
    W = [w / mu for w in weight]
    cut = [2 * paper_transfer(blocks[j].cut_bytes / mu, bw, per_s=MS_PER_S)
           for (_, j, _), bw in zip(stages[:-1], cut_bandwidths)] + [0.0]
    worst, where = 0.0, -1
    for s, (i, j, m) in enumerate(stages):
        if m == 1:
            continue
        local = math.ceil(mu / m)
        held = min(local, kind.replica_inflight(n, m))
        below = sum(F[t] + B[t] for t in range(s + 1, n)) + sum(cut[s:])
        above = sum(F[t] + B[t] for t in range(s)) + sum(cut[:s])
        wave = max(held * F[s], F[s] + below) + held * (B[s] + W[s])
        total = above + math.ceil(local / held) * wave + sync_ms[s] + sum(b.optimizer_ms for b in blocks[i:j + 1])
        if total > worst:
            worst, where = total, s
    return worst, where
