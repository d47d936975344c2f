"""Every command that reads a file ends a malformed, wrongly typed or truncated one in a one-line
error naming the file and exit status 2: never a traceback (issue 21). And loading runs no code:
a pickle payload planted in any file a resume or --init reads is refused, naming the file, and
never runs."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from types import SimpleNamespace

import pytest

from torchpipedream.cli import main
from torchpipedream.plans.plan import Plan

def _valid_files(tmp: Path) -> dict[str, Path]:
    """A graph, plan, trace and topology that the commands accept."""
    from torchpipedream.model.graph import Layer, LayerGraph
    from torchpipedream.sim.trace import Event, Trace

    graph = LayerGraph([Layer("x", is_input=True, activation_bytes=64), Layer("a", forward_ms=1, backward_ms=2,
                                                                                activation_bytes=64, parameter_bytes=64),
                        Layer("b", forward_ms=1, backward_ms=2, activation_bytes=64, parameter_bytes=64)],
                       [("x", "a"), ("a", "b")], batch_size=4)
    graph.save(tmp / "graph.json")
    plan = Plan.straight([["x", "a"], ["b"]], schedule="pipedream")
    for stage in plan.stages:
        stage.forward_ms, stage.backward_ms = 1.0, 2.0
    plan.save(tmp / "plan.json")
    Trace([Event(rank=0, stage=0, kind="F", id=0, start_s=0.0, end_s=1.0)]).save(tmp / "trace.json")
    (tmp / "topology.json").write_text(json.dumps({"levels": [{"count": 2, "bandwidth_Bps": 1e9}]}))
    return {name: tmp / f"{name}.json" for name in ("graph", "plan", "trace", "topology")}


def _commands(files: dict[str, Path], tmp: Path) -> dict[str, list[str]]:
    return {
        "graph": ["show", str(files["graph"])],
        "plan": ["simulate", str(files["plan"])],
        "trace": ["timeline", str(files["trace"]), "--out", str(tmp / "t.png")],
        "topology": ["plan", str(tmp / "good_graph.json"), "--topology", str(files["topology"])],
    }


def _breakages(kind: str, text: str) -> dict[str, str]:
    """Malformed, truncated and wrongly typed versions of a valid JSON file."""
    data = json.loads(text)
    wrong = json.loads(text)
    if kind == "plan":
        wrong["stages"][0]["ranks"] = ["0"]  # strings for ranks: a TypeError traceback before
    elif kind == "graph":
        wrong["layers"][1]["forward_ms"] = "slow"
    elif kind == "trace":
        wrong["events"] = {"not": "a list"} if isinstance(data, dict) else "x"
    else:
        wrong["levels"][0]["count"] = "two"
    return {"truncated": text[: len(text) // 2], "not JSON": "\x00\x01 binary", "empty": "",
            "wrong type": json.dumps(wrong), "a list": "[1, 2, 3]",
            # issue 39: a RecursionError traceback, and plan/show quoted the whole 200 KB line
            "nested 100,000 deep": "[" * 100_000 + "]" * 100_000,
            "objects nested 100,000 deep": '{"a": ' * 100_000 + "1" + "}" * 100_000,
            "a 200 KB line": "x" * 200_000}


@pytest.mark.parametrize("kind", ["graph", "plan", "trace", "topology"])
def test_each_command_refuses_a_bad_file_in_one_line(kind, tmp_path, capsys):
    files = _valid_files(tmp_path)
    (tmp_path / "good_graph.json").write_text(files["graph"].read_text())
    command = _commands(files, tmp_path)[kind]
    assert main(command) == 0  # the valid file works
    capsys.readouterr()
    for what, content in _breakages(kind, files[kind].read_text()).items():
        files[kind].write_text(content)
        code = main(command)
        err = capsys.readouterr().err.strip()
        assert code == 2, (kind, what, err)
        assert len(err.splitlines()) == 1 and str(files[kind].name) in err, (kind, what, err[:2000])
        assert len(err) < 400, (kind, what, f"the error quotes too much: {err[:2000]}")


def test_train_refuses_a_bad_plan_file_in_one_line(tmp_path, capsys):
    bad = tmp_path / "plan.json"
    plan = Plan.straight([["input_1", "_0"], ["_1", "_2"]], schedule="flush").to_dict()
    plan["stages"][1]["ranks"] = ["1"]
    bad.write_text(json.dumps(plan))
    code = main(["train", "--model", "mlp", "--workers", "2", "--plan", str(bad), "--out", str(tmp_path / "run"),
                 "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "plan.json" in err, err


class _Payload:
    """Unpickling this runs ``touch MARKER``: what an attacker's file would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _run(capfd, caplog, *args: str) -> SimpleNamespace:
    """The command in this process: its exit code, and what it and its workers wrote and logged
    (the console's warnings are log records in this process)."""
    capfd.readouterr()
    caplog.clear()
    code = main(list(args))
    out, err = capfd.readouterr()
    return SimpleNamespace(returncode=code, stdout=out, stderr=err + caplog.text)


