"""Tests for the example models, the registry and the data helpers."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.fx
from torch import nn
from torch.nn import functional as F

from torchpipedream.models import (
    MODELS,
    ModelError,
    cnn,
    cross_entropy,
    digits_data,
    get_model,
    loss_fn,
    sample_input,
    text_data,
    transformer,
)
from torchpipedream.models.data import DataError, decode_text, encode_text
from torchpipedream.model.capture import trace


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_model_runs_and_traces_to_the_same_function(name):
    torch.manual_seed(0)
    model = get_model(name).eval()
    x, y = sample_input(name, 4)
    out = model(x)
    expected = (4, 64, 96) if name in ("transformer", "gpt2") else (4, 10)
    assert tuple(out.shape) == expected
    traced = trace(model, (x,), {}, train=False)  # torch.fx, or torch.export for gpt2
    assert traced.method == ("export" if name == "gpt2" else "fx")
    again = traced.unflatten(traced.module(*traced.flatten((x,), {})))
    assert torch.allclose(again, out, atol=1e-6)
    loss = loss_fn(name)(out, y)
    assert loss.dim() == 0 and torch.isfinite(loss)


def test_cnn_parameters_sit_in_the_fully_connected_head():
    model = cnn()
    head = sum(p.numel() for m in model if isinstance(m, nn.Linear) for p in m.parameters())
    total = sum(p.numel() for p in model.parameters())
    assert head / total > 0.95


def test_resnet_traces_to_a_graph_with_skip_additions():
    gm = torch.fx.symbolic_trace(get_model("resnet"))
    adds = [n for n in gm.graph.nodes if n.op == "call_function" and n.target.__name__ == "add"]
    assert len(adds) >= 2
    assert all(len(n.all_input_nodes) == 2 for n in adds)


def test_transformer_is_causal():
    torch.manual_seed(0)
    model = transformer(layers=2).eval()
    x, _ = sample_input("transformer", 2, context=32)
    changed = x.clone()
    changed[:, 20:] = (changed[:, 20:] + 1) % 96
    with torch.no_grad():
        a, b = model(x), model(changed)
    assert torch.allclose(a[:, :20], b[:, :20], atol=1e-5)
    assert not torch.allclose(a[:, 20:], b[:, 20:])


def test_cnn_trains_to_95_percent_on_digits():
    x_train, y_train, x_test, y_test = digits_data(seed=0)
    torch.manual_seed(0)
    model = cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        perm = torch.randperm(len(x_train), generator=gen)
        for i in range(0, len(perm), 32):
            idx = perm[i : i + 32]
            opt.zero_grad()
            cross_entropy(model(x_train[idx]), y_train[idx]).backward()
            opt.step()
    with torch.no_grad():
        accuracy = (model(x_test).argmax(1) == y_test).float().mean().item()
    assert accuracy >= 0.95


# -------------------------------------------------------------------- registry
def test_get_model_builds_registry_models_with_options():
    model = get_model("cnn", fc=64)
    assert isinstance(model, nn.Module)
    assert [m.out_features for m in model if isinstance(m, nn.Linear)] == [64, 64, 10]


def test_get_model_accepts_module_function_specs():
    assert isinstance(get_model("torch.nn:Identity"), nn.Identity)
    assert isinstance(get_model("torchpipedream.models:mlp", hidden=(8,)), nn.Sequential)


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("vgg16", "unknown model 'vgg16'"),
        ("no_such_module_xyz:build", "cannot import module 'no_such_module_xyz'"),
        ("torch.nn:NoSuchThing", "has no attribute 'NoSuchThing'"),
        ("math:pi", "is not callable"),
        ("collections:OrderedDict", "returned OrderedDict, not a torch.nn.Module"),
        ("torch.nn:Linear", "calling Linear() failed"),
        ("sys:exit", "calling exit() failed: SystemExit"),  # a sys.exit(0) inside a user's builder
        (":build", "expected 'module:function'"),
    ],
)
def test_get_model_errors_say_what_is_wrong(spec, fragment):
    with pytest.raises(ModelError) as info:
        get_model(spec)
    assert fragment in str(info.value)
    assert isinstance(info.value, ValueError) and "\n" not in str(info.value)


def test_models_and_digits_work_without_scikit_learn():
    code = (
        "import sys; sys.modules['sklearn'] = None\n"
        "import torchpipedream.models as m\n"
        "for n in m.MODELS: m.get_model(n)\n"
        "x, y, xt, yt = m.digits_data()\n"
        "print('OK', len(x) + len(xt))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "OK 1797" in result.stdout


def test_bundled_digits_are_scikit_learns():
    sklearn_datasets = pytest.importorskip("sklearn.datasets")  # a test dependency
    reference = sklearn_datasets.load_digits()
    x_train, y_train, x_test, y_test = digits_data(seed=0, flatten=True)
    ours = sorted(zip((torch.cat([x_train, x_test]) * 16).round().to(torch.int64).tolist(),
                      torch.cat([y_train, y_test]).tolist()))
    theirs = sorted(zip(torch.as_tensor(reference.data).to(torch.int64).tolist(), reference.target.tolist()))
    assert ours == theirs


# ------------------------------------------------------------------------ data
def test_digits_data_split_is_fixed_scaled_and_stratified():
    a = digits_data(seed=0)
    b = digits_data(seed=0)
    x_train, y_train, x_test, y_test = a
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert len(x_train) + len(x_test) == 1797
    assert abs(len(x_test) / 1797 - 0.25) < 0.01
    assert x_train.shape[1:] == (1, 8, 8) and x_train.dtype == torch.float32
    assert x_train.min() >= 0.0 and x_train.max() <= 1.0 and x_train.max() == 1.0
    assert y_train.dtype == torch.int64
    assert set(y_test.tolist()) == set(range(10))
    everything = torch.cat([y_train, y_test])
    for digit in range(10):  # stratified: each digit splits in the test fraction
        total = int((everything == digit).sum())
        assert int((y_test == digit).sum()) == round(total * 0.25)
    other = digits_data(seed=1)
    assert not torch.equal(other[0], x_train)
    flat = digits_data(seed=0, flatten=True)
    assert flat[0].shape == (len(x_train), 64) and torch.equal(flat[0], x_train.reshape(-1, 64))
    with pytest.raises(DataError):
        digits_data(test_fraction=1.5)


def test_text_data_windows_are_next_character_pairs():
    x_train, y_train, x_val, y_val = text_data(context=32, max_bytes=50_000)
    assert x_train.shape[1] == 32 and y_train.shape == x_train.shape
    assert torch.equal(x_train[:, 1:], y_train[:, :-1])
    assert torch.equal(x_train[1:, 0], y_train[:-1, -1])  # stride = context: windows abut
    assert len(x_val) > 0 and torch.equal(x_val[:, 1:], y_val[:, :-1])
    assert int(x_train.min()) >= 0 and int(x_train.max()) < 96
    assert 40_000 < (len(x_train) + len(x_val)) * 32 <= 50_000
    again = text_data(context=32, max_bytes=50_000)
    assert torch.equal(again[0], x_train)
    assert "def " in decode_text(x_train.flatten())


def test_encode_decode_round_trip():
    text = "def f(x):\n    return x ~ 1\n"
    assert decode_text(encode_text(text)) == text
    assert decode_text(encode_text("a\tb\u00e9")) == "a    b"


def test_sample_input_and_loss():
    x, y = sample_input("transformer", 3)
    assert x.shape == (3, 64) and x.dtype == torch.int64 and y.shape == (3, 64)
    x, y = sample_input("cnn", 5)
    assert x.shape == (5, 1, 8, 8) and y.shape == (5,)
    with pytest.raises(DataError):
        sample_input("nope", 4)
    logits = torch.randn(2, 3, 7)
    target = torch.randint(0, 7, (2, 3))
    manual = -torch.log_softmax(logits, -1).gather(-1, target[..., None]).mean()
    assert torch.allclose(cross_entropy(logits, target), manual)
    logits2 = torch.randn(4, 10)
    target2 = torch.randint(0, 10, (4,))
    assert torch.allclose(cross_entropy(logits2, target2), F.cross_entropy(logits2, target2))
