"""Memory questions over the walked graph: saved-tensor tables (``table``) and who owns each byte
(``attribution``)."""

from gradscope.memory.meta import cpu_kernels_on_meta  # noqa: F401  (NOTE [meta graphs])
