"""Multi-process parity: the runtime's final weights equal independent single-process references.

One launch of 3 gloo processes runs every scenario (spawning costs seconds on a 2-core
machine); the references are computed here, in the test process, by plain PyTorch code that
shares nothing with the runtime: gradient accumulation for flush/gpipe, and the paper's
update rules with explicit weight histories for pipedream (stashing, vertical sync), 2BW
and naive pipelining.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from torch import nn
from torch.func import functional_call

from torchpipedream.plans.kinds import VersionRule, schedule_kind
from torchpipedream.plans.plan import Plan, Stage
from torchpipedream.runtime import Pipeline, launch
from torchpipedream.runtime.loss_scaling import LossScaling

LR = 0.1
N_PROCS = 3


# --------------------------------------------------------------------------- models and data
class Skip(nn.Module):
    """A skip connection from stage 0 to stage 2 (relayed through stage 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)
        self.d = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        g = torch.tanh(self.b(h))
        return self.d(self.c(g) + h)


class Flat(nn.Module):
    """Shape arithmetic: ``x.size(0)`` is computed in stage 0 and used in stages 1 and 2."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.size(0)
        h = torch.tanh(self.a(x)).view(n, 2, 4)
        h = torch.tanh(self.b(h.reshape(n, 8)))
        return self.c(h) * (1.0 + 0.0 * n)


class Shared(nn.Module):
    """One parameter read (fx get_attr) in stage 0 and in stage 2: relayed as an activation."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 3)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)) * self.scale
        h = torch.tanh(self.b(h))
        return self.c(h * self.scale)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def skip() -> nn.Module:
    torch.manual_seed(0)
    return Skip()


def flat() -> nn.Module:
    torch.manual_seed(0)
    return Flat()


def tiny_transformer() -> nn.Module:
    from torchpipedream.models import get_model

    torch.manual_seed(0)
    return get_model("transformer", context=16, d_model=32, heads=2, layers=2)


def shared() -> nn.Module:
    torch.manual_seed(0)
    return Shared()


MODELS = {"mlp": mlp, "skip": skip, "flat": flat, "transformer": tiny_transformer, "shared_weight": shared}
# Stage of every parameter, by name prefix (written by hand, independent of the splitter).
PARAM_STAGE = {"mlp": {"0": 0, "2": 1, "4": 2}, "skip": {"a": 0, "b": 1, "c": 2, "d": 2},
               "flat": {"a": 0, "b": 1, "c": 2}, "shared_weight": {"a": 0, "scale": 0, "b": 1, "c": 2}}
LAYERS = {
    "mlp": [["input_1", "_0", "_1"], ["_2", "_3"], ["_4"]],
    "skip": [["x", "a", "tanh"], ["b", "tanh_1"], ["c", "add", "d"]],
    # An int (size) crosses both cuts, relayed through stage 1.
    "flat": [["x", "size", "a", "tanh"], ["view", "reshape", "b", "tanh_1"], ["c", "mul", "add", "mul_1"]],
    "shared_weight": [["x", "a", "tanh", "mul"], ["b", "tanh_1"], ["mul_1", "c"]],
}


