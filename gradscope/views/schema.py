"""The schema of a saved report, checked at the door by :func:`gradscope.load`.

A report file is read back by code that trusts its shape (checks, summary, memory, render, diff), so a
file of the wrong shape must be refused before anything else touches it, with one sentence naming the
first bad field (``nodes[3].saved[0].nbytes: expected an integer >= 0, got 'x'``). Fields that this
version does not know are kept (a newer gradscope may add some) but must be plain JSON of bounded depth.
"""

from __future__ import annotations

from gradscope.errors import InputValueError

__all__ = ["validate"]

_MAX_DEPTH = 64
_MAX_INT = 2**63
_STATUSES = ("live", "stale", "hooked", "offloaded", "recomputed", "opaque", "freed")  # known today


class _Bad(Exception):
    pass


def _type(v) -> str:
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        type(None): "null",
    }.get(type(v), type(v).__name__)


def _fail(where: str, want: str, v) -> None:
    shown = (
        repr(v) if isinstance(v, (int, float, bool, type(None))) or (isinstance(v, str) and len(v) < 40) else _type(v)
    )
    raise _Bad(f"{where}: expected {want}, got {shown}")


def _int(where, v, low=None, null=False):
    if v is None and null:
        return
    if type(v) is not int or abs(v) >= _MAX_INT or (low is not None and v < low):
        _fail(where, "an integer" + (f" >= {low}" if low is not None else "") + (" or null" if null else ""), v)


def _str(where, v, null=False, choices=None):
    if v is None and null:
        return
    if type(v) is not str or (choices is not None and v not in choices):
        _fail(where, ("one of " + ", ".join(choices)) if choices else "a string" + (" or null" if null else ""), v)


def _bool(where, v):
    if type(v) is not bool:
        _fail(where, "true or false", v)


def _list(where, v, null=False) -> list:
    if v is None and null:
        return []
    if type(v) is not list:
        _fail(where, "a list" + (" or null" if null else ""), v)
    return v


def _obj(where, v) -> dict:
    if type(v) is not dict:
        _fail(where, "an object", v)
    return v


def _shape(where, v, null=False):
    for i, s in enumerate(_list(where, v, null)):
        _int(f"{where}[{i}]", s, low=-1)


def _plain(where, v) -> None:
    """Any JSON value of bounded depth (iterative: a hostile file cannot blow the stack)."""
    stack = [(where, v, 0)]
    while stack:
        w, x, depth = stack.pop()
        if depth > _MAX_DEPTH:
            raise _Bad(f"{w}: nested more than {_MAX_DEPTH} levels deep")
        if type(x) is dict:
            stack.extend((f"{w}.{k}", y, depth + 1) for k, y in x.items())
        elif type(x) is list:
            stack.extend((f"{w}[{i}]", y, depth + 1) for i, y in enumerate(x))
        elif type(x) is int:
            _int(w, x)
        elif not isinstance(x, (str, float, bool, type(None))):
            _fail(w, "a JSON value", x)


# -- fast checks: the common, valid case without building any path string ----------------------------
_NONE = type(None)
_SCALARS = (str, float, bool, _NONE)
_NODE_KEYS = frozenset(
    {"id", "kind", "name", "saved", "saved_bytes", "module", "root", "opaque", "seq", "attrs", "out_shapes"}
)
_SAVED_KEYS = frozenset({"slot", "status", "shape", "dtype", "device", "nbytes", "storage"})


def _plain_ok(v, depth: int = 0) -> bool:
    stack = [(v, depth)]
    pop, push = stack.pop, stack.append
    while stack:
        x, d = pop()
        t = type(x)
        if t is int:
            if not -_MAX_INT < x < _MAX_INT:
                return False
        elif t is list or t is dict:
            if d >= _MAX_DEPTH:
                return False
            for y in x if t is list else x.values():
                ty = type(y)
                if ty is int:
                    if not -_MAX_INT < y < _MAX_INT:
                        return False
                elif ty is list or ty is dict:
                    push((y, d + 1))
                elif ty not in _SCALARS:
                    return False
        elif t not in _SCALARS:
            return False
    return True


def _count(v, low=0, null=False) -> bool:
    return (v is None and null) or (type(v) is int and low <= v < _MAX_INT)


def _shape_ok(v, null=False) -> bool:
    if v is None:
        return null
    return type(v) is list and all(type(s) is int and -1 <= s < _MAX_INT for s in v)


