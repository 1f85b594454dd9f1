"""The page rule on every model the project sweeps: is each default drawing legible?

For every model of the sweep (tests/_sweep_models.py), the render gallery (tests/_render_models.py), the
vision models written by hand with torchvision's layouts (tests/_fold_models.py: ResNet-18/34/50,
DenseNet-121-like, Inception-v3-like) and the trace bench's vision models (bench/_vision.py), plain and
traced: ``report.render("x.svg")`` with the defaults, its size in pt read from the SVG, and the rule of
docs/pictures.md checked on it (longer side <= 3,000 pt, aspect <= 4:1, every finding's text >= 10 px
when the page is fit to a 1,600 px wide window). Only public API is used, so the same script measures
an older checkout (``PYTHONPATH=<checkout> python bench/page_sweep.py``).

Target (exit 1 when missed): every default drawing within the rule.

Usage::

    python bench/page_sweep.py [--models resnet50,inception] [--skip-slow]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(1, HERE)

import torch  # noqa: E402

import gradscope  # noqa: E402

SVG = "{http://www.w3.org/2000/svg}"
SLOW = ("gpt2-small-12", "transformer-96", "chain-10k", "swin-t (HF Swin)")


def _models() -> dict:
    from _vision import VISION

    from tests._fold_models import RESNETS, DenseNet, InceptionV3, ResNet, loss_of
    from tests._render_models import GALLERY
    from tests._sweep_models import HF_CASES, TORCH_CASES, have_transformers

    out: dict = {}
    cases = dict(TORCH_CASES, **(HF_CASES if have_transformers() else {}))
    for name, build in cases.items():
        out[name] = lambda build=build: _call(build)
    for name, build in GALLERY.items():
        out[name] = lambda build=build: build(False)
    for name, kw in RESNETS.items():
        out[f"{name} (torchvision layout)"] = lambda kw=kw: _own(ResNet(**kw), loss_of)
    out["densenet121-like"] = lambda: _own(DenseNet(), loss_of)
    out["inception-v3-like"] = lambda: _own(InceptionV3(), lambda m: loss_of(m, size=75))
    for name, build in VISION.items():
        out[name] = lambda build=build: _call(build)
    return out


def _call(build):
    model, forward = build()
    return forward(), model


def _own(model, loss_of):
    return loss_of(model), model


def rule(path: str) -> tuple[float, float, str | None]:
    """``(width, height, why not)`` of the SVG at ``path``; ``why not`` is None within the rule."""
    root = ET.parse(path).getroot()
    w, h = (float(root.get(k).removesuffix("pt")) for k in ("width", "height"))
    if max(w, h) > 3000:
        return w, h, "longer side over 3,000 pt"
    if max(w, h) > 4 * min(w, h):
        return w, h, f"aspect {max(w, h) / min(w, h):.1f}"
    scale = min(1.0, 1600 / (w * 4 / 3))
    for g in root.iter(f"{SVG}g"):
        if "gs-finding" in g.get("class", ""):
            for t in g.iter(f"{SVG}text"):
                if float(t.get("font-size")) * 4 / 3 * scale < 10:
                    return w, h, "finding text under 10 px"
    return w, h, None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=None, help="comma-separated names (default: all)")
    ap.add_argument("--skip-slow", action="store_true", help=f"leave out {', '.join(SLOW)}")
    args = ap.parse_args()
    models = _models()
    names = args.models.split(",") if args.models else list(models)
    if args.skip_slow:
        names = [n for n in names if n not in SLOW]
    print("| model | nodes | plain (pt) | traced (pt) |\n|---|---|---|---|")
    bad = total = 0
    tmp = tempfile.mkdtemp()
    for name in names:
        cells, nodes = [], 0
        for traced in (False, True):
            torch.manual_seed(0)
            if traced:
                with gradscope.trace() as tr:
                    loss, model = models[name]()
                report = gradscope.inspect(loss, model=model, trace=tr)
            else:
                loss, model = models[name]()
                report = gradscope.inspect(loss, model=model)
            nodes = report.graph.number_of_nodes()
            w, h, why = rule(report.render(os.path.join(tmp, "x.svg")))
            total += 1
            bad += why is not None
            cells.append(f"{w:,.0f} x {h:,.0f}" + (f" **{why}**" if why else ""))
        print(f"| {name} | {nodes:,} | {cells[0]} | {cells[1]} |", flush=True)
    print(f"\n{total - bad} of {total} default drawings within the rule ({len(names)} models, plain and traced).")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
