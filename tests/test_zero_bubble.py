"""Zero Bubble H1 and H2 on 2 and 4 processes: the backward split into B (inputs' gradient, sent
at once) and W (weights' gradient, later) trains exactly what plain single-process training
with gradient accumulation trains; zb-2bw (2bw with the split) exactly what 2bw's rule trains,
W^(t+1) = W^(t) − η∇f_t(W^(t−1)). The references are plain PyTorch written here; the 3-process
scenarios (skip connections, shared parameters, a transformer, recomputation, bf16, fp16 loss
scaling) are in tests/test_runtime_parity.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchpipedream.plans.plan import Plan
from torchpipedream.runtime import Pipeline, launch

LR, BATCH, BATCHES = 0.1, 16, 3


def deep_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


#: fx layer names of deep_mlp, cut into 2 and 4 stages
CUTS = {2: [["input_1", "_0", "_1", "_2", "_3"], ["_4", "_5", "_6"]],
        4: [["input_1", "_0", "_1"], ["_2", "_3"], ["_4", "_5"], ["_6"]]}
MICROBATCHES = {2: 4, 4: 8}
#: zb-2bw: m = 1 of 2 stages holds 2bw's depth; m = 2 of 4 (< n − 1) up to two batches per stage
MICROBATCHES_2BW = {2: 1, 4: 2}


def microbatches(kind: str, n: int) -> int:
    return (MICROBATCHES_2BW if kind == "zb-2bw" else MICROBATCHES)[n]


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)) for _ in range(BATCHES)]


def optimizer(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


KINDS = ("zb-h1", "zb-h2", "zb-2bw")


def worker(rank: int, n: int) -> dict:
    torch.set_num_threads(1)
    out = {}
    for kind in KINDS:
        m = microbatches(kind, n)
        pipe = Pipeline(deep_mlp(), Plan.straight(CUTS[n], schedule=kind, microbatches=m), optimizer=optimizer,
                        loss_fn=nn.CrossEntropyLoss(), microbatches=m, timeout_s=60)
        losses = pipe.train_minibatches(data())
        trace = pipe.trace(dst=0)
        out[kind] = {"full": pipe.state_dict(dst=0), "losses": losses,
                     "events": None if trace is None else [(e.rank, e.kind, e.id) for e in trace.events]}
    return out


def reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    model = deep_mlp()
    opt = optimizer(model.parameters())
    losses = []
    for x, y in data():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {k: v.detach() for k, v in model.state_dict().items()}, losses


def reference_2bw() -> dict[str, torch.Tensor]:
    """2bw's rule with SGD + momentum: batch t's gradient is taken at the weights after t − 1
    updates (the initial ones for t = 0) and applied to the current weights."""
    model = deep_mlp()
    live = dict(model.named_parameters())
    opt = optimizer(live.values())
    history = [{k: p.detach().clone() for k, p in live.items()}]
    for t, (x, y) in enumerate(data()):
        params = {k: v.clone().requires_grad_(True) for k, v in history[max(0, t - 1)].items()}
        loss = nn.functional.cross_entropy(torch.func.functional_call(model, params, (x,)), y)
        grads = torch.autograd.grad(loss, list(params.values()))
        for p, g in zip(live.values(), grads):
            p.grad = g
        opt.step()
        history.append({k: p.detach().clone() for k, p in live.items()})
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module", params=[2, 4], ids=["2_processes", "4_processes"])
def run(request) -> tuple[int, list[dict]]:
    n = request.param
    return n, launch(worker, n, n, timeout_s=240, comm_timeout_s=60, return_all=True)


@pytest.mark.parametrize("kind", ["zb-h1", "zb-h2"])
def test_zero_bubble_equals_plain_training_with_gradient_accumulation(run, kind: str) -> None:
    n, results = run
    want, losses = reference()
    got = results[0][kind]["full"]
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-5, msg=f"parameter {k}")
    assert max((got[k] - deep_mlp().state_dict()[k]).abs().max().item() for k in want) > 1e-3  # it trained
    assert results[0][kind]["losses"] == pytest.approx(losses, abs=1e-5)


def test_zb_2bw_follows_the_2bw_rule(run) -> None:
    _, results = run
    got, want = results[0]["zb-2bw"]["full"], reference_2bw()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-5, msg=f"parameter {k}")
    sync, _ = reference()
    assert max((got[k] - sync[k]).abs().max().item() for k in want) > 1e-4  # not plain training


@pytest.mark.parametrize("kind", KINDS)
def test_every_microbatch_has_a_b_then_a_w_and_the_gradient_leaves_before_w(run, kind: str) -> None:
    n, results = run
    events = results[0][kind]["events"]
    m = microbatches(kind, n)
    for rank in range(n):
        mine = [(kind, i) for r, kind, i in events if r == rank]
        for i in range(BATCHES * m):
            b, w = mine.index(("B", i)), mine.index(("W", i))
            assert b < w, (rank, i)
            if rank > 0:  # the input gradient is sent between B and W, not after W
                assert b < mine.index(("SG", i)) < w, (rank, i)
