"""The GPU check's dry run (benchmarks/device_check.py --device cpu): the same code paths as on a
GPU, so the script is known to run the day a GPU is lent; and what its parity cases rest on."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import device_check  # noqa: E402
from torchpipedream.plans.plan import Plan  # noqa: E402
from torchpipedream.runtime.verification import VerifyError, _Job, _reference, verify  # noqa: E402


def test_the_dry_run_passes_every_parity_case_and_measures_every_section(tmp_path: Path) -> None:
    out = tmp_path / "device_check.json"
    assert device_check.main(["--device", "cpu", "--out", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["info"]["device"] == "cpu" and results["all_parity_ok"]
    cases = {(r["case"], r["workers"], r["precision"]) for r in results["parity"]}
    kinds = device_check.STRAIGHT_KINDS + device_check.VIRTUAL_KINDS + ("flush + recompute", "pipedream + recompute")
    assert {(k, w, "fp32") for k in kinds for w in (1, 2)} <= cases
    assert {("flush", 2, "bf16"), ("zb-v", 2, "bf16")} <= cases
    assert all(r["ok"] and r["max_abs_diff"] <= 1e-4 for r in results["parity"])
    two = {r["plan"] for r in results["parity"] if r["workers"] == 2 and r["case"] == "flush"}
    assert two == {"straight ×2"}  # one stage on each of the two workers sharing the device
    assert results["profile"]["timer"] == "perf_counter"
    assert 0.2 < results["profile"]["profiled_vs_timed"] < 5
    assert [m["stage"] for m in results["memory"]] == [0, 1]
    assert all(m["measured_bytes"] > 0 and m["predicted_bytes"] > 0 for m in results["memory"])
    speed = results["throughput"]
    for key in ("plain_samples_per_s", "pipeline_samples_per_s", "predicted_samples_per_s"):
        assert math.isfinite(speed[key]) and speed[key] > 0


def test_the_bf16_cases_are_not_vacuous() -> None:
    """bfloat16 training moves the weights of the check's model away from fp32 training's by far
    more than the parity cases' tolerance: a bf16 case that passes ran under autocast on both sides."""
    width, blocks, batch = device_check.SIZES["small"][:3]
    model = functools.partial(device_check.make_model, width, blocks)
    batches = device_check.make_batches(width, batch, device_check.PARITY_MINIBATCHES)
    plan = Plan.straight([["input_1"]], schedule="flush", microbatches=device_check.MICROBATCHES)
    job = _Job(model, batches, [plan], device_check._optimizer(), device_check._loss(), "mean", 60, [3])
    fp32 = _reference(job, plan, lambda n, t: t)[-1]
    bf16 = _reference(dataclasses.replace(job, precision="bf16"), plan, lambda n, t: t)[-1]
    atol, rtol = device_check.ATOL, device_check.RTOL
    ratio = max((fp32[k] - bf16[k]).abs().max().item() / (atol + rtol * fp32[k].abs().max().item()) for k in fp32)
    assert ratio > 5


@pytest.mark.parametrize("kwargs, message", [
    ({"precision": "fp16"}, "precision 'fp32' and 'bf16', not 'fp16'"),
    ({"device": "cuda:0"}, "CUDA is not available here"),
    ({"device": "mps"}, "verify runs on cpu or cuda"),
    ({"device": "gpu0"}, "'gpu0' is not a device"),
])
def test_verify_refuses_a_device_or_precision_it_cannot_check_by_name(kwargs: dict, message: str) -> None:
    if "cuda" in kwargs.get("device", "") and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    model = functools.partial(device_check.make_model, 8, 1)
    batches = device_check.make_batches(8, 4, 1)
    plan = Plan.straight([["input_1"]], schedule="flush", microbatches=2)
    with pytest.raises(VerifyError, match=message):
        verify(model, batches, plan, device_check._optimizer(), loss_fn=device_check._loss(), **kwargs)


def test_the_script_refuses_cuda_where_there_is_none() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    run = subprocess.run(["bash", str(ROOT / "scripts" / "device_check"), "--device", "cuda"], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and "CUDA is not available here (use --device cpu for the dry run)" in run.stderr


def test_plans_of_one_version_rule_and_microbatch_count_share_one_reference(monkeypatch) -> None:
    """verify computes a reference once per (version rule, microbatch count): flush, gpipe and the
    zero-bubble kinds at one count are the same plain training; 2bw's rule or another count is not."""
    import torchpipedream.runtime.verification as verification
    from torchpipedream.plans.kinds import schedule_kind

    calls = []
    monkeypatch.setattr(verification, "_reference", lambda job, plan, rule: calls.append(plan.schedule) or [plan])
    cuts = [["input_1", "_0"], ["_1"]]
    plans = [Plan.straight(cuts, schedule=k, microbatches=m)
             for k, m in (("flush", 2), ("gpipe", 2), ("zb-h1", 2), ("2bw", 2), ("flush", 4), ("zb-2bw", 2))]
    plans.append(Plan.straight(cuts, schedule="pipedream"))
    refs = verification._shared_references(None, plans, [schedule_kind(p.schedule) for p in plans])
    assert calls == ["flush", "2bw", "flush"]  # flush m=2 (gpipe, zb-h1 share it), 2bw m=2 (zb-2bw), flush m=4
    assert refs[0] is refs[1] is refs[2] and refs[3] is refs[5] and refs[4] is not refs[0] and refs[6] is None
