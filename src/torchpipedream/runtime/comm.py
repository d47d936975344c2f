"""Point-to-point transfers between pipeline ranks: asynchronous sends, prefetched receives.

Protocol (one rule makes matching unambiguous): all messages between a given sender and
receiver are matched in FIFO order per direction, and the schedule emits matching orders
(the k-th ``SA`` from rank a to rank b pairs with the k-th ``RA`` on b from a). Each
direction uses its own tags, so prefetching on one never steals a message of another.

* **Activations** (``SA``/``RA``, tag ``_TAG_ACT``): one message per transfer, a byte buffer
  holding a header (kind, sample count, number of activation and passenger tensors, then
  per tensor dtype, requires-grad flag and shape) followed by the tensors at 64-byte aligned
  offsets. Its size is *expected* by both sides (the size of the previous message on the
  channel), so the receiver posts the ``irecv`` for the next message as soon as the previous
  one is consumed, long before the sender sends: with gloo's rendezvous protocol the data
  then moves in one hop. When the size changes (the first message of a channel, a last
  partial batch) the sender first sends a *resize* message of the old expected size that
  announces the new one. So shapes and dtypes are learned from the first real batch (one
  small metadata message per channel), cached, and re-negotiated only when they change;
  the user never types a shape. The receiver's tensors are views into the buffer (no copy);
  the sender packs into one buffer (one copy of the activations). Python values a cut
  separates from their use (``x.size(0)``, a ``torch.Size``, a float) travel in the header.
  Values nested in tuples, lists and dicts (an LSTM's ``(output, (h, c))``) are flattened with
  torch's pytree: their leaves travel as above, their structure (the tree spec, as text) as
  the header's last entry, and the receiver rebuilds them.
* **Gradients** (``SG``/``RG``, tag ``_TAG_GRAD``): no header. The receiver of a gradient
  is the stage that sent the activations, so it already knows the shapes (one gradient
  per activation that requires grad); it posts the ``irecv`` as soon as it has sent the
  activations, in the order of its own ``RG`` actions.

**Wire device and compute device.** Messages travel on the *wire device*, received tensors
live on the *compute device* (``P2P(device=, wire_device=)``). They are one device on the CPU
and with NCCL; gloo's send and receive move host memory only (a CUDA tensor's raw device
pointer handed to a socket crashes the process, so :func:`post_send` and :func:`post_recv`
refuse one by name), so a CUDA rank on a gloo group packs its activations into a host buffer
and moves what it receives to its GPU (one copy per message, before the activations are made
leaves that require grad), gradients likewise.

Messages are named by a *key*: the microbatch id, or (stage, microbatch) where a rank holds
several stages (virtual stages) and one channel carries the messages of more than one; the
expected size is then kept per stage of the channel (``_channel``).

Receives are posted early (prefetch): the next activation header of each incoming channel
is always posted, its payload as soon as the header has arrived; gradient receives are
posted as soon as their shapes are known. Sends are ``isend``; the request and the tensor
stay referenced until the send completes. Every wait has a deadline and raises
:class:`CommTimeout` naming the peer rank and stage instead of hanging.
"""

from __future__ import annotations

import collections
import datetime
import logging
import struct
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

__all__ = ["P2P", "CommTimeout", "CommError", "encode_header", "decode_header", "pack", "unpack", "post_send",
           "post_recv"]

log = logging.getLogger(__name__)

_TAG_ACT = 11
_TAG_GRAD = 13
_KIND_DATA, _KIND_RESIZE = 1, 2
#: Expected size of the first message of a channel (it is always a resize message).
INITIAL_BYTES = 64
_ALIGN = 64

_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool,
]
_CODE = {d: i for i, d in enumerate(_DTYPES)}


class CommError(RuntimeError):
    """A transfer could not be made (e.g. a value crossing a cut is not a tensor)."""


