"""Import of PipeDream's graph.txt profiles: every reference profile, totals, and bad input."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from torchpipedream.model.graph import GraphError, LayerGraph
from torchpipedream.model.pipedream_profile import load_graph_txt, parse_graph_txt
from torchpipedream.model.profiles import load_profile

NAMES = [
    "alexnet", "densenet121", "gnmt", "gnmt_large", "inception_v3", "nasnetalarge",
    "nasnetamobile", "resnet101", "resnet18", "resnet50", "resnext101", "resnext50",
    "squeezenet1_0", "vgg16",
]


def _file_totals(text: str) -> dict[str, float]:
    """Totals read straight from the file with a regex: an oracle independent of the parser."""
    nodes = [l for l in text.splitlines() if l.strip() and not l.startswith("\t")]
    edges = [l for l in text.splitlines() if l.startswith("\t")]
    compute = params = acts = 0.0
    for line in nodes:
        f = float(re.search(r"forward_compute_time=([\d.]+)", line).group(1))
        b = float(re.search(r"backward_compute_time=([\d.]+)", line).group(1))
        if " -- Input" not in line:
            compute += f + b
        params += float(re.search(r"parameter_size=([\d.]+)", line).group(1))
        act = re.search(r"activation_size=(\[[^\]]*\]|[\d.]+)", line).group(1)
        acts += sum(float(x) for x in re.findall(r"[\d.]+", act))
    return {"layers": len(nodes), "edges": len(set(edges)), "compute": compute, "params": params, "acts": acts}


@pytest.mark.parametrize("name", NAMES)
def test_every_reference_profile_imports_with_the_files_totals(reference_profiles: Path, name: str) -> None:
    path = reference_profiles / name / "graph.txt"
    graph = load_profile(path)
    want = _file_totals(path.read_text())
    got = graph.totals()
    assert got["layers"] == want["layers"]
    assert len(graph.edges) == want["edges"]
    assert got["compute_ms"] == pytest.approx(want["compute"], rel=1e-9)
    assert got["parameter_bytes"] == pytest.approx(want["params"], abs=len(graph))
    assert got["activation_bytes"] == pytest.approx(want["acts"], abs=len(graph))
    # a topological order exists and respects every edge
    pos = {n: i for i, n in enumerate(graph.topological_order())}
    assert all(pos[a] < pos[b] for a, b in graph.edges)


def test_vgg16_numbers_match_the_published_model(reference_profiles: Path) -> None:
    graph = load_graph_txt(reference_profiles / "vgg16" / "graph.txt")
    # VGG-16 has 138,357,544 parameters; PipeDream records 4 bytes each.
    assert graph.totals()["parameter_bytes"] == 138_357_544 * 4
    # its only branch is the Size(0) node feeding View: every linearised cut carries one tensor
    assert all(len(b.cut_tensors) <= 1 for b in graph.linearize())
    inputs = [l for l in graph if l.is_input]
    assert len(inputs) == 1 and inputs[0].forward_ms > 0  # data loading time, not compute
    assert inputs[0].compute_ms == 0.0


def test_lstm_list_activation_sizes_are_summed(reference_profiles: Path) -> None:
    text = (reference_profiles / "gnmt" / "graph.txt").read_text()
    line = next(l for l in text.splitlines() if "activation_size=[" in l)
    node = line.split(" -- ")[0]
    parts = re.search(r"activation_size=\[([^\]]*)\]", line).group(1).split(";")
    graph = parse_graph_txt(text)
    assert graph[node].activation_bytes == int(sum(float(p) for p in parts))


def test_json_round_trip_is_lossless(reference_profiles: Path, tmp_path: Path) -> None:
    for name in ("inception_v3", "gnmt"):
        graph = load_profile(reference_profiles / name / "graph.txt")
        out = tmp_path / f"{name}.json"
        graph.save(out)
        again = LayerGraph.load(out)
        assert again == graph
        assert again.to_dict() == graph.to_dict()
        assert [l.__dict__ for l in again] == [l.__dict__ for l in graph]


GOOD = (
    "node1 -- Input -- forward_compute_time=1.0, backward_compute_time=0.0, activation_size=8.0, parameter_size=0.0\n"
    "node2 -- Linear(2, 2) -- forward_compute_time=0.5, backward_compute_time=1.0, activation_size=8.0, parameter_size=24.0 -- stage_id=0\n"
    "\tnode1 -- node2\n"
)


def test_small_file_parses_with_stage_ids() -> None:
    graph = parse_graph_txt(GOOD, source="x.txt")
    assert graph.names == ["node1", "node2"]
    assert graph["node2"].stage_id == 0 and graph["node2"].kind == "Linear(2, 2)"
    assert graph.edges == [("node1", "node2")]


@pytest.mark.parametrize(
    "text, message",
    [
        (GOOD.replace("forward_compute_time=0.5", "forward_compute_time=nan"), "line 2: field 'forward_compute_time' must be finite"),
        (GOOD.replace("backward_compute_time=1.0", "backward_compute_time=-1.0"), "line 2: field 'backward_compute_time' must be >= 0"),
        (GOOD.replace("parameter_size=24.0", "parameter_size=abc"), "line 2: field 'parameter_size': not a number"),
        (GOOD.replace(", parameter_size=24.0", ""), "line 2: missing field(s) parameter_size"),
        (GOOD.replace("\tnode1 -- node2", "\tnode1 -- node9"), "line 3: edge node1 -- node9 names a node that does not exist"),
        (GOOD.replace("\tnode1 -- node2", "\tnode1 node2"), "line 3: an edge line must read"),
        (GOOD + "\tnode2 -- node1\n", "cycle"),
        ("garbage\n", "line 1: a node line must read"),
        ("", "no node lines"),
    ],
)
def test_bad_graph_txt_gives_one_clear_error(text: str, message: str) -> None:
    with pytest.raises(GraphError) as info:
        parse_graph_txt(text, source="bad.txt")
    assert message in str(info.value)
    assert str(info.value).startswith("bad.txt")
