"""The backward replay: ``backward_memory()`` and ``replay()`` (``backward.py``) over a ``Program``
(``compile.py`` from the walk's records, ``engine.py`` for autograd's order), ``simulate()`` (``simulate.py``,
``gradients.py``), checkpoint regions (``regions.py``, ``reentrant.py``, ``traced.py``) and the step's budget
(``accounting.py``, ``optimizer.py``); ``result.py`` and ``views.py`` are what it returns and shows."""
