"""A small GPT-2 from Hugging Face ``transformers`` (random weights, nothing downloaded), for
``torchpipedream train --model gpt2`` and the examples: a model nobody here wrote, with its
input embedding and output layer tied, that torch.fx cannot trace (torch.export does).

``transformers`` is an optional dependency (``pip install 'torchpipedream[hf]'``); importing
this module does not need it, building the model does.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from .language import VOCAB_SIZE

__all__ = ["gpt2", "GPT2Logits", "GPT2Stage", "gpt2_stages", "TRANSFORMERS_VERSION"]

#: The release the project is tested with: graph node names (a plan's layer names) depend on it.
TRANSFORMERS_VERSION = "5.25.0"


class GPT2Logits(nn.Module):
    """``GPT2LMHeadModel`` returning its logits (batch, tokens, vocabulary), so that it trains
    with the built-in language model's loss: cross entropy over the last dimension."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits

    def pipeline_units(self) -> list[nn.Module]:
        """The model as a chain of its own modules, each called with the previous one's output:
        the embeddings (a :class:`GPT2Stage` of no block), every block, and the final norm with
        the output layer. ``train --tensor-parallel`` profiles and cuts GPT-2 by these units,
        whose attention and MLP layers stay modules to split (a graph torch.export traced has
        none left)."""
        blocks = list(self.model.transformer.h)
        return [GPT2Stage(self, range(0), True, False), *blocks, GPT2Stage(self, range(0), False, True)]


def gpt2(vocab_size: int = VOCAB_SIZE, context: int = 64, d_model: int = 64, layers: int = 2, heads: int = 2,
         dropout: float = 0.0) -> nn.Module:
    """A ``transformers`` GPT-2 language model over the text of :func:`..data.text_data`.

    ``use_cache=False``: the key/value cache is for generation, and torch.export cannot return it.
    """
    try:
        from transformers import GPT2Config, GPT2LMHeadModel  # lazy: an optional dependency, for --model gpt2 only
    except ImportError:
        raise ImportError(
            "--model gpt2 needs Hugging Face transformers: pip install 'torchpipedream[hf]' "
            f"(or transformers=={TRANSFORMERS_VERSION})") from None
    config = GPT2Config(vocab_size=vocab_size, n_positions=context, n_embd=d_model, n_layer=layers, n_head=heads,
                        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, use_cache=False,
                        bos_token_id=0, eos_token_id=0, tie_word_embeddings=True)
    return GPT2Logits(GPT2LMHeadModel(config))


class GPT2Stage(nn.Module):
    """A pipeline stage of a :class:`GPT2Logits` made of its modules themselves (torchtitan's way
    of cutting a transformer): the token and position embeddings (first stage), some of its
    blocks, the final norm and the output layer (last stage). Its layers stay the model's own
    modules, so tensor parallelism can split their attention and MLP (``Pipeline(tensor_parallel)``
    cannot split a model torch.export traced); the output layer's weight is the embedding's, a
    parameter the first and the last stage share."""

    def __init__(self, model: GPT2Logits, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        body = model.model.transformer
        self.wte = body.wte if first else None
        self.wpe = body.wpe if first else None
        self.drop = body.drop if first else None
        self.h = nn.ModuleList(body.h[i] for i in blocks)
        self.ln_f = body.ln_f if last else None
        self.lm_head = model.model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wte is not None:  # token ids -> hidden states
            positions = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
            x = self.drop(self.wte(x) + self.wpe(positions))
        for block in self.h:
            x = block(x)  # causal self-attention: no mask needed without padding
        return self.lm_head(self.ln_f(x)) if self.lm_head is not None else x


def gpt2_stages(model: GPT2Logits, blocks_per_stage: Sequence[int]) -> list[GPT2Stage]:
    """``model`` cut into ``len(blocks_per_stage)`` :class:`GPT2Stage` modules, stage s taking the
    next ``blocks_per_stage[s]`` blocks (every block once, in order)."""
    total = len(model.model.transformer.h)
    if sum(blocks_per_stage) != total or any(n < 0 for n in blocks_per_stage) or not blocks_per_stage:
        raise ValueError(f"blocks_per_stage {list(blocks_per_stage)} must share the model's {total} blocks among "
                         "the stages")
    stages, start = [], 0
    for s, n in enumerate(blocks_per_stage):
        stages.append(GPT2Stage(model, range(start, start + n), s == 0, s == len(blocks_per_stage) - 1))
        start += n
    return stages
