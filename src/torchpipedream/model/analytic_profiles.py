"""Per-layer profiles of decoder-only transformers computed from their shapes, for planning on paper.

A model too large to profile (GPT-3 175B, Llama 3 70B) is still a chain the planner can cut:
an embedding, ``layers`` identical blocks and a final norm with the output head.
:func:`transformer_graph` returns that chain as a :class:`~torchpipedream.model.graph.LayerGraph`
with every field the profiler fills, computed from the standard formulas below instead of
measured. Notation: b sequences of s tokens, hidden size h, a attention heads (head size
d = h/a), g key/value heads (h_kv = g·d), MLP width f, vocabulary V.

Compute (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", the FLOP count behind its TFLOP/s figures: 2 FLOPs per multiply-add, matrix
multiplications only)

* a GPT block's forward: 24·b·s·h² + 4·b·s²·h (the QKV, output and two MLP matrices hold 12·h²
  weights, each applied to b·s tokens: 2·b·s·12·h²; QKᵀ and attention × V: 2·2·b·s²·h);
* in general 2·b·s·P_mm + 4·b·s²·h with P_mm the block's matrix weights:
  h·(h + 2·h_kv) (Q, K, V; grouped-query attention shrinks K and V to h_kv) + h² (output) +
  2·h·f (GELU MLP) or 3·h·f (gated SwiGLU MLP: gate, up and down). Llama 3 70B:
  P_mm = 8192·(8192 + 2·1024) + 8192² + 3·8192·28672 = 855,638,016;
* the output head's forward: 2·b·s·h·V (the logits); the embedding is a gather (0 FLOPs);
* backward = 2 × forward (a gradient for the input and one for the weights, each the forward's
  size; attention's QKᵀ and ×V have no weights, so their backward is all input gradient:
  ``input_grad_ms`` = matrix FLOPs + 2 × attention FLOPs, ``weight_grad_ms`` = matrix FLOPs);
* causal masking halves no count (the papers count the full QKᵀ).

Time = FLOPs / the GPU's sustained rate (:class:`GPUSpec`): a rate measured end to end on a
large run, so every layer is charged the same efficiency; small microbatches run below it on a
real GPU, and this model does not see that.

Activation memory (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", its per-layer count: 16-bit activations, no tensor or sequence parallelism): a GPT
block saves s·b·h·(34 + 5·a·s/h) bytes for its backward. Term by term, which this module
derives anew for grouped-query attention and SwiGLU: the two norms' inputs 4·s·b·h; QKV's
input 2·s·b·h; Q and K 2·s·b·h + 2·s·b·h_kv; softmax output 2·a·s²·b; V 2·s·b·h_kv; output
projection's input 2·s·b·h; with dropout (GPT) its mask a·s²·b, the dropped probabilities
2·a·s²·b and two sb·h masks (1 byte each); MLP: its input 2·s·b·h, then GELU's input and the
second matrix's input 2·s·b·f each, or for SwiGLU the gate, SiLU, up and product outputs,
2·s·b·f each. GPT (h_kv = h, f = 4h, dropout): 34·s·b·h + 5·a·s²·b, the paper's formula.
Llama (no dropout): 12·s·b·h + 4·s·b·h_kv + 8·s·b·f + 2·a·s²·b. With ``flash_attention`` no
s² term is kept: the attention output (the projection's input, already counted) and the
softmax's log-sum-exp, 4·a·s·b bytes in fp32. The embedding saves its output (the first
norm's input) and, with dropout, its mask s·b·h; the head saves the final norm's output 2·s·b·h
and the loss's fp32 logits 4·s·b·V (the paper's count for the output layer, 4·s·b·h·(1 + V/h),
includes the final norm's input, which here is the last block's output).

Byte conventions (ZeRO, Rajbhandari et al. 2020, §3.1: mixed-precision Adam holds 16 bytes
per parameter): ``parameter_bytes`` are the bf16 weights, 2 bytes per parameter; the gradient
(2 bytes) and Adam's fp32 master weights, momentum and variance (12 bytes) are 7 more copies
of those weights: plan with ``optimizer_state_factor=OPTIMIZER_STATE_FACTOR``. Activations and
the tensors crossing a cut are bf16. ``optimizer_ms`` is the Adam step, memory-bound: it reads
the gradient (2 bytes), reads and writes master weights, momentum and variance (24) and writes
the bf16 weights (2), ``ADAM_STEP_BYTES`` per parameter over the GPU's memory bandwidth.

Parameters: a GPT block 12·h² + 13·h (matrices, their biases, two LayerNorms of 2·h); a Llama
block P_mm + 2·h (no biases, two RMSNorms of h). The GPT embedding adds s·h learned positions;
Llama's rotary positions have no weights. A tied output head shares the embedding's matrix
(``LayerGraph.tied``), counted once, in the embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

from .graph import Layer, LayerGraph, SharedParameter

__all__ = ["TransformerShape", "GPUSpec", "GPT3_175B", "LLAMA3_70B", "A100_80GB", "H100_80GB", "SHAPES", "GPUS",
           "BYTES_PER_PARAMETER", "OPTIMIZER_STATE_FACTOR", "ADAM_STEP_BYTES", "transformer_graph",
           "block_forward_flops", "block_saved_bytes", "head_forward_flops"]

#: bf16 weights, activations and gradients.
BYTES_PER_PARAMETER = 2
#: Extra weight-sized copies per worker: a bf16 gradient (2 bytes) and Adam's fp32 master
#: weights, momentum and variance (12 bytes), in units of the 2-byte weights: (2 + 12) / 2.
OPTIMIZER_STATE_FACTOR = 7.0
#: Bytes one mixed-precision Adam step moves per parameter (module docstring).
ADAM_STEP_BYTES = 28
_FAMILIES = ("gpt", "llama")


@dataclass(frozen=True)
class TransformerShape:
    """A decoder-only transformer's shape.

    ``kv_heads``: grouped-query attention's key/value heads (None: as many as ``heads``).
    ``gated_mlp``: a SwiGLU MLP (three matrices of ``hidden`` × ``ffn_hidden``).
    ``family``: "gpt" (biases, LayerNorm, dropout, learned positions) or "llama" (no biases,
    RMSNorm, no dropout, rotary positions).
    """

    name: str
    layers: int
    hidden: int
    heads: int
    ffn_hidden: int
    vocab: int
    seq_len: int
    kv_heads: int | None = None
    gated_mlp: bool = False
    tied_embeddings: bool = False
    family: str = "gpt"

    def __post_init__(self) -> None:
        for field_name in ("layers", "hidden", "heads", "ffn_hidden", "vocab", "seq_len"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TransformerShape {self.name!r}: {field_name} must be a positive integer, "
                                 f"got {value!r}")
        if self.hidden % self.heads:
            raise ValueError(f"TransformerShape {self.name!r}: hidden ({self.hidden}) must be a multiple of heads "
                             f"({self.heads})")
        if self.kv_heads is not None and (not isinstance(self.kv_heads, int) or self.kv_heads < 1
                                          or self.heads % self.kv_heads):
            raise ValueError(f"TransformerShape {self.name!r}: kv_heads must divide heads ({self.heads}), "
                             f"got {self.kv_heads!r}")
        if self.family not in _FAMILIES:
            raise ValueError(f"TransformerShape {self.name!r}: family must be one of {_FAMILIES}, got {self.family!r}")

    @property
    def kv_hidden(self) -> int:
        """Width of the keys (and of the values): h_kv = kv_heads × head size."""
        return (self.kv_heads or self.heads) * (self.hidden // self.heads)

    @property
    def dropout(self) -> bool:
        return self.family == "gpt"

    @property
    def matrix_parameters(self) -> int:
        """P_mm: the weights of one block's matrix multiplications."""
        h, f = self.hidden, self.ffn_hidden
        return h * (h + 2 * self.kv_hidden) + h * h + (3 if self.gated_mlp else 2) * h * f

    @property
    def block_parameters(self) -> int:
        """One block's parameters: matrices, biases (GPT) and its two norms."""
        h = self.hidden
        if self.family == "llama":
            return self.matrix_parameters + 2 * h
        biases = (h + 2 * self.kv_hidden) + h + (2 if self.gated_mlp else 1) * self.ffn_hidden + h
        return self.matrix_parameters + biases + 4 * h

    @property
    def embedding_parameters(self) -> int:
        """Token embedding (and GPT's learned positions)."""
        positions = self.seq_len * self.hidden if self.family == "gpt" else 0
        return self.vocab * self.hidden + positions

    @property
    def head_parameters(self) -> int:
        """Final norm and output matrix (the latter none when tied to the embedding)."""
        norm = 2 * self.hidden if self.family == "gpt" else self.hidden
        return norm + (0 if self.tied_embeddings else self.vocab * self.hidden)

    @property
    def parameters(self) -> int:
        """The model's parameters, a tied matrix counted once."""
        return self.embedding_parameters + self.layers * self.block_parameters + self.head_parameters


