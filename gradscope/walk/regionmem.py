"""What a ``torch.compile`` region's backward allocates and frees, read from its AOT backward graph as plain
steps for the replay (NOTE [compiled region memory]).

NOTE [compiled region memory] (docs/memory.md#compiled-regions)
A ``CompiledFunctionBackward`` node runs one FX graph, the region's backward, with the generated code's
own liveness: the prologue moves the saved tensors out of the node (``ctx.maybe_clear_saved_tensors()``)
into one argument list that the boxed graph empties, and the graph's code drops each value after its last
use (``x = None``). So each FX node is one step: it allocates the storages of its ``meta["val"]`` that no
earlier value has (a view, ``detach``, ``_unsafe_view`` or ``getitem`` shares its input's fake storage and
allocates nothing), then the values whose last use it was are dropped; a storage goes with its last value:
an intermediate is freed, a saved tensor's reference is released (freed when nothing else holds it), and
so is an incoming gradient: torch 2.13 hands the compiled backward its gradients as one list that the
prologue clears (``flat_args.clear()``), so the engine no longer holds them. What the graph returns is the
node's output gradients. An incoming gradient whose layout is not the traced one (``sum()``'s expanded
gradient) is first copied to a dense tensor by the prologue (``process_runtime_tangent``), and one that
never arrives (an output no gradient reaches: HF GPT-2's past key/values) is materialized as zeros
(``aten::empty`` per tangent, measured); either is held by the argument list and freed at the tangent's
last use: the ``tangents`` (``[bytes, shape, dtype]``, the j-th tangent taken as the node's j-th incoming
gradient) and, per step, the tangents whose last use it was (memory/replay/steps.py ``run_steps``).

A graph traced with symbolic sizes (``dynamic=True``) has values of the traced example's sizes: it is
re-run on fake tensors in a copy, with this run's sizes (``node.symints``, what the prologue passes first)
bound to its size placeholders. The steps are read once per graph (and per run's sizes) and mapped to each
node's saved storages.

The steps are plain data, kept in the node's ``attrs["region_steps"]`` as ``{"steps", "tangents"}``: per
FX node that allocates or frees, ``[allocs, frees, releases, call, tangents]``, ``allocs`` as ``[bytes,
shape, dtype]`` and ``call`` the aten call as ``[op, args, kwargs, tensor specs, outputs]`` for measuring
the kernel's own workspace (memory/kernels/fxops.py), or None. The replay's sub-program hook
(``run_steps`` in memory/replay/steps.py) runs them in place when the engine reaches the node.

Inductor (``"fused": true``) runs the same graph as fused kernels that keep fewer intermediates and reuse
buffers: replayed op by op, the region's peak is then an upper bound of what its generated code keeps (its
saved tensors and returned gradients, what the engine sees, are the same).
"""

from __future__ import annotations

import weakref

import torch

from gradscope._torch import fake_tensor_mode, forward_cls, input_metadata, storage_key_and_bytes
from gradscope.walk.compiled import compiled_region
from gradscope.walk.values import dtype_str

__all__ = ["region_steps", "STEPS", "UNREAD"]

#: The node attribute holding the steps, and the one saying why there are none.
STEPS = "region_steps"
UNREAD = "region_unread"


def _tensors(val) -> list:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [t for v in val for t in _tensors(v)]
    return []


