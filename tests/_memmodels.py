"""Tiny models for the backward-memory tests and bench: ``MODELS[name]() -> (model, inputs, loss_fn)``.

``loss_fn(model, *inputs)`` runs the forward and returns the scalar loss (dropping any other output, so
that the graph is what the step keeps). Inputs are created outside the forward, like a batch the
training loop holds. Everything is seeded by the caller.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

from tests._zoo import Linears
from tests.fuzz._vocab import MulF

__all__ = ["MODELS", "HF_MODELS", "BasicBlock", "ReentrantStack"]


def _mse(model, x):
    return model(x).pow(2).mean()


def _xent(model, x, y):
    return F.cross_entropy(model(x), y)


def mlp():
    m = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 10))
    return m, (torch.randn(32, 64), torch.randint(0, 10, (32,))), _xent


def mlp_norm_dropout():
    m = nn.Sequential(nn.Linear(48, 96), nn.LayerNorm(96), nn.Dropout(0.1), nn.SiLU(), nn.Linear(96, 48),
                      nn.Tanh(), nn.Linear(48, 4))
    return m, (torch.randn(16, 48),), _mse


class BasicBlock(nn.Module):
    """A ResNet basic block without downsampling: ReLU in place, the residual added in place (``out += x``)."""

    def __init__(self, c, inplace=True):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.relu = nn.ReLU(inplace=inplace)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += x
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, c=8, blocks=2, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU(inplace=True))
        self.layers = nn.Sequential(*[BasicBlock(c) for _ in range(blocks)])
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        return self.head(self.layers(self.stem(x)).mean((2, 3)))


def resnet():
    return ResNet(), (torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))), _xent


def cnn_inplace():
    return nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), BasicBlock(6), nn.Flatten(), nn.Linear(6 * 12 * 12, 5)), \
        (torch.randn(2, 3, 12, 12), torch.randint(0, 5, (2,))), _xent


class _ConvNeXtBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c)
        self.pw1 = nn.Linear(c, 4 * c)
        self.pw2 = nn.Linear(4 * c, c)
        self.gamma = nn.Parameter(torch.full((c,), 1e-2))

    def forward(self, x):
        y = self.dw(x).permute(0, 2, 3, 1)
        y = self.pw2(F.gelu(self.pw1(self.norm(y)))) * self.gamma
        return x + y.permute(0, 3, 1, 2)


def convnext():
    m = nn.Sequential(nn.Conv2d(3, 16, 4, stride=4), _ConvNeXtBlock(16), _ConvNeXtBlock(16),
                      nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    return m, (torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))), _xent


class _RNN(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.rnn = cell(16, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 50)

    def forward(self, tok):
        out, _ = self.rnn(self.emb(tok))
        return self.head(out).flatten(0, 1)


def _lm(model, tok, y):
    return F.cross_entropy(model(tok), y.flatten())


def lstm():
    return _RNN(nn.LSTM), (torch.randint(0, 50, (4, 12)), torch.randint(0, 50, (4, 12))), _lm


def gru():
    return _RNN(nn.GRU), (torch.randint(0, 50, (4, 12)), torch.randint(0, 50, (4, 12))), _lm


class _Shared(Linears):
    LAYERS = {"inp": (32, 64), "shared": (64, 64), "out": (64, 1)}

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for _ in range(3):
            h = torch.relu(self.shared(h)) + h
        return self.out(h)


def weight_sharing():
    return _Shared(), (torch.randn(16, 32),), _mse


class _Ckpt(nn.Module):
    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
                                    for _ in range(3))
        self.head = nn.Linear(64, 1)

    def forward(self, x):
        for b in self.blocks:
            x = x + checkpoint(b, x, use_reentrant=self.reentrant)
        return self.head(x)


def checkpoint_nonreentrant():
    return _Ckpt(False), (torch.randn(16, 64),), _mse


def checkpoint_reentrant():
    x = torch.randn(16, 64, requires_grad=True)
    return _Ckpt(True), (x,), _mse


class ReentrantStack(nn.Module):
    """``blocks`` one after another, each in a reentrant checkpoint, then ``head``."""

    def __init__(self, blocks, head):
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = head

    def forward(self, x):
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=True)
        return self.head(x)


def checkpoint_reentrant_chain():
    """Reentrant checkpoints one after another (no residual), on a 3-d input: ``F.linear``'s views, ``mm``
    without bias, activations saving their result (ReLU, Tanh) or their input (SiLU), a frozen layer."""
    blocks = [nn.Sequential(nn.Linear(32, 96), nn.ReLU(), nn.Linear(96, 64, bias=False), nn.SiLU(),
                            nn.Sequential(nn.Linear(64, 32), nn.Tanh()))
              for _ in range(2)]
    blocks[1][2].weight.requires_grad_(False)
    return ReentrantStack(blocks, nn.Linear(32, 1)), (torch.randn(4, 6, 32, requires_grad=True),), _mse


class _Scale(MulF):
    """``a * w`` with ``w`` broadcast over the batch: its gradient is summed back to ``w``'s shape."""

    @staticmethod
    def backward(ctx, g):
        a, w = ctx.saved_tensors
        return g * w, (g * a).sum(0)


class _Custom(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)
        self.w = nn.Parameter(torch.ones(32))
        self.out = nn.Linear(32, 3)

    def forward(self, x):
        return self.out(_Scale.apply(torch.relu(self.lin(x)), self.w))


