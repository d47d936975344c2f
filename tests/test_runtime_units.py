"""Runtime pieces without processes: stage splitting, headers, weight versions, and the whole
Pipeline on a one-worker plan (no process group needed)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from torchpipedream.schedule.actions import Kind
from torchpipedream.plans.plan import Plan, Stage
from torchpipedream.runtime import Pipeline, PipelineError, StageSplitError, forward_only, split_stages
from torchpipedream.runtime.comm import CommError, decode_header, encode_header, pack, unpack
from torchpipedream.runtime.weights import WeightVersions, updates_are_minibatch_means
from torchpipedream.schedule.build import build_schedule


class Skip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        g = torch.relu(self.b(h))
        return self.d(self.c(g) + h)


class Untraceable(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.sum() > 0 else x - 1


def run_stages(stages, *inputs):
    out = stages[0](*inputs)
    for st in stages[1:]:
        out = st(*out)
    return out


# --------------------------------------------------------------------------- splitting
def test_split_skip_model_relays_the_skip_tensor():
    torch.manual_seed(0)
    model = Skip()
    plan = Plan.straight([["x", "a", "relu"], ["b", "relu_1"], ["c", "add", "d"]])
    stages = split_stages(model, plan).modules
    x = torch.randn(5, 4)
    mid = stages[0](x)
    assert isinstance(mid, tuple) and len(mid) == 1
    mid = stages[1](*mid)
    assert len(mid) == 2  # relu_1 and the relayed skip tensor relu
    torch.testing.assert_close(stages[2](*mid), model(x))
    keys = [k for st in stages for k in st.state_dict()]
    assert sorted(keys) == sorted(model.state_dict())


def test_split_sequential_by_fx_names_or_child_names():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    x = torch.randn(3, 4)
    for groups in ([["input_1", "_0", "_1"], ["_2"]], [["0", "1"], ["2"]]):
        stages = split_stages(model, Plan.straight(groups)).modules
        torch.testing.assert_close(run_stages(stages, x), model(x))


def test_untraceable_sequential_is_split_by_children():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Untraceable(), nn.Linear(4, 2))
    stages = split_stages(model, Plan.straight([["0"], ["1", "2"]])).modules
    x = torch.randn(3, 4)
    torch.testing.assert_close(run_stages(stages, x), model(x))
    assert sorted(k for st in stages for k in st.state_dict()) == sorted(model.state_dict())
    with pytest.raises(StageSplitError, match="in order"):
        split_stages(model, Plan.straight([["1"], ["0", "2"]]))


def test_stages_cut_from_a_model_are_named_by_it():
    """Stage modules cut from a model's own modules (``model=``): a Pipeline's state and shared
    parameters take the model's names; a stage parameter the model does not hold is refused by name."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(5, 4), nn.Tanh(), nn.Linear(4, 5, bias=False))
    model[2].weight = model[0].weight  # tied: stage 0 and stage 1 hold it
    stages = [nn.Sequential(model[0], model[1]), model[2]]
    split = split_stages(stages, Plan.straight([["a"], ["b"]]), model=model)
    assert split.tied == {"0.weight": {0: "0.0.weight", 1: "1.weight"}}  # the model's name -> each stage's
    pipe = Pipeline([nn.Sequential(*model)], Plan.straight([["a"]], schedule="flush"), model=model,
                    loss_fn=lambda out, y: nn.functional.cross_entropy(out.reshape(-1, 5), y.reshape(-1)),
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    assert sorted(pipe.state_dict()) == sorted(model.state_dict()) == ["0.weight", "2.weight"]
    with pytest.raises(StageSplitError, match="stage 1's parameter '1.weight' is not a parameter of the model"):
        split_stages([stages[0], nn.Linear(4, 5)], Plan.straight([["a"], ["b"]]), model=model)


def test_user_given_stages():
    torch.manual_seed(0)
    s0, s1 = nn.Linear(4, 6), nn.Sequential(nn.ReLU(), nn.Linear(6, 2))
    stages = split_stages([s0, s1], Plan.straight([["first"], ["second"]])).modules
    x = torch.randn(2, 4)
    torch.testing.assert_close(run_stages(stages, x), s1(s0(x)))
    assert sorted(stages[1].state_dict()) == ["1.1.bias", "1.1.weight"]
    with pytest.raises(StageSplitError, match="2 stage modules .* 3 stages"):
        split_stages([s0, s1], Plan.straight([["a"], ["b"], ["c"]]))


def test_split_errors_name_the_layer():
    model = Skip()
    with pytest.raises(StageSplitError, match="'nope'"):
        split_stages(model, Plan.straight([["x", "a", "nope"], ["b", "relu", "relu_1", "c", "add", "d"]]))
    with pytest.raises(StageSplitError, match="data flow"):
        split_stages(model, Plan.straight([["x", "b", "relu_1"], ["a", "relu", "c", "add", "d"]]))
    with pytest.raises(StageSplitError, match="cannot trace"):
        split_stages(Untraceable(), Plan.straight([["x"]]))


# --------------------------------------------------------------------------- headers, passes
def test_header_round_trip():
    ts = [torch.zeros(2, 3, requires_grad=True), torch.zeros(5, dtype=torch.int64)]
    extra = [torch.zeros(2, dtype=torch.bool)]
    samples, act, passengers = decode_header(encode_header(7, ts, extra))
    assert samples == 7
    assert [(m.shape, m.dtype, m.requires_grad) for m in act] == [((2, 3), torch.float32, True), ((5,), torch.int64, False)]
    assert [(m.shape, m.dtype) for m in passengers] == [((2,), torch.bool)]
    # Python values produced by shape arithmetic travel inside the header.
    values = [3, -2.5, True, None, torch.Size([4, 5])]
    _, act, _ = decode_header(encode_header(1, values, []))
    assert [m.value for m in act] == values and not any(m.is_tensor for m in act)
    assert isinstance(act[4].value, torch.Size)
    with pytest.raises(CommError, match="dict crosses a stage boundary"):
        encode_header(1, [{"a": 1}], [])


def test_pack_unpack_round_trip_with_aligned_views():
    ts = [torch.randn(3, 5), 7, torch.arange(5, dtype=torch.int32), torch.randn(2, dtype=torch.float64)]
    buf = pack(9, ts, [torch.tensor([True, False])], torch.device("cpu"))
    samples, acts, passengers, metas = unpack(buf)
    assert samples == 9 and acts[1] == 7 and len(metas) == 5
    for a, t in zip(acts, ts):
        if isinstance(t, torch.Tensor):
            assert torch.equal(a, t) and a.dtype == t.dtype
            assert a.data_ptr() % 8 == 0 and a.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
    assert torch.equal(passengers[0], torch.tensor([True, False]))


def test_nested_values_cross_a_cut_and_are_rebuilt():
    """An LSTM's ``(output, (h, c))``, lists and dicts of tensors and numbers: their leaves
    travel as tensors (views of the buffer, requires-grad kept) and the receiver gets the
    same structure back; targets may nest too."""
    h = torch.randn(2, 3, requires_grad=True)
    lstm_out = (torch.randn(2, 4, requires_grad=True), (h, torch.randn(1, 2, 3)))
    buf = pack(6, [lstm_out, [torch.Size([2, 4]), 2.5], {"mask": torch.ones(2, dtype=torch.bool)}],
               [{"labels": torch.arange(2)}], torch.device("cpu"))
    samples, acts, passengers, metas = unpack(buf)
    assert samples == 6 and len(acts) == 3
    (out, (h2, c2)), (size, number), mask = acts[0], acts[1], acts[2]["mask"]
    assert torch.equal(out, lstm_out[0]) and torch.equal(h2, h) and torch.equal(c2, lstm_out[1][1])
    assert out.requires_grad and h2.requires_grad and not c2.requires_grad  # the leaves of the next stage's graph
    assert tuple(size) == (2, 4) and number == 2.5 and torch.equal(mask, torch.ones(2, dtype=torch.bool))
    assert torch.equal(passengers[0]["labels"], torch.arange(2))
    # one meta per leaf: 4 activation tensors and numbers, the shape's ints, the mask, the label, the structure
    assert sum(m.is_tensor for m in metas) == 5
    # a value no tree holds is still refused, naming its type
    with pytest.raises(CommError, match="a value of type str crosses a stage boundary"):
        pack(1, [("a", torch.zeros(1))], [], torch.device("cpu"))


def test_unused_items_of_a_returned_tuple_are_no_layers():
    """``h, _ = self.rnn(x)`` traces a getitem for the ``_``; the fx path drops it, so no cut
    can fall between the LSTM and an item nothing uses."""
    from torchpipedream.model.capture import trace

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.LSTM(4, 4, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h, _ = self.rnn(x)
            return h

    traced = trace(Net(), (torch.randn(2, 3, 4),), {})
    items = [n for n in traced.module.graph.nodes if n.op == "call_function" and "getitem" in n.name]
    assert traced.method == "fx" and len(items) == 1 and items[0].users


def test_forward_only_keeps_forward_transfers():
    from torchpipedream.schedule.build import build_schedule

    sched = build_schedule(Plan.straight([["a"], ["b"]]), "pipedream", minibatches=3)
    fwd = forward_only(sched)
    for rank, acts in fwd.items():
        assert {a.kind for a in acts} <= {Kind.FORWARD, Kind.SEND_ACT, Kind.RECV_ACT}
        assert sum(a.kind == Kind.FORWARD for a in acts) == 3


# --------------------------------------------------------------------------- weight versions
def test_copy_on_update_only_when_a_version_is_still_needed():
    lin = nn.Linear(2, 2)
    wv = WeightVersions(lin, lambda p: torch.optim.SGD(p, lr=1.0))
    before = lin.weight.detach().clone()
    wv.expect({0: 2})  # one F and one B of version 0 still to run
    v0 = wv.tensors(0)
    wv.release(0)  # the F ran
    wv.accumulate([torch.ones(2, 2), torch.ones(2)], samples=1)
    assert wv.step() is True and wv.copies == 1
    torch.testing.assert_close(wv.tensors(0)["weight"], before)  # the stash is untouched
    assert wv.tensors(0)["weight"] is v0["weight"]
    torch.testing.assert_close(lin.weight.detach(), before - 1.0)  # the live weights moved
    wv.release(0)  # the B ran: the stash is dropped
    with pytest.raises(RuntimeError, match="version 0"):
        wv.tensors(0)
    wv.expect({})
    wv.accumulate([torch.ones(2, 2), torch.ones(2)], samples=2)
    assert wv.step() is False and wv.copies == 1  # nobody needs version 1: in place
    torch.testing.assert_close(lin.weight.detach(), before - 1.5)


# --------------------------------------------------------------------------- one-worker pipeline
def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))


