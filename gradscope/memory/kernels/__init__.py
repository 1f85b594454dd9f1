"""What one op allocates inside itself while its backward runs (kernel workspace): ``workspace.py`` looks
it up per node, ``calibrate.py`` measures it once per op and shapes and caches it per machine."""
