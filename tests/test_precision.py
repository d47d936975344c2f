"""Mixed precision: bfloat16 autocast (``Pipeline(precision="bf16")``) and float16 with loss
scaling (``precision="fp16"``), and ``train --precision``.

Multi-process parity (bf16: flush, pipedream and 2bw with recomputation; fp16: flush and a
replicated gpipe against torch's GradScaler) is in test_runtime_parity.py, fp16 with a tied
matrix split over stages in test_shared_parameters.py; here: the options' checks, the
overflow check, one stage against torch's GradScaler with a checkpoint between, the profile
of a bf16 run, and the command line.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from torchpipedream.plans.plan import Plan
from torchpipedream.model.profiler import profile
from torchpipedream.runtime import Pipeline
from torchpipedream.runtime.loss_scaling import LossScaling
from torchpipedream.runtime.pipeline import PipelineError


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 4))


@pytest.mark.parametrize("kwargs, message", [
    (dict(precision="float8"), "precision must be one of fp32, bf16, fp16, got 'float8'"),
    (dict(precision="fp16", schedule="pipedream"), "precision='fp16' needs a synchronous schedule .* not 'pipedream'"),
    (dict(precision="fp16", schedule="2bw"), "not '2bw'"),
    (dict(precision="bf16", loss_scaling=LossScaling()), "loss_scaling applies to precision='fp16' only"),
    (dict(precision="fp16", loss_scaling=2.0 ** 16), "loss_scaling must be a LossScaling, got float"),
])
def test_unsupported_precisions_are_refused_by_name(kwargs: dict, message: str) -> None:
    plan = Plan.straight([profile(mlp(), torch.randn(4, 8)).names])
    with pytest.raises(PipelineError, match=message):
        Pipeline(mlp(), plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.CrossEntropyLoss(), **kwargs)


@pytest.mark.parametrize("field, value", [("init_scale", 0.0), ("init_scale", float("inf")), ("growth_factor", 1.0),
                                          ("backoff_factor", 1.0), ("growth_interval", 0), ("growth_interval", 2.5)])
def test_a_bad_loss_scaling_policy_names_its_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"LossScaling.{field} must be"):
        LossScaling(**{field: value})


def test_an_overflowed_gradient_is_found_wherever_it_is() -> None:
    from torchpipedream.runtime.weights import WeightVersions

    for replicated in (False, True):
        weights = WeightVersions(mlp(), lambda p: torch.optim.SGD(p, lr=0.1), replicated=replicated)
        weights.expect({0: 2})
        for bad in (False, True):
            params = weights.tensors(0)
            grads = [torch.ones_like(p) for p in params.values()]
            if bad:
                grads[2][1, 3] = float("nan") if replicated else float("inf")
            weights.accumulate(grads, 4)
            assert weights.gradient_overflowed() is bad, (replicated, bad)
            before = [p.detach().clone() for p in weights.params]
            weights.step(unscale=0.5, apply=not bad)
            after = list(weights.params)
            # a skipped update leaves the weights; an applied one moved them by lr × grad × unscale / samples
            for b, a in zip(before, after):
                torch.testing.assert_close(a.detach(), b if bad else b - 0.1 * 0.5 / 4)


def fp16_reference(data: list, m: int, policy: LossScaling) -> tuple[nn.Module, float, int]:
    """Accumulation under float16 autocast with torch's GradScaler, scaling each microbatch's
    summed loss (as the pipeline does): the model, the final scale, the updates skipped."""
    from fp16_reference import grad_scaler_training

    ref = mlp()
    scale, skipped = grad_scaler_training(ref, torch.optim.SGD(ref.parameters(), lr=0.1), data, m,
                                          nn.functional.cross_entropy, init_scale=policy.init_scale,
                                          growth_interval=policy.growth_interval)
    return ref, scale, skipped


def test_single_stage_fp16_skips_and_scales_as_torch_and_a_checkpoint_keeps_the_scale(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(8)]
    policy = LossScaling(init_scale=2.0 ** 20, growth_interval=2)
    plan = Plan.straight([profile(mlp(), data[0][0]).names], schedule="flush", microbatches=4)

    def pipeline() -> Pipeline:
        return Pipeline(mlp(), plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.CrossEntropyLoss(),
                        precision="fp16", loss_scaling=policy)

    first = pipeline()
    first.train_minibatches(data[:4])
    first.save_checkpoint(tmp_path / "ckpt")
    resumed = pipeline()
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert (resumed.loss_scale, resumed.skipped_updates) == (first.loss_scale, first.skipped_updates)
    resumed.train_minibatches(data[4:])
    ref, scale, skipped = fp16_reference(data, 4, policy)
    assert 0 < skipped < len(data)
    assert (resumed.loss_scale, resumed.skipped_updates) == (scale, skipped)
    got, want = resumed.state_dict(), ref.state_dict()
    for k in want:
        assert got[k].dtype == torch.float32
        torch.testing.assert_close(got[k], want[k], atol=1e-6, rtol=1e-6, msg=k)


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


def test_train_precision_fp16_reports_its_loss_scale(tmp_path: Path, capsys) -> None:
    from torchpipedream.cli import main

    out = tmp_path / "fp16"
    assert main(["train", "--model", "mlp", "--workers", "2", "--no-progress", "--epochs", "1", "--schedule", "flush",
                 "--max-minibatches", "6", "--timeout", "60", "--precision", "fp16", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    scaling = report["loss_scaling"]
    # the default policy starts at 2^16 and halves once per skipped update (6 updates: no growth)
    assert scaling["scale"] == 2.0 ** 16 / 2 ** scaling["skipped_updates"] and scaling["skipped_updates"] < 6
    assert math.isfinite(report["final_test_loss"])
    assert f"{scaling['skipped_updates']} update(s) skipped" in capsys.readouterr().out
    state = torch.load(out / "checkpoint.pt", weights_only=True)["state_dict"]
    assert state and all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