class CommTimeout(CommError):
    """A blocking wait failed: it passed its deadline, or the peer's connection closed first.

    The message names the peer rank and stage; ``peer`` is that rank (None when the wait was
    not on one peer) and ``closed`` tells whether the wait ended early (the connection
    closed or broke) rather than at the deadline.
    """

    def __init__(self, message: str, peer: int | None = None, closed: bool = False) -> None:
        super().__init__(message)
        self.peer = peer
        self.closed = closed


# Python values that may cross a cut travel inside the header (no payload message).
_PY_INT, _PY_FLOAT, _PY_BOOL, _PY_INTS, _PY_NONE, _PY_TREE = 100, 101, 102, 103, 104, 105


@dataclass(frozen=True)
class _Structure:
    """How a message's leaves nest (``pytree.treespec_dumps`` text): its last header entry."""

    spec: str


def _is_leaf(v: Any) -> bool:
    """A value the header or payload carries as it is (not a container to flatten)."""
    return not isinstance(v, (tuple, list, dict)) or _is_ints(v)


def _is_ints(v: Any) -> bool:
    return isinstance(v, (tuple, list)) and all(isinstance(x, int) and not isinstance(x, bool) for x in v)


def flatten_message(tensors: list[Any], passengers: list[Any]) -> tuple[list[Any], list[Any]]:
    """The values of a message as the header carries them: unchanged when none is nested,
    else their leaves, with the structure as the last passenger (:func:`unflatten_message`)."""
    if all(_is_leaf(v) for v in list(tensors) + list(passengers)):
        return list(tensors), list(passengers)
    act_leaves, act_spec = pytree.tree_flatten(list(tensors), is_leaf=_is_leaf)
    pass_leaves, pass_spec = pytree.tree_flatten(list(passengers), is_leaf=_is_leaf)
    spec = pytree.treespec_dumps(act_spec) + "\n" + pytree.treespec_dumps(pass_spec)
    return act_leaves, pass_leaves + [_Structure(spec)]


def unflatten_message(acts: list[Any], passengers: list[Any]) -> tuple[list[Any], list[Any]]:
    """Inverse of :func:`flatten_message` (values whose last passenger is no structure: as they are)."""
    if not passengers or not isinstance(passengers[-1], _Structure):
        return acts, passengers
    act_spec, pass_spec = passengers[-1].spec.split("\n")
    return (pytree.tree_unflatten(acts, pytree.treespec_loads(act_spec)),
            pytree.tree_unflatten(passengers[:-1], pytree.treespec_loads(pass_spec)))


def _encode_value(v: Any) -> list[int]:
    if isinstance(v, torch.Tensor):
        if v.dtype not in _CODE:
            raise CommError(f"cannot send a tensor of dtype {v.dtype}; supported: {[str(d) for d in _DTYPES]}")
        return [_CODE[v.dtype], int(v.requires_grad), v.dim(), *v.shape]
    if v is None:
        return [_PY_NONE, 0, 0]
    if isinstance(v, bool):
        return [_PY_BOOL, 0, 1, int(v)]
    if isinstance(v, int):
        return [_PY_INT, 0, 1, v]
    if isinstance(v, float):
        return [_PY_FLOAT, 0, 1, struct.unpack("<q", struct.pack("<d", v))[0]]
    if _is_ints(v):
        return [_PY_INTS, 0, len(v), *v]  # e.g. a torch.Size
    if isinstance(v, _Structure):
        data = v.spec.encode()
        words = np.frombuffer(data + b"\0" * (-len(data) % 8), dtype=np.int64).tolist()
        return [_PY_TREE, len(data), len(words), *words]
    raise CommError(
        f"a value of type {type(v).__name__} crosses a stage boundary; only tensors, Python numbers, None, "
        "and tuples, lists and dicts of them can (move the cut)"
    )


def encode_header(samples: int, tensors: list[Any], passengers: list[Any]) -> list[int]:
    """The header words for one activation message (see the module docstring).

    ``tensors`` may also hold Python ints, floats, bools, None and tuples of ints (shape
    arithmetic that a cut separates from its use); their values are in the header itself.
    """
    words = [samples, len(tensors), len(passengers)]
    for v in list(tensors) + list(passengers):
        words += _encode_value(v)
    return words


