"""Exact checkpoint and resume across process restarts (gloo, 3 workers), and refused checkpoints.

For every schedule kind: run A trains minibatches 0-9 then 10-19 in one launch; run B trains
0-9, saves, the processes end, a new launch builds a fresh Pipeline, loads and trains 10-19.
The final weights, optimizer state (SGD momentum) and RNG state must be identical bit for bit.
The model has dropout on stage 1, so restoring the RNG state matters too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from torchpipedream.plans.plan import Plan, Stage
from torchpipedream.runtime import CheckpointError, Pipeline, latest_checkpoint, launch, verify_checkpoint
from torchpipedream.runtime.checkpoint import read_stage_states

N_PROCS = 3
LAYERS = [["input_1", "_0", "_1"], ["_2", "_3", "_4"], ["_5"]]
SCENARIOS = {
    "pipedream": dict(kind="pipedream"),
    "2bw": dict(kind="2bw", m=2),
    "flush": dict(kind="flush", m=2),
    "gpipe": dict(kind="gpipe", m=2),
    "naive": dict(kind="naive"),
    "pipedream_2_1": dict(kind="pipedream", replicated=True),
}


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Dropout(0.25), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def plan_for(sc: dict) -> Plan:
    if sc.get("replicated"):
        stages = [Stage(layers=LAYERS[0] + LAYERS[1], replicas=2, ranks=[0, 1]), Stage(layers=LAYERS[2], ranks=[2])]
        return Plan(stages=stages, schedule=sc["kind"])
    return Plan.straight(LAYERS, schedule=sc["kind"], microbatches=sc.get("m", 1))


def data(n: int = 20) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 4, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(n)]


def build(name: str) -> Pipeline:
    sc = SCENARIOS[name]
    return Pipeline(model(), plan_for(sc), optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                    loss_fn=nn.CrossEntropyLoss(), microbatches=sc.get("m"), timeout_s=30, seed=0)


def final_state(pipe: Pipeline) -> dict:
    opt = pipe.weights.optimizer
    return {"stage": pipe.stage_state_dict(), "momentum": [s["momentum_buffer"].clone() for s in opt.state.values()],
            "version": pipe.weights.version, "rng": torch.get_rng_state(), "history": list(pipe.history),
            "minibatches": pipe.minibatches_done}


def straight_through_and_first_half(rank: int, root: str) -> dict:
    """Run A (20 minibatches, no checkpoint) and the first half of run B (10, then save), each
    on a pipeline of its own (the seed argument reseeds each rank's RNG at construction)."""
    out = {}
    for name in SCENARIOS:
        pipe = build(name)
        b = data()
        pipe.train_minibatches(b[:10])
        pipe.train_minibatches(b[10:])
        out[name] = final_state(pipe)
        del pipe
        pipe = build(name)
        pipe.train_minibatches(data()[:10])
        pipe.save_checkpoint(Path(root) / name, scenario=name, next_minibatch=10)
    return out


def second_half(rank: int, root: str, bad: list[str]) -> dict:
    out: dict = {"refused": {}}
    for name in SCENARIOS:
        pipe = build(name)
        if name == "pipedream":
            before = pipe.stage_state_dict()
            for b in bad:  # every rank refuses with the same message: no rank hangs in a collective
                try:
                    pipe.load_checkpoint(Path(root) / b)
                    out["refused"][b] = None
                except CheckpointError as exc:
                    out["refused"][b] = str(exc)
            assert all(torch.equal(before[k], v) for k, v in pipe.stage_state_dict().items())
        extra = pipe.load_checkpoint(Path(root) / name)
        assert extra == {"scenario": name, "next_minibatch": 10}, extra
        assert pipe.minibatches_done == 10
        pipe.train_minibatches(data()[extra["next_minibatch"]:])
        out[name] = final_state(pipe)
    return out


def flip_byte(path: Path, offset: int = 200) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0xFF
    path.write_bytes(bytes(raw))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    a = launch(straight_through_and_first_half, N_PROCS, str(root), timeout_s=120, comm_timeout_s=30, return_all=True)
    # Broken copies of one good checkpoint.
    for bad in ("corrupted", "truncated", "no_manifest"):
        shutil.copytree(root / "pipedream", root / bad)
    flip_byte(root / "corrupted" / "stage1.pt")
    f = root / "truncated" / "stage2.pt"
    f.write_bytes(f.read_bytes()[:-10])
    (root / "no_manifest" / "manifest.json").unlink()
    b = launch(second_half, N_PROCS, str(root), ["corrupted", "truncated", "no_manifest"], timeout_s=120,
               comm_timeout_s=30, return_all=True)
    return root, a, b


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_resume_equals_uninterrupted_run(runs, name):
    _, a, b = runs
    for rank in range(N_PROCS):
        x, y = a[rank][name], b[rank][name]
        assert x["stage"].keys() == y["stage"].keys()
        for k in x["stage"]:
            assert torch.equal(x["stage"][k], y["stage"][k]), (name, rank, k)
        assert len(x["momentum"]) == len(y["momentum"]) > 0
        assert all(torch.equal(u, v) for u, v in zip(x["momentum"], y["momentum"]))
        # 2-1: the replicas of stage 0 take every other minibatch, so they update 10 times
        assert x["version"] == y["version"] == (10 if name == "pipedream_2_1" and rank < 2 else 20)
        assert torch.equal(x["rng"], y["rng"])  # dropout draws continued from the saved RNG state
        assert x["history"] == y["history"] and x["minibatches"] == y["minibatches"] == 20


def test_checkpoint_layout_and_manifest(runs):
    root, _, _ = runs
    d = root / "pipedream_2_1"
    manifest = verify_checkpoint(d)
    names = sorted(e["file"] for e in manifest.files)
    assert names == ["extra.json", "stage0.pt", "stage0_replica1.pt", "stage1.pt"]
    assert manifest.world_size == 3 and manifest.raw["plan_config"] == "2-1"
    for e in manifest.files:
        assert (d / e["file"]).stat().st_size == e["size"]
    assert not [p for p in d.iterdir() if p.name.startswith(".")]  # no temporary files left
    stage0 = torch.load(d / "stage0.pt", weights_only=True)  # plain tensors and containers only
    assert stage0["version"] == 5 and stage0["data"] == {"epoch": 0, "minibatches": 10}
    assert stage0["save_id"] == manifest.save_id
    # Keyed by the model's own names, each tensor once, the index says where.
    assert sorted(stage0["tensors"]) == ["0.bias", "0.weight", "3.bias", "3.weight"]
    assert manifest.index == {"0.bias": "stage0.pt", "0.weight": "stage0.pt", "3.bias": "stage0.pt",
                              "3.weight": "stage0.pt", "5.bias": "stage1.pt", "5.weight": "stage1.pt"}
    assert sorted(stage0["optimizer"]) == sorted(stage0["tensors"])
    assert "momentum_buffer" in stage0["optimizer"]["0.weight"]["state"]
    assert stage0["optimizer"]["0.weight"]["hyper"]["momentum"] == 0.9
    assert len(manifest.history) == 10


def test_broken_checkpoints_are_refused_on_every_rank(runs):
    root, _, b = runs
    for rank in range(N_PROCS):
        refused = b[rank]["refused"]
        assert "stage1.pt is corrupted" in refused["corrupted"]
        assert "stage2.pt is truncated" in refused["truncated"]
        assert "manifest.json is missing" in refused["no_manifest"]
    with pytest.raises(CheckpointError, match=r"stage1\.pt is corrupted: its sha256"):
        verify_checkpoint(root / "corrupted")
    with pytest.raises(CheckpointError, match=r"stage2\.pt is truncated"):
        verify_checkpoint(root / "truncated")


def test_latest_checkpoint_skips_incomplete_and_broken(tmp_path, runs):
    root, _, _ = runs
    for name in ("flush", "pipedream", "no_manifest", "corrupted"):
        shutil.copytree(root / name, tmp_path / name)
    # Make the broken ones look newest: they must still be skipped.
    for name in ("corrupted",):
        m = json.loads((tmp_path / name / "manifest.json").read_text())
        m["created_unix"] += 1e6
        (tmp_path / name / "manifest.json").write_text(json.dumps(m))
    older = json.loads((tmp_path / "pipedream" / "manifest.json").read_text())["created_unix"]
    newest = json.loads((tmp_path / "flush" / "manifest.json").read_text())["created_unix"]
    assert older < newest  # saved in SCENARIOS order
    assert latest_checkpoint(tmp_path) == tmp_path / "flush"
    assert latest_checkpoint(tmp_path / "nothing_here") is None
    assert latest_checkpoint(tmp_path / "no_manifest") is None


def _single(layers: int) -> Pipeline:
    torch.manual_seed(0)
    mods = [nn.Linear(4, 4) for _ in range(layers - 1)] + [nn.Linear(4, 3)]
    names = ["input_1"] + [f"_{i}" for i in range(layers)]
    plan = Plan.straight([names], schedule="flush", microbatches=2)
    return Pipeline(nn.Sequential(*mods), plan, optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                    loss_fn=nn.CrossEntropyLoss())


def test_a_checkpoint_of_another_model_is_refused_one_of_another_plan_loads(tmp_path, runs):
    root, _, _ = runs
    pipe = _single(2)
    pipe.train_minibatches(data(2))
    pipe.save_checkpoint(tmp_path / "two")
    other = _single(3)
    before = other.stage_state_dict()
    with pytest.raises(CheckpointError, match=r"holds no \['2.bias', '2.weight'\] that stage 0 needs"):
        other.load_checkpoint(tmp_path / "two")
    assert all(torch.equal(before[k], v) for k, v in other.stage_state_dict().items())
    with pytest.raises(CheckpointError, match=r"0.weight is \(4, 4\), the model's is \(3, 4\)"):
        _single(1).load_checkpoint(tmp_path / "two")
    torch.manual_seed(0)
    fewer = Pipeline(nn.Sequential(nn.Linear(4, 4)), Plan.straight([["input_1", "_0"]], schedule="flush"),
                     optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), loss_fn=nn.CrossEntropyLoss())
    with pytest.raises(CheckpointError, match=r"holds \['1.bias', '1.weight'\], which this model does not have"):
        fewer.load_checkpoint(tmp_path / "two")
    # The 3-worker flush checkpoint onto one process: every tensor where the files have it.
    one = Pipeline(model(), Plan.straight([sum(LAYERS, [])], schedule="flush", microbatches=2),
                   optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), loss_fn=nn.CrossEntropyLoss())
    assert one.load_checkpoint(root / "flush") == {"scenario": "flush", "next_minibatch": 10}
    saved = read_stage_states(root / "flush")
    assert sorted(saved) == sorted(one.stage_state_dict())
    assert all(torch.equal(one.stage_state_dict()[k], v) for k, v in saved.items())
    assert one.minibatches_done == 10 and one.weights.version == 10
    assert all("momentum_buffer" in s for s in one.weights.optimizer.state.values())
    # Same model and plan: loads, and a single-process checkpoint round-trips exactly.
    again = _single(2)
    assert again.load_checkpoint(tmp_path / "two") == {}
    for k, v in pipe.stage_state_dict().items():
        assert torch.equal(again.stage_state_dict()[k], v)
    assert again.weights.version == pipe.weights.version == 2