# torch's weights-only loader warns about the payload's pickle protocol before refusing it
@pytest.mark.filterwarnings("ignore:Detected pickle protocol:UserWarning")
def test_a_pickle_payload_in_any_file_a_resume_reads_never_runs(tmp_path, capfd, caplog):
    out = tmp_path / "run"
    done = _run(capfd, caplog, "train", "--model", "mlp", "--workers", "2", "--epochs", "1", "--max-minibatches", "2",
                "--no-progress", "--out", str(out))
    assert done.returncode == 0, done.stderr[-2000:]
    checkpoint = out / "checkpoints" / "epoch_1"
    marker = tmp_path / "payload_ran"
    payload = pickle.dumps(_Payload(marker))
    files = sorted(p.name for p in checkpoint.iterdir())
    assert "manifest.json" in files and "stage0.pt" in files and "extra.json" in files
    for name in files:
        original = (checkpoint / name).read_bytes()
        manifest = (checkpoint / "manifest.json").read_text()
        (checkpoint / name).write_bytes(payload)
        if name != "manifest.json":  # the attacker rewrites the checksums too: they prove nothing
            import hashlib

            m = json.loads(manifest)
            for entry in m["files"]:
                if entry["file"] == name:
                    entry["sha256"], entry["size"] = hashlib.sha256(payload).hexdigest(), len(payload)
            (checkpoint / "manifest.json").write_text(json.dumps(m))
        resumed = _run(capfd, caplog, "train", "--model", "mlp", "--workers", "2", "--epochs", "2", "--max-minibatches", "2",
                       "--no-progress", "--out", str(out), "--resume")
        assert not marker.exists(), name
        assert resumed.returncode == 2, (name, resumed.stderr[-2000:])
        assert name in resumed.stderr, (name, resumed.stderr[-2000:])
        assert "Traceback" not in resumed.stderr, (name, resumed.stderr[-2000:])
        (checkpoint / name).write_bytes(original)
        (checkpoint / "manifest.json").write_text(manifest)
    # --init and export read state files the same way.
    state_file = tmp_path / "weights.pt"
    state_file.write_bytes(payload)
    started = _run(capfd, caplog, "train", "--model", "mlp", "--workers", "1", "--epochs", "1", "--init", str(state_file),
                   "--no-progress", "--out", str(tmp_path / "other"))
    assert started.returncode == 2 and "weights.pt" in started.stderr and not marker.exists(), started.stderr[-2000:]


def test_export_and_verify_refuse_bad_inputs_in_one_line(tmp_path, capsys):
    not_a_checkpoint = tmp_path / "nothing"
    not_a_checkpoint.mkdir()
    assert main(["export", str(not_a_checkpoint), "--out", str(tmp_path / "m.pt")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nothing" in err, err
    bad = tmp_path / "plan.json"
    bad.write_text('{"format_version": 1, "stages": [')
    assert main(["verify", "--model", "mlp", "--plan", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "plan.json" in err, err


@pytest.mark.parametrize("argv, fragment", [
    (["--atol", "-1"], "--atol must be a number >= 0, got -1.0"),  # ran, and reported "MISMATCH, max |diff| 0"
    (["--rtol", "-0.5"], "--rtol must be a number >= 0, got -0.5"),
    (["--rtol", "nan"], "--rtol must be a number >= 0, got nan"),
    # kinds mixed: the plan made for the first cannot run zb-v (a ScheduleBuildError traceback before)
    (["--schedule", "zb-h1,zb-v", "--minibatches", "1"], "cannot verify zb-v on the plan straight"),
])
def test_verify_refuses_what_it_cannot_check_in_one_line(argv, fragment, capsys):
    assert main(["verify", "--model", "mlp", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and fragment in err, err


def test_verify_on_a_device_that_is_not_here_is_one_line(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert main(["verify", "--model", "mlp", "--device", "cuda:0", "--minibatches", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "device 'cuda:0': CUDA is not available here" in err, err


def test_verify_plans_refuses_a_negative_tolerance_before_any_process_starts():
    import functools

    import torch

    from torchpipedream.runtime.verification import VerifyError, verify_plans

    plan = Plan.straight([["0"], ["1"]], schedule="flush")
    model = functools.partial(torch.nn.Linear, 2, 2)
    with pytest.raises(VerifyError, match="atol must be a number >= 0"):
        verify_plans(model, [torch.zeros(2, 2)], [plan], torch.optim.SGD, atol=-1.0)
    with pytest.raises(VerifyError, match="cannot verify zb-v on the plan"):
        verify_plans(model, [torch.zeros(2, 2)], [Plan.straight([["0"], ["1"]], schedule="zb-v")], torch.optim.SGD)
