"""Tests for torchpipedream.model.profiler: names, edges, bytes, timing attribution, fallbacks."""

from __future__ import annotations

import statistics
import time

import pytest
import torch
import torch.fx
from torch import nn

from torchpipedream.model.graph import LayerGraph
from torchpipedream.models import cnn, cross_entropy, get_model, mlp, resnet, sample_input, transformer
from torchpipedream.model.profiler import ProfilerError, profile


pytestmark = pytest.mark.usefixtures("one_thread")


def _kept_fx_nodes(model: nn.Module) -> list[torch.fx.Node]:
    gm = torch.fx.symbolic_trace(model)
    return [n for n in gm.graph.nodes if n.op not in ("output", "get_attr")]


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# ----------------------------------------------------------------------- structure
def test_layer_names_and_edges_follow_the_fx_graph():
    torch.manual_seed(0)
    model = resnet()
    x, _ = sample_input("resnet", 8)
    g = profile(model, x, warmup=0, iters=1)
    nodes = _kept_fx_nodes(model)
    assert g.names == [n.name for n in nodes]
    kept = {n.name for n in nodes}
    expected = {(i.name, n.name) for n in nodes for i in n.all_input_nodes if i.name in kept}
    assert set(g.edges) == expected
    assert g.meta["split"] == "fx"


def test_resnet_graph_is_a_dag_not_a_chain():
    torch.manual_seed(0)
    x, _ = sample_input("resnet", 8)
    g = profile(resnet(), x, warmup=0, iters=1)
    joins = [l.name for l in g.layers if len(g.predecessors(l.name)) >= 2]
    assert joins and all(g[name].kind == "add" for name in joins)
    assert len(g.edges) > len(g.layers) - 1
    assert not g.is_chain


def test_input_layer_batch_size_and_meta():
    torch.manual_seed(0)
    x, _ = sample_input("cnn", 16)
    g = profile(cnn(), x, warmup=0, iters=1, name="cnn")
    inputs = [l for l in g.layers if l.is_input]
    assert len(inputs) == 1
    assert inputs[0].forward_ms == 0.0 and inputs[0].backward_ms == 0.0
    assert inputs[0].activation_bytes == x.numel() * 4
    assert inputs[0].output_shapes == [[16, 1, 8, 8]]
    assert g.batch_size == 16
    assert g.meta["model"] == "cnn" and g.meta["device"] == "cpu"
    assert g.meta["torch"] == torch.__version__ and g.meta["threads"] == 1


# ---------------------------------------------------------------------------- bytes
@pytest.mark.parametrize("name", ["mlp", "cnn", "resnet", "transformer"])
def test_parameter_bytes_sum_to_the_models_parameters(name):
    torch.manual_seed(0)
    model = get_model(name)
    x, _ = sample_input(name, 4)
    g = profile(model, x, warmup=0, iters=1)
    assert g.totals()["parameter_bytes"] == _param_bytes(model)


def test_shared_parameters_are_counted_once():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            return self.lin(torch.relu(self.lin(x)))

    model = Tied()
    g = profile(model, torch.randn(4, 8), warmup=0, iters=1)
    assert g.totals()["parameter_bytes"] == (64 + 8) * 4
    assert g["lin"].parameter_bytes == (64 + 8) * 4 and g["lin_1"].parameter_bytes == 0


def test_activation_bytes_and_shapes_match_forward_hooks():
    torch.manual_seed(0)
    model = cnn()
    x, _ = sample_input("cnn", 32)
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        mod.register_forward_hook(lambda m, i, o, path=path: seen.__setitem__(path, o))
        for path, mod in model.named_modules()
        if path
    ]
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    g = profile(model, x, warmup=0, iters=1)
    call_nodes = [n for n in _kept_fx_nodes(model) if n.op == "call_module"]
    assert len(call_nodes) == len(model)
    for node in call_nodes:
        out = seen[node.target]
        assert g[node.name].activation_bytes == out.numel() * out.element_size()
        assert g[node.name].output_shapes == [list(out.shape)]
        assert g[node.name].output_dtypes == ["float32"]


