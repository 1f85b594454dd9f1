"""A plan in the user's idiom: contiguous ranges instead of lists with holes, a Hugging Face model's own
checkpointing switch, and a word when the peak sits at the loss.

- ``contiguous``: when the planner chose ``k`` numbered siblings with holes (``blocks.3``, ``blocks.5``,
  ``blocks.8``), the ``k`` consecutive ones starting at the first (or ending at the last) are replayed; when
  that fits and recomputes no more (within 1%), the plan names the range (``blocks[3:6]``).
- ``hf_switch``: a model traced with ``model=`` a Hugging Face ``PreTrainedModel`` records its
  ``GradientCheckpointingLayer`` modules (``graph.graph[HF_CHECKPOINTING]``); a plan that checkpoints
  exactly those is ``model.gradient_checkpointing_enable()`` (``activation_checkpointing_enable()`` in
  transformers releases that renamed it), which wraps every such layer in
  ``checkpoint(use_reentrant=False)``. A plan inside those layers that all of them would match (fit, no more
  recompute within 1%: attention and MLP of every block, say) becomes the switch (``prefer_switch``); when
  the plan is a cheaper part of them and all of them also fit, the plan says so, with that option's
  replayed peak and recompute.
- ``loss_note``: when the step's peak is at the loss's backward (``LogSoftmaxBackward0`` of a cross-entropy
  over a large vocabulary), checkpointing cannot lower it: the gradient of the logits is made there at
  once. The note names the op and its line, the size of one logits-shaped tensor, and says a chunked loss
  (the loss over slices of the tokens) would remove more than the plan's checkpointing saves.
"""

from __future__ import annotations

import re

from gradscope._format import human_bytes, shape_str
from gradscope.graph import HF_CHECKPOINTING
from gradscope.memory.replay.engine import numel_bytes

__all__ = ["contiguous", "prefer_switch", "hf_switch", "switch_note", "loss_note", "LOSS_OPS", "numbered"]

#: Backward ops of a classification / language-model loss where the gradient of the logits is made.
LOSS_OPS = frozenset({"LogSoftmaxBackward0", "NllLossBackward0", "NllLoss2DBackward0", "SoftmaxBackward0"})
_NUMBERED = re.compile(r"^(?P<head>.*?)\.(?P<i>\d+)(?P<tail>(?:\.[^.\d][^.]*)*)$")


def numbered(name: str) -> tuple[str, int, str] | None:
    """``"transformer.h.3.mlp.act" -> ("transformer.h", 3, ".mlp.act")`` (the last numbered component);
    None for a name without one."""
    m = _NUMBERED.match(name)
    return (m["head"], int(m["i"]), m["tail"]) if m else None


def contiguous(chosen: list[str], off: list[str], best, peak_of, target: int, modules: set[str]):
    """``(checkpoint, WhatIf)``: ``chosen`` with each group of numbered siblings that has holes replaced by
    consecutive siblings, when that fits ``target`` and recomputes no more than 1% over ``best``."""
    groups: dict[tuple[str, str], list[int]] = {}
    for name in chosen:
        key = numbered(name)
        if key is not None:
            groups.setdefault((key[0], key[2]), []).append(key[1])
    for (head, tail), idx in groups.items():
        idx = sorted(idx)
        k = len(idx)
        if k < 2 or idx[-1] - idx[0] + 1 == k:
            continue
        for start in dict.fromkeys((idx[0], idx[-1] - k + 1)):
            window = [f"{head}.{i}{tail}" for i in range(start, start + k)]
            if not all(w in modules for w in window):
                continue
            trial_names = [c for c in chosen if c not in {f"{head}.{i}{tail}" for i in idx}] + window
            trial = peak_of(trial_names, off)
            if trial.peak <= target and trial.recompute_flops <= best.recompute_flops * 1.01:
                chosen, best = trial_names, trial
                break
    return chosen, best


def _switch_call(info: dict) -> str:
    if info["method"] == "activation_checkpointing_enable":
        return "model.activation_checkpointing_enable()"
    return 'model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})'


