"""What ``report.graph`` holds: the node kinds, the saved-slot states, the ``graph.graph`` keys (as constants)
and the TypedDicts of nodes, saved slots, edges, parameters and trace events.

Every reader (the checks, memory, the views, the saved-file validator in :mod:`gradscope.graph.validation`)
names a key through these, never as a literal; adding a field means adding it here first.
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

__all__ = [
    "NodeAttrs",
    "SavedEntry",
    "EdgeAttrs",
    "ParamInfo",
    "TraceEvent",
    "GraphAttrs",
    "NODE_KINDS",
    "STATUSES",
    "OP",
    "PARAM",
    "INPUT",
    "HELD",
    "LIVE",
    "STALE",
    "HOOKED",
    "OFFLOADED",
    "RECOMPUTED",
    "OPAQUE",
    "FREED",
    "ROOTS",
    "ROOT_SHAPES",
    "NO_GRAD_ROOTS",
    "STORAGE_BYTES",
    "PARAMS",
    "EVENTS",
    "CALLED_MODULES",
    "MODULE_CALLS",
    "EVENTS_DROPPED",
    "ROOT_STORAGE_BYTES",
    "EXTERNAL",
    "BUFFERS",
    "CHECKPOINT_PARAMS",
    "INPUT_STORAGES",
    "HF_CHECKPOINTING",
    "DTYPE_FLOW",
    "BATCH",
    "COMPILED_CUTS",
]

# -- node kinds ------------------------------------------------------------------------------------
OP = "op"  #: a backward node (``grad_fn``)
PARAM = "param"  #: an ``AccumulateGrad`` of a named parameter
INPUT = "input"  #: an ``AccumulateGrad`` of a leaf that is not a named parameter
#: Every node kind, in the order the schema lists them.
NODE_KINDS = (OP, PARAM, INPUT)

# -- saved-slot states (NOTE [saved slot states] in gradscope/walk/slots.py) -----------------------
LIVE, STALE, HOOKED = "live", "stale", "hooked"
OFFLOADED, RECOMPUTED, OPAQUE, FREED = "offloaded", "recomputed", "opaque", "freed"
#: Slot states whose bytes the graph holds on the tensor's device.
HELD = (LIVE, STALE, HOOKED)
#: Every saved-slot state the walk writes today (a newer walk may add more; readers keep unknown ones).
STATUSES = (LIVE, STALE, HOOKED, OFFLOADED, RECOMPUTED, OPAQUE, FREED)

# -- graph.graph keys ------------------------------------------------------------------------------
ROOTS = "roots"  #: list of root node ids, in the order the roots were given
ROOT_SHAPES = "root_shapes"  #: list of root shapes (lists of ints), parallel to ROOTS
NO_GRAD_ROOTS = "no_grad_roots"  #: indices of given roots that have no grad_fn (several roots only)
STORAGE_BYTES = "storage_bytes"  #: storage id -> whole-storage size in bytes (a list)
PARAMS = "params"  #: qualified name -> ParamInfo, every named parameter
EVENTS = "events"  #: list of TraceEvent (only with trace=)
CALLED_MODULES = "called_modules"  #: sorted names of the modules the traced forward called (trace=)
MODULE_CALLS = "module_calls"  #: traced: [name, parent, class, first seq, end seq] per call (NOTE [module calls])
EVENTS_DROPPED = "events_dropped"  #: how many events the trace did not keep (only when > 0)
ROOT_STORAGE_BYTES = "root_storage_bytes"  #: whole-storage bytes of each root (None: unknown), parallel to ROOTS
EXTERNAL = "external"  #: storage ids a holder outside the graph keeps alive (NOTE [holder counts])
BUFFERS = "buffers"  #: ``[storage id or None, bytes]`` per distinct buffer storage of model=
CHECKPOINT_PARAMS = "checkpoint_params"  #: traced: parameter -> seqs of the reentrant checkpoint regions using it
INPUT_STORAGES = "input_storages"  #: input leaf node id -> the storage id an op saved it under
#: traced: ``[storage key, bytes, shape, dtype, storage id or None]`` per distinct storage of the tensors
#: given to the outermost module calls that no op made and that need no gradient (the batch the caller
#: holds through the step); the storage id is the walk's when an op saved it (then it is an activation)
BATCH = "batch"
#: traced with a Hugging Face ``model=`` that supports gradient checkpointing: ``{"layers": [names of its
#: GradientCheckpointingLayer modules], "method": "activation_checkpointing_enable" or
#: "gradient_checkpointing_enable"}`` (plans say the model's own switch when they amount to it)
HF_CHECKPOINTING = "hf_checkpointing"
#: traced: what is float32 in a run whose parameters are in a lower precision (FSDP2's ``param_dtype``),
#: from the forward's explicit casts (NOTE [dtype flow]): ``{"nodes": {node id: {"saved": [storage ids
#: it saves in float32], "outputs": [its outputs in float32]}}, "casts": [{"of": node id, "output": nr,
#: "seq": the cast's sequence number, "to": "float32" or "param", "by": [node ids reading the cast]}]}``
DTYPE_FLOW = "dtype_flow"
#: the cuts inside ``torch.compile`` regions, one per region with dead inputs, shaped as a trace event:
#: ``{"kind": "compiled", "op": the region's function ("Net.forward"), "location": "file.py:LINE" of that
#: function (None: unknown), "params": [names below the dead edges], "seq": None}`` (walk/compiled.py)
COMPILED_CUTS = "compiled_cuts"


class SavedEntry(TypedDict, total=False):
    """One saved slot of a node (``node["saved"][i]``)."""

    slot: str  # the slot name, e.g. "self", "mat2", "result"
    shape: list[int] | None
    dtype: str | None  # "float32"
    device: str | None  # "cpu", "meta", ...; for offloaded: the device the tensor left
    nbytes: int  # the whole storage's size (untyped_storage().nbytes()), not the view's
    status: str  # one of the saved-slot states above
    storage: int | None  # storage id (an index into graph.graph["storage_bytes"]); None: unknown
    scalar: bool  # present (True) on a wrapped Python number (``x * 2``): not an activation
    stride: list[int]  # present only when the tensor is not contiguous (a transposed or channels-last view)
    version: int  # stale only: the tensor's version now (it was modified in place)
    saved_version: int | None  # stale only: the version backward expects (from torch's error text); None: unknown
    hidden_op: str  # a CopySlices node's stale hidden slot (``hidden[k]``), when torch's error names the node
    # that saved it ("SigmoidBackward0"): NOTE [CopySlices formula]
    recompute: dict[str, Any]  # recomputed (checkpoint) only, when the frame tells: {"region", "index", "shape",
    # "dtype", "nbytes", "frame_bytes"} of what backward's recompute re-creates


class NodeAttrs(TypedDict, total=False):
    """Attributes of every node (``report.graph.nodes[nid]``); leaves also carry shape/dtype/requires_grad."""

    kind: Literal["op", "param", "input"]
    name: str  # "AddmmBackward0", or the parameter's qualified name, or "input"
    saved: list[SavedEntry]
    saved_bytes: int  # bytes this node's held slots keep alive (its storages counted once)
    device: str | None
    module: str | None  # the owning module: from trace() on ops, from the qualified name on params
    location: str  # traced ops only, when known: the user's "file.py:LINE" that created the node
    root: bool
    opaque: bool  # a node whose saved values cannot be read (checkpoint, compiled)
    seq: int | None  # autograd sequence number (forward creation order); None on leaves
    attrs: dict[str, Any]  # non-tensor saved values (dims, sizes, flags) as plain data
    out_shapes: list[list[int] | None]  # None: an output with no one shape (a nested tensor)
    out_dtypes: list[str]  # ops: the dtype of each output, parallel to out_shapes
    function: str  # custom autograd.Function: "module.QualName"
    shape: list[int] | None  # leaves only; None for a nested tensor
    dtype: str  # leaves only
    requires_grad: bool  # leaves only
    grad: bool  # leaves only: .grad was already set when inspected (backward adds into it)
    planned: str  # only while Plan.render() draws: "checkpoint" / "offload"
    memory_peak: str  # only while BackwardMemory.render() draws: the peak's label line


class EdgeAttrs(TypedDict):
    """Attributes of an edge ``u -> v``: ``v`` consumed output ``output`` of ``u`` as its input ``index``."""

    index: int  # position in v's next_functions
    output: int  # output number of u (a multi-output op such as split)
    count: int  # how many of v's inputs are this output
    outputs: NotRequired[list[int]]  # only when v consumes several outputs of u: each input's output number


class ParamInfo(TypedDict):
    """``graph.graph["params"][name]``."""

    requires_grad: bool
    shape: list[int]
    dtype: str
    node: str | None  # the param node, None when the root does not reach it
    storage: int | None
    grad: bool  # .grad was already set when inspected
    pid: int  # id() of the parameter tensor (matches checkpoint regions' parameters)


class TraceEvent(TypedDict, total=False):
    """``graph.graph["events"][i]``: a cut or an in-place op recorded by ``trace()``."""

    kind: str  # "detach", ".data", "no_grad-region", "to-python", "non-differentiable-op", "inplace"
    op: str
    location: str | None  # "file.py:12 in forward"
    params: list[str]  # parameters that fed the cut input
    module: str | None
    seq: int  # the sequence number current when the event was recorded
    shape: list[int] | None
    version: int  # in-place: the tensor's version after the write
    producer: str | None  # in-place inside a reentrant checkpoint: the op that made the tensor
    region: int  # in-place inside a reentrant checkpoint: the region's number
    optimizer: bool  # in-place by an optimizer step
    view: bool  # in-place written through a view (NOTE [in-place on a slice])
    storage: int  # in-place: the storage written
    joins: list[
        list[int]
    ]  # a cut: [first, end) sequence numbers of nodes made from its result (NOTE [where a cut joins])
    hook: str  # a cut inside a forward hook: the hook's name (NOTE [cuts in forward hooks])
    hook_module: str | None  # ... and the module it is registered on
    op_location: str | None  # a cut under inference_mode: the op's own line (``location`` is the region's)
    function: str  # an output a custom Function returned without a gradient: the Function's class name
    nested: bool  # checkpoint-input: the tensor sat inside a container argument (else captured from outside)


class GraphAttrs(TypedDict, total=False):
    """``report.graph.graph``."""

    roots: list[str]
    root_shapes: list[list[int]]
    no_grad_roots: list[int]
    storage_bytes: list[int]
    params: dict[str, ParamInfo]
    events: list[TraceEvent]
    called_modules: list[str]
    module_calls: list[list]  # [name or None, parent index or -1, class name, first seq, end seq]
    events_dropped: int
    checkpoint_params: dict[
        str, list[int]
    ]  # traced: parameter -> sequence numbers of the reentrant checkpoint regions that used it
    root_storage_bytes: list[int | None]
    external: list[int]
    buffers: list[list]
    batch: list[list]  # traced: [storage key, bytes, shape, dtype, storage id or None] per batch storage
    input_storages: dict[str, int]  # input leaf node id -> the storage id an op saved it under
    hf_checkpointing: dict[str, Any]  # traced, Hugging Face model=: {"layers": [...], "method": "..."}
    dtype_flow: dict[str, Any]  # traced, lower-precision parameters: {"nodes": {...}, "casts": [...]}
    compiled_cuts: list[dict[str, Any]]  # torch.compile regions' dead inputs, as trace events (COMPILED_CUTS)
