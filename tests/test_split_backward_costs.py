"""The split backward's cost, from the profile to the choice: each layer's B and W are timed as
the runtime splits them, summed per stage, charged by the simulator, and the zero-bubble kinds
join ``schedule="auto"`` only where they were timed."""

from __future__ import annotations

import time

import pytest
import torch
import torch.fx
from torch import nn

from torchpipedream.search.auto import choose_schedule
from torchpipedream.model.graph import Layer, LayerGraph
from torchpipedream.search.planner import plan as make_plan
from torchpipedream.plans.plan import Plan, PlanError
from torchpipedream.model.profiler import profile
from torchpipedream.schedule.build import build_schedule
from torchpipedream.sim.simulator import WEIGHT_GRAD_SHARE, Costs, simulate


pytestmark = pytest.mark.usefixtures("one_thread")


class _SlowIdentity(torch.autograd.Function):
    """Identity whose backward sleeps 20 ms."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.020)
        return grad


def slow_input_path(x, w):
    """x @ w with the slow backward on the input's path: B pays it."""
    return _SlowIdentity.apply(x) @ w


def slow_weight_path(x, b):
    """x + b with the slow backward on the weight's path: W pays it."""
    return x + _SlowIdentity.apply(b)


torch.fx.wrap("slow_input_path")
torch.fx.wrap("slow_weight_path")


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.w = nn.Parameter(torch.randn(16, 16) / 4)
        self.bias = nn.Parameter(torch.zeros(16))
        self.b = nn.Linear(16, 4)

    def forward(self, x):
        return self.b(slow_weight_path(slow_input_path(self.a(x), self.w), self.bias))


def test_the_profile_times_each_layers_split_backward_as_the_runtime_runs_it(tmp_path) -> None:
    g = profile(_Net(), torch.randn(8, 16), warmup=1, iters=3)
    # one backward each; split, B pays the sleep on the input's path and W the one on the weight's
    into, onto = g["slow_input_path"], g["slow_weight_path"]
    assert into.backward_ms >= 18.0 and onto.backward_ms >= 18.0
    assert into.input_grad_ms >= 18.0 and into.weight_grad_ms < 5.0
    assert onto.input_grad_ms < 5.0 and onto.weight_grad_ms >= 18.0
    for name in ("a", "b"):
        assert 0.0 <= g[name].input_grad_ms < 5.0 and 0.0 < g[name].weight_grad_ms < 5.0
    g.save(tmp_path / "g.json")
    assert LayerGraph.load(tmp_path / "g.json")["slow_weight_path"].weight_grad_ms == onto.weight_grad_ms
    unsplit = profile(_Net(), torch.randn(8, 16), warmup=0, iters=1, split_backward=False)
    assert all(l.input_grad_ms is None and l.weight_grad_ms is None for l in unsplit.layers)
    unsplit.save(tmp_path / "u.json")
    assert "grad_ms" not in (tmp_path / "u.json").read_text()  # files as before the split was timed
    # microbatches: one microbatch timed, the graph describes the minibatch
    four = profile(_Net(), torch.randn(8, 16), warmup=0, iters=1, microbatches=4)
    assert four["slow_weight_path"].weight_grad_ms >= 4 * 18.0


def _chain(split: tuple[float, float] | None, layers: int = 4) -> LayerGraph:
    """A balanced chain of layers (1 ms forward, 2 ms backward) whose split backward costs
    ``split`` = (B, W) ms per layer, or was not timed (None)."""
    names = [f"l{i}" for i in range(layers)]
    made = [Layer(n, forward_ms=1.0, backward_ms=2.0, activation_bytes=1 << 10, parameter_bytes=1 << 10,
                  input_grad_ms=None if split is None else split[0],
                  weight_grad_ms=None if split is None else split[1]) for n in names]
    return LayerGraph(made, list(zip(names, names[1:])), batch_size=8)


