"""`torchpipedream train`: a short real run end to end, and bad options refused before any worker starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from torchpipedream.cli import main
from torchpipedream.plan import Plan
from torchpipedream.trace import Trace


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
