"""The ``gradscope`` command line: thin click commands (``commands``), target loading (``target``) and
``gradscope diff`` (``diff``)."""

from gradscope.cli.commands import main

__all__ = ["main"]