def test_non_json_extra_and_mid_schedule_save_are_refused(tmp_path):
    pipe = _single(2)
    pipe.train_minibatches(data(1))
    with pytest.raises(CheckpointError, match=r"rank 0: cannot write its checkpoint file .*not JSON serializable"):
        pipe.save_checkpoint(tmp_path / "bad", fn=lambda: 0)
    assert latest_checkpoint(tmp_path) is None  # no manifest: not a checkpoint
    # A stash still alive (what a save in the middle of a pipedream schedule would meet).
    w = pipe.weights
    w.expect({w.version: 1})
    w.tensors(w.version)
    w.accumulate([torch.ones_like(p) for p in w.params], samples=1)
    w.step()  # version still needed: copy on update, the old version stays stashed
    with pytest.raises(RuntimeError, match="mid-schedule"):
        w.boundary_state()
    with pytest.raises(CheckpointError, match="mid-schedule"):
        pipe.save_checkpoint(tmp_path / "mid")


def test_a_manifest_nested_too_deeply_is_a_checkpoint_error(tmp_path: Path) -> None:
    # Issue 39: a JSON file nested 100,000 deep was a RecursionError traceback.
    from torchpipedream.runtime.checkpoint import MANIFEST, read_manifest

    (tmp_path / MANIFEST).write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match="nested too deeply"):
        read_manifest(tmp_path)


