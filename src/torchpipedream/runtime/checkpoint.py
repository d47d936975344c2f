"""Exact checkpoints of a pipeline, keyed by the model's own names, loadable onto any plan.

Layout of a checkpoint directory (format 3)::

    stage0.pt             replica 0 of each stage: the tensors (parameters and buffers) it is
    stage1.pt             the first stage to hold, by the model's names, and their optimizer
                          state by name (``optimizer_state.py``); its version and RNG state
    stage1_replica1.pt    other replicas: their own RNG state only (their weights and optimizer
                          state equal replica 0's by construction: same all-reduced update)
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
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..plans.plan import Plan, PlanError
from ..model.capture import with_aliases
from . import liveness
from .optimizer_state import OptimizerStateError, load_state_by_name, state_by_name

if TYPE_CHECKING:  # pragma: no cover
    from .pipeline import Pipeline

__all__ = ["CheckpointError", "Manifest", "save_checkpoint", "load_checkpoint", "verify_checkpoint",
           "latest_checkpoint", "checkpoints_newest_first", "read_manifest", "read_extra", "read_stage_states",
           "remove_temporary_files", "MANIFEST", "EXTRA"]

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
EXTRA = "extra.json"
FORMAT = "torchpipedream.Checkpoint"
FORMAT_VERSION = 3
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


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that ``path`` is either the old file or all of the new; a
    failed write leaves no temporary file behind. OSError carries a one-line reason."""
    tmp = path.with_name(f".{path.name}{_TMP_MARK}{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OSError(exc.errno, _disk_error(path, exc)) from None
    _fsync_dir(path.parent)


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
        if Path(entry["file"]).name != entry["file"] or entry["file"].startswith("."):
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
    except (UnicodeDecodeError, ValueError) as exc:
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
        for name, holder in manifest.index.items():
            if holder == file:
                if not isinstance(tensors.get(name), torch.Tensor):
                    raise CheckpointError(f"checkpoint file {directory / file} lacks {name}, which the manifest "
                                          "says it holds")
                state[name] = tensors[name]
    return with_aliases(state, manifest.aliases.values())


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
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]
    except ImportError:  # pragma: no cover
        pass
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    version, mt, gauss = state["python"]
    random.setstate((int(version), tuple(int(x) for x in mt), gauss))
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(cached)))
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


# ---------------------------------------------------------------------------- collectives
def _agree(pipe: "Pipeline", what: str, error: str | None) -> None:
    """Raise the first rank's error on every rank (so no rank walks into a collective that
    would hang); a rank that does not answer within the deadline is named."""
    if not pipe.distributed:
        if error is not None:
            raise CheckpointError(error)
        return
    first = pipe.agreement.first_error(what, error)
    if first is not None:
        r, text = first
        raise CheckpointError(text if r == pipe.rank else f"{text} (reported by rank {r})")


def _exchange(pipe: "Pipeline", what: str, value: Any) -> list[Any]:
    return pipe.agreement.exchange(what, value) if pipe.distributed else [value]


# ---------------------------------------------------------------------------- save / load
def _name_of_parameters(pipe: "Pipeline", weights: Any) -> dict[int, str]:
    """id(parameter) -> the model's name, for one WeightVersions' parameters."""
    return {id(p): pipe.state_names.get(n, n) for n, p in zip(weights.names, weights.params)}


def _holdings(pipe: "Pipeline") -> dict[str, list[str]]:
    """What this rank's stage holds, by the model's names (replica 0 writes it)."""
    return {"tensors": sorted(set(pipe.state_names.values())) if pipe.replica == 0 else []}


def _owners(pipe: "Pipeline", holdings: list[dict[str, list[str]]]) -> dict[str, int]:
    """Name -> the stage that writes it: the first stage holding it (a shared parameter and a
    constant buffer used by several stages are written once)."""
    owner: dict[str, int] = {}
    for rank in sorted(range(len(holdings)), key=lambda r: pipe.plan.stage_of_rank(r)):
        for name in holdings[rank]["tensors"]:
            owner.setdefault(name, pipe.plan.stage_of_rank(rank)[0])
    return owner


def _stage_file(pipe: "Pipeline", save_id: str, owner: dict[str, int]) -> tuple[str, dict[str, Any]]:
    """This rank's file name and content (tensors and plain values only)."""
    states = [w.boundary_state() for w in pipe._all_weights()]  # asserts nothing is in flight
    payload: dict[str, Any] = {"save_id": save_id, "stage": pipe.stage, "replica": pipe.replica, "rank": pipe.rank,
                               "version": states[0]["version"], "rng": _rng_state(pipe.device),
                               "data": {"epoch": pipe.epochs_done, "minibatches": pipe.minibatches_done}}
    if pipe.replica != 0:
        return f"stage{pipe.stage}_replica{pipe.replica}.pt", payload
    mine = {name for name, s in owner.items() if s == pipe.stage}
    local = pipe.module.state_dict()
    tensors = {pipe.state_names[k]: v.detach().cpu().clone() for k, v in local.items()
               if k in pipe.state_names and pipe.state_names[k] in mine}
    optimizer: dict[str, Any] = {}
    for weights in pipe._all_weights():
        if weights.optimizer is not None:
            for name, entry in state_by_name(weights.optimizer, _name_of_parameters(pipe, weights)).items():
                if name in mine:
                    optimizer[name] = entry
    payload.update(tensors=tensors, optimizer=optimizer)
    return f"stage{pipe.stage}.pt", payload