def hf_switch(graph, checkpoint: list[str]) -> str | None:
    """The code of a Hugging Face model's own switch when ``checkpoint`` is exactly its checkpointing
    layers, else None."""
    info = graph.graph.get(HF_CHECKPOINTING)
    if not info or not checkpoint or set(checkpoint) != set(info["layers"]):
        return None
    alias = "" if info["method"] == "gradient_checkpointing_enable" else "; gradient_checkpointing_enable() before"
    return "\n".join(
        [
            f"{_switch_call(info)}  # all {len(info['layers'])} layers, checkpoint(use_reentrant=False){alias}",
            "model.train()  # the layers checkpoint in training mode only",
        ]
    )


def _inside_layers(info: dict, checkpoint: list[str]) -> bool:
    return all(any(c == lay or c.startswith(lay + ".") for lay in info["layers"]) for c in checkpoint)


def prefer_switch(graph, chosen: list[str], off: list[str], best, peak_of, target: int):
    """``(checkpoint, WhatIf)``: a Hugging Face model's checkpointing layers instead of ``chosen`` when
    ``chosen`` lies inside them and all of them fit ``target`` for no more recompute (within 1%): what the
    plan then amounts to is the model's own switch."""
    info = graph.graph.get(HF_CHECKPOINTING)
    if not info or not chosen or set(chosen) == set(info["layers"]) or not _inside_layers(info, chosen):
        return chosen, best
    every = peak_of(list(info["layers"]), off)
    if every.peak <= target and every.recompute_flops <= best.recompute_flops * 1.01:
        return list(info["layers"]), every
    return chosen, best


def switch_note(graph, checkpoint: list[str], off: list[str], peak_of, limit: int, plan_flops: int) -> str | None:
    """When ``checkpoint`` lies inside a Hugging Face model's checkpointing layers without being all of them
    and all of them fit ``limit`` too: one sentence with that option's replayed peak and recompute."""
    info = graph.graph.get(HF_CHECKPOINTING)
    if not info or not checkpoint or set(checkpoint) == set(info["layers"]):
        return None
    layers = info["layers"]
    if not _inside_layers(info, checkpoint):
        return None
    every = peak_of(layers, off)
    if every.peak > limit:
        return None
    share = every.recompute_share
    return (
        f"The model's own switch, {_switch_call(info)}, checkpoints all {len(layers)} layers: predicted peak "
        f"{human_bytes(every.peak)} (fits), recompute +{share:.0%} forward FLOPs (this plan: "
        f"+{plan_flops / every.forward_flops if every.forward_flops else 0:.0%})."
    )


def loss_note(graph, memory, saved_by_plan: int, fits: bool) -> str | None:
    """One sentence when the unchanged step's peak is at the loss's backward and a chunked loss would remove
    more than the plan's checkpointing saves (``saved_by_plan``), else None."""
    peak = memory.peak_node
    if peak is None or (memory.step is not None and memory.end + memory.step.peak >= memory.peak):
        return None  # no backward peak, or the step's peak is in optimizer.step()
    node = graph.nodes[peak] if peak in graph else {}
    if node.get("name") not in LOSS_OPS:
        return None
    shapes, dtypes = node.get("out_shapes") or [None], node.get("out_dtypes") or ["float32"]
    one = numel_bytes(shapes[0], dtypes[0]) if shapes[0] else 0
    freed = 3 * one  # the saved log-probabilities, and at the peak the gradients of them and of the logits
    if one == 0 or (fits and freed <= saved_by_plan):
        return None
    where = f" ({node['location']})" if node.get("location") else ""
    return (
        f"The peak is at the loss: {node['name']}{where}, where backward makes the gradient of the "
        f"{shape_str(shapes[0])} logits at once ({human_bytes(one)} per logits-shaped tensor; three are alive "
        f"there, {human_bytes(freed)}); checkpointing cannot lower it, and a chunked cross-entropy (the loss "
        f"computed over slices of the tokens, one slice's logits alive at a time) would remove more than this "
        f"plan's checkpointing saves ({human_bytes(max(saved_by_plan, 0))})."
    )
