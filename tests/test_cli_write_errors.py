"""Every command's output file that cannot be written (a path under a regular file, a full disk)
ends in one line naming the option, the path and the reason, exit status 2: never a
PermissionError, RuntimeError or SafetensorError traceback (issue 39). A path that cannot be
written is found before the work (planning, profiling, simulating, drawing) starts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from torchpipedream.cli import main
from torchpipedream.model.graph import Layer, LayerGraph
from torchpipedream.plans.plan import Plan
from torchpipedream.sim.trace import Event, Trace
from torchpipedream.util.output_files import OutputFileError, check_output, writing

#: Each command's output options: (name, argv with {out} for the output path, suffix of that path).
CASES = [
    ("plan", ["plan", "{graph}", "--topology", "2:10GB/s", "--out", "{out}"], ".json"),
    ("profile", ["profile", "--model", "mlp", "--batch-size", "4", "--iters", "1", "--warmup", "0",
                 "--out", "{out}"], ".json"),
    ("export-pt", ["export", "{checkpoint}", "--out", "{out}"], ".pt"),
    ("export-safetensors", ["export", "{checkpoint}", "--out", "{out}"], ".safetensors"),
    ("simulate-trace", ["simulate", "{plan}", "--minibatches", "4", "--trace", "{out}"], ".json"),
    ("simulate-chrome", ["simulate", "{plan}", "--minibatches", "4", "--chrome", "{out}"], ".json"),
    ("simulate-timeline", ["simulate", "{plan}", "--minibatches", "4", "--timeline", "{out}"], ".png"),
    ("simulate-save-schedule", ["simulate", "{plan}", "--minibatches", "4", "--save-schedule", "{out}"], ".json"),
    ("timeline-out", ["timeline", "{trace}", "--out", "{out}"], ".png"),
    ("timeline-chrome", ["timeline", "{trace}", "--chrome", "{out}"], ".json"),
    ("show-plot", ["show", "{graph}", "--plot", "{out}"], ".png"),
]


def _inputs(tmp: Path) -> dict[str, str]:
    """A graph, a plan with costs, a trace, and a folder that poses as a checkpoint."""
    graph = LayerGraph([Layer("x", is_input=True, activation_bytes=64),
                        Layer("a", forward_ms=1, backward_ms=2, activation_bytes=64, parameter_bytes=64),
                        Layer("b", forward_ms=1, backward_ms=2, activation_bytes=64, parameter_bytes=64)],
                       [("x", "a"), ("a", "b")], batch_size=4)
    graph.save(tmp / "graph.json")
    plan = Plan.straight([["x", "a"], ["b"]], schedule="pipedream", batch_size=4)
    for stage in plan.stages:
        stage.forward_ms, stage.backward_ms = 1.0, 2.0
    plan.save(tmp / "plan.json")
    Trace([Event(rank=0, stage=0, kind="F", id=0, start_s=0.0, end_s=1.0)]).save(tmp / "trace.json")
    checkpoint = tmp / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "manifest.json").write_text("{}")
    return {"graph": str(tmp / "graph.json"), "plan": str(tmp / "plan.json"), "trace": str(tmp / "trace.json"),
            "checkpoint": str(checkpoint)}


def _argv(template: list[str], files: dict[str, str], out: Path) -> list[str]:
    return [a.format(out=out, **files) for a in template]


def _flag(argv: list[str], out: Path) -> str:
    return argv[argv.index(str(out)) - 1]


def _one_error_line(capsys) -> tuple[str, str]:
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return captured.out, err


@pytest.fixture
def small_checkpoint(monkeypatch):
    """export reads a one-tensor state instead of a real checkpoint (only its writing is tested)."""
    import torch

    import torchpipedream.runtime.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "read_stage_states", lambda source: {"w": torch.ones(1000)})


@pytest.mark.parametrize("name, template, suffix", CASES, ids=[c[0] for c in CASES])
def test_an_output_under_a_regular_file_is_one_line_before_the_work(name, template, suffix, tmp_path, capsys):
    files = _inputs(tmp_path)
    (tmp_path / "file.txt").write_text("a file, not a folder\n")
    out = tmp_path / "file.txt" / f"out{suffix}"  # unwritable even for root (chmod does not stop root)
    argv = _argv(template, files, out)
    assert main(argv) == 2
    stdout, err = _one_error_line(capsys)
    assert f"{_flag(argv, out)} {out}" in err and "is a file, not a directory" in err, err
    assert stdout == "", "the path must be checked before the work, so nothing is printed first"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a device that is always full)")
@pytest.mark.parametrize("name, template, suffix", CASES, ids=[c[0] for c in CASES])
def test_a_full_disk_is_one_line_naming_the_path(name, template, suffix, tmp_path, capsys, small_checkpoint,
                                                 monkeypatch):
    files = _inputs(tmp_path)
    out = tmp_path / f"full{suffix}"
    out.symlink_to("/dev/full")  # every write to it fails with ENOSPC
    if suffix == ".safetensors":  # safetensors writes a new file and renames it: make its writer fail instead
        import safetensors.torch

        def full(*args, **kwargs):
            raise safetensors.SafetensorError("Error while serializing: IoError(No space left on device)")

        monkeypatch.setattr(safetensors.torch, "save_file", full)
    argv = _argv(template, files, out)
    assert main(argv) == 2
    _, err = _one_error_line(capsys)
    assert f"{_flag(argv, out)} {out}: cannot write the file" in err, err
    if suffix != ".pt":  # torch.save's own message names no reason ("unexpected pos 704 vs 598")
        assert "No space left on device" in err, err


def test_check_output_names_the_path_and_the_reason(tmp_path):
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(OutputFileError, match=r"^--out .*deep/out.json: cannot create directory .*file.txt is a file"):
        check_output(tmp_path / "file.txt" / "deep" / "out.json", "--out")
    with pytest.raises(OutputFileError, match="is a directory; give a file name"):
        check_output(tmp_path, "--out")
    made = check_output(tmp_path / "new" / "sub" / "out.json", "--out")
    assert made.parent.is_dir() and not made.exists()  # the folder is made, the file is not


def test_writing_turns_a_writer_error_into_one_line(tmp_path):
    path = tmp_path / "x.json"
    with pytest.raises(OutputFileError, match=r"^x.json: cannot write the file \(No space left on device\)$") as info:
        with writing(Path("x.json")):
            raise OSError(28, "No space left on device")
    assert info.value.__cause__ is None
    long = "first line " + "y" * 500 + "\nsecond line"
    with pytest.raises(OutputFileError) as info:
        with writing(path, "--trace"):
            raise RuntimeError(long)
    assert "second line" not in str(info.value) and len(str(info.value)) < 300 + len(str(path))

    class WriterError(Exception):
        pass

    with pytest.raises(OutputFileError, match="disk full"):
        with writing(path, errors=(WriterError,)):
            raise WriterError("disk full")
    with pytest.raises(KeyError):  # a bug in the writer is not a write error
        with writing(path):
            raise KeyError("bug")


def test_export_refuses_an_unknown_suffix_before_reading_the_checkpoint(tmp_path, capsys):
    assert main(["export", str(tmp_path / "no-such-run"), "--out", str(tmp_path / "model.bin")]) == 2
    _, err = _one_error_line(capsys)
    assert "--out" in err and "model.bin" in err and ".safetensors" in err, err