#: backward graph -> {shape key: (steps with releases as saved-tensor positions, tangents)}: a training loop's
#: next step inspects a new node of the same region, whose graph is the same object (nothing is read twice).
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def region_steps(node, saved_storages: list) -> dict:
    """``{STEPS: [...]}`` for a compiled region's node, or ``{UNREAD: why}``.

    ``saved_storages``: per entry of the node's ``saved_tensors``, its storage id as the walk numbered it
    (None for a slot the walk does not hold).
    """
    got = compiled_region(node)
    if isinstance(got, str):
        return {UNREAD: got}
    gm = got[1]
    try:
        memo = _CACHE.get(gm)
        if memo is None:
            memo = _CACHE[gm] = {"redo": not _has_values(gm.graph) or _symbolic(gm.graph)}
        redo = memo["redo"]
        key = (_shape_key(node) if redo else None, len(saved_storages))
        done = memo.get(key)
        if done is None:
            if redo:
                gm = _propagate(gm, node)
                if isinstance(gm, str):
                    return {UNREAD: gm}
            done = memo[key] = _steps(gm.graph, len(saved_storages))
        template, tangents = done
        steps = [
            [a, f, [saved_storages[j] for j in r if j < len(saved_storages) and saved_storages[j] is not None], c, d]
            for a, f, r, c, d in template
        ]
        return {STEPS: {"steps": steps, "tangents": tangents, "fused": compiled_by_inductor(node)}}
    except Exception as exc:  # noqa: BLE001 - a graph this reader does not know: say so, never guess
        return {UNREAD: f"its backward graph could not be read ({type(exc).__name__}: {exc})"}


def _shape_key(node) -> tuple:
    """What a propagated graph's values depend on: this run's sizes, the saved tensors' layouts."""
    syms = getattr(node, "symints", None)
    return (
        tuple(syms) if isinstance(syms, (list, tuple)) else None,
        tuple((tuple(t.shape), tuple(t.stride()), t.dtype) for t in node.saved_tensors),
        tuple(tuple(m.shape) for m in input_metadata(node)),
    )


def compiled_by_inductor(node) -> bool:
    """Whether inductor lowered a compiled region (``_forward_cls.compiled_fw`` is its ``CompiledFxGraph``;
    ``aot_eager`` keeps a plain function): its backward runs fused kernels. docs/internals.md#compiled-region-memory."""
    fw = getattr(forward_cls(node), "compiled_fw", None)
    return type(fw).__module__.startswith("torch._inductor")


def _has_values(graph) -> bool:
    return all(n.op == "output" or "val" in n.meta for n in graph.nodes)


def _symbolic(graph) -> bool:
    """Whether the graph was traced with symbolic sizes (``dynamic=True``, or a size dynamo marked dynamic on a
    recompile): its values' sizes are then the traced example's, not this run's."""
    for n in graph.nodes:
        if n.op != "placeholder":
            break
        v = n.meta.get("val")
        if isinstance(v, torch.SymInt) or (isinstance(v, torch.Tensor) and not all(type(d) is int for d in v.shape)):
            return True
    return False


def _propagate(gm, node):
    """A copy of the backward graph whose ``meta["val"]`` are this run's fake tensors: the graph run on fake
    copies of the node's saved tensors, one dense gradient per forward output and, for a graph traced with
    symbolic sizes, the sizes this run's forward bound them to (``node.symints``, what the prologue hands the
    graph first). Needed for a graph without values (one torch's compile cache rebuilt from its code) and
    for one traced with symbolic sizes (its values carry the traced example's). torch's own graph is left as
    it is (the copy's nodes get new ``meta`` dicts); nothing real runs. A sentence when it cannot be done."""
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    mode, _ = fake_tensor_mode()
    phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
    saved = node.saved_tensors
    meta = input_metadata(node)
    syms = getattr(node, "symints", None)  # set by AOTAutograd's forward on the node (its ctx)
    syms = [int(s) for s in syms] if isinstance(syms, (list, tuple)) and all(isinstance(s, int) for s in syms) else []
    if mode is None or len(phs) != len(syms) + len(saved) + len(meta):
        return "its backward graph (rebuilt by torch's compile cache, or traced with symbolic sizes) carries no shapes"
    graph = torch.fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    copy = torch.fx.GraphModule(gm, graph)
    mode.allow_non_fake_inputs = True  # the graph's constants (a 0-d tensor) are real
    with torch.no_grad(), mode:
        fakes = [mode.from_tensor(t) for t in saved]
        fakes += [torch.empty(tuple(m.shape), dtype=m.dtype, device=m.device) for m in meta]
        FakeTensorProp(copy, mode).propagate_dont_convert_inputs(*syms, *fakes)
    return copy


