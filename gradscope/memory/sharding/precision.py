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

A float32 trace does not show which tensors the model casts on purpose: ``x.to(torch.float32)`` of a
float32 tensor is the tensor itself and makes no node. Traced with :func:`gradscope.trace`, the forward's
casts were followed as it ran (NOTE [dtype flow], ``graph.graph[DTYPE_FLOW]``): what each node saves and
which of its outputs are float32 in the lower-precision run. :func:`in_param_dtype` replays the step with
those in float32 and every other floating tensor of the parameters' dtype that the graph saves or sends as a
gradient in ``param_dtype``; a storage read both ways (RMSNorm's input: the residual stream in
``param_dtype``, its float32 copy saved by ``pow``) counts once per dtype; a storage that only float32
copies are saved of is no longer held by the graph (``Program.unheld`` keeps its size for a checkpoint frame
that takes it as input: NOTE [a requested checkpoint region]). Each node's in-node memory is measured with
the dtypes of that run (``_kept``, NOTE [node facts]). Saved slots that an op keeps in float32 by
itself count as float32 on every report (:data:`F32_SLOTS`, docs/internals.md#float32-saved-slots).
An untraced report has no casts to follow: every such tensor is taken as ``param_dtype``, and where the
model computes in float32 on purpose (RMSNorm, a loss on ``logits.float()``) the peak is a lower bound; the
prediction says so in its notes.
"""

from __future__ import annotations

from dataclasses import replace

from gradscope.graph import DTYPE_FLOW, PARAMS
from gradscope.memory.replay.dtypes import DTYPE_BYTES
from gradscope.memory.replay.engine import node_dtype

__all__ = ["in_param_dtype", "cast_ratio", "params_dtype", "follows_casts", "precision_note", "F32_SLOTS"]

#: Saved slots an op keeps in float32 whatever its inputs' dtype: scaled_dot_product_attention's
#: ``logsumexp`` (docs/internals.md#float32-saved-slots).
F32_SLOTS = frozenset({"logsumexp"})


def params_dtype(graph) -> str:
    """The parameters' own dtype (FSDP2 wants one per group; the first parameter's), ``float32`` without one."""
    return next((str(p["dtype"]) for p in graph.graph.get(PARAMS, {}).values() if p.get("dtype")), "float32")


def cast_ratio(orig: str, to: str) -> float:
    """Bytes per element of ``to`` over those of ``orig``."""
    return DTYPE_BYTES.get(to, 4) / DTYPE_BYTES.get(orig, 4)


def follows_casts(graph) -> bool:
    """Whether the report was traced, so that the forward's casts to float32 are known (NOTE [dtype flow])."""
    return DTYPE_FLOW in graph.graph


def _float32_reads(graph) -> dict:
    """Node id -> (storage ids it saves in float32, output indices in float32) in the lower-precision run."""
    flow = (graph.graph.get(DTYPE_FLOW) or {}).get("nodes") or {}
    out = {n: (set(e["saved"]), set(e["outputs"])) for n, e in flow.items()}
    for n, d in graph.nodes(data=True):
        for e in d.get("saved") or ():
            if e.get("slot") in F32_SLOTS and e.get("storage") is not None:
                out.setdefault(n, (set(), set()))[0].add(e["storage"])
    return out


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
    f32 = _float32_reads(graph)
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
    saved = []
    for v, keys in enumerate(prog.saved):
        up = f32.get(prog.ids[v], ((), ()))[0]
        row = []
        for key in keys:
            if key[0] == "s" and key[1] in up and dtypes.get(key) == orig and key not in params:
                row.append(("f32", key))  # NOTE [dtype flow]: this node reads it in float32
                storages[row[-1]] = prog.storages[key]
            else:
                row.append(held.get(key, key))
        saved.append(tuple(row))
    shapes = {**prog.shapes, **{k: prog.shapes.get(k[1]) for row in saved for k in row if k[0] == "f32"}}
    recompute = {v: [(key, storages.get(key, n)) for key, n in entries] for v, entries in prog.recompute.items()}
    nodes = graph.nodes
    grad_bytes = []
    for v, sizes in enumerate(prog.grad_bytes):
        d = nodes[prog.ids[v]] if prog.ids[v] in nodes else {}
        dts = d.get("out_dtypes") or []
        up = f32.get(prog.ids[v], ((), ()))[1]
        out = []
        for j, n in enumerate(sizes):
            dt = d.get("dtype") if prog.leaf[v] else (dts[j] if j < len(dts) else node_dtype(d))
            out.append(int(n * k) if (dt or "float32") == orig and j not in up else n)
        grad_bytes.append(out)
    used = {key for row in saved for key in row} | set(prog.external)
    used |= {key for entries in recompute.values() for key, _ in entries}
    unheld = {key: n for key, n in storages.items() if key not in used and key[0] in ("s", "e")}
    storages = {key: n for key, n in storages.items() if key not in unheld}
    out = replace(
        prog,
        saved=saved,
        storages=storages,
        shapes=shapes,
        recompute=recompute,
        grad_bytes=grad_bytes,
        unheld={**prog.unheld, **unheld},
        dtype_change=(orig, param_dtype, _kept(prog, graph, f32)),
    )
    return _with_casts(out, prog.grad_bytes, graph, k)


