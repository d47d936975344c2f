"""`torchpipedream export` and `train --init`: a checkpoint's weights as an ordinary state_dict
(tied weights under every name), and a run that starts from one (issue 21)."""

from __future__ import annotations

from pathlib import Path

import torch

from torchpipedream.cli import main
from torchpipedream.models import get_model
from torchpipedream.runtime.checkpoint import latest_checkpoint, read_stage_states
from torchpipedream.model.state_files import load_state_file


def _cli(*args: str) -> None:
    """The command in this process (its imports and host measurement shared with the suite)."""
    assert main(list(args)) == 0


def test_export_then_init_round_trip_with_tied_weights(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _cli("train", "--model", "gpt2", "--workers", "2", "--straight", "--epochs", "1", "--max-minibatches", "2",
         "--no-progress", "--out", str(run))
    saved = read_stage_states(latest_checkpoint(run / "checkpoints"))
    for suffix in (".pt", ".safetensors"):
        path = tmp_path / f"model{suffix}"
        _cli("export", str(run), "--out", str(path))
        state = load_state_file(path)
        model = get_model("gpt2")
        model.load_state_dict(state)  # strict: every name the model has, tied ones included
        assert torch.equal(state["model.transformer.wte.weight"], state["model.lm_head.weight"])
        for k, v in model.state_dict().items():
            assert torch.equal(v, saved[k]), (suffix, k)
    # A run started from the exported weights starts where they are: with a learning rate of
    # 1e-12 its final weights are the exported ones.
    again = tmp_path / "again"
    _cli("train", "--model", "gpt2", "--workers", "2", "--straight", "--epochs", "1", "--max-minibatches", "1",
         "--optimizer", "sgd", "--lr", "1e-12", "--init", str(tmp_path / "model.safetensors"), "--no-progress",
         "--out", str(again))
    final = torch.load(again / "checkpoint.pt", weights_only=True)["state_dict"]
    exported = load_state_file(tmp_path / "model.pt")
    assert max((final[k] - exported[k]).abs().max().item() for k in exported) < 1e-9
    fresh = get_model("gpt2").state_dict()
    assert max((fresh[k] - exported[k]).abs().max().item() for k in exported) > 1e-4  # it trained
