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

from torchpipedream.schedule.actions import Kind
from torchpipedream.plans.plan import Plan, Stage
from torchpipedream.runtime import Pipeline, launch
from torchpipedream.schedule.build import ScheduleBuildError, build_schedule, schedule_from_order
from torchpipedream.sim.simulator import Costs, simulate
from torchpipedream.schedule.torch_text import (TorchScheduleError, from_torch, parse_torch_action, read_torch_csv,
                                          to_torch, write_torch_csv)
from torchpipedream.schedule.validate import ScheduleError, validate_schedule


class MockStage:
    """What torch's schedule classes read from a stage to compute their action lists (no
    process group: the order is computed for every rank from these numbers)."""

    def __init__(self, index: int, stages: int, ranks: int) -> None:
        self.stage_index, self.num_stages, self.group_size, self.group_rank = index, stages, ranks, 0
        self.is_first, self.is_last = index == 0, index == stages - 1
        self.submod = nn.Linear(2, 2)


def torch_order(name: str, n: int, m: int, chunks: int = 1) -> dict:
    """The action lists torch's schedule class ``name`` generates for ``n`` ranks, ``m``
    microbatches and ``chunks`` stages per rank (looped: rank 0 holds stages 0, n, 2n, ...;
    torch's V-shaped schedules hold two, placed by torch itself)."""
    cls = torch_schedules.get_schedule_class(name)
    loss = nn.functional.mse_loss
    if issubclass(cls, torch_schedules.PipelineScheduleMulti):
        ids = [0, 2 * n - 1] if name in ("ZBVZeroBubble", "DualPipeV") else [c * n for c in range(chunks)]
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


def test_looped_stages_with_a_split_backward_are_refused_by_name() -> None:
    with pytest.raises(TorchScheduleError, match=r"rank 0 runs stages \[0, 2\] and splits the backward \(I and W\): "
                       "several stages per rank with a split backward are supported in a V only"):
        from_torch(torch_order("InterleavedZeroBubble", 2, 4, 2))


@pytest.mark.parametrize("n, m", [(2, 4), (2, 8), (3, 6), (4, 8), (4, 16), (8, 16)])
@pytest.mark.parametrize("name", ["ZBVZeroBubble", "DualPipeV"])
def test_torchs_v_shaped_zero_bubble_schedules_take_the_time_of_our_zb_v(name: str, n: int, m: int) -> None:
    """torch's ZBVZeroBubble and DualPipeV (two stages per rank in a V, backward split) import as
    zb-v and validate; on equal F, B and W passes their batch and ours both take 6m + p − 1
    passes: only the forward wave's start idles."""
    sched = from_torch(torch_order(name, n, m, 2))
    assert sched.kind == "zb-v" and [st.ranks for st in sched.plan.stages] == \
        [[k if k < n else 2 * n - 1 - k] for k in range(2 * n)]
    validate_schedule(sched)
    costs = Costs(forward_s=[1.0] * 2 * n, backward_s=[2.0] * 2 * n, weight_grad_s=[1.0] * 2 * n)
    ours = build_schedule(Plan.v_shape([[f"stage{k}"] for k in range(2 * n)], n), "zb-v", minibatches=1,
                          microbatches=m)
    assert simulate(sched, costs).makespan_s == simulate(ours, costs).makespan_s == 6 * m + n - 1


def looped(n: int, chunks: int, m: int) -> Plan:
    """Stage k (one layer) on rank k mod n, ``chunks`` stages per rank."""
    return Plan.looped([[f"layer{k}"] for k in range(n * chunks)], n, microbatches=m)


