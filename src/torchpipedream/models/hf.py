"""A small GPT-2 from Hugging Face ``transformers`` (random weights, nothing downloaded), for
``torchpipedream train --model gpt2`` and the examples: a model nobody here wrote, with its
input embedding and output layer tied, that torch.fx cannot trace (torch.export does).

``transformers`` is an optional dependency (``pip install 'torchpipedream[hf]'``); importing
this module does not need it, building the model does.
"""

from __future__ import annotations

import torch
from torch import nn

from .language import VOCAB_SIZE

__all__ = ["gpt2", "GPT2Logits", "TRANSFORMERS_VERSION"]

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
