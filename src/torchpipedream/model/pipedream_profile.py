"""Import of the original PipeDream profiler's ``graph.txt`` format.

Node lines::

    nodeN -- description -- forward_compute_time=F, backward_compute_time=B, activation_size=A, parameter_size=P[ -- stage_id=S]

edge lines (tab-indented)::

    \tnodeA -- nodeB

Times are milliseconds per minibatch, sizes bytes per minibatch. An LSTM's activation size is
written as a list ``[a; b; c]`` (output and hidden states) and is summed. A node whose
description starts with ``Input`` is a data-loading node: its forward time is loading, not
compute (``Layer.is_input``).
"""

from __future__ import annotations

import re
from pathlib import Path

from ..util.jsonio import excerpt
from .graph import GraphError, Layer, LayerGraph

__all__ = ["parse_graph_txt", "load_graph_txt"]

_FIELDS = ("forward_compute_time", "backward_compute_time", "activation_size", "parameter_size")
_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$|^[+-]?(nan|inf)$", re.IGNORECASE)


def _parse_value(text: str, where: str) -> float:
    """A number, or a ``[a; b; ...]`` list of numbers (summed)."""
    text = text.strip()
    parts = [text]
    if text.startswith("["):
        if not text.endswith("]"):
            raise GraphError(f"{where}: unterminated list {excerpt(text)}")
        parts = [p.strip() for p in text[1:-1].split(";") if p.strip()]
        if not parts:
            raise GraphError(f"{where}: empty list")
    total = 0.0
    for p in parts:
        if not _NUMBER.match(p):
            raise GraphError(f"{where}: not a number: {excerpt(p)}")
        total += float(p)
    return total


def _natural_key(layer: Layer) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", layer.name))


def parse_graph_txt(text: str, source: str = "graph.txt") -> LayerGraph:
    """Parse the text of a PipeDream ``graph.txt``; errors name the file and line."""
    layers: list[Layer] = []
    edges: list[tuple[str, str]] = []
    edge_lines: dict[tuple[str, str], int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        where = f"{source}: line {lineno}"
        if raw.startswith("\t") or raw.startswith(" "):
            ends = [p.strip() for p in raw.strip().split(" -- ")]
            if len(ends) != 2 or not all(ends):
                raise GraphError(f"{where}: an edge line must read '<tab>nodeA -- nodeB', got {excerpt(raw.strip())}")
            edges.append((ends[0], ends[1]))
            edge_lines.setdefault((ends[0], ends[1]), lineno)
            continue
        parts = raw.split(" -- ")
        if len(parts) < 3:
            raise GraphError(
                f"{where}: a node line must read 'nodeN -- description -- forward_compute_time=...', got {excerpt(raw)}"
            )
        node_id = parts[0].strip()
        stage_id = None
        if parts[-1].strip().startswith("stage_id="):
            stage_text = parts.pop().strip()[len("stage_id="):]
            if not stage_text.isdigit():
                raise GraphError(f"{where}: stage_id must be a whole number, got {stage_text!r}")
            stage_id = int(stage_text)
        metrics_text = parts[-1]
        description = " -- ".join(parts[1:-1]).strip()
        values: dict[str, float] = {}
        for item in metrics_text.split(","):
            if "=" not in item:
                raise GraphError(f"{where}: expected key=value, got {item.strip()!r}")
            key, value = (s.strip() for s in item.split("=", 1))
            if key not in _FIELDS:
                raise GraphError(f"{where}: unknown field {key!r} (expected {', '.join(_FIELDS)})")
            values[key] = _parse_value(value, f"{where}: field {key!r}")
        missing = [f for f in _FIELDS if f not in values]
        if missing:
            raise GraphError(f"{where}: missing field(s) {', '.join(missing)}")
        for key, value in values.items():
            if value != value or value in (float("inf"), float("-inf")):
                raise GraphError(f"{where}: field {key!r} must be finite, got {value}")
            if value < 0:
                raise GraphError(f"{where}: field {key!r} must be >= 0, got {value}")
        layers.append(
            Layer(
                name=node_id,
                kind=description,
                forward_ms=values["forward_compute_time"],
                backward_ms=values["backward_compute_time"],
                activation_bytes=int(round(values["activation_size"])),
                parameter_bytes=int(round(values["parameter_size"])),
                is_input=description.startswith("Input"),
                stage_id=stage_id,
            )
        )
    if not layers:
        raise GraphError(f"{source}: no node lines found (is this a PipeDream graph.txt?)")
    names = {l.name for l in layers}
    for (a, b), lineno in edge_lines.items():
        for end in (a, b):
            if end not in names:
                raise GraphError(f"{source}: line {lineno}: edge {a} -- {b} names a node that does not exist: {end!r}")
    # PipeDream writes nodes in hash order; sort by node number for a stable, readable order.
    layers.sort(key=_natural_key)
    return LayerGraph(layers, edges, meta={"source": source, "format": "pipedream graph.txt"}, source=source)


def load_graph_txt(path: str | Path) -> LayerGraph:
    """Read a PipeDream ``graph.txt`` file."""
    path = Path(path)
    if not path.exists():
        raise GraphError(f"{path}: no such file")
    return parse_graph_txt(path.read_text(), source=str(path))
