"""backward_memory() of torch.compile'd models against torch.profiler (tests/_memtruth.measure, CPU): the
region's backward replayed from its AOT backward graph (NOTE [compiled region memory], NOTE [node
sub-programs]). Targets: aot_eager within 1%; inductor, replayed unfused, a labelled upper bound (never
low); never more than 1% low without the lower-bound label. The default profile runs the tiny models on
aot_eager; the rest are slow (compiling takes seconds)."""

from __future__ import annotations

import pytest
import torch

import gradscope
from gradscope.memory.kernels.regions import UPPER
from tests._compiled_mem import MODELS, build, run_case, run_steps

pytestmark = pytest.mark.usefixtures("module_cache_dir")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _check(name: str, backend: str, grad_set: bool, tol: float, optimizer: str = "adamw") -> None:
    truth, bm = run_case(name, backend, grad_set, optimizer)
    assert bm.names == truth.order
    assert bm.levels == truth.levels  # what the region leaves: its outputs, its saved tensors freed
    err = (bm.peak - truth.peak) / truth.peak
    step = (bm.first_step.absolute_peak - truth.absolute_peak) / truth.absolute_peak
    if bm.unmodelled:  # a labelled lower bound may be low, never high
        assert err <= tol and step <= tol, (bm.peak, truth.peak)
        return
    if any(UPPER in n for n in bm.notes):  # inductor's fused code: a labelled upper bound, never low
        assert err >= -0.01 and step >= -0.01, (bm.peak, truth.peak, bm.first_step.absolute_peak, truth.absolute_peak)
        return
    assert abs(err) <= tol, (bm.peak, truth.peak, bm.inner, truth.inner)
    assert abs(step) <= tol, (bm.first_step.absolute_peak, truth.absolute_peak)


@pytest.mark.parametrize("name", ["mlp-tiny", "attn-tiny", "conv-tiny"])
@pytest.mark.parametrize("grad_set", [False, True], ids=["nograd", "grad"])
def test_aot_eager_tiny_matches_the_profiler(name, grad_set):
    _check(name, "aot_eager", grad_set, 0.01)


@pytest.mark.parametrize("name", ["mlp-tiny", "attn-tiny"])
def test_retain_graph_keeps_the_regions_saved_tensors(name):
    """With retain_graph=True the node keeps its saved tensors (no step releases them): every level, the
    peak and the end as measured."""
    from tests._memtruth import measure

    torch.manual_seed(0)
    model = torch.compile(MODELS[name].make(), backend="aot_eager")
    (x,) = MODELS[name].data()
    gradscope.inspect(model(x).sum(), model=model).backward_memory(retain_graph=True)  # warm the cache
    truth = measure(lambda: (model(x).sum(), model), before=[x], retain_graph=True,
                    inspect=lambda loss, m: gradscope.inspect(loss, model=m),
                    predict=lambda r, _: r.backward_memory(retain_graph=True))
    bm = truth.prediction
    assert bm.levels == truth.levels and bm.peak == truth.peak and bm.end == truth.end


def test_the_region_is_modelled_not_a_lower_bound():
    """Before, the region's in-node memory was unknown (a custom Function's backward): now its steps are read."""
    truth, bm = run_case("mlp-tiny", "aot_eager", False)
    assert not bm.unmodelled
    assert bm.peak_node is not None and "CompiledFunction" in str(truth.report.graph.nodes[bm.peak_node]["name"])


def test_an_unread_region_is_a_lower_bound(monkeypatch):
    """When the backward graph cannot be read the answer says so (never an exact-looking number)."""
    import gradscope.walk.regionmem as regionmem

    monkeypatch.setattr(regionmem, "compiled_region", lambda node: "not readable on torch X")
    model = torch.compile(MODELS["mlp-tiny"].make(), backend="aot_eager")
    (x,) = MODELS["mlp-tiny"].data()
    bm = gradscope.inspect(model(x).sum(), model=model).backward_memory()
    assert bm.unmodelled
    assert "not readable on torch X" in str(bm)


