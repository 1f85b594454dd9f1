"""Views read a :class:`~gradscope.Report` and never the walk: text (``text``), graphviz drawings
(``render`` -> ``collapse`` plan -> ``dot``, styled by ``style``), the HTML page and notebook display
(``html_page``, ``notebook``), JSON/GraphML (``serialize``) and SVG charts (``svgchart``)."""
