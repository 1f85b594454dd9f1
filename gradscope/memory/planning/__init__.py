"""Planning on top of the replay: ``what_if()`` (``whatif.py``, rewriting the program in ``rewrite.py`` over
regions chosen in ``select.py``), ``plan()`` (``plan.py``, ``cost.py`` for recompute FLOPs, ``plancode.py``
for the code to write), ``max_batch()`` (``maxbatch.py``) and the chart (``planview.py``)."""
