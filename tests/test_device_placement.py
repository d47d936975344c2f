"""Where the runtime puts things, checked without a GPU: messages staged through a wire device
(torch's "meta" device stands in for a GPU), the one backend rule, the default compute device,
and the action clock's two ways of timing."""

from __future__ import annotations

import collections
import time

import pytest
import torch
import torch.distributed as dist

from torchpipedream.runtime import devices
from torchpipedream.runtime.action_clock import ActionClock, event_seconds
from torchpipedream.runtime.comm import P2P, CommError, _GradRecv, pack, post_recv, post_send, unpack

META, CPU = torch.device("meta"), torch.device("cpu")


# --------------------------------------------------------------------------- wire vs compute device
def test_unpack_moves_received_tensors_to_the_compute_device_as_leaves():
    x = torch.randn(3, 4, requires_grad=True)
    ids = torch.arange(3)
    buf = pack(5, [x, 7, ids], [torch.tensor([1.0, 2.0])], CPU)  # the wire: host memory
    samples, acts, passengers, _ = unpack(buf, META)
    assert samples == 5 and acts[1] == 7
    a, i = acts[0], acts[2]
    assert a.device.type == "meta" and i.device.type == "meta" and passengers[0].device.type == "meta"
    assert a.shape == (3, 4) and a.dtype == torch.float32 and i.dtype == torch.int64
    # leaves of the receiving stage's graph, on its device: .grad lands on them
    assert a.requires_grad and a.is_leaf and not i.requires_grad
    (a * 2).sum().backward()
    assert a.grad is not None and a.grad.device.type == "meta"


def test_unpack_on_another_device_rebuilds_nested_values():
    h = torch.randn(2, 3, requires_grad=True)
    buf = pack(2, [(torch.randn(2, 4, requires_grad=True), (h, torch.randn(1, 2, 3)))], [{"y": torch.arange(2)}], CPU)
    _, acts, passengers, _ = unpack(buf, META)
    out, (h2, c2) = acts[0]
    assert {t.device.type for t in (out, h2, c2, passengers[0]["y"])} == {"meta"}
    assert out.requires_grad and out.is_leaf and h2.requires_grad and h2.is_leaf and not c2.requires_grad
    assert h2.shape == (2, 3) and passengers[0]["y"].shape == (2,)


def test_unpack_on_the_wire_device_keeps_views_of_the_buffer():
    buf = pack(1, [torch.randn(4)], [], CPU)
    _, acts, _, _ = unpack(buf)
    assert acts[0].untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()


def _p2p(device: torch.device, wire: torch.device | None) -> P2P:
    return P2P(0, str, {}, {}, device, 1.0, wire_device=wire)


def test_p2p_keeps_one_device_when_wire_and_compute_agree():
    comm = _p2p(CPU, None)
    assert comm.wire_device == CPU and comm._to_compute is None
    assert _p2p(CPU, CPU)._to_compute is None


def test_p2p_returns_received_gradients_on_the_compute_device():
    """A gradient receive lands in a wire-device tensor and comes back on the compute device."""
    comm = _p2p(META, CPU)
    assert comm.wire_device == CPU and comm._to_compute == META

    class Done:
        def wait(self, timeout=None):
            return True

    comm._grad_posted[1] = collections.deque([_GradRecv(4, [Done()], [torch.randn(2, 3)], 24)])
    grads, nbytes = comm.recv_grads(1, 4)
    assert nbytes == 24 and grads[0].device.type == "meta" and grads[0].shape == (2, 3)


def test_wire_device_is_the_host_with_gloo_only():
    cuda = torch.device("cuda", 0)
    assert devices.wire_device("gloo", cuda) == CPU
    assert devices.wire_device("gloo", CPU) == CPU
    assert devices.wire_device("nccl", cuda) == cuda


@pytest.fixture
def gloo_group():
    """A one-process gloo group (in memory), destroyed after the test."""
    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_gloo_refuses_a_tensor_off_the_host_by_name(gloo_group):
    with pytest.raises(CommError, match=r"cannot send a tensor on meta with gloo: .*host memory only"):
        post_send(torch.zeros(3, device="meta"), 0, 11)
    with pytest.raises(CommError, match=r"cannot receive into a tensor on meta with gloo"):
        post_recv(torch.zeros(3, device="meta"), 0, 11)


