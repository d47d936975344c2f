"""`torchpipedream train`'s training recipe (issue 35): --optimizer adamw, --weight-decay,
--lr-schedule with --warmup, --clip-grad-norm. Bad values are refused in one line before
anything starts; the optimizer factory's groups and steps are checked against the formulas;
one real run is checked against plain PyTorch training with the same recipe."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torchpipedream.cli import main
from torchpipedream.models import digits_data, get_model
from torchpipedream.runtime.lr_schedule import LR_SCHEDULE_KINDS
from torchpipedream.train import TrainConfig, TrainError
from torchpipedream.train.config import (LR_SCHEDULES, OPTIMIZER_STATE, check_options, minibatches_per_epoch,
                                         optimizer_scratch_of)
from torchpipedream.train.inputs import build_optimizer, minibatches, optimizer_factory
from torchpipedream.train.worker import lr_schedule_of


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--weight-decay", "-0.1"], "--weight-decay must be a finite number >= 0, got -0.1"),
        (["--weight-decay", "nan"], "--weight-decay must be a finite number >= 0, got nan"),
        (["--clip-grad-norm", "0"], "--clip-grad-norm must be a positive finite number"),
        (["--clip-grad-norm", "inf"], "--clip-grad-norm must be a positive finite number"),
        (["--warmup", "-1"], "--warmup must be an integer >= 0, got -1"),
        # 2 epochs of at most 4 minibatches: 8 updates, none left to decay over after 8 of warm-up
        (["--lr-schedule", "cosine", "--warmup", "8", "--epochs", "2", "--max-minibatches", "4"],
         "--warmup 8 must be fewer than the run's 8 updates (2 epoch(s) of 4 minibatches)"),
        (["--lr-schedule", "linear", "--warmup", "1000", "--epochs", "1"], "--warmup 1000 must be fewer than the "
                                                                          "run's 42 updates"),  # 1347 digits // 32
    ],
)
def test_bad_recipe_options_are_refused_in_one_line(argv: list[str], message: str, capsys, tmp_path: Path) -> None:
    rc = main(["train", "--model", "mlp", "--out", str(tmp_path / "x"), "--no-progress", *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err
    assert err.strip().count("\n") == 0 and "Traceback" not in err
    assert not (tmp_path / "x").exists()


def test_an_unknown_schedule_or_optimizer_is_refused_by_the_parser(capsys) -> None:
    for argv, name in ((["--lr-schedule", "step"], "--lr-schedule"), (["--optimizer", "lamb"], "--optimizer")):
        with pytest.raises(SystemExit) as exc:
            main(["train", *argv])
        assert exc.value.code == 2 and name in capsys.readouterr().err


def test_a_warmup_shorter_than_the_run_is_accepted() -> None:
    check_options(TrainConfig(model="mlp", lr_schedule="polynomial", warmup=7, epochs=2, max_minibatches=4))
    # a constant rate never decays: a warm-up longer than the run only means it never ends
    check_options(TrainConfig(model="mlp", lr_schedule="constant", warmup=100, epochs=1, max_minibatches=4))
    with pytest.raises(TrainError, match="--warmup 8 must be fewer than the run's 8 updates"):
        check_options(TrainConfig(model="mlp", lr_schedule="polynomial", warmup=8, epochs=2, max_minibatches=4))


def test_the_command_line_offers_the_runtime_schedules_and_adamw_is_costed_as_adam() -> None:
    assert LR_SCHEDULES == LR_SCHEDULE_KINDS
    assert OPTIMIZER_STATE["adamw"] == OPTIMIZER_STATE["adam"] == 3.0
    for cuda in (False, True):
        assert optimizer_scratch_of("adamw", cuda) == optimizer_scratch_of("adam", cuda)


def _small_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2, bias=False), nn.Conv1d(1, 1, 2))


def _group_names(opt: torch.optim.Optimizer, model: nn.Module) -> list[tuple[set[str], float]]:
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [({name_of[id(p)] for p in g["params"]}, g["weight_decay"]) for g in opt.param_groups]


def test_weight_decay_lands_on_the_matrices_and_kernels_only() -> None:
    model = _small_model()
    opt = build_optimizer(list(model.named_parameters()), "adamw", lr=0.1, weight_decay=0.2)
    assert isinstance(opt, torch.optim.AdamW)
    assert _group_names(opt, model) == [({"0.weight", "2.weight", "3.weight"}, 0.2),
                                        ({"0.bias", "1.weight", "1.bias", "3.bias"}, 0.0)]
    # the names go through to torch, as a pipeline stage gives them
    assert opt.state_dict()["param_groups"][0]["param_names"] == ["0.weight", "2.weight", "3.weight"]
    # bare parameters (the profiler's and verify's reference calls) are grouped the same way
    bare = optimizer_factory(TrainConfig(optimizer="sgd", lr=0.1, weight_decay=0.2))(model.parameters())
    assert _group_names(bare, model) == _group_names(opt, model)


def test_a_stage_without_biases_gets_only_the_non_empty_group() -> None:
    model = _small_model()
    only_matrix = [(n, p) for n, p in model.named_parameters() if n == "2.weight"]
    opt = build_optimizer(only_matrix, "adamw", lr=0.1, weight_decay=0.2)
    assert _group_names(opt, model) == [({"2.weight"}, 0.2)]
    only_norm = [(n, p) for n, p in model.named_parameters() if n.startswith("1.")]
    assert _group_names(build_optimizer(only_norm, "momentum", 0.1, 0.2), model) == [({"1.weight", "1.bias"}, 0.0)]


def _one_step(kind: str, lr: float, weight_decay: float) -> tuple[dict, dict, dict]:
    """Weights before and after one step of the factory's optimizer, and the gradients."""
    model = _small_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    cfg = TrainConfig(optimizer=kind, lr=lr, weight_decay=weight_decay)
    factory = pickle.loads(pickle.dumps(optimizer_factory(cfg)))  # verify sends it to worker processes
    factory(list(model.named_parameters())).step()
    return before, {n: p.detach() for n, p in model.named_parameters()}, grads


