"""Exact checkpoints of a pipeline, keyed by the model's own names, loadable onto any plan.

Layout of a checkpoint directory (format 3)::

    stage0.pt             replica 0 of each stage: the tensors (parameters and buffers) it is
    stage1.pt             the first stage to hold, by the model's names, and their optimizer
                          state by name (``optimizer_state.py``); its version and RNG state
    stage1_replica1.pt    other replicas: their own RNG state only (their weights and optimizer
                          state equal replica 0's by construction: same all-reduced update);
                          with tensor parallelism (t ranks a worker) each tensor rank is one:
                          replica q's tensor rank i writes stage<s>_replica<q·t+i>.pt
    stage1.dcp/           a sharded or tensor-parallel stage: its tensors and optimizer state
                          of its weights' shape, saved by its ranks with DCP (dcp_files.py)
                          (a rank holding several stages, under interleaved and zb-v,
                          writes one file per stage it holds, as if each were a rank's)
    extra.json            the caller's ``**extra`` (JSON), written by rank 0
    manifest.json         written LAST by rank 0: the save's identifier, every file with its
                          sha256 and size, the index (model name -> the file that holds it),
                          the names of tied parameters, the plan, the world size, the data
                          position and the loss history

**Layout-free.** A tensor is stored once under the model's name (a tied parameter once, under
its first name; the index lists its other names), by the first stage that holds it. Loading
asks nothing of the plan that wrote the checkpoint: each rank reads, from the files the index
names, the tensors and optimizer states of its own stage, so a checkpoint loads onto another
number of stages, replicas or workers, or another schedule (``train --resume`` re-plans). The
model must be the same (every name, every shape; the error names the first that differs) and
so must the optimizer's class. Random states are restored only when the ranks are laid out as
they were (the runtime's own random numbers, dropout's, are seeded by the microbatch anyway).
A checkpoint is taken at a schedule boundary, where every schedule kind holds one weight
version per stage, so continuing on another plan or kind is the new schedule from those
weights: the version rule of the new kind counts from the checkpoint (docs/architecture.md).

**Loading runs no code.** Stage files hold only tensors and plain containers and are read with
``torch.load(weights_only=True)``; the manifest and ``extra.json`` are JSON, checked field by
field (:func:`read_manifest`). A file that fails a check is named in the error.

**One save, one set of files.** Every save draws a random identifier; it is in the manifest and
inside every file of the save, and loading refuses a file whose identifier differs (a stage
file copied in from another save, with its manifest entry, is caught).

Only a directory whose manifest exists, parses, and whose every file matches its checksum is a
checkpoint. A crash at any moment leaves either the previous complete checkpoint or a
directory without a manifest, which :func:`latest_checkpoint` skips (with a warning naming it
and why). A write that fails removes its temporary file; :func:`remove_temporary_files` clears
those left by a killed process.

Why saving is exact with no stashed versions in it: a checkpoint is taken at a schedule
boundary (after ``train_step``/``fit`` returned), when every minibatch that ran ``F`` has
also run ``B`` and ``U`` on every stage. No older weight version is still needed, so the
state of a stage is its latest weights, its optimizer state and its version counter
(:meth:`WeightVersions.boundary_state` asserts this).

Every file is written to a temporary name in the same directory, flushed, fsynced and then
``os.replace``-d to its name (atomic on POSIX), and the directory is fsynced. The ranks
coordinate through :class:`~torchpipedream.runtime.agreement.Agreement` (the store, JSON, a
deadline per step that names a rank that does not answer), and agree on the first error, so
all of them raise the same :class:`CheckpointError` instead of some continuing into a
collective that would hang. The directory must be visible to every rank (one machine, or a
shared file system).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import math
import os
import random
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from torch import nn

try:
    import numpy as np
except ImportError:  # pragma: no cover - torch runs without numpy; its random state is then not saved
    np = None  # type: ignore[assignment]

from ..model.capture import with_aliases
from ..plans.plan import Plan, PlanError
from . import liveness
from .agreement import Agreement
from .buffers import ReplicaBuffers
from .loss_scaling import LossScaler
from .optimizer_state import OptimizerStateError, load_state_by_name, state_by_name
from .dcp_files import UnsafeMetadataError, load_sharded, save_sharded, saved_tensor_specs
from .sharding import shard_like, sharded_optimizer_entries
from .weights import WeightVersions

__all__ = ["CheckpointError", "CheckpointState", "StageState", "Resumed", "Manifest", "save_checkpoint", "load_checkpoint",
           "verify_checkpoint", "latest_checkpoint", "checkpoints_newest_first", "read_manifest", "read_extra",
           "read_stage_states", "remove_temporary_files", "saved_shapes", "shape_mismatch", "write_json_atomic",
           "MANIFEST", "EXTRA"]

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
EXTRA = "extra.json"
FORMAT = "torchpipedream.Checkpoint"
FORMAT_VERSION = 3
#: The folder a sharded stage's tensors are saved into by DCP: ``stage<s>.dcp/`` (dcp_files.py).
DCP_SUFFIX = ".dcp"
_DCP_FILE = re.compile(r"stage\d+\.dcp/(\.metadata|[\w.-]+\.distcp)")
_TMP_MARK = ".tmp-"


class CheckpointError(ValueError):
    """A checkpoint cannot be written or used; the message names the file and what is wrong."""


# ---------------------------------------------------------------------------- files
def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _disk_error(path: Path, exc: OSError) -> str:
    if exc.errno == errno.ENOSPC:
        try:
            free = shutil.disk_usage(path.parent).free
        except OSError:
            free = 0
        return f"no space left on the device of {path.parent} while writing {path.name} ({free / 1e6:.0f} MB free)"
    return f"cannot write {path}: {exc.strerror or exc}"


def write_atomic(path: Path, data: bytes | Iterable[bytes]) -> None:
    """Write ``data`` (bytes, or chunks of them) to ``path`` so that ``path`` is either the old
    file or all of the new; a failed write leaves no temporary file behind. OSError carries a
    one-line reason."""
    tmp = path.with_name(f".{path.name}{_TMP_MARK}{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            for chunk in ([data] if isinstance(data, bytes) else data):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OSError(exc.errno, _disk_error(path, exc)) from None
    except BaseException:  # the chunks failed (a value that is not JSON): nothing left behind either
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_json_atomic(path: Path, obj: Any, chunk_bytes: int = 1 << 13) -> tuple[str, int]:
    """:func:`write_atomic` of ``obj`` as JSON (indented), streamed: returns its sha256 and size.

    A run's ``extra`` grows with it (``train`` keeps a row per epoch), and ``json.dumps`` with an
    indent builds the text from many small pieces at once: several times the output transiently,
    which the workers' allocator keeps (host/freed_memory.py), so rank 0's resident memory rose
    in steps over a long run. Encoded piece by piece into ``chunk_bytes`` buffers, the peak stays
    near a few buffers."""
    digest, size = hashlib.sha256(), 0

    def encoded(text: str) -> bytes:
        nonlocal size
        data = text.encode()
        digest.update(data)
        size += len(data)
        return data

    def chunks() -> Iterator[bytes]:
        buffer = io.StringIO()  # one growing text buffer, not a list of the encoder's small pieces
        for piece in json.JSONEncoder(indent=1).iterencode(obj):
            buffer.write(piece)
            if buffer.tell() >= chunk_bytes:
                yield encoded(buffer.getvalue())
                buffer = io.StringIO()
        yield encoded(buffer.getvalue())

    write_atomic(path, chunks())
    return digest.hexdigest(), size


def remove_temporary_files(root: str | Path) -> int:
    """Delete the temporary files that killed writers left under ``root``; returns how many."""
    root = Path(root)
    if not root.is_dir():
        return 0
    removed = 0
    for path in root.rglob(f".*{_TMP_MARK}*"):
        try:
            path.unlink()
            removed += 1
        except OSError:
            pass
    return removed


def _serialize(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read_verified(directory: Path, entry: dict[str, Any]) -> bytes:
    """The bytes of one listed file, or CheckpointError naming it (missing, truncated, corrupted)."""
    path = directory / entry["file"]
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"checkpoint file {path} cannot be read ({exc.strerror or exc}); the checkpoint is incomplete") from None
    if len(data) != entry["size"]:
        raise CheckpointError(
            f"checkpoint file {path} is truncated or altered: {len(data)} bytes, the manifest says {entry['size']}"
        )
    if _sha256(data) != entry["sha256"]:
        raise CheckpointError(f"checkpoint file {path} is corrupted: its sha256 does not match the manifest")
    return data


def _load_tensors(data: bytes, path: Path, save_id: str) -> dict[str, Any]:
    """A stage file's content, read without running code, checked to belong to ``save_id``."""
    try:
        payload = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # a pickle that needs code, or not a torch file at all
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"checkpoint file {path} is not a plain tensor file and was not loaded "
                              f"(loading runs no code): {first[:300]}") from None
    if not isinstance(payload, dict):
        raise CheckpointError(f"checkpoint file {path} holds a {type(payload).__name__}, not a stage's state")
    if payload.get("save_id") != save_id:
        raise CheckpointError(f"checkpoint file {path} belongs to another save (its identifier differs from the "
                              "manifest's): files of different checkpoints were mixed")
    return payload


