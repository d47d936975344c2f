"""Long runs that are never cut short, and no wait without a deadline (issue 24's cases).

The launcher's liveness, a worker stopped (SIGSTOP) while a checkpoint is written, ``--out``
checks, bounds on every numeric option, checkpoint retention, temporary files, a full disk,
manifests checked field by field, a file from another save, plans against the data flow, user
errors under torchrun, a killed rank 0, and a diverged loss in report.json.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

from fault_injection.faults import fault_environment
from torchpipedream.cli import main
from torchpipedream.plans.plan import Plan, PlanError
from torchpipedream.runtime import LaunchError, launch, latest_checkpoint, liveness
from torchpipedream.runtime.checkpoint import CheckpointError, read_manifest
from torchpipedream.runtime.launcher import free_port

CLI = [sys.executable, "-m", "torchpipedream", "train"]
QUICK = ["--model", "mlp", "--workers", "2", "--stages", "2", "--no-progress"]


# ------------------------------------------------------------------------------- the launcher
def busy_worker(rank: int, seconds: float) -> int:
    """Works (marks progress) for ``seconds``, longer than the launcher's stall timeout."""
    end = time.monotonic() + seconds
    steps = 0
    while time.monotonic() < end:
        time.sleep(0.05)
        liveness.mark()
        steps += 1
    return steps


def idle_worker(rank: int) -> None:
    time.sleep(60)


def test_a_working_run_longer_than_the_stall_timeout_is_never_cut_short() -> None:
    # A stall limit of seconds, not one: on a loaded 2-core machine a worker can wait over a
    # second for the CPU between its start and its first mark (a 1 s limit failed there). Each
    # worker works 4.5 s by its own clock, past the limit however fast or slow the machine.
    assert launch(busy_worker, 2, 4.5, stall_timeout_s=3.0) > 10


def test_a_run_that_makes_no_progress_is_stopped_and_named() -> None:
    t0 = time.monotonic()
    with pytest.raises(LaunchError, match=r"no worker made progress for 1 s .*rank 0 .*rank 1 .*were killed"):
        launch(idle_worker, 2, stall_timeout_s=1.0)
    assert time.monotonic() - t0 < 20


@pytest.mark.timeout(180)
def test_train_runs_longer_than_its_stall_limit_and_finishes(tmp_path: Path, capsys, monkeypatch) -> None:
    from torchpipedream.train import TrainConfig
    from torchpipedream.train.job import stall_timeout_s

    limit = stall_timeout_s(TrainConfig(timeout_s=2.0, failure_timeout_s=0.1))  # 7.3 s without progress
    # A healthy run longer than the limit on any machine: rank 1 sleeps before each training
    # forward (tests/fault_injection, inherited by the spawned workers), 40 × 0.2 s = 8 s in all
    # and never 2 s (--timeout) at a time.
    epochs, per_epoch, pause = 5, 8, 0.2
    assert epochs * per_epoch * pause > limit
    for key, value in fault_environment(f"rank=1,minibatch=0,mode=slow,seconds={pause}").items():
        monkeypatch.setenv(key, value)
    t0 = time.monotonic()
    rc = main(["train", *QUICK, "--epochs", str(epochs), "--max-minibatches", str(per_epoch), "--timeout", "2",
               "--failure-timeout", "0.1", "--out", str(tmp_path / "run")])
    assert rc == 0, capsys.readouterr().err
    assert time.monotonic() - t0 > limit  # longer than the limit, and never cut short
    assert len(list((tmp_path / "run" / "checkpoints").iterdir())) == 3  # --keep-checkpoints 3


def test_train_gives_start_up_its_own_deadline(tmp_path: Path, monkeypatch, capsys) -> None:
    """--startup-timeout reaches the launcher, apart from --timeout (issue 39: `train --timeout 5`
    killed workers still importing torch, because --timeout was also the start-up deadline)."""
    import torchpipedream.train.job as job

    seen = {}

    def fake_launch(fn, nprocs, *args, **kwargs):
        seen.update(kwargs)
        raise LaunchError("stopped by the test")

    monkeypatch.setattr(job, "launch", fake_launch)
    rc = main(["train", *QUICK, "--epochs", "1", "--max-minibatches", "1", "--timeout", "2",
               "--startup-timeout", "42", "--out", str(tmp_path / "run")])
    assert rc == 1 and "stopped by the test" in capsys.readouterr().err
    assert seen["startup_timeout_s"] == 42 and seen["comm_timeout_s"] == 2


