"""The launcher and the point-to-point layer across real processes (gloo, 2 workers each):
messages with changing shapes and long headers, errors that name the rank, and timeouts
that fail instead of hanging."""

from __future__ import annotations

import os
import re
import resource
import time

import pytest
import torch
import torch.distributed as dist

from torchpipedream.runtime import LaunchError, launch, liveness
from torchpipedream.runtime.comm import P2P, CommTimeout


def _describe(rank: int) -> str:
    return f"rank {rank} (stage {rank})"


def _messages() -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    msgs = [
        [torch.randn(4, 3, generator=g, requires_grad=True)],
        [torch.randn(2, 3, generator=g, requires_grad=True), torch.arange(6).reshape(2, 3)],
        [torch.randn(1, 2, 2, generator=g, requires_grad=True) for _ in range(12)],  # a long header
        [torch.randn(4, 3, generator=g, requires_grad=True)],  # back to the first shape
        [torch.randn(4, 3, generator=g, requires_grad=True)],  # same shape again: no resize
    ]
    targets = [torch.tensor([1, 2, 3, 4]), torch.tensor([0, 1]), torch.tensor([7]), torch.arange(4), torch.arange(4)]
    return msgs, targets


def p2p_worker(rank: int) -> list:
    """Rank 0 sends five messages whose shapes change and receives gradients; rank 1
    receives them (prefetched) and replies with 10 x the activations."""
    msgs, targets = _messages()
    ids = list(range(len(msgs)))
    if rank == 0:
        comm = P2P(0, _describe, act_order={}, grad_order={1: ids}, device=torch.device("cpu"), timeout_s=20)
        for i, (ts, y) in enumerate(zip(msgs, targets)):
            comm.send_acts(1, i, len(y), ts, [y])
        grads = [comm.recv_grads(1, i)[0] for i in ids]
        comm.finish()
        return [grads, comm.resizes]
    comm = P2P(1, _describe, act_order={0: ids}, grad_order={}, device=torch.device("cpu"), timeout_s=20)
    got = []
    for i in ids:
        samples, acts, passengers, nbytes = comm.recv_acts(0, i)
        comm.send_grads(0, i, [a * 10 for a in acts if a.requires_grad])
        got.append((samples, [a.detach().clone() for a in acts], [a.requires_grad for a in acts],
                    [p.clone() for p in passengers], nbytes))
    comm.finish()
    return got


def _messages_then_sockets(rank: int) -> tuple[list, list[str]]:
    """p2p_worker's exchange, then (rank 0) the addresses this launch's processes listen on."""
    return p2p_worker(rank), _listening_worker(rank)


@pytest.fixture(scope="module")
def healthy_run() -> list[tuple[list, list[str]]]:
    """One launch of 2 workers (spawning costs seconds on a 2-core machine) for the two tests
    that look at what a healthy run did: each rank's (p2p_worker's result, listening addresses)."""
    return launch(_messages_then_sockets, 2, timeout_s=60, return_all=True)


def test_messages_with_changing_shapes_and_long_headers(healthy_run):
    (grads, resizes), received = [messages for messages, _ in healthy_run]
    msgs, targets = _messages()
    assert [r[0] for r in received] == [4, 2, 1, 4, 4]
    for (samples, acts, rg, passengers, nbytes), sent, y in zip(received, msgs, targets):
        assert len(acts) == len(sent)
        for a, s in zip(acts, sent):
            assert torch.equal(a, s.detach()) and a.dtype == s.dtype
        assert rg == [s.is_floating_point() for s in sent]
        assert torch.equal(passengers[0], y)
        assert nbytes >= sum(s.numel() * s.element_size() for s in sent) + y.numel() * 8
    # The size is negotiated on the first message and again only when it changes.
    assert resizes == 4
    # Gradients come back for the tensors that require grad only, in the sender's order.
    for gr, sent in zip(grads, msgs):
        floats = [s for s in sent if s.is_floating_point()]
        assert len(gr) == len(floats)
        for a, s in zip(gr, floats):
            torch.testing.assert_close(a, s.detach() * 10)


def failing_worker(rank: int) -> None:
    if rank == 1:
        raise ValueError("bad thing on purpose")
    time.sleep(30)