def _plain_training(batches, make_optimizer):
    """The independent reference: the same MLP trained in one process, one step per minibatch."""
    ref = _mlp()
    opt = make_optimizer(ref.parameters())
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(ref(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return ref, losses


def _data(sizes):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(b, 4, generator=g), torch.randint(0, 3, (b,), generator=g)) for b in sizes]


def test_single_worker_flush_equals_plain_training_with_partial_batch():
    batches = _data([9, 9, 4])
    plan = Plan.straight([["input_1", "_0", "_1", "_2"]], schedule="flush", microbatches=3)
    pipe = Pipeline(_mlp(), plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.5),
                    loss_fn=nn.CrossEntropyLoss())
    losses = pipe.train_minibatches(batches)
    ref, ref_losses = _plain_training(batches, lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.5))
    assert losses == pytest.approx(ref_losses, abs=1e-6)
    got = pipe.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, atol=1e-6, rtol=1e-6)
    ev = pipe.evaluate(_data([6]))
    x, y = _data([6])[0]
    with torch.no_grad():
        assert ev["loss"] == pytest.approx(nn.functional.cross_entropy(ref(x), y).item(), abs=1e-6)
    assert ev["samples"] == 6 and 0.0 <= ev["accuracy"] <= 1.0
    trace = pipe.trace()
    assert {e.kind for e in trace.events} == {"F"}  # the last run was the evaluation


