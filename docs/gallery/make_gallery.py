"""Regenerate the gallery: the default drawing of each gallery model, as render() writes it.

    PYTHONPATH=. python docs/gallery/make_gallery.py [NAME ...]

Models come from tests/_render_models.py (random weights, small shapes), recorded with gradscope.trace()
so clusters carry module names. Pictures marked "planted" have one in-place hazard planted in a middle
layer (backward() would raise): the drawing keeps that layer open down to the hazard's node.
"""

from __future__ import annotations

import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import gradscope  # noqa: E402
from tests._render_models import GALLERY  # noqa: E402

#: file stem -> (gallery model, planted)
PICTURES = {
    "gpt2": ("gpt2", True),
    "gpt2-small-12": ("gpt2-small-12", False),
    "bert": ("bert", False),
    "t5": ("t5", False),
    "vit": ("vit", False),
    "resnet18": ("resnet18", False),
    "resnet18-planted": ("resnet18", True),
    "lstm-200": ("lstm-200", True),
    "transformer-96": ("transformer-96", True),
}


def main(names) -> None:
    for stem in names or PICTURES:
        model_name, planted = PICTURES[stem]
        with gradscope.trace() as tr:
            loss, model = GALLERY[model_name](planted)
        report = gradscope.inspect(loss, model=model, trace=tr)
        t0 = time.perf_counter()
        path = report.render(os.path.join(HERE, f"{stem}.svg"))
        with open(path, encoding="utf-8") as f:
            head = f.read(600)
        size = head[head.index("<svg width="):].split("\n")[0]
        print(f"{stem}: {report.graph.number_of_nodes()} nodes -> {path} ({size.strip()}), "
              f"{time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