def test_one_adamw_step_decays_only_the_matrices() -> None:
    lr, wd, eps = 0.01, 0.5, 1e-8
    before, after, grads = _one_step("adamw", lr, wd)
    for n, w in before.items():
        g = grads[n]
        # AdamW's first step: decoupled decay w(1 - lr wd), then lr * m̂ / (sqrt(v̂) + eps) with m̂ = g, v̂ = g²
        decay = wd if w.ndim >= 2 else 0.0
        expected = w * (1 - lr * decay) - lr * g / (g.abs() + eps)
        torch.testing.assert_close(after[n], expected, rtol=0, atol=1e-6, msg=n)


@pytest.mark.parametrize("kind, wd", [("sgd", 0.3), ("sgd", 0.0), ("momentum", 0.3)])
def test_sgd_weight_decay_is_an_l2_term_on_the_matrices_only(kind: str, wd: float) -> None:
    lr = 0.1
    before, after, grads = _one_step(kind, lr, wd)
    for n, w in before.items():
        # first step of SGD, with or without momentum (its buffer starts as the gradient): w - lr (g + wd w)
        decay = wd if w.ndim >= 2 else 0.0
        torch.testing.assert_close(after[n], w - lr * (grads[n] + decay * w), rtol=0, atol=1e-6, msg=n)


def test_minibatches_per_epoch_counts_what_minibatches_makes() -> None:
    for samples, batch, limit in [(100, 32, None), (96, 32, None), (100, 32, 2), (10, 32, None), (100, 7, 50)]:
        made = minibatches(torch.zeros(samples, 1), torch.zeros(samples), batch, limit, shuffle_seed=0)
        assert minibatches_per_epoch(samples, batch, limit) == len(made), (samples, batch, limit)


def test_the_lr_schedule_spans_the_runs_updates() -> None:
    assert lr_schedule_of(TrainConfig(), per_epoch=10) is None  # constant, no warm-up: no scheduler at all
    schedule = lr_schedule_of(TrainConfig(epochs=2, lr_schedule="cosine", warmup=2), per_epoch=2)
    assert schedule is not None and schedule.total == 4
    # (u + 1) / 2 while warming up, then half a cosine from 1 to 0 over the remaining 2 updates
    assert [schedule(u) for u in range(4)] == pytest.approx([0.5, 1.0, 1.0, 0.5])


RUN = dict(epochs=2, per_epoch=2, batch=32, lr=0.01, clip=1.0)
LR_MULTIPLIERS = [0.5, 1.0, 1.0, 0.5]  # cosine after a warm-up of 2, over 4 updates (as above)