def test_which_schedules_start_backward_from_minibatch_means():
    two = Plan.straight([["a"], ["b"]])
    dp = Plan(stages=[Stage(layers=["a"], replicas=2, ranks=[0, 1])])
    assert updates_are_minibatch_means(build_schedule(two, "pipedream", minibatches=6), False, "mean")
    assert not updates_are_minibatch_means(build_schedule(two, "pipedream", minibatches=6), False, "sum")
    assert not updates_are_minibatch_means(build_schedule(two, "flush", minibatches=2, microbatches=3), False, "mean")
    assert not updates_are_minibatch_means(build_schedule(dp, "pipedream", minibatches=4), True, "mean")


@pytest.mark.parametrize("sizes", [[8, 8, 5], [7]])
def test_single_worker_pipedream_with_mean_gradients_equals_plain_training(sizes):
    # One microbatch per update: the backward starts from the minibatch's mean loss and the
    # update applies it unscaled; the weights must equal plain training's, a last smaller
    # minibatch included.
    batches = _data(sizes)
    plan = Plan.straight([["input_1", "_0", "_1", "_2"]], schedule="pipedream")
    pipe = Pipeline(_mlp(), plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.5),
                    loss_fn=nn.CrossEntropyLoss())
    losses = pipe.train_minibatches(batches)
    assert pipe.weights.grads_are_means
    ref, ref_losses = _plain_training(batches, lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.5))
    assert losses == pytest.approx(ref_losses, abs=1e-6)
    got = pipe.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, atol=1e-6, rtol=1e-6)


