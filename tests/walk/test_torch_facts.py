"""The torch facts gradscope relies on (docs/internals.md), each checked against torch itself.

One test per entry of docs/internals.md that no behaviour test covers directly; the others name the
behaviour test that would fail if the fact changed. On a torch upgrade, a failure here names the fact.
"""

from __future__ import annotations

import re

import torch
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from gradscope import _torch
from gradscope.tracing.probes import is_function_forward


def test_accumulate_grad():
    x = torch.randn(3, requires_grad=True)
    acc = (x * 2).sum().grad_fn.next_functions[0][0].next_functions[0][0]
    assert type(acc) is _torch.ACCUMULATE_GRAD and acc.variable is x
    assert acc.next_functions == () and _torch.sequence_nr(acc) == _torch.NO_SEQUENCE_NR
    assert not [a for a in dir(acc) if a.startswith(_torch.SAVED_PREFIX)]


def test_next_functions():
    x = torch.randn(4, requires_grad=True)
    y = x * 3  # a Python scalar: a None entry
    assert y.grad_fn.next_functions[1] == (None, 0)
    a, b = x.split(2)
    z = a * b
    got = [(type(n).__name__, i) for n, i in z.grad_fn.next_functions]
    assert got == [("SplitBackward0", 0), ("SplitBackward0", 1)]
    emb = torch.nn.functional.embedding(torch.tensor([0, 1]), torch.randn(3, 2, requires_grad=True))
    assert len(emb.grad_fn.next_functions) == 1  # indices get no entry at all


def test_sequence_numbers():
    x = torch.randn(3, requires_grad=True)
    before = _torch.peek_sequence_nr()
    assert _torch.peek_sequence_nr() == before  # peeking does not use a number
    with torch.no_grad():
        x * 2
    assert _torch.peek_sequence_nr() == before  # a no_grad op does not advance it
    y = x.exp()
    z = y.sin()
    assert _torch.sequence_nr(y.grad_fn) == before < _torch.sequence_nr(z.grad_fn)
    # every edge points to an older node: next_functions cannot form a cycle
    assert _torch.sequence_nr(z.grad_fn.next_functions[0][0]) < _torch.sequence_nr(z.grad_fn)


def test_saved_attribute_names():
    a, b = torch.randn(3, 4, requires_grad=True), torch.randn(4, 5, requires_grad=True)
    node = (a @ b).grad_fn
    saved = {n[len(_torch.SAVED_PREFIX) :] for n in dir(node) if n.startswith(_torch.SAVED_PREFIX)}
    raw = {n[len(_torch.RAW_SAVED_PREFIX) :] for n in dir(node) if n.startswith(_torch.RAW_SAVED_PREFIX)}
    assert raw == {"self", "mat2"} and raw < saved and "self_sym_sizes" in saved
    assert isinstance(node._saved_self_sym_sizes, tuple)


def test_negative_ints_come_back_unsigned():
    x = torch.randn(2, 3, 1, requires_grad=True)
    assert x.squeeze(-1).grad_fn._saved_dim == 2**64 - 1


def test_raw_saved_tensor_data():
    x = torch.randn(4, requires_grad=True)
    y = x.sigmoid()
    raw = y.grad_fn._raw_saved_result
    assert type(raw) is _torch.SAVED_TENSOR and raw.unpack_hook is None
    with torch.no_grad():
        y.mul_(2)
    assert raw.data._version == 1  # read without the version check that _saved_result makes
    z = x.exp()
    z.sum().backward()
    assert z.grad_fn._raw_saved_result.data is None  # freed by the backward


def test_input_metadata_survives_backward():
    x = torch.randn(3, 4, 1, requires_grad=True)
    y = x.exp()
    node = y.grad_fn
    y.sum().backward()
    (meta,) = _torch.input_metadata(node)
    assert tuple(meta.shape) == (3, 4, 1) and meta.dtype == torch.float32 and meta.device.type == "cpu"