# --------------------------------------------------------------------------- one backend rule
def _machine(monkeypatch, cuda: bool, gpus: int, nccl: bool = True) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)


@pytest.mark.parametrize("cuda, gpus, nccl, ranks, expected", [
    (False, 0, False, 2, "gloo"),  # a CPU machine
    (True, 2, True, 2, "nccl"),  # a GPU per rank
    (True, 4, True, 2, "nccl"),
    (True, 1, True, 2, "gloo"),  # two ranks on one GPU: NCCL would say "Duplicate GPU detected"
    (True, 1, True, 1, "nccl"),
    (True, 2, False, 2, "gloo"),  # a torch built without NCCL
])
def test_default_backend(monkeypatch, cuda, gpus, nccl, ranks, expected):
    _machine(monkeypatch, cuda, gpus, nccl)
    assert devices.default_backend(ranks) == expected


def test_ranks_per_node_reads_local_world_size(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert devices.ranks_per_node(3) == 3
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert devices.ranks_per_node(8) == 2


@pytest.mark.parametrize("cuda, gpus, local_rank, expected", [
    (False, 0, "1", "cpu"),
    (True, 2, "1", "cuda:1"),
    (True, 1, "1", "cuda:0"),  # two ranks share the one GPU (gloo stages their messages through the host)
    (True, 2, "3", "cuda:1"),
])
def test_default_device(monkeypatch, cuda, gpus, local_rank, expected):
    _machine(monkeypatch, cuda, gpus)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    assert devices.default_device() == torch.device(expected)


@pytest.mark.parametrize("backend, gpus, message", [
    ("nccl", 1, "backend='nccl' needs a GPU for each of the 2 workers, this machine has 1"),
    ("nccl", 0, "backend='nccl' needs a GPU for each of the 2 workers, this machine has 0"),
    ("mpi", 2, "backend must be 'gloo' or 'nccl', got 'mpi'"),
])
def test_launch_refuses_a_backend_the_workers_cannot_use_before_starting_them(monkeypatch, backend, gpus, message):
    from torchpipedream.runtime import launch

    _machine(monkeypatch, gpus > 0, gpus)
    with pytest.raises(ValueError, match=message):
        launch(print, 2, backend=backend)


# --------------------------------------------------------------------------- action clock
class FakeEvent:
    """A CUDA event stand-in: recorded at a known time (ms) on a fake device clock."""

    now_ms = 0.0

    def __init__(self) -> None:
        self.at_ms: float | None = None

    def record(self) -> None:
        self.at_ms = FakeEvent.now_ms

    def elapsed_time(self, other: "FakeEvent") -> float:
        return other.at_ms - self.at_ms


def test_event_seconds_converts_milliseconds_from_the_reference():
    ref, a, b = FakeEvent(), FakeEvent(), FakeEvent()
    ref.at_ms, a.at_ms, b.at_ms = 100.0, 150.0, 1100.0
    assert event_seconds(ref, 2.0, [a, b]) == pytest.approx([2.05, 3.0])


def test_the_cpu_clock_reads_the_host_clock_at_once():
    t0 = time.perf_counter()
    clock = ActionClock(CPU, t0)
    assert clock.mark is time.perf_counter and not clock.uses_events
    marks = [clock.mark(), clock.mark()]
    seconds = clock.seconds(marks)
    assert seconds == [marks[0] - t0, marks[1] - t0] and 0 <= seconds[0] <= seconds[1]
    assert not ActionClock(META, t0).uses_events  # only CUDA times with events


def test_the_event_clock_synchronizes_once_per_schedule():
    syncs = []
    FakeEvent.now_ms = 10.0
    t0 = time.perf_counter()
    clock = ActionClock(CPU, t0, new_event=FakeEvent, synchronize=lambda: syncs.append(1))
    assert clock.uses_events
    marks = []
    for ms in (12.0, 15.0, 15.5, 40.0):
        FakeEvent.now_ms = ms
        marks.append(clock.mark())
    assert all(isinstance(m, FakeEvent) for m in marks) and not syncs  # none per action
    seconds = clock.seconds(marks)
    assert syncs == [1]
    base = clock._reference_s
    assert 0 <= base < 5
    assert seconds == pytest.approx([base + 0.002, base + 0.005, base + 0.0055, base + 0.030])