def _plain_training(weight_decay: float) -> tuple[dict[str, torch.Tensor], list[float]]:
    """The run below in plain PyTorch: the same minibatches (seed 0: epoch e shuffled by seed e),
    AdamW with decay on the Linear weights only, the learning rate set per update, and the
    gradient clipped by its global norm. Returns the final weights and every update's norm."""
    x, y, _, _ = digits_data(seed=0)
    torch.manual_seed(0)
    model = get_model("mlp")
    params = dict(model.named_parameters())
    opt = torch.optim.AdamW([{"params": [p for n, p in params.items() if n.endswith("weight")], "weight_decay": weight_decay},
                             {"params": [p for n, p in params.items() if n.endswith("bias")], "weight_decay": 0.0}])
    norms, b = [], RUN["batch"]
    for epoch in range(RUN["epochs"]):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        for i in range(RUN["per_epoch"]):
            pick = order[i * b:(i + 1) * b]
            opt.zero_grad()
            F.cross_entropy(model(x[pick]), y[pick]).backward()
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), RUN["clip"])))
            for group in opt.param_groups:
                group["lr"] = RUN["lr"] * LR_MULTIPLIERS[len(norms) - 1]
            opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}, norms


@pytest.mark.timeout(240)
def test_a_run_with_the_whole_recipe_trains_as_plain_pytorch(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    argv = ["train", "--model", "mlp", "--workers", "2", "--schedule", "flush", "--microbatches", "2",
            "--epochs", str(RUN["epochs"]), "--max-minibatches", str(RUN["per_epoch"]), "--batch-size",
            str(RUN["batch"]), "--lr", str(RUN["lr"]), "--optimizer", "adamw", "--weight-decay", "0.1",
            "--lr-schedule", "cosine", "--warmup", "2", "--clip-grad-norm", str(RUN["clip"]),
            "--no-progress", "--timeout", "60", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert {k: report["config"][k] for k in ("optimizer", "weight_decay", "lr_schedule", "warmup", "clip_grad_norm")} \
        == {"optimizer": "adamw", "weight_decay": 0.1, "lr_schedule": "cosine", "warmup": 2, "clip_grad_norm": 1.0}
    expected, norms = _plain_training(weight_decay=0.1)
    assert max(norms) > RUN["clip"]  # the clipping acted: the test would see it missing
    for epoch, row in enumerate(report["history"]):
        mine = norms[epoch * RUN["per_epoch"]:(epoch + 1) * RUN["per_epoch"]]
        assert row["grad_norm"]["max"] == pytest.approx(max(mine), rel=1e-4)
        assert row["grad_norm"]["mean"] == pytest.approx(sum(mine) / len(mine), rel=1e-4)
    weights = torch.load(out / "checkpoint.pt", weights_only=False)["state_dict"]
    for name, value in expected.items():
        torch.testing.assert_close(weights[name], value, rtol=0, atol=1e-4, msg=name)
    undecayed, _ = _plain_training(weight_decay=0.0)  # the decay moved the weights by more than the tolerance
    assert max((undecayed[k] - expected[k]).abs().max().item() for k in expected) > 1e-4
    # --resume is a continuation with the same recipe: another one is refused, naming the option
    capsys.readouterr()
    assert main([*argv, "--resume", "--clip-grad-norm", "2.0"]) == 2
    err = capsys.readouterr().err
    assert "other options: --clip-grad-norm 1.0 (now 2.0)" in err and "Traceback" not in err
    assert math.isfinite(report["final_test_loss"])


def test_a_decaying_schedule_fixes_the_runs_length_on_resume():
    """--epochs may change on --resume, except under a decaying learning rate, whose end is the
    run's last update: a longer run would change the decay half way."""
    from dataclasses import asdict

    from torchpipedream.train.resume import _differences

    saved = asdict(TrainConfig(lr_schedule="cosine", epochs=2))
    assert _differences(TrainConfig(lr_schedule="cosine", epochs=3), saved) == ["--epochs 2 (now 3)"]
    constant = asdict(TrainConfig(epochs=2))
    assert _differences(TrainConfig(epochs=3), constant) == []


def test_a_recipe_that_counts_updates_plans_pipedream_straight():
    """pipedream's replicated stage makes one update per minibatch of each replica: a learning
    rate or a norm per update would differ between stages, so such a run plans no replicas."""
    from torchpipedream.train.preparation import _straight

    assert _straight(TrainConfig(schedule="pipedream", lr_schedule="cosine"))
    assert _straight(TrainConfig(schedule="pipedream", clip_grad_norm=1.0))
    assert _straight(TrainConfig(schedule="auto", allow_stale=True, warmup=3))
    assert not _straight(TrainConfig(schedule="pipedream"))
    assert not _straight(TrainConfig(schedule="flush", clip_grad_norm=1.0))  # every stage: one update per minibatch
    assert not _straight(TrainConfig(schedule="2bw", lr_schedule="linear"))
