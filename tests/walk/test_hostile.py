"""Hostile input: each gets a clear result (checked against torch) or a gradscope error, never a crash.

Concurrency (what is supported): ``inspect`` reads a snapshot of the graph structure, which never changes
once built (``next_functions`` are fixed). Another thread may keep running forward passes and in-place ops
on the same tensors while a walk is in progress: the walk still completes, with the right node count; an
in-place hazard created during the walk may or may not be in that report (inspect again after the other
thread is done). Inspecting the same graph from several threads at once is fine.
"""

from __future__ import annotations

import json
import threading

import pytest
import torch
import torch.nn as nn

import gradscope
from gradscope.errors import InputTypeError, InputValueError, NoGradRootError
from tests.fuzz._oracle import count_nodes


class BadRepr:
    def __repr__(self):
        raise ValueError("this object refuses to be printed")

    __str__ = __repr__


def _views(report, tmp_path):
    """Every text/JSON view works on the report (rendering needs no Graphviz for .dot/.json)."""
    report.summary()
    repr(report)
    json.dumps(report.to_json())
    for f in report.findings:
        repr(f)
    report.render(tmp_path / "g.dot")
    report.render(tmp_path / "g.json")


def _none_grads(named):
    return {n for n, p in named.items() if p.requires_grad and p.grad is None}


def _predicted_none(report):
    return {p for f in report.findings if f.severity == "error"
            and f.kind in ("unused-parameter", "detached-branch") for p in f.params}


# -- non-leaf tensors ---------------------------------------------------------------------------
def test_retain_grad_non_leaf_as_root_and_inside_graph(tmp_path):
    lin = nn.Linear(3, 3)
    h = lin(torch.randn(2, 3))
    h.retain_grad()
    loss = torch.tanh(h).sum()
    loss.retain_grad()
    report = gradscope.inspect(loss, model=lin)
    assert report.ok and report.graph.number_of_nodes() == count_nodes([loss])
    _views(report, tmp_path)
    loss.backward()
    assert h.grad is not None and loss.grad is not None and _none_grads(dict(lin.named_parameters())) == set()


def test_retain_grad_non_leaf_in_params_is_a_clear_error():
    lin = nn.Linear(3, 3)
    h = lin(torch.randn(2, 3))
    h.retain_grad()
    with pytest.raises(InputValueError, match=r"params\['h'\] is not a leaf tensor .*AddmmBackward0"):
        gradscope.inspect(h.sum(), params={"h": h})


# -- sparse and complex -------------------------------------------------------------------------
def test_sparse_embedding_and_sparse_matmul(tmp_path):
    emb = nn.Embedding(10, 4, sparse=True)
    w = torch.randn(4, 3, requires_grad=True)
    sp = torch.randn(5, 4).relu().to_sparse().requires_grad_()
    loss = emb(torch.tensor([1, 2, 2])).sum() + torch.sparse.mm(sp, w).sum()
    named = {"emb.weight": emb.weight, "w": w, "sp": sp}
    report = gradscope.inspect(loss, params=named)
    _views(report, tmp_path)
    loss.backward()
    assert _predicted_none(report) == _none_grads(named) == set()
    assert emb.weight.grad.is_sparse and sp.grad is not None


def test_complex_graph(tmp_path):
    z = torch.randn(4, dtype=torch.cfloat, requires_grad=True)
    unused = torch.randn(2, dtype=torch.cdouble, requires_grad=True)
    h = z * z * (1 + 2j)
    loss = h.abs().sum() + torch.view_as_real(h).pow(2).sum()
    report = gradscope.inspect(loss, params={"z": z, "unused": unused})
    assert report.saved_bytes > 0
    _views(report, tmp_path)
    nonscalar = gradscope.inspect(h, params={"z": z})
    assert [f.kind for f in nonscalar.findings] == ["non-scalar-root"]
    with pytest.raises(RuntimeError, match="implicitly created only for scalar outputs"):
        h.backward()
    loss.backward()
    assert _predicted_none(report) == _none_grads({"z": z, "unused": unused}) == {"unused"}


