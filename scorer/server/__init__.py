"""The ScoreDocs gRPC server: ``add_arguments`` and ``run`` back the ``scorer serve`` command."""

from .app import add_arguments, run

__all__ = ["add_arguments", "run"]
