"""torch.distributed.pipelining's schedules in and out (torchpipedream/torch_interop.py).

torch's own schedule classes (the installed torch) generate their action lists; those import,
validate and simulate here, and the ones that split the backward run on our runtime; our
schedules export as torch's CSV, which torch's own loader lowers and its runtime trains one
step with. Every trained result is checked against plain PyTorch training written here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.pipelining import schedules as torch_schedules

from torchpipedream.actions import Kind
from torchpipedream.plans import Plan, Stage
from torchpipedream.runtime import Pipeline, launch
from torchpipedream.schedules import build_schedule
from torchpipedream.simulator import Costs, simulate
from torchpipedream.torch_interop import (TorchScheduleError, from_torch, parse_torch_action, read_torch_csv,
                                          to_torch, write_torch_csv)
from torchpipedream.validate import ScheduleError, validate_schedule


class MockStage:
    """What torch's schedule classes read from a stage to compute their action lists (no
    process group: the order is computed for every rank from these numbers)."""

    def __init__(self, index: int, stages: int, ranks: int) -> None:
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, stages, ranks, 0
        self.is_first, self.is_last = index == 0, index == stages - 1
        self.submod = nn.Linear(2, 2)


def torch_order(name: str, n: int, m: int) -> dict:
    """The action lists torch's schedule class ``name`` generates for ``n`` ranks, ``m`` microbatches."""
    cls = torch_schedules.get_schedule_class(name)
    loss = nn.functional.mse_loss
    if issubclass(cls, torch_schedules.PipelineScheduleMulti):
        ids = [0, 2 * n - 1] if name in ("ZBVZeroBubble", "DualPipeV") else [0]
        stages = [MockStage(i, len(ids) * n, n) for i in ids]
        return cls(stages, n_microbatches=m, loss_fn=loss).pipeline_order
    return cls(MockStage(0, n, n), n_microbatches=m, loss_fn=loss).pipeline_order


def compute_cells(order: dict) -> dict[int, list[str]]:
    """torch's compute actions per rank, as text, without idle steps and REDUCE_GRAD."""
    return {r: [str(a) for a in acts if a is not None and a.computation_type.value in ("F", "B", "I", "W")]
            for r, acts in order.items()}


@pytest.mark.parametrize("n, m", [(2, 4), (4, 8), (4, 4)])
@pytest.mark.parametrize("name, kind", [("GPipe", "gpipe"), ("LoopedBFS", "gpipe"), ("Interleaved1F1B", "flush"),
                                        ("InterleavedZeroBubble", "zb-h1")])
def test_torchs_generated_schedules_import_validate_and_simulate(name: str, kind: str, n: int, m: int) -> None:
    order = torch_order(name, n, m)
    sched = from_torch(order, minibatches=3)
    assert sched.kind == kind and sched.microbatches == m and sched.minibatches == 3
    validate_schedule(sched)
    # batch 0 runs exactly torch's compute actions in torch's order; the others repeat it
    assert to_torch(sched, batch=0) == compute_cells(order)
    assert to_torch(sched, batch=2) == compute_cells(order)
    res = simulate(sched, Costs(forward_s=[1.0] * n, backward_s=[2.0] * n, weight_grad_s=[1.0] * n))
    assert res.makespan_s > 0


@pytest.mark.parametrize("n, m", [(2, 4), (4, 8), (3, 6)])
def test_torchs_zb1p_has_the_bubble_of_our_zb_h1(n: int, m: int) -> None:
    """torch's InterleavedZeroBubble with one stage per rank is ZB-H1 (its docstring: ZB1P):
    on equal stages its batch takes what ours takes, a third of 1F1B's bubble."""
    costs = Costs(forward_s=[1.0] * n, backward_s=[2.0] * n, weight_grad_s=[1.0] * n)
    theirs = simulate(from_torch(torch_order("InterleavedZeroBubble", n, m)), costs).makespan_s
    ours = simulate(build_schedule(Plan.straight([[f"stage{s}"] for s in range(n)]), "zb-h1", minibatches=1,
                                   microbatches=m), costs).makespan_s
    assert theirs == pytest.approx(ours) == pytest.approx(3 * m + (n - 1))


