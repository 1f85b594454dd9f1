"""What a reentrant checkpoint region's forward calls, recorded by the trace mode as plain data.

NOTE [recording a reentrant region]
``checkpoint(fn, x, use_reentrant=True)`` runs ``fn`` under ``no_grad`` in the forward; its backward runs it
again under ``enable_grad`` and backpropagates through that second graph, which does not exist before
backward (``memory/replay/reentrant.py`` NOTE [reentrant checkpoint backward]). What the mode sees of the first
run is enough to rebuild the second one on ``meta`` tensors without running any user code
(``walk/recompute.py``): every top-level torch-function call of the region (the mode is off inside a
call, so ``F.layer_norm``'s own ops are not seen), as ``[function name, args, kwargs, outputs]``, where a
tensor argument is a placeholder ``["T", kind, ref, shape, stride, dtype, requires_grad]``: kind ``"c"`` an
earlier call's output (``ref = [call, output]``), ``"i"`` the region's tensor argument ``ref``, ``"p"`` a
parameter (``ref`` is the trace's parameter key, ``id()``, named in ``annotate``), ``"o"`` a tensor made
outside the region (a mask the region's closure holds). Other arguments are kept only when they are plain
data (numbers, strings, None, dtypes, devices, slices, tuples/lists of those); anything else, a function
name that does not lead back to the function, an op under another autograd Function inside the region
(a custom Function, a nested checkpoint), a tensor from outside that requires grad: the region is not
recordable and says why (``reason``).

Each output a call makes gets a weak reference whose callback notes when that tensor died (the number
of calls made so far) and whether it died inside the region (the next autograd sequence number still
the region's: no node is made under no_grad; the first op after the region that uses its output makes
one). That gives the recompute's transient tensors their real Python lifetimes, and the tensors that
outlived the region are its outputs. The references are weak and only to tensors the region made
(never to a parameter: ``torch.utils.swap_tensors`` refuses a tensor with a weak reference); they are
dropped when the region is closed (the next region starts, or the trace ends). Recording starts only
at an op that runs under no_grad inside a ``CheckpointFunction.forward`` frame, so the ops outside
regions pay nothing more than a grad-mode check on the paths that already do extra work
(NOTE [cheap per-op path]).
"""

from __future__ import annotations

import sys
import weakref

import torch

from gradscope._torch import SDPA_KEY, func_key, impl_key, peek_sequence_nr, sdp_choice, sequence_nr
from gradscope.tracing.probes import checkpoint_region

__all__ = ["RegionRecorder", "REENTRANT"]

REENTRANT = "CheckpointFunctionBackward"
_Tensor = torch.Tensor
_PLAIN = (bool, int, float, str, type(None))
_TORCH_ATTRS = (torch.dtype, torch.memory_format, torch.layout)
_MAX_CALLS = 5000  # per region; a longer region is not recorded


class _Unrecordable(Exception):
    pass


def _meta(t) -> tuple:
    return (tuple(t.shape), t.stride(), str(t.dtype).removeprefix("torch."), bool(t.requires_grad))


def _lists(v):
    """The recording as JSON-ready data: tuples (kept while recording: the collector skips them) as lists."""
    if isinstance(v, (tuple, list)):
        return [_lists(x) for x in v]
    if isinstance(v, dict):
        return {k: _lists(x) for k, x in v.items()}
    return v