def token_data(n: int, size: int = 6, seed: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 96, (size, 16), generator=g), torch.randint(0, 96, (size, 16), generator=g))
            for _ in range(n)]


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def data(n: int, size: int = 8, last: int | None = None, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for t in range(n):
        b = last if (last is not None and t == n - 1) else size
        out.append((torch.randn(b, 4, generator=g), torch.randint(0, 3, (b,), generator=g)))
    return out


def straight(model: str, kind: str, m: int = 1) -> Plan:
    return Plan.straight(LAYERS[model], schedule=kind, microbatches=m)


def two_one(kind: str, m: int = 1) -> Plan:
    """mlp as "2-1": stage 0 (two replicas, ranks 0 and 1) and stage 1 (rank 2)."""
    stages = [Stage(layers=["input_1", "_0", "_1", "_2", "_3"], replicas=2, ranks=[0, 1]),
              Stage(layers=["_4"], replicas=1, ranks=[2])]
    plan = Plan(stages=stages, schedule=kind, microbatches=m)
    plan.validate()
    return plan


# --------------------------------------------------------------------------- the workers
SCENARIOS: dict[str, dict] = {
    "flush_mlp": dict(model="mlp", kind="flush", m=4, n=3),
    "gpipe_mlp": dict(model="mlp", kind="gpipe", m=4, n=3),
    "flush_skip": dict(model="skip", kind="flush", m=2, n=3),
    "gpipe_skip": dict(model="skip", kind="gpipe", m=2, n=3),
    "flush_int_cut": dict(model="flat", kind="flush", m=2, n=3),
    "flush_shared_param": dict(model="shared_weight", kind="flush", m=2, n=3),
    # Planned from a real profile: buffers read via get_attr, ints and several tensors per cut.
    "flush_transformer": dict(model="transformer", kind="flush", m=2, n=2, plan="profiled"),
    "flush_partial_adam": dict(model="mlp", kind="flush", m=3, n=3, last=5, opt="adam"),
    "flush_sum": dict(model="mlp", kind="flush", m=2, n=2, reduction="sum", lr=0.01),
    "pipedream": dict(model="mlp", kind="pipedream", n=12),
    "pipedream_vsync": dict(model="mlp", kind="pipedream", n=12, vertical_sync=True),
    "pipedream_momentum": dict(model="skip", kind="pipedream", n=10, opt="momentum"),
    "2bw": dict(model="mlp", kind="2bw", m=2, n=6),
    "naive": dict(model="mlp", kind="naive", n=12),
    "flush_2_1": dict(model="mlp", kind="flush", m=4, n=3, plan="2-1"),
    "pipedream_2_1": dict(model="mlp", kind="pipedream", n=8, plan="2-1"),
    # Activation recomputation: the same references as without it.
    "flush_skip_recompute": dict(model="skip", kind="flush", m=2, n=3, recompute=True),
    "gpipe_mlp_recompute": dict(model="mlp", kind="gpipe", m=4, n=3, recompute=True),
    "pipedream_recompute": dict(model="mlp", kind="pipedream", n=12, recompute=True),
    "pipedream_momentum_recompute": dict(model="skip", kind="pipedream", n=10, opt="momentum", recompute=[1]),
    "2bw_recompute": dict(model="mlp", kind="2bw", m=2, n=6, recompute=True),
    "flush_2_1_recompute": dict(model="mlp", kind="flush", m=4, n=3, plan="2-1", recompute=[0]),
    # bfloat16 autocast: references run the same microbatches under autocast.
    "flush_skip_bf16": dict(model="skip", kind="flush", m=2, n=3, precision="bf16"),
    "pipedream_bf16": dict(model="mlp", kind="pipedream", n=12, precision="bf16"),
    "2bw_bf16_recompute": dict(model="mlp", kind="2bw", m=2, n=6, precision="bf16", recompute=True),
    # float16 with dynamic loss scaling: a scale that overflows first (skipped updates), then grows.
    "flush_skip_fp16": dict(model="skip", kind="flush", m=2, n=8, precision="fp16"),
    "gpipe_2_1_fp16": dict(model="mlp", kind="gpipe", m=4, n=8, plan="2-1", precision="fp16"),
    # Zero Bubble H1: the backward split into B (inputs) and W (weights); plain training again.
    "zb-h1_mlp": dict(model="mlp", kind="zb-h1", m=4, n=3),
    "zb-h1_skip": dict(model="skip", kind="zb-h1", m=2, n=3),
    "zb-h1_int_cut": dict(model="flat", kind="zb-h1", m=3, n=3),
    "zb-h1_shared_param": dict(model="shared_weight", kind="zb-h1", m=2, n=3),
    "zb-h1_transformer": dict(model="transformer", kind="zb-h1", m=2, n=2, plan="profiled"),
    "zb-h1_partial_adam": dict(model="mlp", kind="zb-h1", m=3, n=3, last=5, opt="adam"),
    "zb-h1_skip_recompute": dict(model="skip", kind="zb-h1", m=2, n=3, recompute=True),
    "zb-h1_skip_bf16": dict(model="skip", kind="zb-h1", m=2, n=3, precision="bf16"),
    "zb-h1_skip_fp16": dict(model="skip", kind="zb-h1", m=2, n=8, precision="fp16"),
    "zb-h2_mlp": dict(model="mlp", kind="zb-h2", m=6, n=3),
    "zb-h2_skip": dict(model="skip", kind="zb-h2", m=2, n=3),
    "zb-h2_shared_param": dict(model="shared_weight", kind="zb-h2", m=4, n=3),
    # 2bw with the backward split: 2bw's rule. m = 2 ≥ n − 1 holds 2bw's depth; m = 1 < n − 1
    # holds up to two batches (2m) per stage.
    "zb-2bw": dict(model="mlp", kind="zb-2bw", m=2, n=6),
    "zb-2bw_m1": dict(model="mlp", kind="zb-2bw", m=1, n=8),
    "zb-2bw_skip_momentum": dict(model="skip", kind="zb-2bw", m=2, n=6, opt="momentum"),
    "zb-2bw_recompute": dict(model="mlp", kind="zb-2bw", m=2, n=6, recompute=True),
}
#: The loss scale's policy of the float16 scenarios: starts high enough to overflow.
FP16_SCALING = dict(init_scale=2.0 ** 18, growth_interval=2)
#: Each recomputing scenario and the scenario it repeats without recomputation.
RECOMPUTED = {name: name.removesuffix("_recompute") for name in SCENARIOS
              if name.endswith("_recompute") and "precision" not in SCENARIOS[name]}


def make_opt(name: str, lr: float):
    if name == "sgd":
        return lambda p: torch.optim.SGD(p, lr=lr)
    if name == "momentum":
        return lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9)
    return lambda p: torch.optim.Adam(p, lr=lr)