# ---------------------------------------------------------------------------- manifest
@dataclass
class Manifest:
    """A checked manifest (see the module docstring for the fields' meaning)."""

    path: Path
    save_id: str
    created_unix: float
    world_size: int
    plan: dict[str, Any]
    schedule: str
    version: int
    epoch: int
    minibatches: int
    files: list[dict[str, Any]]
    raw: dict[str, Any]
    index: dict[str, str]
    aliases: dict[str, list[str]]
    history: list[float]


def _need(data: dict[str, Any], key: str, types: type | tuple[type, ...], path: Path) -> Any:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, types):
        want = " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))
        raise CheckpointError(f"checkpoint manifest {path}: field '{key}' must be {want}, got {value!r:.80}")
    return value


def read_manifest(directory: str | Path) -> Manifest:
    """The manifest of a checkpoint directory, every field checked (CheckpointError naming the
    file and the field when missing or malformed)."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{directory} is not a complete checkpoint: {MANIFEST} is missing (the save did not finish); "
            "resume from an earlier checkpoint (latest_checkpoint() skips incomplete ones)"
        )
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint manifest {path} cannot be read: {exc}") from None
    except RecursionError:
        raise CheckpointError(f"checkpoint manifest {path} cannot be read: nested too deeply") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a torchpipedream checkpoint manifest")
    if data.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format version {data.get('format_version')!r}, this version reads {FORMAT_VERSION}"
        )
    created = float(_need(data, "created_unix", (int, float), path))
    if not math.isfinite(created):
        raise CheckpointError(f"checkpoint manifest {path}: field 'created_unix' must be a finite time")
    files = _need(data, "files", list, path)
    for i, entry in enumerate(files):
        if not isinstance(entry, dict):
            raise CheckpointError(f"checkpoint manifest {path}: files[{i}] must be an object")
        for key, types in (("file", str), ("sha256", str), ("size", int)):
            _need(entry, key, types, Path(f"{path} files[{i}]"))
        if (Path(entry["file"]).name != entry["file"] or entry["file"].startswith(".")) \
                and not _DCP_FILE.fullmatch(entry["file"]):
            raise CheckpointError(f"checkpoint manifest {path}: files[{i}] names {entry['file']!r}, not a file "
                                  "of this directory")
    data_pos = _need(data, "data", dict, path)
    listed = {entry["file"] for entry in files}
    index = _need(data, "index", dict, path)
    for name, file in index.items():
        if not isinstance(file, str) or file not in listed:
            raise CheckpointError(f"checkpoint manifest {path}: index[{name!r}] names {file!r:.80}, not a file it lists")
    aliases = _need(data, "aliases", dict, path)
    if not all(isinstance(v, list) and all(isinstance(n, str) for n in v) for v in aliases.values()):
        raise CheckpointError(f"checkpoint manifest {path}: field 'aliases' must map names to lists of names")
    history = _need(data, "history", list, path)
    if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in history):
        raise CheckpointError(f"checkpoint manifest {path}: field 'history' must be a list of numbers")
    return Manifest(path=path, save_id=_need(data, "save_id", str, path), created_unix=created,
                    world_size=_need(data, "world_size", int, path), plan=_need(data, "plan", dict, path),
                    schedule=_need(data, "schedule", str, path), version=_need(data, "version", int, path),
                    epoch=_need(data_pos, "epoch", int, Path(f"{path} data")),
                    minibatches=_need(data_pos, "minibatches", int, Path(f"{path} data")),
                    files=files, raw=data, index=index, aliases=aliases, history=[float(x) for x in history])


def verify_checkpoint(directory: str | Path, load: bool = False) -> Manifest:
    """Check the manifest and the size and sha256 of every file it lists; returns the manifest.
    With ``load``, also read every stage file as plain tensors (no code runs): a file an
    attacker rewrote together with its checksum is refused here, naming it."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    for entry in manifest.files:
        data = _read_verified(directory, entry)
        if load and entry["file"].endswith(".pt"):
            _load_tensors(data, directory / entry["file"], manifest.save_id)
        if load and entry["file"].endswith("/.metadata"):  # a DCP folder's: read without running code
            _folder_specs((directory / entry["file"]).parent)
    return manifest


