"""Models' outputs as the user sees them, on both tracing paths: a ModelOutput reaches
``loss_fn`` as a ModelOutput (torch.fx would hand an immutable dict), and accuracy is counted on
the model's scores for torch.export-traced models and ModelOutputs alike (issue 37)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

import torchpipedream as tpd

ModelOutput = pytest.importorskip("transformers.utils").ModelOutput


@dataclass
class Scores(ModelOutput):
    logits: torch.Tensor = None


class WithModelOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> Scores:
        return Scores(logits=self.b(torch.relu(self.a(x))))


class ExportOnly(nn.Module):
    """Control flow on a shape: torch.fx cannot trace it, torch.export can; returns a dict."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.a(x)
        if h.shape[1] > 3:
            h = torch.relu(h)
        return {"logits": self.b(h)}


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 4, generator=g), torch.randint(0, 3, (16,), generator=g)


def _loss(out, y: torch.Tensor) -> torch.Tensor:
    logits = out.logits if isinstance(out, ModelOutput) else out["logits"]
    return nn.functional.cross_entropy(logits, y)


@pytest.mark.parametrize("cls, method", [(WithModelOutput, "fx"), (ExportOnly, "export")])
def test_loss_fn_and_accuracy_see_the_models_output(cls, method):
    torch.manual_seed(0)
    model = cls()
    x, y = _data()
    seen = []

    def loss_fn(out, target):
        seen.append(type(out))
        return _loss(out, target)

    graph = tpd.profile(model, x, loss_fn=loss_fn, target=y, iters=1, warmup=0)
    assert graph.meta["split"] == method
    plan = tpd.Plan.straight([graph.names], schedule="flush", microbatches=2)
    pipe = tpd.Pipeline(model, plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=loss_fn, sample=x)
    pipe.train_step((x, y))
    got = pipe.evaluate([(x, y)])
    model.load_state_dict(pipe.state_dict())
    with torch.no_grad():
        logits = model(x)["logits"]  # a ModelOutput is a dict too
    want = (logits.argmax(dim=1) == y).float().mean().item()
    assert got["accuracy"] == pytest.approx(want)  # None before: the export graph's output is a flat tuple
    if cls is WithModelOutput:
        assert set(seen) == {Scores}  # profile, training and evaluation alike
    else:
        assert seen and all(issubclass(t, dict) for t in seen)


class KwargsNet(nn.Module):
    """An optional argument and a keyword-only one, both with defaults."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, *, temperature: float = 2.0) -> torch.Tensor:
        h = torch.relu(self.a(x)) / temperature
        if mask is not None:
            h = h * mask
        return self.b(h)


GIVEN = ["x", "x and mask", "x and temperature"]


def _kwargs_case(given: str) -> tuple[dict, torch.Tensor, object, tpd.Plan]:
    """The inputs a sample gives (``given``), the targets, the model's profile and a plan cut before ``b``."""
    x, y = _data()
    mask = (torch.arange(8) % 2).float().expand(16, 8)
    inputs = {"x": x, **({"mask": mask} if "mask" in given else {}),
              **({"temperature": 3.0} if "temperature" in given else {})}
    torch.manual_seed(0)
    graph = tpd.profile(KwargsNet(), inputs, loss_fn=nn.CrossEntropyLoss(), target=y, iters=1, warmup=0)
    cut = graph.names.index("b")
    plan = tpd.Plan.straight([graph.names[:cut], graph.names[cut:]], schedule="flush", microbatches=2)
    return inputs, y, graph, plan


@pytest.fixture(scope="module")
def kwargs_runs() -> dict[str, tuple[dict, torch.Tensor, object, dict]]:
    """given -> (inputs, targets, profile, the pipeline's trained state) of every case, trained in
    one launch of 2 processes (spawning costs seconds on a 2-core machine)."""
    cases = {given: _kwargs_case(given) for given in GIVEN}
    runs = {given: (plan, inputs, y) for given, (inputs, y, _, plan) in cases.items()}
    trained = tpd.launch(_train_every_kwargs_case, 2, runs, timeout_s=240)
    return {g: (inputs, y, graph, trained[g]) for g, (inputs, y, graph, _) in cases.items()}


