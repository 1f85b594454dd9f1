"""A saved report checked at the door by :func:`gradscope.load`, against the schema of :mod:`gradscope.graph.schema`.

A report file is read back by code that trusts its shape (checks, summary, memory, render, diff), so a
file of the wrong shape must be refused before anything else touches it, with one sentence naming the
first bad field (``nodes[3].saved[0].nbytes: expected an integer >= 0, got 'x'``). Fields that this
version does not know are kept (a newer gradscope may add some) but must be plain JSON of bounded depth.

The key sets come from the TypedDicts: a field checked by hand below (with its bounds and references) must
be a field of the schema, and every other schema field is checked against its annotation
(:func:`conforms`), so a field added to :class:`~gradscope.graph.schema.NodeAttrs` is checked on load
without touching this module.
"""

from __future__ import annotations

from typing import get_type_hints

from gradscope._format import one_line
from gradscope.errors import InputValueError
from gradscope.findings import KINDS, SEVERITIES
from gradscope.graph.jsonvalues import (
    MAX_INT,
    Bad,
    count_ok,
    describe,
    expect_bool,
    expect_int,
    expect_list,
    expect_obj,
    expect_plain,
    expect_shape,
    expect_str,
    fail,
    fields,
    plain_ok,
    shape_ok,
)
from gradscope.graph.schema import NODE_KINDS, EdgeAttrs, NodeAttrs, SavedEntry

__all__ = ["validate"]

#: Fields each fast check tests by hand (with bounds and references); every one is a field of the schema.
_NODE_BY_HAND = frozenset(
    {"id", "kind", "name", "saved", "saved_bytes", "module", "location", "root", "opaque", "seq", "attrs", "out_shapes"}
)
_SAVED_BY_HAND = frozenset(
    {"slot", "status", "shape", "dtype", "device", "nbytes", "storage", "version", "saved_version"}
)
_EDGE_BY_HAND = frozenset({"source", "target", "index", "output", "count"})
#: The other schema fields, each with the predicate of its annotation.
_NODE_FIELDS = {k: p for k, p in fields(NodeAttrs).items() if k not in _NODE_BY_HAND}
_SAVED_FIELDS = {k: p for k, p in fields(SavedEntry).items() if k not in _SAVED_BY_HAND}
_EDGE_FIELDS = {k: p for k, p in fields(EdgeAttrs).items() if k not in _EDGE_BY_HAND}
assert _NODE_BY_HAND <= {"id", *NodeAttrs.__annotations__} and _SAVED_BY_HAND <= set(SavedEntry.__annotations__)
assert _EDGE_BY_HAND <= {"source", "target", *EdgeAttrs.__annotations__}


def _rest_ok(d: dict, by_hand: frozenset, known: dict, depth: int) -> bool:
    """The fields not checked by hand: schema fields by their annotation, unknown ones as plain JSON."""
    for k, x in d.items():
        if k in by_hand:
            continue
        check = known.get(k)
        if not (check(x) if check is not None else plain_ok(x, depth)):
            return False
    return True


def _rest(where: str, d: dict, by_hand: frozenset, known: dict, hints: dict) -> None:
    for k, x in d.items():
        if k not in by_hand and k in known and not known[k](x):
            fail(f"{where}.{k}", describe(hints[k]), x)
    expect_plain(where, d)


# -- fast checks: the common, valid case without building any path string ----------------------------
def _saved_ok(e) -> bool:
    return (
        type(e) is dict
        and type(e.get("slot")) is str
        and type(e.get("status")) is str
        and shape_ok(e.get("shape"), True)
        and type(e.get("dtype")) in (str, type(None))
        and type(e.get("device")) in (str, type(None))
        and count_ok(e.get("nbytes"))
        and count_ok(e.get("storage"), null=True)
        and count_ok(e.get("version"), low=-MAX_INT, null=True)
        and count_ok(e.get("saved_version"), low=-MAX_INT, null=True)
        and _rest_ok(e, _SAVED_BY_HAND, _SAVED_FIELDS, 2)
    )


def _node_ok(d) -> bool:
    if (
        type(d) is not dict
        or type(d.get("id")) is not str
        or d.get("kind") not in NODE_KINDS
        or type(d.get("name")) is not str
        or type(d.get("saved")) is not list
    ):
        return False
    if not (
        count_ok(d.get("saved_bytes"))
        and type(d.get("module")) in (str, type(None))
        and type(d.get("location")) in (str, type(None))
        and type(d.get("root")) is bool
        and type(d.get("opaque")) is bool
        and count_ok(d.get("seq"), low=-MAX_INT, null=True)
    ):
        return False
    attrs, outs = d.get("attrs"), d.get("out_shapes")
    if not (attrs is None or (type(attrs) is dict and plain_ok(attrs, 1))):
        return False
    if not (outs is None or (type(outs) is list and all(s is None or shape_ok(s) for s in outs))):
        return False
    return all(_saved_ok(e) for e in d["saved"]) and _rest_ok(d, _NODE_BY_HAND, _NODE_FIELDS, 1)


