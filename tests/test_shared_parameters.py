"""Parameters shared by stages (a tied embedding and output layer), BatchNorm across replicas,
and dropout's random numbers.

The multi-process scenarios run in one launch of 3 gloo processes. Every numerical claim is
checked against plain PyTorch written here: gradient accumulation for flush and gpipe, and for
pipedream and 2bw the update rules of docs/architecture.md ("Shared parameters") with explicit
weight histories.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call

from torchpipedream.schedule.actions import Kind
from torchpipedream.model.graph import Layer, LayerGraph, SharedParameter
from torchpipedream.schedule.placement import tied_support_problem
from torchpipedream.search.planner import plan as make_plan
from torchpipedream.plans.plan import Plan, PlanError, Stage, TiedParameter
from torchpipedream.runtime import Pipeline, launch
from torchpipedream.runtime.engine import Engine, EngineConfig
from torchpipedream.runtime.loss_scaling import LossScaling
from torchpipedream.runtime.pipeline import PipelineError
from torchpipedream.runtime.weights import WeightVersions
from torchpipedream.schedule.build import ScheduleBuildError, build_schedule
from torchpipedream.sim.simulator import simulate
from torchpipedream.plans.topology import Topology
from torchpipedream.schedule.validate import validate_schedule

V, D, LR = 11, 8, 0.5
FP16_SCALING = dict(init_scale=2.0 ** 22, growth_interval=2)


class TiedLM(nn.Module):
    """Token embedding in stage 0, output layer (the same matrix) in the last stage."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.l1 = nn.Linear(D, D)
        self.l2 = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.l1(self.emb(x)))
        h = torch.tanh(self.l2(h))
        return self.head(h)


def tied_lm() -> TiedLM:
    torch.manual_seed(0)
    return TiedLM()


def lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.flatten(0, 1), y.flatten())


def data(n: int, size: int = 6) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, V, (size, 5), generator=g), torch.randint(0, V, (size, 5), generator=g))
            for _ in range(n)]


THREE = [["x", "emb", "l1"], ["relu", "l2"], ["tanh", "head"]]
# Stage of each parameter (by module name), written by hand; the tied matrix is "emb".
STAGE = {"emb": 0, "l1": 0, "l2": 1, "head": 2}


def replicated_plan(kind: str, m: int) -> Plan:
    """Stage 0 (the embedding) on two replicas, stage 1 (the output layer) on rank 2."""
    plan = Plan(stages=[Stage(layers=THREE[0] + THREE[1], replicas=2, ranks=[0, 1]),
                        Stage(layers=THREE[2], replicas=1, ranks=[2])], schedule=kind, microbatches=m)
    plan.validate()
    return plan


# --------------------------------------------------------------------------- references
def reference_sync(batches) -> dict[str, torch.Tensor]:
    model = tied_lm()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for x, y in batches:
        opt.zero_grad()
        lm_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def reference_versions(batches, version_of) -> dict[str, torch.Tensor]:
    """w(t+1) = w(t) − η ∇f_t(w_p^(version_of(p, t)) for every parameter p); the tied matrix is one
    parameter, its gradient the sum over both uses."""
    model = tied_lm()
    live = {k: nn.Parameter(v.detach().clone()) for k, v in model.named_parameters()}  # emb.weight once
    opt = torch.optim.SGD(live.values(), lr=LR, momentum=0.9)
    history = [{k: p.detach().clone() for k, p in live.items()}]
    for t, (x, y) in enumerate(batches):
        params = {k: history[max(0, version_of(k, t))][k].clone().requires_grad_(True) for k in live}
        loss = lm_loss(functional_call(model, params, (x,)), y)
        for p, g in zip(live.values(), torch.autograd.grad(loss, list(params.values()))):
            p.grad = g
        opt.step()
        history.append({k: p.detach().clone() for k, p in live.items()})
    out = dict(history[-1])
    out["head.weight"] = out["emb.weight"]
    return out


# --------------------------------------------------------------------------- the workers
def _pipeline(plan: Plan, **kwargs) -> Pipeline:
    return Pipeline(tied_lm(), plan, optimizer=lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9), loss_fn=lm_loss,
                    timeout_s=30, **kwargs)


class HeadStage(nn.Module):
    """A user's last stage that reads the embedding's matrix (shared with stage 0's module)."""

    def __init__(self, emb: nn.Embedding, l2: nn.Linear) -> None:
        super().__init__()
        self.l2 = l2
        self.emb = emb

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.l2(h)) @ self.emb.weight.t()


