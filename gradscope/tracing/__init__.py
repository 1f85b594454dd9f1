"""``gradscope.trace()``: records the forward pass (modules, cuts, in-place writes with ``file:line``).

``recorder`` holds the context manager and its events; ``modes`` the ``TorchFunctionMode`` that spots cuts.
"""
