"""Very deep graphs: iterative walk, and freeing after the walk without overflowing the C stack.

Each scenario runs in a subprocess: a failure here is a segfault, which would kill pytest itself.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PRELUDE = """
import gc, sys, time, torch, gradscope
N = {n}
x = torch.randn(4, requires_grad=True)
y = x
for _ in range(N):
    y = y * 1.0001
loss = y.sum()
report = gradscope.inspect(loss, params={{"x": x}})
assert report.graph.number_of_nodes() == N + 2, report.graph.number_of_nodes()
assert report.findings == []
"""

SCENARIOS = {
    "drop-loss": "del loss, y\ntime.sleep(0.2)\nprint('OK')",
    "backward-then-drop": "loss.backward()\nassert x.grad is not None\ndel loss, y\ntime.sleep(0.2)\nprint('OK')",
    "alive-at-exit": "print('OK')",
    "inspect-twice": "r2 = gradscope.inspect(loss)\ndel loss, y\ntime.sleep(0.2)\nprint('OK')",
}


@pytest.mark.slow  # tests/test_noharm.py runs these scenarios (and more) in one subprocess in CI
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_50k_chain_inspected_and_freed(scenario):
    code = PRELUDE.format(n=50_000) + textwrap.dedent(SCENARIOS[scenario])
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.strip().endswith("OK")


def test_deep_release_frees_saved_memory():
    # After the loss is dropped, the held node references are released: the activations die.
    code = PRELUDE.format(n=20_000) + textwrap.dedent("""
        from gradscope.walk.release import pending
        assert pending() == 1
        del loss, y
        deadline = time.time() + 10
        while pending() and time.time() < deadline:
            time.sleep(0.05)
        assert pending() == 0, pending()
        print('OK')
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