def run_scenario(name: str, profiled: dict | None = None) -> dict:
    sc = SCENARIOS[name]
    kind, m = sc["kind"], sc.get("m", 1)
    if sc.get("plan") == "2-1":
        plan = two_one(kind, m)
    elif sc.get("plan") == "profiled":
        plan = dataclasses.replace(profiled[sc["model"]], schedule=kind)
    else:
        plan = straight(sc["model"], kind, m)
    reduction = sc.get("reduction", "mean")
    loss_fn = lm_loss if sc["model"] == "transformer" else nn.CrossEntropyLoss(reduction=reduction)
    pipe = Pipeline(MODELS[sc["model"]](), plan, optimizer=make_opt(sc.get("opt", "sgd"), sc.get("lr", LR)),
                    loss_fn=loss_fn, loss_reduction=reduction, vertical_sync=sc.get("vertical_sync", False),
                    microbatches=m if schedule_kind(kind).microbatched else None, timeout_s=30,
                    recompute=sc.get("recompute"), precision=sc.get("precision", "fp32"),
                    loss_scaling=LossScaling(**FP16_SCALING) if sc.get("precision") == "fp16" else None)
    batches = token_data(sc["n"]) if sc["model"] == "transformer" else data(sc["n"], last=sc.get("last"))
    calls = [0]  # forwards of the stage's modules with parameters (a recomputing stage runs each twice)

    def count(*_: object) -> None:
        calls[0] += 1

    hooks = [m.register_forward_hook(count) for m in pipe.module.modules() if m._parameters]
    losses = pipe.train_minibatches(batches)
    for h in hooks:
        h.remove()
    out = {"losses": losses, "stage": pipe.stage_state_dict(), "full": pipe.state_dict(dst=0),
           "copies": pipe.weights.copies, "versions": pipe.weights.max_versions_alive, "forwards": calls[0],
           "loss_scale": pipe.loss_scale, "skipped": pipe.skipped_updates}
    if name in ("pipedream", "pipedream_bf16"):
        out["trace"] = pipe.trace(dst=0)
        out["eval"] = pipe.evaluate(data(2, seed=7))
    return out


def worker(rank: int, profiled: dict) -> dict:
    torch.set_num_threads(1)
    return {name: run_scenario(name, profiled) for name in SCENARIOS}


