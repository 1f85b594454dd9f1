"""Can the compiler's own recompute knob be predicted without real compute? Evidence for ``plan(budget=)``
answering with ``torch._functorch.config.activation_memory_budget`` (issue 34), measured in one run.

torch 2.13 keeps no joint graph of a compiled region (``_forward_cls`` holds ``compiled_fw``, ``metadata``
and ``_lazy_backward_info`` with ``bw_module``, ``placeholder_list``, ``saved_context``; dynamo's compiled
function holds AOT's runtime wrappers, no ``GraphModule``), so the min-cut partitioner cannot be re-run on
the region that exists. The route probed here: a ``meta`` copy of the model compiled (``aot_eager``, whose
partitioner is ``min_cut_rematerialization_partition``) under ``config.patch(activation_memory_budget=b)``,
its forward run on meta inputs under ``gradscope.memory.kernels_on_meta("cpu")``, then
``backward_memory()``; against the model compiled for real at the same budget and one step measured by
torch.profiler (tests/_memtruth.measure). Target: the predicted backward peak and absolute peak equal to
the measured ones within 1%, and the meta region saving the same tensors as the real one; exit 1 on a miss.

``--fake``: the other route, the model's forward traced by ``aot_function`` (``torch.func.functional_call``
over CPU fake tensors, ``FakeTensorMode``: no real compute) with a partition function that records what
``min_cut_rematerialization_partition`` saves at the budget, against the tensors the real compiled region
saves (``node.saved_tensors``). Target: the same saved bytes; exit 1 on a miss.

    python bench/compiler_budget_probe.py               # mlp and attn at budgets 1.0, 0.5, 0.0
    python bench/compiler_budget_probe.py mlp 0.3       # one model, one budget
    python bench/compiler_budget_probe.py --fake        # the aot_function route: saved tensors only
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

import gradscope
from tests._compiled_mem import build
from tests._memtruth import measure


def _region(loss):
    todo = [loss.grad_fn]
    while todo:
        n = todo.pop()
        if n is not None and "CompiledFunction" in type(n).__name__:
            return n
        if n is not None:
            todo += [f for f, _ in n.next_functions]
    return None


def _saved(node) -> list:
    return [(tuple(t.shape), t.dtype) for t in node.saved_tensors] if node is not None else []


def probe(name: str, budget: float) -> tuple[int, int, int, int, bool]:
    model, _, inputs, loss = build(name, "aot_eager")
    torch._dynamo.reset()
    meta_model = copy.deepcopy(model).to("meta")
    meta_in = [t.to("meta") for t in inputs]
    with torch._functorch.config.patch(activation_memory_budget=budget):
        compiled = torch.compile(meta_model, backend="aot_eager")
        with gradscope.memory.kernels_on_meta("cpu"):
            meta_loss = loss(compiled, *meta_in)
    pred = gradscope.inspect(meta_loss, model=compiled).backward_memory(inputs=meta_in)
    meta_saved = _saved(_region(meta_loss))
    torch._dynamo.reset()
    with torch._functorch.config.patch(activation_memory_budget=budget):
        real = torch.compile(model, backend="aot_eager")
        real_saved = _saved(_region(loss(real, *inputs)))
        gradscope.inspect(loss(real, *inputs), model=real).backward_memory(inputs=list(inputs))  # warm the cache
        truth = measure(lambda: (loss(real, *inputs), real), before=list(inputs))
    return pred.peak, truth.peak, pred.absolute_peak, truth.absolute_peak, meta_saved == real_saved


def fake_saved(name: str, budget: float) -> tuple[list, list]:
    """``(saved shapes the partitioner picks on CPU fake tensors, saved shapes of the real compiled region)``."""
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    model, _, inputs, loss = build(name, "aot_eager")
    got: dict = {}

    def partition(joint, joint_inputs, **kw):
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kw)
        got["bw"] = bw
        return fw, bw

    mode = FakeTensorMode()
    names = [k for k, _ in model.named_parameters()] + [k for k, _ in model.named_buffers()]
    state = [mode.from_tensor(p).requires_grad_(True) for _, p in model.named_parameters()]
    state += [mode.from_tensor(b) for _, b in model.named_buffers()]  # BatchNorm's running stats, fake too
    fakes = [mode.from_tensor(t) for t in inputs]

    def forward(*args):
        n = len(names)
        return functional_call(model, dict(zip(names, args[:n])), tuple(args[n:])).sum()

    with torch._functorch.config.patch(activation_memory_budget=budget):
        fn = aot_function(forward, fw_compiler=lambda g, _: g, partition_fn=partition)
        with mode:
            fn(*state, *fakes)
    phs = [n for n in got["bw"].graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
    predicted = [tuple(n.meta["val"].shape) for n in phs if isinstance(n.meta.get("val"), torch.Tensor)]
    torch._dynamo.reset()
    with torch._functorch.config.patch(activation_memory_budget=budget):
        real = torch.compile(model, backend="aot_eager")
        measured = _saved(_region(loss(real, *inputs)))
    return predicted, [shape for shape, _ in measured]


def _numel_bytes(shapes: list) -> int:
    return sum(4 * int(torch.Size(s).numel()) for s in shapes)  # the probe's models are float32


def main_fake(runs: list) -> int:
    missed = 0
    print(f"{'model':6} {'budget':>6} {'saved (fake)':>13} {'saved (real)':>13}  same shapes  verdict")
    for name, budget in runs:
        predicted, real = fake_saved(name, budget)
        ok = _numel_bytes(predicted) == _numel_bytes(real)
        missed += not ok
        print(f"{name:6} {budget:6.2f} {_numel_bytes(predicted):11d} B {_numel_bytes(real):11d} B  "
              f"{str(sorted(predicted) == sorted(real)):11}  {'ok' if ok else 'MISS'}", flush=True)
    print(f"{missed} missed target(s)")
    return 1 if missed else 0


def main(argv: list[str]) -> int:
    fake = "--fake" in argv
    argv = [a for a in argv if a != "--fake"]
    if fake:
        return main_fake([(argv[0], float(argv[1]))] if len(argv) == 2
                         else [(n, b) for n in ("mlp", "attn", "conv") for b in (1.0, 0.5, 0.0)])
    runs = [(argv[0], float(argv[1]))] if len(argv) == 2 else [(n, b) for n in ("mlp", "attn") for b in (1.0, 0.5, 0.0)]
    missed = 0
    print(f"{'model':6} {'budget':>6} {'pred peak':>10} {'measured':>10} {'err':>8} {'pred abs':>10} {'measured':>10} "
          f"{'err':>8}  same saved  verdict")
    for name, budget in runs:
        p, t, pa, ta, same = probe(name, budget)
        e, ea = (p - t) / t, (pa - ta) / ta
        ok = same and abs(e) <= 0.01 and abs(ea) <= 0.01
        missed += not ok
        print(f"{name:6} {budget:6.2f} {p:10d} {t:10d} {100 * e:+7.2f}% {pa:10d} {ta:10d} {100 * ea:+7.2f}%  "
              f"{str(same):10}  {'ok' if ok else 'MISS'}", flush=True)
    print(f"{missed} missed target(s)")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