def test_storage_identity_on_meta():
    a, b = torch.empty(4, device="meta"), torch.empty(4, device="meta")
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() == 0
    assert _torch.storage_key(a) != _torch.storage_key(b) and _torch.storage_key(a) == _torch.storage_key(a[1:])
    big = torch.randn(100, 100)
    assert big[:2].nbytes == 800 and big[:2].untyped_storage().nbytes() == 40000


def test_stale_slot_error_names_both_versions():
    x = torch.randn(4, requires_grad=True)
    y = x.sigmoid()
    node = y.grad_fn
    with torch.no_grad():
        y.mul_(2)
    try:
        _ = node._saved_result
    except RuntimeError as exc:
        assert re.search(r"is at version (\d+); expected version (\d+)", str(exc)).groups() == ("1", "0")
    else:
        raise AssertionError("reading a slot written in place must raise")


def test_pack_hooks_switch_off_the_version_check():
    x = torch.randn(4, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        y = x.sigmoid()
    with torch.no_grad():
        y.mul_(2)
    y.sum().backward()  # no error: the gradient is silently wrong
    assert not torch.allclose(x.grad, torch.sigmoid(x) * (1 - torch.sigmoid(x)))


def test_freed_slot_error_text():
    x = torch.randn(3, requires_grad=True)
    y = x.exp()
    y.sum().backward()
    try:
        _ = y.grad_fn._saved_result
    except RuntimeError as exc:
        assert "backward through the graph a second time" in str(exc)
    else:
        raise AssertionError("a freed slot must raise")
    assert y.grad_fn.next_functions and _torch.sequence_nr(y.grad_fn) >= 0  # still walkable


def test_saved_tensor_hooks_payloads():
    x = torch.randn(4, requires_grad=True)
    with torch.autograd.graph.save_on_cpu():
        y = x.exp()
    data = y.grad_fn._raw_saved_result.data
    assert isinstance(data, tuple) and isinstance(data[1], torch.Tensor) and y.grad_fn._raw_saved_result.unpack_hook
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t.shape) or t, lambda t: t):
        z = x / 4.0
    assert z.grad_fn._saved_other.dim() == 0 and torch.Size([]) not in seen  # the wrapped scalar skips the hook
    scalar = (x * 2).grad_fn._saved_other
    assert scalar.dim() == 0 and scalar.dtype == torch.int64 and not scalar.requires_grad
    del z


def test_non_reentrant_checkpoint_holder_reruns_the_forward():
    calls = []
    lin = torch.nn.Linear(3, 3)

    def body(t):
        calls.append(1)
        return lin(t).sin()

    y = checkpoint(body, torch.randn(2, 3, requires_grad=True), use_reentrant=False)
    raw = y.grad_fn._raw_saved_self
    assert _torch.is_checkpoint_holder(raw.data) and raw.unpack_hook is not None
    _ = y.grad_fn._saved_self
    assert len(calls) == 2  # reading the slot ran the body again


def test_reentrant_checkpoint_hides_its_parameters():
    lin = torch.nn.Linear(3, 3)
    y = checkpoint(lin, torch.randn(2, 3, requires_grad=True), use_reentrant=True).sum()
    node = y.grad_fn.next_functions[0][0]
    assert _torch.forward_cls(node).__qualname__ == "CheckpointFunction"
    leaves = [n.variable for n, _ in node.next_functions if type(n) is _torch.ACCUMULATE_GRAD]
    assert not any(v is lin.weight for v in leaves)
    y.backward()
    assert lin.weight.grad is not None  # yet it gets a gradient


def test_custom_function_node_is_its_ctx():
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.k = 5
            ctx.save_for_backward(x)
            return x * 5

        @staticmethod
        def backward(ctx, g):
            return g * ctx.k

    x = torch.randn(3, requires_grad=True)
    node = Scale.apply(x).grad_fn
    assert node.k == 5 and _torch.forward_cls(node) is Scale and node.saved_tensors[0] is x


def test_dot_data_reaches_a_torch_function_mode_as_a_get():
    seen = []

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    x = torch.randn(2, requires_grad=True)
    with Mode():
        _ = x.data
    assert any(getattr(f, "__name__", "") == "__get__" and f.__self__ is _torch.TENSOR_DATA for f in seen)


