"""The composition matrix (schedule kinds × features, runtime/composition.py) against the library.

Every cell runs or is refused with a message; a sample of "runs" cells trains a step in one
process as plain PyTorch does (written here); a sample of "refused" cells is refused by a real
``Pipeline`` with the matrix's message word for word; the README's table is the rendered matrix;
``train --schedule`` takes every kind, and every kind's checkpoints resume.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchpipedream.plans.kinds import KIND_NAMES
from torchpipedream.plans.plan import Plan
from torchpipedream.runtime import LossScaling, Pipeline
from torchpipedream.runtime.composition import (FEATURE_OPTIONS, FEATURES, KINDS, README_BEGIN, README_END,
                                                cell, kind_plan, matrix, readme_path, readme_table,
                                                render_markdown)
from torchpipedream.train.config import TrainConfig, check_options

LR = 0.1
REGENERATE = '.venv/bin/python -c "from torchpipedream.runtime.composition import write_readme; write_readme()"'
#: fx layer names of mlp()
NAMES = ["input_1", "_0", "_1", "_2", "_3", "_4"]
#: fx layer names of TiedLM
TIED_NAMES = ["x", "embedding", "hidden", "tanh", "head"]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


class TiedLM(nn.Module):
    """Embedding and output layer are one matrix, under the name the matrix's plans share."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(11, 8)
        self.hidden = nn.Linear(8, 8)
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.embedding.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.embedding(x))))


def batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def loss_fn(reduction: str) -> nn.Module:
    return nn.CrossEntropyLoss(reduction=reduction)


def sgd(params):
    return torch.optim.SGD(params, lr=LR)


CELLS = matrix()


def test_every_cell_runs_or_is_refused_with_a_message() -> None:
    assert KINDS == KIND_NAMES
    assert set(CELLS) == {(k, f) for k in KINDS for f in FEATURES}
    for (kind, feature), c in CELLS.items():
        assert c.status in ("runs", "refused"), (kind, feature, c)
        if c.status == "refused":
            assert isinstance(c.message, str) and c.message.strip(), (kind, feature)
        else:
            assert c.message is None, (kind, feature)
    # what the matrix is for: both outcomes occur, and a kind's own refusals are named
    assert CELLS[("flush", "fp16")].status == "runs"
    assert "pipedream" in (CELLS[("pipedream", "fp16")].message or "")


def reference_step(feature: str, data: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One SGD update of mlp() on all of ``data`` as plain PyTorch (float32; the mean loss over
    every sample is what each of the sample's features trains on), clipped for clip_grad_norm."""
    model = mlp()
    x = torch.cat([b[0] for b in data])
    y = torch.cat([b[1] for b in data])
    nn.functional.cross_entropy(model(x), y).backward()
    if feature == "clip_grad_norm":
        torch.nn.utils.clip_grad_norm_(model.parameters(), FEATURE_OPTIONS[feature].clip_grad_norm)
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad
    return model.state_dict()


@pytest.mark.parametrize("kind, feature", [
    ("flush", "bf16"), ("flush", "fp16"), ("gpipe", "lr_scheduler"), ("flush", "clip_grad_norm"),
    ("flush", "loss_normalizer"), ("2bw", "accumulate"), ("pipedream", "recomputation"), ("interleaved", "bf16"),
    ("interleaved", "clip_grad_norm"), ("zb-v", "clip_grad_norm"), ("zb-v", "fp16"),
])
def test_a_cell_that_runs_trains_a_step_as_plain_pytorch(kind: str, feature: str) -> None:
    plan = kind_plan(kind, workers=1, layers=NAMES)
    assert CELLS[(kind, feature)].status == "runs"
    assert cell(kind, feature, plan).status == "runs"
    options = FEATURE_OPTIONS[feature]
    kwargs = options.pipeline_kwargs()
    if options.precision == "fp16":  # torch's first scale (2**16) overflows here: the first update would be skipped
        kwargs["loss_scaling"] = LossScaling(init_scale=2.0 ** 8)
    pipe = Pipeline(mlp(), plan, optimizer=sgd, loss_fn=loss_fn(kwargs["loss_reduction"]), schedule=kind, **kwargs)
    data = batches(options.accumulate)
    pipe.train_minibatches(data)
    assert pipe.skipped_updates == 0
    got, want, start = pipe.state_dict(), reference_step(feature, data), mlp().state_dict()
    # one update from W^(0) under every kind here (2bw's first uses W^(0); pipedream's one stage is not stale)
    tolerance = 0.05 if options.precision != "fp32" else 1e-5
    for name, w in want.items():
        moved = (w - start[name]).abs().max()
        assert moved > 1e-4, name
        assert (got[name] - w).abs().max() <= tolerance * moved + 1e-6, (name, kind, feature)


def refusal_by_a_pipeline(kind: str, feature: str, model: nn.Module, plan: Plan, tmp_path) -> str:
    """The message a real one-process Pipeline of ``kind`` with ``feature`` stops with: at
    construction, at its first step, or at ``load_checkpoint`` for the checkpoint feature."""
    options = FEATURE_OPTIONS[feature]
    kwargs = options.pipeline_kwargs()
    target = (lambda out, y: out.float().mean()) if isinstance(model, TiedLM) else loss_fn(kwargs["loss_reduction"])
    x = torch.randint(0, 11, (8, 5)) if isinstance(model, TiedLM) else batches(1)[0][0]
    try:
        pipe = Pipeline(model, plan, optimizer=sgd, loss_fn=target, schedule=kind, **kwargs)
        if options.checkpoint:
            pipe.load_checkpoint(tmp_path)
        pipe.train_step((x, torch.zeros(8, dtype=torch.long)))
    except ValueError as exc:
        return str(exc)
    raise AssertionError(f"a {kind} pipeline with {feature} ran")


@pytest.mark.parametrize("kind, feature", [
    ("pipedream", "fp16"), ("zb-2bw", "fp16"),
    ("pipedream", "accumulate"), ("naive", "accumulate"),
    ("zb-v", "shared parameter"), ("flush", "vertical sync"),
])
def test_a_refused_cell_is_what_a_real_pipeline_says(kind: str, feature: str, tmp_path) -> None:
    shared = FEATURE_OPTIONS[feature].shared
    model, names = (TiedLM(), TIED_NAMES) if shared else (mlp(), NAMES)
    plan = kind_plan(kind, workers=1, layers=names)
    expected = cell(kind, feature, plan)
    assert expected.status == "refused"
    assert CELLS[(kind, feature)].status == "refused"
    assert refusal_by_a_pipeline(kind, feature, model, plan, tmp_path) == expected.message


def test_the_readme_table_is_the_rendered_matrix() -> None:
    text = readme_path().read_text()
    assert text.count(README_BEGIN) == 1 and text.count(README_END) == 1
    assert readme_table(text) == render_markdown(CELLS), f"the README's composition table is stale; run {REGENERATE}"


def test_the_rendered_table_shows_a_changed_cell() -> None:
    changed = dict(CELLS)
    changed[("flush", "bf16")] = type(CELLS[("flush", "bf16")])("refused", "bf16 is out of order today")
    assert render_markdown(changed) != render_markdown(CELLS)
    assert "bf16 is out of order today" in render_markdown(changed)


@pytest.mark.parametrize("kind", KINDS)
def test_train_takes_every_kind_whose_checkpoints_resume(kind: str) -> None:
    assert CELLS[(kind, "checkpoint resume onto another plan")].status == "runs"
    check_options(TrainConfig(schedule=kind))  # raises TrainError for a kind it refuses
