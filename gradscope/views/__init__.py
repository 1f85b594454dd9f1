"""Views read a :class:`~gradscope.Report` and never the walk: text (``text``), graphviz drawings
(``render`` -> ``collapse`` plan -> ``dot``, styled by ``style``), the HTML page and notebook display
(``html_page``, ``notebook``, both through ``drawing``) and GraphML; JSON is the report's own
(``Report.to_json()``). A view never imports ``gradscope.report`` (tests/test_architecture.py)."""
