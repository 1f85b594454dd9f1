"""Small models with planted bugs for the rendering tests (and their golden DOT files)."""

from __future__ import annotations

import torch
from torch import nn

from tests._fold_models import ResNet
from tests._zoo import Linears


class Planted(Linears):
    """Linear -> sigmoid -> Linear, with an in-place write on a saved activation and an unused layer."""

    LAYERS = {"a": (3, 4), "b": (4, 1), "unused": (2, 2)}

    def forward(self, x):
        h = torch.sigmoid(self.a(x))
        out = self.b(h)
        h.mul_(2)                      # SigmoidBackward0 saved h: backward() will raise
        return out.sum()


def planted():
    torch.manual_seed(0)
    model = Planted()
    return model(torch.randn(2, 3)), model


class Tied(nn.Module):
    """An embedding whose weight is reused by the output layer (a shared parameter), inside a block."""

    def __init__(self, vocab: int = 7, d: int = 4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.block = nn.Sequential(nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d))

    def forward(self, idx):
        h = self.block(self.emb(idx))
        return (h @ self.emb.weight.t()).logsumexp(-1).mean()


def tied():
    torch.manual_seed(0)
    model = Tied()
    return model(torch.tensor([[1, 2, 3]])), model


class LSTMish(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.LSTMCell(3, 5)
        self.head = nn.Linear(5, 1)


def lstm(steps: int = 200):
    torch.manual_seed(0)
    model = LSTMish()
    h = c = torch.zeros(1, 5)
    xs = torch.randn(steps, 1, 3)
    for t in range(steps):
        h, c = model.cell(xs[t], (h, c))
    return model.head(h).sum(), model


# -- the gallery (tests/views/test_render_gallery.py, bench/render_bench.py, docs/gallery/make_gallery.py) -------
# Each builder takes `planted` (plant one in-place hazard in a mid-depth module: exp(out) then mul_ on
# the saved result, so backward() raises) and returns (loss, model). Random weights, small shapes.

def _plant(model, name: str):
    """Plant an in-place hazard on the output of ``model.<name>``; return the hook handle."""
    def hook(module, inputs, out):
        y = torch.exp(out)                 # ExpBackward0 saves its result ...
        y.mul_(1.0)                        # ... which is then modified in place
        return y
    return model.get_submodule(name).register_forward_hook(hook)


def _hf(kind: str, layers: int, d: int = 32, heads: int = 2, vocab: int = 97):
    import transformers as tf

    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = tf.GPT2Config(n_layer=layers, n_embd=d, n_head=heads, vocab_size=vocab, n_positions=64)
        return tf.GPT2LMHeadModel(cfg), "gpt2"
    if kind == "bert":
        cfg = tf.BertConfig(num_hidden_layers=layers, hidden_size=d, num_attention_heads=heads,
                            intermediate_size=2 * d, vocab_size=vocab, max_position_embeddings=64)
        return tf.BertForMaskedLM(cfg), "bert"
    if kind == "t5":
        cfg = tf.T5Config(num_layers=layers, num_decoder_layers=layers, d_model=d, d_kv=d // heads,
                          decoder_start_token_id=0, pad_token_id=0,
                          num_heads=heads, d_ff=2 * d, vocab_size=vocab)
        return tf.T5ForConditionalGeneration(cfg), "t5"
    cfg = tf.ViTConfig(num_hidden_layers=layers, hidden_size=d, num_attention_heads=heads,
                       intermediate_size=2 * d, image_size=32, patch_size=8, num_labels=5)
    return tf.ViTForImageClassification(cfg), "vit"


_MID = {"gpt2": "transformer.h.{k}.mlp.c_fc", "bert": "bert.encoder.layer.{k}.intermediate.dense",
        "t5": "encoder.block.{k}.layer.1.DenseReluDense.wi", "vit": "vit.layers.{k}.mlp.fc1"}


def hf_model(kind: str, layers: int = 2, planted: bool = False, d: int = 32, heads: int = 2, model=None):
    model, kind = _hf(kind, layers, d, heads) if model is None else (model, kind)
    model.train()
    handle = _plant(model, _MID[kind].format(k=layers // 2)) if planted else None
    ids = torch.randint(0, 97, (2, 12))
    try:
        if kind == "vit":
            out = model(pixel_values=torch.randn(2, 3, 32, 32), labels=torch.tensor([1, 3]))
        elif kind == "t5":
            out = model(input_ids=ids, labels=torch.randint(0, 97, (2, 8)))
        else:
            out = model(input_ids=ids, labels=ids)
    finally:
        if handle is not None:
            handle.remove()
    return out.loss, model


def resnet18(planted: bool = False, model=None):
    torch.manual_seed(0)
    model = ResNet(width=64) if model is None else model  # torchvision.models.resnet18's layout and names
    handle = _plant(model, "layer3.0.conv2") if planted else None
    try:
        loss = nn.functional.cross_entropy(model(torch.randn(2, 3, 64, 64)), torch.tensor([1, 2]))
    finally:
        if handle is not None:
            handle.remove()
    return loss, model


def lstm_gallery(steps: int = 200, planted: bool = False, model=None):
    torch.manual_seed(0)
    model = LSTMish() if model is None else model
    h = c = torch.zeros(4, 5)
    xs = torch.randn(steps, 4, 3)
    for t in range(steps):
        h, c = model.cell(xs[t], (h, c))
        if planted and t == steps // 2:
            h = torch.exp(h)
            h.mul_(1.0)
    return model.head(h).sum(), model


class _Layer(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4):
        super().__init__()
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln1 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.ln2 = nn.LayerNorm(d)

    def forward(self, x):
        h = self.ln1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class DeepTransformer(nn.Module):
    def __init__(self, layers: int = 96, d: int = 32):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(d) for _ in range(layers))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).pow(2).mean()


def deep_transformer(layers: int = 96, planted: bool = False, model=None):
    torch.manual_seed(0)
    model = DeepTransformer(layers) if model is None else model
    handle = _plant(model, f"layers.{layers // 2}.mlp.0") if planted else None
    try:
        loss = model(torch.randn(2, 8, 32))
    finally:
        if handle is not None:
            handle.remove()
    return loss, model


class Chain(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(8))


def chain(n: int = 10_000, planted: bool = False, model=None):
    model = Chain() if model is None else model
    y = model.w * 1.0
    for i in range(n):
        y = y.sin() if i % 2 else y * 1.5
        if planted and i == n // 2:
            y = torch.exp(y)
            y.mul_(1.0)
    return y.sum(), model


#: name -> builder(planted, model=None) -> (loss, model); pass ``model`` to run the forward again on it.
GALLERY = {
    "gpt2": lambda planted, model=None: hf_model("gpt2", 2, planted, model=model),
    "gpt2-small-12": lambda planted, model=None: hf_model("gpt2", 12, planted, d=768, heads=12, model=model),
    "bert": lambda planted, model=None: hf_model("bert", 2, planted, model=model),
    "t5": lambda planted, model=None: hf_model("t5", 2, planted, model=model),
    "vit": lambda planted, model=None: hf_model("vit", 2, planted, model=model),
    "resnet18": lambda planted, model=None: resnet18(planted, model),
    "lstm-200": lambda planted, model=None: lstm_gallery(200, planted, model),
    "transformer-96": lambda planted, model=None: deep_transformer(96, planted, model),
    "chain-10k": lambda planted, model=None: chain(10_000, planted, model),
}