def _user_stages() -> list[nn.Module]:
    model = tied_lm()
    first = nn.Sequential(model.emb, model.l1, nn.ReLU())
    return [first, HeadStage(model.emb, model.l2)]


def worker(rank: int, checkpoint_dir: str) -> dict:
    torch.set_num_threads(1)
    out: dict = {}
    for kind, m in (("flush", 2), ("pipedream", 1), ("2bw", 2), ("zb-h1", 2), ("zb-h2", 3), ("zb-2bw", 1)):
        pipe = _pipeline(Plan.straight(THREE, schedule=kind, microbatches=m))
        pipe.train_minibatches(data(8))
        out[kind] = {"full": pipe.state_dict(dst=0), "stage": pipe.stage_state_dict(),
                     "tied": [(t.name, t.stages, t.bytes) for t in pipe.plan.tied],
                     "events": [e.kind for e in pipe.trace(dst=None).events]}
    # gpipe with the embedding's stage replicated: the shared matrix's group spans 3 ranks.
    pipe = _pipeline(replicated_plan("gpipe", 2))
    pipe.train_minibatches(data(4))
    out["gpipe_replicated"] = {"full": pipe.state_dict(dst=0), "stage": pipe.stage_state_dict()}
    # The same under pipedream is refused at construction, naming the parameter.
    try:
        _pipeline(replicated_plan("pipedream", 1))
        out["refused"] = None
    except PipelineError as exc:
        out["refused"] = str(exc)
    # Checkpoints: 2 + 2 minibatches with a save and a load between equal 4 in a row.
    pipe = _pipeline(Plan.straight(THREE, schedule="flush", microbatches=2))
    pipe.train_minibatches(data(2))
    pipe.save_checkpoint(checkpoint_dir)
    pipe.train_minibatches(data(4)[2:])
    straight = pipe.state_dict(dst=0)
    again = _pipeline(Plan.straight(THREE, schedule="flush", microbatches=2))
    again.load_checkpoint(checkpoint_dir)
    again.train_minibatches(data(4)[2:])
    out["resumed"] = {"straight": straight, "resumed": again.state_dict(dst=0)}
    # float16 with loss scaling: an overflow in either copy's gradient skips the update everywhere.
    pipe = _pipeline(Plan.straight(THREE, schedule="flush", microbatches=2), precision="fp16",
                     loss_scaling=LossScaling(**FP16_SCALING))
    pipe.train_minibatches(data(8))
    out["fp16"] = {"full": pipe.state_dict(dst=0), "stage": pipe.stage_state_dict(), "scale": pipe.loss_scale,
                   "skipped": pipe.skipped_updates}
    return out


def user_stage_worker(rank: int) -> dict:
    torch.set_num_threads(1)
    pipe = Pipeline(_user_stages(), Plan.straight([["a"], ["b"]], schedule="flush", microbatches=2),
                    optimizer=lambda p: torch.optim.SGD(p, lr=LR, momentum=0.9), loss_fn=lm_loss, timeout_s=30)
    pipe.train_minibatches(data(4))
    return {"full": pipe.state_dict(dst=0), "tied": [(t.name, t.stages) for t in pipe.plan.tied]}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    directory = str(tmp_path_factory.mktemp("tied_checkpoint"))
    return launch(worker, 3, directory, timeout_s=300, comm_timeout_s=60, return_all=True)


def assert_close(got: dict, want: dict, atol: float = 1e-5) -> None:
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=atol, rtol=1e-5, msg=f"parameter {k}")


def differs(got: dict, want: dict) -> float:
    return max((got[k] - want[k]).abs().max().item() for k in want)


# --------------------------------------------------------------------------- runtime
@pytest.mark.parametrize("kind", ["flush", "zb-h1", "zb-h2"])
def test_flush_with_tied_weights_equals_plain_training(results, kind):
    got = results[0][kind]["full"]
    assert_close(got, reference_sync(data(8)))
    assert results[0][kind]["tied"] == [("emb.weight", [0, 2], V * D * 4)]
    assert torch.equal(got["emb.weight"], got["head.weight"])


