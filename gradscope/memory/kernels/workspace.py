"""In-node memory: what a backward node allocates and frees before it returns (no graph shows it).

NOTE [in-node memory]
Inside one node, a backward formula allocates temporaries besides the gradients it returns: oneDNN
reorders and scratchpads in ``convolution_backward`` (a depthwise convolution on a channels-last input
allocates several times its input), the intermediates of a composite formula (``logsumexp``, ``gelu``,
a custom Function's ``backward``), sorting buffers in ``embedding_dense_backward``. Their size depends on
the op, the shapes, the strides, the dtype, the thread count and the algorithm a library picks, so no
closed formula holds. gradscope measures every node type the same way: a node's signature
(``signature.py``: op, saved tensors with shape, strides and dtype, saved values, the inputs that need a
gradient, the layout of the gradients it receives) is run again on fresh random CPU tensors
(``rebuild.py``: the op's forward found among torch's operators, then ``torch.autograd.grad``), all
distinct signatures in one torch.profiler session (``measure.py``), and the highest point above what the
backward leaves behind is the node's in-node memory. Results are cached per signature in
``~/.cache/gradscope/innode-<torch>-<source>.json`` (``GRADSCOPE_CACHE`` sets the folder), where
``<source>`` is a hash of the source of the modules that produce the entries (this package,
``gradscope/memory/kernels/``): after a change to how a signature is keyed, rebuilt or measured, the
old file is no longer read. Only measurements are written: a failure (an op the rebuild cannot match,
measuring switched off, a custom Function not run) is kept for this process only and tried again by the
next one. A signature with a
tensor above ``measure.LIMIT`` (1 MiB) is measured at two smaller sizes and extrapolated (``measure.py``
says how), so a 7B-parameter model's shapes cost seconds. A custom
Function's backward is run on fake tensors (``fake.py``: NOTE [custom backwards on fake tensors]) when
that is safe, on real random tensors with ``run_custom=True``; its entry is keyed by which and by a
digest of its code. What cannot be measured (a custom Function's backward that is not safe or not pure
tensor code, an op the rebuild cannot match) is returned as unmodelled with the reason: the peak is then a
lower bound. A step replayed
in another dtype (FSDP2's ``param_dtype``: ``sharding/precision.py``) gives its nodes that dtype, so a
bfloat16 kernel is measured as one (on the CPU a bfloat16 matmul's backward allocates float32 temporaries
that a float32 one does not).
``GRADSCOPE_WORKSPACE=0`` switches measuring off (cached values are still used; the rest is unmodelled).
"""

from __future__ import annotations

import hashlib
import json
import marshal
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

from gradscope.memory.kernels.reuse import derived
from gradscope.memory.kernels.signature import consumers_of, keyed_signature, signature_key

__all__ = ["InNode", "innode", "cache_path"]

_MEMO: dict = {}
_LOADED: list = []


@dataclass(frozen=True, slots=True)
class InNode:
    """In-node memory of the nodes of one program (indices into it).

    Attributes:
        bytes: node index -> bytes allocated and freed inside it (only nodes that have some).
        full: node index -> the bytes of its first gradient when measured (for a scaled replay).
        unmodelled: node index -> why its in-node memory is not known.
        extrapolated: node indices whose value was extrapolated from smaller sizes.
        notes: sentences for the printed result (a profiler was running...).
        how: node index -> how a custom Function's backward was run to measure it (``fake.FAKE`` or
            ``fake.REAL``).
    """

    bytes: dict = field(default_factory=dict)
    full: dict = field(default_factory=dict)
    unmodelled: dict = field(default_factory=dict)
    extrapolated: frozenset = frozenset()
    notes: tuple = ()
    how: dict = field(default_factory=dict)


_PATHS: dict = {}  # (GRADSCOPE_CACHE, HOME) -> the cache file


def cache_path() -> str:
    """The cache file of this machine's measurements (``GRADSCOPE_CACHE`` sets its folder)."""
    env = os.environ.get("GRADSCOPE_CACHE"), os.environ.get("HOME")
    path = _PATHS.get(env)
    if path is None:
        import torch

        folder = env[0] or os.path.join(os.path.expanduser("~"), ".cache", "gradscope")
        name = f"innode-{torch.__version__.split('+')[0]}-{source_key()}.json"
        path = _PATHS[env] = os.path.join(folder, name)
    return path


#: The measuring method's version: a cache file written by another version is not read (its entries may
#: have been measured differently), and is replaced on the next save.
METHOD = 4

_SOURCE: list = []


def source_key() -> str:
    """A hash of what produces the cache's entries: the source of every module of this package (how a
    signature is keyed, rebuilt, measured and extrapolated) and ``METHOD``. Where the source cannot be read
    (an installation without ``.py`` files), the key is this process's own: no file is reused."""
    if not _SOURCE:
        import hashlib

        h = hashlib.sha256(f"method {METHOD}".encode())
        folder = os.path.dirname(os.path.abspath(__file__))
        try:
            names = sorted(n for n in os.listdir(folder) if n.endswith(".py"))
        except OSError:
            names = []
        for n in names:
            try:
                with open(os.path.join(folder, n), "rb") as f:
                    h.update(n.encode() + b"\0" + f.read())
            except OSError:
                names = []
                break
        if not names:  # no source to read: the measuring code cannot be told apart, so never reuse a file
            h.update(f"unread {os.getpid()}".encode())
        _SOURCE.append(h.hexdigest()[:16])
    return _SOURCE[0]