@dataclass(frozen=True)
class GPUSpec:
    """A GPU as the analytic profiles see it: a sustained 16-bit rate (TFLOP/s, what large runs
    reach end to end, not the data sheet's peak), its memory (bytes) and its memory bandwidth
    (bytes/s, for the optimizer step; None: the step is not charged)."""

    name: str
    sustained_tflops: float
    memory_bytes: int
    memory_bandwidth_Bps: float | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.sustained_tflops, (int, float)) and self.sustained_tflops > 0):
            raise ValueError(f"GPUSpec {self.name!r}: sustained_tflops must be > 0, got {self.sustained_tflops!r}")
        if not (isinstance(self.memory_bytes, int) and self.memory_bytes > 0):
            raise ValueError(f"GPUSpec {self.name!r}: memory_bytes must be a positive integer, "
                             f"got {self.memory_bytes!r}")


#: GPT-3 175B (Brown et al. 2020, Table 2.1): 96 layers, d_model 12288, 96 heads, 2048 tokens;
#: Megatron-LM's vocabulary of 51,200 (Narayanan et al. 2021, §5); input and output embeddings tied.
GPT3_175B = TransformerShape("gpt3-175b", layers=96, hidden=12288, heads=96, ffn_hidden=4 * 12288, vocab=51200,
                             seq_len=2048, tied_embeddings=True)
