"""Architectures none of us wrote, tiny and randomly initialised, for the real-world sweep.

Each case is ``name -> build()``; ``build`` returns ``(model, make_loss)`` where ``make_loss()`` runs one
forward pass and returns the loss a user would call ``backward()`` on. Hugging Face ``transformers``
models are built from small configs (no download); the torch.nn ones need nothing extra.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

__all__ = ["TORCH_CASES", "HF_CASES", "have_transformers"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

_B, _T, _V = 2, 8, 100
_SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
              vocab_size=_V, max_position_embeddings=64)


def have_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _ids():
    return torch.randint(0, _V, (_B, _T))


def _hf(cls_name, config_name, loss="labels", **config):
    def build():
        import transformers
        cfg = getattr(transformers, config_name)(**config)
        model = getattr(transformers, cls_name)(cfg).train()
        ids = _ids()

        def make_loss():
            if loss == "labels":
                return model(input_ids=ids, labels=ids).loss
            if loss == "class":
                return model(input_ids=ids, labels=torch.tensor([0, 1])).loss
            if loss == "hidden":  # a base model: the pooler is legitimately unused by this loss
                return model(input_ids=ids).last_hidden_state.pow(2).mean()
            raise ValueError(loss)
        return model, make_loss
    return build


def _vit():
    import transformers
    cfg = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=2, intermediate_size=64)
    model = transformers.ViTModel(cfg).train()
    pixels = torch.randn(_B, 3, 32, 32)
    return model, lambda: model(pixel_values=pixels).last_hidden_state.pow(2).mean()


_DEC = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=64, vocab_size=_V, max_position_embeddings=64)

HF_CASES = {
    "BertModel (loss on hidden states)": _hf("BertModel", "BertConfig", "hidden", **_SMALL),
    "BertForSequenceClassification": _hf("BertForSequenceClassification", "BertConfig", "class", **_SMALL),
    "RobertaForMaskedLM": _hf("RobertaForMaskedLM", "RobertaConfig", **{**_SMALL, "pad_token_id": 1}),
    "DistilBertForSequenceClassification": _hf(
        "DistilBertForSequenceClassification", "DistilBertConfig", "class", dim=32, n_layers=2, n_heads=2,
        hidden_dim=64, vocab_size=_V, max_position_embeddings=64),
    "GPT2LMHeadModel": _hf("GPT2LMHeadModel", "GPT2Config", n_embd=32, n_layer=2, n_head=2, vocab_size=_V,
                           n_positions=64),
    "T5ForConditionalGeneration": _hf("T5ForConditionalGeneration", "T5Config", d_model=32, d_kv=16,
                                      d_ff=64, num_layers=2, num_heads=2, vocab_size=_V,
                                      decoder_start_token_id=0, pad_token_id=0),
    "BartForConditionalGeneration": _hf(
        "BartForConditionalGeneration", "BartConfig", d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        vocab_size=_V, max_position_embeddings=64),
    "ViTModel (loss on hidden states)": _vit,
    "LlamaForCausalLM": _hf("LlamaForCausalLM", "LlamaConfig", **_DEC),
    "MistralForCausalLM": _hf("MistralForCausalLM", "MistralConfig", **_DEC),
}


def _transformer():
    model = nn.Transformer(d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                           dim_feedforward=64, batch_first=True).train()
    src, tgt = torch.randn(_B, _T, 32), torch.randn(_B, 5, 32)
    mask = nn.Transformer.generate_square_subsequent_mask(5)
    return model, lambda: model(src, tgt, tgt_mask=mask).pow(2).mean()


def _rnn(cls):
    def build():
        model = cls(16, 32, num_layers=2, batch_first=True)
        x = torch.randn(_B, _T, 16)
        return model, lambda: model(x)[0][:, -1].pow(2).mean()
    return build


def _mha():
    model = nn.MultiheadAttention(32, 4, batch_first=True)
    q, kv = torch.randn(_B, 5, 32), torch.randn(_B, _T, 32)

    def make_loss():
        out, weights = model(q, kv, kv, need_weights=True)
        return out.pow(2).mean() + weights.var()
    return model, make_loss


def _lstm_classifier():
    # Only the last layer's output feeds the head; an unused projection is a real unused parameter.
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(_V, 16)
            self.rnn = nn.LSTM(16, 32, batch_first=True, bidirectional=True)
            self.head = nn.Linear(64, 3)
            self.aux = nn.Linear(64, 3)   # never called

        def forward(self, ids):
            return self.head(self.rnn(self.emb(ids))[0].mean(1))
    model = Net()
    ids = _ids()
    return model, lambda: nn.functional.cross_entropy(model(ids), torch.tensor([0, 2]))


TORCH_CASES = {
    "nn.Transformer": _transformer,
    "nn.LSTM (2 layers)": _rnn(nn.LSTM),
    "nn.GRU (2 layers)": _rnn(nn.GRU),
    "nn.MultiheadAttention": _mha,
    "LSTM classifier with an unused head": _lstm_classifier,
}