def test_engine_callback_runs_once_after_the_backward():
    order = []
    x = torch.randn(3, requires_grad=True)
    y = x.exp().sin().sum()
    y.grad_fn.register_prehook(lambda g: _torch.queue_engine_callback(lambda: order.append("end")))
    x.register_post_accumulate_grad_hook(lambda p: order.append("acc"))
    y.backward()
    assert order == ["acc", "end"]


def test_current_node_during_backward():
    seen = []
    x = torch.randn(3, requires_grad=True)
    y = x.sin()
    y.grad_fn.register_prehook(lambda g: seen.append((_torch.current_autograd_node(), _torch.current_graph_task_id())))
    y.sum().backward()
    assert seen[0][0] is y.grad_fn and seen[0][1] >= 0
    assert _torch.current_autograd_node() is None and _torch.current_graph_task_id() == -1


def test_anomaly_mode_keeps_the_forward_traceback():
    x = torch.randn(3, requires_grad=True)
    with torch.autograd.detect_anomaly(check_nan=False):
        y = x.exp()  # the line the traceback ends with
    assert any("y = x.exp()" in line for line in y.grad_fn.metadata["traceback_"])


def test_sparse_values_of_an_uncoalesced_tensor():
    t = torch.sparse_coo_tensor(torch.tensor([[0, 0, 1]]), torch.tensor([1.0, 2.0, 3.0]), (2,))
    assert not t.is_coalesced()
    try:
        t.values()
    except RuntimeError:
        pass
    else:
        raise AssertionError("values() accepts an uncoalesced tensor now: sparse_values may use it")
    assert _torch.sparse_values(t).tolist() == [1.0, 2.0, 3.0]


def test_foreach_norm_is_a_norm_per_tensor():
    ts = [torch.randn(3, 4), torch.randn(5)]
    got = _torch.foreach_norm(ts, 2.0)
    assert all(torch.allclose(g, torch.linalg.vector_norm(t)) for g, t in zip(got, ts))


def test_attention_kernel_choice():
    """docs/internals.md#attention-kernel-choice: CPU flash without dropout (masks, grouped-query heads),
    math with dropout or 3-d inputs; meta always math; a stride-0 CPU stand-in gets the CPU answer."""
    q = torch.randn(2, 4, 8, 16, requires_grad=True)
    kv = torch.randn(2, 2, 8, 16, requires_grad=True)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    assert _torch.sdp_choice([q, q, q, None], {}) == 1
    assert _torch.sdp_choice([q, q, q, mask], {}) == 1 and _torch.sdp_choice([q, q, q, mask.float()], {}) == 1
    assert _torch.sdp_choice([q, kv, kv, None], {"enable_gqa": True}) == 1
    assert _torch.sdp_choice([q, q, q, None], {"dropout_p": 0.1}) == 0
    three_d = torch.nn.functional.scaled_dot_product_attention(q[0], q[0], q[0]).grad_fn
    if _torch.sdp_choice([q[0], q[0], q[0], None], {}) == 0:  # up to torch 2.14: 3-d inputs run math
        assert type(three_d).__name__ != "SqueezeBackward1"
    else:  # torch 2.15: flash on the inputs unsqueezed to 4-d, squeezed back
        assert type(three_d).__name__ == "SqueezeBackward1"
        assert type(three_d.next_functions[0][0]).__name__ == "ScaledDotProductFlashAttentionForCpuBackward0"
    out = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    assert type(out.grad_fn).__name__ == "ScaledDotProductFlashAttentionForCpuBackward0"
    m = q.detach().to("meta").requires_grad_()
    assert _torch.sdp_choice([m, m, m, None], {}) == 0
    stand_in = torch.empty(16).as_strided(q.shape, (0, 0, 0, 1)).requires_grad_()
    assert _torch.sdp_choice([stand_in, stand_in, stand_in, None], {}) == 1