@pytest.mark.parametrize("given", GIVEN)
def test_optional_and_keyword_only_arguments_take_their_defaults_on_the_fx_path(kwargs_runs, given):
    """The arguments a sample leaves out are traced as their defaults (fx renames their
    placeholders, mask to mask_1; they are dropped by position), and the pipeline trains the
    graph exactly as the model runs with the same arguments."""
    inputs, y, graph, results = kwargs_runs[given]
    assert graph.meta["split"] == "fx" and not any(n.startswith(("mask_1", "temperature_1")) for n in graph.names)
    torch.manual_seed(0)
    reference = KwargsNet()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    nn.functional.cross_entropy(reference(**inputs), y).backward()
    optimizer.step()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(results[key], value, atol=1e-6, rtol=1e-6)


def _train_kwargs(rank: int, plan, inputs, y):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    pipe = tpd.Pipeline(KwargsNet(), plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                        loss_fn=nn.CrossEntropyLoss(), sample=inputs, timeout_s=60)
    pipe.train_step((inputs, y))
    return pipe.state_dict(dst=0)


def _train_every_kwargs_case(rank: int, cases: dict) -> dict:
    return {given: _train_kwargs(rank, *case) for given, case in cases.items()}


class ShapeBranch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x) if x.shape[1] > 3 else x  # fx cannot trace it, torch.export can


def test_a_sequential_profiled_through_export_needs_the_same_sample_and_says_so():
    """A Sequential that fx cannot trace is profiled by torch.export (its layers are graph
    nodes); without the sample the Pipeline splits it by children, which the plan does not
    name: refused with what to do, and trained once the sample is given."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), ShapeBranch(), nn.Linear(8, 3))
    x, y = _data()
    graph = tpd.profile(model, x, loss_fn=nn.CrossEntropyLoss(), target=y, iters=1, warmup=0)
    assert graph.meta["split"] == "export"
    plan = tpd.Plan.straight([graph.names], schedule="flush", microbatches=2)
    factory = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    with pytest.raises(ValueError, match=r"give the Pipeline the profile's sample \(sample=\.\.\.\)"):
        tpd.Pipeline(model, plan, optimizer=factory, loss_fn=nn.CrossEntropyLoss())
    pipe = tpd.Pipeline(model, plan, optimizer=factory, loss_fn=nn.CrossEntropyLoss(), sample=x)
    assert isinstance(pipe.train_step((x, y)), float)


def _gpt2_batches() -> list[dict[str, torch.Tensor]]:
    import zoo_models as zoo

    g = torch.Generator().manual_seed(1)
    out = []
    for length in (12, 7, 10):  # each minibatch padded to its own longest, say
        ids = torch.randint(0, zoo.VOCAB, (8, length), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def _train_gpt2(rank: int, names: list[str]) -> dict[str, torch.Tensor]:
    import zoo_models as zoo

    torch.set_num_threads(1)
    half = len(names) // 2
    plan = tpd.Plan.straight([names[:half], names[half:]], schedule="flush", microbatches=2)
    pipe = tpd.Pipeline(zoo.gpt2(), plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.5), sample=_gpt2_batches()[0],
                        timeout_s=60)
    pipe.train_minibatches(_gpt2_batches())
    return pipe.state_dict(dst=0)


def test_an_exported_model_takes_sequences_of_other_lengths_than_its_sample():
    """torch.export traces GPT-2 with every input dimension dynamic where the model allows it,
    so minibatches of 12, 7 and 10 tokens train through two stages exactly as in one process
    (with only the batch dimension dynamic, the second failed: "shape '[-1, 12]' is invalid")."""
    pytest.importorskip("transformers")
    import zoo_models as zoo

    names = tpd.profile(zoo.gpt2(), _gpt2_batches()[0], iters=1, warmup=0).names
    got = tpd.launch(_train_gpt2, 2, names, timeout_s=240)
    reference = zoo.gpt2()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for batch in _gpt2_batches():
        optimizer.zero_grad()
        reference(**batch).loss.backward()
        optimizer.step()
    for key, value in reference.state_dict().items():
        if key in got:
            torch.testing.assert_close(got[key], value, atol=1e-6, rtol=1e-5, msg=key)
