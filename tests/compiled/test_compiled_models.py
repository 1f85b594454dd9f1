"""A suite of compiled models, judged by torch's own ``.grad`` after a real backward.

MLP, attention block, conv net, a graph break through numpy, GPT-2 (transformers): each compiled with
``aot_eager`` and ``inductor`` (inductor on the heavier ones only with ``--slow``), ``fullgraph=True``,
``dynamic=True``; inspected plain and under ``gradscope.trace()``. 0 false positives, 0 misses, the user's
names everywhere a name is printed (no ``_orig_mod.``). One compile per case (module-scoped).
"""

from __future__ import annotations

import os

import pytest
import torch

import gradscope
from tests.compiled import _models as M

CUTS = ("unused-parameter", "detached-branch")
MODELS_FILE = os.path.basename(M.__file__)

SLOW = pytest.mark.slow
CASES = [  # (key, model class, model kwargs, torch.compile kwargs); the slow ones compile for a minute on 2 cores
    pytest.param(("mlp", M.MLP, {}, dict(backend="aot_eager")), id="mlp-aot_eager"),
    pytest.param(("mlp", M.MLP, {}, dict(backend="inductor")), id="mlp-inductor"),
    pytest.param(("mlp", M.MLP, {}, dict(backend="aot_eager", fullgraph=True)), id="mlp-fullgraph"),
    pytest.param(("mlp", M.MLP, {}, dict(backend="aot_eager", dynamic=True)), id="mlp-dynamic", marks=SLOW),
    pytest.param(("attention", M.Attention, {}, dict(backend="aot_eager")), id="attention-aot_eager"),
    pytest.param(("attention", M.Attention, {}, dict(backend="inductor")), id="attention-inductor", marks=SLOW),
    pytest.param(("conv", M.ConvNet, {}, dict(backend="aot_eager")), id="conv-aot_eager", marks=SLOW),
    pytest.param(("conv", M.ConvNet, dict(graph_break=True), dict(backend="aot_eager")), id="conv-graph-break"),
    pytest.param(("conv", M.ConvNet, {}, dict(backend="inductor")), id="conv-inductor", marks=SLOW),
    pytest.param(("numpy", M.ThroughNumpy, {}, dict(backend="aot_eager")), id="numpy-aot_eager"),
    pytest.param(("numpy", M.ThroughNumpy, {}, dict(backend="inductor")), id="numpy-inductor", marks=SLOW),
    pytest.param(("hf-head", M.HFHead, {}, dict(backend="aot_eager")), id="gpt2-head-aot_eager"),
    pytest.param(("hf-lm", M.HFLM, {}, dict(backend="aot_eager")), id="gpt2-lm-aot_eager", marks=SLOW),
    pytest.param(("hf-head", M.HFHead, {}, dict(backend="inductor")), id="gpt2-head-inductor", marks=SLOW),
]
#: Traced runs of these recompile around trace()'s module hooks (graph breaks) for long: only with --slow.
TRACED_SLOW = ("hf-head", "hf-lm", "attention")

#: What torch leaves without .grad, per model (the test also asserts torch agrees: not vacuous).
EXPECTED = {
    "mlp": {"fc2.weight", "fc2.bias", "aux.weight", "aux.bias"},
    "attention": {"k.weight", "k.bias"},
    "conv": {"skip.weight", "skip.bias"},
    "numpy": {"first.weight", "first.bias"},
    "hf-head": "gpt.",  # every parameter of the GPT-2 body
    "hf-lm": set(),
}


def _flagged(report) -> set[str]:
    return {p for f in report.findings if f.kind in CUTS for p in f.params}


class Case:
    """One compiled model: its plain report (taken before backward), torch's verdict, and on demand the
    report of a second forward under ``gradscope.trace()``."""

    def __init__(self, key, cls, model_kw, compile_kw):
        torch._dynamo.reset()
        torch.manual_seed(0)
        self.key, self.model, self.fullgraph = key, cls(**model_kw), bool(compile_kw.get("fullgraph"))
        self.compiled = torch.compile(self.model, **compile_kw)
        self.x = M.example(self.model)
        loss = self.compiled(self.x)
        self.plain = gradscope.inspect(loss, model=self.compiled)
        loss.backward()
        self.truth = {n for n, p in self.model.named_parameters() if p.requires_grad and p.grad is None}
        self._traced = None

    def report(self, mode: str, slow: bool):
        if mode == "plain":
            return self.plain
        if self.key in TRACED_SLOW and not slow:
            pytest.skip("traced, this model recompiles at every module hook: run with --slow")
        if self.fullgraph:
            pytest.xfail("trace()'s module hooks call threading.get_ident, which dynamo cannot trace: "
                         "fullgraph=True raises under trace() (reported, not fixed here)")
        if self._traced is None:
            self.model.zero_grad(set_to_none=True)
            with gradscope.trace() as tr:
                loss = self.compiled(self.x)
            self._traced = gradscope.inspect(loss, model=self.compiled, trace=tr)
            loss.backward()
            again = {n for n, p in self.model.named_parameters() if p.requires_grad and p.grad is None}
            assert again == self.truth
        return self._traced


@pytest.fixture(scope="module", params=CASES)
def case(request):
    yield Case(*request.param)
    torch._dynamo.reset()


@pytest.fixture(params=["plain", "traced"])
def report(request, case):
    return case.report(request.param, request.config.getoption("--slow"))


def test_torch_leaves_the_expected_parameters_without_grad(case):
    want = EXPECTED[case.key]
    if isinstance(want, str):
        want = {n for n, _ in case.model.named_parameters() if n.startswith(want)}
        assert len(want) > 10
    assert case.truth == want


def test_findings_match_torchs_grads(case, report):
    assert _flagged(report) == case.truth
    assert report.ok == (not case.truth)


def test_names_are_the_users(case, report):
    texts = [f.message for f in report.findings] + [report.summary(), report.to_dot().source]
    texts += [report.explain(p) for p in sorted(case.truth)[:4]]
    texts += [report.explain(n) for n, _ in list(case.model.named_parameters())[:2]]
    assert not [t for t in texts if "_orig_mod" in t]
    assert set(report.graph.graph["params"]) == {n for n, _ in case.model.named_parameters()}


def test_every_cut_says_where_and_what_to_do(case, report):
    for p in case.truth:
        text = report.explain(p)
        assert ".grad" in text and "None" in text, text
    for f in report.findings:
        if f.kind == "detached-branch":
            assert f.location and f.location.startswith(MODELS_FILE + ":"), (f.location, f.message)
    for name, _ in case.model.named_parameters():
        if name not in case.truth:
            assert "reached from the root" in report.explain(name)
            break
