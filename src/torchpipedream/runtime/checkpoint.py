"""Exact checkpoints of a pipeline: per-stage files written atomically, a manifest written last.

Layout of a checkpoint directory (format 2)::

    stage0.pt             replica 0 of each stage: weights and buffers, optimizer state,
    stage1.pt             weight version, data position, this rank's RNG state
    stage1_replica1.pt    other replicas: their own RNG state only (their weights and optimizer
                          state equal replica 0's by construction: same all-reduced update)
    extra.json            the caller's ``**extra`` (JSON), written by rank 0
    manifest.json         written LAST by rank 0: the save's identifier, every file with its
                          sha256 and size, the plan, the world size, the data position

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

from . import liveness

if TYPE_CHECKING:  # pragma: no cover
    from .pipeline import Pipeline

__all__ = ["CheckpointError", "Manifest", "save_checkpoint", "load_checkpoint", "verify_checkpoint",
           "latest_checkpoint", "checkpoints_newest_first", "read_manifest", "read_extra", "read_stage_states",
           "remove_temporary_files", "MANIFEST", "EXTRA"]

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
EXTRA = "extra.json"
FORMAT = "torchpipedream.Checkpoint"
FORMAT_VERSION = 2
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
    return Manifest(path=path, save_id=_need(data, "save_id", str, path), created_unix=created,
                    world_size=_need(data, "world_size", int, path), plan=_need(data, "plan", dict, path),
                    schedule=_need(data, "schedule", str, path), version=_need(data, "version", int, path),
                    epoch=_need(data_pos, "epoch", int, Path(f"{path} data")),
                    minibatches=_need(data_pos, "minibatches", int, Path(f"{path} data")),
                    files=files, raw=data)


def verify_checkpoint(directory: str | Path) -> Manifest:
    """Check the manifest and the size and sha256 of every file it lists; returns the manifest."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    for entry in manifest.files:
        _read_verified(directory, entry)
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
    """The whole model's state (parameters and buffers by name) from a checkpoint's stage files,
    without a pipeline: what :meth:`Pipeline.state_dict` would give at that point."""
    directory = Path(directory)
    manifest = verify_checkpoint(directory)
    state: dict[str, torch.Tensor] = {}
    for entry in manifest.files:
        if entry["file"].startswith("stage") and "_replica" not in entry["file"]:
            payload = _load_tensors(_read_verified(directory, entry), directory / entry["file"], manifest.save_id)
            module = payload.get("module")
            if not isinstance(module, dict):
                raise CheckpointError(f"checkpoint file {directory / entry['file']} holds no module state")
            state.update(module)
    return state


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


def _plan_layout(pipe: "Pipeline") -> list[dict[str, Any]]:
    return [{"layers": list(st.layers), "ranks": list(st.ranks)} for st in pipe.plan.stages]


