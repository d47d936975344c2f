"""Exact checkpoints of a pipeline: per-stage files written atomically, a manifest written last.

Layout of a checkpoint directory::

    stage0.pt             replica 0 of each stage: weights and buffers, optimizer state,
    stage1.pt             weight version, data position, this rank's RNG state
    stage1_replica1.pt    other replicas: their own RNG state only (their weights and optimizer
                          state equal replica 0's by construction: same all-reduced update)
    extra.pt              the caller's ``**extra`` (written by rank 0)
    manifest.json         written LAST by rank 0: every file with its sha256 and size, the
                          plan (config, per-stage layer names, ranks) and the world size

Only a directory whose manifest exists and whose every file matches its checksum is a
checkpoint. A crash at any moment leaves either the previous complete checkpoint or a
directory without a manifest, which :func:`latest_checkpoint` ignores.

Why saving is exact with no stashed versions in it: a checkpoint is taken at a schedule
boundary (after ``train_step``/``fit`` returned), when every minibatch that ran ``F`` has
also run ``B`` and ``U`` on every stage. No older weight version is still needed, so the
state of a stage is its latest weights, its optimizer state and its version counter
(:meth:`WeightVersions.boundary_state` asserts this). The manifest therefore records no
stashes; a later schedule starts from the same state whether or not the process restarted.

Every file is written to a temporary name in the same directory, flushed, fsynced and then
``os.replace``-d to its name (atomic on POSIX), and the directory is fsynced. Files are
hashed from the bytes written, gathered to rank 0 (which is also the barrier that makes every
stage file exist before the manifest), and rank 0 writes the manifest. The directory must
be visible to every rank (one machine, or a shared file system).

Loading is collective: every rank checks the manifest against its pipeline (world size,
plan) and the checksums of the files it reads (rank 0 checks every file); the ranks agree
on the first error, so all of them raise the same :class:`CheckpointError` instead of some
continuing into a collective that would hang.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:  # pragma: no cover
    from .pipeline import Pipeline

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "verify_checkpoint", "latest_checkpoint",
           "MANIFEST"]

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
FORMAT = "torchpipedream.Checkpoint"
FORMAT_VERSION = 1


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


def _write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that ``path`` is either the old file or all of the new."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _serialize(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _file_entry(name: str, data: bytes, **info: Any) -> dict[str, Any]:
    return {"file": name, "sha256": _sha256(data), "size": len(data), **info}


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


def _load_bytes(data: bytes, path: Path) -> Any:
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    except Exception as exc:  # checksum matched but the content is not ours
        raise CheckpointError(f"checkpoint file {path} cannot be unpickled: {type(exc).__name__}: {exc}") from None


# ---------------------------------------------------------------------------- manifest
def read_manifest(directory: str | Path) -> dict[str, Any]:
    """The manifest of a checkpoint directory (CheckpointError when missing or malformed)."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{directory} is not a complete checkpoint: {MANIFEST} is missing (the save did not finish); "
            "resume from an earlier checkpoint (latest_checkpoint() skips incomplete ones)"
        )
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint manifest {path} cannot be read: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a torchpipedream checkpoint manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format version {manifest.get('format_version')!r}, this version reads {FORMAT_VERSION}"
        )
    return manifest


def verify_checkpoint(directory: str | Path) -> dict[str, Any]:
    """Check the manifest and the size and sha256 of every file it lists; returns the manifest."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    for entry in manifest["files"]:
        _read_verified(directory, entry)
    return manifest


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete, verified checkpoint in ``root`` (itself or a subdirectory), or None.

    Directories without a manifest (a save that did not finish) are ignored; so is a
    checkpoint whose files fail verification (logged as a warning). "Newest" is the
    manifest's save time, then the directory name.
    """
    root = Path(root)
    if not root.is_dir():
        return None
    candidates: list[tuple[float, str, Path]] = []
    for d in [root] + sorted(p for p in root.iterdir() if p.is_dir()):
        try:
            manifest = read_manifest(d) if (d / MANIFEST).is_file() else None
        except CheckpointError as exc:
            log.warning("skipping checkpoint %s: %s", d, exc)
            continue
        if manifest is not None:
            candidates.append((float(manifest.get("created_unix", 0.0)), d.name, d))
    for _, _, d in sorted(candidates, reverse=True):  # newest first; verify only until one passes
        try:
            verify_checkpoint(d)
        except (CheckpointError, KeyError, TypeError) as exc:
            log.warning("skipping checkpoint %s: %s", d, exc)
            continue
        return d
    return None


