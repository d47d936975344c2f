"""A process that used gloo ends without gloo's threads (runtime/process_exit.py): the import of
torchpipedream comes before ``init_process_group`` and keeps torch.distributed.nn's default
arguments from pinning the default group, so ``destroy_process_group`` joins the threads that
otherwise abort the process at exit now and then. Each case runs in a fresh interpreter (the
import order is the subject), one process with a world of one."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_SCRIPT = """
import json, os, sys, logging
import torch
import torch.distributed as dist
from torch import nn
logging.basicConfig(level=logging.WARNING)

def threads():
    return sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))

early = sys.argv[1] == "early"
if early:
    import torchpipedream as tpd
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
if not early:
    import torchpipedream as tpd
plan = tpd.Plan.straight([["_0", "_1", "_2"]], schedule="flush", microbatches=2)
pipe = tpd.Pipeline(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), plan,
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.CrossEntropyLoss())
pipe.fit([(torch.randn(4, 4), torch.randint(0, 2, (4,)))])
from torchpipedream.runtime.process_exit import default_group_pinned
pinned = default_group_pinned()
during = threads()
del pipe
dist.destroy_process_group()
print(json.dumps({"pinned": pinned, "during": during, "after": threads()}))
"""


def _run(order: str) -> tuple[dict, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, order], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads are read from /proc")
def test_gloo_threads_end_with_the_process_group_when_torchpipedream_comes_first() -> None:
    report, stderr = _run("early")
    assert "pt_gloo_runloop" in report["during"]  # the group had its threads
    assert not report["pinned"]
    assert report["after"] == ["python"], report  # destroy_process_group joined them
    assert "keep the default process group alive" not in stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="threads are read from /proc")
def test_imported_after_init_process_group_the_group_is_pinned_and_the_pipeline_says_so() -> None:
    report, stderr = _run("late")
    assert report["pinned"]
    assert "pt_gloo_runloop" in report["after"], report  # what aborts a process at exit, now and then
    assert "Import torchpipedream (or torch.distributed.nn) before calling init_process_group" in stderr
    assert stderr.count("keep the default process group alive") == 1  # once per process