@pytest.mark.parametrize("n, m", [(2, 4), (4, 8)])
def test_torchs_1f1b_order_is_checked_like_any_other(n: int, m: int) -> None:
    """Schedule1F1B's action list (torch builds it for its visualiser and runtime IR) is held to the
    same rules: when some rank does not forward microbatches 0..m-1 exactly once, the validator
    names that rank; otherwise it passes."""
    order = torch_order("1F1B", n, m)
    forwards = {r: sorted(a.microbatch_index for a in acts if a is not None and str(a).endswith(
        f"F{a.microbatch_index}")) for r, acts in order.items()}
    consistent = all(f == list(range(m)) for f in forwards.values())
    try:
        sched = from_torch(order, microbatches=m)
    except TorchScheduleError as exc:  # an I/W mismatch would be reported here
        pytest.fail(str(exc))
    if consistent:
        validate_schedule(sched)
    else:
        bad = next(r for r, f in forwards.items() if f != list(range(m)))
        with pytest.raises(ScheduleError, match=f"rank {bad}"):
            validate_schedule(sched)


@pytest.mark.parametrize("name", ["ZBVZeroBubble", "DualPipeV"])
def test_several_stages_per_rank_are_refused_by_name(name: str) -> None:
    with pytest.raises(TorchScheduleError, match=r"rank 0 runs stages \[0, 3\]: several stages per rank"):
        from_torch(torch_order(name, 2, 4))


@pytest.mark.parametrize("kind, m", [("flush", 4), ("gpipe", 3), ("zb-h1", 4)])
def test_ours_round_trip_through_torchs_text(kind: str, m: int, tmp_path: Path) -> None:
    plan = Plan.straight([["a"], ["b"], ["c"]], schedule=kind, microbatches=m)
    ours = build_schedule(plan, kind, minibatches=3, microbatches=m)
    again = from_torch(to_torch(ours), plan=plan, minibatches=3, kind=kind)
    assert again.actions == ours.actions
    path = write_torch_csv(ours, tmp_path / "sched.csv")
    assert path.read_text().splitlines()[0].split(",")[:2] == to_torch(ours)[0][:2]
    assert read_torch_csv(path, plan=plan, minibatches=3).actions == ours.actions
    if kind == "zb-h1":
        assert any(c[1] == "I" for c in to_torch(ours)[1]) and any(c[1] == "W" for c in to_torch(ours)[1])


def test_what_torch_cannot_run_is_refused_and_bad_text_named(tmp_path: Path) -> None:
    plan = Plan.straight([["a"], ["b"]], schedule="pipedream")
    with pytest.raises(TorchScheduleError, match="pipedream overlaps its batches"):
        to_torch(build_schedule(plan, "pipedream", minibatches=4))
    replicated = Plan(stages=[Stage(["a"], 2, [0, 1]), Stage(["b"], 1, [2])], schedule="flush", microbatches=2)
    with pytest.raises(TorchScheduleError, match="replicates a stage"):
        to_torch(build_schedule(replicated, "flush", minibatches=1))
    with pytest.raises(TorchScheduleError, match="cannot read torch action '0X1'"):
        parse_torch_action("0X1")
    assert parse_torch_action("(0F3;3B1)OVERLAP_F_B") == [(0, "F", 3), (3, "B", 1)]
    with pytest.raises(TorchScheduleError, match="microbatch 1 has an I .* without its W"):
        from_torch({0: ["0F0", "0F1", "0I0", "0W0", "0I1"]})
    bad = tmp_path / "bad.csv"
    bad.write_text("0F0,0F1,0B0,0B1\n1F0,1Z0\n")
    with pytest.raises(TorchScheduleError, match="bad.csv: cannot read torch action '1Z0'"):
        read_torch_csv(bad)
    # transfers, FSDP and REDUCE_GRAD cells are read past; the compute is what counts
    sched = from_torch({0: ["0F0", "0SEND_F0", "0RECV_B0", "0B0", "0REDUCE_GRAD"],
                        1: ["1RECV_F0", "1F0", "1B0", "1SEND_B0", ""]})
    validate_schedule(sched)
    assert [a.kind for a in sched.actions[1]][:2] == [Kind.RECV_ACT, Kind.FORWARD]


# --------------------------------------------------------------------------- running them
LR, M, BATCHES = 0.1, 4, 2


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(BATCHES)]


def reference() -> dict[str, torch.Tensor]:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in data():
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


