"""``gradscope.watch`` under FSDP2 (``fully_shard``), two gloo processes on CPU: torch is the truth."""

from __future__ import annotations

import json
import math

import torch.multiprocessing as mp

from tests.watch import _ddp as _watch_ddp
from tests.watch import _fsdp as _watch_fsdp


def test_fsdp2_names_none_and_nan_on_sharded_dtensor_grads(tmp_path):
    import torch._dynamo  # noqa: F401  (imported once here, not in both forked children)
    port = _watch_ddp.free_port()
    mp.start_processes(_watch_fsdp.worker, args=(port, str(tmp_path)), nprocs=2, join=True,
                       start_method="fork")
    for rank in (0, 1):
        out = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert out["grad_types"] == ["DTensor"] and out["checks"] == 2
        assert out["none"] == out["none_truth"] == ["unused.bias", "unused.weight"]   # FSDP2 itself is silent
        assert out["nan"] == out["nan_truth"] == ["body.bias", "body.weight", "head.bias", "head.weight"]
        for m, v in out["local_norms"].items():                 # the rank's own shard
            assert math.isclose(out["history"][0][m], v, rel_tol=1e-5)