def test_fp16_with_tied_weights_skips_what_torchs_grad_scaler_skips(results):
    """Gradient accumulation under float16 autocast with torch's GradScaler (the same policy,
    scaling each microbatch's summed loss as the pipeline does) against the pipeline with the
    tied matrix split over stages 0 and 2: same skipped updates and scale on every rank, same
    weights, and both copies of the matrix identical."""
    from fp16_reference import grad_scaler_training

    model = tied_lm()
    scale, skipped = grad_scaler_training(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9), data(8), 2,
                                          lm_loss, **FP16_SCALING)
    assert 0 < skipped < 8
    assert [(r["fp16"]["scale"], r["fp16"]["skipped"]) for r in results] == [(scale, skipped)] * 3
    assert_close(results[0]["fp16"]["full"], {k: v.detach() for k, v in model.state_dict().items()}, atol=1e-6)
    assert torch.equal(results[0]["fp16"]["stage"]["emb.weight"], results[2]["fp16"]["stage"]["head.weight"])


def test_copies_stay_bit_identical_under_every_schedule(results):
    for kind in ("flush", "pipedream", "2bw", "zb-h1", "zb-h2", "zb-2bw"):
        first, last = results[0][kind]["stage"]["emb.weight"], results[2][kind]["stage"]["head.weight"]
        assert torch.equal(first, last), kind
        assert not torch.equal(first, tied_lm().emb.weight.detach()), kind  # it trained


def test_pipedream_tied_rule(results):
    """n = 3 stages, the matrix first held by stage 0: every use in minibatch t sees its version
    t − 3, the other weights of stage s theirs, t − (2 − s)."""
    got = results[0]["pipedream"]["full"]
    rule = lambda k, t: t - 3 if k == "emb.weight" else t - (2 - STAGE[k.split(".")[0]])  # noqa: E731
    assert_close(got, reference_versions(data(8), rule))
    # It is not the stage's own version for the matrix, nor synchronous training.
    own = lambda k, t: t - (2 - STAGE[k.split(".")[0]])  # noqa: E731
    assert differs(got, reference_versions(data(8), own)) > 1e-4
    assert differs(got, reference_sync(data(8))) > 1e-4
    # The exchange ran: every holder posted and stepped the matrix once per minibatch.
    events = results[0]["pipedream"]["events"]
    assert events.count("TP") == 2 * 8 and events.count("TR") == 2 * 8


@pytest.mark.parametrize("kind", ["2bw", "zb-2bw"])
def test_2bw_tied_rule(results, kind):
    # zb-2bw with one microbatch per batch: n = 3 > 2μ, the regime where it holds two batches
    got = results[0][kind]["full"]
    assert_close(got, reference_versions(data(8), lambda k, t: t - 1))
    assert differs(got, reference_sync(data(8))) > 1e-4