def profiled_plans() -> dict:
    """A 3-stage plan for the tiny transformer from its real profile (profiler + planner)."""
    from torchpipedream.search.planner import plan as make_plan
    from torchpipedream.model.profiler import profile
    from torchpipedream.plans.topology import Topology

    x, y = token_data(1)[0]
    graph = profile(tiny_transformer(), x, lm_loss, y, warmup=0, iters=1)
    return {"transformer": make_plan(graph, Topology.local(N_PROCS), schedule="flush", straight=True,
                                     num_stages=N_PROCS, microbatches=2)}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return launch(worker, N_PROCS, profiled_plans(), timeout_s=240, comm_timeout_s=60, return_all=True)


# --------------------------------------------------------------------------- references
def _stage_of(model: str, key: str) -> int:
    return PARAM_STAGE[model][key.split(".")[0]]


def _loss(module: nn.Module, params: dict, batch, reduction: str = "mean") -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(functional_call(module, params, (x,)), y, reduction=reduction)


def reference_sync(model: str, batches, opt: str = "sgd", reduction: str = "mean", lr: float = LR) -> dict:
    """Plain training, one optimizer step per batch (= flush/gpipe with any microbatching)."""
    module = MODELS[model]()
    optim = make_opt(opt, lr)(module.parameters())
    for x, y in batches:
        optim.zero_grad()
        if model == "transformer":
            lm_loss(module(x), y).backward()
        else:
            nn.functional.cross_entropy(module(x), y, reduction=reduction).backward()
        optim.step()
    return {k: v.detach() for k, v in module.state_dict().items()}


def reference_versions(model: str, batches, version_of, opt: str = "sgd", lr: float = LR) -> dict:
    """w_s^(t+1) = w_s^(t) − η ∇_{w_s} f_t(w_1^(v_1(t)), …, w_n^(v_n(t))), one optimizer per stage.

    ``version_of(stage, t)`` is the version each stage's weights have in minibatch t's
    computation; ``history[k]`` holds every stage's weights after k updates.
    """
    module = MODELS[model]()
    live = {k: nn.Parameter(v.detach().clone()) for k, v in module.named_parameters()}
    n = 1 + max(PARAM_STAGE[model].values())
    optims = [make_opt(opt, lr)([p for k, p in live.items() if _stage_of(model, k) == s]) for s in range(n)]
    history = [{k: p.detach().clone() for k, p in live.items()}]
    for t, batch in enumerate(batches):
        params = {k: history[max(0, version_of(_stage_of(model, k), t))][k].clone().requires_grad_(True)
                  for k in live}
        loss = _loss(module, params, batch)
        grads = torch.autograd.grad(loss, list(params.values()))
        for (k, p), g in zip(live.items(), grads):
            p.grad = g
        for o in optims:
            o.step()
        history.append({k: p.detach().clone() for k, p in live.items()})
    return history[-1]


def assert_close(got: dict, want: dict, atol: float = 1e-5) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=atol, rtol=1e-5, msg=f"parameter {k}")


def differs(got: dict, want: dict) -> float:
    return max((got[k] - want[k]).abs().max().item() for k in want)


# --------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", ["flush_mlp", "gpipe_mlp", "flush_skip", "gpipe_skip", "flush_int_cut",
                                  "flush_shared_param", "zb-h1_mlp", "zb-h1_skip", "zb-h1_int_cut",
                                  "zb-h1_shared_param", "zb-h2_mlp", "zb-h2_skip", "zb-h2_shared_param"])