#: Llama 3 70B (Dubey et al. 2024, "The Llama 3 Herd of Models", Table 3): 80 layers, model
#: dimension 8192, FFN 28672 (SwiGLU), 64 heads, 8 key/value heads, 8192 tokens; vocabulary
#: 128,256 as released (the paper rounds it to 128K); untied output matrix.
LLAMA3_70B = TransformerShape("llama3-70b", layers=80, hidden=8192, heads=64, ffn_hidden=28672, vocab=128256,
                              seq_len=8192, kv_heads=8, gated_mlp=True, family="llama")
#: A100 SXM 80 GB. 140 TFLOP/s: Narayanan et al. 2021, §5.1, GPT-3 175B on 1,024 A100s (its
#: training-time estimate of 34 days for 300B tokens), 45% of the 312 TFLOP/s bf16 peak; counted
#: with recomputation's FLOPs, i.e. what the hardware sustains. Memory: "80 GB" read as 80·10⁹ bytes
#: (the device has 80 GiB; the difference is the allocator's and the runtime's). 2.039 TB/s HBM2e.
A100_80GB = GPUSpec("A100-80GB", sustained_tflops=140.0, memory_bytes=80 * 10**9, memory_bandwidth_Bps=2.039e12)
#: H100 SXM 80 GB. 400 TFLOP/s: Dubey et al. 2024 (Llama 3), Table 4, Llama 3 405B on 16,384
#: H100s in bf16 (430 on 8,192; 38-43% of the 989 TFLOP/s dense bf16 peak). 3.35 TB/s HBM3.
H100_80GB = GPUSpec("H100-80GB", sustained_tflops=400.0, memory_bytes=80 * 10**9, memory_bandwidth_Bps=3.35e12)