def _check_compatible(pipe: "Pipeline", manifest: Manifest, directory: Path) -> None:
    plan_config = manifest.raw.get("plan_config", "?")
    if manifest.world_size != pipe.world_size:
        raise CheckpointError(
            f"checkpoint {directory} was saved by {manifest.world_size} workers (plan {plan_config}) "
            f"but this pipeline runs {pipe.world_size}: resume with the same plan and number of workers"
        )
    saved, mine = manifest.raw.get("stages"), _plan_layout(pipe)
    if not isinstance(saved, list) or len(saved) != len(mine):
        raise CheckpointError(
            f"checkpoint {directory} has {len(saved) if isinstance(saved, list) else '?'} stages (plan {plan_config}) "
            f"but this pipeline's plan has {len(mine)} ({pipe.plan.config}): resume with the same model and plan"
        )
    for s, (a, b) in enumerate(zip(saved, mine)):
        if not isinstance(a, dict) or a.get("layers") != b["layers"] or a.get("ranks") != b["ranks"]:
            what = "layers" if not isinstance(a, dict) or a.get("layers") != b["layers"] else "ranks"
            theirs = a.get(what, []) if isinstance(a, dict) else []
            raise CheckpointError(
                f"checkpoint {directory} is from another model or plan: stage {s} {what} differ "
                f"(checkpoint {theirs[:6]}{' ...' if len(theirs) > 6 else ''}, "
                f"this pipeline {b[what][:6]}{' ...' if len(b[what]) > 6 else ''}): resume with the same model and plan"
            )


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
def _stage_file(pipe: "Pipeline", save_id: str) -> tuple[str, dict[str, Any]]:
    """This rank's file name and content (tensors and plain values only)."""
    state = pipe.weights.boundary_state()  # asserts nothing is in flight
    payload: dict[str, Any] = {"save_id": save_id, "stage": pipe.stage, "replica": pipe.replica, "rank": pipe.rank,
                               "version": state["version"], "rng": _rng_state(pipe.device),
                               "data": {"epoch": pipe.epochs_done, "minibatches": pipe.minibatches_done},
                               "history": [float(x) for x in pipe.history]}
    # A shared parameter's copy has an optimizer of its own (runtime/engine.py, TiedCopy).
    tied = {pipe.plan.tied[k].name: copy.weights.boundary_state()["optimizer"] for k, copy in pipe.tied.items()}
    if pipe.replica == 0:
        payload.update(layers=list(pipe.plan.stages[pipe.stage].layers), module=pipe.stage_state_dict(),
                       optimizer=state["optimizer"], tied_optimizers=tied)
        return f"stage{pipe.stage}.pt", payload
    return f"stage{pipe.stage}_replica{pipe.replica}.pt", payload


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

    entries: list[dict[str, Any]] = []
    error = None
    try:
        name, payload = _stage_file(pipe, save_id)
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
            "stages": _plan_layout(pipe),
            "version": pipe.weights.version,
            "data": {"epoch": pipe.epochs_done, "minibatches": pipe.minibatches_done},
            "files": [e for p in parts for e in p],
        }
        try:
            write_atomic(directory / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
        except OSError as exc:
            error = f"cannot write the checkpoint manifest: {exc.strerror or exc}"
    _agree(pipe, "the writing of the checkpoint manifest", error)  # nobody returns before it exists
    log.info("rank %d: checkpoint %s written", pipe.rank, directory)
    return directory


def _read_own_files(pipe: "Pipeline", directory: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(replica 0's stage payload, this rank's own payload, extra), checked against the pipeline."""
    manifest = verify_checkpoint(directory) if pipe.rank == 0 else read_manifest(directory)
    _check_compatible(pipe, manifest, directory)
    by_name = {e["file"]: e for e in manifest.files}
    main_name = f"stage{pipe.stage}.pt"
    own_name = f"stage{pipe.stage}_replica{pipe.replica}.pt" if pipe.replica > 0 else main_name
    payloads = {}
    for name in {main_name, own_name}:
        if name not in by_name:
            raise CheckpointError(f"checkpoint {directory}: the manifest lists no {name}")
        payloads[name] = _load_tensors(_read_verified(directory, by_name[name]), directory / name, manifest.save_id)
    main = payloads[main_name]
    if main.get("layers") != list(pipe.plan.stages[pipe.stage].layers):
        raise CheckpointError(f"checkpoint file {directory / main_name} holds other layers than stage {pipe.stage}")
    module = main.get("module")
    if not isinstance(module, dict):
        raise CheckpointError(f"checkpoint file {directory / main_name} holds no module state")
    mine = pipe.module.state_dict()
    missing, unexpected = sorted(set(mine) - set(module)), sorted(set(module) - set(mine))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint file {directory / main_name} does not fit stage {pipe.stage}'s module "
            f"(missing keys {missing[:4]}, unexpected keys {unexpected[:4]}): resume with the same model"
        )
    for key, t in module.items():
        if not isinstance(t, torch.Tensor) or t.shape != mine[key].shape:
            raise CheckpointError(
                f"checkpoint file {directory / main_name}: {key} has shape "
                f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__} but the model's is "
                f"{tuple(mine[key].shape)}: resume with the same model"
            )
    tied = main.get("tied_optimizers", {})
    wanted = sorted(pipe.plan.tied[k].name for k in pipe.tied)
    if not isinstance(tied, dict) or sorted(tied) != wanted:
        raise CheckpointError(
            f"checkpoint file {directory / main_name} holds optimizer states for the shared parameters "
            f"{sorted(tied) if isinstance(tied, dict) else tied!r}, stage {pipe.stage} needs {wanted}: resume with "
            "the same model and plan")
    return main, payloads[own_name], read_extra(directory, manifest)


def load_checkpoint(pipe: "Pipeline", directory: str | Path) -> dict[str, Any]:
    """Restore ``pipe`` from ``directory`` (collective); returns the ``extra`` given at save time.

    Nothing is changed unless every rank verified what it needs.
    """
    directory = Path(directory)
    error = None
    try:
        main, own, extra = _read_own_files(pipe, directory)
    except CheckpointError as exc:
        error = str(exc)
    except Exception as exc:  # a malformed file: refuse on every rank, never hang
        error = f"checkpoint {directory} cannot be used: {type(exc).__name__}: {exc}"
    _agree(pipe, "the reading of the checkpoint files", error)

    with torch.no_grad():
        pipe.module.load_state_dict(main["module"])
    if pipe.engine.buffers is not None:
        pipe.engine.buffers.snapshot()
    pipe.weights.restore_boundary_state({"version": main["version"], "optimizer": main["optimizer"]})
    for k, copy in pipe.tied.items():
        copy.weights.restore_boundary_state({"version": main["version"],
                                             "optimizer": main["tied_optimizers"][pipe.plan.tied[k].name]})
    _set_rng_state(own["rng"], pipe.device)
    pipe.epochs_done = int(own["data"]["epoch"])
    pipe.minibatches_done = int(own["data"]["minibatches"])
    pipe.history.clear()
    pipe.history.extend(float(x) for x in own.get("history", []))
    if pipe.distributed:
        pipe.agreement.barrier("the end of loading the checkpoint")
    log.info("rank %d: resumed from %s at version %d", pipe.rank, directory, main["version"])
    return extra
