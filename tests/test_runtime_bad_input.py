"""Bad input refused clearly across real processes (gloo, 2 workers): a plan for another number
of workers, an optimizer factory that fails, and batches whose shapes change (renegotiated by
design: they train like plain PyTorch) or do not fit the model (the stage's own error, named
by rank, within seconds: no hang)."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from torchpipedream.plans.plan import Plan, PlanError
from torchpipedream.runtime import LaunchError, Pipeline, PipelineError, launch

LR = 0.1


def head() -> nn.Module:
    """Stage 1: mean over a variable-length middle dimension, then a classifier."""

    class Pool(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.b = nn.Linear(8, 8)
            self.c = nn.Linear(8, 3)

        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return self.c(torch.tanh(self.b(h)).mean(dim=1))

    return Pool()


def stages() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(4, 8), nn.Tanh()), head()]


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Minibatches of (N, L, 4) whose N and L both change: the cut activation (N, L, 8) too."""
    g = torch.Generator().manual_seed(2)
    return [(torch.randn(n, seq, 4, generator=g), torch.randint(0, 3, (n,), generator=g))
            for n, seq in ((8, 5), (8, 7), (6, 3), (8, 5))]


def sgd(params):
    return torch.optim.SGD(params, lr=LR)


TWO = Plan.straight([["first"], ["second"]], schedule="flush", microbatches=2)


def refusals(rank: int) -> dict:
    out: dict = {}
    for key, plan in (("three", Plan.straight([["a"], ["b"], ["c"]])), ("one", Plan.straight([["a"]]))):
        try:
            Pipeline(stages(), plan, optimizer=sgd, loss_fn=nn.CrossEntropyLoss(), timeout_s=10)
        except PlanError as exc:
            out[key] = str(exc)

    def failing(params):
        raise ValueError("lr must be set")

    for key, factory in (("raises", failing), ("not_optimizer", lambda params: "sgd")):
        try:
            Pipeline(stages(), TWO, optimizer=factory, loss_fn=nn.CrossEntropyLoss(), timeout_s=10)
        except PipelineError as exc:
            out[key] = str(exc)
    # Shapes change from minibatch to minibatch (and between calls): renegotiated, trained.
    pipe = Pipeline(stages(), TWO, optimizer=sgd, loss_fn=nn.CrossEntropyLoss(), timeout_s=10)
    b = batches()
    pipe.train_minibatches(b[:2])
    pipe.train_minibatches(b[2:])
    out["state"] = pipe.state_dict(dst=0)
    return out


def misfit(rank: int) -> None:
    pipe = Pipeline(stages(), TWO, optimizer=sgd, loss_fn=nn.CrossEntropyLoss(), timeout_s=10)
    b = batches()
    pipe.train_step(b[0])
    pipe.train_step((torch.randn(8, 5, 6), b[0][1]))  # 6 features where the first layer takes 4


@pytest.fixture(scope="module")
def results():
    return launch(refusals, 2, timeout_s=90, comm_timeout_s=20, return_all=True)


def test_plan_for_another_number_of_workers_is_refused(results):
    for rank in (0, 1):
        assert "the plan is for 3 workers (straight ×3) but 2 were launched" in results[rank]["three"]
        assert "the plan is for 1 workers (single worker) but 2 were launched" in results[rank]["one"]


def test_failing_optimizer_factory_names_the_stage(results):
    for rank in (0, 1):
        msg = results[rank]["raises"]
        assert f"rank {rank} (stage {rank}): the optimizer factory raised ValueError: lr must be set" in msg
        assert "returned str, not a torch.optim.Optimizer" in results[rank]["not_optimizer"]


def test_changing_batch_shapes_are_renegotiated_and_train_exactly(results):
    """Reference: plain PyTorch, one process, full-minibatch SGD (flush = gradient accumulation)."""
    s0, s1 = stages()
    opt = torch.optim.SGD(list(s0.parameters()) + list(s1.parameters()), lr=LR)
    for x, y in batches():
        opt.zero_grad()
        nn.functional.cross_entropy(s1(s0(x)), y).backward()
        opt.step()
    ref = {f"0.{k}": v for k, v in s0.state_dict().items()} | {f"1.{k}": v for k, v in s1.state_dict().items()}
    got = results[0]["state"]
    assert got.keys() == ref.keys()
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(90)
def test_batch_that_does_not_fit_the_model_fails_fast_naming_the_rank():
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"(?s)worker rank 0 failed.*rank 0: RuntimeError: mat1 and mat2 shapes"):
        launch(misfit, 2, timeout_s=60, comm_timeout_s=20)
    assert time.monotonic() - t0 < 45  # the other rank is stopped, not left waiting