def test_worker_exception_names_rank_and_kills_the_others():
    # rank 0 sleeps 30 s: it is killed once the grace after rank 1's failure is over (the
    # default 3 s is for a Pipeline's ranks to stop on their own; nothing here would use it)
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"(?s)rank 1.*bad thing on purpose"):
        launch(failing_worker, 2, timeout_s=60, failure_grace_s=0.5)
    assert time.monotonic() - start < 20


def starving_worker(rank: int) -> None:
    """Rank 1 expects activations that rank 0 never sends."""
    if rank == 1:
        comm = P2P(1, _describe, act_order={0: [0]}, grad_order={}, device=torch.device("cpu"), timeout_s=2)
        comm.recv_acts(0, 0)
    else:
        time.sleep(8)


def test_missing_message_times_out_naming_the_peer():
    with pytest.raises(LaunchError) as info:  # rank 0, asleep, is killed after a short grace
        launch(starving_worker, 2, timeout_s=60, failure_grace_s=0.5)
    text = str(info.value)
    assert CommTimeout.__name__ in text
    assert "rank 1 (stage 1) waited more than 2 s" in text and "from rank 0 (stage 0)" in text


def sleepy_worker(rank: int) -> None:
    time.sleep(60)


def test_launch_timeout_kills_workers():
    start = time.monotonic()
    with pytest.raises(LaunchError, match="did not finish within 3 s"):
        launch(sleepy_worker, 2, timeout_s=3)
    assert time.monotonic() - start < 15


def _sleep_then(seconds: float, rank: str | None, value: int) -> int:
    """Unpickled in a worker: sleeps first on ``rank`` (every rank if None), as a slow import would."""
    if rank is None or os.environ.get("RANK") == rank:
        time.sleep(seconds)
    return value


class SlowToStart:
    """An argument that makes the worker(s) of one rank slow to start: its unpickling sleeps,
    as a worker importing torch and the user's modules on a loaded machine does."""

    def __init__(self, seconds: float, rank: str | None = None) -> None:
        self.seconds, self.rank = seconds, rank

    def __reduce__(self):
        return _sleep_then, (self.seconds, self.rank, 7)


def slow_starter_worker(rank: int, value: int) -> tuple[int, int]:
    dist.barrier()  # the process group works once everyone has started
    liveness.mark()
    return rank, value


def test_a_slow_start_is_not_cut_short_by_the_communication_or_stall_deadlines():
    # Rank 1 takes 8 s to start, more than twice the process group's timeout and the stall
    # limit: its peer waits for it without a deadline of theirs (issue 39: `train --timeout 5`
    # killed healthy workers that were still importing torch).
    results = launch(slow_starter_worker, 2, SlowToStart(8.0, rank="1"), comm_timeout_s=3.0, stall_timeout_s=3.0,
                     startup_timeout_s=120, timeout_s=120, return_all=True)
    assert results == [(0, 7), (1, 7)]


def test_a_worker_that_never_starts_is_caught_by_the_startup_deadline():
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        launch(slow_starter_worker, 2, SlowToStart(300.0, rank="1"), startup_timeout_s=3, timeout_s=120)
    text = str(info.value)
    # rank 1 never starts; rank 0 may also be named on a loaded machine (3 s to import torch)
    assert re.search(r"worker rank\(s\) (0, )?1 did not start within 3 s \(the start-up deadline: "
                     r"--startup-timeout", text), text
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), True])
def test_launch_refuses_a_startup_timeout_it_cannot_use(value):
    with pytest.raises(ValueError, match="startup_timeout_s must be a positive number of seconds"):
        launch(slow_starter_worker, 2, 1, startup_timeout_s=value)


def _thp_mode() -> str:
    """The kernel's transparent-huge-page mode: "always", "madvise" or "never"."""
    try:
        text = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return "never"
    return text[text.index("[") + 1: text.index("]")]


def allocation_worker(rank: int) -> tuple[str | None, float]:
    """This worker's huge-page switch and the page faults of one fresh 64 MiB gradient-sized
    buffer (allocated, touched, freed; three times)."""
    torch.empty(4096 * 4096).fill_(1.0)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(3):
        torch.empty(4096 * 4096).fill_(1.0)
    faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 3
    return os.environ.get("THP_MEM_ALLOC_ENABLE"), faults