@dataclass
class TensorMeta:
    """A tensor to receive (``value`` is None), or a Python value carried by the header."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None
    requires_grad: bool
    value: Any = None
    is_tensor: bool = True


def decode_header(words: list[int]) -> tuple[int, list[TensorMeta], list[TensorMeta]]:
    """Inverse of :func:`encode_header`: (samples, activation metas, passenger metas)."""
    samples, n_act, n_pass = words[0], words[1], words[2]
    metas: list[TensorMeta] = []
    pos = 3
    for _ in range(n_act + n_pass):
        code, rg, ndim = words[pos], words[pos + 1], words[pos + 2]
        body = words[pos + 3: pos + 3 + ndim]
        pos += 3 + ndim
        if code < len(_DTYPES):
            metas.append(TensorMeta(tuple(body), _DTYPES[code], bool(rg)))
            continue
        value: Any
        if code == _PY_INT:
            value = body[0]
        elif code == _PY_FLOAT:
            value = struct.unpack("<d", struct.pack("<q", body[0]))[0]
        elif code == _PY_BOOL:
            value = bool(body[0])
        elif code == _PY_INTS:
            value = torch.Size(body)
        elif code == _PY_NONE:
            value = None
        elif code == _PY_TREE:
            value = _Structure(np.asarray(body, dtype=np.int64).tobytes()[:rg].decode())
        else:
            raise CommError(f"corrupt activation header (value code {code}); are both ranks the same version?")
        metas.append(TensorMeta((), None, False, value=value, is_tensor=False))
    return samples, metas[:n_act], metas[n_act:]


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _write_words(buf: torch.Tensor, words: list[int]) -> None:
    """Write int64 ``words`` at the start of byte buffer ``buf``. On the CPU through a numpy
    view: one numpy assignment instead of two torch operations (about 40 µs per message in a
    running pipeline, where each small torch call costs 10-25 µs)."""
    if buf.device.type == "cpu":
        buf.numpy()[: 8 * len(words)] = np.asarray(words, dtype=np.int64).view(np.uint8)
    else:
        buf[: 8 * len(words)].copy_(torch.tensor(words, dtype=torch.int64).view(torch.uint8))


def _read_words(buf: torch.Tensor, start: int, count: int) -> list[int]:
    """``count`` int64 words of byte buffer ``buf`` from byte ``start`` (see :func:`_write_words`)."""
    if buf.device.type == "cpu":
        return np.frombuffer(buf.numpy(), dtype=np.int64, count=count, offset=start).tolist()
    return buf[start: start + 8 * count].cpu().view(torch.int64).tolist()


def pack(samples: int, tensors: list[Any], passengers: list[Any], device: torch.device) -> torch.Tensor:
    """One activation message: header words then the tensors' bytes at aligned offsets (nested
    values flattened: :func:`flatten_message`), in a buffer on ``device`` (the wire device: the
    tensors are copied there from wherever they live, e.g. from a GPU into host memory)."""
    tensors, passengers = flatten_message(tensors, passengers)
    words = encode_header(samples, tensors, passengers)
    values = [v for v in list(tensors) + list(passengers)]
    offset = _align(8 * (2 + len(words)))
    layout = []
    for v in values:
        if isinstance(v, torch.Tensor):
            n = v.numel() * v.element_size()
            layout.append((v, offset, n))
            offset = _align(offset + n)
    buf = torch.empty(offset, dtype=torch.uint8, device=device)
    _write_words(buf, [_KIND_DATA, len(words), *words])
    for v, off, n in layout:
        if n:
            buf[off: off + n].copy_(v.detach().contiguous().reshape(-1).view(torch.uint8))
    return buf


def unpack(buf: torch.Tensor, device: torch.device | None = None) -> tuple[int, list[Any], list[Any], list[TensorMeta]]:
    """Inverse of :func:`pack`: (samples, activations, passengers, metas of the leaves); tensors
    are views of ``buf``, those the sender's required grad require grad (leaves of the
    receiving stage's graph), nested values rebuilt.

    ``device``: the compute device, where it is not ``buf``'s (None: the same). The payload
    then moves there in one copy *before* the tensors are made to require grad, so that each
    is a leaf on that device (a ``.to`` after ``requires_grad_`` would give a non-leaf whose
    ``.grad`` stays None)."""
    kind, nwords = _read_words(buf, 0, 2)
    if kind != _KIND_DATA:
        raise CommError(f"corrupt activation message (kind {kind}); are both ranks running the same schedule?")
    words = _read_words(buf, 16, nwords)
    samples, act, passengers = decode_header(words)
    metas = act + passengers
    offset = _align(8 * (2 + nwords))
    data = buf if device is None else buf.to(device)
    values: list[Any] = []
    for m in metas:
        if not m.is_tensor:
            values.append(m.value)
            continue
        numel = 1
        for d in m.shape:
            numel *= d
        n = numel * m.dtype.itemsize
        values.append(data[offset: offset + n].view(m.dtype).view(m.shape).requires_grad_(m.requires_grad))
        offset = _align(offset + n)
    acts, passengers = unflatten_message(values[: len(act)], values[len(act):])
    return samples, acts, passengers, metas


def _resize_message(expected: int, new_size: int, device: torch.device) -> torch.Tensor:
    buf = torch.zeros(expected, dtype=torch.uint8, device=device)
    _write_words(buf, [_KIND_RESIZE, new_size])
    return buf


@dataclass
class _ActRecv:
    """One posted activation receive."""

    microbatch: Any  # its key
    buf: torch.Tensor
    work: Any
    checked: bool = False  # arrived and known not to be a resize message


@dataclass
class _GradRecv:
    microbatch: Any  # its key
    works: list[Any]
    tensors: list[torch.Tensor]
    nbytes: int


def _channel(peer: int, key: Any) -> tuple[int, ...]:
    """The channel whose expected message size a message of ``key`` follows: the peer, and the
    producing stage where keys name one (a rank of virtual stages sends several stages'
    activations, of different sizes, to the same peer)."""
    return (peer, key[0]) if isinstance(key, tuple) else (peer,)


def _named(key: Any) -> str:
    """A message key in words: "microbatch 5", or "microbatch 5 of stage 2"."""
    return f"microbatch {key[1]} of stage {key[0]}" if isinstance(key, tuple) else f"microbatch {key}"


def _refuse_off_host(tensor: torch.Tensor, what: str) -> None:
    """CommError for a tensor that is not in host memory on a gloo group: gloo's send and
    receive hand the tensor's data pointer to a socket, so a GPU tensor would crash the
    process (``P2P``'s wire device keeps them on the host)."""
    if dist.get_backend() == "gloo":
        raise CommError(f"cannot {what} a tensor on {tensor.device} with gloo: its point-to-point transfers "
                        "move host memory only (stage the message through a CPU tensor: P2P's wire_device)")


def post_send(tensor: torch.Tensor, dst: int, tag: int) -> Any:
    """``isend`` on the default process group, straight to the group object: the
    ``dist.isend`` wrapper's checks cost 15-20 µs per call (measured with gloo), paid on the
    critical path of every message. ``dst`` is a global rank (the default group's ranks).
    A tensor off the host on a gloo group is refused (CommError) instead of crashing."""
    if not tensor.is_cpu:
        _refuse_off_host(tensor, "send")
    return dist.group.WORLD.send([tensor], dst, tag)


def post_recv(tensor: torch.Tensor, src: int, tag: int) -> Any:
    """``irecv`` on the default process group (see :func:`post_send`)."""
    if not tensor.is_cpu:
        _refuse_off_host(tensor, "receive into")
    return dist.group.WORLD.recv([tensor], src, tag)


class P2P:
    """Point-to-point channels of one rank.

    Args:
        rank: this rank.
        describe: rank -> human text ("rank 2 (stage 1)") for error messages.
        act_order: peer -> keys (microbatch ids, or (stage, microbatch)) of this rank's ``RA``
            actions from that peer, in order.
        grad_order: peer -> keys of this rank's ``RG`` actions from that peer, in order.
        device: the compute device: where received activations and gradients must live.
        wire_device: where messages travel (None: ``device``): cpu with gloo, whose transfers
            move host memory only; the compute device with NCCL. Where they differ, sends are
            copied to the wire device and receives moved to ``device`` (``devices.wire_device``).
        timeout_s: deadline of every blocking wait.
        sizes: expected message size per channel, kept by the caller across schedules so a
            shape is negotiated once, not once per schedule (updated in place).
        max_sends: sends kept outstanding at most (see ``pump``); None = no bound.
        drain_at_update: wait for every outstanding send after each optimizer step
            (:meth:`drain`; synchronous kinds, whose update ends a minibatch).
        global_rank: a peer (the schedule's worker) -> its process's global rank (a worker of
            a tensor-parallel plan is several processes: each talks to its counterpart).
    """

    def __init__(
        self,
        rank: int,
        describe: Callable[[int], str],
        act_order: dict[int, list[int]],
        grad_order: dict[int, list[int]],
        device: torch.device,
        timeout_s: float,
        sizes: dict[tuple[str, int], int] | None = None,
        max_sends: int | None = None,
        drain_at_update: bool = False,
        global_rank: Callable[[int], int] | None = None,
        wire_device: torch.device | None = None,
    ) -> None:
        self.rank = rank
        self._global = global_rank or (lambda peer: peer)
        self.max_sends = max_sends
        self.drain_at_update = drain_at_update
        self.describe = describe
        self.device = device
        self.wire_device = device if wire_device is None else torch.device(wire_device)
        # messages change device on the way (compute device: None when it is the wire's)
        self._to_compute = None if self.wire_device == torch.device(device) else torch.device(device)
        self.timeout_s = float(timeout_s)
        self._act_queue = {p: collections.deque(ids) for p, ids in act_order.items()}
        self._grad_queue = {p: collections.deque(ids) for p, ids in grad_order.items()}
        self._act_posted: dict[int, collections.deque[_ActRecv]] = {p: collections.deque() for p in act_order}
        self._grad_posted: dict[int, collections.deque[_GradRecv]] = {p: collections.deque() for p in grad_order}
        self._grad_meta: dict[Any, list[TensorMeta]] = {}
        self._sends: list[tuple[Any, Any, str, int]] = []  # (work, tensor kept alive, what, peer)
        self._sizes = sizes if sizes is not None else {}
        self.resizes = 0  # resize messages sent (for tests and reports)
        self.pump()

    # ------------------------------------------------------------------ helpers
    def _wait(self, work: Any, what: str, peer: int) -> None:
        self._wait_or_raise(
            work,
            f"{self.describe(self.rank)} waited more than {self.timeout_s:g} s for {what} from {self.describe(peer)}",
            "; is that rank alive and running the same schedule?",
            peer=peer,
            closed=f"{self.describe(self.rank)} lost the connection to {self.describe(peer)} while waiting for {what}",
        )

    def _wait_or_raise(self, work: Any, failure: str, advice: str = "", peer: int | None = None,
                       closed: str | None = None) -> None:
        """Wait for ``work`` within the deadline, else raise CommTimeout with ``failure`` and the cause.

        A wait that fails well before its deadline did not time out: the peer's connection
        closed (the process died or gave up); then the message says so (``closed``).
        """
        start = time.monotonic()
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            cause = str(exc).splitlines()[0][:200]
            early = time.monotonic() - start < 0.9 * self.timeout_s
            if early and closed is not None:
                raise CommTimeout(f"{closed} after {time.monotonic() - start:.2f} s ({cause})", peer, True) from None
            raise CommTimeout(f"{failure} ({cause}){advice}", peer, early) from None

    def _finish_send(self, work: Any, _tensor: Any, what: str, peer: int) -> None:
        self._wait_or_raise(
            work, f"{self.describe(self.rank)}: sending {what} to {self.describe(peer)} did not complete within "
            f"{self.timeout_s:g} s", peer=peer,
            closed=f"{self.describe(self.rank)} lost the connection to {self.describe(peer)} while sending {what}")

    # ------------------------------------------------------------------ progress
    def pump(self) -> None:
        """Post every receive that can be posted now; forget completed sends.

        gloo reports a send complete only once it has been waited for, so without a bound
        every buffer sent during a schedule would live until its end (memory growing with the
        schedule's length). Beyond ``max_sends`` outstanding sends the oldest is waited for. That
        cannot deadlock: a receiver takes its messages in order and needs nothing more from
        this rank to reach the one waited for, and this rank's own receives are posted first.
        """
        for peer, queue in self._act_queue.items():
            posted = self._act_posted[peer]
            if posted and not posted[0].checked and posted[0].work.is_completed():
                self._check_resize(peer, posted)
            if queue and not posted:
                self._post_act(peer, queue.popleft())
        for peer, queue in self._grad_queue.items():
            while queue and queue[0] in self._grad_meta:
                microbatch = queue.popleft()
                metas = self._grad_meta.pop(microbatch)
                tensors = [torch.empty(m.shape, dtype=m.dtype, device=self.wire_device) for m in metas]
                works = [post_recv(t, self._global(peer), _TAG_GRAD) for t in tensors]
                nbytes = sum(t.numel() * t.element_size() for t in tensors)
                self._grad_posted[peer].append(_GradRecv(microbatch, works, tensors, nbytes))
        if self._sends:
            self._sends = [s for s in self._sends if not s[0].is_completed()]
        while self.max_sends is not None and len(self._sends) > self.max_sends:
            self._finish_send(*self._sends.pop(0))

    def _check_resize(self, peer: int, posted: collections.deque[_ActRecv]) -> bool:
        """The first posted message has arrived: if it announces a new size, post for the real
        message (same microbatch) and return True."""
        rec = posted[0]
        kind, value = _read_words(rec.buf, 0, 2)
        if kind != _KIND_RESIZE:
            rec.checked = True
            return False
        self._sizes[("recv", *_channel(peer, rec.microbatch))] = value
        buf = torch.empty(value, dtype=torch.uint8, device=self.wire_device)
        posted[0] = _ActRecv(rec.microbatch, buf, post_recv(buf, self._global(peer), _TAG_ACT))
        return True

    def _post_act(self, peer: int, microbatch: Any) -> None:
        size = self._sizes.get(("recv", *_channel(peer, microbatch)), INITIAL_BYTES)
        buf = torch.empty(size, dtype=torch.uint8, device=self.wire_device)
        self._act_posted[peer].append(_ActRecv(microbatch, buf, post_recv(buf, self._global(peer), _TAG_ACT)))

    # ------------------------------------------------------------------ activations
    def send_acts(self, peer: int, microbatch: Any, samples: int, tensors: list[Any], passengers: list[Any]) -> int:
        """Send microbatch ``microbatch``'s activations (and passengers: targets) to ``peer``; returns bytes.

        Remembers which activations require grad, so the matching gradient receive can be
        posted right away.
        """
        try:
            buf = pack(samples, tensors, passengers, self.wire_device)
        except CommError as exc:
            raise CommError(f"{self.describe(self.rank)} -> {self.describe(peer)}: {exc}") from None
        channel = ("send", *_channel(peer, microbatch))
        expected = self._sizes.get(channel, INITIAL_BYTES)
        if buf.numel() != expected:
            note = _resize_message(expected, buf.numel(), self.wire_device)
            self._sends.append((post_send(note, self._global(peer), _TAG_ACT), note, "a shape message", peer))
            self._sizes[channel] = buf.numel()
            self.resizes += 1
        self._sends.append((post_send(buf, self._global(peer), _TAG_ACT), buf, f"activations of {_named(microbatch)}", peer))
        self._grad_meta[microbatch] = [  # one gradient per leaf tensor that requires grad, in leaf order
            TensorMeta(tuple(t.shape), t.dtype, True) for t in pytree.tree_leaves(list(tensors))
            if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        return int(buf.numel())

    def recv_acts(self, peer: int, microbatch: Any) -> tuple[int, list[Any], list[Any], int]:
        """Block until microbatch ``microbatch``'s activations from ``peer`` arrived.

        Returns (samples, activations, passengers, bytes); activations that required grad at
        the sender require grad here (leaves of this stage's graph).
        """
        posted = self._act_posted.get(peer)
        if posted is None:
            raise CommError(f"{self.describe(self.rank)} has no RA from {self.describe(peer)} in its schedule")
        self.pump()
        while True:
            rec = posted[0]
            if rec.microbatch != microbatch:
                raise CommError(
                    f"{self.describe(self.rank)}: schedule asks for {_named(microbatch)} from {self.describe(peer)} "
                    f"but the next message on that channel is {_named(rec.microbatch)}"
                )
            self._wait(rec.work, f"the activations of {_named(microbatch)}", peer)
            if rec.checked or not self._check_resize(peer, posted):
                break
        posted.popleft()
        self.pump()  # prefetch: post the next message of this channel now
        samples, acts, passengers, _ = unpack(rec.buf, self._to_compute)
        return samples, acts, passengers, int(rec.buf.numel())

    # ------------------------------------------------------------------ gradients
    def send_grads(self, peer: int, microbatch: Any, grads: list[torch.Tensor]) -> int:
        """Send the gradients of microbatch ``microbatch``'s received activations to ``peer``
        (copies on the wire device where it is not the compute device); returns bytes."""
        nbytes = 0
        for g in grads:
            data = g.detach().contiguous()
            if self._to_compute is not None:
                data = data.to(self.wire_device)
            self._sends.append((post_send(data, self._global(peer), _TAG_GRAD), data, f"gradients of {_named(microbatch)}", peer))
            nbytes += data.numel() * data.element_size()
        return nbytes

    def recv_grads(self, peer: int, microbatch: Any) -> tuple[list[torch.Tensor], int]:
        """Block until the gradients of microbatch ``microbatch``'s activations arrive from ``peer``;
        returns them on the compute device, and their bytes."""
        self.pump()
        posted = self._grad_posted.get(peer)
        if not posted:
            raise CommError(
                f"{self.describe(self.rank)}: RG {microbatch} from {self.describe(peer)} before the matching SA "
                "(the schedule must send activations before receiving their gradients)"
            )
        rec = posted[0]
        if rec.microbatch != microbatch:
            raise CommError(
                f"{self.describe(self.rank)}: schedule asks for gradients of {_named(microbatch)} from "
                f"{self.describe(peer)} but the next message on that channel is {_named(rec.microbatch)}"
            )
        for w in rec.works:
            self._wait(w, f"the gradients of {_named(microbatch)}", peer)
        posted.popleft()
        if self._to_compute is not None:
            return [t.to(self._to_compute) for t in rec.tensors], rec.nbytes
        return rec.tensors, rec.nbytes

    # ------------------------------------------------------------------ end
    def drain(self) -> None:
        """Wait for every outstanding send.

        Under a synchronous kind the receivers have posted the receives of every message sent
        before an update (a gradient's when its activations went out, an activation's
        consumed before its gradient came back), so this costs at most a transfer. Without it
        GPipe's last stage kept its minibatch's gradient sends (all μ of them: its bound)
        through the next minibatch's forwards, a minibatch of input gradients more than the
        memory model charges."""
        for send in self._sends:
            self._finish_send(*send)
        self._sends = []

    def finish(self) -> None:
        """Wait for every outstanding send (call at the end of a schedule)."""
        self.drain()
        leftover = {p: len(q) for p, q in self._act_posted.items() if q}
        if leftover:
            log.warning("%s: unmatched activation receives left: %s", self.describe(self.rank), leftover)
