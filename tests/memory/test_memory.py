"""report.memory(): totals against what torch's saved_tensors_hooks see during the same forward.

Ground truth: the same forward (same seed, same inputs) run a second time under an identity pack hook that
records every packed tensor's storage (``untyped_storage()._cdata``, ``nbytes()``). The hooked forward is
run separately from the inspected one because pack hooks disable autograd's version check
(docs/internals.md#pack-hooks-and-the-version-check); wrapped Python scalars never reach pack hooks and are
not counted by gradscope either.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import gradscope
from gradscope.errors import InputValueError
from gradscope.memory.table import NO_MODULE, module_bytes, node_bytes
from tests._zoo import Linears


def packed(fn):
    """Run ``fn()`` under an identity pack hook: ({cdata: nbytes}, {cdata: device}, result)."""
    sizes: dict[int, int] = {}
    devices: dict[int, str] = {}

    def pack(t):
        st = t.untyped_storage()
        sizes.setdefault(st._cdata, st.nbytes())
        devices.setdefault(st._cdata, str(t.device))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sizes, devices, out


def truth_and_report(forward, model, seed=0):
    """Hook ground truth of one forward, and the report of an identical, unhooked forward."""
    torch.manual_seed(seed)
    sizes, devices, out = packed(forward)
    param_cdata = {p.untyped_storage()._cdata for p in model.parameters()}
    param_bytes = sum(n for c, n in sizes.items() if c in param_cdata)
    del out
    torch.manual_seed(seed)
    loss = forward()
    return sizes, devices, param_bytes, gradscope.inspect(loss, model=model), loss


class ResBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class TinyResNet(nn.Module):
    def __init__(self, c=8):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU())
        self.blocks = nn.Sequential(ResBlock(c), ResBlock(c))
        self.fc = nn.Linear(c, 10)

    def forward(self, x):
        return self.fc(self.blocks(self.stem(x)).mean(dim=(2, 3)))


def transformer_case():
    model = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True).train()
    x = torch.randn(2, 6, 32)
    return (lambda: model(x).pow(2).mean()), model


def resnet_case():
    model = TinyResNet().train()
    x = torch.randn(2, 3, 12, 12)
    y = torch.tensor([1, 3])
    return (lambda: F.cross_entropy(model(x), y)), model


@pytest.mark.parametrize("case", [transformer_case, resnet_case], ids=["transformer", "resnet"])
def test_totals_equal_saved_tensors_hooks(case):
    forward, model = case()
    sizes, _, param_bytes, report, loss = truth_and_report(forward, model)
    table = report.memory()
    assert report.saved_bytes == sum(sizes.values())
    assert table.saved_bytes == report.saved_bytes
    assert sum(r.held + r.params for r in table) == report.saved_bytes
    assert table.total.params == param_bytes > 0          # weights saved by reference, found by storage
    assert table.total.held == sum(sizes.values()) - param_bytes
    for by in ("op", "node"):
        assert report.memory(by=by).saved_bytes == report.saved_bytes
    assert sum(module_bytes(report.graph, params=True).values()) == report.saved_bytes
    assert sum(node_bytes(report.graph).values()) == table.total.held
    loss.backward()                                        # the report kept nothing alive that breaks it
    assert all(p.grad is not None for p in model.parameters())


def test_rows_sorted_by_bytes_and_printable():
    forward, model = transformer_case()
    report = gradscope.inspect(forward(), model=model)
    table = report.memory()
    keys = [r.held + r.offloaded for r in table]
    assert keys == sorted(keys, reverse=True)
    text = str(table)
    assert "linear1" in text and "KiB" in text and text.splitlines()[-1].startswith("total")
    assert "<table" in table._repr_html_()
    assert report.memory(top=2)[:] == table[:2] and report.memory(top=2).total == table.total


def test_view_of_large_tensor_counts_whole_storage_once():
    base = torch.randn(100, 100, requires_grad=True)

    def forward():
        b = base * 1.0                          # a 100x100 non-leaf: 40,000 bytes
        return b[:2].sin().sum() + b[50:52].cos().sum()   # two (2, 100) views of it are saved

    sizes, _, _ = packed(forward)
    report = gradscope.inspect(forward(), params={"base": base})
    views = [e for _, d in report.graph.nodes(data=True) for e in d["saved"] if e["shape"] == [2, 100]]
    assert len(views) == 2 and views[0]["storage"] == views[1]["storage"]
    assert all(e["nbytes"] == 40_000 for e in views)
    assert report.saved_bytes == sum(sizes.values()) == 40_000
    table = report.memory(by="op")
    assert table.total.held == 40_000 and table.total.shared == 1
    assert table.row("SinBackward0").held + table.row("CosBackward0").held == 40_000
    assert table.row("SinBackward0").shared == table.row("CosBackward0").shared == 1


def test_parameters_saved_by_mm_addmm_are_parameters():
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4, bias=False), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(5, 8)
    sizes, _, param_bytes, report, _ = truth_and_report(lambda: model(x).sum(), model)
    by_op = report.memory(by="op")
    weights = 16 * 4 * 4 + 4 * 2 * 4                      # layers 2 and 4 save weight.t(); layer 0 doesn't
    assert param_bytes == weights
    assert by_op.row("MmBackward0").params == 16 * 4 * 4 and by_op.row("AddmmBackward0").params == 4 * 2 * 4
    assert by_op.total.params == weights and by_op.total.held == sum(sizes.values()) - weights
    by_module = report.memory()
    assert by_module.row("2").params == 256 and by_module.row("4").params == 32
    assert by_module.row("0").params == 0


def test_shared_storage_is_attributed_to_first_saver():
    class Two(Linears):
        LAYERS = {"a": (8, 8), "b": (8, 8)}

        def forward(self, x):
            h = torch.tanh(x)                    # h is saved by tanh, a's addmm and b's addmm
            return self.a(h).sum() + self.b(h).sum()

    model = Two()
    x = torch.randn(4, 8, requires_grad=True)
    report = gradscope.inspect(model(x), model=model)
    table = report.memory()
    h_bytes = 4 * 8 * 4
    assert table.row(NO_MODULE).held == h_bytes            # tanh runs first: it owns h
    assert table.row("a").held == table.row("b").held == 0
    assert {table.row(m).shared for m in (NO_MODULE, "a", "b")} == {1}
    (share,) = table.sharing
    assert share.owner == NO_MODULE and set(share.others) == {"a", "b"} and share.nbytes == h_bytes


def test_traced_module_names_win_over_inference():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    report = gradscope.inspect(model(torch.randn(2, 4)).sum(), model=model)
    relu = next(n for n, d in report.graph.nodes(data=True) if d["name"] == "ReluBackward0")
    assert report.memory().row(NO_MODULE).held == 2 * 4 * 4
    report.graph.nodes[relu]["module"] = "1"                # what gradscope.trace() writes
    assert report.memory().row("1").held == 2 * 4 * 4
    assert "by module" in report.summary() and "1 " in report.summary()


def test_with_trace_every_activation_has_its_module():
    forward, model = transformer_case()
    with gradscope.trace() as tr:
        loss = forward()
    report = gradscope.inspect(loss, model=model, trace=tr)
    table = report.memory()
    names = {r.name for r in table if r.held}
    assert {"linear1", "linear2", "norm1", "norm2", "self_attn"} <= names
    assert table.row("dropout").held == 2 * 6 * 64 * 4        # the scaled dropout mask after linear1's ReLU
    assert table.saved_bytes == report.saved_bytes
    line = next(x for x in report.summary().splitlines() if x.startswith("Saved memory by module"))
    assert table[0].name in line


def test_checkpoint_slots_are_recomputed_and_hold_nothing():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
    calls = []
    block.register_forward_pre_hook(lambda *_: calls.append(1))
    x = torch.randn(8, 16, requires_grad=True)
    plain = gradscope.inspect(block(x).sum(), model=block)

    def forward():
        return checkpoint(block, x, use_reentrant=False).tanh().sum()

    sizes, _, _ = packed(forward)       # the hook sees what checkpoint keeps: its input, and tanh's output
    calls.clear()
    ck_loss = forward()
    ck = gradscope.inspect(ck_loss, model=block)
    assert len(calls) == 1                                  # inspect() did not re-run the block
    table = ck.memory()
    recomputed = sum(e["status"] == "recomputed" for _, d in ck.graph.nodes(data=True) for e in d["saved"])
    assert table.total.recomputed == recomputed > 0
    assert ck.saved_bytes == table.saved_bytes == sum(sizes.values())
    inputs = [e for _, d in ck.graph.nodes(data=True) for e in d["saved"] if e["slot"].startswith("checkpoint")]
    assert [(e["shape"], e["nbytes"]) for e in inputs] == [([8, 16], 8 * 16 * 4)]   # x, listed once
    assert table.total.held < plain.memory().total.held
    assert "recomputed by checkpoint" in str(table)
    ck_loss.backward()                                      # backward recomputes once, as torch intends
    assert x.grad is not None and len(calls) == 2


def test_save_on_cpu_moves_bytes():
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    x = torch.randn(6, 8)
    plain = gradscope.inspect(model(x).sum(), model=model)
    with torch.autograd.graph.save_on_cpu():
        loss = model(x).sum()
    report = gradscope.inspect(loss, model=model)
    table = report.memory()
    assert report.saved_bytes == table.saved_bytes == 0
    assert table.total.offloaded == plain.saved_bytes > 0
    assert table.devices["cpu"].offloaded == plain.saved_bytes
    assert "moved to the CPU" in str(table)
    loss.backward()
    assert model[0].weight.grad is not None


def test_meta_device_totals():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))
        x = torch.randn(32, 64)
    sizes, devices, _, report, _ = truth_and_report(lambda: model(x).pow(2).mean(), model)
    table = report.memory()
    assert set(table.devices) == {"meta"} and not table.spans_devices
    assert table.devices["meta"].held + table.devices["meta"].params == sum(sizes.values())
    assert report.saved_bytes == sum(sizes.values())
    assert "meta" in str(table) and "no real memory" in str(table)


def test_graph_spanning_devices_lists_copies():
    a = nn.Linear(8, 8)
    b = nn.Linear(8, 4, device="meta")
    x = torch.randn(3, 8)
    params = {**{f"a.{k}": v for k, v in a.named_parameters()}, **{f"b.{k}": v for k, v in b.named_parameters()}}

    def forward():
        return b(a(x).relu().to("meta")).pow(2).mean()

    sizes, devices, _ = packed(forward)
    report = gradscope.inspect(forward(), params=params)
    table = report.memory()
    assert table.spans_devices and set(table.devices) == {"cpu", "meta"}
    for dev in ("cpu", "meta"):
        truth = sum(n for c, n in sizes.items() if devices[c] == dev)
        assert table.devices[dev].held + table.devices[dev].params == truth
    assert [(c.name, c.source, c.target) for c in table.copies] == [("ToCopyBackward0", "cpu", "meta")]
    assert "spans 2 devices" in str(table) and "ToCopyBackward0" in str(table)


def test_after_backward_nothing_is_held():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    loss = model(torch.randn(3, 4)).sum()
    loss.backward()
    table = gradscope.inspect(loss, model=model).memory()
    assert table.saved_bytes == 0 and table.freed > 0 and "freed" in str(table)


def test_json_round_trip_gives_the_same_table(tmp_path):
    forward, model = transformer_case()
    report = gradscope.inspect(forward(), model=model)
    path = tmp_path / "r.json"
    path.write_text(json.dumps(report.to_json()))
    again = gradscope.load(path).memory()
    assert list(again) == list(report.memory()) and again.total == report.memory().total


def test_svg_bar_chart():
    forward, model = transformer_case()
    table = gradscope.inspect(forward(), model=model).memory()
    svg = table.to_svg(top=4)
    root = ET.fromstring(svg)
    assert root.tag.endswith("svg")
    texts = "".join(root.itertext())
    assert all(r.name in texts for r in table[:4]) and table[4].name not in texts.split("\n")


def test_bad_arguments_are_sentences():
    report = gradscope.inspect(nn.Linear(2, 1)(torch.randn(1, 2)).sum())
    with pytest.raises(InputValueError, match=r"memory\(by='layer'\).*'module', 'op', 'node'"):
        report.memory(by="layer")
    with pytest.raises(InputValueError, match=r"memory\(depth=0\) must be a positive integer"):
        report.memory(depth=0)


def test_depth_merges_submodules():
    forward, model = transformer_case()
    report = gradscope.inspect(forward(), model=model)
    fine, coarse = report.memory(), report.memory(depth=1)
    assert coarse.row("self_attn").held == fine.row("self_attn").held + fine.row("self_attn.out_proj").held
    assert "self_attn.out_proj" not in {r.name for r in coarse} and coarse.saved_bytes == report.saved_bytes


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_save_on_cpu_and_copy_nodes():
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4)).cuda()
    x = torch.randn(6, 8, requires_grad=True)

    def forward():
        return model(x.cuda()).sum()

    sizes, devices, _, plain, _ = truth_and_report(forward, model)
    table = plain.memory()
    assert plain.saved_bytes == sum(sizes.values())
    assert table.spans_devices and [(c.name, c.source, c.target) for c in table.copies] == \
        [("ToCopyBackward0", "cpu", "cuda:0")]
    with torch.autograd.graph.save_on_cpu():
        loss = forward()
    moved = gradscope.inspect(loss, model=model).memory()
    assert moved.saved_bytes == 0 and moved.devices["cuda:0"].offloaded == moved.total.offloaded > 0
    loss.backward()
    assert x.grad is not None