def test_minibatch_smaller_than_microbatches_leaves_empty_microbatches():
    batches = _data([8, 3])  # m = 4: the second minibatch has one empty microbatch
    plan = Plan.straight([["input_1", "_0", "_1", "_2"]], schedule="gpipe", microbatches=4)
    pipe = Pipeline(_mlp(), plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.3), loss_fn=nn.CrossEntropyLoss())
    losses = pipe.train_minibatches(batches)
    ref, ref_losses = _plain_training(batches, lambda p: torch.optim.SGD(p, lr=0.3))
    assert losses == pytest.approx(ref_losses, abs=1e-6)
    got = pipe.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, atol=1e-6, rtol=1e-6)
    assert pipe.evaluate(_data([2]))["samples"] == 2


def test_fit_streams_an_epoch_through_one_schedule():
    plan = Plan.straight([["input_1", "_0", "_1", "_2"]], schedule="pipedream")
    pipe = Pipeline(_mlp(), plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.5), loss_fn=nn.CrossEntropyLoss())
    loader = _data([8] * 6)
    epochs = pipe.fit(loader, epochs=4)
    assert len(epochs) == 4 and epochs[-1] < epochs[0]
    assert pipe.last_schedule.minibatches == 6 and pipe.weights.version == 24


def test_bad_arguments_give_clear_errors():
    plan1 = Plan.straight([["input_1", "_0", "_1", "_2"]], schedule="flush", microbatches=4)
    with pytest.raises(PipelineError, match="factory"):
        Pipeline(_mlp(), plan1, optimizer=torch.optim.SGD(_mlp().parameters(), lr=0.1), loss_fn=nn.MSELoss())
    with pytest.raises(PipelineError, match="loss_reduction"):
        Pipeline(_mlp(), plan1, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.MSELoss(),
                 loss_reduction="avg")
    pipe = Pipeline(_mlp(), plan1, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.CrossEntropyLoss())
    with pytest.raises(PipelineError, match=r"expected \(inputs, targets\)"):
        pipe.train_step((torch.zeros(4, 4),))
    plan2 = Plan.straight([["input_1", "_0"], ["_1", "_2"]])
    with pytest.raises(PipelineError, match="torchrun --nproc-per-node 2"):
        Pipeline(_mlp(), plan2, optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.CrossEntropyLoss())