def test_foreach_norm_dtype_refuses_float64_and_complex():
    for dtype in (torch.float64, torch.complex64):
        t = torch.ones(4, dtype=dtype)
        try:
            _torch.foreach_norm([t], 2, dtype=torch.float32)
        except RuntimeError:
            pass
        else:
            raise AssertionError(f"_foreach_norm(dtype=float32) accepts {dtype} now")
        (norm,) = _torch.foreach_norm([t], 2)
        assert not norm.is_complex() and norm.item() == 2.0
    (half,) = _torch.foreach_norm([torch.ones(4, dtype=torch.bfloat16)], 2, dtype=torch.float32)
    assert half.dtype == torch.float32 and half.item() == 2.0


def test_sums_gradient_is_expanded_and_passed_through():
    # internals.md#what-one-node-does-to-memory: sum()'s gradient is a stride-0 expand of one element;
    # t() sends a view of it, clone() and add send that same tensor: none allocates the full gradient
    x = torch.randn(4, 8, requires_grad=True)
    a = x * 2
    b = a.clone()
    c = b.t()
    d = c + 1
    seen = {}
    for name, t in (("a", a), ("b", b), ("c", c), ("d", d)):
        t.register_hook(lambda g, name=name: seen.__setitem__(name, g))
    d.sum().backward()
    assert seen["d"].stride() == (0, 0) and seen["d"].untyped_storage().nbytes() == 4
    assert seen["c"] is seen["d"]                                         # add: the same tensor
    assert seen["b"].stride() == (0, 0)                                   # t(): a view of it
    assert seen["b"].untyped_storage().data_ptr() == seen["d"].untyped_storage().data_ptr()
    assert seen["a"] is seen["b"]                                         # clone: the same tensor


def test_cat_and_stack_send_views_of_their_gradient():
    # internals.md#what-one-node-does-to-memory: cat's backward narrows the gradient it received, stack's
    # selects from it: each input's gradient is a view with the whole gradient's strides
    a, b = torch.randn(8, 2, 32, requires_grad=True), torch.randn(8, 2, 32, requires_grad=True)
    seen = {}
    for name, t in (("a", a * 1), ("b", b * 1)):
        t.register_hook(lambda g, name=name: seen.__setitem__(name, g))
        seen[name + "_t"] = t
    whole = torch.cat([seen["a_t"], seen["b_t"]], -1).transpose(0, 1)  # its gradient: (64, 512, 1)
    got = {}
    whole.register_hook(lambda g: got.__setitem__("whole", g))
    (whole * torch.randn(2, 8, 64)).sum().backward()
    assert seen["a"].stride() == (64, 512, 1) and not seen["a"].is_contiguous()
    assert seen["a"].untyped_storage().data_ptr() == got["whole"].untyped_storage().data_ptr()
    x = torch.randn(3, 4, requires_grad=True)
    y = x * 1
    y.register_hook(lambda g: seen.__setitem__("y", g))
    torch.stack([y, x * 2], 1).mul(torch.randn(3, 2, 4)).sum().backward()
    assert seen["y"].stride() == (8, 1)  # a select of the (3, 2, 4) gradient


