"""The ``mixprec`` command: :func:`main` (the ``mixprec`` entry point) and one thin module per
sub-command (``train``, ``audit``, ``report``, ``prepare``, ``bench``, ``memory``, ``plan``,
``estimate``), each with ``configure(parser)`` and ``run(args)``."""
from mixprec.cli.main import COMMANDS, main

__all__ = ["main", "COMMANDS"]