def _plan_layout(pipe: "Pipeline") -> list[dict[str, Any]]:
    return [{"layers": list(st.layers), "ranks": list(st.ranks)} for st in pipe.plan.stages]


def _check_compatible(pipe: "Pipeline", manifest: dict[str, Any], directory: Path) -> None:
    if manifest["world_size"] != pipe.world_size:
        raise CheckpointError(
            f"checkpoint {directory} was saved by {manifest['world_size']} workers (plan {manifest['plan_config']}) "
            f"but this pipeline runs {pipe.world_size}: resume with the same plan and number of workers"
        )
    saved, mine = manifest["stages"], _plan_layout(pipe)
    if len(saved) != len(mine):
        raise CheckpointError(
            f"checkpoint {directory} has {len(saved)} stages (plan {manifest['plan_config']}) but this pipeline's "
            f"plan has {len(mine)} ({pipe.plan.config}): resume with the same model and plan"
        )
    for s, (a, b) in enumerate(zip(saved, mine)):
        if a["layers"] != b["layers"] or a["ranks"] != b["ranks"]:
            what = "layers" if a["layers"] != b["layers"] else "ranks"
            raise CheckpointError(
                f"checkpoint {directory} is from another model or plan: stage {s} {what} differ "
                f"(checkpoint {a[what][:6]}{' ...' if len(a[what]) > 6 else ''}, "
                f"this pipeline {b[what][:6]}{' ...' if len(b[what]) > 6 else ''}): resume with the same model and plan"
            )


# ---------------------------------------------------------------------------- RNG
def _rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)


# ---------------------------------------------------------------------------- collectives
def _agree(pipe: "Pipeline", error: str | None) -> None:
    """Raise the first rank's error on every rank (so no rank walks into a hanging collective)."""
    errors: list[Any] = [error]
    if pipe.distributed:
        errors = [None] * pipe.world_size
        dist.all_gather_object(errors, error)
    for r, e in enumerate(errors):
        if e is not None:
            raise CheckpointError(e if r == pipe.rank or not pipe.distributed else f"{e} (reported by rank {r})")


