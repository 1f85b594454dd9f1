"""Where the bytes go, and will the step fit, split by question:

- ``table``: the saved-tensor table (``report.memory()``);
- ``replay/``: the backward replay (``report.backward_memory()``): the program compiled from the walk,
  autograd's engine order, what each node allocates and frees, checkpoint regions, the step's budget;
- ``kernels/``: what one op allocates inside itself (kernel workspace), measured once per op and shapes;
- ``planning/``: what-if, plans, the largest batch, the code a plan asks for and its pictures;
- ``targets/``: device targets (``"cpu"``, ``"cuda"`` modelled): allocator rounding, kernel choice;
- ``meta``: ``kernels_on_meta(target)`` (``cpu_kernels_on_meta()``): a forward on ``meta`` dispatching
  like the target.

Device targets and sharded (per-rank) prediction are the replay's inputs: docs/architecture.md says where
each lives.
"""

from gradscope.memory.meta import cpu_kernels_on_meta, kernels_on_meta  # noqa: F401  (NOTE [meta graphs])