def test_flush_and_gpipe_equal_gradient_accumulation(results, name):
    sc = SCENARIOS[name]
    batches = data(sc["n"])
    assert_close(results[0][name]["full"], reference_sync(sc["model"], batches))
    # Reported losses are the minibatch means under the weights before each update.
    module, losses = MODELS[sc["model"]](), []
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    for x, y in batches:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(module(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert results[0][name]["losses"] == pytest.approx(losses, abs=1e-5)
    # Flush and gpipe keep one version: an update never needs a copy.
    assert all(r[name]["copies"] == 0 for r in results)


@pytest.mark.parametrize("name", ["flush_transformer", "zb-h1_transformer"])
def test_transformer_from_a_real_profile_and_plan(results, name):
    out = results[0][name]
    assert_close(out["full"], reference_sync("transformer", token_data(2)))
    assert sorted(out["full"]) == sorted(tiny_transformer().state_dict())  # no non-persistent buffers


def test_losses_reach_every_rank(results):
    for name in SCENARIOS:
        assert results[1][name]["losses"] == results[0][name]["losses"] == results[2][name]["losses"]
        assert all(math.isfinite(v) for v in results[0][name]["losses"])


@pytest.mark.parametrize("name", ["flush_partial_adam", "zb-h1_partial_adam"])
def test_partial_last_batch_with_adam_is_exact_mean(results, name):
    sc = SCENARIOS[name]
    want = reference_sync("mlp", data(sc["n"], last=sc["last"]), opt="adam")
    assert_close(results[0][name]["full"], want)


def test_sum_reduction(results):
    sc = SCENARIOS["flush_sum"]
    want = reference_sync("mlp", data(sc["n"]), reduction="sum", lr=sc["lr"])
    assert_close(results[0]["flush_sum"]["full"], want)


def _pipedream_version(n: int):
    return lambda s, t: t - (n - 1 - s)  # 0-indexed stage s uses w_s^(t-n+1+s)


def test_pipedream_stashing_matches_paper_rule(results):
    got = results[0]["pipedream"]["full"]
    want = reference_versions("mlp", data(12), _pipedream_version(3))
    assert_close(got, want)
    # The synchronous rule is not what happened (the test can tell them apart).
    assert differs(got, reference_sync("mlp", data(12))) > 1e-4
    # Stages 0 and 1 stash (copy on update); the last stage never needs a copy.
    assert results[0]["pipedream"]["copies"] > 0 and results[2]["pipedream"]["copies"] == 0
    # Stage s (0-indexed, n = 3) holds at most n − s weight versions (stashes + live).
    assert [r["pipedream"]["versions"] for r in results] == [3, 2, 1]


def test_pipedream_momentum_on_skip_model(results):
    got = results[0]["pipedream_momentum"]["full"]
    assert_close(got, reference_versions("skip", data(10), _pipedream_version(3), opt="momentum"))


def test_pipedream_vertical_sync(results):
    got = results[0]["pipedream_vsync"]["full"]
    assert_close(got, reference_versions("mlp", data(12), lambda s, t: t - 3 + 1))
    assert differs(got, reference_versions("mlp", data(12), _pipedream_version(3))) > 1e-5


def test_2bw_rule(results):
    sc = SCENARIOS["2bw"]
    # W^(t+1) = W^(t) − η ∇f_t(W^(t−1)): every stage uses version t−1 for batch t.
    got = results[0]["2bw"]["full"]
    assert_close(got, reference_versions("mlp", data(sc["n"]), lambda s, t: t - 1))
    assert differs(got, reference_sync("mlp", data(sc["n"]))) > 1e-5
    assert max(r["2bw"]["versions"] for r in results) == 2  # double buffering


@pytest.mark.parametrize("name", ["zb-2bw", "zb-2bw_m1", "zb-2bw_skip_momentum"])
def test_zb_2bw_follows_the_2bw_rule(results, name):
    """The backward split into B and W changes when each gradient is computed, not which
    weights it is computed on: W^(t+1) = W^(t) − η ∇f_t(W^(t−1)), as 2bw."""
    sc = SCENARIOS[name]
    got = results[0][name]["full"]
    want = reference_versions(sc["model"], data(sc["n"]), lambda s, t: t - 1, opt=sc.get("opt", "sgd"))
    assert_close(got, want)
    assert differs(got, reference_sync(sc["model"], data(sc["n"]), opt=sc.get("opt", "sgd"))) > 1e-5
    assert max(r[name]["versions"] for r in results) == 2  # double buffering, W included


def test_naive_differs_from_stashing(results):
    got = results[0]["naive"]["full"]
    want = reference_versions("mlp", data(12), _pipedream_version(3))
    assert differs(got, want) > 1e-4
    assert all(torch.isfinite(v).all() for v in got.values())


def test_replicated_stage_flush_equals_plain_training(results):
    assert_close(results[0]["flush_2_1"]["full"], reference_sync("mlp", data(3)))


@pytest.mark.parametrize("name", ["flush_2_1", "pipedream_2_1"])
def test_replicas_stay_bit_identical(results, name):
    a, b = results[0][name]["stage"], results[1][name]["stage"]
    assert sorted(a) == sorted(b) and a
    for k in a:
        assert torch.equal(a[k], b[k]), k
    initial = mlp().state_dict()
    assert any(not torch.equal(a[k], initial[k]) for k in a)  # it trained


def test_trace_and_evaluate(results, tmp_path):
    from torchpipedream.sim.trace import Trace

    out = results[0]["pipedream"]
    trace = out["trace"]
    assert trace.ranks == [0, 1, 2]
    kinds = {e.kind for e in trace.events}
    assert {"F", "B", "SA", "RA", "SG", "RG", "U"} <= kinds
    assert all(e.end_s >= e.start_s for e in trace.events)
    assert sum(1 for e in trace.events if e.kind == "F") == 3 * 12
    assert all(e.bytes > 0 for e in trace.events if e.kind in ("SA", "RA", "SG", "RG"))
    trace.save(tmp_path / "t.json")
    again = Trace.load(tmp_path / "t.json")
    assert len(again.events) == len(trace.events)
    # The measured trace renders with `torchpipedream timeline`.
    from torchpipedream.cli import main

    assert main(["timeline", str(tmp_path / "t.json"), "--out", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").stat().st_size > 1000
    # evaluate: forward only with the final weights = the reference model's loss/accuracy.
    module = MODELS["mlp"]()
    module.load_state_dict(out["full"])
    xs = torch.cat([x for x, _ in data(2, seed=7)])
    ys = torch.cat([y for _, y in data(2, seed=7)])
    with torch.no_grad():
        logits = module(xs)
    assert out["eval"]["loss"] == pytest.approx(nn.functional.cross_entropy(logits, ys).item(), abs=1e-5)
    assert out["eval"]["accuracy"] == pytest.approx((logits.argmax(1) == ys).float().mean().item())


# --------------------------------------------------------------------------- recomputation
def _reference_of(name: str) -> dict:
    sc = SCENARIOS[name]
    batches = data(sc["n"])
    opt = sc.get("opt", "sgd")
    rule = schedule_kind(sc["kind"]).version_rule
    if rule is VersionRule.BATCH:
        return reference_sync(sc["model"], batches, opt)
    if rule is VersionRule.PREVIOUS_BATCH:  # 2bw, zb-2bw
        return reference_versions(sc["model"], batches, lambda s, t: t - 1, opt)
    return reference_versions(sc["model"], batches, _pipedream_version(3), opt)


@pytest.mark.parametrize("name", sorted(RECOMPUTED))
def test_recomputation_follows_the_same_rule(results, name):
    """A run with recomputation equals its schedule's independent reference, and every stage
    that recomputes ran each forward twice (the one without recomputation once); with a split
    backward (zb-h1, zb-2bw) three times on the stages after the first (the checkpoint region runs again
    for B and for W; the first stage's B has nothing to compute)."""
    assert_close(results[0][name]["full"], _reference_of(name))
    assert results[0][name]["losses"] == pytest.approx(results[0][RECOMPUTED[name]]["losses"], abs=1e-6)
    chosen = SCENARIOS[name]["recompute"]
    plan = two_one("flush") if SCENARIOS[name].get("plan") == "2-1" else straight(SCENARIOS[name]["model"], "flush")
    for rank, r in enumerate(results):
        stage, _ = plan.stage_of_rank(rank)
        once = r[RECOMPUTED[name]]["forwards"]
        assert once > 0
        runs = 3 if schedule_kind(SCENARIOS[name]["kind"]).split_backward and stage > 0 else 2
        assert r[name]["forwards"] == (runs * once if chosen is True or stage in chosen else once), (rank, stage)


# --------------------------------------------------------------------------- bfloat16 autocast
def reference_bf16(model: str, batches, m: int, version_of=None) -> dict:
    """The schedule's rule with every microbatch's forward and loss under bfloat16 autocast:
    float32 weights and optimizer (SGD); ``m`` microbatches accumulated per update; weights of
    the version ``version_of(stage, t)`` (None: the current ones)."""
    module = MODELS[model]()
    live = {k: nn.Parameter(v.detach().clone()) for k, v in module.named_parameters()}
    history = [{k: p.detach().clone() for k, p in live.items()}]
    optim = torch.optim.SGD(live.values(), lr=LR)
    for t, (x, y) in enumerate(batches):
        params = {k: (history[max(0, version_of(_stage_of(model, k), t))][k].clone() if version_of else p.detach().clone())
                  .requires_grad_(True) for k, p in live.items()}
        grads = [torch.zeros_like(p) for p in params.values()]
        for xs, ys in zip(x.chunk(m), y.chunk(m)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(functional_call(module, params, (xs,)), ys)
            for acc, g in zip(grads, torch.autograd.grad(loss * len(ys) / len(y), list(params.values()))):
                acc += g
        for p, g in zip(live.values(), grads):
            p.grad = g
        optim.step()
        history.append({k: p.detach().clone() for k, p in live.items()})
    return history[-1]


@pytest.mark.parametrize("name, rule", [("flush_skip_bf16", None), ("zb-h1_skip_bf16", None),
                                        ("pipedream_bf16", _pipedream_version(3)),
                                        ("2bw_bf16_recompute", lambda s, t: t - 1)])
def test_bf16_autocast_follows_the_rule_with_float32_master_weights(results, name, rule):
    sc = SCENARIOS[name]
    got = results[0][name]["full"]
    assert all(v.dtype == torch.float32 for v in got.values())
    want = reference_bf16(sc["model"], data(sc["n"]), sc.get("m", 1), rule)
    assert_close(got, want, atol=1e-6)
    # The float32 run of the same rule is measurably elsewhere: the test sees the precision.
    fp32 = reference_versions(sc["model"], data(sc["n"]), rule) if rule else reference_sync(sc["model"], data(sc["n"]))
    assert differs(got, fp32) > 1e-5


def test_bf16_activations_cross_the_cuts_in_half_the_bytes(results):
    def sent(name: str) -> list[int]:
        return [e.bytes for e in sorted(results[0][name]["trace"].events, key=lambda e: (e.rank, e.id))
                if e.kind in ("SA", "SG")]

    full, half = sent("pipedream"), sent("pipedream_bf16")
    assert len(full) == len(half) and full
    # Every mlp cut carries 8 samples × 8 features: 256 payload bytes in float32, 128 in bfloat16
    # (the header words are the same).
    assert all(f - h == 8 * 8 * 2 for f, h in zip(full, half)), (full[:4], half[:4])


# --------------------------------------------------------------------------- float16, loss scaling
def reference_fp16(model: str, batches, m: int) -> tuple[dict, float, int]:
    """Gradient accumulation under float16 autocast with torch's own GradScaler (same policy)
    scaling each microbatch's summed loss, as the pipeline does: (weights, final scale, skipped
    updates)."""
    from fp16_reference import grad_scaler_training

    module = MODELS[model]()
    scale, skipped = grad_scaler_training(module, torch.optim.SGD(module.parameters(), lr=LR), batches, m,
                                          nn.functional.cross_entropy, **FP16_SCALING)
    return {k: v.detach() for k, v in module.state_dict().items()}, scale, skipped


@pytest.mark.parametrize("name", ["flush_skip_fp16", "gpipe_2_1_fp16", "zb-h1_skip_fp16"])
def test_fp16_loss_scaling_skips_the_same_updates_on_every_stage_as_torch(results, name):
    """Every rank skipped the updates torch's GradScaler skips and holds its scale; the weights
    (float32 masters) equal the reference's."""
    sc = SCENARIOS[name]
    want, scale, skipped = reference_fp16(sc["model"], data(sc["n"]), sc["m"])
    assert 0 < skipped < sc["n"], "the policy must overflow some updates and apply others"
    assert [(r[name]["loss_scale"], r[name]["skipped"]) for r in results] == [(scale, skipped)] * N_PROCS
    got = results[0][name]["full"]
    assert all(v.dtype == torch.float32 for v in got.values())
    assert_close(got, want, atol=1e-6)
    # the float32 run of the same batches is measurably elsewhere: the test sees the precision
    assert differs(got, reference_sync(sc["model"], data(sc["n"]))) > 1e-5
