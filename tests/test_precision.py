"""bfloat16 autocast (``Pipeline(precision="bf16")``, ``train --precision bf16``).

Multi-process parity of flush, pipedream and 2bw (with recomputation) against references that
run the same microbatches under autocast is in test_runtime_parity.py; here: the option's
checks, the profile of a bf16 run, and the command line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from torchpipedream.plans import Plan
from torchpipedream.profiler import profile
from torchpipedream.runtime import Pipeline
from torchpipedream.runtime.pipeline import PipelineError


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 4))


@pytest.mark.parametrize("precision, message", [
    ("fp16", "fp16 needs loss scaling, not supported yet"),
    ("float8", "precision must be one of fp32, bf16, got 'float8'"),
])
def test_unsupported_precisions_are_refused_by_name(precision: str, message: str) -> None:
    plan = Plan.straight([profile(mlp(), torch.randn(4, 8)).names])
    with pytest.raises(PipelineError, match=message):
        Pipeline(mlp(), plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.CrossEntropyLoss(),
                 precision=precision)


def test_a_profile_under_autocast_sees_bfloat16_activations() -> None:
    x = torch.randn(16, 8)
    plain = profile(mlp(), x, warmup=0, iters=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = profile(mlp(), x, warmup=0, iters=1)
    linear = plain.names[1]  # the first Linear: 16 × 64 outputs
    assert plain[linear].activation_bytes == 16 * 64 * 4 and plain[linear].output_dtypes == ["float32"]
    assert half[linear].activation_bytes == 16 * 64 * 2 and half[linear].output_dtypes == ["bfloat16"]


def test_single_stage_bf16_equals_autocast_accumulation_and_evaluates_under_autocast() -> None:
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(3)]
    plan = Plan.straight([profile(mlp(), data[0][0]).names], schedule="flush", microbatches=4)
    pipe = Pipeline(mlp(), plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.CrossEntropyLoss(),
                    microbatches=4, precision="bf16")
    pipe.train_minibatches(data)
    ref = mlp()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for x, y in data:
        opt.zero_grad()
        for xs, ys in zip(x.chunk(4), y.chunk(4)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(ref(xs), ys)
            (loss * len(ys) / len(y)).backward()
        opt.step()
    got, want = pipe.state_dict(), ref.state_dict()
    for k in want:
        assert got[k].dtype == torch.float32
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-6, msg=k)
    x, y = data[0]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = nn.functional.cross_entropy(ref(x), y).item()
    assert pipe.evaluate([(x, y)])["loss"] == pytest.approx(expected, abs=1e-6)


def test_train_precision_bf16_runs_and_keeps_float32_weights(tmp_path: Path, capsys) -> None:
    from torchpipedream.cli import main

    out = tmp_path / "bf16"
    assert main(["train", "--model", "mlp", "--workers", "2", "--no-progress", "--epochs", "1",
                 "--max-minibatches", "6", "--timeout", "60", "--precision", "bf16", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["precision"] == "bf16" and report["final_test_loss"] > 0
    state = torch.load(out / "checkpoint.pt", weights_only=True)["state_dict"]
    assert state and all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    # a resumption must use the precision the checkpoints were written with, and says so
    assert main(["train", "--model", "mlp", "--workers", "2", "--no-progress", "--epochs", "2",
                 "--max-minibatches", "6", "--timeout", "60", "--resume", "--out", str(out)]) == 2
    assert "--precision 'bf16' (now 'fp32')" in capsys.readouterr().err
