"""Replicated stages under the zero-bubble kinds zb-h1 and zb-h2 (issue 37, item 5).

Each replica of a replicated stage runs the kind's order over its own microbatches (microbatch
i on replica i mod r), and the replicas all-reduce after their last W of the update. The
schedules are proven before they run (every shape and count below validates: matching,
deadlock); here one launch of 4 gloo processes trains every case and compares it with plain
PyTorch in one process (tests/scenario_reference.py: one optimizer step per minibatch on its
mean loss), with clipping by the global norm and a learning-rate schedule, and with tensor
parallelism on a replicated stage.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from torch import nn

from scenario_reference import assert_equals_one_process, one_process_training, optimizer
from torchpipedream.plans.plan import Plan, Stage
from torchpipedream.runtime import Pipeline, launch
from torchpipedream.runtime.lr_schedule import LRSchedule
from torchpipedream.schedule.actions import Kind
from torchpipedream.schedule.build import build_schedule
from torchpipedream.schedule.validate import validate_schedule

N_PROCS = 4
CLIP = 0.3
NAMES = ["input_1", "fc1", "act1", "fc2", "norm", "fc3", "act2", "fc4", "head"]
#: shape -> (layers, replicas) of each stage, on 4 workers
SHAPES = {
    "2-2": [(NAMES[:5], 2), (NAMES[5:], 2)],
    "1-2-1": [(NAMES[:3], 1), (NAMES[3:7], 2), (NAMES[7:], 1)],
    "3-1": [(NAMES[:7], 3), (NAMES[7:], 1)],
    "1-3": [(NAMES[:4], 1), (NAMES[4:], 3)],
    # the input stage replicated: each replica's 1F1B warm-up is shorter than the pipeline's depth,
    # which ZB-H1 and ZB-H2 still hold (the validator used to refuse these for holding it)
    "2-1-1": [(NAMES[:3], 2), (NAMES[3:6], 1), (NAMES[6:], 1)],
}
#: name -> (kind, shape, microbatches, optimizer, options): m = 3 leaves replicas uneven shares
CASES: dict[str, dict] = {
    f"{kind}_{shape}_m{m}": dict(kind=kind, shape=shape, m=m, opt="adam")
    for kind in ("zb-h1", "zb-h2") for shape in SHAPES for m in (3, 4)
}
CASES["zb-h1_2-2_recipe"] = dict(kind="zb-h1", shape="2-2", m=4, opt="momentum", clip=True, sched=True)
CASES["zb-h2_1-3_recipe"] = dict(kind="zb-h2", shape="1-3", m=3, opt="adamw", clip=True, sched=True)
# one stage on 2 replicas of 2 tensor ranks each
CASES["zb-h1_dp2_tp2"] = dict(kind="zb-h1", shape="dp2", m=4, opt="momentum", clip=True, tensor_parallel=2)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(collections.OrderedDict([
        ("fc1", nn.Linear(6, 16)), ("act1", nn.GELU()), ("fc2", nn.Linear(16, 8)), ("norm", nn.LayerNorm(8)),
        ("fc3", nn.Linear(8, 16)), ("act2", nn.Tanh()), ("fc4", nn.Linear(16, 8)), ("head", nn.Linear(8, 3))]))


def data(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(12, 6, generator=g), torch.randint(0, 3, (12,), generator=g)) for _ in range(n)]


def plan_of(case: dict) -> Plan:
    if case["shape"] == "dp2":
        return Plan(stages=[Stage(NAMES, replicas=2, ranks=[0, 1])], schedule=case["kind"], microbatches=case["m"],
                    tensor_parallel=case["tensor_parallel"])
    stages, first = [], 0
    for layers, replicas in SHAPES[case["shape"]]:
        stages.append(Stage(layers, replicas=replicas, ranks=list(range(first, first + replicas))))
        first += replicas
    return Plan(stages=stages, schedule=case["kind"], microbatches=case["m"])


def _worker(rank: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name, case in CASES.items():
        batches = data()
        pipe = Pipeline(model(), plan_of(case), optimizer=optimizer(case["opt"]), loss_fn=nn.functional.cross_entropy,
                        clip_grad_norm=CLIP if case.get("clip") else None,
                        lr_scheduler=LRSchedule("cosine", warmup=1, total=len(batches)) if case.get("sched") else None,
                        timeout_s=60)
        pipe.train_minibatches(batches)
        out[name] = {"state": pipe.state_dict(), "norms": pipe.grad_norms}
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    return launch(_worker, N_PROCS, timeout_s=300, stall_timeout_s=60)


@pytest.mark.parametrize("name", list(CASES))
def test_replicated_zero_bubble_pipeline_equals_one_process(results: dict, name: str) -> None:
    case = CASES[name]
    want = one_process_training(model(), data(), optimizer(case["opt"]), case, CLIP, None)
    assert_equals_one_process(name, case, results[name], want, CLIP)
    start = model().state_dict()
    assert all((want["state"][k] - start[k]).abs().max() > 1e-3 for k in start if k.endswith("weight"))


@pytest.mark.parametrize("kind", ["zb-h1", "zb-h2"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_every_replica_splits_its_backward_and_all_reduces_after_its_last_w(kind: str, shape: str) -> None:
    for m, minibatches in ((1, 3), (3, 2), (4, 3), (8, 1)):
        p = dataclasses.replace(plan_of(dict(kind=kind, shape=shape, m=m)), microbatches=m)
        sched = build_schedule(p, kind, minibatches=minibatches)
        validate_schedule(sched)
        for rank, actions in sched.actions.items():
            stage = p.stage_of_rank(rank)[0]
            w = [i for i, a in enumerate(actions) if a.kind is Kind.WEIGHT_GRAD]
            assert w, (rank, [str(a) for a in actions])  # every replica splits its backward
            if p.stages[stage].replicas > 1:
                for u in range(minibatches):
                    ar = next(i for i, a in enumerate(actions) if a.kind is Kind.ALLREDUCE and a.id == u)
                    assert all(i < ar for i in w if actions[i].id // m == u), (rank, u)


@pytest.mark.parametrize("kind", ["zb-h1", "zb-h2"])
@pytest.mark.parametrize("replicas,m", [((2, 1, 1), 4), ((2, 1, 1), 8), ((3, 1, 1), 6), ((1, 2, 1), 8),
                                        ((2, 2), 8), ((1, 3), 3)])
def test_the_memory_model_charges_what_a_replicated_zero_bubble_order_holds(kind: str, replicas: tuple, m: int) -> None:
    """The busiest replica of a stage of r replicas in a ZB-H1 (ZB-H2) pipeline n stages deep
    holds ⌈n/r⌉ (⌈(2n − 1)/r⌉) microbatches from their F to their W, at most the ⌈μ/r⌉ it runs:
    counted on the built order, proven by the validator, and charged by the planner's memory
    model (the plan's per-stage memory), which equals the simulator's peak of the same schedule."""
    from torchpipedream.model.profiles import load_profile
    from torchpipedream.plans.topology import Topology
    from torchpipedream.search.planner import _build_plan, _planning_blocks, best_split_for_replicas
    from torchpipedream.sim.simulator import Costs, simulate

    graph, topo = load_profile("alexnet"), Topology.from_any(f"{sum(replicas)}:10GB/s")
    blocks = _planning_blocks(graph, False)
    _, stages = best_split_for_replicas(blocks, topo, list(replicas), kind, m)
    p = _build_plan(graph, blocks, topo, stages, kind, m, 2.0, None, 0.0, 0, {"microbatches": m})
    sched = build_schedule(p, kind, minibatches=2, microbatches=m)
    validate_schedule(sched)
    n = len(replicas)
    peaks = [0] * n
    for rank, actions in sched.actions.items():
        held = 0
        for a in actions:
            held += (a.kind is Kind.FORWARD) - (a.kind is Kind.WEIGHT_GRAD)
            peaks[p.stage_of_rank(rank)[0]] = max(peaks[p.stage_of_rank(rank)[0]], held)
    for s, r in enumerate(replicas):
        assert peaks[s] == min(-(-(n if kind == "zb-h1" else 2 * n - 1) // r), -(-m // r)), (s, peaks)
    simulated = simulate(sched, Costs.from_plan(p, microbatches=m)).peak_memory_bytes
    assert [st.memory_bytes for st in p.stages] == pytest.approx(simulated, rel=1e-9)
    assert [p.stage_memory_bytes(s) for s in range(n)] == pytest.approx(simulated, rel=1e-9)


def _shape_plan(kind: str, replicas: tuple, m: int) -> Plan:
    stages, first = [], 0
    for s, r in enumerate(replicas):
        stages.append(Stage([f"l{s}"], replicas=r, ranks=list(range(first, first + r))))
        first += r
    return Plan(stages=stages, schedule=kind, microbatches=m)


@pytest.mark.parametrize("kind", ["zb-h1", "zb-h2"])
def test_every_replicated_zero_bubble_shape_on_five_workers_is_proven(kind: str) -> None:
    """A replica's order is the straight stage's with the other replicas' microbatches left out,
    so every way of replicating stages over up to 5 workers validates: 1-3-1 at 6 microbatches
    deadlocked under zb-h1 when a replica timed its passes by its own count, and 1-3-1 and
    1-2-1-1 at 12 under zb-h2 when a replica applied the stage's rule to its own microbatches."""
    import itertools

    shapes = [reps for w in range(2, 6) for n in range(2, w + 1)
              for reps in itertools.product(range(1, w + 1), repeat=n) if sum(reps) == w and max(reps) > 1]
    assert (1, 3, 1) in shapes and (1, 2, 1, 1) in shapes and len(shapes) == 22
    for reps in shapes:
        for m in (2, 3, 6, 12):
            validate_schedule(build_schedule(_shape_plan(kind, reps, m), kind, minibatches=2))