def _measured(entries: dict) -> dict:
    """The entries that are measurements (a failure is never written to, nor read from, the file)."""
    return {k: v for k, v in entries.items() if isinstance(v, dict) and "error" not in v}


def _load() -> dict:
    path = cache_path()
    if not _LOADED or _LOADED[0] != path:
        _LOADED[:] = [path]
        _MEMO.clear()
        try:
            with open(path) as f:
                data = json.load(f)
            if isinstance(data, dict) and data.get("method") == METHOD and data.get("source") == source_key():
                _MEMO.update(_measured(data.get("entries") or {}))
        except (OSError, ValueError):
            pass
    return _MEMO


def _save() -> None:
    path = cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"method": METHOD, "source": source_key(), "entries": _measured(_MEMO)}, f)
        os.replace(tmp, path)
    except OSError:
        pass


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _grad_bytes(prog, v: int) -> int:
    gb = prog.grad_bytes[v]
    return int(gb[0]) if gb else 0


def _measure_missing(keys: dict, memo: dict, run_custom: bool) -> tuple[str, ...]:
    """Measure the signatures not cached yet (``{key: signature}``); returns notes for the output."""
    from gradscope.memory.kernels.measure import measure

    todo = [k for k in keys if k not in memo]
    if not todo:
        return ()
    if os.environ.get("GRADSCOPE_WORKSPACE", "1") == "0":
        for k in todo:
            memo.setdefault(
                k, {"error": "in-node memory measuring is switched off (GRADSCOPE_WORKSPACE=0)", "retry": 1}
            )
        return ()
    results, elsewhere = measure([keys[k] for k in todo], run_custom)
    for k, r in zip(todo, results):
        memo[k] = r
    _save()
    if elsewhere:
        return (
            "A torch.profiler was running, so in-node memory was measured in a separate Python process "
            "(custom autograd.Functions on fake tensors, here).",
        )
    return ()


def custom_key(sig: dict, run_custom: bool) -> str:
    """The cache key of a custom Function's signature: its JSON text, how it is run, and a digest of its
    backward's code (an edited backward is measured again)."""
    from gradscope.memory.kernels.custom import Unmeasurable, function_class

    try:
        code = getattr(function_class(sig).backward, "__code__", None)
    except Unmeasurable:
        code = None
    digest = "" if code is None else hashlib.sha1(marshal.dumps(code)).hexdigest()[:16]
    return f"{signature_key(sig)}|{'real' if run_custom else 'fake'}|{digest}"


def innode(prog, nodes: Iterable[int], run_custom: bool = False) -> InNode:
    """In-node memory of ``nodes`` (op indices of a compiled program), measured once per signature.

    Each node's signature is kept with the program's structure (NOTE [signature reuse]), so a later call (a
    what-if, the same report again, a graph of the same structure) only looks the measurements up.
    """
    threads = _threads()
    keys_of = derived(prog).setdefault(("innode keys", threads), {})
    memo = _load()
    cons = None
    keys: dict = {}
    unmodelled: dict = {}
    custom: dict = {}  # node index -> its key, for custom Functions (how they run is this call's)
    nodes = list(nodes)
    for v in nodes:
        key = keys_of.get(v, 0)
        if key == 0:
            if cons is None:
                cons = consumers_of(prog)
            key = keys_of[v] = keyed_signature(prog, v, cons, threads)
        if key is None:
            unmodelled[v] = f"the shapes {prog.name[v]} needs are not recorded"
        else:
            if key[1].get("function"):  # user code: keyed by how it is run and by its code
                key = custom[v] = (custom_key(key[1], run_custom), key[1])
            keys.setdefault(key[0], key[1])
    notes = _measure_missing(keys, memo, run_custom)
    out_bytes, full, extra, how = {}, {}, set(), {}
    for v in nodes:
        key = custom.get(v) or keys_of.get(v)
        if key is None:
            continue
        r = memo.get(key[0]) or {"error": "not measured"}
        if "error" in r:
            unmodelled[v] = r["error"]
            if r.get("retry"):
                memo.pop(key[0], None)
            continue
        if r.get("how"):
            how[v] = r["how"]
        if r.get("bytes"):
            out_bytes[v] = int(r["bytes"])
            full[v] = _grad_bytes(prog, v)
        if r.get("extrapolated"):
            extra.add(v)
    return InNode(out_bytes, full, unmodelled, frozenset(extra), notes, how)


def scaled(res: InNode, v: int, grad_scale) -> int:
    """Node ``v``'s in-node bytes, scaled with its gradient when the replay resizes tensors."""
    w = res.bytes.get(v, 0)
    full = res.full.get(v, 0)
    if not w or grad_scale is None or not full:
        return w
    return int(round(w * grad_scale(v, 0, full) / full))


__all__ += ["scaled"]


def cache_entries() -> dict:
    """The in-node cache's entries (read from the file once per path): other measurers keep theirs here too,
    under keys of their own (``memory/kernels/regions.py``)."""
    return _load()


def save_cache() -> None:
    """Write the in-node cache's entries to its file."""
    _save()


__all__ += ["cache_entries", "save_cache"]