# --------------------------------------------------------------------------- profiler + planner
@pytest.mark.parametrize("name", ["cnn", "resnet", "transformer"])
def test_profiled_and_planned_models_split_exactly(name):
    """The plan's layer names (from the profiler, cut by the planner) split the model into
    stages that compose back to it, with the original state-dict keys."""
    from torchpipedream.models import get_model, loss_fn, sample_input
    from torchpipedream.search.planner import plan as make_plan
    from torchpipedream.model.profiler import profile
    from torchpipedream.plans.topology import Topology

    torch.manual_seed(0)
    model = get_model(name)
    x, y = sample_input(name, 2)
    graph = profile(model, x, loss_fn(name), y, warmup=0, iters=1)
    for n in (2, 4):
        plan = make_plan(graph, Topology.local(n), straight=True, num_stages=n)
        stages = split_stages(model, plan).modules
        with torch.no_grad():
            torch.testing.assert_close(run_stages(stages, x), model(x))
        assert sorted(k for st in stages for k in st.state_dict()) == sorted(model.state_dict())


def test_tied_weights_within_a_stage_get_the_summed_gradient():
    """A parameter used by two modules of one stage (tied) is swapped in both slots."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.b.weight = self.a.weight
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.b(torch.tanh(self.a(x))))

    torch.manual_seed(0)
    batches = [(torch.randn(6, 4), torch.randint(0, 2, (6,))) for _ in range(3)]
    plan = Plan.straight([["x", "a", "tanh", "b", "head"]], schedule="pipedream")
    torch.manual_seed(1)
    pipe = Pipeline(Tied(), plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.5), loss_fn=nn.CrossEntropyLoss())
    pipe.train_minibatches(batches)
    torch.manual_seed(1)
    ref = Tied()
    opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for x, y in batches:
        opt.zero_grad()
        nn.functional.cross_entropy(ref(x), y).backward()
        opt.step()
    got = pipe.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v)
    assert isinstance(pipe.module.get_submodule("a").weight, nn.Parameter)  # masters restored


def test_a_deferred_update_waits_for_its_weights_first_use():
    """WeightVersions.defer sets an update aside: the factor (clipping's norm, a collective
    wait) is asked for only when a newer version is needed, and the result equals the step
    taken at once; the next update's gradient accumulates meanwhile, apart."""
    from torchpipedream.runtime.weights import WeightVersions

    def run(deferred: bool) -> tuple[dict[str, torch.Tensor], list[str]]:
        torch.manual_seed(0)
        module = nn.Linear(3, 2)
        weights = WeightVersions(module, lambda named: torch.optim.SGD(named, lr=0.5))
        weights.expect({0: 2, 1: 2})
        asked: list[str] = []
        x = torch.randn(4, 3)
        for version in (0, 1):
            params = weights.tensors(version)
            asked.append(f"F{version}")
            out = torch.func.functional_call(module, params, (x * (version + 1),))
            torch.autograd.backward(out.sum(), inputs=list(params.values()))
            weights.add_samples(4)
            weights.release(version)
            weights.release(version)
            if deferred:
                weights.defer(lambda v=version: asked.append(f"factor{v}") or 0.5)
                assert weights.version == version and weights.next_version == version + 1
            else:
                weights.step(unscale=0.5)
        weights.apply_deferred()
        return {k: v.detach().clone() for k, v in module.state_dict().items()}, asked

    now, _ = run(deferred=False)
    later, asked = run(deferred=True)
    assert asked == ["F0", "factor0", "F1", "factor1"]  # update 0 applied when version 1 was asked for
    for key in now:
        torch.testing.assert_close(later[key], now[key], atol=0, rtol=0)
