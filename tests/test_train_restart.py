"""`torchrun --max-restarts 1 ... torchpipedream train`: a worker killed mid-run is restarted
with the others and the job resumes from the newest checkpoint by itself; the final weights
equal an uninterrupted run's bit for bit (2 processes, gloo, the MLP on digits)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fault_injection.faults import fault_environment
from torchpipedream.runtime.launcher import free_port

ARGS = ["--model", "mlp", "--stages", "2", "--straight", "--schedule", "pipedream", "--optimizer", "momentum",
        "--lr", "0.01", "--epochs", "2", "--max-minibatches", "10", "--checkpoint-every", "4", "--no-progress",
        "--timeout", "30", "--failure-timeout", "5"]


def torchrun(out: Path, fault: str | None, *extra: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TORCHPIPEDREAM_FAULT", None)
    if fault:
        env = fault_environment(fault, env)
    # torchrun stops the survivors within one monitor interval of a worker's death: 1 s leaves the
    # survivor time to say why it stopped (at 0.2 s, on a loaded machine, SIGTERM came first)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
           "--monitor-interval", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           "-m", "torchpipedream", "train", *ARGS, *extra, "--out", str(out)]
    proc = subprocess.run(cmd, cwd=out.parent, env=env, capture_output=True, text=True, timeout=150)
    (out.parent / f"{out.name}.log").write_text(proc.stdout + proc.stderr)
    return proc


@pytest.mark.timeout(200)
def test_killed_worker_restarts_and_resumes_to_the_same_weights(tmp_path: Path) -> None:
    straight = torchrun(tmp_path / "straight", None)
    assert straight.returncode == 0, straight.stderr[-3000:]
    # Rank 1 is SIGKILLed in the forward of minibatch 15 (epoch 2, after the checkpoint at 14).
    # Same plan as the first run (planning from a fresh profile could cut elsewhere).
    killed = torchrun(tmp_path / "killed", "rank=1,minibatch=15,mode=kill", "--plan",
                      str(tmp_path / "straight" / "plan.json"))
    assert killed.returncode == 0, killed.stderr[-3000:]
    log = killed.stdout + killed.stderr
    # it really died (torchrun saw it first, or the survivor did and stopped first), and torchrun
    # restarted the group
    assert "injected fault (kill)" in log
    assert "exitcode: -9" in log or "rank 1 (stage 1) died or closed its connection" in log
    assert "resuming from" in log and "epoch_1_plus_4_minibatches" in log
    assert "resuming from" not in straight.stdout + straight.stderr
    # the survivor of the first attempt said in one line why it stopped, and where it stood,
    # unless torchrun stopped it first (SIGTERM: a race with torchrun's monitor, which no
    # process of ours can win every time on a loaded machine)
    said = "training failed: rank 0 (stage 0) stopped because the pipeline failed" in log
    assert said or "closing signal SIGTERM" in log
    assert not said or "Where the ranks stood: rank 0 (stage 0) was in s0" in log
    assert "Traceback" not in log

    a = torch.load(tmp_path / "straight" / "checkpoint.pt", weights_only=False)["state_dict"]
    b = torch.load(tmp_path / "killed" / "checkpoint.pt", weights_only=False)["state_dict"]
    assert a.keys() == b.keys() and a
    for key in a:
        assert torch.equal(a[key], b[key]), key
    ra = json.loads((tmp_path / "straight" / "report.json").read_text())["history"]
    rb = json.loads((tmp_path / "killed" / "report.json").read_text())["history"]
    assert [r["train_loss"] for r in ra] == [r["train_loss"] for r in rb]
    assert [r["test_accuracy"] for r in ra] == [r["test_accuracy"] for r in rb]


@pytest.mark.parametrize("argv, message", [
    (["--checkpoint-every", "0"], "--checkpoint-every must be a positive number of minibatches"),
    (["--failure-timeout", "0"], "--failure-timeout must be a positive number of seconds"),
    (["--startup-timeout", "0"], "--startup-timeout must be a positive number of seconds"),
    (["--startup-timeout", "inf"], "--startup-timeout must be a positive number of seconds"),
])
def test_bad_reliability_options_are_refused_before_any_worker_starts(argv, message, tmp_path: Path, capsys) -> None:
    from torchpipedream.cli import main

    rc = main(["train", "--out", str(tmp_path / "x"), "--no-progress", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()
