"""The exact planner on a GPT-3-175B-shaped profile on 64 GPUs (issue 36): the packed
feasibility test (memory budget, flush) finds the plan the search found before it, in seconds.

The expected plan was recorded with the planner before the packed test existed (the dense
(sizes, start blocks, stage counts, ranks) test, 26 to 48 s for this case); the plan's
stages, replicas, ranks and prediction are compared, not the time (benchmarks/scale.py times it).
"""

from __future__ import annotations

import numpy as np
import pytest

from torchpipedream.model.analytic_profiles import A100_80GB, GPT3_175B, OPTIMIZER_STATE_FACTOR, transformer_graph
from torchpipedream.plans.topology import Topology
from torchpipedream.search.planner import _ChainTerms, _planning_blocks, _Problem, plan

#: stage k's replicas, recorded with the dense test: 16 replicas of the first stage, 46
#: single-worker stages, 2 replicas of the last.
EXPECTED_REPLICAS = [16] + [1] * 46 + [2]
#: each stage's (first block, last block) of the linearised chain, as recorded
EXPECTED_BLOCKS = [[0, 2]] + [[k, k + 1] for k in range(3, 95, 2)] + [[95, 97]]
#: feasibility tests of the chain it chose: 73 as recorded with one test per depth; 13 since one
#: packed test over every stage count screens the depths (``_DepthScreen``), with the same plan
EXPECTED_CHECKS = 13
EXPECTED_MINIBATCH_S = 690.0458863338054


def _gpt3_on_64() -> tuple:
    graph = transformer_graph(GPT3_175B, 1, A100_80GB, microbatches=1536)
    topo = Topology.from_any("8x8:300GB/s,25GB/s@80GB")
    return graph, topo


@pytest.fixture(scope="module")
def gpt3_plan():
    graph, topo = _gpt3_on_64()
    return plan(graph, topo, schedule="flush", microbatches=1536, recompute=True,
                optimizer_state_factor=OPTIMIZER_STATE_FACTOR)


def test_gpt3_on_64_gpus_plans_the_recorded_stages(gpt3_plan) -> None:
    assert [s.replicas for s in gpt3_plan.stages] == EXPECTED_REPLICAS
    ranks = [r for s in gpt3_plan.stages for r in s.ranks]
    assert ranks == list(range(64))
    assert gpt3_plan.meta["blocks"] == EXPECTED_BLOCKS
    assert gpt3_plan.meta["feasibility_checks"] == EXPECTED_CHECKS
    assert gpt3_plan.predicted["time_per_minibatch_s"] == pytest.approx(EXPECTED_MINIBATCH_S, rel=1e-12)
    assert gpt3_plan.predicted["peak_memory_bytes"] <= A100_80GB.memory_bytes


def test_one_screen_answers_every_depth_as_that_depths_own_test() -> None:
    """``feasible_depths`` of the deepest problem says, for each stage count, what the test of
    that depth alone says: without a bottleneck (memory alone rules out the shallow depths), just
    above the best plan's bottleneck and below it."""
    graph, topo = _gpt3_on_64()
    blocks = _planning_blocks(graph, True)
    cache = _ChainTerms()

    def problem(depth: int) -> _Problem:
        return _Problem(blocks, topo, "flush", 1536, A100_80GB.memory_bytes, OPTIMIZER_STATE_FACTOR, depth, False,
                        True, cache=cache)

    deepest = problem(64)
    depths = [1, 20, 47, 48, 49, 56, 63, 64]
    seen = []
    for T in (float("inf"), 6.7e5, 6.6e5):
        screen = deepest.feasible_depths(T, 64, True)
        assert screen is not None and len(screen) == 65
        alone = [problem(d).feasible(T, 64, True, False)[0] for d in depths]
        assert [bool(screen[d]) for d in depths] == alone, T
        seen += alone
    assert any(seen) and not all(seen)
