"""Activation recomputation (``Stage.recompute``): same numbers, fewer bytes kept, costs charged.

The multi-process parity of every schedule kind with recomputation against the independent
references is in test_runtime_parity.py (``test_recomputation_follows_the_same_rule``); here:
BatchNorm statistics and dropout masks in one process, what the forward keeps, the plan's
field, the planner's and simulator's charge, and the ``train --recompute`` option.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from torchpipedream.plans.plan import Plan, PlanError
from torchpipedream.runtime import Pipeline
from torchpipedream.runtime.pipeline import PipelineError

LR = 0.1


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def drop_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Dropout(0.5), nn.Linear(32, 32), nn.Tanh(),
                         nn.Dropout(0.3), nn.Linear(32, 3))


def batches(n: int, size: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(4)
    return [(torch.randn(size, 6, generator=g), torch.randint(0, 3, (size,), generator=g)) for _ in range(n)]


def one_stage(model: nn.Module, kind: str, m: int) -> Plan:
    from torchpipedream.model.profiler import profile

    x, y = batches(1)[0]
    graph = profile(model, x, loss_fn=nn.CrossEntropyLoss(), target=y, warmup=0, iters=1)
    return Plan.straight([graph.names], schedule=kind, microbatches=m)


def train(make: type | object, kind: str, m: int, recompute: bool, n: int = 4) -> Pipeline:
    plan = one_stage(make(), kind, m)
    pipe = Pipeline(make(), plan, optimizer=lambda p: torch.optim.SGD(p, lr=LR), loss_fn=nn.CrossEntropyLoss(),
                    microbatches=m, seed=11, recompute=recompute)
    pipe.train_minibatches(batches(n))
    return pipe


def test_batchnorm_statistics_move_once_per_microbatch_with_recomputation() -> None:
    """Flush with 4 microbatches and recomputation = plain gradient accumulation over the same
    microbatches, each forward once: weights, running mean/var and the batch count."""
    pipe = train(bn_model, "flush", 4, recompute=True)
    ref = bn_model()
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for x, y in batches(4):
        opt.zero_grad()
        for xs, ys in zip(x.chunk(4), y.chunk(4)):
            (nn.functional.cross_entropy(ref(xs), ys) * len(ys) / len(y)).backward()
        opt.step()
    got = pipe.state_dict()
    want = ref.state_dict()
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k].to(want[k].dtype), want[k], atol=1e-6, rtol=1e-5, msg=k)
    assert int(got["1.num_batches_tracked"]) == 16  # 4 minibatches × 4 microbatches, not twice that


@pytest.mark.parametrize("kind, m", [("pipedream", 1), ("flush", 4), ("2bw", 2)])
def test_dropout_masks_of_the_recomputed_forward_are_the_original_ones(kind: str, m: int) -> None:
    """With dropout, a recomputed forward that drew other masks would differentiate another
    function than the one whose loss was reported: the weights would differ."""
    plain = train(drop_model, kind, m, recompute=False)
    again = train(drop_model, kind, m, recompute=True)
    assert plain.history and list(plain.history) == list(again.history)
    a, b = plain.state_dict(), again.state_dict()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert any(not torch.equal(a[k], v) for k, v in drop_model().state_dict().items())  # it trained


def test_a_recomputing_forward_keeps_only_its_inputs_for_the_backward() -> None:
    """Bytes that autograd packs for the backward outside the checkpoint: the whole graph's
    activations without recomputation, none of the stage's intermediates with it."""
    def packed_bytes(recompute: bool) -> int:
        total = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            total[0] += t.numel() * t.element_size()
            return t

        plan = one_stage(drop_model(), "flush", 2)
        pipe = Pipeline(drop_model(), plan, optimizer=lambda p: torch.optim.SGD(p, lr=LR),
                        loss_fn=nn.CrossEntropyLoss(), microbatches=2, recompute=recompute)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            pipe.train_minibatches(batches(1, size=64))
        return total[0]

    without, with_ = packed_bytes(False), packed_bytes(True)
    assert without > 64 * 32 * 4 * 2  # at least two 64×32 float activations were kept
    assert with_ < without / 4, (with_, without)


