"""Virtual stages on 2 and 4 processes, each holding two stages: interleaved 1F1B (looped) and
ZB-V (in a V, backward split into B and W); and on one process holding three (interleaved) or two
(ZB-V), every transfer a hand-over in memory. Each trains exactly what plain single-process
training with gradient accumulation trains. The reference is plain PyTorch written here."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchpipedream.plans.plan import Plan
from torchpipedream.runtime import Pipeline, launch

LR, BATCH, BATCHES = 0.1, 16, 3


def deep_mlp() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(6, 16), nn.Tanh()]
    for _ in range(6):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(16, 3))


#: fx layer names of deep_mlp ("_0" .. "_14"), cut into 8 and 4 chunks and 3
NAMES = ["input_1"] + [f"_{i}" for i in range(15)]
CUTS = {8: [NAMES[:3]] + [NAMES[k:k + 2] for k in range(3, 15, 2)] + [NAMES[15:]],
        4: [NAMES[:5], NAMES[5:9], NAMES[9:13], NAMES[13:]],
        3: [NAMES[:5], NAMES[5:11], NAMES[11:]],
        2: [NAMES[:9], NAMES[9:]]}
KINDS = ("interleaved", "zb-v")


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(BATCH, 6, generator=g), torch.randint(0, 3, (BATCH,), generator=g)) for _ in range(BATCHES)]


def optimizer(params):
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def train(workers: int, chunks: int, m: int, kind: str = "interleaved") -> dict:
    cut = CUTS[workers * chunks]
    plan = Plan.v_shape(cut, workers, microbatches=m) if kind == "zb-v" else Plan.looped(cut, workers, microbatches=m)
    pipe = Pipeline(deep_mlp(), plan, optimizer=optimizer, loss_fn=nn.CrossEntropyLoss(), timeout_s=60)
    losses = pipe.train_minibatches(data())
    trace = pipe.trace(dst=0)
    return {"full": pipe.state_dict(dst=0), "losses": losses, "eval": pipe.evaluate(data()[:1]),
            "events": None if trace is None else [(e.rank, e.stage, e.kind, e.id) for e in trace.events]}


def worker(rank: int, workers: int) -> dict:
    torch.set_num_threads(1)
    return {kind: train(workers, 2, 2 * workers, kind) for kind in KINDS}


def reference() -> tuple[dict[str, torch.Tensor], list[float], float]:
    model = deep_mlp()
    opt = optimizer(model.parameters())
    losses = []
    for x, y in data():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        x, y = data()[0]
        evaluated = nn.functional.cross_entropy(model(x), y).item()
    return {k: v.detach() for k, v in model.state_dict().items()}, losses, evaluated


def assert_trained_like_the_reference(out: dict) -> None:
    want, losses, evaluated = reference()
    got = out["full"]
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-5, msg=f"parameter {k}")
    assert max((got[k] - deep_mlp().state_dict()[k]).abs().max().item() for k in want) > 1e-3  # it trained
    assert out["losses"] == pytest.approx(losses, abs=1e-5)
    assert out["eval"]["loss"] == pytest.approx(evaluated, abs=1e-5)


@pytest.fixture(scope="module", params=[2, 4], ids=["2_processes", "4_processes"])
def run(request) -> tuple[int, list[dict]]:
    n = request.param
    return n, launch(worker, n, n, timeout_s=240, comm_timeout_s=60, return_all=True)


@pytest.mark.parametrize("kind", KINDS)
def test_virtual_stages_equal_plain_training_with_gradient_accumulation(run, kind: str) -> None:
    n, results = run
    assert_trained_like_the_reference(results[0][kind])
    assert all(r[kind]["losses"] == results[0][kind]["losses"] for r in results)


def test_each_rank_ran_its_two_stages_interleaved(run) -> None:
    n, results = run
    events = results[0]["interleaved"]["events"]
    for rank in range(n):
        assert {s for r, s, _, _ in events if r == rank} == {rank, rank + n}
        order = [s for r, s, k, _ in events if r == rank and k == "F"]
        assert order[:n] == [rank] * n and order[n:2 * n] == [rank + n] * n  # a round per chunk


def test_zb_v_ran_its_v_and_split_every_backward(run) -> None:
    n, results = run
    events = results[0]["zb-v"]["events"]
    for rank in range(n):
        assert {s for r, s, _, _ in events if r == rank} == {rank, 2 * n - 1 - rank}
        mine = [(s, k, i) for r, s, k, i in events if r == rank]
        for s, k, i in mine:
            if k == "B":  # every backward split: its W later on the same rank
                assert mine.index((s, "B", i)) < mine.index((s, "W", i))


@pytest.mark.parametrize("kind, chunks", [("interleaved", 3), ("zb-v", 2)])
def test_one_process_holding_several_stages_hands_over_in_memory(kind: str, chunks: int) -> None:
    out = train(1, chunks, 4, kind)
    assert_trained_like_the_reference(out)
    assert {s for _, s, _, _ in out["events"]} == set(range(chunks))
