"""Tests for `torchpipedream profile` and `torchpipedream show`, run in-process."""

from __future__ import annotations

import json
import time

import pytest

from torchpipedream.cli import main
from torchpipedream.cli.commands.show import format_table, human_bytes
from torchpipedream.model.graph import Layer, LayerGraph


pytestmark = pytest.mark.usefixtures("one_thread")


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    return err


def test_profile_writes_a_graph_and_show_prints_it(tmp_path, capsys):
    out = tmp_path / "runs" / "cnn.json"  # the directory is created, as the README's command needs
    code = main(["profile", "--model", "cnn", "--batch-size", "16", "--iters", "2", "--warmup", "1", "--out", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "profiled cnn" in printed and str(out) in printed
    graph = LayerGraph.load(out)
    assert graph.batch_size == 16 and graph.meta["model"] == "cnn"
    assert graph.meta["loss_layer"] == graph.names[-1]
    assert len(graph) == 12  # input + 11 modules

    plot = tmp_path / "cnn.png"
    assert main(["show", str(out), "--plot", str(plot)]) == 0
    shown = capsys.readouterr().out
    assert "total" in shown and "12 layers" in shown
    assert human_bytes(graph.totals()["parameter_bytes"]) in shown
    assert all(name in shown for name in graph.names)
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"


def test_profile_a_user_model_by_module_function(tmp_path, capsys):
    out = tmp_path / "lin.json"
    args = ["profile", "--model", "torch.nn:Identity", "--input-shape", "3,4", "--batch-size", "2",
            "--iters", "1", "--warmup", "0", "--out", str(out)]
    assert main(args) == 0
    graph = LayerGraph.load(out)
    assert graph.layers[0].output_shapes == [[2, 3, 4]]
    assert main(args[:3] + args[5:]) == 2  # without --input-shape or a sample_input()
    assert "--input-shape" in _one_error_line(capsys)


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["profile", "--model", "vgg99", "--out", "{tmp}/g.json"], "unknown model 'vgg99'"),
        (["profile", "--model", "cnn", "--batch-size", "0", "--out", "{tmp}/g.json"], "--batch-size"),
        (["profile", "--model", "cnn", "--out", "{tmp}/bad.json/g.json"], "cannot create directory"),
        (["profile", "--model", "cnn", "--out", "{tmp}"], "is a directory"),
        (["show", "{tmp}/missing.json"], "no such file"),
        (["show", "{tmp}/bad.json"], "invalid JSON"),
        (["show", "{tmp}/wrong.json"], "format_version"),
        (["show", "{tmp}/ok.json", "--plot", "{tmp}/x.txt"], ".png"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, argv, fragment):
    (tmp_path / "bad.json").write_text('{"layers": [')
    (tmp_path / "wrong.json").write_text(json.dumps({"layers": []}))
    LayerGraph([Layer("a", forward_ms=1.0)], batch_size=1).save(tmp_path / "ok.json")
    code = main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert code == 2
    err = _one_error_line(capsys)
    assert fragment in err


def test_show_reads_pipedream_graph_txt(reference_profiles, capsys):
    path = next(reference_profiles.glob("*/graph.txt"))
    assert main(["show", str(path), "--limit", "0"]) == 0
    out = capsys.readouterr().out
    assert "total" in out and "[input]" in out


def test_show_large_graph_is_fast_and_elided(tmp_path, capsys):
    n = 3000
    layers = [Layer(f"l{i}", kind="Linear", forward_ms=0.5, backward_ms=1.0, activation_bytes=1000,
                    parameter_bytes=2_000_000) for i in range(n)]
    LayerGraph(layers, [(f"l{i}", f"l{i + 1}") for i in range(n - 1)], batch_size=8).save(tmp_path / "big.json")
    start = time.perf_counter()
    assert main(["show", str(tmp_path / "big.json")]) == 0
    elapsed = time.perf_counter() - start
    out = capsys.readouterr().out
    assert elapsed < 5.0
    assert f"... {n - 60} more layers" in out
    assert "1500.000" in out and "4500.000" in out  # totals cover every layer, not the shown ones
    assert "6.0 GB" in out


def test_format_table_sorts_and_limits():
    layers = [Layer("small", parameter_bytes=10, forward_ms=1.0), Layer("big", parameter_bytes=5000, forward_ms=0.1)]
    graph = LayerGraph(layers, [("small", "big")])
    text = format_table(graph, limit=1, sort="params")
    assert "big" in text and "small" not in text.split("... 1 more")[0].split("\n", 2)[2]
    assert text.index("big") < text.index("... 1 more layers")


def test_human_bytes():
    assert human_bytes(0) == "0 B"
    assert human_bytes(999) == "999 B"
    assert human_bytes(1234) == "1.2 kB"
    assert human_bytes(2_500_000) == "2.5 MB"
    assert human_bytes(3e9) == "3.0 GB"