def test_workers_allocate_large_buffers_on_huge_pages(monkeypatch):
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    # fresh buffers each time (kept freed memory would serve them again without faults)
    env, faults = launch(allocation_worker, 1, timeout_s=60, keep_freed_memory=False)
    assert env == "1"
    assert "THP_MEM_ALLOC_ENABLE" not in os.environ  # the parent's environment is left as it was
    off_env, off_faults = launch(allocation_worker, 1, timeout_s=60, huge_pages=False, keep_freed_memory=False)
    assert off_env is None
    if _thp_mode() == "madvise":  # 16,384 faults on 4 KiB pages; a few hundred on 2 MiB pages
        assert faults < 4096 < off_faults, (faults, off_faults)


def test_launch_keeps_the_users_huge_page_setting(monkeypatch):
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    env, _ = launch(allocation_worker, 1, timeout_s=60)
    assert env == "0"


def test_prefer_huge_pages_sets_only_what_the_user_left_unset():
    from torchpipedream.host.huge_pages import prefer_huge_pages

    env: dict[str, str] = {}
    assert prefer_huge_pages(env) and env == {"THP_MEM_ALLOC_ENABLE": "1"}
    env = {"THP_MEM_ALLOC_ENABLE": "0"}
    assert not prefer_huge_pages(env) and env == {"THP_MEM_ALLOC_ENABLE": "0"}


def _listening_addresses(pids: list[int]) -> list[str]:
    """Local addresses of the TCP sockets in LISTEN state that ``pids`` hold (from /proc)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    found = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                found.append(fields[1].split(":")[0].rjust(width, "0"))
    return found


def _loopback(hex_address: str) -> bool:
    if len(hex_address) == 8:  # IPv4, little-endian: 0100007F is 127.0.0.1
        return hex_address[6:8] == "7F"
    return hex_address in ("00000000000000000000000001000000", "0000000000000000FFFF00000100007F")


def _listening_worker(rank: int) -> list[str]:
    time.sleep(0.5)  # every rank's process group is up
    parent = os.getppid()
    siblings = [int(p) for p in open(f"/proc/{parent}/task/{parent}/children").read().split()]
    return _listening_addresses([parent] + siblings) if rank == 0 else []


def test_a_local_run_listens_on_loopback_only(healthy_run):
    """The launcher's store and gloo's sockets accept no connection from another address."""
    addresses = healthy_run[0][1]
    assert addresses, "found no listening socket: the check would prove nothing"
    assert all(_loopback(a) for a in addresses), addresses


def test_a_rank_that_dies_on_its_way_out_is_reported_with_how_far_it_got(tmp_path) -> None:
    """A worker killed after returning its result (an abort in gloo's teardown, seen rarely)
    is reported with the last step it finished, so the report says where it died."""
    from torchpipedream.runtime.launcher import _root_cause

    (tmp_path / "phase_1.txt").write_text("had passed the final barrier")
    text = _root_cause({1: -6}, tmp_path, [])
    assert text == ("worker rank 1 exited with code -6 (killed by a signal if negative), "
                    "after it had passed the final barrier")
    assert _root_cause({0: -9}, tmp_path, []).endswith("(killed by a signal if negative)")


def test_a_script_without_a_main_guard_fails_naming_the_guard_even_with_large_arguments(tmp_path) -> None:
    """A script that calls launch() at its top level, with arguments larger than a pipe's
    buffer: each worker imports the script again (spawn) and fails before it starts. The call
    ends with an error naming the ``__main__`` guard, not a hang (before, the launching process
    waited for good writing the arguments to a worker that was gone)."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "no_guard.py"
    script.write_text(textwrap.dedent("""
        from torchpipedream.runtime import launch

        def f(rank, blob):
            return len(blob)

        print(launch(f, 2, b"x" * 300_000, timeout_s=60))
    """))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("torchpipedream.runtime.launcher.LaunchError: worker rank"), done.stderr[-2000:]
    assert "before it started" in last and '`if __name__ == "__main__":` guard' in last