# -- several roots ------------------------------------------------------------------------------
def test_nested_lists_of_roots():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    x = torch.randn(3, 2)
    l1, l2, l3 = a(x).sum(), b(x).sum(), (a(x) * b(x)).mean()
    report = gradscope.inspect([[l1, (l2,)], [[l3]]], params={"a.weight": a.weight, "b.weight": b.weight})
    assert len(report.graph.graph["roots"]) == 3
    assert report.graph.number_of_nodes() == count_nodes([l1, l2, l3])
    torch.autograd.backward([l1, l2, l3])
    assert report.ok and a.weight.grad is not None and b.weight.grad is not None


def test_roots_from_two_unrelated_graphs():
    m1, m2 = nn.Linear(3, 1), nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    l1, l2 = m1(torch.randn(2, 3)).sum(), m2(torch.randn(2, 3)).sum()
    named = {**{f"m1.{n}": p for n, p in m1.named_parameters()},
             **{f"m2.{n}": p for n, p in m2.named_parameters()}}
    report = gradscope.inspect([l1, l2], params=named)
    import networkx as nx
    assert nx.number_weakly_connected_components(report.graph) == 2
    assert report.graph.number_of_nodes() == count_nodes([l1, l2])
    torch.autograd.backward([l1, l2])
    assert _predicted_none(report) == _none_grads(named) == set()


def test_mixed_roots_one_without_grad():
    w = torch.randn(3, requires_grad=True)
    good, dead = (w * 2).sum(), torch.randn(3).sum()
    report = gradscope.inspect([good, dead], params={"w": w})
    assert [f.kind for f in report.findings] == ["no-grad-root"]
    with pytest.raises(RuntimeError, match="does not require grad"):
        torch.autograd.backward([good, dead])
    with pytest.raises(NoGradRootError):
        gradscope.inspect([dead, dead.detach()])


def test_root_that_is_a_leaf():
    lin = nn.Linear(3, 2)
    report = gradscope.inspect(lin.weight, model=lin)
    assert report.graph.number_of_nodes() == 1
    assert {f.kind for f in report.findings} == {"non-scalar-root", "unused-parameter"}
    lin.weight.backward(torch.ones_like(lin.weight))
    assert _predicted_none(report) == _none_grads(dict(lin.named_parameters())) == {"bias"}
    scalar = torch.tensor(1.0, requires_grad=True)
    assert gradscope.inspect(scalar, params={"s": scalar}).findings == []


# -- concurrency --------------------------------------------------------------------------------
def test_graph_modified_from_another_thread_while_inspected():
    lin = nn.Linear(8, 8)
    h = torch.sigmoid(lin(torch.randn(4, 8)))
    y = h
    for _ in range(300):
        y = torch.sin(y) * 1.0001
    loss = y.sum() + h.exp().sum()
    expected = count_nodes([loss])
    stop, started = threading.Event(), threading.Event()
    errors = []

    def meddle():
        try:
            extra = h
            while not stop.is_set():
                extra = torch.tanh(extra)         # grows the graph behind h (not behind loss)
                with torch.no_grad():
                    h.mul_(1.0)                   # bumps h's version: sigmoid/exp slots go stale
                started.set()
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
            started.set()

    t = threading.Thread(target=meddle)
    t.start()
    started.wait(30)
    try:
        reports = [gradscope.inspect(loss, model=lin) for _ in range(10)]
    finally:
        stop.set()
        t.join()
    assert not errors
    assert all(r.graph.number_of_nodes() == expected for r in reports)
    final = gradscope.inspect(loss, model=lin)
    assert any(f.kind == "inplace-hazard" for f in final.findings)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_inspect_same_graph_from_several_threads():
    lin = nn.Linear(8, 8)
    loss = torch.relu(lin(torch.randn(4, 8))).pow(2).sum()
    out, errors = [], []

    def work():
        try:
            out.append(gradscope.inspect(loss, model=lin).to_json())
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(out) == 4
    assert all(json.dumps(o, sort_keys=True) == json.dumps(out[0], sort_keys=True) for o in out)