def _edge_ok(e, ids) -> bool:
    return (
        type(e) is dict
        and e.get("source") in ids
        and e.get("target") in ids
        and count_ok(e.get("index"))
        and count_ok(e.get("output"))
        and count_ok(e.get("count"))
        and _rest_ok(e, _EDGE_BY_HAND, _EDGE_FIELDS, 1)
    )


# -- detailed checks: run only to name the first bad field -------------------------------------------
def _saved(where, e) -> None:
    expect_obj(where, e)
    expect_str(f"{where}.slot", e.get("slot"))
    expect_str(f"{where}.status", e.get("status"))  # a newer walk may add states beyond schema.STATUSES
    expect_shape(f"{where}.shape", e.get("shape"), null=True)
    expect_str(f"{where}.dtype", e.get("dtype"), null=True)
    expect_str(f"{where}.device", e.get("device"), null=True)
    expect_int(f"{where}.nbytes", e.get("nbytes"), low=0)
    expect_int(f"{where}.storage", e.get("storage"), low=0, null=True)
    for k in ("version", "saved_version"):
        if k in e:
            expect_int(f"{where}.{k}", e[k], null=True)
    _rest(where, e, _SAVED_BY_HAND, _SAVED_FIELDS, get_type_hints(SavedEntry))


def _node(where, d, ids: set) -> None:
    expect_obj(where, d)
    nid = d.get("id")
    expect_str(f"{where}.id", nid)
    if nid in ids:
        raise Bad(f"{where}.id: node id {one_line(nid)} appears twice")
    ids.add(nid)
    expect_str(f"{where}.kind", d.get("kind"), choices=NODE_KINDS)
    expect_str(f"{where}.name", d.get("name"))
    for i, e in enumerate(expect_list(f"{where}.saved", d.get("saved"))):
        _saved(f"{where}.saved[{i}]", e)
    expect_int(f"{where}.saved_bytes", d.get("saved_bytes"), low=0)
    expect_str(f"{where}.module", d.get("module"), null=True)
    expect_str(f"{where}.location", d.get("location"), null=True)
    expect_bool(f"{where}.root", d.get("root"))
    expect_bool(f"{where}.opaque", d.get("opaque"))
    expect_int(f"{where}.seq", d.get("seq"), null=True)
    if "attrs" in d and d["attrs"] is not None:
        expect_obj(f"{where}.attrs", d["attrs"])
    for i, s in enumerate(expect_list(f"{where}.out_shapes", d.get("out_shapes"), null=True)):
        expect_shape(f"{where}.out_shapes[{i}]", s, null=True)  # None: a nested tensor has no one shape
    _rest(where, d, _NODE_BY_HAND, _NODE_FIELDS, get_type_hints(NodeAttrs))


def _edge(where, e, ids: set) -> None:
    expect_obj(where, e)
    for k in ("source", "target"):
        if e.get(k) not in ids:
            raise Bad(f"{where}.{k}: {one_line(e.get(k))} is not the id of a node in the file")
    for k in ("index", "output", "count"):
        expect_int(f"{where}.{k}", e.get(k), low=0)
    _rest(where, e, _EDGE_BY_HAND, _EDGE_FIELDS, get_type_hints(EdgeAttrs))