SHAPES = {s.name: s for s in (GPT3_175B, LLAMA3_70B)}
GPUS = {g.name: g for g in (A100_80GB, H100_80GB)}


def block_forward_flops(shape: TransformerShape, batch: int) -> tuple[float, float]:
    """One block's forward FLOPs for ``batch`` sequences: (matrix multiplications, attention's
    QKᵀ and ×V), i.e. 2·b·s·P_mm and 4·b·s²·h."""
    b, s, h = batch, shape.seq_len, shape.hidden
    return 2.0 * b * s * shape.matrix_parameters, 4.0 * b * s * s * h


def head_forward_flops(shape: TransformerShape, batch: int) -> float:
    """The output head's forward FLOPs: 2·b·s·h·V."""
    return 2.0 * batch * shape.seq_len * shape.hidden * shape.vocab


def block_saved_bytes(shape: TransformerShape, batch: int, flash_attention: bool = False) -> int:
    """Bytes one block's forward saves for its backward, its input included (Korthikanti et
    al.'s per-layer count; see the module docstring for each term)."""
    b, s, h, f, kv, a = batch, shape.seq_len, shape.hidden, shape.ffn_hidden, shape.kv_hidden, shape.heads
    sbh = s * b * h
    norms = 4 * sbh
    attention = 2 * sbh + 2 * sbh + 4 * s * b * kv + 2 * sbh  # QKV input, Q, K and V, projection input
    if flash_attention:
        attention += 4 * a * s * b  # fp32 log-sum-exp per row and head
    else:
        attention += 2 * a * s * s * b + (3 * a * s * s * b if shape.dropout else 0)  # softmax; mask + dropped
    mlp = 2 * sbh + (8 if shape.gated_mlp else 4) * s * b * f
    masks = 2 * sbh if shape.dropout else 0  # dropout masks after attention and after the MLP, 1 byte each
    return norms + attention + mlp + masks


def _ms(flops: float, gpu: GPUSpec) -> float:
    return flops / (gpu.sustained_tflops * 1e12) * 1e3


def _step_ms(parameters: int, gpu: GPUSpec) -> float:
    """One Adam step over ``parameters`` (memory-bound), or 0 when the GPU names no bandwidth."""
    if gpu.memory_bandwidth_Bps is None:
        return 0.0
    return parameters * ADAM_STEP_BYTES / gpu.memory_bandwidth_Bps * 1e3


def _embedding(shape: TransformerShape, b: int, gpu: GPUSpec) -> Layer:
    out = 2 * shape.seq_len * b * shape.hidden
    mask = out // 2 if shape.dropout else 0
    return Layer("embedding", kind="Embedding", activation_bytes=out,
                 parameter_bytes=BYTES_PER_PARAMETER * shape.embedding_parameters,
                 optimizer_ms=_step_ms(shape.embedding_parameters, gpu), saved_bytes=out + mask,
                 saved_output_bytes=out, released_bytes=out, input_grad_ms=0.0, weight_grad_ms=0.0)


