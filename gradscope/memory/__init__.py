"""Memory questions over the walked graph: saved-tensor tables (``table``) and who owns each byte
(``attribution``)."""
