"""The in-node signatures and gradient layouts read from the compact columns equal those read from the node
dicts (memory/kernels/facts.py NOTE [node facts]), build no dict, and a signature looked up by its parts
(memory/kernels/signature.py ``keyed_signature``) is the one built afresh. What the signatures measure is
checked against torch.profiler in test_innode.py and test_backward_memory.py."""

from __future__ import annotations

import pytest
import torch

import gradscope
from gradscope.memory.kernels import reuse
from gradscope.memory.kernels.facts import facts
from gradscope.memory.kernels.layout import consumers_of, layout_clones, reshape_views
from gradscope.memory.kernels.signature import keyed_signature
from gradscope.memory.replay.backward import program
from gradscope.memory.replay.compile import compile_records
from gradscope.memory.replay.engine import compile_graph
from tests._memmodels import MODELS


def _keys(prog) -> list:
    cons = consumers_of(prog)
    return [None if p else keyed_signature(prog, v, cons, 1) for v, p in enumerate(prog.leaf)]


def _facts(prog) -> list:
    f = facts(prog)
    out = []
    for i in range(len(prog.name)):
        shapes, dts = f.outputs(i)
        out.append((
            [(s, None if sh is None else list(sh), st, dt, sc, stt) for s, sh, st, dt, sc, stt in f.slots(i)],
            f.values(i), [None if sh is None else list(sh) for sh in shapes], list(dts), f.function(i),
            [f.dtype(i, k) for k in range(max(len(shapes), 1))],
        ))
    return out


@pytest.mark.parametrize("name", sorted(MODELS))
def test_signatures_from_the_columns_equal_those_from_the_dicts(name):
    torch.manual_seed(0)
    model, inputs, loss_fn = MODELS[name]()
    loss = loss_fn(model, *inputs)
    fast = gradscope.inspect(loss, model=model)
    reuse.forget()
    cols = program(fast)
    records = fast.peek_graph().compact
    built = len(records._dicts)
    keys = _keys(cols)
    views, clones = reshape_views(cols), layout_clones(cols)
    assert len(records._dicts) == built  # no node dict was built for them
    assert any(k is not None for k in keys)

    slow = gradscope.inspect(loss, model=model)
    slow_records = slow.peek_graph().compact
    dicts = compile_graph(slow.graph)  # a program over the node dicts (its own derived values)
    assert _facts(cols) == _facts(dicts)
    assert _keys(dicts) == keys
    assert (reshape_views(dicts), layout_clones(dicts)) == (views, clones)

    # every dict already built (as a trace builds them): read from the dicts, the same
    ids = list(slow.graph.nodes)
    reuse.forget()
    built_all = compile_records(slow_records, ids, dict, None)
    assert len(slow_records._dicts) == len(slow_records)
    assert _facts(built_all) == _facts(dicts)
    assert _keys(built_all) == keys

    # a structure seen before (signatures looked up by their parts): the same keys and signatures
    reuse.forget()
    again = gradscope.inspect(loss, model=model)
    first = _keys(program(again))
    reuse._LAST.clear()  # the program's derived values made again; the signatures by parts kept
    looked_up = _keys(program(gradscope.inspect(loss, model=model)))
    assert looked_up == first == keys
    assert len(reuse.signatures()) <= sum(k is not None for k in keys)


def test_a_value_equal_but_of_another_type_gets_its_own_signature():
    x = torch.randn(4, 4, requires_grad=True)
    reuse.forget()
    as_int = _keys(program(gradscope.inspect(x.pow(3).sum())))
    reuse._LAST.clear()
    as_float = _keys(program(gradscope.inspect(x.pow(3.0).sum())))  # 3 == 3.0 but their JSON differs
    assert [k[0] for k in as_int if k] != [k[0] for k in as_float if k]
    assert any('"exponent":3.0' in k[0] for k in as_float if k)
