"""Views read a :class:`~gradscope.Report` and never the walk: text (``text``), graphviz drawings
(``render`` -> ``collapse`` plan -> ``dot``, styled by ``style``), the HTML page and notebook display
(``html_page``, ``notebook``, both through ``drawing``), JSON/GraphML (``serialize``) and SVG charts
(``svgchart``). A view imports ``gradscope.report`` only for type hints (tests/test_architecture.py)."""
