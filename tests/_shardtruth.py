"""Per-rank memory of one DDP / FSDP2 training step, measured: gloo ranks spawned on this machine, each under
torch.profiler from before the model is built; the truth is the running sum of the trace's ``[memory]``
events (CPU, all threads), its highest value from the step's start to the end of ``optimizer.step()``."""

from __future__ import annotations

import datetime
import fnmatch
import gc
import json
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.profiler import ProfilerActivity, profile, record_function

from tests._shardmodels import SHARDED, batch, build, loss_of
from tests._steptruth import trace_events

__all__ = ["measure", "free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wrap(model, cfg: dict, world: int):
    kind = cfg["kind"]
    cfg = {"model": "mlp", **cfg}
    if cfg.get("ckpt"):
        from tests._steptruth import apply_changes

        pat = cfg.get("modules", SHARDED[cfg["model"]])
        apply_changes(model, checkpoint_names=[n for n, _ in model.named_modules() if fnmatch.fnmatchcase(n, pat)
                                               and n.count(".") == pat.count(".")])
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # init_sync=False: every rank builds the same seeded model, and the initial broadcast's flat buffer is
        # freed by whichever thread drops it last; a free on gloo's worker thread is missing from the trace
        return DistributedDataParallel(model, gradient_as_bucket_view=cfg.get("bucket_view", False),
                                       bucket_cap_mb=cfg.get("bucket_cap_mb", 25), init_sync=False)
    if kind == "single":
        return model
    if kind == "code":  # the code a plan wrote, run as written (``model`` and ``device`` are the user's names)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        names = {"torch": torch, "model": model, "device": "cpu", "init_device_mesh": init_device_mesh,
                 "fully_shard": fully_shard, "MixedPrecisionPolicy": MixedPrecisionPolicy,
                 "CPUOffloadPolicy": CPUOffloadPolicy}
        exec(cfg["code"], names)
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    kw: dict = {"mesh": mesh, "reshard_after_forward": cfg.get("reshard", True)}
    if cfg.get("mp"):
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if cfg.get("offload"):
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)  # pinning needs an accelerator
    done: list[str] = []  # the outermost module of each match, as gradscope.FSDP reads ``modules``
    for name, _ in model.named_modules():
        if fnmatch.fnmatchcase(name, cfg.get("modules", SHARDED[cfg["model"]])):
            if not any(name.startswith(d + ".") for d in done):
                done.append(name)
    for name in reversed(done):  # children before parents, as fully_shard wants
        fully_shard(model.get_submodule(name), **kw)
    root = dict(kw)
    root.pop("reshard_after_forward")
    fully_shard(model, **root)
    return model


def _sizes(mem, how: str = "high") -> list[int]:
    """Each ``[memory]`` event's size, with the frees the trace lost put back.

    NOTE [lost frees]
    Some frees are missing from the trace: on FSDP2 over gloo, a reduce-scatter input (the group's unsharded
    gradients, padded) whose last reference goes with gloo's work object, off the thread the step runs on.
    The allocator later hands out the same address again with no free recorded in between, and the running
    sum keeps counting the block for the rest of the job: +1 block per lost free, more in every later step
    (the "spread between identical runs"). A block's free is lost when an allocation reuses its address while
    it is still counted; the free is then applied just before that allocation, the latest moment it can have
    happened: the level stays an upper bound of what was alive, never below it (``"high"``, the default).
    ``"low"`` counts such a block not at all (freed the moment it was made): a lower bound. What was alive lies
    between the two; ``"raw"`` is the trace as it is.
    """
    live: dict = {}
    out = []
    lost_at: set = set()  # indices of the allocations whose free was lost
    if os.environ.get("GS_SHARD_RAW"):  # the trace as it is (to compare)
        how = "raw"
    for k, e in enumerate(mem):
        n = int(e["args"]["Bytes"])
        addr = e["args"].get("Addr")
        lost = 0
        if n > 0 and addr is not None and how != "raw" and addr in live:
            old, lost = live.pop(addr)
            lost_at.add(old)
        if n > 0 and addr is not None:
            live[addr] = (k, n)
        elif addr is not None:
            live.pop(addr, None)
        out.append(n - lost)
    if how == "low":  # the lost blocks never counted: their allocation and their correction both left out
        mem_n = [int(e["args"]["Bytes"]) for e in mem]
        out = [0 if k in lost_at else (mem_n[k] if d != mem_n[k] else d) for k, d in enumerate(out)]
    return out