def compute_of(sched, rank: int, batch: int = 0) -> list[tuple[int, str, int]]:
    """Rank ``rank``'s compute actions of batch ``batch``: (stage, F/B/W, microbatch in the batch)."""
    m = sched.microbatches
    return [(a.stage, a.kind.value, a.id - batch * m) for a in sched.actions[rank]
            if a.kind.is_compute and a.id // m == batch]


@pytest.mark.parametrize("n, chunks, m", [(2, 2, 4), (4, 2, 8), (2, 3, 4)])
@pytest.mark.parametrize("name", ["Interleaved1F1B", "LoopedBFS"])
def test_torchs_looped_schedules_import_as_interleaved_validate_and_simulate(name: str, n: int, chunks: int,
                                                                              m: int) -> None:
    """Several stages per rank (torch's stage index = ours, stage k on rank k mod n) read as our
    interleaved kind: each rank runs torch's compute in torch's order, stage by stage."""
    order = torch_order(name, n, m, chunks)
    plan = looped(n, chunks, m)
    sched = from_torch(order, plan=plan, minibatches=3)
    assert sched.kind == "interleaved" and sched.plan is plan and (sched.minibatches, sched.microbatches) == (3, m)
    validate_schedule(sched)
    assert to_torch(sched, batch=0) == compute_cells(order) == to_torch(sched, batch=2)
    for r, acts in order.items():  # the same, read from our actions
        want = [(a.stage_index, a.computation_type.value, a.microbatch_index) for a in acts
                if a is not None and a.computation_type.value in ("F", "B")]
        assert compute_of(sched, r, batch=1) == want, f"rank {r}"
        assert {s for s, _, _ in want} == set(plan.stages_of_rank(r))
    res = simulate(sched, Costs(forward_s=[1.0] * n * chunks, backward_s=[2.0] * n * chunks))
    assert res.makespan_s > 0
    # without a plan, torch's placement gives the looped one
    default = from_torch(order, minibatches=3)
    assert [st.ranks for st in default.plan.stages] == [[k % n] for k in range(n * chunks)]
    assert default.actions == sched.actions


def test_torchs_interleaved_1f1b_spot_check() -> None:
    """Interleaved1F1B, 2 ranks × 2 stages, 4 microbatches, as torch lists it: rank 1 (stages 1
    and 3) runs its last stage's backward right after each forward of it; transfers go to the
    rank holding the neighbouring stage."""
    sched = from_torch(torch_order("Interleaved1F1B", 2, 4, 2), plan=looped(2, 2, 4))
    assert [f"{s}{k}{i}" for s, k, i in compute_of(sched, 0)] == \
        "0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3".split()
    assert [f"{s}{k}{i}" for s, k, i in compute_of(sched, 1)] == \
        "1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3".split()
    sends = [a for a in sched.actions[1] if a.kind is Kind.SEND_ACT]
    assert sends and all(a.stage == 1 and a.peer == 0 for a in sends)  # stage 1 -> stage 2 on rank 0
    assert "max_inflight" not in (sched.options or {})  # within interleaved's own bound


@pytest.mark.parametrize("n, chunks, m", [(2, 2, 4), (4, 2, 8)])
def test_looped_bfs_declares_what_it_holds(n: int, chunks: int, m: int) -> None:
    """LoopedBFS runs every forward of a stage before its backwards: each stage holds all m
    microbatches (a rank all m of each of its stages), more than interleaved's bounds; the
    schedule declares both, and without the declarations the validator refuses it."""
    sched = from_torch(torch_order("LoopedBFS", n, m, chunks), plan=looped(n, chunks, m))
    assert sched.options == {"max_inflight": m, "max_rank_inflight": m * chunks}
    validate_schedule(sched)
    sched.options = {}
    with pytest.raises(ScheduleError, match=f"rank {n - 1}"):
        validate_schedule(sched)


@pytest.mark.parametrize("n, chunks, m", [(2, 2, 4), (4, 2, 8), (4, 2, 4), (2, 3, 6)])
def test_our_interleaved_is_torchs_interleaved_1f1b_and_round_trips(n: int, chunks: int, m: int,
                                                                     tmp_path: Path) -> None:
    plan = looped(n, chunks, m)
    ours = build_schedule(plan, "interleaved", minibatches=3, microbatches=m)
    assert to_torch(ours) == compute_cells(torch_order("Interleaved1F1B", n, m, chunks))
    assert to_torch(ours, batch=2) == to_torch(ours)
    again = from_torch(to_torch(ours), plan=plan, minibatches=3)
    assert again.kind == "interleaved" and again.actions == ours.actions and not again.options
    path = write_torch_csv(ours, tmp_path / "interleaved.csv")
    assert read_torch_csv(path, plan=plan, minibatches=3).actions == ours.actions


def test_a_v_shaped_order_without_split_backward_imports() -> None:
    """Stages 0 and 3 on rank 0, 1 and 2 on rank 1 (V-shaped, as ZBV places them): the default
    plan takes torch's placement, and the transfer from stage 1 to stage 2 stays on rank 1."""
    order = {0: "0F0 0F1 3F0 3B0 3F1 3B1 0B0 0B1".split(), 1: "1F0 2F0 1F1 2F1 2B0 1B0 2B1 1B1".split()}
    sched = from_torch(order, minibatches=2)
    assert [st.ranks for st in sched.plan.stages] == [[0], [1], [1], [0]] and sched.kind == "interleaved"
    validate_schedule(sched)
    assert any(a.kind is Kind.SEND_ACT and a.stage == 1 and a.peer == 1 for a in sched.actions[1])
    assert to_torch(sched, batch=1) == order


def test_several_stages_per_rank_need_a_matching_plan_and_kind() -> None:
    order = torch_order("Interleaved1F1B", 2, 4, 2)
    with pytest.raises(TorchScheduleError, match=r"placed as the torch schedule runs them: stages per rank "
                                                 r"\{0: \[0, 2\], 1: \[1, 3\]\}"):
        from_torch(order, plan=Plan.straight([["a"], ["b"], ["c"], ["d"]], microbatches=4))
    with pytest.raises(TorchScheduleError, match="placed as the torch schedule runs them"):
        from_torch(order, plan=looped(2, 3, 4))
    with pytest.raises(TorchScheduleError, match=r"rank 0 runs stages \[0, 2\]: kind flush runs one stage per rank"):
        from_torch(order, kind="flush")
    with pytest.raises(TorchScheduleError, match="stage 0 runs on rank 0 and on rank 1"):
        from_torch({0: ["0F0", "0B0"], 1: ["0F1", "0B1"]})
    with pytest.raises(TorchScheduleError, match="stage 1 is missing"):
        from_torch({0: ["0F0", "2F0", "2B0", "0B0"], 1: ["3F0", "3B0"]})


def test_schedule_from_order_needs_and_checks_rank_order() -> None:
    """A plan with virtual stages: per stage the compute order, per rank how its stages interleave."""
    plan = looped(2, 2, 1)
    F, B = Kind.FORWARD, Kind.BACKWARD
    order = {(s, 0): [(F, 0), (B, 0)] for s in range(4)}
    good = {0: [0, 2, 2, 0], 1: [1, 3, 3, 1]}
    sched = schedule_from_order(plan, "interleaved", 1, 1, order, good)
    validate_schedule(sched)
    assert [(a.stage, a.kind) for a in sched.actions[0] if a.kind.is_compute] == [(0, F), (2, F), (2, B), (0, B)]
    with pytest.raises(ScheduleBuildError, match=r"several stages on one worker .*: rank_order is needed"):
        schedule_from_order(plan, "interleaved", 1, 1, order)
    with pytest.raises(ScheduleBuildError, match="flush runs one stage per worker"):
        schedule_from_order(plan, "flush", 1, 1, order, good)
    with pytest.raises(ScheduleBuildError, match=r"rank_order\[1\] lists stage 3 1 times, but the order has 2 compute "
                                                 "items of stage 3"):
        schedule_from_order(plan, "interleaved", 1, 1, order, {0: good[0], 1: [1, 3, 1]})
    with pytest.raises(ScheduleBuildError, match=r"rank_order\[0\] names stage 1; rank 0 holds stages \[0, 2\]"):
        schedule_from_order(plan, "interleaved", 1, 1, order, {0: [0, 1, 2, 0], 1: good[1]})
    with pytest.raises(ScheduleBuildError, match=r"rank_order lists ranks \[0\]; the plan has ranks \[0, 1\]"):
        schedule_from_order(plan, "interleaved", 1, 1, order, {0: good[0]})


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


def reference(build=None) -> dict[str, torch.Tensor]:
    """Plain training of ``build()`` (default ``mlp``) on ``data()``: the weights every run here must equal."""
    model = (build or mlp)()
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


# --------------------------------------------------------------------------- two stages per rank, in a V
def mlp4() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


#: mlp4's children in 4 stages, and the same cut by fx layer names; a V puts stages 0 and 3 on rank 0
PIECES = [[0, 1], [2, 3], [4, 5], [6]]
V_CUT = [["input_1", "_0", "_1"], ["_2", "_3"], ["_4", "_5"], ["_6"]]


def torch_v_worker(rank: int, csv_path: str) -> dict:
    """Our zb-v, exported as torch's CSV, on torch's runtime with two PipelineStages per rank."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage

    torch.set_num_threads(1)
    children = list(mlp4().children())
    ids = [rank, 3 - rank]
    pieces = {s: nn.Sequential(*[children[i] for i in PIECES[s]]) for s in ids}
    stages = [PipelineStage(pieces[s], s, 4, torch.device("cpu")) for s in ids]
    sched = torch_schedules._PipelineScheduleRuntime(stages, n_microbatches=M, loss_fn=nn.functional.cross_entropy)
    sched._load_csv(csv_path)
    opt = torch.optim.SGD([p for s in ids for p in pieces[s].parameters()], lr=LR)
    for x, y in data():
        opt.zero_grad()
        if rank == 0:  # rank 0 holds the first and the last stage
            sched.step(x, target=y)
        else:
            sched.step()
        opt.step()
    state: list = [None, None]
    dist.all_gather_object(state, {s: {k: v.detach() for k, v in pieces[s].state_dict().items()} for s in ids})
    return {"state": state}


def ours_v_worker(rank: int) -> dict:
    """torch's ZBVZeroBubble order on our runtime (Pipeline.use_schedule, a V-shaped plan)."""
    torch.set_num_threads(1)
    pipe = Pipeline(mlp4(), Plan.v_shape(V_CUT, 2, microbatches=M), optimizer=lambda p: torch.optim.SGD(p, lr=LR),
                    loss_fn=nn.CrossEntropyLoss(), timeout_s=60)
    pipe.use_schedule(from_torch(torch_order("ZBVZeroBubble", 2, M, 2), plan=pipe.plan, minibatches=BATCHES))
    pipe.train_minibatches(data())
    return {"state": pipe.state_dict(dst=0)}


def test_torchs_runtime_trains_our_exported_zb_v_and_ours_trains_torchs_zbv(tmp_path: Path) -> None:
    want = reference(mlp4)
    path = write_torch_csv(build_schedule(Plan.v_shape(V_CUT, 2, microbatches=M), "zb-v", minibatches=1,
                                          microbatches=M), tmp_path / "zbv.csv")
    pieces = [piece for rank in launch(torch_v_worker, 2, str(path), timeout_s=240, comm_timeout_s=60)["state"]
              for piece in rank.items()]
    assert sorted(s for s, _ in pieces) == [0, 1, 2, 3]
    for s, state in pieces:  # a piece's child i is the model's child PIECES[s][i]
        for k, v in state.items():
            i, name = k.split(".")
            torch.testing.assert_close(v, want[f"{PIECES[s][int(i)]}.{name}"], atol=1e-5, rtol=1e-5,
                                       msg=f"torch running our zb-v: stage {s} {k}")
    got = launch(ours_v_worker, 2, timeout_s=240, comm_timeout_s=60, return_all=True)[0]["state"]
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-5, msg=f"ours running torch's ZBV: {k}")
