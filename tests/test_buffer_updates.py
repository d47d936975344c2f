"""A buffer the model updates in its forward (a running mean under ``torch.no_grad()``): torch.fx
would trace the update without its no_grad (and run part of it on the real buffer while
tracing), so the model is traced by torch.export, and the pipeline updates the buffer once per
microbatch, in microbatch order, as one process running the same microbatches does."""

from __future__ import annotations

import torch
from torch import nn

import torchpipedream as tpd
from torchpipedream.model.capture import trace

M = 2  # microbatches per minibatch


class RunningMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)
        self.register_buffer("ema", torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        with torch.no_grad():
            self.ema.mul_(0.9).add_(h.mean(0) * 0.1)
        return self.b(h - self.ema)


class WithoutNoGrad(RunningMean):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        ema = self.ema * 0.9 + h.mean(0) * 0.1
        self.ema.copy_(ema.detach())
        return self.b(h - ema)


def model(cls: type[RunningMean] = RunningMean) -> nn.Module:
    torch.manual_seed(0)
    return cls()


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(3)]


def worker(rank: int, names: list[str]) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    cut = names.index("sub")
    plan = tpd.Plan.straight([names[:cut], names[cut:]], schedule="flush", microbatches=M)
    pipe = tpd.Pipeline(model(), plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.5), loss_fn=nn.CrossEntropyLoss(),
                        sample=data()[0][0], timeout_s=60)
    pipe.train_minibatches(data())
    return pipe.state_dict(dst=0)


def reference(cls: type[RunningMean] = RunningMean) -> dict[str, torch.Tensor]:
    """One process, the same microbatches in order: the buffer moves once per microbatch; the
    gradient of the minibatch's mean loss."""
    net = model(cls)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    for x, y in data():
        optimizer.zero_grad()
        for xm, ym in zip(x.chunk(M), y.chunk(M)):
            (nn.functional.cross_entropy(net(xm), ym) * len(xm) / len(x)).backward()
        optimizer.step()
    return net.state_dict()


def test_the_update_is_traced_by_export_and_the_users_model_is_left_alone():
    net = model()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    x, y = data()[0]
    assert trace(net, (x,), {}).method == "export"
    graph = tpd.profile(net, x, loss_fn=nn.CrossEntropyLoss(), target=y, iters=1, warmup=0)
    assert graph.meta["split"] == "export"
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())  # profile put everything back


def test_the_pipeline_updates_the_buffer_as_one_process_does():
    x, y = data()[0]
    names = tpd.profile(model(), x, loss_fn=nn.CrossEntropyLoss(), target=y, iters=1, warmup=0).names
    got, want = tpd.launch(worker, 2, names, timeout_s=120), reference()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, atol=1e-6, rtol=1e-6, msg=key)
    assert got["ema"].abs().sum() > 0  # it moved
    # what fx's graph computed (the update without its no_grad: a gradient through the buffer)
    # differs by far more than the tolerance, so the test can tell
    wrong = reference(WithoutNoGrad)
    assert max((wrong[k] - want[k]).abs().max().item() for k in want) > 1e-3
