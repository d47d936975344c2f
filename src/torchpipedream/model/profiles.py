"""Profiles by file or by name: a saved ``LayerGraph`` (JSON), a PipeDream ``graph.txt``, or one
of the reference profiles that ship with the package.

The reference profiles are PipeDream's own (SOSP 2019) measurements of 14 models on one GPU
(``reference_profiles/README.md`` says where each comes from; MIT licence in
``reference_profiles/LICENSE.txt``), so the paper's models can be planned without a GPU:
``torchpipedream plan vgg16 --topology A``. No torch import here.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from .graph import GraphError, LayerGraph
from .pipedream_profile import parse_graph_txt

__all__ = ["load_profile", "reference_profile_names", "reference_profile_path"]

_REFERENCE_DIR = "reference_profiles"


def _reference_root() -> Path:
    return Path(str(resources.files(__package__).joinpath(_REFERENCE_DIR)))


def reference_profile_names() -> list[str]:
    """Names of the bundled reference profiles (vgg16, resnet50, gnmt, ...), sorted."""
    root = _reference_root()
    return sorted(p.name for p in root.iterdir() if (p / "graph.txt").is_file())


def reference_profile_path(name: str) -> Path:
    """The ``graph.txt`` of a bundled reference profile; GraphError listing the names if unknown."""
    path = _reference_root() / name / "graph.txt"
    if not path.is_file():
        raise GraphError(f"no reference profile named {name!r}; the bundled ones are {', '.join(reference_profile_names())}")
    return path


def load_profile(spec: str | Path) -> LayerGraph:
    """A layer graph from a JSON file written by ``LayerGraph.save`` (or ``torchpipedream
    profile``), from a PipeDream ``graph.txt`` (recognised by its content), or from the name of
    a bundled reference profile (``"vgg16"``) when no such file exists."""
    path = Path(spec)
    if not path.exists() and isinstance(spec, str) and "/" not in spec and not spec.endswith((".json", ".txt")):
        path = reference_profile_path(spec)
    if path.is_dir():
        raise GraphError(f"{path}: is a directory, not a profile file")
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise GraphError(f"{path}: no such file (nor a bundled reference profile: "
                         f"{', '.join(reference_profile_names())})") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise GraphError(f"{path}: cannot be read: {exc}") from None
    if text.lstrip().startswith(("{", "[")):  # JSON (a graph.txt starts with a node line)
        return LayerGraph.load(path)
    return parse_graph_txt(text, source=str(path))
