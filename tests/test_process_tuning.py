"""Process-wide tuning (malloc thresholds, huge pages) happens only in processes torchpipedream
owns: the command, launch()'s workers, the host measurements. A caller's process and
environment are left as they were unless the caller opts in."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from torchpipedream.host import freed_memory
from torchpipedream.host.huge_pages import HUGE_PAGES_ENV
from torchpipedream.runtime import launch

glibc_only = pytest.mark.skipif(freed_memory._glibc() is None, reason="mallopt is glibc's")

LIBRARY_USE = """
import os, sys
environment = dict(os.environ)
import torch, torchpipedream as tpd
sys.path.insert(0, TESTS)
from allocation_probe import faults_per_round
from torch import nn
from torchpipedream.host import freed_memory
from torchpipedream.cli import main
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
graph = tpd.profile(model, x, loss_fn=nn.CrossEntropyLoss(), target=y)
pipe = tpd.Pipeline(model, tpd.Plan.straight([graph.names]), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                    loss_fn=nn.CrossEntropyLoss(), tune_allocator=TUNE)
pipe.train_step((x, y))
assert main(["plan", "vgg16", "--topology", "A"]) == 0
changed = {k for k in set(os.environ) | set(environment) if os.environ.get(k) != environment.get(k)}
changed = {k for k in changed if not k.startswith("TORCHINDUCTOR_")}  # torch's own, set when inductor loads
print("RESULT", freed_memory._applied is not None, os.environ.get("THP_MEM_ALLOC_ENABLE"), faults_per_round(),
      not changed)
"""


def _clean_env() -> dict[str, str]:
    env = dict(os.environ)
    for name in (HUGE_PAGES_ENV, freed_memory.KEEP_FREED_MEMORY_ENV, "GLIBC_TUNABLES", *freed_memory._USER_VARIABLES):
        env.pop(name, None)
    return env


TESTS = repr(str(Path(__file__).resolve().parent))


def _result(code: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-c", code], env=_clean_env(), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split("RESULT", 1)[1].split()


@glibc_only
def test_profile_pipeline_and_cli_main_change_nothing_process_wide() -> None:
    tuned, huge_pages, _, environment_unchanged = _result(LIBRARY_USE.replace("TUNE", "False").replace("TESTS", TESTS))
    assert tuned == "False" and huge_pages == "None" and environment_unchanged == "True"
    # (page faults are no test here: glibc's own dynamic threshold may keep buffers too)


def test_only_freed_memory_calls_mallopt() -> None:
    import torchpipedream

    package = Path(torchpipedream.__file__).parent
    callers = sorted(str(p.relative_to(package)) for p in package.rglob("*.py") if "mallopt" in p.read_text())
    assert callers == ["host/freed_memory.py"]


@glibc_only
def test_pipeline_tunes_the_allocator_when_asked() -> None:
    tuned, huge_pages, faults, environment_unchanged = _result(LIBRARY_USE.replace("TUNE", "True").replace("TESTS", TESTS))
    assert tuned == "True" and huge_pages == "None" and environment_unchanged == "True"
    assert float(faults) < 50  # freed buffers are reused


@glibc_only
def test_the_command_tunes_its_own_process() -> None:
    code = ("import os, sys\n"
            "from torchpipedream.host import freed_memory\n"
            "from torchpipedream.cli import console_main\n"
            "sys.argv = ['torchpipedream', 'plan', 'vgg16', '--topology', 'A']\n"
            "assert console_main() == 0\n"
            "print('RESULT', freed_memory._applied is not None, os.environ.get('THP_MEM_ALLOC_ENABLE'))\n")
    assert _result(code) == ["True", "1"]


def initial_environment_worker(rank: int) -> tuple[str | None, str | None]:
    """The huge-page switch in this worker's environment at its start (/proc/self/environ, which
    later changes do not touch) and now."""
    with open("/proc/self/environ", "rb") as f:
        start = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    at_start = start.get(HUGE_PAGES_ENV.encode())
    return (at_start.decode() if at_start is not None else None), os.environ.get(HUGE_PAGES_ENV)


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="reads /proc")
def test_launch_sets_huge_pages_in_the_worker_not_in_the_callers_environment(monkeypatch) -> None:
    monkeypatch.delenv(HUGE_PAGES_ENV, raising=False)
    at_start, now = launch(initial_environment_worker, 1, timeout_s=60)
    assert (at_start, now) == (None, "1")  # not inherited from the caller: set in the worker itself
    assert HUGE_PAGES_ENV not in os.environ
