"""inspect() against the physical limit and against torchviz, measured in the same run.

For each model: node count, the time of ``gradscope.inspect`` as a ratio to
  (a) a bare iterative walk that visits every node once and reads every saved tensor's shape, dtype,
      device and storage size, with the attribute names cached per node type (what any inspector must at
      least do), and
  (b) ``torchviz.make_dot(..., show_attrs=True, show_saved=True)`` (builds the DOT source; no layout),
the per-node cost, "reads only" (the bare walk plus every other read the report's attributes need, with no
bookkeeping: the floor of any pure-Python inspect, as a ratio to (a)), and the bytes the report keeps per node
until ``report.graph`` is first touched (tracemalloc, after a warm-up call and with the node wrappers already
created by the bare walk), plus the cost of then building the DiGraph.

Targets (exit status 1 when one is missed):
  * inspect <= 3x the bare walk on every model;
  * inspect >= 5x faster than torchviz on every model where torchviz was timed;
  * per-node cost of chains flat from 1k to the largest chain (max/min <= 1.3);
  * <= 800 bytes kept per node until report.graph is touched, on every model.
Times are thread CPU time (robust to neighbours on a shared machine), medians of interleaved rounds, each
sample long enough (>= ~20 ms) to be above timer noise.

Run: ``python bench/inspect_bench.py`` (default: chains to 200k, torchviz on chains up to 50k, ~2 min),
``--quick`` (chains to 50k, fewer rounds), ``--full`` (torchviz on every chain, more rounds).
``torchviz`` is in the ``bench`` extra.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import threading
import time
import tracemalloc
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _models import MODELS, chain

import gradscope

try:
    import torchviz
except ImportError:  # pragma: no cover - bench-only dependency
    torchviz = None

TARGET_BARE, TARGET_VIZ, TARGET_FLAT, TARGET_BYTES = 3.0, 5.0, 1.3, 800
_NAMES: dict = {}


def _names(cls) -> tuple:
    """``(raw saved slots, other saved values, is a leaf)`` of one node class, read once per class."""
    attrs = dir(cls)
    raw = [a for a in attrs if a.startswith("_raw_saved_")]
    vals = [a for a in attrs if a.startswith("_saved_") and "_raw" + a not in raw]
    return raw, vals, hasattr(cls, "variable")


def bare_walk(loss, reads: bool = False) -> int:
    """The floor: visit every node once, read every saved tensor's shape/dtype/device/storage size.

    ``reads=True``: plus the other reads the report's attributes need, with no bookkeeping: saved values,
    ``_input_metadata`` (output shapes, device), ``_sequence_nr()``, versions, storage ids, unpack hooks.
    """
    root = loss.grad_fn
    seen = {root}
    stack = [root]
    while stack:
        node = stack.pop()
        cls = type(node)
        names = _NAMES.get(cls)
        if names is None:
            names = _NAMES[cls] = _names(cls)
        if reads and names[2]:
            v = node.variable
            _ = (v.shape, v.dtype, v.device, v.requires_grad)
        for a in names[0]:
            raw = getattr(node, a)
            for r in (raw if isinstance(raw, (list, tuple)) else (raw,)):
                t = r.data
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    if reads:
                        _ = (t.shape, t.dtype, t.device, st.nbytes(), st._cdata, t._version, r.unpack_hook)
                    else:
                        (t.shape, t.dtype, t.device, st.nbytes())
        if reads:
            for a in names[1]:
                getattr(node, a)
            if not names[2]:
                for m in node._input_metadata:
                    _ = (m.shape, m.device)
                node._sequence_nr()
        for child, _ in node.next_functions:
            if child is not None and child not in seen:
                seen.add(child)
                stack.append(child)
    return len(seen)


def reads_walk(loss) -> int:
    """:func:`bare_walk` with every read the report's attributes need (``reads=True``)."""
    return bare_walk(loss, reads=True)