def lost_frees(mem) -> int:
    """How many frees the trace lost (NOTE [lost frees])."""
    return sum(1 for e, n in zip(mem, _sizes(mem)) if n != int(e["args"]["Bytes"]))


def _fixed(fix) -> str:
    return "high" if fix is True else ("raw" if fix is False else fix)


def _curve(traced, marker: str, how: str = "high") -> dict:
    events, mem = traced
    start = min(e["ts"] for e in events if e.get("name") == marker)
    level, peak, at_start = 0, 0, None
    for e, n in zip(mem, _sizes(mem, how)):
        if at_start is None and e["ts"] >= start:
            at_start = level
        level += n
        if e["ts"] >= start:
            peak = max(peak, level)
    dump = os.environ.get("GS_SHARD_DUMP")
    if dump:
        marks = [(e["ts"], e["name"]) for e in events if e.get("ph") == "X" and (
            e["name"].startswith("FSDP") or e["name"].startswith("gradscope") or "Optimizer" in e["name"]
            or e["name"].startswith("autograd::engine::evaluate_function"))]
        with open(f"{dump}.{os.getpid()}.{len(os.listdir(os.path.dirname(dump)))}.json", "w") as f:
            json.dump({"start": start, "mem": [(e["ts"], e["tid"], int(e["args"]["Bytes"]), e["args"].get("Addr"))
                                                for e in mem],
                       "marks": marks}, f)
    if os.environ.get("GS_SHARD_DIAG"):
        main = mem[0]["tid"]
        big = [(round(e["ts"] - start), e["tid"] == main, e["args"]["Bytes"], e["args"].get("Addr")) for e in mem
               if abs(int(e["args"]["Bytes"])) > 200_000 and e["ts"] >= start - 1e6]
        print(os.getpid(), peak, big, flush=True)
    return {"peak": peak, "start": at_start or level, "end": level}


def _step_peaks(traced, marker: str, fix: bool | str = True) -> list[int]:
    """The running sum's highest point within each ``marker`` window (each step, to the next one's start);
    ``fix=False``: without NOTE [lost frees]'s correction (the trace as it is); ``"low"``: its lower bound."""
    events, mem = traced
    starts = sorted(e["ts"] for e in events if e.get("name") == marker) + [float("inf")]
    level, peaks, i = 0, [], -1
    for e, n in zip(mem, _sizes(mem, _fixed(fix))):
        while e["ts"] >= starts[i + 1]:
            i += 1
            peaks.append(level)
        level += n
        if i >= 0:
            peaks[i] = max(peaks[i], level)
    return peaks + [level] * (len(starts) - 1 - len(peaks))


