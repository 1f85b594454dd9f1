"""A traced reentrant checkpoint region's recompute, rebuilt on ``meta`` tensors and walked.

NOTE [rebuilding a recompute on meta]
``tracing/regions.py`` (NOTE [recording a reentrant region]) keeps, as plain data, the torch calls a
reentrant region's forward made. What ``CheckpointFunction.backward`` will build follows from them: the
same calls under ``enable_grad`` on the detached inputs. We replay them on ``meta`` (no data, no user
code: only torch functions named in the recording, resolved by ``_torch.resolve_func``), with a fresh
meta leaf per region input (``requires_grad`` as the input had it, as ``detach_variable`` does), a meta
stand-in per parameter (named, so the walk labels its AccumulateGrad) and a meta constant per tensor from
outside; devices become ``meta`` and factory calls get ``device="meta"``; no TorchFunctionMode sees the
calls. Each call's outputs must have the recorded shapes and dtypes, or the replay is refused (data-
dependent code). A value is dropped when the forward's tensor died (its recorded death), so that, after
each call, the live values are the recompute's; the values still held at the end are the region's
outputs and the leaves, which then read as held outside the graph (NOTE [holder counts]), as they are in
torch. The result is walked with the ordinary walk into compact records.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gradscope._torch import (
    SDPA_KEY,
    cpu_flash_attention,
    no_torch_function,
    peek_sequence_nr,
    resolve_func,
    storage_key_and_bytes,
)
from gradscope.walk.build import build
from gradscope.walk.records import Records, node_ids
from gradscope.walk.slots import StorageIds
from gradscope.walk.values import dtype_str

__all__ = ["Rebuilt", "rebuild"]

_META = torch.device("meta")


@dataclass
class Rebuilt:
    """The rebuilt recompute (NOTE [rebuilding a recompute on meta]); storage keys as the replay uses them:
    ``("s", sid)`` for a storage the walk met, ``("c", n)`` for one it did not.

    Attributes:
        records, ids: the walk's records of the recompute graph and its node ids.
        steps: per call, ``(live right after it, live after the deaths that follow)``, ``{key: bytes}``.
        seq_ranges: per call, the sequence numbers of the nodes it made (``range``).
        pre: keys of storages that exist before the recompute (inputs, parameters, outside tensors).
        outputs: ``{key: bytes}`` of the region's outputs.
        input_grad: bytes of the gradients of the inputs that require grad.
        has_grad: parameter name -> whether its ``.grad`` was set when inspected.
    """

    records: Records
    ids: list
    steps: list
    seq_ranges: list
    pre: set
    outputs: dict
    input_grad: int
    has_grad: dict


class _Fail(Exception):
    pass


def _empty(meta) -> torch.Tensor:
    shape, stride, dtype, rg = meta
    t = torch.empty_strided(shape, stride, dtype=getattr(torch, dtype), device=_META)
    return t.requires_grad_(True) if rg and t.is_floating_point() else t


class _Replay:
    def __init__(self, rec: dict) -> None:
        self.inputs = {i: _empty(m) for i, m in rec["inputs"]}
        self.params = {key: _empty(m) for key, _name, m, _had in rec["params"]}
        self.outside: list = []
        self.values: dict = {}

    def dec(self, v):
        if not isinstance(v, list):
            return v
        tag = v[0]
        if tag == "T":
            kind, ref = v[1], v[2]
            if kind == "i":
                return self.inputs[ref]
            if kind == "p":
                return self.params[ref]
            if kind == "c":
                t = self.values.get(tuple(ref))
                if t is None:
                    raise _Fail(f"call {ref[0]}'s output is used after it died")
                return t
            t = _empty([*v[3:6], False])
            self.outside.append(t)
            return t
        if tag == "torch":
            return getattr(torch, v[1])
        if tag == "device":
            return _META
        if tag == "slice":
            return slice(*(self.dec(x) for x in v[1:]))
        if tag == "...":
            return Ellipsis
        items = [self.dec(x) for x in v[1]]
        return items if tag == "list" else tuple(items)


def _has_tensor(v) -> bool:
    return isinstance(v, list) and (v[0] == "T" or (v[0] in ("list", "tuple") and any(map(_has_tensor, v[1]))))


def rebuild(rec: dict) -> Rebuilt | str:
    """The recompute of the region recorded in ``rec`` (``region_recompute["traced"]``), or why not."""
    try:
        return _rebuild(rec)
    except _Fail as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - an op with no meta kernel, a torch that renamed a function
        return f"replaying it on meta failed ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"


def _rebuild(rec: dict) -> Rebuilt:
    r = _Replay(rec)
    deaths: dict = {}
    for i, j, n in rec["deaths"]:
        deaths.setdefault(n, []).append((i, j))
    steps: list = []
    ranges: list = []
    births: dict = {}  # storage pointer -> (bytes, the storage), of the storages the calls made
    with no_torch_function(), torch.enable_grad():
        for i, (fkey, args, kwargs, outs, single, *hint) in enumerate(rec["calls"]):
            func = resolve_func(tuple(fkey))
            if hint and "sdp" in hint[0]:
                func = _sdpa(hint[0]["sdp"])
            a = [r.dec(x) for x in args]
            kw = {k: r.dec(x) for k, x in kwargs.items()}
            if not any(map(_has_tensor, args)) and not any(map(_has_tensor, kwargs.values())):
                kw["device"] = _META  # a factory: its tensor goes to meta
            s0 = peek_sequence_nr()
            res = func(*a, **kw)
            ranges.append(range(s0, peek_sequence_nr()))
            got = (res,) if single else tuple(res) if isinstance(res, (tuple, list)) else None
            if got is None or len(got) != len(outs):
                raise _Fail(f"call {i} ({fkey[-1]}) gave other outputs on meta")
            for j, (t, m) in enumerate(zip(got, outs)):
                if m is None:
                    continue
                if not isinstance(t, torch.Tensor) or not t.is_meta or list(t.shape) != m[0]:
                    raise _Fail(f"call {i} ({fkey[-1]}) gave another shape on meta")
                if dtype_str(t.dtype) != m[1]:
                    raise _Fail(f"call {i} ({fkey[-1]}) gave another dtype on meta")
                st = t.untyped_storage()
                if st._cdata not in births:  # held to the end of the replay: no pointer is reused
                    births[st._cdata] = (st.nbytes(), st)
                r.values.setdefault((i, j), t)
            del res, got, a, kw
            after = _live(r.values)
            for where in deaths.get(i + 1, ()):
                r.values.pop(where, None)
            steps.append((after, _live(r.values)))
    outputs = []
    for i, j in rec["outputs"]:
        t = r.values.get((i, j))
        if t is None:
            raise _Fail("an output died inside the region")
        outputs.append(t)
    r.values.clear()  # what the recompute's function held dies when it returns
    sizes = {p: n for p, (n, _st) in births.items()}
    births.clear()
    roots = [t for t in outputs if t.requires_grad]
    if not roots:
        raise _Fail("no output of the recompute requires grad")
    leaves = [*r.inputs.values(), *r.params.values(), *r.outside]
    names = {id(r.params[key]): (name, r.params[key]) for key, name, _m, _had in rec["params"]}
    storages = StorageIds()
    records = build(roots, names, storages=storages)
    sid = storages.ids

    def key(ptr):
        return ("s", sid[ptr]) if ptr in sid else ("c", ptr)

    pre = {key(storage_key_and_bytes(t)[0]) for t in leaves}
    out_keys = {key(p): n for p, n in (storage_key_and_bytes(t) for t in outputs)}
    input_grad = sum(t.numel() * t.element_size() for t in r.inputs.values() if t.requires_grad)
    steps = [tuple({key(p): sizes.get(p, 0) for p in live} for live in step) for step in steps]
    return Rebuilt(
        records=records,
        ids=node_ids(len(records)),
        steps=steps,
        seq_ranges=ranges,
        pre=pre,
        outputs=out_keys,
        input_grad=input_grad,
        has_grad={name: had for _key, name, _m, had in rec["params"]},
    )


def _sdpa(choice):
    if choice == 1:
        return cpu_flash_attention
    if choice == 0:
        return resolve_func(SDPA_KEY)  # math, what meta runs
    raise _Fail(f"its attention ran a kernel (sdp choice {choice}) the meta replay does not model")


def _live(values: dict) -> set:
    return {storage_key_and_bytes(t)[0] for t in values.values()}
