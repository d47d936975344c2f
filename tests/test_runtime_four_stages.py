"""Four straight stages, several calls with evaluation in between, a stage without weights.

Regression for a stage that holds no trainable parameters (a planner cut such as
``[relu, maxpool, flatten]``): vertical sync and 2BW name an older weight version than the
stage's current one, and the stage kept no stash of its (empty) weights, so the run failed
with "weight version 1 was requested but this stage holds version 2". Whether the planner
made such a cut depended on the profile's timings, which made the failure look intermittent.

One launch of 4 gloo processes runs every scenario; each is compared with an independent
single-process reference of its update rule (one optimizer per stage, explicit weight
histories) written with plain PyTorch here. Naive pipelining is also run twice to check that
it is deterministic.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from torchpipedream.plans.plan import Plan
from torchpipedream.runtime import Pipeline, launch
from torchpipedream.runtime.weights import WeightVersions

LR = 0.05
N = 4  # stages = processes
CALLS = (5, 6)  # minibatches per fit() call; evaluate() after each call

# fx names of mlp4() and, written by hand, the Sequential indices of each stage.
PLANS = {
    "dense": ([["input_1", "_0", "_1"], ["_2", "_3"], ["_4", "_5"], ["_6"]], [[0, 1], [2, 3], [4, 5], [6]]),
    # Stage 1 is a lone Tanh: no trainable parameters.
    "empty": ([["input_1", "_0"], ["_1"], ["_2", "_3", "_4"], ["_5", "_6"]], [[0], [1], [2, 3, 4], [5, 6]]),
}
SCENARIOS = {
    "naive_dense": dict(plan="dense", kind="naive"),
    "naive_dense_again": dict(plan="dense", kind="naive"),
    "naive_empty": dict(plan="empty", kind="naive"),
    "pipedream_empty": dict(plan="empty", kind="pipedream"),
    "vsync_empty": dict(plan="empty", kind="pipedream", vsync=True),
    "2bw_empty": dict(plan="empty", kind="2bw", m=2),
    # m = 2 < n − 1: zb-2bw holds up to two batches per stage
    "zb-2bw_dense": dict(plan="dense", kind="zb-2bw", m=2),
    "zb-2bw_empty": dict(plan="empty", kind="zb-2bw", m=2),
}


def mlp4() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 3))


def data(n: int, seed: int, size: int = 8) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 4, generator=g), torch.randint(0, 3, (size,), generator=g)) for _ in range(n)]


def calls() -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    return [data(n, seed=10 + c) for c, n in enumerate(CALLS)]


TEST = data(2, seed=99)


def momentum(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


# --------------------------------------------------------------------------- the workers
def run_scenario(name: str) -> dict:
    sc = SCENARIOS[name]
    m = sc.get("m", 1)
    plan = Plan.straight(PLANS[sc["plan"]][0], schedule=sc["kind"], microbatches=m)
    pipe = Pipeline(mlp4(), plan, optimizer=momentum, loss_fn=nn.CrossEntropyLoss(), schedule=sc["kind"],
                    microbatches=m if sc["kind"] in ("2bw", "zb-2bw") else None, vertical_sync=sc.get("vsync", False),
                    timeout_s=30)
    evals = []
    for batches in calls():
        pipe.fit(batches)
        evals.append(pipe.evaluate(TEST))
    return {"full": pipe.state_dict(dst=0), "evals": evals}


def worker(rank: int) -> dict:
    torch.set_num_threads(1)
    return {name: run_scenario(name) for name in SCENARIOS}


@pytest.fixture(scope="module")
def results() -> dict:
    return launch(worker, N, timeout_s=150, comm_timeout_s=30)


# --------------------------------------------------------------------------- the reference
def reference(plan: str, version_f, version_b, m: int = 1) -> tuple[dict, list[float]]:
    """Every stage's weights after the calls, and the test loss after each call.

    Minibatch t of a call that starts after ``base`` updates runs stage s's forward with its
    weights after ``version_f(s, t) + base`` updates; the backward recomputes the stage's
    forward from the same stage input with the weights ``version_b(s, t) + base`` and
    differentiates that (equal versions: weight stashing). Then every stage with weights
    takes one optimizer step with the minibatch's mean gradient.
    """
    model = mlp4()
    layers = list(model)
    index = PLANS[plan][1]
    mods = [nn.Sequential(*[layers[i] for i in idx]) for idx in index]
    live = [{k: nn.Parameter(p.detach().clone()) for k, p in mod.named_parameters()} for mod in mods]
    optims = [momentum(list(w.values())) if w else None for w in live]
    history = [[{k: p.detach().clone() for k, p in w.items()}] for w in live]
    test_losses = []
    base = 0
    for batches in calls():
        for t, (x, y) in enumerate(batches):
            ins = [x]
            with torch.no_grad():
                for s, mod in enumerate(mods):
                    ins.append(functional_call(mod, history[s][base + version_f(s, t)], (ins[s],)))
            grad_out = None
            for s in reversed(range(N)):
                w = {k: v.clone().requires_grad_(True) for k, v in history[s][base + version_b(s, t)].items()}
                xin = ins[s].clone().requires_grad_(s > 0)
                out = functional_call(mods[s], w, (xin,))
                wrt = list(w.values()) + ([xin] if s > 0 else [])
                if s == N - 1:
                    grads = torch.autograd.grad(nn.functional.cross_entropy(out, y), wrt)
                else:
                    grads = torch.autograd.grad(out, wrt, grad_outputs=grad_out)
                for p, g in zip(live[s].values(), grads[: len(w)]):
                    p.grad = g
                grad_out = grads[-1] if s > 0 else None
            for s, opt in enumerate(optims):
                if opt is not None:
                    opt.step()
                history[s].append({k: p.detach().clone() for k, p in live[s].items()})
        base += len(batches)
        final = {}
        for s, idx in enumerate(index):
            for k, v in history[s][-1].items():
                pos, name = k.split(".")
                final[f"{idx[int(pos)]}.{name}"] = v
        xt = torch.cat([a for a, _ in TEST])
        yt = torch.cat([b for _, b in TEST])
        with torch.no_grad():
            test_losses.append(nn.functional.cross_entropy(functional_call(model, final, (xt,)), yt).item())
    return final, test_losses


def check(got: dict, want: tuple[dict, list[float]]) -> None:
    final, test_losses = want
    assert sorted(got["full"]) == sorted(final)
    for k in final:
        torch.testing.assert_close(got["full"][k], final[k], atol=1e-5, rtol=1e-5, msg=f"parameter {k}")
    assert [e["loss"] for e in got["evals"]] == pytest.approx(test_losses, abs=1e-5)


def warmup(s: int) -> int:
    return N - s  # forwards before the first backward on stage s (straight 1F1B)


# --------------------------------------------------------------------------- tests
def test_weightless_stage_serves_any_version():
    weights = WeightVersions(nn.Sequential(nn.Tanh(), nn.Flatten()), momentum)
    weights.expect({0: 2, 1: 2})
    assert weights.tensors(0) == {}
    weights.step()
    weights.step()
    assert weights.version == 2 and weights.tensors(1) == {} and weights.tensors(0) == {}


def test_vertical_sync_with_a_weightless_stage_over_several_calls(results):
    v = lambda s, t: max(0, t - N + 1)  # noqa: E731 - every stage uses the input stage's version
    check(results["vsync_empty"], reference("empty", v, v))


def test_pipedream_with_a_weightless_stage(results):
    v = lambda s, t: max(0, t - warmup(s) + 1)  # noqa: E731
    check(results["pipedream_empty"], reference("empty", v, v))


def test_2bw_with_a_weightless_stage(results):
    # Batch t uses version t − 1 on every stage; the microbatches' mean gradient is the batch's.
    v = lambda s, t: max(0, t - 1)  # noqa: E731
    check(results["2bw_empty"], reference("empty", v, v))


@pytest.mark.parametrize("plan", ["dense", "empty"])
def test_zb_2bw_follows_the_2bw_rule(results, plan):
    v = lambda s, t: max(0, t - 1)  # noqa: E731
    check(results[f"zb-2bw_{plan}"], reference(plan, v, v))


@pytest.mark.parametrize("plan", ["dense", "empty"])
def test_naive_matches_its_rule(results, plan):
    # F with the latest weights at F time; B recomputes with the latest at B time (= t updates).
    vf = lambda s, t: max(0, t - warmup(s) + 1)  # noqa: E731
    vb = lambda s, t: t  # noqa: E731
    want = reference(plan, vf, vb)
    check(results[f"naive_{plan}"], want)
    stash = reference(plan, vf, vf)
    assert max((want[0][k] - stash[0][k]).abs().max().item() for k in want[0]) > 1e-4  # tells them apart


def test_naive_is_deterministic(results):
    a, b = results["naive_dense"], results["naive_dense_again"]
    assert all(torch.equal(a["full"][k], b["full"][k]) for k in a["full"])
    assert [e["loss"] for e in a["evals"]] == [e["loss"] for e in b["evals"]]