def test_the_recompute_option_is_checked_and_names_the_stage() -> None:
    plan = one_stage(bn_model(), "flush", 2)
    with pytest.raises(PipelineError, match=r"recompute: 3 is not a stage of this plan \(0..0\)"):
        Pipeline(bn_model(), plan, optimizer=lambda p: torch.optim.SGD(p, lr=LR), loss_fn=nn.CrossEntropyLoss(),
                 recompute=[3])
    assert plan.with_recompute([0]).stages[0].recompute and not plan.stages[0].recompute  # a copy


def test_plan_files_carry_recompute_and_older_files_load_without_it(tmp_path: Path) -> None:
    plan = Plan.straight([["a"], ["b", "c"]]).with_recompute([1])
    plan.save(tmp_path / "p.json")
    again = Plan.load(tmp_path / "p.json")
    assert [st.recompute for st in again.stages] == [False, True]
    assert "b..c recomputed (2)" in again.table()
    data = json.loads((tmp_path / "p.json").read_text())
    for st in data["stages"]:
        del st["recompute"]  # a plan written before the field existed
    assert [st.recompute for st in Plan.from_dict(data).stages] == [False, False]
    data["stages"][0]["recompute"] = "yes"
    with pytest.raises(PlanError, match="stage 0: recompute must be true or false, got 'yes'"):
        Plan.from_dict(data)


def test_planner_and_simulator_charge_the_second_forward() -> None:
    from torchpipedream.search.planner import plan as make_plan
    from torchpipedream.model.profiles import load_profile
    from torchpipedream.schedule.build import build_schedule
    from torchpipedream.sim.simulator import Costs, simulate

    graph = load_profile("vgg16")
    base = make_plan(graph, "4:10GB/s", schedule="flush", microbatches=4, straight=True)
    rec = make_plan(graph, "4:10GB/s", schedule="flush", microbatches=4, straight=True, recompute=True)
    assert all(st.recompute for st in rec.stages) and not any(st.recompute for st in base.stages)
    assert rec.meta["planner"]["recompute"] is True
    # Stage.backward_ms is the backward alone; the simulator adds the stage's forward to it.
    same_cut = base.with_recompute(True)
    costs, plain = Costs.from_plan(same_cut, microbatches=4), Costs.from_plan(base, microbatches=4)
    for s, st in enumerate(base.stages):
        assert costs.backward_s[s] == pytest.approx(plain.backward_s[s] + st.forward_ms / 1e3 / 4)
    times = [simulate(build_schedule(p, "flush", minibatches=4, microbatches=4), Costs.from_plan(p, microbatches=4))
             .makespan_s for p in (base, same_cut)]
    assert times[1] > times[0] * 1.1
    # The planner's own prediction includes it too, and is no better than the plan without.
    assert rec.predicted["time_per_minibatch_s"] > base.predicted["time_per_minibatch_s"]
    with pytest.raises(PlanError, match="recompute must be True or False"):
        make_plan(graph, "4:10GB/s", recompute="all")


def test_train_with_recompute_ends_with_the_same_weights(tmp_path: Path) -> None:
    """`train --recompute` on 2 workers (pipedream, dropout-free MLP) on the plan of a run
    without it: the plan file says so, and the final weights equal that run's."""
    from torchpipedream.cli import main

    common = ["train", "--model", "mlp", "--workers", "2", "--no-progress", "--epochs", "1", "--max-minibatches", "6",
              "--timeout", "60"]
    assert main([*common, "--stages", "2", "--straight", "--out", str(tmp_path / "plain")]) == 0
    assert main([*common, "--plan", str(tmp_path / "plain" / "plan.json"), "--recompute",
                 "--out", str(tmp_path / "rec")]) == 0
    report = json.loads((tmp_path / "rec" / "report.json").read_text())
    assert report["config"]["recompute"] is True
    assert [st.recompute for st in Plan.load(tmp_path / "rec" / "plan.json").stages] == [True, True]
    a = torch.load(tmp_path / "plain" / "checkpoint.pt", weights_only=True)
    b = torch.load(tmp_path / "rec" / "checkpoint.pt", weights_only=True)
    a, b = a["state_dict"], b["state_dict"]
    assert sorted(a) == sorted(b) and a
    for k in a:
        assert torch.equal(a[k], b[k]), k
