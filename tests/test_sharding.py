"""Pipeline stages sharded over their replicas with torch's FSDP2 (issue 36): equal to one-process
training, memory split over the replicas, refusals by name.

One launch of 4 gloo processes runs every scenario (spawning costs seconds on a 2-core
machine). The reference is plain PyTorch written here: the whole model in one process, one
optimizer step per minibatch on the minibatch's mean loss (``clip_grad_norm_`` and a
``LambdaLR`` where the scenario clips and schedules) — what flush and gpipe promise, with the
gradient accumulated over microbatches and replicas.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from scenario_reference import assert_equals_one_process, one_process_training, optimizer
from torchpipedream.plans.plan import Plan, PlanError, Stage
from torchpipedream.runtime import Pipeline, PipelineError, launch
from torchpipedream.runtime.loss_scaling import LossScaling
from torchpipedream.runtime.lr_schedule import LRSchedule
from torchpipedream.runtime.sharding import local_tensor
from torchpipedream.schedule.build import build_schedule
from torchpipedream.schedule.orders import ScheduleBuildError
from torchpipedream.schedule.validate import ScheduleError, validate_schedule

N_PROCS = 4
#: float16's loss scale: 2**20 overflows at first (an update is skipped), then halves
FP16_SCALING = LossScaling(init_scale=2.0 ** 20, growth_interval=2)
WIDTH = 16
CLIP = 0.3
#: scenario -> (kind, per-stage replicas, sharding, microbatches, optimizer, options)
SCENARIOS: dict[str, dict] = {
    "flush_zero3": dict(kind="flush", shape=(2, 2), sharding="zero3", m=4, opt="momentum", clip=True, sched=True),
    "gpipe_zero2": dict(kind="gpipe", shape=(2, 2), sharding="zero2", m=2, opt="adamw"),
    # stage 0 on three shards, stage 1 whole on one worker; the last minibatch of 2 samples
    # leaves microbatch 2 empty on one shard (its backward still meets the others')
    "flush_3_1_uneven": dict(kind="flush", shape=(3, 1), sharding="zero3", m=3, opt="adam", uneven=True,
                             evaluate=True),
    "flush_bf16": dict(kind="flush", shape=(2, 2), sharding="zero3", m=2, opt="sgd", precision="bf16"),
    # activation recomputation: the backward runs the forward again, gathering the weights again
    "flush_recompute": dict(kind="flush", shape=(2, 2), sharding="zero3", m=4, opt="momentum", recompute=True),
    # float16 with a loss scale that overflows at first: skipped updates agreed over the shards
    "flush_fp16": dict(kind="flush", shape=(2, 2), sharding="zero2", m=2, opt="sgd", precision="fp16"),
    # zero1: gathered once per minibatch (UN), reduce-scattered once (RD), freed (RS)
    "flush_zero1": dict(kind="flush", shape=(2, 2), sharding="zero1", m=4, opt="momentum", clip=True, sched=True),
    "gpipe_zero1_fp16": dict(kind="gpipe", shape=(2, 2), sharding="zero1", m=2, opt="sgd", precision="fp16"),
    "flush_3_1_zero1_uneven": dict(kind="flush", shape=(3, 1), sharding="zero1", m=3, opt="adam", uneven=True,
                                   evaluate=True),
    # the control: the same plan with replicas that replicate (PipeDream's all-reduce)
    "flush_replicate": dict(kind="flush", shape=(2, 2), sharding="replicate", m=4, opt="adam"),
}
LAYERS = [["0", "1", "2", "3"], ["4", "5", "6"]]


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 3))


def data(uneven: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    sizes = [12, 12, 12, 2] if uneven else [12, 12, 12]
    return [(torch.randn(b, 6, generator=g), torch.randint(0, 3, (b,), generator=g)) for b in sizes]


def plan_of(sc: dict) -> Plan:
    stages, rank = [], 0
    for layers, replicas in zip(LAYERS if len(sc["shape"]) == 2 else FOUR, sc["shape"]):
        stages.append(Stage(layers=layers, replicas=replicas, ranks=list(range(rank, rank + replicas)),
                            sharding=sc["sharding"] if replicas > 1 else "replicate"))
        rank += replicas
    return Plan(stages=stages, schedule=sc["kind"], microbatches=sc["m"])


def _held_bytes(pipe: Pipeline) -> int:
    """Bytes of this rank's weights and optimizer state (the shards' local parts)."""
    tensors = list(pipe.weights.params)
    for state in pipe.weights.optimizer.state.values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return sum(local_tensor(t).numel() * t.element_size() for t in tensors)


def _pipeline(sc: dict, batches: list) -> Pipeline:
    return Pipeline(model(), plan_of(sc), loss_fn=nn.functional.cross_entropy, optimizer=optimizer(sc["opt"]),
                    sample=batches[0][0], microbatches=sc["m"], timeout_s=60)


#: checkpoints: (first plan, the plan that resumes it) — sharded (zero3, zero1) onto a straight ×4 pipeline, and
#: a replicating run onto a sharded one; the test process resumes the first on one process too
RESUMES = {
    "sharded_to_straight": (dict(kind="flush", shape=(2, 2), sharding="zero3", m=4, opt="adam"),
                            dict(kind="gpipe", shape=(1, 1, 1, 1), sharding="replicate", m=2, opt="adam")),
    "zero1_to_straight": (dict(kind="flush", shape=(2, 2), sharding="zero1", m=4, opt="adam"),
                          dict(kind="gpipe", shape=(1, 1, 1, 1), sharding="replicate", m=2, opt="adam")),
    "replicated_to_sharded": (dict(kind="gpipe", shape=(2, 2), sharding="replicate", m=2, opt="adam"),
                              dict(kind="flush", shape=(2, 2), sharding="zero2", m=2, opt="adam")),
}
FOUR = [["0", "1"], ["2", "3"], ["4", "5"], ["6"]]


def _resumes(rank: int, directory: str) -> dict:
    out = {}
    batches = data()
    for name, (first, second) in RESUMES.items():
        pipe = _pipeline(first, batches)
        pipe.train_minibatches(batches[:2])
        pipe.save_checkpoint(f"{directory}/{name}")
        again = _pipeline(second, batches)
        again.load_checkpoint(f"{directory}/{name}")
        again.train_minibatches(batches[2:])
        out[name] = again.state_dict()
    return out


def _worker(rank: int, directory: str) -> dict:
    torch.set_num_threads(1)
    out = {"resumes": _resumes(rank, directory)}
    for name, sc in SCENARIOS.items():
        batches = data(sc.get("uneven", False))
        pipe = Pipeline(model(), plan_of(sc), loss_fn=nn.functional.cross_entropy, optimizer=optimizer(sc["opt"]),
                        sample=batches[0][0], microbatches=sc["m"], precision=sc.get("precision", "fp32"),
                        loss_scaling=FP16_SCALING if sc.get("precision") == "fp16" else None,
                        clip_grad_norm=CLIP if sc.get("clip") else None,
                        lr_scheduler=LRSchedule("cosine", warmup=1, total=len(batches)) if sc.get("sched") else None,
                        recompute=sc.get("recompute", False),
                        timeout_s=60)
        pipe.fit(batches, epochs=1)
        held = torch.tensor([_held_bytes(pipe), pipe.stage], dtype=torch.int64)
        gathered = [torch.zeros_like(held) for _ in range(N_PROCS)]
        torch.distributed.all_gather(gathered, held)
        result = {"state": pipe.state_dict(), "norms": pipe.grad_norms, "held": [t.tolist() for t in gathered],
                  "scale": (pipe.loss_scale, pipe.skipped_updates) if sc.get("precision") == "fp16" else None}
        if sc.get("evaluate"):
            result["eval"] = pipe.evaluate(batches)
        out[name] = result
    return out


def reference(sc: dict) -> dict:
    """One process, one step per minibatch on its mean loss (plain PyTorch: scenario_reference.py)."""
    return one_process_training(model(), data(sc.get("uneven", False)), optimizer(sc["opt"]), sc, CLIP, FP16_SCALING)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("sharded_checkpoints"))


@pytest.fixture(scope="module")
def results(checkpoints: str) -> dict:
    return launch(_worker, N_PROCS, checkpoints, timeout_s=300, stall_timeout_s=60)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_sharded_pipeline_equals_one_process(results: dict, name: str) -> None:
    sc, got = SCENARIOS[name], results[name]
    assert_equals_one_process(name, sc, got, reference(sc), CLIP)


@pytest.mark.parametrize("name", list(RESUMES))
def test_a_checkpoint_moves_between_sharded_and_other_plans(results: dict, checkpoints: str, name: str) -> None:
    """Two minibatches on the first plan, saved; the third on another plan that loaded it (and,
    for the sharded one, on one process): the weights of three minibatches in one process."""
    want = reference(dict(opt="adam"))["state"]
    resumed = {name: results["resumes"][name]}
    if name == "sharded_to_straight":
        one = Pipeline(model(), Plan.straight([[n for group in LAYERS for n in group]], schedule="flush"),
                       loss_fn=nn.functional.cross_entropy, optimizer=optimizer("adam"), sample=data()[0][0])
        one.load_checkpoint(f"{checkpoints}/{name}")
        one.train_minibatches(data()[2:])
        resumed["one process"] = one.state_dict()
    for label, got in resumed.items():
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, atol=2e-5, rtol=2e-5, msg=f"{label}: {key}")


def test_shards_hold_a_share_of_the_weights_and_optimizer_state(results: dict) -> None:
    """Each of a stage's two shards holds about half of what a replicating replica holds
    (weights + Adam's two moments; FSDP2 pads a row count to a multiple of the shards)."""
    sharded = {rank: held for rank, (held, _) in enumerate(results["gpipe_zero2"]["held"])}
    control = {rank: held for rank, (held, _) in enumerate(results["flush_replicate"]["held"])}
    for rank in range(N_PROCS):
        assert 0.45 <= sharded[rank] / control[rank] <= 0.6, (rank, sharded[rank], control[rank])
    # the two shards of a stage together hold its weights and state once (padding aside)
    for ranks in ([0, 1], [2, 3]):
        assert sum(sharded[r] for r in ranks) == pytest.approx(control[ranks[0]], rel=0.1)


# ------------------------------------------------------------------ refusals and proofs (no process)
def _two_two(kind: str, sharding: str = "zero3", m: int = 4) -> Plan:
    return Plan(stages=[Stage(LAYERS[0], replicas=2, ranks=[0, 1], sharding=sharding),
                        Stage(LAYERS[1], replicas=2, ranks=[2, 3], sharding=sharding)], schedule=kind, microbatches=m)


@pytest.mark.parametrize("kind", ["pipedream", "2bw", "zb-2bw", "naive"])
def test_kinds_with_several_weight_versions_are_refused_by_name(kind: str) -> None:
    m = 1 if kind in ("pipedream", "naive") else 4
    with pytest.raises(ScheduleBuildError, match=f"stage 0 is sharded \\(zero3\\): {kind} keeps several weight"):
        build_schedule(_two_two(kind, m=m), kind, minibatches=2, microbatches=m)


def test_microbatches_must_split_evenly_over_the_shards() -> None:
    with pytest.raises(ScheduleBuildError, match="stage 0 is sharded .* over 2 replicas, and microbatches is 3.*= 4"):
        build_schedule(_two_two("flush", m=3), "flush", minibatches=2, microbatches=3)


def test_the_validator_proves_the_shards_meet() -> None:
    """Every F/B of a sharded stage is a collective of its replicas: where one replica runs
    1F1B (F B F B) and the other its forwards first (F F B B), their second collectives differ
    and the run deadlocks; the same lists on replicating replicas are fine."""
    def reordered(sharding: str):
        sched = build_schedule(_two_two("flush", sharding), "flush", minibatches=1, microbatches=4)
        validate_schedule(sched)  # as built: proven
        acts = sched.actions[1]
        order = {("F", 1): 0, ("SA", 1): 1, ("RG", 1): 2, ("B", 1): 3, ("F", 3): 4, ("SA", 3): 5, ("RG", 3): 6,
                 ("B", 3): 7}
        head = sorted((a for a in acts if (a.kind.value, a.id) in order), key=lambda a: order[(a.kind.value, a.id)])
        assert len(head) == 8
        return dataclasses.replace(sched, actions={**sched.actions, 1: head + [a for a in acts if a not in head]})

    validate_schedule(reordered("replicate"))
    with pytest.raises(ScheduleError, match="deadlock: cycle 0 -> 1 -> 0: rank 0 waits at s0F2v0 for rank 1; rank 1 waits at s0r1B1v0"):
        validate_schedule(reordered("zero3"))


def test_plan_fields_sharding() -> None:
    plan = _two_two("flush")
    again = Plan.from_dict(plan.to_dict())
    assert [st.sharding for st in again.stages] == ["zero3", "zero3"]
    assert "sharded zero3" in plan.summary and "2 zero3" in plan.table()
    plain = Plan.from_dict(_two_two("flush", "replicate").to_dict())
    assert "sharding" not in plain.to_dict()["stages"][0]  # files as before sharding existed
    with pytest.raises(PlanError, match="stage 0: sharding 'zero3' splits the stage over its replicas, and it has 1"):
        Plan(stages=[Stage(["a"], ranks=[0], sharding="zero3")]).validate()
    with pytest.raises(PlanError, match="stage 0: sharding must be one of replicate, zero3, zero2, zero1, got 'zero4'"):
        Plan(stages=[Stage(["a"], replicas=2, ranks=[0, 1], sharding="zero4")]).validate()


def test_train_and_plan_take_shard(tmp_path, capsys) -> None:
    """`train --shard` trains the default model on sharded stages (its report says so, its
    exported weights are whole tensors) and resumes; `plan --shard` prices sharded stages; a
    kind that cannot shard is refused by name before anything starts."""
    import json

    from torchpipedream.cli import main

    out = tmp_path / "sharded"
    common = ["train", "--workers", "4", "--stages", "2", "--schedule", "flush", "--no-progress",
              "--max-minibatches", "4", "--timeout", "60", "--out", str(out)]
    assert main(common + ["--epochs", "1", "--shard"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert "sharded zero3" in report["plan"] and report["final_test_loss"] > 0
    state = torch.load(out / "checkpoint.pt", weights_only=True)["state_dict"]
    assert state and all(type(v) is torch.Tensor for v in state.values())
    assert main(common + ["--epochs", "2", "--shard", "zero1", "--resume"]) == 0  # zero3 resumed as zero1
    assert "sharded zero1" in json.loads((out / "report.json").read_text())["plan"]
    assert main(["plan", "vgg16", "-t", "4:1GB/s", "--schedule", "flush", "--microbatches", "4", "--stages", "1",
                 "--shard", "zero2"]) == 0
    assert "4 zero2" in capsys.readouterr().out
    assert main(["train", "--schedule", "2bw", "--shard", "--out", str(tmp_path / "no")]) == 2
    assert "--shard zero3 splits replicated stages with FSDP2, which runs under flush, gpipe, zb-h1 and zb-h2" in \
        capsys.readouterr().err


def test_auto_shards_only_the_stages_that_need_it() -> None:
    """A plan with every replicated stage sharded keeps sharding only where the stage's replicated
    peak exceeds the budget (replicating is the faster of the two where both fit), and there the
    fastest sharding that fits: zero1, zero2, then zero3 (as planned)."""
    from torchpipedream.model.profiles import load_profile
    from torchpipedream.search.auto import shard_where_needed
    from torchpipedream.search.planner import plan as make_plan

    sharded = make_plan(load_profile("vgg16"), "4:1GB/s", schedule="flush", microbatches=4, num_stages=2,
                        sharding="zero3")
    replicated = [s for s, st in enumerate(sharded.stages) if st.replicas > 1]
    assert replicated
    def peak(s: int, sharding: str) -> float:
        return dataclasses.replace(sharded, stages=[dataclasses.replace(st, sharding=sharding if st.replicas > 1
                                                                        else st.sharding)
                                                    for st in sharded.stages]).stage_memory_bytes(s)

    for s in replicated:
        held = {k: peak(s, k) for k in ("replicate", "zero1", "zero2", "zero3")}
        # SGD with momentum (f = 2) on two replicas: replicating holds 3 weights' worth, zero1
        # 1.5 + 3 gathered, zero2 1.5 + 1 (+ a layer), zero3 1.5 + two layers
        assert held["zero3"] < held["zero2"] < held["replicate"] < held["zero1"]
        for budget, kept in ((held["replicate"] + 1, "replicate"), (held["replicate"] - 1, "zero2"),
                             (held["zero2"] - 1, "zero3")):
            chosen = shard_where_needed(sharded, budget)
            assert chosen.stages[s].sharding == kept
            assert chosen.stages[s].memory_bytes == pytest.approx(held[kept], abs=1)
    # where zero1 holds less than replicating (mixed-precision Adam's f = 7 on four replicas:
    # 8/4 + 3 gathered against 8), a budget between them takes zero1
    adam = make_plan(load_profile("vgg16"), "4:1GB/s", schedule="flush", microbatches=4, num_stages=1,
                     sharding="zero3", optimizer_state_factor=7.0)
    assert adam.stages[0].replicas == 4
    sharded, replicated = adam, [0]
    held = {k: peak(0, k) for k in ("replicate", "zero1", "zero2")}
    assert held["zero1"] < held["replicate"]
    assert shard_where_needed(adam, (held["zero1"] + held["replicate"]) / 2).stages[0].sharding == "zero1"


def test_a_shared_parameter_on_a_sharded_stage_is_charged_whole() -> None:
    """FSDP2 leaves a parameter stages share whole on every replica (``ignored_params``): the
    memory model charges its bytes and their optimizer state whole, (1 + f)(1 − 1/r) of them
    more than if they were sharded (zero3 gathers one layer at a time either way)."""
    from torchpipedream.model.profiles import load_profile
    from torchpipedream.plans.plan import TiedParameter
    from torchpipedream.search.planner import plan as make_plan
    from torchpipedream.sim.simulator import Costs, simulate

    sharded = make_plan(load_profile("vgg16"), "4:1GB/s", schedule="flush", microbatches=4, num_stages=2,
                        sharding="zero3")
    owner = next(s for s, st in enumerate(sharded.stages) if st.replicas > 1)
    r, f, shared = sharded.stages[owner].replicas, 2.0, 10 * 2**20
    other = 1 - owner
    tied = dataclasses.replace(sharded, tied=[TiedParameter("embedding.weight", sorted([owner, other]), shared)])
    if tied.tied[0].stages[0] != owner:  # the owner's profile counts the parameter; the other holds a copy
        pytest.skip("the replicated stage is not the first holder")
    assert tied.stage_memory_bytes(owner) - sharded.stage_memory_bytes(owner) == pytest.approx(
        (1 + f) * shared * (1 - 1 / r))
    costs = Costs.from_plan(tied, microbatches=4)
    got = simulate(build_schedule(tied, "flush", minibatches=4), costs).peak_memory_bytes[owner]
    base = simulate(build_schedule(sharded, "flush", minibatches=4), Costs.from_plan(sharded, microbatches=4))
    assert got - base.peak_memory_bytes[owner] == pytest.approx((1 + f) * shared * (1 - 1 / r))


def test_verify_takes_shard(tmp_path, capsys) -> None:
    """`verify --shard` checks a plan with its replicated stages sharded against its one-process
    reference; a kind that cannot shard is refused by name."""
    from torchpipedream.cli import main
    from torchpipedream.model.profiler import profile
    from torchpipedream.train.inputs import seeded_model

    names = profile(seeded_model("mlp", 0), torch.zeros(16, 1, 8, 8), warmup=0, iters=1).names
    half = len(names) // 2
    path = tmp_path / "plan.json"
    Plan(stages=[Stage(names[:half], replicas=2, ranks=[0, 1]), Stage(names[half:], replicas=2, ranks=[2, 3])],
         schedule="flush", microbatches=2).save(path)
    assert main(["verify", "--model", "mlp", "--workers", "4", "--schedule", "flush", "--shard", "zero2",
                 "--plan", str(path)]) == 0
    text = capsys.readouterr().out
    assert "2-2, stages 0, 1 sharded zero2" in text and text.count(": OK") == 1 and "MISMATCH" not in text
    assert main(["verify", "--shard"]) == 2
    assert "--shard zero3 runs under flush, gpipe, zb-h1 and zb-h2, not --schedule pipedream" in capsys.readouterr().err


def test_sharded_checkpoints_are_dcp_folders_that_load_without_running_code(results: dict, checkpoints: str,
                                                                           tmp_path) -> None:
    """A sharded stage's tensors are saved by its replicas with torch.distributed.checkpoint into
    stage<s>.dcp/ (listed in the manifest, nothing gathered in the stage file); the whole model
    reads back from them; a .metadata rewritten to run code (its checksum rewritten too) is
    refused by name, as a stage file that needs code is."""
    import json
    import pickle
    import shutil

    from torchpipedream.runtime.checkpoint import CheckpointError, read_stage_states, verify_checkpoint

    saved = tmp_path / "saved"
    shutil.copytree(f"{checkpoints}/sharded_to_straight", saved)
    manifest = json.loads((saved / "manifest.json").read_text())
    listed = {e["file"] for e in manifest["files"]}
    assert {"stage0.dcp/.metadata", "stage1.dcp/.metadata"} <= listed
    assert any(f.startswith("stage0.dcp/") and f.endswith(".distcp") for f in listed)
    assert torch.load(saved / "stage0.pt", weights_only=True)["tensors"] == {}
    whole = read_stage_states(saved)  # the two minibatches the first plan trained, in one process
    net = model()
    opt = optimizer("adam")(list(net.named_parameters()))
    for x, y in data()[:2]:
        opt.zero_grad()
        nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    assert set(whole) == set(net.state_dict())
    for key, value in net.state_dict().items():
        torch.testing.assert_close(whole[key], value, atol=2e-5, rtol=2e-5, msg=key)

    class Evil:
        def __reduce__(self):
            return (print, ("this ran",))

    evil = pickle.dumps(Evil())
    (saved / "stage0.dcp" / ".metadata").write_bytes(evil)
    for entry in manifest["files"]:
        if entry["file"] == "stage0.dcp/.metadata":
            import hashlib
            entry.update(sha256=hashlib.sha256(evil).hexdigest(), size=len(evil))
    (saved / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="stage0.dcp/.metadata was not loaded \\(loading runs no code\\): "
                                              "it names builtins.print"):
        verify_checkpoint(saved, load=True)
    with pytest.raises(CheckpointError, match="loading runs no code"):
        read_stage_states(saved)