def _kept(prog, graph, f32: dict) -> dict:
    """Node index -> (saved slot positions, output indices) that stay float32 in the lower-precision run
    (NOTE [dtype flow]): the signatures its in-node memory is measured by read every other tensor of the
    traced dtype in ``param_dtype`` (``Program.dtype_change``, NOTE [node facts]), as the kernels of
    ``param_dtype`` allocate their own temporaries (a bfloat16 matmul on the CPU is not a float32 one)."""
    nodes, out = graph.nodes, {}
    for nid, (up_saved, up_out) in f32.items():
        v = prog.index.get(nid)
        if v is not None and nid in nodes:
            pos = {j for j, e in enumerate(nodes[nid].get("saved") or ()) if e.get("storage") in up_saved}
            out[v] = (frozenset(pos), frozenset(up_out))
    return out


def _with_casts(prog, full: list, graph, k: float):
    """``prog`` with the ``ToCopyBackward0`` node of each cast the traced forward made as a no-op (NOTE [dtype
    flow]): between the cast tensor's producer and the nodes that read it, receiving their gradient in the
    cast's dtype (``full``: the gradient bytes in float32) and sending it on in the producer's."""
    casts = (graph.graph.get(DTYPE_FLOW) or {}).get("casts") or ()
    if not casts:
        return prog
    names = ("ids", "name", "seq", "leaf", "edges", "needs", "grad_bytes", "grad_shapes", "saved", "module", "attrs")
    cols = {f: list(getattr(prog, f)) for f in names}
    opaque, index = list(prog.opaque), dict(prog.index)
    orig, to, kept = prog.dtype_change
    kept = dict(kept)
    for i, c in enumerate(casts):
        u, j = prog.index.get(c["of"]), c["output"]
        by = [prog.index[n] for n in c["by"] if n in prog.index]
        if u is None or not by or j >= len(full[u]):
            continue
        v = len(cols["ids"])
        for w in by:
            cols["edges"][w] = [(v, 0) if e == (u, j) else e for e in cols["edges"][w]]
        row = {
            "ids": f"{c['of']}:cast{i}",
            "name": "ToCopyBackward0",
            "seq": c["seq"] - 0.5,  # made by the cast: after the producer, before the first reader
            "leaf": False,
            "edges": [(u, j)],
            "needs": [0],
            "grad_bytes": [full[u][j] if c["to"] == "float32" else int(full[u][j] * k)],
            "grad_shapes": [prog.grad_shapes[u][j] if j < len(prog.grad_shapes[u]) else None],
            "saved": (),
            "module": prog.module[by[0]],
            "attrs": {"kind": "op", "name": "ToCopyBackward0"},
        }
        if c["to"] == "float32":
            kept[v] = (frozenset(), frozenset({0}))  # its output, read by the nodes after it, is float32
        for f in names:
            cols[f].append(row[f])
        index[row["ids"]] = v
        if opaque:
            opaque.append(False)
    return replace(prog, **cols, opaque=opaque, index=index, dtype_change=(orig, to, kept))


def precision_note(graph, param_dtype: str, orig: str) -> str:
    """What the replay in ``param_dtype`` assumed (NOTE [FSDP2 mixed precision], NOTE [dtype flow])."""
    if follows_casts(graph):
        return (
            f"the forward replayed in {param_dtype}, with what the traced forward casts to float32 (its "
            f".float() / .to(torch.float32) / dtype= and type promotion, followed by gradscope.trace) in float32"
        )
    return (
        f"the forward replayed in {param_dtype}: every {orig} activation and gradient of the step "
        f"taken as {param_dtype}; what the model computes in {orig} on purpose (an upcast that is a no-op "
        f"in a {orig} trace) is not seen, so where it is alive the peak is a lower bound (trace the forward "
        "again with this version's gradscope.trace() to follow its casts)"
    )
