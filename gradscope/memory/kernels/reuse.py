"""What the in-node signatures and the gradient layouts derive from a compiled program, kept in one dict that
the programs of graphs of one structure share.

NOTE [signature reuse]
A node's in-node signature (``signature.py``) and the layout of the gradient it receives (``layout.py``) are
read from the graph's metadata only: op names, output shapes and dtypes, saved slots (shapes, strides,
dtypes), saved values, leaves, edges and roots. Working them out costs more than the rest of the replay (a
dict per node, each gradient followed up to ``layout.DEPTH`` consumers, a JSON key per signature), and so
does much of compiling the program (edges, gradient sizes, recorded checkpoint regions). A training loop
inspects graphs of one structure step after step, as what-if planning replays copies of one program, so
these are kept in one dict per structure: the columns of the compact records they are read from (node
types, outputs, saved slots and values, strides, leaves, edges, roots; kept as shallow copies) are compared
with the last structure's (the saved values as marshal's bytes, which tell ``2`` from ``2.0``), and when all
are equal the dict is shared, so a program's results are those a fresh computation in the same order gives.
What a walk reads besides (sequence numbers, storage sizes, ``.grad``, the roots' shapes, the tensors held
outside) is read afresh every time. Only the last structure is kept; nothing in it refers to a tensor, a
module or a report (``tests/memory/test_signature_reuse.py``). A program compiled from a DiGraph (no compact
records) has a dict of its own. A structure seen for the first time still works its signatures out, from
the columns (NOTE [node facts]); a signature whose parts (the node's own digest, its inputs, the layouts
of the gradients it receives) were seen before, in this graph or an earlier one, takes the JSON key made
then (:func:`signatures`; ``tests/memory/test_node_facts.py``).
"""

from __future__ import annotations

import marshal

__all__ = ["derived", "forget", "shared", "signatures"]

_LAST: list = []  # [the last structure, its dict]
_SIGNATURES: dict = {}  # (a node's raw key, its inputs and gradient layouts, threads) -> (JSON key, signature)
_MAX_SIGNATURES = 1 << 16


def derived(prog) -> dict:
    """The dict of values derived from ``prog``'s structure (shared with the last program of the same
    structure; see NOTE [signature reuse])."""
    got = prog.__dict__.get("_derived")
    if got is None:
        structure = getattr(prog.attrs, "structure", None)
        if getattr(prog, "dtype_change", None) is not None:  # its signatures differ from the structure's
            structure = None
        got = {} if structure is None else shared(structure())
        prog.__dict__["_derived"] = got
    return got


def shared(structure: tuple) -> dict:
    """The dict of the compact records' ``structure`` (``NodeAttrs.structure()``): the last one's when it is
    equal, else a new one, kept as the last."""
    cols = list(structure)
    cols[3] = _values_key(cols[3])
    try:
        same = bool(_LAST) and _LAST[0] == cols
    except Exception:  # noqa: BLE001 - a saved slot that cannot be compared: not shared
        same = False
    if same:
        return _LAST[1]
    got: dict = {}
    _LAST[:] = [[c.copy() if type(c) is dict else c[:] for c in cols], got]  # copies: the columns may grow
    return got


def signatures() -> dict:
    """The signatures built so far by their parts (``signature.keyed_signature``), for every program: a
    structure seen for the first time writes the JSON key of each distinct signature once, not per node.
    Nothing in it refers to a tensor, a module or a report; emptied when it grows past 65536 entries."""
    if len(_SIGNATURES) >= _MAX_SIGNATURES:
        _SIGNATURES.clear()
    return _SIGNATURES


def forget() -> None:
    """Forget the structure kept and the signatures built (the next program works everything out afresh,
    as for a structure seen for the first time: what ``bench/memory_bench.py --backward --cold`` times)."""
    _LAST.clear()
    _SIGNATURES.clear()


def _values_key(values: list):
    """The saved values as bytes that tell apart what ``==`` does not and the signatures' JSON keys do
    (``2`` and ``2.0``, ``True`` and ``1``, ``-0.0`` and ``0.0``): marshal's, or their ``repr`` for a value
    marshal cannot write."""
    try:
        return marshal.dumps(values, 2)  # version 2: no back-references, so equal values give equal bytes
    except ValueError:
        return repr(values)
