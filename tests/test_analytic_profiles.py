"""Analytic transformer profiles (model/analytic_profiles.py): parameter counts against the published
totals, FLOPs and saved activation bytes of a block against tiny plain-PyTorch blocks (a FLOP
counter and autograd's saved-tensor hooks), and the graph as the planner and the JSON files take it."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from torchpipedream.model.analytic_profiles import (A100_80GB, BYTES_PER_PARAMETER, GPT3_175B, LLAMA3_70B,
                                                    OPTIMIZER_STATE_FACTOR, GPUSpec, TransformerShape,
                                                    block_forward_flops, block_saved_bytes, transformer_graph)
from torchpipedream.model.graph import LayerGraph
from torchpipedream.search.planner import plan

TINY_GPT = TransformerShape("tiny-gpt", layers=2, hidden=64, heads=4, ffn_hidden=256, vocab=100, seq_len=32)
TINY_LLAMA = TransformerShape("tiny-llama", layers=2, hidden=64, heads=8, ffn_hidden=96, vocab=100, seq_len=32,
                              kv_heads=2, gated_mlp=True, family="llama")
BATCH = 2


# ------------------------------------------------------------------ plain-PyTorch reference blocks
def _gpt_params(shape: TransformerShape) -> dict[str, torch.Tensor]:
    h, f = shape.hidden, shape.ffn_hidden
    shapes = {"ln1_w": (h,), "ln1_b": (h,), "qkv_w": (3 * h, h), "qkv_b": (3 * h,), "out_w": (h, h), "out_b": (h,),
              "ln2_w": (h,), "ln2_b": (h,), "fc1_w": (f, h), "fc1_b": (f,), "fc2_w": (h, f), "fc2_b": (h,)}
    return {k: torch.nn.Parameter(torch.randn(v, dtype=torch.bfloat16) * 0.1) for k, v in shapes.items()}


def _gpt_block(x: torch.Tensor, p: dict[str, torch.Tensor], heads: int) -> torch.Tensor:
    """A pre-LN GPT block with dropout (p = 0.1) as Megatron runs it: masks of one byte."""
    b, s, h = x.shape
    d = h // heads
    y = F.layer_norm(x, (h,), p["ln1_w"], p["ln1_b"])
    q, k, v = (t.reshape(b, s, heads, d).transpose(1, 2) for t in F.linear(y, p["qkv_w"], p["qkv_b"]).split(h, -1))
    probs = torch.softmax((q @ k.transpose(-2, -1)) * d ** -0.5, dim=-1)
    probs, _ = torch.native_dropout(probs, 0.1, True)
    ctx = (probs @ v).transpose(1, 2).reshape(b, s, h)
    x = x + torch.native_dropout(F.linear(ctx, p["out_w"], p["out_b"]), 0.1, True)[0]
    y = F.gelu(F.linear(F.layer_norm(x, (h,), p["ln2_w"], p["ln2_b"]), p["fc1_w"], p["fc1_b"]))
    return x + torch.native_dropout(F.linear(y, p["fc2_w"], p["fc2_b"]), 0.1, True)[0]


def _llama_params(shape: TransformerShape) -> dict[str, torch.Tensor]:
    h, f, kv = shape.hidden, shape.ffn_hidden, shape.kv_hidden
    shapes = {"n1": (h,), "wq": (h, h), "wk": (kv, h), "wv": (kv, h), "wo": (h, h), "n2": (h,), "wg": (f, h),
              "wu": (f, h), "wd": (h, f)}
    return {k: torch.nn.Parameter(torch.randn(v, dtype=torch.bfloat16) * 0.1) for k, v in shapes.items()}


def _llama_block(x: torch.Tensor, p: dict[str, torch.Tensor], heads: int, kv_heads: int) -> torch.Tensor:
    """A Llama block: grouped-query attention (each key/value head serves heads/kv_heads query
    heads, kept at its own width) and a SwiGLU MLP. The norms are LayerNorms without bias: a fused
    RMSNorm saves the same (its input and a statistic per row), while torch's CPU rms_norm is
    decomposed into fp32 pieces."""
    b, s, h = x.shape
    d, rep = h // heads, heads // kv_heads

    def norm(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(t, (h,), w)

    y = norm(x, p["n1"])
    q = F.linear(y, p["wq"]).reshape(b, s, kv_heads, rep, d).permute(0, 2, 3, 1, 4).reshape(b, kv_heads, rep * s, d)
    k = F.linear(y, p["wk"]).reshape(b, s, kv_heads, d).transpose(1, 2)
    v = F.linear(y, p["wv"]).reshape(b, s, kv_heads, d).transpose(1, 2)
    probs = torch.softmax((q @ k.transpose(-2, -1)) * d ** -0.5, dim=-1)
    ctx = (probs @ v).reshape(b, kv_heads, rep, s, d).permute(0, 3, 1, 2, 4).reshape(b, s, h)
    x = x + F.linear(ctx, p["wo"])
    y = norm(x, p["n2"])
    return x + F.linear(F.silu(F.linear(y, p["wg"])) * F.linear(y, p["wu"]), p["wd"])


def _reference(shape: TransformerShape) -> tuple[float, float, int, int]:
    """(forward FLOPs, backward FLOPs, bytes saved for the backward, parameters) of one tiny block."""
    torch.manual_seed(0)
    x = torch.randn(BATCH, shape.seq_len, shape.hidden, dtype=torch.bfloat16, requires_grad=True)
    if shape.family == "gpt":
        params = _gpt_params(shape)
        run = lambda: _gpt_block(x, params, shape.heads)  # noqa: E731
    else:
        params = _llama_params(shape)
        run = lambda: _llama_block(x, params, shape.heads, shape.kv_heads)  # noqa: E731
    fixed = {p.untyped_storage().data_ptr() for p in params.values()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in fixed:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with FlopCounterMode(display=False) as forward_count, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    with FlopCounterMode(display=False) as backward_count:
        out.backward(torch.ones_like(out))
    return (forward_count.get_total_flops(), backward_count.get_total_flops(), sum(saved.values()),
            sum(p.numel() for p in params.values()))


# ---------------------------------------------------------------------------------------- tests
def test_parameter_counts_match_the_published_totals() -> None:
    assert GPT3_175B.parameters == pytest.approx(175e9, rel=0.01)
    assert LLAMA3_70B.parameters == pytest.approx(70.6e9, rel=0.02)
    for shape in (GPT3_175B, LLAMA3_70B, TINY_GPT):  # the graph holds them all, a tied matrix once
        g = transformer_graph(shape, 1, A100_80GB)
        assert g.totals()["parameter_bytes"] == BYTES_PER_PARAMETER * shape.parameters


@pytest.mark.parametrize("shape", [TINY_GPT, TINY_LLAMA], ids=lambda s: s.name)
def test_a_block_against_plain_pytorch(shape: TransformerShape) -> None:
    forward, backward, saved, parameters = _reference(shape)
    matrices, attention = block_forward_flops(shape, BATCH)
    assert matrices + attention == forward
    assert backward == 2 * forward
    assert shape.block_parameters == parameters
    # the references also save LayerNorm's per-row statistics, which the formula leaves out (< 1%)
    assert saved == pytest.approx(block_saved_bytes(shape, BATCH), rel=0.01)
    assert saved >= block_saved_bytes(shape, BATCH)


def test_a_gpt_block_by_hand_and_korthikantis_formula() -> None:
    shape = TransformerShape("hand", layers=1, hidden=8, heads=2, ffn_hidden=32, vocab=10, seq_len=4)
    # QKV 2·4·8·24, QKᵀ and ×V 2·2·4·4·4 each, output 2·4·8·8, MLP 2·(2·4·8·32)
    assert sum(block_forward_flops(shape, 1)) == 1536 + 256 + 256 + 512 + 2048 + 2048
    s, b, h, a = 2048, 3, GPT3_175B.hidden, GPT3_175B.heads
    assert block_saved_bytes(GPT3_175B, b) == s * b * h * (34 + 5 * a * s / h)


def test_times_are_flops_over_the_sustained_rate_and_scale_with_microbatches() -> None:
    gpu = GPUSpec("test", sustained_tflops=100.0, memory_bytes=10**10)
    one = transformer_graph(TINY_GPT, 2, gpu)
    four = transformer_graph(TINY_GPT, 2, gpu, microbatches=4)
    assert one["block0"].forward_ms == pytest.approx(sum(block_forward_flops(TINY_GPT, 2)) / 100e12 * 1e3)
    assert one["block0"].optimizer_ms == 0.0  # no memory bandwidth given: the step is not charged
    assert four.batch_size == 8
    for a, b in zip(one, four):
        assert b.forward_ms == pytest.approx(4 * a.forward_ms) and b.backward_ms == pytest.approx(4 * a.backward_ms)
        assert (b.activation_bytes, b.saved_bytes) == (4 * a.activation_bytes, 4 * a.saved_bytes)
        assert b.parameter_bytes == a.parameter_bytes and b.optimizer_ms == a.optimizer_ms
    # the layers' saved bytes add up to Korthikanti's per-layer count plus the embedding's and head's
    total = sum(layer.saved_bytes for layer in one)
    s, bh, v = TINY_GPT.seq_len * 2, TINY_GPT.hidden, TINY_GPT.vocab
    assert total == TINY_GPT.layers * block_saved_bytes(TINY_GPT, 2) + s * bh + 4 * s * bh + 4 * s * v


def test_the_graph_validates_round_trips_and_ties_the_embedding(tmp_path: Path) -> None:
    g = transformer_graph(GPT3_175B, 1, A100_80GB, microbatches=8)
    assert g.is_chain and len(g) == GPT3_175B.layers + 2
    assert [t.layers for t in g.tied] == [["embedding", "head"]]
    g.save(tmp_path / "gpt3.json")
    assert LayerGraph.load(tmp_path / "gpt3.json") == g
    untied = transformer_graph(LLAMA3_70B, 1, A100_80GB, flash_attention=True)
    assert not untied.tied
    assert untied["block0"].saved_bytes < transformer_graph(LLAMA3_70B, 1, A100_80GB)["block0"].saved_bytes / 3


def test_bad_shapes_and_arguments_are_one_clear_error() -> None:
    with pytest.raises(ValueError, match="hidden .* multiple of heads"):
        TransformerShape("bad", layers=2, hidden=10, heads=3, ffn_hidden=40, vocab=10, seq_len=4)
    with pytest.raises(ValueError, match="kv_heads must divide"):
        TransformerShape("bad", layers=2, hidden=12, heads=4, ffn_hidden=40, vocab=10, seq_len=4, kv_heads=3)
    with pytest.raises(ValueError, match="microbatch_size must be a positive integer"):
        transformer_graph(TINY_GPT, 0, A100_80GB)


def test_the_planner_takes_the_graph_on_eight_gpus() -> None:
    shape = TransformerShape("gpt-1.3b-like", layers=24, hidden=2048, heads=16, ffn_hidden=8192, vocab=51200,
                             seq_len=2048, tied_embeddings=True)
    g = transformer_graph(shape, 1, A100_80GB, microbatches=16)
    t0 = time.perf_counter()
    p = plan(g, "8:300GB/s@80GB", schedule="flush", microbatches=16, optimizer_state_factor=OPTIMIZER_STATE_FACTOR)
    assert time.perf_counter() - t0 < 5.0
    assert p.num_workers == 8 and sorted(n for s in p.stages for n in s.layers) == sorted(g.names)
    assert 0 < p.predicted["peak_memory_bytes"] <= 80e9
    assert p.predicted["samples_per_s"] > 0