def _graph(g, ids: set) -> None:
    g = expect_obj("graph", g)
    for i, r in enumerate(expect_list("graph.roots", g.get("roots", []))):
        if r not in ids:
            raise Bad(f"graph.roots[{i}]: {one_line(r)} is not the id of a node in the file")
    for i, s in enumerate(expect_list("graph.root_shapes", g.get("root_shapes", []))):
        expect_shape(f"graph.root_shapes[{i}]", s)
    for i, v in enumerate(expect_list("graph.no_grad_roots", g.get("no_grad_roots", []))):
        expect_int(f"graph.no_grad_roots[{i}]", v, low=0)
    for i, v in enumerate(expect_list("graph.storage_bytes", g.get("storage_bytes", []))):
        expect_int(f"graph.storage_bytes[{i}]", v, low=0)
    for name, p in expect_obj("graph.params", g.get("params", {})).items():
        w = f"graph.params[{name!r}]"
        expect_obj(w, p)
        expect_bool(f"{w}.requires_grad", p.get("requires_grad"))
        expect_shape(f"{w}.shape", p.get("shape"))
        expect_str(f"{w}.dtype", p.get("dtype"))
        if p.get("node") is not None and p["node"] not in ids:
            raise Bad(f"{w}.node: {one_line(p['node'])} is not the id of a node in the file")
        expect_int(f"{w}.storage", p.get("storage"), low=0, null=True)
    for i, ev in enumerate(expect_list("graph.events", g.get("events", []))):
        w = f"graph.events[{i}]"
        expect_obj(w, ev)
        expect_str(f"{w}.kind", ev.get("kind"))
        expect_str(f"{w}.op", ev.get("op"))
        expect_str(f"{w}.location", ev.get("location"), null=True)
        for j, p in enumerate(expect_list(f"{w}.params", ev.get("params", []))):
            expect_str(f"{w}.params[{j}]", p)
        expect_str(f"{w}.module", ev.get("module"), null=True)
        expect_int(f"{w}.seq", ev.get("seq"), null=True)
        expect_shape(f"{w}.shape", ev.get("shape"), null=True)
        if "version" in ev:
            expect_int(f"{w}.version", ev["version"], null=True)
        expect_str(f"{w}.producer", ev.get("producer"), null=True)
        for key in ("optimizer", "view"):
            if key in ev:
                expect_bool(f"{w}.{key}", ev[key])
        if "storage" in ev:
            expect_int(f"{w}.storage", ev["storage"], low=0)
        if "region" in ev:
            expect_int(f"{w}.region", ev["region"], low=-1)
    for i, m in enumerate(expect_list("graph.called_modules", g.get("called_modules"), null=True)):
        expect_str(f"graph.called_modules[{i}]", m)
    for i, c in enumerate(expect_list("graph.module_calls", g.get("module_calls"), null=True)):
        w = f"graph.module_calls[{i}]"
        if type(c) is not list or len(c) != 5:
            raise Bad(f"{w}: expected [name, parent, class, first seq, end seq], got {c!r:.80}")
        expect_str(f"{w}[0]", c[0], null=True)
        expect_int(f"{w}[1]", c[1], low=-1)
        expect_str(f"{w}[2]", c[2])
        expect_int(f"{w}[3]", c[3], low=-MAX_INT)
        expect_int(f"{w}[4]", c[4], low=-MAX_INT)
    for name, seqs in (expect_obj("graph.checkpoint_params", g.get("checkpoint_params") or {})).items():
        for i, s in enumerate(expect_list(f"graph.checkpoint_params[{name!r}]", seqs)):
            expect_int(f"graph.checkpoint_params[{name!r}][{i}]", s, low=-1)
    for i, f in enumerate(expect_list("graph.findings", g.get("findings", []))):
        w = f"graph.findings[{i}]"
        expect_obj(w, f)
        expect_str(f"{w}.kind", f.get("kind"), choices=KINDS)
        expect_str(f"{w}.severity", f.get("severity"), choices=SEVERITIES)
        expect_str(f"{w}.message", f.get("message"))
        expect_str(f"{w}.node", f.get("node"), null=True)
        for j, p in enumerate(expect_list(f"{w}.params", f.get("params", []), null=True)):
            expect_str(f"{w}.params[{j}]", p)
        expect_str(f"{w}.location", f.get("location"), null=True)
    if "saved_bytes" in g:
        expect_int("graph.saved_bytes", g["saved_bytes"], low=0, null=True)
    expect_plain("graph", g)


def validate(data, source: str = "the report") -> str:
    """Check ``data`` (parsed JSON) against the report schema; return the key holding the edges.

    Raises:
        InputValueError: naming the first field that is missing or of the wrong type.
    """
    try:
        if type(data) is not dict or type(data.get("nodes")) is not list:
            raise Bad("the top level must be an object with a 'nodes' list")
        edges = "edges" if "edges" in data else "links"
        if edges not in data:
            raise Bad("the 'edges' list is missing")
        ids: set = set()
        add = ids.add
        for i, d in enumerate(data["nodes"]):
            if _node_ok(d) and d["id"] not in ids:
                add(d["id"])
            else:
                _node(f"nodes[{i}]", d, ids)
        for i, e in enumerate(expect_list(edges, data.get(edges, []))):
            if not _edge_ok(e, ids):
                _edge(f"{edges}[{i}]", e, ids)
        _graph(data.get("graph", {}), ids)
        for k in ("directed", "multigraph"):
            if k in data:
                expect_bool(k, data[k])
        if data.get("multigraph") is True or data.get("directed") is False:
            raise Bad("a gradscope report is a directed graph without parallel edges")
    except Bad as exc:
        raise InputValueError(
            f"{source} is not a gradscope report ({exc}); pass a file written by report.render('x.json')."
        ) from None
    return edges
