"""A checkpoint moves between plans: 3 → 2 workers, straight → hybrid, flush → gpipe, and
pipedream onto fewer stages (issue 21).

Run A trains minibatches 0-5 on a straight 3-stage pipeline and saves. Runs B load it onto
another plan and train minibatches 6-11. For flush and gpipe the result must equal plain
training of all 12 minibatches in one process (an independent reference: the schedule is
exact). For pipedream it must equal the documented continuation rule, written out here with
explicit weight histories: minibatch t < 6 uses stage s's version t − (2 − s) on the 3-stage
plan; after the checkpoint the new schedule counts from its 6 updates, so minibatch t ≥ 6 uses
6 + max(0, (t − 6) − (n′ − 1 − s′)) with s′ the parameter's stage on the n′-stage plan.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.func import functional_call

from torchpipedream.plans.plan import Plan, Stage
from torchpipedream.runtime import Pipeline, launch

LR = 0.05
NAMES = ["input_1", "_0", "_1", "_2", "_3", "_4", "_5", "_6"]
THREE = [NAMES[:3], NAMES[3:5], NAMES[5:]]  # parameters 0 | 2 | 4, 6
TWO = [NAMES[:5], NAMES[5:]]  # parameters 0, 2 | 4, 6
STAGE3 = {"0": 0, "2": 1, "4": 2, "6": 2}
STAGE2 = {"0": 0, "2": 0, "4": 1, "6": 1}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 3))


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(12)]


def pipeline(plan: Plan) -> Pipeline:
    return Pipeline(model(), plan, optimizer=lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9),
                    loss_fn=nn.CrossEntropyLoss(), timeout_s=30)


def first_half(rank: int, root: str) -> None:
    torch.set_num_threads(1)
    for kind in ("flush", "pipedream"):
        pipe = pipeline(Plan.straight(THREE, schedule=kind, microbatches=2))
        pipe.train_minibatches(data()[:6])
        pipe.save_checkpoint(Path(root) / kind)


def second_half(rank: int, root: str, runs: list[tuple[str, str, Plan]]) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name, source, plan in runs:
        pipe = pipeline(plan)
        pipe.load_checkpoint(Path(root) / source)
        assert pipe.minibatches_done == 6
        pipe.train_minibatches(data()[6:])
        out[name] = pipe.state_dict(dst=0)
    return out


def hybrid(kind: str) -> Plan:
    """2-1 on 3 workers: stage 0 (the first two layers) replicated on ranks 0 and 1."""
    plan = Plan(stages=[Stage(layers=TWO[0], replicas=2, ranks=[0, 1]), Stage(layers=TWO[1], ranks=[2])],
                schedule=kind, microbatches=2)
    plan.validate()
    return plan


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = str(tmp_path_factory.mktemp("reshard"))
    launch(first_half, 3, root, timeout_s=180, comm_timeout_s=60)
    on_two = launch(second_half, 2, root, [("flush_3_to_2", "flush", Plan.straight(TWO, schedule="flush",
                                                                                   microbatches=2)),
                                           ("pipedream_3_to_2", "pipedream", Plan.straight(TWO, schedule="pipedream"))],
                    timeout_s=180, comm_timeout_s=60)
    on_three = launch(second_half, 3, root, [("flush_to_hybrid", "flush", hybrid("flush")),
                                             ("flush_to_gpipe", "flush", Plan.straight(THREE, schedule="gpipe",
                                                                                       microbatches=2))],
                      timeout_s=180, comm_timeout_s=60)
    return {**on_two, **on_three}


def plain_training() -> dict[str, torch.Tensor]:
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=LR, momentum=0.9)
    for x, y in data():
        opt.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
    return {k: v.detach() for k, v in m.state_dict().items()}


def continuation_rule() -> dict[str, torch.Tensor]:
    m = model()
    live = {k: nn.Parameter(v.detach().clone()) for k, v in m.named_parameters()}
    opt = torch.optim.SGD(live.values(), lr=LR, momentum=0.9)
    history = [{k: p.detach().clone() for k, p in live.items()}]
    for t, (x, y) in enumerate(data()):
        def version(name: str) -> int:
            layer = name.split(".")[0]
            if t < 6:
                return max(0, t - (2 - STAGE3[layer]))
            return 6 + max(0, (t - 6) - (1 - STAGE2[layer]))

        params = {k: history[version(k)][k].clone().requires_grad_(True) for k in live}
        loss = nn.functional.cross_entropy(functional_call(m, params, (x,)), y)
        for p, g in zip(live.values(), torch.autograd.grad(loss, list(params.values()))):
            p.grad = g
        opt.step()
        history.append({k: p.detach().clone() for k, p in live.items()})
    return history[-1]


def assert_close(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-5, msg=f"parameter {k}")


@pytest.mark.parametrize("name", ["flush_3_to_2", "flush_to_hybrid", "flush_to_gpipe"])
def test_synchronous_schedules_continue_exactly_on_another_plan(results, name):
    assert_close(results[name], plain_training())


def test_pipedream_continues_by_its_rule_on_fewer_stages(results):
    got = results["pipedream_3_to_2"]
    assert_close(got, continuation_rule())
    # The rule matters: plain training is something else.
    assert max((got[k] - v).abs().max().item() for k, v in plain_training().items()) > 1e-4
