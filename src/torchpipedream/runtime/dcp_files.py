"""A sharded stage's tensors in a checkpoint, written and read by torch.distributed.checkpoint (DCP).

A stage sharded over its replicas (``Stage.sharding``, runtime/sharding.py) saves its weights,
buffers and the optimizer state of its weights' shape with ``dcp.save`` into a folder of the
checkpoint (``stage<s>.dcp/``): every replica writes its own shards, in parallel, and nothing
is gathered whole on one worker. Loading asks DCP for each tensor by name into a tensor of
the new plan's layout: a shard of another sharding (DCP reads the overlapping pieces), or a
whole tensor on a stage that replicates or runs on one process. So a checkpoint still loads
onto any plan (checkpoint.py, layout-free).

**Loading runs no code.** DCP's own reader unpickles the folder's ``.metadata`` with
``pickle.load``, which runs whatever a crafted file names; :class:`_MetadataReader` reads it
with an unpickler that builds only DCP's metadata records and torch's sizes, dtypes and
layouts, and refuses any other name (the error names it). The files are listed in the
manifest with their sha256 like every other file of a checkpoint.
"""

from __future__ import annotations

import io
import pickle
import warnings
from pathlib import Path
from typing import Any

import torch

__all__ = ["save_sharded", "load_sharded", "saved_tensor_specs", "UnsafeMetadataError"]

#: The names DCP's ``.metadata`` pickle may build: its records, and torch's and pathlib's plain values.
_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {"Metadata", "MetadataIndex", "ChunkStorageMetadata", "TensorProperties",
                                               "TensorStorageMetadata", "BytesStorageMetadata", "StorageMeta",
                                               "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class UnsafeMetadataError(ValueError):
    """A DCP ``.metadata`` file names something other than DCP's records: not loaded."""


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise UnsafeMetadataError(f"it names {module}.{name}, which a checkpoint's metadata never holds")


def _reader(directory: Path) -> Any:
    """DCP's file reader of ``directory`` whose metadata is read by the restricted unpickler."""
    # lazy: DCP's machinery, needed only by sharded stages' checkpoints
    from torch.distributed.checkpoint import FileSystemReader

    class _MetadataReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            path = Path(self.path) / ".metadata"
            try:
                metadata = _RestrictedUnpickler(io.BytesIO(path.read_bytes())).load()
            except UnsafeMetadataError as exc:
                raise UnsafeMetadataError(f"checkpoint file {path} was not loaded (loading runs no code): {exc}") from None
            metadata.storage_meta = getattr(metadata, "storage_meta", None) or self._storage_meta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        @staticmethod
        def _storage_meta() -> Any:
            from torch.distributed.checkpoint.metadata import StorageMeta  # lazy: as above
            return StorageMeta()

    return _MetadataReader(str(directory))


def save_sharded(state: dict[str, torch.Tensor], directory: Path, group: Any) -> None:
    """``dcp.save`` of ``state`` (names -> tensors: shards or whole) into ``directory``, a
    collective of ``group`` (the stage's ranks; each writes its shards; a strided shard whole)."""
    # lazy: as above
    import torch.distributed.checkpoint as dcp

    from .conv1d_styles import strided  # lazy: DTensor's placements, as above

    # A strided shard on one mesh dimension (a fused projection's: conv1d_styles) is not one
    # chunk of the whole tensor, and DCP would describe it as one: saved whole instead (its
    # tensor ranks gather it, in the same order on each; DCP keeps one copy).
    state = {k: v.full_tensor() if strided(v) else v for k, v in state.items()}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(directory)), process_group=group)


def load_sharded(targets: dict[str, torch.Tensor], directory: Path) -> None:
    """Fill ``targets`` (names -> tensors of this rank's layout: shards or whole) from the DCP
    folder ``directory``, on this rank alone (no collective: any plan loads any checkpoint);
    a strided shard (``save_sharded``) from the whole tensor."""
    # lazy: as above
    import torch.distributed.checkpoint as dcp

    from .conv1d_styles import strided  # lazy: as above
    from .sharding import shard_like

    # a strided shard is read whole (as it was saved) and this rank's part taken from it
    whole = {k: torch.empty(t.shape, dtype=t.dtype) if strided(t) else t for k, t in targets.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(whole, storage_reader=_reader(directory), no_dist=True)
    with torch.no_grad():
        for k, t in targets.items():
            if whole[k] is not t:
                t.to_local().copy_(shard_like(whole[k], t).to_local())


def saved_tensor_specs(directory: Path) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Name -> (whole shape, dtype) of every tensor in the DCP folder ``directory``."""
    metadata = _reader(directory).read_metadata()
    return {name: (m.size, m.properties.dtype) for name, m in metadata.state_dict_metadata.items()
            if hasattr(m, "size")}
