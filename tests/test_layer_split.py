"""split_wide_layers: the same function and the same training, with cut points inside wide layers."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchpipedream.model.layer_split import merge_split_state_dict, split_wide_layers
from torchpipedream.plans.plan import Plan
from torchpipedream.runtime import Pipeline, launch


def classifier() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 5))


def test_split_model_computes_the_same_function_and_gradients() -> None:
    model = classifier()
    split = split_wide_layers(model, parts=3, min_out_features=32)
    names = [n for n, _ in split.named_parameters()]
    assert sum(".weight" in n and "_part" in n for n in names) == 6  # two 40-wide layers, 3 parts each
    assert "4.weight" in names  # the 5-wide output layer stays whole
    x = torch.randn(7, 24)
    torch.testing.assert_close(split(x), model(x), rtol=1e-6, atol=1e-6)
    model(x).square().sum().backward()
    split(x).square().sum().backward()
    grads = merge_split_state_dict({n: p.grad for n, p in split.named_parameters()}, split.split_layers)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6)
    assert merge_split_state_dict(split.state_dict(), split.split_layers).keys() == model.state_dict().keys()


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="positive integer"):
        split_wide_layers(classifier(), parts=0)

    class Untraceable(nn.Module):
        def forward(self, x):
            return x if x.sum() > 0 else -x

    with pytest.raises(ValueError, match="torch.fx can trace"):
        split_wide_layers(Untraceable(), parts=2)


def _train_split_pipeline(rank: int, steps: int) -> dict[str, torch.Tensor] | None:
    model = split_wide_layers(classifier(), parts=4, min_out_features=32)
    names = [n.name for n in torch.fx.symbolic_trace(model).graph.nodes if n.op not in ("placeholder", "output")]
    cut = names.index("_2_part1") + 1  # inside the middle layer: parts 0-1 on stage 0, 2-3 on stage 1
    plan = Plan.straight([names[:cut], names[cut:]])
    pipe = Pipeline(model, plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.05), loss_fn=nn.CrossEntropyLoss(),
                    schedule="flush", microbatches=2, timeout_s=60)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        pipe.train_step((torch.randn(8, 24, generator=g), torch.randint(0, 5, (8,), generator=g)))
    state = pipe.state_dict()
    return merge_split_state_dict(state, model.split_layers) if state is not None else None


@pytest.mark.timeout(120)
def test_a_cut_inside_a_split_layer_trains_like_the_original() -> None:
    steps = 3
    got = launch(_train_split_pipeline, 2, steps, timeout_s=100)
    model = classifier()  # independent reference: the original model, one process
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 24, generator=g), torch.randint(0, 5, (8,), generator=g)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    for n, p in model.state_dict().items():
        torch.testing.assert_close(got[n], p, rtol=1e-5, atol=1e-6)