def test_stages_sum_their_layers_split_and_the_simulator_charges_it(tmp_path) -> None:
    g = _chain((1.5, 1.5))
    assert [b.weight_grad_ms for b in g.linearize()] == [1.5] * 4
    p = make_plan(g, "2:10GB/s", schedule="zb-h1", microbatches=2, straight=True)
    assert [(st.input_grad_ms, st.weight_grad_ms) for st in p.stages] == [(3.0, 3.0), (3.0, 3.0)]
    p.save(tmp_path / "p.json")
    assert Plan.load(tmp_path / "p.json").stages[1].weight_grad_ms == 3.0
    costs = Costs.from_plan(p, microbatches=2)
    # the second stage: B + W as timed; the first stage's W is one backward over its weights
    assert costs.backward_s[1] == pytest.approx(6.0 / 1e3 / 2) and costs.weight_grad_s[1] == pytest.approx(3.0 / 1e3 / 2)
    assert costs.backward_s[0] == pytest.approx(4.0 / 1e3 / 2) and costs.weight_grad_s[0] == pytest.approx(4.0 / 1e3 / 2)
    # unsplit kinds charge the unsplit backward; an untimed split falls back on the assumed share
    flush = make_plan(g, "2:10GB/s", schedule="flush", microbatches=2, straight=True)
    assert Costs.from_plan(flush, 2).backward_s[1] == pytest.approx(4.0 / 1e3 / 2)
    untimed = Costs.from_plan(make_plan(_chain(None), "2:10GB/s", schedule="zb-h1", microbatches=2, straight=True), 2)
    assert untimed.weight_grad_s[1] == pytest.approx(WEIGHT_GRAD_SHARE * 4.0 / 1e3 / 2)

    def makespan(graph: LayerGraph) -> float:
        q = make_plan(graph, "2:10GB/s", schedule="zb-h1", microbatches=2, straight=True)
        return simulate(build_schedule(q, "zb-h1", minibatches=8, microbatches=2), Costs.from_plan(q, 2)).makespan_s

    # a split that costs 1.5x the backward predicts a slower run than one that costs what it does
    assert makespan(_chain((1.0, 1.0))) == pytest.approx(makespan(_chain(None)))
    assert makespan(_chain((1.5, 1.5))) > 1.15 * makespan(_chain((1.0, 1.0)))


def test_auto_tries_the_zero_bubble_kinds_only_where_their_split_was_timed() -> None:
    def kinds(graph: LayerGraph) -> set[str]:
        chosen = choose_schedule(graph, "2:10GB/s", microbatches=(1, 2), straight=True)
        return {c["schedule"] for c in chosen.meta["auto"]["candidates"]}

    assert kinds(_chain(None)) == {"flush", "gpipe", "interleaved"}
    only_one_stage_per_worker = choose_schedule(_chain((1.0, 1.0)), "2:10GB/s", microbatches=(1, 2), straight=True,
                                                virtual_stages=False)
    assert {c["schedule"] for c in only_one_stage_per_worker.meta["auto"]["candidates"]} == {
        "flush", "gpipe", "zb-h1", "zb-h2"}
    assert kinds(_chain((1.0, 1.0))) == {"flush", "gpipe", "zb-h1", "zb-h2", "interleaved", "zb-v"}
    # splitting for free, a zero-bubble kind fills the flush's bubble and is chosen; at twice the
    # backward it is not
    assert choose_schedule(_chain((1.0, 1.0)), "2:10GB/s", microbatches=(1, 2), straight=True).schedule in ("zb-h1", "zb-h2", "zb-v")
    assert choose_schedule(_chain((2.0, 2.0)), "2:10GB/s", microbatches=(1, 2),
                           straight=True).schedule in ("flush", "gpipe", "interleaved")


def test_a_virtual_kind_names_num_stages_it_cannot_plan() -> None:
    with pytest.raises(PlanError, match="num_stages=3: interleaved plans 2 stages on each of the 2 workers"):
        make_plan(_chain(None, 8), "2:10GB/s", schedule="interleaved", microbatches=2, num_stages=3)
    assert make_plan(_chain(None, 8), "2:10GB/s", schedule="interleaved", microbatches=2, num_stages=4).num_stages == 4