def hf(kind: str):
    """A HF GPT-2 / BERT with 12 layers of a tiny width (real depth, so real node counts), train mode."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(n_embd=64, n_layer=12, n_head=4, vocab_size=1000, n_positions=128,
                                      bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.BertConfig(hidden_size=64, num_hidden_layers=12, num_attention_heads=4,
                                      intermediate_size=128, vocab_size=1000, max_position_embeddings=128)
        model = transformers.BertForMaskedLM(cfg)
    model.train()
    ids = torch.randint(0, 1000, (2, 32))
    return model(input_ids=ids, labels=ids).loss, model


def _per_sample(fn, target: float) -> int:
    t0 = time.thread_time()
    fn()
    dt = time.thread_time() - t0
    return max(1, int(target / max(dt, 1e-6)))


def _sample(fn, k: int) -> float:
    t0 = time.thread_time()
    for _ in range(k):
        fn()
    return (time.thread_time() - t0) / k


def _big_stack(fn):
    """Run ``fn`` on a thread with a 512 MiB stack (torchviz recurses once per graph level)."""
    out = {}

    def run():
        try:
            out["v"] = fn()
        except BaseException as exc:  # noqa: BLE001
            out["e"] = exc

    old = threading.stack_size()
    threading.stack_size(512 * 1024 * 1024)
    try:
        t = threading.Thread(target=run)
        t.start()
        t.join()
    finally:
        threading.stack_size(old)
    if "e" in out:
        raise out["e"]
    return out["v"]


def torchviz_time(loss, model, rounds: int) -> float | None:
    if torchviz is None:
        return None
    params = dict(model.named_parameters())
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(1_000_000)

    def go():
        fn = lambda: torchviz.make_dot(loss, params=params, show_attrs=True, show_saved=True)  # noqa: E731
        k = _per_sample(fn, 0.02)
        return statistics.median(_sample(fn, k) for _ in range(rounds))
    try:
        return _big_stack(go)
    finally:
        sys.setrecursionlimit(old)


def kept_bytes(loss, model) -> tuple[int, float]:
    """Bytes a report keeps until report.graph is touched, and the time to then build the DiGraph."""
    gc.collect()                             # the per-type caches are warm: the timed calls ran first
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    report = gradscope.inspect(loss, model=model)
    gc.collect()
    kept = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    t0 = time.thread_time()
    report.graph  # noqa: B018 - the lazy DiGraph
    return kept, time.thread_time() - t0


def measure(name, build, rounds: int, viz: bool) -> dict:
    torch.manual_seed(0)
    loss, model = build()
    n = bare_walk(loss)                     # also creates every node's Python wrapper
    assert f"<gradscope.Report: {n} nodes," in repr(gradscope.inspect(loss, model=model)), name
    bare = lambda: bare_walk(loss)  # noqa: E731
    reads = lambda: reads_walk(loss)  # noqa: E731
    insp = lambda: gradscope.inspect(loss, model=model)  # noqa: E731
    kb, kr, ki = _per_sample(bare, 0.02), _per_sample(reads, 0.02), _per_sample(insp, 0.02)
    t_bare, t_reads, t_gs = [], [], []
    for _ in range(rounds):                 # interleaved: neighbours' load hits all alike
        t_bare.append(_sample(bare, kb))
        t_reads.append(_sample(reads, kr))
        t_gs.append(_sample(insp, ki))
    kept, t_graph = kept_bytes(loss, model)
    t_viz = torchviz_time(loss, model, max(1, rounds // 2)) if viz else None
    return {"name": name, "nodes": n, "bare": statistics.median(t_bare), "inspect": statistics.median(t_gs),
            "reads": statistics.median(t_reads),
            "viz": t_viz, "kept": kept, "graph": t_graph}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="chains to 50k, fewer rounds")
    mode.add_argument("--full", action="store_true", help="torchviz on every chain, more rounds")
    ap.add_argument("--only", help="run only the models whose name contains this")
    args = ap.parse_args()
    rounds = 3 if args.quick else (9 if args.full else 5)
    models = {k: v for k, v in MODELS.items() if k != "chain_10k"}
    models["hf_gpt2_12L"] = lambda: hf("gpt2")
    models["hf_bert_12L"] = lambda: hf("bert")
    sizes = (1_000, 10_000, 50_000) if args.quick else (1_000, 10_000, 50_000, 200_000)
    for size in sizes:
        models[f"chain_{size // 1000}k"] = (lambda s: lambda: chain(s))(size)
    rows = []
    for name, build in models.items():
        if args.only and args.only not in name:
            continue
        big = name.startswith("chain_") and int(name[6:-1]) * 1000 > 50_000
        rows.append(measure(name, build, 1 if big and not args.full else rounds,
                            viz=args.full or not big))
        print(f"  measured {name}", file=sys.stderr, flush=True)
        gc.collect()
    return report(rows)


def report(rows: list[dict]) -> int:
    print()
    print("| model | nodes | bare walk | reads only | inspect | x bare walk | torchviz / inspect | us/node | "
          "kept B/node | report.graph |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    missed = []
    for r in rows:
        n, ratio = r["nodes"], r["inspect"] / r["bare"]
        speed = r["viz"] / r["inspect"] if r["viz"] else None
        per_node = r["kept"] / n
        if ratio > TARGET_BARE:
            missed.append(f"{r['name']}: {ratio:.2f}x the bare walk (target <= {TARGET_BARE})")
        if speed is not None and speed < TARGET_VIZ:
            missed.append(f"{r['name']}: only {speed:.1f}x faster than torchviz (target >= {TARGET_VIZ})")
        if per_node > TARGET_BYTES:
            missed.append(f"{r['name']}: keeps {per_node:.0f} B/node (target <= {TARGET_BYTES})")
        viz = f"{speed:.1f}" if speed is not None else "n/a"
        print(f"| {r['name']} | {n:,} | {_ms(r['bare'])} | {r['reads'] / r['bare']:.2f}x | {_ms(r['inspect'])} | "
              f"{ratio:.2f} | {viz} | "
              f"{r['inspect'] / n * 1e6:.2f} | {per_node:.0f} | {_ms(r['graph'])} |")
    chains = [r for r in rows if r["name"].startswith("chain_")]
    if len(chains) >= 2:
        per = [r["inspect"] / r["nodes"] for r in chains]
        spread = max(per) / min(per)
        print(f"\nchain per-node cost {min(per) * 1e6:.2f}-{max(per) * 1e6:.2f} us: spread {spread:.2f}x "
              f"(target <= {TARGET_FLAT})")
        rel = [r["inspect"] / r["bare"] for r in chains]
        print(f"(load-robust view: x bare walk {min(rel):.2f}-{max(rel):.2f}, spread {max(rel) / min(rel):.2f}x; "
              "absolute per-node times drift with the machine's load between models)")
        if spread > TARGET_FLAT:
            missed.append(f"chain per-node cost spread {spread:.2f}x (target <= {TARGET_FLAT})")
    print(f"torch {torch.__version__}, Python {sys.version.split()[0]}, "
          f"torchviz {'installed' if torchviz else 'missing (pip install torchviz)'}")
    if missed:
        print("\nTARGETS MISSED:\n  " + "\n  ".join(missed))
        return 1
    print("\nall targets met")
    return 0


def _ms(t: float) -> str:
    return f"{t * 1e3:.2f} ms" if t < 1 else f"{t:.2f} s"


if __name__ == "__main__":
    sys.exit(main())