def _call(n):
    """``[op, args, kwargs, tensor specs, number of outputs]`` of an aten call (tensors as ``{"t": "s",
    "k": i}`` into the specs ``[name, shape, stride, dtype]``), or None for a call that cannot be run alone
    (not an aten operator, a symbolic size)."""
    target = n.target
    if not isinstance(target, torch._ops.OpOverload):
        return None
    specs: list = []

    def enc(a):
        if isinstance(a, torch.fx.Node):
            t = a.meta.get("val")
            if type(t) is int:  # a size the graph computes (sym_size): this run's value
                return t
            if not isinstance(t, torch.Tensor):
                raise ValueError("not a tensor")
            specs.append(
                [f"hidden[{len(specs)}]", [int(x) for x in t.shape], [int(x) for x in t.stride()], dtype_str(t.dtype)]
            )
            return {"t": "s", "k": len(specs) - 1}
        if isinstance(a, (list, tuple)):
            return [enc(x) for x in a]
        if isinstance(a, torch.dtype):
            return {"dtype": dtype_str(a)}
        if isinstance(a, torch.device):
            return {"device": str(a)}
        if isinstance(a, (torch.memory_format, torch.layout)):
            return {"f": str(a).removeprefix("torch.")}
        if a is None or isinstance(a, (bool, int, float, str)):
            return a
        raise ValueError(f"argument {type(a).__name__}")

    try:
        args = enc(list(n.args))
        kwargs = {k: enc(v) for k, v in n.kwargs.items()}
    except ValueError:
        return None
    val = n.meta.get("val")
    return [str(target), args, kwargs, specs, len(val) if isinstance(val, (list, tuple)) else 1]


def _steps(graph, n_saved: int) -> tuple[list, list]:
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    out_node = next(n for n in reversed(nodes) if n.op == "output")
    held = {storage_key_and_bytes(t)[0] for a in out_node.all_input_nodes for t in _tensors(a.meta.get("val"))}
    held_nodes = set(out_node.all_input_nodes)
    last = {}
    for n in nodes:
        users = [pos[u] for u in n.users if u.op != "output"]
        last[n] = max(users) if users else pos[n]
    dies: dict = {}
    for n in nodes:
        if n.op != "output" and n not in held_nodes:
            dies.setdefault(last[n], []).append(n)
    storage: dict = {}  # fake storage key -> [live values, kind, ref] (kind: "t" temp alloc id, "s" saved, "g")
    of_node: dict = {}
    n_tensor_ph = 0
    steps: list = []
    tangents: list = []
    n_alloc = 0
    for i, n in enumerate(nodes):
        if n.op == "output":
            break
        keys = []
        allocs = []
        for t in _tensors(n.meta.get("val")):
            key, nbytes = storage_key_and_bytes(t)
            if key in keys:
                continue
            keys.append(key)
            rec = storage.get(key)
            if rec is None:
                if n.op == "placeholder":
                    j = n_tensor_ph
                    if j < n_saved:
                        rec = storage[key] = [0, "s", j]
                    else:
                        rec = storage[key] = [0, "g", len(tangents)]
                        tangents.append([int(nbytes), list(t.shape), dtype_str(t.dtype)])
                elif n.op != "call_function":  # a constant of the graph (get_attr): there before, kept
                    rec = storage[key] = [0, "c", None]
                else:
                    rec = storage[key] = [0, "t", n_alloc]
                    allocs.append([int(nbytes), list(t.shape), dtype_str(t.dtype)])
                    n_alloc += 1
            rec[0] += 1
        if n.op == "placeholder" and _tensors(n.meta.get("val")):
            n_tensor_ph += 1
        of_node[n] = keys
        frees, releases, dead = [], [], []
        for d in dies.get(i, ()):
            for key in of_node.get(d, ()):
                rec = storage[key]
                rec[0] -= 1
                if rec[0] == 0 and key not in held:
                    if rec[1] == "t":
                        frees.append(rec[2])
                    elif rec[1] == "s":
                        releases.append(rec[2])
                    elif rec[1] == "g":
                        dead.append(rec[2])
        if allocs or frees or releases or dead:
            steps.append([allocs, frees, releases, _call(n) if allocs else None, dead])
    return steps, tangents