def _saved_ok(e) -> bool:
    return (
        type(e) is dict
        and type(e.get("slot")) is str
        and type(e.get("status")) is str
        and _shape_ok(e.get("shape"), True)
        and type(e.get("dtype")) in (str, _NONE)
        and type(e.get("device")) in (str, _NONE)
        and _count(e.get("nbytes"))
        and _count(e.get("storage"), null=True)
        and all(k in _SAVED_KEYS or _plain_ok(x, 2) for k, x in e.items())
    )


def _node_ok(d) -> bool:
    if (
        type(d) is not dict
        or type(d.get("id")) is not str
        or d.get("kind") not in ("op", "param", "input")
        or type(d.get("name")) is not str
        or type(d.get("saved")) is not list
    ):
        return False
    if not (
        _count(d.get("saved_bytes"))
        and type(d.get("module")) in (str, _NONE)
        and type(d.get("location")) in (str, _NONE)
        and type(d.get("root")) is bool
        and type(d.get("opaque")) is bool
        and _count(d.get("seq"), low=-_MAX_INT, null=True)
    ):
        return False
    attrs, outs = d.get("attrs"), d.get("out_shapes")
    if not (attrs is None or (type(attrs) is dict and _plain_ok(attrs, 1))):
        return False
    if not (outs is None or (type(outs) is list and all(_shape_ok(s) for s in outs))):
        return False
    return all(_saved_ok(e) for e in d["saved"]) and all(k in _NODE_KEYS or _plain_ok(x, 1) for k, x in d.items())


def _edge_ok(e, ids) -> bool:
    return (
        type(e) is dict
        and e.get("source") in ids
        and e.get("target") in ids
        and _count(e.get("index"))
        and _count(e.get("output"))
        and _count(e.get("count"))
        and all(k in ("source", "target", "index", "output", "count") or _plain_ok(x, 1) for k, x in e.items())
    )


# -- detailed checks: run only to name the first bad field -------------------------------------------
def _saved(where, e) -> None:
    _obj(where, e)
    _str(f"{where}.slot", e.get("slot"))
    _str(f"{where}.status", e.get("status"))  # a newer walk may add states beyond _STATUSES
    _shape(f"{where}.shape", e.get("shape"), null=True)
    _str(f"{where}.dtype", e.get("dtype"), null=True)
    _str(f"{where}.device", e.get("device"), null=True)
    _int(f"{where}.nbytes", e.get("nbytes"), low=0)
    _int(f"{where}.storage", e.get("storage"), low=0, null=True)
    for k in ("version", "saved_version"):
        if k in e:
            _int(f"{where}.{k}", e[k], null=True)
    _plain(where, e)


def _node(where, d, ids: set) -> None:
    _obj(where, d)
    nid = d.get("id")
    _str(f"{where}.id", nid)
    if nid in ids:
        raise _Bad(f"{where}.id: node id {nid!r} appears twice")
    ids.add(nid)
    _str(f"{where}.kind", d.get("kind"), choices=("op", "param", "input"))
    _str(f"{where}.name", d.get("name"))
    for i, e in enumerate(_list(f"{where}.saved", d.get("saved"))):
        _saved(f"{where}.saved[{i}]", e)
    _int(f"{where}.saved_bytes", d.get("saved_bytes"), low=0)
    _str(f"{where}.module", d.get("module"), null=True)
    _str(f"{where}.location", d.get("location"), null=True)
    _bool(f"{where}.root", d.get("root"))
    _bool(f"{where}.opaque", d.get("opaque"))
    _int(f"{where}.seq", d.get("seq"), null=True)
    if "attrs" in d and d["attrs"] is not None:
        _obj(f"{where}.attrs", d["attrs"])
    for i, s in enumerate(_list(f"{where}.out_shapes", d.get("out_shapes"), null=True)):
        _shape(f"{where}.out_shapes[{i}]", s)
    _plain(where, d)


def _edge(where, e, ids: set) -> None:
    _obj(where, e)
    for k in ("source", "target"):
        if e.get(k) not in ids:
            raise _Bad(f"{where}.{k}: {e.get(k)!r} is not the id of a node in the file")
    for k in ("index", "output", "count"):
        _int(f"{where}.{k}", e.get(k), low=0)
    _plain(where, e)


