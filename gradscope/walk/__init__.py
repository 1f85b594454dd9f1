"""The walk: the only code that touches live autograd objects.

Roots (and parameter names) go in; plain metadata comes out. ``build`` runs the loop (``loop``), reads
saved slots (``saved``, with checkpoint frames from ``checkpoint``) into compact records (``records``,
which also build the ``networkx.DiGraph`` of the contract on demand) and arranges the safe release of
deep graphs (``release``). Nothing outside this package reads a ``grad_fn``.
"""