def custom_function():
    return _Custom(), (torch.randn(8, 32),), _mse


class _GLU(Linears):
    LAYERS = {"proj": (24, 64), "out": (32, 24)}

    def forward(self, x):
        a, b = self.proj(x).chunk(2, dim=-1)
        h = a * torch.sigmoid(b)
        c, d = torch.split(h, [12, 20], dim=-1)
        return self.out(torch.cat([d, c], -1)) + x


def glu_split():
    return nn.Sequential(_GLU(), _GLU()), (torch.randn(8, 24),), _mse


class _GPT(nn.Module):
    def __init__(self, d=32, heads=4, layers=2, vocab=64):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(16, d))
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(nn.ModuleDict(dict(ln1=nn.LayerNorm(d), qkv=nn.Linear(d, 3 * d),
                                                  proj=nn.Linear(d, d), ln2=nn.LayerNorm(d),
                                                  fc=nn.Linear(d, 4 * d), out=nn.Linear(4 * d, d))))
        self.lnf = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tok):
        b, t = tok.shape
        x = self.emb(tok) + self.pos[:t]
        for blk in self.blocks:
            q, k, v = blk.qkv(blk.ln1(x)).split(x.shape[-1], dim=-1)
            q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + blk.proj(y.transpose(1, 2).reshape(b, t, -1))
            x = x + blk.out(F.gelu(blk.fc(blk.ln2(x))))
        return self.head(self.lnf(x)).flatten(0, 1)


def gpt_sdpa():
    return _GPT(), (torch.randint(0, 64, (2, 16)), torch.randint(0, 64, (2, 16))), _lm


def transformer_encoder():
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    m = nn.Sequential(nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(32, 3))
    return m, (torch.randn(2, 10, 32),), _mse


def conv1d_pool():
    m = nn.Sequential(nn.Conv1d(4, 16, 5, padding=2), nn.BatchNorm1d(16), nn.ReLU(), nn.MaxPool1d(2),
                      nn.Conv1d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveMaxPool1d(1), nn.Flatten(),
                      nn.Linear(16, 3))
    return m, (torch.randn(4, 4, 32), torch.randint(0, 3, (4,))), _xent


def embedding_bag():
    m = nn.Sequential(nn.Embedding(100, 24), nn.Dropout(0.0))
    head = nn.Linear(24, 2)
    model = nn.ModuleDict(dict(emb=m, head=head))

    def loss(model, tok, y):
        return F.cross_entropy(model["head"](model["emb"](tok).mean(1)), y)
    return model, (torch.randint(0, 100, (8, 20)), torch.randint(0, 2, (8,))), loss


# -- HF transformers, random weights, tiny configs ------------------------------------------------------
def _hf_lm(model, tok):
    return model(input_ids=tok, labels=tok).loss


def _hf(config_name, model_name, **kw):
    def build():
        import transformers

        cfg = getattr(transformers, config_name)(**kw)
        if hasattr(cfg, "_attn_implementation"):
            cfg._attn_implementation = "eager" if kw.pop("_eager", False) else "sdpa"
        m = getattr(transformers, model_name)(cfg)
        m.train()
        return m, (torch.randint(0, 64, (2, 12)),), _hf_lm
    return build


def _t5():
    import transformers

    cfg = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                decoder_start_token_id=0, dropout_rate=0.0)
    m = transformers.T5ForConditionalGeneration(cfg)

    def loss(model, src, tgt):
        return model(input_ids=src, labels=tgt).loss
    return m, (torch.randint(0, 64, (2, 10)), torch.randint(0, 64, (2, 8))), loss


def _vit():
    import transformers

    cfg = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                                 num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                                 num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    m = transformers.ViTForImageClassification(cfg)

    def loss(model, px, y):
        return model(pixel_values=px, labels=y).loss
    return m, (torch.randn(2, 3, 16, 16), torch.randint(0, 5, (2,))), loss


def _bert():
    import transformers

    cfg = transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, num_labels=3)
    m = transformers.BertForSequenceClassification(cfg)

    def loss(model, tok, y):
        return model(input_ids=tok, labels=y).loss
    return m, (torch.randint(0, 64, (2, 12)), torch.randint(0, 3, (2,))), loss


_TINY = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=32)
HF_MODELS = {
    "hf_gpt2": _hf("GPT2Config", "GPT2LMHeadModel", vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=32,
                   resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "hf_bert": _bert,
    "hf_t5": _t5,
    "hf_llama": _hf("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=2, **_TINY),
    "hf_vit": _vit,
}

MODELS = {
    "mlp": mlp, "mlp_norm_dropout": mlp_norm_dropout, "resnet": resnet, "cnn_inplace": cnn_inplace,
    "convnext": convnext, "lstm": lstm, "gru": gru, "weight_sharing": weight_sharing,
    "checkpoint_nonreentrant": checkpoint_nonreentrant, "checkpoint_reentrant": checkpoint_reentrant,
    "checkpoint_reentrant_chain": checkpoint_reentrant_chain,
    "custom_function": custom_function, "glu_split": glu_split, "gpt_sdpa": gpt_sdpa,
    "transformer_encoder": transformer_encoder, "conv1d_pool": conv1d_pool, "embedding_bag": embedding_bag,
    **HF_MODELS,
}