# ---------------------------------------------------------------------------- save / load
def save_checkpoint(pipe: "Pipeline", directory: str | Path, **extra: Any) -> Path:
    """Write ``pipe``'s state into ``directory`` (collective: call on every rank, at a schedule boundary)."""
    directory = Path(directory)
    error = None
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if pipe.rank == 0:
            # Overwriting: the directory stops being a checkpoint until the new manifest lands.
            (directory / MANIFEST).unlink(missing_ok=True)
            _fsync_dir(directory)
    except OSError as exc:
        error = f"cannot prepare checkpoint directory {directory}: {exc}"
    _agree(pipe, error)

    entries: list[dict[str, Any]] = []
    error = None
    try:
        state = pipe.weights.boundary_state()  # asserts nothing is in flight
        info = {"stage": pipe.stage, "replica": pipe.replica, "rank": pipe.rank}
        payload: dict[str, Any] = {**info, "version": state["version"], "rng": _rng_state(pipe.device),
                                   "data": {"epoch": pipe.epochs_done, "minibatches": pipe.minibatches_done},
                                   "history": list(pipe.history)}
        if pipe.replica == 0:
            name = f"stage{pipe.stage}.pt"
            payload.update(layers=list(pipe.plan.stages[pipe.stage].layers),
                           module=pipe.stage_state_dict(), optimizer=state["optimizer"])
        else:
            name = f"stage{pipe.stage}_replica{pipe.replica}.pt"
        data = _serialize(payload)
        _write_atomic(directory / name, data)
        entries.append(_file_entry(name, data, **info))
        if pipe.rank == 0:
            data = _serialize(extra)
            _write_atomic(directory / "extra.pt", data)
            entries.append(_file_entry("extra.pt", data))
    except Exception as exc:  # any failure (I/O, mid-schedule, unpicklable extra) must reach every rank
        error = f"rank {pipe.rank}: cannot write its checkpoint file into {directory}: {type(exc).__name__}: {exc}"
    _agree(pipe, error)

    # The gather is the barrier: every stage file is on disk before rank 0 writes the manifest.
    if pipe.distributed:
        parts: list[Any] = [None] * pipe.world_size if pipe.rank == 0 else None  # type: ignore[assignment]
        dist.gather_object(entries, parts, dst=0)
    else:
        parts = [entries]
    error = None
    if pipe.rank == 0:
        try:
            manifest = {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
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
            _write_atomic(directory / MANIFEST, (json.dumps(manifest, indent=1) + "\n").encode())
        except Exception as exc:
            error = f"cannot write the checkpoint manifest {directory / MANIFEST}: {type(exc).__name__}: {exc}"
    _agree(pipe, error)  # nobody returns before the manifest exists
    log.info("rank %d: checkpoint %s written", pipe.rank, directory)
    return directory


def load_checkpoint(pipe: "Pipeline", directory: str | Path) -> dict[str, Any]:
    """Restore ``pipe`` from ``directory`` (collective); returns the ``extra`` given at save time.

    Nothing is changed unless every rank verified what it needs.
    """
    directory = Path(directory)
    error = None
    payloads: dict[str, Any] = {}
    try:
        manifest = verify_checkpoint(directory) if pipe.rank == 0 else read_manifest(directory)
        _check_compatible(pipe, manifest, directory)
        by_name = {e["file"]: e for e in manifest["files"]}
        need = [f"stage{pipe.stage}.pt", "extra.pt"]
        if pipe.replica > 0:
            need.append(f"stage{pipe.stage}_replica{pipe.replica}.pt")
        for name in need:
            if name not in by_name:
                raise CheckpointError(f"checkpoint {directory}: the manifest lists no {name}")
            payloads[name] = _load_bytes(_read_verified(directory, by_name[name]), directory / name)
        own = payloads[need[-1]] if pipe.replica > 0 else payloads[need[0]]
        main = payloads[need[0]]
        if main.get("layers") != list(pipe.plan.stages[pipe.stage].layers):
            raise CheckpointError(f"checkpoint file {directory / need[0]} holds other layers than stage {pipe.stage}")
        missing, unexpected = _key_mismatch(pipe, main["module"])
        if missing or unexpected:
            raise CheckpointError(
                f"checkpoint file {directory / need[0]} does not fit stage {pipe.stage}'s module "
                f"(missing keys {missing[:4]}, unexpected keys {unexpected[:4]}): resume with the same model"
            )
        for key, t in main["module"].items():
            mine = pipe.module.state_dict()[key]
            if t.shape != mine.shape:
                raise CheckpointError(
                    f"checkpoint file {directory / need[0]}: {key} has shape {tuple(t.shape)} but the model's is "
                    f"{tuple(mine.shape)}: resume with the same model"
                )
    except CheckpointError as exc:
        error = str(exc)
    except Exception as exc:  # a malformed manifest or file: refuse on every rank, never hang
        error = f"checkpoint {directory} cannot be used: {type(exc).__name__}: {exc}"
    _agree(pipe, error)

    with torch.no_grad():
        pipe.module.load_state_dict(main["module"])
    pipe.weights.restore_boundary_state({"version": main["version"], "optimizer": main["optimizer"]})
    _set_rng_state(own["rng"], pipe.device)
    pipe.epochs_done = int(own["data"]["epoch"])
    pipe.minibatches_done = int(own["data"]["minibatches"])
    pipe.history = list(own.get("history", []))
    if pipe.distributed:
        dist.barrier()
    log.info("rank %d: resumed from %s at version %d", pipe.rank, directory, main["version"])
    return dict(payloads["extra.pt"])


def _key_mismatch(pipe: "Pipeline", saved: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
    mine = set(pipe.module.state_dict())
    return sorted(mine - set(saved)), sorted(set(saved) - mine)