def test_get_attr_parameters_fold_into_their_user():
    torch.manual_seed(0)
    model = transformer(layers=1)
    x, _ = sample_input("transformer", 2)
    g = profile(model, x, warmup=0, iters=1)
    assert "pos" not in g and "blocks_0_attn_mask" not in g
    users = [l for l in g.layers if l.kind == "Tensor.narrow" and l.parameter_bytes]
    assert [l.parameter_bytes for l in users] == [model.pos.numel() * 4]
    # shape arithmetic (x.shape[1]) is a layer with no tensor output and no backward
    shape_layers = [l for l in g.layers if l.kind in ("getattr", "getitem")]
    assert shape_layers
    assert all(l.activation_bytes == 0 and l.forward_ms == 0 and l.backward_ms == 0 for l in shape_layers)
    merged = {name for block in g.linearize() for name in block.layers[1:]}
    assert {l.name for l in shape_layers} <= merged


# --------------------------------------------------------------------------- timing
def test_summed_layer_forward_is_close_to_the_whole_forward():
    torch.manual_seed(0)
    model = cnn()
    x, _ = sample_input("cnn", 64)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the profiler times with one thread; so does the reference
    try:
        # Up to three attempts, so that a moment of load from another process on this shared
        # machine does not fail the test; a profiler that is consistently off still fails.
        for _ in range(3):
            g = profile(model, x, warmup=3, iters=15)
            with torch.enable_grad():
                for _ in range(3):
                    model(x)
                whole = []
                for _ in range(15):
                    t0 = time.perf_counter()
                    model(x)
                    whole.append((time.perf_counter() - t0) * 1e3)
            ratio = g.totals()["forward_ms"] / statistics.median(whole)
            if 0.3 < ratio < 3.0:
                break
    finally:
        torch.set_num_threads(threads)
    assert 0.3 < ratio < 3.0, ratio
    assert all(l.forward_ms > 0 for l in g.layers if not l.is_input)
    # convolutions and linear layers have a backward; the parameterised ones cost time
    assert all(l.backward_ms > 0 for l in g.layers if l.parameter_bytes)


class _SlowFn(torch.autograd.Function):
    """Identity whose forward sleeps 10 ms and whose backward sleeps 25 ms."""

    @staticmethod
    def forward(ctx, x):
        time.sleep(0.010)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.025)
        return grad


def slow_op(x):
    return _SlowFn.apply(x)


torch.fx.wrap("slow_op")


