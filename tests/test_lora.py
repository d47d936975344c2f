"""LoRA adapters from the ``peft`` package (installed as published) on a frozen model, through
a 2-stage pipeline: only the adapters train, exactly as in one process, the frozen weights stay
bit for bit, and the trained adapters load back into a fresh peft model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

peft = pytest.importorskip("peft")

import torchpipedream as tpd  # noqa: E402
from torchpipedream.runtime import launch  # noqa: E402

LR = 0.5


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 16), nn.Linear(16, 16), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def lora_model() -> nn.Module:
    """Net with rank-2 adapters on ``a`` and ``b`` (random B, so every adapter gets a gradient)."""
    torch.manual_seed(0)
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["a", "b"], lora_dropout=0.0, init_lora_weights=False)
    return peft.get_peft_model(Net(), config)


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(4)]


def worker(rank: int, names: list[str], kind: str) -> dict:
    torch.set_num_threads(1)
    x = data()[0][0]
    plan = tpd.Plan.straight([names[:8], names[8:]], schedule=kind, microbatches=2 if kind == "flush" else 1)
    pipe = tpd.Pipeline(lora_model(), plan, optimizer=lambda named: torch.optim.SGD(named, lr=LR),
                        loss_fn=nn.CrossEntropyLoss(), sample=x, timeout_s=30)
    trained = [n for w in pipe._all_weights() for n in w.names]
    pipe.train_minibatches(data())
    return {"state": pipe.state_dict(dst=0), "trained": trained}


@pytest.fixture(scope="module")
def names() -> list[str]:
    x, y = data()[0]
    return tpd.profile(lora_model(), x, loss_fn=nn.CrossEntropyLoss(), target=y, iters=1, warmup=0).names


def reference() -> dict[str, torch.Tensor]:
    model = lora_model()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    for x, y in data():
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.state_dict()


@pytest.mark.parametrize("kind", ["flush"])
def test_only_the_adapters_train_exactly_as_in_one_process(names, kind):
    results = launch(worker, 2, names, kind, timeout_s=240, return_all=True)
    got, want, start = results[0]["state"], reference(), lora_model().state_dict()
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, atol=1e-6, rtol=1e-6, msg=key)
        if "lora_" in key:
            assert not torch.equal(value, start[key]), f"{key} did not train"  # the test can tell
        else:
            assert torch.equal(got[key], start[key]), f"frozen {key} moved"
    # each rank's optimizer holds adapters only: the frozen base is not given to it
    assert all(all("lora_" in n for n in r["trained"]) and r["trained"] for r in results)

    # the trained adapters load back into a fresh peft model (what `export` users do next)
    fresh = lora_model()
    fresh.load_state_dict(got)
    adapters = peft.get_peft_model_state_dict(fresh)
    assert adapters and all("lora_" in k for k in adapters)
    x = data()[0][0]
    model = reference_model_after_training()
    torch.testing.assert_close(fresh(x), model(x), atol=1e-5, rtol=1e-5)


def reference_model_after_training() -> nn.Module:
    model = lora_model()
    model.load_state_dict(reference())
    return model