def test_extra_json_is_streamed_with_a_small_peak_and_nothing_left_on_failure(tmp_path: Path) -> None:
    """A long run's extra (a row per epoch) is written piece by piece: the same bytes and digest
    as ``json.dumps``, without holding the whole text transiently several times over (rank 0's
    memory rose in steps in the soak, docs/architecture.md "Checkpoints")."""
    import hashlib
    import tracemalloc

    from torchpipedream.runtime.checkpoint import write_json_atomic

    row = {"epoch": 1, "train_loss": 0.1234567, "test_loss": 0.1670123, "test_accuracy": 0.98888888,
           "seconds": 0.3456789, "minibatches": 23, "samples_per_s": 5996.123456}
    extra = {"save_id": "s", "extra": {"history": [dict(row, epoch=i) for i in range(8000)]}}
    want = json.dumps(extra, indent=1).encode()
    tracemalloc.start()
    try:
        json.dumps(extra, indent=1).encode()
        _, at_once = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        digest, size = write_json_atomic(tmp_path / "extra.json", extra)
        _, peak = tracemalloc.get_traced_memory()
        streamed = peak - base
    finally:
        tracemalloc.stop()
    assert (tmp_path / "extra.json").read_bytes() == want
    assert (digest, size) == (hashlib.sha256(want).hexdigest(), len(want))
    assert at_once > 3 * len(want) and streamed < len(want) / 4, (at_once, streamed, len(want))
    with pytest.raises(TypeError):
        write_json_atomic(tmp_path / "bad.json", {"x": object()})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["extra.json"]  # no temporary file left behind