class _Region:
    """One region's recording while it runs (ids of live tensors only while it is open)."""

    def __init__(self, key: int, frame, seq: int) -> None:
        self.key, self.frame_id, self.seq0, self.seq_now = key, id(frame), seq, seq
        args = frame.f_locals.get("args") or ()
        self.inputs = {id(a): i for i, a in enumerate(args) if isinstance(a, _Tensor)}
        self.input_meta = {i: _meta(a) for i, a in enumerate(args) if isinstance(a, _Tensor)}
        self.calls: list = []
        self.values: dict = {}  # id(tensor) -> (weak reference, (call, output))
        self.where: dict = {}  # id(weak reference) -> (call, output)
        self.deaths: dict = {}  # (call, output) -> calls made when it died inside the region
        self.params: dict = {}  # parameter key -> placeholder metadata
        self.reason: str | None = None

    def died(self, ref) -> None:
        where = self.where.pop(id(ref), None)
        if where is not None and peek_sequence_nr() == self.seq0:
            self.deaths[where] = len(self.calls)

    def close(self) -> None:
        self.inputs.clear()
        self.values.clear()  # no callback fires after this
        self.where.clear()

    # -- one call ---------------------------------------------------------------------------------
    def record(self, func, args, kwargs, out, refs: dict) -> None:
        key = func_key(func)
        if key is None:
            raise _Unrecordable(f"it calls {getattr(func, '__name__', func)!r}, which gradscope cannot name")
        enc = tuple([self._enc(a, refs, 0) for a in args])
        kw = tuple([(str(k), self._enc(v, refs, 0)) for k, v in kwargs.items()])
        outs = out if isinstance(out, (tuple, list)) else (out,)
        i = len(self.calls)
        metas: list = []
        inputs = [a for a in (*args, *kwargs.values()) if isinstance(a, _Tensor)]
        for j, o in enumerate(outs):
            if not isinstance(o, _Tensor):
                metas.append(None)
                continue
            metas.append((tuple(o.shape), str(o.dtype).removeprefix("torch.")))
            if any(o is a for a in inputs):
                continue  # in place, or an op that returned its input: the same value
            if o.requires_grad and (o._base is None or torch.is_grad_enabled()):  # else a view under no_grad
                raise _Unrecordable("an op inside it made a tensor that requires grad")
            ref = weakref.ref(o, self.died)
            self.where[id(ref)] = (i, j)
            self.values[id(o)] = (ref, (i, j))
        call: tuple = (key, enc, kw, tuple(metas), not isinstance(out, (tuple, list)))
        if key == SDPA_KEY:  # the kernel CPU picked: meta always takes the math path
            call = (*call, (("sdp", sdp_choice(args, kwargs)),))
        self.calls.append(call)

    def _enc(self, v, refs: dict, depth: int):
        if isinstance(v, _PLAIN):
            return v
        if isinstance(v, _Tensor):
            return self._tensor(v, refs)
        if isinstance(v, _TORCH_ATTRS):
            name = str(v).removeprefix("torch.")
            if getattr(torch, name, None) != v:
                raise _Unrecordable(f"it passes {v!r}")
            return ("torch", name)
        if isinstance(v, torch.device):
            return ("device",)
        if isinstance(v, slice):
            return ("slice", *(self._enc(x, refs, depth + 1) for x in (v.start, v.stop, v.step)))
        if v is Ellipsis:
            return ("...",)
        if isinstance(v, (tuple, list)) and depth < 4:
            return ("list" if isinstance(v, list) else "tuple", tuple([self._enc(x, refs, depth + 1) for x in v]))
        raise _Unrecordable(f"it passes a {type(v).__name__} to a torch function")

    def _tensor(self, t, refs: dict) -> tuple:
        if type(t) not in (_Tensor, torch.nn.Parameter) or t.layout != torch.strided:
            raise _Unrecordable(f"it uses a {type(t).__name__} ({t.layout})")
        k = id(t)
        index = self.inputs.get(k)
        if index is not None:
            return ("T", "i", index, *_meta(t))
        entry = self.values.get(k)
        if entry is not None and entry[0]() is t:
            return ("T", "c", entry[1], *_meta(t))
        if t.requires_grad:
            if t.grad_fn is not None:
                raise _Unrecordable("it uses a tensor from outside the region that requires grad")
            if k not in refs:  # the trace's parameter key: no reference to the parameter, not a weak one
                refs[k] = impl_key(t)
            self.params[k] = _meta(t)
            return ("T", "p", k, *_meta(t))
        return ("T", "o", None, *_meta(t))


