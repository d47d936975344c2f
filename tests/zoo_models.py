"""The model zoo of tests/test_model_zoo.py: models nobody here wrote, built from tiny configs with
random weights (nothing downloaded), with dropout off so one process can reproduce them.

Each entry is a module-level factory (``verify`` sends it to worker processes) and a function
giving minibatches as the model takes them: a dict of keyword arguments with ``labels`` (the
Hugging Face models compute their own loss), or ``(inputs, targets)`` with a ``loss_fn``.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB = 64


def gpt2() -> nn.Module:
    """GPT-2 language model head: input embedding and output layer share one matrix."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                      bos_token_id=0, eos_token_id=0))


def llama() -> nn.Module:
    """A Llama-shaped causal LM (grouped-query attention, SwiGLU MLP, RMSNorm, rotary positions),
    output layer not tied to the input embedding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        tie_word_embeddings=False, use_cache=False, attention_dropout=0.0))


def bert() -> nn.Module:
    """BERT for sequence classification: attention mask, token type ids, labels -> loss."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    return BertForSequenceClassification(BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=32, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        classifier_dropout=0.0, problem_type="single_label_classification"))


def resnet() -> nn.Module:
    """ResNet for image classification: BatchNorm, in-place ReLU after a cut."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    return ResNetForImageClassification(ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                                     num_labels=10))


def mobilenet() -> nn.Module:
    """MobileNetV2: depthwise convolutions, BatchNorm, ReLU6."""
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    torch.manual_seed(0)
    # 64x64 inputs: at 32x32 its last BatchNorms normalise a 1x1 map over a microbatch of 4
    # samples, where a change in the last bit of an input moves the gradient by 1e-5 (measured:
    # one process on 1 thread against 2); at 64x64 by 1e-7.
    return MobileNetV2ForImageClassification(MobileNetV2Config(image_size=64, num_labels=10, depth_multiplier=0.35,
                                                               classifier_dropout_prob=0.0))


def vit() -> nn.Module:
    """Vision transformer: patch embedding, class token, position embeddings."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    return ViTForImageClassification(ViTConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
                                               num_attention_heads=2, intermediate_size=64, num_labels=10,
                                               hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def t5() -> nn.Module:
    """T5 encoder-decoder: one embedding matrix shared by the encoder, the decoder and the output
    layer (three uses), labels -> loss."""
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                               num_decoder_layers=1, num_heads=2, dropout_rate=0.0, use_cache=False,
                                               decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
                                               tie_word_embeddings=True))


