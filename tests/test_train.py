"""`torchpipedream train`: a short real run end to end, and bad options refused before any worker starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fault_injection.faults import fault_environment
from torchpipedream.cli import main
from torchpipedream.plans.plan import Plan
from torchpipedream.sim.trace import Trace


@pytest.mark.timeout(240)
def test_short_training_run_writes_every_output(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    rc = main(["train", "--workers", "2", "--epochs", "2", "--max-minibatches", "12", "--out", str(out),
               "--no-progress", "--timeout", "60"])
    assert rc == 0
    text = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["plan"] in text and "why" in text and "measured" in text and "predicted" in text
    assert Plan.load(out / "plan.json").num_workers == 2
    trace = Trace.load(out / "trace.json")
    assert {e.rank for e in trace.events} == {0, 1}
    assert json.loads((out / "trace.chrome.json").read_text())["traceEvents"]
    assert (out / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ckpt = torch.load(out / "checkpoint.pt", weights_only=False)
    from torchpipedream.models import get_model

    assert set(ckpt["state_dict"]) == set(get_model("cnn").state_dict())
    # two short epochs of 12 minibatches already learn something on digits (chance is 10%)
    assert report["final_test_accuracy"] > 0.5
    assert len(report["history"]) == 2
    # the time split: the measured terms of each rank sum to the last epoch's trace per minibatch
    split = report["time_split"]
    assert set(split["measured"]["ranks"]) == set(split["predicted"]["ranks"]) == {"0", "1"}
    for terms in split["measured"]["ranks"].values():
        assert sum(terms.values()) == pytest.approx(trace.makespan / 12, rel=1e-9)
    assert "time split     rank 1: compute" in text


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--model", "vgg99"], "unknown model 'vgg99'"),
        (["--model", "nosuchpkg.x:build"], "cannot import module 'nosuchpkg.x'"),
        (["--epochs", "0"], "--epochs must be a positive integer"),
        (["--lr", "-1"], "--lr must be a positive number"),
        (["--schedule", "flush", "--batch-size", "2", "--microbatches", "4"], "cannot be split into"),
    ],
)
def test_bad_options_fail_before_any_worker_starts(argv: list[str], message: str, capsys, tmp_path: Path) -> None:
    rc = main(["train", "--out", str(tmp_path / "x"), "--no-progress", *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err
    assert "Traceback" not in err
    assert not (tmp_path / "x").exists()


def test_plan_for_another_model_is_refused(tmp_path: Path, capsys) -> None:
    other = Plan.straight([["a", "b"], ["c"]])
    other.save(tmp_path / "plan.json")
    rc = main(["train", "--plan", str(tmp_path / "plan.json"), "--workers", "2", "--out", str(tmp_path / "x"),
               "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "does not match the model" in err


def test_more_stages_than_layers_is_refused(tmp_path: Path, capsys) -> None:
    rc = main(["train", "--model", "mlp", "--workers", "2", "--stages", "40", "--out", str(tmp_path / "x"),
               "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "40 stages requested but the graph has only" in err and "Traceback" not in err


def _weights(out: Path) -> dict:
    return torch.load(out / "checkpoint.pt", weights_only=False)["state_dict"]


@pytest.mark.timeout(300)
def test_resume_continues_exactly(tmp_path: Path) -> None:
    """4 epochs straight equal 2 epochs + --resume to 4 (same plan file, per-epoch checkpoints)."""
    from torchpipedream.runtime import latest_checkpoint
    from torchpipedream.train import TrainConfig, TrainError
    from torchpipedream.train.job import run

    common = dict(model="mlp", schedule="pipedream", workers=2, batch_size=16, lr=0.05, optimizer="momentum",
                  max_minibatches=4, progress=False, timeout_s=60.0)
    names = _mlp_layer_names()  # one plan file for both runs: re-planning from a noisy profile could differ
    plan = Plan.straight([names[: len(names) // 2], names[len(names) // 2:]], schedule="pipedream")
    plan.save(tmp_path / "plan.json")
    common["plan_file"] = str(tmp_path / "plan.json")
    straight_run = run(TrainConfig(epochs=4, out=str(tmp_path / "a"), **common))
    first = run(TrainConfig(epochs=2, out=str(tmp_path / "b"), **common))
    assert latest_checkpoint(tmp_path / "b" / "checkpoints") == tmp_path / "b" / "checkpoints" / "epoch_2"
    (tmp_path / "b" / "report.json").unlink()
    again = run(TrainConfig(epochs=2, out=str(tmp_path / "b"), resume=True, **common))  # complete: outputs again
    assert again["history"] == first["history"] and (tmp_path / "b" / "report.json").exists()
    with pytest.raises(TrainError, match="other options: --lr 0.05"):
        run(TrainConfig(epochs=4, out=str(tmp_path / "b"), resume=True, **{**common, "lr": 0.1}))
    resumed = run(TrainConfig(epochs=4, out=str(tmp_path / "b"), resume=True, **common))
    a, b = _weights(tmp_path / "a"), _weights(tmp_path / "b")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert [r["train_loss"] for r in resumed["history"]] == [r["train_loss"] for r in straight_run["history"]]
    # --keep-checkpoints 3 (the default): the oldest epoch's checkpoint is gone
    assert sorted(p.name for p in (tmp_path / "b" / "checkpoints").iterdir()) == [f"epoch_{i}" for i in (2, 3, 4)]


def _mlp_layer_names() -> list[str]:
    from torchpipedream.model.profiler import profile
    from torchpipedream.train import TrainConfig
    from torchpipedream.train.inputs import build_model, load_data, loss_for

    cfg = TrainConfig(model="mlp")
    x, y, _, _ = load_data(cfg)
    return profile(build_model(cfg), x[:4], loss_fn=loss_for(cfg), target=y[:4], name="mlp").names


def test_resume_without_checkpoint_is_refused(tmp_path: Path, capsys) -> None:
    rc = main(["train", "--model", "mlp", "--workers", "2", "--out", str(tmp_path / "x"), "--resume", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "--resume: no complete checkpoint in" in err and "Traceback" not in err


@pytest.mark.timeout(240)
def test_a_failing_worker_ends_the_command_with_its_error_not_a_launcher_traceback(
        tmp_path: Path, capsys, monkeypatch) -> None:
    # rank 1 raises in the forward of its 5th minibatch (tests/fault_injection: the spawned
    # workers inherit this environment)
    for key, value in fault_environment("rank=1,minibatch=4,mode=raise").items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "run"
    rc = main(["train", "--workers", "2", "--stages", "2", "--epochs", "1", "--max-minibatches", "8",
               "--out", str(out), "--no-progress", "--timeout", "60"])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.startswith("torchpipedream train: training failed:")
    assert "rank 1" in err
    # nothing to resume from: no resume hint for checkpoints that do not exist
    assert "no checkpoint was written" in err and "--resume" not in err


def test_a_memory_budget_is_kept_and_the_peaks_are_measured(tmp_path: Path, capsys) -> None:
    """`--schedule auto --memory B --measure-memory`: the chosen plan's predicted peaks fit B, the
    measured peak of every stage is reported beside its prediction, and a budget no plan fits is
    refused with the smallest that would."""
    out = tmp_path / "run"
    common = ["train", "--workers", "2", "--epochs", "1", "--max-minibatches", "8", "--no-progress",
              "--timeout", "60", "--optimizer", "momentum", "--schedule", "auto"]
    assert main([*common, "--memory", "64MB", "--measure-memory", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    report = json.loads((out / "report.json").read_text())
    assert report["auto"]["memory_budget_bytes"] == 64_000_000
    assert [m["stage"] for m in report["memory"]] == list(range(len(report["memory"])))
    for m in report["memory"]:
        assert 0 < m["predicted_bytes"] <= 64_000_000 and m["measured_bytes"] > 0
    assert "memory budget 64" in text and "measured" in text.split("memory", 1)[1]
    assert main([*common, "--memory", "1kB", "--out", str(tmp_path / "tiny")]) == 2
    assert "no plan fits in 1" in capsys.readouterr().err
