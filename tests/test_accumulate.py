"""``Pipeline(accumulate=k)``: one update per k minibatches, against references in plain
PyTorch (one launch of 3 gloo processes for every scenario), and its refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from torchpipedream.plans.plan import Plan, Stage
from torchpipedream.runtime import Pipeline, PipelineError, launch
from torchpipedream.runtime.lr_schedule import LRSchedule

LR = 0.2
LAYERS = [["input_1", "_0", "_1"], ["_2", "_3"], ["_4"]]
STAGE_OF = {"0": 0, "2": 1, "4": 2}  # first module index of a parameter name -> its stage


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def data(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


SCENARIOS = {
    # name: (kind, microbatches, accumulate, minibatches, replicated 2-1 plan)
    "flush": ("flush", 2, 2, 5, False),  # 5 = two groups of 2 and a last update of 1
    "zb-h1": ("zb-h1", 2, 3, 6, False),
    "gpipe_2_1": ("gpipe", 2, 2, 4, True),
    "2bw": ("2bw", 2, 2, 6, False),
    # with the recipe: a learning rate per update, clipping by the norm of each update's gradient
    "flush_recipe": ("flush", 2, 2, 7, False),
    "2bw_recipe": ("2bw", 2, 3, 6, False),
}
#: The recipe of the "_recipe" scenarios: updates counted, not minibatches.
SCHEDULE = LRSchedule("linear", warmup=1, total=4)
MAX_NORM = 0.3


def _plan(kind: str, m: int, replicated: bool) -> Plan:
    if replicated:
        return Plan(stages=[Stage(layers=LAYERS[0] + LAYERS[1], replicas=2, ranks=[0, 1]),
                            Stage(layers=LAYERS[2], ranks=[2])], schedule=kind, microbatches=m)
    return Plan.straight(LAYERS, schedule=kind, microbatches=m)


def worker(rank: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for name, (kind, m, k, n, replicated) in SCENARIOS.items():
        recipe = name.endswith("_recipe")
        pipe = Pipeline(mlp(), _plan(kind, m, replicated), optimizer=lambda p: torch.optim.SGD(p, lr=LR, momentum=0.5),
                        loss_fn=nn.CrossEntropyLoss(), accumulate=k, timeout_s=30,
                        lr_scheduler=SCHEDULE if recipe else None, clip_grad_norm=MAX_NORM if recipe else None)
        losses = pipe.train_minibatches(data(n))
        out[name] = {"losses": losses, "state": pipe.state_dict(dst=0), "version": pipe.weights.version,
                     "done": pipe.minibatches_done, "norms": pipe.grad_norms}
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return launch(worker, 3, timeout_s=240, comm_timeout_s=60, return_all=True)


def _groups(n: int, k: int) -> list[list[int]]:
    return [list(range(i, min(n, i + k))) for i in range(0, n, k)]


def reference(n: int, k: int, stale: bool, recipe: bool = False) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Updates of k minibatches each (the mean loss over all their samples), SGD with momentum
    per stage; ``stale``: 2BW's rule, update u's gradient computed with the weights after u − 1
    updates (w^(u−1), the first with w^(0)); ``recipe``: each update's gradient clipped by its
    norm over the whole model, the learning rate times SCHEDULE(u). Returns the final weights
    and the updates' norms (with ``recipe``)."""
    module = mlp()
    live = {k_: nn.Parameter(v.detach().clone()) for k_, v in module.named_parameters()}
    optimizer = torch.optim.SGD(list(live.values()), lr=LR, momentum=0.5)
    norms = []
    history = [{k_: p.detach().clone() for k_, p in live.items()}]
    batches = data(n)
    for u, group in enumerate(_groups(n, k)):
        weights = history[max(0, u - 1)] if stale else history[u]
        params = {k_: w.clone().requires_grad_(True) for k_, w in weights.items()}
        x = torch.cat([batches[i][0] for i in group])
        y = torch.cat([batches[i][1] for i in group])
        loss = nn.functional.cross_entropy(functional_call(module, params, (x,)), y)
        grads = torch.autograd.grad(loss, list(params.values()))
        for p, g in zip(live.values(), grads):
            p.grad = g
        if recipe:
            norms.append(float(torch.nn.utils.clip_grad_norm_(list(live.values()), MAX_NORM)))
            for group in optimizer.param_groups:
                group["lr"] = LR * SCHEDULE(u)
        optimizer.step()
        history.append({k_: p.detach().clone() for k_, p in live.items()})
    return history[-1], norms


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_one_update_per_k_minibatches_equals_the_reference(results, name):
    kind, m, k, n, _ = SCENARIOS[name]
    got = results[0][name]
    want, norms = reference(n, k, stale=kind == "2bw", recipe=name.endswith("_recipe"))
    for key, value in want.items():
        torch.testing.assert_close(got["state"][key], value, atol=1e-5, rtol=1e-5, msg=f"{name}: {key}")
    assert got["version"] == len(_groups(n, k))  # updates, not minibatches
    assert got["done"] == n and len(got["losses"]) == n  # one loss per minibatch, on every rank
    assert all(r[name]["losses"] == got["losses"] for r in results)
    assert got["norms"] == pytest.approx(norms, rel=1e-6)
    if norms:
        assert sum(x > MAX_NORM for x in norms) >= 2  # it really clipped


def test_the_reference_tells_accumulation_from_one_update_per_minibatch(results):
    """Without accumulation the weights differ by more than the tolerance above."""
    got = results[0]["flush"]["state"]
    one_each, _ = reference(5, 1, stale=False)
    assert max((got[key] - value).abs().max().item() for key, value in one_each.items()) > 1e-3


@pytest.mark.parametrize("kind", ["pipedream", "naive"])
def test_kinds_that_update_every_minibatch_refuse_accumulate_by_name(kind):
    with pytest.raises(PipelineError, match=f"accumulate=2 needs a kind .*{kind} updates once per minibatch"):
        Pipeline(mlp(), Plan.straight([sum(LAYERS, [])], schedule=kind), optimizer=lambda p: torch.optim.SGD(p, lr=LR),
                 loss_fn=nn.CrossEntropyLoss(), accumulate=2)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_accumulate_must_be_a_positive_whole_number(bad):
    with pytest.raises(PipelineError, match="accumulate must be a whole number"):
        Pipeline(mlp(), Plan.straight([sum(LAYERS, [])], schedule="flush", microbatches=2),
                 optimizer=lambda p: torch.optim.SGD(p, lr=LR), loss_fn=nn.CrossEntropyLoss(), accumulate=bad)