class MaskedMean(nn.Module):
    """A model of our own with keyword arguments: an optional mask, a keyword-only scale, and a
    dict output."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, *, scale: float = 1.0) -> dict:
        h = torch.relu(self.embed(x))
        h = torch.tanh(self.mix(h)) * scale
        if mask is not None:
            h = h * mask.unsqueeze(-1)
        return {"logits": self.head(h.mean(dim=1))}


def masked_mean() -> nn.Module:
    torch.manual_seed(0)
    return MaskedMean()


def logits_loss(output: dict, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output["logits"], target)


def batches(name: str, n: int, size: int = 8) -> list:
    """``n`` minibatches of ``size`` samples for zoo model ``name``."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        if name in ("gpt2", "llama"):
            ids = torch.randint(0, VOCAB, (size, 12), generator=g)
            out.append({"input_ids": ids, "labels": ids})
        elif name == "t5":
            ids = torch.randint(2, VOCAB, (size, 8), generator=g)
            out.append({"input_ids": ids, "attention_mask": torch.ones(size, 8, dtype=torch.long),
                        "labels": torch.randint(2, VOCAB, (size, 6), generator=g)})
        elif name == "bert":
            ids = torch.randint(0, VOCAB, (size, 10), generator=g)
            mask = (torch.arange(10) < torch.randint(4, 11, (size, 1), generator=g)).long()
            out.append({"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 3, (size,), generator=g)})
        elif name in ("resnet", "mobilenet"):
            side = 64 if name == "mobilenet" else 32
            out.append({"pixel_values": torch.randn(size, 3, side, side, generator=g),
                        "labels": torch.randint(0, 10, (size,), generator=g)})
        elif name == "vit":
            out.append({"pixel_values": torch.randn(size, 3, 16, 16, generator=g),
                        "labels": torch.randint(0, 10, (size,), generator=g)})
        elif name == "masked_mean":
            mask = (torch.arange(5) < torch.randint(2, 6, (size, 1), generator=g)).float()
            out.append(({"x": torch.randn(size, 5, 6, generator=g), "mask": mask, "scale": 0.5},
                        torch.randint(0, 3, (size,), generator=g)))
        else:
            raise KeyError(name)
    return out


FACTORIES = {"gpt2": gpt2, "bert": bert, "t5": t5, "resnet": resnet, "mobilenet": mobilenet, "vit": vit,
             "masked_mean": masked_mean}
LOSSES = {"masked_mean": logits_loss}


# ----------------------------------------------------------------------------- the paper's families
# Issue 37 (item 4): models of the families PipeDream and PipeDream-2BW train (tests/test_paper_models.py),
# written here with torch.nn only, tiny, dropout off: ``paper_model(name)`` builds one, ``paper_batches``
# gives its ``(inputs, target)`` minibatches for ``lm_loss``.
PAPER_VOCAB = 50


class TiedLSTMLM(nn.Module):
    """AWD-LM-like: an embedding, three single-layer LSTMs (``h, _ = rnn(h)``: the state unused)
    and a decoder whose weight is the embedding's."""

    def __init__(self, dim: int = 24) -> None:
        super().__init__()
        self.embed = nn.Embedding(PAPER_VOCAB, dim)
        self.rnn1 = nn.LSTM(dim, dim, batch_first=True)
        self.rnn2 = nn.LSTM(dim, dim, batch_first=True)
        self.rnn3 = nn.LSTM(dim, dim, batch_first=True)
        self.decoder = nn.Linear(dim, PAPER_VOCAB)
        self.decoder.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h, _ = self.rnn1(h)
        h, _ = self.rnn2(h)
        h, _ = self.rnn3(h)
        return self.decoder(h)


class Seq2SeqAttention(nn.Module):
    """GNMT-like: an LSTM encoder over the source, an LSTM decoder over the target started from the
    encoder's final ``(h, c)``, dot-product attention of the decoder's outputs over the encoder's,
    and a layer to the vocabulary. ``forward(src, tgt)``."""

    def __init__(self, dim: int = 24) -> None:
        super().__init__()
        self.src_embed = nn.Embedding(PAPER_VOCAB, dim)
        self.encoder1 = nn.LSTM(dim, dim, batch_first=True)
        self.encoder2 = nn.LSTM(dim, dim, batch_first=True)
        self.tgt_embed = nn.Embedding(PAPER_VOCAB, dim)
        self.decoder = nn.LSTM(dim, dim, batch_first=True)
        self.query = nn.Linear(dim, dim)
        self.out = nn.Linear(2 * dim, PAPER_VOCAB)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        enc, _ = self.encoder1(self.src_embed(src))
        enc, state = self.encoder2(enc)
        dec, _ = self.decoder(self.tgt_embed(tgt), state)
        scores = torch.bmm(self.query(dec), enc.transpose(1, 2))
        context = torch.bmm(torch.softmax(scores, dim=-1), enc)
        return self.out(torch.cat([dec, context], dim=-1))


class EncoderLM(nn.Module):
    """A causal language model on ``nn.TransformerEncoder`` (``nn.MultiheadAttention`` inside):
    token and position embeddings, two layers, an output layer."""

    def __init__(self, dim: int = 32, context: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(PAPER_VOCAB, dim)
        self.pos = nn.Parameter(0.1 * torch.randn(context, dim))
        layer = nn.TransformerEncoderLayer(dim, nhead=2, dim_feedforward=64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, PAPER_VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) + self.pos
        h = self.encoder(h, mask=self.mask)
        return self.head(self.norm(h))


def paper_model(name: str) -> nn.Module:
    """Paper model ``name`` (``PAPER_MODELS``), built after ``torch.manual_seed(0)``: the same
    weights in every process."""
    torch.manual_seed(0)
    return PAPER_MODELS[name]()


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy over every token."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def paper_batches(name: str, n: int, size: int = 8) -> list:
    """``n`` minibatches ``(inputs, target)`` of ``size`` samples for paper model ``name``: for
    gnmt ``((src, tgt_in), tgt_out)``, sources of 10 tokens, targets of 8."""
    g = torch.Generator().manual_seed(2)
    out = []
    for _ in range(n):
        if name == "gnmt":
            src = torch.randint(0, PAPER_VOCAB, (size, 10), generator=g)
            tgt = torch.randint(0, PAPER_VOCAB, (size, 9), generator=g)
            out.append(((src, tgt[:, :-1]), tgt[:, 1:]))
        elif name in ("awd_lm", "encoder_lm"):
            ids = torch.randint(0, PAPER_VOCAB, (size, 13), generator=g)
            out.append((ids[:, :-1], ids[:, 1:]))
        else:
            raise KeyError(name)
    return out


PAPER_MODELS = {"awd_lm": TiedLSTMLM, "gnmt": Seq2SeqAttention, "encoder_lm": EncoderLM}