def test_a_batch_scaled_replay_scales_the_region():
    """The what-if machinery's batch scale (``Overrides(scale=batch_scale(2, 8))``) resizes the region's own
    allocations: the prediction at batch 8 x 2 against the same model compiled and measured at batch 16."""
    from gradscope.memory.replay.backward import Overrides, batch_scale, replay
    from tests._memtruth import measure

    torch.manual_seed(0)
    model = MODELS["mlp-tiny"].make()
    cm = torch.compile(model, backend="aot_eager")
    x = torch.randn(8, 16)
    r = gradscope.inspect(cm(x).sum(), model=cm)
    scaled = replay(r, Overrides(scale=batch_scale(2.0, 8)))
    torch._dynamo.reset()
    cm2 = torch.compile(model, backend="aot_eager")
    x2 = torch.randn(16, 16)
    truth = measure(lambda: (cm2(x2).sum(), cm2), before=[x2])
    assert scaled.peak != r.backward_memory().peak  # the region grew with the batch
    assert abs(scaled.peak - truth.peak) <= 0.01 * truth.peak, (scaled.peak, truth.peak)


@pytest.mark.parametrize("name", ["break-tiny", "mlp-dyn-tiny"])
def test_graph_breaks_and_dynamic_shapes_match_the_profiler(name):
    """Two regions (a graph break: the second region's incoming gradient dies at its last use inside the
    graph, not when the node returns) and a region traced with symbolic sizes, SGD with momentum."""
    _check(name, "aot_eager", False, 0.01, optimizer="sgd")


def test_a_dynamic_region_is_replayed_at_this_runs_sizes():
    """Compiled with dynamic=True at batch 8, asked at batch 16: the graph's values carry the traced example's
    sizes; the replay uses this run's (before: -30%)."""
    from tests._memtruth import measure

    model, cm, (x,), loss = build("mlp-dyn-tiny", "aot_eager")
    loss(cm, x).backward()
    x2 = torch.randn(16, 16)
    gradscope.inspect(loss(cm, x2), model=cm).backward_memory()  # warm the cache
    truth = measure(lambda: (loss(cm, x2), cm), before=[x2], inspect=lambda r, m: gradscope.inspect(r, model=m),
                    predict=lambda r, _: r.backward_memory())
    bm = truth.prediction
    assert not bm.unmodelled
    assert bm.levels == truth.levels and bm.peak == truth.peak


def test_first_and_later_steps_match_three_real_steps():
    """The first step (no optimizer state yet) and the later ones (SGD's momentum buffers alive through
    backward) of a compiled model, against three profiled steps of a training loop."""
    steps, bm = run_steps("mlp-tiny", "aot_eager", "sgd")
    assert steps[1] > steps[0]  # the momentum buffers
    assert abs(bm.first_step.absolute_peak - steps[0]) <= 0.01 * steps[0], (bm.first_step, steps)
    assert abs(bm.later_step.absolute_peak - max(steps[1:])) <= 0.01 * max(steps[1:]), (bm.later_step, steps)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "attn", "conv", "gpt2", "break", "attn-dyn"])
@pytest.mark.parametrize("grad_set", [False, True], ids=["nograd", "grad"])
def test_aot_eager_matches_the_profiler(name, grad_set):
    if name == "gpt2":
        pytest.importorskip("transformers")
    _check(name, "aot_eager", grad_set, 0.01)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "attn", "conv", "gpt2", "break", "attn-dyn"])
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_first_and_later_steps_all_models(name, optimizer):
    if name == "gpt2":
        pytest.importorskip("transformers")
    steps, bm = run_steps(name, "aot_eager", optimizer)
    assert abs(bm.first_step.absolute_peak - steps[0]) <= 0.01 * steps[0], (bm.first_step, steps)
    assert abs(bm.later_step.absolute_peak - max(steps[1:])) <= 0.01 * max(steps[1:]), (bm.later_step, steps)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mlp", "attn", "conv", "mlp-tiny", "gpt2", "break", "attn-dyn"])
@pytest.mark.parametrize("grad_set", [False, True], ids=["nograd", "grad"])
def test_inductor_within_its_target(name, grad_set):
    if name == "gpt2":
        pytest.importorskip("transformers")
    _check(name, "inductor", grad_set, 0.05)