# -- objects whose __repr__ raises --------------------------------------------------------------
@pytest.mark.parametrize("bad", [BadRepr(), [BadRepr()], (torch.randn(1, requires_grad=True) * 2, BadRepr())],
                         ids=["object", "list", "tuple-with-tensor"])
def test_unprintable_root(bad):
    with pytest.raises(InputTypeError, match="<unprintable>"):
        gradscope.inspect(bad)


def test_unprintable_model_params_and_keys():
    lin = nn.Linear(2, 2)
    loss = lin(torch.randn(1, 2)).sum()
    with pytest.raises(InputTypeError, match="model= must be"):
        gradscope.inspect(loss, model=BadRepr())
    with pytest.raises(InputTypeError, match="params= must be"):
        gradscope.inspect(loss, params=BadRepr())
    with pytest.raises(InputTypeError, match=r"params\['w'\] must be a tensor"):
        gradscope.inspect(loss, params={"w": BadRepr()})
    with pytest.raises(InputTypeError, match="keys must be parameter names"):
        gradscope.inspect(loss, params={BadRepr(): lin.weight})


def test_unprintable_module_attribute(tmp_path):
    lin = nn.Linear(2, 2)
    lin.bad = BadRepr()
    loss = lin(torch.randn(1, 2)).sum()
    report = gradscope.inspect(loss, model=lin)
    _views(report, tmp_path)
    assert report.ok


