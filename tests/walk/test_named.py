"""The model structure cache (NOTE [model structure cache], gradscope/walk/named.py) against torch itself.

Every call must give what torch's ``named_parameters()`` / ``buffers()`` give at that moment, whatever the
model went through since the last call (a parameter added, replaced, deleted, renamed or frozen, a buffer
or a submodule swapped, a class patched), and the cache must keep no module or tensor alive.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

import gradscope
from gradscope.walk import named
from gradscope.walk.named import model_buffers, names_and_buffers, param_names
from tests.conftest import grads_none


def _truth(model) -> list:
    return [(id(p), (n, p)) for n, p in model.named_parameters()]


def _check(model) -> None:
    """Two calls (the second one from the cache) agree with torch: the same names, tensors and order."""
    for _ in range(2):
        names, buffers = names_and_buffers(model)
        assert [(k, (n, id(p))) for k, (n, p) in names.items()] == [(k, (n, id(p))) for k, (n, p) in _truth(model)]
        assert all(names[k][1] is p for k, (_, p) in _truth(model))
        assert sorted(map(id, buffers)) == sorted(id(b) for m in model.modules() for b in m._buffers.values()
                                                  if b is not None)
        assert {id(b) for b in buffers} == {id(b) for b in model.buffers()}
        assert param_names(model) == names and [id(b) for b in model_buffers(model)] == [id(b) for b in buffers]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4)
        self.b = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        self.head = nn.Linear(2, 2)

    def forward(self, x):
        return self.head(self.b(self.bn(self.a(x))))


def test_hits_the_cache_and_agrees_with_torch():
    m = Net()
    _check(m)
    entry = named._LAST[0]
    assert entry is not None and entry.valid(m) is not None
    names_and_buffers(m)
    assert named._LAST[0] is entry  # the second call used it


def test_shared_parameters_and_modules_and_none_entries():
    m = Net()
    m.tied = nn.Linear(2, 2)
    m.tied.weight = m.head.weight  # one tensor, two names: the first one counts, like torch
    m.again = m.b  # one submodule under two names: visited once
    m.register_parameter("nothing", None)
    m.register_buffer("none_buffer", None)
    m.bn.register_buffer("alias", m.bn.running_mean)  # one buffer twice: both kept
    _check(m)
    _check(nn.DataParallel(m).module)
    assert names_and_buffers(nn.DataParallel(m))[0].keys() == names_and_buffers(m)[0].keys()


@pytest.mark.parametrize("change", ["add", "replace", "delete-readd", "none", "rename", "buffer", "buffer-replace",
                                    "submodule", "submodule-replace", "submodule-delete", "class"])
def test_sees_every_change_between_calls(change):
    m = Net()
    _check(m)
    if change == "add":
        m.b[0].register_parameter("extra", nn.Parameter(torch.ones(3)))
    elif change == "replace":
        m.a.weight = nn.Parameter(torch.randn(4, 3))
    elif change == "delete-readd":  # the new tensor may well get the old one's address (and id)
        del m.a.weight
        gc.collect()
        m.a.weight = nn.Parameter(torch.randn(4, 3))
    elif change == "none":
        m.head.bias = None
    elif change == "rename":
        m.a._parameters["w"] = m.a._parameters.pop("weight")
    elif change == "buffer":
        m.head.register_buffer("scale", torch.ones(2))
    elif change == "buffer-replace":
        m.bn.running_var = torch.ones(4)
    elif change == "submodule":
        m.b.add_module("extra", nn.Linear(2, 2))
    elif change == "submodule-replace":
        m.b[2] = nn.Linear(4, 2)
    elif change == "submodule-delete":
        del m.b[2]
        gc.collect()
    elif change == "class":
        class Renamed(nn.Linear):
            def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
                for n, p in super().named_parameters(prefix, recurse, remove_duplicate):
                    yield n.replace("weight", "w"), p

        m.head.__class__ = Renamed  # torch's named_parameters() of the parent does not call it: same names
    _check(m)


def test_a_patched_class_is_seen():
    class Plain(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

    m = Plain()
    _check(m)
    Plain.named_parameters = lambda self, *a, **k: iter([("renamed", self.w)])  # type: ignore[method-assign]
    try:
        assert names_and_buffers(m)[0] == {id(m.w): ("renamed", m.w)} == dict(_truth(m))
    finally:
        del Plain.named_parameters
    _check(m)


def test_inspect_sees_a_parameter_added_replaced_or_frozen():
    """The findings follow the model between calls; ground truth: which .grad torch leaves None."""
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    x = torch.randn(2, 3)

    def unused():
        loss = m(x).sum()
        report = gradscope.inspect(loss, model=m)
        m.zero_grad(set_to_none=True)
        loss.backward()
        found = {p for f in report.findings if f.kind == "unused-parameter" for p in f.params}
        assert found == grads_none(m)
        return found

    assert unused() == set()
    m[1].register_parameter("spare", nn.Parameter(torch.ones(3)))  # added, never used
    assert unused() == {"1.spare"}
    m[1].spare.requires_grad_(False)  # frozen: no gradient expected any more
    assert unused() == set()
    old = m[0].weight
    m[0].weight = nn.Parameter(torch.randn(3, 3))  # replaced: the report names the new tensor
    assert unused() == set()
    loss = m(x).sum()
    params = gradscope.inspect(loss, model=m).graph.graph["params"]
    assert params["0.weight"]["pid"] == id(m[0].weight) != id(old)
    assert params["1.spare"]["requires_grad"] is False
    m[1].spare.requires_grad_(True)
    assert gradscope.inspect(loss, model=m).graph.graph["params"]["1.spare"]["requires_grad"] is True


def test_keeps_no_module_or_tensor_alive():
    m = Net()
    names_and_buffers(m)
    old = weakref.ref(m.a.weight)
    m.a.weight = nn.Parameter(torch.randn(4, 3))  # the cache must not hold the replaced tensor
    gc.collect()
    assert old() is None
    names_and_buffers(m)
    refs = [weakref.ref(m), weakref.ref(m.b), weakref.ref(m.head.weight), weakref.ref(m.bn.running_mean)]
    del m
    gc.collect()
    assert [r() for r in refs] == [None] * 4


def test_odd_modules_fall_back_to_torch():
    class OwnNames(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(2))

        def named_parameters(self, prefix="", recurse=True, remove_duplicate=True):
            yield "custom", self.w

    m = OwnNames()
    assert names_and_buffers(m)[0] == {id(m.w): ("custom", m.w)}
    assert named._LAST[0] is None  # not cached
    weird = nn.Linear(2, 2)
    weird._parameters["junk"] = 3  # not a tensor: the same clear error as without the cache
    with pytest.raises(gradscope.errors.InputTypeError, match="must yield"):
        names_and_buffers(weird)
    with pytest.raises(gradscope.errors.InputTypeError, match="model= must be a torch.nn.Module"):
        names_and_buffers(object())


def test_no_tensor_is_referenced_not_even_weakly():
    """A weak reference on a parameter would make torch.utils.swap_tensors (module.to() in swap mode) raise."""
    m = Net()
    gradscope.inspect(m(torch.randn(2, 3)).sum(), model=m)
    assert named._LAST[0] is not None
    assert all(not weakref.getweakrefs(t) for t in [*m.parameters(), *m.buffers()])
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        m.to(torch.float64)  # swaps every parameter: raises if one has a weak reference
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    assert m.a.weight.dtype == torch.float64
    _check(m)


def test_an_id_reused_by_another_type_is_not_taken_for_the_old_tensor():
    m = Net()
    names_and_buffers(m)
    entry = named._LAST[0]
    m.a._parameters["weight"] = "junk"  # as if "junk" had been given the freed weight's address:
    sig = list(entry.sig)
    sig[2] = named._read(list(map(named._CALL, entry.mod_refs)))[0][2]  # the ids now match
    entry.sig = tuple(sig)
    assert entry.valid(m) is None  # the types still tell them apart
    with pytest.raises(gradscope.errors.InputTypeError, match="must yield"):
        names_and_buffers(m)


def test_graph_params_are_each_tensors_state_now():
    """graph["params"] reads as torch says, reached or not,
    frozen or not, with a .grad or not, and with a params= entry shadowing a model name."""
    m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2), nn.Linear(2, 2))
    m[1].bias.requires_grad_(False)
    m[0](torch.randn(1, 3)).sum().backward()  # m[0] has a .grad now
    loss = m[1](m[0](torch.randn(2, 3))).sum()  # m[2] not reached
    other = torch.zeros(5, requires_grad=True)

    def expect(name, p, node):
        return {"requires_grad": p.requires_grad, "shape": list(p.shape), "dtype": str(p.dtype).split(".")[1],
                "node": node, "storage": None, "grad": p.grad is not None, "pid": id(p)}

    for params in (None, {"0.weight": other}):
        graph = gradscope.inspect(loss, model=m, params=params).graph
        got = graph.graph["params"]
        nodes = {d["name"]: n for n, d in graph.nodes(data=True) if d["kind"] == "param"}
        for name, p in m.named_parameters():
            want = expect(name, p, nodes.get(name))
            sid = got[name]["storage"]
            assert {**got[name], "storage": None} == want or (params and name == "0.weight"), name
            assert sid is None or graph.graph["storage_bytes"][sid] == p.untyped_storage().nbytes()
        if params:  # the later entry wins the name, as before: the shadowing tensor, never reached
            assert got["0.weight"]["pid"] == id(other) and got["0.weight"]["shape"] == [5]
            assert got["0.weight"]["grad"] is False and got["0.weight"]["node"] == nodes["0.weight"]