def test_a_mode_does_not_see_calls_inside_a_function_it_handles():
    """docs/internals.md#attention-kernel-choice: while a TorchFunctionMode handles
    ``F.multi_head_attention_forward`` it is popped, so the attention call inside is not seen; the copy
    without its own check runs the body with the mode active and shows it (torch itself is unchanged)."""
    import torch.nn.functional as F

    from gradscope.memory.meta import without_torch_function_check

    seen = []

    class Mode(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", ""))
            if func is F.multi_head_attention_forward and self.inner:
                with self:
                    return without_torch_function_check(func)(*args, **(kwargs or {}))
            return func(*args, **(kwargs or {}))

    mha = torch.nn.MultiheadAttention(8, 2)
    x = torch.randn(3, 1, 8)
    for inner in (False, True):
        seen.clear()
        mode = Mode()
        mode.inner = inner
        with mode:
            mha(x, x, x, need_weights=False)
        assert ("scaled_dot_product_attention" in seen) is inner
    assert F.multi_head_attention_forward.__globals__["has_torch_function"] is not None  # torch's own, kept


def test_fsdp2_pads_the_last_rank_shard_storage_to_chunk_zero():
    """docs/internals.md#fsdp2-shards-and-ddp-buckets: rank 1 of 2 holds 2 of a Linear(3, 5) weight's 5
    rows, in a storage of chunk 0's 3 rows (the fake process group: one process, no communication)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from gradscope.memory.sharding.layout import shard_rows

    dist.init_process_group("fake", rank=1, world_size=2, store=FakeStore())
    try:
        m = torch.nn.Linear(3, 5)
        fully_shard(m, mesh=init_device_mesh("cpu", (2,)))
        local = m.weight.to_local()
        assert local.shape == (shard_rows(5, 2, 1), 3) == (2, 3)
        assert local.untyped_storage().nbytes() == shard_rows(5, 2, 0) * 3 * 4 == 36
    finally:
        dist.destroy_process_group()


def test_non_reentrant_recompute_stops_at_the_last_saved_tensor():
    # internals.md#non-reentrant-checkpoint: backward re-runs the region only until the last tensor its
    # forward saved is packed again (an op saves its inputs before it runs), so later ops do not run
    calls = []

    def fn(x):
        calls.append("sin")
        a = x.sin()                # saves x
        calls.append("cos")
        b = a.cos()                # saves a: the last pack
        calls.append("mul")
        return b * 2               # saves nothing

    x = torch.randn(4, requires_grad=True)
    y = checkpoint(fn, x, use_reentrant=False)
    calls.clear()
    y.sum().backward()
    assert calls == ["sin", "cos"]


def test_convolution_layout_on_cpu_and_on_meta():
    """CPU's convolution keeps channels-last (input or weight), for 2-d and for oneDNN's 3-d (float32), not
    for float64 3-d or 1-d; meta's returns a contiguous output and channels-last gradients from either."""
    import torch.nn.functional as F

    cl, cl3 = torch.channels_last, torch.channels_last_3d
    x, w = torch.randn(2, 4, 5, 5).contiguous(memory_format=cl), torch.randn(6, 4, 3, 3)
    assert F.conv2d(x, w).is_contiguous(memory_format=cl)
    assert F.conv2d(x.double(), w.double()).is_contiguous(memory_format=cl)
    assert F.conv2d(x.contiguous(), w.contiguous(memory_format=cl)).is_contiguous(memory_format=cl)
    x3, w3 = torch.randn(2, 4, 5, 5, 5).contiguous(memory_format=cl3), torch.randn(6, 4, 3, 3, 3)
    assert F.conv3d(x3, w3).is_contiguous(memory_format=cl3)
    y3 = F.conv3d(x3.double(), w3.double())
    assert y3.is_contiguous() and not y3.is_contiguous(memory_format=cl3)
    xm, wm = x.to("meta").requires_grad_(), w.to("meta").requires_grad_()
    out = F.conv2d(xm, wm)
    assert out.is_contiguous() and not out.is_contiguous(memory_format=cl)
    gx, gw = torch.autograd.grad(out, (xm, wm), torch.ones_like(out))
    assert gx.is_contiguous(memory_format=cl) and gw.is_contiguous(memory_format=cl) and not gx.is_contiguous()


def test_gradient_layouts_that_the_replay_follows():
    """docs/internals.md#gradient-layout: a transpose's gradient is a view (of a piece of cat's gradient
    too); bmm's, layer_norm's and mean's are contiguous whatever they read; mm's follows a column-major input."""
    import torch.nn.functional as F

    a = torch.randn(2, 16, 32, requires_grad=True)
    b = torch.randn(2, 1, 32, requires_grad=True)
    out = torch.cat([b, a], 1).transpose(1, 2)
    g = torch.randn(2, 17, 32).transpose(1, 2)
    ga, gb = torch.autograd.grad(out, (a, b), g)
    assert ga.untyped_storage().data_ptr() == g.untyped_storage().data_ptr() and ga.stride() == (544, 32, 1)
    q = torch.randn(4, 8, 16).transpose(1, 2).requires_grad_()
    k = torch.randn(4, 8, 16, requires_grad=True)
    gq, gk = torch.autograd.grad(torch.bmm(q, k), (q, k), torch.randn(4, 16, 16).transpose(1, 2))
    assert gq.is_contiguous() and gk.is_contiguous()
    x = torch.randn(2, 16, 8).transpose(1, 2).requires_grad_()
    (gx,) = torch.autograd.grad(F.layer_norm(x, (16,)), x, torch.randn(2, 16, 8).transpose(1, 2))
    assert gx.is_contiguous()
    x = torch.randn(2, 8, 4, 4).to(memory_format=torch.channels_last).requires_grad_()
    for y in (x.mean(), x.mean((2, 3)), x.mean(1, keepdim=True)):
        (gx,) = torch.autograd.grad(y.sum(), x)
        assert gx.is_contiguous() and not gx.is_contiguous(memory_format=torch.channels_last)  # mean's: new
    w = torch.randn(5, 3, requires_grad=True)
    m1 = torch.randn(3, 4).t().requires_grad_()
    g1, gw = torch.autograd.grad(F.linear(m1, w), (m1, w), torch.randn(4, 5))
    assert g1.stride() == (1, 4) and gw.is_contiguous()
    x = torch.randn(2, 64, 16).permute(0, 2, 1).reshape(2, 16, 8, 8)  # channels-last strides
    conv = torch.nn.Conv2d(16, 16, 2, stride=2)
    (gw,) = torch.autograd.grad(conv(x).sum(), conv.weight)
    assert gw.is_contiguous(memory_format=torch.channels_last) and not gw.is_contiguous()
    conv(x).sum().backward()
    assert conv.weight.grad.is_contiguous()  # AccumulateGrad cloned it into the weight's layout


def test_post_accumulate_hook_fires_only_when_grad_is_written():
    p = torch.nn.Parameter(torch.randn(3))
    pre, post = [], []
    p.register_hook(lambda g: pre.append(g is not None))
    p.register_post_accumulate_grad_hook(lambda t: post.append(1))
    torch.autograd.grad((p * 2).sum(), p)                        # computes a gradient, stores none
    assert pre == [True] and post == [] and p.grad is None
    (p * 2).sum().backward()
    assert pre == [True, True] and post == [1]
    with torch.no_grad():
        t = torch.zeros(3)
    try:
        t.register_hook(lambda g: g)
    except RuntimeError as exc:                                  # no hook on a tensor without grad
        assert "doesn't require gradient" in str(exc)
    else:
        raise AssertionError("torch took a hook on a tensor that does not require grad")


def test_functional_call_swaps_plain_tensors_in_for_one_call():
    lin = torch.nn.Linear(2, 1)
    weight, seen = lin.weight, []
    lin.register_forward_pre_hook(lambda m, a: seen.append(type(m._parameters["weight"])))
    fast = {"weight": lin.weight * 2, "bias": lin.bias.detach()}
    torch.func.functional_call(lin, fast, (torch.randn(1, 2),))
    assert seen == [torch.Tensor] and lin._parameters["weight"] is weight


def test_whole_module_pickles_its_hook_dicts():
    import io
    import pickle
    import warnings

    lin = torch.nn.Linear(2, 1)
    lin.register_forward_hook(lambda m, a, o: None)
    try:
        torch.save(lin, io.BytesIO())
    except (pickle.PicklingError, AttributeError, TypeError):
        pass                                                     # a lambda in the hook dict: refused
    else:
        raise AssertionError("torch.save pickled a lambda hook")
    lin = torch.nn.Linear(2, 1)
    lin.weight.register_hook(lambda g: g)
    buf = io.BytesIO()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        torch.save(lin, buf)                                     # a Parameter's hooks: dropped, silently
    buf.seek(0)
    assert not said and not torch.load(buf, weights_only=False).weight._backward_hooks
    plain = torch.randn(2, requires_grad=True)
    plain.register_hook(lambda g: g)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        torch.save(plain, io.BytesIO())                          # a plain tensor's: dropped, with a warning
    assert any("will not be serialized" in str(w.message) for w in said)
    plain = torch.randn(2, requires_grad=True)
    plain.register_hook(torch.utils.hooks.unserializable_hook(lambda g: g))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        torch.save(plain, io.BytesIO())
    assert not said


def test_forward_hooks_run_from_module_code_with_hook_and_self_in_locals():
    import sys

    lin, seen = torch.nn.Linear(2, 2), []

    def hook(module, args, out):
        caller = sys._getframe(1)
        seen.append((caller.f_code.co_filename, caller.f_locals.get("hook") is hook, caller.f_locals.get("self")))

    lin.register_forward_hook(hook)
    lin(torch.randn(1, 2))
    assert seen == [(torch.nn.modules.module.__file__, True, lin)]


def test_inference_mode_decorator_enters_through_decorate_context():
    import sys

    found = []

    @torch.inference_mode()
    def body():
        caller = sys._getframe(1)
        found.append((caller.f_code, getattr(caller.f_locals.get("ctx_factory"), "__self__", None)))

    body()
    (code, ctx), (other, _) = found[0], (body.__code__, None)
    assert code is other  # every decorated function's __code__ is the one decorate_context code
    assert isinstance(ctx, torch.inference_mode)


def test_new_leaves_and_detach_in_place():
    seen = []

    class Names(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(getattr(func, "__name__", ""))
            return func(*args, **(kwargs or {}))

    h = torch.randn(3, requires_grad=True) * 2
    with Names():
        p = torch.nn.Parameter(h)  # Tensor._make_subclass: no torch function is called
        q = h * 1
        q.detach_()
    assert seen == ["mul", "detach_"]
    assert p.grad_fn is None and p.is_leaf and p.requires_grad and p.data_ptr() == h.data_ptr()
    assert q.grad_fn is None and not q.requires_grad  # detach_ leaves nothing to walk afterwards
    with torch.inference_mode():
        t = torch.randn(2, requires_grad=True) * 2
    assert t.is_inference() and not t.clone().is_inference() and t.clone().grad_fn is None


def test_a_custom_functions_forward_is_on_the_stack_under_grad_off():
    """Inside ``Function.apply`` the frame that runs is the subclass's own ``forward`` (old style with
    ``ctx``, ``setup_context`` style, inherited), with grad disabled; ``Function.apply`` itself has a
    frame up to 2.14 and none from 2.15 (a builtin), so trace() looks for the forward frame."""
    import sys

    seen: list = []

    class Old(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append((sys._getframe(0).f_code, torch.is_grad_enabled()))
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 2

    class New(torch.autograd.Function):
        @staticmethod
        def forward(x):
            seen.append((sys._getframe(0).f_code, torch.is_grad_enabled()))
            return x * 3

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            return g * 3

    class Inherits(Old):
        pass

    x = torch.ones(2, requires_grad=True)
    Old.apply(x), New.apply(x), Inherits.apply(x)
    assert [grad for _, grad in seen] == [False, False, False]
    assert all(is_function_forward(code) for code, _ in seen)
    assert seen[0][0] is seen[2][0]  # the inherited forward is the base's code

    def forward(x):  # a plain function named forward, and an nn.Module's forward, are not
        return sys._getframe(0).f_code

    assert not is_function_forward(forward(x))
    assert not is_function_forward(torch.nn.Linear.forward.__code__)


def test_a_tuple_of_saved_tensors_refuses_to_be_read_once_freed():
    buf = torch.zeros(4, 2)
    x = torch.randn(2, 2, requires_grad=True)
    buf[torch.tensor([0, 1])] = x * 2
    node = buf.grad_fn
    assert type(node).__name__ == "IndexPutBackward0"
    assert isinstance(getattr(node, _torch.RAW_SAVED_PREFIX + "indices"), tuple)  # a tuple, not one SavedTensor
    buf.sum().backward()
    try:
        getattr(node, _torch.RAW_SAVED_PREFIX + "indices")
    except RuntimeError as exc:
        assert "backward through the graph a second time" in str(exc)
    else:
        raise AssertionError("torch read a freed tuple of saved tensors")
