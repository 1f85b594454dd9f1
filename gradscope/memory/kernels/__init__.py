"""What a backward node allocates and frees inside itself (kernel workspace, a formula's temporaries):
``signature.py`` says what it depends on, ``rebuild.py`` runs the node's backward again on fresh tensors
(``tensors.py`` makes them), ``measure.py`` measures every signature in one profiler session,
``workspace.py`` caches and looks it up."""