def read_extra(directory: str | Path, manifest: Manifest | None = None) -> dict[str, Any]:
    """The ``extra`` a save was given (JSON, verified against the manifest)."""
    directory = Path(directory)
    manifest = manifest or read_manifest(directory)
    entry = next((e for e in manifest.files if e["file"] == EXTRA), None)
    if entry is None:
        raise CheckpointError(f"checkpoint {directory}: the manifest lists no {EXTRA}")
    try:
        extra = json.loads(_read_verified(directory, entry).decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"checkpoint file {directory / EXTRA} is not JSON: {exc}") from None
    if not isinstance(extra, dict) or extra.get("save_id") != manifest.save_id:
        raise CheckpointError(f"checkpoint file {directory / EXTRA} belongs to another save")
    return dict(extra.get("extra") or {})


def read_stage_states(directory: str | Path) -> dict[str, torch.Tensor]:
    """The whole model's state from a checkpoint, without a pipeline: what the model's own
    ``state_dict()`` holds (every name of a tied parameter), loadable with ``load_state_dict``."""
    directory = Path(directory)
    manifest = verify_checkpoint(directory)
    by_file = {e["file"]: e for e in manifest.files}
    state: dict[str, torch.Tensor] = {}
    for file in sorted(set(manifest.index.values())):
        payload = _load_tensors(_read_verified(directory, by_file[file]), directory / file, manifest.save_id)
        tensors = payload.get("tensors")
        if not isinstance(tensors, dict):
            raise CheckpointError(f"checkpoint file {directory / file} holds no tensors")
        if payload.get("dcp"):  # a sharded stage's: its tensors whole, from its DCP folder
            folder = directory / payload["dcp"]
            specs = _folder_specs(folder)
            whole = {name: torch.empty(specs[name][0], dtype=specs[name][1]) for name in payload.get("dcp_tensors", ())
                     if name in specs}
            load_sharded(whole, folder)
            tensors = {**tensors, **whole}
        for name, holder in manifest.index.items():
            if holder == file:
                if not isinstance(tensors.get(name), torch.Tensor):
                    raise CheckpointError(f"checkpoint file {directory / file} lacks {name}, which the manifest "
                                          "says it holds")
                state[name] = tensors[name]
    return with_aliases(state, manifest.aliases.values())


