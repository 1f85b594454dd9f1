"""The private torch facts gradscope relies on (``gradscope/_torchcheck.py``): every probe holds on the
installed torch; a torch that lacks one still imports gradscope, and the feature that needs the fact says in
one sentence that it is not readable on that torch and what still works (``UnsupportedTorchError``, a
``RuntimeError``), or labels its number; each removal runs in a fresh process, the way a future release would."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from gradscope import _torchcheck as check

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: The facts the issue names, by the private API each covers (every one has an entry).
_NAMED = {
    "saved-tensors": "_raw_saved_",
    "function-forward-frame": "Function.apply",
    "profiler-events": "evaluate_function",
    "compiled-regions": "_lazy_backward_info",
    "distributed-tools": "torch.distributed._tools",
    "tensor-descriptors": "TensorBase",
    "fsdp2-internals": "_get_fsdp_state",
}


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                          env={**os.environ, "PYTHONPATH": _ROOT})


def test_the_registry_covers_each_named_private_api():
    for key, name in _NAMED.items():
        assert name in check.FACTS[key].reads, key
    for fact in check.FACTS.values():
        assert fact.needs and fact.still and fact.reads and callable(fact.probe), fact.key
    assert set(check.WALK) <= set(check.FACTS)


@pytest.mark.parametrize("key", sorted(check.FACTS))
def test_each_probe_holds_on_this_torch(key):
    assert check.readable(key) is None, check.readable(key)


@pytest.mark.parametrize("state", ["no_grad", "inference_mode", "meta device", "FakeTensorMode"])
def test_a_probe_holds_whatever_mode_the_caller_is_in(state):
    """A first use inside a mode (``inspect()`` under ``no_grad``, MemTracker's ``FakeTensorMode``) probes
    real CPU tensors with grad on: the answer is torch's, not the mode's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    modes = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
             "meta device": lambda: torch.device("meta"), "FakeTensorMode": FakeTensorMode}
    fast = [k for k in check.FACTS if k not in ("compiled-regions", "profiler-events")]   # the slow two aside
    for key in fast:
        check._ANSWERS.pop(key, None)
    with modes[state]():
        answers = {key: check.readable(key) for key in fast}
    assert answers == dict.fromkeys(fast), answers


def _remove(owner: str, attr: str) -> str:
    return f"import importlib, torch\ndelattr(importlib.import_module({owner!r}), {attr!r})\nimport gradscope\n"


_INSPECT = (
    "a = torch.nn.Linear(3, 1)\n"
    "r = gradscope.inspect(a(torch.randn(2, 3)).sum(), model=a)\n"
    "print('inspect', len(r.graph), r.findings)\n"
)


@pytest.mark.parametrize("owner,attr,feature,names", [
    ("torch", "_foreach_norm", "watch()'s gradient norms", "torch._foreach_norm"),
    ("torch._C", "_current_autograd_node", "watch()", "torch._C._current_autograd_node()"),
])
def test_a_missing_watch_fact_leaves_inspect_working(owner, attr, feature, names):
    done = _run(
        _remove(owner, attr) + _INSPECT
        + "try:\n"
        "    gradscope.watch(a)\n"
        "except gradscope.UnsupportedTorchError as e:\n"
        "    assert isinstance(e, RuntimeError) and isinstance(e, gradscope.GradscopeError)\n"
        "    print(e)\n"
    )
    assert done.returncode == 0, done.stderr
    first, message = done.stdout.strip().splitlines()
    assert first.startswith("inspect ") and first.endswith(" []"), first   # inspect still works, no finding
    assert message.startswith(f"{feature}") and f"not readable on torch {torch.__version__}" in message, message
    assert names in message and "inspect() and trace() still work" in message, message


def test_a_missing_walk_fact_is_one_sentence_at_first_use_and_load_still_works(tmp_path):
    saved = tmp_path / "g.json"
    done = _run(
        "import torch, gradscope\n" + _INSPECT + f"r.render({str(saved)!r})\n"
        + _remove("torch._C._autograd", "_get_sequence_nr")
        + "import gradscope.report, gradscope.inspection\n"   # importing every module still works
        + f"print('load', len(gradscope.load({str(saved)!r}).graph))\n"
        + "import gradscope._torchcheck as c; c._ANSWERS.clear()\n"   # this process probed before the removal
        + "try:\n"
        "    gradscope.inspect(a(torch.randn(2, 3)).sum())\n"
        "except gradscope.UnsupportedTorchError as e:\n"
        "    print(e)\n"
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    assert lines[0].split()[1] == lines[1].split()[1]    # the saved graph loads, same node count
    message = lines[2]
    assert message.startswith("inspect(), trace() and watch() (every walk of a live graph) is not readable on torch")
    assert "torch._C._autograd._get_sequence_nr" in message and "gradscope.load()" in message, message
    assert len(lines) == 3 and message.count(". ") == 0   # one sentence


def test_a_missing_profiler_fact_labels_the_in_node_number():
    """Without the profiler's event tag, backward_memory() still answers; each in-node figure is the
    fact's sentence (not measured), never a number."""
    done = _run(
        _remove("torch._C._profiler", "_EventType")
        + "from gradscope.memory.kernels.measure import _session\n"
        "print(_session([(0, {'op': 'MulBackward0'})], False)[0])\n"
    )
    assert done.returncode == 0, done.stderr
    message = done.stdout.strip().splitlines()[-1]
    assert message.startswith("backward_memory()'s measured in-node memory is not readable on torch"), message
    assert "labelled not measured" in message


def test_the_registry_names_every_private_torch_attribute_the_shim_reads():
    """Every ``torch.X._Y`` the shim (``gradscope/_torch.py``) reads is named by a fact."""
    import ast
    import pathlib

    src = (pathlib.Path(_ROOT) / "gradscope" / "_torch.py").read_text(encoding="utf-8")
    read = set()
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "read":
            read.add(node.args[0].value)
        elif isinstance(node, ast.Attribute):
            parts, cur = [], node
            while isinstance(cur, ast.Attribute):
                parts.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id == "torch" and any(p.startswith("_") for p in parts):
                read.add(".".join(reversed(parts)))
    listed = " ".join(f.reads for f in check.FACTS.values())
    missing = {name for name in read if name.split(".")[-1] not in listed}
    missing -= {"autograd._engine_run_backward"}     # optional: watch() looks it up with a default
    assert not missing, f"add to a fact in _torchcheck.FACTS: {sorted(missing)}"