def _graph(g, ids: set) -> None:
    g = _obj("graph", g)
    for i, r in enumerate(_list("graph.roots", g.get("roots", []))):
        if r not in ids:
            raise _Bad(f"graph.roots[{i}]: {r!r} is not the id of a node in the file")
    for i, s in enumerate(_list("graph.root_shapes", g.get("root_shapes", []))):
        _shape(f"graph.root_shapes[{i}]", s)
    for i, v in enumerate(_list("graph.no_grad_roots", g.get("no_grad_roots", []))):
        _int(f"graph.no_grad_roots[{i}]", v, low=0)
    for i, v in enumerate(_list("graph.storage_bytes", g.get("storage_bytes", []))):
        _int(f"graph.storage_bytes[{i}]", v, low=0)
    for name, p in _obj("graph.params", g.get("params", {})).items():
        w = f"graph.params[{name!r}]"
        _obj(w, p)
        _bool(f"{w}.requires_grad", p.get("requires_grad"))
        _shape(f"{w}.shape", p.get("shape"))
        _str(f"{w}.dtype", p.get("dtype"))
        if p.get("node") is not None and p["node"] not in ids:
            raise _Bad(f"{w}.node: {p['node']!r} is not the id of a node in the file")
        _int(f"{w}.storage", p.get("storage"), low=0, null=True)
    for i, ev in enumerate(_list("graph.events", g.get("events", []))):
        w = f"graph.events[{i}]"
        _obj(w, ev)
        _str(f"{w}.kind", ev.get("kind"))
        _str(f"{w}.op", ev.get("op"))
        _str(f"{w}.location", ev.get("location"), null=True)
        for j, p in enumerate(_list(f"{w}.params", ev.get("params", []))):
            _str(f"{w}.params[{j}]", p)
        _str(f"{w}.module", ev.get("module"), null=True)
        _int(f"{w}.seq", ev.get("seq"), null=True)
        _shape(f"{w}.shape", ev.get("shape"), null=True)
        if "version" in ev:
            _int(f"{w}.version", ev["version"], null=True)
        _str(f"{w}.producer", ev.get("producer"), null=True)
        for key in ("optimizer", "view"):
            if key in ev:
                _bool(f"{w}.{key}", ev[key])
        if "storage" in ev:
            _int(f"{w}.storage", ev["storage"], low=0)
        if "region" in ev:
            _int(f"{w}.region", ev["region"], low=-1)
    for i, m in enumerate(_list("graph.called_modules", g.get("called_modules"), null=True)):
        _str(f"graph.called_modules[{i}]", m)
    for name, seqs in (_obj("graph.checkpoint_params", g.get("checkpoint_params") or {})).items():
        for i, s in enumerate(_list(f"graph.checkpoint_params[{name!r}]", seqs)):
            _int(f"graph.checkpoint_params[{name!r}][{i}]", s, low=-1)
    for i, f in enumerate(_list("graph.findings", g.get("findings", []))):
        w = f"graph.findings[{i}]"
        _obj(w, f)
        _str(f"{w}.kind", f.get("kind"))
        _str(f"{w}.severity", f.get("severity"), choices=("error", "warning", "info"))
        _str(f"{w}.message", f.get("message"))
        _str(f"{w}.node", f.get("node"), null=True)
        for j, p in enumerate(_list(f"{w}.params", f.get("params", []), null=True)):
            _str(f"{w}.params[{j}]", p)
        _str(f"{w}.location", f.get("location"), null=True)
    if "saved_bytes" in g:
        _int("graph.saved_bytes", g["saved_bytes"], low=0, null=True)
    _plain("graph", g)


def validate(data, source: str = "the report") -> str:
    """Check ``data`` (parsed JSON) against the report schema; return the key holding the edges.

    Raises:
        InputValueError: naming the first field that is missing or of the wrong type.
    """
    try:
        if type(data) is not dict or type(data.get("nodes")) is not list:
            raise _Bad("the top level must be an object with a 'nodes' list")
        edges = "edges" if "edges" in data else "links"
        ids: set = set()
        add = ids.add
        for i, d in enumerate(data["nodes"]):
            if _node_ok(d) and d["id"] not in ids:
                add(d["id"])
            else:
                _node(f"nodes[{i}]", d, ids)
        for i, e in enumerate(_list(edges, data.get(edges, []))):
            if not _edge_ok(e, ids):
                _edge(f"{edges}[{i}]", e, ids)
        _graph(data.get("graph", {}), ids)
        for k in ("directed", "multigraph"):
            if k in data:
                _bool(k, data[k])
        if data.get("multigraph") is True or data.get("directed") is False:
            raise _Bad("a gradscope report is a directed graph without parallel edges")
    except _Bad as exc:
        raise InputValueError(
            f"{source} is not a gradscope report ({exc}); pass a file written by report.render('x.json')."
        ) from None
    return edges