class _BadCtx(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.bad = BadRepr()
        ctx.pair = (BadRepr(), 3)
        ctx.k = 2
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * ctx.k


def test_unprintable_ctx_attributes_of_custom_function(tmp_path):
    w = torch.randn(3, requires_grad=True)
    loss = _BadCtx.apply(w * 1).sum()
    report = gradscope.inspect(loss, params={"w": w})
    _views(report, tmp_path)
    node = next(d for _, d in report.graph.nodes(data=True) if d["name"] == "_BadCtxBackward")
    assert node["attrs"]["k"] == 2 and node["attrs"]["pair"][1] == 3
    loss.backward()
    assert report.ok and w.grad is not None


def test_root_whose_grad_fn_torch_refuses_to_read():
    p = nn.Parameter(torch.randn(2, 4))
    h = p * 1
    with torch.no_grad():
        v = h.t()
    h.mul_(2)                     # the base of a no_grad view, modified in place with grad enabled
    with pytest.raises(RuntimeError, match="A view was created in no_grad mode"):
        v.sum()
    with pytest.raises(InputValueError, match="torch refuses to read its grad_fn"):
        gradscope.inspect(v)
    with pytest.raises(InputValueError, match="root 1 "):
        gradscope.inspect([h.sum(), v])


# -- bad input -------------------------------------------------------------------------
def _good_report(tmp_path):
    lin = nn.Linear(3, 1)
    path = tmp_path / "good.json"
    gradscope.inspect(lin(torch.randn(2, 3)).sum(), model=lin).render(path)
    return json.loads(path.read_text())


def _mutations(good):
    import copy

    def edit(fn):
        d = copy.deepcopy(good)
        fn(d)
        return json.dumps(d)

    return {
        "nodes=5": '{"nodes": 5}',
        "node without kind": '{"nodes": [{"id": "n0"}]}',
        "finding missing keys": '{"nodes": [], "edges": [], "graph": {"findings": [{"kind": "x"}]}}',
        "100k-deep nesting": '{"nodes": [], "graph": {"x": ' + "[" * 100000 + "]" * 100000 + "}}",
        "65-deep nesting": '{"nodes": [], "graph": {"x": ' + "[" * 65 + "]" * 65 + "}}",
        "100k-digit int": '{"nodes": [], "graph": {"y": ' + "9" * 100000 + "}}",
        "2**70 nbytes": edit(lambda d: d["nodes"][1]["saved"].append(
            {"slot": "x", "status": "live", "shape": [1], "dtype": "float32", "device": "cpu",
             "nbytes": 2**70, "storage": None})),
        "saved is a string": edit(lambda d: d["nodes"][0].__setitem__("saved", "abc")),
        "edge to nowhere": edit(lambda d: d["edges"][0].__setitem__("target", "n999")),
        "params not a dict": edit(lambda d: d["graph"].__setitem__("params", [1])),
        "root unknown": edit(lambda d: d["graph"].__setitem__("roots", ["zz"])),
        "event params int": edit(lambda d: d["graph"].__setitem__("events", [
            {"kind": "detach", "op": "detach", "location": None, "params": [3]}])),
        "bad severity": edit(lambda d: d["graph"].__setitem__("findings", [
            {"kind": "x", "severity": "fatal", "message": "m"}])),
        "top-level list": "[1, 2]",
        "duplicate id": edit(lambda d: d["nodes"].append(dict(d["nodes"][0]))),
    }


def test_load_refuses_every_malformed_report_with_one_sentence(tmp_path):
    # each malformed file used to escape as a raw KeyError/TypeError/RecursionError/ValueError.
    good = _good_report(tmp_path)
    assert gradscope.load(tmp_path / "good.json").summary()      # the untouched file loads
    for name, text in _mutations(good).items():
        p = tmp_path / "bad.json"
        p.write_text(text)
        with pytest.raises(InputValueError, match="is not a gradscope report") as info:
            gradscope.load(p)
        assert "\n" not in str(info.value), name
        assert len(str(info.value)) < 400, name


def test_load_wrong_argument_types_and_paths(tmp_path):
    import os

    with pytest.raises(InputTypeError, match="path of a report file"):
        gradscope.load(None)
    fd_before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(InputTypeError, match="got int"):
        gradscope.load(0)                       # never opens a file descriptor
    assert len(os.listdir("/proc/self/fd")) == fd_before
    with pytest.raises(InputValueError, match="is a folder"):
        gradscope.load(tmp_path)
    with pytest.raises(InputValueError, match="NUL byte"):
        gradscope.load(str(tmp_path / "a\0b.json"))
    with pytest.raises(InputValueError, match="no such report file"):
        gradscope.load(tmp_path / "missing.json")


class _StringParams(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 1)

    def named_parameters(self, *args, **kwargs):
        yield from ["weight", "bias"]


def test_raw_python_errors_become_gradscope_errors(tmp_path):
    lin = nn.Linear(3, 1)
    report = gradscope.inspect(lin(torch.randn(2, 3)).sum(), model=lin)
    with pytest.raises(InputTypeError, match="ignore must be"):
        gradscope.watch(lin, ignore=None)
    with pytest.raises(InputValueError, match="top"):
        report.summary(top="x")
    with pytest.raises(InputValueError, match="limit must be a positive int"):
        report.render(tmp_path / "g.dot", limit="x")
    with pytest.raises(InputValueError, match="NUL"):
        report.render(str(tmp_path / "a\0b.dot"))
    bad = _StringParams()
    with pytest.raises(InputTypeError, match=r"must yield \(name, tensor\) pairs"):
        gradscope.inspect(bad.lin(torch.randn(2, 3)).sum(), model=bad)
    with gradscope.trace(bad) as tr:
        bad.lin(torch.randn(2, 3)).detach()
    assert tr.events[0]["kind"] == "detach"      # names from a broken named_parameters(): skipped


def test_multi_line_reprs_are_pasted_on_one_line():
    seq = nn.Sequential(nn.Linear(3, 1), nn.ReLU())
    for call in (lambda: gradscope.inspect(seq), lambda: gradscope.trace(torch.ones(4, 4)),
                 lambda: gradscope.watch(seq, every=torch.ones(3, 3))):
        with pytest.raises((InputTypeError, InputValueError)) as info:
            call()
        assert "\n" not in str(info.value)


def test_cli_target_whose_exception_str_raises_and_diff_of_deep_json(tmp_path):
    import subprocess
    import sys

    (tmp_path / "badstr.py").write_text(
        "class E(Exception):\n    def __str__(self):\n        raise TypeError('str exploded')\n"
        "def f():\n    raise E()\n")
    deep = tmp_path / "deep.json"
    deep.write_text('{"nodes": [], "links": [], "graph": {"x": ' + "[" * 100000 + "]" * 100000 + "}}")
    for args in (["check", "badstr.py:f"], ["diff", str(deep), str(deep)]):
        proc = subprocess.run([sys.executable, "-m", "gradscope", *args], capture_output=True, text=True,
                              cwd=tmp_path, timeout=120)
        assert proc.returncode == 2, (args, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_cli_nested_tensor_graph_is_one_line_not_a_traceback(tmp_path):
    # a nested-tensor graph, the CLI side: whatever inspect() cannot read ends in one sentence.
    import subprocess
    import sys

    (tmp_path / "nested_target.py").write_text(
        "import torch\n"
        "def f():\n"
        "    a = torch.randn(2, 3, requires_grad=True)\n"
        "    nt = torch.nested.as_nested_tensor([a * 2, a[:1] * 3])\n"
        "    return torch.nested.to_padded_tensor(nt.sin(), 0.0).sum()\n")
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "gradscope", "check", "nested_target.py:f"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.returncode in (0, 1, 2)     # a report (once the walk reads nested tensors) or one line
    if proc.returncode == 2:
        assert len(proc.stderr.strip().splitlines()) == 1 and "gradscope could not read" in proc.stderr


def test_a_100_digit_number_is_never_echoed_whole(tmp_path):
    # Every bad argument is named in one short sentence: a 100-digit number is cut, not pasted whole.
    big, digits = -(10**100), "0" * 100
    lin = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))
    with gradscope.trace(lin) as tr:
        loss = lin(torch.randn(2, 3)).sum()
    report = gradscope.inspect(loss, model=lin, trace=tr)
    good = _good_report(tmp_path)
    good["edges"][0]["target"] = 10**100
    (tmp_path / "bad.json").write_text(json.dumps(good))
    calls = {
        "watch(every=)": lambda: gradscope.watch(lin, every=big),
        "watch(vanishing=)": lambda: gradscope.watch(lin, vanishing=big),
        "summary(top=)": lambda: report.summary(top=big),
        "render(limit=)": lambda: report.render(tmp_path / "g.dot", limit=big),
        "render(collapse=)": lambda: report.render(tmp_path / "g.dot", collapse=big),
        "render(size=)": lambda: report.render(tmp_path / "g.dot", size=big),
        "render(rankdir=)": lambda: report.render(tmp_path / "g.dot", rankdir=digits),
        "explain()": lambda: report.explain("1" + digits),
        "backward_memory(target=)": lambda: report.backward_memory(target=digits),
        "what_if(batch=)": lambda: report.what_if(batch=big),
        "plan(budget=)": lambda: report.plan(budget=big),
        "plan(margin=)": lambda: report.plan(budget="1 GB", margin=big),
        "plan(offload=)": lambda: report.plan(budget="1 GB", offload=big),
        "max_batch(margin=)": lambda: report.max_batch("1 GB", margin=big),
        "DDP(world_size=)": lambda: gradscope.DDP(big),
        "Finding(kind=)": lambda: gradscope.Finding(digits, "error", "m"),
        "load(edge target)": lambda: gradscope.load(tmp_path / "bad.json"),
    }
    for name, call in calls.items():
        with pytest.raises((InputTypeError, InputValueError, gradscope.UnknownParameterError)) as info:
            call()
        text = str(info.value)
        assert digits not in text and "\n" not in text, (name, text)
        assert "..." in text, (name, text)                          # the value is shown, cut
