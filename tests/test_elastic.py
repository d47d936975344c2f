"""Training continues on fewer workers (issue 21): three torchrun agents (elastic, 2 to 3 nodes of
one process each, on this machine); after the first checkpoint one agent and its worker are
killed and never come back. The survivors restart, re-plan for 2 workers, load the newest
checkpoint onto the new plan and finish. The result is checked against one process: plain
training for flush (exact), and pipedream's rule for the chunks of ``--checkpoint-every``
minibatches each schedule runs, on 3 stages before the change and 2 after.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.func import functional_call

from torchpipedream.plans.plan import Plan
from torchpipedream.train import TrainConfig
from torchpipedream.train.inputs import build_model, load_data, minibatches, optimizer_factory

EPOCHS, PER_EPOCH, EVERY = 2, 20, 5
#: The rendezvous drops a node whose agent sent no keep-alive for interval × attempts seconds: the
#: survivors' new round waits that long after the kill (torch's default, 5 s × 3, made the round
#: 15 s). A live agent's heartbeat is at most about 2 intervals old (its timer sends one when the
#: last is an interval old), so 1 s × 10 leaves a live agent 8 s of slack, more than the default's
#: 5 s (10 s after the kill instead of 15).
RDZV_CONF = "last_call_timeout=2,join_timeout=90,keep_alive_interval=1,keep_alive_max_attempt=10"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    try:
        children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    except OSError:
        return []
    return [p for c in children for p in [int(c)] + _descendants(int(c))]


def _options(schedule: str) -> list[str]:
    return ["--model", "mlp", "--schedule", schedule, "--straight", "--epochs", str(EPOCHS), "--max-minibatches",
            str(PER_EPOCH), "--checkpoint-every", str(EVERY), "--optimizer", "momentum", "--lr", "0.05",
            "--microbatches", "2", "--no-progress", "--timeout", "30", "--failure-timeout", "3", "--keep-checkpoints", "0"]


def _elastic_run(out: Path, schedule: str) -> dict:
    """Three agents, one killed after the first checkpoint; returns the report and timings."""
    port = _free_port()
    agents = []
    for i in range(3):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2:3", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"elastic-{schedule}",
               "--max-restarts", "2", "--rdzv-conf", f"{RDZV_CONF},is_host={int(i == 0)}",
               "-m", "torchpipedream", "train", *_options(schedule), "--out", str(out)]
        agents.append(subprocess.Popen(cmd, stdout=open(out.parent / f"{out.name}_agent{i}.out", "w"),
                                       stderr=open(out.parent / f"{out.name}_agent{i}.err", "w"),
                                       env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True))
        time.sleep(0.3)  # the host agent first
    try:
        first = out / "checkpoints" / f"epoch_0_plus_{EVERY}_minibatches" / "manifest.json"
        t0 = time.monotonic()
        while not first.exists():
            assert time.monotonic() - t0 < 180, f"no checkpoint within 3 minutes:\n{_agent_logs(out)}"
            assert all(a.poll() is None for a in agents), \
                f"an agent ended before the first checkpoint:\n{_agent_logs(out)}"
            time.sleep(0.05)
        for pid in _descendants(agents[2].pid) + [agents[2].pid]:  # the worker, then its agent: gone for good
            os.kill(pid, signal.SIGKILL)
        killed, killed_wall = time.monotonic(), time.time()
        codes = [a.wait(timeout=240) for a in agents[:2]]
        finished = time.monotonic()
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
    assert codes == [0, 0], f"agents ended with {codes}:\n{_agent_logs(out)}"
    report = json.loads((out / "report.json").read_text())
    # Recovery: from the kill to the first checkpoint the job wrote after it (failure seen by
    # every worker, the agents' new rendezvous, re-profile and re-plan, reload, 5 minibatches).
    after = [m.stat().st_mtime for m in (out / "checkpoints").glob("*/manifest.json") if m.stat().st_mtime > killed_wall]
    print(f"{schedule}: one of 3 workers killed {killed - t0:.1f} s into the run; first checkpoint on 2 workers "
          f"{min(after) - killed_wall:.1f} s after the kill; the job finished {finished - killed:.1f} s after it")
    return report


def _agent_logs(out: Path, chars: int = 2500) -> str:
    """The end of every agent's stderr (pytest's temporary folders do not outlive CI: a failure's
    message must carry what explains it)."""
    parts = []
    for i in range(3):
        path = out.parent / f"{out.name}_agent{i}.err"
        text = path.read_text(errors="replace") if path.exists() else "(no log)"
        parts.append(f"--- agent {i}{' (killed)' if i == 2 else ''}, last {chars} characters of stderr:\n{text[-chars:]}")
    return "\n".join(parts)


def _config() -> TrainConfig:
    return TrainConfig(model="mlp", epochs=EPOCHS, max_minibatches=PER_EPOCH, optimizer="momentum", lr=0.05)


def _batches(cfg: TrainConfig) -> list[list]:
    x, y, _, _ = load_data(cfg)
    return [minibatches(x, y, cfg.batch_size, cfg.max_minibatches, cfg.seed * 1000 + e) for e in range(EPOCHS)]


def _plain_training() -> dict[str, torch.Tensor]:
    cfg = _config()
    model = build_model(cfg)
    opt = optimizer_factory(cfg)(model.parameters())
    for epoch in _batches(cfg):
        for x, y in epoch:
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _pipedream_rule(change_at: int, before: Plan, after: Plan) -> dict[str, torch.Tensor]:
    """Each schedule (a chunk of EVERY minibatches) starts from one version; in it, minibatch t
    of the chunk uses stage s's version base + max(0, t − (n − 1 − s)). ``change_at``: the
    global minibatch where the 2-stage plan took over."""
    cfg = _config()
    model = build_model(cfg)
    live = {k: nn.Parameter(v.detach().clone()) for k, v in model.named_parameters()}
    opt = optimizer_factory(cfg)(live.values())
    history = [{k: p.detach().clone() for k, p in live.items()}]

    def stage_of(plan: Plan, name: str) -> int:
        layer = "_" + name.split(".")[0]
        return next(s for s, st in enumerate(plan.stages) if layer in st.layers)

    step = 0
    for epoch in _batches(cfg):
        for t, (x, y) in enumerate(epoch):
            plan = before if step < change_at else after
            base, local = step - t % EVERY, t % EVERY
            params = {k: history[base + max(0, local - (plan.num_stages - 1 - stage_of(plan, k)))][k].clone()
                      .requires_grad_(True) for k in live}
            loss = nn.functional.cross_entropy(functional_call(model, params, (x,)), y)
            for p, g in zip(live.values(), torch.autograd.grad(loss, list(params.values()))):
                p.grad = g
            opt.step()
            history.append({k: p.detach().clone() for k, p in live.items()})
            step += 1
    return history[-1]


def _final_state(out: Path) -> dict[str, torch.Tensor]:
    return torch.load(out / "checkpoint.pt", weights_only=True)["state_dict"]


@pytest.mark.timeout(600)
def test_flush_continues_on_two_workers_exactly(tmp_path):
    out = tmp_path / "flush"
    report = _elastic_run(out, "flush")
    [change] = report["plan_changes"]
    assert change["from_config"] == "1-1-1" and change["to_config"] == "1-1"
    assert change["because"] == ["--workers 3 (now 2)"] and report["plan"] == "straight ×2"
    got, want = _final_state(out), _plain_training()
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-5, msg=k)


@pytest.mark.timeout(600)
def test_pipedream_continues_on_two_workers_by_its_rule(tmp_path):
    out = tmp_path / "pipedream"
    report = _elastic_run(out, "pipedream")
    [change] = report["plan_changes"]
    change_at = change["epoch"] * PER_EPOCH + change["minibatch"]
    three, two = Plan.straight(change["from_stages"]), Plan.straight(change["to_stages"])
    assert (three.num_stages, two.num_stages) == (3, 2)
    got = _final_state(out)
    want = _pipedream_rule(change_at, three, two)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-5, msg=k)
    assert max((got[k] - v).abs().max().item() for k, v in _plain_training().items() if k in got) > 1e-4