class RegionRecorder:
    """The regions of one trace (NOTE [recording a reentrant region]); ``leaf_refs`` is the trace's."""

    def __init__(self, leaf_refs: dict) -> None:
        self.refs = leaf_refs
        self.done: dict = {}  # region key (its node's sequence number) -> _Region
        self.open: _Region | None = None
        self.no_region_seq = -2  # a sequence number at which an op was seen outside any region
        self.region_seq = -2  # the open region's (for the mode's getter path)

    def call(self, func, args, kwargs, out, seq: int) -> None:
        """One call the mode saw under no_grad (``seq``: the next sequence number before it ran)."""
        if seq == self.no_region_seq:
            return
        frame, nested = checkpoint_region(sys._getframe(2))
        if frame is None:
            self.no_region_seq, self.region_seq = seq, -2
            return
        region = self.open
        if region is None or region.frame_id != id(frame) or (seq != region.seq_now and _ctx_seq(frame) != region.key):
            self.close()
            region = self.open = _Region(_ctx_seq(frame), frame, seq)
            self.done[region.key] = region
        del frame
        region.seq_now = self.region_seq = seq
        if region.reason is not None:
            return
        if nested:
            region.reason = "it calls an autograd Function (a custom Function or a nested checkpoint)"
        elif len(region.calls) >= _MAX_CALLS:
            region.reason = f"it makes more than {_MAX_CALLS} torch calls"
        else:
            try:
                region.record(func, args, kwargs or {}, out, self.refs)
            except _Unrecordable as exc:
                region.reason = str(exc)
            except Exception as exc:  # noqa: BLE001 - NOTE [never change the program]; never half a call
                region.reason = f"gradscope could not record a call ({type(exc).__name__})"
        if region.reason is not None:
            region.close()

    def close(self) -> None:
        if self.open is not None:
            self.open.close()
            self.open = None
        self.region_seq = -2

    def annotate(self, ops, pnames: dict, params: dict) -> None:
        """Write each recorded region into its node's ``attrs["region_recompute"]["traced"]`` (plain data)."""
        if not self.done:
            return
        for d in ops:
            region = self.done.get(d.get("seq")) if d.get("name") == REENTRANT else None
            rec = (d.get("attrs") or {}).get("region_recompute") if region is not None else None
            if rec is not None and region is not None:
                rec["traced"] = _plain(region, d, pnames, params)


def _ctx_seq(frame) -> int:
    try:
        return sequence_nr(frame.f_locals["ctx"])
    except (KeyError, AttributeError, RuntimeError):
        return -1


def _plain(region: _Region, node: dict, pnames: dict, params: dict) -> dict:
    reason = region.reason
    plist = []
    for key, meta in region.params.items():
        name = pnames.get(key)
        if name is None:
            reason = reason or "it uses a tensor that requires grad and is no parameter of the model"
            break
        plist.append([key, name, _lists(meta), bool((params.get(name) or {}).get("grad"))])
    outputs = _outputs(region, node.get("out_shapes") or [], node.get("out_dtypes") or [])
    if outputs is None:
        reason = reason or "its outputs are not among the tensors it made"
    return {
        "reason": reason,
        "calls": [_call(c) for c in region.calls] if reason is None else [],
        "inputs": [[i, _lists(m)] for i, m in region.input_meta.items()],
        "params": plist if reason is None else [],
        "deaths": [[i, j, n] for (i, j), n in region.deaths.items()],
        "outputs": outputs or [],
    }


def _call(call: tuple) -> list:
    key, args, kwargs, metas, single, *hint = call
    out = [list(key), _lists(args), {k: _lists(v) for k, v in kwargs}, _lists(metas), single]
    return out + [dict(hint[0])] if hint else out


def _outputs(region: _Region, shapes: list, dtypes: list) -> list | None:
    """The calls' outputs that outlived the region, matched to the node's outputs by shape and dtype."""
    alive = [
        [i, j, m]
        for i, call in enumerate(region.calls)
        for j, m in enumerate(call[3])
        if m is not None and (i, j) not in region.deaths
    ]
    out = []
    for k, shape in enumerate(shapes):
        dtype = dtypes[k] if k < len(dtypes) else None
        hits = [a for a in alive if list(a[2][0]) == list(shape or ()) and (dtype is None or a[2][1] == dtype)]
        if len(hits) != 1:
            hits = hits[-1:] if len(shapes) == 1 and hits else []  # one output: the last such tensor made
        if not hits:
            return None
        alive.remove(hits[0])
        out.append(hits[0][:2])
    return out