def test_replicated_holder_under_gpipe(results):
    assert_close(results[0]["gpipe_replicated"]["full"], reference_sync(data(4)))
    a, b = results[0]["gpipe_replicated"]["stage"], results[1]["gpipe_replicated"]["stage"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(a["emb.weight"], results[2]["gpipe_replicated"]["stage"]["head.weight"])


def test_unsupported_combination_is_refused_by_name(results):
    message = results[0]["refused"]
    assert message is not None and "emb.weight" in message and "replicated" in message


def test_checkpoint_keeps_the_shared_parameter_and_its_optimizer(results):
    r = results[0]["resumed"]
    for k in r["straight"]:
        assert torch.equal(r["straight"][k], r["resumed"][k]), k


def test_user_stage_modules_sharing_a_parameter():
    out = launch(user_stage_worker, 2, timeout_s=120, comm_timeout_s=60)
    assert out["tied"] == [("0.0.weight", [0, 1])]
    want = reference_sync(data(4))
    assert_close({"0.0.weight": out["full"]["0.0.weight"], "0.1.weight": out["full"]["0.1.weight"],
                  "1.l2.weight": out["full"]["1.l2.weight"]},
                 {"0.0.weight": want["emb.weight"], "0.1.weight": want["l1.weight"], "1.l2.weight": want["l2.weight"]})
    assert torch.equal(out["full"]["0.0.weight"], out["full"]["1.emb.weight"])


# --------------------------------------------------------------------------- schedules and plans
def _tied_plan(kind: str, m: int = 1) -> Plan:
    plan = Plan.straight(THREE, schedule=kind, microbatches=m)
    plan.tied = [TiedParameter("emb.weight", [0, 2], 352)]
    plan.validate()
    return plan


@pytest.mark.parametrize("kind,m", [("pipedream", 1), ("2bw", 2), ("flush", 3), ("gpipe", 2)])
def test_schedules_exchange_the_shared_parameter_once_per_update(kind, m):
    sched = build_schedule(_tied_plan(kind, m), minibatches=5)
    validate_schedule(sched)  # the validator checks the posts, the waits and the versions
    for rank in (0, 2):
        acts = sched.actions[rank]
        posts = [a.id for a in acts if a.kind is Kind.TIED_POST]
        steps = [a.id for a in acts if a.kind is Kind.TIED_REDUCE]
        assert posts == steps == list(range(5)), (kind, rank)
    assert not any(a.kind in (Kind.TIED_POST, Kind.TIED_REDUCE) for a in sched.actions[1])


def test_tied_exchange_costs_little_in_simulation():
    plain = Plan.straight(THREE, schedule="pipedream")
    for st in plain.stages:
        st.forward_ms, st.backward_ms = 1.0, 2.0
    tied = copy.deepcopy(plain)
    tied.tied = [TiedParameter("emb.weight", [0, 2], 10_000)]
    base = simulate(build_schedule(plain, minibatches=20))
    with_tie = simulate(build_schedule(tied, minibatches=20))
    assert with_tie.makespan_s >= base.makespan_s
    assert with_tie.makespan_s <= base.makespan_s * 1.05  # posted early, waited for late
    assert any(e.kind == "TR" for e in with_tie.trace.events)


def test_unsupported_kinds_name_the_parameter():
    assert "emb.weight" in tied_support_problem(_tied_plan("naive"), "naive")
    assert "vertical sync" in tied_support_problem(_tied_plan("pipedream"), "pipedream", vertical_sync=True)
    with pytest.raises(ScheduleBuildError, match="emb.weight"):
        build_schedule(_tied_plan("naive"), minibatches=2)


def test_plan_json_keeps_the_shared_parameters(tmp_path):
    plan = _tied_plan("flush", 2)
    plan.save(tmp_path / "p.json")
    again = Plan.load(tmp_path / "p.json")
    assert again.tied == plan.tied and again.tied_at(2) == [0] and again.tied_at(1) == []
    assert "shared parameter emb.weight" in again.table()
    bad = plan.to_dict()
    bad["tied"] = [{"name": "emb.weight", "stages": [2, 0], "bytes": 1}]
    with pytest.raises(PlanError, match="ascending"):
        Plan.from_dict(bad)


def _graph(compute: list[float], tied_bytes: int) -> LayerGraph:
    names = ["x", "a", "b", "c", "d"]
    layers = [Layer("x", is_input=True, activation_bytes=1000)]
    layers += [Layer(n, forward_ms=f, backward_ms=2 * f, activation_bytes=1000, parameter_bytes=4000)
               for n, f in zip(names[1:], compute)]
    return LayerGraph(layers, list(zip(names, names[1:])), batch_size=8,
                      tied=[SharedParameter("w", ["a", "d"], tied_bytes)])


def test_planner_prices_a_split_tie_and_records_it():
    graph = _graph([1.0, 1.0, 1.0, 1.0], 4000)
    split = make_plan(graph, Topology.from_any("2:1GB/s"), schedule="pipedream", straight=True)
    assert split.tied == [TiedParameter("w", [0, 1], 4000, ["a", "d"])]
    assert "(used by a, d)" in split.table()
    plain = make_plan(LayerGraph(graph.layers, graph.edges, batch_size=8), Topology.from_any("2:1GB/s"),
                      schedule="pipedream", straight=True)
    # The copy costs memory on the second holder and its exchange time on both.
    assert split.stages[1].memory_bytes > plain.stages[1].memory_bytes
    assert split.predicted["time_per_minibatch_s"] > plain.predicted["time_per_minibatch_s"]


def test_planner_keeps_a_tie_in_one_stage_when_that_costs_nothing():
    # A huge tied matrix over a slow link: splitting it costs more than the pipeline gains, so
    # the plan keeps both uses in one stage (here: data parallel, one stage).
    graph = _graph([1.0, 1.0, 1.0, 1.0], 400_000_000)
    chosen = make_plan(graph, Topology.from_any("2:1MB/s"), schedule="flush", microbatches=2)
    assert chosen.tied == []
    stage_of = {n: s for s, st in enumerate(chosen.stages) for n in st.layers}
    assert stage_of["a"] == stage_of["d"]


# --------------------------------------------------------------------------- BatchNorm and dropout
def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6, momentum=0.3), nn.ReLU(), nn.Linear(6, 3))


def bn_worker(rank: int) -> dict:
    torch.set_num_threads(1)
    plan = Plan(stages=[Stage(layers=["input_1", "_0", "_1", "_2", "_3"], replicas=2, ranks=[0, 1])],
                schedule="flush", microbatches=2)
    pipe = Pipeline(bn_model(), plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.CrossEntropyLoss())
    g = torch.Generator().manual_seed(3)
    pipe.train_step((torch.randn(8, 4, generator=g) * 3 + 1, torch.randint(0, 3, (8,), generator=g)))
    return {k: v for k, v in pipe.stage_state_dict().items() if "1." in k}