def saved_shapes(directory: str | Path) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor a checkpoint holds, by the model's names, read cheaply (stage
    files memory-mapped, DCP folders' metadata; nothing verified: loading does that), so a run can
    refuse a checkpoint of another model before it starts its workers."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(set(manifest.index.values())):
        try:
            payload = torch.load(directory / file, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:  # a pickle that needs code, or not a torch file at all
            raise CheckpointError(f"checkpoint file {directory / file} cannot be read: {type(exc).__name__}") from None
        tensors = payload.get("tensors") if isinstance(payload, dict) else None
        if not isinstance(tensors, dict):
            raise CheckpointError(f"checkpoint file {directory / file} holds no tensors")
        shapes.update({k: tuple(v.shape) for k, v in tensors.items() if isinstance(v, torch.Tensor)})
        if payload.get("dcp"):
            specs = _folder_specs(directory / payload["dcp"])
            shapes.update({k: tuple(specs[k][0]) for k in payload.get("dcp_tensors", ()) if k in specs})
    for first, names in manifest.aliases.items():  # a tied parameter's other names hold the same tensor
        if first in shapes:
            shapes.update({name: shapes[first] for name in names})
    return shapes


def shape_mismatch(saved: dict[str, tuple[int, ...]], model: nn.Module) -> str | None:
    """The first difference between a checkpoint's tensors (:func:`saved_shapes`) and ``model``'s
    state, in words; None when every name and shape agrees."""
    mine = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for name in sorted(set(mine) | set(saved)):
        if name not in saved:
            return f"{name} is not in the checkpoint"
        if name not in mine:
            return f"the checkpoint holds {name}, which this model does not have"
        if saved[name] != mine[name]:
            return f"{name} is {saved[name]} in the checkpoint and {mine[name]} in this model"
    return None


def checkpoints_newest_first(root: str | Path) -> list[Manifest]:
    """Every checkpoint in ``root`` (itself or a subdirectory) whose manifest reads, newest
    first (the manifest's save time, then the directory name). A directory with a malformed
    manifest is skipped with a warning naming it and why; files are not verified here."""
    root = Path(root)
    if not root.is_dir():
        return []
    found: list[Manifest] = []
    for d in [root] + sorted(p for p in root.iterdir() if p.is_dir()):
        if not (d / MANIFEST).is_file():
            continue
        try:
            found.append(read_manifest(d))
        except CheckpointError as exc:
            log.warning("skipping checkpoint %s: %s", d, exc)
    return sorted(found, key=lambda m: (m.created_unix, m.path.parent.name), reverse=True)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete, verified checkpoint in ``root`` (itself or a subdirectory), or None.

    Directories without a manifest (a save that did not finish) are ignored; a checkpoint whose
    manifest or files fail their checks is skipped with a warning naming it and why.
    """
    for manifest in checkpoints_newest_first(root):
        try:
            verify_checkpoint(manifest.path.parent)
        except CheckpointError as exc:
            log.warning("skipping checkpoint %s: %s", manifest.path.parent, exc)
            continue
        return manifest.path.parent
    return None


# ---------------------------------------------------------------------------- RNG
def _rng_state(device: torch.device) -> dict[str, Any]:
    """This process's random states as tensors and plain values (loadable without code)."""
    version, mt, gauss = random.getstate()
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": [version, list(mt), gauss]}
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    version, mt, gauss = state["python"]
    random.setstate((int(version), tuple(int(x) for x in mt), gauss))
    if "numpy" in state:
        if np is None:  # pragma: no cover
            raise ImportError("numpy is needed to restore the random state this checkpoint saved")
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


# ---------------------------------------------------------------------------- what is saved
@dataclass
class StageState:
    """One stage a rank holds, as checkpointing reads and restores it: a rank holds one, or
    several of one worker each (virtual stages, under interleaved and zb-v).

    ``module``, ``weights`` and ``buffers`` are the pipeline's own objects: loading restores
    into them.
    """

    stage: int
    replica: int
    module: nn.Module  # the stage's module: its state_dict holds the stage's tensors
    state_names: dict[str, str]  # the module's state_dict key -> the model's name
    weights: list[WeightVersions]  # the stage's own first, then its copies of shared parameters
    buffers: ReplicaBuffers | None = None  # a replicated stage's buffers (re-based after loading)
    group: Any = None  # a sharded or tensor-parallel stage's ranks' process group (their DCP save is a collective of it)

    @property
    def own_file(self) -> str:
        """The name of the file this stage's replica writes."""
        return f"stage{self.stage}.pt" if self.replica == 0 else f"stage{self.stage}_replica{self.replica}.pt"


@dataclass
class CheckpointState:
    """One rank's part of a pipeline, as checkpointing reads and restores it (the pipeline
    hands it over; this module knows nothing else of the pipeline): the stages it holds, in
    order, and what the rank keeps once (random state, loss scale, data position).

    ``scaler`` is the pipeline's own object: loading restores into it. The data position and
    the loss history are copies: loading returns the restored ones (:class:`Resumed`).
    """

    rank: int
    world_size: int
    device: torch.device
    plan: Plan
    kind: str  # the schedule kind
    stages: list[StageState]
    aliases: dict[str, list[str]]  # a tied parameter's first name -> every name of it
    scaler: LossScaler | None  # float16's loss scale
    agreement: Agreement | None  # the ranks' deadline-bounded collectives; None in one process
    epochs_done: int
    minibatches_done: int
    history: list[float]


@dataclass(frozen=True)
class Resumed:
    """What loading a checkpoint gives back besides the restored tensors: the caller's
    ``extra``, the data position and the loss history."""

    extra: dict[str, Any]
    epochs_done: int
    minibatches_done: int
    history: list[float]


# ---------------------------------------------------------------------------- collectives
def _agree(state: CheckpointState, what: str, error: str | None) -> None:
    """Raise the first rank's error on every rank (so no rank walks into a collective that
    would hang); a rank that does not answer within the deadline is named."""
    if state.agreement is None:
        if error is not None:
            raise CheckpointError(error)
        return
    first = state.agreement.first_error(what, error)
    if first is not None:
        r, text = first
        raise CheckpointError(text if r == state.rank else f"{text} (reported by rank {r})")


def _exchange(state: CheckpointState, what: str, value: Any) -> list[Any]:
    return state.agreement.exchange(what, value) if state.agreement is not None else [value]


# ---------------------------------------------------------------------------- save
def _name_of_parameters(part: StageState, weights: WeightVersions) -> dict[int, str]:
    """id(parameter) -> the model's name, for one WeightVersions' parameters."""
    return {id(p): part.state_names.get(n, n) for n, p in zip(weights.names, weights.params)}


def _holdings(state: CheckpointState) -> list[tuple[int, list[str]]]:
    """What this rank's stages hold, by the model's names: (stage, names) of each stage it
    holds as replica 0 (which writes them)."""
    return [(part.stage, sorted(set(part.state_names.values()))) for part in state.stages if part.replica == 0]


def _owners(holdings: list[list[tuple[int, list[str]]]]) -> dict[str, int]:
    """Name -> the stage that writes it: the first stage holding it (a shared parameter and a
    constant buffer used by several stages are written once)."""
    owner: dict[str, int] = {}
    for stage, names in sorted((int(stage), names) for part in holdings for stage, names in part):
        for name in names:
            owner.setdefault(name, stage)
    return owner


def _base_payload(state: CheckpointState, part: StageState, save_id: str) -> dict[str, Any]:
    """What every stage file holds: whose it is, its version, the rank's random state, the data position."""
    states = [w.boundary_state() for w in part.weights]  # asserts nothing is in flight
    return {"save_id": save_id, "stage": part.stage, "replica": part.replica, "rank": state.rank,
            "version": states[0]["version"], "rng": _rng_state(state.device),
            "data": {"epoch": state.epochs_done, "minibatches": state.minibatches_done}}


def _stage_file(state: CheckpointState, part: StageState, save_id: str, owner: dict[str, int]) -> dict[str, Any]:
    """A stage's file content (tensors and plain values only)."""
    payload = _base_payload(state, part, save_id)
    if part.replica != 0:
        return payload
    mine = {name for name, s in owner.items() if s == part.stage}
    names = part.state_names
    tensors = {names[k]: v.detach().cpu().clone() for k, v in part.module.state_dict().items()
               if k in names and names[k] in mine}
    optimizer: dict[str, Any] = {}
    for weights in part.weights:
        if weights.optimizer is not None:
            for name, entry in state_by_name(weights.optimizer, _name_of_parameters(part, weights)).items():
                if name in mine:
                    optimizer[name] = entry
    payload.update(tensors=tensors, optimizer=optimizer)
    return payload


def _dcp_folder(stage: int) -> str:
    return f"stage{stage}{DCP_SUFFIX}"


def _sharded_stage_file(state: CheckpointState, part: StageState, save_id: str, owner: dict[str, int],
                        directory: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A sharded stage's save (dcp_files.py): its replicas write their shards of its tensors and of
    its optimizer state of its weights' shape into ``stage<s>.dcp/`` together (a collective of the
    stage's group), and replica 0 a stage file with the rest; its content and, on replica 0, the
    manifest entries of the DCP folder's files."""
    payload = _base_payload(state, part, save_id)
    mine = {name for name, s in owner.items() if s == part.stage}
    names = part.state_names
    shards = {names[k]: v for k, v in part.module.state_dict().items() if k in names and names[k] in mine}
    optimizer: dict[str, Any] = {}
    for weights in part.weights:
        if weights.optimizer is None:
            continue
        params = {name: p for name, p in zip((part.state_names.get(n, n) for n in weights.names), weights.params)}
        for name, entry in state_by_name(weights.optimizer, _name_of_parameters(part, weights)).items():
            moved = [k for k, v in entry["state"].items()
                     if isinstance(v, torch.Tensor) and v.shape == params[name].shape and v.dim() > 0]
            shards.update({f"optimizer/{name}/{k}": entry["state"][k] for k in moved})
            optimizer[name] = {**entry, "state": {k: v for k, v in entry["state"].items() if k not in moved},
                               "dcp": moved}
    folder = directory / _dcp_folder(part.stage)
    save_sharded(shards, folder, part.group)
    if part.replica != 0:
        return payload, []
    payload.update(tensors={}, optimizer={n: e for n, e in optimizer.items() if n in mine},
                   dcp=folder.name, dcp_tensors=sorted(n for n in shards if not n.startswith("optimizer/")))
    entries = []
    for path in sorted(p for p in folder.iterdir() if p.is_file()):
        data = path.read_bytes()
        entries.append({"file": f"{folder.name}/{path.name}", "sha256": _sha256(data), "size": len(data),
                        "stage": part.stage})
    return payload, entries


def _prepare_directory(state: CheckpointState, directory: Path) -> str:
    """Agree on the save's identifier and make the directory (rank 0 takes its manifest away:
    the directory stops being a checkpoint until the new manifest lands)."""
    save_id = _exchange(state, "the start of a checkpoint", uuid.uuid4().hex if state.rank == 0 else None)[0]
    error = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if state.rank == 0:
            (directory / MANIFEST).unlink(missing_ok=True)
            for folder in directory.glob(f"stage*{DCP_SUFFIX}"):  # a sharded stage's shards of an earlier save
                shutil.rmtree(folder)
            _fsync_dir(directory)
    except OSError as exc:
        error = f"cannot prepare checkpoint directory {directory}: {exc.strerror or exc}"
    _agree(state, "the creation of the checkpoint directory", error)
    return save_id


def _write_stage(state: CheckpointState, part: StageState, directory: Path, save_id: str,
                 owner: dict[str, int]) -> list[dict[str, Any]]:
    """Write one stage's file (and its DCP folder where it is sharded); their manifest entries."""
    entries: list[dict[str, Any]] = []
    if any(w.sharded for w in part.weights):
        payload, entries = _sharded_stage_file(state, part, save_id, owner, directory)
    else:
        payload = _stage_file(state, part, save_id, owner)
    data = _serialize(payload)
    liveness.mark()
    write_atomic(directory / part.own_file, data)
    entries.append({"file": part.own_file, "sha256": _sha256(data), "size": len(data), "stage": part.stage,
                    "replica": part.replica, "rank": state.rank})
    return entries


def _write_files(state: CheckpointState, directory: Path, save_id: str, owner: dict[str, int],
                 extra: dict[str, Any]) -> list[dict[str, Any]]:
    """Write this rank's stage files, in stage order (and rank 0 ``extra.json``); their manifest entries."""
    entries: list[dict[str, Any]] = []
    error = None
    try:
        for part in state.stages:
            entries += _write_stage(state, part, directory, save_id, owner)
        if state.rank == 0:
            digest, size = write_json_atomic(directory / EXTRA, {"save_id": save_id, "extra": extra})
            entries.append({"file": EXTRA, "sha256": digest, "size": size})
    except OSError as exc:
        error = f"rank {state.rank}: {exc.strerror or exc}"
    except Exception as exc:  # mid-schedule, an extra that is not JSON: must reach every rank
        error = f"rank {state.rank}: cannot write its checkpoint file into {directory}: {type(exc).__name__}: {exc}"
    _agree(state, "the writing of the checkpoint files", error)
    return entries


def _manifest(state: CheckpointState, save_id: str, owner: dict[str, int],
              files: list[dict[str, Any]]) -> dict[str, Any]:
    """The manifest's content (see the module docstring)."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "save_id": save_id,
        "created_unix": time.time(),
        "world_size": state.world_size,
        "plan_config": state.plan.config,
        "plan": state.plan.to_dict(),
        "schedule": state.kind,
        "version": state.stages[0].weights[0].version,
        "data": {"epoch": state.epochs_done, "minibatches": state.minibatches_done},
        "files": files,
        "history": [float(x) for x in state.history],
        # Which file holds each tensor (and the optimizer state of each trained one), by
        # the model's names: any plan reads what its stages need (module docstring).
        "index": {name: f"stage{stage}.pt" for name, stage in sorted(owner.items())},
        "aliases": dict(sorted(state.aliases.items())),
        # float16's loss scale (the same on every rank), so a resumed run skips what it would have
        "loss_scaler": state.scaler.state_dict() if state.scaler is not None else None,
    }


def save_checkpoint(state: CheckpointState, directory: str | Path, **extra: Any) -> Path:
    """Write ``state`` into ``directory`` (collective: call on every rank, at a schedule
    boundary). ``extra`` must be JSON-serialisable (it is written as ``extra.json``)."""
    directory = Path(directory)
    save_id = _prepare_directory(state, directory)
    holdings = _exchange(state, "the checkpoint's names", _holdings(state))
    owner = _owners(holdings)
    entries = _write_files(state, directory, save_id, owner, extra)
    # Every stage file is on disk before rank 0 writes the manifest.
    parts = _exchange(state, "the checkpoint file list", entries)
    error = None
    if state.rank == 0:
        manifest = _manifest(state, save_id, owner, [e for p in parts for e in p])
        try:
            write_atomic(directory / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
        except OSError as exc:
            error = f"cannot write the checkpoint manifest: {exc.strerror or exc}"
    _agree(state, "the writing of the checkpoint manifest", error)  # nobody returns before it exists
    log.info("rank %d: checkpoint %s written", state.rank, directory)
    return directory


# ---------------------------------------------------------------------------- load
@dataclass
class _LoadedStage:
    """What one rank read for one of its stages: its state dict (own keys), its optimizers'
    states by name, and its update count."""

    state: dict[str, torch.Tensor]
    optimizer: dict[str, dict[str, Any]]
    version: int


@dataclass
class _Loaded:
    """What one rank read: each of its stages' part (in the order of ``CheckpointState.stages``),
    its own random state (None when the checkpoint's ranks were laid out otherwise), the
    manifest and extra."""

    stages: list[_LoadedStage]
    rng: dict[str, Any] | None
    manifest: Manifest
    extra: dict[str, Any]

    @property
    def version(self) -> int:
        return self.stages[0].version
def _same_layout(state: CheckpointState, manifest: Manifest) -> bool:
    if manifest.world_size != state.world_size:
        return False
    try:
        return Plan.from_dict(manifest.plan).same_layout(state.plan)
    except PlanError:
        return False


class _StageFiles:
    """The checkpoint's stage files, each read, verified and loaded (as plain tensors) once."""

    def __init__(self, directory: Path, manifest: Manifest) -> None:
        self.directory, self.manifest = directory, manifest
        self._by_file = {e["file"]: e for e in manifest.files}
        self._files: dict[str, dict[str, Any]] = {}

    def payload(self, name: str) -> dict[str, Any]:
        if name not in self._files:
            if name not in self._by_file:
                raise CheckpointError(f"checkpoint {self.directory}: the manifest lists no {name}")
            self._files[name] = _load_tensors(_read_verified(self.directory, self._by_file[name]),
                                              self.directory / name, self.manifest.save_id)
        return self._files[name]

    def from_folder(self, holder: str, likes: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors ``likes`` names, from the DCP folder of the sharded stage whose file is
        ``holder``, each in its like's layout (this rank's shard, or whole), shapes checked."""
        folder = self.directory / self.payload(holder)["dcp"]
        specs = _folder_specs(folder)
        for name, like in likes.items():
            if name not in specs:
                raise CheckpointError(f"checkpoint folder {folder} holds no {name}, which the manifest says it holds")
            if tuple(specs[name][0]) != tuple(like.shape):
                raise CheckpointError(f"checkpoint folder {folder}: {name} is {tuple(specs[name][0])}, the model's is "
                                      f"{tuple(like.shape)}: resume with the same model")
        targets = {name: torch.empty_like(like) for name, like in likes.items()}
        load_sharded(targets, folder)
        return targets


def _folder_specs(folder: Path) -> dict[str, tuple[Any, torch.dtype]]:
    """A DCP folder's tensor names, shapes and dtypes, or CheckpointError (its metadata unreadable
    or naming code to run)."""
    try:
        return saved_tensor_specs(folder)
    except UnsafeMetadataError as exc:
        raise CheckpointError(str(exc)) from None
    except Exception as exc:  # a missing or malformed .metadata
        raise CheckpointError(f"checkpoint folder {folder} cannot be read: {type(exc).__name__}: {exc}") from None


def _read_tensors(part: StageState, files: _StageFiles) -> dict[str, torch.Tensor]:
    """A stage's state dict (its own keys) from the files that hold it, shapes checked."""
    directory, manifest = files.directory, files.manifest
    local = part.module.state_dict()
    needed = {part.state_names[k]: k for k in local if k in part.state_names}
    missing = sorted(n for n in needed if n not in manifest.index)
    if missing:
        raise CheckpointError(f"checkpoint {directory} holds no {missing[:4]}{' ...' if len(missing) > 4 else ''} "
                              f"that stage {part.stage} needs: it is from another model")
    tensors: dict[str, torch.Tensor] = {}
    in_folders: dict[str, dict[str, torch.Tensor]] = {}  # a sharded stage's file -> names its DCP folder holds
    for name, key in needed.items():
        holder = manifest.index[name]
        if name in files.payload(holder).get("dcp_tensors", ()):
            in_folders.setdefault(holder, {})[name] = local[key]
            continue
        tensor = files.payload(holder).get("tensors", {}).get(name)
        if not isinstance(tensor, torch.Tensor) or tensor.shape != local[key].shape:
            got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise CheckpointError(f"checkpoint file {directory / holder}: {name} is {got}, the model's is "
                                  f"{tuple(local[key].shape)}: resume with the same model")
        tensors[key] = tensor
    for holder, likes in in_folders.items():
        tensors.update({needed[name]: t for name, t in files.from_folder(holder, likes).items()})
    return tensors


def _read_optimizer_states(part: StageState, files: _StageFiles) -> dict[str, dict[str, Any]]:
    """The optimizer state of each of a stage's trained parameters, by the model's names."""
    index = files.manifest.index
    optimizer: dict[str, dict[str, Any]] = {}
    in_folders: dict[str, dict[str, torch.Tensor]] = {}  # as _read_tensors: state of the weights' shape
    for weights in part.weights:
        names = _name_of_parameters(part, weights)
        for p in weights.params:
            name = names[id(p)]
            entry = files.payload(index[name]).get("optimizer", {}).get(name)
            if entry is None:
                raise CheckpointError(f"checkpoint file {files.directory / index[name]} holds no optimizer state "
                                      f"for {name}")
            optimizer[name] = entry
            for k in entry.get("dcp", ()):
                in_folders.setdefault(index[name], {})[f"optimizer/{name}/{k}"] = p.detach()
    for holder, likes in in_folders.items():
        for key, t in files.from_folder(holder, likes).items():
            _, name, k = key.split("/", 2)
            optimizer[name] = {**optimizer[name], "state": {**optimizer[name]["state"], k: t}}
    return optimizer


def _read_for_rank(state: CheckpointState, directory: Path) -> _Loaded:
    """Read and check what this rank's stages need, from whichever files hold it (any plan)."""
    manifest = verify_checkpoint(directory) if state.rank == 0 else read_manifest(directory)
    files = _StageFiles(directory, manifest)
    # Laid out as saved: this rank's own random state and each stage's update count. Otherwise
    # the count is a label (weight versions are counted from a schedule's start): rank 0's.
    same = _same_layout(state, manifest)
    stages = [_LoadedStage(_read_tensors(part, files), _read_optimizer_states(part, files),
                           int(files.payload(part.own_file)["version"]) if same else manifest.version)
              for part in state.stages]
    rng = files.payload(state.stages[0].own_file)["rng"] if same else None
    return _Loaded(stages, rng, manifest, read_extra(directory, manifest))


def _check_names_cover(state: CheckpointState, directory: Path, manifest: Manifest) -> str | None:
    """Every tensor of the checkpoint is used by some stage of this pipeline (else the model
    lacks some of the checkpoint's layers): checked on rank 0 from every rank's names."""
    names = _exchange(state, "the names the stages load",
                      sorted({n for part in state.stages for n in part.state_names.values()}))
    if state.rank != 0:
        return None
    unused = sorted(set(manifest.index) - {n for part in names for n in part})
    if unused:
        return (f"checkpoint {directory} holds {unused[:4]}{' ...' if len(unused) > 4 else ''}, which this model "
                "does not have: resume with the same model")
    return None


def _read_everywhere(state: CheckpointState, directory: Path) -> _Loaded:
    """Every rank reads what it needs; any rank's failure is raised on every rank."""
    error = None
    loaded = None
    try:
        loaded = _read_for_rank(state, directory)
    except CheckpointError as exc:
        error = str(exc)
    except Exception as exc:  # a malformed file: refuse on every rank, never hang
        error = f"checkpoint {directory} cannot be used: {type(exc).__name__}: {exc}"
    _agree(state, "the reading of the checkpoint files", error)
    assert loaded is not None  # every rank read its files (the agreement above)
    _agree(state, "the checking of the checkpoint's names", _check_names_cover(state, directory, loaded.manifest))
    return loaded


def _restore_stage(part: StageState, loaded: _LoadedStage) -> None:
    """Put what was read into one stage: tensors, weight versions, optimizer states."""
    local = part.module.state_dict()
    with torch.no_grad():  # whole tensors, cut to this replica's shards where the stage is sharded
        part.module.load_state_dict({k: shard_like(v, local[k]) for k, v in loaded.state.items()}, strict=False)
    if part.buffers is not None:
        part.buffers.snapshot()
    for weights in part.weights:
        weights.restore_boundary_state({"version": loaded.version, "optimizer": None})
        if weights.optimizer is not None:
            names = _name_of_parameters(part, weights)
            saved = sharded_optimizer_entries(loaded.optimizer, {names[id(p)]: p for p in weights.params}) \
                if weights.sharded else loaded.optimizer
            load_state_by_name(weights.optimizer, saved, names)
            weights.resume_schedule()  # the learning rate of the restored update count


def _restore(state: CheckpointState, loaded: _Loaded, directory: Path) -> None:
    """Put what was read into every stage of this rank, then its loss scale (agreed on every
    rank) and random state."""
    error = None
    try:
        for part, part_loaded in zip(state.stages, loaded.stages):
            _restore_stage(part, part_loaded)
        scaler_state = loaded.manifest.raw.get("loss_scaler")
        if state.scaler is not None and isinstance(scaler_state, dict):
            state.scaler.load_state_dict(scaler_state)
    except (OptimizerStateError, ValueError) as exc:
        error = f"checkpoint {directory}: {exc}"
    _agree(state, "the loading of the optimizer states", error)
    if loaded.rng is not None:
        _set_rng_state(loaded.rng, state.device)


def load_checkpoint(state: CheckpointState, directory: str | Path) -> Resumed:
    """Restore ``state`` from ``directory`` (collective); returns the ``extra`` given at save
    time, the data position and the loss history.

    The checkpoint may come from any plan of the same model (other stages, replicas, workers or
    schedule): each rank reads the tensors its stage needs by name. Nothing is changed unless
    every rank verified what it needs.
    """
    directory = Path(directory)
    loaded = _read_everywhere(state, directory)
    _restore(state, loaded, directory)
    resumed = Resumed(loaded.extra, loaded.manifest.epoch, loaded.manifest.minibatches, list(loaded.manifest.history))
    if state.agreement is not None:
        state.agreement.barrier("the end of loading the checkpoint")
    log.info("rank %d: resumed from %s at version %d", state.rank, directory, loaded.version)
    return resumed