# ------------------------------------------------------------------------------- deadlines
@pytest.mark.timeout(180)
def test_a_worker_stopped_during_a_checkpoint_save_ends_the_run_within_the_timeout(tmp_path: Path) -> None:
    timeout = 5
    env = fault_environment("rank=1,save=1,mode=stop", dict(os.environ, OMP_NUM_THREADS="1"))
    proc = subprocess.run([*CLI, *QUICK, "--epochs", "2", "--max-minibatches", "6", "--timeout", str(timeout),
                           "--out", str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=150)
    gone = time.time()
    assert proc.returncode == 1, proc.stderr[-3000:]
    stopped = re.search(r"FAULT-STOP pid=(\d+) time=([\d.]+)", proc.stdout + proc.stderr)
    assert stopped, proc.stdout[-2000:]
    pid, at = int(stopped.group(1)), float(stopped.group(2))
    elapsed = gone - at
    print(f"SIGSTOP during a checkpoint save -> every process gone in {elapsed:.1f} s (--timeout {timeout})")
    assert elapsed < timeout + 10
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the stopped worker was killed, not left behind
    assert "rank 1 (stage 1) did not" in proc.stderr and "checkpoint" in proc.stderr
    assert "Traceback" not in proc.stderr
    # where every rank stood (runtime/flight_recorder.py): the waiting rank's record, the stopped one's absence
    assert "Where every rank stood" in proc.stderr
    assert "rank 1: no report" in proc.stderr
    record = json.loads((tmp_path / "run" / "flight_record" / "rank0.json").read_text())
    assert record["current"]["what"] == "saving a checkpoint" and "PipelineFailure" in record["error"]


def _workers_of(pid: int) -> list[int]:
    """The pids of ``pid``'s launched workers (multiprocessing's spawned children, not its tracker)."""
    try:
        children = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    found = []
    for child in children:
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            found.append(child)
    return found


@pytest.mark.timeout(150)
def test_sigterm_to_train_stops_the_run_and_its_workers_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.Popen([*CLI, *QUICK, "--epochs", "100000", "--out", str(out)],
                            env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        while not any(out.glob("checkpoints/*/manifest.json")):  # a complete checkpoint, not one being written
            assert proc.poll() is None and time.monotonic() - t0 < 120, "no checkpoint within 2 minutes"
            time.sleep(0.1)
        workers = _workers_of(proc.pid)
        assert len(workers) == 2
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, err
    lines = err.strip().splitlines()
    assert lines[0] == "torchpipedream train: stopped by SIGTERM; its workers were stopped.", err
    assert len(lines) == 2 and "continue from it with --resume" in lines[1], err  # no C++ stacks, no traceback
    for pid in workers:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# ------------------------------------------------------------------------------- --out
def test_a_checkpoints_folder_that_cannot_take_checkpoints_is_refused_before_training(tmp_path: Path,
                                                                                    capsys) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").write_text("not a folder")  # found at once, not after the first epoch
    t0 = time.monotonic()
    assert main(["train", "--model", "mlp", "--no-progress", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "checkpoints" in err and "is a file" in err and len(err.strip().splitlines()) == 1
    assert time.monotonic() - t0 < 10
    assert (out / "checkpoints").read_text() == "not a folder"


def test_an_out_that_is_a_file_or_under_a_file_is_refused_at_once(tmp_path: Path, capsys) -> None:
    a_file = tmp_path / "f"
    a_file.write_text("x")
    for out in (a_file, a_file / "below"):
        t0 = time.monotonic()
        assert main(["train", "--model", "mlp", "--no-progress", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert "--out" in err and "file" in err and len(err.strip().splitlines()) == 1
        assert time.monotonic() - t0 < 10
    assert a_file.read_text() == "x"


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Run A (lr 0.05, 2 epochs, a checkpoint every 3 minibatches) into ``a``; run B (lr 0.1,
    1 epoch) into ``b``; both on one plan file."""
    from torchpipedream.model.profiler import profile
    from torchpipedream.train import TrainConfig
    from torchpipedream.train.inputs import build_model, load_data, loss_for

    root = tmp_path_factory.mktemp("runs")
    cfg = TrainConfig(model="mlp")
    x, y, _, _ = load_data(cfg)
    names = profile(build_model(cfg), x[:4], loss_fn=loss_for(cfg), target=y[:4]).names
    Plan.straight([names[:2], names[2:]]).save(root / "plan.json")
    common = ["--model", "mlp", "--workers", "2", "--no-progress", "--max-minibatches", "6", "--timeout", "60",
              "--plan", str(root / "plan.json")]
    assert main(["train", *common, "--epochs", "2", "--lr", "0.05", "--checkpoint-every", "3",
                 "--keep-checkpoints", "0", "--out", str(root / "a")]) == 0
    assert main(["train", *common, "--epochs", "1", "--lr", "0.1", "--out", str(root / "b")]) == 0
    return root, common


def test_a_second_run_into_the_same_out_is_refused_unless_resume_or_overwrite(two_runs, capsys) -> None:
    root, common = two_runs
    before = (root / "b" / "report.json").read_text()
    assert main(["train", *common, "--epochs", "1", "--lr", "0.1", "--out", str(root / "b")]) == 2
    err = capsys.readouterr().err
    assert "holds another run" in err and "--resume" in err and "--overwrite" in err
    assert (root / "b" / "report.json").read_text() == before  # nothing overwritten


def test_overwrite_replaces_the_earlier_run(two_runs, tmp_path: Path, capsys) -> None:
    root, common = two_runs
    out = tmp_path / "b"
    shutil.copytree(root / "b", out)
    (out / "notes.txt").write_text("mine")
    assert main(["train", *common, "--epochs", "1", "--lr", "0.05", "--overwrite", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["lr"] == 0.05 and (out / "notes.txt").read_text() == "mine"


def test_overwrite_reads_the_plan_of_the_earlier_run_before_deleting_it(two_runs, tmp_path: Path, capsys) -> None:
    # Issue 39: `train --plan runs/train/plan.json --overwrite` (the README's way to reproduce a
    # run, with the default --out) deleted the earlier run and then failed "--plan: ... no such file".
    root, common = two_runs
    out = tmp_path / "b"
    shutil.copytree(root / "b", out)
    own = [a for a in common if a not in ("--plan", str(root / "plan.json"))]
    plan_before = Plan.load(out / "plan.json")
    assert main(["train", *own, "--epochs", "1", "--lr", "0.05", "--plan", str(out / "plan.json"), "--overwrite",
                 "--out", str(out)]) == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert report["config"]["lr"] == 0.05 and report["config"]["plan_file"] == str(out / "plan.json")
    assert Plan.load(out / "plan.json").same_layout(plan_before)


def test_overwrite_reads_init_from_the_earlier_run_before_deleting_anything(two_runs, tmp_path: Path,
                                                                            capsys) -> None:
    # Issue 39: `train --init runs/train/checkpoint.pt --overwrite` deleted the earlier run and
    # then failed. That file is not a state dict (`export` writes one): refused, nothing deleted.
    root, common = two_runs
    out = tmp_path / "b"
    shutil.copytree(root / "b", out)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    assert main(["train", *common, "--epochs", "1", "--init", str(out / "checkpoint.pt"), "--overwrite",
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--init {out / 'checkpoint.pt'}" in err and "torchpipedream export" in err  # what to run instead
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    # a state dict among the earlier run's outputs is read, then the run replaces them
    torch.save(torch.load(out / "checkpoint.pt", weights_only=False)["state_dict"], out / "checkpoint.pt")
    assert main(["train", *common, "--epochs", "1", "--init", str(out / "checkpoint.pt"), "--overwrite",
                 "--out", str(out)]) == 0, capsys.readouterr().err
    assert json.loads((out / "report.json").read_text())["config"]["init"] == str(out / "checkpoint.pt")


def test_overwrite_refuses_an_input_inside_the_checkpoints_it_deletes(two_runs, tmp_path: Path, capsys) -> None:
    root, common = two_runs
    out = tmp_path / "b"
    shutil.copytree(root / "b", out)
    inside = out / "checkpoints" / "weights.pt"
    shutil.copy(out / "checkpoint.pt", inside)
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    assert main(["train", *common, "--epochs", "1", "--init", str(inside), "--overwrite", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--init {inside} is inside {out / 'checkpoints'}, which --overwrite deletes" in err, err
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before  # nothing deleted


def test_a_run_locks_its_out_and_a_second_run_is_refused_naming_the_first(tmp_path: Path, capsys) -> None:
    # Issue 39: two `train` runs on one --out both exited 0, the second overwriting the first.
    from torchpipedream.train.out_dir import LOCK_FILE, lock_out_dir

    out = tmp_path / "run"
    argv = ["train", *QUICK, "--epochs", "1", "--max-minibatches", "1", "--out", str(out)]
    held = lock_out_dir(out)  # a run in progress (this process stands for it)
    try:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"--out {out} is in use by another run (process {os.getpid()})" in err, err
        assert err.count("\n") == 1 and not (out / "report.json").exists()
    finally:
        held.release()
    assert not out.exists()  # the lock alone made the directory: removed with it
    assert main(argv) == 0, capsys.readouterr().err  # released: the next run goes ahead
    assert (out / "report.json").exists() and (out / LOCK_FILE).exists()


LOCK_HOLDER = """
import sys, time
from torchpipedream.train.out_dir import lock_out_dir
lock = lock_out_dir(sys.argv[1])
print("locked", flush=True)
time.sleep(120)
"""


def test_the_lock_on_out_is_released_when_its_process_dies(tmp_path: Path, capsys) -> None:
    from torchpipedream.train.out_dir import lock_out_dir

    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(Exception, match=rf"in use by another run \(process {holder.pid}\)"):
            lock_out_dir(out)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    lock_out_dir(out).release()  # SIGKILL released it: no stale lock to clear by hand


def test_resume_takes_the_newest_checkpoint_of_the_same_options_and_says_which(two_runs, tmp_path: Path,
                                                                                  caplog) -> None:
    root, common = two_runs
    out = tmp_path / "a"
    shutil.copytree(root / "a", out)
    # A newer checkpoint of another run (lr 0.1) lands in a's checkpoints: it must be skipped.
    intruder = out / "checkpoints" / "zz_other"
    shutil.copytree(root / "b" / "checkpoints" / "epoch_1", intruder)
    manifest = json.loads((intruder / "manifest.json").read_text())
    manifest["created_unix"] += 1e6
    (intruder / "manifest.json").write_text(json.dumps(manifest))
    shutil.copy(root / "plan.json", tmp_path / "same_plan_elsewhere.json")  # --plan is compared by content
    args = [a if a != str(root / "plan.json") else str(tmp_path / "same_plan_elsewhere.json") for a in common]
    with caplog.at_level(logging.WARNING, logger="torchpipedream"):
        assert main(["train", *args, "--epochs", "3", "--lr", "0.05", "--checkpoint-every", "3",
                     "--keep-checkpoints", "0", "--resume", "--out", str(out)]) == 0
    text = caplog.text
    assert "skipping checkpoint" in text and "zz_other" in text and "--lr 0.1" in text
    assert f"resuming from {out / 'checkpoints' / 'epoch_2'}" in text


def test_resume_onto_another_plan_continues_and_reports_the_change(two_runs, tmp_path: Path, capsys) -> None:
    root, common = two_runs
    out = tmp_path / "a"
    shutil.copytree(root / "a", out)
    plan = Plan.load(root / "plan.json")
    other = Plan.straight([plan.stages[0].layers[:1], plan.stages[0].layers[1:] + plan.stages[1].layers])
    other.save(tmp_path / "other.json")
    args = [a if a != str(root / "plan.json") else str(tmp_path / "other.json") for a in common]
    assert main(["train", *args, "--epochs", "3", "--lr", "0.05", "--checkpoint-every", "3",
                 "--keep-checkpoints", "0", "--resume", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    [change] = report["plan_changes"]
    assert change["epoch"] == 2 and change["minibatch"] == 0
    assert change["from_stages"] == [list(st.layers) for st in plan.stages]
    assert change["to_stages"] == [list(st.layers) for st in other.stages]
    assert any("--plan" in why and "another plan" in why for why in change["because"])
    console = capsys.readouterr().out
    line = next(ln for ln in console.splitlines() if ln.startswith("plan change"))
    a, b = len(plan.stages[0].layers), len(plan.stages[1].layers)
    assert "at epoch 2" in line and f"layers per stage {a}|{b}) -> straight ×2 (1-1; layers per stage 1|{a + b - 1})" in line
    final = json.loads((out / "checkpoints" / "epoch_3" / "manifest.json").read_text())
    assert [st["layers"] for st in final["plan"]["stages"]] == [list(st.layers) for st in other.stages]


def test_resume_refuses_an_option_outside_the_plan_and_names_it(two_runs, tmp_path: Path, capsys) -> None:
    root, common = two_runs
    out = tmp_path / "a"
    shutil.copytree(root / "a", out)
    assert main(["train", *common, "--epochs", "3", "--lr", "0.2", "--checkpoint-every", "3",
                 "--keep-checkpoints", "0", "--resume", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no checkpoint" in err and "--lr 0.05 (now 0.2)" in err and "Traceback" not in err
    assert not (out / "checkpoints" / "epoch_3").exists()


def test_resume_refuses_a_checkpoint_of_another_model_before_any_worker_starts(two_runs, tmp_path: Path,
                                                                               monkeypatch, capsys) -> None:
    """The model's code changed since the checkpoint was written (a wider hidden layer): the
    run says which tensor differs, in one line, before it launches anything."""
    import torchpipedream.train.job as job
    from torchpipedream.models.vision import mlp
    from torchpipedream.train import inputs

    root, common = two_runs
    out = tmp_path / "a"
    shutil.copytree(root / "a", out)
    monkeypatch.setattr(inputs, "get_model", lambda name: mlp(hidden=(256, 300)))
    monkeypatch.setattr(job, "launch", lambda *a, **k: pytest.fail("launched workers for a checkpoint of another model"))
    assert main(["train", *common, "--epochs", "3", "--lr", "0.05", "--checkpoint-every", "3",
                 "--keep-checkpoints", "0", "--resume", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--resume: the checkpoint" in err and "written for another model" in err, err
    assert "3.bias is (256,) in the checkpoint and (300,) in this model" in err, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------------------- bounds
@pytest.mark.parametrize("argv, message", [
    (["--workers", "1000"], "--workers 1000 would need about"),
    (["--timeout", "-5"], "--timeout must be a positive number of seconds"),
    (["--timeout", "0"], "--timeout must be a positive number of seconds"),
    (["--timeout", "inf"], "--timeout must be a positive number of seconds"),
    (["--max-minibatches", "0"], "--max-minibatches must be a positive number of minibatches"),
    (["--max-minibatches", "-3"], "--max-minibatches must be a positive number of minibatches"),
    (["--keep-checkpoints", "-1"], "--keep-checkpoints must be an integer >= 0"),
    (["--workers", "-2"], "--workers must be an integer >= 0"),
    (["--topology", "4x:fast"], "--topology 4x:fast"),
    (["--resume", "--overwrite"], "give one of them"),
    (["--schedule", "auto", "--vertical-sync"], "--vertical-sync applies to pipedream only"),
    (["--allow-stale"], "--allow-stale lets --schedule auto choose"),
    (["--precision", "fp16"], "(flush, gpipe, or auto without --allow-stale), not --schedule pipedream"),
    (["--precision", "fp16", "--schedule", "auto", "--allow-stale"], "not --schedule auto --allow-stale"),
    (["--memory", "lots"], "--memory 'lots'"),
    (["--memory", "0MB"], "--memory '0MB': memory size must be > 0"),
    (["--seed", str(2**70)], f"--seed must be an integer between -2**53 and 2**53 (exclusive), got {2**70}"),
    (["--seed", str(-2**53)], "--seed must be an integer between -2**53 and 2**53"),
])
def test_bad_numbers_are_refused_before_anything_starts(argv, message, tmp_path: Path, capsys, monkeypatch) -> None:
    import torchpipedream.model.profiler as profiler

    monkeypatch.setattr(profiler, "profile", lambda *a, **k: pytest.fail("profiled before the options were checked"))
    t0 = time.monotonic()
    assert main(["train", "--model", "mlp", "--no-progress", "--out", str(tmp_path / "x"), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert time.monotonic() - t0 < 10 and not (tmp_path / "x").exists()


def test_a_plan_against_the_data_flow_is_refused_before_launch(two_runs, tmp_path: Path, capsys) -> None:
    root, common = two_runs
    plan = Plan.load(root / "plan.json")
    reversed_plan = Plan.straight([plan.stages[1].layers, plan.stages[0].layers])
    reversed_plan.save(tmp_path / "reversed.json")
    args = [a if a != str(root / "plan.json") else str(tmp_path / "reversed.json") for a in common]
    assert main(["train", *args, "--epochs", "1", "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "earlier stage" in err and "Traceback" not in err
    with pytest.raises(PlanError, match="feeds layer"):
        reversed_plan.validate(edges=[(plan.stages[0].layers[-1], plan.stages[1].layers[0])])


@pytest.mark.parametrize("mutate, message", [
    (lambda p: p["stages"][0].update(ranks=["0"]), "ranks must be a list of integers"),
    (lambda p: p["stages"][0].update(layers="abc"), "layers must be a list of layer names"),
    (lambda p: p.update(microbatches="4"), "'microbatches' has the wrong type"),
    (lambda p: p.update(predicted=[1]), "'predicted' has the wrong type"),
])
def test_wrongly_typed_plan_fields_are_one_clear_error(tmp_path: Path, mutate, message) -> None:
    data = Plan.straight([["a"], ["b"]]).to_dict()
    mutate(data)
    (tmp_path / "p.json").write_text(json.dumps(data))
    with pytest.raises(PlanError, match=message):
        Plan.load(tmp_path / "p.json")


# ------------------------------------------------------------------------------- disk
def test_retention_keeps_the_newest_and_the_newest_epoch_end(two_runs, tmp_path: Path) -> None:
    from torchpipedream.train.out_dir import prune_checkpoints

    root, _ = two_runs
    shutil.copytree(root / "a" / "checkpoints", tmp_path / "c")
    before = sorted(p.name for p in (tmp_path / "c").iterdir())
    assert before == ["epoch_0_plus_3_minibatches", "epoch_1", "epoch_1_plus_3_minibatches", "epoch_2"]
    newest = latest_checkpoint(tmp_path / "c")
    assert newest is not None and newest.name == "epoch_2"
    deleted = prune_checkpoints(tmp_path / "c", keep=1)
    assert sorted(p.name for p in deleted) == ["epoch_0_plus_3_minibatches", "epoch_1", "epoch_1_plus_3_minibatches"]
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["epoch_2"]
    assert prune_checkpoints(tmp_path / "c", keep=0) == []


def test_leftover_temporary_files_are_removed_at_start(two_runs, tmp_path: Path) -> None:
    from torchpipedream.train import TrainConfig
    from torchpipedream.train.out_dir import prepare_out_dir

    root, _ = two_runs
    out = tmp_path / "a"
    shutil.copytree(root / "a", out)
    leftover = out / "checkpoints" / "epoch_1" / ".stage0.pt.tmp-4242"
    leftover.write_bytes(b"half a file")
    prepare_out_dir(TrainConfig(out=str(out), resume=True))
    assert not leftover.exists() and (out / "checkpoints" / "epoch_1" / "stage0.pt").exists()


def test_a_full_disk_is_one_line_and_leaves_no_temporary_file(tmp_path: Path, monkeypatch) -> None:
    from torchpipedream.runtime import Pipeline

    torch.manual_seed(0)
    pipe = Pipeline(nn.Sequential(nn.Linear(4, 3)), Plan.straight([["input_1", "_0"]]),
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.CrossEntropyLoss())
    pipe.train_step((torch.randn(8, 4), torch.randint(0, 3, (8,))))

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(CheckpointError, match=r"no space left on the device of .* while writing stage0\.pt"):
        pipe.save_checkpoint(tmp_path / "ckpt")
    assert not [p for p in (tmp_path / "ckpt").iterdir() if ".tmp-" in p.name]


def test_a_full_disk_at_the_outputs_is_one_line_and_they_can_be_written_again(two_runs, tmp_path: Path,
                                                                                monkeypatch, capsys) -> None:
    import torchpipedream.runtime.checkpoint as checkpoint

    root, common = two_runs
    out = tmp_path / "b"
    shutil.copytree(root / "b", out)
    for name in ("report.json", "timeline.png"):
        (out / name).unlink()
    real = checkpoint.write_atomic

    def full(path: Path, data: bytes) -> None:
        if path.name == "timeline.png":
            raise OSError(errno.ENOSPC, f"no space left on the device of {path.parent} while writing {path.name}")
        real(path, data)

    monkeypatch.setattr(checkpoint, "write_atomic", full)
    assert main(["train", *common, "--epochs", "1", "--lr", "0.1", "--resume", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no space left" in err and "--resume" in err and len(err.strip().splitlines()) == 1
    monkeypatch.setattr(checkpoint, "write_atomic", real)
    assert main(["train", *common, "--epochs", "1", "--lr", "0.1", "--resume", "--out", str(out)]) == 0
    again = json.loads((out / "report.json").read_text())
    assert again["history"] == json.loads((root / "b" / "report.json").read_text())["history"]
    assert (out / "timeline.png").exists()


# ------------------------------------------------------------------------------- manifests, save ids
@pytest.mark.parametrize("mutate, why", [
    (lambda m: m.pop("plan"), "field 'plan' must be dict"),
    (lambda m: m.update(created_unix="yesterday"), "field 'created_unix' must be int or float"),
    (lambda m: m["files"].append({"file": "../x", "sha256": "0", "size": 1}), "not a file of this directory"),
])
def test_a_malformed_manifest_is_skipped_with_a_warning(two_runs, tmp_path: Path, mutate, why, caplog) -> None:
    root, _ = two_runs
    good, bad = tmp_path / "good", tmp_path / "bad"
    shutil.copytree(root / "a" / "checkpoints" / "epoch_1", good)
    shutil.copytree(root / "a" / "checkpoints" / "epoch_2", bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    mutate(manifest)
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with caplog.at_level(logging.WARNING):
        assert latest_checkpoint(tmp_path) == good
    assert "skipping checkpoint" in caplog.text and str(bad) in caplog.text and why in caplog.text


def test_a_stage_file_from_another_save_is_refused(two_runs, tmp_path: Path) -> None:
    from torchpipedream.runtime.checkpoint import read_stage_states

    root, _ = two_runs
    mixed = tmp_path / "mixed"
    shutil.copytree(root / "a" / "checkpoints" / "epoch_2", mixed)
    donor = root / "a" / "checkpoints" / "epoch_1"
    shutil.copy(donor / "stage1.pt", mixed / "stage1.pt")  # with its manifest entry copied too
    mine, theirs = json.loads((mixed / "manifest.json").read_text()), read_manifest(donor)
    entry = next(e for e in theirs.files if e["file"] == "stage1.pt")
    mine["files"] = [entry if e["file"] == "stage1.pt" else e for e in mine["files"]]
    (mixed / "manifest.json").write_text(json.dumps(mine))
    with pytest.raises(CheckpointError, match=r"stage1\.pt belongs to another save"):
        read_stage_states(mixed)


# ------------------------------------------------------------------------------- torchrun, rank 0, NaN
@pytest.mark.timeout(180)
def test_a_user_error_under_torchrun_is_reported_once_and_not_retried(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "2",
           "--monitor-interval", "0.2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           "-m", "torchpipedream", "train", "--model", "nosuchpkg.x:build", "--no-progress",
           "--out", str(tmp_path / "run")]
    proc = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                          timeout=150)
    assert proc.returncode != 0
    assert proc.stderr.count("cannot import module 'nosuchpkg.x'") == 1, proc.stderr[-3000:]
    assert "terminate called" not in proc.stderr


@pytest.mark.timeout(120)
def test_a_killed_rank_0_ends_in_the_projects_message_not_cpp_frames(tmp_path: Path) -> None:
    env = fault_environment("rank=0,minibatch=5,mode=kill", dict(os.environ, OMP_NUM_THREADS="1"))
    proc = subprocess.run([*CLI, *QUICK, "--epochs", "1", "--max-minibatches", "20", "--timeout", "10",
                           "--out", str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 1
    assert "worker rank 0 exited with code -9" in proc.stderr
    assert "frame #" not in proc.stderr and "Exception raised from" not in proc.stderr
    # the message, a heading and one line per rank of where it stood, the resume hint
    assert len(proc.stderr.strip().splitlines()) <= 5 + 3, proc.stderr
    assert "  rank 0: no report" in proc.stderr and "  rank 1 (stage 1) was " in proc.stderr


@pytest.mark.timeout(120)
def test_a_diverged_loss_is_null_in_report_json_with_a_warning(tmp_path: Path, capfd) -> None:
    out = tmp_path / "run"
    assert main(["train", *QUICK, "--epochs", "1", "--max-minibatches", "10", "--lr", "1e8", "--optimizer", "sgd",
                 "--out", str(out)]) == 0
    captured = capfd.readouterr()  # the warning comes from rank 0's process
    assert "diverged" in captured.err + captured.out

    def no_constants(name: str) -> None:
        raise ValueError(f"report.json holds {name}, which is not JSON")

    report = json.loads((out / "report.json").read_text(), parse_constant=no_constants)
    assert report["history"][0]["train_loss"] is None


def test_a_user_error_marker_of_an_earlier_job_is_not_read_by_a_later_one(tmp_path: Path) -> None:
    """`--rdzv-id` is reused by later jobs: only a marker written since this job's agent
    started stops a restart."""
    from torchpipedream.train.job import reported_by_this_job

    marker = tmp_path / "torchpipedream-job-user-error.txt"
    assert not reported_by_this_job(marker, time.time())  # none written
    marker.write_text("--lr must be a positive number")
    now = time.time()
    os.utime(marker, (now - 3600, now - 3600))  # an hour old: another job's
    assert not reported_by_this_job(marker, now - 60)
    os.utime(marker, (now - 30, now - 30))  # written by this job's first attempt
    assert reported_by_this_job(marker, now - 60)


def test_checkpoints_written_before_an_option_existed_resume_with_its_default(two_runs, tmp_path: Path,
                                                                               caplog) -> None:
    """A checkpoint whose saved options lack those added since (recompute, precision,
    allow_stale) resumes: the older run had their defaults; nothing is re-planned."""
    import hashlib

    root, common = two_runs
    out = tmp_path / "a"
    shutil.copytree(root / "a", out)
    edited = 0
    for extra in (out / "checkpoints").rglob("extra.json"):  # as an older version wrote them
        data = json.loads(extra.read_text())
        for key in ("recompute", "precision", "allow_stale"):
            data["extra"]["config"].pop(key)
        raw = json.dumps(data).encode()
        extra.write_bytes(raw)
        manifest_path = extra.parent / "manifest.json"
        manifest = json.loads(manifest_path.read_text())
        entry = next(e for e in manifest["files"] if e["file"] == "extra.json")
        entry.update(size=len(raw), sha256=hashlib.sha256(raw).hexdigest())
        manifest_path.write_text(json.dumps(manifest))
        edited += 1
    assert edited, "no saved options found to edit"
    with caplog.at_level(logging.WARNING, logger="torchpipedream"):
        assert main(["train", *common, "--epochs", "3", "--lr", "0.05", "--checkpoint-every", "3",
                     "--keep-checkpoints", "0", "--resume", "--out", str(out)]) == 0
    assert "skipping checkpoint" not in caplog.text and "another plan" not in caplog.text
    assert f"resuming from {out / 'checkpoints' / 'epoch_2'}" in caplog.text


def test_memory_is_checked_against_a_given_plan(two_runs, tmp_path: Path, capsys) -> None:
    # Issue 39: `--memory` was ignored with `--plan` (a 5 MB budget accepted for a plan predicted
    # at 10.8 MB). Now every stage's prediction is held against it, and a plan without one refused.
    import torchpipedream as tpd
    from torchpipedream.train import TrainConfig
    from torchpipedream.train.inputs import build_model, load_data, loss_for
    from torchpipedream.train.preparation import _check_fits_memory

    root, common = two_runs
    cfg = TrainConfig(model="mlp")
    x, y, _, _ = load_data(cfg)
    graph = tpd.profile(build_model(cfg), x[:32], loss_fn=loss_for(cfg), target=y[:32])
    planned = tpd.plan(graph, tpd.Topology.local(2), straight=True, schedule="pipedream")
    planned.save(tmp_path / "planned.json")
    need = max(planned.stage_memory_bytes(s) for s in range(len(planned.stages)))
    args = [a if a != str(root / "plan.json") else str(tmp_path / "planned.json") for a in common]
    assert main(["train", *args, "--epochs", "1", "--memory", "1kB", "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "--memory 1kB" in err and "is predicted to need" in err and "Traceback" not in err
    assert not (tmp_path / "m" / "report.json").exists()
    _check_fits_memory(TrainConfig(model="mlp", memory=f"{int(need * 4)}B"), planned, "--plan planned.json")
    assert main(["train", *common, "--epochs", "1", "--memory", "10GB", "--out", str(tmp_path / "n")]) == 2
    assert "has no memory prediction" in capsys.readouterr().err  # Plan.straight has no activation terms