def save_checkpoint(pipe: "Pipeline", directory: str | Path, **extra: Any) -> Path:
    """Write ``pipe``'s state into ``directory`` (collective: call on every rank, at a schedule
    boundary). ``extra`` must be JSON-serialisable (it is written as ``extra.json``)."""
    directory = Path(directory)
    save_id = _exchange(pipe, "the start of a checkpoint", uuid.uuid4().hex if pipe.rank == 0 else None)[0]
    error = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if pipe.rank == 0:
            # Overwriting: the directory stops being a checkpoint until the new manifest lands.
            (directory / MANIFEST).unlink(missing_ok=True)
            _fsync_dir(directory)
    except OSError as exc:
        error = f"cannot prepare checkpoint directory {directory}: {exc.strerror or exc}"
    _agree(pipe, "the creation of the checkpoint directory", error)
    holdings = _exchange(pipe, "the checkpoint's names", _holdings(pipe))
    owner = _owners(pipe, holdings)

    entries: list[dict[str, Any]] = []
    error = None
    try:
        name, payload = _stage_file(pipe, save_id, owner)
        data = _serialize(payload)
        liveness.mark()
        write_atomic(directory / name, data)
        entries.append({"file": name, "sha256": _sha256(data), "size": len(data), "stage": pipe.stage,
                        "replica": pipe.replica, "rank": pipe.rank})
        if pipe.rank == 0:
            data = json.dumps({"save_id": save_id, "extra": extra}, indent=1).encode()
            write_atomic(directory / EXTRA, data)
            entries.append({"file": EXTRA, "sha256": _sha256(data), "size": len(data)})
    except OSError as exc:
        error = f"rank {pipe.rank}: {exc.strerror or exc}"
    except Exception as exc:  # mid-schedule, an extra that is not JSON: must reach every rank
        error = f"rank {pipe.rank}: cannot write its checkpoint file into {directory}: {type(exc).__name__}: {exc}"
    _agree(pipe, "the writing of the checkpoint files", error)

    # Every stage file is on disk before rank 0 writes the manifest.
    parts = _exchange(pipe, "the checkpoint file list", entries)
    error = None
    if pipe.rank == 0:
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "save_id": save_id,
            "created_unix": time.time(),
            "world_size": pipe.world_size,
            "plan_config": pipe.plan.config,
            "plan": pipe.plan.to_dict(),
            "schedule": pipe.kind,
            "version": pipe.weights.version,
            "data": {"epoch": pipe.epochs_done, "minibatches": pipe.minibatches_done},
            "files": [e for p in parts for e in p],
            "history": [float(x) for x in pipe.history],
            # Which file holds each tensor (and the optimizer state of each trained one), by
            # the model's names: any plan reads what its stages need (module docstring).
            "index": {name: f"stage{stage}.pt" for name, stage in sorted(owner.items())},
            "aliases": dict(sorted(pipe._aliases.items())),
            # float16's loss scale (the same on every rank), so a resumed run skips what it would have
            "loss_scaler": pipe.engine.scaler.state_dict() if pipe.engine.scaler is not None else None,
        }
        try:
            write_atomic(directory / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
        except OSError as exc:
            error = f"cannot write the checkpoint manifest: {exc.strerror or exc}"
    _agree(pipe, "the writing of the checkpoint manifest", error)  # nobody returns before it exists
    log.info("rank %d: checkpoint %s written", pipe.rank, directory)
    return directory


@dataclass
class _Loaded:
    """What one rank read for its stage: its state dict (own keys), its optimizers' states by
    name, its own random state (None when the checkpoint's ranks were laid out otherwise), the
    data position and extra."""

    state: dict[str, torch.Tensor]
    optimizer: dict[str, dict[str, Any]]
    rng: dict[str, Any] | None
    manifest: Manifest
    extra: dict[str, Any]
    version: int


def _same_layout(pipe: "Pipeline", manifest: Manifest) -> bool:
    if manifest.world_size != pipe.world_size:
        return False
    try:
        return Plan.from_dict(manifest.plan).same_layout(pipe.plan)
    except PlanError:
        return False


def _read_for_stage(pipe: "Pipeline", directory: Path) -> _Loaded:
    """Read and check what this rank needs, from whichever files hold it (any plan)."""
    manifest = verify_checkpoint(directory) if pipe.rank == 0 else read_manifest(directory)
    by_file = {e["file"]: e for e in manifest.files}
    local = pipe.module.state_dict()
    needed = {pipe.state_names[k]: k for k in local if k in pipe.state_names}
    missing = sorted(n for n in needed if n not in manifest.index)
    if missing:
        raise CheckpointError(f"checkpoint {directory} holds no {missing[:4]}{' ...' if len(missing) > 4 else ''} "
                              f"that stage {pipe.stage} needs: it is from another model")
    files: dict[str, dict[str, Any]] = {}

    def payload(name: str) -> dict[str, Any]:
        if name not in files:
            if name not in by_file:
                raise CheckpointError(f"checkpoint {directory}: the manifest lists no {name}")
            files[name] = _load_tensors(_read_verified(directory, by_file[name]), directory / name, manifest.save_id)
        return files[name]

    state: dict[str, torch.Tensor] = {}
    for name, key in needed.items():
        holder = manifest.index[name]
        tensor = payload(holder).get("tensors", {}).get(name)
        if not isinstance(tensor, torch.Tensor) or tensor.shape != local[key].shape:
            got = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            raise CheckpointError(f"checkpoint file {directory / holder}: {name} is {got}, the model's is "
                                  f"{tuple(local[key].shape)}: resume with the same model")
        state[key] = tensor
    optimizer: dict[str, dict[str, Any]] = {}
    for weights in pipe._all_weights():
        for name in _name_of_parameters(pipe, weights).values():
            entry = payload(manifest.index[name]).get("optimizer", {}).get(name)
            if entry is None:
                raise CheckpointError(f"checkpoint file {directory / manifest.index[name]} holds no optimizer state "
                                      f"for {name}")
            optimizer[name] = entry
    # Laid out as saved: this rank's own random state and update count. Otherwise the count is
    # a label (weight versions are counted from a schedule's start): rank 0's.
    own = f"stage{pipe.stage}.pt" if pipe.replica == 0 else f"stage{pipe.stage}_replica{pipe.replica}.pt"
    same = _same_layout(pipe, manifest)
    rng, version = (payload(own)["rng"], int(payload(own)["version"])) if same else (None, manifest.version)
    return _Loaded(state, optimizer, rng, manifest, read_extra(directory, manifest), version)


def _check_names_cover(pipe: "Pipeline", directory: Path, manifest: Manifest) -> str | None:
    """Every tensor of the checkpoint is used by some stage of this pipeline (else the model
    lacks some of the checkpoint's layers): checked on rank 0 from every rank's names."""
    names = _exchange(pipe, "the names the stages load", sorted(set(pipe.state_names.values())))
    if pipe.rank != 0:
        return None
    unused = sorted(set(manifest.index) - {n for part in names for n in part})
    if unused:
        return (f"checkpoint {directory} holds {unused[:4]}{' ...' if len(unused) > 4 else ''}, which this model "
                "does not have: resume with the same model")
    return None


def load_checkpoint(pipe: "Pipeline", directory: str | Path) -> dict[str, Any]:
    """Restore ``pipe`` from ``directory`` (collective); returns the ``extra`` given at save time.

    The checkpoint may come from any plan of the same model (other stages, replicas, workers or
    schedule): each rank reads the tensors its stage needs by name. Nothing is changed unless
    every rank verified what it needs.
    """
    directory = Path(directory)
    error = None
    loaded = None
    try:
        loaded = _read_for_stage(pipe, directory)
    except CheckpointError as exc:
        error = str(exc)
    except Exception as exc:  # a malformed file: refuse on every rank, never hang
        error = f"checkpoint {directory} cannot be used: {type(exc).__name__}: {exc}"
    _agree(pipe, "the reading of the checkpoint files", error)
    assert loaded is not None  # every rank read its files (the agreement above)
    _agree(pipe, "the checking of the checkpoint's names", _check_names_cover(pipe, directory, loaded.manifest))

    with torch.no_grad():
        pipe.module.load_state_dict(loaded.state, strict=False)
    if pipe.engine.buffers is not None:
        pipe.engine.buffers.snapshot()
    error = None
    try:
        for weights in pipe._all_weights():
            weights.restore_boundary_state({"version": loaded.version, "optimizer": None})
            if weights.optimizer is not None:
                load_state_by_name(weights.optimizer, loaded.optimizer, _name_of_parameters(pipe, weights))
        scaler_state = loaded.manifest.raw.get("loss_scaler")
        if pipe.engine.scaler is not None and isinstance(scaler_state, dict):
            pipe.engine.scaler.load_state_dict(scaler_state)
    except (OptimizerStateError, ValueError) as exc:
        error = f"checkpoint {directory}: {exc}"
    _agree(pipe, "the loading of the optimizer states", error)
    if loaded.rng is not None:
        _set_rng_state(loaded.rng, pipe.device)
    pipe.epochs_done = loaded.manifest.epoch
    pipe.minibatches_done = loaded.manifest.minibatches
    pipe.history.clear()
    pipe.history.extend(loaded.manifest.history)
    if pipe.distributed:
        pipe.agreement.barrier("the end of loading the checkpoint")
    log.info("rank %d: resumed from %s at version %d", pipe.rank, directory, loaded.version)
    return loaded.extra