class _WithSlowOp(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(slow_op(self.a(x)))


def test_forward_and_backward_time_is_charged_to_the_right_layer():
    g = profile(_WithSlowOp(), torch.randn(8, 16), warmup=1, iters=3)
    slow = g["slow_op"]
    assert slow.forward_ms >= 9.0
    assert slow.backward_ms >= 23.0
    for name in ("a", "b"):
        assert g[name].forward_ms < 5.0 and g[name].backward_ms < 5.0


def test_loss_time_is_added_to_the_output_layer():
    def slow_loss(out, target):
        time.sleep(0.015)
        return cross_entropy(out, target)

    torch.manual_seed(0)
    model = mlp()
    x, y = sample_input("mlp", 16)
    plain = profile(model, x, warmup=0, iters=2)
    with_loss = profile(model, x, loss_fn=slow_loss, target=y, warmup=0, iters=2)
    last = plain.names[-1]
    assert with_loss.meta["loss_layer"] == last
    assert plain[last].forward_ms < 10.0
    assert with_loss[last].forward_ms >= 14.0
    assert plain.meta["loss_layer"] is None


# ---------------------------------------------------------------- side effects
def test_profiling_leaves_the_model_and_process_as_it_was():
    torch.manual_seed(0)
    model = resnet()  # BatchNorm: running statistics would change in train mode
    x, _ = sample_input("resnet", 8)
    model.fc.weight.grad = torch.full_like(model.fc.weight, 7.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x_before = x.clone()
    torch.set_num_threads(2)
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    profile(model, x, warmup=1, iters=2)
    assert torch.equal(torch.rand(3), expected_next)
    assert torch.get_num_threads() == 2
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(model.fc.weight.grad, torch.full_like(model.fc.weight, 7.0))
    assert model.stem[0].weight.grad is None
    assert torch.equal(x, x_before)


def test_in_place_operations_are_profiled_without_corrupting_inputs():
    class InPlace(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)
            self.act = nn.ReLU(inplace=True)

        def forward(self, x):
            x = x.mul_(1.5)  # mutates the caller's tensor: profiling must not
            y = self.act(self.lin(x))
            return y.add_(2.0)

    model = InPlace()
    x = torch.randn(4, 8)
    x_before = x.clone()
    expected = model(x.clone())
    g = profile(model, x, loss_fn=lambda out: out.sum(), warmup=1, iters=3)
    assert torch.equal(x, x_before)
    assert torch.allclose(model(x.clone()), expected)
    assert g["lin"].backward_ms > 0 and g["add_"].backward_ms > 0


# ------------------------------------------------------------------- fallbacks
class _DataDependent(nn.Module):
    def forward(self, x):
        if x.sum() > 0:  # fx cannot trace control flow on tensor values
            return x * 2
        return -x


def test_untraceable_sequential_falls_back_to_its_children():
    model = nn.Sequential(nn.Linear(8, 16), _DataDependent(), nn.ReLU(), nn.Linear(16, 4))
    g = profile(model, torch.randn(5, 8), warmup=0, iters=2)
    assert g.meta["split"] == "sequential"
    assert g.names == ["0", "1", "2", "3"]  # the child names the runtime splits by
    assert g.is_chain
    assert not any(l.is_input for l in g.layers)
    assert g.totals()["parameter_bytes"] == _param_bytes(model)
    assert g["3"].output_shapes == [[5, 4]]


def test_a_list_of_modules_is_profiled_as_stages():
    parts = [nn.Linear(8, 16), nn.Linear(16, 2)]
    g = profile(parts, torch.randn(3, 8), warmup=0, iters=1)
    assert g.names == ["0", "1"] and g.meta["split"] == "sequential"


def test_untraceable_module_raises_a_clear_error():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.dd = _DataDependent()

        def forward(self, x):
            return self.dd(self.lin(x))

    with pytest.raises(ProfilerError) as info:
        profile(Net(), torch.randn(2, 4))
    msg = str(info.value)
    assert isinstance(info.value, ValueError)
    assert "neither torch.fx" in msg and "nor torch.export" in msg and "can trace Net" in msg and "nn.Sequential" in msg
    assert "\n" not in msg


def test_a_sample_that_does_not_fit_names_the_layer():
    with pytest.raises(ProfilerError, match=r"layer '_0'.*shape"):
        profile(cnn(), torch.randn(4, 3, 8, 8))
    with pytest.raises(ProfilerError, match="inputs"):
        profile(cnn(), (torch.randn(4, 1, 8, 8), torch.randn(4)))
    with pytest.raises(ProfilerError, match="iters"):
        profile(cnn(), torch.randn(4, 1, 8, 8), iters=0)


def test_a_failing_or_non_scalar_loss_is_a_clear_error():
    x, y = sample_input("mlp", 4)
    with pytest.raises(ProfilerError, match="loss_fn failed"):
        profile(mlp(), x, loss_fn=cross_entropy, target=y[:2], warmup=0, iters=1)
    with pytest.raises(ProfilerError, match="scalar"):
        profile(mlp(), x, loss_fn=lambda out: out, warmup=0, iters=1)


class _NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("this op has no backward")


def no_backward_op(x):
    return _NoBackward.apply(x)


torch.fx.wrap("no_backward_op")


def test_a_failing_backward_names_the_layer():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return no_backward_op(self.lin(x))

    with pytest.raises(ProfilerError, match="backward of layer 'no_backward_op'.*no backward"):
        profile(Net(), torch.randn(2, 4), warmup=0, iters=1)


def test_graph_round_trips_through_json(tmp_path):
    torch.manual_seed(0)
    x, _ = sample_input("resnet", 4)
    g = profile(resnet(), x, warmup=0, iters=1)
    g.save(tmp_path / "g.json")
    assert LayerGraph.load(tmp_path / "g.json") == g


def test_optimizer_step_is_timed_per_layer_on_copies():
    torch.manual_seed(0)
    model = cnn()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x, y = sample_input("cnn", 8)
    g = profile(model, x, loss_fn=cross_entropy, target=y, warmup=1, iters=3,
                optimizer=lambda params: torch.optim.Adam(params, lr=0.1))
    with_params = [l for l in g.layers if l.parameter_bytes]
    assert with_params and all(l.optimizer_ms > 0 for l in with_params)
    assert all(l.optimizer_ms == 0 for l in g.layers if not l.parameter_bytes)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # a big lr would show
    # the planner's unit of work includes the step; without an optimizer nothing is charged
    assert g.totals()["compute_ms"] == pytest.approx(
        g.totals()["forward_ms"] + g.totals()["backward_ms"] + g.totals()["optimizer_ms"])
    assert profile(model, x, warmup=0, iters=1).totals()["optimizer_ms"] == 0


def test_microbatches_profile_one_microbatch_times_their_number():
    # slow_op costs a fixed 10 ms forward / 25 ms backward per call, whatever the batch: each
    # of 4 microbatches pays it, so the minibatch costs ~4x what one call of 8 samples does
    x = torch.randn(8, 16)
    whole = profile(_WithSlowOp(), x, warmup=0, iters=2)
    split = profile(_WithSlowOp(), x, warmup=0, iters=2, microbatches=4)
    assert split["slow_op"].output_shapes == [[2, 16]]  # ran on one microbatch of 8/4 samples
    assert split["slow_op"].forward_ms >= 4 * 9.0 and split["slow_op"].backward_ms >= 4 * 23.0
    assert whole["slow_op"].forward_ms < 2 * 10.0
    # the graph still describes one minibatch: its batch size and activation bytes
    assert split.batch_size == 8 and split.meta["microbatches"] == 4
    assert split["a"].activation_bytes == whole["a"].activation_bytes == 8 * 16 * 4
    # an uneven split profiles the largest microbatch; too few samples is a clear error
    uneven = profile(_WithSlowOp(), torch.randn(10, 16), warmup=0, iters=1, microbatches=4)
    assert uneven["slow_op"].output_shapes == [[3, 16]]
    with pytest.raises(ProfilerError, match="cannot be split into 4 microbatches"):
        profile(_WithSlowOp(), torch.randn(2, 16), warmup=0, iters=1, microbatches=4)


#: The fixed cost of _FixedCostSGD's step: large beside a loaded machine's scheduling delays, so
#: that once per update (50 ms) and once per layer (150 ms) stay apart however busy it is.
FIXED_STEP_S = 0.05


class _FixedCostSGD(torch.optim.SGD):
    """SGD whose step costs a fixed FIXED_STEP_S per call, however many parameters it updates."""

    def step(self, closure=None):
        time.sleep(FIXED_STEP_S)
        return super().step(closure)


def test_optimizer_time_counts_the_fixed_cost_of_a_step_once_per_update():
    # 3 layers with weights: timed one by one, each step pays the fixed cost; a stage (or the
    # whole model) pays it once per update, and the per-layer shares must add up to that.
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    g = profile(model, torch.randn(4, 8), warmup=1, iters=3, optimizer=lambda ps: _FixedCostSGD(ps, lr=0.1))
    total = g.totals()["optimizer_ms"]
    fixed_ms = FIXED_STEP_S * 1000
    assert fixed_ms <= total < 2 * fixed_ms  # 3 × fixed_ms if counted once per layer
    assert all(l.optimizer_ms > 0 for l in g.layers if l.parameter_bytes)
