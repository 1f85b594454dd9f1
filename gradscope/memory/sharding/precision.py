"""FSDP2's mixed precision in the replay's terms: the traced step with its forward in ``param_dtype``.

NOTE [FSDP2 mixed precision]
With ``MixedPrecisionPolicy(param_dtype=...)`` FSDP2 keeps each shard in the parameter's own dtype and
casts it before the all-gather (one flat copy of the group's padded shards in ``param_dtype``), so the
all-gather output and the unsharded parameters are in ``param_dtype``; the root's pre-forward casts the
forward's floating inputs (``cast_forward_inputs``). The forward then runs on those parameters: every
floating tensor the model computes is in ``param_dtype``, and so are the gradients autograd makes for
them, the unsharded parameters' included. The post-backward copies the unsharded gradients into a flat
reduce-scatter input in ``reduce_dtype`` (``param_dtype`` when None; torch treats a ``reduce_dtype`` equal
to ``param_dtype`` as None), one padded chunk of each gradient cast at a time when the dtypes differ;
the output, a padded shard in ``reduce_dtype``, is cast to the parameter's dtype when it differs and
becomes the sharded ``.grad``. The optimizer steps the shards in their own dtype
(docs/internals.md#fsdp2-mixed-precision).

A report traced with the parameters in their own dtype (``float32``) does not show which tensors the
model casts on purpose: ``x.to(torch.float32)`` of a float32 tensor is the tensor itself and makes no node.
So the step is replayed with every floating tensor of the parameters' dtype that the graph saves or sends
as a gradient in ``param_dtype`` (:func:`in_param_dtype`). A model that computes some of its forward in
float32 on purpose (RMSNorm's ``hidden_states.to(torch.float32)``, a loss on ``logits.float()``) holds
more than this during its backward; the prediction says so in its notes.
"""

from __future__ import annotations

from dataclasses import replace

from gradscope.graph import PARAMS
from gradscope.memory.replay.dtypes import DTYPE_BYTES
from gradscope.memory.replay.engine import node_dtype

__all__ = ["in_param_dtype", "cast_ratio", "params_dtype"]


def params_dtype(graph) -> str:
    """The parameters' own dtype (FSDP2 wants one per group; the first parameter's), ``float32`` without one."""
    return next((str(p["dtype"]) for p in graph.graph.get(PARAMS, {}).values() if p.get("dtype")), "float32")


def cast_ratio(orig: str, to: str) -> float:
    """Bytes per element of ``to`` over those of ``orig``."""
    return DTYPE_BYTES.get(to, 4) / DTYPE_BYTES.get(orig, 4)


def _saved_dtypes(graph) -> dict:
    """Storage key (as the compiled program names it) -> dtype of the first slot that saved it."""
    out: dict = {}
    for nid, d in graph.nodes(data=True):
        for j, e in enumerate(d.get("saved") or ()):
            sid = e.get("storage")
            key = ("s", sid) if sid is not None else ("e", nid, j)
            if e.get("dtype") and key not in out:
                out[key] = str(e["dtype"])
    return out


def in_param_dtype(prog, graph, param_dtype: str, orig: str = "float32"):
    """A copy of the compiled program ``prog`` whose activations and gradients of dtype ``orig`` are in
    ``param_dtype`` (NOTE [FSDP2 mixed precision]); the parameters and what the user holds keep their size."""
    k = cast_ratio(orig, param_dtype)
    if k == 1:
        return prog
    dtypes = _saved_dtypes(graph)
    params = {("s", p["storage"]) for p in graph.graph.get(PARAMS, {}).values() if p.get("storage") is not None}

    storages = {}
    held = {}  # an input the rank holds (external): FSDP2 casts a copy, which the graph saves instead
    for key, n in prog.storages.items():
        if key in params or dtypes.get(key) != orig:
            storages[key] = n
        elif key in prog.external:
            storages[key] = n
            held[key] = ("c", key)
            storages[held[key]] = int(n * k)
        else:
            storages[key] = int(n * k)
    saved = [tuple(held.get(key, key) for key in keys) for keys in prog.saved] if held else prog.saved
    recompute = {v: [(key, storages.get(key, n)) for key, n in entries] for v, entries in prog.recompute.items()}
    nodes = graph.nodes
    grad_bytes = []
    for v, sizes in enumerate(prog.grad_bytes):
        d = nodes[prog.ids[v]] if prog.ids[v] in nodes else {}
        dts = d.get("out_dtypes") or []
        out = []
        for j, n in enumerate(sizes):
            dt = d.get("dtype") if prog.leaf[v] else (dts[j] if j < len(dts) else node_dtype(d))
            out.append(int(n * k) if (dt or "float32") == orig else n)
        grad_bytes.append(out)
    return replace(prog, saved=saved, storages=storages, recompute=recompute, grad_bytes=grad_bytes)
