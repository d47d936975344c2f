"""Plain PyTorch training in one process: the reference the multi-process scenarios of
tests/test_sharding.py and tests/test_tensor_parallel.py must equal.

One optimizer step per minibatch on the minibatch's mean cross-entropy, as flush and gpipe
promise: clipped by ``clip_grad_norm_`` and scheduled by a warm-up-then-cosine ``LambdaLR`` where
the scenario says so; under bfloat16 autocast its microbatches' gradients accumulated; with
float16, torch's GradScaler over the microbatches' summed losses (fp16_reference.py). The
scenarios' optimizers are here too, so that both sides build the same one.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR


def optimizer(name: str) -> Callable[[list], torch.optim.Optimizer]:
    """A scenario's optimizer factory (the model's named parameters -> optimizer): "momentum",
    "adamw" (groups by name: no decay on biases), "sgd", else Adam."""
    def make(named: list) -> torch.optim.Optimizer:
        if name == "momentum":
            return torch.optim.SGD([p for _, p in named], lr=0.1, momentum=0.9)
        if name == "adamw":
            return torch.optim.AdamW([{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
                                      {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}],
                                     lr=0.02)
        if name == "sgd":
            return torch.optim.SGD([p for _, p in named], lr=0.1)
        return torch.optim.Adam([p for _, p in named], lr=0.02)
    return make


def one_process_training(net: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]],
                         make_optimizer: Callable[[list], torch.optim.Optimizer], sc: dict, clip: float,
                         fp16_scaling: Any) -> dict:
    """Train ``net`` on ``batches`` as scenario ``sc`` says (keys: m, clip, sched, precision,
    evaluate); its state, the update norms before clipping, and its evaluation where asked."""
    opt = make_optimizer(list(net.named_parameters()))
    sched = None
    if sc.get("sched"):
        total = len(batches)
        sched = LambdaLR(opt, lambda t: (t + 1) / 1 if t < 1 else 0.5 * (1 + math.cos(math.pi * (t - 1) / (total - 1))))
    if sc.get("precision") == "fp16":
        from fp16_reference import grad_scaler_training
        scale = grad_scaler_training(net, opt, batches, sc["m"], nn.functional.cross_entropy,
                                     init_scale=fp16_scaling.init_scale, growth_interval=fp16_scaling.growth_interval)
        return {"state": net.state_dict(), "norms": [], "scale": scale}
    norms = []
    for x, y in batches:
        opt.zero_grad()
        if sc.get("precision") == "bf16":  # bfloat16 forwards: the microbatches' gradients accumulated
            for xs, ys in zip(x.chunk(sc["m"]), y.chunk(sc["m"])):
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = nn.functional.cross_entropy(net(xs), ys)
                (loss * len(ys) / len(y)).backward()
        else:
            nn.functional.cross_entropy(net(x), y).backward()
        if sc.get("clip"):
            norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), clip)))
        opt.step()
        if sched is not None:
            sched.step()
    result = {"state": net.state_dict(), "norms": norms}
    if sc.get("evaluate"):
        with torch.no_grad():
            xs, ys = torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])
            logits = net(xs)
            result["eval"] = {"loss": float(nn.functional.cross_entropy(logits, ys)),
                              "accuracy": float((logits.argmax(1) == ys).float().mean())}
    return result


def assert_equals_one_process(name: str, sc: dict, got: dict, want: dict, clip: float) -> None:
    """A scenario's run (``got``: its gathered state, norms, loss scale, evaluation) equals the
    one-process reference ``want``: every tensor a whole plain tensor within float32 rounding
    (bfloat16's: the pipeline back-propagates each microbatch's summed loss, the reference its
    share of the mean, and bfloat16 rounds the two gradients differently, 7e-5 here), the same
    norms (and clipping really clipped), the same skipped float16 updates, the same evaluation."""
    tol = 3e-4 if sc.get("precision") == "bf16" else 2e-5
    assert set(got["state"]) == set(want["state"])
    for key, value in want["state"].items():
        assert type(got["state"][key]) is torch.Tensor  # gathered whole, not a DTensor
        torch.testing.assert_close(got["state"][key], value, atol=tol, rtol=tol, msg=f"{name}: {key}")
    assert got["norms"] == pytest.approx(want["norms"], rel=1e-5)
    if sc.get("clip"):
        assert max(want["norms"]) > clip  # clipping really clipped
    if sc.get("precision") == "fp16":
        assert got["scale"] == want["scale"] and want["scale"][1] > 0  # an update was skipped, as torch's
    if sc.get("evaluate"):
        assert got["eval"]["loss"] == pytest.approx(want["eval"]["loss"], rel=1e-5)
        assert got["eval"]["accuracy"] == pytest.approx(want["eval"]["accuracy"])