def test_replicas_average_batchnorm_statistics():
    a, b = launch(bn_worker, 2, timeout_s=120, comm_timeout_s=60, return_all=True)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # Independently: each replica updates from its microbatch; the update keeps their mean.
    model = bn_model()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 4, generator=g) * 3 + 1
    h = model[0](x).detach()
    means = [part.mean(0) for part in h.tensor_split(2)]
    variances = [part.var(0, unbiased=True) for part in h.tensor_split(2)]
    want_mean = sum(0.7 * torch.zeros(6) + 0.3 * mu for mu in means) / 2
    want_var = sum(0.7 * torch.ones(6) + 0.3 * v for v in variances) / 2
    torch.testing.assert_close(a["1.running_mean"], want_mean, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(a["1.running_var"], want_var, atol=1e-6, rtol=1e-5)
    assert int(a["1.num_batches_tracked"]) == 2  # every microbatch counted, as one process would


def _engine(module: nn.Module, seed: int) -> Engine:
    weights = WeightVersions(module, lambda p: torch.optim.SGD(p, lr=0.1))
    engine = Engine(0, 0, 0, module, True, True, weights, loss_fn=lambda out: out.sum(),
                    config=EngineConfig(draws_random=True, rng_seed=seed))
    return engine


def test_dropout_masks_per_microbatch_reproducible_and_global_state_untouched():
    engine = _engine(nn.Linear(2, 2), seed=5)
    before = torch.get_rng_state()
    draws = {}
    for microbatch in (0, 1, 0):
        with engine._seeded(microbatch, train=True):
            draws.setdefault(microbatch, []).append(torch.rand(6))
    assert torch.equal(draws[0][0], draws[0][1])  # the same microbatch draws the same numbers
    assert not torch.equal(draws[0][0], draws[1][0])  # replicas take other microbatches: others
    assert torch.equal(torch.get_rng_state(), before)  # the caller's generator is left alone
    other = _engine(nn.Linear(2, 2), seed=6)
    with other._seeded(0, train=True):
        assert not torch.equal(torch.rand(6), draws[0][0])


def test_training_leaves_the_global_random_state_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 3))
    pipe = Pipeline(model, Plan.straight([["input_1", "_0", "_1", "_2"]], schedule="flush", microbatches=2),
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.CrossEntropyLoss(), seed=1)
    assert pipe.engine.draws_random
    before = torch.get_rng_state()
    batch = (torch.ones(4, 4), torch.zeros(4, dtype=torch.long))
    first = pipe.train_step(batch)
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 3))
    again = Pipeline(model, Plan.straight([["input_1", "_0", "_1", "_2"]], schedule="flush", microbatches=2),
                     optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.CrossEntropyLoss(), seed=1)
    assert again.train_step(batch) == first  # reproducible with a seed


def test_split_wide_layers_leaves_the_global_random_state_alone():
    from torchpipedream.model.layer_split import split_wide_layers

    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2048))
    before = torch.get_rng_state()
    split = split_wide_layers(model, parts=2)
    assert torch.equal(torch.get_rng_state(), before)
    x = torch.randn(3, 4)
    torch.testing.assert_close(split(x), model(x))


def test_the_papers_dp_never_returns_a_replicated_holder_of_a_split_tie():
    """method="hierarchical" replicates freely; a split tie under a round-robin kind must not
    be held by a replicated stage, so the straight re-search is the exact planner's."""
    from torchpipedream.schedule.build import build_schedule

    names = ["x"] + [f"l{i}" for i in range(6)]
    layers = [Layer("x", is_input=True, activation_bytes=1000)]
    layers += [Layer(n, forward_ms=1.0, backward_ms=2.0, activation_bytes=1000, parameter_bytes=4000)
               for n in names[1:]]
    graph = LayerGraph(layers, list(zip(names, names[1:])), batch_size=8,
                       tied=[SharedParameter("w", [names[1], names[-1]], 10)])
    for topology in ("C", "A", "4:1GB/s"):
        plan = make_plan(graph, Topology.from_any(topology), schedule="pipedream", method="hierarchical")
        held = {s for t in plan.tied for s in t.stages}
        assert all(plan.stages[s].replicas == 1 for s in held), (topology, plan.config)
        build_schedule(plan, "pipedream", minibatches=4)  # runnable
