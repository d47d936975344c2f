"""A small character-level transformer language model, written to be traced by torch.fx.

No data-dependent Python control flow: the sequence length comes from ``x.shape`` (a traced
``size`` call), and the causal mask is a registered buffer sliced to that length. Attention
is spelled out (query/key/value projections, scaled scores, masked softmax) rather than
hidden in ``nn.MultiheadAttention``, so the profile shows each matmul as its own layer.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["transformer", "CharTransformer", "VOCAB_SIZE"]

#: Printable ASCII (32..126) plus newline: the alphabet of :func:`..data.text_data`.
VOCAB_SIZE = 96


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, heads: int, context: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"transformer: d_model={d_model} must be divisible by heads={heads}")
        self.heads = heads
        self.head_dim = d_model // heads
        self.query = nn.Linear(d_model, d_model)
        self.key = nn.Linear(d_model, d_model)
        self.value = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.register_buffer("mask", torch.tril(torch.ones(context, context, dtype=torch.bool)), persistent=False)

    def forward(self, x):
        b, t, d = x.shape
        q = self.query(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.key(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        v = self.value(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        # narrow (not slicing): torch.fx records it even though the bound comes from x.shape.
        causal = self.mask.narrow(0, 0, t).narrow(1, 0, t)
        scores = scores.masked_fill(~causal, float("-inf"))
        y = F.softmax(scores, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, d_model: int, heads: int, context: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, heads, context)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, 4 * d_model)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(self.act(self.fc1(self.ln2(x))))


class CharTransformer(nn.Module):
    """Token + learned position embeddings → ``layers`` blocks → LayerNorm → vocabulary logits.

    Input: ``(N, T)`` int64 character ids, ``T <= context``; output: ``(N, T, vocab)`` logits.
    """

    def __init__(self, vocab: int, context: int, d_model: int, heads: int, layers: int) -> None:
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(context, d_model))
        nn.init.normal_(self.pos, std=0.02)
        self.blocks = nn.Sequential(*[Block(d_model, heads, context) for _ in range(layers)])
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos.narrow(0, 0, t)
        return self.head(self.ln(self.blocks(x)))


def transformer(
    vocab: int = VOCAB_SIZE, context: int = 64, d_model: int = 128, heads: int = 4, layers: int = 2
) -> CharTransformer:
    """A small causal character LM (defaults: 96 characters, context 64, 2 layers, d_model 128)."""
    return CharTransformer(vocab, context, d_model, heads, layers)