def _one(rank: int, world: int, model_name: str, model_kw: dict, cfg: dict, n: int) -> dict:
    gc.collect()  # the previous run's model (DDP and FSDP2 objects hold reference cycles) goes now
    gc.disable()  # and no collection runs inside the step
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model = _wrap(build(model_name, **model_kw), cfg, world)
        opt = torch.optim.AdamW(model.parameters()) if cfg.get("opt", True) else None
        x = batch(model_name, n, seed=1 + rank, **model_kw)
        for k in range(cfg.get("steps", 1)):  # a job of several steps: zero_grad(set_to_none=True) between
            if k:
                opt.zero_grad(set_to_none=True)
            with record_function("gradscope-test::step"):
                loss = loss_of(model(x))
                loss.backward()
                held = _host_held(model, opt)
                stepped = opt is not None
                if stepped:
                    with record_function("gradscope-test::optstep"):
                        opt.step()
            del loss
        del model, opt
    gc.enable()
    traced = trace_events(prof)
    out = _curve(traced, "gradscope-test::step")
    out["lost"] = lost_frees(traced[1])
    if cfg.get("steps", 1) > 1:  # each step's own peak (from its start to the next one's)
        out["steps"] = _step_peaks(traced, "gradscope-test::step")
        out["raw_steps"] = _step_peaks(traced, "gradscope-test::step", fix=False)
        out["low_steps"] = _step_peaks(traced, "gradscope-test::step", fix="low")
    if stepped:  # the host's peak under CPU offload: what it holds at the step's start plus the step's rise
        step = _curve(traced, "gradscope-test::optstep", "raw")  # a rise: a correction inside it would shorten it
        out["host"] = held + step["peak"] - step["start"]
    return out


def _host_held(model, opt) -> int:
    """Bytes of the storages of the local shards, their gradients and the optimizer state (each storage once)."""
    seen: dict = {}

    def add(t) -> None:
        if isinstance(t, torch.Tensor):
            t = getattr(t, "_local_tensor", t)
            st = t.untyped_storage()
            seen[st.data_ptr() or id(t)] = st.nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    for st in (opt.state.values() if opt is not None else ()):
        for v in st.values():
            add(v)
    return sum(seen.values())


def _inspected(rank: int, world: int, model_name: str, model_kw: dict, cfg: dict, n: int) -> dict:
    """``inspect(loss, model=wrapped)`` on this rank, before backward: the spec it read, the rank, and
    ``what_if(optimizer=opt).ranks`` (one step: the same forward, loss and optimizer as a measured run)."""
    import gradscope

    model = _wrap(build(model_name, **model_kw), cfg, world)
    opt = torch.optim.AdamW(model.parameters()) if cfg.get("opt", True) else None
    x = batch(model_name, n, seed=1 + rank, **model_kw)
    with gradscope.trace(model) as tr:
        loss = loss_of(model(x))
    report = gradscope.inspect(loss, model=model, trace=tr)
    wi = report.what_if(optimizer=opt)
    loss.backward()  # the collectives every rank runs
    return {"spec": report.shard.label(), "rank": report.rank, "ranks": wi.ranks, "wi_rank": wi.rank}


def _worker(rank: int, port: int, world: int, model_name: str, model_kw: dict, cfgs: list, runs: int, n: int,
            out: str):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    torch.set_num_threads(1)
    try:
        res = [[_one(rank, world, model_name, model_kw, {"model": model_name, **cfg}, cfg.get("n", n))
                for _ in range(runs)] for cfg in cfgs]
        for cfg, runs_of in zip(cfgs, res):
            if cfg.get("inspect"):  # after the measured runs, unprofiled: gradscope on this rank's wrapped model
                seen = _inspected(rank, world, model_name, model_kw, {"model": model_name, **cfg}, n)
                for rec in runs_of:
                    rec["inspected"] = seen
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)


def measure(model_name: str, cfgs: list[dict], world: int = 2, runs: int = 1, n: int = 8,
            model_kw: dict | None = None, key: str = "peak") -> list[list[list[int]]]:
    """Per config, per run, each rank's peak (bytes): ``out[config][run][rank]``; one process group for all.
    ``key="all"``: each rank's whole record (``peak``; ``host``, the host's peak under CPU offload)."""
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_worker, args=(free_port(), world, model_name, model_kw or {}, cfgs, runs, n, out), nprocs=world)
        per_rank = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(world)]
    return [[[per_rank[r][c][k] if key == "all" else per_rank[r][c][k][key] for r in range(world)]
             for k in range(runs)] for c in range(len(cfgs))]


if __name__ == "__main__":
    import sys

    args = sys.argv[1:] + [None] * 4
    print(measure(args[3] or "mlp", json.loads(args[0]), world=int(args[1] or 2), runs=int(args[2] or 1)))
