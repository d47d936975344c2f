"""LayerGraph: validation, JSON, topological order and the linearisation the planner cuts."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchpipedream.model.graph import FORMAT_VERSION, GraphError, Layer, LayerGraph


def chain(n: int) -> LayerGraph:
    layers = [Layer(f"l{i}", "Linear", 1.0 + i, 2.0, 100 * (i + 1), 10 * i) for i in range(n)]
    return LayerGraph(layers, [(f"l{i}", f"l{i+1}") for i in range(n - 1)])


def residual() -> LayerGraph:
    # x -> a -> b -> add(b, a) -> c : the skip edge a -> add crosses a cut after b
    layers = [Layer(n, n, 1.0, 1.0, size, 0) for n, size in
              [("x", 1), ("a", 10), ("b", 100), ("add", 1000), ("c", 10000)]]
    edges = [("x", "a"), ("a", "b"), ("b", "add"), ("a", "add"), ("add", "c")]
    return LayerGraph(layers, edges)


def test_chain_basics() -> None:
    g = chain(4)
    assert g.is_chain and len(g) == 4
    assert g.topological_order() == ["l0", "l1", "l2", "l3"]
    assert g.totals()["compute_ms"] == pytest.approx(sum(1.0 + i + 2.0 for i in range(4)))
    blocks = g.linearize()
    assert [b.cut_bytes for b in blocks] == [100, 200, 300, 0]


def test_skip_connection_crossing_a_cut_is_counted() -> None:
    g = residual()
    assert not g.is_chain
    order = g.topological_order()
    assert order == ["x", "a", "b", "add", "c"]
    cuts = {b.layers[-1]: (b.cut_bytes, b.cut_tensors) for b in g.linearize()}
    assert cuts["a"] == (10, ["a"])
    assert cuts["b"] == (110, ["a", "b"])  # the skip tensor a and b's output both cross
    assert cuts["add"] == (1000, ["add"])
    assert cuts["c"] == (0, [])


def test_free_layers_merge_into_the_previous_block() -> None:
    layers = [Layer("a", "conv", 1, 1, 8, 4), Layer("view", "view", 0, 0, 8, 0), Layer("fc", "fc", 1, 1, 4, 4)]
    g = LayerGraph(layers, [("a", "view"), ("view", "fc")])
    blocks = g.linearize()
    assert [b.layers for b in blocks] == [["a", "view"], ["fc"]]
    assert [b.layers for b in g.linearize(merge_free_cuts=False)] == [["a"], ["view"], ["fc"]]


def test_leading_inputs_join_the_first_real_block() -> None:
    layers = [Layer("x", "input", 0, 0, 64, 0, is_input=True), Layer("a", "fc", 1, 1, 8, 4), Layer("b", "fc", 1, 1, 4, 4)]
    g = LayerGraph(layers, [("x", "a"), ("a", "b")])
    assert [b.layers for b in g.linearize()] == [["x", "a"], ["b"]]
    assert g.linearize()[0].cut_bytes == 8


@st.composite
def random_dags(draw):
    n = draw(st.integers(1, 9))
    edges = [(f"n{i}", f"n{j}") for i, j in itertools.combinations(range(n), 2) if draw(st.booleans())]
    perm = draw(st.permutations(range(n)))
    sizes = [draw(st.integers(0, 1000)) for _ in range(n)]
    layers = [Layer(f"n{i}", "op", 1.0, 1.0, sizes[i], 0) for i in perm]
    return LayerGraph(layers, edges)


@settings(max_examples=150, deadline=None)
@given(random_dags())
def test_every_prefix_of_the_linearisation_is_a_valid_cut(g: LayerGraph) -> None:
    order = g.topological_order()
    assert sorted(order) == sorted(g.names)
    pos = {n: i for i, n in enumerate(order)}
    assert all(pos[a] < pos[b] for a, b in g.edges)
    seen: list[str] = []
    for block in g.linearize(merge_free_cuts=False):
        seen += block.layers
        prefix = set(seen)
        # oracle: producers in the prefix with a consumer outside it
        crossing = {a for a, b in g.edges if a in prefix and b not in prefix}
        assert set(block.cut_tensors) == crossing
        assert block.cut_bytes == sum(g[a].activation_bytes for a in crossing)


def test_json_round_trip(tmp_path: Path) -> None:
    g = residual()
    g.layers[0].output_shapes = [[4, 3]]
    g.layers[0].output_dtypes = ["float32"]
    g.batch_size = 4
    g.meta["model"] = "toy"
    path = tmp_path / "g.json"
    g.save(path)
    again = LayerGraph.load(path)
    assert again == g and again.batch_size == 4 and again["x"].output_shapes == [[4, 3]]


def _write(tmp_path: Path, data) -> Path:
    path = tmp_path / "graph.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def _base() -> dict:
    return residual().to_dict()


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda d: d["layers"][1].update(forward_ms=float("nan")), "layer 1 ('a'): field 'forward_ms': must be finite"),
        (lambda d: d["layers"][2].update(activation_bytes=-5), "layer 2 ('b'): field 'activation_bytes': must be >= 0"),
        (lambda d: d["layers"][2].update(parameter_bytes="many"), "field 'parameter_bytes': expected a number"),
        (lambda d: d["edges"].append(["c", "zz"]), "names a layer that does not exist: 'zz'"),
        (lambda d: d["edges"].append(["c", "a"]), "cycle through layer(s) a, b, add, c"),
        (lambda d: d["layers"].append(dict(d["layers"][0])), "duplicate layer name"),
        (lambda d: d.update(format_version=99), "format_version 99 is not supported"),
        (lambda d: d.pop("format_version"), "missing field 'format_version'"),
        (lambda d: d["layers"][0].update(colour="red"), "layers[0]: unknown field(s) ['colour']"),
        (lambda d: d.update(layers=[]), "the graph has no layers"),
        (lambda d: d.update(edges=[["a"]]), "edges[0] must be a [producer, consumer] pair"),
    ],
)
def test_bad_json_gives_one_clear_error_naming_the_file(tmp_path: Path, mutate, message: str) -> None:
    data = _base()
    mutate(data)
    path = _write(tmp_path, data)
    with pytest.raises(GraphError) as info:
        LayerGraph.load(path)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_malformed_json_names_line(tmp_path: Path) -> None:
    path = _write(tmp_path, '{\n "format_version": 1,\n "layers": [,]\n}')
    with pytest.raises(GraphError, match=r"line 3, column \d+: invalid JSON"):
        LayerGraph.load(path)


def test_missing_file() -> None:
    with pytest.raises(GraphError, match="no such file"):
        LayerGraph.load("/nonexistent/graph.json")


def test_format_version_is_written() -> None:
    assert residual().to_dict()["format_version"] == FORMAT_VERSION
