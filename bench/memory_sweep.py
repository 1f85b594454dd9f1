"""Backward peak on architectures none of us wrote, against torch.profiler: how many within 1%.

Each model (HF ``transformers`` tiny configs with random weights, the project's sweep and bench models,
hand-built vision blocks: ConvNeXt-like depthwise channels-last, MobileNet-like, DenseNet-like) runs one
training step under ``torch.profiler`` (tests/_memtruth.py); ``report.backward_memory()`` (custom
Functions on fake tensors, the default; ``GRADSCOPE_SWEEP_REAL_CUSTOM=1``: ``run_custom=True``) is taken
inside that step, its in-node memory measured before (cache in a fresh temporary folder). A model
counts as a miss when its peak is more than 1% off; a low miss whose nodes are all listed in
``bm.unmodelled`` is "listed" (the output says the peak is a lower bound).

    python bench/memory_sweep.py                # every model; exit 1 when under 99% within 1%
    python bench/memory_sweep.py convnext t5    # models whose name contains a word
    PYTHONPATH=<another checkout> python bench/memory_sweep.py   # the same sweep on other code (before/after)
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

os.environ.setdefault("GRADSCOPE_CACHE", tempfile.mkdtemp(prefix="gs-sweep-"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import gradscope  # noqa: E402
from tests._memmodels import MODELS  # noqa: E402
from tests._memtruth import measure  # noqa: E402
from tests._sweep_models import HF_CASES, TORCH_CASES  # noqa: E402

_B, _T, _V = 2, 8, 100
_H = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=_V,
          max_position_embeddings=64)  # fmt: skip
_DEC = dict(_H, num_key_value_heads=1)


def _hf(cls, cfg, kind="lm", **kw):
    def build():
        import transformers

        model = getattr(transformers, cls)(getattr(transformers, cfg)(**kw)).train()
        ids = torch.randint(1, _V, (_B, _T))
        if kind == "lm":
            return model, lambda: model(input_ids=ids, labels=ids).loss
        if kind == "hidden":
            return model, lambda: model(input_ids=ids).last_hidden_state.pow(2).mean()
        if kind == "pixels":
            px = torch.randn(_B, kw.get("num_channels", 3), kw.get("image_size", 32), kw.get("image_size", 32))
            return model, lambda: model(pixel_values=px, labels=torch.tensor([0, 1])).loss
        if kind == "whisper":
            feats = torch.randn(_B, kw["num_mel_bins"], 2 * kw["max_source_positions"])
            return model, lambda: model(input_features=feats, labels=ids).loss
        raise ValueError(kind)

    return build


_S2S = dict(d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
            encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=_V, max_position_embeddings=64)  # fmt: skip
_VIS = dict(image_size=32, num_labels=2)

HF_MORE = {
    "OPTForCausalLM": _hf("OPTForCausalLM", "OPTConfig", hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          ffn_dim=64, vocab_size=_V, max_position_embeddings=64, word_embed_proj_dim=32),
    "BloomForCausalLM": _hf("BloomForCausalLM", "BloomConfig", hidden_size=32, n_layer=2, n_head=2, vocab_size=_V),
    "GPTNeoXForCausalLM": _hf("GPTNeoXForCausalLM", "GPTNeoXConfig", **_H),
    "Qwen2ForCausalLM": _hf("Qwen2ForCausalLM", "Qwen2Config", **_DEC),
    "GemmaForCausalLM": _hf("GemmaForCausalLM", "GemmaConfig", head_dim=16, **_DEC),
    "PhiForCausalLM": _hf("PhiForCausalLM", "PhiConfig", **_H),
    "FalconForCausalLM": _hf("FalconForCausalLM", "FalconConfig", hidden_size=32, num_hidden_layers=2,
                             num_attention_heads=2, vocab_size=_V),
    "MixtralForCausalLM (MoE)": _hf("MixtralForCausalLM", "MixtralConfig", num_local_experts=4,
                                    num_experts_per_tok=2, **_DEC),
    "GPTNeoForCausalLM": _hf("GPTNeoForCausalLM", "GPTNeoConfig", hidden_size=32, num_layers=2, num_heads=2,
                             attention_types=[[["global", "local"], 1]], vocab_size=_V, max_position_embeddings=64),
    "CodeGenForCausalLM": _hf("CodeGenForCausalLM", "CodeGenConfig", n_embd=32, n_layer=2, n_head=2, vocab_size=_V,
                              n_positions=64, rotary_dim=8),
    "AlbertForMaskedLM": _hf("AlbertForMaskedLM", "AlbertConfig", embedding_size=16, **_H),
    "ElectraForMaskedLM": _hf("ElectraForMaskedLM", "ElectraConfig", embedding_size=16, **_H),
    "DebertaV2ForMaskedLM": _hf("DebertaV2ForMaskedLM", "DebertaV2Config", **_H),
    "XLMRobertaForMaskedLM": _hf("XLMRobertaForMaskedLM", "XLMRobertaConfig", pad_token_id=1, **_H),
    "T5 (hidden)": _hf("T5EncoderModel", "T5Config", "hidden", d_model=32, d_kv=16, d_ff=64, num_layers=2,
                       num_heads=2, vocab_size=_V),
    "MBartForConditionalGeneration": _hf("MBartForConditionalGeneration", "MBartConfig", **_S2S),
    "PegasusForConditionalGeneration": _hf("PegasusForConditionalGeneration", "PegasusConfig", **_S2S),
    "MarianMTModel": _hf("MarianMTModel", "MarianConfig", decoder_vocab_size=_V, pad_token_id=0,
                           decoder_start_token_id=0, **_S2S),
    "WhisperForConditionalGeneration": _hf("WhisperForConditionalGeneration", "WhisperConfig", "whisper",
                                           pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
                                           num_mel_bins=8, max_source_positions=16, max_target_positions=16,
                                           **{k: v for k, v in _S2S.items() if k != "max_position_embeddings"}),
    "ConvNextForImageClassification": _hf("ConvNextForImageClassification", "ConvNextConfig", "pixels",
                                          hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, **_VIS),
    "ConvNextV2ForImageClassification": _hf("ConvNextV2ForImageClassification", "ConvNextV2Config", "pixels",
                                            hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, **_VIS),
    "SwinForImageClassification": _hf("SwinForImageClassification", "SwinConfig", "pixels", patch_size=4,
                                      embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4, **_VIS),
    "Swinv2ForImageClassification": _hf("Swinv2ForImageClassification", "Swinv2Config", "pixels", patch_size=4,
                                        embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4, **_VIS),
    "ResNetForImageClassification": _hf("ResNetForImageClassification", "ResNetConfig", "pixels",
                                        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], **_VIS),
    "RegNetForImageClassification": _hf("RegNetForImageClassification", "RegNetConfig", "pixels",
                                        embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], groups_width=8,
                                        **_VIS),
    "MobileNetV2ForImageClassification": _hf("MobileNetV2ForImageClassification", "MobileNetV2Config", "pixels",
                                             depth_multiplier=0.25, **_VIS),
    "EfficientNetForImageClassification": _hf("EfficientNetForImageClassification", "EfficientNetConfig",
                                              "pixels", width_coefficient=0.1, depth_coefficient=0.1,
                                              hidden_dim=128, **_VIS),  # round_filters(1280) at width 0.1
    "ViTForImageClassification": _hf("ViTForImageClassification", "ViTConfig", "pixels", patch_size=8, **_H,
                                     **_VIS),
    "DeiTForImageClassification": _hf("DeiTForImageClassification", "DeiTConfig", "pixels", patch_size=8, **_H,
                                      **_VIS),
    "PvtV2ForImageClassification": _hf("PvtV2ForImageClassification", "PvtV2Config", "pixels",
                                       hidden_sizes=[16, 32], depths=[1, 1], num_encoder_blocks=2,
                                       num_attention_heads=[1, 2], sr_ratios=[2, 1], mlp_ratios=[2, 2],
                                       patch_sizes=[7, 3], strides=[4, 2], **_VIS),
}


def _edgenext_like():
    """An EdgeNeXt/ConvNeXt-like stage built by hand: depthwise conv on a channels-last activation."""

    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.dw, self.ln = nn.Conv2d(c, c, 7, padding=3, groups=c), nn.LayerNorm(c)
            self.fc1, self.fc2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)

        def forward(self, x):
            y = self.dw(x).permute(0, 2, 3, 1)
            return x + self.fc2(nn.functional.gelu(self.fc1(self.ln(y)))).permute(0, 3, 1, 2)

    m = nn.Sequential(nn.Conv2d(3, 24, 4, stride=4), Block(24), Block(24)).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 64, 64).to(memory_format=torch.channels_last)
    return m, lambda: m(x).pow(2).mean()


def _densenet_like():
    class Dense(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(
                nn.Sequential(nn.BatchNorm2d(8 + 4 * i), nn.ReLU(), nn.Conv2d(8 + 4 * i, 4, 3, padding=1))
                for i in range(4)
            )

        def forward(self, x):
            for layer in self.layers:
                x = torch.cat([x, layer(x)], 1)
            return x

    m, x = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), Dense()), torch.randn(2, 3, 16, 16)
    return m, lambda: m(x).pow(2).mean()


HAND = {"EdgeNeXt-like (depthwise, channels-last)": _edgenext_like, "DenseNet-like (cat)": _densenet_like}


def _mem_case(name):
    def build():
        model, inputs, loss_fn = MODELS[name]()
        return model, lambda: loss_fn(model, *inputs)

    return build


def cases() -> dict:
    out = {f"bench: {n}": _mem_case(n) for n in MODELS}
    out.update({f"sweep: {n}": b for n, b in {**TORCH_CASES, **HF_CASES}.items()})
    out.update({f"hf: {n}": b for n, b in HF_MORE.items()})
    out.update({f"hand: {n}": b for n, b in HAND.items()})
    return out


def run(name: str, build) -> dict:
    torch.manual_seed(0)
    model, make_loss = build()
    real = os.environ.get("GRADSCOPE_SWEEP_REAL_CUSTOM") == "1"  # custom Functions on real tensors
    kw = {"run_custom": True} if real and "run_custom" in gradscope.Report.backward_memory.__code__.co_varnames else {}
    gradscope.inspect(make_loss(), model=model).backward_memory(**kw)  # measured outside the profiled step
    t0 = time.perf_counter()
    truth = measure(lambda: (make_loss(), model), inspect=lambda loss, m: gradscope.inspect(loss, model=m),
                    predict=lambda r, _: r.backward_memory(**kw))  # fmt: skip
    bm = truth.prediction
    err = (bm.peak - truth.peak) / max(truth.peak, 1)
    listed = bool(getattr(bm, "unmodelled", None))
    return {"err": err, "pred": bm.peak, "truth": truth.peak, "listed": listed, "s": time.perf_counter() - t0}


def main(argv: list) -> int:
    every = cases()
    names = [n for n in every if not argv or any(a.lower() in n.lower() for a in argv)]
    rows, skipped = [], []
    for name in names:
        try:
            rows.append((name, run(name, every[name])))
        except Exception as e:  # noqa: BLE001 - a config this transformers version refuses: said, not hidden
            skipped.append((name, f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"))
    print(f"{'model':<52} {'predicted':>11} {'profiler':>11} {'error':>8}")
    for name, r in rows:
        mark = "" if abs(r["err"]) <= 0.01 else ("  (listed: lower bound)" if r["listed"] else "  MISS")
        print(f"{name:<52} {r['pred']:>11,} {r['truth']:>11,} {r['err']:>+8.2%}{mark}")
    ok = sum(1 for _, r in rows if abs(r["err"]) <= 0.01)
    low = [n for n, r in rows if r["err"] < -0.01 and not r["listed"]]
    print(f"\nbackward peak within 1% of torch.profiler on {ok} of {len(rows)} models"
          f"; unlisted under-predictions beyond 1%: {len(low)}{' (' + ', '.join(low) + ')' if low else ''}")
    for name, why in skipped:
        print(f"skipped {name}: {why}")
    return 0 if rows and ok >= 0.99 * len(rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