def _block(shape: TransformerShape, i: int, b: int, gpu: GPUSpec, flash_attention: bool) -> Layer:
    matrices, attention = block_forward_flops(shape, b)
    out = 2 * shape.seq_len * b * shape.hidden
    # the block's input is charged to the layer that produced it, and its output (which the next
    # norm saves) to it: the same count as Korthikanti's, which includes the input
    return Layer(f"block{i}", kind="TransformerBlock", forward_ms=_ms(matrices + attention, gpu),
                 backward_ms=_ms(2 * (matrices + attention), gpu), activation_bytes=out,
                 parameter_bytes=BYTES_PER_PARAMETER * shape.block_parameters,
                 optimizer_ms=_step_ms(shape.block_parameters, gpu),
                 saved_bytes=block_saved_bytes(shape, b, flash_attention), saved_output_bytes=out, released_bytes=out,
                 input_grad_ms=_ms(matrices + 2 * attention, gpu), weight_grad_ms=_ms(matrices, gpu))


def _head(shape: TransformerShape, b: int, gpu: GPUSpec) -> Layer:
    flops = head_forward_flops(shape, b)
    s, h, v = shape.seq_len, shape.hidden, shape.vocab
    return Layer("head", kind="NormAndOutput", forward_ms=_ms(flops, gpu), backward_ms=_ms(2 * flops, gpu),
                 activation_bytes=2 * s * b * v, parameter_bytes=BYTES_PER_PARAMETER * shape.head_parameters,
                 optimizer_ms=_step_ms(shape.head_parameters, gpu), saved_bytes=2 * s * b * h + 4 * s * b * v,
                 saved_output_bytes=0, released_bytes=0, input_grad_ms=_ms(flops, gpu), weight_grad_ms=_ms(flops, gpu))


def _scaled(layer: Layer, microbatches: int) -> Layer:
    """``layer`` for a minibatch of ``microbatches`` microbatches, as the profiler scales a
    profile: times and activation sizes times the count, parameters and the step unchanged."""
    for attr in ("forward_ms", "backward_ms", "input_grad_ms", "weight_grad_ms", "activation_bytes", "saved_bytes",
                 "saved_output_bytes", "released_bytes"):
        setattr(layer, attr, getattr(layer, attr) * microbatches)
    return layer


def transformer_graph(shape: TransformerShape, microbatch_size: int, gpu: GPUSpec, *, microbatches: int = 1,
                      flash_attention: bool = False) -> LayerGraph:
    """The chain embedding → ``shape.layers`` blocks → head, with analytic costs on ``gpu``.

    Like a profile taken with ``microbatches``: one microbatch of ``microbatch_size`` sequences
    is costed and every time and activation size scaled to the minibatch of ``microbatches`` of
    them (``LayerGraph.batch_size`` = ``microbatch_size × microbatches``); plan it with the same
    ``microbatches``. ``flash_attention``: attention keeps no s × s scores for the backward.
    """
    for name, value in (("microbatch_size", microbatch_size), ("microbatches", microbatches)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"transformer_graph: {name} must be a positive integer, got {value!r}")
    if not isinstance(shape, TransformerShape) or not isinstance(gpu, GPUSpec):
        raise ValueError("transformer_graph: shape must be a TransformerShape and gpu a GPUSpec")
    b = microbatch_size
    layers = [_embedding(shape, b, gpu)]
    layers += [_block(shape, i, b, gpu, flash_attention) for i in range(shape.layers)]
    layers.append(_head(shape, b, gpu))
    layers = [_scaled(layer, microbatches) for layer in layers]
    names = [layer.name for layer in layers]
    tied = []
    if shape.tied_embeddings:
        tied = [SharedParameter("embedding.weight", ["embedding", "head"],
                                BYTES_PER_PARAMETER * shape.vocab * shape.hidden)]
    meta = {"source": "analytic", "model": shape.name, "gpu": gpu.name, "sustained_tflops": gpu.sustained_tflops,
            "microbatch_size": microbatch_size, "microbatches": microbatches, "flash_attention": flash_attention,
            "parameters": shape.parameters}
    return LayerGraph(layers, list(zip(names, names[1:])), batch_size=b * microbatches, meta=meta, tied=tied,
                      source=f"transformer_graph({shape.name})")