CUT = [["input_1", "_0", "_1", "_2"], ["_3", "_4"]]


def ours_worker(rank: int) -> dict:
    """torch's InterleavedZeroBubble order on our runtime (Pipeline.use_schedule)."""
    torch.set_num_threads(1)
    out: dict = {}
    plan = Plan.straight(CUT, schedule="zb-h1", microbatches=M)
    pipe = Pipeline(mlp(), plan, optimizer=lambda p: torch.optim.SGD(p, lr=LR), loss_fn=nn.CrossEntropyLoss(),
                    microbatches=M, timeout_s=60)
    theirs = from_torch(torch_order("InterleavedZeroBubble", 2, M), plan=pipe.plan, minibatches=BATCHES)
    refused = []
    for wrong in (from_torch(torch_order("InterleavedZeroBubble", 2, 2 * M), plan=pipe.plan, minibatches=BATCHES),
                  from_torch(torch_order("InterleavedZeroBubble", 3, M), minibatches=BATCHES)):
        try:
            pipe.use_schedule(wrong)
        except Exception as exc:  # noqa: BLE001 - the message is what the test reads
            refused.append(f"{type(exc).__name__}: {exc}")
    out["refused"] = refused
    pipe.use_schedule(theirs)
    pipe.train_minibatches(data())
    out["state"] = pipe.state_dict(dst=0)
    trace = pipe.trace(dst=0)  # every rank takes part; rank 0 gets the events
    out["events"] = [(e.rank, e.kind, e.id) for e in trace.events] if trace is not None else None
    return out


def torch_worker(rank: int, csv_path: str) -> dict:
    """Our zb-h1, exported as torch's CSV, on torch's runtime (PipelineStage +
    _PipelineScheduleRuntime._load_csv, its compute-only loader, which adds the transfers)."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    torch.set_num_threads(1)
    model = mlp()
    piece = nn.Sequential(*list(model.children())[:3]) if rank == 0 else nn.Sequential(*list(model.children())[3:])
    stage = PipelineStage(piece, rank, 2, torch.device("cpu"))
    sched = torch_schedules._PipelineScheduleRuntime([stage], n_microbatches=M, loss_fn=nn.functional.cross_entropy)
    sched._load_csv(csv_path)
    opt = torch.optim.SGD(piece.parameters(), lr=LR)
    for x, y in data():
        opt.zero_grad()
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=y)
        opt.step()
    state = [None, None]
    dist.all_gather_object(state, {k: v.detach() for k, v in piece.state_dict().items()})
    return {"state": state}


def test_our_runtime_trains_torchs_zb1p_exactly() -> None:
    results = launch(ours_worker, 2, timeout_s=240, comm_timeout_s=60, return_all=True)
    want = reference()
    got = results[0]["state"]
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-5, msg=f"ours running torch's: {k}")
    assert {kind for _, kind, _ in results[0]["events"]} >= {"F", "B", "W"}
    refused = results[0]["refused"]
    assert len(refused) == 2 and all(r.startswith("PipelineError") for r in refused), refused
    assert "8 microbatches" in refused[0] and "in 4" in refused[0]
    assert "(3 stages" in refused[1] and "runs 1-1 (2 stages" in refused[1]


def test_torchs_runtime_trains_our_exported_zb_h1_exactly(tmp_path: Path) -> None:
    plan = Plan.straight(CUT, schedule="zb-h1", microbatches=M)
    path = write_torch_csv(build_schedule(plan, "zb-h1", minibatches=1, microbatches=M), tmp_path / "zb.csv")
    first, second = launch(torch_worker, 2, str(path), timeout_s=240, comm_timeout_s=60)["state"]
    want = reference()
    for k, v in first.items():  # stage 0 holds children 0..2 under their own names
        torch.testing.assert_close(v, want[k], atol=1e-5, rtol=1e-5, msg=f"torch running ours: {k}")
    for k, v in second.items():  # stage 1 holds children 3.. (Tanh has none): its "1.weight" is layer 4's
        i, name = k.split(".")
        torch.testing.assert_close(v, want[f"{int(i) + 3}.{name}"], atol=1e-5, rtol=1e-5,
                                   msg=f"torch running ours: {k}")
    assert set(first) == {"0.weight", "0.bias", "2.weight", "2.bias"} and set(second) == {"1.weight", "1.bias"}
